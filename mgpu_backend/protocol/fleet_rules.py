"""The fleet's rules, once: which configurations and policies a fleet can run, as pure functions on frozen values.

Every caller asks here: the controller (`controller.check_config`, from the checkpoint's header facts, before any
worker starts), the worker (`WorkerState`: the int8 path, the memory check, each job's policy), the splits
(`ParallelPlan.for_policy`, `build_plan`, `apply_plan`), the fleet (`Fleet.plan_for`), the CLI
(before a controller is started) and the nodes (Load Checkpoint (MGPU), before a fleet is touched). No rule is
written anywhere else.

The rules:
- degrees and heads: a sequence-parallel degree W splits the video attention heads over W ranks (Ulysses), so W
  must divide the heads and be at most the rank count (`valid_sp_degrees`, `check_requested_degree`,
  `top_sp_degree`);
- sharded weights × the split: every layer is gathered by all ranks at once, so every forward runs on all ranks —
  sequence parallel over all of them, never an SP sub-group, no guidance passes over ranks, tiles a multiple of the
  ranks (`check_sharded_policy`, `check_sharded_tiles`);
- sharded weights × compile: the compiled blocks do not run the gathers (`check_compile`);
- int8 modes: "dequantize" doubles what each GPU holds, so not with sharded weights; "auto" picks a path per rank
  from the sizes (`check_int8_mode`, `resolve_int8_compute`);
- memory: a rank's weights plus one forward's activations must fit its GPU (`WeightBytes`, `check_fits`,
  `ACTIVATION_RESERVE_BYTES`);
- placement: which blocks a rank holds whole and which are sharded, within the fleet's per-GPU budget
  (`place_weights` -> `WeightPlacement`, `sharded_units`, `agreed_budget`).

"sharded weights" in the rules above means any sharded unit: `weights` is "sharded" (every unit, known from the
configuration) or a `WeightPlacement` with `any_sharded` (what "auto" / "placed" resolved to at load: a placement with
no sharded unit is a replicated fleet). Before the load, "auto" and "placed" are not known to shard: the rules that
need it are applied by the workers once they have placed the weights (`serving/worker.py`).

`check_fleet` applies every rule a configuration's values and its checkpoint's heads decide. Each refusal is a
`ValidationError` naming the value and the rule. Standard library only (the nodes import it without torch); the
facts come from the checkpoint header (`models/headers.py`) or the loaded transformer.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ValidationError

# the transformer's weights over the ranks (`FleetIdentity.weights`; `place_weights`, weights/sharding.py): "auto" (the
# default: replicated when a replica fits every GPU's budget, else placed), "replicated", "placed" (whole blocks where
# the budget allows, FSDP-sharded for the rest), "sharded" (every block sharded)
WEIGHT_MODES = ("auto", "replicated", "placed", "sharded")
INT8_COMPUTE_MODES = ("auto", "w8a8", "dequantize")  # how an int8(-convrot) file computes (models/quant.py)
GiB = 2 ** 30

ACTIVATION_RESERVE_BYTES = 3 * GiB
"""Kept free per GPU for one forward beside the weights: what one rank's peak exceeded its resident weights by at
1280×704×121 (stage 2, 7,040 tokens per rank at W = 2: 2.96 GiB; 640×352×121 with a CFG batch of 2: 1.88 GiB), in
bench/results/sharded_h200.txt. Larger sizes need more (a finer split: more ranks)."""

ALLOCATOR_MARGIN_BYTES = 1 * GiB
"""Kept free beside the reserve when weights are placed to fill a budget: the caching allocator's reserved-but-unused
memory and the fragmentation around the gathered blocks (0.65 GiB reserved above allocated at stage 2 on a placed
W = 2 rank under 24 GiB, bench/results/sharded_lora_h100.txt, where a placement made with the 3 GiB reserve alone
peaked at 22.36 GiB of 24)."""

PLACEMENT_RESERVE_BYTES = ACTIVATION_RESERVE_BYTES + ALLOCATOR_MARGIN_BYTES
"""What `place_weights` keeps free per GPU beside the weights and the gathered blocks (one forward + the margin)."""


# ---- the facts the rules read -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint's safetensors header says about its transformer (`models.headers.checkpoint_facts`; no
    weight read).

    path: the file. family: the model family's name ("2.0", "2.3", "2.5"). heads: the video attention heads.
    blocks: the transformer blocks. fp8_layers / int8_layers: Linear weights stored as float8 / int8 (a count).
    transformer_bytes: the transformer's and text connectors' tensors as stored (bytes).
    """

    path: str
    family: str
    heads: int
    blocks: int
    fp8_layers: int = 0
    int8_layers: int = 0
    transformer_bytes: int = 0


