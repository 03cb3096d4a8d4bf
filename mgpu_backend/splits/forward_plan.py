"""The parallel plan of the one forward, declared as data (issue 25), in the style of diffusers' `_cp_plan` and
PyTorch's `parallelize_module` plan dicts: which `TokenBatch` inputs are split along which dim, which outputs are
gathered, which attentions exchange what — one `ForwardPlan` per kind of split, applied by one function each.

| plan | inputs | attention | outputs | weights |
|---|---|---|---|---|
| `SEQUENCE` (sequence parallel, docs/design/sequence-parallel.md) | the video token fields (`tokens.TOKEN_FIELDS`) split on the token dim into W contiguous slices after zero-padding to a multiple of W; the rest replicated | `attn1`: Ulysses (all_to_all to head slices and back); `video_to_audio_attn`: the video K/V all_gathered; padded keys masked in both | video gathered on the token dim, padding cut | replicated |
| `TILES` (tiled data parallel, docs/design/tiled-data-parallel.md) | the video token fields indexed by each tile's tokens (+ the conditioning tokens it keeps), positions re-based per tile | local | video: weighted sum over the tiles' tokens, one all_reduce | replicated |
| `ROWS` (guidance passes / batch rows, `passes.py`) | whole rows (dim 0) round-robin to ranks | local | each row's outputs broadcast from its owner | replicated |

`weights`: "replicated", or `SHARDED` on a fleet whose weights are sharded (`FleetIdentity.weights`, FSDP2
`fully_shard` per transformer block, `weights/sharding.py`: each block gathered as it runs, the arithmetic
unchanged). With sharded weights every rank runs every forward: `SEQUENCE` over all ranks and `TILES` with a multiple
of W tiles; `ROWS` and sequence-parallel sub-groups are refused (`ParallelPlan.for_policy`). A new kind of split is a new `ForwardPlan`
here plus the one function that applies it (`shard_batch` for token splits); the forward itself
(`model_forward.run_eager`) does not change.

Which plan a stage or a native forward runs is chosen once per job by `ParallelPlan.split` (the cost model,
`cost.py`) and carried down as a `StageRun`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..engine.tokens import TOKEN_FIELDS, TokenBatch


@dataclass(frozen=True)
class Split:
    """An input split along `dim` (only when the field has the video token axis there; per-row values are
    replicated)."""

    dim: int


@dataclass(frozen=True)
class Gather:
    """An output gathered along `dim` from every rank of the split (padding cut)."""

    dim: int


REPLICATED = "replicated"
ULYSSES = "ulysses"  # all_to_all sequence -> heads, attend over every token, back (splits/sequence.py)
GATHERED_KEYS = "gathered keys"  # replicated queries, the sharded keys / values all_gathered (splits/sequence.py)
LOCAL = "local"
SHARDED = "sharded"  # the weights entry of a fleet with sharded weights (FSDP2 per block)


@dataclass(frozen=True)
class ForwardPlan:
    """One kind of split of the one forward, as data (see the module docstring's table)."""

    name: str
    inputs: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # field -> Split
    attention: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # attention module -> kind
    outputs: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # "video" | "audio" -> Gather
    weights: str = REPLICATED  # the weight-sharding entry: REPLICATED or SHARDED (weights/sharding.py)

    def with_sharded_weights(self) -> "ForwardPlan":
        """The same split on a fleet whose weights are sharded. Raises ValueError for `ROWS` (ranks would run
        different forwards, and every block's gather needs all of them)."""
        if self.name == ROWS.name:
            raise ValueError("batch rows spread over ranks cannot run with sharded weights")
        return dataclasses.replace(self, weights=SHARDED)


SEQUENCE = ForwardPlan(
    name="sequence parallel",
    inputs=MappingProxyType({name: Split(2 if name == "video_coords" else 1) for name in TOKEN_FIELDS}),
    attention=MappingProxyType({"attn1": ULYSSES, "video_to_audio_attn": GATHERED_KEYS}),
    outputs=MappingProxyType({"video": Gather(1)}))
TILES = ForwardPlan(name="tiles", inputs=MappingProxyType({name: Split(2 if name == "video_coords" else 1)
                                                           for name in TOKEN_FIELDS}))
ROWS = ForwardPlan(name="batch rows", inputs=MappingProxyType({"*": Split(0)}))
PLANS = (SEQUENCE, TILES, ROWS)


def pad_and_slice(x: torch.Tensor, dim: int, padded: int, rank: int, world_size: int) -> torch.Tensor:
    """Zero-pad `dim` of `x` to `padded` and take rank `rank`'s contiguous slice of `padded / world_size`."""
    t = x.shape[dim]
    if padded != t:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded - t
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    per_rank = padded // world_size
    return x.narrow(dim, rank * per_rank, per_rank)


def shard_batch(plan: ForwardPlan, batch: TokenBatch, rank: int, world_size: int) -> tuple[TokenBatch, int]:
    """This rank's share of `batch` under a token-splitting `plan` -> (local batch, padded token count).
    Fields the plan splits are padded with zeros to a multiple of `world_size` and sliced; the others are kept."""
    n = batch.video_tokens
    padded = -(-n // world_size) * world_size
    if world_size == 1 and padded == n:
        return batch, n
    changes = {name: pad_and_slice(getattr(batch, name), entry.dim, padded, rank, world_size)
               for name, entry in plan.inputs.items() if batch.per_token(name)}
    return dataclasses.replace(batch, **changes), padded


def select_tokens(plan: ForwardPlan, batch: TokenBatch, index: torch.Tensor, **replace) -> TokenBatch:
    """The batch of the video tokens `index` (a tile's): every field the plan splits indexed along its dim;
    `replace` overrides fields (e.g. the tile's re-based positions)."""
    changes = {name: getattr(batch, name).index_select(entry.dim, index.to(getattr(batch, name).device))
               for name, entry in plan.inputs.items() if batch.per_token(name)}
    changes.update(replace)
    return dataclasses.replace(batch, **changes)


__all__ = ["ForwardPlan", "GATHERED_KEYS", "Gather", "LOCAL", "PLANS", "REPLICATED", "ROWS", "SEQUENCE", "SHARDED", "Split",
           "TILES", "ULYSSES", "pad_and_slice", "select_tokens", "shard_batch"]
