"""Stage 2 with tiled data parallelism (TDP) and the tiled VAE decode: per-tile cost against the untiled work.

For each tile count T (1, 2, 4, 8 by default; the balanced grid of docs/design/tiled-data-parallel.md: 1×2, 2×2, 2×4,
overlap 5 latent cells) at the stage-2 size (default 1920×1088×121 -> latent 16×34×60 = 32640 tokens):
- the transformer forward of the largest tile (tiles differ by at most one cell per axis; with one tile per GPU the
  stage waits for the largest) against the untiled forward: `tile/untiled` (ideal between 1/T² for pure attention
  and 1/T for pure linear layers, plus the overlap), `speedup` = untiled / tile (T GPUs, one tile each, the one
  all_reduce per forward not counted) and `work` = T·tile / untiled (total compute against one untiled forward);
- the VAE decode of the largest spatial tile (decode overlap 2 cells = 64 px, full time axis) against the untiled
  decode, same columns (an untiled decode that runs out of memory is reported as OOM).

Weights are random: a 19B-shaped `LTX2VideoTransformer3DModel` (the real LTX-2.0 config, `--blocks` of the 48,
times scaled to 48 blocks; the embeddings and output layers are negligible) and a real-shaped LTX-2 video VAE
(diffusers' default `AutoencoderKLLTX2Video` config: decoder 1024/512/256/128 channels, 5 res layers per stage,
non-causal decoder, reflect padding), both built directly in GPU memory in bf16. A stage-2 step is one forward
(no guidance); the reference TDP schedule (0.625, 0.4, 0) has 2 steps.

    python bench/bench_tdp.py --blocks 8                 # on one H200: a table, times scaled to 48 blocks
    python bench/bench_tdp.py --blocks 48 --tiles 1,2,4,8,16
    python bench/bench_tdp.py --tiny                     # CPU smoke check (tiny configs, a small size)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend.engine import forward as model_forward  # noqa: E402
from mgpu_backend.engine import latents as L  # noqa: E402
from mgpu_backend.engine.attention import LTX2AttnProcessor, use_processor  # noqa: E402
from mgpu_backend.models import configs  # noqa: E402
from mgpu_backend.splits.tiling import default_tiling, make_tiles, split_axis  # noqa: E402

LTX2_19B = {  # LTX-2.0 transformer metadata (docs/design/models.md#the-releases; diffusers' converter config)
    "num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
    "caption_channels": 3840, "num_layers": 48, "rope_type": "split", "frequencies_precision": "float64",
    "av_ca_timestep_scale_multiplier": 1000,
}
# the LTX-2 video-VAE layout: diffusers' default `AutoencoderKLLTX2Video` config (decoder conv_in 128->1024, 5 res
# layers at 1024 / 512 / 256 / 128 channels between three 2× depth-to-space upsamplers, patch 4) with these fields;
# timestep conditioning stays off (when on it adds a per-block scale/shift: negligible time)
REAL_VAE = dict(decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8)


def _quiet_diffusers():
    from diffusers.utils import logging

    logging.set_verbosity_error()  # the "should be kept in float32: []" notice of `.to(dtype)`: nothing is


def _random_fill(model, std: float = 0.02):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model.eval().requires_grad_(False)


def build_transformer(meta: dict, device, dtype):
    """On the meta device, cast, then allocated on `device` in `dtype` (no fp32 copy of 19B weights)."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta))
    model = model.to(dtype).to_empty(device=device)  # the RoPE modules hold no buffers: nothing else to rebuild
    return _random_fill(model)


def build_vae(kwargs: dict, device, dtype):
    from diffusers import AutoencoderKLLTX2Video

    with torch.device("meta"):
        vae = AutoencoderKLLTX2Video(**kwargs)
    vae.encoder = None  # decode only
    vae = vae.to(dtype).to_empty(device=device)
    return _random_fill(vae)


def transformer_inputs(model, grid, audio_tokens, fps, device, dtype):
    f, h, w = grid
    t = f * h * w
    g = torch.Generator(device="cpu").manual_seed(0)
    ctx = torch.randn(1, 1024, model.config.caption_channels, generator=g).to(device, dtype)
    return dict(hidden_states=torch.randn(1, t, 128, generator=g).to(device, dtype),
                audio_hidden_states=torch.randn(1, audio_tokens, 128, generator=g).to(device, dtype),
                encoder_hidden_states=ctx, audio_encoder_hidden_states=ctx,
                timestep=torch.full((1, t), 625.0, device=device),
                audio_timestep=torch.zeros(1, audio_tokens, device=device),  # frozen audio (timestep 0)
                sigma=torch.tensor([625.0], device=device), audio_sigma=torch.zeros(1, device=device),
                encoder_attention_mask=torch.ones(1, 1024, device=device),
                audio_encoder_attention_mask=torch.ones(1, 1024, device=device),
                # a tile's normalized positions are those of a grid of its shape starting at 0
                video_coords=L.video_coords(model, 1, f, h, w, fps, device=device),
                audio_coords=L.audio_coords(model, 1, audio_tokens, device=device),
                use_cross_timestep=True, return_dict=False)


