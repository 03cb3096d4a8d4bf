"""The native MODEL's forward (`mgpu_backend/stages/native.py`, issue 19) eager vs replayed from CUDA graphs, at the stage-1
sizes of ComfyUI's LTX templates (issue 20), in one run.

Full-width random weights built on the GPU (bench_sp's 19B shape with the family's transformer flags: LTX-2.3 =
cross-attention AdaLN + prompt modulation, LTX-2.5 = that, no FF bias, keyframe embedding), `--blocks` of the 48
(times scaled to 48), bf16, and with `--fp8` the same block weights as per-tensor e4m3 `FP8Linear`s (fp8 matmuls,
as an fp8 checkpoint runs). One `NativeEngine.forward` per call — a `ForwardRequest` in ComfyUI's layout (CPU
tensors in, CPU tensors out: the latent's upload and the outputs' download are in the figure) — at `--sizes` ×
121 frames (640×352: the LTX-2.3 / 2.5 t2v templates' stage 1, half of 1280×704), 126 audio steps, the processed
context [B, 1024, 6144], CFG batch B = 2 and the distilled CFG-1 batch B = 1. W = 1 is the whole forward;
W > 1 one simulated rank of a W-way sequence-parallel split (T/W tokens, H/W heads in self-attention; each
exchange a local copy and, like the real collectives, a graph-segment boundary: the graphed figure is the
piecewise replay). `rel.L2` compares the graphed output with the eager one (0: the same bits).

    python bench/bench_native_graphs.py --blocks 16 --families 2.3,2.5 --world 1,2,4 --fp8
    python bench/bench_native_graphs.py --tiny        # CPU smoke check of the code path (no timings worth reading)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_sp import LTX2_19B, SimulatedExchange, build_transformer, rel_l2  # noqa: E402
from bench_speed import interleaved  # noqa: E402

from mgpu_backend.engine import cuda_graphs as G  # noqa: E402
from mgpu_backend.protocol.native_forward import ForwardRequest  # noqa: E402
from mgpu_backend.models.families import get_family  # noqa: E402
from mgpu_backend.stages.native import NativeEngine  # noqa: E402
from mgpu_backend.splits.sequence import UlyssesSplit  # noqa: E402


def request(engine: NativeEngine, batch: int, frames: int, height: int, width: int, dtype, audio_steps: int = 126,
            text: int = 1024) -> ForwardRequest:
    """A CFG-batch request as ComfyUI's forward sends it (nodes/native_forward.py), context included."""
    f, h, w = (frames - 1) // 8 + 1, height // 32, width // 32
    g = torch.Generator().manual_seed(batch)
    return ForwardRequest(
        video=torch.randn(batch, 128, f, h, w, generator=g).to(dtype),
        audio=torch.randn(batch, 8, audio_steps, 16, generator=g).to(dtype),
        video_timestep=torch.full((batch,), 0.7), audio_timestep=torch.full((batch,), 0.7),
        context=torch.randn(batch, text, engine.context_width, generator=g).to(dtype), frame_rate=25.0,
        cond_or_uncond=(1, 0)[:batch])


def fp8_blocks(model):
    """`model` with its block Linears replaced in place by per-tensor e4m3 `FP8Linear`s (bench_speed.fp8_twin's
    recipe; the bf16 weights are dropped to make room)."""
    from torch import nn

    from mgpu_backend.models import fp8 as F8

    for name, layer in list(model.named_modules()):
        if name.startswith("transformer_blocks.") and isinstance(layer, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            f = F8.FP8Linear(layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype)
            q, s = F8.quantize_fp8(layer.weight)
            f.weight = nn.Parameter(q, requires_grad=False)
            f.weight_scale = s.to(q.device)
            f.bias = layer.bias
            setattr(model.get_submodule(parent_name), child, f)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="2.3,2.5")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--sizes", default="640x352")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--batches", default="2,1")
    ap.add_argument("--world", default="1,2,4")
    ap.add_argument("--fp8", action="store_true", help="also the fp8-weight model")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    scale = 48 / args.blocks
    if args.tiny:
        args.sizes, args.frames, args.world, args.iters, scale = "128x64", 9, "1,2", 1, 1.0
    print(f"{time.strftime('%Y-%m-%d')} bench_native_graphs on {name}, torch {torch.__version__}, {args.blocks} blocks "
          f"(×{scale:g} to 48), {dtype}, median of {args.iters}; command: {' '.join(sys.argv)}", flush=True)
    print(f"\nnative forward per call, eager vs CUDA graphs (ms, ×{scale:g} to 48 blocks; W > 1: one simulated rank)")
    print(f"{'family':>6} {'weights':>7} {'size':>8} {'B':>2} {'tokens':>6} {'W':>2} {'eager':>8} {'graphed':>8} "
          f"{'ratio':>6} {'segments':>8} {'rel.L2':>8}")
    rows = []
    for family in args.families.split(","):
        if args.tiny:
            from mgpu_backend.testing.tiny import tiny_transformer_metadata

            meta = tiny_transformer_metadata(family)
        else:
            meta = dict(LTX2_19B, num_layers=args.blocks, **get_family(family).transformer_flags)
        for weights in (("bf16", "fp8") if args.fp8 else ("bf16",)):
            model = build_transformer(meta, device, dtype)
            if weights == "fp8":
                fp8_blocks(model)
                torch.cuda.empty_cache()
            engine = NativeEngine(SimpleNamespace(transformer=model, video_connector=None, audio_connector=None),
                                  None, dtype, device)
            local = engine.local_split
            for width, height in (tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")):
                for batch in (int(b) for b in args.batches.split(",")):
                    req = request(engine, batch, args.frames, height, width, dtype)
                    context = req.context.to(device, dtype)
                    tokens = req.video_tokens
                    for w in (int(v) for v in args.world.split(",")):
                        engine.local_split = local if w == 1 else UlyssesSplit(SimulatedExchange(w))

                        def eager():
                            G.set_mode("off")
                            try:
                                return engine.forward(req, context)
                            finally:
                                G.set_mode("auto")

                        def graphed():
                            return engine.forward(req, context)
                        with torch.no_grad():
                            ref = eager()
                            got = [graphed() for _ in range(3)]  # warm-up, capture, replay
                            t = interleaved({"eager": eager, "graphed": graphed}, args.iters, warmup=0)  # warmed above
                        cache = G.graphs_of(model)
                        entry = next(reversed(cache.entries.values()), None) if cache.entries else None
                        err = max(rel_l2(got[2][0], ref[0]), rel_l2(got[2][1], ref[1]))
                        row = dict(family=family, weights=weights, size=f"{width}x{height}", batch=batch,
                                   tokens=tokens, W=w, eager_ms=t["eager"] * scale * 1e3,
                                   graphed_ms=t["graphed"] * scale * 1e3,
                                   segments=entry.capture.segments if entry else 0, rel_l2=err,
                                   fallbacks=sorted(set(cache.failed.values())))
                        rows.append(row)
                        print(f"{family:>6} {weights:>7} {row['size']:>8} {batch:2d} {tokens:6d} {w:2d} "
                              f"{row['eager_ms']:8.1f} {row['graphed_ms']:8.1f} "
                              f"{row['graphed_ms'] / row['eager_ms']:6.2f} {row['segments']:8d} {err:8.1e}"
                              f"{'  ' + '; '.join(row['fallbacks']) if row['fallbacks'] else ''}", flush=True)
                        cache.clear()
            engine.local_split = local
            del engine, model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           command=" ".join(sys.argv), blocks=args.blocks, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
