"""The one transformer forward of the engine (issue 25): a `TokenBatch` in, packed velocities out, under a
`Semantics` record and, optionally, the sequence split of a parallel plan.

Every path runs it: the native MGPU MODEL (`native.NativeEngine.run_rows`), the stage runners of the CLI and the
nodes (`denoiser.LTX2Denoiser`, `comfy_stage.ComfyDenoiser`), the sequence-parallel and tiled wrappers
(`splits/sequence.py`, `splits/tiled.py`). It calls the resident diffusers `LTX2VideoTransformer3DModel`'s
modules (projections, AdaLN embeddings, RoPE, blocks, output layers); diffusers' own `forward` is no longer called.

Steps of `run_eager(transformer, batch, semantics, split, options)`:
1. the split (if any) takes this rank's share of the per-token fields (`split.shard_batch`: the plan's input entries,
   `splits/forward_plan.py`);
2. input projections (+ LTX-2.5's keyframe embedding on the marked tokens), the AdaLN embeddings of every timestep
   field, the LTX-2.0 caption projection, the RoPE tables of the local positions;
3. the blocks in the semantics' order (`Semantics.block_order`: "diffusers" = the block's own forward, "comfyui" =
   `comfy_block`), with the padded video keys masked and the guide-attention bias installed in the split's state;
4. output layers; the split gathers the video tokens (the plan's output entry) and cuts the padding; the audio output
   loses its `audio_prefix` (reference-audio) tokens.
Under the REFERENCE semantics this is diffusers 0.42.1's `LTX2VideoTransformer3DModel.forward` operation for
operation (bit-identical on CPU); under COMFYUI it is ComfyUI 0.33's `LTXAVModel` forward as `stages/native.py` documents.

`run(...)` is the same forward replayed from CUDA graphs where it can be (`cuda_graphs.call`, a pure function of the
batch's tensors; keyed on the semantics, the options, the batch's static fields and the installed processors), with
the semantics' q/k eps applied around it.

`Outputs`: video `[B, N, Cv_out]` (all tokens of the batch, on every rank of the split), audio
`[B, Ta − audio_prefix, Ca_out]`, in the compute dtype.
"""
from __future__ import annotations

import contextlib

import torch

from . import cuda_graphs
from .attention import GuideBias
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


# ---- the two block orders -------------------------------------------------------------------------------------------

def _mod(table: torch.Tensor, temb: torch.Tensor, b: int):
    """diffusers `get_mod_params`: per-layer table + per-token (or per-row) AdaLN embedding, unbound per parameter."""
    return (table[None, None].to(temb.dtype) + temb.reshape(b, temb.shape[1], table.shape[0], -1)).unbind(dim=2)


def diffusers_block(block, vx, ax, *, v_ctx, a_ctx, v_text_bias, a_text_bias, temb, temb_audio, video_ca_ss,
                    audio_ca_ss, a2v_gate, v2a_gate, temb_prompt, temb_prompt_audio, rope, run_vx=True, run_ax=True,
                    a2v=True, v2a=True):
    """diffusers' `LTX2VideoTransformerBlock.forward` (the reference's order), called as diffusers' transformer calls
    it. a2v / v2a False skip those attentions (`isolate_modalities`). Raises ValueError for `run_vx` / `run_ax`
    False (ComfyUI's switches: the "comfyui" block order only)."""
    if not (run_vx and run_ax):
        raise ValueError("run_vx / run_ax False need ComfyUI's block order (semantics 'comfyui')")
    return block(hidden_states=vx, audio_hidden_states=ax, encoder_hidden_states=v_ctx,
                 audio_encoder_hidden_states=a_ctx, temb=temb, temb_audio=temb_audio,
                 temb_ca_scale_shift=video_ca_ss, temb_ca_audio_scale_shift=audio_ca_ss, temb_ca_gate=a2v_gate,
                 temb_ca_audio_gate=v2a_gate, temb_prompt=temb_prompt, temb_prompt_audio=temb_prompt_audio,
                 video_rotary_emb=rope["video_rotary_emb"], audio_rotary_emb=rope["audio_rotary_emb"],
                 ca_video_rotary_emb=rope["ca_video_rotary_emb"], ca_audio_rotary_emb=rope["ca_audio_rotary_emb"],
                 encoder_attention_mask=v_text_bias, audio_encoder_attention_mask=a_text_bias,
                 self_attention_mask=None, audio_self_attention_mask=None, a2v_cross_attention_mask=None,
                 v2a_cross_attention_mask=None, use_a2v_cross_attention=a2v, use_v2a_cross_attention=v2a,
                 perturbation_mask=None, all_perturbed=False)


