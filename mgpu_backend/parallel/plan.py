"""How one job is split over a fleet: the sequence-parallel group and the hand-over to the other ranks.

SP runs on the largest valid subset of the fleet (W must divide the video heads): on 6 GPUs with 32 heads, SP uses
ranks 0–3 as a sub-group and says so in the job report; ranks 4–5 skip the SP stages and receive the result by
broadcast from rank 0, so the stages that use every device (tiled stage 2, decode, Gemma) still can.

Per stage, the SP degree is chosen so the split pays: on CUDA the cost model (`cost.py`, fitted to H200
measurements) picks the degree with the lowest predicted forward time — fewer ranks, or one, when the video tokens
per rank are too few to beat one GPU — and the job report says which degree ran and why. An explicit
`min_tokens_per_rank` replaces the model by the rule "at least that many video tokens per rank" (0: always the full
degree, the default on CPU fleets).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..validation import ValidationError
from .cost import CostModel, ModelShape, best_sp_degree, choice_reason
from .cost import DEFAULT as DEFAULT_COST_MODEL
from .decode import decode_tiles
from .exchange import Exchange
from .sequence import SequenceParallelTransformer, check_token_cap, largest_sp_degree
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
class ParallelPlan:
    """The split of one fleet. Build it on every rank with `build_plan` (creating a sub-group is collective)."""

    rank: int
    world_size: int
    device: torch.device
    sp_degree: int
    sp_group: dist.ProcessGroup | None  # None = the default (world) group
    sp_forward: SequenceParallelTransformer | None  # None on ranks outside the SP group
    token_cap: int | None = DEFAULT_TOKEN_CAP
    active_group: dist.ProcessGroup | None = None  # the group of the stage now running (for the cancel check)
    stages: dict[int, SPStage] | None = None  # every usable SP degree -> its group (built collectively)
    min_tokens_per_rank: int = 0
    last_degree: int | None = None  # the degree the last SP stage ran at (job report)
    cost_model: CostModel | None = None  # set: the degree per stage is the cost model's choice (min_tokens ignored)
    shape: ModelShape | None = None  # the transformer's shape for the cost model (None: LTX-2 19B)
    last_reason: str | None = None  # why the last SP stage ran at `last_degree` (job report)

    def stage(self, tokens: int) -> SPStage:
        """The SP stage for a forward of `tokens` video tokens.

        With a cost model: the degree with the lowest predicted forward time among the built stages (1 when no split
        is predicted to beat one GPU). Otherwise the largest degree that keeps at least `min_tokens_per_rank` video
        tokens per rank; the full degree when no minimum is set."""
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

    @property
    def in_sp_group(self) -> bool:
        return self.rank < self.sp_degree

    def check(self, tokens: int) -> None:
        """Before any work: the per-rank token cap of the largest SP stage (raises ValidationError)."""
        try:
            check_token_cap(tokens, self.sp_degree, self.token_cap)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def announce(self, stage: str, failure: BaseException | None, degree: int) -> None:
        """After an SP stage on a sub-group: rank 0 tells every rank whether it finished, was cancelled or failed,
        so the ranks outside the group stop too instead of waiting in `share`'s broadcast. Re-raises `failure` on
        the group's ranks; raises SamplingCancelled / RuntimeError on the others."""
        from ..sampling import SamplingCancelled

        if degree != self.world_size:
            status = torch.tensor([0 if failure is None else 1 if isinstance(failure, SamplingCancelled) else 2],
                                  dtype=torch.int32, device=self._comm_device())
            dist.broadcast(status, src=0)
            code = int(status.item())
            if failure is None and code == 1:
                raise SamplingCancelled(f"{stage} cancelled on the sequence-parallel ranks")
            if failure is None and code == 2:
                raise RuntimeError(f"{stage} failed on the sequence-parallel ranks (rank 0 reports the cause)")
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
        """A TDP wrapper over every rank of the fleet (the default group)."""
        return TiledTransformer(transformer, grid, tiling, None, self.world_size, self.rank)

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
        """The job report's line: the degree the last SP stage ran at, and why."""
        if self.world_size == 1:
            return "one rank"
        reason = f": {self.last_reason}" if self.last_reason else ""
        if self.last_degree is not None and self.last_degree < self.sp_degree:
            return f"sequence parallel on {self.last_degree} of {self.world_size} ranks{reason}"
        if self.sp_degree == self.world_size:
            return f"sequence parallel over all {self.world_size} ranks{reason}"
        return (f"sequence parallel on ranks 0-{self.sp_degree - 1} of {self.world_size} (the SP degree must divide "
                f"the attention heads; {self.world_size} does not); the other ranks wait for its result{reason}")


def check_requested_degree(heads: int, degree: int, world_size: int) -> None:
    """An explicitly requested SP degree must divide the heads and fit the fleet (raises ValidationError naming the
    valid degrees)."""
    valid = [d for d in range(1, min(heads, world_size) + 1) if heads % d == 0]
    if degree not in valid:
        raise ValidationError(f"sequence parallel degree {degree} is not possible with {heads} attention heads on "
                              f"{world_size} rank(s): the degree must divide the heads and be at most the rank "
                              f"count; valid degrees: {', '.join(map(str, valid))}")


def build_plan(transformer, rank: int, world_size: int, device: torch.device,
               token_cap: int | None = DEFAULT_TOKEN_CAP, min_tokens_per_rank: int | None = 0,
               sp_degree: int | None = None) -> ParallelPlan:
    """Called by every rank of an initialized default process group (creating the sub-groups is collective).

    `min_tokens_per_rank`: None = the default policy: on CUDA the cost model (`cost.py`) picks each stage's degree,
    on CPU the full degree; an int = smaller SP degrees for stages with fewer video tokens per rank than that (0:
    always the full degree), the cost model off.
    `sp_degree`: an explicit degree (checked by `check_requested_degree`); None = the largest valid one. It is the
    largest degree a stage uses; the policy may still pick fewer ranks.
    """
    cost_model = None
    if min_tokens_per_rank is None:
        cost_model = DEFAULT_COST_MODEL if device.type == "cuda" else None
        min_tokens_per_rank = 0
    heads = transformer.config.num_attention_heads
    if sp_degree is not None:
        check_requested_degree(heads, sp_degree, world_size)
    degree = sp_degree or largest_sp_degree(heads, world_size)
    stages = {}
    # every rank creates every group, in the same order; degree 1 gets a group of rank 0 alone (cancel checks)
    degrees = [d for d in range(1, degree + 1)
               if heads % d == 0 and (d == degree or min_tokens_per_rank > 0 or cost_model is not None)]
    for d in degrees:
        group = None if d == world_size else dist.new_group(list(range(d)))
        forward = (SequenceParallelTransformer(transformer, Exchange(group, d, rank), token_cap)
                   if rank < d and d > 1 else None)
        stages[d] = SPStage(d, group, forward)
    top = stages[degree]
    return ParallelPlan(rank, world_size, device, degree, top.group, top.forward, token_cap,
                        stages=stages, min_tokens_per_rank=min_tokens_per_rank, cost_model=cost_model,
                        shape=ModelShape.of(transformer.config) if cost_model is not None else None)
