"""The worker fleet as the controller sees it: spawn, health, one job at a time, failure detection, teardown.

Failure handling (docs/design/fleet.md#errors):
- an error raised on every rank (bad input, found before any collective) is returned and the fleet stays;
- a worker that dies, a job with no step progress for `stall_timeout_s` (one rank stalls and the others wait in a
  collective), or an error on only some ranks tears the fleet down and is reported with rank, stage and step; the
  next job starts a fresh fleet. Workers are separate processes, so the controller (and the client) never dies
  because a worker did.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

from ..protocol.frames import frames_ref, free_frames, remove_orphans
from ..protocol.fleet_rules import top_sp_degree, valid_sp_degrees
from ..protocol.errors import ControllerError, ErrorDetails, ErrorKind, JobCancelled
from ..protocol.fleet_config import FleetConfig, FleetPlan, FleetPolicy
from ..protocol.job_requests import JOB_STAGES, JobSpec
from ..protocol.job_results import FleetDescription
from ..protocol.messages import Progress
from ..protocol.transport import Pickled, send_inline
from ..protocol.worker_messages import JobDone, JobFailed, JobProgress, JobStopped, RunJob, StopWorker, WorkerInitError, WorkerMessage, WorkerReady
from ..protocol.resources import FleetTooLarge, check_fleet, oom_text, write_pid_file
from .worker import clean_allocator_env
from .worker_start import WorkerLinks, start as start_worker

# how long the other ranks get to report the same error before an error is treated as asymmetric
ERROR_GRACE_S = 10.0
# how long a fleet gets to stop cleanly before its workers are killed
STOP_GRACE_S = 10.0

EventFn = Callable[[Progress], None]

log = logging.getLogger("ltx2_mgpu.fleet")

# Workers get PR_SET_PDEATHSIG (worker_start.bind_to_parent, before they import torch), which fires when the *thread* that spawned them ends, not
# the process: every worker is started from this one thread, which lives as long as the process (the controller
# starts fleets from per-connection threads that end with their client).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ltx2-mgpu-spawner")


def exit_text(code: int | None) -> str:
    """`exit code 17`, `exit code -9 (SIGKILL)` for a worker's `Process.exitcode`."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class Fleet:
    """W worker processes, rank r on `config.devices[r]`, started from `config.identity` (what they load) under
    `config.policy`; each job may run under another policy (`run`), which changes no process.

    Raises ControllerError (fleet_lost=True) when a worker fails to start, naming the rank and the cause.
    """

    def __init__(self, config: FleetConfig, generation: int, pid_dir: Path | None = None):
        """`pid_dir`: where each worker's pid file is kept until it is reaped (the controller's runtime directory,
        `resources.reap`). Raises ControllerError (kind "validation") for a fleet this host cannot run
        (`resources.check_fleet`), before any process starts."""
        try:
            self.memory = check_fleet(config)  # the host's memory figures, for a worker's SIGKILL (`_death_text`)
        except FleetTooLarge as exc:
            raise ControllerError(str(exc), kind=ErrorKind.VALIDATION) from None
        self.config, self.generation = config, generation  # the configuration it was started with
        self.identity = config.identity  # what makes a fleet this one (the controller compares it)
        self.policy = config.policy  # the policy of the last job (status)
        self.world_size = config.world_size
        self.pid_dir = pid_dir
        self._starting = None  # the spawner thread's `Process.start` of the newest worker
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="ltx2-mgpu-fleet-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self.cancel_flag = ctx.Value("i", 0)
        self.heartbeat = ctx.Array("d", 2 * self.world_size)
        self.conns, self.processes = [], []
        self.pids: tuple[int, ...] = ()
        self.open_counts: list[int] = [0] * self.world_size
        self.load_seconds = 0.0
        self.heads: int | None = None  # the loaded transformer's attention heads (`WorkerReady`)
        self.int8_compute: str | None = None  # the int8 path rank 0 took (`WorkerReady.int8_compute`), for status
        self.link = None  # rank 0's `WorkerReady.link` (protocol.link.LinkReport) and predicted step times, for status
        self.predicted: tuple[str, ...] = ()
        self.placement = None  # where the weights went (`WorkerReady.placement`, rank 0's), for the plan
        self.lost: str | None = None
        # frames blocks handed to clients lately (theirs to unlink); any other block of this fleet's workers left in
        # /dev/shm at teardown is an orphan (e.g. written by rank 0 of a job another rank's death ended)
        self.handed_out: collections.deque[str] = collections.deque(maxlen=64)
        # the workers watch the read end: when this process dies its write end closes and they exit (serving/worker.py)
        watch, self._watch = ctx.Pipe(duplex=False)
        try:
            self._spawn(ctx, init_file, watch)
            watch.close()
            self._wait_ready()
        except BaseException as exc:  # a failed or interrupted start (a signal, a timeout) leaves no process
            watch.close()
            self._abort_start(exc)
            raise

    def _spawn(self, ctx, init_file: str, watch) -> None:
        saved_env = dict(os.environ)
        os.environ.clear()
        os.environ.update(clean_allocator_env(saved_env))  # inherited by the spawned workers
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=start_worker, name=f"ltx2-mgpu-rank{rank}", daemon=True,
                                   args=(rank, self.identity, self.config.policy, init_file,
                                         WorkerLinks(child, self.cancel_flag, self.heartbeat, os.getpid(), watch)))
                self.conns.append(parent)
                self.processes.append(proc)
                self._starting = _SPAWNER.submit(proc.start)
                self._starting.result()
                child.close()
                self.pids += (proc.pid,)
                if self.pid_dir is not None:
                    write_pid_file(self.pid_dir, proc.pid, rank=rank, generation=self.generation)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)

    def _abort_start(self, exc: BaseException) -> None:
        """Reap every worker a start spawned (`_fail` may have already) and log why it did not finish."""
        if self._starting is not None:  # an interrupt in `_spawn` may come while the spawner thread starts one
            self._starting.exception()
        started = [p.pid for p in self.processes if p.pid is not None]
        why = str(exc) if isinstance(exc, ControllerError) else f"interrupted by {type(exc).__name__}: {exc}"
        if self.lost is None:
            self.lost = why
            self.shutdown(graceful=False)
        log.warning("fleet generation %d did not start (%d of %d worker(s) spawned, pids %s, all reaped): %s",
                    self.generation, len(started), self.world_size, started, why)

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.init_timeout_s
        ready: set[int] = set()
        while len(ready) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - ready)
                self._fail(f"fleet start timed out after {self.config.init_timeout_s:g} s; ranks {missing} did not "
                           f"report ready")
            for rank, message in self._receive(remaining):
                if isinstance(message, WorkerReady):
                    ready.add(rank)
                    self.open_counts[rank] = message.open_count
                    self.load_seconds = max(self.load_seconds, message.load_seconds)
                    self.heads = message.heads
                    if rank == 0:
                        self.int8_compute = getattr(message, "int8_compute", None)
                        self.link, self.predicted = message.link, tuple(message.predicted)
                        self.placement = getattr(message, "placement", None)
                elif isinstance(message, WorkerInitError):
                    self._fail(f"rank {rank} failed to start: {message.error}",
                               details=ErrorDetails(traceback=message.traceback))

    def _receive(self, timeout: float) -> list[tuple[int, WorkerMessage]]:
        """Messages from the workers within `timeout`; a dead worker raises ControllerError."""
        by_object = {id(c): r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes)}
        out = []
        for ready in wait(list(self.conns) + list(sentinels), timeout=timeout):
            if isinstance(ready, int):
                self._died(sentinels[ready])
            else:
                rank = by_object[id(ready)]
                try:
                    out.append((rank, ready.recv()))
                except (EOFError, OSError):
                    # a worker that dies closes its pipe too: report the death (exit code, where), not the pipe
                    self.processes[rank].join(5)
                    if not self.processes[rank].is_alive():
                        self._died(rank)
                    self._fail(f"lost the connection to worker rank {rank} (pid {self.pids[rank]})" + self._where(rank))
        return out

    def _died(self, rank: int) -> None:
        self.processes[rank].join(5)
        code = self.processes[rank].exitcode
        self._drain_progress()  # rank 0's progress sent before the death names the stage in the report
        self._fail(self._death_text(rank, code, self._where(rank)))

    def _death_text(self, rank: int, code: int | None, when: str = "") -> str:
        """"worker rank R (pid P) died with exit code C{when}" (`when`: where the job was, or " while the fleet was
        idle"); for SIGKILL, what most often sends it — the kernel's out-of-memory killer — with the fleet's memory
        figures (`resources.oom_text`)."""
        text = f"worker rank {rank} (pid {self.pids[rank]}) died with {exit_text(code)}{when}"
        if code == -getattr(signal, "SIGKILL", 9):
            text += f": {oom_text(getattr(self, 'memory', None))}"
        return text

    def _drain_progress(self) -> None:
        for conn in self.conns:
            try:
                while conn.poll(0):
                    message = conn.recv()
                    if isinstance(message, JobProgress):
                        self._stage = (message.stage, message.step, message.total)
            except (EOFError, OSError):
                continue

    def _fail(self, message: str, details: ErrorDetails | None = None) -> None:
        self.lost = message
        self.shutdown(graceful=False)
        raise ControllerError(message, kind=ErrorKind.FLEET_LOST, fleet_lost=True, details=details)

    def alive(self) -> bool:
        return self.lost is None and all(p.is_alive() for p in self.processes)

    def death(self) -> str | None:
        """Why this fleet is not alive: the failure that tore it down, or a worker that died between jobs (e.g.
        killed by a user or the OOM killer); None while it is alive or after a plain shutdown."""
        if self.lost is not None:
            return None if self.lost == "shut down" else self.lost
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                proc.join(1)
                return self._death_text(rank, proc.exitcode, " while the fleet was idle")
        return None

    def plan_for(self, policy: FleetPolicy) -> FleetPlan:
        """The split this fleet's jobs get under `policy`: the heads its workers loaded (`WorkerReady.heads`) and the
        degree rule the workers apply (`protocol.fleet_rules.top_sp_degree`, as `ParallelPlan.for_policy`). Raises
        ValidationError for a degree the heads do not allow (the controller's `check_config` refuses it first)."""
        heads = self.heads or 1
        placement = getattr(self, "placement", None)  # the weights' placement the workers reported
        if not self.identity.sequence_parallel:
            return FleetPlan(self.world_size, heads, 1, (1,), sequence_parallel=False, placement=placement)
        return FleetPlan(self.world_size, heads, top_sp_degree(heads, self.world_size, policy.sp_degree),
                         tuple(valid_sp_degrees(heads, self.world_size)), set_by_policy=policy.sp_degree is not None,
                         placement=placement)

    def describe(self) -> FleetDescription:
        """The fleet for status answers and for saying what a stop or a rebuild replaces (the one place a
        `FleetDescription` is built)."""
        return FleetDescription(
            generation=self.generation, devices=tuple(self.config.devices), worker_pids=tuple(self.pids),
            checkpoint=self.config.checkpoint, weights=self.config.weights, load_seconds=self.load_seconds,
            int8_compute=self.int8_compute, policy=self.policy, plan=self.plan_for(self.policy),
            open_counts=tuple(self.open_counts), link=self.link, predicted=self.predicted,
            transformer_only=self.identity.transformer_only)

    def shutdown(self, graceful: bool = True) -> None:
        if graceful and self.lost is None:
            for conn in self.conns:
                try:
                    conn.send(StopWorker())
                except OSError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in self.processes:
                if proc.pid is not None:
                    proc.join(max(0.0, deadline - time.monotonic()))
        started = [p for p in self.processes if p.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.kill()
        for proc in started:
            proc.join(5)
            if self.pid_dir is not None and not proc.is_alive():  # one still running keeps its record
                (self.pid_dir / f"{proc.pid}.json").unlink(missing_ok=True)
        for conn in self.conns:
            conn.close()
        self._watch.close()
        self.lost = self.lost or "shut down"
        self._tmp.cleanup()
        self._remove_orphan_frames()

    def _remove_orphan_frames(self) -> None:
        """Unlink the /dev/shm frames blocks this fleet's workers wrote that no client was handed."""
        remove_orphans(self.pids, keep=self.handed_out)

    # ---- jobs ---------------------------------------------------------------------------------------------------

    _stage: tuple[str, int, int] | None = None  # rank 0's last reported (stage, step, total) of the running job
    _job_stage: str | None = None  # what the running job does before its first progress event (JOB_STAGES)

    def _where(self, rank: int) -> str:
        begun = f"rank {rank} had begun {int(self.heartbeat[2 * rank])} steps of the job"
        if self._stage is None:
            return f" during {self._job_stage} (before its first step; {begun})" if self._job_stage else ""
        stage, step, total = self._stage
        if total and step >= total:  # e.g. the decode after the last sampling stage, which reports no steps
            return f" after {stage} had finished ({step}/{total} steps; {begun})"
        return f" during {stage} (rank 0 at step {step}/{total}, {begun})"

    def cancel(self) -> None:
        """Ask rank 0 to stop the running job at the next step boundary (all ranks stop there together)."""
        self.cancel_flag.value = 1

    def run(self, spec: JobSpec, on_event: EventFn, policy: FleetPolicy | None = None) -> Any:
        """Run one job on every rank under `policy` (None: the start configuration's); stream rank 0's progress to
        `on_event`; return rank 0's result (a typed result of `protocol.job_results` / `protocol/native_forward.py`, or a
        `transport.Pickled` of one). The policy reaches every rank with the job (no process restarts).

        Raises JobCancelled, ControllerError (kind "job_error": same error on every rank, fleet kept; kind
        "fleet_lost": crash, stall or asymmetric error, fleet torn down).
        """
        results: dict[int, Any] = {}
        try:
            self.policy = policy or self.config.policy
            result = self._run(spec, on_event, results, self.policy)
        except BaseException:
            for r in results.values():  # e.g. rank 0's frames when another rank then died: nobody will read them
                free_frames(r)
            raise
        ref = frames_ref(result)
        if ref is not None:
            self.handed_out.append(ref.name)
        return result

    def _run(self, spec: JobSpec, on_event: EventFn, results: dict[int, Any], policy: FleetPolicy) -> Any:
        # the cancel flag is cleared by the controller when the job becomes current (a cancel may come before this)
        for i in range(2 * self.world_size):
            self.heartbeat[i] = 0.0
        self._stage = None
        self._job_stage = JOB_STAGES.get(spec.kind, f"{'an' if spec.kind[:1] in 'aeiou' else 'a'} {spec.kind} job")
        positions: dict[int, tuple[str, int]] = {}
        if isinstance(spec.payload, Pickled):  # a client's small INLINE_JOBS payload: by value to every rank
            send_inline(self.conns, RunJob(spec, policy))
        else:
            for conn in self.conns:
                conn.send(RunJob(spec, policy))
        errors: dict[int, JobFailed] = {}
        cancelled: set[int] = set()
        last_progress = time.monotonic()
        last_steps = tuple(self.heartbeat[2 * r] for r in range(self.world_size))
        first_error_at: float | None = None
        # an error the other ranks have not reported within this long is asymmetric (they wait in a collective)
        stall_timeout = policy.stall_timeout_s
        error_grace = min(ERROR_GRACE_S, stall_timeout)
        while len(results) + len(errors) + len(cancelled) < self.world_size:
            for rank, message in self._receive(timeout=1.0):
                if isinstance(message, JobProgress):
                    self._stage = (message.stage, message.step, message.total)
                    on_event(Progress(spec.job_id, message.stage, message.step, message.total))
                    last_progress = time.monotonic()
                elif isinstance(message, JobDone):
                    results[rank] = message.result
                elif isinstance(message, JobStopped):
                    cancelled.add(rank)
                    positions[rank] = (message.stage, message.step)
                elif isinstance(message, JobFailed):
                    errors[rank] = message
                    positions[rank] = (message.stage, message.step)
                    first_error_at = first_error_at or time.monotonic()
                if isinstance(message, (JobDone, JobStopped, JobFailed)):
                    self.open_counts[rank] = message.open_count  # the worker's loader.OPEN_COUNT after the job
            steps = tuple(self.heartbeat[2 * r] for r in range(self.world_size))
            if steps != last_steps:
                last_steps, last_progress = steps, time.monotonic()
            stalled = time.monotonic() - last_progress > stall_timeout
            if errors and (stalled or time.monotonic() - first_error_at > error_grace):
                self._asymmetric_error(errors)  # the error is the cause; the others wait for the failed rank
            if stalled:
                self._stalled(steps, stall_timeout)
        if cancelled:
            if len(cancelled) != self.world_size:
                self._fail(f"cancel reached only ranks {sorted(cancelled)}; the fleet was torn down")
            stage, step = positions[0]
            raise JobCancelled(f"job {spec.job_id} cancelled before {stage} step {step + 1}",
                               kind=ErrorKind.CANCELLED)
        if errors:
            if len(errors) != self.world_size:
                self._asymmetric_error(errors)
            rank0 = errors[0]
            kind = ErrorKind.VALIDATION if all(e.bad_input for e in errors.values()) else ErrorKind.JOB_ERROR
            # bad input reads as in one process ("error: frames=10: …"); other errors keep their class name
            message = rank0.message if kind == ErrorKind.VALIDATION else f"{rank0.error_type}: {rank0.message}"
            raise ControllerError(message, kind=kind, details=ErrorDetails(stage=rank0.stage, step=rank0.step,
                                                                           error_type=rank0.error_type,
                                                                           traceback=rank0.traceback))
        return results[0]

    def _asymmetric_error(self, errors: dict[int, JobFailed]) -> None:
        rank, e = sorted(errors.items())[0]
        others = sorted(set(range(self.world_size)) - set(errors))
        self._fail(f"rank {rank} failed during {e.stage} step {e.step} with {e.error_type}: {e.message} (ranks "
                   f"{others} did not fail; a collective would hang) — the fleet was torn down",
                   details=ErrorDetails(traceback=e.traceback))

    def _stalled(self, steps: tuple[float, ...], stall_timeout: float) -> None:
        """A rank that stalls before a step boundary has begun fewer steps than those waiting for it there; when all
        have begun as many, the hang is inside a step (e.g. a collective of the model) and no single rank is named."""
        fewest = min(steps)
        behind = [r for r in range(self.world_size) if steps[r] == fewest]
        if len(behind) == 1 or len(behind) < self.world_size:
            who = f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} stalled{self._where(behind[0])}"
        else:
            who = f"all ranks stalled inside a step{self._where(0)}"
        self._fail(f"no progress for {stall_timeout:g} s: {who}; "
                   f"steps begun per rank: {[int(s) for s in steps]} — the fleet was torn down")


_generations = itertools.count(1)


def next_generation() -> int:
    return next(_generations)
