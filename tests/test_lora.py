"""LoRA files (LTX / ComfyUI key naming): parsing, reading, fusing, exact restore, coverage and errors.

The reference for the fused weights is computed here directly from the file's tensors (safetensors, float64,
`W + strength · alpha / rank · B @ A`, the PEFT / kohya / ComfyUI `comfy/lora.py` convention) and the model's own
module paths (for attention and feed-forward Linears the original and diffusers names coincide), without
`mgpu_backend.weights.lora` or the key maps.

Tolerances:
* fused weight vs the float64 reference: |diff| <= 2 · eps32 · max|W| — the fuser adds a float32 delta to the
  float32 weight (one rounding of the sum, <= 1/2 ulp of the largest entry) after computing B @ A in float32
  (rank 4, |terms| ~ 1e-3, far below that ulp); measured max 6e-8 (one ulp at |W| ~ 0.5).
* fused output vs the output of the reference-weight model: relative L2 <= 1e-5 (weights equal to within a
  float32 ulp; the forward is float32); measured 1.8e-7.
* strength 0.5 vs 1: (W_0.5 - W) vs (W_1 - W)/2 within 4 · eps32 · max|W| (each side rounded once to float32).
* restore: exact (`torch.equal`), bf16/float32 and fp8 alike.
* fp8: the bound of `test_fp8_model_fuse_then_restore_exact` (one e4m3 step of stochastic rounding). ComfyUI's own
  bytes for the same arithmetic: tests/test_lora_requant.py.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mgpu_backend.weights.lora import LoRAFuser, LoRAReport, parse_lora_arg, read_lora
from mgpu_backend.models.fp8 import FP8Linear
from mgpu_backend.models.loader import SafetensorsFile, load_transformer
from mgpu_backend.protocol.stage_params import check_lora_file
from _forward import av_forward

VARIANTS = ("2.0", "2.3")
EPS32 = torch.finfo(torch.float32).eps
# attention projections and feed-forward Linears of a block: what a distilled LoRA touches
_LORA_TARGET = re.compile(
    r"^transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
    r"\.(to_q|to_k|to_v|to_out\.0)$"
    r"|^transformer_blocks\.\d+\.(ff|audio_ff)\.net\.(0\.proj|2)$")


def _transformer(path, dtype=torch.float32):
    return load_transformer(SafetensorsFile(path), dtype)[0]


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1 else a[k],
                                                 b[k].view(torch.uint8) if b[k].element_size() == 1 else b[k])
        for k in a)


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _lora_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _reference_fuse(model: nn.Module, path, strength: float) -> nn.Module:
    """Independent fuse: a deep copy of `model` with W += strength · alpha/rank · B @ A (float64) per file pair."""
    ref = copy.deepcopy(model)
    tensors = _lora_tensors(path)
    bases = {k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")}
    with torch.no_grad():
        for base in bases:
            a = tensors[base + ".lora_A.weight"].double()
            b = tensors[base + ".lora_B.weight"].double()
            alpha = float(tensors[base + ".alpha"]) if base + ".alpha" in tensors else a.shape[0]
            layer = ref.get_submodule(base.removeprefix("diffusion_model."))
            layer.weight.copy_((layer.weight.double() + strength * alpha / a.shape[0] * (b @ a)).float())
    return ref


# ------------------------------------------------------------------------------------------------- parse_lora_arg

@pytest.mark.parametrize("arg, expected", [
    ("loras/distilled.safetensors", ("loras/distilled.safetensors", 1.0)),
    ("loras/distilled.safetensors:0.6", ("loras/distilled.safetensors", 0.6)),
    ("/abs/path/x.safetensors:1.25", ("/abs/path/x.safetensors", 1.25)),
    ("x.safetensors:-0.5", ("x.safetensors", -0.5)),
    ("x.safetensors:1e-1", ("x.safetensors", 0.1)),
    ("C:/loras/x.safetensors", ("C:/loras/x.safetensors", 1.0)),  # Windows drive, forward slashes
    ("C:\\loras\\x.safetensors", ("C:\\loras\\x.safetensors", 1.0)),  # Windows drive, backslashes
    ("C:\\loras\\x.safetensors:0.3", ("C:\\loras\\x.safetensors", 0.3)),
])
def test_parse_lora_arg(arg, expected):
    path, strength = parse_lora_arg(arg)
    assert path == expected[0] and strength == pytest.approx(expected[1], rel=1e-12)


@pytest.mark.parametrize("arg, bad", [("x.safetensors:strong", "strong"), ("x.safetensors:nan", "nan"),
                                      ("x.safetensors:inf", "inf")])
def test_parse_lora_arg_bad_strength(arg, bad):
    with pytest.raises(ValueError, match=f"'{bad}'") as err:
        parse_lora_arg(arg)
    assert arg in str(err.value)


# ------------------------------------------------------------------------------------------------------ read_lora

@pytest.mark.parametrize("variant", VARIANTS)
def test_read_lora_pairs_every_attention_and_ff_linear(tiny_dir, tiny_modules, variant):
    model = tiny_modules[variant]["transformer"]
    targets = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _LORA_TARGET.match(n)}
    # 2 blocks × (6 attentions × 4 projections + 2 feed-forwards × 2 Linears) = 56
    n_blocks = len(model.transformer_blocks)
    assert len(targets) == n_blocks * (6 * 4 + 2 * 2) == 56
    lora = read_lora(tiny_dir[variant]["distilled_lora"], strength=0.75)
    assert set(lora.pairs) == targets
    assert lora.strength == 0.75 and lora.unmatched_keys == []
    tensors = _lora_tensors(tiny_dir[variant]["distilled_lora"])
    for name, (a, b, alpha) in lora.pairs.items():
        layer = model.get_submodule(name)
        assert a.shape == (4, layer.in_features) and b.shape == (layer.out_features, 4)
        assert torch.equal(a, tensors[f"diffusion_model.{name}.lora_A.weight"])
        assert torch.equal(b, tensors[f"diffusion_model.{name}.lora_B.weight"])
        assert alpha == 4.0


def test_read_lora_prefixes_alpha_default_and_unmatched(tmp_path):
    a, b = torch.ones(2, 8), torch.ones(8, 2)
    path = tmp_path / "mixed.safetensors"
    save_file({"model.diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": a,
               "model.diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight": b,
               "transformer.transformer_blocks.1.ff.net.2.lora_A.weight": a.clone(),
               "transformer.transformer_blocks.1.ff.net.2.lora_B.weight": b.clone(),
               "transformer.transformer_blocks.1.ff.net.2.alpha": torch.tensor(1.0),
               "diffusion_model.transformer_blocks.0.norm1.diff_b": torch.zeros(8)}, str(path))
    lora = read_lora(path)
    assert set(lora.pairs) == {"transformer_blocks.0.attn1.to_q", "transformer_blocks.1.ff.net.2"}
    assert lora.pairs["transformer_blocks.0.attn1.to_q"][2] == 2.0  # alpha defaults to the rank
    assert lora.pairs["transformer_blocks.1.ff.net.2"][2] == 1.0
    assert lora.unmatched_keys == ["diffusion_model.transformer_blocks.0.norm1.diff_b"]


@pytest.mark.parametrize("read", [read_lora, check_lora_file], ids=["read_lora", "node_check"])
def test_read_lora_errors(tmp_path, read):
    """The engine's `read_lora` and LoRA (MGPU)'s header check (`stage_params.check_lora_file`, in ComfyUI's process)
    refuse the same files with the same messages."""
    with pytest.raises(FileNotFoundError, match="absent.safetensors"):
        read(tmp_path / "absent.safetensors")
    empty = tmp_path / "not-a-lora.safetensors"
    save_file({"some.weight": torch.zeros(3)}, str(empty))
    with pytest.raises(ValueError, match="no LoRA pairs") as err:
        read(empty)
    assert str(empty) in str(err.value)
    half = tmp_path / "half.safetensors"
    save_file({"diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 8)}, str(half))
    with pytest.raises(ValueError, match="lora_B") as err:
        read(half)
    assert str(half) in str(err.value)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read(garbage)
    good = tmp_path / "good.safetensors"
    save_file({"diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 8),
               "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(8, 2)}, str(good))
    with pytest.raises(ValueError, match="strength nan must be a finite number"):
        read(good, float("nan"))
    assert check_lora_file(good) == len(read_lora(good).index) == 1


# ---------------------------------------------------------------------------------------------------- fuse/restore

@pytest.mark.parametrize("variant", VARIANTS)
def test_fuse_matches_independent_computation_and_restore_is_exact(tiny_dir, tmp_path, variant):
    model = _transformer(tiny_dir[variant]["checkpoint"])
    # a LoRA whose alpha (2) differs from its rank (4), so the alpha/rank factor is exercised
    tensors = _lora_tensors(tiny_dir[variant]["distilled_lora"])
    tensors = {k: (torch.tensor(2.0) if k.endswith(".alpha") else v) for k, v in tensors.items()}
    path = tmp_path / "alpha2.safetensors"
    save_file(tensors, str(path))
    strength = 0.7

    original = _weights(model)
    base_v, base_a = av_forward(model)
    fuser = LoRAFuser(model)
    reports = fuser.fuse([read_lora(path, strength)])
    assert fuser.active
    assert [(r.matched, r.total) for r in reports] == [(56, 56)]
    assert str(reports[0]) == "alpha2.safetensors @ 0.7: 56/56 layers applied"

    ref = _reference_fuse(_transformer(tiny_dir[variant]["checkpoint"]), path, strength)
    fused, want = model.state_dict(), ref.state_dict()
    changed = [k for k in want if not torch.equal(original[k], want[k])]
    assert len(changed) == 56  # exactly the LoRA layers' weights move
    for k in want:
        assert _amax(fused[k] - want[k]) <= 2 * EPS32 * _amax(want[k]), k
    fused_v, fused_a = av_forward(model)
    ref_v, ref_a = av_forward(ref)
    for got, exp, base in ((fused_v, ref_v, base_v), (fused_a, ref_a, base_a)):
        assert float((got - exp).norm() / exp.norm()) <= 1e-5
        assert float((got - base).norm() / base.norm()) > 1e-3  # the LoRA really changes the output

    fuser.restore()
    assert not fuser.active
    assert _states_equal(_weights(model), original)
    again_v, again_a = av_forward(model)
    assert torch.equal(again_v, base_v) and torch.equal(again_a, base_a)
    fuser.restore()  # idempotent
    assert _states_equal(_weights(model), original)


def test_strength_half_halves_the_delta(tiny_dir):
    model = _transformer(tiny_dir["2.0"]["checkpoint"])
    w0 = _weights(model)
    fuser = LoRAFuser(model)
    fuser.fuse([read_lora(tiny_dir["2.0"]["distilled_lora"], 1.0)])
    w1 = _weights(model)
    fuser.fuse([read_lora(tiny_dir["2.0"]["distilled_lora"], 0.5)])  # fuse restores first
    w05 = _weights(model)
    moved = 0
    for k in w0:
        d1, d05 = w1[k] - w0[k], w05[k] - w0[k]
        if d1.abs().max() > 0:
            moved += 1
        assert _amax(d05 - 0.5 * d1) <= 4 * EPS32 * _amax(w0[k]), k
    assert moved == 56
    # two LoRAs add up: 1.0 + 0.5 of the same file == 1.5 within the same rounding bound
    fuser.fuse([read_lora(tiny_dir["2.0"]["distilled_lora"], 1.0), read_lora(tiny_dir["2.0"]["distilled_lora"], 0.5)])
    w_sum = _weights(model)
    fuser.fuse([read_lora(tiny_dir["2.0"]["distilled_lora"], 1.5)])
    w15 = _weights(model)
    for k in w0:
        assert _amax(w_sum[k] - w15[k]) <= 4 * EPS32 * _amax(w0[k]), k
    fuser.restore()
    assert _states_equal(_weights(model), w0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_model_fuse_then_restore_exact(tiny_dir, variant):
    """A LoRA on the fp8 checkpoint is fused INTO each fp8 weight and its per-tensor scale (re-quantized as ComfyUI
    does, `models/requantize.py`: same tensors, no full-precision copy held), and restore gives every byte back.

    Reference (independent: float64 from the file's tensors): want = deq(clean) + alpha / rank · B @ A. Bound: the
    fused value q · s (s the new scale) is one of the two e4m3 neighbours of want / s (stochastic rounding, after a
    float16 rounding of want / s that moves it by ≤ 2⁻¹¹ relative): |q · s − want| ≤ max(|want| · (2⁻³ + 2⁻¹⁰),
    2⁻⁹ · s · 1.01) — an e4m3 step is ≤ 2⁻³ of the value for normal values, 2⁻⁹ (in units of s) below."""
    model = _transformer(tiny_dir[variant]["checkpoint_fp8"])
    fp8_layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    original = _weights(model)
    tensors = {n: (m.weight, m.weight_scale) for n, m in fp8_layers.items()}
    base_v, base_a = av_forward(model)
    lora = read_lora(tiny_dir[variant]["distilled_lora"])
    fuser = LoRAFuser(model)
    reports = fuser.fuse([lora])
    assert (reports[0].matched, reports[0].total) == (56, 56)
    assert {n for n, m in fp8_layers.items() if m.lora_fused} == set(lora.pairs)
    assert fuser.fuse_stats.fused_bytes == 0
    assert fuser.clean_bytes == sum(original[n + ".weight"].numel() + 4 for n in lora.pairs)  # fp8 bytes + scale
    fused = _weights(model)
    for name in lora.pairs:
        layer = fp8_layers[name]
        assert layer.weight is tensors[name][0] and layer.weight_scale is tensors[name][1]  # written in place
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert not torch.equal(fused[name + ".weight"].view(torch.uint8), original[name + ".weight"].view(torch.uint8))
        a, b, alpha = lora.pairs[name]
        clean = original[name + ".weight"].double() * original[name + ".weight_scale"].double()
        want = clean + alpha / a.shape[0] * (b.double() @ a.double())
        s = layer.weight_scale.double()
        got = layer.weight.double() * s
        bound = torch.maximum(want.abs() * (2 ** -3 + 2 ** -10), 2 ** -9 * s * 1.01)
        assert bool(((got - want).abs() <= bound).all()), name
    fused_v, fused_a = av_forward(model)
    assert float((fused_v - base_v).norm() / base_v.norm()) > 1e-3
    assert float((fused_a - base_a).norm() / base_a.norm()) > 1e-3
    fuser.restore()
    assert not any(m.lora_fused for m in fp8_layers.values())
    assert _states_equal(_weights(model), original)
    again_v, again_a = av_forward(model)
    assert torch.equal(again_v, base_v) and torch.equal(again_a, base_a)


# ------------------------------------------------------------------------------------------ coverage and errors

def test_partial_coverage_is_reported(tiny_dir, tmp_path):
    tensors = _lora_tensors(tiny_dir["2.0"]["distilled_lora"])
    # one layer the model does not have (a 3rd block)
    tensors["diffusion_model.transformer_blocks.2.attn1.to_q.lora_A.weight"] = torch.zeros(4, 64)
    tensors["diffusion_model.transformer_blocks.2.attn1.to_q.lora_B.weight"] = torch.zeros(64, 4)
    path = tmp_path / "deeper.safetensors"
    save_file(tensors, str(path))
    model = _transformer(tiny_dir["2.0"]["checkpoint"])
    reports = LoRAFuser(model).fuse([read_lora(path, 0.25)])
    assert reports == [LoRAReport(str(path), 0.25, 56, 57)]
    assert str(reports[0]) == "deeper.safetensors @ 0.25: 56/57 layers applied"


def test_lora_matching_nothing_names_the_file(tiny_dir, tmp_path):
    path = tmp_path / "other-model.safetensors"
    save_file({"diffusion_model.input_blocks.1.1.proj_in.lora_A.weight": torch.zeros(4, 64),
               "diffusion_model.input_blocks.1.1.proj_in.lora_B.weight": torch.zeros(64, 4)}, str(path))
    model = _transformer(tiny_dir["2.0"]["checkpoint"])
    fuser = LoRAFuser(model)
    with pytest.raises(ValueError, match="none of its 1 LoRA layers") as err:
        fuser.fuse([read_lora(path)])
    assert str(path) in str(err.value)
    assert not fuser.active


def test_lora_of_wrong_width_names_shapes_and_touches_nothing(tiny_dir, tmp_path):
    tensors = _lora_tensors(tiny_dir["2.0"]["distilled_lora"])
    # a LoRA made for a wider model: to_k expects 64 -> 64 here
    tensors["diffusion_model.transformer_blocks.1.attn1.to_k.lora_A.weight"] = torch.zeros(4, 96)
    tensors["diffusion_model.transformer_blocks.1.attn1.to_k.lora_B.weight"] = torch.zeros(96, 4)
    path = tmp_path / "wide.safetensors"
    save_file(tensors, str(path))
    model = _transformer(tiny_dir["2.0"]["checkpoint"])
    original = _weights(model)
    fuser = LoRAFuser(model)
    with pytest.raises(ValueError) as err:
        fuser.fuse([read_lora(path)])
    msg = str(err.value)
    assert str(path) in msg and "transformer_blocks.1.attn1.to_k" in msg
    assert "(4, 96)" in msg and "(96, 4)" in msg and "64 -> 64" in msg
    assert not fuser.active and _states_equal(_weights(model), original)


def test_tiny_ic_lora_is_a_lora_with_the_reference_downscale_metadata(tmp_path):
    """The tiny IC-LoRA (the live IC-LoRA template's file): the distilled tiny LoRA's key layout and dtypes, other
    weights, and the `reference_downscale_factor` safetensors metadata that ComfyUI's GetICLoRAParameters reads."""
    from mgpu_backend.testing.tiny import write_tiny_ic_lora, write_tiny_lora

    plain = write_tiny_lora(tmp_path / "plain.safetensors", "2.3", seed=0)
    ic = write_tiny_ic_lora(tmp_path / "ic.safetensors", "2.3", seed=0)
    with safe_open(str(plain), "pt") as a, safe_open(str(ic), "pt") as b:
        assert b.metadata()["reference_downscale_factor"] == "2" and "reference_downscale_factor" not in a.metadata()
        assert sorted(a.keys()) == sorted(b.keys())
        key = next(k for k in a.keys() if k.endswith("lora_A.weight"))
        assert a.get_tensor(key).dtype == b.get_tensor(key).dtype and not torch.equal(a.get_tensor(key),
                                                                                      b.get_tensor(key))
    read = read_lora(ic, 1.0)  # the fleet's reader takes it as a plain LoRA, every pair understood
    assert read.index.keys() == read_lora(plain, 1.0).index.keys() and not read.unmatched_keys


def test_a_lora_whose_clean_bytes_do_not_fit_the_hosts_room_is_refused_before_any_weight(tiny_dir, monkeypatch):
    """Issue 36 item 1: the clean bytes a fuse keeps on the host (pinned host memory for GPU weights:
    `backup_device_for`) count against the host's room — MemAvailable or the cgroup's limit. A LoRA whose touched
    layers do not fit is refused with the numbers before any weight changes; one that fits fuses as before."""
    from mgpu_backend.protocol import resources as R
    from mgpu_backend.weights.lora import LoRAError, host_clean_bytes

    model = _transformer(tiny_dir["2.0"]["checkpoint"])
    original = _weights(model)
    lora = read_lora(tiny_dir["2.0"]["distilled_lora"])
    fuser = LoRAFuser(model)
    _, plan = fuser._plan([lora])
    need = host_clean_bytes(plan, 1)
    assert need == sum(layer.weight.numel() * 4 for _, layer, _ in plan) and len(plan) == 56  # float32, 56 layers
    source = "under the cgroup v2 memory limit of /sys/fs/cgroup/x: 2.0 GiB, 2.0 GiB in use; MemAvailable 20.0 GiB"
    monkeypatch.setattr(R, "memory_room", lambda root="/": R.MemoryRoom(need - 1, source))
    with pytest.raises(LoRAError) as e:
        fuser.fuse([lora])
    assert str(e.value) == (f"LoRA: fusing it keeps the clean bytes of the 56 layers it touches in host memory: "
                            f"{need / 2**30:.1f} GiB over the fleet's 1 rank(s), more than the {(need - 1) / 2**30:.1f} "
                            f"GiB available ({source}); use a LoRA on fewer layers, fewer ranks, or raise the memory "
                            f"limit")
    assert not fuser.active and _states_equal(_weights(model), original)
    monkeypatch.setattr(R, "memory_room", lambda root="/": R.MemoryRoom(need, source))
    assert [(r.matched, r.total) for r in fuser.fuse([lora])] == [(56, 56)] and fuser.clean_bytes == need
