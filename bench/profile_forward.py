"""Where the forward's time goes: a CUDA profile of our transformer forward and of Lightricks' reference forward
on the same shapes (input for issue #9's speed work).

19B-shaped random bf16 weights in GPU memory (`--blocks` of the 48), one size, one profiled forward after a warm-up.
Prints the top operators by CUDA time for each, and the wall time of both.

    python bench/profile_forward.py --blocks 8 --size 1280x704 [--frames 121] [--top 20] \
        [--compile [--mode max-autotune-no-cudagraphs]] [--no-reference]
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
        fn()
        torch.cuda.synchronize()
    print(f"\n=== {label}: {wall * 1000:.1f} ms wall (unprofiled)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--size", default="1280x704")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="profile ours with compiled blocks")
    ap.add_argument("--mode", default=None, help="torch.compile mode for --compile")
    ap.add_argument("--no-reference", action="store_true")
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
