"""LoRAs on quantized weights as ComfyUI applies them (`models/requantize.py`, `weights/lora.py`), against goldens
made by ComfyUI 0.33 itself with comfy-kitchen 0.2.31 (`tests/golden/make_lora_requant_golden.py`: its
`ModelPatcher.patch_weight_to_device` on its own quantization-aware Linears, CPU).

What is asserted, bit for bit (`torch.equal` on the bytes) unless said otherwise:
- `string_to_seed` equals ComfyUI's `comfy.utils.string_to_seed` on every golden key (ASCII and not);
- `keymaps.comfyui_weight_key` gives ComfyUI's state-dict key of each golden layer from its diffusers module path
  (the text connector's included);
- two stacked LoRAs (rank 7 with alpha 5 in bf16 at 0.5, rank 3 without alpha in float32 at 1.25) fused by
  `LoRAFuser` into fp8 e4m3 / e5m2, int8 per tensor / per row / ConvRot and bf16 layers give ComfyUI's weight bytes
  and recalculated scales, for both of ComfyUI's patch dtypes (float32: its CPU choice; float16: its choice on recent
  GPUs, arithmetic reproduced on the CPU), through comfy-kitchen's quantizers and through the torch steps;
- restore gives the clean bytes back, and no full-precision copy is held (`fuse_stats.fused_bytes` 0, the layers'
  tensors are the same objects);
- comfy-kitchen's quantizers and the torch steps agree on random weights (float32 / float16 / bf16 inputs);
- stochastic rounding to fp8 keeps representable values and lands on one of the two neighbours otherwise (the
  neighbours from torch's own fp8 casts).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mgpu_backend.models import keymaps
from mgpu_backend.models import requantize as R
from mgpu_backend.models.fp8 import FP8Linear
from mgpu_backend.models.quant import Int8Linear, kitchen_op
from mgpu_backend.weights.lora import LoRAFuser, read_lora

GOLDEN = Path(__file__).resolve().parent / "golden" / "lora_requant_golden.safetensors"
KITCHEN = kitchen_op() is not None
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def golden():
    with safe_open(str(GOLDEN), "pt") as f:
        meta = json.loads(f.metadata()["golden"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, tensors


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _module_path(key: str) -> str:
    """The fleet's module path of a ComfyUI state-dict key (the inverse of `comfyui_weight_key`, written out here)."""
    path = key.removeprefix("diffusion_model.").removesuffix(".weight")
    if path.startswith("video_embeddings_connector."):
        return path.replace("video_embeddings_connector.transformer_1d_blocks.", "video_connector.transformer_blocks.")
    return path


def _model(meta, tensors) -> nn.Module:
    """The golden layers as the fleet's layers (FP8Linear / Int8Linear / bf16 nn.Linear) with their clean bytes, in a
    module tree named by their module paths."""
    root = nn.Module()
    for layer in meta["layers"]:
        key, fmt, (out_f, in_f) = layer["key"], layer["format"], layer["shape"]
        clean = tensors[f"clean/{key}"]
        if fmt in FP8:
            m = FP8Linear(in_f, out_f, False, torch.bfloat16, FP8[fmt])
        elif fmt.startswith("int8"):
            m = Int8Linear(in_f, out_f, False, torch.bfloat16, layer["convrot_group"], per_row_scale=layer["per_row"])
        else:
            m = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
        m.weight = nn.Parameter(clean.clone(), requires_grad=False)
        if f"clean/{key}_scale" in tensors:
            m.weight_scale.copy_(tensors[f"clean/{key}_scale"].reshape(m.weight_scale.shape))
        *parents, leaf = _module_path(key).split(".")
        node = root
        for seg in parents:
            if seg not in node._modules:
                node.add_module(seg, nn.Module())
            node = node._modules[seg]
        node.add_module(leaf, m)
    return root


def _lora_files(meta, tensors, folder: Path) -> list:
    """The golden LoRAs as files the fleet reads (keys named by the module paths), with their strengths."""
    out = []
    for lora in meta["loras"]:
        name = lora["name"]
        state = {}
        for k, v in tensors.items():
            if k.startswith(name + "/"):
                file_key = k[len(name) + 1:]
                base, _, suffix = file_key.partition(".lora_") if ".lora_" in file_key else \
                    (file_key.removesuffix(".alpha"), "", "alpha")
                layer = _module_path(base + ".weight")
                state[f"diffusion_model.{layer}." + ("lora_" + suffix if suffix != "alpha" else "alpha")] = v
        path = folder / f"{name}.safetensors"
        save_file(state, str(path))
        out.append(read_lora(path, lora["strength"]))
    return out


