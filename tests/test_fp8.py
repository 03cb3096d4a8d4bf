"""fp8-resident checkpoints (`ltx-2-19b-dev-fp8` layout): FP8Linear swap, resident memory, strict `weight_scale`,
accuracy against the bf16 twin, and `quantize_fp8`.

The fp8 tiny checkpoint is written from the same modules as the bf16 one (conftest `tiny_dir`): every 2-D `.weight`
inside `transformer_blocks` is per-tensor scaled float8_e4m3fn (scale = amax / 448) quantized FROM the bf16 value.

Tolerances:
* per weight: e4m3 keeps 3 mantissa bits, so round-to-nearest errs by at most half an ulp = 2^-4 · |w/s| for normal
  numbers (|w/s| >= 2^-6); below that the subnormal spacing is 2^-9, half of it 2^-10. So
  |deq - w| <= 2^-4·|w| + 2^-10·s, plus 2^-20·|w| for the float32 division/multiplication by s (a few float32 ulps).
* transformer output, fp8 vs bf16 twin (both computed in float32): relative L2 error < 0.1. Measured on the tiny
  models: 0.019-0.033 (2.0) and 0.013-0.018 (2.3) over seeds 0-2; the weights themselves are off by relative L2
  ≈ 0.027 (uniform rounding error of 3 mantissa bits ≈ 2^-4/√3 ≈ 0.036 at most) and two blocks compound it.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from mgpu_backend.models import keymaps
from mgpu_backend.models.fp8 import FP8Linear, quantize_fp8
from mgpu_backend.models.loader import CheckpointError, load_components
from _forward import av_forward

P = keymaps.TRANSFORMER_PREFIX
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value (OCP FP8 spec: S.1111.110 = 1.75 · 2^8)
VARIANTS = ("2.0", "2.3")


def _fp8_bound(w: torch.Tensor, scale: float) -> torch.Tensor:
    return 2.0 ** -4 * w.abs() + 2.0 ** -10 * scale + 2.0 ** -20 * w.abs()


def _block_linears(module: nn.Module) -> dict[str, nn.Module]:
    """Linear layers inside transformer_blocks, counted on the float32 source modules (not on what was loaded)."""
    return {n: m for n, m in module.named_modules() if n.startswith("transformer_blocks.") and isinstance(m, nn.Linear)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_file_layout(tiny_dir, tiny_modules, variant):
    """The writer's fp8 twin: each block Linear weight is e4m3 + a 0-d float32 `weight_scale`, nothing else is."""
    expected = {P + n + ".weight" for n in _block_linears(tiny_modules[variant]["transformer"])}
    with safe_open(str(tiny_dir[variant]["checkpoint_fp8"]), framework="pt") as f:
        fp8_keys = {k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"}
        scales = {k for k in f.keys() if k.endswith(".weight_scale")}
        assert all(f.get_tensor(k).dtype == torch.float32 and f.get_tensor(k).ndim == 0 for k in scales)
    assert fp8_keys == expected
    assert scales == {k[: -len("weight")] + "weight_scale" for k in expected}


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_linears_are_fp8_resident(tiny_dir, tiny_modules, variant):
    fp8 = load_components(tiny_dir[variant]["checkpoint_fp8"]).transformer  # default compute dtype bf16
    bf16 = load_components(tiny_dir[variant]["checkpoint"]).transformer
    block_linears = _block_linears(tiny_modules[variant]["transformer"])
    swapped = {n: m for n, m in fp8.named_modules() if isinstance(m, FP8Linear)}
    assert set(swapped) == set(block_linears)
    for name, layer in swapped.items():
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.element_size() == 1, name
        assert layer.compute_dtype == torch.bfloat16 and not layer.lora_fused
        assert layer.weight.shape == block_linears[name].weight.shape
    # Linears outside the blocks (patchify projections, AdaLN, output projections) stay ordinary bf16 Linears
    outside = [m for n, m in fp8.named_modules() if isinstance(m, nn.Linear) and not n.startswith("transformer_blocks.")]
    assert outside and all(m.weight.dtype == torch.bfloat16 for m in outside)

    def param_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    fp8_elements = sum(m.weight.numel() for m in block_linears.values())
    # each fp8 weight element takes 1 byte instead of 2; every other parameter is the same bf16 tensor
    assert param_bytes(fp8) == param_bytes(bf16) - fp8_elements
    block_weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in swapped.values())
    assert block_weight_bytes == fp8_elements
    # the scales are 0-d float32 buffers, 4 bytes per layer
    scale_bytes = sum(b.numel() * b.element_size() for n, b in fp8.named_buffers() if n.endswith("weight_scale"))
    assert scale_bytes == 4 * len(swapped)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantized_weights_within_e4m3_rounding_of_bf16_twin(tiny_dir, variant):
    fp8 = load_components(tiny_dir[variant]["checkpoint_fp8"], dtype=torch.float32).transformer
    bf16 = load_components(tiny_dir[variant]["checkpoint"], dtype=torch.float32).transformer
    layers = [(n, m) for n, m in fp8.named_modules() if isinstance(m, FP8Linear)]
    assert layers
    for name, layer in layers:
        w = bf16.get_submodule(name).weight
        scale = float(layer.weight_scale)
        assert scale == pytest.approx(float(w.abs().max()) / E4M3_MAX, rel=1e-6), name
        deq = layer.dequantized_weight()
        assert torch.equal(deq, layer.weight.float() * layer.weight_scale)
        assert bool(((deq - w).abs() <= _fp8_bound(w, scale)).all()), name
        assert not torch.equal(deq, w)  # it really is quantized
        # biases are not quantized
        assert torch.equal(layer.bias, bf16.get_submodule(name).bias)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_forward_close_to_bf16_twin(tiny_dir, variant):
    fp8 = load_components(tiny_dir[variant]["checkpoint_fp8"], dtype=torch.float32).transformer
    bf16 = load_components(tiny_dir[variant]["checkpoint"], dtype=torch.float32).transformer
    for seed in (0, 1):
        (fv, fa), (bv, ba) = av_forward(fp8, seed), av_forward(bf16, seed)
        for got, want in ((fv, bv), (fa, ba)):
            assert torch.isfinite(got).all()
            rel = float((got - want).norm() / want.norm())
            assert 0.0 < rel < 0.1, rel  # see module docstring: measured <= 0.033


