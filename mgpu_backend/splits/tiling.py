"""Count-based tiling of the latent grid with trapezoid blend masks (docs/design/tiled-data-parallel.md, after
Lightricks' `ltx_core.tiling` and `tiled_data_parallel.py`).

Split rule for an axis of length D into n tiles with overlap o: `total = D + o·(n−1)`, base size `s = total // n`
(must be larger than o), the first `total % n` tiles one longer, each adjacent pair overlapping by exactly o.
Blend: across an overlap of width o the outgoing tile weighs (o+1−k)/(o+1) and the incoming one k/(o+1), k = 1..o,
so adjacent pairs sum to one; the N-D weight of a tile is the product over axes. Where the weights would not sum
to one (three tiles overlapping when 2·o exceeds a tile) they are normalized by their sum — never blended wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..protocol.stage_params import DimensionTilingConfig, TileCountConfig


def balanced_tile_split(world_size: int) -> tuple[int, int]:
    """(height tiles, width tiles) with product `world_size`, as square as possible, height the smaller factor:
    1 -> 1×1, 2 -> 1×2, 4 -> 2×2, 8 -> 2×4, 6 -> 2×3 (reference `balanced_tile_split`)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    h = max(d for d in range(1, int(math.isqrt(world_size)) + 1) if world_size % d == 0)
    return h, world_size // h


def split_axis(length: int, num_tiles: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) of each tile along an axis of `length` cells (module docstring rule).

    Raises ValueError when the tiles would be no larger than the overlap (naming the numbers).
    """
    if num_tiles == 1:
        return [(0, length)]
    total = length + overlap * (num_tiles - 1)
    base = total // num_tiles
    if base <= overlap:
        raise ValueError(f"{num_tiles} tiles with overlap {overlap} on an axis of {length} latent cells give tiles of "
                         f"{base} cells, not larger than the overlap: use fewer tiles or a smaller overlap")
    extra = total % num_tiles
    spans, start = [], 0
    for i in range(num_tiles):
        size = base + (1 if i < extra else 0)
        spans.append((start, start + size))
        start += size - overlap
    assert spans[-1][1] == length, (spans, length)
    return spans


def axis_weights(spans: list[tuple[int, int]], overlap: int) -> list[torch.Tensor]:
    """Trapezoid weight vector (float64) of each tile: ramps k/(o+1) over its leading overlap (not for the first
    tile) and (o+1−k)/(o+1) over its trailing overlap (not for the last tile)."""
    out = []
    ramp = torch.arange(1, overlap + 1, dtype=torch.float64) / (overlap + 1)
    for i, (start, end) in enumerate(spans):
        w = torch.ones(end - start, dtype=torch.float64)
        if overlap and i > 0:
            w[:overlap] = torch.minimum(w[:overlap], ramp[: end - start])
        if overlap and i < len(spans) - 1:
            n = min(overlap, end - start)
            w[-n:] = torch.minimum(w[-n:], ramp.flip(0)[-n:])
        out.append(w)
    return out


@dataclass
class Tile:
    """One tile: index, [start, end) per axis (frames, height, width) and its blend weight `[f, h, w]` (float64)."""

    index: int
    spans: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(e - s for s, e in self.spans)  # type: ignore[return-value]

    def token_index(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """Indices of this tile's tokens in the packed (f, h, w) order of a grid."""
        (f0, f1), (h0, h1), (w0, w1) = self.spans
        _, gh, gw = grid
        f = torch.arange(f0, f1)[:, None, None]
        h = torch.arange(h0, h1)[None, :, None]
        w = torch.arange(w0, w1)[None, None, :]
        return (f * gh * gw + h * gw + w).reshape(-1)


