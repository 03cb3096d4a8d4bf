"""Distributed video-VAE decode (docs/design/distributed-decode.md): spatial latent tiles (full time axis), round-robin
over W = 1 / 2 gloo ranks (`tests/_dist.py`), blended in pixel space with trapezoid masks (latent overlap × 32 px),
assembled on rank 0. On a stand-in VAE and on the tiny LTX-2 / LTX-2.3 VAEs (fp32, CPU).

Tolerances, and why:
- W ranks vs one rank (`decode_tiles` with world_size 1, same tiles): every tile decode is bit-identical in any
  process; only the order of the fp32 sum differs (rank buffers reduced by gloo vs tiles added one after another).
  A pixel covered by at most two tiles is a sum of at most two non-zero terms, so it must be bit-identical
  (`torch.equal`); pixels of 3-4 tiles (2×2 corners, normalized 3-way overlaps) may differ by reassociation of
  ≤ 4 fp32 terms: asserted |Δ| ≤ 1e-6·(1 + |ref|) (measured ≈ 9e-8).
- tiled vs untiled `vae.decode`, away from the seams: the tiny VAE decoder is local (3×3×3 convolutions, per-pixel
  RMS norms, depth-to-space upsampling; no attention, no group norm) with reflect padding at its borders, so a
  tile's pixel differs from the untiled one only if its receptive field reaches past an interior tile edge. The
  radius R is measured here by perturbing one latent cell (R = 212 px = 6.6 latent cells for the tiny VAE: conv_in,
  the mid res block and the first upsampler conv at latent resolution, then 3 more convs at each of 2×, 4×, 8×).
  A pixel at least R px from every interior edge of every tile covering it is "clean"; there the tiled decode must
  match the untiled one to 1e-5 (measured ≈ 1.5e-6, the rounding of convolutions over different input sizes;
  pixel values are O(1)). Within R of a seam the pixels differ by up to ≈ 3 (reported, not asserted: that is the
  tiling approximation the blend hides).
- stand-in ramp: a VAE whose output is a fixed smooth function of the global pixel position: the blend must
  reproduce it to 1e-6 (fp32 rounding of Σ wᵢ·x with Σ wᵢ = 1, ≈ 2e-7).
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from _dist import run_ranks
from mgpu_backend.models.loader import load_components
from mgpu_backend.splits.decode import SPATIAL, decode_tiles
from mgpu_backend.splits.tiling import DimensionTilingConfig, TileCountConfig, split_axis

torch.set_num_threads(1)

VARIANTS = ("2.0", "2.3")
RAMP_TOL = 1e-6
RANK_RTOL = 1e-6
CLEAN_TOL = 1e-5

# tiny-VAE cases decoded on W ranks and on one: (latent grid (F, H, W), tiling)
DECODE_CASES = {
    "one-tile": ((2, 3, 4), TileCountConfig()),                      # W=2: rank 1 decodes nothing, still reduces
    "1x2": ((2, 4, 6), TileCountConfig.spatial(1, 2, overlap=1)),
    "2x2": ((2, 4, 6), TileCountConfig.spatial(2, 2, overlap=1)),    # 4-way corners; two tiles per rank
    "1x3-normalized": ((2, 4, 6), TileCountConfig(width=DimensionTilingConfig(3, 2))),  # 3-way overlaps
    "seams": ((2, 6, 20), TileCountConfig.spatial(1, 2, overlap=2)),  # wide enough for pixels away from seams
}
RAMP_CASES = {
    "one-tile": ((2, 3, 5), TileCountConfig()),
    "overlap0": ((2, 4, 6), TileCountConfig.spatial(2, 3, overlap=0)),
    "uneven": ((2, 7, 11), TileCountConfig.spatial(2, 3, overlap=2)),
    "normalized": ((2, 3, 10), TileCountConfig(width=DimensionTilingConfig(4, 3))),
    "many": ((3, 9, 17), TileCountConfig.spatial(3, 5, overlap=1)),
}


# ---- stand-in VAE ------------------------------------------------------------------------------------------------

class RampVAE(nn.Module):
    """A stand-in decoder whose pixels are a smooth function of their global position. The latent carries each
    cell's global (row, column) in channels 0 and 1; `decode` upsamples them nearest ×32 and adds the position of
    the pixel inside its cell, so every tile reproduces its part of one global image. Time: (F − 1)·8 + 1 frames."""

    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # decode_tiles reads the device and dtype from a parameter
        self.config = types.SimpleNamespace(temporal_compression_ratio=8)

    @staticmethod
    def image(frames: int, height_px: int, width_px: int, row0=None, col0=None) -> torch.Tensor:
        t = torch.arange(frames, dtype=torch.float32)[:, None, None]
        y = (row0 if row0 is not None else torch.arange(height_px, dtype=torch.float32)[:, None])[None]
        x = (col0 if col0 is not None else torch.arange(width_px, dtype=torch.float32)[None, :])[None]
        channels = [0.3 + 0.002 * y - 0.001 * x + 0.01 * t, 0.1 * torch.sin(0.01 * y + 0.02 * x) + 0.005 * t,
                    (0.5 + 0.001 * (x + y)).expand(frames, height_px, width_px)]
        return torch.stack([c.expand(frames, height_px, width_px) for c in channels])[None]  # [1, 3, T, H, W]

    def decode(self, z, temb=None, return_dict=False):
        f = z.shape[2]
        frames = (f - 1) * self.config.temporal_compression_ratio + 1
        rows = z[0, 0, 0, :, 0].repeat_interleave(SPATIAL) * SPATIAL + torch.arange(z.shape[3] * SPATIAL) % SPATIAL
        cols = z[0, 1, 0, 0, :].repeat_interleave(SPATIAL) * SPATIAL + torch.arange(z.shape[4] * SPATIAL) % SPATIAL
        out = self.image(frames, z.shape[3] * SPATIAL, z.shape[4] * SPATIAL, rows[:, None], cols[None, :])
        return (out + 0 * self.anchor,)


def _position_latent(grid) -> torch.Tensor:
    f, h, w = grid
    z = torch.zeros(1, 128, f, h, w)
    z[0, 0] = torch.arange(h, dtype=torch.float32)[None, :, None]
    z[0, 1] = torch.arange(w, dtype=torch.float32)[None, None, :]
    return z


def _ramp_error(case: str, world: int = 1, rank: int = 0) -> float | None:
    grid, tiling = RAMP_CASES[case]
    pixels, _ = decode_tiles(RampVAE(), _position_latent(grid), tiling, None, None, world, rank)
    if pixels is None:
        return None
    f, h, w = grid
    return float((pixels - RampVAE.image((f - 1) * 8 + 1, h * SPATIAL, w * SPATIAL)).abs().max())


@pytest.mark.parametrize("case", list(RAMP_CASES))
def test_ramp_reproduced(case):
    err = _ramp_error(case)
    assert err <= RAMP_TOL, f"{case}: the blended stand-in decode is off by {err:.2e}"


class MarkerVAE(RampVAE):
    """Decodes tile `mark` (in call order) to ones and every other tile to zeros: the blend then reads back the
    (normalized) pixel weight map of that tile."""

    def __init__(self, mark: int):
        super().__init__()
        self.mark, self.calls = mark, 0

    def decode(self, z, temb=None, return_dict=False):
        frames = (z.shape[2] - 1) * self.config.temporal_compression_ratio + 1
        value = 1.0 if self.calls == self.mark else 0.0
        self.calls += 1
        return (torch.full((1, 3, frames, z.shape[3] * SPATIAL, z.shape[4] * SPATIAL), value) + 0 * self.anchor,)


def _trapezoid(spans_px: list[tuple[int, int]], overlap_px: int, length_px: int) -> list[torch.Tensor]:
    """The rule written out: over an overlap of O px the outgoing tile weighs (O+1−k)/(O+1), the incoming k/(O+1),
    k = 1..O; 1 elsewhere inside the tile, 0 outside."""
    out = []
    for i, (a, b) in enumerate(spans_px):
        w = torch.zeros(length_px, dtype=torch.float64)
        w[a:b] = 1.0
        k = torch.arange(1, overlap_px + 1, dtype=torch.float64)
        if i > 0:
            w[a:a + overlap_px] = k / (overlap_px + 1)
        if i < len(spans_px) - 1:
            w[b - overlap_px:b] = (overlap_px + 1 - k) / (overlap_px + 1)
        out.append(w)
    return out


def _weight_maps(grid, tiling) -> torch.Tensor:
    """[tiles, H px, W px] normalized pixel weights read back through `decode_tiles`."""
    maps = []
    for mark in range(tiling.num_tiles):
        pixels, _ = decode_tiles(MarkerVAE(mark), _position_latent(grid), tiling)
        assert (pixels == pixels[:, :1, :1]).all()  # the same weight for every channel and frame
        maps.append(pixels[0, 0, 0].double())
    return torch.stack(maps)


WEIGHT_CASES = {
    "1x2": ((2, 3, 6), TileCountConfig.spatial(1, 2, overlap=1)),
    "2x3": ((2, 5, 8), TileCountConfig.spatial(2, 3, overlap=1)),
    "2x2 overlap 2": ((2, 6, 7), TileCountConfig.spatial(2, 2, overlap=2)),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_pixel_weights_are_trapezoids(case):
    """The pixel-space masks are the trapezoids over latent overlap × 32 px (products over the two axes) and sum to
    one without normalization. (The ramp test alone cannot see the weights: every tile of the ramp stand-in is
    exact, so any normalized blend reproduces it; it checks placement and coverage.)"""
    grid, tiling = WEIGHT_CASES[case]
    maps = _weight_maps(grid, tiling)
    _, h, w = grid
    rows = _trapezoid([(a * SPATIAL, b * SPATIAL) for a, b in split_axis(h, tiling.height.num_tiles,
                                                                         tiling.height.overlap)],
                      tiling.height.overlap * SPATIAL, h * SPATIAL)
    cols = _trapezoid([(a * SPATIAL, b * SPATIAL) for a, b in split_axis(w, tiling.width.num_tiles,
                                                                         tiling.width.overlap)],
                      tiling.width.overlap * SPATIAL, w * SPATIAL)
    expect = torch.stack([r[:, None] * c[None, :] for r in rows for c in cols])
    assert (expect.sum(0) - 1).abs().max() < 1e-12  # the rule itself is a partition of unity here
    torch.testing.assert_close(maps, expect, rtol=0, atol=RAMP_TOL)


def test_pixel_weight_check_can_fail(monkeypatch):
    """A hard-pasted first tile (its trailing ramp replaced by ones) is caught by the weight read-back."""
    import mgpu_backend.splits.decode as D

    real = D.axis_weights

    def broken(spans, overlap):
        weights = real(spans, overlap)
        return [torch.ones_like(weights[0])] + weights[1:]

    monkeypatch.setattr(D, "axis_weights", broken)
    with pytest.raises(AssertionError):
        test_pixel_weights_are_trapezoids("1x2")


def test_refuses_frame_tiles_and_small_tiles():
    vae = RampVAE()
    with pytest.raises(ValueError, match="never splits the frame axis"):
        decode_tiles(vae, _position_latent((3, 4, 4)), TileCountConfig(frames=DimensionTilingConfig(2, 0)))
    with pytest.raises(ValueError, match="3 tiles with overlap 2 on an axis of 4 latent cells"):
        decode_tiles(vae, _position_latent((2, 4, 4)), TileCountConfig.spatial(1, 3, overlap=2))


# ---- the tiny VAE: W ranks vs one rank -------------------------------------------------------------------------------

def _latent(grid, seed=0) -> torch.Tensor:
    return torch.randn(1, 128, *grid, generator=torch.Generator().manual_seed(seed))


def _rank_fn(rank: int, world: int, checkpoints: dict) -> dict:
    out = {}
    for variant, path in checkpoints.items():
        vae = load_components(path, dtype=torch.float32).video_vae
        for name, (grid, tiling) in DECODE_CASES.items():
            pixels, report = decode_tiles(vae, _latent(grid), tiling, None, None, world, rank)
            out[variant, name] = (pixels, report.tiles)
    for case in RAMP_CASES:
        out["ramp", case] = _ramp_error(case, world, rank)
    return out


def _pixel_coverage(grid, tiling) -> torch.Tensor:
    _, h, w = grid
    count = torch.zeros(h * SPATIAL, w * SPATIAL, dtype=torch.int64)
    for h0, h1 in split_axis(h, tiling.height.num_tiles, tiling.height.overlap):
        for w0, w1 in split_axis(w, tiling.width.num_tiles, tiling.width.overlap):
            count[h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL] += 1
    return count


@pytest.fixture(scope="module")
def vaes(tiny_dir):
    return {v: load_components(tiny_dir[v]["checkpoint"], dtype=torch.float32).video_vae for v in VARIANTS}


@pytest.fixture(scope="module")
def references(vaes):
    """Single-process tiled decodes of the same tiles, and the untiled decodes."""
    out = {}
    for variant, vae in vaes.items():
        for name, (grid, tiling) in DECODE_CASES.items():
            tiled, report = decode_tiles(vae, _latent(grid), tiling)
            assert report.tiles == tuple(range(tiling.num_tiles))
            with torch.no_grad():
                untiled = vae.decode(_latent(grid), None, return_dict=False)[0].float()
            out[variant, name] = (tiled, untiled)
    return out


@pytest.mark.parametrize("world", [2])  # W=4 adds only process start-up time: W=2 covers idle and busy ranks
def test_distributed_decode_equals_single_process(tiny_dir, references, world):
    checkpoints = {v: str(tiny_dir[v]["checkpoint"]) for v in VARIANTS}
    results = run_ranks(_rank_fn, world, checkpoints)
    worst = 0.0
    for variant in VARIANTS:
        for name, (grid, tiling) in DECODE_CASES.items():
            ref = references[variant, name][0]
            pixels = results[0][variant, name][0]
            assert [results[r][variant, name][1] for r in range(world)] == \
                [tuple(range(r, tiling.num_tiles, world)) for r in range(world)]  # round-robin
            assert all(results[r][variant, name][0] is None for r in range(1, world)), "frames only on rank 0"
            assert pixels.shape == ref.shape == (1, 3, (grid[0] - 1) * 8 + 1, grid[1] * 32, grid[2] * 32)
            low = (_pixel_coverage(grid, tiling) <= 2).expand_as(ref)
            assert torch.equal(pixels[low], ref[low]), f"{variant} {name} W={world}: pixels of ≤ 2 tiles differ"
            diff = (pixels - ref).abs()
            worst = max(worst, float((diff / (1 + ref.abs())).max()))
            assert (diff <= RANK_RTOL * (1 + ref.abs())).all(), f"{variant} {name} W={world}: {diff.max():.2e}"
    print(f"W={world}: max |Δ|/(1+|ref|) {worst:.2e}")
    for case in RAMP_CASES:
        assert results[0]["ramp", case] <= RAMP_TOL
        assert all(results[r]["ramp", case] is None for r in range(1, world))


# ---- the tiny VAE: tiled vs untiled away from the seams -------------------------------------------------------------

def _receptive_radius(vae, latent: torch.Tensor, untiled: torch.Tensor) -> int:
    """Pixels (either side) that a change of one latent cell reaches, measured along the width of the untiled decode
    (the long axis, so that the change does not reach the image border; the kernels are square, so the radius is the
    same along the height)."""
    _, _, _, h, w = latent.shape
    ch, cw = h // 2, w // 2
    bumped = latent.clone()
    bumped[..., ch, cw] += 1.0
    with torch.no_grad():
        changed = (vae.decode(bumped, None, return_dict=False)[0].float() - untiled).abs().amax(dim=(0, 1, 2)) > 0
    cols = changed.any(dim=0).nonzero().flatten()
    assert 0 < int(cols.min()) and int(cols.max()) < w * SPATIAL - 1, "receptive field clipped by the border"
    return max(cw * SPATIAL - int(cols.min()), int(cols.max()) - (cw * SPATIAL + SPATIAL - 1))


def _clean_mask(grid, tiling, radius: int) -> torch.Tensor:
    """True where every tile covering the pixel is at least `radius` px from all its interior edges."""
    _, h, w = grid
    height, width = h * SPATIAL, w * SPATIAL
    clean = torch.ones(height, width, dtype=torch.bool)
    ys, xs = torch.arange(height)[:, None], torch.arange(width)[None, :]
    for h0, h1 in split_axis(h, tiling.height.num_tiles, tiling.height.overlap):
        for w0, w1 in split_axis(w, tiling.width.num_tiles, tiling.width.overlap):
            a, b, c, d = h0 * SPATIAL, h1 * SPATIAL, w0 * SPATIAL, w1 * SPATIAL
            inside = (ys >= a) & (ys < b) & (xs >= c) & (xs < d)
            ok = ((a == 0) | (ys >= a + radius)) & ((b == height) | (ys < b - radius)) & \
                 ((c == 0) | (xs >= c + radius)) & ((d == width) | (xs < d - radius))
            clean &= ~inside | ok
    return clean


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiled_decode_matches_untiled_away_from_seams(vaes, references, variant):
    grid, tiling = DECODE_CASES["seams"]
    tiled, untiled = references[variant, "seams"]
    radius = _receptive_radius(vaes[variant], _latent(grid), untiled)
    clean = _clean_mask(grid, tiling, radius)
    assert clean.float().mean() > 0.3, f"too few pixels away from the seams ({clean.float().mean():.0%})"
    err = (tiled - untiled).abs().amax(dim=(0, 1, 2))  # [H, W] over channels and frames
    clean_err, seam_err = float(err[clean].max()), float(err[~clean].max())
    print(f"{variant}: receptive radius {radius} px; max |tiled − untiled| {clean_err:.2e} away from the seams "
          f"({clean.float().mean():.0%} of the pixels), {seam_err:.2e} within {radius} px of one; pixel range "
          f"{float(untiled.min()):.2f}..{float(untiled.max()):.2f}")
    assert clean_err <= CLEAN_TOL, f"{variant}: tiled decode differs by {clean_err:.2e} away from the seams"


# ---- small and odd latent sizes (issue 24) ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def diffusion_vae(tmp_path_factory):
    from mgpu_backend.models.loader import load_diffusion_vae
    from mgpu_backend.testing.tiny_vae25 import write_tiny_diffusion_vae

    path = write_tiny_diffusion_vae(tmp_path_factory.mktemp("dvae") / "ltx-2.5-tiny-diffusion-vae.safetensors", 0)
    return load_diffusion_vae(path, dtype=torch.float32).decoder


SMALL_GRIDS = [(1, 2, 2), (2, 2, 3), (3, 3, 2), (2, 2, 1), (1, 1, 3), (3, 1, 1)]  # (frames, height, width) cells


@pytest.mark.parametrize("grid", SMALL_GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_small_and_odd_latents_decode_or_are_refused_before_work(vaes, diffusion_vae, grid, monkeypatch):
    """Every latent of 1-3 frames and 1-3 cells high or wide: the conv decoder (reflection padding) decodes it
    untiled when both axes have 2 cells or more; an axis — or, split in two tiles, a tile — of one cell is refused
    before decoding anything, naming the size and the rule (torch's reflection padding needs a pad smaller than the
    axis: ComfyUI 0.33's VAEDecode, the same decoder, fails inside its first convolution). The LTX-2.5 diffusion
    decoder takes every size, untiled and in two tiles."""
    from mgpu_backend.splits.decode import decode_untiled

    latent = _latent(grid)
    pixel_shape = (1, 3, (grid[0] - 1) * 8 + 1, grid[1] * SPATIAL, grid[2] * SPATIAL)
    for tiling in (None, TileCountConfig.spatial(1, 2, overlap=0) if grid[2] > 1 else None):
        pixels = decode_untiled(diffusion_vae, latent) if tiling is None else decode_tiles(diffusion_vae, latent,
                                                                                           tiling)[0]
        assert pixels.shape == pixel_shape and torch.isfinite(pixels).all()
    vae = vaes["2.3"]
    assert vae.config.decoder_spatial_padding_mode == "reflect"
    calls = []
    real = type(vae).decode
    monkeypatch.setattr(type(vae), "decode", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    _, h, w = grid
    if min(h, w) < 2:
        axis = "height" if h < 2 else "width"
        with pytest.raises(ValueError, match=rf"the latent is 1 latent cell \(32 px\) in {axis}; the conv VAE decoder "
                                             r"pads by reflection and needs at least 2 latent cells \(64 px\)"):
            decode_untiled(vae, latent)
        assert calls == []
        return
    untiled = decode_untiled(vae, latent)
    assert untiled.shape == pixel_shape and torch.isfinite(untiled).all()
    for tiling, axis, length in ((TileCountConfig.spatial(1, 2, overlap=0), "width", w),
                                 (TileCountConfig.spatial(2, 1, overlap=0), "height", h)):
        calls.clear()
        if length < 4:  # two tiles of a 2- or 3-cell axis: one of them is 1 cell
            with pytest.raises(ValueError, match=rf"a {axis} tile of the 2-tile split is 1 latent cell .* use fewer "
                                                 rf"{axis} tiles"):
                decode_tiles(vae, latent, tiling)
            assert calls == []


# ---- the default tiling at the smallest sizes: what ComfyUI's VAEDecode computes (issue 36) -------------------------

# pixel size (width × height × frames) -> latent grid (F, H, W); 9 frames = 2 latent frames
SMALLEST = {"64x64x9": (2, 2, 2), "96x64x9": (2, 2, 3), "64x96x9": (2, 3, 2), "32x64x9": (2, 2, 1),
            "416x64x9": (2, 2, 13)}  # 13 cells: the widest latent two default tiles of 8 cells cannot cover
FIRST_SPLIT = (2, 2, 14)  # 448 px: the narrowest width the default splits in two (two 8-cell tiles, 2 overlapping)


def _default_decode_tiling(ranks: int, grid) -> TileCountConfig:
    """What the decode job resolves for a request without tiles (`run_decode` -> `TwoStagePipeline.resolve_tiling`)."""
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    return TwoStagePipeline.resolve_tiling(None, ranks, grid, 2, "decode tiles")


def test_default_decode_tiles_are_never_smaller_than_comfyui_vaedecode_tiles():
    """Every latent of 1..40 cells high and wide, 2..8 ranks: the default decode tiling (overlap 2, the node's
    default) never makes a tile of fewer than 8 cells (256 px: the smallest tile ComfyUI 0.33's VAEDecode makes when
    it tiles a video latent) on an axis it splits; a latent too small for that is not split there (one tile: rank 0
    decodes it whole). And it splits as soon as two such tiles fit: 14 cells wide at 2 ranks."""
    from mgpu_backend.splits.decode import MIN_DEFAULT_TILE

    assert MIN_DEFAULT_TILE * SPATIAL == 256
    for ranks in range(2, 9):
        for h in range(1, 41):
            for w in range(1, 41):
                tiling = _default_decode_tiling(ranks, (2, h, w))
                assert tiling.frames.num_tiles == 1 and tiling.num_tiles <= ranks
                for length, axis in ((h, tiling.height), (w, tiling.width)):
                    if axis.num_tiles > 1:
                        sizes = [e - s for s, e in split_axis(length, axis.num_tiles, axis.overlap)]
                        assert min(sizes) >= MIN_DEFAULT_TILE, (ranks, h, w, sizes)
    for grid in SMALLEST.values():
        assert _default_decode_tiling(2, grid).num_tiles == 1, grid
    tiling = _default_decode_tiling(2, FIRST_SPLIT)
    assert (tiling.height.num_tiles, tiling.width.num_tiles, tiling.width.overlap) == (1, 2, 2)
    assert split_axis(14, 2, 2) == [(0, 8), (6, 14)]
    assert (_default_decode_tiling(4, (2, 22, 40)).height.num_tiles,
            _default_decode_tiling(4, (2, 22, 40)).width.num_tiles) == (2, 2)  # 1280×704: unchanged


def _smallest_rank_fn(rank: int, world: int, checkpoint: str, diffusion_path: str) -> dict:
    from mgpu_backend.models.loader import load_diffusion_vae

    decoders = {"conv": load_components(checkpoint, dtype=torch.float32).video_vae,
                "diffusion": load_diffusion_vae(diffusion_path, dtype=torch.float32).decoder}
    out = {}
    for kind, vae in decoders.items():
        for name, grid in SMALLEST.items():
            tiling = _default_decode_tiling(world, grid)
            try:
                pixels, report = decode_tiles(vae, _latent(grid), tiling, None, None, world, rank)
                out[kind, name] = (pixels, report.tiles)
            except ValueError as exc:
                out[kind, name] = str(exc)
    return out


def test_default_decode_on_two_ranks_equals_the_one_process_decode_at_the_smallest_sizes(tiny_dir, tmp_path):
    """64×64×9, 96×64×9, 64×96×9, 32×64×9 and 416×64×9 on 2 gloo ranks with the default tiles, both decoders: the
    decode is the one-process untiled decode (`decode_untiled`, what ComfyUI's VAEDecode computes: equal to it in
    `test_comfyui_load.py` for the conv VAE, `test_diffusion_decoder.py` for LTX-2.5's), bit for bit — rank 0
    decodes the whole latent, rank 1 adds zeros. (Before issue 36: 64×64 was refused, 96×64 came out in two 2-cell
    tiles 0.3-0.7 relative L2 away.) The conv VAE refuses 32 px in width as VAEDecode fails on it, naming the width."""
    from mgpu_backend.splits.decode import decode_untiled
    from mgpu_backend.testing.tiny_vae25 import write_tiny_diffusion_vae
    from mgpu_backend.models.loader import load_diffusion_vae

    diffusion_path = write_tiny_diffusion_vae(tmp_path / "ltx-2.5-tiny-diffusion-vae.safetensors", 0)
    checkpoint = str(tiny_dir["2.3"]["checkpoint"])
    results = run_ranks(_smallest_rank_fn, 2, checkpoint, str(diffusion_path))
    decoders = {"conv": load_components(checkpoint, dtype=torch.float32).video_vae,
                "diffusion": load_diffusion_vae(diffusion_path, dtype=torch.float32).decoder}
    for kind, vae in decoders.items():
        for name, grid in SMALLEST.items():
            got, idle = results[0][kind, name], results[1][kind, name]
            if kind == "conv" and grid[2] == 1:
                axis = "width"
                expect = (f"decode: the latent is 1 latent cell (32 px) in {axis}; the conv VAE decoder pads by "
                          f"reflection and needs at least 2 latent cells (64 px) per axis (ComfyUI's VAEDecode fails "
                          f"the same): make the video at least 64 px in {axis}")
                assert got == idle == expect, (name, got)
                continue
            assert not isinstance(got, str), f"{kind} {name}: refused: {got}"
            pixels, tiles = got
            assert tiles == (0,) and idle == (None, ()), (kind, name, tiles, idle)
            reference = decode_untiled(vae, _latent(grid))
            assert pixels.shape == (1, 3, (grid[0] - 1) * 8 + 1, grid[1] * SPATIAL, grid[2] * SPATIAL)
            assert torch.equal(pixels, reference.float()), \
                f"{kind} {name}: {float((pixels - reference).norm() / reference.norm()):.3e} relative L2"


def test_decode_refusals_name_what_cannot_be_decoded(vaes):
    """Every clause of a refusal is true. The conv VAE (reflection padding, 2 cells per axis):
    - a latent 1 cell (32 px) wide is refused naming the WIDTH and that ComfyUI's VAEDecode fails the same (it does:
      `test_comfyui_load.py`), whatever tiles were asked — even 2 height tiles, which before issue 36 were blamed;
    - explicit tiles of 1 cell on a latent VAEDecode decodes are refused naming those tiles, saying the whole latent
      decodes, and NOT claiming that VAEDecode fails."""
    vae = vaes["2.3"]
    for grid, axis in (((2, 2, 1), "width"), ((2, 1, 2), "height")):
        for tiling in (_default_decode_tiling(2, grid), TileCountConfig.spatial(2, 1, overlap=0),
                       TileCountConfig.spatial(1, 2, overlap=0)):
            if (tiling.height.num_tiles > grid[1]) or (tiling.width.num_tiles > grid[2]):
                continue  # two tiles of a 1-cell axis: split_axis refuses the tiles themselves (tested above)
            with pytest.raises(ValueError) as info:
                decode_tiles(vae, _latent(grid), tiling)
            assert str(info.value) == (
                f"decode: the latent is 1 latent cell (32 px) in {axis}; the conv VAE decoder pads by reflection and "
                f"needs at least 2 latent cells (64 px) per axis (ComfyUI's VAEDecode fails the same): make the "
                f"video at least 64 px in {axis}")
    for grid, tiling, axis in (((2, 2, 2), TileCountConfig.spatial(1, 2, overlap=0), "width"),
                               ((2, 2, 3), TileCountConfig.spatial(2, 1, overlap=0), "height")):
        with pytest.raises(ValueError) as info:
            decode_tiles(vae, _latent(grid), tiling)
        whole = grid[1] if axis == "height" else grid[2]
        assert str(info.value) == (
            f"decode: a {axis} tile of the 2-tile split is 1 latent cell (32 px) in {axis}; the conv VAE decoder "
            f"pads by reflection and needs at least 2 latent cells (64 px) per axis of each tile (the whole latent, "
            f"{whole} cells, decodes untiled): use fewer {axis} tiles (each needs 2 cells) or the default tiling")
        assert "VAEDecode" not in str(info.value)