def test_missing_weight_scale_is_named(tiny_dir, tmp_path):
    src = tiny_dir["2.0"]["checkpoint_fp8"]
    sd = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    removed = P + "transformer_blocks.0.attn1.to_q.weight_scale"
    del sd[removed]
    bad = tmp_path / "noscale.safetensors"
    save_file(sd, str(bad), metadata=meta)
    with pytest.raises(CheckpointError, match="missing keys") as err:
        load_components(bad)
    assert removed in str(err.value) and str(bad) in str(err.value)


def test_fp8_weight_outside_a_linear_is_refused(tiny_dir, tmp_path):
    """Only Linear weights may be fp8: a float8 norm / conv weight is a broken file, not something to guess at."""
    src = tiny_dir["2.0"]["checkpoint"]
    sd = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    key = "vae.decoder.conv_in.conv.weight"
    sd[key] = sd[key].float().to(torch.float8_e4m3fn)
    bad = tmp_path / "fp8conv.safetensors"
    save_file(sd, str(bad), metadata=meta)
    with pytest.raises(CheckpointError, match="conv_in.conv.weight") as err:
        load_components(bad)
    assert str(bad) in str(err.value) and "Linear" in str(err.value)


def test_quantize_fp8_round_trip_bound(seed):
    g = seed(11)
    # a wide dynamic range: normal and subnormal e4m3 codes are both exercised
    w = torch.randn(96, 80, generator=g) * torch.logspace(-3, 0, 80)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.ndim == 0
    s = float(scale)
    assert s == pytest.approx(float(w.abs().max()) / E4M3_MAX, rel=1e-7)
    # the largest magnitude lands on the largest code exactly
    assert float(q.float().abs().max()) == E4M3_MAX
    r = q.float() * scale
    assert bool(((r - w).abs() <= _fp8_bound(w, s)).all())
    # subnormal codes really occur (|w/s| < 2^-6), so the absolute term of the bound is needed
    assert bool(((w / s).abs() < 2.0 ** -6).any())
    normal = (w / s).abs() >= 2.0 ** -6
    assert float(((r - w).abs() / w.abs())[normal].max()) <= 2.0 ** -4 * (1 + 2.0 ** -16)
    # quantizing the dequantized tensor again gives the same codes (idempotent: same amax, values on the grid)
    q2, scale2 = quantize_fp8(r)
    assert float(scale2) == pytest.approx(s, rel=1e-7)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    # e5m2 (2 mantissa bits): half-ulp 2^-3 relative for normal values
    q5, s5 = quantize_fp8(w, torch.float8_e5m2)
    assert q5.dtype == torch.float8_e5m2
    assert float(s5) == pytest.approx(float(w.abs().max()) / 57344.0, rel=1e-7)
    r5 = q5.float() * s5
    normal5 = (w / s5).abs() >= 2.0 ** -14
    assert float(((r5 - w).abs() / w.abs())[normal5].max()) <= 2.0 ** -3 * (1 + 2.0 ** -16)


# ---- the fp8 matmul path (issue 16): which path runs, and the math of the fp8 kernel call --------------------------

def _layer(fp8_dtype=torch.float8_e4m3fn, features=(64, 48), input_scale=False):
    from mgpu_backend.models.fp8 import FP8Linear

    layer = FP8Linear(*features, bias=True, compute_dtype=torch.bfloat16, fp8_dtype=fp8_dtype,
                      has_input_scale=input_scale)
    q, s = quantize_fp8(torch.randn(features[1], features[0]), fp8_dtype)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        layer.bias.normal_()
    return layer


