"""ComfyUI's quantized-layer layout (`.comfy_quant` markers) and resident int8 Linear layers.

ComfyUI files mark each quantized layer with a `<layer>.comfy_quant` tensor: the UTF-8 bytes of a JSON object as
uint8, e.g. `{"format": "float8_e4m3fn"}` or `{"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": 256}` (ComfyUI 0.33 `comfy/ops.py::_load_quantized_weight` / `_quantized_weight_state_dict`;
the group size may also sit under `"params"`). Per format (`comfy/quant_ops.py::QUANT_ALGOS`):

* `float8_e4m3fn` / `float8_e5m2`: `weight` in that dtype (legacy files: uint8 bytes), `weight_scale` (per tensor),
  optional `input_scale`; dequantized weight = weight · weight_scale. Loaded as `FP8Linear`.
* `int8_tensorwise`: `weight` int8 `[out, in]`, `weight_scale` (0-d, or per row `[out, 1]` for the ConvRot files);
  dequantized weight = weight · weight_scale. With `convrot`, the stored weight was rotated group-wise by a
  normalized regular Hadamard matrix H of size g (`convrot_groupsize`, a power of 4) before quantizing: the file holds
  Q(W_g · Hᵀ) per group of g input features, and the original basis comes back as deq(Q)_g · Hᵀ (H is symmetric and
  orthogonal, so Hᵀ·Hᵀ = I). Source: comfy-kitchen 0.2.31 (Apache-2.0)
  `backends/eager/quantization.py::quantize_int8_convrot_weight` / `dequantize_int8_convrot_weight`,
  `tensor/int8_utils.py::_build_hadamard` (H₄ = [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]],
  H_{4^k} = H₄^{⊗k}, divided by √g).
  Loaded as `Int8Linear`: the int8 tensor stays resident, the weight is dequantized per call (exact; the fast int8
  matmul is a separate speed path).

Other formats (`nvfp4`, `mxfp8`, `convrot_w4a4`, `asym_w4a8_int8`) are refused by name.
"""
from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import FP8Linear

COMFY_QUANT_SUFFIX = "comfy_quant"
FLOAT8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
INT8_FORMAT = "int8_tensorwise"
SUPPORTED_FORMATS = (*FLOAT8_FORMATS, INT8_FORMAT)
DEFAULT_CONVROT_GROUP = 256  # ComfyUI's default when the marker names none