def comfy_block(block, vx, ax, *, v_ctx, a_ctx, v_text_bias, a_text_bias, temb, temb_audio, video_ca_ss, audio_ca_ss,
                a2v_gate, v2a_gate, temb_prompt, temb_prompt_audio, rope, run_vx=True, run_ax=True, a2v=True,
                v2a=True):
    """ComfyUI 0.33 `BasicAVTransformerBlock.forward` on a diffusers `LTX2VideoTransformerBlock`'s modules.

    Differences from diffusers' block order (ComfyUI's win): the video→audio cross-attention normalizes the video
    stream *after* the audio→video update of the same block; `run_vx` / `run_ax` False skip a stream's self-attention,
    text cross-attention and feed-forward (a2v needs run_vx, v2a run_ax); a2v / v2a False skip those attentions.
    STG is the attention processor's business (`denoiser.skip_self_attention`)."""
    b = vx.shape[0]
    v_vals = _mod(block.scale_shift_table, temb, b)
    a_vals = _mod(block.audio_scale_shift_table, temb_audio, b)
    run_a2v = run_vx and a2v and ax.shape[1] > 0
    run_v2a = run_ax and v2a and ax.shape[1] > 0
    if block.cross_attn_adaln:
        kv = (_mod(block.prompt_scale_shift_table, temb_prompt, b) if temb_prompt is not None else
              block.prompt_scale_shift_table[None, None].to(vx.dtype).unbind(dim=2))
        a_kv = (_mod(block.audio_prompt_scale_shift_table, temb_prompt_audio, b) if temb_prompt_audio is not None
                else block.audio_prompt_scale_shift_table[None, None].to(ax.dtype).unbind(dim=2))
    if run_vx:
        shift, scale, gate = v_vals[:3]
        vx = vx + block.attn1(block.norm1(vx) * (1 + scale) + shift, None, None, rope["video_rotary_emb"], None) * gate
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
            out = block.video_to_audio_attn(a_in, v_in, None, rope["ca_audio_rotary_emb"], rope["ca_video_rotary_emb"])
            ax = ax + out * _mod(block.audio_a2v_cross_attn_scale_shift_table[4:], v2a_gate, b)[0]
    if run_vx:
        shift, scale, gate = v_vals[3:6]
        vx = vx + block.ff(block.norm3(vx) * (1 + scale) + shift) * gate
    if run_ax:
        shift, scale, gate = a_vals[3:6]
        ax = ax + block.audio_ff(block.audio_norm3(ax) * (1 + scale) + shift) * gate
    return vx, ax


def block_function(order: str):
    """The block of `Semantics.block_order` (looked up per call, so a test may replace one)."""
    return {"diffusers": diffusers_block, "comfyui": comfy_block}[order]


# ---- the forward ----------------------------------------------------------------------------------------------------