def test_fp8_compute_path_selection(monkeypatch):
    """CPU dequantizes (exact to the file); on an fp8-capable GPU the fp8 matmul path is taken unless the weights are
    e5m2, the compute is float32, the features are not multiples of 16, or the mode is off — a fused LoRA (written
    into the fp8 weight and scale) keeps it."""
    from mgpu_backend.models import fp8 as F8

    layer = _layer()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert F8.compute_path(layer, x) == ("dequantize", "CPU")
    # the CPU forward is today's exact dequantizing forward
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias))
    assert layer.computed.path == "dequantize" and "CPU" in F8.compute_report(layer)
    monkeypatch.setattr(F8, "scaled_mm_capable", lambda device: True)  # as on a Hopper GPU
    assert F8.compute_path(layer, x)[0] == "scaled_mm"
    assert F8.compute_path(layer, x.float()) == ("dequantize", "torch.float32 compute (the fp8 matmul path returns "
                                                               "bf16 / fp16)")
    assert F8.compute_path(_layer(torch.float8_e5m2), x)[0] == "dequantize"
    assert "multiples of 16" in F8.compute_path(_layer(features=(64, 40)), x)[1]
    layer.lora_fused = True
    assert F8.compute_path(layer, x)[0] == "scaled_mm"
    layer.lora_fused = False
    F8.set_compute("off")
    try:
        assert F8.compute_path(layer, x) == ("dequantize", "fp8 compute set off")
    finally:
        F8.set_compute("auto")
    with pytest.raises(ValueError, match="'fast'.*auto, on, off"):
        F8.set_compute("fast")


def test_fp8_compute_on_refuses_by_layer_name():
    from mgpu_backend.models import fp8 as F8

    model = nn.Sequential(_layer())
    F8.set_compute("on")
    try:
        with pytest.raises(ValueError, match="layer '0' cannot use fp8 matmuls: CPU"):
            F8.check_compute(model, torch.device("cpu"), torch.bfloat16)
    finally:
        F8.set_compute("auto")


@pytest.mark.parametrize("input_scale", [False, True])
def test_fp8_linear_is_the_quantized_product(input_scale):
    """`fp8_linear` = (x quantized to e4m3 per row, or by the file's input_scale) · (weight·weight_scale)ᵀ + bias,
    accumulated in float32 and rounded once to bf16 (torch._scaled_mm runs on the CPU too)."""
    from mgpu_backend.models.fp8 import fp8_linear, quantize_rows, quantize_static

    g = torch.Generator().manual_seed(3)
    layer = _layer(input_scale=input_scale)
    x = torch.randn(37, 64, generator=g).to(torch.bfloat16) * torch.logspace(-2, 1, 37)[:, None].to(torch.bfloat16)
    if input_scale:
        layer.input_scale.fill_(float(x.float().abs().max()) / 448.0)
        xq, sa = quantize_static(x, layer.input_scale), layer.input_scale
    else:
        xq, sa = quantize_rows(x)
        assert xq.dtype == torch.float8_e4m3fn and sa.shape == (37, 1)
        # every row's largest magnitude lands on the largest code
        assert torch.equal(xq.float().abs().amax(1), torch.full((37,), 448.0))
    got = fp8_linear(x.unsqueeze(0), layer.weight, layer.weight_scale, layer.bias,
                     getattr(layer, "input_scale", None))
    assert got.shape == (1, 37, 48) and got.dtype == torch.bfloat16
    want = (xq.float() * sa) @ (layer.weight.float() * layer.weight_scale).t() + layer.bias.float()
    assert float((got[0].float() - want).norm() / want.norm()) < 2 ** -8  # one bf16 rounding
    exact = x.float() @ layer.dequantized_weight().float().t() + layer.bias.float()
    assert float((got[0].float() - exact).norm() / exact.norm()) < 0.06  # e4m3 activations: 3 mantissa bits


def test_scale_written_in_place_keeps_captured_tensors():
    """A LoRA fuse / restore writes `weight_scale` in place; `scale_written` rewrites the row copy the fp8 matmul
    reads in place too (a CUDA graph captured before replays with the same tensor objects), and the weight generation
    captured graphs key on stays put (no tensor object changed)."""
    from mgpu_backend.models import fp8 as F8

    layer = _layer()
    rows = layer._scale_b_rows()
    assert torch.equal(rows, layer.weight_scale.reshape(1, 1).expand(1, layer.out_features))
    generation = F8.WEIGHT_GENERATION[0]
    with torch.no_grad():
        layer.weight_scale.copy_(torch.tensor(0.125))
    layer.scale_written()
    assert layer._scale_b_rows() is rows and torch.equal(rows, torch.full((1, layer.out_features), 0.125))
    assert F8.WEIGHT_GENERATION[0] == generation
    layer.scale_written()  # idempotent
    assert torch.equal(rows, torch.full((1, layer.out_features), 0.125))
