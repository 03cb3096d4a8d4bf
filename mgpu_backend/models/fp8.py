"""Linear layers whose weights stay resident in float8 (e4m3fn): fp8 matmuls on GPUs that have them, otherwise
computed in the compute dtype per call.

Users mostly have the fp8 checkpoints (`ltx-2-19b-dev-fp8`, `ltx-2.3-22b-dev-fp8`): every transformer-block Linear
stores `weight` as float8_e4m3fn plus a per-tensor float32 `weight_scale` (dequantized weight = weight · scale, the
"scaled fp8" convention of ComfyUI's `comfy/ops.py` and Lightricks' fp8 files; Lightricks' files also carry a
per-tensor `input_scale` for the activations). Keeping the fp8 tensor resident makes weight memory ≈ file size.

Two ways to compute `FP8Linear` (`compute_path` chooses per call and says why):
- **scaled_mm** (CUDA, compute capability ≥ 8.9 — Ada, Hopper and newer): the activations are quantized to e4m3
  and the product runs on the fp8 tensor cores through `torch._scaled_mm` with the file's e4m3 weight and its
  `weight_scale`, output in the compute dtype. Activations: by the file's `input_scale` where present (per tensor,
  clamped to ±448, as Lightricks' fp8-scaled-mm path and ComfyUI's `TensorCoreFP8Layout` do), else dynamically
  per row (`scale = amax(|x_row|) / 448`; one Triton kernel in eager, fused by the compiler under `torch.compile`).
  The fast path on those GPUs; its time against bf16, GEMM and whole forward, is in bench/results/speed_h200.txt.
  ComfyUI's kernel library `comfy-kitchen` computes its fp8 linear with the same `torch._scaled_mm` call (per-tensor
  activation scale) plus a CUDA quantize kernel of its own; it is no faster side by side (`bench/bench_speed.py
  --what gemm`), so it is not a dependency here.
- **dequantize** (CPU, GPUs before Ada, e5m2 weights, float32 compute, shapes the fp8 kernels refuse, or
  `set_compute("off")`): `x · (weight·weight_scale)ᵀ` in the compute dtype, exact to the file; the bf16 copy exists
  only for the duration of one matmul.

A LoRA fused into an fp8 layer is written into the layer's own fp8 weight and per-tensor scale, re-quantized as
ComfyUI does it (`models.requantize`, `weights.lora`), so a fused layer computes on the same path as a clean one.

Error against the bf16 forward: the dequantizing path carries the weights' e4m3 rounding alone, the fp8 matmul path
the activations' e4m3 rounding too (relative L2 errors measured in bench/results/speed_h200.txt). int8
(`int8_tensorwise` files) is computed W8A8 the way ComfyUI computes it, through comfy-kitchen's `int8_linear`
(`models.quant`, a subclass of `FP8Linear` with its own path): for equality with ComfyUI, not for speed
(bench/results/int8_h200.txt). Figures these paragraphs once held: bench/results/docstring_figures.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "weight_scale"
INPUT_SCALE_SUFFIX = "input_scale"
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value

COMPUTE_MODES = ("auto", "on", "off")
"""`set_compute`: "auto" (fp8 matmuls wherever `compute_path` allows them), "on" (the same, and `check_compute`
raises where they cannot run), "off" (always dequantize)."""
_MODE = os.environ.get("LTX2_MGPU_FP8_COMPUTE", "auto")

WEIGHT_GENERATION = [0]
"""Bumped whenever an `FP8Linear`'s weight or scale becomes another tensor object: captured CUDA graphs key on it
(`mgpu_backend.engine.cuda_graphs`), since their kernels read the tensors they were captured with. LoRA fusing and
restoring write the bytes in place (`FP8Linear.scale_written` rewrites the derived row scales in place too), so they
keep the tensors and the captured graphs valid and do not bump it."""


def set_compute(mode: str) -> None:
    """Process-wide choice of the fp8 compute path (see `COMPUTE_MODES`). Raises ValueError for another mode."""
    global _MODE
    if mode not in COMPUTE_MODES:
        raise ValueError(f"fp8 compute mode {mode!r}: choose one of {', '.join(COMPUTE_MODES)}")
    _MODE = mode


def compute_mode() -> str:
    return _MODE


_CAPABLE: dict[int, bool] = {}


def scaled_mm_capable(device: torch.device) -> bool:
    """True on CUDA devices of compute capability ≥ 8.9 (fp8 tensor cores) with `torch._scaled_mm`."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _CAPABLE[index]


