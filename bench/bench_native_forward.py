"""Per-forward round trip of the native MODEL's "forward" job (issue 19): ComfyUI's process -> controller -> ranks ->
back, with the text context shipped every call against left in the fleet's cache.

    PYTHONPATH=. python bench/bench_native_forward.py                     # W = 1, 2; 640×352×121, CFG batch 2
    PYTHONPATH=. python bench/bench_native_forward.py --world-sizes 2 --repeat 20 --out bench/results/x.txt
    PYTHONPATH=. python bench/bench_native_forward.py --device cuda --world-sizes 1   # the GPU machine (bf16)

What is measured (CPU ranks, gloo, float32; one client connection, the fleet already started):
- `transport, real bytes`: a job that does no work ("noop") carrying a `ForwardRequest` of the real LTX-2.3 sizes at
  640×352×121 with CFG batch 2 (video [2, 128, 16, 11, 20], audio [2, 8, 126, 16], per-row sigmas, bf16) — with the
  processed context [2, 1024, 6144] bf16 (24 MiB, what an uncached forward ships) and without it (what a forward
  ships once the context is cached); side by side the empty noop job (the controller's fixed cost per job). The
  reply of the real job (1.8 MB of velocities) is not in these figures: see the tiny forward's `overhead`.
- `tiny forward`: the "forward" job on the tiny LTX-2.3 model at the same latent grid (3,520 video tokens, 126 audio
  steps, B = 2; its context is [2, 1024, 96]): wall time per call at the client, the fleet's own forward time
  (`ForwardReply.seconds`, rank 0) and their difference, the round trip's overhead (request + reply transport,
  controller, unpacking) — context shipped vs cached.
- `ForwardMiss`: the tiny request through the "forward" job with cache keys the fleet does not hold: answered before
  any compute — the request's transport and the job's wrapper, with a small reply.
- `in-process`: the same forward (same request, context cached) on a `NativeEngine` in this process on the same
  device — what ComfyUI would pay with the transformer in its own process; `overhead vs in-process` is the round
  trip minus it (the issue's definition), `overhead vs fleet` the round trip minus the fleet's own forward time.
- bytes per forward: the request as pickled by the client (with / without the context) and the reply.
`--device cuda`: the ranks and the in-process engine on cuda:0 in bf16 (CUDA graphs on, as in use); W = 1 only
(NCCL refuses two ranks on one GPU). Figures: median and 90th percentile of `--repeat` calls after one warm-up call.
`--paths old,lane` (the default): every row for both transports in the same run, their calls alternated (old, lane,
old, …): `old` sends the tensors by value through the controller (`ControllerClient(shm_lane=False)`), `lane` in the
client's shared-memory lane (`protocol/shm_lane.py`, issue 27); `--paths lane` or `--paths old` for one of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pickle
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_backend.serving.client import ControllerClient  # noqa: E402
from mgpu_backend.protocol.native_forward import ForwardReply, ForwardRequest  # noqa: E402
from mgpu_backend.testing.tiny import make_tiny  # noqa: E402
from mgpu_backend.protocol.fleet_config import FleetConfig  # noqa: E402
from mgpu_backend.protocol.job_requests import JobSpec, NoopRequest  # noqa: E402

GRID = (16, 11, 20)  # 640×352×121: latent frames, height, width
AUDIO_STEPS = 126  # ~5 s of audio latents


def _request(batch: int, width: int, dtype: torch.dtype, keys: tuple[str, ...]) -> ForwardRequest:
    g = torch.Generator().manual_seed(0)
    f, h, w = GRID
    return ForwardRequest(
        video=torch.randn(batch, 128, f, h, w, generator=g).to(dtype),
        audio=torch.randn(batch, 8, AUDIO_STEPS, 16, generator=g).to(dtype),
        video_timestep=torch.full((batch,), 0.7), audio_timestep=torch.full((batch,), 0.7),
        context=torch.randn(batch, 1024, width, generator=g).to(dtype), context_keys=keys, frame_rate=25.0,
        cond_or_uncond=(1, 0)[:batch])


def _nbytes(req: ForwardRequest) -> int:
    return sum(t.numel() * t.element_size() for t in (req.video, req.audio, req.video_timestep, req.audio_timestep,
                                                      req.context) if t is not None)


def _timed(fn, repeat: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _timed_paths(client: ControllerClient, fn, paths: list[str], repeat: int) -> dict[str, list[float]]:
    """`_timed` for each transport of `paths` ("old": by value, "lane": the shared-memory lane), their calls
    alternated so that the machine's load drifts over both alike; one warm-up call each first."""
    out: dict[str, list[float]] = {p: [] for p in paths}
    for i in range(repeat + 1):
        for path in (paths if i % 2 == 0 else paths[::-1]):
            client.shm_lane = path == "lane"
            t = time.perf_counter()
            fn(path)
            if i:
                out[path].append(time.perf_counter() - t)
    return out


