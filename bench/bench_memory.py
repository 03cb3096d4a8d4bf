"""Peak GPU memory per rank: transformer weights + the activations of one forward, bf16 and fp8-resident weights.

A 19B-shaped LTX-2.0 transformer (`LTX2_19B`, as in bench_sp.py; `--blocks` of the 48) is built directly in GPU
memory with random weights, either all bf16 or with every transformer-block Linear weight resident in float8_e4m3fn via
`FP8Linear` — swapped in by the loader's own `swap_in_fp8_linears`, as `load_module` does for an fp8 checkpoint
(`ltx-2-19b-dev-fp8`: block Linears fp8 + per-tensor scale, everything else bf16). For each size (121 frames at
640×352, 1280×704, 1920×1088 by default) and each W (1, 2, 4, 8) one no-grad forward runs through
`SequenceParallelTransformer` with a one-GPU stand-in for the W-way exchange (`MemoryExchange`: this rank holds
T/W video tokens; the all_to_all / all_gather buffers are allocated with the shapes the real `Exchange` allocates,
so attention runs over all T tokens with H/W heads). Reported per forward (a warm-up forward first):
- weights: `torch.cuda.memory_allocated()` after the build, and the parameter bytes split into the blocks and the
  rest; the 48-block figure is extrapolated linearly: rest + 48 × (block bytes / built blocks);
- act: `max_memory_allocated()` during the forward minus what was allocated before it (weights + inputs), after
  `reset_peak_memory_stats()`; `+resv` the same for `max_memory_reserved()` (what the caching allocator holds);
- rank peak @48 = 48-block weights + act. Activations do not scale with the block count (no grad: one block's
  intermediates live at a time), so the figure measured with `--blocks N` holds for 48;
- ms @48: the forward time scaled ×48/N (a by-product; bench_sp.py is the timing benchmark).
Not counted: NCCL's own buffers (outside PyTorch's allocator), the CUDA context (~0.5 GiB), the other components a
worker holds (listed below the table from their parameter bytes: VAEs, connectors, text projection, upscaler, Gemma).

    python bench/bench_memory.py --blocks 8 --out bench/results/memory_h200.txt   # on one H200
    python bench/bench_memory.py --blocks 8 --sizes 1280x704 --world 2 --dtypes fp8
    python bench/bench_memory.py --tiny                # CPU smoke check (tiny configs; no memory statistics on CPU)
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_gemma

from mgpu_backend.engine import latents as L  # noqa: E402
from mgpu_backend.models import configs  # noqa: E402
from mgpu_backend.models.fp8 import FP8Linear, swap_in_fp8_linears  # noqa: E402
from mgpu_backend.splits.exchange import Exchange  # noqa: E402
from mgpu_backend.splits.sequence import SequenceParallelTransformer  # noqa: E402

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"

# the LTX-2.0 transformer metadata of `bench_sp.LTX2_19B` (docs/design/models.md#the-releases; the fields diffusers
# reads), repeated here rather than imported: importing bench_sp runs its module-level setup (custom ops, compile
# helpers)
LTX2_19B = {
    "num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
    "caption_channels": 3840, "num_layers": 48, "rope_type": "split", "frequencies_precision": "float64",
    "av_ca_timestep_scale_multiplier": 1000, "use_middle_indices_grid": True,
}


# ---- random models built in place (shared with bench_e2e.py) ---------------------------------------------------------

def quiet_diffusers() -> None:
    from diffusers.utils import logging

    logging.set_verbosity_error()


def fill_random_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter and buffer of a module built with `to_empty` (nothing may stay uninitialized,
    docs/design/models.md#the-substrate-diffusers): weights ~ N(0, 1/fan_in), norm gains ≈ 1, other vectors
    ~ N(0, 0.05²), VAE stats ≈ 0 / ≈ 1; `FP8Linear` weights ~ N(0, 1) in float8 with `weight_scale` = 1/sqrt(fan_in).
    Runs on the module's device."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, m in module.named_modules():
            if isinstance(m, FP8Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen, device=device, dtype=torch.bfloat16))
                m.weight_scale.fill_(1.0 / math.sqrt(m.in_features))
                if hasattr(m, "input_scale"):
                    m.input_scale.fill_(1.0)
        for name, p in module.named_parameters():
            if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                continue  # filled above
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim >= 2 and "scale_shift_table" not in leaf and leaf != "learnable_registers":
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
            elif "norm" in name and leaf == "weight":
                p.normal_(1.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, 0.05, generator=gen)
        for name, b in module.named_buffers():
            if name.endswith("latents_mean"):
                b.normal_(0.0, 0.1, generator=gen)
            elif name.endswith("latents_std"):
                b.uniform_(0.5, 1.5, generator=gen)
            elif not name.endswith(("weight_scale", "input_scale")):
                raise AssertionError(f"no fill rule for buffer {name} of {type(module).__name__}")
    return module.eval().requires_grad_(False)


def block_linear_names(model: nn.Module) -> dict[str, torch.dtype]:
    """`{"transformer_blocks.….weight": float8_e4m3fn}` for every Linear inside the blocks: the layers an fp8 LTX-2
    checkpoint stores in float8 (the names `load_module` hands to `swap_in_fp8_linears`)."""
    return {f"{name}.weight": torch.float8_e4m3fn for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.startswith("transformer_blocks.")}


def build_transformer(meta: dict, device, dtype: torch.dtype, fp8: bool = False, seed: int = 0) -> nn.Module:
    """`LTX2VideoTransformer3DModel` built on the meta device, cast, (fp8: block Linears swapped for `FP8Linear`),
    then allocated on `device` and filled: no full-precision copy ever exists."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta)).to(dtype)
        if fp8:  # after the cast: `.to(dtype)` would upcast float8 parameters too
            swap_in_fp8_linears(model, block_linear_names(model), compute_dtype=dtype)
    return fill_random_(model.to_empty(device=device), seed)


