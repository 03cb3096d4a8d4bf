"""Longer clips (issue 35): the longest clip one rank of a W-rank fleet can run on a memory budget, with and without
the feed-forward over token chunks, against the activation plan's prediction; and the plan's fit.

One rank of W is simulated on one GPU as bench_memory.py / bench_sharded.py do: the rank holds T/W video tokens and
the sequence-parallel exchange is `bench_memory.MemoryExchange` (the real exchange's buffers on one GPU: attention
over all T tokens with H/W heads). The transformer is 22B-shaped (`bench_sharded.LTX23_SHAPE`: 48 blocks of video
32 × 128, audio 32 × 64) with `--blocks` blocks built (activations do not grow with the block count: one block's
intermediates live at a time), block Linears fp8 (`--weights`); the rest of the rank's weights is a dummy tensor, so
that what is allocated before the forward is `--resident-gib` (the per-rank resident figure of the fleet being
modelled, e.g. 11.5 for a W = 2 sharded 22B fp8 rank, bench/results/sharded_h200.txt), plus `--gathered-gib` (a
sharded rank's two gathered blocks: 0.75). The process runs under `torch.cuda.set_per_process_memory_fraction`
(`--budget-gib`: a 24 GB card). Per W and per feed-forward mode ("off": whole; "auto": the engine's default,
`protocol/memory_plan.py auto_ff_chunk`; or a chunk in tokens), the largest 8k+1 frame count at `--size` whose one
no-grad forward (per-token timesteps, 1024 text tokens, audio at 24 fps) runs without running out of memory is
found by doubling then bisection; printed with its tokens, the measured peak, and the plan's longest clip
(`memory_plan.token_cap` with no reserve, the same budget).

    python bench/bench_long_clips.py --budget-gib 24 --resident-gib 11.5 --worlds 1,2,4 --out \\
        bench/results/long_clips_h100.txt                                  # one GPU (device machine)
    python bench/bench_long_clips.py --fit --out bench/results/activation_plan_fit.md   # the plan's fit (no GPU)
    python bench/bench_long_clips.py --tiny    # CPU smoke check: tiny model, the plan as the oracle (no CUDA stats)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mgpu_backend.protocol import memory_plan as MP  # noqa: E402

GiB = 2 ** 30
RESULTS = Path(__file__).resolve().parent / "results"
FIT_FPS, FIT_FRAMES = 24.0, 121


# ---- the plan's fit (bench/results, no GPU) ---------------------------------------------------------------------

def fit_points(results: Path = RESULTS) -> list[dict]:
    """The measured activation peaks the plan is fitted to (see `protocol/memory_plan.py`): per point its source
    file, size, W, tokens per rank n, padded total N = n·W, batch, the Linears' path, the AdaLN parameters M and the
    measured bytes above the resident weights (a sharded rank's two gathered units taken off)."""
    points = []
    row = re.compile(r"^\s+(\d+)x(\d+)\s+(\d+)\s+(\d+) \|\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+ \|\s+([\d.]+)")
    for line in (results / "memory_h200.txt").read_text().splitlines():
        m = row.match(line)
        if m:
            w, h, world, n, bf16, fp8 = m.groups()
            for linear, act in (("bf16", bf16), ("fp8", fp8)):
                points.append(dict(source="memory_h200.txt", size=f"{w}x{h}", world=int(world), n=int(n),
                                   total=int(n) * int(world), batch=1, linear=linear, mod_params=6,
                                   measured=float(act) * GiB))
    for name, linear in (("sharded_h200.json", "fp8"), ("sharded_ltx25_h200.json", "int8")):
        data = json.loads((results / name).read_text())
        for world, res in data.items():
            world = int(world)
            gathered = 2 * res["report"]["largest_unit_bytes"] if world > 1 else 0
            for r in res["rows"]:
                n = -(-r["tokens"] // world)
                points.append(dict(source=name, size=r["size"].rsplit("x", 1)[0], world=world, n=n, total=n * world,
                                   batch=r["batch"], linear=linear, mod_params=9,
                                   measured=r["peak"] - res["resident"] - gathered))
    return points


def modelled(point: dict) -> MP.ActivationTerms:
    """The plan's terms at a fit point (per-token video timesteps, per-row cross-modal ones, and the video
    self-attention before issue 35 — q, k, v held through the all_to_all —: what the benches ran)."""
    shape = MP.ActivationShape(mod_params=point["mod_params"], linear=point["linear"], timesteps="token")
    from mgpu_backend.engine.latents import audio_latent_frames

    return MP.activation_terms(point["n"], point["total"], shape, point["batch"], None,
                               audio_latent_frames(FIT_FRAMES, FIT_FPS), held_qkv=True)


def fit(points: list[dict]) -> dict[str, float]:
    """Per Linear path: the factor k of measured ≈ k · modelled, least squares through the origin
    (k = Σ x·y / Σ x²)."""
    out = {}
    for linear in MP.LINEAR_PATHS:
        xs = [modelled(p).modelled for p in points if p["linear"] == linear]
        ys = [p["measured"] for p in points if p["linear"] == linear]
        out[linear] = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return out


def fit_report(points: list[dict], fitted: dict) -> list[str]:
    lines = ["# The activation plan's fit (issue 35)", "",
             "`python bench/bench_long_clips.py --fit` on the measured peaks in bench/results/memory_h200.txt, "
             "sharded_h200.json and sharded_ltx25_h200.json (peak − resident; a sharded rank's two gathered units, "
             "2 × `largest_unit_bytes`, taken off). Model: `mgpu_backend/protocol/memory_plan.py` "
             "`activation_terms(...).modelled`; planned = FUDGE · modelled per Linear path, least squares through "
             "the origin.", "", "| path | points | FUDGE (fitted) | in memory_plan.py | residual range GiB "
             "| largest relative |", "|---|---|---|---|---|---|"]
    for linear, k in fitted.items():
        ps = [p for p in points if p["linear"] == linear]
        res = [p["measured"] - modelled(p).peak for p in ps]
        rel = max((abs(r) / p["measured"], r / GiB, p["n"]) for r, p in zip(res, ps))
        lines.append(f"| {linear} | {len(ps)} | {k:.3f} | {MP.FUDGE[linear]:.3f} | {min(res) / GiB:+.2f} … "
                     f"{max(res) / GiB:+.2f} | {rel[0] * 100:.0f} % ({rel[1]:+.2f} GiB at {rel[2]:,} tokens per "
                     f"rank) |")
    lines += ["", "Per point (GiB; residual = measured − planned with memory_plan.py's constants):", "",
              "| source | path | size | batch | W | tokens/rank | measured | planned | residual | largest moment |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        t = modelled(p)
        planned = t.peak
        lines.append(f"| {p['source']} | {p['linear']} | {p['size']} | {p['batch']} | {p['world']} | {p['n']:,} | "
                     f"{p['measured'] / GiB:.2f} | {planned / GiB:.2f} | {(p['measured'] - planned) / GiB:+.2f} "
                     f"({(p['measured'] - planned) / p['measured'] * 100:+.0f} %) | {t.moment} |")
    return lines


# ---- one rank of W on one GPU -------------------------------------------------------------------------------------

def chunk_setting(mode: str) -> int | None:
    """A `--modes` entry -> `ForwardOptions.ff_chunk_tokens`: "off" 0, "auto" None, digits that many tokens.
    Raises SystemExit for anything else."""
    if mode in ("off", "auto"):
        return 0 if mode == "off" else None
    if mode.isdigit() and int(mode) > 0:
        return int(mode)
    raise SystemExit(f"--modes {mode!r}: 'off', 'auto' or a chunk in tokens")


class Rank:
    """One simulated rank: the transformer (`blocks` blocks built), the dummy resident bytes, the budget."""

    def __init__(self, args, device, dtype):
        from bench_memory import MemoryExchange, build_transformer, quiet_diffusers
        from bench_sharded import shape_meta

        quiet_diffusers()
        self.args, self.device, self.dtype, self.MemoryExchange = args, device, dtype, MemoryExchange
        meta = shape_meta(args.tiny, 1, args.variant)
        meta["num_layers"] = args.blocks if not args.tiny else meta["num_layers"]
        self.model = build_transformer(meta, device, dtype, fp8=args.weights == "fp8" and not args.tiny)
        self.model_bytes = sum(t.numel() * t.element_size() for t in
                               list(self.model.parameters()) + list(self.model.buffers()))
        self.filler = None
        linear = "fp8" if args.weights == "fp8" and device.type == "cuda" else "bf16"
        self.shape = MP.ActivationShape.of(self.model.config, linear=linear, act_bytes=dtype.itemsize,
                                           timesteps="token")

    def set_resident(self, resident_bytes: int, gathered_bytes: int) -> None:
        """Allocate the dummy so that the model + dummy = `resident_bytes` + `gathered_bytes`."""
        self.filler = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.args.tiny:
            resident_bytes = max(resident_bytes, self.model_bytes)
        extra = resident_bytes + gathered_bytes - self.model_bytes
        if extra < 0:
            raise SystemExit(f"--resident-gib {resident_bytes / GiB:.2f}: below the {self.model_bytes / GiB:.2f} GiB "
                             f"of the {self.args.blocks} built blocks and the rest (build fewer --blocks)")
        self.filler = torch.empty(extra, dtype=torch.uint8, device=self.device)

    def forward(self, frames: int, world: int, chunk: int | None) -> dict:
        """One no-grad forward of rank 0 of `world` at `frames`; {"fits": bool, "peak": bytes | None, tokens}."""
        from bench_sharded import _inputs
        from mgpu_backend.engine import forward as model_forward
        from mgpu_backend.engine.semantics import REFERENCE
        from mgpu_backend.splits.apply import apply_plan
        from mgpu_backend.splits.sequence import UlyssesSplit
        from mgpu_backend.testing.diffusers_inputs import diffusers_batch

        w_px, h_px = self.args.width, self.args.height
        out = {"frames": frames, "tokens": None, "peak": None, "fits": False}
        dev = self.device
        try:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            kw, tokens = _inputs(self.model, frames, w_px, h_px, self.args.batch, dev, self.dtype)
            out["tokens"] = tokens
            batch, options = diffusers_batch(self.model.config, **kw)
            del kw
            options = dataclasses.replace(options, ff_chunk_tokens=chunk)
            split = UlyssesSplit(self.MemoryExchange(world))
            apply_plan(self.model, split.plan, split.exchange)
            with torch.no_grad():
                video, audio = model_forward.run_eager(self.model, batch, REFERENCE, split, options)
                del video, audio
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                out["peak"] = torch.cuda.max_memory_allocated(dev)
            out["fits"] = True
        except torch.OutOfMemoryError:
            out["fits"] = False
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        return out


def planned_longest(rank: Rank, budget: int, resident: int, gathered: int, world: int, chunk: int | None,
                    frame_tokens: int) -> tuple[int, int]:
    """(frames, per-rank token cap) the plan allows on this budget (no reserve)."""
    mb = MP.MemoryBudget(budget, resident, gathered, 0, rank.shape, rank.args.batch, chunk)
    cap = MP.token_cap(mb, world)
    return MP.frames_of_latent(MP.longest_latent_frames(cap, world, frame_tokens)), cap


def longest(rank: Rank, world: int, chunk: int | None, start_k: int, fits_by_plan=None, log=print) -> dict:
    """The largest k with frames 8k+1 that fits (doubling from `start_k`, then bisection). `fits_by_plan`: an
    oracle (frames -> bool) replacing the OOM test (CPU smoke: no memory statistics), the forward still runs."""
    cache: dict[int, dict] = {}

    def trial(k: int) -> bool:
        if k not in cache:
            t0 = time.perf_counter()
            res = rank.forward(8 * k + 1, world, chunk)
            if fits_by_plan is not None and res["fits"]:
                res["fits"] = fits_by_plan(8 * k + 1)
            res["seconds"] = time.perf_counter() - t0
            cache[k] = res
            peak = f", peak {res['peak'] / GiB:.2f} GiB" if res["peak"] else ""
            log(f"    try {8 * k + 1} frames ({res['tokens']} tokens): {'fits' if res['fits'] else 'does not fit'}"
                f"{peak} ({res['seconds']:.1f} s)")
        return cache[k]["fits"]

    top = rank.args.max_k
    k = min(max(start_k, 0), top)
    if trial(k):
        lo, hi, step = k, None, max(1, k // 4)
        while hi is None:
            if lo == top:
                return dict(cache[lo], k=lo, capped=True)
            k = min(lo + step, top)
            step *= 2
            if trial(k):
                lo = k
            else:
                hi = k
    else:
        lo, hi = None, k
        while lo is None:
            if hi == 0:
                return {"k": None}
            k = hi // 2
            if trial(k):
                lo = k
            else:
                hi = k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return dict(cache[lo], k=lo)


def run_bench(args, log) -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.zeros(1, device=device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * GiB / total), device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"# bench_long_clips.py — {datetime.date.today()} — {name} — torch {torch.__version__}")
    log(f"# command: python bench/bench_long_clips.py {' '.join(args.argv)}")
    rank = Rank(args, device, dtype)
    worlds = [int(w) for w in args.worlds.split(",")]
    residents = [float(r) for r in str(args.resident_gib).split(",")]
    if len(residents) == 1:
        residents = residents * len(worlds)
    if len(residents) != len(worlds):
        raise SystemExit(f"--resident-gib {args.resident_gib}: one figure, or one per W of --worlds {args.worlds}")
    frame_tokens = (args.height // 32) * (args.width // 32)
    budget = int(args.budget_gib * GiB)
    log(f"# {'tiny' if args.tiny else f'22B-shaped ({args.variant})'} transformer, {rank.model.config.num_layers} "
        f"blocks built ({rank.model_bytes / GiB:.2f} GiB), weights {args.weights if not args.tiny else 'float32'}, "
        f"{args.width}x{args.height} ({frame_tokens} tokens per latent frame), batch {args.batch}, budget "
        f"{args.budget_gib} GiB" + (" (the plan is the oracle: no memory statistics on the CPU)" if args.tiny else
                                    " (set_per_process_memory_fraction)"))
    summary = []
    for world, res_gib in zip(worlds, residents):
        gathered = int(args.gathered_gib * GiB) if world > 1 else 0
        resident = int(res_gib * GiB) if not args.tiny else max(int(res_gib * GiB), rank.model_bytes)
        rank.set_resident(resident, gathered)
        log(f"W={world}: resident {res_gib:.2f} GiB + gathered {gathered / GiB:.2f} GiB")
        for mode in args.modes.split(","):
            chunk = chunk_setting(mode)
            planned_frames, cap = planned_longest(rank, budget, resident, gathered, world, chunk, frame_tokens)
            oracle = None
            if args.tiny:
                def oracle(frames, world=world, chunk=chunk):
                    n = -(-MP.latent_tokens(frames, args.height, args.width) // world)
                    mb = MP.MemoryBudget(budget, resident, gathered, 0, rank.shape, args.batch, chunk)
                    return mb.peak(n, world) <= mb.available
            log(f"  ff chunk {mode}: planned longest {planned_frames} frames (cap {cap:,} tokens per rank)")
            start = max(0, (planned_frames - 1) // 8)
            got = longest(rank, world, chunk, start, oracle, log)
            if got.get("k") is None:
                line = f"W={world} ff {mode}: not even 1 frame fits"
            else:
                frames, tokens = 8 * got["k"] + 1, got["tokens"]
                per_rank = -(-tokens // world)
                used = MP.resolve_ff_chunk(chunk, per_rank, rank.shape, args.batch)
                planned = MP.MemoryBudget(budget, resident, gathered, 0, rank.shape, args.batch, chunk)
                peak = (f"peak {got['peak'] / GiB:.2f} GiB (activations {(got['peak'] - resident - gathered) / GiB:.2f}"
                        f", planned {planned.peak(per_rank, world) / GiB:.2f})" if got.get("peak")
                        else "fits by the plan (oracle)")
                bound = " (the --max-frames bound)" if got.get("capped") else ""
                line = (f"W={world} ff {mode}: longest {frames} frames{bound} = {tokens:,} tokens, {per_rank:,} per "
                        f"rank, chunk {'whole' if used is None else f'{used:,} tokens'}; {peak}; the plan: "
                        f"{planned_frames} frames")
            log("  " + line)
            summary.append(line)
    log("")
    log("summary:")
    for line in summary:
        log("  " + line)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-gib", type=float, default=24.0, help="per-process GPU memory (a 24 GB card)")
    p.add_argument("--resident-gib", default="11.5",
                   help="the rank's resident weights: one figure or one per W (e.g. 21.9,11.5,6.1)")
    p.add_argument("--gathered-gib", type=float, default=0.0,
                   help="a sharded rank's gathered blocks at W > 1 (0.75: 2 × 403 MB, sharded_h200.json)")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--size", default="1280x704", help="WIDTHxHEIGHT")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--blocks", type=int, default=2, help="transformer blocks built (activations do not grow with them)")
    p.add_argument("--weights", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--variant", choices=("2.3", "2.5"), default="2.3")
    p.add_argument("--modes", default="off,auto", help="feed-forward chunking: off, auto or a chunk in tokens")
    p.add_argument("--max-frames", type=int, default=2001)
    p.add_argument("--fit", action="store_true", help="print the activation plan's fit to bench/results (no GPU)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: the tiny model, the plan as the oracle")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    if args.fit:
        points = fit_points()
        for line in fit_report(points, fit(points)):
            log(line)
    else:
        if args.tiny:
            defaults = p.parse_args([])
            if args.budget_gib == defaults.budget_gib:
                args.budget_gib = 12 / 1024  # 12 MiB: tens of frames of the tiny model (~10 KB per token)
            if args.modes == defaults.modes:
                args.modes = "off,auto,64"  # auto does not chunk a tiny model: an explicit chunk too
            if args.resident_gib == defaults.resident_gib:
                args.resident_gib = "0"
            if args.size == defaults.size:
                args.size = "256x128"
            args.max_frames = min(args.max_frames, 801)
        args.width, args.height = (int(v) for v in args.size.split("x"))
        args.max_k = (args.max_frames - 1) // 8
        run_bench(args, log)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
