"""Per-forward round-trip cost of the native MGPU MODEL: what one ComfyUI model call costs on top of the fleet's
transformer forward (issue 19's target: ≤ 5 ms at 640×352×121, CFG batch 2, on the GPU machine).

    PYTHONPATH=. python bench/bench_native_model.py [--world-sizes 1,2] [--calls 20] [--out bench/results/x.txt]

What is measured, side by side, for the latent of a 640×352×121 video at 25 fps (video `[2, 128, 16, 11, 20]` =
3,520 tokens per row, audio `[2, 8, 121, 16]`, CFG batch 2, float32 on CPU ranks; the tiny model's context width):
- `build`: the proxy's translation of ComfyUI's forward arguments into a `ForwardRequest`
  (`nodes.native_forward.build_request`, incl. the per-row context digests), in this process;
- `round trip`: `ControllerClient.run` of the "forward" job (submit → controller → every rank → reply → client,
  pickled by value) minus the fleet's own forward time (`ForwardReply.seconds`, rank 0's wall time of the forward):
  the transport overhead a forward pays, with the context cached on the fleet (every step after the first) and
  uncached (the context shipped every call);
- `context`: the bytes a real LTX-2.3 context would add uncached (`[2, 1024, 6144]` bf16 = 24 MiB) pickled and
  unpickled in this process (the tiny model's context is 128 wide, so the real one cannot travel to it).
The transformer is the tiny random-weight model, so `forward` is small; the overhead does not depend on the model.
`--paths old,lane` (the default): each round-trip row for both transports in the same run, calls alternated: `old`
by value through the controller, `lane` with the tensors in the client's shared-memory lane (issue 27).
"""
from __future__ import annotations

import argparse
import datetime
import pickle
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_backend.protocol import native_forward as F  # noqa: E402
from mgpu_backend.serving.client import ControllerClient  # noqa: E402
from mgpu_backend.testing.tiny import make_tiny  # noqa: E402
from mgpu_backend.protocol.fleet_config import FleetConfig  # noqa: E402
from mgpu_backend.protocol.job_requests import JobSpec  # noqa: E402
from nodes import native_forward as NF  # noqa: E402

B, FRAMES, H, W, AUDIO = 2, 16, 11, 20, 121  # 640×352×121 at 25 fps: latent 16×11×20, 121 audio latents


def _inputs(width: int):
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(B, 128, FRAMES, H, W, generator=g), torch.randn(B, 8, AUDIO, 16, generator=g)]
    ts = (torch.full((B,), 0.7), torch.full((B,), 0.7))
    context = torch.randn(B, 1024, width, generator=g)
    options = {"uuids": [uuid.uuid4(), uuid.uuid4()], "cond_or_uncond": [1, 0]}
    return x, ts, context, options


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.2f} ms (min {min(values) * 1e3:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--paths", default="old,lane", help="transports, in the same run: old (by value), lane (shm)")
    args = ap.parse_args()
    transports = [p for p in args.paths.split(",") if p]
    if not transports or any(p not in ("old", "lane") for p in transports):
        ap.error(f"--paths={args.paths!r}: a comma-separated list of 'old' and 'lane'")
    torch.set_num_threads(1)
    lines = [f"# bench_native_model.py — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{platform.node() and 'CPU'} {platform.processor() or platform.machine()}, torch {torch.__version__}",
             f"# command: PYTHONPATH=. python bench/bench_native_model.py --world-sizes {args.world_sizes} "
             f"--calls {args.calls} --paths {args.paths}",
             f"# latent of 640x352x121 @ 25 fps: video [{B}, 128, {FRAMES}, {H}, {W}] ({FRAMES * H * W} tokens/row), "
             f"audio [{B}, 8, {AUDIO}, 16], CFG batch {B}, float32; tiny transformer on CPU ranks (gloo)"]
    big = torch.randn(B, 1024, 6144).to(torch.bfloat16)
    x, ts, _, options = _inputs(6144)
    builds = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        NF.build_request(x, ts, big, None, 25.0, options, None)
        builds.append(time.perf_counter() - t0)
    pickles = []
    for _ in range(5):
        t0 = time.perf_counter()
        pickle.loads(pickle.dumps(big, protocol=pickle.HIGHEST_PROTOCOL))
        pickles.append(time.perf_counter() - t0)
    lines.append(f"build (real LTX-2.3 context [2, 1024, 6144] bf16, digests incl.): {_ms(builds)}")
    lines.append(f"context pickle + unpickle, 24 MiB bf16 (what an uncached call adds before the socket): "
                 f"{_ms(pickles)}")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny(Path(tmp) / "tiny", "2.0", seed=0)
        runtime = Path(tmp) / "rt"
        client = ControllerClient(runtime)
        try:
            for ws in (int(w) for w in args.world_sizes.split(",")):
                handle = client.configure(FleetConfig(devices=("cpu",) * ws, checkpoint=str(tiny["checkpoint"]),
                                                      gemma=str(tiny["gemma"]), gemma_unload=True))
                x, ts, context, options = _inputs(128)  # the tiny LTX-2.0 processed context: 2 × 64
                first = NF.build_request(x, ts, context, None, 25.0, options, None)
                cached = NF.build_request(x, ts, context, None, 25.0, options, None,
                                          known_contexts=set(first.context_keys))
                uncached = F.ForwardRequest(**{**first.__dict__, "context_keys": ()})
                client.run(handle, JobSpec(F.FORWARD_JOB, first))  # the context rows stored on the fleet
                for name, req in (("uncached", uncached), ("cached", cached)):
                    walls = {p: [] for p in transports}
                    fwd = {p: [] for p in transports}
                    for i in range(args.calls + 1):  # the first round: a warm-up per transport
                        for path in (transports if i % 2 == 0 else transports[::-1]):
                            client.shm_lane = path == "lane"
                            t0 = time.perf_counter()
                            reply = client.run(handle, JobSpec(F.FORWARD_JOB, req))
                            if i:
                                walls[path].append(time.perf_counter() - t0)
                                fwd[path].append(reply.seconds)
                    for path in transports:
                        over = [w - f for w, f in zip(walls[path], fwd[path])]
                        lines.append(f"W={ws} {path:4s} {name:8s}: round trip {_ms(walls[path])}, fleet forward "
                                     f"{_ms(fwd[path])}, overhead {_ms(over)}  [{reply.report}]")
                        print(lines[-1], flush=True)
        finally:
            try:
                client.stop()
            except Exception:  # noqa: BLE001
                pass
            client.close()
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