def test_string_to_seed_is_comfyuis(golden):
    meta, tensors = golden
    want = tensors["seeds"].tolist()
    got = [R.string_to_seed(k) for k in meta["seed_keys"]]
    assert got == want
    assert any(not k.isascii() for k in meta["seed_keys"])  # the per-character path is covered too
    with pytest.raises(TypeError, match="must be a str"):
        R.string_to_seed(b"diffusion_model")


def test_comfyui_weight_key_of_each_layer(golden):
    meta, _ = golden
    for layer in meta["layers"]:
        assert keymaps.comfyui_weight_key(_module_path(layer["key"])) == layer["key"]
    assert keymaps.comfyui_weight_key("transformer_blocks.3.attn1.norm_q") == \
        "diffusion_model.transformer_blocks.3.attn1.q_norm.weight"  # a renamed segment goes back to ComfyUI's name


@pytest.mark.parametrize("use_kitchen", [pytest.param(True, marks=pytest.mark.skipif(
    not KITCHEN, reason="comfy-kitchen is not installed")), False], ids=["kitchen", "torch"])
@pytest.mark.parametrize("patch_dtype", ["float32", "float16"])
def test_fused_bytes_equal_comfyuis(golden, tmp_path, patch_dtype, use_kitchen):
    meta, tensors = golden
    model = _model(meta, tensors)
    layers = {layer["key"]: model.get_submodule(_module_path(layer["key"])) for layer in meta["layers"]}
    objects = {k: (m.weight, getattr(m, "weight_scale", None)) for k, m in layers.items()}
    fuser = LoRAFuser(model, patch_dtype=getattr(torch, patch_dtype), use_kitchen=use_kitchen)
    reports = fuser.fuse(_lora_files(meta, tensors, tmp_path))
    assert [(r.matched, r.total) for r in reports] == [(7, 7), (5, 5)]
    bad = []
    for key, m in layers.items():
        if not _same(m.weight, tensors[f"fused.{patch_dtype}/{key}"]):
            bad.append(key)
        if f"fused.{patch_dtype}/{key}_scale" in tensors and not _same(
                m.weight_scale, tensors[f"fused.{patch_dtype}/{key}_scale"].reshape(m.weight_scale.shape)):
            bad.append(key + " (scale)")
        assert m.weight is objects[key][0] and getattr(m, "weight_scale", None) is objects[key][1]  # in place
        if isinstance(m, FP8Linear):
            assert m.lora_fused
    assert not bad, f"differs from ComfyUI 0.33 ({patch_dtype}, kitchen={use_kitchen}): {bad}"
    assert fuser.fuse_stats.fused_bytes == 0
    clean_total = sum(tensors[k].numel() * tensors[k].element_size() for k in tensors if k.startswith("clean/"))
    assert fuser.clean_bytes == clean_total  # one process keeps every touched layer's clean bytes, scales included
    fuser.restore()
    for key, m in layers.items():
        assert _same(m.weight, tensors[f"clean/{key}"]), key
        if f"clean/{key}_scale" in tensors:
            assert _same(m.weight_scale, tensors[f"clean/{key}_scale"].reshape(m.weight_scale.shape)), key
        if isinstance(m, FP8Linear):
            assert not m.lora_fused
    assert fuser.clean_bytes == 0


def test_the_two_patch_dtypes_differ_as_comfyui_says(golden):
    """ComfyUI's float16 patch (its GPU choice) is another result than its float32 one (its CPU choice): the goldens
    differ, so each test above checks its own arithmetic."""
    meta, tensors = golden
    differ = [layer["key"] for layer in meta["layers"]
              if not _same(tensors[f"fused.float32/{layer['key']}"], tensors[f"fused.float16/{layer['key']}"])]
    assert len(differ) == len(meta["layers"])


