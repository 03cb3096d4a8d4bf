"""LoRA swap time on the fleet's working weights vs re-reading the transformer from disk.

A 19B-shaped LTX-2.0 transformer (the real config, `--blocks` of the 48, random weights built directly in GPU
memory; bf16, or fp8-resident block Linears with `--fp8`) gets the per-stage LoRA sets of the two-stage recipe through
`mgpu_backend.weights.lora.LoRAFuser`, exactly as the workers do:
- a "distilled" LoRA of rank `--rank` (384 like `ltx-2-19b-distilled-lora-384`) on every attention and feed-forward
  Linear of the blocks, and a small "user" LoRA (rank 32, the video/audio self-attention projections), both written
  here as safetensors files in the real key layout (`diffusion_model.<module>.lora_A/lora_B.weight`, `.alpha`);
- one swap = restore the previous set + fuse the next one (stage 1 `user` -> stage 2 `user + distilled` -> stage 1 …),
  the LoRA pairs read from their (page-cached) files each time, as a job does.
On W ranks (`--world W`, one process per GPU, NCCL; gloo on CPU) each rank fuses its ~1/W share of the layers,
keeps their clean bytes and broadcasts the fused ones; restore rebroadcasts the clean bytes from their owners. fp8
layers are re-quantized into their own fp8 weight and scale as ComfyUI does (`models/requantize.py`): no bf16 copy.

The alternative, re-reading the transformer from disk, is NOT run at full size: its time is extrapolated from the
read rate of a file this script writes (`--read-gib`, default 8 GiB, in `--tmp`): written, fsync'ed, evicted from the
page cache (`posix_fadvise(DONTNEED)`), then read sequentially into pinned memory and copied to the device ("cold");
then read again ("warm", page cache). Extrapolated reload = transformer file bytes (48 blocks, bf16 or fp8 file) /
rate — a lower bound: the real loader also parses, converts and assigns.

Times are scaled to 48 blocks (the blocks hold > 99 % of the weights and all the LoRA layers).

    python bench/bench_lora.py [--blocks 48] [--fp8] [--world 1] [--rank 384] [--iters 3] [--out FILE]
    python bench/bench_lora.py --tiny [--world 2]      # CPU smoke check (tiny model, gloo)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mgpu_backend.weights.lora import LoRAFuser, read_lora  # noqa: E402
from mgpu_backend.models import configs, keymaps  # noqa: E402
from mgpu_backend.models.fp8 import FP8Linear, quantize_fp8  # noqa: E402

LTX2_19B = {  # LTX-2.0 transformer metadata (as bench_sp.py)
    "num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
    "caption_channels": 3840, "num_layers": 48, "rope_type": "split", "frequencies_precision": "float64",
    "av_ca_timestep_scale_multiplier": 1000, "use_middle_indices_grid": True,
}
FULL_BLOCKS = 48
USER_TARGETS = (".attn1.to_q", ".attn1.to_k", ".attn1.to_v", ".attn1.to_out.0", ".audio_attn1.to_q",
                ".audio_attn1.to_k", ".audio_attn1.to_v", ".audio_attn1.to_out.0")


# ---- model and LoRA files --------------------------------------------------------------------------------------------

def build_transformer(meta: dict, device: torch.device, dtype: torch.dtype, fp8: bool, seed: int = 0):
    """Random weights built in `device` memory; `fp8`: every block Linear fp8-resident (`FP8Linear`)."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta))
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    model = model.to(dtype).eval().requires_grad_(False)
    if fp8:
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks."):
                q, scale = quantize_fp8(module.weight)
                layer = FP8Linear(module.in_features, module.out_features, module.bias is not None, dtype)
                layer.weight.data = q
                layer.weight_scale.copy_(scale)
                if module.bias is not None:
                    layer.bias.data = module.bias.data
                layer.to(device)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, layer)
    return model