def parse_comfy_quant(marker: torch.Tensor, key: str = "comfy_quant") -> dict:
    """Decode a `.comfy_quant` uint8 tensor to its JSON dict. Raises ValueError naming `key` when it is not JSON."""
    try:
        conf = json.loads(bytes(marker.to(torch.uint8).flatten().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{key}: not a JSON quantization marker ({exc})") from None
    if not isinstance(conf, dict) or "format" not in conf:
        raise ValueError(f"{key}: quantization marker without a 'format' field: {conf!r}")
    return conf


def encode_comfy_quant(conf: dict) -> torch.Tensor:
    """The uint8 marker tensor for `conf` (what ComfyUI writes)."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def convrot_group(conf: dict) -> int | None:
    """The ConvRot group size of an `int8_tensorwise` marker, or None when the layer is not rotated."""
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return None
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_CONVROT_GROUP)))


def hadamard(size: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Normalized regular Hadamard matrix `[size, size]` (symmetric, orthogonal) for a power-of-4 `size`.

    Raises ValueError for any other size (ComfyUI accepts group sizes 16, 64, 256).
    """
    if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
        raise ValueError(f"ConvRot group size {size}: must be a power of 4 (16, 64, 256)")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return (h / math.sqrt(size)).to(dtype=dtype, device=device)


def rotate_groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """`[out, in]` -> each run of `group` input features multiplied by Hᵀ (its own inverse). Float32 math."""
    out_f, in_f = weight.shape
    if in_f % group:
        raise ValueError(f"ConvRot: in_features {in_f} is not divisible by the group size {group}")
    h = hadamard(group, device=weight.device)
    return (weight.float().reshape(out_f, in_f // group, group) @ h.T).reshape(out_f, in_f)


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's int8 weight quantization (round to nearest, clamp to [-128, 127]).

    Without `group`: one scale `amax / 127` (0-d). With `group` (ConvRot): rotate, then one scale per row
    (`[out, 1]`), as comfy-kitchen's `quantize_int8_convrot_weight`. Returns `(q int8, scale float32)`.
    """
    w = weight.float()
    if group is not None:
        w = rotate_groups(w, group)
        scale = (w.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
    else:
        scale = (w.abs().max() / 127.0).clamp(min=1e-30).reshape(())
    q = (w / scale).round().clamp(-128.0, 127.0).to(torch.int8)
    return q, scale.to(torch.float32)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """`q · scale` (float32), rotated back when `group` is given. Shapes as in `quantize_int8`."""
    w = q.float() * scale.float()
    return rotate_groups(w, group) if group is not None else w


class Int8Linear(FP8Linear):
    """`y = x · deq(weight)ᵀ + bias` with `weight` resident as int8 (ComfyUI `int8_tensorwise`, optional ConvRot).

    A subclass of `FP8Linear` so that everything that handles resident-quantized layers (LoRA fusing through
    `fused_weight`, memory reports) treats it alike.

    Attributes:
        weight: `[out_features, in_features]` int8 parameter, frozen.
        weight_scale: float32 buffer, 0-d (per tensor) or `[out_features, 1]` (per row).
        convrot_group: Hadamard group size, or None (no rotation).
        bias: `[out_features]` in the compute dtype, or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 convrot_group: int | None = None, per_row_scale: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.convrot_group = convrot_group
        if convrot_group is not None:
            hadamard(convrot_group)  # validates the size
            if in_features % convrot_group:
                raise ValueError(f"ConvRot group size {convrot_group} does not divide in_features {in_features}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((out_features, 1) if per_row_scale else (),
                                                        dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype), requires_grad=False) if bias else None
        self.fused_weight: torch.Tensor | None = None
        self.last_path: str | None = None  # for `fp8.compute_report`, like FP8Linear's
        self.last_reason: str | None = None

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in `compute_dtype` (float32 math, rotated back for ConvRot)."""
        return dequantize_int8(self.weight, self.weight_scale, self.convrot_group).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            # no int8 matmul beats bf16 on Hopper (measured: models/fp8.py's docstring), so int8 always dequantizes
            self.last_path, self.last_reason = "dequantize", "int8 weights, dequantized per call"
        w = self.fused_weight if self.fused_weight is not None else self.dequantized_weight()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)

    def extra_repr(self) -> str:
        rot = f", convrot={self.convrot_group}" if self.convrot_group else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight=int8{rot}, "
                f"compute={self.compute_dtype}")


def swap_in_int8_linears(module: nn.Module, layers: dict[str, dict], compute_dtype: torch.dtype,
                         scale_shapes: dict[str, tuple[int, ...]]) -> int:
    """Replace each listed `nn.Linear` (module path -> its `comfy_quant` dict) by an `Int8Linear`.

    `scale_shapes`: module path -> stored `weight_scale` shape (0-d or `[out, 1]`).
    Returns the number replaced. Raises ValueError naming the layer when it is not a Linear or the scale does not fit.
    """
    for path, conf in layers.items():
        parent_path, _, child = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        old = getattr(parent, child, None)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"int8 weight {path}.weight does not belong to a Linear layer "
                             f"(found {type(old).__name__})")
        shape = tuple(scale_shapes.get(path, ()))
        if shape not in ((), (1,), (old.out_features, 1)):
            raise ValueError(f"{path}.weight_scale has shape {shape}; int8_tensorwise takes one scale or one per row "
                             f"({old.out_features}, 1)")
        setattr(parent, child, Int8Linear(old.in_features, old.out_features, old.bias is not None, compute_dtype,
                                          convrot_group(conf), per_row_scale=shape == (old.out_features, 1)))
    return len(layers)
