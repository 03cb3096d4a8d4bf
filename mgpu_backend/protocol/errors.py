"""What a failure is, on both ends: `ErrorKind` (on the wire its plain string value, e.g. "validation") and
`ControllerError` with its subclasses `FleetBusy` and `JobCancelled`, raised by the client and the fleet, and the
`ErrorDetails` they carry; and `ValidationError`, bad input refused before any work (here, torch-free, so the fleet's
rules and the nodes raise it without torch; `protocol.validation` re-exports it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum


class ErrorKind(str, Enum):
    """What kind of failure a `ControllerError` (or an error event) is. A `str` enum (`enum.StrEnum` needs Python
    3.11): a member equals and hashes as its value (`ErrorKind.BUSY == "busy"`), prints as it, and the value is what
    travels on the wire."""

    VALIDATION = "validation"  # bad input, refused on every rank before work; the fleet stays
    JOB_ERROR = "job_error"  # the same error on every rank; the fleet stays
    CANCELLED = "cancelled"  # every rank stopped at the same step boundary; the fleet stays
    BUSY = "busy"  # another job runs (answered at once, never queued)
    STALE_HANDLE = "stale_handle"  # the handle names a fleet another configuration replaced
    FLEET_LOST = "fleet_lost"  # a crash, stall or one-rank error tore the fleet down
    FLEET_STOPPED = "fleet_stopped"  # a `stop` / `shutdown_fleet` from another client ended the running job
    PROTOCOL = "protocol"  # an unreadable request
    START_FAILED = "start_failed"  # (client side) the controller did not start
    NOT_RUNNING = "not_running"  # (client side) no controller answers
    CONTROLLER_LOST = "controller_lost"  # (client side) the controller went away during a request or a job
    ERROR = "error"  # anything else (a failure inside the controller itself)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class ValidationError(ValueError):
    """Bad input, refused before any work; nothing loaded is lost."""


@dataclass(frozen=True)
class ErrorDetails:
    """What the fleet knows more about a failure (every field None when unknown).

    stage / step: where the job failed (step 0-based); error_type: the exception's class name on the rank;
    traceback: the rank's traceback; rank: the rank it names; kind: an `ErrorKind` value this version does not know
    (from another controller version; the error itself is then `ErrorKind.ERROR`).
    """

    stage: str | None = None
    step: int | None = None
    error_type: str | None = None
    traceback: str | None = None
    rank: int | None = None
    kind: str | None = None

    @classmethod
    def of(cls, value: ErrorDetails | dict | None) -> ErrorDetails:
        """`value` as ErrorDetails: None -> empty; a dict (a controller of an older version sends one) -> its
        known keys (the others dropped)."""
        if value is None:
            return cls()
        if isinstance(value, ErrorDetails):
            return value
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(value).items() if k in names})


class ControllerError(RuntimeError):
    """An error reported by the controller or the fleet (message says rank, stage, step where known).

    `kind`: an `ErrorKind` or its string value (converted; an unknown one, e.g. from another controller version,
    becomes `ErrorKind.ERROR` with the original in `details.kind`). `details`: `ErrorDetails` (a dict is read
    through `ErrorDetails.of`)."""

    def __init__(self, message: str, kind: ErrorKind | str = ErrorKind.ERROR, fleet_lost: bool = False,
                 details: ErrorDetails | dict | None = None):
        super().__init__(message)
        details = ErrorDetails.of(details)
        try:
            self.kind = ErrorKind(kind)
        except ValueError:  # a kind from another version of the controller: keep its message, name the kind
            self.kind = ErrorKind.ERROR
            details = dataclasses.replace(details, kind=str(kind))
        self.fleet_lost = fleet_lost
        self.details = details


class FleetBusy(ControllerError):
    """The fleet is running another job (answered at once, never queued)."""


class JobCancelled(ControllerError):
    """The job was cancelled; every rank stopped at the same step boundary and the fleet stays."""
