"""Speed where users are (issue 16): CUDA-graphed forwards, batched guidance passes, fp8 / int8 compute — each
printed side by side with the path it replaces, in one run.

19B-shaped random bf16 weights built in GPU memory (bench_sp's LTX-2.0 config, `--blocks` of the 48; times scaled
to 48 blocks when fewer are built), 121 frames, 126 audio tokens, 1024 text tokens. Sections (`--what`):
- `gemm`: the block GEMMs at LTX shapes: bf16 `F.linear` against our fp8 path (`models/fp8.fp8_linear`: dynamic
  per-row activation scales, Triton quantize + `torch._scaled_mm`; and with a static per-tensor input scale),
  comfy-kitchen's fp8 linear (its CUDA per-tensor quantize + `torch._scaled_mm`, as ComfyUI runs fp8 files),
  `torch._int_mm` (int8, per-row activations) and comfy-kitchen's `int8_linear` (its int8 GEMM, the
  `int8_tensorwise` layout of ComfyUI's int8 files) — time ratio to bf16 and relative L2 error to an fp32 product.
- `graphs`: the per-rank forward eager vs replayed from CUDA graphs (`mgpu_backend.engine.cuda_graphs.call`) at each size
  and W: W = 1 is the whole forward; W > 1 one simulated rank of a W-way sequence-parallel split (T/W tokens, H/W
  heads in attention; every exchange a local copy standing in for the collective and — like the real exchanges —
  a graph-segment boundary, so the graphed figure is the piecewise replay); `--compile-at` adds the same with the
  blocks compiled (`mgpu_backend.engine.compile`).
- `batched`: at W = 1, the 4 guidance passes of the LTX-2.0 recipe (cond, uncond, STG, isolated) as 4 forwards vs
  one batched forward (`LTX2Denoiser.batch`), eager and graphed; per-pass time ratio; max relative L2 between them.
- `fp8`: the whole forward with the block Linears as `FP8Linear` (per-tensor e4m3 weights quantized from the bf16
  ones): dequantizing (today's path) and fp8 matmuls, eager and compiled, against bf16; relative L2 vs bf16.

    python bench/bench_speed.py --what gemm,fp8 --blocks 16 --fp8-sizes 640x352,1280x704,1920x1088
    python bench/bench_speed.py --what graphs,batched --blocks 48
    python bench/bench_speed.py --tiny          # CPU smoke check of the code paths (no timings worth reading)
`--json FILE` writes every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_sp import LTX2_19B, SimulatedExchange, build_transformer, inputs, plain_diffusers, rel_l2  # noqa: E402

from mgpu_backend.engine import compile as C  # noqa: E402
from mgpu_backend.engine import cuda_graphs as G  # noqa: E402
from mgpu_backend.testing.diffusers_inputs import call_diffusers  # noqa: E402
from mgpu_backend.engine import sampling as S  # noqa: E402
from mgpu_backend.engine.denoiser import LTX2Denoiser, TextContext  # noqa: E402
from mgpu_backend.models import fp8 as F8  # noqa: E402
from mgpu_backend.splits.exchange import Exchange  # noqa: E402
from mgpu_backend.testing.diffusers_inputs import SequenceDriver  # noqa: E402

RESULTS: dict = {}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(fns: dict, iters: int, warmup: int = 2) -> dict:
    """Median seconds per call of each function, taken in turn (a, b, a, b, …)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


# ---- gemm ------------------------------------------------------------------------------------------------------------