def timeit(fn, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _attempt(fn):
    """Seconds, or the reason it could not run (out of memory on a big untiled decode)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return "OOM"


def _fmt(x, scale=1000.0, width=9, digits=1):
    return f"{x * scale:{width}.{digits}f}" if isinstance(x, float) else f"{x:>{width}}"


def _row(t, shape, tokens, tile_s, untiled_s):
    cols = [f"{t:>5}", f"{shape:>16}", f"{tokens:>8}", _fmt(tile_s)]
    if isinstance(tile_s, float) and isinstance(untiled_s, float):
        cols += [f"{tile_s / untiled_s:12.3f}", f"{1 / t:6.3f}", f"{untiled_s / tile_s:8.2f}",
                 f"{t * tile_s / untiled_s:6.2f}"]
    else:
        cols += [f"{'-':>12}", f"{1 / t:6.3f}", f"{'-':>8}", f"{'-':>6}"]
    return " ".join(cols)


HEADER = (f"{'tiles':>5} {'tile (f×h×w)':>16} {'tokens':>8} {'ms':>9} {'tile/untiled':>12} {'1/T':>6} "
          f"{'speedup':>8} {'work':>6}")


def bench_transformer(args, device, dtype, grid, counts):
    meta = dict(LTX2_19B, num_layers=args.blocks)
    if args.tiny:
        from mgpu_backend.testing.tiny import tiny_transformer_metadata

        meta = tiny_transformer_metadata("2.0")
    scale = 48 / meta["num_layers"]
    model = build_transformer(meta, device, dtype)
    use_processor(model, LTX2AttnProcessor())  # the processor TDP tiles run with
    audio_tokens = L.audio_latent_frames(args.frames, args.fps)
    print(f"\nstage-2 transformer forward ({meta['num_layers']} blocks measured, times scaled ×{scale:g} to 48; "
          f"{audio_tokens} audio tokens, 1024 text tokens; tile overlap {args.overlap} cells)")
    print(HEADER)

    def forward_time(tile_grid):
        kw = transformer_inputs(model, tile_grid, audio_tokens, args.fps, device, dtype)
        with torch.no_grad():
            seconds = timeit(lambda: model_forward.call_diffusers(model, **kw), args.iters) * scale  # the engine's
        del kw
        return seconds

    untiled = _attempt(lambda: forward_time(grid))
    for t in counts:
        tiling = default_tiling(t, grid, args.overlap) if t > 1 else None
        shape = make_tiles(grid, tiling)[0][0].shape if tiling else grid
        seconds = untiled if t == 1 else _attempt(lambda: forward_time(shape))
        print(_row(t, "×".join(map(str, shape)), shape[0] * shape[1] * shape[2], seconds, untiled))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_decode(args, device, dtype, grid, counts):
    if args.tiny:
        from mgpu_backend.testing.tiny import tiny_vae_metadata

        kwargs = configs.video_vae_kwargs(tiny_vae_metadata())
    else:
        kwargs = dict(REAL_VAE)
    vae = build_vae(kwargs, device, dtype)
    f, h, w = grid
    latent = torch.randn(1, 128, f, h, w, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    print(f"\nVAE decode ({'tiny' if args.tiny else 'real-shaped'} decoder, {(f - 1) * 8 + 1} frames; spatial tiles, "
          f"full time axis, overlap {args.decode_overlap} cells = {args.decode_overlap * 32} px)")
    print(HEADER.replace("tokens", "pixels"))

    def decode_time(h0, h1, w0, w1):
        z = latent[..., h0:h1, w0:w1].contiguous()
        with torch.no_grad():
            return timeit(lambda: vae.decode(z, None, return_dict=False), args.iters)

    untiled = _attempt(lambda: decode_time(0, h, 0, w))
    for t in counts:
        if t == 1:
            hs, ws = (0, h), (0, w)
        else:
            tiling = default_tiling(t, grid, args.decode_overlap)
            hs = split_axis(h, tiling.height.num_tiles, tiling.height.overlap)[0]
            ws = split_axis(w, tiling.width.num_tiles, tiling.width.overlap)[0]
        seconds = untiled if t == 1 else _attempt(lambda: decode_time(*hs, *ws))
        th, tw = hs[1] - hs[0], ws[1] - ws[0]
        print(_row(t, f"{f}×{th}×{tw}", th * tw * 32 * 32, seconds, untiled))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks to build (times scaled to 48)")
    ap.add_argument("--width", type=int, default=1920)
    ap.add_argument("--height", type=int, default=1088)
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--fps", type=float, default=24.0)
    ap.add_argument("--tiles", default="1,2,4,8", help="tile counts (balanced grids)")
    ap.add_argument("--overlap", type=int, default=5, help="TDP tile overlap in latent cells")
    ap.add_argument("--decode-overlap", type=int, default=2, help="decode tile overlap in latent cells")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-transformer", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny configs at 512×256×9")
    args = ap.parse_args()
    _quiet_diffusers()
    if args.tiny:
        args.width, args.height, args.frames, args.iters = 512, 256, 9, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = (L.latent_frames(args.frames), args.height // 32, args.width // 32)
    counts = [int(c) for c in args.tiles.split(",") if c]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, {dtype}; {args.width}×{args.height}×{args.frames} -> stage-2 latent "
          f"{grid[0]}×{grid[1]}×{grid[2]} = {grid[0] * grid[1] * grid[2]} tokens")
    if not args.no_transformer:
        bench_transformer(args, device, dtype, grid, counts)
    if not args.no_decode:
        bench_decode(args, device, dtype, grid, counts)


if __name__ == "__main__":
    main()
