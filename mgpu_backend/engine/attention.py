"""Our attention processor for the diffusers LTX-2 attention modules (`LTX2Attention.set_processor`).

Same math as diffusers' `LTX2AudioVideoAttnProcessor` (transformer_ltx2.py): Q/K/V projections, RMS QK-norm across
heads, RoPE (interleaved or split) on Q and K, scaled-dot-product attention, optional per-head gates (LTX-2.3),
output projection — split into `project` / `attend` / `finish` so the sequence-parallel processors
(`splits/sequence.py`) can put their exchanges between the steps.

What differs from diffusers is only where the arithmetic happens, the way Lightricks' reference does it (ltx-core
1.0.0 `rope.precompute_freqs_cis` / `apply_split_rotary_emb`, `utils.rms_norm`): the dtype copies diffusers makes
here are most of its overhead against the reference (bench/results/profile_forward_1280x704_h200.txt):
- RoPE is applied in the compute dtype with the cos / sin tables cast to it **once per forward** (diffusers upcasts
  q and k to float32 in every attention and casts back);
- the blocks' parameter-free RMSNorms run as one fused `torch.nn.functional.rms_norm` kernel
  (`use_fused_norms`; diffusers' `RMSNorm` makes float32 copies of the hidden states).
In float32 both are the reference's arithmetic exactly.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm


class RopeTables:
    """The RoPE tables of one forward in the compute dtype and the layout `apply_rope` wants, made once per forward.

    diffusers' transformer computes each table (float32, split: cos / sin `[B, H, T, D/2]`; interleaved: `[B, T, C]`)
    once per forward and passes the same tensors to all 48 blocks; the first attention that sees a table converts it,
    the other blocks reuse the conversion (keyed by the source tensor, which is kept alive so the key stays unique).
    Under `torch.compile` the conversion is traced into the graph instead (the compiler fuses it with the rotation).
    `capacity` = the tables of one forward (video, audio, and the two cross-modal ones): the next forward's first
    table drops them, so at most one forward's tables (~0.8 GB at 1920×1088×121) outlive their forward.
    """

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._tables: dict[tuple[int, torch.dtype], tuple] = {}

    def clear(self) -> None:
        self._tables.clear()

    def get(self, rope_type: str, freqs, dtype: torch.dtype):
        cos, sin = freqs
        if torch.compiler.is_compiling():
            return _convert(rope_type, cos, sin, dtype)
        key = (id(cos), dtype)
        hit = self._tables.get(key)
        if hit is None or hit[0] is not cos:
            if len(self._tables) >= self.capacity:
                self._tables.clear()  # a new forward: its tables replace the old ones
            hit = (cos, _convert(rope_type, cos, sin, dtype))
            self._tables[key] = hit
        return hit[1]


def _convert(rope_type: str, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
    if rope_type == "interleaved":
        return cos.to(dtype), sin.to(dtype)
    # split: [B, H, T, D/2] -> [B, T, H, 1, D/2], broadcast against q / k viewed as [B, T, H, 2, D/2]
    return tuple(t.transpose(1, 2).unsqueeze(3).to(dtype) for t in (cos, sin))


def apply_rope(rope_type: str, x: torch.Tensor, tables) -> torch.Tensor:
    """Rotate `x` `[B, T, H·D]` by the tables of `RopeTables.get`, in x's dtype (the reference's arithmetic:
    `x·cos` then one fused multiply-add per half, ltx-core 1.0.0 `rope.apply_*_rotary_emb`).

    split: the first and second halves of each head's D channels are the rotation pairs;
    interleaved: channels (2i, 2i+1) are the pairs.
    """
    cos, sin = tables
    if rope_type == "interleaved":
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return x * cos + rotated * sin
    heads = cos.shape[2]
    halves = x.unflatten(-1, (heads, 2, -1))  # [B, T, H, 2, D/2]
    out = halves * cos
    out[..., 0:1, :].addcmul_(-sin, halves[..., 1:2, :])
    out[..., 1:2, :].addcmul_(sin, halves[..., 0:1, :])
    return out.flatten(2)


def additive_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """diffusers' masks (`[B, Tk]` 0/1, or additive `[B, 1, Tk]` / `[B, Tq, Tk]`) -> additive `[B, 1, Tq|1, Tk]`."""
    if mask is None:
        return None
    if mask.ndim == 2:
        return ((1 - mask.float()) * -10000.0)[:, None, None, :]
    if mask.ndim == 3:
        return mask[:, None]
    return mask


VIDEO_KEY_ATTENTIONS = ("attn1", "video_to_audio_attn")
"""The attentions whose keys are the video tokens: what a split's padding mask and the guide-attention kernel
concern (`VideoKeys`)."""


@dataclass(frozen=True, eq=False)
class VideoKeys:
    """What the attentions of `VIDEO_KEY_ATTENTIONS` need per forward under a split, made by the forward
    (`engine/forward.py`) and passed down the blocks in those attentions' `attention_mask` argument (diffusers'
    block hands that argument to the processor unchanged), so no processor keeps per-forward state.

    mask: additive `[1, 1, 1, Tp]` over the split's padded video sequence (0 on real keys, −inf on padding), or
        None (no padding).
    self_attention: the video self-attention kernel `(q, k, v, mask) -> out` on the whole sequence (`[B, Tp, H, D]`,
        this rank's heads), e.g. `GuideBias.attend`; None: scaled-dot-product attention.
    """

    mask: torch.Tensor | None = None
    self_attention: Callable | None = None


