"""Controller overhead per job and frame hand-back time, against a plain memory copy of the same bytes.

    python bench/bench_controller.py                        # W = 1, 2; clips 121×1088×1920×3 and 25×544×960×3
    python bench/bench_controller.py --world-sizes 1 --clips 25x544x960 --jobs 20

What is measured (CPU ranks, gloo; the tiny model is loaded by the workers but no job here runs it):
- `ping`: one request/reply on the controller's Unix socket (HMAC-authenticated connection already open);
- `noop job`: submit -> accepted -> result of a job with no work, through the controller and every rank (the
  fixed cost a real job pays on top of its compute);
- `per step`: the cost of one synchronized step boundary (rank 0's cancel flag broadcast to all ranks) plus one
  progress event streamed to the client, from jobs of 0 and 50 empty steps;
- `hand-back`: a `[F, H, W, 3]` float32 clip from rank 0 to the client: the worker's copy into a new
  shared-memory block, the result message, and the client's copy out of it (then the block is unlinked); from the
  worker's clock just before the copy to the tensor in the client's hands. Side by side: `numpy copy`, a plain
  `ndarray.copy()` of the same bytes in this process (fresh destination, as the hand-back's are).

Run with the repository root on PYTHONPATH (or from the root: `PYTHONPATH=. python bench/bench_controller.py`).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_backend.protocol import frames as frames_module  # noqa: E402
from mgpu_backend.serving.client import ControllerClient  # noqa: E402
from mgpu_backend.testing.tiny import make_tiny  # noqa: E402
from mgpu_backend.protocol.fleet_config import FleetConfig  # noqa: E402
from mgpu_backend.protocol.job_requests import FramesRequest, JobSpec, NoopRequest  # noqa: E402


def _clip(text: str) -> tuple[int, int, int, int]:
    f, h, w = (int(n) for n in text.lower().split("x"))
    return f, h, w, 3


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def _stats(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def numpy_copy_seconds(shape, repeat: int) -> float:
    """Best of `repeat` plain copies of a filled float32 array of `shape` into fresh memory."""
    src = np.full(shape, 0.5, dtype=np.float32)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        dst = src.copy()
        best = min(best, time.perf_counter() - t)
        del dst
        gc.collect()
    del src
    gc.collect()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="1,2", help="comma list of CPU fleet sizes for the job overhead")
    parser.add_argument("--jobs", type=int, default=50, help="noop jobs per fleet size")
    parser.add_argument("--clips", default="121x1088x1920,25x544x960", help="comma list of FxHxW clips (float32 RGB)")
    parser.add_argument("--repeat", type=int, default=3, help="hand-backs (and numpy copies) per clip; best is kept")
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    clips = [_clip(c) for c in args.clips.split(",") if c]

    with tempfile.TemporaryDirectory(prefix="ltx2-bench-") as tmp:
        paths = make_tiny(Path(tmp) / "tiny", "2.0", seed=0)
        runtime = Path(tmp) / "rt"
        client = ControllerClient(runtime_dir=runtime)
        print(f"controller pid {client.ping().pid} on {runtime / 'controller.sock'}")
        try:
            samples = []
            for _ in range(200):
                t = time.perf_counter()
                client.ping()
                samples.append(time.perf_counter() - t)
            med, p90 = _stats(samples)
            print(f"\nping round trip                       median {_ms(med)}   p90 {_ms(p90)}")

            print("\ncontroller overhead per job (noop jobs: no work on the ranks)")
            for world in world_sizes:
                config = FleetConfig(devices=("cpu",) * world, checkpoint=str(paths["checkpoint"]),
                                     gemma=str(paths["gemma"]), upscaler=str(paths["upsampler"]), dtype="float32",
                                     threads_per_worker=1)
                t = time.perf_counter()
                handle = client.configure(config)
                start = time.perf_counter() - t
                for _ in range(3):
                    client.run(handle, JobSpec("noop", NoopRequest(steps=0)))
                samples = []
                for _ in range(args.jobs):
                    t = time.perf_counter()
                    client.run(handle, JobSpec("noop", NoopRequest(steps=0)))
                    samples.append(time.perf_counter() - t)
                med, p90 = _stats(samples)
                steps = 50
                stepped = []
                for _ in range(max(3, args.jobs // 10)):
                    t = time.perf_counter()
                    client.run(handle, JobSpec("noop", NoopRequest(steps=steps)), on_event=lambda e: None)
                    stepped.append(time.perf_counter() - t)
                per_step = (statistics.median(stepped) - med) / steps
                print(f"  W={world}: fleet start {start:6.1f} s | noop job median {_ms(med)}  p90 {_ms(p90)} | "
                      f"per step (broadcast + progress event) {_ms(per_step)}")

            print("\nframe hand-back (rank 0 -> client, shared memory) vs a plain numpy copy of the same bytes")
            handle = client.configure(FleetConfig(devices=("cpu",), checkpoint=str(paths["checkpoint"]),
                                                  gemma=str(paths["gemma"]), upscaler=str(paths["upsampler"]),
                                                  dtype="float32", threads_per_worker=1))
            receive = frames_module.receive_frames
            for shape in clips:
                nbytes = int(np.prod(shape)) * 4
                copy_s = numpy_copy_seconds(shape, args.repeat)
                best, best_client = float("inf"), float("inf")
                for _ in range(args.repeat):
                    timing = {}

                    def timed_receive(result, _timing=timing):
                        t = time.perf_counter()
                        out = receive(result)
                        _timing["client"] = time.perf_counter() - t
                        return out

                    frames_module.receive_frames = timed_receive
                    try:
                        out = client.run(handle, JobSpec("frames", FramesRequest(shape)))
                        done = time.time()
                    finally:
                        frames_module.receive_frames = receive
                    assert tuple(out.frames.shape) == shape
                    if done - out.sent_at < best:
                        best, best_client = done - out.sent_at, timing["client"]
                    del out
                    gc.collect()
                label = "x".join(map(str, shape))
                print(f"  {label:<18} {nbytes / 2**30:6.2f} GiB | hand-back {best:7.3f} s "
                      f"(worker copy + message {best - best_client:6.3f} s, client copy + unlink {best_client:6.3f} s)"
                      f" | numpy copy {copy_s:7.3f} s | ratio {best / copy_s:5.2f}x | "
                      f"{nbytes / best / 2**30:5.2f} GiB/s")
        finally:
            client.stop()


if __name__ == "__main__":
    main()
