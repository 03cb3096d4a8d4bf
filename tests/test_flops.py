"""`engine/flops.py` against a count that is not ours: `torch.utils.flop_counter.FlopCounterMode` running the real
diffusers LTX-2 transformer (tiny random weights on CPU, and the released 19B / 22B widths on the meta device, where
no arithmetic runs but every aten matmul is dispatched with its real shape).

FlopCounterMode counts aten mm / addmm / bmm / baddbmm / _scaled_mm / convolution and the fused SDPA kernels (CUDA's
flash / efficient / cuDNN); it does not count CPU's fused SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`)
nor any elementwise op. The tests therefore run SDPA's math backend (`sdpa_kernel(SDPBackend.MATH)`): attention
decomposes into the two bmm's FlopCounterMode counts, the same 4·Tq·Tk·D the fused kernels are credited with.
Everything the function counts is then counted there too, so the counts must match exactly.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mgpu_backend.engine import latents as L
from mgpu_backend.engine import forward as model_forward
from mgpu_backend.engine.attention import use_processor
from mgpu_backend.engine.denoiser import per_item_perturbations, skip_self_attention
from mgpu_backend.models import configs
from mgpu_backend.models.families import get_family
from mgpu_backend.testing.tiny import tiny_transformer_metadata
from mgpu_backend.engine import flops as F
from mgpu_backend.engine.sampling import GuidancePass
from mgpu_backend.engine.tokens import TokenBatch

GRID = (2, 2, 3)  # latent frames, height, width -> 12 video tokens
AUDIO, TEXT = 5, 7


def _model(meta: dict, device: str = "cpu"):
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device(device):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta))
    return model.eval().requires_grad_(False)


def _kwargs(model, batch: int, grid=GRID, audio=AUDIO, text=TEXT, device="cpu"):
    f, h, w = grid
    n = f * h * w
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    caption = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.cross_attention_dim
    audio_caption = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.audio_cross_attention_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device) if device != "meta" else torch.empty(*shape, device="meta")

    return dict(hidden_states=rnd(batch, n, cfg.in_channels), audio_hidden_states=rnd(batch, audio, 128),
                encoder_hidden_states=rnd(batch, text, caption), audio_encoder_hidden_states=rnd(batch, text,
                                                                                                 audio_caption),
                timestep=torch.full((batch, n), 700.0, device=device),
                audio_timestep=torch.full((batch, audio), 700.0, device=device),
                sigma=torch.full((batch,), 700.0, device=device), audio_sigma=torch.full((batch,), 700.0, device=device),
                encoder_attention_mask=torch.ones(batch, text, device=device),
                audio_encoder_attention_mask=torch.ones(batch, text, device=device),
                video_coords=L.video_coords(model, batch, f, h, w, 24.0, device=device),
                audio_coords=L.audio_coords(model, batch, audio, device=device), use_cross_timestep=True)


def _counted(fn) -> int:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("variant", ["2.0", "2.3", "2.5"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny_forward_matches_flop_counter(variant, batch):
    model = _model(tiny_transformer_metadata(variant))
    use_processor(model)
    kw = _kwargs(model, batch)
    shape = F.TransformerShape.of(model.config)
    expected = F.forward_flops(shape, 12, AUDIO, TEXT, batch)
    # the engine's one forward and diffusers' own forward, both counted by torch
    assert _counted(lambda: model_forward.call_diffusers(model, **kw)) == expected.total
    assert _counted(lambda: model(**kw, return_dict=False)) == expected.total


def test_per_row_timesteps_and_isolated_pass():
    model = _model(tiny_transformer_metadata("2.3"))
    kw = _kwargs(model, 1)
    shape = F.TransformerShape.of(model.config)
    per_row = dict(kw, timestep=torch.full((1, 1), 700.0), audio_timestep=torch.full((1, 1), 700.0))
    assert _counted(lambda: model_forward.call_diffusers(model, **per_row)) == \
        F.forward_flops(shape, 12, AUDIO, TEXT, variant=F.ForwardVariant(timestep_per_token=False)).total
    isolated = F.forward_flops(shape, 12, AUDIO, TEXT, variant=F.ForwardVariant(cross_modal=False))
    assert _counted(lambda: model_forward.call_diffusers(model, **kw, isolate_modalities=True)) == isolated.total
    assert isolated.parts["cross-modal linear"] == isolated.parts["cross-modal attention"] == 0


def test_native_cross_timesteps_per_token():
    """ComfyUI's native forward feeds per-token cross-attention AdaLN inputs (`stages/native.py`): counted per token."""
    model = _model(tiny_transformer_metadata("2.0"))
    kw = _kwargs(model, 1)
    batch = TokenBatch.from_diffusers(model.config, **kw)
    n = batch.video_tokens
    import dataclasses

    batch = dataclasses.replace(batch, video_cross_timestep=torch.full((1, n), 700.0),
                                audio_cross_timestep=torch.full((1, AUDIO), 700.0))
    got = _counted(lambda: model_forward.run_eager(model, batch))
    shape = F.TransformerShape.of(model.config)
    assert got == F.forward_flops(shape, n, AUDIO, TEXT, variant=F.ForwardVariant(cross_timestep_per_token=True)).total