def compute_path(layer: "FP8Linear", x: torch.Tensor) -> tuple[str, str]:
    """("scaled_mm" | "dequantize", why) for `layer` applied to `x` `[..., in_features]`.

    Pure selection logic (no GPU work): mode, device, dtypes and the kernels' shape rule (in and out features
    multiples of 16, cuBLASLt's fp8 alignment). A fused LoRA changes nothing here: it lives in the fp8 weight."""
    if _MODE == "off":
        return "dequantize", "fp8 compute set off"
    if not scaled_mm_capable(x.device):
        why = "CPU" if x.device.type != "cuda" else "this GPU has no fp8 matmuls (compute capability < 8.9)"
        return "dequantize", why
    if layer.weight.dtype != torch.float8_e4m3fn:
        return "dequantize", f"{layer.weight.dtype} weights (the fp8 matmul path takes e4m3fn)"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return "dequantize", f"{x.dtype} compute (the fp8 matmul path returns bf16 / fp16)"
    if layer.in_features % 16 or layer.out_features % 16:
        return "dequantize", f"{layer.in_features}→{layer.out_features} features are not multiples of 16"
    return "scaled_mm", "fp8 tensor cores (torch._scaled_mm)"


# ---- activation quantization -----------------------------------------------------------------------------------

def _quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


_TRITON_ROWS = None


