"""The one transformer forward of the engine (issue 25): a `TokenBatch` in, packed velocities out, under a
`Semantics` record and, optionally, a `Split` of the parallel plan.

Every path runs it: the native MGPU MODEL (`native.NativeEngine.run_rows`), the stage runners of the CLI and the
nodes (`denoiser.LTX2Denoiser`, `comfy_stage.ComfyDenoiser`), sequence parallel and tiles (`splits/sequence.py`'s
`UlyssesSplit`, `splits/tiled.py`'s `TiledSplit`). It calls the resident diffusers `LTX2VideoTransformer3DModel`'s
modules (projections, AdaLN embeddings, RoPE, blocks, output layers); diffusers' own `forward` is no longer called.

Steps of `run_eager(transformer, batch, semantics, split, options)`:
1. the split (if any) gives this rank's parts of the batch (`Split.shard`: the plan's input entries,
   `splits/forward_plan.py`) — one part for sequence parallel, one per tile for tiles;
2. per part: input projections (+ LTX-2.5's keyframe embedding on the marked tokens), the AdaLN embeddings of every
   timestep field, the LTX-2.0 caption projection, the RoPE tables of the local positions — one `BlockInputs`
   record, with the split's per-forward `VideoKeys` (the padded-key mask, `Split.key_mask`, and the guide-attention
   kernel);
3. the blocks in the semantics' order (`Semantics.block_order`: "diffusers" = the block's own forward, "comfyui" =
   `comfy_block`), each called as `block(blk, video, audio, inputs)`; the `VideoKeys` reach the split's processors
   (installed beforehand by `splits.apply.apply_plan`) in the `attention_mask` argument of the attentions whose keys
   are the video tokens; the video feed-forward runs over token chunks when `BlockInputs.ff_chunk` says so
   (`ForwardOptions.ff_chunk_tokens`, by default `protocol/memory_plan.py auto_ff_chunk`: only when the rank's
   4×-wide FF hidden would exceed 256 MiB — the same result, a lower peak);
4. output layers (the audio output loses its `audio_prefix` reference-audio tokens); the split gathers the parts'
   outputs (`Split.gather`: the plan's output entries — the video tokens gathered and the padding cut, or the tiles
   blended).
The forward reads no state of the split or its processors: everything per forward travels down as arguments.
Under the REFERENCE semantics this is diffusers 0.42.1's `LTX2VideoTransformer3DModel.forward` operation for
operation (bit-identical on CPU); under COMFYUI it is ComfyUI 0.33's `LTXAVModel` forward as `stages/native.py`
documents.

`run(...)` is the same forward replayed from CUDA graphs where it can be (`cuda_graphs.call`, a pure function of the
batch's tensors; keyed on the semantics, the options, the batch's static fields and the installed processors), with
the semantics' q/k eps applied around it; a split that is not `cuda_graph_safe` (tiles) runs eagerly.

`Outputs`: video `[B, N, Cv_out]` (all tokens of the batch, on every rank of the split), audio
`[B, Ta − audio_prefix, Ca_out]`, in the compute dtype.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from . import cuda_graphs
from .attention import GuideBias, VideoKeys
from ..protocol.memory_plan import ActivationShape, resolve_ff_chunk
from ..protocol.native_forward import ForwardOptions
from ..weights.sharding import gathered
from .semantics import REFERENCE, Semantics
from .tokens import TokenBatch

PLAIN = ForwardOptions()


# ---- q/k eps --------------------------------------------------------------------------------------------------------

def qk_norms(*modules: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention q/k RMSNorms (`norm_q`, `norm_k`) of `modules`."""
    return [m for module in modules if module is not None for name, m in module.named_modules()
            if name.rsplit(".", 1)[-1] in ("norm_q", "norm_k") and hasattr(m, "eps")]


@contextlib.contextmanager
def qk_eps(norms: list[torch.nn.Module], eps: float | None):
    """Within the block, the q/k RMSNorms `norms` use `eps` (None: unchanged); their own eps is restored after."""
    if eps is None:
        yield
        return
    saved = [m.eps for m in norms]
    try:
        for m in norms:
            m.eps = eps
        yield
    finally:
        for m, old in zip(norms, saved):
            m.eps = old


def _transformer_qk_norms(transformer) -> list[torch.nn.Module]:
    """`qk_norms(transformer)`, found once and kept on the module (a walk over every submodule costs host time)."""
    norms = getattr(transformer, "_ltx2_qk_norms", None)
    if norms is None:
        norms = qk_norms(transformer)
        object.__setattr__(transformer, "_ltx2_qk_norms", norms)  # not a submodule list
    return norms


