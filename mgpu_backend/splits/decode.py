"""Distributed video-VAE decode (docs/design/distributed-decode.md): spatial latent tiles, full time axis per tile
(LTX's causal first frame makes temporal splits error-prone), decoded round-robin on the ranks, blended in pixel space
with trapezoid masks (latent overlap × 32 px), assembled on the driver rank by one reduce.

With `world_size=1` it is the single-process tiled decode of the same tiles (the reference it must match).

Two decoders, one tiling: the conv decoder (`AutoencoderKLLTX2Video`, LTX-2.0 / 2.3 / 2.5) decodes each latent tile;
the LTX-2.5 diffusion decoder (`LTX2VideoDiffusionDecoderModel`, `models/diffusion_decoder.py`) runs all its stages
on each latent tile and denoises the tile's window of ONE noise canvas for the whole video — drawn on every rank as
ComfyUI draws it for an untiled decode (seed 0, the decoder's device and dtype) — so a tile's pixels away from its
seams equal the untiled decode's, and the result does not depend on which rank decoded which tile.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..protocol.job_results import DecodeReport
from .tiling import TileCountConfig, axis_weights, default_tiling, split_axis

SPATIAL = 32  # pixels per latent cell (VAE spatial compression)
MIN_REFLECT_CELLS = 2  # a conv decoder that pads by reflection needs this many latent cells per spatial axis
# The smallest tile the DEFAULT decode tiling makes on a split axis, in latent cells: ComfyUI 0.33's own VAEDecode,
# when it has to tile a video latent (its out-of-memory fallback, `comfy/sd.py` `VAE.decode`), starts from tiles of
# 256 px (`256 // spacial_compression_decode()` = 8 cells, overlap a quarter of that) and only grows them. Smaller
# tiles are mostly seam: a tile's pixels within the decoder's receptive field of an inner edge (6.6 cells for the
# tiny VAE, more for the real one) differ from the untiled decode's (e.g. 96×64 px in two tiles of 2 cells: ~32 %
# relative L2 away from VAEDecode, issue 36). A latent too small for two such tiles on an axis is not split on it;
# too small on both, it is decoded whole by one rank — exactly what VAEDecode computes. Explicit tiles are taken as
# asked (down to what the decoder can take: `check_decodable`).
MIN_DEFAULT_TILE = 256 // SPATIAL


def default_decode_tiling(ranks: int, grid: tuple[int, int, int], overlap: int) -> TileCountConfig:
    """The decode's default tiles for `ranks` ranks over the latent `grid` (F, H, W): the balanced grid
    (`tiling.default_tiling`) whose tiles all have at least `MIN_DEFAULT_TILE` cells on a split axis, else fewer
    tiles, down to one (the whole latent, decoded by rank 0 as ComfyUI's VAEDecode decodes it)."""
    return default_tiling(ranks, grid, overlap, min_tile=MIN_DEFAULT_TILE)


def check_decodable(vae, h_spans: list[tuple[int, int]], w_spans: list[tuple[int, int]]) -> None:
    """Refuse, before any decode, a piece (the latent, or a tile of it) the conv VAE decoder cannot take.

    The LTX conv decoders (diffusers' `AutoencoderKLLTX2Video`, ComfyUI 0.33's `VideoVAE`: the files' default
    `spatial_padding_mode` "reflect") pad their 3×3 convolutions by reflection, which torch allows only for a pad
    smaller than the axis: a piece of 1 latent cell (32 px) on an axis fails inside the first convolution
    ("Padding size should be less than the corresponding input dimension"). The whole latent is checked first, on
    both axes (ComfyUI's VAEDecode fails on it the same), then the tiles (the whole latent would decode: fewer tiles
    fix it). Raises ValueError naming the size, the rule and what would fit.
    """
    config = getattr(vae, "config", None)
    mode = config.get("decoder_spatial_padding_mode") if isinstance(config, dict) else \
        getattr(config, "decoder_spatial_padding_mode", None)
    if is_diffusion_decoder(vae) or mode != "reflect":
        return
    rule = (f"the conv VAE decoder pads by reflection and needs at least {MIN_REFLECT_CELLS} latent cells "
            f"({MIN_REFLECT_CELLS * SPATIAL} px) per axis")
    axes = (("height", h_spans), ("width", w_spans))
    for axis, spans in axes:
        length = spans[-1][1] - spans[0][0]
        if length < MIN_REFLECT_CELLS:
            raise ValueError(
                f"decode: the latent is {_cells(length)} in {axis}; {rule} (ComfyUI's VAEDecode fails the same): "
                f"make the video at least {MIN_REFLECT_CELLS * SPATIAL} px in {axis}")
    for axis, spans in axes:
        narrow = [e - s for s, e in spans if e - s < MIN_REFLECT_CELLS]
        if narrow:
            length = spans[-1][1] - spans[0][0]
            raise ValueError(
                f"decode: a {axis} tile of the {len(spans)}-tile split is {_cells(narrow[0])} in {axis}; {rule} of "
                f"each tile (the whole latent, {length} cells, decodes untiled): use fewer {axis} tiles (each needs "
                f"{MIN_REFLECT_CELLS} cells) or the default tiling")


def _cells(n: int) -> str:
    return f"{n} latent cell{'' if n == 1 else 's'} ({n * SPATIAL} px)"


def decode_tiles(vae, latent: torch.Tensor, tiling: TileCountConfig, temb: torch.Tensor | None = None,
                 group: dist.ProcessGroup | None = None, world_size: int = 1, rank: int = 0,
                 dst: int = 0) -> tuple[torch.Tensor | None, DecodeReport]:
    """Decode a de-normalized latent `[1, 128, F, H, W]` (VAE space) in spatial tiles.

    `vae`: the conv `AutoencoderKLLTX2Video` (with `temb` when it is timestep-conditioned) or the LTX-2.5
    `LTX2VideoDiffusionDecoderModel` (no `temb`; its noise canvas is drawn here on every rank, see the module doc).
    Tiles are `tiling.height × tiling.width` over the latent grid (the frame axis is never split); tile i is
    decoded by rank i mod W. Returns (pixels `[1, 3, F', 32H, 32W]` float32 on rank `dst` — None elsewhere —,
    this rank's `DecodeReport`: its tiles and seconds). Every rank of the group must call it.

    Raises ValueError when tiles would not be larger than the overlap, a piece the conv decoder cannot take
    (`check_decodable`), or a `temb` for the diffusion decoder.
    """
    if tiling.frames.num_tiles != 1:
        raise ValueError("the decode never splits the frame axis (the causal first frame); use height/width tiles")
    _, _, f, h, w = latent.shape
    param = next(vae.parameters())
    check_decodable(vae, [(0, h)], [(0, w)])  # the whole latent first: what no tiling can fix
    decode_tile = _tile_decoder(vae, latent, temb)
    h_spans = split_axis(h, tiling.height.num_tiles, tiling.height.overlap)
    w_spans = split_axis(w, tiling.width.num_tiles, tiling.width.overlap)
    check_decodable(vae, h_spans, w_spans)
    # pixel-space weights: the trapezoid over the overlap measured in pixels
    h_weights = axis_weights([(s * SPATIAL, e * SPATIAL) for s, e in h_spans], tiling.height.overlap * SPATIAL)
    w_weights = axis_weights([(s * SPATIAL, e * SPATIAL) for s, e in w_spans], tiling.width.overlap * SPATIAL)
    tiles = [(i, j) for i in range(len(h_spans)) for j in range(len(w_spans))]
    out = None
    mine = [k for k in range(len(tiles)) if k % world_size == rank]
    start = time.perf_counter()
    for k in mine:
        i, j = tiles[k]
        (h0, h1), (w0, w1) = h_spans[i], w_spans[j]
        pixels = decode_tile(h0, h1, w0, w1)
        if out is None:
            frames = pixels.shape[2]
            out = torch.zeros(1, 3, frames, h * SPATIAL, w * SPATIAL, device=pixels.device)
        weight = h_weights[i][:, None] * w_weights[j][None, :]
        out[..., h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL] += pixels * weight.to(pixels)
    seconds = time.perf_counter() - start
    if out is None:  # a rank without tiles still joins the reduce: learn the frame count from the VAE config
        frames = (f - 1) * vae.config.temporal_compression_ratio + 1
        out = torch.zeros(1, 3, frames, h * SPATIAL, w * SPATIAL, device=param.device)
    # partition of unity in pixel space (normalize where 2·overlap exceeded a tile)
    total = torch.zeros(h * SPATIAL, w * SPATIAL, dtype=torch.float64)
    for i, j in tiles:
        (h0, h1), (w0, w1) = h_spans[i], w_spans[j]
        total[h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL] += h_weights[i][:, None] * w_weights[j][None, :]
    if world_size > 1:
        dist.reduce(out, dst=dst, op=dist.ReduceOp.SUM, group=group)
    report = DecodeReport(tiles=tuple(mine), seconds=seconds, rank=rank)
    if rank != dst:
        return None, report
    if not torch.allclose(total, torch.ones_like(total), rtol=0, atol=1e-12):
        out = out / total.to(out)
    return out, report


# ---- the diffusion decoder's memory: estimate, and tile automatically rather than run out of memory ----------------

GiB = 2 ** 30
# Measured peaks of the untiled LTX-2.5 diffusion decode, one H200, bf16, random full-size weights (ComfyUI's
# LTX_24_VAE_CONFIG decoder), 121 frames (`bench/bench_diffusion_decode.py`, `torch.cuda.max_memory_allocated`:
# weights + the whole noise canvas + the decode's activations; figures of issue 27): (output pixels F'·H·W, bytes)
MEASURED_UNTILED_PEAKS = ((121 * 704 * 1280, 37 * GiB), (121 * 1088 * 1920, 85 * GiB))
(_P1, _M1), (_P2, _M2) = MEASURED_UNTILED_PEAKS
PEAK_BYTES_PER_PIXEL = (_M2 - _M1) / (_P2 - _P1)  # ≈ 358.6 B per output pixel (bf16)
PEAK_BASE_BYTES = _M1 - PEAK_BYTES_PER_PIXEL * _P1  # ≈ 0.58 GiB: about the decoder's bf16 weights
CANVAS_BYTES_PER_PIXEL = 3  # the noise canvas x_t: 3 channels, in the decoder dtype (× its itemsize)
BLEND_BYTES_PER_PIXEL = 12  # the tiled decode's float32 accumulator `[1, 3, F', H, W]` on every rank
DECODE_MARGIN_BYTES = 2 * GiB  # kept free beside the estimate (allocator fragmentation, the final float copy)
# and 15 % of the estimate besides: a one-process 2×2 decode at 1920×1088×121 with ~30 GiB free (estimate 27.5 GiB
# + 2) ran out of memory holding 28.6 GiB allocated and 2.7 GiB cached unused (bench/results/diffusion_decode_h200.txt)
DECODE_MARGIN_FRACTION = 0.15


def decode_margin_bytes(estimate: int) -> int:
    """Bytes kept free beside a decode's estimated peak `estimate` (bytes): `DECODE_MARGIN_BYTES` plus
    `DECODE_MARGIN_FRACTION` of the estimate (the caching allocator's fragmentation grows with the decode)."""
    return int(DECODE_MARGIN_BYTES + DECODE_MARGIN_FRACTION * estimate)
MAX_AUTO_TILES = 64


def diffusion_decode_peak_bytes(grid: tuple[int, int, int], tile: tuple[int, int] | None = None,
                                itemsize: int = 2) -> int:
    """Estimated peak device bytes of an LTX-2.5 diffusion decode of a latent grid `(F, H, W)` (latent cells), whole
    (`tile` None) or as one rank decoding tiles of at most `tile` = (h, w) latent cells each.

    The fit: peak = base + b · P, P = output pixels ((F-1)·8+1) · 32H · 32W, through the two measured untiled peaks
    (`MEASURED_UNTILED_PEAKS`: 37 GiB at 1280×704×121, 85 GiB at 1920×1088×121, bf16, one H200): b ≈ 358.6 B/pixel,
    base ≈ 0.58 GiB (about the decoder's weights). Two points, two parameters: an exact fit, linear in the pixels
    (the decoder is local: activations scale with the tokens); other sizes are predictions. A tiled rank holds the
    whole noise canvas (included in the fit for the whole video) and the float32 blend accumulator besides its
    tile's activations: base + b · P_tile + canvas · (P − P_tile) + 12 · P. `itemsize`: the decoder dtype's bytes
    (2 for bf16, the fit; 4 for float32 doubles the activation and canvas terms — not measured).
    """
    f, h, w = grid
    frames = (f - 1) * 8 + 1
    pixels = frames * h * w * SPATIAL * SPATIAL
    scale = itemsize / 2
    act = (PEAK_BYTES_PER_PIXEL - CANVAS_BYTES_PER_PIXEL * 2) * scale  # the fit's per-pixel term less the canvas
    canvas = CANVAS_BYTES_PER_PIXEL * itemsize
    if tile is None:
        return int(PEAK_BASE_BYTES + (act + canvas) * pixels)
    tile_pixels = frames * min(tile[0], h) * min(tile[1], w) * SPATIAL * SPATIAL
    return int(PEAK_BASE_BYTES + act * tile_pixels + canvas * pixels + BLEND_BYTES_PER_PIXEL * pixels)


def _largest_tile(grid: tuple[int, int, int], tiling: TileCountConfig) -> tuple[int, int]:
    h = max(e - s for s, e in split_axis(grid[1], tiling.height.num_tiles, tiling.height.overlap))
    w = max(e - s for s, e in split_axis(grid[2], tiling.width.num_tiles, tiling.width.overlap))
    return h, w


def _tile_label(tiling: TileCountConfig | None) -> str:
    return "untiled" if tiling is None else f"{tiling.height.num_tiles}×{tiling.width.num_tiles}"


def fit_decode_tiling(grid: tuple[int, int, int], tiling: TileCountConfig | None, free_bytes: int | None,
                      overlap: int, itemsize: int = 2) -> tuple[TileCountConfig | None, str | None]:
    """The decode's tiling made to fit `free_bytes` (an LTX-2.5 diffusion decode; `diffusion_decode_peak_bytes`).

    Args:
        grid: latent `(F, H, W)`.
        tiling: the tiling the job would use (None: untiled, one rank); tiles go round-robin over the ranks, each
            rank decodes one at a time, so a rank's peak is its largest tile's.
        free_bytes: the smallest free device memory over the ranks that decode (None: not probed, e.g. CPU: nothing
            changes).
        overlap: latent cells of overlap for new tiles (the job's decode overlap).
    Returns `(tiling, note)`: unchanged and None when the estimate plus its margin (`decode_margin_bytes`) fits; else the
    smallest balanced grid (`tiling.default_tiling`, more tiles than before) that fits, and the note for the job's
    report, e.g. "tiled 2×2 automatically: untiled needs ~85 GiB, 60 GiB free".
    Raises ValueError naming the sizes when no grid of up to `MAX_AUTO_TILES` tiles fits.
    """
    if free_bytes is None:
        return tiling, None

    def need(t: TileCountConfig | None) -> int:
        if t is None or t.height.num_tiles * t.width.num_tiles == 1:
            return diffusion_decode_peak_bytes(grid, None, itemsize)
        return diffusion_decode_peak_bytes(grid, _largest_tile(grid, t), itemsize)

    now = need(tiling)
    if now + decode_margin_bytes(now) <= free_bytes:
        return tiling, None
    count = 1 if tiling is None else tiling.height.num_tiles * tiling.width.num_tiles
    what = "untiled" if count == 1 else f"{_tile_label(tiling)} tiles"
    for n in range(count + 1, MAX_AUTO_TILES + 1):
        try:
            candidate = default_tiling(n, grid, overlap)
        except ValueError:
            continue
        if candidate.height.num_tiles * candidate.width.num_tiles <= count:
            continue  # the grid is too small for n tiles: default_tiling fell back to fewer
        if (n_bytes := need(candidate)) + decode_margin_bytes(n_bytes) <= free_bytes:
            return candidate, (f"tiled {_tile_label(candidate)} automatically: {what} "
                               f"{'needs' if count == 1 else 'need'} ~{now / GiB:.0f} GiB, "
                               f"{free_bytes / GiB:.0f} GiB free (estimated ~{n_bytes / GiB:.0f} GiB "
                               f"tiled)")
    raise ValueError(f"decode: the diffusion decoder needs ~{now / GiB:.1f} GiB {what} and no tiling of up to "
                     f"{MAX_AUTO_TILES} tiles fits the {free_bytes / GiB:.1f} GiB free (less "
                     f"a margin of {DECODE_MARGIN_BYTES / GiB:.0f} GiB + {DECODE_MARGIN_FRACTION:.0%} of the estimate): "
                     f"free the GPU or decode a shorter clip")


def free_decode_bytes(device: torch.device) -> int | None:
    """Device memory a decode can use now: the driver's free bytes plus what PyTorch's caching allocator holds
    unused (`memory_reserved - memory_allocated`); None off CUDA (host memory is not probed)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def is_diffusion_decoder(vae) -> bool:
    """True for the LTX-2.5 diffusion decoder (`LTX2VideoDiffusionDecoderModel`), False for the conv VAE."""
    from diffusers import LTX2VideoDiffusionDecoderModel

    return isinstance(vae, LTX2VideoDiffusionDecoderModel)


def _tile_decoder(vae, latent: torch.Tensor, temb: torch.Tensor | None):
    """`decode(h0, h1, w0, w1)` -> float32 pixels `[1, 3, F', 32·(h1-h0), 32·(w1-w0)]` of that latent window."""
    param = next(vae.parameters())
    if not is_diffusion_decoder(vae):
        def conv_tile(h0, h1, w0, w1):
            with torch.no_grad():
                return vae.decode(latent[:, :, :, h0:h1, w0:w1].to(param.device, param.dtype), temb,
                                  return_dict=False)[0].float()
        return conv_tile
    from ..models.diffusion_decoder import decode_vae_space, noise_canvas

    if temb is not None:
        raise ValueError("the diffusion decoder takes no decode timestep (temb must be None)")
    z = latent.to(param.device, param.dtype)
    canvas = noise_canvas(vae, z)  # the whole video's x_t, identical on every rank

    def diffusion_tile(h0, h1, w0, w1):
        return decode_vae_space(vae, z[:, :, :, h0:h1, w0:w1],
                                canvas[..., h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL]).float()
    return diffusion_tile


def decode_untiled(vae, latent: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a de-normalized latent `[1, 128, F, H, W]` in one piece -> pixels `[1, 3, F', 32H, 32W]` (the VAE's
    dtype, about -1..1); either decoder (the diffusion decoder as ComfyUI's untiled VAEDecode: noise seed 0)."""
    _, _, _, h, w = latent.shape
    check_decodable(vae, [(0, h)], [(0, w)])
    return _tile_decoder(vae, latent, temb)(0, h, 0, w)
