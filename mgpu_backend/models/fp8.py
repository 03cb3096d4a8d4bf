"""Linear layers whose weights stay resident in float8 (e4m3fn), computed in the compute dtype per call.

Users mostly have the fp8 checkpoints (`ltx-2-19b-dev-fp8`, `ltx-2.3-22b-dev-fp8`): every transformer-block Linear
stores `weight` as float8_e4m3fn plus a per-tensor float32 `weight_scale` (dequantized weight = weight · scale, the
"scaled fp8" convention of ComfyUI's `comfy/ops.py` and Lightricks' fp8 files). Keeping the fp8 tensor resident makes
weight memory ≈ file size; the bf16 copy exists only for the duration of one matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "weight_scale"
INPUT_SCALE_SUFFIX = "input_scale"


class FP8Linear(nn.Module):
    """`y = x · (weight·weight_scale)ᵀ + bias` with `weight` stored in float8.

    Attributes:
        weight: `[out_features, in_features]` float8_e4m3fn (or e5m2) parameter, frozen.
        weight_scale: 0-d float32 buffer (per-tensor scale).
        input_scale: optional 0-d float32 buffer, kept for strict loading and fp8 matmul kernels; unused here.
        bias: `[out_features]` in the compute dtype, or None.
        compute_dtype: dtype the weight is dequantized to per call (bf16 on GPU by default).
        fused_weight: optional full-precision override set by LoRA fusing (`mgpu_backend.lora`); when present it
            is used instead of the fp8 weight, and dropping it restores the original exactly.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, has_input_scale: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8_dtype), requires_grad=False)
        self.register_buffer(SCALE_SUFFIX, torch.ones((), dtype=torch.float32))
        if has_input_scale:
            self.register_buffer(INPUT_SCALE_SUFFIX, torch.ones((), dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype), requires_grad=False) if bias else None
        self.fused_weight: torch.Tensor | None = None

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in `compute_dtype`: `weight.to(compute_dtype) · weight_scale`."""
        return self.weight.to(self.compute_dtype) * self.weight_scale.to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fused_weight if self.fused_weight is not None else self.dequantized_weight()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={self.weight.dtype}, compute={self.compute_dtype}")


def swap_in_fp8_linears(module: nn.Module, fp8_weight_names: dict[str, torch.dtype], compute_dtype: torch.dtype,
                        input_scale_names: set[str] = frozenset()) -> int:
    """Replace each `nn.Linear` whose `<path>.weight` is listed by an `FP8Linear` of the same shape.

    Args:
        module: model whose parameters are still uninitialized (meta) or about to be overwritten by loading.
        fp8_weight_names: `{"<module path>.weight": fp8 dtype}` in the module's own key names.
        compute_dtype: dtype for the per-call dequantization.
        input_scale_names: module paths that also carry an `input_scale`.
    Returns: the number of layers replaced.
    Raises: ValueError naming the key when an fp8 weight does not belong to an `nn.Linear`.
    """
    replaced = 0
    for weight_name, fp8_dtype in fp8_weight_names.items():
        path = weight_name[: -len(".weight")]
        parent_path, _, child = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        old = getattr(parent, child, None)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"fp8 weight {weight_name!r} does not belong to a Linear layer "
                             f"(found {type(old).__name__}); only Linear weights may be stored in fp8")
        setattr(parent, child, FP8Linear(old.in_features, old.out_features, old.bias is not None, compute_dtype,
                                         fp8_dtype, has_input_scale=path in input_scale_names))
        replaced += 1
    return replaced


def quantize_fp8(weight: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled fp8 quantization: `scale = amax / fp8_max`, `q = (w / scale).to(fp8)`.

    Returns `(q, scale)` with `scale` a 0-d float32 tensor; `q.float() * scale ≈ weight`.
    """
    fp8_max = torch.finfo(fp8_dtype).max
    amax = weight.detach().abs().max().float().clamp(min=1e-12)
    scale = (amax / fp8_max).reshape(())
    q = (weight.float() / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q, scale.to(torch.float32)
