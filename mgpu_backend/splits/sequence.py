"""Faithful sequence parallelism (SP) for the LTX-2 transformer: Ulysses video self-attention.

Every rank runs the same denoising loop on the same full latent (docs/design/sequence-parallel.md). Inside one
transformer forward:
1. the video tokens are padded with zero tokens to a multiple of W, and rank r takes the contiguous slice
   `[r·Tp/W, (r+1)·Tp/W)` of the latent, the per-token timesteps and the positions; audio and text stay replicated;
2. video self-attention (`attn1`): after QK-norm and RoPE on the local tokens, one all_to_all (q, k and v stacked)
   gives each rank all tokens for H/W heads; attention with the padded keys masked; all_to_all back
   (DeepSpeed-Ulysses) — 2 collectives per block;
3. video→audio cross-attention (`video_to_audio_attn`, audio queries replicated, video keys sharded): the video K/V
   are all_gathered in one collective (after QK-norm and RoPE) and the **padded keys are masked here too** (the
   reference leaves them visible, so its audio drifts when T % W ≠ 0); every rank then computes the same audio
   update;
   — all_gather of K/V is chosen over a head-split exchange because the audio stream is short (~126 tokens per
   5 s): the attention it replicates is small, and it needs one collective instead of three;
4. text and audio→video cross-attention, feed-forwards and AdaLN are per token: no communication;
5. the per-rank velocities are all_gathered and the padding cut.
The result equals the single-process forward up to floating-point reduction order.

Valid degrees: W must divide the video heads (32 for LTX-2/2.3 → 1, 2, 4, 8, 16, 32; 8 for the tiny models): the
rule is `protocol/fleet_rules.py`.

Pieces: `UlyssesSplit` (the `engine.forward.Split` of the `SEQUENCE` plan: shard, key mask, gather) and the two
processors `apply.apply_plan` installs for the plan's attention entries (`ULYSSES`, `GATHERED_KEYS`). The
per-forward key mask and guide-attention kernel reach the processors as `attention.VideoKeys` in their
`attention_mask` argument; nothing here keeps per-forward state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.attention import LTX2AttnProcessor, video_keys
from ..engine.tokens import TokenBatch
from ..protocol.fleet_rules import check_sp_degree
from ..protocol.memory_plan import cap_refusal
from .exchange import Exchange
from .forward_plan import SEQUENCE, ForwardPlan, shard_batch

NEG_INF = float("-inf")


def check_token_cap(tokens: int, world_size: int, cap: int | None, frame_tokens: int | None = None,
                    size: str | None = None, degrees=None, cap_at=None) -> None:
    """Refuse (ValueError) a forward whose per-rank video token count ⌈tokens / world_size⌉ exceeds `cap` (None: no
    cap), saying how to get under it (`protocol/memory_plan.py cap_refusal`): with `frame_tokens` (latent tokens per
    latent frame) the longest clip that fits at this `size`, and the ranks that would hold the asked clip — the
    fewest of `degrees` (valid SP degrees) under `cap_at(d)` (the per-rank cap at d ranks; default: `cap` at every
    degree), or ⌈tokens / cap⌉ without `degrees`."""
    if cap is None:
        return
    msg = cap_refusal(tokens, world_size, lambda d: cap if d == world_size or cap_at is None else cap_at(d), degrees,
                      frame_tokens, size)
    if msg is not None:
        raise ValueError(msg)


class UlyssesSelfAttention(LTX2AttnProcessor):
    """Video self-attention: local projections, all_to_all to head slices, attention over all tokens, back."""

    def __init__(self, exchange: Exchange):
        self.exchange = exchange

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, **_):
        keys = video_keys(attention_mask, "video self-attention (IC-LoRA)")
        # one all_to_all for q, k and v (stacked along the batch): a third of the collectives' launches and waits.
        # The projections are not kept past their concatenation (no local names): during the all_to_all the rank
        # holds the stack, the send and the receive buffer — 9 token-widths instead of 12 (issue 35's memory plan)
        q, k, v = self.exchange.seq_to_heads(torch.cat(self.project(attn, hidden_states, None, query_rotary_emb,
                                                                    key_rotary_emb))).chunk(3)
        attend = keys.self_attention or self.attend
        out = attend(q, k, v, None if keys.mask is None else keys.mask.to(q.dtype))
        out = self.exchange.heads_to_seq(out)
        return self.finish(attn, hidden_states, out)


class GatheredKeysCrossAttention(LTX2AttnProcessor):
    """video→audio cross-attention: replicated audio queries, video K/V all_gathered, padded keys masked."""

    def __init__(self, exchange: Exchange):
        self.exchange = exchange

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, **_):
        keys = video_keys(attention_mask, "video→audio")
        q, k, v = self.project(attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb)
        k, v = self.exchange.all_gather_seq(torch.cat((k, v))).chunk(2)  # one all_gather for K and V
        out = self.attend(q, k, v, None if keys.mask is None else keys.mask.to(q.dtype))
        return self.finish(attn, hidden_states, out)


@dataclass(frozen=True, eq=False)
class UlyssesSplit:
    """The `SEQUENCE` plan over `exchange`'s group, as the one forward uses it (`engine.forward.Split`): every rank
    takes its contiguous slice of the (zero-padded) video tokens, the processors exchange what attention needs,
    the video output is gathered and the padding cut. A value: build it per group (`plan.build_plan`) and pass it
    to each forward; its processors are installed by `apply.apply_plan(transformer, split.plan, split.exchange)`.

    token_cap: the job's per-rank video token cap (`plan.StageRun`; None: no cap), checked by `shard` (ValueError).
    `W = 1` runs without collectives (the native MODEL's single-process forward: the guide-bias kernel needs these
    processors).
    """

    exchange: Exchange
    token_cap: int | None = None
    plan: ForwardPlan = SEQUENCE
    cuda_graph_safe = True  # a pure function of its tensors: `cuda_graphs.call` may capture it (piecewise)

    @property
    def world_size(self) -> int:
        return self.exchange.world_size

    def shard(self, batch: TokenBatch) -> list[TokenBatch]:
        """This rank's share of `batch` by the plan's input entries (one part). Raises ValueError above the token
        cap."""
        check_token_cap(batch.video_tokens, self.exchange.world_size, self.token_cap)
        return [shard_batch(self.plan, batch, self.exchange.rank, self.exchange.world_size)[0]]

    def padded(self, tokens: int) -> int:
        """The video token count padded to a multiple of the degree."""
        return -(-tokens // self.exchange.world_size) * self.exchange.world_size

    def key_mask(self, batch: TokenBatch, part: TokenBatch) -> torch.Tensor | None:
        """Additive `[1, 1, 1, padded]`: 0 on the real video keys, −inf on the padding (None: no padding)."""
        tokens, padded = batch.video_tokens, self.padded(batch.video_tokens)
        if padded == tokens:
            return None
        mask = torch.zeros(1, 1, 1, padded, device=part.video.device)
        mask[..., tokens:] = NEG_INF
        return mask

    def gather(self, batch: TokenBatch, outputs: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's output entries: every rank's video tokens gathered along the entry's dim, the padding cut ->
        `[B, tokens, C]`; the audio (replicated) as computed."""
        (video, audio), = outputs
        dim = self.plan.outputs["video"].dim
        return self.exchange.all_gather_seq(video, dim).narrow(dim, 0, batch.video_tokens), audio


__all__ = ["GatheredKeysCrossAttention", "UlyssesSelfAttention", "UlyssesSplit", "check_token_cap"]
