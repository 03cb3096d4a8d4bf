"""How one job is split over a fleet: the sequence-parallel group and the hand-over to the other ranks.

SP runs on the largest valid subset of the fleet (W must divide the video heads): on 6 GPUs with 32 heads, SP uses
ranks 0–3 as a sub-group and says so in the job report; ranks 4–5 skip the SP stages and receive the result by
broadcast from rank 0, so the stages that use every device (tiled stage 2, decode, Gemma) still can.

Per stage, the SP degree is chosen so the split pays: on CUDA the cost model (`cost.py`, fitted to H200
measurements) picks the degree with the lowest predicted forward time — fewer ranks, or one, when the video tokens
per rank are too few to beat one GPU — and the stage's `PlanReport` says which degree ran and why. An explicit
`min_tokens_per_rank` replaces the model by the rule "at least that many video tokens per rank" (0: always the full
degree, the default on CPU fleets).

A guided stage may instead run its guidance passes in parallel (`passes.py`, xDiT's "CFG parallel"): pass j of each
step on rank j % g, the x0 predictions broadcast within ranks 0..g-1 — on CUDA when the cost model predicts it faster
than the stage's SP choice (`FleetConfig.guidance_parallel`: "auto", "on", "off"); `split` decides per stage and
`describe(report)` says which ran.

Three objects, apart: `PlanGroups` (the process groups and their sequence splits, `UlyssesSplit`, built once per
fleet by `build_plan`, kept by the worker), `ParallelPlan` (those groups under one job's `PlanPolicy`: a frozen
value made per job by `ParallelPlan.for_policy` / `with_policy`, never changed in place) and `PlanReport` (how one
stage was split, returned by `split` inside its `StageRun`). The per-rank token cap travels with the `StageRun`'s
split to each forward; the shared splits hold no policy. The cap is the policy's fixed number, or with "auto"
(`AUTO_TOKEN_CAP`, issue 35) the activation plan's per degree (`ParallelPlan.cap_at`: `protocol/memory_plan.py`
on this rank's `MemoryBudget`, measured by `build_plan` on CUDA); `check` refuses a job above it before any work,
naming the longest clip that fits at the job's size and the ranks that would hold it. How a stage's branches run (sequence parallel or spread
over ranks) is asked through `dispatch.py`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist

from ..protocol.fleet_config import FleetPolicy
from ..protocol.job_results import RankReport
from ..protocol.memory_plan import ActivationShape, MemoryBudget, token_cap as planned_token_cap
from ..protocol.validation import ValidationError
from .cost import CostModel, ModelShape, best_sp_degree, choice_reason, default_model
from .decode import decode_tiles
from ..protocol.fleet_rules import (check_requested_degree, check_sharded_policy, check_sharded_tiles, top_sp_degree,
                                    valid_sp_degrees)
from .exchange import Exchange
from .passes import MAX_PASSES, SplitChoices, StageSplit, StageWork, check_mode, choose_split
from ..engine.forward import Split
from .sequence import UlyssesSplit, check_token_cap
from .tiled import TiledSplit
from .tiling import TileCountConfig

DEFAULT_TOKEN_CAP = 65536  # video tokens per rank per forward (≈ 241 frames at 1920×1088 on 2 ranks)
AUTO_TOKEN_CAP = "auto"
"""A policy's `token_cap` asking for the memory plan's cap (`protocol/memory_plan.py`): per degree, the largest
tokens per rank whose planned forward fits the rank's memory (`PlanGroups.memory`, measured by `build_plan` on
CUDA); `DEFAULT_TOKEN_CAP` where no budget is known (CPU fleets)."""
DEFAULT_BUILD_POLICY = FleetPolicy(min_tokens_per_rank=0, token_cap=DEFAULT_TOKEN_CAP)
"""`build_plan`'s policy when none is given: every stage at the full degree (tests, tools; a fleet passes its own)."""


@dataclass(frozen=True)
class SPStage:
    """The sequence-parallel group one stage runs on: ranks 0..degree-1."""

    degree: int
    group: dist.ProcessGroup | None
    forward: Split | None  # None on ranks outside the group, and for degree 1


