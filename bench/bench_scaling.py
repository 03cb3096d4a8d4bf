"""Real multi-GPU scaling on one host (NCCL): stage-1 sequence-parallel forward and stage-2 tiled forward at
W = 1, 2, 4, 8, with a bf16 parity check of SP against W = 1 (issue #10).

Every rank builds the same 19B-shaped random bf16 transformer in its GPU's memory (same seed on every device), runs
the same inputs, and rank 0 reports the median forward time over `--iters` (after one warm-up), the speedup and the
parallel efficiency (speedup / W). Parity: the W-rank SP output (video and audio) against the W = 1 output of the
same run, relative L2 error (bf16 tolerance: 1e-2 — bf16 keeps 8 mantissa bits, so a different reduction order in
attention and the all_to_all split moves results by a few units of 2^-8 relative).

    python bench/bench_scaling.py --world 1,2 [--blocks 48] [--sizes 1280x704,1920x1088] [--frames 121]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from mgpu_backend.engine import latents as L  # noqa: E402
from mgpu_backend.splits.exchange import Exchange  # noqa: E402
from mgpu_backend.testing.diffusers_inputs import SequenceDriver  # noqa: E402
from mgpu_backend.testing.diffusers_inputs import TiledDriver  # noqa: E402
from mgpu_backend.splits.tiling import default_tiling  # noqa: E402

PARITY_TOL = 1e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, world: int, args, port: int, out_dir: str) -> None:
    from bench_sp import LTX2_19B, build_transformer, inputs

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    torch.manual_seed(0)
    model = build_transformer(dict(LTX2_19B, num_layers=args.blocks), device, torch.bfloat16)
    scale = 48 / args.blocks
    results = {}
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        kw, tokens = inputs(model, args.frames, height, width, 24.0, device, torch.bfloat16)
        kw = {k: v for k, v in kw.items() if k != "return_dict"}
        sp = SequenceDriver(model, Exchange(None, world, rank))
        sp.activate()
        with torch.no_grad():
            t_sp = _timed(lambda: sp(**kw), args.iters) * scale
            video, audio = sp(**kw)
            grid = (L.latent_frames(args.frames), height // 32, width // 32)
            t_tdp = float("nan")
            if world > 1:
                tiled = TiledDriver(model, grid, default_tiling(world, grid, 5), None, world, rank)
                t_tdp = _timed(lambda: tiled(**kw), args.iters) * scale
        if rank == 0:
            torch.save({"video": video.float().cpu(), "audio": audio.float().cpu()},
                       os.path.join(out_dir, f"out_{world}_{size}.pt"))
            results[size] = {"tokens": tokens, "sp_s": t_sp, "tdp_s": t_tdp}
    if rank == 0:
        with open(os.path.join(out_dir, f"times_{world}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", default="1,2")
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--sizes", default="1280x704,1920x1088")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    worlds = [int(w) for w in args.world.split(",")]
    if worlds[0] != 1:
        worlds = [1] + worlds
    out_dir = tempfile.mkdtemp(prefix="ltx2-scaling-")
    for world in worlds:
        if world > torch.cuda.device_count():
            print(f"W={world}: only {torch.cuda.device_count()} GPUs here, skipped")
            continue
        mp.spawn(_rank, args=(world, args, _free_port(), out_dir), nprocs=world, join=True)
    times = {w: json.load(open(os.path.join(out_dir, f"times_{w}.json")))
             for w in worlds if os.path.exists(os.path.join(out_dir, f"times_{w}.json"))}
    print(f"{torch.cuda.get_device_name()} ×{torch.cuda.device_count()}, bf16, {args.blocks} blocks measured "
          f"(scaled to 48), {args.frames} frames; median of {args.iters}")
    print(f"{'size':>10} {'tokens':>7} {'W':>2} {'SP fwd ms':>10} {'speedup':>8} {'eff':>5} {'TDP fwd ms':>11} "
          f"{'TDP speedup':>11} {'video rel':>10} {'audio rel':>10}")
    table = []
    for size in args.sizes.split(","):
        base = times[1][size]
        ref = torch.load(os.path.join(out_dir, f"out_1_{size}.pt"))
        for w, t in sorted(times.items()):
            r = t[size]
            out = torch.load(os.path.join(out_dir, f"out_{w}_{size}.pt"))
            rv, ra = _rel(out["video"], ref["video"]), _rel(out["audio"], ref["audio"])
            speed = base["sp_s"] / r["sp_s"]
            tdp_speed = base["sp_s"] / r["tdp_s"] if w > 1 else float("nan")
            row = dict(size=size, tokens=r["tokens"], world=w, sp_ms=r["sp_s"] * 1000, speedup=speed,
                       efficiency=speed / w, tdp_ms=r["tdp_s"] * 1000, tdp_speedup=tdp_speed, video_rel=rv,
                       audio_rel=ra, parity_ok=rv < PARITY_TOL and ra < PARITY_TOL)
            table.append(row)
            print(f"{size:>10} {r['tokens']:7d} {w:2d} {row['sp_ms']:10.1f} {speed:8.2f} {speed / w:5.2f} "
                  f"{row['tdp_ms']:11.1f} {tdp_speed:11.2f} {rv:10.2e} {ra:10.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