def test_stg_pass_skips_its_blocks_self_attention():
    model = _model(tiny_transformer_metadata("2.0"))
    use_processor(model)
    kw = _kwargs(model, 1)
    shape = F.TransformerShape.of(model.config)
    with skip_self_attention(model, (1,), (0, 1)):
        got = _counted(lambda: model_forward.call_diffusers(model, **kw))
    assert got == F.forward_flops(shape, 12, AUDIO, TEXT,
                                variant=F.ForwardVariant(video_skip_blocks=1, audio_skip_blocks=2)).total
    assert got < F.forward_flops(shape, 12, AUDIO, TEXT).total


def test_batched_guidance_forward_executes_every_pass_in_full():
    """The batched forward of the 4 guidance passes (`LTX2Denoiser.batch`): each item runs the full attention and the
    STG item's value path on top (picked per item), the isolated item its cross-modal attention ×0 — so torch counts
    4 full forwards + the STG block's value projections; the recipe's model FLOPs (each pass as its own forward) are
    less, which is what bench_e2e reports."""
    model = _model(tiny_transformer_metadata("2.0"))
    use_processor(model)
    kw = _kwargs(model, 4)
    shape = F.TransformerShape.of(model.config)
    passes = [GuidancePass("cond"), GuidancePass("uncond"), GuidancePass("perturbed", (1,), (1,)),
              GuidancePass("isolated")]
    with per_item_perturbations(model, passes):
        got = _counted(lambda: model_forward.call_diffusers(model, **kw))
    d, da = shape.video_dim, shape.audio_dim
    extra_value_path = 4 * (2 * 12 * 2 * d * d + 2 * AUDIO * 2 * da * da)  # v + out of attn1 / audio_attn1, 4 items
    assert got == F.forward_flops(shape, 12, AUDIO, TEXT, 4).total + extra_value_path


