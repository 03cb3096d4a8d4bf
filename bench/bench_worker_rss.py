"""A worker's host memory (the figure `resources.WORKER_RSS_BYTES` refuses oversized fleets with) and how soon the
workers end after their controller is killed (issue 24).

    PYTHONPATH=. python bench/bench_worker_rss.py [--rounds 3] [--world-size 2]

What is measured (CPU ranks, gloo, the tiny LTX-2.0 model with its Gemma and upscaler, float32):
- `status` of a fresh controller's fleet: every process it owns with its RSS (VmRSS, /proc), and each worker's
  anonymous / file-backed split (RssAnon / RssFile: shared libraries are file-backed);
- the controller SIGKILLed (no teardown: as the OOM killer would): milliseconds until every worker is gone, polled
  every millisecond (parent-death signal and watched pipe, `worker_start.bind_to_parent`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_backend.serving.client import ControllerClient  # noqa: E402
from mgpu_backend.testing.tiny import make_tiny  # noqa: E402
from mgpu_backend.protocol.fleet_config import FleetConfig  # noqa: E402


def status_mib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024
    return out


def alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # the controller is our child: reap it
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ltx2-rss-"))
    try:
        files = make_tiny(root / "tiny", "2.0", 0)
        config = FleetConfig(devices=("cpu",) * args.world_size, checkpoint=str(files["checkpoint"]),
                             gemma=str(files["gemma"]), upscaler=str(files["upsampler"]))
        for i in range(args.rounds):
            client = ControllerClient(root / f"rt{i}")
            handle = client.configure(config)
            status = client.status()
            client.close()
            for p in status.processes:
                split = status_mib(p.pid) if p.role.startswith("worker") else {}
                print(f"round {i}: {p.role:<40} pid {p.pid:>7}  RSS {p.rss_bytes / 2**20:6.0f} MiB  {split}")
            t0 = time.monotonic()
            os.kill(status.pid, signal.SIGKILL)
            while any(alive(p) for p in handle.worker_pids):
                time.sleep(0.001)
            print(f"round {i}: {args.world_size} workers gone {1000 * (time.monotonic() - t0):.1f} ms after the "
                  f"controller's SIGKILL")
            alive(status.pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
