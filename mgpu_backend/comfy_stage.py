"""The model function of a stage with semantics "comfyui": every guidance pass is one `forward.ForwardRequest` run by
the fleet's `native.NativeEngine` — the same ComfyUI 0.33 LTX-AV forward that serves the native MGPU MODEL (issue
19, Build 6), so SP Sampler (MGPU) and a ComfyUI graph on the MGPU MODEL compute the same thing.

A pass maps onto ComfyUI's per-call `transformer_options` as LTXV's guidance nodes set them: "perturbed" (STG) →
`stg_self_attn_blocks` (ComfyUI perturbs the video and audio self-attention of each listed block in one pass; the
union of both modalities' blocks is used, a modality whose STG is off ignores that pass), "isolated" (modality
guidance) → `a2v_cross_attn` / `v2a_cross_attn` off, "uncond" → the negative context.
Timesteps as `LTXAV.process_timestep` builds them: per token (`mask · σ`) for a modality with a denoise mask, else
per row.
"""
from __future__ import annotations

import torch

from . import latents as L
from .forward import ForwardOptions, ForwardRequest
from .native import comfy_qk_eps
from .sampling import GuidancePass, ModelInputs


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
        forward: the `SequenceParallelTransformer` of the stage's SP group (None: the engine's degree-1 wrapper —
            one device, or one pass per rank under the guidance-pass split).
    """

    def __init__(self, engine, spec, forward=None):
        self.engine, self.spec = engine, spec
        self.sp = forward if forward is not None else engine._local  # noqa: SLF001
        dev, dt = engine.device, engine.dtype
        self.contexts = {"cond": torch.cat([spec.positive.video, spec.positive.audio], dim=-1).to(dev, dt)}
        if spec.negative is not None:
            self.contexts["uncond"] = torch.cat([spec.negative.video, spec.negative.audio], dim=-1).to(dev, dt)
        self.forwards = 0

    def request(self, inputs: ModelInputs) -> ForwardRequest:
        """The ForwardRequest of one pass (ComfyUI's layout: `[1, 128, F, H, W]`, `[1, 8, T, 16]`)."""
        spec, p = self.spec, inputs.guidance
        f, h, w = spec.grid
        video_ts = (inputs.video_timesteps.unsqueeze(-1) if spec.video_mask is not None else inputs.video_sigma)
        audio_ts = (inputs.audio_timesteps.unsqueeze(-1) if spec.audio_mask is not None else inputs.audio_sigma)
        guides = spec.guides
        context = self.contexts["uncond" if p.kind == "uncond" else "cond"]
        return ForwardRequest(
            video=L.unpack_video(inputs.video, f, h, w), audio=L.unpack_audio(inputs.audio),
            video_timestep=video_ts, audio_timestep=audio_ts, context=context, frame_rate=float(spec.fps),
            keyframe_idxs=guides.keyframe_idxs if guides else None,
            denoise_mask=guides.denoise_mask if guides else None,
            guide_attention_entries=guides.guide_attention_entries if guides else (),
            ref_audio_tokens=guides.ref_audio_tokens if guides else None,
            options=pass_options(p))

    def __call__(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.guidance.kind == "uncond" and "uncond" not in self.contexts:
            raise ValueError("CFG needs a negative prompt context")
        engine = self.engine
        request = self.request(inputs)
        engine.check(request)
        with torch.no_grad(), comfy_qk_eps(engine._qk_norms):  # noqa: SLF001
            prepared = engine.prepare(request, request.context)
            video, audio = engine.run_rows(prepared, [0], self.sp, request.options)
            if prepared.keep is not None:  # IC-LoRA's dropped cells come back as zeros
                video, audio = (L.pack_video(x) if x.ndim == 5 else L.pack_audio(x)
                                for x in engine.unpack(prepared, video, audio, torch.float32))
        self.forwards += 1
        return video.float().to(inputs.video.device), audio.float().to(inputs.audio.device)


__all__ = ["ComfyDenoiser", "pass_options"]