@pytest.mark.parametrize("family", ["2.0", "2.5"])
def test_released_widths_on_the_meta_device(family):
    """The 19B (2.0) and 22B (2.5) widths: 2 of the 48 blocks built on the meta device (no memory, no arithmetic),
    torch's count of the forward's matmuls equals the function's."""
    shape48 = F.family_shape(family)
    two = F.family_shape(family, blocks=2)
    meta = {"num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
            "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
            "caption_channels": 3840, "num_layers": 2, **get_family(family).transformer_flags}
    model = _model(meta, device="meta")
    assert F.TransformerShape.of(model.config) == two
    grid, audio, text = (2, 4, 6), 9, 16
    kw = _kwargs(model, 1, grid, audio, text, device="meta")
    assert _counted(lambda: model_forward.call_diffusers(model, **kw)) == F.forward_flops(two, 48, audio, text).total
    # per video token, 48 blocks: the blocks' linear layers ≈ 25.8 GFLOP (docs/design/models.md#shapes; exactly
    # 2·48·(14·D² + 4·D·Da) = 25.770 G on 2.0, + the 2.3 / 2.5 gate logits 0.038 G)
    per_token = F.linear_flops_per_video_token(shape48)
    assert per_token == 48 * 2 * (14 * 4096**2 + 4 * 4096 * 2048) + (0 if family == "2.0" else 48 * 2 * 4096 * 96)
    assert per_token / 1e9 == pytest.approx(25.8, abs=0.05)
    # the marginal cost of one more video token without attention (N → N+1 at fixed N² terms excluded): the blocks'
    # linear layers + the per-token timestep embedding (0.24 G on 2.0: 6 AdaLN parameters; 0.34 G on 2.5: 9) + io
    a, b = (F.forward_flops(shape48, n, 126, 1024) for n in (10_000, 10_001))
    marginal = (b.linear - a.linear) / 1e9
    adaln = (256 * 4096 + 4096**2 + (6 if family == "2.0" else 9) * 4096**2) * 2 / 1e9
    assert marginal == pytest.approx(per_token / 1e9 + adaln + 2 * 2 * 128 * 4096 / 1e9, rel=1e-12)


def test_ltx25_distilled_template_total():
    """The issue's floor: LTX-2.5 distilled 1920×1088×121, 8 stage-1 steps at 960×544 + 3 stage-2 steps, one forward
    each. The first estimate (docs/design/baselines.md#the-floor) was ≈ 7.1 PFLOP from 25.8 GFLOP per token +
    4·T²·4096·48; the full count (text cross-attention over 1024 positions, audio stream, AdaLN, cross-modal) is given
    here, and it is larger."""
    shape = F.family_shape("2.5")
    s1 = L.video_token_count(121, 544, 960)
    s2 = L.video_token_count(121, 1088, 1920)
    assert (s1, s2) == (8160, 32640)
    audio = L.audio_latent_frames(121, 24.0)
    total = 8 * F.forward_flops(shape, s1, audio, 1024).total + 3 * F.forward_flops(shape, s2, audio, 1024).total
    estimate = sum(k * (25.8e9 * t + 4 * t * t * 4096 * 48) for k, t in ((8, s1), (3, s2)))
    assert estimate / 1e15 == pytest.approx(7.1, abs=0.1)
    assert 1.0 < total / estimate < 1.15


def test_dense_peaks():
    assert F.dense_peak("NVIDIA H200", torch.bfloat16).tflops == 989.4
    assert F.dense_peak("NVIDIA H200", "fp8").tflops == 1978.9
    assert F.dense_peak("NVIDIA H100 80GB HBM3", torch.bfloat16).tflops == 989.4
    assert F.dense_peak("NVIDIA H100 PCIe", torch.bfloat16).tflops == 756.5
    assert F.dense_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16).tflops == 312.0
    assert F.dense_peak("NVIDIA L40S", "fp8").tflops == 733.0
    unknown = F.dense_peak("NVIDIA A100-SXM4-80GB", "fp8")
    assert unknown.tflops is None and unknown.fraction(1e15) is None and "no fp8" in unknown.reason
    for name in ("NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA GH200 480GB"):  # not the SXM figure by a substring
        assert F.dense_peak(name, torch.bfloat16).tflops is None
    assert F.dense_peak("NVIDIA GeForce RTX 5090", torch.bfloat16).tflops is None
    cpu = F.dense_peak("cpu", torch.float32)
    assert cpu.tflops is None and "not in the dense-peak table" in cpu.describe()
    assert F.dense_peak("NVIDIA H200", "bf16").fraction(494.7e12) == pytest.approx(0.5)


def test_bad_input_is_refused():
    shape = F.family_shape("2.0")
    with pytest.raises(ValueError, match="video_tokens"):
        F.forward_flops(shape, -1, 0, 0)
    with pytest.raises(ValueError, match="skipped blocks"):
        F.forward_flops(shape, 10, 0, 0, variant=F.ForwardVariant(video_skip_blocks=49))
    with pytest.raises(ValueError, match="blocks"):
        F.TransformerShape(blocks=0)