# ---- the feed-forward over token chunks (issue 35) ------------------------------------------------------------------

def feed_forward(ff, x: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """`ff(x)` for `x` `[B, N, C]`, over slices of `chunk` tokens of the batch's B·N tokens taken in order (rows
    flattened; None or ≥ B·N: one call). Returns `[B, N, C_out]`.

    Each slice runs the same modules (the FF's Linears, its GELU) on a contiguous row range `[chunk, C]`, so every
    token's result is that of the whole call up to the GEMM kernel's choice for the row count (measured on CPU:
    bf16 bit-equal, float32 within 2e-7 relative — MKL's sgemm is not row-slice invariant; tests/test_long_clips.py).
    The output goes into one `[B·N, C_out]` buffer made at the first slice, so the peak holds the buffer and one
    slice's 4×-wide hidden instead of the whole hidden. The slices are Python ints from the shape (no data-dependent
    control flow): CUDA graphs and torch.compile capture fixed slices.
    """
    b, n = x.shape[0], x.shape[1]
    rows = b * n
    if chunk is None or chunk >= rows:
        return ff(x)
    flat = x.reshape(rows, x.shape[-1])
    out = None
    for start in range(0, rows, chunk):
        part = ff(flat[start:start + chunk])
        if out is None:
            out = part.new_empty(rows, part.shape[-1])
        out[start:start + part.shape[0]] = part
    return out.view(b, n, out.shape[-1])


class _ChunkedFeedForward:
    """Put in front of a block's feed-forward class by `chunked_ff`: `forward` is `feed_forward` over the class's
    own forward, by `ff_chunk_tokens` (class default None: one call)."""

    ff_chunk_tokens: int | None = None

    def forward(self, hidden_states, *args, **kwargs):
        chunk = self.ff_chunk_tokens
        base = super().forward
        if chunk is None:
            return base(hidden_states, *args, **kwargs)
        return feed_forward(lambda x: base(x, *args, **kwargs), hidden_states, chunk)


_CHUNKED_CLASSES: dict[type, type] = {}


@contextlib.contextmanager
def chunked_ff(ff: torch.nn.Module, chunk: int | None):
    """Within the block, `ff` (a block's `ff`, called by diffusers' own block forward) runs over token chunks of
    `chunk` (None: unchanged). The module's class gets `_ChunkedFeedForward` in front of it once (keeping its name,
    state dict and parameters; like FSDP2's `fully_shard` class swap), and the chunk is an instance attribute for
    the duration of the block (removed after: between blocks the module computes whole, as before)."""
    if chunk is None:
        yield
        return
    cls = type(ff)
    if not issubclass(cls, _ChunkedFeedForward):
        if cls not in _CHUNKED_CLASSES:
            _CHUNKED_CLASSES[cls] = type(cls.__name__, (_ChunkedFeedForward, cls), {"__module__": cls.__module__})
        ff.__class__ = _CHUNKED_CLASSES[cls]
    ff.ff_chunk_tokens = chunk
    try:
        yield
    finally:
        del ff.ff_chunk_tokens


def ff_chunk_of(options: ForwardOptions, hidden: torch.Tensor) -> int | None:
    """The chunk one part's video feed-forward runs in (`memory_plan.resolve_ff_chunk` on `options.ff_chunk_tokens`
    and `hidden` `[B, N, u]`'s shape and dtype): None = whole."""
    b, n, width = hidden.shape
    return resolve_ff_chunk(options.ff_chunk_tokens, n, ActivationShape(video_dim=width,
                                                                        act_bytes=hidden.element_size()), b)


# ---- the two block orders -------------------------------------------------------------------------------------------

def _mod(table: torch.Tensor, temb: torch.Tensor, b: int):
    """diffusers `get_mod_params`: per-layer table + per-token (or per-row) AdaLN embedding, unbound per parameter."""
    return (table[None, None].to(temb.dtype) + temb.reshape(b, temb.shape[1], table.shape[0], -1)).unbind(dim=2)


@dataclass(frozen=True, eq=False)
class BlockInputs:
    """What every block of one forward reads besides the two hidden streams (made once per forward by `run_eager`).

    video_context / audio_context `[B, L, D]` (after the LTX-2.0 caption projection); video_text_bias /
    audio_text_bias additive `[B, 1, 1, L]` or None; temb / temb_audio: the AdaLN embeddings `[B, N | 1, k·D]` of each
    stream; video_ca_ss / audio_ca_ss: the audio↔video cross-attention scale / shift embeddings; a2v_gate /
    v2a_gate: their gate embeddings; temb_prompt / temb_prompt_audio: the prompt AdaLN embeddings (LTX-2.3 / 2.5) or
    None; rope: the RoPE tables (`video_rotary_emb`, `audio_rotary_emb`, `ca_video_rotary_emb`,
    `ca_audio_rotary_emb`); options: ComfyUI's per-call switches (`ForwardOptions`: run_vx / run_ax, a2v / v2a
    cross-attention; STG is the caller's processor swap); keys: the split's `VideoKeys` for the attentions of
    `VIDEO_KEY_ATTENTIONS` (None: no split, or nothing to pass); ff_chunk: the video feed-forward's token chunk
    (`ff_chunk_of`; None: whole).
    """

    video_context: torch.Tensor
    audio_context: torch.Tensor
    video_text_bias: torch.Tensor | None
    audio_text_bias: torch.Tensor | None
    temb: torch.Tensor
    temb_audio: torch.Tensor
    video_ca_ss: torch.Tensor
    audio_ca_ss: torch.Tensor
    a2v_gate: torch.Tensor
    v2a_gate: torch.Tensor
    temb_prompt: torch.Tensor | None
    temb_prompt_audio: torch.Tensor | None
    rope: Mapping[str, tuple]
    options: ForwardOptions = PLAIN
    keys: VideoKeys | None = None
    ff_chunk: int | None = None


def diffusers_block(block, vx, ax, inputs: BlockInputs):
    """diffusers' `LTX2VideoTransformerBlock.forward` (the reference's order), called as diffusers' transformer calls
    it; the split's `VideoKeys` go in the masks of `attn1` and `video_to_audio_attn`. a2v / v2a False skip those
    attentions (`isolate_modalities`); `inputs.ff_chunk` runs the video feed-forward over token chunks (`chunked_ff`).
    Raises ValueError for `run_vx` / `run_ax` False (ComfyUI's switches: the "comfyui" block order only)."""
    i, o = inputs, inputs.options
    if not (o.run_vx and o.run_ax):
        raise ValueError("run_vx / run_ax False need ComfyUI's block order (semantics 'comfyui')")
    rope = i.rope
    with chunked_ff(block.ff, i.ff_chunk):
        return _diffusers_call(block, vx, ax, i, o, rope)


def _diffusers_call(block, vx, ax, i: BlockInputs, o: ForwardOptions, rope):
    return block(hidden_states=vx, audio_hidden_states=ax, encoder_hidden_states=i.video_context,
                 audio_encoder_hidden_states=i.audio_context, temb=i.temb, temb_audio=i.temb_audio,
                 temb_ca_scale_shift=i.video_ca_ss, temb_ca_audio_scale_shift=i.audio_ca_ss, temb_ca_gate=i.a2v_gate,
                 temb_ca_audio_gate=i.v2a_gate, temb_prompt=i.temb_prompt, temb_prompt_audio=i.temb_prompt_audio,
                 video_rotary_emb=rope["video_rotary_emb"], audio_rotary_emb=rope["audio_rotary_emb"],
                 ca_video_rotary_emb=rope["ca_video_rotary_emb"], ca_audio_rotary_emb=rope["ca_audio_rotary_emb"],
                 encoder_attention_mask=i.video_text_bias, audio_encoder_attention_mask=i.audio_text_bias,
                 self_attention_mask=i.keys, audio_self_attention_mask=None, a2v_cross_attention_mask=None,
                 v2a_cross_attention_mask=i.keys, use_a2v_cross_attention=o.a2v_cross_attn,
                 use_v2a_cross_attention=o.v2a_cross_attn, perturbation_mask=None, all_perturbed=False)


def comfy_block(block, vx, ax, inputs: BlockInputs):
    """ComfyUI 0.33 `BasicAVTransformerBlock.forward` on a diffusers `LTX2VideoTransformerBlock`'s modules.

    Differences from diffusers' block order (ComfyUI's win): the video→audio cross-attention normalizes the video
    stream *after* the audio→video update of the same block; `run_vx` / `run_ax` False skip a stream's self-attention,
    text cross-attention and feed-forward (a2v needs run_vx, v2a run_ax); a2v / v2a False skip those attentions.
    STG is the attention processor's business (`denoiser.skip_self_attention`); `inputs.ff_chunk` runs the video
    feed-forward over token chunks (`feed_forward`)."""
    i, o = inputs, inputs.options
    run_vx, run_ax, rope, keys = o.run_vx, o.run_ax, i.rope, i.keys
    temb, temb_audio, temb_prompt, temb_prompt_audio = i.temb, i.temb_audio, i.temb_prompt, i.temb_prompt_audio
    video_ca_ss, audio_ca_ss, a2v_gate, v2a_gate = i.video_ca_ss, i.audio_ca_ss, i.a2v_gate, i.v2a_gate
    v_ctx, a_ctx, v_text_bias, a_text_bias = i.video_context, i.audio_context, i.video_text_bias, i.audio_text_bias
    b = vx.shape[0]
    v_vals = _mod(block.scale_shift_table, temb, b)
    a_vals = _mod(block.audio_scale_shift_table, temb_audio, b)
    run_a2v = run_vx and o.a2v_cross_attn and ax.shape[1] > 0
    run_v2a = run_ax and o.v2a_cross_attn and ax.shape[1] > 0
    if block.cross_attn_adaln:
        kv = (_mod(block.prompt_scale_shift_table, temb_prompt, b) if temb_prompt is not None else
              block.prompt_scale_shift_table[None, None].to(vx.dtype).unbind(dim=2))
        a_kv = (_mod(block.audio_prompt_scale_shift_table, temb_prompt_audio, b) if temb_prompt_audio is not None
                else block.audio_prompt_scale_shift_table[None, None].to(ax.dtype).unbind(dim=2))
    if run_vx:
        shift, scale, gate = v_vals[:3]
        vx = vx + block.attn1(block.norm1(vx) * (1 + scale) + shift, None, keys, rope["video_rotary_emb"], None) * gate
        q = block.norm2(vx)
        ctx = v_ctx
        if block.video_cross_attn_adaln:
            q = q * (1 + v_vals[7]) + v_vals[6]
        if block.cross_attn_adaln:
            ctx = ctx * (1 + kv[1]) + kv[0]
        out = block.attn2(q, ctx, v_text_bias, None, None)
        vx = vx + (out * v_vals[8] if block.video_cross_attn_adaln else out)
    if run_ax:
        shift, scale, gate = a_vals[:3]
        ax = ax + block.audio_attn1(block.audio_norm1(ax) * (1 + scale) + shift, None, None,
                                    rope["audio_rotary_emb"], None) * gate
        q = block.audio_norm2(ax)
        ctx = a_ctx
        if block.audio_cross_attn_adaln:
            q = q * (1 + a_vals[7]) + a_vals[6]
        if block.cross_attn_adaln:
            ctx = ctx * (1 + a_kv[1]) + a_kv[0]
        out = block.audio_attn2(q, ctx, a_text_bias, None, None)
        ax = ax + (out * a_vals[8] if block.audio_cross_attn_adaln else out)
    if run_a2v or run_v2a:
        ax_norm = block.video_to_audio_norm(ax)
        v_ss = _mod(block.video_a2v_cross_attn_scale_shift_table[:4], video_ca_ss, b)
        a_ss = _mod(block.audio_a2v_cross_attn_scale_shift_table[:4], audio_ca_ss, b)
        if run_a2v:
            v_in = block.audio_to_video_norm(vx) * (1 + v_ss[0]) + v_ss[1]
            a_in = ax_norm * (1 + a_ss[0]) + a_ss[1]
            out = block.audio_to_video_attn(v_in, a_in, None, rope["ca_video_rotary_emb"], rope["ca_audio_rotary_emb"])
            vx = vx + out * _mod(block.video_a2v_cross_attn_scale_shift_table[4:], a2v_gate, b)[0]
        if run_v2a:
            a_in = ax_norm * (1 + a_ss[2]) + a_ss[3]
            v_in = block.audio_to_video_norm(vx) * (1 + v_ss[2]) + v_ss[3]
            out = block.video_to_audio_attn(a_in, v_in, keys, rope["ca_audio_rotary_emb"], rope["ca_video_rotary_emb"])
            ax = ax + out * _mod(block.audio_a2v_cross_attn_scale_shift_table[4:], v2a_gate, b)[0]
    if run_vx:
        shift, scale, gate = v_vals[3:6]
        vx = vx + feed_forward(block.ff, block.norm3(vx) * (1 + scale) + shift, i.ff_chunk) * gate
    if run_ax:
        shift, scale, gate = a_vals[3:6]
        ax = ax + block.audio_ff(block.audio_norm3(ax) * (1 + scale) + shift) * gate
    return vx, ax


def block_function(order: str):
    """The block of `Semantics.block_order` (looked up per call, so a test may replace one)."""
    return {"diffusers": diffusers_block, "comfyui": comfy_block}[order]


# ---- the forward ----------------------------------------------------------------------------------------------------

class Split(Protocol):
    """One kind of split of the one forward over ranks, as the forward uses it (implemented in `splits/`: Ulysses
    sequence parallel `sequence.UlyssesSplit`, tiles `tiled.TiledSplit`; batch rows and guidance passes split whole
    forwards: `passes.PassParallel` has the same three methods over a step's branches instead of a batch's tokens,
    made by the dispatcher `splits/dispatch.py`). The attention processors the split's plan names are installed
    beforehand by `splits.apply.apply_plan`; the split holds no per-forward state.

    plan: its `ForwardPlan` (`splits/forward_plan.py`); exchange: the collectives of its group that the plan's
    processors use (`splits/exchange.py`'s `Exchange`, what `apply_plan` installs them over; None for a plan whose
    attention is all local, e.g. tiles); cuda_graph_safe: a pure function of its tensors (`cuda_graphs.call` may
    capture the forward) or not (it synchronises with the host: eager).
    """

    plan: object
    exchange: object | None
    cuda_graph_safe: bool

    def shard(self, batch: TokenBatch) -> list[TokenBatch]:
        """This rank's parts of `batch` (its inputs split by the plan's input entries); each part is one local
        forward."""

    def key_mask(self, batch: TokenBatch, part: TokenBatch) -> torch.Tensor | None:
        """The additive `[1, 1, 1, Tp]` mask of `part`'s video keys (−inf on padding), None without padding."""

    def gather(self, batch: TokenBatch, outputs: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts' `(video, audio)` outputs -> the whole batch's (the plan's output entries), on every rank."""


def _local(transformer, batch: TokenBatch, semantics: Semantics, options: ForwardOptions,
           keys: VideoKeys | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2–4 of the module docstring on one part of a batch (all of it without a split)."""
    t, cfg = transformer, transformer.config
    b = batch.rows
    hidden = t.proj_in(batch.video)
    audio_hidden = t.audio_proj_in(batch.audio)
    dt, adt = hidden.dtype, audio_hidden.dtype
    if batch.keyframe_marker is not None:
        hidden = hidden + batch.keyframe_marker.to(dt).unsqueeze(-1) * t.keyframes_abs_pos_embedding.to(dt)

    def embed(module, ts, dtype):
        out, emb = module(ts.flatten(), batch_size=b, hidden_dtype=dtype)
        return out.view(b, -1, out.shape[-1]), emb.view(b, -1, emb.shape[-1])

    temb, emb = embed(t.time_embed, batch.video_timestep, dt)
    temb_audio, a_emb = embed(t.audio_time_embed, batch.audio_timestep, adt)
    temb_prompt = temb_prompt_audio = None
    if t.prompt_modulation and cfg.use_prompt_adaln_single:
        temb_prompt = embed(t.prompt_adaln, batch.video_prompt_timestep, dt)[0]
        temb_prompt_audio = embed(t.audio_prompt_adaln, batch.audio_prompt_timestep, adt)[0]
    v_ctx, a_ctx = batch.video_context, batch.audio_context
    if cfg.use_prompt_embeddings:  # LTX-2.0: the caption projection inside the forward
        v_ctx = t.caption_projection(v_ctx).view(b, -1, hidden.shape[-1])
        a_ctx = t.audio_caption_projection(a_ctx).view(b, -1, audio_hidden.shape[-1])
    coords, a_coords = batch.video_coords, batch.audio_coords
    inputs = BlockInputs(
        video_context=v_ctx, audio_context=a_ctx, video_text_bias=batch.video_text_bias,
        audio_text_bias=batch.audio_text_bias, temb=temb, temb_audio=temb_audio,
        video_ca_ss=embed(t.av_cross_attn_video_scale_shift, batch.video_cross_timestep, dt)[0],
        audio_ca_ss=embed(t.av_cross_attn_audio_scale_shift, batch.audio_cross_timestep, adt)[0],
        a2v_gate=embed(t.av_cross_attn_video_a2v_gate, batch.a2v_gate_timestep, dt)[0],
        v2a_gate=embed(t.av_cross_attn_audio_v2a_gate, batch.v2a_gate_timestep, adt)[0],
        temb_prompt=temb_prompt, temb_prompt_audio=temb_prompt_audio,
        rope=MappingProxyType(dict(
            video_rotary_emb=t.rope(coords, device=hidden.device),
            audio_rotary_emb=t.audio_rope(a_coords, device=audio_hidden.device),
            ca_video_rotary_emb=t.cross_attn_rope(coords[:, 0:1], device=hidden.device),
            ca_audio_rotary_emb=t.cross_attn_audio_rope(a_coords[:, 0:1], device=audio_hidden.device))),
        options=options, keys=keys, ff_chunk=ff_chunk_of(options, hidden))
    block = block_function(semantics.block_order)
    for blk in gathered(t.transformer_blocks):  # sharded weights: each block gathered as it runs
        hidden, audio_hidden = block(blk, hidden, audio_hidden, inputs)
    shift, scale = (t.scale_shift_table[None, None].to(dt) + emb[:, :, None]).unbind(dim=2)
    out = t.proj_out(t.norm_out(hidden) * (1 + scale) + shift)
    a_shift, a_scale = (t.audio_scale_shift_table[None, None].to(adt) + a_emb[:, :, None]).unbind(dim=2)
    audio_out = t.audio_proj_out(t.audio_norm_out(audio_hidden) * (1 + a_scale) + a_shift)
    return out, audio_out[:, batch.audio_prefix:]


def _keys(split: Split, batch: TokenBatch, part: TokenBatch) -> VideoKeys | None:
    """The per-forward `VideoKeys` of one part under `split` (None: nothing to pass)."""
    mask = split.key_mask(batch, part)
    kernel = GuideBias(part.guide_start, part.guide_log_w).attend if part.guide_log_w is not None else None
    return None if mask is None and kernel is None else VideoKeys(mask, kernel)


def run_eager(transformer, batch: TokenBatch, semantics: Semantics = REFERENCE, split: Split | None = None,
              options: ForwardOptions = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of `batch` (see the module docstring), eagerly. `split`: a `Split` whose plan's processors are
    installed (`splits.apply.apply_plan`), or None (the whole batch here, with whatever processors are installed).
    `options`: ComfyUI's per-call switches (a2v / v2a cross-attention, run_vx / run_ax; STG is the caller's
    processor swap). Raises ValueError for a guide bias without a split."""
    if split is None:
        if batch.guide_log_w is not None:
            raise ValueError("a guide-attention bias needs a split's processors (a degree-1 sequence split at least)")
        return _local(transformer, batch, semantics, options, None)
    outputs = [_local(transformer, part, semantics, options, _keys(split, batch, part))
               for part in split.shard(batch)]
    return split.gather(batch, outputs)


def run(transformer, batch: TokenBatch, semantics: Semantics = REFERENCE, split: Split | None = None,
        options: ForwardOptions = PLAIN, what: str = "forward") -> tuple[torch.Tensor, torch.Tensor]:
    """`run_eager`, replayed from CUDA graphs where it can be (`cuda_graphs.call`; CPU forwards never touch the
    graph machinery), with the semantics' q/k eps on the transformer's attention norms. A split that is not
    `cuda_graph_safe` (tiles) runs eagerly, the reason noted once for the report. `what` names the forward in a
    fallback reason of the job report."""
    tensors, static = batch.graph_inputs()
    if split is not None and not split.cuda_graph_safe:
        if cuda_graphs.eligible(tensors) is None:
            cuda_graphs.graphs_of(transformer).note_eager(
                f"{type(split).__name__} forwards eager (the split synchronises with the host)")
        with qk_eps(_transformer_qk_norms(transformer), semantics.qk_eps):
            return run_eager(transformer, batch, semantics, split, options)

    def forward(**kw):
        return run_eager(transformer, TokenBatch(**kw, **static), semantics, split, options)

    key = ("one forward", semantics, options, tuple(sorted((k, v) for k, v in static.items() if v is not None)),
           None if split is None else type(split).__name__)
    with qk_eps(_transformer_qk_norms(transformer), semantics.qk_eps):
        return cuda_graphs.call(transformer, forward, tensors, extra=key, what=what)


__all__ = ["BlockInputs", "PLAIN", "Split", "block_function", "chunked_ff", "comfy_block", "diffusers_block",
           "feed_forward", "ff_chunk_of", "qk_eps", "qk_norms", "run", "run_eager"]
