"""Distributed video-VAE decode (DESIGN.md §6): spatial latent tiles, full time axis per tile (LTX's causal first
frame makes temporal splits error-prone), decoded round-robin on the ranks, blended in pixel space with trapezoid
masks (latent overlap × 32 px), assembled on the driver rank by one reduce.

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

from .tiling import TileCountConfig, axis_weights, split_axis

SPATIAL = 32  # pixels per latent cell (VAE spatial compression)
MIN_REFLECT_CELLS = 2  # a conv decoder that pads by reflection needs this many latent cells per spatial axis


def check_decodable(vae, h_spans: list[tuple[int, int]], w_spans: list[tuple[int, int]]) -> None:
    """Refuse, before any decode, a piece (the latent, or a tile of it) the conv VAE decoder cannot take.

    The LTX conv decoders (diffusers' `AutoencoderKLLTX2Video`, ComfyUI 0.33's `VideoVAE`: the files' default
    `spatial_padding_mode` "reflect") pad their 3×3 convolutions by reflection, which torch allows only for a pad
    smaller than the axis: an axis of 1 latent cell (32 px) fails inside the first convolution ("Padding size should be
    less than the corresponding input dimension"), in ComfyUI's VAEDecode as here. Raises ValueError naming the size,
    the rule and what would fit.
    """
    config = getattr(vae, "config", None)
    mode = config.get("decoder_spatial_padding_mode") if isinstance(config, dict) else \
        getattr(config, "decoder_spatial_padding_mode", None)
    if is_diffusion_decoder(vae) or mode != "reflect":
        return
    for axis, spans in (("height", h_spans), ("width", w_spans)):
        narrow = [e - s for s, e in spans if e - s < MIN_REFLECT_CELLS]
        if not narrow:
            continue
        what = "the latent" if len(spans) == 1 else f"a {axis} tile of the {len(spans)}-tile split"
        fix = f"make the video at least {MIN_REFLECT_CELLS * SPATIAL} px in {axis}" if len(spans) == 1 else \
            f"use fewer {axis} tiles (each needs {MIN_REFLECT_CELLS} cells)"
        raise ValueError(
            f"decode: {what} is {narrow[0]} latent cell ({narrow[0] * SPATIAL} px) in {axis}; the conv VAE decoder "
            f"pads by reflection and needs at least {MIN_REFLECT_CELLS} latent cells ({MIN_REFLECT_CELLS * SPATIAL} "
            f"px) per axis (ComfyUI's VAEDecode fails the same): {fix}")


def decode_tiles(vae, latent: torch.Tensor, tiling: TileCountConfig, temb: torch.Tensor | None = None,
                 group: dist.ProcessGroup | None = None, world_size: int = 1, rank: int = 0,
                 dst: int = 0) -> tuple[torch.Tensor | None, dict]:
    """Decode a de-normalized latent `[1, 128, F, H, W]` (VAE space) in spatial tiles.

    `vae`: the conv `AutoencoderKLLTX2Video` (with `temb` when it is timestep-conditioned) or the LTX-2.5
    `LTX2VideoDiffusionDecoderModel` (no `temb`; its noise canvas is drawn here on every rank, see the module doc).
    Tiles are `tiling.height × tiling.width` over the latent grid (the frame axis is never split); tile i is
    decoded by rank i mod W. Returns (pixels `[1, 3, F', 32H, 32W]` float32 on rank `dst` — None elsewhere —,
    report dict with this rank's tiles and seconds). Every rank of the group must call it.

    Raises ValueError when tiles would not be larger than the overlap, a piece the conv decoder cannot take
    (`check_decodable`), or a `temb` for the diffusion decoder.
    """
    if tiling.frames.num_tiles != 1:
        raise ValueError("the decode never splits the frame axis (the causal first frame); use height/width tiles")
    _, _, f, h, w = latent.shape
    param = next(vae.parameters())
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
    report = {"rank": rank, "tiles": mine, "seconds": seconds}
    if rank != dst:
        return None, report
    if not torch.allclose(total, torch.ones_like(total), rtol=0, atol=1e-12):
        out = out / total.to(out)
    return out, report


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