def run_eager(transformer, batch: TokenBatch, semantics: Semantics = REFERENCE, split=None,
              options: ForwardOptions = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of `batch` (see the module docstring), eagerly. `split`: the sequence split of the plan (a
    `parallel.sequence.SequenceParallelTransformer`, whose processors are installed) or None (the whole batch here,
    with whatever processors are installed). `options`: ComfyUI's per-call switches (a2v / v2a cross-attention,
    run_vx / run_ax; STG is the caller's processor swap). Raises ValueError for a guide bias without a split."""
    t, cfg = transformer, transformer.config
    n, b = batch.video_tokens, batch.rows
    local, padded = (batch, n) if split is None else split.shard_batch(batch)
    hidden = t.proj_in(local.video)
    audio_hidden = t.audio_proj_in(local.audio)
    dt, adt = hidden.dtype, audio_hidden.dtype
    if local.keyframe_marker is not None:
        hidden = hidden + local.keyframe_marker.to(dt).unsqueeze(-1) * t.keyframes_abs_pos_embedding.to(dt)

    def embed(module, ts, dtype):
        out, emb = module(ts.flatten(), batch_size=b, hidden_dtype=dtype)
        return out.view(b, -1, out.shape[-1]), emb.view(b, -1, emb.shape[-1])

    temb, emb = embed(t.time_embed, local.video_timestep, dt)
    temb_audio, a_emb = embed(t.audio_time_embed, local.audio_timestep, adt)
    temb_prompt = temb_prompt_audio = None
    if t.prompt_modulation and cfg.use_prompt_adaln_single:
        temb_prompt = embed(t.prompt_adaln, local.video_prompt_timestep, dt)[0]
        temb_prompt_audio = embed(t.audio_prompt_adaln, local.audio_prompt_timestep, adt)[0]
    video_ca_ss = embed(t.av_cross_attn_video_scale_shift, local.video_cross_timestep, dt)[0]
    a2v_gate = embed(t.av_cross_attn_video_a2v_gate, local.a2v_gate_timestep, dt)[0]
    audio_ca_ss = embed(t.av_cross_attn_audio_scale_shift, local.audio_cross_timestep, adt)[0]
    v2a_gate = embed(t.av_cross_attn_audio_v2a_gate, local.v2a_gate_timestep, adt)[0]
    v_ctx, a_ctx = local.video_context, local.audio_context
    if cfg.use_prompt_embeddings:  # LTX-2.0: the caption projection inside the forward
        v_ctx = t.caption_projection(v_ctx).view(b, -1, hidden.shape[-1])
        a_ctx = t.audio_caption_projection(a_ctx).view(b, -1, audio_hidden.shape[-1])
    coords, a_coords = local.video_coords, local.audio_coords
    rope = dict(video_rotary_emb=t.rope(coords, device=hidden.device),
                audio_rotary_emb=t.audio_rope(a_coords, device=audio_hidden.device),
                ca_video_rotary_emb=t.cross_attn_rope(coords[:, 0:1], device=hidden.device),
                ca_audio_rotary_emb=t.cross_attn_audio_rope(a_coords[:, 0:1], device=audio_hidden.device))
    block = block_function(semantics.block_order)
    state = split.state if split is not None else None
    if local.guide_log_w is not None and state is None:
        raise ValueError("a guide-attention bias needs the sequence split's processors (a degree-1 split at least)")
    if state is not None:
        state.key_mask = split.key_mask(n, padded, hidden.device)
        state.self_attention = (GuideBias(local.guide_start, local.guide_log_w).attend
                                if local.guide_log_w is not None else None)
    try:
        for blk in gathered(t.transformer_blocks):  # sharded weights: each block gathered as it runs
            hidden, audio_hidden = block(
                blk, hidden, audio_hidden, v_ctx=v_ctx, a_ctx=a_ctx, v_text_bias=local.video_text_bias,
                a_text_bias=local.audio_text_bias, temb=temb, temb_audio=temb_audio, video_ca_ss=video_ca_ss,
                audio_ca_ss=audio_ca_ss, a2v_gate=a2v_gate, v2a_gate=v2a_gate, temb_prompt=temb_prompt,
                temb_prompt_audio=temb_prompt_audio, rope=rope, run_vx=options.run_vx, run_ax=options.run_ax,
                a2v=options.a2v_cross_attn, v2a=options.v2a_cross_attn)
    finally:
        if state is not None:
            state.key_mask = state.self_attention = None
    shift, scale = (t.scale_shift_table[None, None].to(dt) + emb[:, :, None]).unbind(dim=2)
    out = t.proj_out(t.norm_out(hidden) * (1 + scale) + shift)
    if split is not None:
        out = split.gather(out, n)
    a_shift, a_scale = (t.audio_scale_shift_table[None, None].to(adt) + a_emb[:, :, None]).unbind(dim=2)
    audio_out = t.audio_proj_out(t.audio_norm_out(audio_hidden) * (1 + a_scale) + a_shift)
    return out, audio_out[:, batch.audio_prefix:]


def run(transformer, batch: TokenBatch, semantics: Semantics = REFERENCE, split=None,
        options: ForwardOptions = PLAIN, what: str = "forward") -> tuple[torch.Tensor, torch.Tensor]:
    """`run_eager`, replayed from CUDA graphs where it can be (`cuda_graphs.call`; CPU forwards never touch the
    graph machinery), with the semantics' q/k eps on the transformer's attention norms. `what` names the forward in
    a fallback reason of the job report."""
    if split is not None:
        split.ensure_active()  # another job may have used the shared transformer since
    tensors, static = batch.graph_inputs()

    def forward(**kw):
        return run_eager(transformer, TokenBatch(**kw, **static), semantics, split, options)

    key = ("one forward", semantics, options, tuple(sorted((k, v) for k, v in static.items() if v is not None)),
           None if split is None else type(split).__name__)
    with qk_eps(_transformer_qk_norms(transformer), semantics.qk_eps):
        return cuda_graphs.call(transformer, forward, tensors, extra=key, what=what)


def call_diffusers(transformer, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The diffusers transformer's keyword API (`hidden_states`, `timestep`, `video_coords`, …, as
    `TokenBatch.from_diffusers` reads them) served by the one forward, eagerly, on this process (reference
    semantics; `isolate_modalities` severs both cross-modal attentions)."""
    isolate = bool(kwargs.get("isolate_modalities", False))
    batch = TokenBatch.from_diffusers(transformer.config, **kwargs)
    options = ForwardOptions(a2v_cross_attn=not isolate, v2a_cross_attn=not isolate) if isolate else PLAIN
    return run_eager(transformer, batch, REFERENCE, None, options)


__all__ = ["PLAIN", "block_function", "call_diffusers", "comfy_block", "diffusers_block", "qk_eps", "qk_norms",
           "run", "run_eager"]
