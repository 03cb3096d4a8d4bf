"""Soak the background controller: several clients submit jobs back to back for thousands of jobs on a CPU fleet,
with random cancels and a worker SIGKILL every N jobs; count what went wrong.

    python bench/soak_controller.py                                   # 3000 jobs, 2 clients, W = 2, kill every 250
    python bench/soak_controller.py --jobs 200 --clients 3 --kill-every 50 --out bench/results/soak.json

Each client is a thread with its own connection kept open (every `--reconnect-every`-th job goes out on a fresh
connection, as the ComfyUI nodes make them); it takes the next job number, submits, and on a `busy` answer (another
client's job runs) submits again after a random wait of up to `--busy-backoff-s`. Jobs: `noop` (0-3 synchronized
steps), `frames` (a small clip handed back through /dev/shm), `sample` (a tiny 3-step stage-1 job on the tiny
LTX-2.0 model) and, with `--cancel-prob`, a long noop that the client cancels after its first progress event.
Every `--kill-every` finished jobs the client that finishes it SIGKILLs a random worker of the fleet (maybe mid-job
of another client: that job ends `fleet_lost`, expected); the next job starts a new fleet.

Printed (and written to `--out` as JSON):
- completed (result), cancelled, fleet_lost (jobs hit by a kill), legit busy (another job was running);
- wrongly refused: a `busy` that named a job whose answer had reached a client BEFORE the refused submit was sent
  (the controller releases a job before it answers, so that is always wrong);
- lost: submitted, never answered within `--job-timeout-s`; other errors (anything else, listed);
- leaked /dev/shm files (blocks of this fleet's workers left there after the run), leaked processes (workers or
  other children of the controller still alive after `stop`), and the controller's RSS (+ swap: VmRSS + VmSwap)
  at start (after `--warmup` jobs) and end.
Target: 0 wrongly refused, 0 lost, 0 other errors, 0 leaked, RSS growth under 5 %.

Run with the repository root on PYTHONPATH (or from the root: `PYTHONPATH=. python bench/soak_controller.py`).
Not part of the test suite (tests/test_controller_serving.py runs short versions).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak_common import alive, descendants, leaked_blocks, rss_kib, shm_blocks  # noqa: E402
from mgpu_backend.serving.client import ControllerClient  # noqa: E402
from mgpu_backend.testing.tiny import make_tiny  # noqa: E402
from mgpu_backend.protocol.errors import ControllerError, FleetBusy, JobCancelled  # noqa: E402
from mgpu_backend.protocol.fleet_config import FleetConfig  # noqa: E402
from mgpu_backend.protocol.job_requests import FramesRequest, JobSpec, NoopRequest  # noqa: E402
from mgpu_backend.protocol.stage_requests import SampleRequest  # noqa: E402

SP_VIDEO, AUDIO = (1, 128, 2, 2, 3), (1, 8, 5, 16)


class JobTimeout(Exception):
    """No answer within the job timeout: the job is counted lost."""


def sample_payload(rng: random.Random) -> SampleRequest:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return SampleRequest(positive=torch.randn(1, 7, 64, generator=g), negative=None,
                         video=torch.randn(SP_VIDEO, generator=g), audio=torch.randn(AUDIO, generator=g),
                         noise_video=torch.randn(SP_VIDEO, generator=g), noise_audio=torch.randn(AUDIO, generator=g),
                         fps=24.0, mode="sequence_parallel", sigmas=torch.tensor([1.0, 0.7, 0.4, 0.0]))


class Soak:
    def __init__(self, args, runtime: Path, handle, controller_pid: int):
        self.args, self.runtime, self.handle, self.controller_pid = args, runtime, handle, controller_pid
        self.lock = threading.Lock()
        self.next_job = 0
        self.finished = 0
        self.answered: set[str] = set()
        self.counts = {k: 0 for k in ("completed", "cancelled", "fleet_lost", "legit_busy", "wrongly_refused",
                                      "lost", "other_errors", "kills", "reconnects")}
        self.kinds = {"noop": 0, "frames": 0, "sample": 0, "cancel": 0}
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.worker_pids: set[int] = set()
        self.rss_start: int | None = None

    def take(self) -> int | None:
        with self.lock:
            if self.next_job >= self.args.jobs:
                return None
            self.next_job += 1
            return self.next_job

    def count(self, key: str, message: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if message and key == "other_errors" and len(self.errors) < 20:
                self.errors.append(message)

    def job_for(self, rng: random.Random) -> tuple[str, JobSpec]:
        r = rng.random()
        a = self.args
        if r < a.cancel_prob:
            return "cancel", JobSpec("noop", NoopRequest(steps=200, sleep_s=0.01))
        r -= a.cancel_prob
        if r < a.sample_prob:
            return "sample", JobSpec("sample", sample_payload(rng))
        r -= a.sample_prob
        if r < a.frames_prob:
            return "frames", JobSpec("frames", FramesRequest((5, 32, 48, 3)))
        return "noop", JobSpec("noop", NoopRequest(steps=rng.randrange(4)))

    def run_one(self, client: ControllerClient, label: str, job: JobSpec, rng: random.Random) -> str:
        """Submit until not busy; returns the outcome."""
        deadline = [0.0]
        progressed = threading.Event()

        def cancel_requested() -> bool:
            if time.monotonic() > deadline[0]:
                raise JobTimeout(f"job {job.job_id} ({label}): no answer within {self.args.job_timeout_s:g} s")
            return label == "cancel" and progressed.is_set()

        def on_accepted(event):
            with self.lock:
                self.worker_pids.update(event.worker_pids)

        while True:
            with self.lock:
                answered_before = set(self.answered)
            deadline[0] = time.monotonic() + self.args.job_timeout_s
            try:
                out = client.run(self.handle, job, on_event=lambda e: progressed.set(), on_accepted=on_accepted,
                                 cancel_requested=cancel_requested, poll_s=0.05)
            except FleetBusy as exc:
                named = re.search(r"\(([0-9a-f]{12})\)", str(exc))
                if named and named.group(1) in answered_before:
                    with self.lock:
                        self.wrong.append(str(exc))
                    self.count("wrongly_refused")
                else:
                    self.count("legit_busy")
                job = JobSpec(job.kind, job.payload)  # a new id for the new submit
                time.sleep(rng.uniform(0.0, self.args.busy_backoff_s))
                continue
            except JobCancelled:
                outcome = "cancelled"
            except ControllerError as exc:
                outcome = "fleet_lost" if exc.fleet_lost else "other_errors"
                if outcome == "other_errors":
                    self.count(outcome, f"{label}: {exc.kind}: {exc}")
                    outcome = "counted"
            else:
                outcome = "completed"
                if label == "frames":
                    frames = out.frames
                    if frames.shape != (5, 32, 48, 3) or abs(float(frames[4, 0, 0, 0]) - 0.8) > 1e-6:
                        self.count("other_errors", f"frames: wrong clip back {tuple(frames.shape)}")
                        outcome = "counted"
            with self.lock:
                self.answered.add(job.job_id)
            if outcome != "counted":
                self.count(outcome)
            return outcome

    def maybe_kill(self, rng: random.Random) -> None:
        with self.lock:
            self.finished += 1
            due = self.args.kill_every and self.finished % self.args.kill_every == 0
        if not due:
            return
        status = ControllerClient(self.runtime, start=False)
        try:
            fleet = status.status().fleet
        finally:
            status.close()
        if fleet:
            victim = rng.choice(fleet.worker_pids)
            try:
                os.kill(victim, signal.SIGKILL)
                self.count("kills")
            except ProcessLookupError:
                pass

    def client_loop(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        client = ControllerClient(self.runtime, start=False)
        try:
            while (n := self.take()) is not None:
                if self.args.reconnect_every and n % self.args.reconnect_every == 0:
                    client.close()
                    client = ControllerClient(self.runtime, start=False)
                    self.count("reconnects")
                label, job = self.job_for(rng)
                with self.lock:
                    self.kinds[label] += 1
                try:
                    self.run_one(client, label, job, rng)
                except JobTimeout as exc:
                    self.count("lost")
                    with self.lock:
                        self.errors.append(str(exc))
                    client.close()
                    client = ControllerClient(self.runtime, start=False)
                except (EOFError, OSError) as exc:  # the connection broke: the job was not answered
                    self.count("lost")
                    with self.lock:
                        self.errors.append(f"connection lost: {type(exc).__name__}: {exc}")
                    client = ControllerClient(self.runtime, start=False)
                except Exception as exc:  # noqa: BLE001 - anything else is counted, and the client goes on
                    self.count("other_errors", f"{label}: {type(exc).__name__}: {exc}")
                    client.close()
                    client = ControllerClient(self.runtime, start=False)
                if n == self.args.warmup:
                    self.rss_start = rss_kib(self.controller_pid)
                self.maybe_kill(rng)
                if n % 500 == 0:
                    print(f"  {n} jobs submitted, controller RSS {rss_kib(self.controller_pid) / 1024:.1f} MiB",
                          flush=True)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--kill-every", type=int, default=250, help="SIGKILL a worker every N finished jobs (0: never)")
    parser.add_argument("--cancel-prob", type=float, default=0.03)
    parser.add_argument("--sample-prob", type=float, default=0.05, help="share of tiny stage-1 'sample' jobs")
    parser.add_argument("--frames-prob", type=float, default=0.2, help="share of /dev/shm 'frames' jobs")
    parser.add_argument("--reconnect-every", type=int, default=10, help="every Nth job on a fresh connection")
    parser.add_argument("--warmup", type=int, default=200, help="jobs before the start RSS is taken")
    parser.add_argument("--job-timeout-s", type=float, default=180.0)
    parser.add_argument("--busy-backoff-s", type=float, default=0.02, help="wait up to this long before a retry")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--keep-log", default=None, help="copy the controller's log here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    cache = Path(os.environ.get("LTX2_MGPU_CACHE") or Path.home() / ".cache" / "ltx2-multigpu")
    files = make_tiny(cache / "tiny-2.0-seed0", "2.0", seed=0)
    runtime = Path(tempfile.mkdtemp(prefix="ltx2-soak-"))
    shm_before = shm_blocks()
    config = FleetConfig(devices=("cpu",) * args.world_size, checkpoint=str(files["checkpoint"]),
                         gemma=str(files["gemma"]), upscaler=str(files["upsampler"]), dtype="float32",
                         threads_per_worker=1, stall_timeout_s=60.0, init_timeout_s=120.0)
    t0 = time.monotonic()
    first = ControllerClient(runtime)
    controller_pid = first.ping().pid
    rss_launch = rss_kib(controller_pid)
    handle = first.configure(config)
    first.close()
    soak = Soak(args, runtime, handle, controller_pid)
    print(f"soak: {args.jobs} jobs, {args.clients} clients, W = {args.world_size} CPU ranks, a worker SIGKILL every "
          f"{args.kill_every} jobs, cancel p = {args.cancel_prob}; controller pid {controller_pid}", flush=True)
    threads = [threading.Thread(target=soak.client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    rss_end = rss_kib(controller_pid)
    children = descendants(controller_pid)
    log_lines = (runtime / "controller.log").read_text().splitlines()
    job_lines = sum(1 for line in log_lines if re.search(r" job [0-9a-f]{12} \w+ from ", line))
    starts = sum(1 for line in log_lines if re.search(r"fleet generation \d+ started", line))
    stopper = ControllerClient(runtime, start=False)
    stopper.stop()
    stopper.close()
    end = time.monotonic() + 30
    watched = soak.worker_pids | children | {controller_pid}
    while time.monotonic() < end and any(alive(p) for p in watched):
        time.sleep(0.2)
    leaked_procs = sorted(p for p in watched if alive(p))
    for p in leaked_procs:
        os.kill(p, signal.SIGKILL)
    # /dev/shm is shared with every other process of the machine: count the blocks our workers made and anything
    # else new, separately
    new_shm = sorted(shm_blocks() - shm_before)
    leaked_shm = leaked_blocks(shm_before, soak.worker_pids)
    c = soak.counts
    rss_start = soak.rss_start or rss_launch
    growth = (rss_end - rss_start) / rss_start * 100
    figures = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "command": "python bench/soak_controller.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "jobs": args.jobs, "clients": args.clients, "world_size": args.world_size, "seconds": round(seconds, 1),
        "job_kinds": soak.kinds, **c,
        "answered": c["completed"] + c["cancelled"] + c["fleet_lost"] + c["other_errors"],
        "fleet_starts": starts, "log_job_lines": job_lines,
        "leaked_shm_files": len(leaked_shm), "other_new_shm_files": len(new_shm) - len(leaked_shm),
        "leaked_processes": len(leaked_procs),
        "controller_rss_launch_mib": round(rss_launch / 1024, 1),
        "controller_rss_start_mib": round(rss_start / 1024, 1), "controller_rss_end_mib": round(rss_end / 1024, 1),
        "rss_growth_percent": round(growth, 2), "errors": soak.errors[:20], "wrong_busy": soak.wrong[:5],
        "leaked_shm": leaked_shm[:10], "leaked_pids": leaked_procs[:10],
    }
    print(f"jobs completed      {c['completed']} of {args.jobs}  (the others: cancelled {c['cancelled']}, hit by a "
          f"kill {c['fleet_lost']}; kinds {soak.kinds})")
    print(f"wrongly refused     {c['wrongly_refused']}  (legit busy answers, retried: {c['legit_busy']})")
    print(f"lost                {c['lost']}  (other errors: {c['other_errors']})")
    print(f"worker kills        {c['kills']}  (fleet starts: {starts}; log job lines: {job_lines})")
    print(f"leaked /dev/shm     {len(leaked_shm)}  (other new files there, not from this fleet: "
          f"{len(new_shm) - len(leaked_shm)})")
    print(f"leaked processes    {len(leaked_procs)}")
    print(f"controller RSS+swap start {rss_start / 1024:.1f} MiB (after {args.warmup} jobs; at launch "
          f"{rss_launch / 1024:.1f}), end {rss_end / 1024:.1f} MiB: {growth:+.2f} %")
    print(f"wall time           {seconds:.1f} s")
    for e in soak.errors[:10]:
        print(f"  error: {e}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    if args.keep_log:
        shutil.copy(runtime / "controller.log", args.keep_log)
    shutil.rmtree(runtime, ignore_errors=True)
    ok = (c["wrongly_refused"] == 0 and c["lost"] == 0 and c["other_errors"] == 0 and not leaked_shm
          and not leaked_procs and growth < 5.0)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
