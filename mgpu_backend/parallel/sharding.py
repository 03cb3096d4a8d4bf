"""Sharded weights (the fleet's memory mode): the transformer's layers sharded over the ranks with FSDP2.

`FleetIdentity.weights = "sharded"` makes every rank hold 1/W of each attention and feed-forward layer of the
transformer blocks (`torch.distributed.fsdp.fully_shard`, one FSDP unit per attention / feed-forward module, dim 0
of every parameter split over the ranks). Before a unit runs, FSDP all-gathers its full weights on every rank; after
it, the gathered copy is freed (`reshard_after_forward=True`). So:

- **Faithful**: the forward computes with the very same weights as one process (an all-gather copies bytes), so a
  sharded forward equals the replicated forward bit for bit on the same rank layout — sequence parallel or not. It
  composes with Ulysses sequence parallelism on the same ranks (weights sharded over all W, tokens split over all W:
  "ZeRO-3 + Ulysses"), which needs no 2-D mesh.
- **Any dtype**: bf16 / fp32 parameters, fp8 (e4m3fn / e5m2) and int8 weights stay in their dtype in the shards
  (FSDP2 all-gathers a unit whose parameters mix dtypes as bytes); per-tensor and per-row scales are buffers and stay
  replicated, as do the blocks' AdaLN tables, the embeddings and the projections in and out (small: ~1 % of the
  transformer). The text connectors' blocks (attention, feed-forward) are sharded too: they run on every rank.
- **Lockstep**: every rank must call every unit in the same order (each call is a collective). Hence the plan of a
  sharded fleet (`ParallelPlan.set_policy`): every forward runs sequence parallel over all ranks, never on a
  sub-group; guidance passes or batch rows are not spread over ranks; a tiled stage needs a tile count that is a
  multiple of W (every rank runs the same number of tile forwards). CUDA graphs and `torch.compile` are off (the
  per-unit all-gathers are not captured).

Why FSDP and not tensor parallel (DTensor `ColwiseParallel` / `RowwiseParallel`): FSDP moves the weights (≈ the
model size × (W−1)/W per forward, whatever the token count) and changes no arithmetic; tensor parallel moves
activations (≈ 2 all-reduces per attention and feed-forward, ∝ tokens: ≈ 8 per block × T × 4096 × 2 B) and changes
the reduction order of every row-split layer and of the q/k RMSNorm across heads. At stage-1 sizes (T ≥ 4k video
tokens) tensor parallel moves more bytes than FSDP (`bench/bench_sharded.py` prints both), so FSDP is the one mode.

Memory per rank (`ShardingReport`): the shards (≈ 1/W of the block layers) + the replicated rest + one gathered
unit at a time (≈ 1/48 of the blocks per attention, ×4 for a feed-forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..protocol import WEIGHT_MODES  # "replicated" | "sharded": `FleetIdentity.weights`

# the modules of a transformer block that become FSDP units (everything else stays replicated)
SHARDED_UNITS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn",
                 "ff", "audio_ff")
CONNECTOR_UNITS = ("attn1", "ff")  # the same in the text connectors' blocks (LTX-2.3 / 2.5: ~2B parameters)


@dataclass(frozen=True)
class ShardingReport:
    """What one rank holds after `shard_transformer` (bytes of parameters and buffers, this rank's memory).

    world_size: ranks the units are sharded over.
    units: FSDP units (8 per transformer block: six attentions, two feed-forwards; 2 per connector block).
    sharded_bytes: this rank's shards of the units (≈ 1/W of `unit_bytes`, rounded up per parameter).
    unit_bytes: the units' full size (what one replica holds of them).
    replicated_bytes: the rest of the transformer, held whole by every rank.
    largest_unit_bytes: the largest unit, gathered whole while it runs.
    """

    world_size: int
    units: int
    sharded_bytes: int
    unit_bytes: int
    replicated_bytes: int
    largest_unit_bytes: int

    @property
    def resident_bytes(self) -> int:
        """Weights resident on this rank between forwards."""
        return self.sharded_bytes + self.replicated_bytes

    @property
    def replica_bytes(self) -> int:
        """What one rank would hold with replicated weights."""
        return self.unit_bytes + self.replicated_bytes

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"sharded weights (FSDP2) over {self.world_size} ranks: {self.units} units, "
                f"{self.resident_bytes / gib:.2f} GiB resident per rank ({self.sharded_bytes / gib:.2f} GiB shards + "
                f"{self.replicated_bytes / gib:.2f} GiB replicated) of a {self.replica_bytes / gib:.2f} GiB replica; "
                f"+{self.largest_unit_bytes / gib:.2f} GiB while the largest layer runs")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _slots(transformer: nn.Module, connectors=()) -> list[tuple[nn.Module, str, nn.Module]]:
    """(block, attribute, unit) of every module `shard_transformer` makes an FSDP unit, in call order."""
    out = [(block, name, getattr(block, name)) for block in transformer.transformer_blocks for name in SHARDED_UNITS
           if getattr(block, name, None) is not None]
    for connector in connectors:
        out += [(block, name, getattr(block, name)) for block in connector.transformer_blocks
                for name in CONNECTOR_UNITS if getattr(block, name, None) is not None]
    return out


def units_of(transformer: nn.Module, connectors=()) -> list[nn.Module]:
    """The modules `shard_transformer` makes FSDP units: the blocks' attentions and feed-forwards (and those of
    the text connectors' blocks, when given)."""
    return [unit for _, _, unit in _slots(transformer, connectors)]


def is_sharded(transformer: nn.Module) -> bool:
    """True when `shard_transformer` sharded this transformer."""
    return getattr(transformer, "_mgpu_sharding", None) is not None


def sharding_of(transformer: nn.Module) -> ShardingReport | None:
    return getattr(transformer, "_mgpu_sharding", None)


def shard_transformer(transformer: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None,
                      connectors: tuple[nn.Module, ...] = ()) -> ShardingReport:
    """Shard the block layers of `transformer` (and of the text `connectors`, which run on every rank too) over the
    ranks of `group` (None: the default group) and move the rest of those modules to `device`; every rank calls it
    (collective), with the modules on any device (e.g. a memory map on the CPU: only this rank's shards and the
    replicated rest reach `device`, one unit's full weights at a time).

    Returns this rank's `ShardingReport`. Raises RuntimeError without an initialized process group, ValueError when
    the transformer is sharded already.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("sharded weights need an initialized process group (a fleet's workers)")
    if is_sharded(transformer):
        raise ValueError("the transformer is sharded already")
    group = group or dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device.type)
    slots = _slots(transformer, connectors)
    units = [unit for _, _, unit in slots]
    unit_bytes = sum(_nbytes(p) for u in units for p in u.parameters())
    largest = max((sum(_nbytes(p) for p in u.parameters()) for u in units), default=0)
    # the replicated rest to the device first, with the units taken out (they never reach it whole)
    for block, name, _ in slots:
        setattr(block, name, nn.Identity())
    try:
        for module in (transformer, *connectors):
            module.to(device)
    finally:
        for block, name, unit in slots:
            setattr(block, name, unit)
    for unit in units:
        # FSDP moves the unit's parameters and buffers to the mesh's device, one unit at a time, and keeps this rank's
        # shard of each parameter (buffers — fp8 / int8 scales — stay whole)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    unit_ids = {id(p) for u in units for p in u.parameters()}
    sharded = sum(_nbytes(_local(p)) for u in units for p in u.parameters())
    rest = sum(_nbytes(p) for m in (transformer, *connectors) for p in m.parameters() if id(p) not in unit_ids)
    rest += sum(_nbytes(b) for m in (transformer, *connectors) for b in m.buffers())
    report = ShardingReport(dist.get_world_size(group), len(units), sharded, unit_bytes, rest, largest)
    transformer._mgpu_sharding = report
    return report


def full_weight(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter gathered from the ranks' shards (a collective over its mesh: every rank calls it for the
    same parameter), or the parameter itself when it is not sharded. The shards travel as bytes, so it is exact for
    every dtype, fp8 and int8 included, on gloo too (whose all-gather has no float8 type)."""
    if not hasattr(param, "to_local"):
        return param
    world, group = param.device_mesh.size(), param.device_mesh.get_group()
    rows, rest = param.shape[0], tuple(param.shape[1:])
    chunk = -(-rows // world)
    local = param.to_local()
    padded = torch.zeros((chunk, *rest), dtype=local.dtype, device=local.device)
    padded[:local.shape[0]].copy_(local)
    mine = padded.reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts).view(local.dtype).reshape(world * chunk, *rest)[:rows]


def local_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The rows of `full` (`[out, …]`, the whole parameter) that this rank's shard of `param` holds: FSDP2 splits
    dim 0 as `torch.chunk` does (the last ranks may hold fewer rows, or none)."""
    local = _local(param)
    if not hasattr(param, "to_local"):
        return full
    rank, world = param.device_mesh.get_local_rank(), param.device_mesh.size()
    chunk = -(-full.shape[0] // world)
    start = min(rank * chunk, full.shape[0])
    return full[start:start + local.shape[0]]


__all__ = ["CONNECTOR_UNITS", "SHARDED_UNITS", "ShardingReport", "WEIGHT_MODES", "full_weight", "is_sharded", "local_rows", "shard_transformer",
           "sharding_of", "units_of"]
