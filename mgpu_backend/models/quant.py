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
  Loaded as `Int8Linear`: the int8 tensor stays resident and is computed W8A8, as ComfyUI does (below).

How ComfyUI 0.33 computes an `int8_tensorwise` layer (`QUANT_ALGOS["int8_tensorwise"]` has `quantize_input: False`;
`comfy/ops.py::mixed_precision_ops.Linear.forward` takes the weight-only branch, `forward_comfy_cast_weights(...,
weight_only_quant=True)`, and `F.linear(x, weight, bias)` on the `QuantizedTensor` weight dispatches to comfy-kitchen
`tensor/int8.py::_handle_int8_linear_tensorwise` -> `torch.ops.comfy_kitchen.int8_linear(x.contiguous(), q, scale,
bias, <x's dtype>, convrot, convrot_groupsize)`; the LTX FeedForward's down projection goes through
`comfy/ops.py::linear_input_act(..., "gelu_tanh")` -> `comfy_kitchen.int8_linear(..., input_act="gelu_tanh")`, the
GELU folded into the activation quantizer). comfy-kitchen 0.2.31's eager backend (`backends/eager/quantization.py::
int8_linear`, what runs on CPU and on CUDA unless its CUDA backend is enabled) computes, for x `[..., K]` in the
compute dtype D (bf16 / fp16 / fp32):
  1. `input_act` applied in D (`backends/_activations.py::apply_input_act`: `F.gelu(x, approximate="tanh")`);
  2. ConvRot: x grouped by g and multiplied by H (built in D; H = Hᵀ), in D — the rotation the weight got offline;
  3. per-row dynamic quantization (`quantize_int8_rowwise`): `s_x = max(amax(|x_row|).float() / 127, 1e-30)`
     (float32), `q_x = clamp(round_half_even(x / s_x.to(D)), -128, 127)` in D (a scale that is 0 in D -> D's tiny);
  4. `q_x @ qᵀ` as int8 × int8 with int32 accumulation (`torch._int_mm`; exact);
  5. `acc.float() * (s_x * s_w)` in float32 (`s_w` the 0-d or per-row weight scale, float32), cast to D;
  6. `+ bias.to(D)` in D; output `[..., N]` in D.
comfy/quant_ops.py (ComfyUI's import) turns comfy-kitchen's "cuda" backend off when torch's CUDA is < 13 (or CPU
torch) and its "triton" backend off unless `--enable-triton-backend`; where the "cuda" backend runs (torch cu130+),
its fused kernels compute the same rule (int8 GEMM with int32 accumulation, per-row activation scales) in their own
order. A LoRA on an int8 layer: ComfyUI patches the dequantized weight and *re-quantizes* it (`set_weight` ->
`requantize_from_float(scale="recalculate", stochastic_rounding=<seed of the key>)`), then computes W8A8 again; the
fleet does the same (`models.requantize`, `weights.lora`: the new int8 bytes and scale written into the layer in
place). ComfyUI dequantizes and runs a float matmul (W8A16) only where the cast hands back a plain tensor: a layer
carrying `weight_function`s (LoRA patches applied per call in low-VRAM mode) or an input whose dtype differs from the
layer's compute dtype (`comfy/ops.py::cast_bias_weight`). `full_precision_mm=True` (its text encoders,
`comfy/sd1_clip.py`) does NOT make int8 layers dequantize: the weight stays a `QuantizedTensor` and `F.linear`
still dispatches to comfy-kitchen's int8_linear (checked on ComfyUI 0.33 + comfy-kitchen 0.2.31, CPU, float32 and
bf16).

The fleet calls comfy-kitchen's own op (`torch.ops.comfy_kitchen.int8_linear`, the `kitchen` extra), with its backends
chosen as comfy/quant_ops.py chooses them. Without comfy-kitchen, `int8_linear_torch` computes the same steps 1-6 in
plain torch (tested equal, bit for bit on CPU, to comfy-kitchen's eager backend); a one-time log line says so. It is a
faithful fallback rather than W8A16 because ComfyUI cannot load an int8 file at all without comfy-kitchen, so the
only result to be equal to is comfy-kitchen's.

Other formats (`nvfp4`, `mxfp8`, `convrot_w4a4`, `asym_w4a8_int8`) are refused by name.

Dequantized at load (the fleet option `int8_compute`, `FleetIdentity`): "w8a8" keeps the int8 weights resident and
computes as above; "dequantize" replaces every `Int8Linear` by a plain `nn.Linear` in the compute dtype at load
(`dequantize_int8_linears`), its weight the one ComfyUI dequantizes (`QuantizedTensor.dequantize()` ->
`comfy_kitchen.dequantize_int8_convrot_weight_dtype`: `q.float() · scale` in float32, rotated back group-wise by Hᵀ
in float32, cast to the compute dtype once; `dequantize_weight_like_comfyui`), and the FeedForward GELU folded into
the down projection moves back in front of it. The layer then computes x · deq(W)ᵀ in the compute dtype (W8A16 from
weights made once): closer to the bf16 file than ComfyUI's W8A8 result, 2× the resident bytes of those weights, and
on the H200 as fast as a bf16 file (bench/results/int8_h200.txt: W8A8 1.03-3.69× the bf16 time per layer). "auto"
(`protocol.fleet_rules.resolve_int8_compute`) takes "dequantize" on CUDA when the dequantized weights fit the GPU,
else "w8a8".
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import ComputeRecord, FP8Linear

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


# ---- int8 compute (W8A8, as ComfyUI with comfy-kitchen) ----------------------------------------------------------

log = logging.getLogger("ltx2_mgpu.quant")
INT8_COMPUTE_MODES = ("w8a8", "w8a16")
"""`LTX2_MGPU_INT8_COMPUTE` (read at import, in every worker): "w8a8" (default: ComfyUI's computation) or "w8a16"
(weights dequantized per call, activations kept in the compute dtype: closer to the bf16 file, not ComfyUI's result)."""
INT8_COMPUTE = os.environ.get("LTX2_MGPU_INT8_COMPUTE", "w8a8")
if INT8_COMPUTE not in INT8_COMPUTE_MODES:
    raise ValueError(f"LTX2_MGPU_INT8_COMPUTE={INT8_COMPUTE!r}: choose one of {', '.join(INT8_COMPUTE_MODES)}")
INPUT_ACTS = (None, "gelu_tanh")  # what `int8_linear` takes as `input_act` (the LTX FeedForward's GELU)
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # comfy-kitchen's output dtype codes
_KITCHEN: list = []  # [the op, or None] once looked up


def kitchen_op():
    """`torch.ops.comfy_kitchen.int8_linear`, or None when comfy-kitchen is not installed (one log line then).

    On first use in a process that is not ComfyUI's own (where comfy/quant_ops.py has already chosen from ComfyUI's
    flags), comfy-kitchen's backends are set as comfy/quant_ops.py sets them by default: "cuda" off for CPU torch
    or torch CUDA < 13, "triton" off.
    """
    if not _KITCHEN:
        try:
            import comfy_kitchen as ck
        except ImportError:
            log.warning("comfy-kitchen is not installed: int8 layers are computed W8A8 by the pack's torch copy of "
                        "comfy-kitchen's eager int8_linear (same result as ComfyUI's on CPU; no fused kernels on "
                        "GPU). Install the 'kitchen' extra (comfy-kitchen>=0.2.31) for ComfyUI's own kernels.")
            _KITCHEN.append(None)
            return None
        if "comfy.quant_ops" not in sys.modules:
            cuda = torch.version.cuda
            if cuda is None or tuple(int(v) for v in cuda.split(".")[:2]) < (13,):
                ck.registry.disable("cuda")
            ck.registry.disable("triton")
        _KITCHEN.append(torch.ops.comfy_kitchen.int8_linear)
    return _KITCHEN[0]


def _hadamard_like(size: int, x: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's `_build_hadamard(size, dtype=x.dtype)`: H₄ Kronecker powers built in x's dtype, / √size.
    (Entries ±1/√size with √size a power of 2: exact in every float dtype.)"""
    hadamard(size)  # validates the size
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=x.dtype, device=x.device)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return h / (size ** 0.5)


def _int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a [M, K] int8 @ b [K, N] int8` with int32 accumulation (exact): `torch._int_mm` where it takes the shape,
    else float64 (exact: |sum| ≤ 128² · K < 2⁵³)."""
    try:
        return torch._int_mm(a, b)
    except RuntimeError:
        return (a.double() @ b.double()).to(torch.int32)


def int8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      convrot_group: int | None = None, input_act: str | None = None) -> torch.Tensor:
    """ComfyUI's int8 linear (comfy-kitchen 0.2.31 eager `int8_linear`, steps 1-6 of the module docstring) in torch.

    Args:
        x: `[..., K]` float32 / bf16 / fp16 (the compute dtype D; the output has it).
        weight: `[N, K]` int8 (ConvRot-rotated when `convrot_group` is given).
        weight_scale: float32, 0-d / `[1]` or per row `[N, 1]` / `[N]`.
        bias: `[N]` or None.
        input_act: None or "gelu_tanh" (applied to x first).
    Returns `[..., N]` in D. Raises ValueError for a group size that does not divide K or is not a power of 4.
    """
    if input_act == "gelu_tanh":
        x = F.gelu(x, approximate="tanh")
    elif input_act is not None:
        raise ValueError(f"input_act {input_act!r}: choose one of {INPUT_ACTS}")
    k = x.shape[-1]
    if convrot_group is not None:
        if k % convrot_group:
            raise ValueError(f"ConvRot group size {convrot_group} does not divide input features {k}")
        x = (x.reshape(-1, k // convrot_group, convrot_group) @ _hadamard_like(convrot_group, x)).reshape(x.shape)
    x2 = x.reshape(-1, k)
    s_x = (x2.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(min=1e-30)
    s_d = s_x.to(x.dtype)
    s_d = torch.where(s_d == 0, torch.full_like(s_d, torch.finfo(x.dtype).tiny), s_d)
    q_x = (x2 / s_d).round_().clamp_(-128.0, 127.0).to(torch.int8)
    acc = _int8_mm(q_x, weight.t().contiguous())
    out = (acc.float() * (s_x * weight_scale.float().reshape(1, -1))).to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype).reshape(1, -1)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                convrot_group: int | None = None, input_act: str | None = None) -> torch.Tensor:
    """`x · (deq(weight))ᵀ + bias` computed W8A8 as ComfyUI does: comfy-kitchen's op when installed (what ComfyUI
    calls), else `int8_linear_torch`. Arguments as `int8_linear_torch`'s."""
    op = kitchen_op()
    if op is None or x.dtype not in _DTYPE_CODE:
        return int8_linear_torch(x, weight, weight_scale, bias, convrot_group, input_act)
    return op(x.contiguous(), weight, weight_scale, bias, _DTYPE_CODE[x.dtype], convrot_group is not None,
              convrot_group or DEFAULT_CONVROT_GROUP, input_act)


