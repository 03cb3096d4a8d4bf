"""The LTX-2.5 diffusion video decoder, decoded in spatial tiles over simulated ranks on one GPU: seconds per
tile count against the untiled decode.

For each size (default 1280×704×121 and 1920×1088×121; 720 is not a multiple of the VAE's 32 px, ComfyUI's
EmptyLTXVLatentVideo rounds it to 704) and tile count T (1×1, 1×2, 2×2, 2×4 by default, decode overlap 2 latent cells
= 64 px, full time axis: `splits/decode.py`), every tile is decoded one after another on the one GPU, each timed
alone (`torch.cuda.synchronize`), the way a rank decodes it (its latent window and its window of the one noise
canvas). Simulated ranks: with W = T ranks (one tile each) the decode takes `max tile` + the blend and the fp32
reduce onto rank 0 (the reduce is not run here; its size is printed); with W = 4 ranks (round-robin, as the fleet
assigns tiles) the busiest rank's sum. Columns: `max tile`, `sum tiles` (total work), `W=T` / `W=4` simulated
seconds and their speedups over the untiled decode (`×`; `-` when the untiled decode ran out of memory), and
`×tiled` = (sum tiles + blend) / (W=T): the speedup over decoding the same tiles in one process (the result the
distributed decode equals). Peak memory: the largest tile's (or the untiled) peak; `est GiB`: what
`splits/decode.py diffusion_decode_peak_bytes` predicts for it (the fit through the untiled peaks at 1280×704×121
and 1920×1088×121; for tiles, the tile's activations plus the whole noise canvas, without the fp32 blend
accumulator this bench does not hold while decoding) — the check of the estimate that auto-tiles the decode.

Anchor: vLLM-Omni's tiled patch-parallel decode of this decoder on 4×H200: 6.57 s → 1.90 s.

Weights are random, full size: ComfyUI 0.33's `LTX_24_VAE_CONFIG` decoder (stages 2048/1024/512/512/256, depths
4/6/4/2/8, kernels 3×7×7, 3×7×7, 3×5×5, 3×5×5 and 11×11×11, head 64), as diffusers'
`LTX2VideoDiffusionDecoderModel` with our neighborhood-attention processor (comfy-kitchen's `na3d`: CUDA kernels
when its CUDA backend loads, else Triton or eager — printed), built directly in GPU memory in bf16.

    python bench/bench_diffusion_decode.py                                   # one H200, the default table
    python bench/bench_diffusion_decode.py --sizes 1920x1088x121 --tiles 1x1,2x2,2x4,4x4
    python bench/bench_diffusion_decode.py --tiny --device cpu               # CPU smoke check (tiny config)
    python bench/bench_diffusion_decode.py --auto-free 40 --sizes 1920x1088x121   # never out of memory: see below

`--auto-free GIB`: instead of the table, hold GPU memory so that about GIB GiB stay free, then decode each size the
way a job does (`TwoStagePipeline.decode_video`: the estimate against the free memory, automatic tiling when it
would not fit) and print the tiling it chose, its note, the seconds and the measured peak — or the out-of-memory
error it must never hit.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend.models.diffusion_decoder import (DiffusionDecoderConfig, build_decoder,  # noqa: E402
                                                   decode_vae_space, noise_canvas)
from mgpu_backend.models import neighborhood  # noqa: E402
from mgpu_backend.splits.decode import BLEND_BYTES_PER_PIXEL, SPATIAL, diffusion_decode_peak_bytes
from mgpu_backend.splits.tiling import axis_weights, split_axis  # noqa: E402

REAL = DiffusionDecoderConfig()  # the defaults are ComfyUI's LTX_24_VAE_CONFIG decoder (the released model's shape)


def _tiny() -> DiffusionDecoderConfig:
    from mgpu_backend.testing.tiny_vae25 import TINY_DECODER
    return TINY_DECODER


def build(config: DiffusionDecoderConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The decoder with random weights made on `device`: fan-in-scaled normal matrices, unit norms, small biases."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build_decoder(config)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "scale_shift_table" not in name:
                p.copy_(torch.randn(p.shape, generator=g, device=device) / math.sqrt(p.shape[1]))
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device=device))
        model.latents_mean.zero_()
        model.latents_std.fill_(1.0)
    return model.to(dtype).eval().requires_grad_(False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def timed_tile(model, z, canvas, h0, h1, w0, w1, device) -> tuple[float | None, float, tuple]:
    """Seconds, peak GiB and pixel shape of one tile decode (None seconds on out-of-memory)."""
    _peak_reset(device)
    _sync(device)
    start = time.perf_counter()
    try:
        out = decode_vae_space(model, z[..., h0:h1, w0:w1],
                               canvas[..., h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL])
        _sync(device)
    except torch.OutOfMemoryError:
        return None, _peak_gib(device), ()
    seconds = time.perf_counter() - start
    shape = tuple(out.shape)
    del out
    return seconds, _peak_gib(device), shape


def blend_seconds(shape, h_spans, w_spans, overlap, device) -> float:
    """The pixel-space accumulation of every tile into one fp32 canvas (what the ranks do before the reduce)."""
    _, _, frames, hp, wp = shape
    out = torch.zeros(1, 3, frames, hp, wp, device=device)
    hw = axis_weights([(a * SPATIAL, b * SPATIAL) for a, b in h_spans], overlap * SPATIAL)
    ww = axis_weights([(a * SPATIAL, b * SPATIAL) for a, b in w_spans], overlap * SPATIAL)
    _sync(device)
    start = time.perf_counter()
    for i, (h0, h1) in enumerate(h_spans):
        for j, (w0, w1) in enumerate(w_spans):
            tile = torch.ones(1, 3, frames, (h1 - h0) * SPATIAL, (w1 - w0) * SPATIAL, device=device)
            weight = (hw[i][:, None] * ww[j][None, :]).to(tile)
            out[..., h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL] += tile * weight
    _sync(device)
    return time.perf_counter() - start


def auto_free(model, sizes: str, free_gib: float, overlap: int, device: torch.device, config) -> None:
    """Hold memory so that ~`free_gib` GiB stay free on `device`, then decode each size through the pipeline's
    `decode_video` (its automatic tiling) and print what it did."""
    import types

    from mgpu_backend.splits import decode as D
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    if device.type != "cuda":
        raise SystemExit("--auto-free needs a CUDA device (the free memory is probed there)")
    fake = types.SimpleNamespace(components=types.SimpleNamespace(video_vae=model), plan=None)
    fake._fit_decode = lambda *a: TwoStagePipeline._fit_decode(fake, *a)
    for size in sizes.split(","):
        width, height, frames = (int(v) for v in size.split("x"))
        grid = ((frames - 1) // 8 + 1, height // SPATIAL, width // SPATIAL)
        latent = torch.randn(1, config.in_channels, *grid)
        _peak_reset(device)
        free = D.free_decode_bytes(device)
        hold = max(0, int(free - free_gib * 2**30))
        blocker = torch.empty(hold, dtype=torch.uint8, device=device) if hold else None
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        try:
            _, report = TwoStagePipeline.decode_video(fake, latent, 0, None, overlap)
            _sync(device)
            outcome = (f"{report.auto_tiling or 'untiled (fits)'}; {time.perf_counter() - start:.2f} s, "
                       f"peak {(torch.cuda.max_memory_allocated(device) - base) / 2**30:.1f} GiB above the held "
                       f"memory")
        except torch.OutOfMemoryError as exc:
            outcome = f"OUT OF MEMORY (must not happen): {str(exc).splitlines()[0]}"
        except Exception as exc:  # noqa: BLE001  (a refusal: nothing fits)
            outcome = f"refused: {exc}"
        print(f"{size}: {free / 2**30:.1f} GiB free, ~{free_gib:g} GiB left free -> {outcome}", flush=True)
        del blocker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1280x704x121,1920x1088x121", help="WxHxFRAMES, comma-separated")
    ap.add_argument("--tiles", default="1x1,1x2,2x2,2x4", help="HxW tile grids, comma-separated")
    ap.add_argument("--overlap", type=int, default=2, help="latent cells (the decode default: 2 = 64 px)")
    ap.add_argument("--ranks", type=int, default=4, help="the round-robin rank count of the W=… column")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="tiny config (smoke check), default sizes 256x192x17")
    ap.add_argument("--warmup", type=int, default=1, help="untimed decodes of the first tile before timing")
    ap.add_argument("--auto-free", type=float, default=None, metavar="GIB",
                    help="leave about GIB GiB free and decode as a job does (automatic tiling); see the docstring")
    args = ap.parse_args()

    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # `to(dtype)` of a model built from a config warns about fp32 modules
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = _tiny() if args.tiny else REAL
    sizes = "256x192x17" if args.tiny and args.sizes == ap.get_default("sizes") else args.sizes
    torch.manual_seed(0)
    model = build(config, device, dtype)
    backends = "none (plain fallback)"
    if neighborhood.kitchen_available():
        import comfy_kitchen as ck
        backends = ", ".join(n for n, b in ck.list_backends().items() if b["available"] and "na3d" in b["capabilities"])
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# LTX-2.5 diffusion decoder, random {'tiny' if args.tiny else 'full-size'} weights, {args.dtype}, "
          f"{gpu}, torch {torch.__version__}; na3d: comfy-kitchen backends with na3d: {backends}")
    print(f"# config: stages {config.stage_channels}, depths {config.stage_depths}, kernels "
          f"{config.stage_kernels} + {config.stage5_kernel}; overlap {args.overlap} cells; "
          f"anchor vLLM-Omni 4×H200 6.57 → 1.90 s (3.46×)")
    if args.auto_free is not None:
        auto_free(model, sizes, args.auto_free, args.overlap, device, config)
        return
    print(f"{'size':>16} {'tiles':>5} {'max tile s':>10} {'sum s':>8} {'blend s':>8} {'W=T s':>8} {'×':>6} "
          f"{'×tiled':>6} {'W=' + str(args.ranks) + ' s':>8} {'×':>6} {'peak GiB':>9} {'est GiB':>8} {'reduce MB':>9}")
    for size in sizes.split(","):
        width, height, frames = (int(v) for v in size.split("x"))
        grid = ((frames - 1) // 8 + 1, height // SPATIAL, width // SPATIAL)
        z = torch.randn(1, config.in_channels, *grid, device=device, dtype=dtype)
        canvas = noise_canvas(model, z)
        untiled = None
        for spec in args.tiles.split(","):
            th, tw = (int(v) for v in spec.split("x"))
            ov_h, ov_w = (args.overlap if th > 1 else 0), (args.overlap if tw > 1 else 0)
            h_spans, w_spans = split_axis(grid[1], th, ov_h), split_axis(grid[2], tw, ov_w)
            tiles = [(h, w) for h in h_spans for w in w_spans]
            for _ in range(args.warmup):
                (h0, h1), (w0, w1) = tiles[0]
                timed_tile(model, z, canvas, h0, h1, w0, w1, device)
            times, peak, shape = [], 0.0, None
            for (h0, h1), (w0, w1) in tiles:
                s, p, shp = timed_tile(model, z, canvas, h0, h1, w0, w1, device)
                times.append(s)
                peak = max(peak, p)
                shape = shape or shp
            if any(t is None for t in times):
                print(f"{size:>16} {spec:>5} {'OOM':>10}   peak {peak:.1f} GiB")
                continue
            out_shape = (1, 3, (grid[0] - 1) * 8 + 1, grid[1] * SPATIAL, grid[2] * SPATIAL)
            blend = blend_seconds(out_shape, h_spans, w_spans, args.overlap, device) if len(tiles) > 1 else 0.0
            per_rank = [sum(times[k] for k in range(r, len(tiles), args.ranks)) for r in range(args.ranks)]
            w_t = max(times) + blend / len(tiles)
            w_r = max(per_rank) + blend / min(args.ranks, len(tiles))
            if len(tiles) == 1:
                untiled = times[0]
            ratio = lambda t: f"{untiled / t:6.2f}" if untiled else f"{'-':>6}"  # noqa: E731
            reduce_mb = 4 * math.prod(out_shape) / 2**20 if len(tiles) > 1 else 0.0
            tiled_ratio = (sum(times) + blend) / w_t
            largest = (max(h1 - h0 for h0, h1 in h_spans), max(w1 - w0 for w0, w1 in w_spans))
            est = diffusion_decode_peak_bytes(grid, None if len(tiles) == 1 else largest, dtype.itemsize)
            if len(tiles) > 1:  # this bench holds no blend accumulator while it decodes
                est -= BLEND_BYTES_PER_PIXEL * math.prod(out_shape[2:])
            print(f"{size:>16} {spec:>5} {max(times):10.3f} {sum(times):8.3f} {blend:8.3f} {w_t:8.3f} {ratio(w_t)} "
                  f"{tiled_ratio:6.2f} {w_r:8.3f} {ratio(w_r)} {peak:9.1f} {est / 2**30:8.1f} {reduce_mb:9.0f}",
                  flush=True)
        del z, canvas


if __name__ == "__main__":
    main()