def _stats(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _stop(client: ControllerClient, pids: list[int]) -> None:
    """Stop the controller this bench started and wait for it and its workers to exit (SIGKILL after 30 s)."""
    try:
        client.stop()
    except Exception:  # noqa: BLE001 - already gone
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


def _in_process(paths: dict, shipped: ForwardRequest, cached: ForwardRequest, device: str, dtype: torch.dtype,
                repeat: int) -> tuple[float, float]:
    """Median / p90 seconds of the same forward on a `NativeEngine` in this process (context cached)."""
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.stages.native import NativeEngine

    components = load_components(paths["checkpoint"], dtype=dtype, device=torch.device(device))
    engine = NativeEngine(components, None, dtype, torch.device(device))
    engine.forward(shipped, engine.resolve_context(shipped)[0])  # stores the context rows

    def call():
        context, missing = engine.resolve_context(cached)
        assert not missing
        engine.forward(cached, context)
    call()  # CUDA graphs: the warm-up forward runs eagerly, the next one captures
    out = _stats(_timed(call, repeat))
    del engine, components
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu (gloo ranks, float32) or cuda (cuda:0 ranks, bf16)")
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--paths", default="old,lane", help="transports, in the same run: old (by value), lane (shm)")
    args = ap.parse_args(argv)
    transports = [p for p in args.paths.split(",") if p]
    if not transports or any(p not in ("old", "lane") for p in transports):
        ap.error(f"--paths={args.paths!r}: a comma-separated list of 'old' and 'lane'")
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    compute = torch.bfloat16 if cuda else torch.float32
    device_name = torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU"
    lines = [f"# bench_native_forward — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{device_name}, torch {torch.__version__}",
             f"# command: python bench/bench_native_forward.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"# 640×352×121 grid {GRID}, {AUDIO_STEPS} audio steps, CFG batch 2; median / p90 of {args.repeat} calls",
             f"# {os.cpu_count()} CPU cores; load average at start {os.getloadavg()[0]:.1f} (other processes share "
             f"the cores: figures are upper bounds)"]
    real = _request(2, 6144, torch.bfloat16, ("neg", "pos"))
    real_cached = dataclasses.replace(real, context=None)
    tiny = _request(2, 96, compute, ("neg", "pos"))
    tiny_cached = dataclasses.replace(tiny, context=None)
    lines.append(f"# real request: {_nbytes(real) / 2**20:.1f} MiB with the context, "
                 f"{_nbytes(real_cached) / 2**20:.2f} MiB without; tiny request {_nbytes(tiny) / 2**20:.2f} / "
                 f"{_nbytes(tiny_cached) / 2**20:.2f} MiB")
    pickled = {k: len(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)) for k, v in
               (("real", real), ("real_cached", real_cached))}
    lines.append(f"# bytes per forward (pickled by the client): real request {pickled['real'] / 2**20:.2f} MiB with the "
                 f"context, {pickled['real_cached'] / 2**20:.2f} MiB cached; a real reply (video + audio, bf16) "
                 f"{2 * 2 * (128 * GRID[0] * GRID[1] * GRID[2] + 128 * AUDIO_STEPS) / 2**20:.2f} MiB")
    with tempfile.TemporaryDirectory(prefix="ltx2-bench-native-") as tmp:
        paths = make_tiny(Path(tmp) / "tiny", "2.3", seed=0)
        client = ControllerClient(runtime_dir=Path(tmp) / "rt")
        pids = [client.ping().pid]
        inproc = _in_process(paths, tiny, tiny_cached, "cuda:0" if cuda else "cpu", compute, args.repeat)
        lines.append(f"in-process tiny forward (NativeEngine here, context cached) {inproc[0] * 1e3:8.2f} ms  "
                     f"(p90 {inproc[1] * 1e3:8.2f})")
        print(lines[-1], flush=True)
        try:
            for world in (int(w) for w in args.world_sizes.split(",")):
                devices = ("cuda:0",) * world if cuda else ("cpu",) * world
                handle = client.configure(FleetConfig(devices=devices, checkpoint=str(paths["checkpoint"]),
                                                      gemma=str(paths["gemma"]),
                                                      dtype="bfloat16" if cuda else "float32"))
                pids += list(client.status().fleet.worker_pids)
                rows = []
                for label, payload in (("empty noop job", NoopRequest()),
                                       ("noop + real request, context shipped", NoopRequest(carry=real)),
                                       ("noop + real request, context cached", NoopRequest(carry=real_cached))):
                    timed = _timed_paths(client, lambda _, p=payload: client.run(handle, JobSpec("noop", p)),
                                         transports, args.repeat)
                    for path in transports:
                        med, p90 = _stats(timed[path])
                        rows.append(f"W={world}  {path:4s} transport, {label:38s} {med * 1e3:8.2f} ms  "
                                    f"(p90 {p90 * 1e3:8.2f})")
                client.run(handle, JobSpec("forward", tiny))  # stores the rows under their keys
                # the real-size request through the forward job, answered `ForwardMiss` before any compute (keys the
                # fleet does not hold): the request's transport and the job's wrapper, with a small reply
                miss = dataclasses.replace(tiny_cached, context_keys=("missing-0", "missing-1"))
                timed = _timed_paths(client, lambda _: client.run(handle, JobSpec("forward", miss)), transports,
                                     args.repeat)
                for path in transports:
                    med, p90 = _stats(timed[path])
                    rows.append(f"W={world}  {path:4s} forward job answered ForwardMiss (request, no compute) "
                                f"{med * 1e3:8.2f} ms  (p90 {p90 * 1e3:8.2f})")
                for label, req in (("context shipped", tiny), ("context cached", tiny_cached)):
                    fleet: dict[str, list[float]] = {p: [] for p in transports}

                    def call(path, req=req, fleet=fleet):
                        reply = client.run(handle, JobSpec("forward", req))
                        assert isinstance(reply, ForwardReply), reply
                        fleet[path].append(reply.seconds)

                    timed = _timed_paths(client, call, transports, args.repeat)
                    for path in transports:
                        wall, fl = timed[path], fleet[path][1:]
                        over = [w - f for w, f in zip(wall, fl)]
                        rows.append(f"W={world}  {path:4s} tiny forward, {label:16s} wall {_stats(wall)[0] * 1e3:8.2f} "
                                    f"ms  fleet {_stats(fl)[0] * 1e3:8.2f} ms  overhead vs fleet "
                                    f"{_stats(over)[0] * 1e3:7.2f} ms (p90 {_stats(over)[1] * 1e3:7.2f}), vs in-process "
                                    f"{(_stats(wall)[0] - inproc[0]) * 1e3:7.2f} ms")
                for r in rows:
                    print(r, flush=True)
                lines += rows
        finally:
            _stop(client, pids)
    lines.append(f"# load average at end {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
