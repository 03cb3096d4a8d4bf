"""3-D neighborhood attention (NATTEN `na3d` semantics) without NATTEN, for the LTX-2.5 diffusion video decoder.

Semantics (NATTEN, dilation 1, non-causal — what the decoder's reference and ComfyUI 0.33 compute): along each axis
of the `(T, H, W)` grid a query at index i attends the window `[s, s + k)` with `s = clamp(i - k // 2, 0, n - k)`,
i.e. exactly `k` positions centered on i, shifted inward at the borders; a kernel larger than its axis is clamped to
the axis (ComfyUI's `comfy_kitchen.na3d` clamps; diffusers' module raises instead, see `diffusion_decoder.py`). The
3-D window is the product of the three axis windows.

Which implementation, and why:
- **`comfy-kitchen`** (`comfy_kitchen.na3d`; PyPI `comfy-kitchen`, Apache-2.0, Comfy Org's kernel package, the one
  ComfyUI 0.33's `na_diffusion_decoder.py` calls): used whenever it imports. It dispatches per device and dtype to
  fused CUDA kernels, Triton, or an eager PyTorch backend (tiled SDPA with one additive mask per window geometry),
  and installs as a binary wheel that imports and runs on CPU here (eager backend). Calling the same function as
  ComfyUI makes our decoder agree with ComfyUI's by construction, and the fused kernels are what makes the decoder
  fast on the GPU.
- **`na3d_plain`** (below): the fallback when comfy-kitchen is absent — tiled `scaled_dot_product_attention` over
  query slabs (frames × rows) with an additive window mask over the key slab that slab's windows reach. Exact, and
  memory-bounded, but not fast. `torch.nn.attention.flex_attention` with a neighborhood `BlockMask` (diffusers'
  default processor) was not chosen: its block mask is quadratic in the token count (diffusers notes 167 GiB for
  one 69×64×96 stage), so it cannot run the decoder at video sizes.

Both are tested against a brute-force per-query reference on small grids including borders
(`tests/test_neighborhood.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional binary dependency (see the module docstring)
    import comfy_kitchen as _kitchen
except ImportError:  # pragma: no cover - exercised where comfy-kitchen is not installed
    _kitchen = None

BACKENDS = ("auto", "kitchen", "plain")
PLAIN_ON_GPU = ("neighborhood attention in plain PyTorch, comfy-kitchen is not installed: several times slower on a "
                "GPU (1280×704×121 tiled 1×2: 63 s on an H100, 7.6 s with comfy-kitchen on an H200); "
                "pip install comfy-kitchen")
"""The decode report's line when the diffusion decoder's attention falls back to `na3d_plain` on a GPU (figures:
bench/results/diffusion_decode_h200.txt and issue 37's H100 run)."""
_MASK_BUDGET = 2 ** 24  # elements of one query-slab × key-slab mask in `na3d_plain`


def plain_fallback(device: torch.device | str) -> str | None:
    """`PLAIN_ON_GPU` when the "auto" backend would run `na3d_plain` on `device` (comfy-kitchen absent, CUDA), else
    None: on the CPU comfy-kitchen runs its eager backend too, so nothing is lost there."""
    return PLAIN_ON_GPU if not kitchen_available() and torch.device(device).type == "cuda" else None


def window_starts(length: int, kernel: int, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Per-index window start along one axis and the (clamped) kernel: `clamp(i - k // 2, 0, n - k)`.

    Returns (`[length]` int64 starts, k') with k' = min(kernel, length).
    """
    k = min(kernel, length)
    i = torch.arange(length, device=device)
    return (i - k // 2).clamp(0, length - k), k


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size) -> tuple[int, int, int]:
    if q.ndim != 6:
        raise ValueError(f"na3d: q must be (B, T, H, W, heads, head_dim), got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"na3d: q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    kernel = tuple(int(x) for x in kernel_size)
    if len(kernel) != 3 or min(kernel) < 1:
        raise ValueError(f"na3d: kernel_size must be three positive ints (T, H, W), got {kernel_size!r}")
    return kernel


def na3d_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size, scale: float = 1.0) -> torch.Tensor:
    """Neighborhood attention in plain PyTorch (the fallback; semantics in the module docstring).

    Args: q, k, v `(B, T, H, W, heads, head_dim)`, one dtype; kernel_size `(k_t, k_h, k_w)`; scale multiplies the
    scores (1.0 for pre-scaled queries, as the decoder passes). Returns `(B, T, H, W, heads, head_dim)`, v's dtype.
    Raises ValueError for other shapes or kernels.
    """
    kernel = _check(q, k, v, kernel_size)
    b, t, h, w, nh, hd = q.shape
    dev = q.device
    (st, kt), (sh, kh), (sw, kw) = (window_starts(n, kk, dev) for n, kk in zip((t, h, w), kernel))
    # query slabs of `tq` frames × `th` rows × all columns, sized so one additive mask stays under the budget
    tq, th = t, h
    while tq * th * w * min(t, tq + kt - 1) * min(h, th + kh - 1) * w > _MASK_BUDGET and (tq > 1 or th > 1):
        if tq >= th and tq > 1:
            tq = (tq + 1) // 2
        else:
            th = (th + 1) // 2
    cols = torch.arange(w, device=dev)
    visible_w = (cols[None, :] >= sw[:, None]) & (cols[None, :] < sw[:, None] + kw)  # [w_q, w_k]
    out = torch.empty_like(v)
    qh = q.permute(0, 4, 1, 2, 3, 5)  # (B, heads, T, H, W, hd)
    kh_, vh_ = k.permute(0, 4, 1, 2, 3, 5), v.permute(0, 4, 1, 2, 3, 5)
    for t0 in range(0, t, tq):
        t1 = min(t0 + tq, t)
        kt0, kt1 = int(st[t0]), int(st[t1 - 1]) + kt
        frames = torch.arange(kt0, kt1, device=dev)
        visible_t = (frames[None, :] >= st[t0:t1, None]) & (frames[None, :] < st[t0:t1, None] + kt)
        for h0 in range(0, h, th):
            h1 = min(h0 + th, h)
            kh0, kh1 = int(sh[h0]), int(sh[h1 - 1]) + kh
            rows = torch.arange(kh0, kh1, device=dev)
            visible_h = (rows[None, :] >= sh[h0:h1, None]) & (rows[None, :] < sh[h0:h1, None] + kh)
            visible = (visible_t[:, None, None, :, None, None] & visible_h[None, :, None, None, :, None]
                       & visible_w[None, None, :, None, None, :])
            nq, nk = (t1 - t0) * (h1 - h0) * w, (kt1 - kt0) * (kh1 - kh0) * w
            mask = torch.zeros(nq, nk, dtype=q.dtype, device=dev)
            mask.masked_fill_(~visible.reshape(nq, nk), torch.finfo(q.dtype).min)
            qs = qh[:, :, t0:t1, h0:h1].reshape(b, nh, nq, hd)
            ks = kh_[:, :, kt0:kt1, kh0:kh1].reshape(b, nh, nk, hd)
            vs = vh_[:, :, kt0:kt1, kh0:kh1].reshape(b, nh, nk, hd)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[:, t0:t1, h0:h1] = o.reshape(b, nh, t1 - t0, h1 - h0, w, hd).permute(0, 2, 3, 4, 1, 5)
    return out


def kitchen_available() -> bool:
    return _kitchen is not None


def na3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size, scale: float = 1.0,
         backend: str = "auto") -> torch.Tensor:
    """Neighborhood attention over `(B, T, H, W, heads, head_dim)` tensors (semantics in the module docstring).

    backend: "auto" (comfy-kitchen when installed, else plain), "kitchen" (raises ImportError when comfy-kitchen is
    not installed) or "plain". Raises ValueError for an unknown backend, other shapes or kernels.
    """
    if backend not in BACKENDS:
        raise ValueError(f"na3d: backend must be one of {BACKENDS}, got {backend!r}")
    kernel = _check(q, k, v, kernel_size)
    if backend == "kitchen" and _kitchen is None:
        raise ImportError("na3d backend 'kitchen' needs the comfy-kitchen package (pip install comfy-kitchen)")
    if backend == "plain" or _kitchen is None:
        return na3d_plain(q, k, v, kernel, scale)
    return _kitchen.na3d(q.contiguous(), k.contiguous(), v.contiguous(), list(kernel), None, float(scale))