def make_tiles(grid: tuple[int, int, int], config: TileCountConfig) -> tuple[list[Tile], bool]:
    """Tiles of a latent grid (F, H, W) with partition-of-unity weights.

    Returns (tiles, normalized): `normalized` is True when the trapezoids did not sum to one somewhere (three tiles
    overlapping) and the weights were divided by their sum.
    Raises ValueError from `split_axis`.
    """
    per_axis = []
    for length, axis in zip(grid, config.axes):
        spans = split_axis(length, axis.num_tiles, axis.overlap)
        per_axis.append(list(zip(spans, axis_weights(spans, axis.overlap))))
    tiles = []
    for i, ((fs, fw), (hs, hw), (ws, ww)) in enumerate(
            (a, b, c) for a in per_axis[0] for b in per_axis[1] for c in per_axis[2]):
        weight = fw[:, None, None] * hw[None, :, None] * ww[None, None, :]
        tiles.append(Tile(i, (fs, hs, ws), weight))
    total = torch.zeros(grid, dtype=torch.float64)
    for t in tiles:
        (f0, f1), (h0, h1), (w0, w1) = t.spans
        total[f0:f1, h0:h1, w0:w1] += t.weight
    normalized = not torch.allclose(total, torch.ones_like(total), rtol=0, atol=1e-12)
    if normalized:
        for t in tiles:
            (f0, f1), (h0, h1), (w0, w1) = t.spans
            t.weight = t.weight / total[f0:f1, h0:h1, w0:w1]
    return tiles, normalized


def fit_overlap(length: int, num_tiles: int, overlap: int) -> int:
    """The largest overlap ≤ `overlap` for which `num_tiles` tiles fit an axis of `length` with a clean partition of
    unity (no three tiles overlapping). For default grids on small latents; an explicit request that does not fit
    is refused by `split_axis` instead."""
    if num_tiles == 1:
        return 0
    for o in range(overlap, -1, -1):
        try:
            spans = split_axis(length, num_tiles, o)
        except ValueError:
            continue
        total = torch.zeros(length, dtype=torch.float64)
        for (start, end), weight in zip(spans, axis_weights(spans, o)):
            total[start:end] += weight
        if torch.allclose(total, torch.ones_like(total), rtol=0, atol=1e-12):
            return o
    raise ValueError(f"{num_tiles} tiles do not fit an axis of {length} latent cells")


def default_tiling(world_size: int, grid: tuple[int, int, int], overlap: int,
                   min_tile: int = 1) -> TileCountConfig:
    """The balanced spatial grid for `world_size` ranks (height gets the smaller factor), overlap fitted to the grid.

    A grid too small for that split (fewer cells on an axis than tiles: a latent 1-3 cells high or wide) gets the
    squarest split of the same tile count that fits, else of the largest smaller count, down to one tile: every
    size runs, as in one process (ranks without a tile wait for the blend, as when tiles < ranks). `min_tile`: the
    fewest latent cells a tile may have on an axis that is split (the decode's `splits.decode.MIN_DEFAULT_TILE`):
    a split whose tiles would be smaller is passed over the same way."""
    for count in range(world_size, 0, -1):
        h_tiles, w_tiles = balanced_tile_split(count)
        pairs = sorted({(d, count // d) for d in range(1, count + 1) if count % d == 0},
                       key=lambda p: (abs(p[0] - p[1]), p[0] > p[1]))
        for ht, wt in [(h_tiles, w_tiles)] + pairs:
            if grid[1] < ht or grid[2] < wt:
                continue
            try:
                tiling = TileCountConfig(height=DimensionTilingConfig(ht, fit_overlap(grid[1], ht, overlap)),
                                         width=DimensionTilingConfig(wt, fit_overlap(grid[2], wt, overlap)))
            except ValueError:  # no clean partition of unity on an axis: try fewer tiles
                continue
            if all(axis.num_tiles == 1 or min(e - s for s, e in split_axis(length, axis.num_tiles, axis.overlap))
                   >= min_tile for length, axis in ((grid[1], tiling.height), (grid[2], tiling.width))):
                return tiling
    raise ValueError(f"world_size={world_size}, grid={grid}: no tiling fits (a latent axis of 0 cells?)")