def video_keys(attention_mask, where: str) -> VideoKeys:
    """The `VideoKeys` a split's processor was given in its `attention_mask` argument (None: none). Raises
    NotImplementedError for a tensor mask (IC-LoRA's self-attention mask, a v2a mask): not supported under a split."""
    if attention_mask is None:
        return NO_KEYS
    if isinstance(attention_mask, VideoKeys):
        return attention_mask
    raise NotImplementedError(f"a {where} attention mask is not supported under sequence parallel")


NO_KEYS = VideoKeys()


class LTX2AttnProcessor:
    """Local attention with the diffusers LTX-2 semantics (see module docstring)."""

    rope_tables = RopeTables()  # shared by every processor: the tables are per forward, not per processor

    def project(self, attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb):
        """-> q `[B, Tq, H, D]`, k, v `[B, Tk, H, D]` after QK-norm and RoPE."""
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(context))
        v = attn.to_v(context)
        if query_rotary_emb is not None:
            key_rotary_emb = key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
            q = apply_rope(attn.rope_type, q, self.rope_tables.get(attn.rope_type, query_rotary_emb, q.dtype))
            k = apply_rope(attn.rope_type, k, self.rope_tables.get(attn.rope_type, key_rotary_emb, k.dtype))
        return (q.unflatten(2, (attn.heads, -1)), k.unflatten(2, (attn.heads, -1)),
                v.unflatten(2, (attn.heads, -1)))

    @staticmethod
    def attend(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """`[B, Tq, H, D]` × `[B, Tk, H, D]` -> `[B, Tq, H, D]` (SDPA; `mask` additive, broadcast to `[B, H, Tq, Tk]`)."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2)

    def finish(self, attn, hidden_states, out: torch.Tensor) -> torch.Tensor:
        """Per-head gates (LTX-2.3: `2·sigmoid(to_gate_logits(x))`) and the output projection."""
        if attn.to_gate_logits is not None:
            gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))  # [B, Tq, H]
            out = out * gates.unsqueeze(-1).to(out.dtype)
        out = out.flatten(2, 3).to(hidden_states.dtype)
        return attn.to_out[1](attn.to_out[0](out))

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, **_):
        q, k, v = self.project(attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb)
        out = self.attend(q, k, v, additive_mask(attention_mask))
        return self.finish(attn, hidden_states, out)


@dataclass
class GuideBias:
    """ComfyUI's `GuideAttentionMask` over the kept token sequence: queries [0, guide_start) add `log_w` on keys
    [guide_start, guide_start + tracked); tracked queries add their own `log_w` on keys [0, guide_start)."""

    guide_start: int
    log_w: torch.Tensor  # [tracked] in the compute dtype (finfo.min where the weight is 0)

    @property
    def tracked(self) -> int:
        return self.log_w.numel()

    def attend(self, q, k, v, key_mask):
        """The video self-attention kernel on the whole (padded) sequence: `[B, Tp, H, D]` in, out; `key_mask`
        additive `[1, 1, 1, Tp]` (−inf on padding) or None."""
        gs, te, tp = self.guide_start, self.guide_start + self.tracked, q.shape[1]
        log_w = self.log_w.to(q.dtype)
        base = torch.zeros(1, 1, 1, tp, dtype=q.dtype, device=q.device) if key_mask is None else key_mask.to(q.dtype)
        outs = []
        if gs > 0:
            noisy = base.clone()
            noisy[..., gs:te] += log_w
            outs.append(LTX2AttnProcessor.attend(q[:, :gs], k, v, noisy))
        tracked = base.expand(1, 1, te - gs, tp).clone()
        tracked[..., :gs] += log_w.view(1, 1, -1, 1)
        outs.append(LTX2AttnProcessor.attend(q[:, gs:te], k, v, tracked))
        if te < tp:
            outs.append(LTX2AttnProcessor.attend(q[:, te:], k, v, key_mask))
        return torch.cat(outs, dim=1)


class FusedRMSNorm(torch.nn.Module):
    """A parameter-free RMSNorm as one `F.rms_norm` kernel (accumulates in float32, one rounding to x's dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), eps=self.eps)


def use_fused_norms(transformer) -> None:
    """Replace the blocks' parameter-free diffusers `RMSNorm`s by `FusedRMSNorm` (same math; no state-dict change)."""
    for block in transformer.transformer_blocks:
        for name, child in list(block.named_children()):
            if isinstance(child, RMSNorm) and child.weight is None:
                setattr(block, name, FusedRMSNorm(child.dim[-1] if isinstance(child.dim, tuple) else child.dim,
                                                  child.eps))


def _attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                       key_rotary_emb=None, **kwargs):
    """`LTX2Attention.forward` without its per-call `inspect.signature` of the processor (288 calls per forward, CPU
    time that bounds small sizes): the processor is called directly."""
    return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                          key_rotary_emb, **kwargs)


ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


def use_processor(transformer, processor: LTX2AttnProcessor | None = None) -> None:
    """Install `processor` (default: a local `LTX2AttnProcessor`) on every attention of the transformer blocks,
    the direct processor call (`_attention_forward`) and the fused norms (`use_fused_norms`)."""
    processor = processor or LTX2AttnProcessor()
    LTX2AttnProcessor.rope_tables.clear()  # a new stage: the last stage's tables are not needed any more
    use_fused_norms(transformer)
    for block in transformer.transformer_blocks:
        for name in ATTENTIONS:
            attn = getattr(block, name)
            attn.set_processor(processor)
            attn.forward = types.MethodType(_attention_forward, attn)
