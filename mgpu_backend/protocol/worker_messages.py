"""Fleet <-> worker messages (each worker's pipe; `multiprocessing.Connection` pickles them): `RunJob` /
`StopWorker` to the workers; `WorkerReady` / `WorkerInitError` once, then per job `JobProgress` (rank 0) and one of
`JobDone`, `JobStopped`, `JobFailed`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fleet_config import FleetPolicy
from .fleet_rules import WeightPlacement
from .job_requests import JobSpec
from .link import LinkReport


@dataclass(frozen=True)
class RunJob:
    """Fleet -> every worker: run `spec` under `policy` (`WorkerState.apply_policy` first; no process restarts)."""

    spec: JobSpec
    policy: FleetPolicy


@dataclass(frozen=True)
class StopWorker:
    """Fleet -> worker: leave the job loop, destroy the process group and exit."""


@dataclass(frozen=True)
class WorkerReady:
    """Worker -> fleet, once: the process group is up and the weights are loaded. `open_count`: checkpoint opens so
    far (`models.loader.OPEN_COUNT`); `load_seconds`: from joining the group to ready; `heads`: the loaded
    transformer's attention heads (the SP degree must divide them; `FleetPlan`); `int8_compute`: which path the
    transformer's int8 layers take ("int8 W8A8 …" / "int8 dequantized to bfloat16 at load …"; None: no int8 layers);
    `link`: the links measured once the weights were loaded (`splits/link.py`; rank 0's is kept); `predicted`: rank 0's
    predicted step times of the 720p template's stages, this fleet against one card with weight streaming
    (`weights_cost.FleetFacts.lines`; () on CPU ranks); `placement`: where the fleet's transformer weights went
    (`protocol.fleet_rules.WeightPlacement`, the same on every rank; None: not reported)."""

    rank: int
    pid: int
    open_count: int
    load_seconds: float
    heads: int
    int8_compute: str | None = None
    link: LinkReport | None = None
    predicted: tuple[str, ...] = ()
    placement: WeightPlacement | None = None


@dataclass(frozen=True)
class WorkerInitError:
    """Worker -> fleet, instead of `WorkerReady`: the start failed (`error` = "Type: message")."""

    rank: int
    error: str
    traceback: str


@dataclass(frozen=True)
class JobProgress:
    """Rank 0 -> fleet: `step` of `total` steps of `stage` done (forwarded to the client as a progress event)."""

    job_id: str
    stage: str
    step: int
    total: int


@dataclass(frozen=True)
class JobDone:
    """Worker -> fleet: the job ended on this rank; `result` is rank 0's answer (other ranks send `{}`).
    `open_count` is this rank's `models.loader.OPEN_COUNT` after the job (a re-read checkpoint shows in status)."""

    job_id: str
    rank: int
    result: Any
    open_count: int


@dataclass(frozen=True)
class JobStopped:
    """Worker -> fleet: the job was cancelled on this rank before `step` of `stage` (every rank stops at the same
    step boundary)."""

    job_id: str
    rank: int
    stage: str
    step: int
    open_count: int


@dataclass(frozen=True)
class JobFailed:
    """Worker -> fleet: the job raised on this rank during `step` of `stage`. `error_type` is the exception's class
    name, `message` its text; `bad_input`: a ValidationError / FileNotFoundError (refused before work: reported as
    kind "validation")."""

    job_id: str
    rank: int
    error_type: str
    message: str
    stage: str
    step: int
    bad_input: bool
    traceback: str
    open_count: int


WorkerMessage = WorkerReady | WorkerInitError | JobProgress | JobDone | JobStopped | JobFailed
