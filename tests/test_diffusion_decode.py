"""Distributed decode with the LTX-2.5 diffusion decoder (`splits/decode.py`): spatial latent tiles with the
full time axis, round-robin over W = 1, 2 and 3 gloo ranks (`tests/_dist.py`), blended in pixel space, assembled on
rank 0 — against the one-process tiled decode of the same tiles, and the tiled decode against the untiled
(ComfyUI-equal, `tests/test_diffusion_decoder.py`) one away from the seams. Tiny diffusion VAE (`tiny_vae25.py`),
fp32, CPU.

Tolerances, and why:
- W ranks vs one process: every tile is decoded by the same code on the same inputs — its latent window and its
  window of the one noise canvas every rank draws (seed 0) — so tile pixels are bit-identical in any process; only
  the order of the fp32 blend sum differs. Pixels of ≤ 2 tiles must be bit-identical (`torch.equal`), pixels of 3-4
  tiles within 1e-6·(1 + |ref|) (reassociation of ≤ 4 fp32 terms).
- tiled vs untiled: the decoder is local. Every neighborhood-attention layer reaches k // 2 cells of its grid, the
  MLPs and norms are per token, so the receptive radius in latent cells is the sum over layers of (k // 2) / (that
  stage's cells per latent cell): tiny config 1 (stage 1, 3×3×3) + ½ + ½ (stages 2, 3 at 2×) + ¼ (stage 4 at 4×)
  + 2 · 2/8 (two 5×5×5 stage-5 blocks at 8×) = 2.75 cells = 88 px; the window's inward shift at a tile edge is
  inside that reach. Pixels at least R = 3 cells (96 px) from every interior tile edge and outside the overlaps
  (weight 1) must equal the untiled decode to 5e-5 (rounding of ~30 fp32 layers over different sizes; measured
  2e-5). Closer to a seam they differ by up to ~3 (reported, not asserted: the tiling approximation the blend hides).
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.models.diffusion_decoder import denormalize
from mgpu_backend.models.loader import load_diffusion_vae
from mgpu_backend.testing.tiny_vae25 import write_tiny_diffusion_vae
from mgpu_backend.splits.decode import SPATIAL, decode_tiles, decode_untiled, is_diffusion_decoder
from mgpu_backend.splits.tiling import TileCountConfig, split_axis

torch.set_num_threads(1)

RANK_RTOL = 1e-6
CLEAN_TOL = 5e-5
RADIUS_CELLS = 3
CASES = {  # latent grid (F, H, W), tiling
    "2x2": ((2, 3, 5), TileCountConfig.spatial(2, 2, overlap=1)),  # W=3: rank 0 two tiles; 2-row tiles clamp kernels
    "1x3": ((2, 3, 7), TileCountConfig.spatial(1, 3, overlap=1)),  # W=2: two tiles on rank 0, one on rank 1
}


def _latent(grid, seed=0) -> torch.Tensor:
    return torch.randn(1, 128, *grid, generator=torch.Generator().manual_seed(seed))


def _decode_all(path: str, world: int = 1, rank: int = 0, names=tuple(CASES)) -> dict:
    vae = load_diffusion_vae(path, torch.float32).decoder
    out = {}
    for name in names:
        grid, tiling = CASES[name]
        pixels, report = decode_tiles(vae, denormalize(vae, _latent(grid)), tiling, None, None, world, rank)
        out[name] = (pixels, report.tiles)
    return out


def _rank_fn(rank: int, world: int, path: str, names: tuple[str, ...]) -> dict:
    return _decode_all(path, world, rank, names)


def _pixel_coverage(grid, tiling) -> torch.Tensor:
    _, h, w = grid
    count = torch.zeros(h * SPATIAL, w * SPATIAL, dtype=torch.int64)
    for h0, h1 in split_axis(h, tiling.height.num_tiles, tiling.height.overlap):
        for w0, w1 in split_axis(w, tiling.width.num_tiles, tiling.width.overlap):
            count[h0 * SPATIAL:h1 * SPATIAL, w0 * SPATIAL:w1 * SPATIAL] += 1
    return count


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(write_tiny_diffusion_vae(tmp_path_factory.mktemp("tiny25d") / "vae.safetensors", 0))


@pytest.fixture(scope="module")
def references(tiny_path):
    return _decode_all(tiny_path)


@pytest.mark.parametrize("world,name", [(1, "1x3"), (2, "1x3"), (3, "2x2")])
def test_distributed_equals_single_process(tiny_path, references, world, name):
    results = run_ranks(_rank_fn, world, tiny_path, (name,))
    for name, (grid, tiling) in [(name, CASES[name])]:
        ref, tiles = references[name]
        assert tiles == tuple(range(tiling.num_tiles))
        pixels = results[0][name][0]
        assert [results[r][name][1] for r in range(world)] == \
            [tuple(range(r, tiling.num_tiles, world)) for r in range(world)]  # round-robin
        assert all(results[r][name][0] is None for r in range(1, world)), "frames only on rank 0"
        assert pixels.shape == ref.shape == (1, 3, (grid[0] - 1) * 8 + 1, grid[1] * 32, grid[2] * 32)
        low = (_pixel_coverage(grid, tiling) <= 2).expand_as(ref)
        assert torch.equal(pixels[low], ref[low]), f"{name} W={world}: pixels of ≤ 2 tiles differ"
        diff = (pixels - ref).abs()
        assert (diff <= RANK_RTOL * (1 + ref.abs())).all(), f"{name} W={world}: {diff.max():.2e}"


def test_tiled_equals_untiled_away_from_seams(tiny_path):
    vae = load_diffusion_vae(tiny_path, torch.float32).decoder
    assert is_diffusion_decoder(vae)
    grid, tiling = (2, 3, 12), TileCountConfig.spatial(1, 2, overlap=2)  # tiles [0, 7) and [5, 12)
    z = denormalize(vae, _latent(grid, seed=5))
    untiled = decode_untiled(vae, z).float()
    tiled, _ = decode_tiles(vae, z, tiling)
    r = RADIUS_CELLS * SPATIAL
    clean = torch.zeros(grid[2] * SPATIAL, dtype=torch.bool)
    clean[:7 * SPATIAL - r] = True   # only tile 0, ≥ R from its right edge
    clean[5 * SPATIAL + r:] = True   # only tile 1, ≥ R from its left edge
    diff = (tiled - untiled).abs()
    assert diff[..., clean].max() <= CLEAN_TOL
    print(f"tiled vs untiled: clean {diff[..., clean].max():.1e}, near the seam {diff[..., ~clean].max():.2f}")


def test_diffusion_decoder_refuses_a_decode_timestep(tiny_path):
    vae = load_diffusion_vae(tiny_path, torch.float32).decoder
    with pytest.raises(ValueError, match="no decode timestep"):
        decode_tiles(vae, _latent((2, 3, 3)), TileCountConfig(), temb=torch.tensor([0.05]))