@dataclass(frozen=True)
class PlanGroups:
    """The process groups of one fleet, built once on every rank by `build_plan` (creating a group is collective):
    what any policy may choose among. Frozen: a policy never creates or drops a group.

    stages: SP degree -> `SPStage` (ranks 0..d-1; this rank's `UlyssesSplit` when it is in the group).
    pass_groups: guidance-pass group size g -> ranks 0..g-1 (None: the whole fleet).
    heads / model_shape: the transformer's attention heads (the SP degree must divide them) and shape (cost model).
    built: False for a plan made by hand (`ParallelPlan.hand_built`): no other policy can be applied to it.
    sharded: the weights are sharded over all ranks (`weights/sharding.py`): every forward runs on all of them.
    memory: this rank's memory for a forward (`memory_plan.MemoryBudget`, `memory_budget` at build time; None: not
    known, e.g. CPU): what an "auto" token cap is planned from.
    """

    rank: int
    world_size: int
    device: torch.device
    stages: Mapping[int, SPStage]
    pass_groups: Mapping[int, dist.ProcessGroup | None]
    heads: int | None = None
    model_shape: ModelShape | None = None
    built: bool = True
    sharded: bool = False  # the transformer's weights are sharded over all ranks (sharding.py): lockstep forwards
    memory: MemoryBudget | None = None

    @property
    def comm_device(self) -> torch.device:
        """Where collectives' buffers live: the rank's CUDA device (NCCL) or the CPU (gloo)."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class PlanPolicy:
    """A `FleetPolicy` (protocol) applied to a fleet's groups (`ParallelPlan.for_policy`, per job): which groups a
    stage may use and how its split is chosen. Frozen: a job with another policy gets another plan.

    sp_degree: the largest SP degree a stage may use; stage_degrees / pass_degrees: the SP degrees and guidance-pass
    group sizes a stage may pick among; token_cap: video tokens per rank per forward; min_tokens_per_rank: the rule
    "at least that many video tokens per rank" (0: the full degree) when no cost model is set; cost_model / shape:
    the cost model that picks a stage's split (CUDA) and the transformer's shape for it; guidance_parallel: "auto" |
    "on" | "off" (`passes.py`); requested_sp_degree: the policy's explicit `sp_degree` (None: the largest allowed);
    memory: with `token_cap` None, the budget the per-rank cap is planned from at each degree (`ParallelPlan.cap_at`;
    None: `token_cap` alone, None meaning no cap).
    """

    sp_degree: int
    stage_degrees: tuple[int, ...] = ()
    pass_degrees: tuple[int, ...] = ()
    token_cap: int | None = DEFAULT_TOKEN_CAP
    min_tokens_per_rank: int = 0
    cost_model: CostModel | None = None
    shape: ModelShape | None = None
    guidance_parallel: str = "off"
    requested_sp_degree: int | None = None
    memory: MemoryBudget | None = None


@dataclass(frozen=True)
class PlanReport:
    """How one stage run through a plan was split (`StageRun.report`; `ParallelPlan.describe(report)` words it for
    the job report): the SP degree, why (None: nothing to say), and the guidance-pass split when the passes ran in
    parallel (None: sequence parallel)."""

    degree: int | None = None
    reason: str | None = None
    split: StageSplit | None = None


@dataclass(frozen=True)
class StageRun:
    """What one stage runs on (`ParallelPlan.split`): `split.kind` "sequence" (SP over ranks 0..degree-1 with
    `forward`) or "passes" (the guidance passes spread over ranks 0..degree-1, plain forwards); `group` holds those
    ranks (None: the whole fleet); `report` says which split ran and why; `token_cap`: the job's per-rank video
    token cap, checked by each SP forward of the stage (`UlyssesSplit.shard`; None: no cap); `forward`: the
    `UlyssesSplit` of the SP group, carrying that cap (None: not sequence parallel on this rank)."""

    split: StageSplit
    group: dist.ProcessGroup | None
    forward: Split | None
    report: PlanReport = PlanReport()
    token_cap: int | None = DEFAULT_TOKEN_CAP

    @property
    def degree(self) -> int:
        return self.split.degree

    @property
    def kind(self) -> str:
        return self.split.kind


@dataclass(frozen=True, eq=False)
class ParallelPlan:
    """The split of one job over a fleet, a frozen value: the fleet's groups (`PlanGroups`, built once by
    `build_plan` on every rank, kept by the worker) under the job's policy (`PlanPolicy`). A job with another policy
    gets another plan (`for_policy` / `with_policy`, no collective); nothing here changes in place. `split` chooses a
    stage's split once (the cost model) and hands it down as a `StageRun` carrying its `PlanReport`."""

    groups: PlanGroups
    policy: PlanPolicy

    @classmethod
    def hand_built(cls, rank: int, world_size: int, device: torch.device, policy: PlanPolicy,
                   stages: Mapping[int, SPStage] | None = None, pass_groups: Mapping | None = None,
                   heads: int | None = None) -> ParallelPlan:
        """A plan without `build_plan` (tests, tools): the SP `stages` given (default: one of `policy.sp_degree`
        without a group or split) and the guidance-pass groups given, under `policy` fixed (`with_policy` raises);
        the policy's stage and pass degrees are those of `stages` and `pass_groups`."""
        sp_degree = policy.sp_degree
        every = {**(stages or {})}
        every.setdefault(sp_degree, SPStage(sp_degree, None, None))
        groups = PlanGroups(rank, world_size, device, MappingProxyType(every),
                            MappingProxyType(dict(pass_groups or {})), heads, None, built=False)
        allowed = tuple(stages) if stages else (sp_degree,)
        return cls(groups, dataclasses.replace(policy, stage_degrees=allowed, pass_degrees=tuple(pass_groups or {})))

    @classmethod
    def for_policy(cls, groups: PlanGroups, sp_degree: int | None = None, min_tokens_per_rank: int | None = 0,
                   guidance_parallel: str = "auto", token_cap: int | str | None = DEFAULT_TOKEN_CAP) -> ParallelPlan:
        """The plan of `groups` (from `build_plan`) under a parallel policy (`FleetPolicy`'s fields; see
        `build_plan`), on every rank with the same values, per job: a new `PlanPolicy` choosing among the groups
        `build_plan` built, so no collective runs and nothing is reloaded. `token_cap`: an int, None (no cap) or
        "auto" (`AUTO_TOKEN_CAP`: the memory plan's cap per degree from `groups.memory`, `DEFAULT_TOKEN_CAP` without
        one). Raises ValidationError (a degree the heads or the fleet do not allow, a token cap that is none of
        those), ValueError (an unknown guidance-parallel mode) or RuntimeError (hand-built groups)."""
        check_mode(guidance_parallel)
        memory = None
        if token_cap == AUTO_TOKEN_CAP:
            memory = groups.memory
            token_cap = None if memory is not None else DEFAULT_TOKEN_CAP
        elif token_cap is not None and (isinstance(token_cap, bool) or not isinstance(token_cap, int)
                                        or token_cap < 1):
            raise ValidationError(f"token_cap={token_cap!r}: must be a positive number of video tokens per rank, "
                                  f"None (no cap) or {AUTO_TOKEN_CAP!r} (the memory plan's)")
        if not groups.built:
            raise RuntimeError("a policy needs the groups of build_plan (a hand-built plan's policy is fixed)")
        if groups.sharded:
            check_sharded_policy(groups.world_size, sp_degree, min_tokens_per_rank, guidance_parallel)
        heads = groups.heads or 1
        degree = top_sp_degree(heads, groups.world_size, sp_degree)  # raises for a degree the heads do not allow
        cost_model = None
        if min_tokens_per_rank is None:
            cost_model = (default_model() if groups.device.type == "cuda" and not groups.sharded
                          else None)  # the graphed forward's
            min_tokens_per_rank = 0
        stage_degrees = tuple(d for d in groups.stages
                              if d <= degree and (d == degree or min_tokens_per_rank > 0 or cost_model is not None))
        use_passes = not groups.sharded and (
            guidance_parallel == "on" or (guidance_parallel == "auto" and groups.device.type == "cuda"))
        pass_degrees = tuple(groups.pass_groups) if use_passes else ()
        shape = groups.model_shape if cost_model is not None or pass_degrees else None
        return cls(groups, PlanPolicy(degree, stage_degrees, pass_degrees, token_cap, min_tokens_per_rank,
                                      cost_model, shape, guidance_parallel, sp_degree, memory))

    def with_policy(self, policy) -> ParallelPlan:
        """This plan's groups under a job's `FleetPolicy` (protocol.fleet_config): a new plan (`for_policy`) from the
        policy's fields that split the stages. A policy field the plan reads is passed on here (and nowhere else: the
        worker hands the policy over whole). This plan is unchanged."""
        return self.for_policy(self.groups, sp_degree=policy.sp_degree, min_tokens_per_rank=policy.min_tokens_per_rank,
                               guidance_parallel=policy.guidance_parallel, token_cap=policy.token_cap)

    # ---- read-only views (the groups, the policy) ----
    rank = property(lambda self: self.groups.rank)
    world_size = property(lambda self: self.groups.world_size)
    device = property(lambda self: self.groups.device)
    heads = property(lambda self: self.groups.heads)
    model_shape = property(lambda self: self.groups.model_shape)
    all_stages = property(lambda self: dict(self.groups.stages) if self.groups.built else None)
    all_pass_groups = property(lambda self: dict(self.groups.pass_groups) if self.groups.built else None)
    sp_degree = property(lambda self: self.policy.sp_degree)
    token_cap = property(lambda self: self.cap_at(self.policy.sp_degree))  # the cap at the plan's SP degree
    min_tokens_per_rank = property(lambda self: self.policy.min_tokens_per_rank)
    cost_model = property(lambda self: self.policy.cost_model)
    shape = property(lambda self: self.policy.shape)
    guidance_parallel = property(lambda self: self.policy.guidance_parallel)
    requested_sp_degree = property(lambda self: self.policy.requested_sp_degree)
    sharded = property(lambda self: self.groups.sharded)

    def cap_at(self, degree: int) -> int | None:
        """The job's per-rank video token cap for a forward over `degree` ranks: the policy's fixed `token_cap`, or,
        with a memory budget (`PlanPolicy.memory`, an "auto" cap), the largest tokens per rank whose planned
        forward fits it at that degree (`memory_plan.token_cap`; the attention and the gathered video→audio keys
        grow with the total tokens, so the cap differs per degree). None: no cap."""
        if self.policy.memory is None or self.policy.token_cap is not None:
            return self.policy.token_cap
        return _planned_cap(self.policy.memory, degree)

    @property
    def stages(self) -> dict[int, SPStage]:
        """The SP stages the policy allows (degree -> stage)."""
        return {d: self.groups.stages[d] for d in self.policy.stage_degrees}

    @property
    def pass_groups(self) -> dict[int, dist.ProcessGroup | None]:
        """The guidance-pass groups the policy allows (size -> group)."""
        return {g: self.groups.pass_groups[g] for g in self.policy.pass_degrees}

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return self.groups.stages[self.policy.sp_degree].group

    @property
    def sp_forward(self) -> Split | None:
        return self.groups.stages[self.policy.sp_degree].forward

    def choose(self, tokens: int) -> PlanReport:
        """The SP degree for a forward of `tokens` video tokens, and why (`PlanReport` without a pass split).

        With a cost model: the degree with the lowest predicted forward time among the allowed stages (1 when no
        split is predicted to beat one GPU). Otherwise the largest degree that keeps at least `min_tokens_per_rank`
        video tokens per rank; the full degree when no minimum is set."""
        stages = self.stages
        if self.cost_model is not None:
            shape = self.shape or ModelShape()
            degree = best_sp_degree(tokens, [d for d in stages], shape, self.cost_model)
            degree = degree if degree in stages else min(stages)
            return PlanReport(degree, choice_reason(tokens, degree, list(stages), shape, self.cost_model))
        fits = [d for d in stages if d == 1 or tokens >= d * self.min_tokens_per_rank]
        degree = max(fits) if fits else min(stages)
        return PlanReport(degree, f"fewer than {self.min_tokens_per_rank} video tokens per rank would not pay"
                          if degree < self.sp_degree else None)

    def stage(self, tokens: int) -> SPStage:
        """The SP stage for a forward of `tokens` video tokens (`choose`'s degree)."""
        return self.stages[self.choose(tokens).degree]

    def split(self, stage: str, tokens: int, passes: int, pass_bytes: float = 0.0) -> StageRun:
        """How a stage of `tokens` video tokens and `passes` guidance passes per step runs: SP at `choose(tokens)`'s
        degree, or the passes in parallel (`passes.choose_split`: by `guidance_parallel`, on CUDA with the cost
        model's predictions — this plan's, or cost.py's default when `min_tokens_per_rank` replaced it).
        `pass_bytes`: one pass's outputs (the per-step exchange). The same decision on every rank; the returned
        `StageRun` carries its `PlanReport` and the job's token cap."""
        sp_choice = self.choose(tokens)
        sp = self.stages[sp_choice.degree]
        model = self.cost_model
        if model is None and self.device.type == "cuda":
            model = default_model()
        choice = choose_split(StageWork(stage, tokens, passes, pass_bytes),
                              SplitChoices(self.guidance_parallel, self.world_size, sp.degree,
                                           tuple(self.pass_groups or {}), model, self.shape or ModelShape(),
                                           self.cap_at(1)))  # a spread pass holds all the tokens on one rank
        if choice.kind == "passes":
            report = PlanReport(sp_choice.degree, sp_choice.reason, choice)
            return StageRun(choice, self.pass_groups[choice.degree], None, report, self.cap_at(1))
        reason = sp_choice.reason
        if choice.reason:
            reason = f"{reason}; {choice.reason}" if reason else choice.reason
        cap = self.cap_at(sp.degree)
        forward = None if sp.forward is None else dataclasses.replace(sp.forward, token_cap=cap)
        return StageRun(choice, sp.group, forward, PlanReport(sp_choice.degree, reason), cap)

    @property
    def in_sp_group(self) -> bool:
        return self.rank < self.sp_degree

    def check(self, tokens: int, frame_tokens: int | None = None, size: str | None = None) -> None:
        """Before any work: the per-rank token cap of the largest SP stage (raises ValidationError). The refusal
        names, with `frame_tokens` (latent tokens per latent frame of the checked stage) and `size` (the job's
        "width×height"), the longest clip that fits, and the fewest ranks that would hold the asked clip among the
        degrees the heads allow (`sequence.check_token_cap`)."""
        degrees = valid_sp_degrees(self.heads) if self.heads else None
        try:
            check_token_cap(tokens, self.sp_degree, self.token_cap, frame_tokens, size, degrees, self.cap_at)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def announce(self, stage: str, failure: BaseException | None, degree: int,
                 who: str = "sequence-parallel ranks") -> None:
        """After an SP (or guidance-parallel) stage on a sub-group: rank 0 tells every rank whether it finished, was
        cancelled or failed, so the ranks outside the group stop too instead of waiting in `share`'s broadcast.
        Re-raises `failure` on the group's ranks; raises SamplingCancelled / RuntimeError on the others (`who`
        names the group in their message)."""
        from ..engine.sampling import SamplingCancelled

        if degree != self.world_size:
            status = torch.tensor([0 if failure is None else 1 if isinstance(failure, SamplingCancelled) else 2],
                                  dtype=torch.int32, device=self.groups.comm_device)
            dist.broadcast(status, src=0)
            code = int(status.item())
            if failure is None and code == 1:
                raise SamplingCancelled(f"{stage} cancelled on the {who}")
            if failure is None and code == 2:
                raise RuntimeError(f"{stage} failed on the {who} (rank 0 reports the cause)")
        if failure is not None:
            raise failure

    def share(self, video: torch.Tensor | None, audio: torch.Tensor | None, video_shape, audio_shape,
              degree: int | None = None):
        """After an SP stage: ranks outside its group receive rank 0's latents (no-op when SP spans the fleet)."""
        if (degree or self.sp_degree) == self.world_size:
            return video, audio
        out = []
        for x, shape in ((video, video_shape), (audio, audio_shape)):
            buf = (x if x is not None else torch.empty(shape, dtype=torch.float32)).to(self.groups.comm_device)
            dist.broadcast(buf, src=0)
            out.append(buf.cpu())
        return out[0], out[1]

    def tiled(self, transformer, grid: tuple[int, int, int], tiling: TileCountConfig) -> TiledSplit:
        """A TDP split over every rank of the fleet (the default group). With sharded weights the tile count must
        be a multiple of the ranks (raises ValidationError before any work): each rank runs the same number of tile
        forwards, in lockstep."""
        tiled = TiledSplit(transformer, grid, tiling, None, self.world_size, self.rank)
        if self.sharded:
            check_sharded_tiles(len(tiled.tiles), self.world_size)
        return tiled

    def decode(self, vae, latent: torch.Tensor, tiling: TileCountConfig, temb=None):
        """Distributed decode over every rank; pixels on rank 0 (None elsewhere) and this rank's report."""
        return decode_tiles(vae, latent, tiling, temb, None, self.world_size, self.rank)

    def gather_reports(self, report: RankReport) -> list[RankReport] | None:
        """Every rank's report on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [report]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, out, dst=0)
        return out

    def describe(self, report: PlanReport | None = None) -> str:
        """The job report's line for a stage split as `report` says (`StageRun.report`; None: no stage ran yet, the
        plan alone): the degree the SP stage ran at, and why — or, when the stage ran its guidance passes in
        parallel, that."""
        report = report or PlanReport()
        if self.world_size == 1:
            return "one rank"
        if self.sharded:
            return (f"sequence parallel over all {self.world_size} ranks, weights sharded over them (FSDP: every "
                    f"layer gathered by all ranks in lockstep)")
        if report.split is not None and report.split.kind == "passes":
            return report.split.describe(self.world_size)
        reason = f": {report.reason}" if report.reason else ""
        if report.degree is not None and report.degree < self.sp_degree:
            return f"sequence parallel on {report.degree} of {self.world_size} ranks{reason}"
        if self.sp_degree == self.world_size:
            return f"sequence parallel over all {self.world_size} ranks{reason}"
        why = (f"sp_degree {self.sp_degree} requested" if self.requested_sp_degree is not None else
               f"the SP degree must divide the {self.heads or '?'} attention heads; {self.world_size} does not")
        return (f"sequence parallel on ranks 0-{self.sp_degree - 1} of {self.world_size} ({why}); the other ranks "
                f"wait for its result{reason}")


@functools.lru_cache(maxsize=256)
def _planned_cap(memory: MemoryBudget, degree: int) -> int:
    """`memory_plan.token_cap(memory, degree)`, once per budget and degree (a bisection over the plan)."""
    return planned_token_cap(memory, degree)


def linear_path(transformer, device: torch.device) -> str:
    """How the transformer's block Linears compute on `device`, for the memory plan (`ActivationShape.linear`):
    "int8" (W8A8 layers, `models.quant`), "fp8" (fp8 layers on a GPU with fp8 tensor cores: compute capability ≥
    8.9) or "bf16" (plain weights, or fp8 dequantized per call)."""
    names = {type(m).__name__ for m in transformer.transformer_blocks.modules()}
    if "Int8Linear" in names:
        return "int8"
    if "FP8Linear" in names and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "fp8"
    return "bf16"


def memory_budget(transformer, device: torch.device, sharded: bool = False, budget_bytes: int | None = None,
                  batch: int = 1) -> MemoryBudget | None:
    """This rank's `MemoryBudget` for the "auto" token cap, read now (after the weights are loaded): budget =
    `budget_bytes` (a per-GPU budget) or the GPU's total memory; resident = `torch.cuda.memory_allocated` (the
    weights and every other resident component); gathered = 2 × the largest sharded unit when any is sharded (the
    running block and the prefetched next, `weights/sharding.py gathered`; 0 replicated; `sharded` is not read:
    the transformer's `sharding_of` report says); the transformer's `ActivationShape` in its
    compute dtype with its Linears' path (`linear_path`), every timestep per token (the largest plan). None on a
    CPU device, or a "cuda" device without CUDA (tests' simulated fleets): no budget to plan against."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    from ..weights.sharding import sharding_of

    total = torch.cuda.get_device_properties(device).total_memory
    report = sharding_of(transformer)  # sharded or placed weights: some units gathered while they run
    gathered = 2 * report.largest_unit_bytes if report is not None and report.sharded_units > 0 else 0
    dtype = next((p.dtype for p in transformer.proj_in.parameters()), torch.bfloat16)
    shape = ActivationShape.of(transformer.config, linear=linear_path(transformer, device),
                               act_bytes=torch.empty((), dtype=dtype).element_size())
    return MemoryBudget(budget=int(budget_bytes or total), resident=int(torch.cuda.memory_allocated(device)),
                        gathered=int(gathered), shape=shape, batch=batch)


def build_plan(transformer, rank: int, world_size: int, device: torch.device, policy: FleetPolicy | None = None,
               sharded: bool = False, budget_bytes: int | None = None) -> ParallelPlan:
    """Called by every rank of an initialized default process group (creating the sub-groups is collective).

    Every group a policy may use is built here, once, in the same order on every rank: an SP group of ranks
    0..d-1 for every degree d that divides the heads and fits the fleet, and a guidance-pass group of ranks 0..g-1
    for g = 2..min(W, 4) (sharing the SP group of the same ranks). `torch.distributed.new_group` is collective, so a
    later job's plan (`ParallelPlan.with_policy`, per job, on every rank) only picks among these groups.

    Returns the plan of those groups (`plan.groups`, kept for the fleet's life) under `policy` (a `FleetPolicy`,
    applied by `ParallelPlan.for_policy`; None: `DEFAULT_BUILD_POLICY`, the full degree on every stage):
    `min_tokens_per_rank`: None = on CUDA the cost model (`cost.py`) picks each stage's degree, on CPU the full
    degree; an int = smaller SP degrees for stages with fewer video tokens per rank than that (0: always the full
    degree), the cost model off.
    `sp_degree`: an explicit degree (checked by `check_requested_degree`); None = the largest valid one. It is the
    largest degree a stage uses; the policy may still pick fewer ranks.
    `guidance_parallel`: "auto" | "on" | "off" (`passes.py`): whether a guided stage may run its passes in parallel
    instead ("on", or "auto" on CUDA). `token_cap`: video tokens per rank per forward (an int, None: no cap, or
    "auto": the memory plan's per degree, from this rank's `memory_budget` measured here, against `budget_bytes` —
    a per-GPU budget — or the GPU's total memory).
    `sharded`: the weights are sharded over all ranks (every forward on all of them). Raises ValidationError /
    ValueError for a policy the heads, the fleet or sharded weights do not allow.
    """
    policy = policy or DEFAULT_BUILD_POLICY
    sp_degree, min_tokens_per_rank, guidance_parallel = (policy.sp_degree, policy.min_tokens_per_rank,
                                                         policy.guidance_parallel)
    check_mode(guidance_parallel)
    heads = transformer.config.num_attention_heads
    if sharded:
        check_sharded_policy(world_size, sp_degree, min_tokens_per_rank, guidance_parallel, heads)
    if sp_degree is not None:
        check_requested_degree(heads, sp_degree, world_size)
    all_stages: dict[int, SPStage] = {}
    # every rank creates every group, in the same order; degree 1 gets a group of rank 0 alone (cancel checks)
    for d in valid_sp_degrees(heads, world_size):
        group = None if d == world_size else dist.new_group(list(range(d)))
        forward = UlyssesSplit(Exchange(group, d, rank)) if rank < d and d > 1 else None
        all_stages[d] = SPStage(d, group, forward)
    all_pass_groups: dict[int, dist.ProcessGroup | None] = {}
    for g in range(2, min(world_size, MAX_PASSES) + 1):  # same order on every rank; reuse the SP groups
        all_pass_groups[g] = (None if g == world_size else all_stages[g].group if g in all_stages
                              else dist.new_group(list(range(g))))
    groups = PlanGroups(rank, world_size, device, MappingProxyType(all_stages), MappingProxyType(all_pass_groups),
                        heads, ModelShape.of(transformer.config), sharded=sharded,
                        memory=memory_budget(transformer, device, sharded, budget_bytes))
    return ParallelPlan.for_policy(groups, sp_degree=sp_degree, min_tokens_per_rank=min_tokens_per_rank,
                                   guidance_parallel=guidance_parallel, token_cap=policy.token_cap)
