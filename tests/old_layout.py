"""The module layout before issue 34 moved `mgpu_backend/` into one package per layer, for the snapshot scripts
(`forward_snapshot.py`, `stage_snapshot.py`, `loop_snapshot.py`) run on a tree extracted from an older commit: they
import the new names, and on an old tree `install()` makes each new name an alias of the module it was.
Stdlib only; a tree that has the new layout is left alone.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from pathlib import Path

# new module (under mgpu_backend) -> the module it was before the move
NEW_TO_OLD = {
    "protocol.native_forward": "forward",
    "protocol.stage_params": "stage_params",
    "protocol.validation": "validation",
    "protocol.frames": "frames",
    "protocol.resources": "resources",
    "models.neighborhood": "ops.neighborhood",
    "weights.sharding": "parallel.sharding",
    "weights.lora": "lora",
    "engine.tokens": "tokens",
    "engine.semantics": "semantics",
    "engine.attention": "attention",
    "engine.forward": "model_forward",
    "engine.cuda_graphs": "cuda_graphs",
    "engine.compile": "compile",
    "engine.sampling": "sampling",
    "engine.denoiser": "denoiser",
    "engine.latents": "latents",
    "engine.flops": "parallel.flops",
    "splits.cost": "parallel.cost",
    "splits.decode": "parallel.decode",
    "splits.degrees": "parallel.degrees",
    "splits.exchange": "parallel.exchange",
    "splits.forward_plan": "parallel.forward_plan",
    "splits.passes": "parallel.passes",
    "splits.plan": "parallel.plan",
    "splits.sequence": "parallel.sequence",
    "splits.tiled": "parallel.tiled",
    "splits.tiling": "parallel.tiling",
    "stages.stage": "stage",
    "stages.pipelines": "pipelines",
    "stages.comfy_stage": "comfy_stage",
    "stages.native": "native",
    "stages.media": "media",
    "stages.text_encoder": "parallel.gemma",
    "serving.controller": "controller",
    "serving.fleet": "fleet",
    "serving.worker": "worker",
    "serving.client": "client",
    "serving.cli": "cli",
    "serving.jobs": "jobs",
    "serving.jobs.diagnostics": "jobs.diagnostics",
    "serving.jobs.forward": "jobs.forward",
    "serving.jobs.generate": "jobs.generate",
    "serving.jobs.stages": "jobs.stages",
    "serving.jobs.text": "jobs.text",
    "testing.tiny": "models.tiny",
    "testing.tiny_fill": "models.tiny_fill",
    "testing.tiny_gemma": "models.tiny_gemma",
    "testing.tiny_gemma4": "models.tiny_gemma4",
    "testing.tiny_vae25": "models.tiny_vae25",
}
NEW_PACKAGES = ('engine', 'splits', 'weights', 'stages', 'serving', 'testing')


def _old_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "mgpu_backend" or len(parts) < 2:
        return None
    rest = ".".join(parts[1:])
    for new in sorted(NEW_TO_OLD, key=len, reverse=True):
        if rest == new or rest.startswith(new + "."):
            return "mgpu_backend." + NEW_TO_OLD[new] + rest[len(new):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "mgpu_backend" and parts[1] in NEW_PACKAGES and name not in {
                "mgpu_backend." + k for k in NEW_TO_OLD}:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        if _old_name(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=False)

    def create_module(self, spec):
        old = _old_name(spec.name)
        if old is None:  # a new layer package: an empty namespace its aliases are set on
            module = types.ModuleType(spec.name)
            module.__path__ = []
            return module
        return importlib.import_module(old)

    def exec_module(self, module):
        pass


def install(root: Path) -> None:
    """On a tree without the layer packages (`root/mgpu_backend/engine` absent), alias the new names to the old."""
    if (Path(root) / "mgpu_backend" / "engine").is_dir():
        return
    sys.meta_path.insert(0, _Alias())