def bench_gemm(args, device):
    from triton.testing import do_bench

    try:
        import comfy_kitchen as ck
        kitchen = ck
    except Exception as exc:  # noqa: BLE001
        kitchen = None
        print(f"comfy-kitchen not importable: {type(exc).__name__}: {exc}")
    print(f"\nGEMMs (median ms; ratio to bf16; rel. L2 vs fp32 product)")
    head = f"{'M':>6} {'K→N':>12} {'bf16':>7} {'fp8 row':>12} {'fp8 static':>12} {'kitchen fp8':>12} " \
           f"{'_int_mm':>12} {'kitchen i8':>12}  errors: row / static / kitchen fp8 / int_mm / kitchen i8"
    print(head)
    rows = []
    for m in (3520, 14080, 32640):
        for k, n in ((4096, 4096), (4096, 16384), (16384, 4096)):
            g = torch.Generator(device=device).manual_seed(m + k + n)
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
            bias = torch.randn(n, device=device, generator=g).to(torch.bfloat16) * 0.1
            q, ws = F8.quantize_fp8(w)
            ref = x.float() @ (q.float() * ws).t() + bias.float()
            scale_rows = ws.reshape(1, 1).expand(1, n).contiguous()
            in_scale = (x.float().abs().amax() / 448.0).reshape(())
            fns = {
                "bf16": lambda: F.linear(x, w, bias),
                "fp8_row": lambda: F8.fp8_linear(x, q, ws, bias, None, scale_rows),
                "fp8_static": lambda: F8.fp8_linear(x, q, ws, bias, in_scale),
            }
            if kitchen is not None:
                def kitchen_fp8():
                    xq = kitchen.quantize_per_tensor_fp8(x, in_scale)
                    return torch._scaled_mm(xq, q.t(), scale_a=in_scale, scale_b=ws, bias=bias,
                                            out_dtype=torch.bfloat16)
                fns["kitchen_fp8"] = kitchen_fp8
            # int8: per-tensor weight scale (ComfyUI's int8_tensorwise), per-row activation scales
            w8_scale = (w.float().abs().amax() / 127.0).reshape(())
            w8 = (w.float() / w8_scale).round().clamp(-127, 127).to(torch.int8)
            ref8 = x.float() @ (w8.float() * w8_scale).t() + bias.float()
            w8t = w8.t()

            def int_mm():
                xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 127.0
                x8 = (x.float() / xs).round().clamp(-127, 127).to(torch.int8)
                return (torch._int_mm(x8, w8t).float() * (xs * w8_scale) + bias.float()).to(torch.bfloat16)
            fns["int_mm"] = int_mm
            if kitchen is not None:
                fns["kitchen_i8"] = lambda: kitchen.int8_linear(x, w8, w8_scale.reshape(1), bias,
                                                                out_dtype=torch.bfloat16)
            row = {"M": m, "K": k, "N": n}
            for name, fn in fns.items():
                try:
                    out = fn()
                    row[name + "_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    row[name + "_err"] = rel_l2(out, ref8 if name in ("int_mm", "kitchen_i8") else ref)
                except Exception as exc:  # noqa: BLE001 — reported in the table
                    row[name + "_ms"] = float("nan")
                    row[name + "_err"] = float("nan")
                    row[name + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            base = row["bf16_ms"]

            def cell(name):
                return f"{row.get(name + '_ms', float('nan')):6.3f} {row.get(name + '_ms', float('nan')) / base:4.2f}×"
            errs = " / ".join(f"{row.get(n + '_err', float('nan')):.1e}"
                              for n in ("fp8_row", "fp8_static", "kitchen_fp8", "int_mm", "kitchen_i8"))
            print(f"{m:6d} {f'{k}→{n}':>12} {base:7.3f} {cell('fp8_row'):>12} {cell('fp8_static'):>12} "
                  f"{cell('kitchen_fp8'):>12} {cell('int_mm'):>12} {cell('kitchen_i8'):>12}  {errs}", flush=True)
            for r in row:
                if r.endswith("_error"):
                    print(f"    {r}: {row[r]}")
    RESULTS["gemm"] = rows


# ---- graphs ----------------------------------------------------------------------------------------------------------

def rank_forward(model, kw, tokens, w):
    """(eager fn, graphed fn) of one rank of a W-way split (W = 1: the whole forward through the SP wrapper)."""
    base = {k: v for k, v in kw.items() if k != "return_dict"}
    if w == 1:
        sp = SequenceDriver(model, Exchange(None, 1, 0))
        sp.activate()
        return (lambda: sp(**base)), (lambda: G.call(model, sp, base, extra="sp"))
    sim = SequenceDriver(model, SimulatedExchange(w))
    sim.activate()
    per = tokens // w
    sim_kw = dict(base, hidden_states=base["hidden_states"][:, :per], timestep=base["timestep"][:, :per],
                  video_coords=base["video_coords"][:, :, :per])

    def fwd(**k):  # the engine's one forward on the rank's tokens (model_forward), the simulated exchanges installed
        return call_diffusers(model, **k)
    return (lambda: fwd(**sim_kw)), (lambda: G.call(model, fwd, sim_kw, extra=("rank", w)))


def bench_graphs(args, model, device, dtype, scale):
    print(f"\nper-rank forward, eager vs CUDA graphs (ms, ×{scale:g} to 48 blocks; W > 1: simulated rank, piecewise)")
    print(f"{'size':>10} {'tokens':>7} {'W':>2} {'eager':>8} {'graphed':>8} {'ratio':>6} {'segments':>8} "
          f"{'held GiB':>8}")
    rows = []
    compile_at = {(tuple(int(v) for v in s.split("@")[0].split("x")), int(s.split("@")[1]))
                  for s in args.compile_at.split(",") if s}
    for width, height in sizes(args.sizes):
        kw, tokens = inputs(model, args.frames, height, width, 24.0, device, dtype)
        for w in [int(v) for v in args.world.split(",")]:
            eager, graphed = rank_forward(model, kw, tokens, w)
            with torch.no_grad():
                ref = eager()
                got = graphed(), graphed()  # warm-up, capture + replay
                t = interleaved({"eager": eager, "graphed": graphed}, args.iters, warmup=1)
            cache = G.graphs_of(model)
            entry = next(reversed(cache.entries.values()), None) if cache.entries else None
            err = max(rel_l2(got[1][0], ref[0]), rel_l2(got[1][1], ref[1]))
            row = dict(size=f"{width}x{height}", tokens=tokens, W=w, eager_ms=t["eager"] * scale * 1e3,
                       graphed_ms=t["graphed"] * scale * 1e3, segments=entry.capture.segments if entry else 0,
                       held_gib=cache.held_bytes / 2**30, rel_l2=err, fallbacks=sorted(set(cache.failed.values())))
            rows.append(row)
            print(f"{row['size']:>10} {tokens:7d} {w:2d} {row['eager_ms']:8.1f} {row['graphed_ms']:8.1f} "
                  f"{row['graphed_ms'] / row['eager_ms']:6.2f} {row['segments']:8d} {row['held_gib']:8.2f}"
                  f"{'  rel.L2 %.1e' % err if err > 0 else ''}{'  ' + '; '.join(row['fallbacks']) if row['fallbacks'] else ''}",
                  flush=True)
            if ((width, height), w) in compile_at:
                C.compile_blocks(model)
                with torch.no_grad():
                    t0 = time.perf_counter()
                    eager()
                    sync()
                    compile_s = time.perf_counter() - t0
                    graphed(), graphed()
                    tc = interleaved({"eager": eager, "graphed": graphed}, args.iters, warmup=1)
                C.uncompile_blocks(model)
                crow = dict(size=f"{width}x{height}", tokens=tokens, W=w, compiled=True,
                            eager_ms=tc["eager"] * scale * 1e3, graphed_ms=tc["graphed"] * scale * 1e3,
                            compile_s=compile_s)
                rows.append(crow)
                print(f"{'compiled':>10} {tokens:7d} {w:2d} {crow['eager_ms']:8.1f} {crow['graphed_ms']:8.1f} "
                      f"{crow['graphed_ms'] / crow['eager_ms']:6.2f}   (compile {compile_s:.1f} s)", flush=True)
            G.graphs_of(model).clear()
            torch.cuda.empty_cache()
    RESULTS["graphs"] = rows


# ---- batched passes --------------------------------------------------------------------------------------------------

def bench_batched(args, model, device, dtype, scale):
    from mgpu_backend.engine import latents as L

    print(f"\nguidance passes at W = 1: 4 forwards vs one batched forward (ms per step, ×{scale:g} to 48 blocks)")
    print(f"{'size':>10} {'tokens':>7} {'mode':>7} {'4 × B=1':>8} {'B=4':>8} {'per pass':>8} {'rel.L2':>8}")
    passes = S.plan_passes(S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(min(29, len(
        model.transformer_blocks) - 1),), modality_scale=3.0), S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0,
                                                                                  stg_blocks=(min(29, len(
                                                                                      model.transformer_blocks) - 1),),
                                                                                  modality_scale=3.0))
    g = torch.Generator(device="cpu").manual_seed(1)
    cfg = model.config
    ctx = [TextContext(torch.randn(1, 1024, cfg.caption_channels, generator=g).to(device, dtype),
                       torch.randn(1, 1024, cfg.caption_channels, generator=g).to(device, dtype),
                       torch.ones(1, 1024, device=device, dtype=dtype)) for _ in range(2)]
    rows = []
    for width, height in sizes(args.batch_sizes):
        f, h, w = L.latent_frames(args.frames), height // 32, width // 32
        t = f * h * w
        d = LTX2Denoiser(model, ctx[0], ctx[1], L.video_coords(model, 1, f, h, w, 24.0, device=device),
                         L.audio_coords(model, 1, 126, device=device), dtype)
        x = torch.randn(1, t, 128, generator=g)
        a = torch.randn(1, 126, 128, generator=g)
        inp = S.ModelInputs(x, a, torch.full((1, t), 0.7), torch.full((1, 126), 0.7), torch.tensor([0.7]),
                            torch.tensor([0.7]), passes[0], 0)
        import dataclasses

        def singles():
            return [d(dataclasses.replace(inp, guidance=p)) for p in passes]

        def batched():
            return d.batch(inp, passes)
        for mode in ("eager", "graphed"):
            G.set_mode("off" if mode == "eager" else "auto")
            with torch.no_grad():
                one, many = singles(), batched()
                tm = interleaved({"singles": singles, "batched": batched}, args.batch_iters, warmup=2)
            err = max(max(rel_l2(b[0], s[0]), rel_l2(b[1], s[1])) for b, s in zip(many, one))
            row = dict(size=f"{width}x{height}", tokens=t, mode=mode, singles_ms=tm["singles"] * scale * 1e3,
                       batched_ms=tm["batched"] * scale * 1e3, rel_l2=err)
            rows.append(row)
            print(f"{row['size']:>10} {t:7d} {mode:>7} {row['singles_ms']:8.1f} {row['batched_ms']:8.1f} "
                  f"{row['batched_ms'] / row['singles_ms']:7.2f}× {err:8.1e}", flush=True)
        G.set_mode("auto")
        G.graphs_of(model).clear()
        torch.cuda.empty_cache()
    RESULTS["batched"] = rows


