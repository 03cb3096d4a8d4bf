"""Predicted multi-GPU scaling of LTX-2 on NVLink H200s from the cost model (`mgpu_backend/splits/cost.py`): stage 1
(sequence parallel) and stage 2 (tiled data parallel) at W = 1, 2, 4, 8, with the measured numbers beside the
predictions where they exist, the degree the engine picks, and its thresholds. No GPU needed.

    python bench/scaling_model.py            # the table (bench/results/scaling_model_h200.txt)
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend.splits import cost as C  # noqa: E402

WORLDS = (1, 2, 4, 8)
# (label, latent grid F×H×W): 121 frames -> 16 latent frames; 17 frames -> 3
STAGE1 = [("608x352x17", (3, 11, 19)), ("640x352", (16, 11, 20)), ("960x544", (16, 17, 30)),
          ("1280x704", (16, 22, 40)), ("1280x704x241", (31, 22, 40)), ("1920x1088", (16, 34, 60))]
STAGE2 = [("640x352", (16, 11, 20)), ("1280x704", (16, 22, 40)), ("1920x1088", (16, 34, 60))]


def _tokens(grid) -> int:
    return grid[0] * grid[1] * grid[2]


def _dev(pred: float, meas: float) -> str:
    d = pred / meas - 1
    return f"{d:+.1%}" + ("  <-- >10%" if abs(d) > 0.10 else "")


def main() -> None:
    m = C.DEFAULT
    ideal = dataclasses.replace(m, efficiency=0.8)
    print("Scaling model of one LTX-2 19B transformer forward (48 blocks, bf16, batch 1 = one guidance pass; a step "
          "is 1-4 forwards, same ratios) — mgpu_backend/splits/cost.py")
    print(f"GPU: H200. Link assumed: NVLink 4, 900 GB/s bidirectional per GPU = {m.link_GBps:.0f} GB/s per "
          f"direction; collectives at η = {m.efficiency:.2f} of it = {m.bandwidth / 1e9:.0f} GB/s effective (η fitted "
          f"to the real 2×H200 SP runs) + {m.latency * 1e6:.0f} µs each")
    print(f"compute per rank = {m.c0 * 1e3:.1f} ms + {m.c_lin * 1e6:.1f} µs·T/W + {m.c_attn * 1e9:.3f} ns·T²/W "
          f"(fitted to bench/results/sp_forward_h200.txt); host = {m.host_floor * 1e3:.1f} ms + "
          f"{m.host_per_collective * 1e3:.3f} ms per collective (fitted to the 627-token 2×H200 run); "
          f"forward = max(host, compute + comm)")
    print()
    print("Stage 1: sequence parallel. Per rank per forward: Ulysses = 2 all_to_all per block (q, k, v stacked; out), "
          "v2a = 1 all_gather per block (video K, V stacked, at the audio width 2048), "
          "gather = 1 all_gather of the output")
    print("'sim ms' = measured per-rank compute of the split simulated on one H200 (no comm); 'meas ×' = real "
          "2×H200 NCCL speedup, measured with the earlier, slower eager forward (the model's speedup for that "
          "forward is in the checks at the end); 'η=.8 ×' = predicted speedup if the exchange reached 80 % of the "
          "link; 'L' = launch-bound (host > GPU)")
    head = (f"{'size':>13} {'tokens':>6} {'W':>2} {'tok/rank':>8} {'compute ms':>10} {'sim ms':>7} "
            f"{'ulysses ms (GB)':>16} {'v2a ms (GB)':>14} {'gather ms':>9} {'host ms':>8} {'forward ms':>11} "
            f"{'speedup':>7} {'eff':>5} {'η=.8 ×':>7} {'meas ×':>7}")
    print(head)
    for label, grid in STAGE1:
        t = _tokens(grid)
        base = m.sp(t, 1).total
        base_ideal = ideal.sp(t, 1).total
        for w in WORLDS:
            p = m.sp(t, w)
            comm = {k: p.comm.get(k, C.Collective(0, 0.0, 0.0)) for k in ("ulysses", "v2a", "gather")}
            sim = C.SP_FORWARD_H200.get(t, {}).get(w)
            meas = C.SCALING_2XH200.get(t, {})
            meas_x = meas[1] / meas[w] if w in meas else None
            if t == C.SMALL_2XH200["tokens"]:
                meas_x = C.SMALL_2XH200["ms"][1] / C.SMALL_2XH200["ms"][w] if w in C.SMALL_2XH200["ms"] else None
            speed = base / p.total
            print(f"{label:>13} {t:6d} {w:2d} {-(-t // w):8d} {p.compute * 1e3:10.1f} "
                  f"{f'{sim:.1f}' if sim else '':>7} "
                  f"{comm['ulysses'].seconds * 1e3:7.1f} ({comm['ulysses'].bytes / 1e9:5.2f}) "
                  f"{comm['v2a'].seconds * 1e3:6.1f} ({comm['v2a'].bytes / 1e9:5.2f}) "
                  f"{comm['gather'].seconds * 1e3:9.2f} {p.host * 1e3:8.1f} "
                  f"{p.total * 1e3:10.1f}{'L' if p.launch_bound else ' '} {speed:7.2f} {speed / w:5.2f} "
                  f"{base_ideal / ideal.sp(t, w).total:7.2f} {f'{meas_x:.2f}' if meas_x else '':>7}")
        picks = ", ".join(f"{n} GPUs -> {C.best_sp_degree(t, [d for d in WORLDS if d <= n])}" for n in (2, 4, 8))
        print(f"{'':>13} chosen degree: {picks}")
    print()
    print("Policy thresholds (the smallest token count at which the larger degree is predicted faster; below it the "
          "engine uses fewer ranks):")
    for hi, lo in ((2, 1), (4, 2), (8, 4)):
        x = C.crossover_tokens(hi, lo)
        print(f"  {lo} -> {hi} ranks at {x:,} video tokens ({-(-x // hi):,} per rank)" if x else
              f"  {lo} -> {hi} ranks: never below {1 << 22:,} tokens")
    print()
    print("Stage 2: tiled data parallel (default grid 1×2, 2×2, 2×4, overlap 5; each rank runs its tile whole, then "
          "one all_reduce of the float32 [T, 128] blend); speedup against the untiled forward on one GPU; 'meas' "
          "columns measured with the earlier, slower eager forward")
    print(f"{'size':>13} {'tokens':>6} {'W':>2} {'tiles':>5} {'max tile':>8} {'tile ms':>8} {'all_reduce ms (MB)':>19} "
          f"{'forward ms':>10} {'speedup':>7} {'eff':>5} {'meas ×':>7} {'meas tile ms':>12}")
    for label, grid in STAGE2:
        t = _tokens(grid)
        base = C.predict_tdp(grid, 1).total
        for w in WORLDS:
            tiles = C.tdp_tile_tokens(grid, w) if w > 1 else [[t]]
            p = C.predict_tdp(grid, w)
            ar = p.comm.get("all_reduce", C.Collective(0, 0.0, 0.0))
            biggest = max(max(r) for r in tiles if r)
            meas_x = (C.SCALING_2XH200[t][1] / C.TDP_2XH200[t]) if (w == 2 and t in C.TDP_2XH200) else None
            meas_tile = C.TDP_TILES_H200.get(biggest) if t == 32640 else None
            speed = base / p.total
            print(f"{label:>13} {t:6d} {w:2d} {sum(len(r) for r in tiles):5d} {biggest:8d} {p.compute * 1e3:8.1f} "
                  f"{ar.seconds * 1e3:10.2f} ({ar.bytes / 1e6:5.1f}) {p.total * 1e3:10.1f} {speed:7.2f} "
                  f"{speed / w:5.2f} {f'{meas_x:.2f}' if meas_x else '':>7} "
                  f"{f'{meas_tile:.1f}' if meas_tile else '':>12}")
    print()
    print("Model against the measurements (deviations above 10 % flagged). The real 2×H200 runs and the tile "
          "forwards were measured with the earlier, slower eager forward: each is compared with the model scaled to "
          "that run's own one-GPU time (CostModel.matched: the forward's terms × the factor, the communication "
          "terms as they are); the model's own prediction (this forward) follows.")
    fit = C.fit_compute()
    print(f"  fits: host floor {fit['host_floor'] * 1e3:.2f} ms, c0 {fit['c0'] * 1e3:.2f} ms, c_lin "
          f"{fit['c_lin'] * 1e6:.2f} µs, c_attn {fit['c_attn'] * 1e9:.4f} ns, host per collective "
          f"{C.fit_host_per_collective() * 1e3:.3f} ms, η {C.fit_efficiency():.3f}")
    for t, by_w in C.SP_FORWARD_H200.items():
        for w, ms in by_w.items():
            p = max(m.compute(t, w), m.host(1, 0))  # the simulated split has no collectives
            note = (" (excluded from the fit: outlier)" if (t, w) in C.SP_FORWARD_OUTLIERS else
                    " (floor point: the host floor is their mean)" if (t, w) in C.SP_FORWARD_FLOOR_POINTS else
                    "" if ms / 1e3 > 1.15 * fit["host_floor"] else " (near the floor: not in the compute fit)")
            print(f"  simulated split {t:>6} tokens W={w}: model {p * 1e3:7.1f} ms, measured {ms:7.1f} ms "
                  f"{_dev(p * 1e3, ms)}{note}")
    speedup = lambda model, t: model.sp(t, 1).total / model.sp(t, 2).total  # noqa: E731
    for t, ms in C.SCALING_2XH200.items():
        run = m.matched(t, ms[1])
        print(f"  2×H200 SP {t:>6} tokens: speedup model at the run's forward {speedup(run, t):.3f} (×"
              f"{ms[1] / 1e3 / m.sp(t, 1).total:.3f}), measured {ms[1] / ms[2]:.3f} "
              f"{_dev(speedup(run, t), ms[1] / ms[2])}; this forward: {speedup(m, t):.3f}; W=1 model "
              f"{m.sp(t, 1).total * 1e3:.1f} ms, measured {ms[1]:.1f} ms")
    small = C.SMALL_2XH200
    t = small["tokens"]
    run = m.matched(t, small["ms"][1])
    print(f"  2×H200 SP {t:>6} tokens: speedup model at the run's forward {speedup(run, t):.3f} (×"
          f"{small['ms'][1] / 1e3 / m.sp(t, 1).total:.3f}), measured {small['ms'][1] / small['ms'][2]:.3f} "
          f"{_dev(speedup(run, t), small['ms'][1] / small['ms'][2])} (h_coll is fitted to it; 8 blocks ×6: "
          f"{6 * (6 * 8 + 1)} collectives, unstacked; this code's stacked exchange: {3 * 48 + 1} per forward); "
          f"this forward: {speedup(m, t):.3f}; "
          f"W=1 model {m.sp(t, 1).total * 1e3:.1f} ms, measured {small['ms'][1]:.1f} ms")
    for t, ms in C.TDP_2XH200.items():
        grid = {14080: (16, 22, 40), 32640: (16, 34, 60)}[t]
        run = m.matched(t, C.SCALING_2XH200[t][1])
        pred = C.predict_tdp(grid, 1, model=run).total / C.predict_tdp(grid, 2, model=run).total
        own = C.predict_tdp(grid, 1).total / C.predict_tdp(grid, 2).total
        meas = C.SCALING_2XH200[t][1] / ms
        print(f"  2×H200 TDP {t:>5} tokens: speedup model at the run's forward {pred:.3f}, measured {meas:.3f} "
              f"{_dev(pred, meas)}; this forward: {own:.3f}")
    tiles = m.matched(32640, C.TDP_TILES_H200[32640])
    for tokens, ms in C.TDP_TILES_H200.items():
        p = max(tiles.compute(tokens, 1), tiles.host(1, 0)) * 1e3
        own = max(m.compute(tokens, 1), m.host(1, 0)) * 1e3
        print(f"  one H200 tile forward {tokens:>6} tokens: model at the run's forward (matched at 32,640) {p:7.1f} "
              f"ms, measured {ms:7.1f} ms {_dev(p, ms)}; this forward: {own:7.1f} ms")
    print("  compiled forward (mgpu_backend/engine/compile.py, not modelled): compiled / eager reference " + ", ".join(
        f"{r:.3f} at {t:,}" for t, r in C.SP_FORWARD_COMPILED_RATIO_H200.items()) + " tokens")
    graphed()


def _stage_seconds(model, tokens: int, steps: int, passes: int, gpus: int) -> tuple[float, str]:
    """Predicted seconds of a stage's transformer forwards on `gpus` GPUs: the better of SP at its best degree (the
    passes in turn) and the passes in parallel (`splits/passes.py`), as the plan chooses."""
    from mgpu_backend.splits import passes as P

    degrees = [d for d in WORLDS if d <= gpus]
    d = C.best_sp_degree(tokens, degrees, model=model)
    seq = P.predict_sequence(tokens, passes, d, model=model)
    how = f"SP {d}"
    step = seq
    g = P.pass_degree(passes, degrees, gpus)
    if passes > 1 and g > 1:
        par = P.predict_passes(tokens, passes, g, P.pass_bytes((1, tokens, 128), (1, 126, 128)), model=model)
        if par < seq:
            step, how = par, f"passes on {g}"
    return steps * step, how


def graphed() -> None:
    """The CUDA-graphed forward's model (cost.H200_GRAPHED, issue 16): the stage-1 table, the thresholds, and the
    public anchors' workloads (predicted)."""
    m = C.H200_GRAPHED
    print()
    print("CUDA-graphed forward (the default on CUDA; cost.H200_GRAPHED: compute per rank = "
          f"{m.c0 * 1e3:.1f} ms + {m.c_lin * 1e6:.1f} µs·T/W + {m.c_attn * 1e9:.3f} ns·T²/W fitted to the graphed "
          "simulated split in bench/results/speed_h200.txt (a); host ASSUMED "
          f"{m.host_floor * 1e3:.0f} ms + {m.host_per_collective * 1e3:.2f} ms per collective; comm as above). "
          "PREDICTED, one forward (ms) and speedup over one GPU:")
    print(f"{'size':>13} {'tokens':>6} " + " ".join(f"{'W=' + str(w):>14}" for w in WORLDS) + "  chosen on 2/4/8")
    for label, grid in [("384x256", (16, 8, 12))] + STAGE1:
        t = _tokens(grid)
        base = m.sp(t, 1).total
        cells = " ".join(f"{m.sp(t, w).total * 1e3:8.1f} {base / m.sp(t, w).total:4.2f}×" for w in WORLDS)
        picks = "/".join(str(C.best_sp_degree(t, [d for d in WORLDS if d <= n], model=m)) for n in (2, 4, 8))
        print(f"{label:>13} {t:6d} {cells}  {picks}")
    for hi, lo in ((2, 1), (4, 2), (8, 4)):
        x = C.crossover_tokens(hi, lo, model=m)
        print(f"  {lo} -> {hi} ranks at {x:,} video tokens" if x else f"  {lo} -> {hi} ranks: never")
    print()
    print("Public anchors' workloads, PREDICTED transformer-forward seconds only (no text encoding, upscale, VAE "
          "decode or mux; the 19B LTX-2.0 shape stands in for LTX-2.3 / 2.5; bf16, graphed, eager blocks):")
    anchors = [
        ("LTX-2.3 768x512x121 two-stage, 30 steps, 4 passes (SGLang 4xH200: 8.19 s end to end)", 4,
         [("stage 1 384x256", 1536, 30, 4), ("stage 2 768x512", 6144, 3, 1)]),
        ("LTX-2.5 distilled 1920x1088x121 stage 1 (960x544), 8 steps, CFG 1 (vLLM-Omni 4xH200: 1.61 s)", 4,
         [("stage 1 960x544", 8160, 8, 1)]),
        ("LTX-2 768x1280x121 40+3 steps, 4 passes (TensorRT-LLM 8xB200 NVFP4: 2.13 s)", 8,
         [("stage 1 384x640", 3840, 40, 4), ("stage 2 768x1280", 15360, 3, 1)]),
    ]
    for title, gpus, stages in anchors:
        total = 0.0
        parts = []
        for name, tokens, steps, passes in stages:
            sec, how = _stage_seconds(m, tokens, steps, passes, gpus)
            one, _ = _stage_seconds(m, tokens, steps, passes, 1)
            total += sec
            parts.append(f"{name}: {sec:.2f} s ({how}; one GPU {one:.2f} s)")
        print(f"  {title}, {gpus} GPUs: {total:.2f} s — " + "; ".join(parts))


if __name__ == "__main__":
    main()
