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
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.attention import LTX2AttnProcessor, use_processor
from ..protocol.native_forward import ForwardOptions
from ..engine import forward as model_forward
from ..engine.semantics import REFERENCE
from ..engine.tokens import TokenBatch
from ..protocol.fleet_rules import check_sp_degree
from .exchange import Exchange
from .forward_plan import SEQUENCE, pad_and_slice, shard_batch

NEG_INF = float("-inf")


def check_token_cap(tokens: int, world_size: int, cap: int | None) -> None:
    """Refuse a forward whose per-rank video token count exceeds `cap`, saying how to get under it."""
    if cap is None:
        return
    per_rank = -(-tokens // world_size)
    if per_rank > cap:
        need = -(-tokens // cap)
        raise ValueError(f"{tokens} video tokens over {world_size} ranks is {per_rank} tokens per rank, above the cap "
                         f"of {cap}: use at least {need} GPUs, fewer frames or a smaller size, or raise the cap")


@dataclass
class _ForwardState:
    """Per-forward information the processors need: the key-padding mask of the full padded video sequence."""

    key_mask: torch.Tensor | None = None  # additive [1, 1, 1, Tp]: 0 for real tokens, -inf for padding
    # per-forward replacement of the video self-attention kernel `(q, k, v, key_mask) -> out` on the gathered
    # sequence (all tokens, this rank's heads): the native forward's guide-attention bias (mgpu_backend/stages/native.py)
    self_attention: Callable | None = None


class UlyssesSelfAttention(LTX2AttnProcessor):
    """Video self-attention: local projections, all_to_all to head slices, attention over all tokens, back."""

    def __init__(self, exchange: Exchange, state: _ForwardState):
        self.exchange, self.state = exchange, state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, **_):
        if attention_mask is not None:
            raise NotImplementedError("a video self-attention mask (IC-LoRA) is not supported under sequence parallel")
        q, k, v = self.project(attn, hidden_states, None, query_rotary_emb, key_rotary_emb)
        # one all_to_all for q, k and v (stacked along the batch): a third of the collectives' launches and waits
        q, k, v = self.exchange.seq_to_heads(torch.cat((q, k, v))).chunk(3)
        mask = self.state.key_mask
        attend = self.state.self_attention or self.attend
        out = attend(q, k, v, None if mask is None else mask.to(q.dtype))
        out = self.exchange.heads_to_seq(out)
        return self.finish(attn, hidden_states, out)


class GatheredKeysCrossAttention(LTX2AttnProcessor):
    """video→audio cross-attention: replicated audio queries, video K/V all_gathered, padded keys masked."""

    def __init__(self, exchange: Exchange, state: _ForwardState):
        self.exchange, self.state = exchange, state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, **_):
        q, k, v = self.project(attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb)
        k, v = self.exchange.all_gather_seq(torch.cat((k, v))).chunk(2)  # one all_gather for K and V
        mask = self.state.key_mask
        if attention_mask is not None:
            raise NotImplementedError("a video→audio attention mask is not supported under sequence parallel")
        out = self.attend(q, k, v, None if mask is None else mask.to(q.dtype))
        return self.finish(attn, hidden_states, out)


