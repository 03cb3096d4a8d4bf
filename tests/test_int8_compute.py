"""int8 layers compute W8A8 as ComfyUI 0.33 does (`mgpu_backend.models.quant`'s docstring has the facts).

The reference is comfy-kitchen itself (the `test` extra installs it): `comfy_kitchen.int8_linear` (what ComfyUI's
`linear_input_act` calls) and `F.linear` on a comfy-kitchen `QuantizedTensor` weight (ComfyUI's dispatch for every other
int8 layer). On CPU both run comfy-kitchen's eager backend; ours must equal them bit for bit — through comfy-kitchen's
op, and through the pack's torch fallback (what runs without comfy-kitchen). A LoRA-fused layer computes W8A16.
"""
from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn.functional as F

from mgpu_backend.models import quant as Q
from mgpu_backend.models.fp8 import compute_report

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout  # noqa: E402

K, N = 256, 48
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _layer(group, seed=0, per_tensor=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    q, s = Q.quantize_int8(w, None if per_tensor else group)
    return q, s, torch.randn(N, generator=g)


def _comfy_linear(x, q, s, bias, group):
    """ComfyUI's int8 layer: F.linear on the QuantizedTensor weight (comfy-kitchen's TensorWiseINT8Layout)."""
    params = TensorWiseINT8Layout.Params(scale=s, orig_dtype=x.dtype, orig_shape=(N, K), convrot=group is not None,
                                         convrot_groupsize=group or 256)
    return F.linear(x, QuantizedTensor(q, "TensorWiseINT8Layout", params), bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [None, 16, 64, 256])
def test_int8_linear_equals_comfy_kitchen_bit_for_bit(dtype, group):
    q, s, b = _layer(group, per_tensor=group is None)
    g = torch.Generator().manual_seed(1)
    for shape in ((1,), (3,), (2, 5), (7, 3), (1, 1, 9)):  # odd batch / token counts, 2-D to 4-D inputs
        x = (torch.randn(*shape, K, generator=g) * 3).to(dtype)
        for bias in (None, b.to(dtype)):
            want = _comfy_linear(x, q, s, bias, group)
            for act in (None, "gelu_tanh"):
                ref = ck.int8_linear(x, q, s, bias, dtype, convrot=group is not None,
                                     convrot_groupsize=group or 256, input_act=act)
                ours = Q.int8_linear(x, q, s, bias, group, act)
                fallback = Q.int8_linear_torch(x, q, s, bias, group, act)
                assert ours.dtype == fallback.dtype == dtype and ours.shape == (*shape, N)
                assert torch.equal(ours, ref) and torch.equal(fallback, ref), (shape, act)
            assert torch.equal(Q.int8_linear(x, q, s, bias, group), want)


def test_w8a8_is_not_the_dequantized_product():
    """The activations really are quantized: the result moves from x · deq(W)ᵀ by about one activation step."""
    q, s, _ = _layer(16)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2))
    w8a16 = F.linear(x, Q.dequantize_int8(q, s, 16))
    diff = float((Q.int8_linear(x, q, s, None, 16) - w8a16).abs().max())
    assert 0 < diff < 0.05 * float(w8a16.abs().max())


def test_int8_linear_module_stays_w8a8_with_a_fused_lora():
    """A fused LoRA lives in the int8 weight and scale (re-quantized as ComfyUI does, `weights.lora`): the layer
    computes W8A8 on them as ComfyUI does after its `set_weight`."""
    q, s, b = _layer(16)
    layer = Q.Int8Linear(K, N, True, torch.float32, convrot_group=16, per_row_scale=True)
    layer.load_state_dict({"weight": q, "weight_scale": s, "bias": b})
    x = torch.randn(3, 2, K, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer(x), _comfy_linear(x, q, s, b, 16))
    assert layer.computed.path == "int8" and "comfy-kitchen int8_linear" in compute_report(layer)
    q2, s2 = Q.quantize_int8(Q.dequantize_int8(q, s, 16) + 0.01, 16)  # new bytes and scale, written in place
    with torch.no_grad():
        layer.weight.copy_(q2)
        layer.weight_scale.copy_(s2)
    layer.lora_fused = True
    assert torch.equal(layer(x), _comfy_linear(x, q2, s2, b, 16)) and layer.computed.path == "int8"


