"""Count-based tiling (docs/design/tiled-data-parallel.md): the split rule, the trapezoid masks and their partition of
unity, the refusals, the balanced default grid and the overlap fitting. Pure index arithmetic, no model.

Tolerances: the weights are float64; where the trapezoids already sum to one the sums are exact sums of k/(o+1)
terms (≤ 4 terms of float64, error ≤ a few 1e-16), where they were normalized the division adds one rounding. Every
sum is checked against 1 with atol 1e-12, far above float64 rounding and far below any wrong weight (the smallest
weight step is 1/(o+1) ≥ 1/64 here).
"""
from __future__ import annotations

import pytest
import torch

from mgpu_backend.engine import latents as L
from mgpu_backend.splits.tiling import DimensionTilingConfig, TileCountConfig, axis_weights, balanced_tile_split, default_tiling, fit_overlap, make_tiles, split_axis

torch.set_num_threads(1)

ATOL = 1e-12

# (length, tiles, overlap): one tile, overlap 0, uneven lengths, many tiles, overlap near the tile size
SPLIT_CASES = [
    (7, 1, 0), (7, 1, 3),            # one tile: the whole axis, the overlap is irrelevant
    (10, 2, 0), (10, 3, 0),          # overlap 0: a hard partition; 10 % 3 = 1 -> the first tile one longer
    (16, 2, 5), (17, 3, 2), (9, 2, 1),  # uneven: total % n > 0
    (60, 4, 5), (60, 8, 5), (34, 2, 5),  # the real 1920×1088 stage-2 grid (34×60) with the default overlap
    (100, 7, 5), (33, 16, 1),        # many tiles
    (10, 4, 3),                      # tiles of 5, 5, 5, 4 with overlap 3: 2·o > tile -> three tiles overlap
    (8, 3, 3),                       # base = o + 1, the largest accepted overlap: three tiles overlap
    (12, 3, 3),                      # interior tile exactly 2·o: the ramps touch but do not overlap -> no normalize
]


def _expected_sizes(length: int, n: int, o: int) -> list[int]:
    if n == 1:
        return [length]
    total = length + o * (n - 1)
    base, extra = divmod(total, n)
    return [base + 1] * extra + [base] * (n - extra)


@pytest.mark.parametrize("length,n,o", SPLIT_CASES)
def test_split_rule(length, n, o):
    spans = split_axis(length, n, o)
    assert len(spans) == n
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert [e - s for s, e in spans] == _expected_sizes(length, n, o)  # first total % n tiles one longer
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert e0 - s1 == o, f"adjacent tiles {s0, e0} and {s1, e1} overlap by {e0 - s1}, not {o}"
        assert s1 > s0 and e1 > e0
    if n > 1:
        assert min(e - s for s, e in spans) > o


@pytest.mark.parametrize("length,n,o", SPLIT_CASES)
def test_axis_weights_partition_of_unity(length, n, o):
    spans = split_axis(length, n, o)
    weights = axis_weights(spans, o)
    total = torch.zeros(length, dtype=torch.float64)
    for (s, e), w in zip(spans, weights):
        assert w.shape == (e - s,) and w.dtype == torch.float64
        assert (w > 0).all() and (w <= 1).all()
        total[s:e] += w
    three_overlap = n >= 3 and min(e - s for s, e in spans[1:-1]) < 2 * o
    if three_overlap:
        assert (total - 1).abs().max() > 1e-3, "three overlapping tiles should exceed one before normalizing"
    else:
        torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=ATOL)


def test_trapezoid_values():
    """Across an overlap of width o the outgoing tile weighs (o+1−k)/(o+1), the incoming one k/(o+1), k = 1..o."""
    o = 3
    spans = split_axis(10, 2, o)  # total 13 -> sizes 7, 6: (0, 7), (4, 10)
    assert spans == [(0, 7), (4, 10)]
    w0, w1 = axis_weights(spans, o)
    assert w0.tolist() == [1, 1, 1, 1, 0.75, 0.5, 0.25]
    assert w1.tolist() == [0.25, 0.5, 0.75, 1, 1, 1]
    # overlap 0: weights are all one (a hard partition)
    assert all(w.tolist() == [1.0] * len(w) for w in axis_weights(split_axis(10, 3, 0), 0))