class SequenceParallelTransformer:
    """Wraps an `LTX2VideoTransformer3DModel` so its forward runs sequence-parallel over `exchange`'s group.

    Call it with the transformer's keyword arguments (full, replicated inputs on every rank):
    `hidden_states [B, T, C]`, per-token `timestep [B, T]`, `video_coords [B, 3, T, 2]` (required: positions are
    sliced with the tokens), optional per-token `video_keyframes_mask [B, T, 1]` (sliced too), audio / text inputs
    as usual. Returns `(video [B, T, C], audio [B, Ta, C])` — the same
    on every rank.

    `activate()` installs its processors on the wrapped module (Ulysses for `attn1`, gathered K/V for
    `video_to_audio_attn`, local `LTX2AttnProcessor` for the rest); the stage that uses the wrapper calls it first,
    so one resident transformer serves SP and non-SP stages alike. `W = 1` runs without collectives.
    Raises ValueError for a degree that does not divide the heads, or above the token cap given with the call
    (`token_cap`: the job's, carried by `plan.StageRun`; the wrapper is shared by every job and holds no policy),
    before any work.
    """

    cuda_graph_safe = True  # a pure function of its tensors: `cuda_graphs.call` may capture it (piecewise)
    plan = SEQUENCE  # the declarative plan it applies (splits/forward_plan.py)

    def __init__(self, transformer, exchange: Exchange):
        check_sp_degree(transformer.config.num_attention_heads, exchange.world_size)
        self.transformer, self.exchange = transformer, exchange
        self.transformer_blocks = transformer.transformer_blocks  # for STG's processor swap
        self.state = _ForwardState()
        self._self_attention = UlyssesSelfAttention(exchange, self.state)
        self._video_to_audio = GatheredKeysCrossAttention(exchange, self.state)

    def activate(self) -> None:
        """Install the SP processors on the shared transformer (before the stage's first forward)."""
        use_processor(self.transformer, LTX2AttnProcessor())
        for block in self.transformer.transformer_blocks:
            block.attn1.set_processor(self._self_attention)
            block.video_to_audio_attn.set_processor(self._video_to_audio)

    def shard(self, x: torch.Tensor, dim: int, padded: int) -> torch.Tensor:
        """Zero-pad `dim` to `padded` and take this rank's contiguous slice."""
        return pad_and_slice(x, dim, padded, self.exchange.rank, self.exchange.world_size)

    def shard_batch(self, batch: TokenBatch) -> tuple[TokenBatch, int]:
        """This rank's share of `batch` by the plan (`forward_plan.SEQUENCE`'s inputs) -> (local, padded tokens)."""
        return shard_batch(self.plan, batch, self.exchange.rank, self.exchange.world_size)

    @staticmethod
    def key_mask(tokens: int, padded: int, device) -> torch.Tensor | None:
        """Additive `[1, 1, 1, padded]`: 0 on the real video keys, −inf on the padding (None: no padding)."""
        if padded == tokens:
            return None
        mask = torch.zeros(1, 1, 1, padded, device=device)
        mask[..., tokens:] = NEG_INF
        return mask

    def gather(self, video: torch.Tensor, tokens: int) -> torch.Tensor:
        """The plan's output entry: every rank's video tokens, gathered, the padding cut -> `[B, tokens, C]`."""
        return self.exchange.all_gather_seq(video)[:, :tokens]

    def check(self, tokens: int, timestep: torch.Tensor, token_cap: int | None = None) -> None:
        """Before a forward: the per-rank token cap `token_cap` (the job's; None: no cap), and per-token timesteps
        (raises ValueError)."""
        check_token_cap(tokens, self.exchange.world_size, token_cap)
        if timestep.ndim != 2 or timestep.shape[1] != tokens:
            raise ValueError(f"sequence parallel needs per-token timesteps [B, {tokens}]; got "
                             f"{tuple(timestep.shape)}")

    def ensure_active(self) -> None:
        """`activate()` unless this wrapper's processors are installed (another stage may have used the shared
        transformer since; STG never swaps the video→audio one, and a batch of guidance passes only wraps it, so
        the wrapped processor is what is checked). Called before a CUDA graph key is taken."""
        processor = self.transformer.transformer_blocks[0].video_to_audio_attn.processor
        while hasattr(processor, "inner"):  # a per-item wrapper of a batch of guidance passes (engine/denoiser.py)
            processor = processor.inner
        if processor is not self._video_to_audio:
            self.activate()

    def __call__(self, token_cap: int | None = None, **kwargs):
        """The diffusers keyword API (`TokenBatch.from_diffusers`) on the one forward, sequence parallel, eagerly;
        `token_cap`: the per-rank video token cap of this forward (None: no cap)."""
        self.ensure_active()
        self.check(kwargs["hidden_states"].shape[1], kwargs["timestep"], token_cap)
        isolate = bool(kwargs.get("isolate_modalities", False))
        batch = TokenBatch.from_diffusers(self.transformer.config, **kwargs)
        options = ForwardOptions(a2v_cross_attn=not isolate, v2a_cross_attn=not isolate)
        return model_forward.run_eager(self.transformer, batch, REFERENCE, self, options)
