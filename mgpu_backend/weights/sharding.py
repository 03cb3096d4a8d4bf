"""Sharded and placed weights (the fleet's memory modes): the transformer's blocks sharded over the ranks with FSDP2.

`FleetIdentity.weights = "sharded"` makes every rank hold 1/W of every transformer block and text-connector block
(`torch.distributed.fsdp.fully_shard`, one FSDP unit per block, dim 0 of every parameter split over the ranks).
"placed" (and "auto" when a replica does not fit) shards only some of those units and moves the others to the
device whole: the units of a `protocol.fleet_rules.WeightPlacement` (`place_weights`: the fewest sharded units that
fit the fleet's per-GPU budget — the connectors' blocks first, then transformer blocks spread evenly through the
block order). Before a sharded block runs, FSDP all-gathers its full weights on every rank; after it, the gathered
copy is freed (`reshard_after_forward=True`). So:

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
  ComfyUI block order) iterates `gathered(blocks)`, which starts the next sharded block's gather as soon as the
  current one runs — with placed weights that gather overlaps the whole blocks in between; the engine's block loop
  (`engine/forward.py`) uses it on every path. FSDP's own hooks would gather one block at a time (each block is an
  FSDP root of its own, and FSDP 2.11's hook prefetch across roots fails before their lazy init).
- **Placed = partly sharded**: a placement with any sharded unit follows every rule above (lockstep, no CUDA graphs
  or compile, no int8 dequantize); one with none is a replicated fleet (`is_sharded` False).

Budgets (`rank_budget`, `agree_budget`): a rank's budget is its GPU's free memory at load, or
`FleetIdentity.gpu_budget_gib` (on CUDA made a hard cap with `torch.cuda.set_per_process_memory_fraction`); CPU ranks
without one are unbounded. Every rank must shard the same units (each gather is a collective over all ranks), so
the ranks take the smallest budget of the fleet (one all_reduce MIN, before any weight is placed): on mixed cards
the larger card's extra memory holds no more weights than the smaller card's; it stays free for activations.

Why FSDP and not tensor parallel (DTensor `ColwiseParallel` / `RowwiseParallel`): FSDP moves the weights (≈ the
model size × (W−1)/W per forward, whatever the token count) and changes no arithmetic; tensor parallel moves
activations (2 all-reduces per attention and feed-forward, ∝ tokens) and changes the reduction order of every
row-split layer and of the q/k RMSNorm across heads. Per forward of one rank at W = 2 (22B fp8,
bench/results/sharded_h200.txt): stage 1 at 640×352×121 (CFG batch 2) FSDP 11.3 GB vs tensor parallel 11.1 GB;
stage 2 at 1280×704×121 11.3 GB vs 22.1 GB. Tensor parallel never moves clearly less, so FSDP is the one mode.

Memory per rank (`ShardingReport`): the shards (≈ 1/W of the sharded blocks) + the whole blocks + the replicated
rest + two gathered blocks at a time (the running one and the next sharded one, ≈ 0.45 GiB each for the 22B fp8
file).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..protocol.fleet_rules import GiB, WEIGHT_MODES, WeightPlacement, agreed_budget  # WEIGHT_MODES re-exported


@dataclass(frozen=True)
class ShardingReport:
    """What one rank holds after `shard_transformer` (bytes of parameters and buffers, this rank's memory).

    world_size: ranks the sharded units are sharded over.
    units: FSDP-able units (one per transformer block and per text-connector block), sharded or whole.
    sharded_bytes: this rank's shards of the sharded units (≈ 1/W of their bytes, rounded up per parameter).
    unit_bytes: the units' full size, sharded and whole (what one replica holds of them).
    replicated_bytes: the rest of the transformer (and connectors), held whole by every rank.
    largest_unit_bytes: the largest sharded unit, gathered whole while it runs (two at a time: the running one and
        the next sharded one); 0 when none is sharded.
    replicated_units: how many units are held whole (not sharded); whole_unit_bytes: their bytes.
    gathered_bytes: what this rank receives per transformer forward: each sharded transformer block's bytes less
        this rank's shard (the connectors' units gather once per text encoding, not per forward).
    placement: the `WeightPlacement` it followed (None: every unit sharded, no placement given).
    """

    world_size: int
    units: int
    sharded_bytes: int
    unit_bytes: int
    replicated_bytes: int
    largest_unit_bytes: int
    replicated_units: int = 0
    whole_unit_bytes: int = 0
    gathered_bytes: int = 0
    placement: WeightPlacement | None = field(default=None, compare=False)

    @property
    def sharded_units(self) -> int:
        return self.units - self.replicated_units

    @property
    def resident_bytes(self) -> int:
        """Weights resident on this rank between forwards."""
        return self.sharded_bytes + self.whole_unit_bytes + self.replicated_bytes

    @property
    def replica_bytes(self) -> int:
        """What one rank would hold with replicated weights."""
        return self.unit_bytes + self.replicated_bytes

    def describe(self) -> str:
        """The load report's line, e.g. "weights placed: 40 of 52 units replicated, 12 sharded over 2 ranks; resident
        15.20 GiB (a replica: 21.85 GiB); gathers 2.71 GB per forward (budget 21.00 GiB per GPU, the fleet's
        smallest)"."""
        p = self.placement
        mode = ("replicated" if not self.sharded_units else "sharded" if not self.replicated_units else "placed")
        head = (f"weights {mode}: {self.replicated_units} of {self.units} units replicated, {self.sharded_units} "
                f"sharded" + (f" over {self.world_size} ranks" if self.sharded_units else ""))
        tail = []
        if p is not None:
            tail.append("unbounded budget" if p.budget_bytes is None else
                        f"budget {p.budget_bytes / GiB:.2f} GiB per GPU, the fleet's smallest")
            if p.requested != mode:
                tail.append(f"weights={p.requested!r}")
        return (f"{head}; resident {self.resident_bytes / GiB:.2f} GiB (a replica: {self.replica_bytes / GiB:.2f} "
                f"GiB); gathers {self.gathered_bytes / 1e9:.2f} GB per forward"
                + (f" ({', '.join(tail)})" if tail else ""))


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
    """Iterate `blocks` for a block loop, each sharded block (an FSDP unit) yielded with its weights gathered and
    resharded once the loop moves on; whole blocks pass through. The gathers run ahead: the first sharded block's
    starts before the loop's first block, and each next sharded block's as soon as the current sharded one is
    yielded, so it overlaps this block's compute and that of the whole blocks in between (placed weights). At most
    two gathered blocks are held at a time (the running one and the next). Every rank must iterate the same blocks
    to the end (each gather is a collective)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = list(blocks)
    sharded = [i for i, block in enumerate(blocks) if isinstance(block, FSDPModule)]
    following = dict(zip(sharded, sharded[1:]))
    pending = {sharded[0]: blocks[sharded[0]].unshard(async_op=True)} if sharded else {}
    for i, block in enumerate(blocks):
        if i not in pending:
            yield block
            continue
        handle = pending.pop(i)
        nxt = following.get(i)
        if nxt is not None:
            pending[nxt] = blocks[nxt].unshard(async_op=True)
        if handle is not None:
            handle.wait()
        try:
            yield block
        finally:
            block.reshard()


def is_sharded(transformer: nn.Module) -> bool:
    """True when `shard_transformer` sharded some unit of this transformer (a placement with none: False)."""
    report = getattr(transformer, "_mgpu_sharding", None)
    return report is not None and report.sharded_units > 0


def sharding_of(transformer: nn.Module) -> ShardingReport | None:
    return getattr(transformer, "_mgpu_sharding", None)


def shard_transformer(transformer: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None,
                      connectors: tuple[nn.Module, ...] = (), placement: WeightPlacement | None = None
                      ) -> ShardingReport:
    """Shard the units of `transformer` (its blocks, and the text `connectors`' blocks, which run on every rank too:
    `units_of`) over the ranks of `group` (None: the default group) and move the rest of those modules to `device`;
    every rank calls it (collective) with the same `placement`, with the modules on any device (e.g. a memory map on
    the CPU: only this rank's shards and the whole modules reach `device`, one sharded unit's full weights at a time).

    placement: which units to shard (`WeightPlacement.sharded`, indices into `units_of`; the others move to `device`
    whole); None: every unit. A placement with no sharded unit only moves the modules (no process group needed).

    Returns this rank's `ShardingReport`, also kept on the transformer (`sharding_of`). Raises RuntimeError when a
    unit is to be sharded without an initialized process group; ValueError when the transformer is sharded already,
    or the placement's unit count or world size differs from the model's / the group's.
    """
    if is_sharded(transformer):
        raise ValueError("the transformer is sharded already")
    units = units_of(transformer, connectors)
    if placement is not None and placement.units != len(units):
        raise ValueError(f"the placement has {placement.units} units, the model {len(units)} (transformer blocks and "
                         f"connector blocks: units_of)")
    chosen = set(range(len(units))) if placement is None else set(placement.sharded)
    if chosen and not dist.is_initialized():
        raise RuntimeError("sharded weights need an initialized process group (a fleet's workers)")
    group = (group or dist.group.WORLD) if chosen else None
    world = dist.get_world_size(group) if chosen else (placement.world_size if placement is not None else 1)
    if placement is not None and chosen and placement.world_size != world:
        raise ValueError(f"the placement shards over {placement.world_size} ranks, the group has {world}")
    unit_sizes = [sum(_nbytes(p) for p in u.parameters()) for u in units]
    # the whole modules to the device first, with the sharded blocks taken out (they never reach it whole)
    lists = [transformer.transformer_blocks, *(c.transformer_blocks for c in connectors)]
    saved = [list(blocks) for blocks in lists]
    index = 0
    for blocks in lists:
        for i in range(len(blocks)):
            if index in chosen:
                blocks[i] = nn.Identity()
            index += 1
    try:
        for module in (transformer, *connectors):
            module.to(device)
    finally:
        for blocks, originals in zip(lists, saved):
            for i, block in enumerate(originals):
                blocks[i] = block
    if chosen:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        for i in sorted(chosen):
            _bytes_as_float(units[i])
            # FSDP moves the block's parameters and buffers to the mesh's device, one block at a time, and keeps this
            # rank's shard of each parameter (buffers — fp8 / int8 scales — stay whole)
            fully_shard(units[i], mesh=mesh, reshard_after_forward=True)
    unit_ids = {id(p) for u in units for p in u.parameters()}
    sharded = sum(_nbytes(local_shard(p)) for i in chosen for p in units[i].parameters())
    whole = sum(unit_sizes[i] for i in range(len(units)) if i not in chosen)
    rest = sum(_nbytes(p) for m in (transformer, *connectors) for p in m.parameters() if id(p) not in unit_ids)
    rest += sum(_nbytes(b) for m in (transformer, *connectors) for b in m.buffers())
    blocks = len(transformer.transformer_blocks)
    gathered_bytes = sum(unit_sizes[i] - sum(_nbytes(local_shard(p)) for p in units[i].parameters())
                         for i in chosen if i < blocks)
    report = ShardingReport(world, len(units), sharded, sum(unit_sizes), rest,
                            max((unit_sizes[i] for i in chosen), default=0), replicated_units=len(units) - len(chosen),
                            whole_unit_bytes=whole, gathered_bytes=gathered_bytes, placement=placement)
    transformer._mgpu_sharding = report
    return report


def rank_budget(device: torch.device, gpu_budget_gib: float | None) -> int | None:
    """This rank's budget (bytes) for the transformer's weights and one forward (`FleetIdentity.gpu_budget_gib`):

    - CUDA: the GPU's free memory now (`torch.cuda.mem_get_info`), or `gpu_budget_gib` when it is less; a given
      budget is also made a hard cap on this process's allocations (`torch.cuda.set_per_process_memory_fraction`,
      budget / the GPU's total), so a large card can stand for a small one;
    - CPU: `gpu_budget_gib` (tests; nothing is capped), None = unbounded.
    """
    cap = None if gpu_budget_gib is None else int(gpu_budget_gib * GiB)
    if device.type != "cuda":
        return cap
    free, total = torch.cuda.mem_get_info(device)
    if cap is None:
        return int(free)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return min(cap, int(free))


_UNBOUNDED = 2 ** 62  # an unbounded budget in the all_reduce (no GPU holds 4 EiB)


def agree_budget(budget: int | None, device: torch.device, group: dist.ProcessGroup | None = None) -> int | None:
    """The fleet's budget: the smallest of every rank's `budget` (`protocol.fleet_rules.agreed_budget`; None =
    unbounded), by one all_reduce MIN over `group` (None: the default group) — a collective, every rank calls it
    before placing any weight. Without an initialized process group (one process): `budget` itself."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return agreed_budget([budget])
    value = torch.tensor([_UNBOUNDED if budget is None else int(budget)], dtype=torch.int64,
                         device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    agreed = int(value.item())
    return None if agreed >= _UNBOUNDED else agreed


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


__all__ = ["ShardingReport", "WEIGHT_MODES", "agree_budget", "full_weight", "gathered", "is_dtensor", "is_sharded",
           "local_shard", "local_rows", "rank_budget", "shard_transformer", "sharding_of", "units_of"]
