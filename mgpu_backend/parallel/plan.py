"""How one job is split over a fleet: the sequence-parallel group and the hand-over to the other ranks.

SP runs on the largest valid subset of the fleet (W must divide the video heads): on 6 GPUs with 32 heads, SP uses
ranks 0–3 as a sub-group and says so in the job report; ranks 4–5 skip the SP stages and receive the result by
broadcast from rank 0, so the stages that use every device (tiled stage 2, decode, Gemma) still can.

Per stage, the SP degree is chosen so the split pays: on CUDA the cost model (`cost.py`, fitted to H200
measurements) picks the degree with the lowest predicted forward time — fewer ranks, or one, when the video tokens
per rank are too few to beat one GPU — and the job report says which degree ran and why. An explicit
`min_tokens_per_rank` replaces the model by the rule "at least that many video tokens per rank" (0: always the full
degree, the default on CPU fleets).

A guided stage may instead run its guidance passes in parallel (`passes.py`, xDiT's "CFG parallel"): pass j of each
step on rank j % g, the x0 predictions broadcast within ranks 0..g-1 — on CUDA when the cost model predicts it faster
than the stage's SP choice (`FleetConfig.guidance_parallel`: "auto", "on", "off"); `split` decides per stage and
`describe` says which ran.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..validation import ValidationError
from .cost import CostModel, ModelShape, best_sp_degree, choice_reason, default_model
from .decode import decode_tiles
from .degrees import check_requested_degree, top_sp_degree, valid_sp_degrees
from .exchange import Exchange
from .passes import MAX_PASSES, StageSplit, check_mode, choose_split
from .sequence import SequenceParallelTransformer, check_token_cap
from .tiled import TiledTransformer
from .tiling import TileCountConfig

DEFAULT_TOKEN_CAP = 65536  # video tokens per rank per forward (≈ 241 frames at 1920×1088 on 2 ranks)


@dataclass
class SPStage:
    """The sequence-parallel group one stage runs on: ranks 0..degree-1."""

    degree: int
    group: dist.ProcessGroup | None
    forward: SequenceParallelTransformer | None  # None on ranks outside the group, and for degree 1


@dataclass
class StageRun:
    """What one stage runs on (`ParallelPlan.split`): `split.kind` "sequence" (SP over ranks 0..degree-1 with
    `forward`) or "passes" (the guidance passes spread over ranks 0..degree-1, plain forwards); `group` holds those
    ranks (None: the whole fleet)."""

    split: StageSplit
    group: dist.ProcessGroup | None
    forward: SequenceParallelTransformer | None

    @property
    def degree(self) -> int:
        return self.split.degree

    @property
    def kind(self) -> str:
        return self.split.kind


@dataclass
class ParallelPlan:
    """The split of one fleet. Build it on every rank with `build_plan` (creating a sub-group is collective)."""

    rank: int
    world_size: int
    device: torch.device
    sp_degree: int
    sp_group: dist.ProcessGroup | None  # None = the default (world) group
    sp_forward: SequenceParallelTransformer | None  # None on ranks outside the SP group
    token_cap: int | None = DEFAULT_TOKEN_CAP
    stages: dict[int, SPStage] | None = None  # every usable SP degree -> its group (built collectively)
    min_tokens_per_rank: int = 0
    last_degree: int | None = None  # the degree the last SP stage ran at (job report)
    cost_model: CostModel | None = None  # set: the degree per stage is the cost model's choice (min_tokens ignored)
    shape: ModelShape | None = None  # the transformer's shape for the cost model (None: LTX-2 19B)
    last_reason: str | None = None  # why the last SP stage ran at `last_degree` (job report)
    guidance_parallel: str = "off"  # "auto" | "on" | "off" (build_plan's default is "auto"; see passes.py)
    pass_groups: dict[int, dist.ProcessGroup | None] | None = None  # group size g -> ranks 0..g-1 (built collectively)
    last_split: StageSplit | None = None  # how the last stage run through `split` ran (job report)
    # every group built at fleet start (`build_plan`); a policy (`set_policy`) picks `stages` / `pass_groups` among them
    all_stages: dict[int, SPStage] | None = None
    all_pass_groups: dict[int, dist.ProcessGroup | None] | None = None
    heads: int | None = None  # the transformer's attention heads (the SP degree must divide them)
    model_shape: ModelShape | None = None  # the transformer's shape (`shape` is set from it when a policy needs it)
    requested_sp_degree: int | None = None  # the policy's explicit `sp_degree` (None: the largest the heads allow)
    sharded: bool = False  # the transformer's weights are sharded over all ranks (sharding.py): lockstep forwards

    def set_policy(self, sp_degree: int | None = None, min_tokens_per_rank: int | None = 0,
                   guidance_parallel: str = "auto", token_cap: int | None = DEFAULT_TOKEN_CAP) -> None:
        """Apply a parallel policy (`protocol.FleetPolicy`'s fields; see `build_plan`) to this plan, on every rank
        with the same values, between jobs: it only chooses among the groups `build_plan` built, so no collective
        runs and nothing is reloaded. Raises ValidationError (a degree the heads or the fleet do not allow) or
        ValueError (an unknown guidance-parallel mode) before anything changes."""
        check_mode(guidance_parallel)
        if self.all_stages is None:
            raise RuntimeError("set_policy needs a plan from build_plan (its groups are built there)")
        if self.sharded:
            check_sharded_policy(self.world_size, sp_degree, min_tokens_per_rank, guidance_parallel)
        heads = self.heads or 1
        degree = top_sp_degree(heads, self.world_size, sp_degree)  # raises for a degree the heads do not allow
        cost_model = None
        if min_tokens_per_rank is None:
            cost_model = (default_model() if self.device.type == "cuda" and not self.sharded
                          else None)  # the graphed forward's
            min_tokens_per_rank = 0
        self.stages = {d: s for d, s in self.all_stages.items()
                       if d <= degree and (d == degree or min_tokens_per_rank > 0 or cost_model is not None)}
        use_passes = not self.sharded and (
            guidance_parallel == "on" or (guidance_parallel == "auto" and self.device.type == "cuda"))
        self.pass_groups = dict(self.all_pass_groups or {}) if use_passes else {}
        top = self.all_stages[degree]
        self.sp_degree, self.sp_group, self.sp_forward = degree, top.group, top.forward
        self.token_cap, self.min_tokens_per_rank, self.cost_model = token_cap, min_tokens_per_rank, cost_model
        for stage in self.all_stages.values():
            if stage.forward is not None:
                stage.forward.token_cap = token_cap
        self.shape = self.model_shape if cost_model is not None or self.pass_groups else None
        self.guidance_parallel, self.requested_sp_degree = guidance_parallel, sp_degree
        self.last_degree = self.last_reason = self.last_split = None

    def stage(self, tokens: int) -> SPStage:
        """The SP stage for a forward of `tokens` video tokens.

        With a cost model: the degree with the lowest predicted forward time among the built stages (1 when no split
        is predicted to beat one GPU). Otherwise the largest degree that keeps at least `min_tokens_per_rank` video
        tokens per rank; the full degree when no minimum is set."""
        self.last_split = None
        stages = self.stages or {self.sp_degree: SPStage(self.sp_degree, self.sp_group, self.sp_forward)}
        if self.cost_model is not None:
            shape = self.shape or ModelShape()
            degree = best_sp_degree(tokens, [d for d in stages], shape, self.cost_model)
            degree = degree if degree in stages else min(stages)
            chosen = stages[degree]
            self.last_reason = choice_reason(tokens, degree, list(stages), shape, self.cost_model)
        else:
            fits = [d for d in stages if d == 1 or tokens >= d * self.min_tokens_per_rank]
            chosen = stages[max(fits) if fits else min(stages)]
            self.last_reason = (f"fewer than {self.min_tokens_per_rank} video tokens per rank would not pay"
                                if chosen.degree < self.sp_degree else None)
        self.last_degree = chosen.degree
        return chosen

    def split(self, stage: str, tokens: int, passes: int, pass_bytes: float = 0.0) -> StageRun:
        """How a stage of `tokens` video tokens and `passes` guidance passes per step runs: SP at `stage(tokens)`'s
        degree, or the passes in parallel (`passes.choose_split`: by `guidance_parallel`, on CUDA with the cost
        model's predictions — this plan's, or cost.py's default when `min_tokens_per_rank` replaced it).
        `pass_bytes`: one pass's outputs (the per-step exchange). The same decision on every rank."""
        sp = self.stage(tokens)
        model = self.cost_model
        if model is None and self.device.type == "cuda":
            model = default_model()
        choice = choose_split(self.guidance_parallel, tokens, passes, self.world_size, sp.degree,
                              list(self.pass_groups or {}), cost_model=model, shape=self.shape or ModelShape(),
                              nbytes=pass_bytes, token_cap=self.token_cap, stage=stage)
        if choice.kind == "passes":
            self.last_split = choice
            return StageRun(choice, (self.pass_groups or {})[choice.degree], None)
        if choice.reason:
            self.last_reason = f"{self.last_reason}; {choice.reason}" if self.last_reason else choice.reason
        return StageRun(choice, sp.group, sp.forward)

    @property
    def in_sp_group(self) -> bool:
        return self.rank < self.sp_degree

    def check(self, tokens: int) -> None:
        """Before any work: the per-rank token cap of the largest SP stage (raises ValidationError)."""
        try:
            check_token_cap(tokens, self.sp_degree, self.token_cap)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def announce(self, stage: str, failure: BaseException | None, degree: int,
                 who: str = "sequence-parallel ranks") -> None:
        """After an SP (or guidance-parallel) stage on a sub-group: rank 0 tells every rank whether it finished, was
        cancelled or failed, so the ranks outside the group stop too instead of waiting in `share`'s broadcast.
        Re-raises `failure` on the group's ranks; raises SamplingCancelled / RuntimeError on the others (`who`
        names the group in their message)."""
        from ..sampling import SamplingCancelled

        if degree != self.world_size:
            status = torch.tensor([0 if failure is None else 1 if isinstance(failure, SamplingCancelled) else 2],
                                  dtype=torch.int32, device=self._comm_device())
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
            buf = (x if x is not None else torch.empty(shape, dtype=torch.float32)).to(self._comm_device())
            dist.broadcast(buf, src=0)
            out.append(buf.cpu())
        return out[0], out[1]

    def tiled(self, transformer, grid: tuple[int, int, int], tiling: TileCountConfig) -> TiledTransformer:
        """A TDP wrapper over every rank of the fleet (the default group). With sharded weights the tile count must
        be a multiple of the ranks (raises ValidationError before any work): each rank runs the same number of tile
        forwards, in lockstep."""
        tiled = TiledTransformer(transformer, grid, tiling, None, self.world_size, self.rank)
        if self.sharded and len(tiled.tiles) % self.world_size:
            raise ValidationError(
                f"{len(tiled.tiles)} tiles over {self.world_size} ranks: with sharded weights every rank runs the "
                f"same number of tile forwards (each layer is gathered by all ranks at once), so the tile count "
                f"must be a multiple of {self.world_size}; choose tiles such as 1x{self.world_size}")
        return tiled

    def decode(self, vae, latent: torch.Tensor, tiling: TileCountConfig, temb=None):
        """Distributed decode over every rank; pixels on rank 0 (None elsewhere) and this rank's report."""
        return decode_tiles(vae, latent, tiling, temb, None, self.world_size, self.rank)

    def gather_reports(self, report: dict) -> list[dict] | None:
        """Every rank's report on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [report]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, out, dst=0)
        return out

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def describe(self) -> str:
        """The job report's line: the degree the last SP stage ran at, and why — or, when the last stage ran its
        guidance passes in parallel, that."""
        if self.world_size == 1:
            return "one rank"
        if self.sharded:
            return (f"sequence parallel over all {self.world_size} ranks, weights sharded over them (FSDP: every "
                    f"layer gathered by all ranks in lockstep)")
        if self.last_split is not None and self.last_split.kind == "passes":
            return self.last_split.describe(self.world_size)
        reason = f": {self.last_reason}" if self.last_reason else ""
        if self.last_degree is not None and self.last_degree < self.sp_degree:
            return f"sequence parallel on {self.last_degree} of {self.world_size} ranks{reason}"
        if self.sp_degree == self.world_size:
            return f"sequence parallel over all {self.world_size} ranks{reason}"
        why = (f"sp_degree {self.sp_degree} requested" if self.requested_sp_degree is not None else
               f"the SP degree must divide the {self.heads or '?'} attention heads; {self.world_size} does not")
        return (f"sequence parallel on ranks 0-{self.sp_degree - 1} of {self.world_size} ({why}); the other ranks "
                f"wait for its result{reason}")


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


def build_plan(transformer, rank: int, world_size: int, device: torch.device,
               token_cap: int | None = DEFAULT_TOKEN_CAP, min_tokens_per_rank: int | None = 0,
               sp_degree: int | None = None, guidance_parallel: str = "auto", sharded: bool = False) -> ParallelPlan:
    """Called by every rank of an initialized default process group (creating the sub-groups is collective).

    Every group a policy may use is built here, once, in the same order on every rank: an SP group of ranks
    0..d-1 for every degree d that divides the heads and fits the fleet, and a guidance-pass group of ranks 0..g-1
    for g = 2..min(W, 4) (sharing the SP group of the same ranks). `torch.distributed.new_group` is collective, so a
    later policy change (`ParallelPlan.set_policy`, per job, on every rank) only picks among these groups.

    The policy arguments (`FleetPolicy`'s fields) are then applied with `set_policy`:
    `min_tokens_per_rank`: None = the default policy: on CUDA the cost model (`cost.py`) picks each stage's degree,
    on CPU the full degree; an int = smaller SP degrees for stages with fewer video tokens per rank than that (0:
    always the full degree), the cost model off.
    `sp_degree`: an explicit degree (checked by `check_requested_degree`); None = the largest valid one. It is the
    largest degree a stage uses; the policy may still pick fewer ranks.
    `guidance_parallel`: "auto" | "on" | "off" (`passes.py`): whether a guided stage may run its passes in parallel
    instead ("on", or "auto" on CUDA).
    """
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
        forward = (SequenceParallelTransformer(transformer, Exchange(group, d, rank), token_cap)
                   if rank < d and d > 1 else None)
        all_stages[d] = SPStage(d, group, forward)
    all_pass_groups: dict[int, dist.ProcessGroup | None] = {}
    for g in range(2, min(world_size, MAX_PASSES) + 1):  # same order on every rank; reuse the SP groups
        all_pass_groups[g] = (None if g == world_size else all_stages[g].group if g in all_stages
                              else dist.new_group(list(range(g))))
    top = all_stages[top_sp_degree(heads, world_size)]
    plan = ParallelPlan(rank, world_size, device, top.degree, top.group, top.forward, token_cap,
                        all_stages=all_stages, all_pass_groups=all_pass_groups, heads=heads,
                        model_shape=ModelShape.of(transformer.config), sharded=sharded)
    plan.set_policy(sp_degree=sp_degree, min_tokens_per_rank=min_tokens_per_rank,
                    guidance_parallel=guidance_parallel, token_cap=token_cap)
    return plan
