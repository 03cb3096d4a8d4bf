"""One dispatcher of N branches over M ranks: how a stage's guidance passes, or a native request's batch rows, run
on the fleet (in the manner of vLLM-Omni's multi-branch CFG dispatcher: the branches of one step are independent
forwards; the plan decides once whether they run one after the other, each split over the sequence-parallel group,
or spread over ranks and exchanged).

`dispatch(plan, ...)` asks the plan (`ParallelPlan.split`: the cost model on CUDA, the policy's
`guidance_parallel`) and returns a `Dispatch`: which ranks take part, the sequence split of every branch's forward
(`UlyssesSplit`, `kind` "sequence"), or the spreading of the branches over ranks 0..M-1 (`passes.PassParallel`,
`kind` "passes": branch j on rank j % M, each branch's outputs broadcast from its owner). Both the stage runners
(`stages/stage.py`) and the native engine (`stages/native.py`) call it; neither reaches into the plan's groups.
"""
from __future__ import annotations

from dataclasses import dataclass

from .passes import PassParallel
from .plan import ParallelPlan, StageRun
from ..engine.forward import Split

ONE_RANK = "one rank"


@dataclass(frozen=True, eq=False)
class Dispatch:
    """How the N branches of one stage (or request) run on this rank.

    run: the plan's `StageRun` (None: no plan, or one rank); rank: this rank; spread: the branches over ranks
    0..degree-1 (`kind` "passes"; None otherwise).
    """

    run: StageRun | None
    rank: int = 0
    spread: PassParallel | None = None

    @property
    def kind(self) -> str:
        """"one rank", "sequence" (every branch split over the SP group) or "passes" (branches over ranks)."""
        return ONE_RANK if self.run is None else self.run.kind

    @property
    def joins(self) -> bool:
        """Whether this rank computes anything (ranks past the degree wait for rank 0's result)."""
        return self.run is None or self.rank < self.run.degree

    @property
    def split(self) -> Split | None:
        """The sequence split of every branch's forward (None: one rank, or the branches spread)."""
        return None if self.run is None else self.run.forward


def dispatch(plan: ParallelPlan | None, stage: str, tokens: int, branches: int, branch_bytes: float = 0.0
             ) -> Dispatch:
    """The plan's choice for `branches` branches (guidance passes per step, or batch rows) of `tokens` video tokens
    each, `branch_bytes` of outputs each (the per-step exchange when spread), named `stage` in the report. The same
    on every rank. `plan` None: one rank."""
    if plan is None:
        return Dispatch(None)
    run = plan.split(stage, tokens, branches, branch_bytes)
    spread = (PassParallel(run.group, run.degree, plan.rank, plan.groups.comm_device)
              if run.kind == "passes" and plan.rank < run.degree else None)
    return Dispatch(run, plan.rank, spread)


__all__ = ["Dispatch", "ONE_RANK", "dispatch"]
