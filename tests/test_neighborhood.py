"""Neighborhood attention (`mgpu_backend/models/neighborhood.py`) against a brute-force reference.

The reference is written from NATTEN's definition, not from either implementation: for every query it lists the
window positions per axis (`s = clamp(i - k // 2, 0, n - k)`, `k = min(kernel, n)`), gathers those keys and values
and takes a float64 softmax. Grids are small and chosen so that every query kind appears: interior, both borders of
every axis, even and odd kernels, a kernel equal to the axis and one larger than it (clamped), grids of one frame.
Tolerance: fp32 inputs, max |Δ| ≤ 2e-6 (values O(1); SDPA's fp32 softmax vs the float64 reference).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from mgpu_backend.models import neighborhood
from mgpu_backend.models.neighborhood import na3d, na3d_plain

torch.set_num_threads(1)
TOL = 2e-6

CASES = [  # (T, H, W), kernel
    ((4, 5, 6), (3, 3, 3)),
    ((5, 7, 9), (3, 5, 5)),
    ((3, 6, 8), (2, 4, 3)),     # even kernels: the window sits one to the left of center
    ((2, 4, 4), (3, 7, 7)),     # kernels larger than the axes: clamped to the axis
    ((1, 3, 5), (3, 3, 3)),     # one frame
    ((6, 4, 5), (6, 4, 1)),     # kernel equal to the axis / width one (self only)
]


def brute_force(q, k, v, kernel, scale):
    b, t, h, w, nh, hd = q.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    q64, k64, v64 = q.double(), k.double(), v.double()

    def window(i, n, kk):
        kk = min(kk, n)
        s = min(max(i - kk // 2, 0), n - kk)
        return range(s, s + kk)

    for ti, hi, wi in itertools.product(range(t), range(h), range(w)):
        pos = list(itertools.product(window(ti, t, kernel[0]), window(hi, h, kernel[1]), window(wi, w, kernel[2])))
        idx_t, idx_h, idx_w = (torch.tensor(a) for a in zip(*pos))
        keys = k64[:, idx_t, idx_h, idx_w]  # (B, n, heads, hd)
        vals = v64[:, idx_t, idx_h, idx_w]
        scores = torch.einsum("bhd,bnhd->bhn", q64[:, ti, hi, wi], keys) * scale
        out[:, ti, hi, wi] = torch.einsum("bhn,bnhd->bhd", scores.softmax(-1), vals)
    return out


def _qkv(grid, seed, heads=2, head_dim=8, batch=2):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, *grid, heads, head_dim)
    return [torch.randn(shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize("grid,kernel", CASES)
def test_plain_matches_brute_force(grid, kernel):
    q, k, v = _qkv(grid, seed=sum(grid))
    ref = brute_force(q, k, v, kernel, 0.35)
    assert (na3d_plain(q, k, v, kernel, scale=0.35).double() - ref).abs().max() <= TOL


@pytest.mark.skipif(not neighborhood.kitchen_available(), reason="comfy-kitchen not installed")
@pytest.mark.parametrize("grid,kernel", CASES)
def test_kitchen_matches_brute_force(grid, kernel):
    q, k, v = _qkv(grid, seed=sum(grid) + 1)
    ref = brute_force(q, k, v, kernel, 1.0)
    assert (na3d(q, k, v, kernel, scale=1.0, backend="kitchen").double() - ref).abs().max() <= TOL


def test_plain_tiles_its_queries(monkeypatch):
    """A small mask budget forces many query slabs; the result must not change."""
    q, k, v = _qkv((5, 7, 6), seed=3)
    ref = brute_force(q, k, v, (3, 3, 5), 1.0)
    monkeypatch.setattr(neighborhood, "_MASK_BUDGET", 200)
    assert (na3d_plain(q, k, v, (3, 3, 5)).double() - ref).abs().max() <= TOL


def test_bad_input_is_refused():
    q, k, v = _qkv((2, 3, 3), seed=0)
    with pytest.raises(ValueError, match="backend"):
        na3d(q, k, v, (3, 3, 3), backend="natten")
    with pytest.raises(ValueError, match="kernel_size"):
        na3d(q, k, v, (3, 3))
    with pytest.raises(ValueError, match="one shape"):
        na3d(q, k[:, :1], v, (3, 3, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not neighborhood.kitchen_available(),
                    reason="needs a CUDA GPU and comfy-kitchen")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_kitchen_cuda_matches_plain(dtype, tol):
    """comfy-kitchen on the GPU (its CUDA / Triton kernels) against the plain fallback in float32 on the same GPU, at
    the decoder's real kernels (3×7×7, 11×11×11) and head width 64 on grids with borders on every side. bf16: the
    kernels' bf16 inputs and accumulation (outputs are window averages, |values| < 1; bound 3e-2); float32 bound
    1e-3 in case a backend computes in TF32."""
    for grid, kernel in (((6, 14, 20), (3, 7, 7)), ((13, 16, 18), (11, 11, 11))):
        q, k, v = (t.cuda() for t in _qkv(grid, seed=7, heads=4, head_dim=64, batch=1))
        ref = na3d_plain(q, k, v, kernel, scale=0.125)
        out = na3d(q.to(dtype), k.to(dtype), v.to(dtype), kernel, scale=0.125, backend="kitchen").float()
        assert (out - ref).abs().max() <= tol, (grid, kernel, dtype)


def test_the_plain_fallback_on_a_gpu_is_reported(monkeypatch):
    """Without comfy-kitchen the decode report names the slower attention on CUDA (its cost in the line), not on the
    CPU, where comfy-kitchen would run its eager backend too."""
    monkeypatch.setattr(neighborhood, "_kitchen", None)
    assert neighborhood.plain_fallback("cuda:1") == neighborhood.PLAIN_ON_GPU
    assert "comfy-kitchen is not installed" in neighborhood.PLAIN_ON_GPU and " s " in neighborhood.PLAIN_ON_GPU
    assert neighborhood.plain_fallback("cpu") is None
    monkeypatch.setattr(neighborhood, "_kitchen", object())
    assert neighborhood.plain_fallback("cuda") is None
