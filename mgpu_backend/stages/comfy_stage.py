"""The model function of a stage with semantics "comfyui": every guidance pass is one `forward.ForwardRequest` run by
the fleet's `native.NativeEngine` — the same ComfyUI 0.33 LTX-AV forward that serves the native MGPU MODEL (issue
19, Build 6), so SP Sampler (MGPU) and a ComfyUI graph on the MGPU MODEL compute the same thing.

A pass maps onto ComfyUI's per-call `transformer_options` as LTXV's guidance nodes set them: "perturbed" (STG) →
`stg_self_attn_blocks` (ComfyUI perturbs the video and audio self-attention of each listed block in one pass; the
union of both modalities' blocks is used, a modality whose STG is off ignores that pass), "isolated" (modality
guidance) → `a2v_cross_attn` / `v2a_cross_attn` off, "uncond" → the negative context.
Timesteps as `LTXAV.process_timestep` builds them: per token (`mask · σ`) for a modality with a denoise mask, else
per row. The passes of a step that need no per-call options (cond and uncond) run as ONE request of several rows on
CUDA when the latent is small (as ComfyUI batches cond and uncond; `batch_choice`), else one request per pass.
"""
from __future__ import annotations

import torch

from ..engine import latents as L
from ..protocol.native_forward import ForwardOptions, ForwardRequest
from .native import comfy_qk_eps
from ..engine.denoiser import BATCH_TOKENS
from ..engine.sampling import GuidancePass, ModelInputs

BATCH_MODES = ("auto", "on", "off")
"""Plain passes of a step as one request of several rows: "auto" on CUDA with at most `denoiser.BATCH_TOKENS` video
tokens per rank, "on" whenever possible (CPU too: the tests), "off" never."""


def pass_options(p: GuidancePass) -> ForwardOptions:
    """ComfyUI's per-call options for one guidance pass."""
    if p.kind == "perturbed":
        return ForwardOptions(stg_self_attn_blocks=tuple(sorted(set(p.video_stg_blocks) | set(p.audio_stg_blocks))))
    if p.kind == "isolated":
        return ForwardOptions(a2v_cross_attn=False, v2a_cross_attn=False)
    return ForwardOptions()