def lora_layers(model, targets: tuple[str, ...] | None) -> list[tuple[str, int, int]]:
    """(module path, in, out) of the block Linears a LoRA touches (None: every attention / feed-forward Linear)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, FP8Linear)) and name.startswith("transformer_blocks.") \
                and "gate_logits" not in name and (targets is None or name.endswith(targets)):
            out.append((name, m.in_features, m.out_features))
    return out


def write_lora(path: str, layers, rank: int, seed: int) -> int:
    """A LoRA file in the real key layout (bf16 pairs, alpha = rank); returns its size in bytes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, fan_in, fan_out in layers:
        key = "diffusion_model." + keymaps.transformer_to_original(name)
        state[key + ".lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(torch.bfloat16)
        state[key + ".lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 1e-3).to(torch.bfloat16)
        state[key + ".alpha"] = torch.tensor(float(rank))
    save_file(state, path)
    return os.path.getsize(path)


def transformer_file_bytes(model, blocks: int, target: int = FULL_BLOCKS) -> int:
    """Bytes of the transformer's tensors as stored (bf16 / fp8 + scales), scaled from `blocks` to `target`."""
    total, in_blocks = 0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rope" in name:
            continue  # computed buffers, not in the file
        n = t.numel() * t.element_size()
        total += n
        if name.startswith("transformer_blocks."):
            in_blocks += n
    return int(total - in_blocks + in_blocks * target / blocks)


# ---- disk read rate --------------------------------------------------------------------------------------------------

def read_rate(folder: str, gib: float, device: torch.device) -> dict:
    """Write `gib` GiB, fsync, evict from the page cache, read it into pinned memory and copy to `device` (cold);
    then again from the page cache (warm). Returns GB/s for both and whether the eviction was possible."""
    path = os.path.join(folder, "read-rate.bin")
    chunk = 64 << 20
    n_chunks = max(1, int(gib * (1 << 30)) // chunk)
    block = torch.randint(0, 256, (chunk,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for _ in range(n_chunks):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    size = n_chunks * chunk
    pin = device.type == "cuda"
    buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(chunk, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def read_all() -> float:
        view = memoryview(buf.numpy())
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(view)
                if not got:
                    break
                if dev is not None:
                    dev[:got].copy_(buf[:got], non_blocking=True)
                    torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    evicted = True
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except (AttributeError, OSError):
        evicted = False
    cold = read_all()
    warm = read_all()
    os.remove(path)
    return {"file_gib": size / 2**30, "cold_gbps": size / cold / 1e9, "warm_gbps": size / warm / 1e9,
            "evicted": evicted}


# ---- the measurement, on every rank ----------------------------------------------------------------------------------

def run_rank(rank: int, world: int, args, folder: str) -> None:
    if args.tiny:
        from mgpu_backend.testing.tiny import tiny_transformer_metadata

        meta, device, dtype = tiny_transformer_metadata("2.0"), torch.device("cpu"), torch.float32
    else:
        meta = dict(LTX2_19B, num_layers=args.blocks)
        device, dtype = torch.device(f"cuda:{rank}"), torch.bfloat16
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{folder}/rdv",
                                rank=rank, world_size=world, timeout=timedelta(seconds=600))
    blocks = meta["num_layers"]
    t = time.perf_counter()
    model = build_transformer(meta, device, dtype, args.fp8)
    build_s = time.perf_counter() - t
    distilled_path, user_path = os.path.join(folder, "distilled.safetensors"), os.path.join(folder, "user.safetensors")
    sizes = {}
    if rank == 0:
        sizes["distilled"] = write_lora(distilled_path, lora_layers(model, None), args.rank, seed=1)
        sizes["user"] = write_lora(user_path, lora_layers(model, USER_TARGETS), 32, seed=2)
    if world > 1:
        dist.barrier()
    distilled, user = read_lora(distilled_path, 1.0), read_lora(user_path, 0.8)
    fuser = LoRAFuser(model, rank=rank, world_size=world, backup_device=args.backup_device)
    sets = {"stage 1 (user)": [user], "stage 2 (user + distilled)": [user, distilled]}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world > 1:
            dist.barrier()

    times: dict[str, list[float]] = {"fuse " + k: [] for k in sets} | {"restore " + k: [] for k in sets}
    times |= {"swap to " + k: [] for k in sets}
    peak = 0
    for it in range(args.iters + 1):  # the first round warms the page cache and the allocator
        for name, loras in sets.items():
            sync()
            t0 = time.perf_counter()
            previous = next((k for k in sets if fuser.active and k != name), None)
            fuser.restore()
            sync()
            t1 = time.perf_counter()
            fuser.fuse(loras)
            sync()
            t2 = time.perf_counter()
            clean = fuser.clean_bytes
            if device.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(device))
            if it == 0:
                continue
            times["fuse " + name].append(t2 - t1)
            if previous is not None:
                times["restore " + previous].append(t1 - t0)
            times["swap to " + name].append(t2 - t0)
            stats = dict(dataclasses.asdict(fuser.fuse_stats), clean_bytes=clean)
            if name.startswith("stage 2"):
                stage2_stats = stats
    fuser.restore()
    scale = 1.0 if args.tiny else FULL_BLOCKS / blocks
    result = {k: statistics.median(v) * scale for k, v in times.items() if v}
    gathered = [None] * world if world > 1 else None
    mine = {"rank": rank, "peak_gib": peak / 2**30,
            "stage2 (scaled)": {k: (int(v * scale) if k.endswith("bytes") else v * scale if k == "seconds" else v)
                                for k, v in stage2_stats.items()}}
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        weights = transformer_file_bytes(model, blocks, blocks if args.tiny else FULL_BLOCKS)
        rate = read_rate(args.tmp or folder, args.read_gib, device)
        best = rate["cold_gbps"] if rate["evicted"] else rate["warm_gbps"]
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world": world, "blocks_built": blocks, "scaled_to_blocks": blocks if args.tiny else FULL_BLOCKS,
            "weights": "fp8 block Linears" if args.fp8 else str(dtype).replace("torch.", ""),
            "lora_rank": args.rank, "lora_file_bytes": sizes, "build_seconds": build_s,
            "seconds (median, scaled)": result, "per_rank_stage2": gathered,
            "transformer_file_gib": weights / 2**30, "read_rate": rate,
            "reload_seconds_extrapolated": {"cold": weights / (rate["cold_gbps"] * 1e9),
                                            "warm (page cache)": weights / (rate["warm_gbps"] * 1e9)},
            "note": "reload = transformer file bytes / measured read rate of a written file (not a real reload; a "
                    "lower bound). Swap times scaled from the built blocks to 48.",
        }
        text = json.dumps(report, indent=2, default=str)
        print(text)
        swap = result.get("swap to stage 2 (user + distilled)")
        if swap:
            reload = weights / (best * 1e9)
            print(f"\nswap to the stage-2 set (restore + fuse): {swap:.3f} s on W={world}; re-reading the "
                  f"transformer ({weights / 2**30:.2f} GiB) at the measured {'cold' if rate['evicted'] else 'warm'} "
                  f"read rate {best:.2f} GB/s: {reload:.2f} s (extrapolated; {reload / swap:.1f}x the swap)")
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _entry(rank, world, args, folder):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world) if args.tiny else 4)
    run_rank(rank, world, args, folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=48, help="blocks built (times are scaled to 48)")
    ap.add_argument("--fp8", action="store_true", help="fp8-resident block Linears (the fp8 checkpoints)")
    ap.add_argument("--world", type=int, default=1, help="ranks (one GPU each; gloo CPU ranks with --tiny)")
    ap.add_argument("--rank", type=int, default=384, help="rank of the distilled-style LoRA")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--read-gib", type=float, default=8.0, help="size of the file whose read rate is measured")
    ap.add_argument("--tmp", default=None, help="folder for the LoRA files and the read-rate file (default: a temp "
                                                "folder)")
    ap.add_argument("--backup-device", default=None, help="keep clean weights here (e.g. cpu; default: the GPU)")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check: the tiny model, rank 4, a 64 MiB read")
    args = ap.parse_args()
    if args.tiny:
        args.rank, args.read_gib = min(args.rank, 4), min(args.read_gib, 1 / 16)
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: use --tiny for the CPU smoke check")
    elif torch.cuda.device_count() < args.world:
        ap.error(f"--world {args.world} needs {args.world} GPUs ({torch.cuda.device_count()} visible)")
    with tempfile.TemporaryDirectory(prefix="bench_lora_", dir=args.tmp) as folder:
        if args.world == 1:
            _entry(0, 1, args, folder)
        else:
            mp.spawn(_entry, args=(args.world, args, folder), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
