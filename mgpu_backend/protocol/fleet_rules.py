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
  `ACTIVATION_RESERVE_BYTES`).

`check_fleet` applies every rule a configuration's values and its checkpoint's heads decide. Each refusal is a
`ValidationError` naming the value and the rule. Standard library only (the nodes import it without torch); the
facts come from the checkpoint header (`models/headers.py`) or the loaded transformer.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ValidationError

WEIGHT_MODES = ("replicated", "sharded")  # the transformer's weights over the ranks (weights/sharding.py)
INT8_COMPUTE_MODES = ("auto", "w8a8", "dequantize")  # how an int8(-convrot) file computes (models/quant.py)
GiB = 2 ** 30

ACTIVATION_RESERVE_BYTES = 3 * GiB
"""Kept free per GPU for one forward beside the weights: what one rank's peak exceeded its resident weights by at
1280×704×121 (stage 2, 7,040 tokens per rank at W = 2: 2.96 GiB; 640×352×121 with a CFG batch of 2: 1.88 GiB), in
bench/results/sharded_h200.txt. Larger sizes need more (a finer split: more ranks)."""


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
    fp8 / int8 weights and their scales as stored; `models.headers.weight_bytes`): `blocks` (transformer and
    text-connector blocks: sharded in the memory mode) and `rest` (everything else: held whole by every rank)."""

    blocks: int
    rest: int

    def per_rank(self, weights: str, world_size: int) -> int:
        """Bytes one rank holds under `weights` ("replicated" | "sharded") over `world_size` ranks."""
        if weights == "sharded":
            return -(-self.blocks // world_size) + self.rest
        return self.blocks + self.rest


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


def check_compile(weights: str, compile: bool) -> None:
    """compile=True needs replicated weights: with sharded weights the blocks' layers are gathered over the ranks
    as they run (FSDP hooks), which compiled blocks do not run. Raises ValidationError."""
    if compile and weights == "sharded":
        raise ValidationError("compile=True with weights='sharded': the blocks' layers are gathered over the ranks "
                              "as they run (FSDP hooks), which the compiled blocks do not run; use replicated "
                              "weights to compile")


# ---- int8 modes -------------------------------------------------------------------------------------------------


def check_int8_mode(weights: str, int8_compute: str) -> None:
    """`int8_compute` is one of `INT8_COMPUTE_MODES`, and "dequantize" is not asked of sharded weights (the memory
    mode keeps the int8 weights: dequantizing doubles what each GPU holds). Raises ValidationError."""
    if int8_compute not in INT8_COMPUTE_MODES:
        raise ValidationError(f"int8_compute={int8_compute!r}: choose one of {', '.join(INT8_COMPUTE_MODES)}")
    if int8_compute == "dequantize" and weights == "sharded":
        raise ValidationError("int8_compute='dequantize' with weights='sharded': the memory mode keeps the int8 "
                              "weights (dequantizing doubles what each GPU holds); use weights='replicated', or "
                              "int8_compute='w8a8' / 'auto'")


def resolve_int8_compute(mode: str, *, device_type: str, weights: str, int8_bytes: int, dequantized_bytes: int,
                         free_bytes: int | None, reserve_bytes: int = 0) -> tuple[str, str]:
    """The int8 path a rank takes for the fleet option `int8_compute`: `("w8a8" | "dequantize", why)`.

    Args:
        mode: "auto", "w8a8" or "dequantize" (`INT8_COMPUTE_MODES`).
        device_type: "cuda" or "cpu" (the rank's device).
        weights: "replicated" or "sharded" (`FleetIdentity.weights`).
        int8_bytes / dequantized_bytes: what this rank would hold (bytes) with the int8 weights resident / dequantized
            to the compute dtype (`WeightBytes.per_rank` of `models.headers.weight_bytes(..., int8_dequantized=...)`).
        free_bytes: the GPU's free memory (bytes); None on CPU (host memory is not probed: no check).
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
    if weights == "sharded":
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
    """Refuse (ValidationError, before any weight is loaded) a fleet whose rank on `device` would not fit its
    `free_bytes`: its weights (`sizes.per_rank(weights, world_size)`) plus `reserve` for one forward. The message
    gives the figure needed and the modes that would fit."""
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


# ---- a whole configuration --------------------------------------------------------------------------------------


def check_policy(weights: str, world_size: int, policy, heads: int | None = None,
                 sequence_parallel: bool = True) -> None:
    """The rules a job's `FleetPolicy` meets on a fleet of `world_size` ranks holding `weights` ("replicated" |
    "sharded") of a transformer with `heads` attention heads (None: the rules that need them are skipped):
    compile × sharded (`check_compile`), an explicit SP degree (`check_requested_degree`), sharded × the split
    (`check_sharded_policy`; its heads rule only with a parallel plan, `sequence_parallel`). Raises
    ValidationError."""
    check_compile(weights, policy.compile)
    if heads is not None and policy.sp_degree is not None:
        check_requested_degree(heads, policy.sp_degree, world_size)
    if weights == "sharded":
        check_sharded_policy(world_size, policy.sp_degree, policy.min_tokens_per_rank, policy.guidance_parallel,
                             heads if sequence_parallel else None)


def check_fleet(identity, policy, heads: int | None = None) -> None:
    """Every rule a configuration's values decide — a `FleetIdentity` and a `FleetPolicy` (protocol.fleet_config; not
    imported here: fleet_config imports this module) and, when known, the checkpoint's `heads`
    (`CheckpointFacts.heads`): the int8 mode (`check_int8_mode`) and the policy's rules (`check_policy`). What
    needs the GPU's free memory (`check_fits`, `resolve_int8_compute`) is decided by each rank. Raises
    ValidationError naming the value and the rule."""
    check_int8_mode(identity.weights, identity.int8_compute)
    check_policy(identity.weights, identity.world_size, policy, heads, identity.sequence_parallel)


__all__ = ["ACTIVATION_RESERVE_BYTES", "CheckpointFacts", "GiB", "INT8_COMPUTE_MODES", "WEIGHT_MODES", "WeightBytes",
           "check_compile", "check_fits", "check_fleet", "check_int8_mode", "check_policy", "check_requested_degree",
           "check_sharded_policy", "check_sharded_tiles", "check_sp_degree", "largest_sp_degree",
           "resolve_int8_compute", "top_sp_degree", "valid_sp_degrees"]