# ---- fp8 forward -----------------------------------------------------------------------------------------------------

def fp8_twin(model, meta):
    """A transformer sharing `model`'s non-block parameters whose block Linears are `FP8Linear`s quantized from the
    bf16 weights (per-tensor e4m3, as the fp8 checkpoints store them)."""
    twin = plain_diffusers(model, meta)
    for name, layer in list(twin.named_modules()):
        if name.startswith("transformer_blocks.") and isinstance(layer, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = twin.get_submodule(parent_name)
            f = F8.FP8Linear(layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype)
            q, s = F8.quantize_fp8(layer.weight)
            f.weight = nn.Parameter(q, requires_grad=False)
            f.weight_scale = s.to(q.device)
            f.bias = layer.bias
            setattr(parent, child, f)
    return twin.eval().requires_grad_(False)


def bench_fp8(args, model, meta, device, dtype, scale):
    twin = fp8_twin(model, meta)
    print(f"\nwhole forward with fp8 block Linears (ms, ×{scale:g} to 48 blocks; ratio to bf16 of the same mode)")
    print(f"{'size':>10} {'mode':>8} {'bf16':>8} {'fp8 deq':>8} {'ratio':>6} {'fp8 mm':>8} {'ratio':>6} "
          f"{'err deq':>8} {'err mm':>8}")
    rows = []
    for width, height in sizes(args.fp8_sizes):
        kw, tokens = inputs(model, args.frames, height, width, 24.0, device, dtype)
        base = {k: v for k, v in kw.items() if k != "return_dict"}
        sp_b = SequenceDriver(model, Exchange(None, 1, 0))
        sp_f = SequenceDriver(twin, Exchange(None, 1, 0))
        for mode in ("eager", "graphed", "compiled"):
            if mode == "compiled":
                C.compile_blocks(model)
                C.compile_blocks(twin)
            G.set_mode("auto" if mode == "graphed" else "off")

            def run_b():
                sp_b.activate()
                return G.call(model, sp_b, base, extra="bf16")

            def run_deq():
                F8.set_compute("off")
                sp_f.activate()
                try:
                    return G.call(twin, sp_f, base, extra="deq")
                finally:
                    F8.set_compute("auto")

            def run_mm():
                sp_f.activate()
                return G.call(twin, sp_f, base, extra="mm")
            with torch.no_grad():
                ref, deq, mm = run_b(), run_deq(), run_mm()
                tm = interleaved({"bf16": run_b, "deq": run_deq, "mm": run_mm}, args.iters, warmup=1)
            paths = F8.compute_report(twin)
            row = dict(size=f"{width}x{height}", tokens=tokens, mode=mode, bf16_ms=tm["bf16"] * scale * 1e3,
                       deq_ms=tm["deq"] * scale * 1e3, mm_ms=tm["mm"] * scale * 1e3,
                       err_deq=max(rel_l2(deq[0], ref[0]), rel_l2(deq[1], ref[1])),
                       err_mm=max(rel_l2(mm[0], ref[0]), rel_l2(mm[1], ref[1])), paths=paths)
            rows.append(row)
            print(f"{row['size']:>10} {mode:>8} {row['bf16_ms']:8.1f} {row['deq_ms']:8.1f} "
                  f"{row['deq_ms'] / row['bf16_ms']:6.2f} {row['mm_ms']:8.1f} {row['mm_ms'] / row['bf16_ms']:6.2f} "
                  f"{row['err_deq']:8.1e} {row['err_mm']:8.1e}", flush=True)
        C.uncompile_blocks(model)
        C.uncompile_blocks(twin)
        G.set_mode("auto")
        G.graphs_of(model).clear()
        G.graphs_of(twin).clear()
        torch.cuda.empty_cache()
    print(F8.compute_report(twin))
    RESULTS["fp8"] = rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="gemm,graphs,batched,fp8")
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--sizes", default="384x256,640x352,768x512,1280x704")
    ap.add_argument("--world", default="1,2,4,8")
    ap.add_argument("--compile-at", default="640x352@1,640x352@4,640x352@8,1280x704@8")
    ap.add_argument("--batch-sizes", default="384x256,640x352,768x512,1280x704")
    ap.add_argument("--fp8-sizes", default="640x352,1280x704,1920x1088")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch-iters", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = dict(LTX2_19B, num_layers=args.blocks)
    if args.tiny:
        from mgpu_backend.testing.tiny import tiny_transformer_metadata

        meta = tiny_transformer_metadata("2.0")
        args.sizes = args.batch_sizes = args.fp8_sizes = "128x64"
        args.frames, args.world, args.compile_at, args.iters, args.batch_iters = 9, "1,2", "", 1, 1
        args.what = ",".join(w for w in args.what.split(",") if w != "gemm")
    scale = 48 / meta["num_layers"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{time.strftime('%Y-%m-%d')} bench_speed on {name}, torch {torch.__version__}, {meta['num_layers']} blocks "
          f"(×{scale:g} to 48), {dtype}, median of {args.iters}; command: {' '.join(sys.argv)}", flush=True)
    RESULTS.update(device=name, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, blocks=meta["num_layers"],
                   command=" ".join(sys.argv))
    what = args.what.split(",")
    if "gemm" in what:
        bench_gemm(args, device)
    if any(w in what for w in ("graphs", "batched", "fp8")):
        model = build_transformer(meta, device, dtype)
        if "graphs" in what:
            bench_graphs(args, model, device, dtype, scale)
        if "batched" in what:
            bench_batched(args, model, device, dtype, scale)
        if "fp8" in what:
            bench_fp8(args, model, meta, device, dtype, scale)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
