"""Regenerate `lora_requant_golden.safetensors`: two LoRAs patched into fp8, int8 and bf16 Linear weights by ComfyUI
0.33 itself, for tests/test_lora_requant.py (the fleet's `weights/lora.py` + `models/requantize.py` must give the
same bytes).

Runs in-process with ComfyUI's interpreter and a ComfyUI 0.33 checkout on the path (no server):

    COMFYUI_DIR=/tmp/comfyui /tmp/comfyvenv/bin/python tests/golden/make_lora_requant_golden.py

(docs/testing.md#a-live-comfyui says how to make such a checkout and venv.) Only a few of ComfyUI's requirements are
imported on this path, so the project's own venv also does, with those few in a throwaway folder:

    pip install --no-deps --target /tmp/comfydeps comfy-kitchen==0.2.31 comfy-aimdo==0.4.13 scipy torchsde trampoline
    PYTHONPATH=/tmp/comfydeps COMFYUI_DIR=/tmp/comfyui .venv/bin/python tests/golden/make_lora_requant_golden.py

ComfyUI's model zoo imports torchvision at module level (cosmos, sam3 …), and torch 2.13's CPU wheel cannot import
the PyPI torchvision; when `import torchvision` fails, an empty stand-in module answers those imports (nothing on the
weight-patching path touches it) and the metadata says so. comfy-kitchen must be ComfyUI 0.33's pinned 0.2.31.

What it does (all on the CPU):
1. `LAYERS`: small Linear weights (seeded `torch.randn`, scaled) quantized into each layer's format by ComfyUI's
   own quantizers (`QuantizedTensor.from_float` with ComfyUI's layouts: `TensorCoreFP8E4M3Layout` /
   `TensorCoreFP8E5M2Layout`, comfy-kitchen's `TensorWiseINT8Layout` per tensor, per row and ConvRot, group 16) or
   kept in bf16, keyed by real LTX-2 state-dict keys (a text-connector layer among them). Saved as `clean/<key>` and
   `clean/<key>_scale`.
2. Two LoRAs in the LTX / ComfyUI key layout (`diffusion_model.<path>.lora_A/lora_B.weight`): `lora1` rank 7 with
   alpha 5 in bf16 on every layer (strength 0.5), `lora2` rank 3 without alpha in float32 on some layers
   (strength 1.25). Saved as `lora1/<its keys>`, `lora2/<its keys>`.
3. For each patch dtype — float32 (`lora_compute_dtype` on the CPU, ComfyUI's own choice there) and float16 (its
   choice on CUDA GPUs of compute capability ≥ 8, forced here through `comfy.model_management.LORA_COMPUTE_DTYPES`
   to get that arithmetic on the CPU) — builds the layers with `comfy.ops.mixed_precision_ops` (bf16 compute) in a
   module tree named by the keys, loads the clean state dict with its `.comfy_quant` markers, wraps it in
   `comfy.model_patcher.ModelPatcher`, adds `comfy.lora.load_lora(lora1)` at 0.5 then `load_lora(lora2)` at 1.25
   (`add_patches`, as two stacked `LoraLoaderModelOnly` nodes do) and calls `patch_weight_to_device(key, cpu)` for
   every key. Saves the resulting weight bytes and scale as `fused.<dtype>/<key>` and `fused.<dtype>/<key>_scale`.
4. `comfy.utils.string_to_seed` of `SEED_KEYS` (the layer keys and a few others, non-ASCII included): `seeds`.
5. Metadata `golden`: the layers (key, format, shape, group, per-row), the LoRAs, the keys of `seeds`, and the
   versions (ComfyUI, comfy-kitchen, torch) and whether torchvision was stood in for.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "lora_requant_golden.safetensors"

# (ComfyUI state-dict key, format, [out, in], weight magnitude); format: "fp8_e4m3" | "fp8_e5m2" | "int8" (per tensor)
# | "int8_rows" (per row) | "int8_convrot" (group 16) | "bf16"
LAYERS = [
    ("diffusion_model.transformer_blocks.0.attn1.to_q.weight", "fp8_e4m3", (48, 64), 0.05),
    ("diffusion_model.transformer_blocks.1.attn1.to_v.weight", "fp8_e4m3", (32, 32), 1e-4),  # 1/scale > fp16 max
    ("diffusion_model.transformer_blocks.0.ff.net.2.weight", "int8", (64, 128), 0.05),
    ("diffusion_model.transformer_blocks.1.attn2.to_out.0.weight", "int8_rows", (64, 32), 0.05),
    ("diffusion_model.transformer_blocks.1.audio_attn1.to_k.weight", "int8_convrot", (32, 64), 0.05),
    ("diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_v.weight", "fp8_e5m2", (32, 64),
     0.05),
    ("diffusion_model.transformer_blocks.0.attn2.to_k.weight", "bf16", (64, 48), 0.05),
]
CONVROT_GROUP = 16
LORAS = [  # name, rank, alpha (None: no alpha key), dtype, strength, layers (indices into LAYERS)
    ("lora1", 7, 5.0, "bfloat16", 0.5, list(range(len(LAYERS)))),
    ("lora2", 3, None, "float32", 1.25, [0, 2, 4, 5, 6]),
]
PATCH_DTYPES = ("float32", "float16")
SEED_KEYS = [key for key, *_ in LAYERS] + ["", "a", "diffusion_model.transformer_blocks.0.attn1.to_q",
                                          "diffusion_model.transformer_blocks.47.audio_ff.net.0.proj.weight",
                                          "diffusion_model.é_ü.weight", "模型.权重"]


class _Stand_in(types.ModuleType):
    """An empty module whose every attribute is an inert class (for imports ComfyUI's model zoo makes at import)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, name, path, target=None):
        if name == self.package or name.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stand_in(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _torchvision_or_stand_in() -> bool:
    """True when torchvision had to be stood in for."""
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:  # noqa: BLE001 — torch 2.13 CPU + PyPI torchvision: "operator torchvision::nms does not exist"
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _StandInFinder("torchvision"))
        return True


def _weights(torch):
    """Seeded float32 weights of `LAYERS` (a generator per layer, seed 100 + index)."""
    out = {}
    for i, (key, _, shape, magnitude) in enumerate(LAYERS):
        g = torch.Generator().manual_seed(100 + i)
        out[key] = torch.randn(shape, generator=g) * magnitude
    return out


def _clean_state(torch, quant_ops):
    """The clean layers as ComfyUI's quantizers make them: {key: (state-dict tensors, comfy_quant dict | None)}."""
    from comfy_kitchen.tensor import QuantizedTensor

    out = {}
    for key, fmt, _shape, _ in LAYERS:
        w = _weights(torch)[key]
        prefix = key[: -len("weight")]
        if fmt in ("fp8_e4m3", "fp8_e5m2"):
            layout = "TensorCoreFP8E4M3Layout" if fmt == "fp8_e4m3" else "TensorCoreFP8E5M2Layout"
            qt = QuantizedTensor.from_float(w, layout, scale="recalculate")
            conf = {"format": "float8_e4m3fn" if fmt == "fp8_e4m3" else "float8_e5m2"}
        elif fmt.startswith("int8"):
            convrot = fmt == "int8_convrot"
            qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", scale="recalculate", is_weight=True,
                                            per_channel=fmt != "int8", convrot=convrot,
                                            convrot_groupsize=CONVROT_GROUP)
            conf = {"format": "int8_tensorwise"}
            if convrot:
                conf.update(convrot=True, convrot_groupsize=CONVROT_GROUP)
        else:
            out[key] = ({key: w.to(torch.bfloat16)}, None)
            continue
        tensors = {prefix + "weight": qt._qdata.contiguous(), prefix + "weight_scale": qt._params.scale.contiguous()}
        out[key] = (tensors, conf)
    return out


