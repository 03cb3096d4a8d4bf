"""Sharded weights (the fleet's memory mode): the transformer's blocks sharded over the ranks with FSDP2.

`FleetIdentity.weights = "sharded"` makes every rank hold 1/W of every transformer block and text-connector block
(`torch.distributed.fsdp.fully_shard`, one FSDP unit per block, dim 0 of every parameter split over the ranks).
Before a block runs, FSDP all-gathers its full weights on every rank; after it, the gathered copy is freed
(`reshard_after_forward=True`). So:

- **Faithful**: the forward computes with the very same weights as one process (an all-gather copies bytes), so a
  sharded forward equals the replicated forward bit for bit on the same rank layout — sequence parallel or not. It
  composes with Ulysses sequence parallelism on the same ranks (weights sharded over all W, tokens split over all W:
  "ZeRO-3 + Ulysses"), which needs no 2-D mesh.
- **Any dtype**: bf16 / fp32 parameters, fp8 (e4m3fn / e5m2) and int8 weights stay in their dtype in the shards
  (FSDP2 all-gathers a unit whose parameters mix dtypes as bytes). int8 weights are held as float8_e4m3fn views of
  the same bytes (`_bytes_as_float`: FSDP2 up to torch 2.11 creates every sharded parameter with requires_grad=True,
  which integer tensors refuse — pytorch#177844); `Int8Linear.int8_weight` views them back, no value converted.
  Per-tensor and per-row scales are buffers and stay whole, as do the embeddings, the projections in and out and the AdaLN embedders outside the blocks (~4 % of the
  22B transformer). The text connectors' blocks are sharded too: they run on every rank.
- **Lockstep**: every rank must run every block in the same order (each gather is a collective). Hence the plan of a
  sharded fleet (`protocol.fleet_rules.check_sharded_policy`): every forward runs sequence parallel over all ranks, never on a
  sub-group; guidance passes or batch rows are not spread over ranks; a tiled stage needs a tile count that is a
  multiple of W (every rank runs the same number of tile forwards). CUDA graphs and `torch.compile` are off (the
  per-block gathers are not captured). A block loop that calls a block's submodules itself (the native forward's
  ComfyUI block order) iterates `gathered(blocks)`, which starts the next block's gather before this block computes;
`block(...)` (diffusers' forward: the stage jobs) gathers through FSDP's hooks, one block at a time (each block is an
FSDP root of its own, and FSDP 2.11's hook prefetch across roots fails before their lazy init).

Why FSDP and not tensor parallel (DTensor `ColwiseParallel` / `RowwiseParallel`): FSDP moves the weights (≈ the
model size × (W−1)/W per forward, whatever the token count) and changes no arithmetic; tensor parallel moves
activations (2 all-reduces per attention and feed-forward, ∝ tokens) and changes the reduction order of every
row-split layer and of the q/k RMSNorm across heads. Per forward of one rank at W = 2 (22B fp8,
bench/results/sharded_h200.txt): stage 1 at 640×352×121 (CFG batch 2) FSDP 11.3 GB vs tensor parallel 11.1 GB;
stage 2 at 1280×704×121 11.3 GB vs 22.1 GB. Tensor parallel never moves clearly less, so FSDP is the one mode.

Memory per rank (`ShardingReport`): the shards (≈ 1/W of the blocks) + the replicated rest + two gathered blocks
at a time (the running one and the next, ≈ 0.45 GiB each for the 22B fp8 file).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..protocol.fleet_rules import WEIGHT_MODES  # "replicated" | "sharded": `FleetIdentity.weights` (re-exported)


@dataclass(frozen=True)
class ShardingReport:
    """What one rank holds after `shard_transformer` (bytes of parameters and buffers, this rank's memory).

    world_size: ranks the units are sharded over.
    units: FSDP units (one per transformer block and per text-connector block).
    sharded_bytes: this rank's shards of the units (≈ 1/W of `unit_bytes`, rounded up per parameter).
    unit_bytes: the units' full size (what one replica holds of them).
    replicated_bytes: the rest of the transformer, held whole by every rank.
    largest_unit_bytes: the largest block, gathered whole while it runs (two at a time: the running one and the
        next).
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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_dtensor(t: torch.Tensor) -> bool:
    """A parameter sharded over ranks (a DTensor of FSDP)."""
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a parameter: its local shard when sharded, else the parameter itself."""
    return t.to_local() if is_dtensor(t) else t


def units_of(transformer: nn.Module, connectors=()) -> list[nn.Module]:
    """The modules `shard_transformer` makes FSDP units: the transformer's blocks (and the text connectors' blocks,
    when given), in call order."""
    return [*transformer.transformer_blocks, *(b for c in connectors for b in c.transformer_blocks)]


def gathered(blocks) -> Iterator[nn.Module]:
    """Iterate `blocks` for a block loop that calls a block's submodules directly (not `block(...)`, whose FSDP hooks
    gather it): each sharded block is yielded with its weights gathered, the next block's gather already under way
    (overlapping this block's compute), and resharded once the loop moves on. Unsharded blocks pass through."""
    from torch.distributed.fsdp import FSDPModule

    blocks = list(blocks)
    pending = None
    for i, block in enumerate(blocks):
        if not isinstance(block, FSDPModule):
            yield block
            continue
        handle = pending if pending is not None else block.unshard(async_op=True)
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        pending = nxt.unshard(async_op=True) if isinstance(nxt, FSDPModule) else None
        if handle is not None:
            handle.wait()
        try:
            yield block
        finally:
            block.reshard()


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
    units = units_of(transformer, connectors)
    unit_bytes = sum(_nbytes(p) for u in units for p in u.parameters())
    largest = max((sum(_nbytes(p) for p in u.parameters()) for u in units), default=0)
    # the replicated rest to the device first, with the blocks taken out (they never reach it whole)
    lists = [transformer.transformer_blocks, *(c.transformer_blocks for c in connectors)]
    saved = [list(blocks) for blocks in lists]
    for blocks in lists:
        for i in range(len(blocks)):
            blocks[i] = nn.Identity()
    try:
        for module in (transformer, *connectors):
            module.to(device)
    finally:
        for blocks, originals in zip(lists, saved):
            for i, block in enumerate(originals):
                blocks[i] = block
    for unit in units:
        _bytes_as_float(unit)
        # FSDP moves the block's parameters and buffers to the mesh's device, one block at a time, and keeps this
        # rank's shard of each parameter (buffers — fp8 / int8 scales — stay whole)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    unit_ids = {id(p) for u in units for p in u.parameters()}
    sharded = sum(_nbytes(local_shard(p)) for u in units for p in u.parameters())
    rest = sum(_nbytes(p) for m in (transformer, *connectors) for p in m.parameters() if id(p) not in unit_ids)
    rest += sum(_nbytes(b) for m in (transformer, *connectors) for b in m.buffers())
    report = ShardingReport(dist.get_world_size(group), len(units), sharded, unit_bytes, rest, largest)
    transformer._mgpu_sharding = report
    return report


#: the 1-byte floating dtype integer weights are viewed as while sharded (see the module docstring)
BYTES_AS_FLOAT = torch.float8_e4m3fn


def _bytes_as_float(unit: nn.Module) -> None:
    """Replace every int8 parameter of `unit` by a float8_e4m3fn view of the same bytes (frozen), so that FSDP2 of
    any torch version can shard it: torch ≤ 2.11 builds each sharded parameter as `nn.Parameter(t)`, which raises
    "only Tensors of floating point dtype can require gradients" for integer tensors (pytorch#177844). The layer
    (`models.quant.Int8Linear`) views its weight back to int8 wherever it reads it."""
    for module in unit.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.int8:
                setattr(module, name, nn.Parameter(param.data.view(BYTES_AS_FLOAT), requires_grad=False))


def full_weight(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter gathered from the ranks' shards (a collective over its mesh: every rank calls it for the
    same parameter), or the parameter itself when it is not sharded. The shards travel as bytes, so it is exact for
    every dtype, fp8 and int8 included, on gloo too (whose all-gather has no float8 type)."""
    if not is_dtensor(param):
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
    local = local_shard(param)
    if not is_dtensor(param):
        return full
    rank, world = param.device_mesh.get_local_rank(), param.device_mesh.size()
    chunk = -(-full.shape[0] // world)
    start = min(rank * chunk, full.shape[0])
    return full[start:start + local.shape[0]]


__all__ = ["ShardingReport", "WEIGHT_MODES", "full_weight", "gathered", "is_dtensor", "is_sharded", "local_shard", "local_rows", "shard_transformer",
           "sharding_of", "units_of"]