class Int8Linear(FP8Linear):
    """`y = x · deq(weight)ᵀ + bias` with `weight` resident as int8 (ComfyUI `int8_tensorwise`, optional ConvRot),
    computed W8A8 by `int8_linear` (activations quantized per row at run time; W8A16 with
    `LTX2_MGPU_INT8_COMPUTE=w8a16`). A fused LoRA is re-quantized into `weight` / `weight_scale` (`weights.lora`).

    A subclass of `FP8Linear` so that everything that handles resident-quantized layers (LoRA fusing, memory reports)
    treats it alike.

    Attributes:
        weight: `[out_features, in_features]` int8 parameter, frozen (on a sharded fleet: a float8_e4m3fn view of
            the same bytes, `weights/sharding.py`; read it through `int8_weight`).
        weight_scale: float32 buffer, 0-d (per tensor) or `[out_features, 1]` (per row).
        convrot_group: Hadamard group size, or None (no rotation).
        bias: `[out_features]` in the compute dtype, or None.
        input_act: None, or "gelu_tanh": the GELU applied to the input first (`fold_gelu`).
        lora_fused: True while a LoRA is fused into `weight` / `weight_scale` (`weights.lora`).
        computed: `fp8.ComputeRecord` of the latest eager call ("int8": W8A8, or "dequantize": W8A16, and why); None
            before the first.
    """

    QUANT_FORMAT = "int8"

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
        self.lora_fused = False
        self.computed: ComputeRecord | None = None  # for `fp8.compute_report`, like FP8Linear's
        self.input_act: str | None = None  # "gelu_tanh" once `fold_gelu` moved a FeedForward's GELU in here

    def int8_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` (default: this layer's) as int8: the bytes of a sharded layer's float8 view reinterpreted."""
        weight = self.weight if weight is None else weight
        return weight if weight.dtype == torch.int8 else weight.view(torch.int8)

    def dequantized_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The weight in `compute_dtype` (float32 math, rotated back for ConvRot); `weight`: as `FP8Linear`'s."""
        return dequantize_int8(self.int8_weight(weight), self.weight_scale, self.convrot_group).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if INT8_COMPUTE == "w8a16":  # weights dequantized per call
            if not torch.compiler.is_compiling():
                self.computed = ComputeRecord("dequantize",
                                              "LTX2_MGPU_INT8_COMPUTE=w8a16 (weights dequantized per call)")
            if self.input_act == "gelu_tanh":
                x = F.gelu(x, approximate="tanh")
            return F.linear(x, self.dequantized_weight().to(x.dtype), bias)
        if not torch.compiler.is_compiling():
            self.computed = ComputeRecord("int8", (
                "W8A8, comfy-kitchen int8_linear" if kitchen_op() is not None
                else "W8A8, torch copy of comfy-kitchen's int8_linear (comfy-kitchen not installed)"))
        return int8_linear(x, self.int8_weight(), self.weight_scale, bias, self.convrot_group, self.input_act)

    def extra_repr(self) -> str:
        rot = f", convrot={self.convrot_group}" if self.convrot_group else ""
        act = f", input_act={self.input_act}" if self.input_act else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight=int8{rot}{act}, "
                f"compute={self.compute_dtype}")


# ---- int8 dequantized at load (the fleet option `int8_compute`) ------------------------------------------------------

PATH_W8A8 = "int8 W8A8"
PATH_DEQUANTIZED = "int8 dequantized to {dtype} at load"
_KITCHEN_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # comfy-kitchen's dequantize codes


def dequantize_weight_like_comfyui(q: torch.Tensor, scale: torch.Tensor, group: int | None,
                                   dtype: torch.dtype) -> torch.Tensor:
    """The weight ComfyUI dequantizes from an `int8_tensorwise` layer (comfy-kitchen `TensorWiseINT8Layout.dequantize`):
    `q.float() · scale` in float32, rotated back by Hᵀ group-wise in float32 when `group` (ConvRot), cast to `dtype`.

    Args: q `[out, in]` int8; scale float32 0-d or `[out, 1]`; group: ConvRot group size or None; dtype: output.
    Through comfy-kitchen's own op when it is installed (`dequantize_int8_convrot_weight_dtype` /
    `dequantize_int8_simple_dtype`, the backend ComfyUI would use), else `dequantize_int8` (the same float32 steps;
    tested bit-equal to comfy-kitchen's eager backend). Returns `[out, in]` in `dtype`.
    """
    if kitchen_op() is not None and dtype in _KITCHEN_DTYPE_CODE:
        ops = torch.ops.comfy_kitchen
        if group is not None:
            out = ops.dequantize_int8_convrot_weight_dtype(q, scale, group, _KITCHEN_DTYPE_CODE[dtype])
        else:
            out = ops.dequantize_int8_simple_dtype(q, scale, _KITCHEN_DTYPE_CODE[dtype])
        return out.to(dtype)
    return dequantize_int8(q, scale, group).to(dtype)


def dequantize_int8_linears(module: nn.Module, reason: str = "") -> int:
    """Replace every `Int8Linear` of `module` by an `nn.Linear` in its compute dtype on the same device, its weight
    `dequantize_weight_like_comfyui` (made one layer at a time, so the peak is the dequantized weights plus one
    layer's float32 copy), and put back the FeedForward GELU `fold_gelu` moved into a down projection (same state-dict
    keys as a bf16 file). Records `int8_compute_note` on `module` for the job report (`fp8.compute_report`).

    Returns the number of layers replaced. Raises ValueError naming a layer that has a fused LoRA (dequantize before
    any LoRA is fused) or whose weight is sharded over ranks (a float8 view: dequantize before sharding).
    """
    from diffusers.models.activations import GELU

    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, Int8Linear)]
    for name, m in layers:
        if m.lora_fused:
            raise ValueError(f"{name}: a LoRA is fused into this int8 layer; dequantize at load, before fusing")
        if m.weight.dtype != torch.int8:
            raise ValueError(f"{name}: the int8 weight is sharded ({m.weight.dtype} view); dequantize before "
                             f"sharding (int8_compute='dequantize' is refused with sharded weights)")
    for m in list(module.modules()):  # the GELU back in front of each int8 down projection it was folded into
        net = getattr(m, "net", None)
        if (isinstance(net, nn.ModuleList) and len(net) == 3 and isinstance(net[0], GeluProjection)
                and isinstance(net[2], Int8Linear) and net[2].input_act == "gelu_tanh"):
            proj = net[0].proj
            with torch.device("meta"):
                gelu = GELU(proj.in_features, proj.out_features, approximate="tanh", bias=proj.bias is not None)
            gelu.proj = proj
            net[0] = gelu
            net[2].input_act = None
    dtype, names = None, [name for name, _ in layers]
    del layers  # each int8 weight is freed as its layer is replaced (the peak: one layer more than the result)
    for name in names:
        m = module.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        with torch.device("meta"):
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=m.compute_dtype)
        linear.weight = nn.Parameter(dequantize_weight_like_comfyui(m.int8_weight(), m.weight_scale, m.convrot_group,
                                                                    m.compute_dtype), requires_grad=False)
        if m.bias is not None:
            linear.bias = nn.Parameter(m.bias.detach().to(m.compute_dtype), requires_grad=False)
        setattr(parent, child, linear.eval())
        dtype = m.compute_dtype
        del m
    if names:
        what = PATH_DEQUANTIZED.format(dtype=str(dtype).replace("torch.", ""))
        module.int8_compute_note = f"{what} ({len(names)} layers{'; ' + reason if reason else ''})"
    return len(names)


def apply_int8_compute(modules, mode: str, reason: str) -> int:
    """At load: `dequantize_int8_linears` on each module when `mode` is "dequantize"; with "w8a8" record "int8 W8A8
    (reason)" on each module holding int8 layers (`int8_compute_note`, read by `fp8.compute_report`). Returns the layers
    dequantized. `modules`: the transformer and its text connectors (None entries skipped)."""
    done = 0
    for module in modules:
        if module is None:
            continue
        if mode == "dequantize":
            done += dequantize_int8_linears(module, reason)
        elif any(isinstance(m, Int8Linear) for m in module.modules()):
            module.int8_compute_note = PATH_W8A8 + (f" ({reason})" if reason else "")
    return done


class GeluProjection(nn.Module):
    """A diffusers `GELU` (`proj` then tanh-GELU) whose GELU moved into the next `Int8Linear` (`fold_gelu`): returns
    `proj(x)`. Keeps the child `proj` (same state-dict keys, same LoRA targets)."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def fold_gelu(module: nn.Module) -> int:
    """ComfyUI's `linear_input_act(net[2], net[0].proj(x), "gelu_tanh")` for every diffusers `FeedForward` of
    `module` whose down projection `net[2]` is an `Int8Linear` and whose `net[0]` is a tanh-GELU: the GELU moves
    into `net[2]` (`input_act`), where comfy-kitchen's fused quantizer applies it as ComfyUI's does (on CPU and
    comfy-kitchen's eager backend the result is the same as before). Returns the number folded."""
    from diffusers.models.activations import GELU

    folded = 0
    for m in module.modules():
        net = getattr(m, "net", None)
        if (type(m).__name__ == "FeedForward" and isinstance(net, nn.ModuleList) and len(net) == 3
                and isinstance(net[0], GELU) and net[0].approximate == "tanh" and isinstance(net[2], Int8Linear)
                and net[2].input_act is None):
            net[0] = GeluProjection(net[0].proj)
            net[2].input_act = "gelu_tanh"
            folded += 1
    return folded


def swap_in_int8_linears(module: nn.Module, layers: dict[str, dict], compute_dtype: torch.dtype,
                         scale_shapes: dict[str, tuple[int, ...]]) -> int:
    """Replace each listed `nn.Linear` (module path -> its `comfy_quant` dict) by an `Int8Linear`.

    `scale_shapes`: module path -> stored `weight_scale` shape (0-d or `[out, 1]`).
    Then moves each FeedForward GELU in front of an int8 down projection into it (`fold_gelu`, as ComfyUI).
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
    fold_gelu(module)
    return len(layers)