def _lora_tensors(torch):
    """{lora name: {file key: tensor}} in the LTX / ComfyUI layout (A: N(0, 1) · 0.05, B: N(0, 1) · 0.05)."""
    out = {}
    for n, (name, rank, alpha, dtype, _strength, layers) in enumerate(LORAS):
        g = torch.Generator().manual_seed(500 + n)
        tensors = {}
        for i in layers:
            key, _, (out_f, in_f), _ = LAYERS[i]
            base = key[: -len(".weight")]
            tensors[base + ".lora_A.weight"] = (torch.randn(rank, in_f, generator=g) * 0.05).to(getattr(torch, dtype))
            tensors[base + ".lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.05).to(getattr(torch, dtype))
            if alpha is not None:
                tensors[base + ".alpha"] = torch.tensor(alpha, dtype=torch.float32)
        out[name] = tensors
    return out


def _model(torch, comfy, clean):
    """ComfyUI's quantization-aware Linears (`mixed_precision_ops`, bf16 compute) in a module tree named by the keys,
    loaded from the clean state dict with its `.comfy_quant` markers."""
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.bfloat16)
    root = torch.nn.Module()
    state = {}
    for key, _fmt, (out_f, in_f), _ in LAYERS:
        *parents, leaf = key[: -len(".weight")].split(".")
        node = root
        for seg in parents:
            if seg not in node._modules:
                node.add_module(seg, torch.nn.Module())
            node = node._modules[seg]
        node.add_module(leaf, ops.Linear(in_f, out_f, bias=False))
        tensors, conf = clean[key]
        state.update({k: v.clone() for k, v in tensors.items()})
        if conf is not None:
            state[key[: -len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")),
                                                                         dtype=torch.uint8)
    missing, unexpected = root.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("bias")]:
        raise RuntimeError(f"ComfyUI's Linears did not take the state dict: missing {missing}, unexpected {unexpected}")
    return root


