"""Our attention processor for the diffusers LTX-2 attention modules (`LTX2Attention.set_processor`).

Same math as diffusers' `LTX2AudioVideoAttnProcessor` (transformer_ltx2.py): Q/K/V projections, RMS QK-norm across
heads, RoPE (interleaved or split) on Q and K, scaled-dot-product attention, optional per-head gates (LTX-2.3),
output projection — split into `project` / `attend` / `finish` so the sequence-parallel processors
(`parallel/sequence.py`) can put their exchanges between the steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb


def _rope(attn, x: torch.Tensor, freqs) -> torch.Tensor:
    if attn.rope_type == "interleaved":
        return apply_interleaved_rotary_emb(x, freqs)
    return apply_split_rotary_emb(x, freqs)


def additive_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """diffusers' masks (`[B, Tk]` 0/1, or additive `[B, 1, Tk]` / `[B, Tq, Tk]`) -> additive `[B, 1, Tq|1, Tk]`."""
    if mask is None:
        return None
    if mask.ndim == 2:
        return ((1 - mask.float()) * -10000.0)[:, None, None, :]
    if mask.ndim == 3:
        return mask[:, None]
    return mask


class LTX2AttnProcessor:
    """Local attention with the diffusers LTX-2 semantics (see module docstring)."""

    def project(self, attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb):
        """-> q `[B, Tq, H, D]`, k, v `[B, Tk, H, D]` after QK-norm and RoPE."""
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(context))
        v = attn.to_v(context)
        if query_rotary_emb is not None:
            q = _rope(attn, q, query_rotary_emb)
            k = _rope(attn, k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
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


def use_processor(transformer, processor: LTX2AttnProcessor | None = None) -> None:
    """Install `processor` (default: a local `LTX2AttnProcessor`) on every attention of the transformer blocks."""
    processor = processor or LTX2AttnProcessor()
    for block in transformer.transformer_blocks:
        for name in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"):
            getattr(block, name).set_processor(processor)