def tensor_bytes(module: nn.Module, prefix: str | None = None) -> int:
    """Bytes of the parameters and buffers (whose name starts with `prefix`, if given)."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return sum(t.numel() * t.element_size() for n, t in tensors if prefix is None or n.startswith(prefix))


class MemoryExchange(Exchange):
    """A W-way exchange on one GPU with the allocations of the real one (`splits/exchange.py`): `seq_to_heads`
    makes the contiguous send buffer and a receive buffer of the same size, then the reshaped result; `all_gather_seq`
    W received parts and their concatenation. This rank's data stands in for the other ranks'."""

    def __init__(self, world_size: int):
        super().__init__(None, world_size, 0)

    def seq_to_heads(self, x):
        w = self.world_size
        if w == 1:
            return x
        b, t_local, h, d = x.shape
        send = x.reshape(b, t_local, w, h // w, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = send.clone()
        return recv.permute(1, 0, 2, 3, 4).reshape(b, w * t_local, h // w, d)

    def heads_to_seq(self, x):
        w = self.world_size
        if w == 1:
            return x
        b, t, h_local, d = x.shape
        send = x.reshape(b, w, t // w, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = send.clone()
        return recv.permute(1, 2, 0, 3, 4).reshape(b, t // w, w * h_local, d)

    def all_gather_seq(self, x, dim=1):
        if self.world_size == 1:
            return x
        return torch.cat([x.contiguous().clone() for _ in range(self.world_size)], dim=dim)


def transformer_inputs(model, frames: int, height: int, width: int, fps: float, device, dtype,
                       text_tokens: int = 1024) -> tuple[dict, int]:
    """Full (unsharded) forward inputs of one guidance pass: video and audio latents, 1024 text tokens (the
    connectors' minimum context), per-token timesteps, RoPE coordinates. Returns (kwargs, video tokens)."""
    f, h, w = L.latent_frames(frames), height // 32, width // 32
    t, ta = f * h * w, L.audio_latent_frames(frames, fps)
    g = torch.Generator().manual_seed(0)
    cfg = model.config

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    kw = dict(hidden_states=randn(1, t, cfg.in_channels), audio_hidden_states=randn(1, ta, cfg.audio_in_channels),
              encoder_hidden_states=randn(1, text_tokens, cfg.caption_channels),
              audio_encoder_hidden_states=randn(1, text_tokens, cfg.caption_channels),
              timestep=torch.full((1, t), 700.0, device=device),
              audio_timestep=torch.full((1, ta), 700.0, device=device),
              sigma=torch.full((1,), 700.0, device=device), audio_sigma=torch.full((1,), 700.0, device=device),
              encoder_attention_mask=torch.ones(1, text_tokens, device=device),
              audio_encoder_attention_mask=torch.ones(1, text_tokens, device=device),
              video_coords=L.video_coords(model, 1, f, h, w, fps, device=device),
              audio_coords=L.audio_coords(model, 1, ta, device=device), use_cross_timestep=True)
    return kw, t


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---- other resident components (parameter bytes, from meta modules) ------------------------------------------------

def component_bytes(dtype: torch.dtype) -> dict[str, int]:
    """Parameter + buffer bytes of the other modules a worker holds, at the released LTX-2.0 / Gemma 3 12B shapes
    (built on the meta device, no memory): as the loader keeps them (vocoder float32, the rest `dtype`)."""
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2 import vocoder as vocoder_module
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from bench_gemma import GEMMA3_12B
    from mgpu_backend.models.loader import build_audio_vae
    from mgpu_backend.models.text_projection import TextProjection

    def size(module, as_dtype):
        return sum(t.numel() * (as_dtype.itemsize if t.is_floating_point() else t.element_size())
                   for t in list(module.parameters()) + list(module.buffers()))

    voc_cls, voc_kw = configs.vocoder_kwargs({})
    with torch.device("meta"):
        out = {
            "text connectors (video + audio)": sum(size(LTX2ConnectorTransformer1d(
                **configs.connector_kwargs(LTX2_19B, audio=a)), dtype) for a in (False, True)),
            "text projection 188160->3840": size(TextProjection("single_linear", 3840 * 49, 3840), dtype),
            "video VAE (encoder + decoder)": size(AutoencoderKLLTX2Video(**configs.video_vae_kwargs(
                LTX2_VIDEO_VAE)), dtype),
            "audio VAE": size(build_audio_vae(**configs.audio_vae_kwargs({})), dtype),
            "vocoder (float32)": size(getattr(vocoder_module, voc_cls)(**voc_kw), torch.float32),
            "latent upscaler": size(LTX2LatentUpsamplerModel(**configs.upsampler_kwargs({})), dtype),
            "Gemma 3 12B (if resident)": size(Gemma3TextModel(Gemma3TextConfig(**GEMMA3_12B)), dtype),
        }
    return out


def _res(n: int) -> list:
    return ["res_x", {"num_layers": n, "inject_noise": False}]


# `config.vae` of ltx-2-19b-*.safetensors (tests/test_reference_ltx_core.py RELEASED_VAE_LAYOUTS["2.0"])
LTX2_VIDEO_VAE = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
    "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False, "encoder_base_channels": 128,
    "decoder_base_channels": 128, "timestep_conditioning": False,
    "encoder_blocks": [_res(4), ["compress_space_res", {"multiplier": 2}], _res(6),
                       ["compress_time_res", {"multiplier": 2}], _res(6), ["compress_all_res", {"multiplier": 2}],
                       _res(2), ["compress_all_res", {"multiplier": 2}], _res(2)],
    "decoder_blocks": [_res(5), ["compress_all", {"residual": True, "multiplier": 2}]] * 3 + [_res(5)],
}