class ComfyDenoiser:
    """`sampling.denoise_loop`'s model function (packed `ModelInputs` -> packed velocities, float32) on ComfyUI's
    forward.

    Args:
        engine: this rank's `native.NativeEngine`.
        spec: the `stage.StageSpec` (contexts, grid, fps, masks, guides).
        split: the `UlyssesSplit` of the stage's SP group (None: the engine's degree-1 split — one device, or one pass
            per rank under the guidance-pass split); the stage runner applies its plan (`stage.applied`).
    `batch_mode` (class default "auto", `BATCH_MODES`): whether plain passes of a step may share one request.
    """

    batch_mode = "auto"

    def __init__(self, engine, spec, split=None):
        self.engine, self.spec = engine, spec
        self.split = split if split is not None else engine.local_split
        dev, dt = engine.device, engine.dtype
        self.contexts = {"cond": torch.cat([spec.positive.video, spec.positive.audio], dim=-1).to(dev, dt)}
        if spec.negative is not None:
            self.contexts["uncond"] = torch.cat([spec.negative.video, spec.negative.audio], dim=-1).to(dev, dt)
        self.forwards = 0
        self.batch_notes: dict[str, int] = {}  # how the steps' passes ran -> how many steps

    def _context(self, p: GuidancePass) -> torch.Tensor:
        if p.kind == "uncond" and "uncond" not in self.contexts:
            raise ValueError("CFG needs a negative prompt context")
        return self.contexts["uncond" if p.kind == "uncond" else "cond"]

    def request(self, inputs: ModelInputs, passes: list[GuidancePass] | None = None) -> ForwardRequest:
        """The ForwardRequest of one pass, or of `passes` (plain options) as rows in that order (ComfyUI's layout:
        `[B, 128, F, H, W]`, `[B, 8, T, 16]`)."""
        spec = self.spec
        passes = passes or [inputs.guidance]
        b = len(passes)
        f, h, w = spec.grid

        def rows(x):
            return x if b == 1 else x.expand(b, *x.shape[1:])

        video_ts = (inputs.video_timesteps.unsqueeze(-1) if spec.video_mask is not None else inputs.video_sigma)
        audio_ts = (inputs.audio_timesteps.unsqueeze(-1) if spec.audio_mask is not None else inputs.audio_sigma)
        guides = spec.guides
        context = torch.cat([self._context(p) for p in passes]) if b > 1 else self._context(passes[0])
        return ForwardRequest(
            video=rows(L.unpack_video(inputs.video, f, h, w)), audio=rows(L.unpack_audio(inputs.audio)),
            video_timestep=rows(video_ts), audio_timestep=rows(audio_ts), context=context,
            frame_rate=float(spec.fps),
            keyframe_idxs=guides.keyframe_idxs if guides else None,
            denoise_mask=guides.denoise_mask if guides else None,
            guide_attention_entries=guides.guide_attention_entries if guides else (),
            ref_audio_tokens=guides.ref_audio_tokens if guides else None,
            options=pass_options(passes[0]))

    def _run(self, request: ForwardRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's rows on this stage's split -> packed velocities `[B, N, 128]`, `[B, T, 128]`."""
        engine = self.engine
        engine.check(request)
        with torch.no_grad(), comfy_qk_eps(engine._qk_norms):  # noqa: SLF001
            prepared = engine.prepare(request, request.context)
            video, audio = engine.run_rows(prepared, list(range(request.batch)), self.split, request.options)
            if prepared.keep is not None:  # IC-LoRA's dropped cells come back as zeros
                video, audio = (L.pack_video(x) if x.ndim == 5 else L.pack_audio(x)
                                for x in engine.unpack(prepared, video, audio, torch.float32))
        self.forwards += 1
        return video, audio

    def __call__(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        video, audio = self._run(self.request(inputs))
        return video.float().to(inputs.video.device), audio.float().to(inputs.audio.device)

    # ---- several passes as one request (sampling.denoise_loop's `batch` hook) ----
    def batch_choice(self, passes: list[GuidancePass], video: torch.Tensor | None) -> bool:
        """Whether this step's `passes` run as one request of several rows (see `BATCH_MODES`): only passes without
        per-call options (cond, uncond) with contexts of one length; "auto": on CUDA, at most `BATCH_TOKENS` video
        tokens per rank. The reason is counted for `batch_report`."""
        if self.batch_mode not in BATCH_MODES:
            raise ValueError(f"batch mode {self.batch_mode!r}: choose one of {', '.join(BATCH_MODES)}")
        if self.batch_mode == "auto" and self.engine.device.type != "cuda":
            return False  # CPU: one request per pass, nothing to report
        why = None
        if self.batch_mode == "off":
            why = "set off"
        elif any(not pass_options(p).is_plain for p in passes):
            why = "STG / modality passes carry their own options"
        elif len({tuple(self._context(p).shape) for p in passes}) > 1:
            why = "the prompts' contexts have different lengths"
        elif self.batch_mode == "auto":
            per_rank = -(-self.spec.video_tokens // self.split.exchange.world_size)
            if per_rank > BATCH_TOKENS:
                why = f"{per_rank:,} video tokens per rank > {BATCH_TOKENS:,} (a batch would not pay)"
        note = f"{len(passes)} passes as one request" if why is None else f"passes one at a time: {why}"
        self.batch_notes[note] = self.batch_notes.get(note, 0) + 1
        return why is None

    def batch(self, inputs: ModelInputs, passes: list[GuidancePass]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`passes` (plain options) as the rows of one request -> one `(video, audio)` velocity pair per pass."""
        video, audio = self._run(self.request(inputs, passes))
        return [(video[i:i + 1].float().to(inputs.video.device), audio[i:i + 1].float().to(inputs.audio.device))
                for i in range(len(passes))]

    def batch_report(self) -> str | None:
        """One line for the job report: how the guidance passes of the steps ran (None: nothing to say)."""
        if not self.batch_notes:
            return None
        return "guidance passes: " + "; ".join(f"{n} step{'s' if n != 1 else ''}: {note}"
                                               for note, n in self.batch_notes.items())


__all__ = ["ComfyDenoiser", "pass_options"]
