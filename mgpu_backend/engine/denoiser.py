"""The LTX-2 transformer as a denoising function: text contexts, positions and guidance passes -> velocities.

`text_contexts` runs the checkpoint's text connectors on CONDITIONING embeddings (positive and negative batched
together), the way ComfyUI's `LTXAVModel.preprocess_text_embeds` and diffusers' `LTX2TextConnectors` do it.
`LTX2Denoiser` is the `model_fn` of `sampling.denoise_loop`: one transformer forward per guidance pass, with STG
implemented by swapping the self-attention processor of the chosen blocks (each modality in its own blocks, as the
reference's perturbations do) and modality guidance by `isolate_modalities`. On CUDA each forward is replayed from
CUDA graphs where it can be (`cuda_graphs.call`), and the passes of a step can run as one batched forward
(`LTX2Denoiser.batch`, chosen per step by `batch_choice`; per-item STG and isolation by `per_item_perturbations`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor

from . import cuda_graphs, forward as model_forward
from .attention import LTX2AttnProcessor, VideoKeys, use_processor
from ..protocol.native_forward import ForwardOptions
from .sampling import TIMESTEP_SCALE, GuidancePass, ModelInputs
from .semantics import REFERENCE
from .tokens import TokenBatch

# connectors replace padding with 128 learnable registers; the reference pads prompts to 1024 tokens
MIN_CONTEXT_TOKENS = 1024

BATCH_MODES = ("auto", "on", "off")
"""Guidance passes of a step as one batched forward (`LTX2Denoiser.batch_choice`): "auto" on CUDA where it pays
(per-rank video tokens ≤ `BATCH_TOKENS`, and the extra activations fit in free memory), "on" whenever possible
(CPU too: the tests), "off" never."""
BATCH_TOKENS = 4096
"""Per-rank video tokens above which "auto" runs the passes one by one: above it a batch of passes is no faster on an
H200 while its activations grow with the pass count (source: bench/results/speed_h200.txt, "guidance passes at
W = 1"; the figures are quoted in bench/results/docstring_figures.md)."""
ACTIVATION_BYTES_PER_TOKEN = 10 * 4096 * 2
"""Rough live activations of one LTX-2 block forward per video token (the feed-forward's 4× hidden plus a few
hidden-size tensors, bf16): what a batch of P passes needs beyond one forward, times P − 1, with a 2× margin."""


@dataclass
class TextContext:
    """Transformer context for one or more prompts.

    video: `[B, L, Dv]`, audio: `[B, L, Da]`, mask: `[B, L]` (1 = attend) in the compute dtype; L is a multiple of
    the connector's register count, at least `MIN_CONTEXT_TOKENS`.
    """

    video: torch.Tensor
    audio: torch.Tensor
    mask: torch.Tensor

    def select(self, index: int) -> "TextContext":
        return TextContext(self.video[index:index + 1], self.audio[index:index + 1], self.mask[index:index + 1])


def split_embeds(embeds: torch.Tensor, family, video_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CONDITIONING embeddings -> (video input, audio input) of the connectors, by the family's text split.

    LTX-2.0: one `[B, T, 3840]` tensor feeds both connectors; LTX-2.3 / 2.5: `[B, T, 4096 + 2048]` is split at the
    video width (ComfyUI `av_model.py::preprocess_text_embeds`).
    """
    if family.splits_text:
        return embeds[..., :video_dim], embeds[..., video_dim:]
    return embeds, embeds


def text_contexts(components, embeds: list[torch.Tensor], dtype: torch.dtype | None = None) -> TextContext:
    """Run the text connectors on a list of CONDITIONING embeddings (each `[1, T_i, C]`, valid tokens only).

    The prompts are left-padded to a common length L = max(1024, ceil(max T_i / R)·R) (R = register count) and
    run as one batch; the connectors replace the padding by their learnable registers.

    Returns a `TextContext` with batch `len(embeds)`, in the order given.
    Raises ValueError when an embedding's width does not match the checkpoint's connectors.
    """
    video_connector, audio_connector = components.video_connector, components.audio_connector
    param = next(video_connector.parameters())
    dtype = dtype or param.dtype
    device = param.device
    width = components.family.conditioning_width(video_connector.inner_dim, audio_connector.inner_dim)
    for e in embeds:
        if e.ndim != 3 or e.shape[0] != 1 or e.shape[-1] != width:
            raise ValueError(f"conditioning embeddings of shape {tuple(e.shape)} do not fit this checkpoint's text "
                             f"connectors (expected [1, T, {width}] for {components.family.display})")
    registers = video_connector.num_learnable_registers or 1
    longest = max(e.shape[1] for e in embeds)
    length = max(MIN_CONTEXT_TOKENS, math.ceil(longest / registers) * registers)
    batch = torch.zeros(len(embeds), length, width, dtype=dtype, device=device)
    mask = torch.zeros(len(embeds), length, dtype=torch.long, device=device)
    for i, e in enumerate(embeds):
        t = e.shape[1]
        batch[i, length - t:] = e[0].to(device=device, dtype=dtype)
        mask[i, length - t:] = 1
    video_in, audio_in = split_embeds(batch, components.family, video_connector.inner_dim)
    additive = ((mask - 1).to(dtype) * torch.finfo(dtype).max).view(len(embeds), 1, 1, length)
    with torch.no_grad():
        video, video_mask = video_connector(video_in, additive)
        keep = (video_mask.reshape(len(embeds), -1) >= -9000.0).to(dtype)  # registers make every slot valid
        video = video * keep.unsqueeze(-1)
        audio, _ = audio_connector(audio_in, additive)
    return TextContext(video, audio, keep)


def keyframe_token_mask(video_coords: torch.Tensor, num_generated: int | None = None) -> torch.Tensor:
    """`[B, T, 1]` float marker of the video tokens whose latent frame encodes one pixel frame: generated tokens whose
    time interval starts at 0 (the causal first latent frame), never the conditioning / guide tokens after the first
    `num_generated` (None: every token is generated). What LTX-2.5's `keyframes_abs_pos_embedding` is added to.

    Source: ComfyUI 0.33 `comfy/ldm/lightricks/model.py::keyframes_abs_pos_mask` (applied after `patchify_proj` on
    every forward; guide tokens excluded); diffusers' `video_keyframes_mask` argument takes the marker.
    `video_coords`: `[B, 3, T, 2]` in any unit whose time origin is the clip start.
    """
    mask = video_coords[:, 0, :, 0] == 0
    if num_generated is not None:
        mask[:, num_generated:] = False
    return mask.unsqueeze(-1).float()


class _SkipSelfAttention:
    """STG perturbation: the attention output is replaced by its value projection (diffusers'
    `LTX2PerturbedAttnProcessor` with every item perturbed; reference: ltx-core `SkipSelfAttention` perturbation)."""

    def __init__(self):
        self._inner = LTX2PerturbedAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, **_):
        if isinstance(attention_mask, VideoKeys):  # a split's keys: the value projection attends to nothing
            attention_mask = None
        return self._inner(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                           key_rotary_emb, perturbation_mask=None, all_perturbed=True)


@contextlib.contextmanager
def skip_self_attention(transformer, video_blocks: tuple[int, ...], audio_blocks: tuple[int, ...]):
    """Within the block, video self-attention of `video_blocks` and audio self-attention of `audio_blocks` are
    replaced by their value projections. Raises ValueError for a block index the model does not have."""
    blocks = transformer.transformer_blocks
    for b in (*video_blocks, *audio_blocks):
        if not 0 <= b < len(blocks):
            raise ValueError(f"STG block {b} does not exist: this transformer has blocks 0..{len(blocks) - 1}")
    swapped = [(blocks[b].attn1, blocks[b].attn1.processor) for b in video_blocks]
    swapped += [(blocks[b].audio_attn1, blocks[b].audio_attn1.processor) for b in audio_blocks]
    try:
        for attn, _ in swapped:
            attn.processor = _SkipSelfAttention()
        yield
    finally:
        for attn, processor in swapped:
            attn.processor = processor


_MASKS: dict[tuple, torch.Tensor] = {}


def _item_mask(pattern: tuple[bool, ...], device, dtype) -> torch.Tensor:
    """`[P, 1, 1]` 0/1 tensor of `pattern`, made once per (pattern, device, dtype) and kept: a captured CUDA graph
    reads it at every replay, so it must never be freed or rewritten."""
    key = (pattern, str(device), dtype)
    if key not in _MASKS:
        _MASKS[key] = torch.tensor(pattern, dtype=dtype, device=device).view(-1, 1, 1)
    return _MASKS[key]


class _PerItemSkip:
    """STG in a batch of passes: items where `pattern` is True get the skipped self-attention (value projection,
    `_SkipSelfAttention`), the others the installed processor's output — picked with `torch.where`, so each item is
    exactly what its own forward computes (the extra value path costs little: only the STG blocks have it)."""

    def __init__(self, inner, pattern: tuple[bool, ...]):
        self.inner, self.pattern, self.skip = inner, pattern, _SkipSelfAttention()
        self.exchange = getattr(inner, "exchange", None)
        self.graph_key = ("skip", type(inner), pattern)

    def __call__(self, attn, hidden_states, *args, **kwargs):
        out = self.inner(attn, hidden_states, *args, **kwargs)
        skipped = self.skip(attn, hidden_states, *args, **kwargs)
        mask = _item_mask(self.pattern, out.device, torch.bool)
        return torch.where(mask, skipped, out)


class _PerItemIsolation:
    """Modality isolation in a batch of passes: the audio↔video cross-attention output of items where `pattern` is
    True is multiplied by 0, so the block adds `gate · 0 = 0` — exactly what their own forward does by skipping the
    cross-attention (`isolate_modalities`); the other items are multiplied by 1."""

    def __init__(self, inner, pattern: tuple[bool, ...]):
        self.inner, self.pattern = inner, pattern
        self.exchange = getattr(inner, "exchange", None)
        self.graph_key = ("isolate", type(inner), pattern)

    def __call__(self, attn, hidden_states, *args, **kwargs):
        out = self.inner(attn, hidden_states, *args, **kwargs)
        return out * _item_mask(tuple(not p for p in self.pattern), out.device, out.dtype)


@contextlib.contextmanager
def per_item_perturbations(transformer, passes: list[GuidancePass]):
    """Install the per-item STG and isolation processors a batch of `passes` (in batch order) needs; undone after.
    Raises ValueError for an STG block the model does not have."""
    blocks = transformer.transformer_blocks
    swapped = []
    for which, name in (("video_stg_blocks", "attn1"), ("audio_stg_blocks", "audio_attn1")):
        wanted: dict[int, list[bool]] = {}
        for i, p in enumerate(passes):
            if p.kind == "perturbed":
                for b in getattr(p, which):
                    if not 0 <= b < len(blocks):
                        raise ValueError(f"STG block {b} does not exist: this transformer has blocks "
                                         f"0..{len(blocks) - 1}")
                    wanted.setdefault(b, [False] * len(passes))[i] = True
        for b, pattern in wanted.items():
            attn = getattr(blocks[b], name)
            swapped.append((attn, attn.processor))
            attn.processor = _PerItemSkip(attn.processor, tuple(pattern))
    isolated = tuple(p.kind == "isolated" for p in passes)
    if any(isolated):
        for block in blocks:
            for name in ("audio_to_video_attn", "video_to_audio_attn"):
                attn = getattr(block, name)
                swapped.append((attn, attn.processor))
                attn.processor = _PerItemIsolation(attn.processor, isolated)
    try:
        yield
    finally:
        for attn, processor in reversed(swapped):
            attn.processor = processor


class LTX2Denoiser:
    """`model_fn` for `sampling.denoise_loop`: one transformer forward per guidance pass.

    Args:
        transformer: `LTX2VideoTransformer3DModel` (diffusers).
        positive / negative: `TextContext` of batch 1 each (negative may be None when no pass needs it).
        video_coords: `[1, 3, Tv, 2]`, audio_coords: `[1, 1, Ta, 2]` (see `latents.video_coords/audio_coords`).
        dtype: compute dtype of the forward.
        split: the `engine.forward.Split` every forward runs under (`splits/`: `UlyssesSplit` for sequence parallel,
            carrying the job's token cap; `TiledSplit` for tiles), whose plan the caller applied
            (`splits.apply.apply_plan`); None: the whole forward here, with local processors (installed here).
        num_generated: generated video tokens (later tokens are conditioning / guides); None: all of them.
    Each forward's `TokenBatch` is built here by the reference's (diffusers') input rules (`token_batch`):
    timesteps and sigmas × 1000, the cross-attention AdaLN inputs from the other stream's sigma
    (`use_cross_timestep`), the gates × the cross-attention timestep factor, the prompt AdaLN from the sigmas
    (LTX-2.3 / 2.5), the text masks as additive biases `(1 − mask)·−10000`; a transformer with LTX-2.5's
    `keyframes_abs_pos_embedding` gets its frame-0 marker (`keyframe_token_mask`), as ComfyUI applies it.
    Returns velocities in float32 (diffusers convention: v = noise - x0).
    """

    def __init__(self, transformer, positive: TextContext, negative: TextContext | None,
                 video_coords: torch.Tensor, audio_coords: torch.Tensor, dtype: torch.dtype, split=None,
                 num_generated: int | None = None):
        self.transformer, self.split = transformer, split
        if split is None:  # the resident transformer is shared by every stage: this one runs locally
            use_processor(transformer, LTX2AttnProcessor())
        self.positive, self.negative = positive, negative
        self.video_coords, self.audio_coords = video_coords, audio_coords
        self.keyframes_mask = None
        if getattr(transformer.config, "use_keyframes_abs_pos_embedding", False):
            self.keyframes_mask = keyframe_token_mask(video_coords, num_generated).to(dtype)
        self.dtype = dtype
        self.forwards = 0
        self.batch_mode = "auto"
        self.batch_notes: dict[str, int] = {}  # why batches ran or not -> how many steps

    def batch_choice(self, passes: list[GuidancePass], video: torch.Tensor | None) -> bool:
        """Whether this step's `passes` run as one batched forward (see `BATCH_MODES`); the reason is counted in
        `batch_notes` for the job report (`batch_report`)."""
        if self.batch_mode not in BATCH_MODES:
            raise ValueError(f"batch mode {self.batch_mode!r}: choose one of {', '.join(BATCH_MODES)}")
        why = self.can_batch(passes) if self.batch_mode != "off" else "set off"
        ok = why is None
        if ok and self.batch_mode == "auto":
            device = self.video_coords.device
            tokens = video.shape[1] if video is not None else 0
            world = getattr(getattr(self.split, "exchange", None), "world_size", 1)
            per_rank = -(-tokens // world)
            if device.type != "cuda":
                return False  # CPU: unchanged, one forward per pass, nothing to report
            elif per_rank > BATCH_TOKENS:
                ok, why = False, f"{per_rank:,} video tokens per rank > {BATCH_TOKENS:,} (a batch would not pay)"
            else:
                need = 2 * (len(passes) - 1) * per_rank * ACTIVATION_BYTES_PER_TOKEN
                free = torch.cuda.mem_get_info(device)[0]
                if need > free:
                    ok, why = False, f"needs ~{need / 2**30:.1f} GiB more, {free / 2**30:.1f} GiB free"
                else:
                    why = f"~{need / 2**30:.2f} GiB more of {free / 2**30:.0f} GiB free"
        note = (f"{len(passes)} passes as one batched forward ({why})" if ok and why else
                f"{len(passes)} passes as one batched forward" if ok else f"passes one at a time: {why}")
        self.batch_notes[note] = self.batch_notes.get(note, 0) + 1
        return ok

    def batch_report(self) -> str | None:
        """One line for the job report: how the guidance passes of the steps ran (None: no multi-pass step)."""
        if not self.batch_notes:
            return None
        return "guidance passes: " + "; ".join(f"{n} step{'s' if n != 1 else ''}: {note}"
                                               for note, n in self.batch_notes.items())

    def token_batch(self, inputs: ModelInputs, contexts: list[TextContext], rows: int = 1) -> TokenBatch:
        """The one forward's inputs for `inputs` with one text context per pass (`contexts`; several: a batch of
        passes stacked along the batch, each context repeated over the `rows` latent rows), by the reference's
        input rules (see the class docstring), on the model's device."""
        cfg, device, dtype = self.transformer.config, self.video_coords.device, self.dtype
        n = len(contexts)

        def rep(x: torch.Tensor) -> torch.Tensor:
            x = x.to(device)
            return x if n == 1 else x.repeat(n, *([1] * (x.ndim - 1)))

        video, audio = rep(inputs.video.to(device, dtype)), rep(inputs.audio.to(device, dtype))
        b = video.shape[0]
        video_sigma = rep(inputs.video_sigma) * TIMESTEP_SCALE
        audio_sigma = rep(inputs.audio_sigma) * TIMESTEP_SCALE
        video_cross, audio_cross = audio_sigma.flatten(), video_sigma.flatten()  # diffusers' use_cross_timestep
        factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
        if n == 1:
            mask, video_context, audio_context = contexts[0].mask, contexts[0].video, contexts[0].audio
        else:
            mask = torch.cat([c.mask.expand(rows, -1) for c in contexts])
            video_context = torch.cat([c.video.expand(rows, -1, -1) for c in contexts])
            audio_context = torch.cat([c.audio.expand(rows, -1, -1) for c in contexts])
        prompt = getattr(cfg, "use_prompt_adaln_single", False)
        marker = None
        if cfg.use_keyframes_abs_pos_embedding and self.keyframes_mask is not None:
            marker = (rep(self.keyframes_mask) > 0).reshape(b, -1)
        return TokenBatch(
            video=video, audio=audio, video_timestep=rep(inputs.video_timesteps) * TIMESTEP_SCALE,
            audio_timestep=rep(inputs.audio_timesteps) * TIMESTEP_SCALE,
            video_cross_timestep=video_cross, audio_cross_timestep=audio_cross,
            a2v_gate_timestep=video_cross * factor, v2a_gate_timestep=audio_cross * factor,
            video_coords=rep(self.video_coords), audio_coords=rep(self.audio_coords),
            video_context=video_context, audio_context=audio_context,
            video_prompt_timestep=video_sigma.flatten() if prompt else None,
            audio_prompt_timestep=audio_sigma.flatten() if prompt else None,
            video_text_bias=((1 - mask.to(video.dtype)) * -10000.0).view(b, 1, 1, -1),
            audio_text_bias=((1 - mask.to(audio.dtype)) * -10000.0).view(b, 1, 1, -1),
            keyframe_marker=marker)

    def run_forward(self, batch: TokenBatch, isolate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of `batch` under this denoiser's split (`model_forward.run`: replayed from CUDA graphs where
        it can be; a split that synchronises with the host runs eagerly); `isolate` severs both cross-modal
        attentions (modality guidance)."""
        options = ForwardOptions(a2v_cross_attn=not isolate, v2a_cross_attn=not isolate)
        return model_forward.run(self.transformer, batch, REFERENCE, self.split, options)

    def _context(self, p: GuidancePass) -> TextContext:
        if p.kind == "uncond":
            if self.negative is None:
                raise ValueError("CFG needs a negative prompt context")
            return self.negative
        return self.positive

    def can_batch(self, passes: list[GuidancePass]) -> str | None:
        """None when `passes` can run as one batched forward here, else why not."""
        if len(passes) < 2:
            return "one pass"
        lengths = {self._context(p).video.shape[1] for p in passes}
        if len(lengths) > 1:
            return f"the prompts' contexts have different lengths {sorted(lengths)}"
        if self.split is not None and not self.split.cuda_graph_safe:
            return f"{type(self.split).__name__} forwards one pass at a time"
        return None

    def batch(self, inputs: ModelInputs, passes: list[GuidancePass]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The forwards of `passes` (one step: same latent, timesteps and sigmas; `inputs.guidance` is ignored) as
        ONE forward with the passes stacked along the batch: each item gets its own text context (negative for
        "uncond"), the STG pass its skipped self-attention in its blocks and the isolated pass its cross-modal
        attention switched off (`per_item_perturbations`) — per item the same arithmetic as its own forward, equal
        to float tolerance (batched kernels may order reductions differently).

        Returns one `(video, audio)` velocity pair per pass, float32, in order.
        Raises ValueError when `can_batch` says no.
        """
        why = self.can_batch(passes)
        if why is not None:
            raise ValueError(f"guidance passes cannot be batched: {why}")
        n = len(passes)
        b = inputs.video.shape[0]
        contexts = [self._context(p) for p in passes]
        with per_item_perturbations(self.transformer, [p for p in passes for _ in range(b)]), torch.no_grad():
            video, audio = self.run_forward(self.token_batch(inputs, contexts, rows=b))
        self.forwards += 1
        self.batched_forwards = getattr(self, "batched_forwards", 0) + 1
        return [(video[i * b:(i + 1) * b].float().to(inputs.video.device),
                 audio[i * b:(i + 1) * b].float().to(inputs.audio.device)) for i in range(n)]

    def __call__(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        p: GuidancePass = inputs.guidance
        context = self._context(p)
        perturb = skip_self_attention(self.transformer, p.video_stg_blocks, p.audio_stg_blocks) \
            if p.kind == "perturbed" else contextlib.nullcontext()
        # the sampling state stays where the loop keeps it (small); each forward runs on the model's device
        with perturb, torch.no_grad():
            video, audio = self.run_forward(self.token_batch(inputs, [context]), isolate=p.kind == "isolated")
        self.forwards += 1
        return video.float().to(inputs.video.device), audio.float().to(inputs.audio.device)


def speed_report(transformer, batch_notes: dict[str, str] | None = None) -> list[str]:
    """The job report's lines on how the forwards ran: CUDA graphs (kept, held memory, and why any forward stayed
    eager: `cuda_graphs.report`), fp8 compute (`models.fp8.compute_report`) and the guidance-pass batching per stage
    (`batch_notes`: stage -> `LTX2Denoiser.batch_report()`). Empty when there is nothing to say (CPU, bf16, one pass).
    """
    from ..models.fp8 import compute_report

    lines = [line for line in (cuda_graphs.report(transformer), compute_report(transformer)) if line]
    lines += [f"{stage}: {note}" for stage, note in (batch_notes or {}).items() if note]
    return lines
