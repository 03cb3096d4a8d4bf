"""What a sampling MODEL patcher holds that the fleet must honour (LoRAs) or that must be refused by name.

Importable without ComfyUI (duck-typed on the patcher's attributes), so that the rules are tested on stand-ins.

A native MODEL from Load Diffusion Model (MGPU) has no weights in ComfyUI: its transformer runs on the fleet. So:
- **plain LoRAs** (`LoraLoaderModelOnly` / `LoraLoader`: `ModelPatcher.add_patches` with ComfyUI's `LoRAAdapter`,
  weights `(up [out, r], down [r, in], alpha | None, None, None, None)`) are read from the patcher at each forward
  (`patches_uuid` says when they changed) and applied on the fleet: `W + strength · (alpha / r) · up @ down`, several
  patches of one weight summed in their order — ComfyUI's `LoRAAdapter.calculate_weight` formula;
- everything that needs real weights or a callable inside the transformer is refused with its name: block /
  attention replacements and patches (`patches_replace`, `patches`, `optimized_attention_override` in
  `transformer_options`), object patches inside the transformer (`diffusion_model.*`; the wrapper's own, e.g.
  ModelSamplingLTXV's `model_sampling`, apply in ComfyUI as usual), weight wrappers, hook-scheduled patches
  (`hook_patches`), ComfyUI core's MultiGPU CFG Split (`refuse_core_multigpu`), model merges (`ModelMergeSimple`
  and friends add another model's weights as patches), LoRA variants other than plain LoRA (LoCon mid weights,
  DoRA, LoHa, LoKr, …), `strength_model` != 1, offsets and patch functions, and ControlNet (a `control` argument).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .native_types import UnsupportedInput

UNET_PREFIX = "diffusion_model."

# transformer_options keys that would need a callable inside the fleet's transformer
REFUSED_OPTIONS = {
    "patches_replace": "block / attention replacements (patches_replace: e.g. SkipLayerGuidanceDiT, attention-patch "
                       "nodes)",
    "patches": "attention / block patches (patches: e.g. attn1/attn2 patch nodes)",
    "optimized_attention_override": "an attention override (e.g. a SageAttention patch node)",
}


@dataclass(frozen=True)
class LoRATerm:
    """One plain-LoRA patch of one weight, as ComfyUI applies it: `W += strength · (alpha / rank) · up @ down`.

    key: ComfyUI's state-dict key without the model prefix (`transformer_blocks.0.attn1.to_q.weight`).
    up: `[out, rank]`; down: `[rank, in]` (the file's lora_B / lora_A). alpha: None means alpha = rank (scale 1).
    strength: the loader's strength (`strength_patch`)."""

    key: str
    up: torch.Tensor
    down: torch.Tensor
    alpha: float | None
    strength: float

    @property
    def scale(self) -> float:
        """strength · alpha / rank (ComfyUI: `alpha = v[2] / mat2.shape[0]`, 1.0 without alpha)."""
        rank = self.down.shape[0]
        return self.strength * (1.0 if self.alpha is None else float(self.alpha) / rank)


def _describe_adapter(adapter: Any) -> str:
    name = getattr(adapter, "name", None)
    if name:
        return f"LoRA type {name!r}"
    if isinstance(adapter, (tuple, list)) and adapter and isinstance(adapter[0], str):
        return f"a {adapter[0]!r} weight patch (a model merge or a model-add node)"
    if isinstance(adapter, (tuple, list)):
        return "another model's weights (a model merge: ModelMergeSimple / ModelMergeBlocks / ModelAdd …)"
    return f"a weight patch of type {type(adapter).__name__}"


def lora_terms(patches: dict) -> list[LoRATerm]:
    """`ModelPatcher.patches` -> plain LoRA terms in ComfyUI's order (keys sorted, patches of a key in order).

    Raises UnsupportedInput naming the first patch the fleet cannot apply (see the module docstring)."""
    terms = []
    for full_key in sorted(patches):
        key = full_key if isinstance(full_key, str) else full_key[0]
        if not isinstance(full_key, str):
            raise UnsupportedInput(f"a weight patch with an offset on {key} (not a plain LoRA) cannot be applied on "
                                   f"the fleet")
        if not key.startswith(UNET_PREFIX):
            raise UnsupportedInput(f"a weight patch on {key!r} (outside the diffusion model) cannot be applied on "
                                   f"the fleet")
        for entry in patches[full_key]:
            strength_patch, adapter, strength_model = entry[0], entry[1], entry[2]
            offset = entry[3] if len(entry) > 3 else None
            function = entry[4] if len(entry) > 4 else None
            if getattr(adapter, "name", None) != "lora":
                raise UnsupportedInput(f"{_describe_adapter(adapter)} on {key}: only plain LoRAs "
                                       f"(LoraLoaderModelOnly / LoraLoader) apply to the MGPU model")
            weights = adapter.weights
            up, down, alpha = weights[0], weights[1], weights[2]
            extra = [n for n, v in zip(("LoCon mid weight", "DoRA scale", "reshape"), weights[3:6]) if v is not None]
            if extra:
                raise UnsupportedInput(f"a LoRA with a {extra[0]} on {key}: only plain LoRAs apply to the MGPU model")
            if float(strength_model) != 1.0 or offset is not None or function is not None:
                raise UnsupportedInput(f"a weight patch on {key} with strength_model={strength_model}, offset "
                                       f"{offset}, function {function}: only plain LoRAs apply to the MGPU model")
            if up.ndim != 2 or down.ndim != 2:
                raise UnsupportedInput(f"a LoRA on {key} with up {tuple(up.shape)} / down {tuple(down.shape)}: "
                                       f"only Linear (2-D) LoRAs apply to the MGPU model")
            alpha_value = None if alpha is None else float(alpha.item() if torch.is_tensor(alpha) else alpha)
            terms.append(LoRATerm(key[len(UNET_PREFIX):], up, down, alpha_value, float(strength_patch)))
    return terms


def refuse_patcher_features(patcher: Any) -> None:
    """Raise UnsupportedInput naming what the sampling patcher holds that the fleet cannot honour (everything but
    plain LoRAs, wrappers and callbacks, which run locally)."""
    if patcher is None:
        return
    inside = sorted(k for k in (getattr(patcher, "object_patches", None) or {}) if k.startswith(UNET_PREFIX))
    if inside:  # object patches of the wrapper (ModelSamplingLTXV's model_sampling) apply in ComfyUI as usual
        raise UnsupportedInput(f"object patches inside the transformer ({', '.join(inside)}) replace parts of it "
                               f"in ComfyUI's process, but the MGPU model's transformer runs on the fleet")
    if getattr(patcher, "weight_wrapper_patches", None):
        raise UnsupportedInput(f"weight wrappers ({', '.join(sorted(patcher.weight_wrapper_patches))}) need the "
                               f"weights in ComfyUI's process; the MGPU model's weights are on the fleet")
    if getattr(patcher, "hook_patches", None):
        raise UnsupportedInput("hook-scheduled weight patches (Create Hook LoRA / hook keyframes) are not supported "
                               "by the MGPU model; use LoraLoaderModelOnly")
    model_options = getattr(patcher, "model_options", None) or {}
    refuse_core_multigpu(patcher, model_options)
    refuse_transformer_options(model_options.get("transformer_options", {}))


# ComfyUI core's "MultiGPU CFG Split" (comfy_extras/nodes_multigpu.py, ComfyUI >= 0.33)
CORE_CFG_SPLIT = "MultiGPU_WorkUnits"
CFG_SPLIT_REFUSAL = (
    "ComfyUI's MultiGPU CFG Split (MultiGPU_WorkUnits) cannot be used with the MGPU model: it would clone the model "
    "onto other GPUs to run cond and uncond there, but the MGPU model's transformer already runs on the fleet, which "
    "splits the guidance passes (cond / uncond / STG / modality) of every step over its GPUs and the tokens of each "
    "pass (sequence parallel). Remove the node; to use more GPUs, give the MGPU loader more devices")


def refuse_core_multigpu(patcher: Any, model_options: dict | None = None, upstream_classes=()) -> None:
    """Raise UnsupportedInput (CFG_SPLIT_REFUSAL) when ComfyUI core's MultiGPU CFG Split was applied to the model.

    What core sets (ComfyUI 0.33, `comfy.multigpu.create_multigpu_deepclones`), any one of which is enough:
    additional models under the key "multigpu" on the patcher (one clone per extra device), those clones flagged
    `is_multigpu_base_clone`, `model_options["multigpu_options"]`, and on the guider's per-run copy of the options
    `model_options["multigpu_clones"]`. On a host with one device core sets none of them (the node only clones the
    patcher), so `upstream_classes` — the class types on the running prompt's model links into the sampler — names
    the node there."""
    model_options = model_options if model_options is not None else (getattr(patcher, "model_options", None) or {})
    extra = getattr(patcher, "get_additional_models_with_key", None)
    marked = (bool(extra("multigpu")) if callable(extra) else False) \
        or bool(getattr(patcher, "is_multigpu_base_clone", False)) \
        or bool(model_options.get("multigpu_options")) or bool(model_options.get("multigpu_clones"))
    if marked or CORE_CFG_SPLIT in upstream_classes:
        raise UnsupportedInput(CFG_SPLIT_REFUSAL)


def _holds_something(value) -> bool:
    """False for None / False and for containers holding only empty containers (`{"dit": {}}`: nothing set)."""
    if isinstance(value, dict):
        return any(_holds_something(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) > 0
    return value is not None and value is not False


def refuse_transformer_options(options: dict) -> None:
    """Raise UnsupportedInput for a transformer option that needs a callable inside the fleet's transformer."""
    for key, what in REFUSED_OPTIONS.items():
        value = options.get(key)
        if _holds_something(value):
            names = (", ".join(str(k) for k, v in value.items() if _holds_something(v)) if isinstance(value, dict)
                     else type(value).__name__)
            raise UnsupportedInput(f"{what} [{key}: {names}] cannot run on the fleet: the MGPU model's transformer "
                                   f"is in other processes")