@dataclass(frozen=True)
class WeightBytes:
    """The bytes a rank holds of a model's files, as the loader keeps them (floating tensors in the compute dtype,
    fp8 / int8 weights and their scales as stored; `models.loader.weight_bytes`, header reads only): `blocks`
    (transformer and text-connector blocks: the units that can be sharded) and `rest` (everything else: held whole
    by every rank).

    block_units: the bytes of each transformer block, in block order (`transformer_blocks.0`, `.1`, …).
    connector_units: the bytes of each text-connector block, the video connector's then the audio connector's.
    Together, in that order, they are the FSDP units of `weights.sharding.units_of` (unit index i = position i);
    () when not known (then only `per_rank` works, not `place_weights`). Raises ValueError when units are given and
    do not sum to `blocks`, or a size is negative.
    """

    blocks: int
    rest: int
    block_units: tuple[int, ...] = ()
    connector_units: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if min((self.blocks, self.rest, *self.units), default=0) < 0:
            raise ValueError(f"WeightBytes: negative size in blocks={self.blocks}, rest={self.rest}, units "
                             f"{self.units}")
        if self.units and sum(self.units) != self.blocks:
            raise ValueError(f"WeightBytes: the units sum to {sum(self.units)} bytes, blocks={self.blocks}")

    @property
    def units(self) -> tuple[int, ...]:
        """Every unit's bytes in unit order: the transformer blocks, then the connectors' blocks."""
        return self.block_units + self.connector_units

    def per_rank(self, weights: str, world_size: int) -> int:
        """Bytes one rank holds under `weights` over `world_size` ranks: "sharded" 1/W of the blocks (rounded up) +
        the rest; any other mode a whole replica (the most "auto" / "placed" can hold: `place_weights` says what they
        do hold)."""
        if weights == "sharded":
            return -(-self.blocks // world_size) + self.rest
        return self.blocks + self.rest


@dataclass(frozen=True)
class WeightPlacement:
    """Which FSDP units (transformer blocks, then text-connector blocks: `weights.sharding.units_of`) every rank holds
    whole and which are sharded over the ranks, with what that costs per rank (`place_weights`; bytes).

    requested: the mode asked for (`FleetIdentity.weights`: "auto", "replicated", "placed" or "sharded").
    world_size: ranks the sharded units are sharded over (all of the fleet's).
    units: how many units the model has; block_units: how many of them are transformer blocks (units 0 …
        block_units − 1; the rest are the connectors' blocks, which run once per text encoding, not per forward).
    sharded: the sharded units' indices, ascending (() = a replica on every rank).
    budget_bytes: the per-GPU budget it was chosen in (the fleet's smallest, `agreed_budget`); None = unbounded.
    reserve_bytes: kept free beside the weights for one forward's activations.
    resident_bytes: weights one rank holds between forwards: the rest, the whole units, and ⌈u / W⌉ of each sharded
        unit u (FSDP2 splits dim 0 of every parameter; scales stay whole: a few KiB per block more).
    gathered_bytes: bytes one rank receives per transformer forward: u − ⌊u / W⌋ of each sharded transformer block
        (the all-gathers; connector units gather once per text encoding instead).
    transient_bytes: gathered units held whole at once beside the shards: the largest sharded unit, twice when two
        or more are sharded (the running one and the next, prefetched by `weights.sharding.gathered`).
    """

    requested: str
    world_size: int
    units: int
    block_units: int
    sharded: tuple[int, ...]
    budget_bytes: int | None
    reserve_bytes: int
    resident_bytes: int
    gathered_bytes: int
    transient_bytes: int

    @property
    def any_sharded(self) -> bool:
        """Some unit is sharded: the fleet's sharded rules apply (lockstep forwards, no compile, no int8
        dequantize, tiles a multiple of W)."""
        return bool(self.sharded)

    @property
    def replicated_units(self) -> int:
        return self.units - len(self.sharded)

    @property
    def mode(self) -> str:
        """What the placement is: "replicated" (no unit sharded), "sharded" (every unit) or "placed" (a mix)."""
        if not self.sharded:
            return "replicated"
        return "sharded" if len(self.sharded) == self.units else "placed"

    @property
    def need_bytes(self) -> int:
        """What the budget must hold: resident + transient gathered units + the activation reserve."""
        return self.resident_bytes + self.transient_bytes + self.reserve_bytes

    def gather_seconds(self, gbps: float) -> float:
        """Seconds one rank spends per transformer forward receiving `gathered_bytes` over a link of `gbps` GB/s
        (bus bandwidth, e.g. `resources.LINKS_GBPS`), if not hidden behind compute."""
        return self.gathered_bytes / (gbps * 1e9)

    def describe(self) -> str:
        """One line for the load report, e.g. "placed: 40 of 52 units replicated, 12 sharded over 2 ranks; resident
        15.20 GiB; gathers 2.71 GB per forward (budget 21.00 GiB per GPU, auto)"."""
        head = (f"{self.mode}: {self.replicated_units} of {self.units} units replicated, {len(self.sharded)} sharded"
                + (f" over {self.world_size} ranks" if self.sharded else ""))
        budget = "unbounded budget" if self.budget_bytes is None else \
            f"budget {self.budget_bytes / GiB:.2f} GiB per GPU"
        asked = f", weights={self.requested!r}" if self.requested != self.mode else ""
        return (f"{head}; resident {self.resident_bytes / GiB:.2f} GiB; gathers {self.gathered_bytes / 1e9:.2f} GB "
                f"per forward ({budget}{asked})")


# ---- degrees and heads ------------------------------------------------------------------------------------------


def valid_sp_degrees(heads: int, max_degree: int | None = None) -> list[int]:
    """Degrees W that divide `heads` (powers of two and others), up to `max_degree` (e.g. 32 heads, 6 ranks ->
    [1, 2, 4])."""
    return [w for w in range(1, heads + 1) if heads % w == 0 and (max_degree is None or w <= max_degree)]


def largest_sp_degree(heads: int, devices: int) -> int:
    """The largest W ≤ `devices` that divides `heads` (e.g. 32 heads on 6 GPUs -> 4)."""
    return max(valid_sp_degrees(heads, devices))


def check_sp_degree(heads: int, world_size: int) -> None:
    """A group of `world_size` ranks splits the heads evenly. Raises ValidationError naming the valid degrees."""
    if heads % world_size:
        raise ValidationError(f"sequence parallel degree {world_size} does not divide the {heads} attention heads; "
                              f"valid degrees: {', '.join(map(str, valid_sp_degrees(heads)))}")


def check_requested_degree(heads: int, degree: int, world_size: int) -> None:
    """An explicitly requested SP degree must divide the heads and fit the fleet (raises ValidationError naming the
    valid degrees)."""
    valid = valid_sp_degrees(heads, world_size)
    if degree not in valid:
        raise ValidationError(f"sequence parallel degree {degree} is not possible with {heads} attention heads on "
                              f"{world_size} rank(s): the degree must divide the heads and be at most the rank "
                              f"count; valid degrees: {', '.join(map(str, valid))}")


def top_sp_degree(heads: int, world_size: int, sp_degree: int | None = None) -> int:
    """The largest degree a stage may use under a policy: `sp_degree` when given (checked by
    `check_requested_degree`), else `largest_sp_degree(heads, world_size)`. Per stage, a smaller one may still run
    (cost model or `min_tokens_per_rank`, `splits.plan.ParallelPlan.split`)."""
    if sp_degree is not None:
        check_requested_degree(heads, sp_degree, world_size)
        return sp_degree
    return largest_sp_degree(heads, world_size)


# ---- sharded weights × the split, × compile ---------------------------------------------------------------------


def check_sharded_policy(world_size: int, sp_degree: int | None, min_tokens_per_rank: int | None,
                         guidance_parallel: str, heads: int | None = None) -> None:
    """Refuse, by name, a policy a sharded-weights fleet cannot follow (ValidationError, before any work): every
    layer is gathered by all ranks at once, so every forward runs on all ranks — sequence parallel over all of them
    (the world size must divide the heads; `heads` None: not checked), never on a sub-group, and guidance passes are
    not spread over ranks."""
    if heads is not None and heads % world_size:
        raise ValidationError(f"sharded weights over {world_size} ranks: every forward runs sequence parallel over "
                              f"all ranks, so the world size must divide the transformer's {heads} attention heads "
                              f"(use {', '.join(str(d) for d in range(2, heads + 1) if heads % d == 0 and d <= 8)} "
                              f"ranks, or replicated weights)")
    if sp_degree is not None and sp_degree != world_size:
        raise ValidationError(f"sp_degree={sp_degree} with sharded weights: every forward runs on all {world_size} "
                              f"ranks (each layer is gathered by all of them); leave sp_degree unset")
    if min_tokens_per_rank:
        raise ValidationError(f"min_tokens_per_rank={min_tokens_per_rank} with sharded weights: every forward runs "
                              f"on all ranks; leave it unset (or 0)")
    if guidance_parallel == "on":
        raise ValidationError("guidance_parallel='on' with sharded weights: the ranks run every guidance pass "
                              "together (each layer is gathered by all of them); use 'auto' or 'off'")


def check_sharded_tiles(tiles: int, world_size: int) -> None:
    """A tiled stage on a sharded-weights fleet: every rank runs the same number of tile forwards in lockstep (each
    layer is gathered by all ranks at once), so the tile count is a multiple of the ranks. Raises ValidationError."""
    if tiles % world_size:
        raise ValidationError(
            f"{tiles} tiles over {world_size} ranks: with sharded weights every rank runs the same number of tile "
            f"forwards (each layer is gathered by all ranks at once), so the tile count must be a multiple of "
            f"{world_size}; choose tiles such as 1x{world_size}")


def shards(weights) -> bool:
    """`weights` shards some unit: the mode "sharded", or a `WeightPlacement` with a sharded unit (what "auto" /
    "placed" resolved to at load). "auto" and "placed" themselves: not known before the load (False)."""
    if isinstance(weights, WeightPlacement):
        return weights.any_sharded
    return weights == "sharded"


def weights_named(weights) -> str:
    """`weights` as the refusals name it: "weights='sharded'", or for a placement "weights='auto' (12 of 52 units
    sharded)"."""
    if isinstance(weights, WeightPlacement):
        return f"weights={weights.requested!r} ({len(weights.sharded)} of {weights.units} units sharded)"
    return f"weights={weights!r}"


def check_compile(weights, compile: bool) -> None:
    """compile=True needs replicated weights: with sharded weights (`shards`: the mode "sharded" or a placement with
    a sharded unit) the blocks' layers are gathered over the ranks as they run (FSDP hooks), which compiled blocks do
    not run. Raises ValidationError."""
    if compile and shards(weights):
        raise ValidationError(f"compile=True with {weights_named(weights)}: the blocks' layers are gathered over the "
                              f"ranks as they run (FSDP hooks), which the compiled blocks do not run; use replicated "
                              f"weights to compile" + (" (GPUs or a gpu_budget_gib that hold a replica)"
                                                       if isinstance(weights, WeightPlacement) else ""))


# ---- int8 modes -------------------------------------------------------------------------------------------------


def check_int8_mode(weights, int8_compute: str) -> None:
    """`int8_compute` is one of `INT8_COMPUTE_MODES`, and "dequantize" is not asked of sharded weights (`shards`: the
    memory mode keeps the int8 weights: dequantizing doubles what each GPU holds). Raises ValidationError."""
    if int8_compute not in INT8_COMPUTE_MODES:
        raise ValidationError(f"int8_compute={int8_compute!r}: choose one of {', '.join(INT8_COMPUTE_MODES)}")
    if int8_compute == "dequantize" and shards(weights):
        raise ValidationError(f"int8_compute='dequantize' with {weights_named(weights)}: the memory mode keeps the "
                              f"int8 weights (dequantizing doubles what each GPU holds); use weights='replicated', "
                              f"or int8_compute='w8a8' / 'auto'")


def check_int8_file(int8_compute: str, facts: CheckpointFacts) -> None:
    """An explicit int8 path ("w8a8" / "dequantize") applies only to a transformer file with int8 layers
    (`facts.int8_layers`, from its header: `models.headers.checkpoint_facts`); on any other file it would be ignored,
    so it is refused by name, before any worker starts ("auto" fits every file). Raises ValidationError naming the
    switch, the file and what its header holds."""
    if int8_compute != "auto" and facts.int8_layers == 0:
        stored = f"{facts.fp8_layers} fp8 Linear layers" if facts.fp8_layers else "bf16 / fp32 weights"
        raise ValidationError(f"int8_compute={int8_compute!r}: {facts.path} has no int8 layers (its header: "
                              f"{stored}, 0 int8), so the switch cannot apply to it; leave int8_compute at 'auto', "
                              f"or load an int8(-convrot) file")


def resolve_int8_compute(mode: str, *, device_type: str, weights: str, int8_bytes: int, dequantized_bytes: int,
                         free_bytes: int | None, reserve_bytes: int = 0) -> tuple[str, str]:
    """The int8 path a rank takes for the fleet option `int8_compute`: `("w8a8" | "dequantize", why)`.

    Args:
        mode: "auto", "w8a8" or "dequantize" (`INT8_COMPUTE_MODES`).
        device_type: "cuda" or "cpu" (the rank's device).
        weights: `FleetIdentity.weights` ("auto" / "placed": dequantized only when a whole replica fits, so that
            nothing is sharded) or a `WeightPlacement`.
        int8_bytes / dequantized_bytes: what this rank would hold (bytes) with the int8 weights resident / dequantized
            to the compute dtype (`WeightBytes.per_rank` of `models.loader.weight_bytes(..., int8_dequantized=...)`).
        free_bytes: the GPU's budget for the weights (bytes: the fleet's `agreed_budget`); None on CPU without a
            budget (host memory is not probed: no check).
        reserve_bytes: kept free for one forward beside the weights (`ACTIVATION_RESERVE_BYTES`).
    Rules: "w8a8" always; "dequantize" with sharded weights is refused (`check_int8_mode`), on CUDA refused when
    `dequantized_bytes + reserve_bytes > free_bytes` (ValidationError naming the sizes); "auto": sharded -> "w8a8";
    CPU -> "w8a8" (ComfyUI's result, what the CPU tests compare with; no CPU speed table); CUDA -> "dequantize" when
    it fits (W8A8 measured slower than bf16 in 7 of 8 layer shapes on the H200, bench/results/int8_h200.txt), else
    "w8a8".
    """
    check_int8_mode(weights, mode)
    sizes = (f"the weights need {dequantized_bytes / GiB:.1f} GiB dequantized (+ {reserve_bytes / GiB:.0f} GiB for "
             f"one forward) against {int8_bytes / GiB:.1f} GiB as int8")
    free = "" if free_bytes is None else f"{free_bytes / GiB:.1f} GiB free"
    fits = free_bytes is None or dequantized_bytes + reserve_bytes <= free_bytes
    if mode == "w8a8":
        return "w8a8", "int8_compute='w8a8'"
    if mode == "dequantize":
        if not fits:
            raise ValidationError(f"int8_compute='dequantize': {free} on this GPU, {sizes}; use int8_compute='auto' "
                                  f"or 'w8a8' (int8 resident), or free the GPU")
        return "dequantize", "int8_compute='dequantize'" + (f": {sizes}, {free}" if free else "")
    if shards(weights):
        return "w8a8", "auto: sharded weights keep int8 resident"
    if device_type != "cuda":
        return "w8a8", "auto: on CPU, ComfyUI's result"
    if not fits:
        return "w8a8", f"auto: not dequantized, {sizes}, {free}"
    return "dequantize", (f"auto: W8A8 measured slower than bf16 on the H200 (bench/results/int8_h200.txt); {sizes}, "
                          f"{free}")


# ---- memory -----------------------------------------------------------------------------------------------------


def check_fits(device: str, free_bytes: int, sizes: WeightBytes, weights: str, world_size: int,
               reserve: int = ACTIVATION_RESERVE_BYTES) -> None:
    """Refuse (ValidationError) a fleet whose rank on `device` would not fit its `free_bytes`: its weights
    (`sizes.per_rank(weights, world_size)`: "replicated" or "sharded") plus `reserve` for one forward. The message
    gives the figure needed and the modes that would fit. The workers place their weights with `place_weights`
    (every mode, per unit, in the fleet's smallest budget); this is the whole-model check without per-unit sizes."""
    need = sizes.per_rank(weights, world_size) + reserve
    if need <= free_bytes:
        return
    fits = [f"sharded over {w} GPUs ({(sizes.per_rank('sharded', w) + reserve) / GiB:.1f} GiB per GPU)"
            for w in (2, 4, 8) if sizes.per_rank("sharded", w) + reserve <= free_bytes]
    if sizes.per_rank("replicated", 1) + reserve <= free_bytes:
        fits.insert(0, "replicated weights")
    what = f"{weights} weights" + (f" over {world_size} GPUs" if weights == "sharded" else "")
    raise ValidationError(
        f"{device} has {free_bytes / GiB:.1f} GiB free; this fleet needs {need / GiB:.1f} GiB on each GPU ({what}: "
        f"{sizes.per_rank(weights, world_size) / GiB:.1f} GiB of weights + {reserve / GiB:.0f} GiB for one "
        f"forward). Would fit: {'; '.join(fits) if fits else 'none of replicated or sharded over 2, 4 or 8 GPUs'}"
        f" (also: free the GPU, or use an fp8 / int8 file)")


# ---- placement: which units a rank holds whole ------------------------------------------------------------------


def agreed_budget(budgets) -> int | None:
    """The budget every rank places the weights in: the smallest of the ranks' `budgets` (bytes; None = unbounded,
    e.g. a CPU rank without `gpu_budget_gib`); None when all are unbounded. The sharded units' all-gathers are
    collectives over all ranks, so every rank must shard the same units: they all place in the smallest budget (on a
    fleet, one all_reduce MIN: `weights.sharding.agree_budget`). A larger card's extra memory then holds no weights;
    it stays free for activations."""
    known = [int(b) for b in budgets if b is not None]
    return min(known) if known else None


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` of the positions 0 … `total` − 1 spread evenly: the middle of each of `count` equal segments,
    ⌊(2i + 1) · total / (2 · count)⌋ for i < count (distinct, ascending: consecutive values differ by
    total / count ≥ 1). E.g. 3 of 12 -> (2, 6, 10); all of them -> (0, 1, …). Raises ValueError unless 0 ≤ count ≤ total."""
    if not 0 <= count <= total:
        raise ValueError(f"spread: count={count} must be between 0 and total={total}")
    return tuple((2 * i + 1) * total // (2 * count) for i in range(count))


def sharded_units(count: int, block_units: int, connector_units: int) -> tuple[int, ...]:
    """The `count` units a placement shards (unit order: `block_units` transformer blocks, then `connector_units`
    connector blocks), ascending: the connectors' blocks first — they run once per text encoding, so a sharded one
    costs one gather per prompt, not one per forward — then transformer blocks spread evenly through the block order
    (`spread`), so that each sharded block has whole blocks before it whose compute hides its gather
    (`weights.sharding.gathered` starts the next sharded block's gather as the current one runs). Raises ValueError
    unless 0 ≤ count ≤ block_units + connector_units."""
    if not 0 <= count <= block_units + connector_units:
        raise ValueError(f"sharded_units: count={count} must be between 0 and the {block_units + connector_units} "
                         f"units")
    connectors = min(count, connector_units)
    return spread(count - connectors, block_units) + tuple(range(block_units, block_units + connectors))


def placement_of(sizes: WeightBytes, world_size: int, sharded, budget_bytes: int | None = None,
                 reserve_bytes: int = PLACEMENT_RESERVE_BYTES, requested: str = "placed") -> WeightPlacement:
    """The `WeightPlacement` that shards the units `sharded` (indices into `sizes.units`) over `world_size` ranks and
    holds the others whole, with its bytes per rank (formulas in `WeightPlacement`'s docstring). Does not check the
    budget (`place_weights` does). Raises ValueError for an index out of range or repeated, per-unit sizes unknown,
    or world_size < 1."""
    units = sizes.units
    if not units and sizes.blocks:
        raise ValueError("placement: the per-unit sizes are unknown (WeightBytes without block_units / "
                         "connector_units; models.loader.weight_bytes gives them)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"placement: world_size={world_size!r} must be a positive integer")
    chosen = tuple(sorted(sharded))
    if len(set(chosen)) != len(chosen) or any(not 0 <= i < len(units) for i in chosen):
        raise ValueError(f"placement: sharded units {chosen} must be distinct indices of the {len(units)} units")
    whole = set(range(len(units))) - set(chosen)
    resident = sizes.rest + sum(units[i] for i in whole) + sum(-(-units[i] // world_size) for i in chosen)
    gathered = sum(units[i] - units[i] // world_size for i in chosen if i < len(sizes.block_units))
    transient = max((units[i] for i in chosen), default=0) * min(2, len(chosen))
    return WeightPlacement(requested=requested, world_size=world_size, units=len(units),
                           block_units=len(sizes.block_units), sharded=chosen, budget_bytes=budget_bytes,
                           reserve_bytes=reserve_bytes, resident_bytes=resident, gathered_bytes=gathered,
                           transient_bytes=transient)


def place_weights(sizes: WeightBytes, world_size: int, budget_bytes: int | None, weights: str = "auto",
                  reserve_bytes: int = PLACEMENT_RESERVE_BYTES, budget_from: str = "") -> WeightPlacement:
    """Where the weights go on every rank of a fleet of `world_size` ranks, each GPU given `budget_bytes` (the
    fleet's smallest, `agreed_budget`; None: unbounded) for its weights, the gathered blocks and `reserve_bytes` of
    one forward's activations.

    weights (`WEIGHT_MODES`): "replicated" -> no unit sharded; "sharded" -> every unit; "placed" and "auto" (the
    same rule: "auto" is the default's name) -> the fewest sharded units k (k = 0: replicated) whose placement fits,
    the units `sharded_units(k, …)`: the most blocks that fit stay whole, i.e. with B the block bytes, N units and
    the rest R, k is the least with R + (N − k)·B + k·⌈B / W⌉ + min(2, k)·B + reserve ≤ budget (per unit sizes,
    exactly: `placement_of`).

    Raises ValidationError (before any weight is loaded) when the placement of "replicated" / "sharded", or every
    placement of "placed" / "auto" (even every unit sharded), needs more than the budget: naming the budget
    (`budget_from` says where it came from), the need and what would fit. ValueError for a mode outside
    `WEIGHT_MODES` or unknown per-unit sizes."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights={weights!r}: choose one of {', '.join(WEIGHT_MODES)}")
    blocks, connectors = len(sizes.block_units), len(sizes.connector_units)
    n = blocks + connectors

    def at(count: int, ranks: int = world_size) -> WeightPlacement:
        return placement_of(sizes, ranks, sharded_units(count, blocks, connectors), budget_bytes, reserve_bytes,
                            weights)

    def fits(p: WeightPlacement) -> bool:
        return budget_bytes is None or p.need_bytes <= budget_bytes

    counts = {"replicated": (0,), "sharded": (n,)}.get(weights, range(n + 1))
    tried = []
    for count in counts:
        p = at(count)
        if fits(p):
            return p
        tried.append(p)
    best = min(tried, key=lambda p: p.need_bytes)
    what = {"replicated": "replicated weights", "sharded": f"weights sharded over {world_size} GPU(s)"}.get(
        weights, f"weights={weights!r} (its smallest need: {len(best.sharded)} of {n} units sharded over {world_size} GPU(s))")
    would = []
    if weights in ("replicated", "sharded"):
        other = next((p for p in (at(k) for k in range(n + 1)) if fits(p)), None)
        if other is not None:
            would.append(f"weights='placed' ({other.replicated_units} of {n} units replicated, "
                         f"{other.need_bytes / GiB:.1f} GiB per GPU)")
    would += [f"sharded over {w} GPUs ({at(n, w).need_bytes / GiB:.1f} GiB per GPU)" for w in (2, 4, 8)
              if w > world_size and fits(at(n, w))]
    source = f" ({budget_from})" if budget_from else ""
    raise ValidationError(
        f"a budget of {budget_bytes / GiB:.1f} GiB per GPU{source} cannot hold {what}: that needs "
        f"{best.need_bytes / GiB:.1f} GiB ({best.resident_bytes / GiB:.1f} GiB of weights resident + "
        f"{best.transient_bytes / GiB:.1f} GiB of gathered blocks + {best.reserve_bytes / GiB:.1f} GiB kept free "
        f"for one forward). Would fit: {'; '.join(would) if would else 'nothing on this fleet'} (also: free the GPU, "
        f"raise gpu_budget_gib, or use an fp8 / int8 file)")


# ---- a whole configuration --------------------------------------------------------------------------------------


def check_policy(weights, world_size: int, policy, heads: int | None = None,
                 sequence_parallel: bool = True) -> None:
    """The rules a job's `FleetPolicy` meets on a fleet of `world_size` ranks holding `weights` (a mode of
    `WEIGHT_MODES`, or the `WeightPlacement` the workers resolved it to) of a transformer with `heads` attention
    heads (None: the rules that need them are skipped): compile × sharded (`check_compile`), an explicit SP degree
    (`check_requested_degree`), sharded × the split (`check_sharded_policy`; its heads rule only with a parallel
    plan, `sequence_parallel`) — the sharded rules whenever some unit is sharded (`shards`). Raises
    ValidationError."""
    check_compile(weights, policy.compile)
    if heads is not None and policy.sp_degree is not None:
        check_requested_degree(heads, policy.sp_degree, world_size)
    if shards(weights):
        check_sharded_policy(world_size, policy.sp_degree, policy.min_tokens_per_rank, policy.guidance_parallel,
                             heads if sequence_parallel else None)


def check_fleet(identity, policy, heads: int | None = None, facts: CheckpointFacts | None = None) -> None:
    """Every rule a configuration's values decide — a `FleetIdentity` and a `FleetPolicy` (protocol.fleet_config; not
    imported here: fleet_config imports this module) and, when known, the checkpoint's `heads`
    (`CheckpointFacts.heads`) or its header's `facts` (heads from them when `heads` is None): the int8 mode
    (`check_int8_mode`; with `facts`, `check_int8_file`: an explicit int8 path needs int8 layers) and the policy's
    rules (`check_policy`). What needs the GPU's memory (`place_weights`, `resolve_int8_compute`) is decided by the
    ranks at load; so are the sharded rules for "auto" / "placed", which shard only when a replica does not fit.
    Raises ValidationError naming the value and the rule."""
    check_int8_mode(identity.weights, identity.int8_compute)
    if facts is not None:
        check_int8_file(identity.int8_compute, facts)
        heads = facts.heads if heads is None else heads
    check_policy(identity.weights, identity.world_size, policy, heads, identity.sequence_parallel)


__all__ = ["ACTIVATION_RESERVE_BYTES", "ALLOCATOR_MARGIN_BYTES", "PLACEMENT_RESERVE_BYTES", "CheckpointFacts", "GiB", "INT8_COMPUTE_MODES", "WEIGHT_MODES", "WeightBytes",
           "WeightPlacement", "agreed_budget", "check_compile", "check_fits", "check_fleet", "check_int8_file", "check_int8_mode",
           "check_policy", "check_requested_degree", "check_sharded_policy", "check_sharded_tiles", "check_sp_degree",
           "largest_sp_degree", "place_weights", "placement_of", "resolve_int8_compute", "sharded_units", "shards",
           "spread", "top_sp_degree", "valid_sp_degrees", "weights_named"]