@pytest.mark.parametrize("grid,config,expect_normalized", [
    ((2, 5, 7), TileCountConfig(), False),                                   # one tile
    ((2, 6, 9), TileCountConfig.spatial(2, 2, overlap=0), False),           # overlap 0
    ((3, 7, 11), TileCountConfig.spatial(2, 3, overlap=2), False),          # uneven lengths
    ((16, 34, 60), TileCountConfig.spatial(2, 4, overlap=5), False),        # the 8-GPU default at 1920×1088
    ((5, 8, 10), TileCountConfig(DimensionTilingConfig(2, 1), DimensionTilingConfig(2, 2),
                                 DimensionTilingConfig(3, 1)), False),    # all three axes tiled
    ((2, 8, 10), TileCountConfig(width=DimensionTilingConfig(4, 3)), True),  # overlap near the tile size
    ((2, 8, 8), TileCountConfig.spatial(3, 3, overlap=3), True),            # three-way overlaps on both axes
    ((1, 20, 33), TileCountConfig.spatial(4, 16, overlap=1), False),        # many tiles (64)
])
def test_make_tiles_sum_to_one(grid, config, expect_normalized):
    tiles, normalized = make_tiles(grid, config)
    assert normalized is expect_normalized
    assert len(tiles) == config.num_tiles
    total = torch.zeros(grid, dtype=torch.float64)
    coverage = torch.zeros(grid, dtype=torch.int64)
    for i, t in enumerate(tiles):
        assert t.index == i and t.weight.shape == t.shape
        assert (t.weight > 0).all() and (t.weight <= 1 + ATOL).all()
        (f0, f1), (h0, h1), (w0, w1) = t.spans
        total[f0:f1, h0:h1, w0:w1] += t.weight
        coverage[f0:f1, h0:h1, w0:w1] += 1
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=ATOL)
    assert (coverage >= 1).all()
    if not normalized:  # the N-D weight is the product of the axis trapezoids
        per_axis = [list(zip(split_axis(n, a.num_tiles, a.overlap),
                             axis_weights(split_axis(n, a.num_tiles, a.overlap), a.overlap)))
                    for n, a in zip(grid, config.axes)]
        t = tiles[-1]
        (fs, fw), (hs, hw), (ws, ww) = per_axis[0][-1], per_axis[1][-1], per_axis[2][-1]
        assert t.spans == (fs, hs, ws)
        assert torch.equal(t.weight, fw[:, None, None] * hw[None, :, None] * ww[None, None, :])


def test_token_index_matches_packing():
    grid = (3, 5, 7)
    ids = torch.arange(105).reshape(1, 1, *grid).float()
    packed = L.pack_video(ids)[0, :, 0]  # token order of the transformer
    tiles, _ = make_tiles(grid, TileCountConfig(DimensionTilingConfig(2, 1), DimensionTilingConfig(2, 1),
                                                DimensionTilingConfig(3, 2)))
    for t in tiles:
        (f0, f1), (h0, h1), (w0, w1) = t.spans
        expect = ids[0, 0, f0:f1, h0:h1, w0:w1].reshape(-1)
        assert torch.equal(packed[t.token_index(grid)], expect)


@pytest.mark.parametrize("length,n,o", [(4, 3, 2), (3, 4, 0), (10, 2, 10), (10, 2, 9), (5, 5, 1)])
def test_refused_when_tiles_not_larger_than_overlap(length, n, o):
    base = (length + o * (n - 1)) // n
    with pytest.raises(ValueError) as info:
        split_axis(length, n, o)
    msg = str(info.value)
    for part in (f"{n} tiles", f"overlap {o}", f"{length} latent cells", f"tiles of {base} cells", "fewer tiles"):
        assert part in msg, f"{part!r} not in {msg!r}"
    with pytest.raises(ValueError, match=f"{n} tiles with overlap {o}"):
        make_tiles((1, 1, length), TileCountConfig(width=DimensionTilingConfig(n, o)))


