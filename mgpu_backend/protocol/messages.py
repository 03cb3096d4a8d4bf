"""Client <-> controller messages (the controller's socket; `transport.send` / `recv` pickle them), frozen.

Requests, one per message: `Ping`, `Status`, `Configure`, `Submit`, `Cancel`, `ShutdownFleet`, `Stop`.

Every request but `Submit` is answered with one reply: `Pong` (`Ping`), `StatusReply` (`Status`), `Configured`
(`Configure`: the handle, and what a rebuild replaced), `Done` (`Cancel`), `Stopped` (`ShutdownFleet`, `Stop`: what
was stopped), or `Refused`.

A `Submit` is answered with a stream of events on the same connection: `Accepted`, then `Progress` events, ending
with one `JobResult` or `JobError` — or a single `Busy` (another job runs) or `Refused`.

`Refused` answers a request the controller cannot run or cannot read (kind "protocol": not a pickled request of
this module, a `Configure` without a `FleetConfig`, a `Submit` without a handle and a job), so both client paths
(a request's reply, a job's stream) read it; the connection stays, except after a message longer than
`transport.MAX_MESSAGE_BYTES` (its bytes were never read).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ErrorDetails
from .fleet_config import FleetConfig, FleetHandle
from .job_requests import JobSpec
from .job_results import ControllerStatus, FleetTeardown

# ---- client -> controller ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ping:
    """Is a controller there? -> `Pong`."""


@dataclass(frozen=True)
class Status:
    """The controller's and the fleet's state -> `StatusReply`."""


@dataclass(frozen=True)
class Configure:
    """The fleet for `config` -> `Configured`. The same `identity` reuses the running fleet, whatever the policy (the
    handle carries the new policy, applied to each of its jobs, and the `FleetPlan` the fleet computed for it)."""

    config: FleetConfig


@dataclass(frozen=True)
class Submit:
    """Run `job` on the fleet of `handle` -> `Accepted`, `Progress` …, then `JobResult` or `JobError` (or `Busy`).
    A job's payload is its kind's frozen request (`job_requests`, `stage_requests`, `pipelines.GenerateRequest`,
    `forward.ForwardRequest` / `PreprocessTextRequest`); frames in a result come back as a `frames.FramesRef`."""

    handle: FleetHandle
    job: JobSpec


@dataclass(frozen=True)
class Cancel:
    """Cancel the running job `job_id` (sent on another connection) -> `Done`, or `Refused` when it is not running."""

    job_id: str


@dataclass(frozen=True)
class ShutdownFleet:
    """Stop the fleet; the controller stays -> `Stopped`."""


@dataclass(frozen=True)
class Stop:
    """Stop the fleet and the controller -> `Stopped`."""


Request = Ping | Status | Configure | Submit | Cancel | ShutdownFleet | Stop

# ---- controller -> client: replies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pong:
    pid: int


@dataclass(frozen=True)
class StatusReply:
    """`status`: the controller's pid, socket, busy job, last failure, clients, fleet (a `FleetDescription`, or
    None) and processes (`ProcessInfo`s): `job_results.ControllerStatus`."""

    status: ControllerStatus


@dataclass(frozen=True)
class Configured:
    """`replaced`: what a rebuild for another configuration ended (`job_results.FleetTeardown`: the old fleet and
    the other clients connected), or None (the fleet was kept, or none ran)."""

    handle: FleetHandle
    replaced: FleetTeardown | None = None


@dataclass(frozen=True)
class Done:
    """A request done, with nothing to report (`Cancel`)."""


@dataclass(frozen=True)
class Stopped:
    """What a `ShutdownFleet` / `Stop` stopped (`job_results.FleetTeardown`: the fleet or None, the other clients
    connected, the job that was running or None)."""

    stopped: FleetTeardown


@dataclass(frozen=True)
class Refused:
    """A request refused or unreadable: `message` says why; `kind` is an `errors.ErrorKind` value (a plain string on
    the wire), e.g. "protocol", "busy", "validation"."""

    message: str
    kind: str


Reply = Pong | StatusReply | Configured | Done | Stopped | Refused

# ---- controller -> client: a job's events --------------------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """The job runs on fleet `generation` (its workers' `worker_pids`)."""

    job_id: str
    generation: int
    worker_pids: tuple[int, ...]


@dataclass(frozen=True)
class Progress:
    """Rank 0 finished `step` of `total` steps of `stage`."""

    job_id: str
    stage: str
    step: int
    total: int


@dataclass(frozen=True)
class JobResult:
    """The job's result: rank 0's answer, a frozen dataclass of `job_results` (or the native MODEL's replies of
    `protocol/native_forward.py`), pickled once by rank 0 (`transport.Pickled`) for the inline jobs; frames as a `frames.FramesRef`."""

    job_id: str
    result: Any


@dataclass(frozen=True)
class JobError:
    """The job failed: `kind` an `errors.ErrorKind` value (a plain string on the wire), `fleet_lost` whether the
    fleet was torn down, `details` what the fleet knows more (`errors.ErrorDetails`: e.g. the rank's traceback)."""

    job_id: str
    message: str
    kind: str
    fleet_lost: bool = False
    details: ErrorDetails = field(default_factory=ErrorDetails)


@dataclass(frozen=True)
class Busy:
    """Another job runs (`running` names it); the job was not queued."""

    job_id: str
    running: str


Event = Accepted | Progress | JobResult | JobError | Busy