# ---- the measurement ----------------------------------------------------------------------------------------------

def measure_forward(model, wrapper, kw, device, scale: float) -> dict:
    """One warm-up and one measured forward through `wrapper`; memory deltas against what was allocated before."""
    with torch.no_grad():
        wrapper(**kw)  # warm-up (kernel selection, workspaces)
        sync(device)
        out = {}
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base, base_resv = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        wrapper(**kw)
        sync(device)
        out["ms48"] = (time.perf_counter() - start) * 1000 * scale
        if device.type == "cuda":
            out["act"] = torch.cuda.max_memory_allocated(device) - base
            out["resv"] = torch.cuda.max_memory_reserved(device) - base_resv
    return out


def run_dtype(kind: str, args, meta: dict, device, dtype, sizes, worlds, log) -> dict:
    """Build the transformer with `kind` ("bf16" or "fp8") weights and measure every (size, W)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
    model = build_transformer(meta, device, dtype, fp8=(kind == "fp8"))
    sync(device)
    blocks = meta["num_layers"]
    block_bytes, total = tensor_bytes(model, "transformer_blocks."), tensor_bytes(model)
    rest = total - block_bytes
    w48 = rest + 48 * block_bytes / blocks
    info = {"blocks": blocks, "tensor_bytes": total, "block_bytes": block_bytes, "rest_bytes": rest, "w48": w48,
            "allocated": (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else None,
            "fp8_layers": sum(isinstance(m, FP8Linear) for m in model.modules()), "rows": {}}
    alloc = f"{info['allocated'] / GiB:.2f} GiB allocated" if info["allocated"] is not None else "no CUDA statistics"
    log(f"[{kind}] {blocks} blocks built: {alloc}, tensors {total / GiB:.3f} GiB = blocks {block_bytes / GiB:.3f} + "
        f"rest {rest / GiB:.3f}; {info['fp8_layers']} FP8Linear layers; 48 blocks ≈ rest + 48 × "
        f"{block_bytes / blocks / GiB:.4f} = {w48 / GiB:.2f} GiB (linear extrapolation from per-block bytes)")
    scale = 1.0 if args.tiny else 48 / blocks  # tiny: no scaling
    for width, height in sizes:
        try:
            kw, tokens = transformer_inputs(model, args.frames, height, width, args.fps, device, dtype)
        except Exception as exc:  # noqa: BLE001 - reported, the next size still runs
            log(f"[{kind}] {width}x{height}: inputs failed: {type(exc).__name__}: {exc}")
            continue
        for w in worlds:
            key = (width, height, w)
            try:
                wrapper = SequenceParallelTransformer(model, MemoryExchange(w))
                wrapper.activate()
                row = measure_forward(model, wrapper, kw, device, scale)
                row["tokens"], row["per_rank"] = tokens, -(-tokens // w)
            except torch.OutOfMemoryError as exc:
                row = {"error": "OOM"}
                log(f"[{kind}] {width}x{height} W={w}: out of memory ({str(exc).splitlines()[0][:120]})")
            except Exception as exc:  # noqa: BLE001
                row = {"error": type(exc).__name__}
                log(f"[{kind}] {width}x{height} W={w}: {type(exc).__name__}: {exc}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            info["rows"][key] = row
            if "error" not in row:
                mem = (f"act {row['act'] / GiB:6.2f} GiB (+resv {row['resv'] / GiB:5.2f}), rank peak @48 "
                       f"{(w48 + row['act']) / GiB:6.2f} GiB" if "act" in row else "memory n/a on CPU")
                log(f"[{kind}] {width}x{height} W={w}: {row['per_rank']} tokens/rank, {mem}, "
                    f"{row['ms48']:.1f} ms @48 blocks")
        del kw
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def table(results: dict, sizes, worlds) -> list[str]:
    kinds = [k for k in ("bf16", "fp8") if k in results]
    head = f"{'size':>10} {'W':>2} {'tok/rank':>8}"
    for k in kinds:
        head += f" | {k + ' act':>9} {'+resv':>6} {'peak@48':>8} {'ms@48':>8}"
    lines = [head + "   (GiB; ms = forward time ×48/N)", "-" * len(head)]
    for width, height in sizes:
        for w in worlds:
            cols, per_rank = [], ""
            for k in kinds:
                row = results[k]["rows"].get((width, height, w), {"error": "-"})
                if "error" in row:
                    cols.append(f" | {row['error']:>9} {'':>6} {'':>8} {'':>8}")
                    continue
                per_rank = row["per_rank"]
                if "act" in row:
                    cols.append(f" | {row['act'] / GiB:9.2f} {row['resv'] / GiB:6.2f} "
                                f"{(results[k]['w48'] + row['act']) / GiB:8.2f} {row['ms48']:8.1f}")
                else:
                    cols.append(f" | {'n/a':>9} {'n/a':>6} {'n/a':>8} {row['ms48']:8.1f}")
            lines.append(f"{f'{width}x{height}':>10} {w:>2} {per_rank:>8}" + "".join(cols))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks built (weights extrapolated to 48)")
    ap.add_argument("--sizes", default="640x352,1280x704,1920x1088")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--fps", type=float, default=24.0)
    ap.add_argument("--world", default="1,2,4,8", help="simulated SP degrees (must divide the 32 heads)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="bf16 weights and/or fp8-resident block Linears")
    ap.add_argument("--out", default=None,
                    help="also write the table to this file (the shipped H200 figures: bench/results/memory_h200.txt)")
    ap.add_argument("--no-components", action="store_true", help="skip the other-components table")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny transformer config, a small size")
    args = ap.parse_args(argv)
    quiet_diffusers()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = dict(LTX2_19B, num_layers=args.blocks)
    if args.tiny:
        from mgpu_backend.testing.tiny import tiny_transformer_metadata

        meta = tiny_transformer_metadata("2.0")  # 2 blocks, 8 heads
        args.sizes, args.frames = "256x128,512x256", 9
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",") if s]
    worlds = [int(w) for w in args.world.split(",") if w]
    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    log(f"bench_memory {datetime.datetime.now().isoformat(timespec='seconds')} on {device_name(device)} "
        f"(torch {torch.__version__}), compute {dtype}; {'tiny config' if args.tiny else '19B-shaped LTX-2.0'} "
        f"transformer, {meta['num_layers']} blocks built, {args.frames} frames at {args.fps:g} fps; "
        f"command: {' '.join(sys.argv)}")
    results = {}
    for kind in [k for k in args.dtypes.split(",") if k]:
        start = time.perf_counter()
        try:
            results[kind] = run_dtype(kind, args, meta, device, dtype, sizes, worlds, log)
        except Exception as exc:  # noqa: BLE001 - the other dtype still runs
            log(f"[{kind}] failed: {type(exc).__name__}: {exc}")
        log(f"[{kind}] {time.perf_counter() - start:.1f} s")
    log()
    for kind, info in results.items():
        log(f"{kind}: 48-block transformer weights {info['w48'] / GiB:.2f} GiB (rest {info['rest_bytes'] / GiB:.2f} + "
            f"48 × {info['block_bytes'] / info['blocks'] / GiB:.3f} per block; extrapolated linearly from "
            f"{info['blocks']} built blocks" + (f", {info['allocated'] / GiB:.2f} GiB allocated for them)"
                                                 if info["allocated"] is not None else ")"))
    log("act = peak allocated during one no-grad forward minus weights + inputs; +resv = the same for the allocator's "
        "reserved bytes; peak@48 = 48-block weights + act (activations do not grow with the block count)")
    for line in table(results, sizes, worlds):
        log(line)
    if not args.no_components and not args.tiny:
        log()
        try:
            parts = component_bytes(dtype)
            log("other components a worker may hold (parameter bytes at the released shapes, bf16 unless noted):")
            for name, n in parts.items():
                log(f"  {name:<34} {n / GiB:6.2f} GiB")
            log(f"  {'sum without Gemma':<34} {sum(v for k, v in parts.items() if 'Gemma' not in k) / GiB:6.2f} GiB")
        except Exception as exc:  # noqa: BLE001
            log(f"component sizes failed: {type(exc).__name__}: {exc}")
    out = args.out
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("\n".join(lines) + "\n")
        print(f"written {out}")


if __name__ == "__main__":
    main()
