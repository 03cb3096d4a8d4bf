"""The sequence-parallel degree rule, once: a degree W splits the video attention heads over W ranks (Ulysses,
`sequence.py`), so W must divide the heads and be at most the rank count; the largest such W is the fleet's SP
degree unless a policy asks for a smaller one (`FleetPolicy.sp_degree`).

Used by the workers (`plan.build_plan` / `ParallelPlan.for_policy`), by the controller (`controller.check_config`,
from the checkpoint header, and `Fleet.plan_for`, the plan returned in the handle) — no torch.distributed, no
diffusers here.
"""
from __future__ import annotations

from ..protocol.validation import ValidationError


def valid_sp_degrees(heads: int, max_degree: int | None = None) -> list[int]:
    """Degrees W that divide `heads` (powers of two and others), up to `max_degree` (e.g. 32 heads, 6 ranks ->
    [1, 2, 4])."""
    return [w for w in range(1, heads + 1) if heads % w == 0 and (max_degree is None or w <= max_degree)]


def largest_sp_degree(heads: int, devices: int) -> int:
    """The largest W ≤ `devices` that divides `heads` (e.g. 32 heads on 6 GPUs -> 4)."""
    return max(valid_sp_degrees(heads, devices))


def check_sp_degree(heads: int, world_size: int) -> None:
    """Raises ValueError naming the valid counts when `world_size` does not divide the heads."""
    if heads % world_size:
        raise ValueError(f"sequence parallel degree {world_size} does not divide the {heads} attention heads; "
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
    (cost model or `min_tokens_per_rank`, `plan.ParallelPlan.split`)."""
    if sp_degree is not None:
        check_requested_degree(heads, sp_degree, world_size)
        return sp_degree
    return largest_sp_degree(heads, world_size)


def check_sharded_policy(world_size: int, sp_degree: int | None, min_tokens_per_rank: int | None,
                         guidance_parallel: str, heads: int | None = None) -> None:
    """Refuse, by name, a policy a sharded-weights fleet cannot follow (ValidationError, before any work): every
    layer is gathered by all ranks at once, so every forward runs on all ranks — sequence parallel over all of them
    (the world size must divide the heads), never on a sub-group, and guidance passes are not spread over ranks."""
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
