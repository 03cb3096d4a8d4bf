"""Where the forward's time goes: a CUDA profile of our transformer forward and of Lightricks' reference forward
on the same shapes (input for issue #9's speed work).

19B-shaped random bf16 weights in GPU memory (`--blocks` of the 48), one size, one profiled forward after a warm-up.
Prints the top operators by CUDA time for each, the wall time of both, and the GPU time by op category
(`CATEGORIES`: attention kernel, GEMMs, norms, copies / casts, compiled fused kernels, other elementwise —
modulation, RoPE, gates, residuals —) with the host gap: wall − GPU busy time (one stream: the time the GPU waited
for launches). `--rows N` runs the forward on a batch of N rows (the guidance passes of a step batched: 4 for the
two-stage recipe's stage 1). `--attention` times each scaled-dot-product-attention backend torch offers here on the
video self-attention's shape (rows × 32 heads × tokens × 128).

    python bench/profile_forward.py --blocks 8 --size 1280x704 [--frames 121] [--top 20] [--rows 1] \
        [--compile [--mode max-autotune-no-cudagraphs]] [--no-reference] [--attention]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_sp import LTX2_19B, build_reference, build_transformer, inputs  # noqa: E402
from mgpu_backend.engine import compile as C  # noqa: E402
from mgpu_backend.splits.exchange import Exchange  # noqa: E402
from mgpu_backend.testing.diffusers_inputs import SequenceDriver  # noqa: E402


CATEGORIES = (  # (category, substrings of a CUDA kernel's name, lower case), first match wins
    ("attention", ("fmha", "flash", "sdpa", "attention", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "scaled_mm", "sm90_")),
    ("norm", ("norm",)),
    # not "cast": most elementwise kernels are `gpu_kernel_impl_nocast<…Functor…>`; copies and dtype casts run
    # `direct_copy_kernel_cuda`
    ("copy / cast", ("direct_copy", "copy_kernel", "batchedcopy", "memcpy", "memset")),  # batchedcopy: torch.cat
    ("compiled fused (triton)", ("triton",)),
    ("other elementwise", ("",)),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next(c for c, keys in CATEGORIES if any(k in name for k in keys))


def category_table(prof, wall_s: float) -> str:
    """GPU time per `CATEGORIES` entry of the profiled forward, and the host gap (wall − GPU busy)."""
    totals: dict[str, float] = {c: 0.0 for c, _ in CATEGORIES}
    kernels: dict[str, int] = {c: 0 for c, _ in CATEGORIES}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "device_time", None)
        us = e.cuda_time if us is None else us
        c = category(e.name)
        totals[c] += us / 1e6
        kernels[c] += 1
    busy = sum(totals.values())
    lines = [f"{'category':<26}{'GPU ms':>10}{'of wall':>9}{'kernels':>9}"]
    for c, t in totals.items():
        lines.append(f"{c:<26}{1000 * t:>10.1f}{100 * t / wall_s:>8.1f}%{kernels[c]:>9}")
    gap = max(0.0, wall_s - busy)
    lines.append(f"{'host gap (wall - busy)':<26}{1000 * gap:>10.1f}{100 * gap / wall_s:>8.1f}%")
    lines.append(f"{'wall (profiled)':<26}{1000 * wall_s:>10.1f}")
    return "\n".join(lines)


def attention_backends(rows: int, tokens: int, heads: int = 32, head_dim: int = 128, repeat: int = 10) -> str:
    """Milliseconds of one bf16 scaled-dot-product attention of [rows, heads, tokens, head_dim] per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(rows, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * rows * heads * tokens * tokens * head_dim
    lines = [f"attention [{rows}, {heads}, {tokens}, {head_dim}] bf16:"]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, None):
        name = "default choice" if backend is None else backend.name
        try:
            ctx = sdpa_kernel([backend]) if backend is not None else torch.no_grad()
            with ctx, torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(repeat):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v)
                torch.cuda.synchronize()
            ms = 1000 * (time.perf_counter() - start) / repeat
            lines.append(f"  {name:<22}{ms:>9.2f} ms  {flops / ms / 1e9:>7.0f} TFLOP/s")
        except RuntimeError as exc:
            lines.append(f"  {name:<22} not available here ({str(exc).splitlines()[0][:90]})")
    return "\n".join(lines)


def profile(fn, label: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    fn()  # a compiled module finishes compiling over its first two calls
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        profiled = time.perf_counter() - start
    print(f"\n=== {label}: {wall * 1000:.1f} ms wall (unprofiled)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))
    print(category_table(prof, profiled))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--size", default="1280x704")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="profile ours with compiled blocks")
    ap.add_argument("--mode", default=None, help="torch.compile mode for --compile")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--rows", type=int, default=1, help="batch rows (the guidance passes of a step batched)")
    ap.add_argument("--attention", action="store_true", help="time each SDPA backend on the video attention shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_forward.py profiles CUDA kernels and needs a GPU; for a CPU smoke check of the same "
                 "forwards run bench/bench_sp.py --tiny")
    device = torch.device("cuda")
    meta = dict(LTX2_19B, num_layers=args.blocks)
    width, height = (int(v) for v in args.size.split("x"))
    model = build_transformer(meta, device, torch.bfloat16)
    kw, _ = inputs(model, args.frames, height, width, 24.0, device, torch.bfloat16)
    ours_kw = {k: v for k, v in kw.items() if k != "return_dict"}
    if args.rows > 1:
        ours_kw = {k: (v.expand(args.rows, *v.shape[1:]).contiguous() if isinstance(v, torch.Tensor) and v.dim()
                       and v.shape[0] == 1 else v) for k, v in ours_kw.items()}
        args.no_reference = True  # the reference forward is timed at one row
    if args.attention:
        print(attention_backends(args.rows, kw["hidden_states"].shape[1]))
    sp = SequenceDriver(model, Exchange(None, 1, 0))
    sp.activate()
    if args.compile:
        C.compile_blocks(model, mode=args.mode)
    with torch.no_grad():
        label = f"ours{' compiled (mode ' + (args.mode or 'default') + ')' if args.compile else ''} " \
                f"({args.blocks} blocks, " \
                f"{args.size}×{args.frames})"
        profile(lambda: sp(**ours_kw), label, args.top)
    del model, sp
    if args.no_reference:
        return
    torch.cuda.empty_cache()
    lc, ref = build_reference(meta, device, torch.bfloat16)
    vm = lc.Modality(latent=kw["hidden_states"], sigma=kw["sigma"] / 1000, timesteps=kw["timestep"] / 1000,
                     positions=kw["video_coords"], context=kw["encoder_hidden_states"], context_mask=None)
    am = lc.Modality(latent=kw["audio_hidden_states"], sigma=kw["audio_sigma"] / 1000,
                     timesteps=kw["audio_timestep"] / 1000, positions=kw["audio_coords"],
                     context=kw["audio_encoder_hidden_states"], context_mask=None)
    with torch.no_grad():
        profile(lambda: ref(vm, am, lc.BatchedPerturbationConfig.empty(1)), "reference ltx-core", args.top)


if __name__ == "__main__":
    main()