def _triton_rows():
    """The eager row-quantization kernel (one read of x, one write of the codes and the scales), or None."""
    global _TRITON_ROWS
    if _TRITON_ROWS is None:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def _rows(x_ptr, q_ptr, s_ptr, k, stride, block: tl.constexpr):
                row = tl.program_id(0)
                offs = tl.arange(0, block)
                mask = offs < k
                x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
                scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
                q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
                tl.store(q_ptr + row * k + offs, q.to(tl.float8e4nv), mask=mask)
                tl.store(s_ptr + row, scale)

            @triton.jit
            def _static(x_ptr, q_ptr, s_ptr, n, block: tl.constexpr):
                offs = tl.program_id(0) * block + tl.arange(0, block)
                mask = offs < n
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                q = tl.minimum(tl.maximum(x / tl.load(s_ptr), -448.0), 448.0)
                tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=mask)

            def run(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                m, k = x2.shape
                q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
                s = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
                block = triton.next_power_of_2(k)
                _rows[(m,)](x2, q, s, k, x2.stride(0), block=block, num_warps=min(16, max(4, block // 1024)))
                return q, s

            def run_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
                x = x.contiguous()
                q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
                n = x.numel()
                _static[(triton.cdiv(n, 4096),)](x, q, scale.float(), n, block=4096, num_warps=8)
                return q

            _TRITON_ROWS = (run, run_static)
        except Exception:  # noqa: BLE001 — no Triton (or no fp8 in it): the torch expression does the same
            _TRITON_ROWS = False
    return _TRITON_ROWS or None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic e4m3 quantization of a 2-D `[M, K]` tensor: `(codes [M, K] e4m3fn, scales [M, 1] float32)`
    with `codes.float() · scales ≈ x` (`scale = max(amax_row, 1e-12) / 448`)."""
    if x.is_cuda and x.stride(-1) == 1 and not torch.compiler.is_compiling():
        kernels = _triton_rows()
        if kernels is not None:
            return kernels[0](x)
    return _quantize_rows_torch(x)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """`clamp(x / input_scale, ±448)` as e4m3 codes (a file's per-tensor activation scale); one Triton kernel in
    eager on CUDA, the torch expression otherwise (fused by the compiler)."""
    if x.is_cuda and not torch.compiler.is_compiling():
        kernels = _triton_rows()
        if kernels is not None:
            return kernels[1](x, input_scale)
    return (x.float() / input_scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None = None, scale_b_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`x · (weight·weight_scale)ᵀ + bias` on the fp8 tensor cores.

    Args:
        x: `[..., K]` bf16 / fp16 activations (the output has x's dtype).
        weight: `[N, K]` float8_e4m3fn; weight_scale: 0-d float32.
        bias: `[N]` or None.
        input_scale: 0-d float32 per-tensor activation scale (the file's), or None for dynamic per-row scales.
        scale_b_rows: `weight_scale` broadcast to `[1, N]` float32 contiguous (the row-wise kernel's layout);
            made here when None.
    Raises RuntimeError from `torch._scaled_mm` for shapes / devices it refuses (see `compute_path`).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if input_scale is not None:
        out = torch._scaled_mm(quantize_static(x2, input_scale), weight.t(), scale_a=input_scale.float(),
                               scale_b=weight_scale.float(), bias=bias, out_dtype=x.dtype)
    else:
        q, scale_a = quantize_rows(x2)
        if scale_b_rows is None:
            scale_b_rows = weight_scale.float().reshape(1, 1).expand(1, weight.shape[0]).contiguous()
        out = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b_rows, bias=bias, out_dtype=x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


class FP8Linear(nn.Module):
    """`y = x · (weight·weight_scale)ᵀ + bias` with `weight` stored in float8 (see the module docstring for the two
    compute paths).

    Attributes:
        weight: `[out_features, in_features]` float8_e4m3fn (or e5m2) parameter, frozen.
        weight_scale: 0-d float32 buffer (per-tensor scale).
        input_scale: optional 0-d float32 buffer: the file's activation scale, used by the fp8 matmul path.
        bias: `[out_features]` in the compute dtype, or None.
        compute_dtype: dtype the weight is dequantized to per call (bf16 on GPU by default).
        lora_fused: True while `mgpu_backend.weights.lora` has a LoRA fused into `weight` / `weight_scale` (re-quantized
            in place; the fuser keeps the clean bytes and puts them back on restore).
        computed: how the latest eager call computed (`ComputeRecord`: "scaled_mm" / "dequantize" and why; None
            before the first) — a module's forward returns only its tensor, so `compute_report` reads it here.
    """

    QUANT_FORMAT = "fp8"  # "int8" in the subclass `models.quant.Int8Linear`

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
        self.lora_fused = False
        self._scale_rows: torch.Tensor | None = None
        self._scale_rows_src: tuple = (None, -1)
        self.computed: ComputeRecord | None = None

    def scale_written(self) -> None:
        """After `weight_scale` was written in place (a LoRA fused or restored): the row-wise copy of it that the fp8
        matmul reads (`_scale_b_rows`) is rewritten in place as well, so that a CUDA graph captured before — which
        replays without running this module's Python — reads the new scale."""
        rows = getattr(self, "_scale_rows", None)  # (`quant.Int8Linear` reads `weight_scale` itself: none)
        if rows is not None and self._scale_rows_src[0] is self.weight_scale:
            rows.copy_(self.weight_scale.float().reshape(1, 1).expand(1, self.out_features))
            self._scale_rows_src = (self.weight_scale, self.weight_scale._version)

    def dequantized_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The weight in `compute_dtype`: `weight.to(compute_dtype) · weight_scale` (`weight`: this layer's, or the
        same weight gathered whole when the layer is sharded over ranks)."""
        weight = self.weight if weight is None else weight
        return weight.to(self.compute_dtype) * self.weight_scale.to(self.compute_dtype)

    def _scale_b_rows(self) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.weight_scale.float().reshape(1, 1).expand(1, self.out_features).contiguous()
        # made once per scale tensor and version (no device round trip per call: the check is on the host)
        src = (self.weight_scale, self.weight_scale._version)
        if self._scale_rows is None or self._scale_rows_src[0] is not src[0] or self._scale_rows_src[1] != src[1]:
            self._scale_rows = self.weight_scale.float().reshape(1, 1).expand(1, self.out_features).contiguous()
            self._scale_rows_src = src
        return self._scale_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path, why = compute_path(self, x)
        if not torch.compiler.is_compiling():
            self.computed = ComputeRecord(path, why)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if path == "scaled_mm":
            input_scale = getattr(self, INPUT_SCALE_SUFFIX, None)
            return fp8_linear(x, self.weight, self.weight_scale, bias, input_scale,
                              None if input_scale is not None else self._scale_b_rows())
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={self.weight.dtype}, compute={self.compute_dtype}")


@dataclass(frozen=True)
class ComputeRecord:
    """How a quantized linear layer computed its latest eager call: path "scaled_mm" (fp8 tensor cores),
    "dequantize" (the weight dequantized to the compute dtype) or "int8" (W8A8, `models.quant.Int8Linear`); reason:
    why that path (None when there is nothing to say)."""

    path: str
    reason: str | None = None


def compute_report(module: nn.Module) -> str | None:
    """One line for a job report: how many `FP8Linear`s of `module` ran on the fp8 tensor cores in their last
    eager call and why the others did not (None when the module has no FP8Linear that ran eagerly yet); for an int8
    file, which path ran: "int8 W8A8 …" or "int8 dequantized to bf16 at load …" (`models.quant.apply_int8_compute`
    recorded it on `module` as `int8_compute_note`)."""
    note = getattr(module, "int8_compute_note", None)
    layers = [m for m in module.modules() if isinstance(m, FP8Linear) and m.computed is not None]
    int8 = [m for m in layers if m.computed.path == "int8"]  # models.quant.Int8Linear computed W8A8
    if int8:
        layers = [m for m in layers if m.computed.path != "int8"]
        line = f"int8 compute: {len(int8)} int8 layers {int8[0].computed.reason}"
        if note:  # "int8 W8A8 (why: the fleet option int8_compute)"
            line = f"int8 compute: {note}; {len(int8)} layers: {int8[0].computed.reason}"
        rest = compute_report_of(layers)
        return line if rest is None else f"{line}; {rest}"
    rest = compute_report_of(layers)
    if note and "dequantized" in note:
        return f"int8 compute: {note}" + ("" if rest is None else f"; {rest}")
    return rest


def compute_report_of(layers: list["FP8Linear"]) -> str | None:
    """`compute_report`'s line for these layers (each has run eagerly), None for none."""
    if not layers:
        return None
    fast = sum(m.computed.path == "scaled_mm" for m in layers)
    if fast == len(layers):
        return f"fp8 compute: all {fast} fp8 layers on the fp8 tensor cores (torch._scaled_mm)"
    reasons: dict[str, int] = {}
    for m in layers:
        if m.computed.path != "scaled_mm":
            reasons[m.computed.reason] = reasons.get(m.computed.reason, 0) + 1
    detail = "; ".join(f"{n} layers: {why}" for why, n in reasons.items())
    return f"fp8 compute: {fast} of {len(layers)} fp8 layers on the fp8 tensor cores, the others dequantized ({detail})"


def check_compute(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """With `set_compute("on")`: raise ValueError naming the first `FP8Linear` of `module` that cannot use the fp8
    matmul path on `device` in `dtype`, and why. A no-op in the other modes."""
    if _MODE != "on":
        return
    probe = torch.empty(0, device=device, dtype=dtype) if device.type != "cuda" else None
    for name, m in module.named_modules():
        if isinstance(m, FP8Linear) and m.QUANT_FORMAT == "fp8":  # int8 layers: models.quant's own path
            x = probe if probe is not None else torch.empty(0, device=device, dtype=dtype)
            path, why = compute_path(m, x)
            if path != "scaled_mm":
                raise ValueError(f"fp8 compute is set 'on' but layer {name!r} cannot use fp8 matmuls: {why}")


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