def _stored(torch, weight):
    """(weight bytes as stored, scale or None) of a ComfyUI weight (a QuantizedTensor or a plain tensor)."""
    from comfy_kitchen.tensor import QuantizedTensor

    if isinstance(weight, QuantizedTensor):
        return weight._qdata.detach().contiguous().clone(), weight._params.scale.detach().float().contiguous().clone()
    return weight.detach().contiguous().clone(), None


def main() -> int:
    comfy_dir = Path(os.environ.get("COMFYUI_DIR", "/tmp/comfyui"))
    sys.path.insert(0, str(comfy_dir))
    sys.argv = [sys.argv[0], "--cpu"]
    stood_in = _torchvision_or_stand_in()
    import torch
    from safetensors.torch import save_file

    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    import comfy.quant_ops
    import comfy.utils
    import comfy_kitchen
    import comfyui_version

    kitchen = getattr(comfy_kitchen, "__version__", None)
    if kitchen is None:
        from importlib.metadata import version

        kitchen = version("comfy-kitchen")
    cpu = torch.device("cpu")
    clean = _clean_state(torch, comfy.quant_ops)
    loras = _lora_tensors(torch)
    out: dict[str, torch.Tensor] = {}
    for key, (tensors, _) in clean.items():
        w = tensors.get(key[: -len("weight")] + "weight")
        out[f"clean/{key}"] = w.contiguous()
        scale = tensors.get(key[: -len("weight")] + "weight_scale")
        if scale is not None:
            out[f"clean/{key}_scale"] = scale.contiguous()
    for name, tensors in loras.items():
        out.update({f"{name}/{k}": v.contiguous() for k, v in tensors.items()})
    to_load = {key[: -len(".weight")]: key for key, *_ in LAYERS}
    for dtype_name in PATCH_DTYPES:
        comfy.model_management.LORA_COMPUTE_DTYPES[cpu] = getattr(torch, dtype_name)
        assert comfy.model_management.lora_compute_dtype(cpu) == getattr(torch, dtype_name)
        model = _model(torch, comfy, clean)
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
        for name, _rank, _alpha, _dtype, strength, _layers in LORAS:
            patches = comfy.lora.load_lora(loras[name], to_load)
            added = patcher.add_patches(patches, strength, 1.0)
            assert len(added) == len(patches), (name, added)
        with torch.no_grad():
            for key, *_ in LAYERS:
                patcher.patch_weight_to_device(key, device_to=cpu)
        for key, *_ in LAYERS:
            weight, scale = _stored(torch, comfy.utils.get_attr(model, key))
            out[f"fused.{dtype_name}/{key}"] = weight
            if scale is not None:
                out[f"fused.{dtype_name}/{key}_scale"] = scale
    out["seeds"] = torch.tensor([comfy.utils.string_to_seed(k) for k in SEED_KEYS], dtype=torch.int64)
    meta = {
        "layers": [{"key": k, "format": f, "shape": list(s), "convrot_group": CONVROT_GROUP if f == "int8_convrot"
                    else None, "per_row": f in ("int8_rows", "int8_convrot")} for k, f, s, _ in LAYERS],
        "loras": [{"name": n, "rank": r, "alpha": a, "dtype": d, "strength": s, "layers": [LAYERS[i][0] for i in ls]}
                  for n, r, a, d, s, ls in LORAS],
        "patch_dtypes": list(PATCH_DTYPES), "seed_keys": SEED_KEYS,
        "versions": {"comfyui": comfyui_version.__version__, "comfy_kitchen": kitchen, "torch": torch.__version__},
        "torchvision_stood_in": stood_in,
    }
    save_file({k: v.contiguous() for k, v in out.items()}, str(OUT), metadata={"golden": json.dumps(meta)})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {len(out)} tensors; {meta['versions']}, "
          f"torchvision stood in: {stood_in}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
