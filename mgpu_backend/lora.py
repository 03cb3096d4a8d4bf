"""LoRA files in the LTX / ComfyUI key naming, fused into the transformer and exactly restored.

File layout (Lightricks' distilled LoRA, ComfyUI's LoRA loader): for a Linear at original path `P`
(`transformer_blocks.0.attn1.to_q`, …) the keys `diffusion_model.P.lora_A.weight` `[rank, in]`,
`diffusion_model.P.lora_B.weight` `[out, rank]` and optionally `diffusion_model.P.alpha` (scalar). The fused weight
is `W + strength · (alpha / rank) · B @ A` (alpha defaults to rank; the PEFT / kohya convention ComfyUI follows in
`comfy/lora.py`).

Fusing keeps the original tensor of each touched layer so that `restore()` puts back the very same bits: stage 1
after a stage-2 LoRA equals stage 1 with no LoRA. For fp8-resident layers the fused weight is held in the compute
dtype beside the untouched fp8 weight (`FP8Linear.fused_weight`) and dropped on restore.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .models import keymaps
from .models.fp8 import FP8Linear

_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "transformer.")


@dataclass
class LoRAFile:
    """The low-rank pairs of one LoRA file, keyed by the transformer's (diffusers) module path."""

    path: Path
    strength: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module -> (A [r,in], B [out,r], alpha)
    unmatched_keys: list[str] = field(default_factory=list)  # file keys that are not LoRA pairs we understand


@dataclass
class LoRAReport:
    """Coverage of one fused LoRA: how many of its layers found a Linear in the model."""

    path: str
    strength: float
    matched: int
    total: int

    def __str__(self) -> str:
        return f"{Path(self.path).name} @ {self.strength:g}: {self.matched}/{self.total} layers applied"


def parse_lora_arg(arg: str) -> tuple[str, float]:
    """`PATH[:STRENGTH]` -> (path, strength); strength defaults to 1.0. Raises ValueError for a bad strength."""
    path, sep, strength = arg.rpartition(":")
    if not sep or "/" in strength or "\\" in strength or not strength:  # no strength; ':' of a Windows drive
        return arg, 1.0
    try:
        value = float(strength)
    except ValueError:
        raise ValueError(f"LoRA argument {arg!r}: strength {strength!r} is not a number (use PATH:STRENGTH)") from None
    if not math.isfinite(value):  # nan / inf would fuse non-finite weights
        raise ValueError(f"LoRA argument {arg!r}: strength {strength!r} must be a finite number")
    return path, value


def read_lora(path: str | Path, strength: float = 1.0) -> LoRAFile:
    """Read a LoRA file into (A, B, alpha) per transformer module path.

    Raises FileNotFoundError for a missing file and ValueError naming the file when it holds no LoRA pairs.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    pairs, unmatched = {}, []
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            if not key.endswith((".lora_B.weight", ".alpha")):
                unmatched.append(key)
            continue
        base = key[: -len(".lora_A.weight")]
        b_key = base + ".lora_B.weight"
        if b_key not in tensors:
            raise ValueError(f"{path}: {key} has no matching {b_key}")
        module = base
        for prefix in _PREFIXES:
            if module.startswith(prefix):
                module = module[len(prefix):]
                break
        a, b = tensors[key], tensors[b_key]
        alpha = float(tensors[base + ".alpha"]) if base + ".alpha" in tensors else float(a.shape[0])
        pairs[keymaps.transformer_to_diffusers(module)] = (a, b, alpha)
    if not pairs:
        raise ValueError(f"{path}: no LoRA pairs found (expected keys like "
                         f"'diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight')")
    return LoRAFile(path, strength, pairs, unmatched)


class LoRAFuser:
    """Fuses LoRAs into a transformer's Linear weights and restores the originals exactly.

    Usage: `fuser = LoRAFuser(transformer); reports = fuser.fuse([lora, ...]); ...; fuser.restore()`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._backup: dict[str, torch.Tensor] = {}  # module path -> original weight (plain Linear only)
        self._fp8_fused: list[FP8Linear] = []

    @property
    def active(self) -> bool:
        return bool(self._backup or self._fp8_fused)

    def fuse(self, loras: list[LoRAFile]) -> list[LoRAReport]:
        """Add every LoRA's delta to the matching Linears. Restores first if something is fused.

        Raises ValueError (before touching any weight) for a LoRA that matches no layer, or whose shapes do not
        fit the model (a LoRA for another model width), naming the file, the key and both shapes.
        """
        self.restore()
        modules = dict(self.model.named_modules())
        reports, plan = [], []
        for lora in loras:
            matched = 0
            for name, (a, b, alpha) in lora.pairs.items():
                layer = modules.get(name)
                if not isinstance(layer, (nn.Linear, FP8Linear)):
                    continue
                if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features or b.shape[1] != a.shape[0]:
                    raise ValueError(
                        f"{lora.path}: LoRA for {name} has A {tuple(a.shape)}, B {tuple(b.shape)} but the layer is "
                        f"{layer.in_features} -> {layer.out_features}; was it made for another model?")
                plan.append((name, layer, a, b, lora.strength * alpha / a.shape[0]))
                matched += 1
            if matched == 0:
                raise ValueError(f"{lora.path}: none of its {len(lora.pairs)} LoRA layers matches a Linear of this "
                                 f"transformer (e.g. {next(iter(lora.pairs))})")
            reports.append(LoRAReport(str(lora.path), lora.strength, matched, len(lora.pairs)))
        deltas: dict[str, tuple[nn.Module, torch.Tensor]] = {}
        for name, layer, a, b, scale in plan:
            device = layer.weight.device
            delta = scale * (b.to(device, torch.float32) @ a.to(device, torch.float32))
            prev = deltas.get(name)
            deltas[name] = (layer, delta if prev is None else prev[1] + delta)
        with torch.no_grad():
            for name, (layer, delta) in deltas.items():
                if isinstance(layer, FP8Linear):
                    layer.fused_weight = (layer.dequantized_weight().float() + delta).to(layer.compute_dtype)
                    self._fp8_fused.append(layer)
                else:
                    self._backup[name] = layer.weight.detach().clone()
                    layer.weight.copy_((layer.weight.float() + delta).to(layer.weight.dtype))
        return reports

    def restore(self) -> None:
        """Put back the exact original weights of every fused layer."""
        if not self.active:
            return
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for name, weight in self._backup.items():
                modules[name].weight.copy_(weight)
        for layer in self._fp8_fused:
            layer.fused_weight = None
        self._backup.clear()
        self._fp8_fused.clear()
