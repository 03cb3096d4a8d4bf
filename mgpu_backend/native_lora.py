"""The native MODEL's LoRAs on the fleet: a `ForwardRequest.lora` (ComfyUI's plain-LoRA patches of the sampling
MODEL, shipped once per `patches_uuid`) fused into the resident transformer with the pack's LoRA machinery
(`lora.LoRAFuser`: every rank bit-identical, exact restore).

The fleet uses the pipeline's own fuser (`state.pipeline.lora`), so there is one fused set per fleet: the SP Sampler's
stage jobs fuse theirs and restore after the stage; a forward with another LoRA set (or none) restores first — a
LoRA never leaks into a plain run (NATIVE-MODEL.md).

ComfyUI's patch `W += strength · (alpha / rank) · up @ down` (`LoRAAdapter.calculate_weight`, several patches of one
weight applied in order) becomes one in-memory `LoRAFile` per patch position (the i-th patch of every layer), with
strength 1 and alpha = strength · alpha: LoRAFuser's scale `strength · alpha / rank` is then ComfyUI's; the deltas
are summed in float32 and rounded once to the weight's dtype.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch

from .forward import ForwardMiss, LoraSet
from .lora import LoRAFile, LoRAPair, LoRAReport
from .models import keymaps

HELD_SETS = 4  # LoRA sets kept (their A / B tensors) per fleet, most recent first


class MemoryLoRA(LoRAFile):
    """A LoRAFile whose pairs are tensors in memory (`tensors`: module -> (A [r, in], B [out, r]))."""

    def __init__(self, name: str, index: dict[str, LoRAPair], tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 identity: tuple):
        super().__init__(Path(name), 1.0, index, [], identity)
        self.tensors = tensors

    @contextlib.contextmanager
    def reader(self) -> Iterator:
        def get(name: str):
            a, b = self.tensors[name]
            return a, b, self.index[name].alpha
        yield get


def lora_files(lora: LoraSet) -> list[MemoryLoRA]:
    """The set's patches -> MemoryLoRAs in ComfyUI's order (module docstring). Module paths: the original LTX /
    ComfyUI names mapped to the resident (diffusers) transformer's."""
    layers: list[dict] = []
    for patch in lora.patches:
        name = keymaps.transformer_to_diffusers(patch.module)
        slot = next((d for d in layers if name not in d), None)
        if slot is None:
            slot = {}
            layers.append(slot)
        slot[name] = patch
    out = []
    for i, slot in enumerate(layers):
        index, tensors = {}, {}
        for name, p in slot.items():
            rank = p.down.shape[0]
            alpha = float(p.strength) * (float(rank) if p.alpha is None else float(p.alpha))
            index[name] = LoRAPair(f"{name}.lora_A", f"{name}.lora_B", tuple(p.down.shape), tuple(p.up.shape), alpha)
            tensors[name] = (p.down, p.up)
        out.append(MemoryLoRA(f"ComfyUI LoRA {lora.key} #{i}", index, tensors, ("comfyui", lora.key, i)))
    return out


class NativeLoRAs:
    """The LoRA sets this fleet holds for the native MODEL (by key) and their application."""

    def __init__(self):
        self.held: OrderedDict[str, list[MemoryLoRA]] = OrderedDict()
        self.last_reports: list[LoRAReport] = []

    def apply(self, fuser, lora: LoraSet | None) -> ForwardMiss | None:
        """Make `lora` the fused set (None: the clean weights). Returns a ForwardMiss when the set is referred to by
        key only and this fleet does not hold it (nothing touched). Every rank calls it with the same request."""
        if lora is None:
            fuser.restore()
            self.last_reports = []
            return None
        if lora.patches is not None:
            self.held[lora.key] = lora_files(lora)
        files = self.held.get(lora.key)
        if files is None:
            return ForwardMiss(lora_key=lora.key)
        self.held.move_to_end(lora.key)
        while len(self.held) > HELD_SETS:
            self.held.popitem(last=False)
        self.last_reports = fuser.apply(files, stage="native MODEL")
        return None

    def report(self) -> str:
        """'LoRA k/n layers' over the fused set (empty without one)."""
        if not self.last_reports:
            return ""
        matched = sum(r.matched for r in self.last_reports)
        total = sum(r.total for r in self.last_reports)
        return f"LoRA {matched}/{total} layer patches applied"


def apply_request_lora(state, request) -> ForwardMiss | None:
    """The forward job's LoRA step: fuse (or restore) on the rank's resident transformer before the forward."""
    held = getattr(state, "native_loras", None)
    if held is None:
        held = state.native_loras = NativeLoRAs()
    return held.apply(state.pipeline.lora, request.lora)