def test_config_refusals():
    with pytest.raises(ValueError, match="num_tiles=0"):
        DimensionTilingConfig(0, 0)
    with pytest.raises(ValueError, match="overlap=-1"):
        DimensionTilingConfig(2, -1)
    spatial = TileCountConfig.spatial(1, 2)
    assert spatial.height == DimensionTilingConfig(1, 0) and spatial.width == DimensionTilingConfig(2, 5)
    assert spatial.frames == DimensionTilingConfig(1, 0) and spatial.num_tiles == 2


@pytest.mark.parametrize("world,expect", [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (6, (2, 3)),
                                          (8, (2, 4)), (9, (3, 3)), (12, (3, 4)), (16, (4, 4)), (7, (1, 7))])
def test_balanced_tile_split(world, expect):
    assert balanced_tile_split(world) == expect


def test_balanced_tile_split_refuses_zero():
    with pytest.raises(ValueError, match="world_size=0"):
        balanced_tile_split(0)


@pytest.mark.parametrize("length,n,requested,expect", [
    (60, 4, 5, 5), (34, 2, 5, 5), (10, 1, 5, 0), (4, 2, 5, 2), (4, 4, 5, 0), (7, 3, 5, 2), (8, 2, 0, 0),
])
def test_fit_overlap_is_the_largest_that_fits(length, n, requested, expect):
    """The largest overlap whose tiles fit without three tiles overlapping (no normalization needed)."""
    o = fit_overlap(length, n, requested)
    assert o == expect
    if n > 1:
        tiles, normalized = make_tiles((1, 1, length), TileCountConfig(width=DimensionTilingConfig(n, o)))
        assert not normalized  # accepted, a clean partition of unity
        if o < requested:  # one more would not fit, or would make three tiles overlap
            try:
                _, normalized = make_tiles((1, 1, length), TileCountConfig(width=DimensionTilingConfig(n, o + 1)))
                assert normalized
            except ValueError:
                pass


def test_fit_overlap_refuses_too_many_tiles():
    with pytest.raises(ValueError, match="3 tiles do not fit an axis of 2"):
        fit_overlap(2, 3, 1)


def test_default_tiling():
    real = (16, 34, 60)  # 1920×1088×121 at stage 2
    assert default_tiling(1, real, 5) == TileCountConfig()
    assert default_tiling(2, real, 5) == TileCountConfig(width=DimensionTilingConfig(2, 5))
    assert default_tiling(4, real, 5) == TileCountConfig.spatial(2, 2, overlap=5)
    assert default_tiling(8, real, 5) == TileCountConfig.spatial(2, 4, overlap=5)
    # small grids: the overlap is fitted per axis (4 cells, 2 tiles -> 2; 4 cells, 4 tiles -> 0)
    small = default_tiling(8, (2, 4, 4), 5)
    assert small == TileCountConfig(height=DimensionTilingConfig(2, 2), width=DimensionTilingConfig(4, 0))
    make_tiles((2, 4, 4), small)
    # a grid too small for the balanced split (issue 24): the squarest split of that count that fits, else fewer
    # tiles, down to one
    assert default_tiling(2, (1, 3, 1), 5) == TileCountConfig(height=DimensionTilingConfig(2, 1))
    assert default_tiling(8, (2, 1, 4), 5) == TileCountConfig(width=DimensionTilingConfig(4, 0))
    assert default_tiling(8, (2, 3, 2), 5) == TileCountConfig.spatial(3, 2, overlap=0)
    assert default_tiling(4, (1, 1, 1), 5) == TileCountConfig()