def test_feedforward_gelu_folds_into_the_int8_down_projection():
    """ComfyUI's `linear_input_act(net[2], net[0].proj(x), "gelu_tanh")`: after `swap_in_int8_linears` the
    FeedForward computes `ck.int8_linear(proj(x), ..., input_act="gelu_tanh")`; same keys, and on CPU the same as
    applying the GELU before the layer."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(64, activation_fn="gelu-approximate").eval()
    x = torch.randn(2, 5, 64)
    q, s = Q.quantize_int8(ff.net[2].weight.detach(), 16)
    bias = ff.net[2].bias.detach().clone()
    keys = set(ff.state_dict())
    assert Q.swap_in_int8_linears(ff, {"net.2": {"format": Q.INT8_FORMAT, "convrot": True, "convrot_groupsize": 16}},
                                  torch.float32, {"net.2": (64, 1)}) == 1
    ff.net[2].load_state_dict({"weight": q, "weight_scale": s, "bias": bias})
    assert isinstance(ff.net[0], Q.GeluProjection) and ff.net[2].input_act == "gelu_tanh"
    assert set(ff.state_dict()) == keys | {"net.2.weight_scale"}
    with torch.no_grad():
        h = ff.net[0].proj(x)
        got = ff(x)
    assert torch.equal(got, ck.int8_linear(h, q, s, bias, torch.float32, convrot=True, convrot_groupsize=16,
                                           input_act="gelu_tanh"))
    assert torch.equal(got, _comfy_linear(F.gelu(h, approximate="tanh"), q, s, bias, 16))


def test_without_comfy_kitchen_the_torch_copy_runs_with_one_log_line(monkeypatch, caplog):
    q, s, b = _layer(64)
    x = torch.randn(5, K, dtype=torch.bfloat16, generator=None)
    want = ck.int8_linear(x, q, s, b.bfloat16(), torch.bfloat16, convrot=True, convrot_groupsize=64)
    monkeypatch.setattr(Q, "_KITCHEN", [])
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # import fails
    with caplog.at_level(logging.WARNING, logger="ltx2_mgpu.quant"):
        a = Q.int8_linear(x, q, s, b.bfloat16(), 64)
        c = Q.int8_linear(x, q, s, b.bfloat16(), 64)
    assert Q.kitchen_op() is None and torch.equal(a, want) and torch.equal(c, want)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "comfy-kitchen is not installed" in caplog.records[0].message
    layer = Q.Int8Linear(K, N, False, torch.bfloat16, convrot_group=64, per_row_scale=True)
    layer.load_state_dict({"weight": q, "weight_scale": s})
    layer(x)
    assert "not installed" in layer.computed.reason


def test_bad_arguments_are_refused_by_name():
    q, s, _ = _layer(16)
    with pytest.raises(ValueError, match="does not divide input features 250"):
        Q.int8_linear_torch(torch.randn(2, 250), q[:, :250], s, None, 16)
    with pytest.raises(ValueError, match="input_act 'relu'"):
        Q.int8_linear_torch(torch.randn(2, K), q, s, None, 16, "relu")


def test_w8a16_on_request(monkeypatch):
    """`LTX2_MGPU_INT8_COMPUTE=w8a16`: x · deq(W)ᵀ in the compute dtype (not ComfyUI's result; closer to bf16)."""
    q, s, b = _layer(16)
    layer = Q.Int8Linear(K, N, True, torch.float32, convrot_group=16, per_row_scale=True)
    layer.load_state_dict({"weight": q, "weight_scale": s, "bias": b})
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(Q, "INT8_COMPUTE", "w8a16")
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), b)) and "w8a16" in layer.computed.reason


def test_token_shards_compute_the_same_bits():
    """Activations are quantized per row (per token), so a rank's shard of the tokens (sequence parallelism) or one
    row of a batch gives the same bits as the whole: the fleet at W = 2 / 4 equals W = 1."""
    q, s, b = _layer(16)
    x = torch.randn(2, 27, K, generator=torch.Generator().manual_seed(5))
    whole = Q.int8_linear(x, q, s, b, 16, "gelu_tanh")
    for world in (2, 4):
        shards = [Q.int8_linear(part, q, s, b, 16, "gelu_tanh") for part in x.tensor_split(world, dim=1)]
        assert torch.equal(torch.cat(shards, dim=1), whole)
    assert torch.equal(Q.int8_linear(x[1:], q, s, b, 16, "gelu_tanh"), whole[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", [16, 256])
def test_int8_linear_on_cuda_equals_comfyui_bit_for_bit(group):
    """On CUDA, with comfy-kitchen's backends set as ComfyUI sets them (its "cuda" backend with torch cu130+): ours
    equals ComfyUI's int8 layer bit for bit; the pack's torch copy (no comfy-kitchen) stays within a few rounding
    steps of it (a different int8 kernel may round the rescale differently)."""
    q, s, b = (t.cuda() for t in _layer(group))
    g = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((7,), (2, 33)):
            x = (torch.randn(*shape, K, generator=g, device="cuda") * 3).to(dtype)
            ours = Q.int8_linear(x, q, s, b.to(dtype), group)  # first: sets comfy-kitchen's backends as ComfyUI does
            want = _comfy_linear(x, q, s, b.to(dtype), group)
            assert ours.device.type == "cuda" and ours.dtype == dtype
            assert torch.equal(ours, want), (dtype, shape, float((ours - want).abs().max()))
            fallback = Q.int8_linear_torch(x, q, s, b.to(dtype), group)
            rel = float((fallback.float() - want.float()).norm() / want.float().norm())
            print(f"int8 cuda group {group} {dtype} {shape}: torch copy rel L2 {rel:.2e}")
            assert rel < 1e-2