@pytest.mark.skipif(not KITCHEN, reason="comfy-kitchen is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kitchen_and_torch_steps_agree(dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 128, generator=g) * 0.05).to(dtype)
    w[0, 0] = 0.0  # a zero, and a value far below the rest (subnormal after scaling)
    w[1, 1] = 1e-7
    for fp8 in FP8.values():
        for seed in (0, 1, 2815298891):
            a, b = R.requantize_fp8(w, fp8, seed, use_kitchen=True), R.requantize_fp8(w, fp8, seed, use_kitchen=False)
            assert _same(a[0], b[0]) and _same(a[1], b[1]), (fp8, seed)
        assert _same(R.dequantize_fp8(a[0], a[1], dtype, use_kitchen=True),
                     R.dequantize_fp8(a[0], a[1], dtype, use_kitchen=False))
    for per_row, group in ((False, None), (True, None), (True, 16)):
        for seed in (0, 12345):
            a = R.requantize_int8(w, per_row, group, seed, use_kitchen=True)
            b = R.requantize_int8(w, per_row, group, seed, use_kitchen=False)
            assert _same(a[0], b[0]) and _same(a[1], b[1]), (per_row, group, seed)


@pytest.mark.parametrize("fp8", list(FP8.values()), ids=list(FP8))
def test_stochastic_rounding_lands_on_a_neighbour(fp8):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4096, generator=g) * 4).half()
    a = x.float().abs()
    nearest = a.to(fp8)  # torch's round-to-nearest cast; the codes of non-negative fp8 values grow with the value
    code = nearest.view(torch.uint8).to(torch.int16)
    above = nearest.float() > a
    lo = torch.where(above, code - 1, code).to(torch.uint8).view(fp8).float()
    hi = torch.where(above, code, code + 1).to(torch.uint8).view(fp8).float()
    rng = torch.randint(0, 256, x.shape, dtype=torch.uint8, generator=g)
    got = R.stochastic_round_fp8_torch(x, rng, fp8).float()
    assert bool(((got == 0) | (torch.sign(got) == torch.sign(x.float()))).all())
    exact = nearest.float() == a
    assert torch.equal(got.abs()[exact], a[exact])  # representable values are kept whatever the random step
    ok = (got.abs() == lo) | (got.abs() == hi)
    assert bool(ok[~exact].all()), x[~exact][~ok[~exact]][:5]
    assert 0.2 < float((got.abs()[~exact] == hi[~exact]).float().mean()) < 0.8  # both neighbours are drawn
    with pytest.raises(ValueError, match="uint8 of x's shape"):
        R.stochastic_round_fp8_torch(x, rng[:10], fp8)


def test_lora_compute_dtype_follows_comfyuis_rule(monkeypatch):
    assert R.lora_compute_dtype("cpu") == torch.float32
    caps = {"name": "NVIDIA H100 80GB HBM3", "cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: caps["cap"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: caps["name"])
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert R.lora_compute_dtype(cuda) == torch.float16
    caps.update(name="NVIDIA GeForce RTX 2080", cap=(7, 5))
    assert R.lora_compute_dtype(cuda) == torch.float16
    caps.update(name="NVIDIA GeForce GTX 1660 SUPER", cap=(7, 5))
    assert R.lora_compute_dtype(cuda) == torch.float32  # one of the Turing cards ComfyUI lists as broken in fp16
    caps.update(name="NVIDIA GeForce GTX 1080 Ti", cap=(6, 1))
    assert R.lora_compute_dtype(cuda) == torch.float32


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="Conv1d is not a Linear"):
        R.lora_patched(nn.Conv1d(2, 2, 1), torch.zeros(2, 2), [], 1)
    with pytest.raises(ValueError, match="patch_dtype torch.float64: choose one of float32, float16, bfloat16"):
        LoRAFuser(nn.Linear(2, 2), patch_dtype=torch.float64)
    with pytest.raises(ValueError, match="only float8_e4m3fn and float8_e5m2"):
        R.stochastic_round_fp8_torch(torch.zeros(2), torch.zeros(2, dtype=torch.uint8), torch.int8)


def test_clean_bytes_of_sharded_gpu_weights_go_to_host_memory():
    from mgpu_backend.weights.lora import backup_device_for

    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert backup_device_for(cuda, sharded=True) == cpu  # the memory mode: nothing kept on the GPU
    assert backup_device_for(cuda, sharded=False) == cpu  # replicated too: ComfyUI keeps its backups off the GPU
    assert backup_device_for(cpu, sharded=True) == cpu
    assert backup_device_for(cuda, sharded=True, configured=cuda) == cuda
