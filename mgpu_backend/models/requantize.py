"""A LoRA patched into a Linear weight and the result put back in the layer's own format, as ComfyUI does it.

What ComfyUI 0.33 computes for a LoRA on one Linear (`comfy/model_patcher.py::ModelPatcher.patch_weight_to_device`,
the patcher that runs on the CPU, with `--disable-dynamic-vram`, `--highvram` or `--gpu-only`, and for hooks; with
comfy-kitchen 0.2.31, the version ComfyUI 0.33's requirements pin), for the weight of state-dict key K (e.g.
`diffusion_model.transformer_blocks.0.attn1.to_q.weight`), all on the device the model is loaded to:

1. Patch dtype D = `comfy.model_management.lora_compute_dtype(device)`: float32 on the CPU; on CUDA float16 wherever
   ComfyUI's `should_use_fp16` says so (compute capability ≥ 8, or 7.x except the Turing cards it lists as broken;
   float32 below) — `lora_compute_dtype` here.
2. The weight in D: a plain weight cast (`weight.to(D)`); a quantized one dequantized in D (the layer's
   `convert_weight` → `QuantizedTensor.dequantize()` with `orig_dtype` D): fp8 `q.to(D) · scale.to(D)` (comfy-kitchen
   `dequantize_per_tensor_fp8`), int8 `(q.float() · scale)` in float32, rotated back by Hᵀ for ConvRot, then `.to(D)`
   (`dequantize_int8[_convrot]_weight_dtype`).
3. Each LoRA on that key, in the order the patches were added (`comfy/lora.py::calculate_weight`,
   `comfy/weight_adapter/lora.py::LoRAAdapter.calculate_weight`): `diff = torch.mm(up, down)` in float32 (up = B
   `[out, r]`, down = A `[r, in]`, cast from the file's dtype), `W += ((strength · (alpha / r)) · diff).type(D)`
   (alpha / r = 1.0 when the file has no alpha); one addition per LoRA, each rounded to D.
4. Back to the layer's format, seeded by `seed = string_to_seed(K)`:
   * plain weight (`set_func` None, or ComfyUI's quantization-aware Linear without a layout):
     `comfy.float.stochastic_rounding(W, weight.dtype, seed)`, which for bf16 / fp16 / float32 is a plain cast.
   * fp8 layer (a `QuantizedTensor` of ComfyUI's `TensorCoreFP8E4M3Layout` / `E5M2Layout`; its `set_weight` →
     `requantize_from_float(W, scale="recalculate", stochastic_rounding=seed, inplace_ops=True)` →
     `comfy/quant_ops.py::_TensorCoreFP8LayoutBase.quantize`): `scale = amax(|W|).float() / fp8_max`; when D is
     neither float32 nor bf16, `scale = 1 / clamp(1 / scale, D's finite range)` (ComfyUI: "prevent scale from being
     too small"); `W *= (1 / scale).to(D)`; then `comfy.float.stochastic_rounding(W, fp8, seed)`, which with
     comfy-kitchen draws `rng = torch.randint(0, 256, W.shape, uint8)` from a `torch.Generator(W.device)` seeded with
     `seed` (one draw for the whole tensor) and calls comfy-kitchen's `stochastic_rounding_fp8(W, rng, fp8)` (below);
     the new per-tensor scale is stored in float32. (A seed of 0 would round to nearest: `quantize_per_tensor_fp8`.)
   * int8 layer (`TensorWiseINT8Layout`, comfy-kitchen's own; `requantize_kwargs` keeps `per_channel` = ConvRot or a
     scale with a dimension, `convrot`, `convrot_groupsize`): ConvRot first rotates `W` group-wise by `Hᵀ` in D (H built
     in D); the scale is recalculated — one `amax(|W|).float() / 127` (clamped to ≥ 1e-30) per tensor, or per row for
     per-row / ConvRot layers; `W / scale.to(D)` in D (a scale that is 0 in D becomes D's tiny); with `seed` > 0
     `+ torch.rand(W.shape, dtype=D)` from a generator seeded with `seed`, then floor; else round half to even;
     clamp to [-128, 127], int8 (comfy-kitchen `backends/eager/quantization.py::quantize_int8_tensorwise` /
     `_rowwise` / `quantize_int8_convrot_weight`, `_round_int8`).

comfy-kitchen's `stochastic_rounding_fp8` (eager backend) in float16: `x = x.half()`; `e = clamp(floor(log2|x|) +
bias, 0, 2^E − 1)` (e4m3: E 4, M 3, bias 7; e5m2: 5, 2, 15); the mantissa scaled to integer steps,
`m = (|x| / 2^(e − bias) − 1) · 2^M` for normal (e > 0) values, `|x| / 2^(1 − bias − M)` for subnormal ones;
`m = floor(m + rng / 256) / 2^M`; the value `sign(x) · 2^(e − bias) · (1 + m)` (normal) or `sign(x) · 2^(1 − bias) · m`
(subnormal), clamped to the fp8 range and cast. Every step is a float16 operation, so the same steps in torch give
the same bits on the same device.

Where the bits are ComfyUI's: with the same weights, LoRA tensors, key and patch dtype, on the CPU, the result is
bit-identical to ComfyUI's (tests/test_lora_requant.py against goldens made by ComfyUI 0.33 + comfy-kitchen 0.2.31,
tests/golden/make_lora_requant_golden.py). On CUDA the random draws come from the CUDA generator, as ComfyUI's do on
its GPU: equal to ComfyUI on the same GPU model and torch build, not to a CPU run. ComfyUI's default on NVIDIA GPUs
(dynamic VRAM, `comfy/model_patcher.py::ModelPatcherDynamic`) instead patches each weight at every cast
(`comfy/ops.py::cast_bias_weight`), with the LoRA product in D too and the module path (without `.weight`) as the seed
key: a run there is not bit-comparable to this rule (nor to ComfyUI's own patcher above).

comfy-kitchen's functions are used when the package is installed (what ComfyUI calls: `stochastic_rounding_fp8`,
`quantize_per_tensor_fp8`, `dequantize_per_tensor_fp8`, `TensorWiseINT8Layout.quantize`; its backends chosen as
comfy/quant_ops.py chooses them, `quant.kitchen_op`), else the torch steps above (tested bit-equal on the CPU).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from . import quant
from .fp8 import FP8Linear

_CRC32_POLY = 0xEDB88320  # CRC-32 (IEEE 802.3), reflected
# Turing cards ComfyUI's `should_use_fp16` lists as "FP16 is just broken" (matched in the device name)
_FP16_BROKEN = ("1660", "1650", "1630", "T500", "T550", "T600", "MX550", "MX450", "CMP 30HX", "T2000", "T1000",
                "T1200")
_FP8_BITS = {torch.float8_e4m3fn: (4, 3, 7), torch.float8_e5m2: (5, 2, 15)}  # exponent bits, mantissa bits, bias
PATCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # dtypes a LoRA may be patched in


def string_to_seed(key: str) -> int:
    """ComfyUI's `comfy.utils.string_to_seed`: the CRC-32 of `key` (reflected polynomial 0xEDB88320, initial value
    and final XOR 0xFFFFFFFF) taken over its characters' code points (one "byte" per character, as ComfyUI feeds
    `ord(c)`), an int in [0, 2³²). For an ASCII key it equals `zlib.crc32(key.encode())`."""
    if not isinstance(key, str):
        raise TypeError(f"string_to_seed: key must be a str, got {type(key).__name__}")
    if key.isascii():
        return zlib.crc32(key.encode("ascii"))
    crc = 0xFFFFFFFF
    for ch in key:
        crc ^= ord(ch)
        for _ in range(8):
            crc = (crc >> 1) ^ (_CRC32_POLY if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def lora_compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype ComfyUI patches a weight in on `device` (`comfy.model_management.lora_compute_dtype` without its
    `--force-fp16` / `--force-fp32` flags, on Linux): float32 off CUDA; on CUDA (ROCm: float16) float16 for compute
    capability ≥ 8, float16 for 7.x unless the device name is one of the Turing cards ComfyUI treats as broken in
    fp16, float32 below 7."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    if torch.version.hip:
        return torch.float16
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = torch.cuda.get_device_capability(index)[0]
    if major >= 8:
        return torch.float16
    if major < 7:
        return torch.float32
    name = torch.cuda.get_device_name(index)
    return torch.float32 if any(n in name for n in _FP16_BROKEN) else torch.float16


def _kitchen(use_kitchen: bool | None):
    """comfy_kitchen (its backends set as ComfyUI sets them) when it is installed and `use_kitchen` is not False;
    None otherwise. Raises ImportError when `use_kitchen` is True and it is not installed."""
    if use_kitchen is False:
        return None
    if quant.kitchen_op() is None:
        if use_kitchen:
            raise ImportError("use_kitchen=True but comfy-kitchen is not installed (the 'kitchen' extra)")
        return None
    import comfy_kitchen

    return comfy_kitchen


# ---- fp8 ---------------------------------------------------------------------------------------------------------

def stochastic_round_fp8_torch(x: torch.Tensor, rng: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """comfy-kitchen's eager `stochastic_rounding_fp8` in torch (the steps of the module docstring, float16 math).

    Args: x: any float tensor (already divided by the scale); rng: uint8, x's shape (the random steps, 0..255);
        fp8_dtype: float8_e4m3fn or float8_e5m2.
    Returns x's shape in `fp8_dtype`. Raises ValueError for another dtype or a shape mismatch.
    """
    if fp8_dtype not in _FP8_BITS:
        raise ValueError(f"stochastic rounding to {fp8_dtype}: only float8_e4m3fn and float8_e5m2 are supported")
    if rng.shape != x.shape or rng.dtype != torch.uint8:
        raise ValueError(f"rng must be uint8 of x's shape {tuple(x.shape)}, got {rng.dtype} {tuple(rng.shape)}")
    e_bits, m_bits, bias = _FP8_BITS[fp8_dtype]
    h = x.half()
    magnitude = h.abs()
    sign = torch.where(magnitude == 0, 0, torch.sign(h))
    exponent = torch.clamp(torch.floor(torch.log2(magnitude)) + bias, 0, 2 ** e_bits - 1)
    normal = exponent != 0
    steps = torch.where(normal, (magnitude / (2.0 ** (exponent - bias)) - 1.0) * (2 ** m_bits),
                        magnitude / (2.0 ** (-bias + 1 - m_bits)))
    steps = steps + rng.to(steps.dtype) * (1.0 / 256.0)
    fraction = steps.floor() / (2 ** m_bits)
    value = sign * torch.where(normal, (2.0 ** (exponent - bias)) * (1.0 + fraction),
                               (2.0 ** (-bias + 1)) * fraction)
    info = torch.finfo(fp8_dtype)
    return torch.clamp(value, min=info.min, max=info.max).to(fp8_dtype)


def fp8_random_steps(shape: torch.Size, device: torch.device, seed: int) -> torch.Tensor:
    """The uint8 random steps ComfyUI draws for `stochastic_rounding` (comfy-kitchen branch): one `torch.randint(0,
    256, shape, uint8)` from a fresh `torch.Generator(device)` seeded with `seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)


def requantize_fp8(weight: torch.Tensor, fp8_dtype: torch.dtype, seed: int,
                   use_kitchen: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's fp8 layout quantize with `scale="recalculate"` and stochastic rounding seeded by `seed` (the module
    docstring, step 4).

    Args: weight: `[out, in]` patched weight in the patch dtype D (float32 / float16 / bf16); fp8_dtype: the layer's;
        seed: `string_to_seed` of its key (0: round to nearest); use_kitchen: None = comfy-kitchen when installed.
    Returns `(q [out, in] fp8_dtype, scale 0-d float32)` with `q.to(D) · scale ≈ weight`.
    """
    if fp8_dtype not in _FP8_BITS:
        raise ValueError(f"requantize to {fp8_dtype}: the fp8 layouts are float8_e4m3fn and float8_e5m2")
    ck = _kitchen(use_kitchen)
    scale = torch.amax(weight.abs()).to(dtype=torch.float32) / torch.finfo(fp8_dtype).max
    if weight.dtype not in (torch.float32, torch.bfloat16):
        limits = torch.finfo(weight.dtype)
        scale = 1.0 / torch.clamp(1.0 / scale, min=limits.min, max=limits.max)
    if seed > 0:
        scaled = weight * (1.0 / scale).to(weight.dtype)
        rng = fp8_random_steps(scaled.size(), scaled.device, seed)
        q = (ck.stochastic_rounding_fp8(scaled, rng, fp8_dtype) if ck is not None
             else stochastic_round_fp8_torch(scaled, rng, fp8_dtype))
    elif ck is not None:
        q = ck.quantize_per_tensor_fp8(weight, scale, fp8_dtype)
    else:
        fmax = torch.finfo(fp8_dtype).max
        q = torch.clamp(weight * (1.0 / scale).to(weight.dtype), -fmax, fmax).to(fp8_dtype)
    return q, scale.float()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   use_kitchen: bool | None = None) -> torch.Tensor:
    """ComfyUI's fp8 dequantization for patching: `q.to(dtype) · scale.to(dtype)` (comfy-kitchen
    `dequantize_per_tensor_fp8`). q `[out, in]` fp8, scale 0-d float32; returns `[out, in]` in `dtype`."""
    ck = _kitchen(use_kitchen)
    if ck is not None:
        return ck.dequantize_per_tensor_fp8(q, scale, dtype)
    return q.to(dtype=dtype) * scale.to(dtype=dtype)


# ---- int8 --------------------------------------------------------------------------------------------------------

def requantize_int8_torch(weight: torch.Tensor, per_row: bool, group: int | None,
                          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """comfy-kitchen's `TensorWiseINT8Layout.quantize(weight, scale="recalculate", stochastic_rounding=seed,
    per_channel=per_row or ConvRot, convrot=group is not None, convrot_groupsize=group)` in torch (eager backend
    steps, the module docstring). Arguments and result as `requantize_int8`."""
    x = weight
    if group is not None:
        out_f, in_f = x.shape
        if in_f % group:
            raise ValueError(f"ConvRot group size {group} does not divide in_features {in_f}")
        h = quant._hadamard_like(group, x)
        x = torch.matmul(x.reshape(out_f, in_f // group, group), h.T).reshape(out_f, in_f)
        per_row = True
    amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().max()
    scale = (amax.float() / 127.0).clamp(min=1e-30)
    divisor = scale.to(dtype=x.dtype)
    divisor = torch.where(divisor == 0, torch.full_like(divisor, torch.finfo(x.dtype).tiny), divisor)
    scaled = x / divisor
    if seed > 0:
        generator = torch.Generator(device=x.device)
        generator.manual_seed(seed)
        scaled = (scaled + torch.rand(x.shape, dtype=x.dtype, device=x.device, generator=generator)).floor()
    else:
        scaled = scaled.round()
    return scaled.clamp(-128.0, 127.0).to(torch.int8), scale


def requantize_int8(weight: torch.Tensor, per_row: bool, group: int | None, seed: int,
                    use_kitchen: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's int8 requantization of a patched weight (comfy-kitchen `TensorWiseINT8Layout.quantize` with the
    layer's `requantize_kwargs`, `scale="recalculate"`, stochastic rounding seeded by `seed`).

    Args: weight: `[out, in]` patched weight in the patch dtype D; per_row: the layer's scale is per row (`[out, 1]`);
        group: ConvRot group size or None; seed: `string_to_seed` of the key (0: round half to even);
        use_kitchen: None = comfy-kitchen when installed.
    Returns `(q [out, in] int8 (rotated for ConvRot), scale float32 0-d or [out, 1])`.
    """
    ck = _kitchen(use_kitchen)
    if ck is None:
        return requantize_int8_torch(weight, per_row, group, seed)
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    q, params = TensorWiseINT8Layout.quantize(
        weight, scale="recalculate", stochastic_rounding=seed, inplace_ops=True, is_weight=True,
        per_channel=bool(per_row or group is not None), convrot=group is not None,
        convrot_groupsize=group or quant.DEFAULT_CONVROT_GROUP)
    return q, params.scale


# ---- one layer ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PatchedWeight:
    """A layer's LoRA-patched weight in its own storage format.

    weight: `[out, in]` whole, in the layer's storage dtype (fp8, int8, or the plain weight's dtype); scale: the new
    `weight_scale` (float32, the layer's scale shape) for a quantized layer, None for a plain one; dtype: the patch
    dtype D it was computed in."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    dtype: torch.dtype


def lora_patched(layer: torch.nn.Module, weight: torch.Tensor, terms, seed: int,
                 dtype: torch.dtype | None = None, use_kitchen: bool | None = None) -> PatchedWeight:
    """The weight of `layer` with LoRA `terms` patched in, in the layer's format, as ComfyUI computes it (module
    docstring, steps 1-4).

    Args:
        layer: an `nn.Linear`, `fp8.FP8Linear` or `quant.Int8Linear`.
        weight: the layer's whole weight `[out, in]` as stored (gathered whole when the layer is sharded; an int8
            weight may be its float8 byte view).
        terms: `[(A [r, in], B [out, r], s), ...]` in the order ComfyUI applies them, `s = strength · (alpha / r)`
            (a Python float); A / B in any float dtype, on any device.
        seed: `string_to_seed` of the layer's ComfyUI state-dict key.
        dtype: the patch dtype D (None: `lora_compute_dtype(weight.device)`, ComfyUI's).
        use_kitchen: None = comfy-kitchen when installed, False = the torch steps, True = comfy-kitchen or ImportError.
    Returns a `PatchedWeight` on the weight's device. Raises TypeError for another layer type.
    """
    from .quant import Int8Linear  # a subclass of FP8Linear

    dtype = dtype or lora_compute_dtype(weight.device)
    device = weight.device
    if isinstance(layer, Int8Linear):
        q = layer.int8_weight(weight)
        if quant.kitchen_op() is not None and use_kitchen is not False:
            patched = quant.dequantize_weight_like_comfyui(q, layer.weight_scale, layer.convrot_group, dtype)
        else:
            patched = quant.dequantize_int8(q, layer.weight_scale, layer.convrot_group).to(dtype)
    elif isinstance(layer, FP8Linear):
        patched = dequantize_fp8(weight, layer.weight_scale, dtype, use_kitchen)
    elif isinstance(layer, torch.nn.Linear):
        patched = weight.to(dtype=dtype, copy=True)
    else:
        raise TypeError(f"lora_patched: {type(layer).__name__} is not a Linear, FP8Linear or Int8Linear")
    for a, b, s in terms:
        diff = torch.mm(b.to(device=device, dtype=torch.float32), a.to(device=device, dtype=torch.float32))
        patched += diff.mul_(s).to(dtype)  # (s · diff) in float32, rounded to D, added in D
        del diff
    if isinstance(layer, Int8Linear):
        per_row = layer.weight_scale.dim() > 0  # ComfyUI: `per_channel` = a scale with a dimension
        q, scale = requantize_int8(patched, per_row, layer.convrot_group, seed, use_kitchen)
        return PatchedWeight(q, scale.reshape(layer.weight_scale.shape), dtype)
    if isinstance(layer, FP8Linear):
        q, scale = requantize_fp8(patched, weight.dtype, seed, use_kitchen)
        return PatchedWeight(q, scale.reshape(layer.weight_scale.shape), dtype)
    return PatchedWeight(patched.to(weight.dtype), None, dtype)


__all__ = ["PATCH_DTYPES", "PatchedWeight", "dequantize_fp8", "fp8_random_steps", "lora_compute_dtype", "lora_patched",
           "requantize_fp8", "requantize_int8", "requantize_int8_torch", "stochastic_round_fp8_torch",
           "string_to_seed"]
