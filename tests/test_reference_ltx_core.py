"""Our components against Lightricks' reference implementation, `ltx-core` 1.0.0, on the same tiny checkpoints.

Both sides read the same original-layout single file (stored float32 here) and run in float32: ours through
`mgpu_backend.models.loader.load_components` (diffusers modules, our key maps), the reference through ltx-core's own
configurators (`from_config(<file's config metadata>)`) and its own key renames (`SDOps`), loaded with
`strict=True` (see `tests/_ltx_core.py`). Inputs are random; every comparison is on full tensors.

Tolerances (float32 on the CPU; outputs are O(1), max |x| about 3-5):
- exact (`torch.equal`) for the convolution stacks — latent upsampler, video VAE encoder and decoder (the tiny
  files, the LTX-2.3 block pattern, a timestep-conditioned decoder), audio VAE decoder, vocoders (2.0 HiFi-GAN and
  the 2.3 BWE chain, stage by stage): both sides run the same float32 ops in the same order, so any difference is
  a real one.
- 1e-6 absolute (about two float32 ulps at these magnitudes) for the feature extractor, the text connectors and the
  transformer forwards: measured bit-identical (max difference 0.0) on torch 2.13 CPU, but the two implementations
  reach attention through different call layouts (separate q/k/v reshapes, RMS-norm, RoPE tables built in float64
  and cast), so a torch release that picks another SDPA / matmul kernel for one of the layouts may move results by
  an ulp without anything being wrong. A real mismatch (a wrong mask, register, RoPE or AdaLN convention) shows
  up as differences of 1e-2 or more.

What ltx-core 1.0.0 cannot load as is, and how the tests get around it (each is an ltx-core limitation, not a
difference of the file):
- the feature extractor: `EmbeddingsProcessorConfigurator` hard-codes Gemma 3 12B's widths (3840 × 49); the tests
  build ltx-core's `FeatureExtractorV1` / `FeatureExtractorV2` with the tiny widths and load the file's
  `text_embedding_projection.*` strictly, through ltx-core's own `EMBEDDINGS_PROCESSOR_KEY_OPS`.
- the audio VAE decoder: ltx-core sizes `per_channel_statistics` by `ddconfig.ch` (128 only at the released
  width; the statistics are over the 8 × 16 = 128 packed latent features); the tests resize the two buffers to 128
  before the strict load.
- the text connectors run one prompt at a time: ltx-core 1.0.0's register replacement indexes with
  `mask.squeeze()` and fails for batch > 1 (docs/design/models.md#the-substrate-diffusers); our batched `text_contexts`
  is compared per prompt.
- the video encoder: ltx-core ignores `encoder_base_channels` (hard-coded 128, the released value); the LTX-2.3
  layout test keeps 128 there and small multipliers instead.
- `SingleGPUModelBuilder.build` loads with `strict=False` and builds on the meta device (the 2.0 caption
  projections even when asked for the CPU), so the tests build with the configurators and load strictly themselves.
- the transformer metadata must carry the 17 fixed architecture fields ltx-core asserts (`dropout`,
  `attention_bias`, ... `use_middle_indices_grid`), and `connector_positional_embedding_max_pos` (ltx-core's
  default [1] ≠ the [4096] of ComfyUI / diffusers / the released files): the tiny writer states them, as the
  released files do.
Skipped cleanly when ltx-core (or einops) is not installed.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("ltx_core", reason="the reference extra (ltx-core 1.0.0) is not installed")
pytest.importorskip("einops", reason="ltx-core needs einops")

from mgpu_backend.engine import latents as L  # noqa: E402
from mgpu_backend.engine.denoiser import LTX2Denoiser, text_contexts  # noqa: E402
from mgpu_backend.models.loader import ComponentFiles, load_components  # noqa: E402
from mgpu_backend.models.text_projection import make_conditioning  # noqa: E402
from mgpu_backend.testing.tiny import TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS, build_tiny_modules, tiny_vae_metadata, write_tiny_checkpoint, write_tiny_upsampler
from mgpu_backend.engine.sampling import GuidancePass, ModelInputs  # noqa: E402

from _ltx_core import build, import_ltx_core, load_strict, read_config, read_state  # noqa: E402

VARIANTS = ("2.0", "2.3")
TEXT_ATOL = 1e-6
TRANSFORMER_ATOL = 1e-6
CONTEXT_TOKENS = 1024  # the reference pads prompts to 1024 tokens (Gemma tokenizer max_length)


@pytest.fixture(scope="session")
def lc():
    try:
        return import_ltx_core()
    except ImportError as exc:  # pragma: no cover - importorskip above covers the usual case
        pytest.skip(f"ltx-core not importable: {exc}")


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """{variant: (checkpoint path, upsampler path)}: float32 tiny files (bf16 would do as well; float32 keeps the
    comparison independent of storage rounding)."""
    root = tmp_path_factory.mktemp("ltx_core_ref")
    out = {}
    for variant in VARIANTS:
        modules = build_tiny_modules(variant, seed=7)
        ckpt = write_tiny_checkpoint(root / f"ltx-{variant}-tiny.safetensors", variant, seed=7,
                                     dtype=torch.float32, modules=modules)
        ups = write_tiny_upsampler(root / f"ltx-{variant}-tiny-upscaler.safetensors", seed=7, modules=modules)
        out[variant] = (ckpt, ups)
    return out


@pytest.fixture(scope="session")
def ours(files):
    return {v: load_components(c, ComponentFiles(upsampler=u), dtype=torch.float32) for v, (c, u) in files.items()}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ---- text path -------------------------------------------------------------------------------------------------------

def _ref_embeddings_processor(lc, path, variant):
    """ltx-core's EmbeddingsProcessor: connectors from its configurators, feature extractor with the tiny widths."""
    config = read_config(lc, path)
    tmeta = config["transformer"]
    flat = TINY_GEMMA_HIDDEN * (TINY_GEMMA_LAYERS + 1)
    with torch.device("cpu"):
        if variant == "2.0":
            extractor = lc.FeatureExtractorV1(torch.nn.Linear(flat, TINY_GEMMA_HIDDEN, bias=False), is_av=True)
        else:
            v_dim = tmeta["num_attention_heads"] * tmeta["attention_head_dim"]
            a_dim = tmeta["audio_num_attention_heads"] * tmeta["audio_attention_head_dim"]
            extractor = lc.FeatureExtractorV2(torch.nn.Linear(flat, v_dim), TINY_GEMMA_HIDDEN,
                                              torch.nn.Linear(flat, a_dim))
        processor = lc.EmbeddingsProcessor(
            feature_extractor=extractor,
            video_connector=build(lc.Embeddings1DConnectorConfigurator, config),
            audio_connector=build(lc.AudioEmbeddings1DConnectorConfigurator, config))
    return load_strict(processor, read_state(lc, path, lc.EMBEDDINGS_PROCESSOR_KEY_OPS))


@pytest.fixture(scope="session")
def ref_text(lc, files):
    return {v: _ref_embeddings_processor(lc, files[v][0], v) for v in VARIANTS}


def _hidden_states(seed: int, tokens: int, valid: int, batch: int = 1):
    """Fake Gemma hidden states `[B, T, H, L]` and a LEFT-padded mask (the reference's tokenizer pads left)."""
    hidden = torch.randn(batch, tokens, TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS + 1, generator=_gen(seed)) * 3.0
    mask = torch.zeros(batch, tokens, dtype=torch.long)
    mask[:, tokens - valid:] = 1
    return hidden, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_feature_extractor_matches_reference(variant, ours, ref_text):
    """`TextProjection` = ltx-core `FeatureExtractorV1` (2.0) / `V2` (2.3), padded positions included."""
    hidden, mask = _hidden_states(1, tokens=48, valid=29, batch=2)
    mask[1, :40] = 0  # second row: 8 valid tokens
    got = ours[variant].text_projection(hidden, mask)
    video, audio = ref_text[variant].feature_extractor(hidden, mask, padding_side="left")
    want = video if variant == "2.0" else torch.cat([video, audio], dim=-1)
    assert _max_diff(got, want) <= TEXT_ATOL  # measured 0.0


def _ref_connectors(lc, processor, cond: torch.Tensor, variant: str, video_dim: int):
    """The reference's connector call on a CONDITIONING tensor: left-padded with zeros to 1024 tokens, additive
    mask, `EmbeddingsProcessor.create_embeddings` (registers replace the padding; binary mask applied to video)."""
    t = cond.shape[1]
    features = torch.zeros(1, CONTEXT_TOKENS, cond.shape[-1])
    features[:, CONTEXT_TOKENS - t:] = cond
    mask = torch.zeros(1, CONTEXT_TOKENS, dtype=torch.long)
    mask[:, CONTEXT_TOKENS - t:] = 1
    additive = lc.convert_to_additive_mask(mask, torch.float32)
    if variant == "2.0":
        v_in, a_in = features, features
    else:
        v_in, a_in = features[..., :video_dim], features[..., video_dim:]
    return processor.create_embeddings(v_in, a_in, additive)


@pytest.mark.parametrize("variant", VARIANTS)
def test_text_connectors_match_reference(variant, ours, ref_text, lc):
    """`text_contexts` on CONDITIONING-form embeddings = ltx-core's connectors on the same tokens.

    Conventions both sides share: prompts left-padded to 1024 tokens; the connector moves the valid tokens to the
    front and fills the rest with its 128 learnable registers (tiled), so every one of the 1024 context slots is
    valid afterwards (mask all ones) and the padded values never matter. Our batch of two prompts of different
    lengths equals the reference run one prompt at a time (it cannot batch, see module docstring).
    """
    comps = ours[variant]
    width = comps.video_connector.inner_dim + (comps.audio_connector.inner_dim if variant == "2.3" else 0)
    conds = [torch.randn(1, t, width, generator=_gen(10 + t)) for t in (17, 300)]
    ctx = text_contexts(comps, conds, dtype=torch.float32)
    assert ctx.video.shape[:2] == (2, CONTEXT_TOKENS) and bool((ctx.mask == 1).all())
    for i, cond in enumerate(conds):
        video, audio, mask = _ref_connectors(lc, ref_text[variant], cond, variant, comps.video_connector.inner_dim)
        assert bool((mask == 1).all())
        assert _max_diff(ctx.video[i:i + 1], video) <= TEXT_ATOL  # measured 0.0
        assert _max_diff(ctx.audio[i:i + 1], audio) <= TEXT_ATOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_text_path_from_hidden_states_matches_reference(variant, ours, ref_text):
    """Gemma hidden states -> our projection -> CONDITIONING (padding cut, as ComfyUI) -> connectors equals the
    reference's `process_hidden_states` on the left-padded 1024-token batch."""
    hidden, mask = _hidden_states(2, tokens=CONTEXT_TOKENS, valid=61)
    comps = ours[variant]
    cond = make_conditioning(comps.text_projection(hidden, mask), mask)[0][0]
    assert cond.shape[1] == 61
    ctx = text_contexts(comps, [cond], dtype=torch.float32)
    ref = ref_text[variant].process_hidden_states(hidden, mask, padding_side="left")
    assert _max_diff(ctx.video, ref.video_encoding) <= TEXT_ATOL
    assert _max_diff(ctx.audio, ref.audio_encoding) <= TEXT_ATOL
    assert torch.equal(ctx.mask.long(), ref.attention_mask.long())


# ---- audio, video VAE decoders, upsampler ----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_vocoder_matches_reference(variant, ours, files, lc):
    """2.0: HiFi-GAN `Vocoder`; 2.3: `VocoderWithBWE` (BigVGAN-v2 AMP vocoder at 16 kHz, causal log-mel from the
    file's STFT / mel bases, BWE generator + hann-sinc resampled skip to 48 kHz)."""
    path = files[variant][0]
    ref = load_strict(build(lc.VocoderConfigurator, read_config(lc, path)),
                      read_state(lc, path, lc.VOCODER_COMFY_KEYS_FILTER))
    assert isinstance(ref, lc.VocoderWithBWE) == (variant == "2.3")
    mel = torch.randn(1, 2, 13, 64, generator=_gen(3))
    with torch.no_grad():
        got, want = ours[variant].vocoder(mel), ref(mel)
    assert got.shape == want.shape
    assert torch.equal(got, want), _max_diff(got, want)
    if variant == "2.3":
        # the tiny BigVGAN has a large gain, so most final samples sit at the ±1 clamp: compare the stages unclamped
        # too (first-stage generator without its final clamp, BWE residual, resampled skip)
        ours_bwe = ours[variant].vocoder
        with torch.no_grad():
            clamped = ref.vocoder(mel)
            assert torch.equal(ours_bwe.vocoder(mel), clamped)
            ours_bwe.vocoder.final_act_fn, ref.vocoder.apply_final_activation = None, False
            try:
                raw_got, raw_want = ours_bwe.vocoder(mel), ref.vocoder(mel)
            finally:
                ours_bwe.vocoder.final_act_fn, ref.vocoder.apply_final_activation = "clamp", True
            assert raw_want.abs().max() > 1.0 and torch.equal(raw_got, raw_want)
            x = torch.nn.functional.pad(clamped, (0, (-clamped.shape[-1]) % ref.hop_length))
            mel_bwe = ref._compute_mel(x).transpose(2, 3)
            assert float(mel_bwe.std()) > 0.1  # real STFT / mel bases in the file, not zeros
            assert torch.equal(ours_bwe.bwe_generator(mel_bwe), ref.bwe_generator(mel_bwe))
            assert torch.equal(ours_bwe.resampler(x), ref.resampler(x))
    rate = ref.output_sampling_rate
    assert ours[variant].vocoder.config.output_sampling_rate == rate == (48000 if variant == "2.3" else 24000)


@pytest.mark.parametrize("variant", VARIANTS)
def test_audio_vae_decoder_matches_reference(variant, ours, files, lc):
    path = files[variant][0]

    def stats_128(decoder):  # ltx-core sizes the statistics by `ch` (see module docstring)
        for name in ("std-of-means", "mean-of-means"):
            decoder.per_channel_statistics.register_buffer(name, torch.empty(128))

    ref = load_strict(build(lc.AudioDecoderConfigurator, read_config(lc, path), fix=stats_128),
                      read_state(lc, path, lc.AUDIO_VAE_DECODER_COMFY_KEYS_FILTER))
    latent = torch.randn(1, 8, 6, 16, generator=_gen(4))  # model space (normalized)
    vae = ours[variant].audio_vae
    with torch.no_grad():
        got = vae.decode(L.denormalize_audio_latents(latent, vae.latents_mean, vae.latents_std),
                         return_dict=False)[0]
        want = ref(latent)
    assert got.shape == want.shape
    assert torch.equal(got, want), _max_diff(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_video_vae_decoder_matches_reference(variant, ours, files, lc):
    path = files[variant][0]
    # the statistics that are stored but unused (`mean-of-stds`, like the released files) have no slot in ltx-core's
    # decoder either; its own builder loads non-strictly and skips them
    unused = ("per_channel_statistics.mean-of-stds", "per_channel_statistics.channel")
    ref = load_strict(build(lc.VideoDecoderConfigurator, read_config(lc, path)),
                      read_state(lc, path, lc.VAE_DECODER_COMFY_KEYS_FILTER, drop_prefixes=unused))
    latent = torch.randn(1, 128, 2, 2, 3, generator=_gen(5))  # model space
    vae = ours[variant].video_vae
    with torch.no_grad():
        got = vae.decode(L.denormalize_latents(latent, vae.latents_mean, vae.latents_std), return_dict=False)[0]
        want = ref(latent)
    assert got.shape == want.shape == (1, 3, 9, 64, 96)
    assert torch.equal(got, want), _max_diff(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_video_vae_encoder_matches_reference(variant, ours, files, lc):
    """Our `encode` (latent mean, normalized with the file's statistics) = ltx-core `VideoEncoder` (normalized
    means). The tiny file states `spatial_padding_mode: reflect`, which both encoders honour."""
    path = files[variant][0]
    unused = ("per_channel_statistics.mean-of-stds", "per_channel_statistics.channel")
    ref = load_strict(build(lc.VideoEncoderConfigurator, read_config(lc, path)),
                      read_state(lc, path, lc.VAE_ENCODER_COMFY_KEYS_FILTER, drop_prefixes=unused))
    video = torch.rand(1, 3, 9, 64, 96, generator=_gen(12)) * 2 - 1
    vae = ours[variant].video_vae
    with torch.no_grad():
        got = L.normalize_latents(vae.encode(video).latent_dist.mode(), vae.latents_mean, vae.latents_std)
        want = ref(video)
    assert got.shape == want.shape == (1, 128, 2, 2, 3)
    assert torch.equal(got, want), _max_diff(got, want)


def _ltx23_vae_metadata() -> dict:
    """The block pattern of the released LTX-2.3 video VAE (`ltx-2.3-22b-*.safetensors` metadata: the decoder mixes
    `compress_space`, `compress_time` and `compress_all` with multipliers 2, 2, 1, 2; the encoder's last
    downsampler keeps the width) at small widths, `spatial_padding_mode: zeros` like the released file.
    The encoder starts at 128 channels: ltx-core 1.0.0's `VideoEncoder` ignores `encoder_base_channels` (hard-coded
    128, the released value), so the multipliers are kept small instead."""
    meta = tiny_vae_metadata()
    res = lambda n: ["res_x", {"num_layers": n}]  # noqa: E731
    meta.update({
        "encoder_base_channels": 128, "decoder_base_channels": 8, "spatial_padding_mode": "zeros",
        "encoder_blocks": [res(1), ["compress_space_res", {"multiplier": 1}], res(2),
                           ["compress_time_res", {"multiplier": 1}], res(1), ["compress_all_res", {"multiplier": 2}],
                           res(1), ["compress_all_res", {"multiplier": 1}], res(1)],
        "decoder_blocks": [res(2), ["compress_space", {"multiplier": 2}], res(3), ["compress_time", {"multiplier": 2}],
                           res(1), ["compress_all", {"multiplier": 1}], res(2), ["compress_all", {"multiplier": 2}],
                           res(1)],
    })
    return meta


def _write_vae_file(path, meta: dict, seed: int):
    """A video-VAE-only file (`vae.*` keys, `config.vae`) written from a diffusers module built by our config
    translation and key map (random weights, statistics included)."""
    from diffusers import AutoencoderKLLTX2Video
    from safetensors.torch import save_file

    from mgpu_backend.models import configs, keymaps

    kwargs = configs.video_vae_kwargs(meta)
    module = AutoencoderKLLTX2Video(**kwargs)
    g = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1 / max(1, p[0].numel()) ** 0.5 if p.ndim > 1 else 0.05))
        module.latents_mean.copy_(0.1 * torch.randn(128, generator=g))
        module.latents_std.copy_(0.5 + torch.rand(128, generator=g))
    stages = len(kwargs["block_out_channels"])
    state = {keymaps.VIDEO_VAE_PREFIX + keymaps.video_vae_to_original(k, stages): v.contiguous()
             for k, v in module.state_dict().items()}
    save_file(state, str(path), metadata={"config": json.dumps({"vae": meta})})
    return path


def test_ltx23_video_vae_layout_matches_reference(tmp_path, lc):
    """Our loader builds the LTX-2.3 decoder (mixed spatial / temporal / spatio-temporal upsamplers, a multiplier-1
    stage) with exactly ltx-core's modules: the file loads strictly into both, and decode / encode agree."""
    from mgpu_backend.models.loader import SafetensorsFile, load_video_vae

    path = _write_vae_file(tmp_path / "ltx-2.3-vae-layout.safetensors", _ltx23_vae_metadata(), seed=13)
    vae = load_video_vae(SafetensorsFile(path), torch.float32)
    config = read_config(lc, path)
    decoder = load_strict(build(lc.VideoDecoderConfigurator, config),
                          read_state(lc, path, lc.VAE_DECODER_COMFY_KEYS_FILTER))
    encoder = load_strict(build(lc.VideoEncoderConfigurator, config),
                          read_state(lc, path, lc.VAE_ENCODER_COMFY_KEYS_FILTER))
    latent = torch.randn(1, 128, 2, 2, 3, generator=_gen(14))
    video = torch.rand(1, 3, 9, 64, 96, generator=_gen(15)) * 2 - 1
    with torch.no_grad():
        got = vae.decode(L.denormalize_latents(latent, vae.latents_mean, vae.latents_std), return_dict=False)[0]
        want = decoder(latent)
        enc = L.normalize_latents(vae.encode(video).latent_dist.mode(), vae.latents_mean, vae.latents_std)
        enc_want = encoder(video)
    assert got.shape == want.shape == (1, 3, 9, 64, 96)
    assert torch.equal(got, want), _max_diff(got, want)
    assert torch.equal(enc, enc_want), _max_diff(enc, enc_want)


def test_timestep_conditioned_video_vae_matches_reference(tmp_path, lc):
    """A decoder with `timestep_conditioning` (per-block time embedders, the decoder-level `last_time_embedder` /
    `last_scale_shift_table`) loads through our key map and decodes like ltx-core at the reference's decode
    timestep 0.05 (ltx-core's decode noise switched off on both sides: the noise itself is the caller's)."""
    from mgpu_backend.models.loader import SafetensorsFile, load_video_vae

    meta = {**tiny_vae_metadata(), "timestep_conditioning": True}
    path = _write_vae_file(tmp_path / "ltx-vae-timestep.safetensors", meta, seed=16)
    vae = load_video_vae(SafetensorsFile(path), torch.float32)
    decoder = load_strict(build(lc.VideoDecoderConfigurator, read_config(lc, path)),
                          read_state(lc, path, lc.VAE_DECODER_COMFY_KEYS_FILTER))
    decoder.decode_noise_scale = 0.0
    latent = torch.randn(1, 128, 2, 2, 3, generator=_gen(17))
    with torch.no_grad():
        got = vae.decode(L.denormalize_latents(latent, vae.latents_mean, vae.latents_std),
                         torch.tensor([0.05]), return_dict=False)[0]
        want = decoder(latent, timestep=torch.tensor([0.05]))
    assert torch.equal(got, want), _max_diff(got, want)


_RES = lambda n, **kw: ["res_x", {"num_layers": n, **kw}]  # noqa: E731
RELEASED_VAE_LAYOUTS = {
    # ltx-2.3-22b-*.safetensors `config.vae`
    "2.3": {"encoder_blocks": [_RES(4), ["compress_space_res", {"multiplier": 2}], _RES(6),
                               ["compress_time_res", {"multiplier": 2}], _RES(4),
                               ["compress_all_res", {"multiplier": 2}], _RES(2),
                               ["compress_all_res", {"multiplier": 1}], _RES(2)],
            "decoder_blocks": [_RES(4), ["compress_space", {"multiplier": 2}], _RES(6),
                               ["compress_time", {"multiplier": 2}], _RES(4), ["compress_all", {"multiplier": 1}],
                               _RES(2), ["compress_all", {"multiplier": 2}], _RES(2)],
            "spatial_padding_mode": "zeros", "timestep_conditioning": False},
    # ltx-2-19b-*.safetensors (diffusers' LTX-2 converter configuration)
    "2.0": {"encoder_blocks": [_RES(4), ["compress_space_res", {"multiplier": 2}], _RES(6),
                               ["compress_time_res", {"multiplier": 2}], _RES(6),
                               ["compress_all_res", {"multiplier": 2}], _RES(2),
                               ["compress_all_res", {"multiplier": 2}], _RES(2)],
            "decoder_blocks": [_RES(5, inject_noise=False), ["compress_all", {"residual": True, "multiplier": 2}]] * 3
                              + [_RES(5, inject_noise=False)],
            "timestep_conditioning": False},
}


@pytest.mark.parametrize("layout", ["2.3", "2.0", "2.0-timestep"])
def test_released_video_vae_layouts_build_reference_modules(layout, lc):
    """At the released widths (built on the meta device, no memory): the diffusers VAE our config translation builds
    has, through our key map, exactly the keys and shapes of ltx-core's VideoEncoder + VideoDecoder for the same
    metadata."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLLTX2Video

    from mgpu_backend.models import configs, keymaps

    meta = {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
            "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False,
            "encoder_base_channels": 128, "decoder_base_channels": 128,
            **RELEASED_VAE_LAYOUTS[layout.split("-")[0]]}
    if layout.endswith("timestep"):
        meta["timestep_conditioning"] = True
    kwargs = configs.video_vae_kwargs(meta)
    with init_empty_weights():
        ours = AutoencoderKLLTX2Video(**kwargs)
    stages = len(kwargs["block_out_channels"])
    got = {keymaps.video_vae_to_original(k, stages): tuple(v.shape) for k, v in ours.state_dict().items()}
    with torch.device("meta"):
        decoder = lc.VideoDecoderConfigurator.from_config({"vae": meta})
        encoder = lc.VideoEncoderConfigurator.from_config({"vae": meta})
    want = {f"{side}.{k}": tuple(v.shape) for side, module in (("decoder", decoder), ("encoder", encoder))
            for k, v in module.state_dict().items() if not k.startswith("per_channel_statistics.")}
    want.update({k: tuple(v.shape) for k, v in encoder.state_dict().items() if k.startswith("per_channel")})
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    assert {k: v for k, v in got.items() if want[k] != v} == {}


def test_latent_upsampler_matches_reference(ours, files, lc):
    path = files["2.0"][1]
    ref = load_strict(build(lc.LatentUpsamplerConfigurator, read_config(lc, path)), read_state(lc, path))
    latent = torch.randn(1, 128, 2, 3, 4, generator=_gen(6))
    with torch.no_grad():
        got, want = ours["2.0"].upsampler(latent), ref(latent)
    assert got.shape == want.shape == (1, 128, 2, 6, 8)
    assert torch.equal(got, want), _max_diff(got, want)


# ---- transformer ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def ref_transformers(lc, files):
    out = {}
    for variant in VARIANTS:
        path = files[variant][0]
        out[variant] = load_strict(
            build(lc.LTXModelConfigurator, read_config(lc, path)),
            read_state(lc, path, lc.LTXV_MODEL_COMFY_RENAMING_MAP,
                       drop_prefixes=("video_embeddings_connector.", "audio_embeddings_connector.")))
    return out


PASSES = {
    "cond": GuidancePass("cond"),
    "perturbed": GuidancePass("perturbed", video_stg_blocks=(1,), audio_stg_blocks=(0,)),
    "isolated": GuidancePass("isolated"),
}


def _ref_perturbations(lc, kind: str):
    from ltx_core.guidance.perturbations import Perturbation, PerturbationConfig, PerturbationType as P

    if kind == "cond":
        items = []
    elif kind == "perturbed":
        items = [Perturbation(P.SKIP_VIDEO_SELF_ATTN, [1]), Perturbation(P.SKIP_AUDIO_SELF_ATTN, [0])]
    else:
        items = [Perturbation(P.SKIP_A2V_CROSS_ATTN, None), Perturbation(P.SKIP_V2A_CROSS_ATTN, None)]
    return lc.BatchedPerturbationConfig([PerturbationConfig(items)])


@pytest.mark.parametrize("kind", list(PASSES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_transformer_forward_matches_reference(variant, kind, ours, ref_text, ref_transformers, lc):
    """One denoiser forward (our `LTX2Denoiser`, diffusers transformer) = ltx-core `LTXModel` on the same inputs:
    connector contexts, per-token timesteps (first latent frame conditioned: timestep 0), different video / audio
    sigmas, RoPE [start, end) positions at 25 fps. Also the STG pass (video self-attention skipped in block 1,
    audio in block 0) and the modality-isolated pass (a2v / v2a cross-attention off)."""
    comps = ours[variant]
    tr = comps.transformer
    frames, h, w, audio_frames = 2, 2, 3, 5
    g = _gen(8)
    video = torch.randn(1, frames * h * w, 128, generator=g)
    audio = torch.randn(1, audio_frames, 128, generator=g)
    v_sigma, a_sigma = torch.tensor([0.7]), torch.tensor([0.45])
    v_steps = L.video_token_mask(L.image_conditioning_mask(1, frames), 1, frames, h, w) * v_sigma
    a_steps = torch.full((1, audio_frames), 0.45)
    width = comps.video_connector.inner_dim + (comps.audio_connector.inner_dim if variant == "2.3" else 0)
    cond = torch.randn(1, 23, width, generator=g)
    ctx = text_contexts(comps, [cond], dtype=torch.float32)
    v_coords = L.video_coords(tr, 1, frames, h, w, fps=25.0)
    a_coords = L.audio_coords(tr, 1, audio_frames)

    denoiser = LTX2Denoiser(tr, ctx, None, v_coords, a_coords, torch.float32)
    got_v, got_a = denoiser(ModelInputs(video, audio, v_steps, a_steps, v_sigma, a_sigma, PASSES[kind], 0))

    r_video, r_audio, r_mask = _ref_connectors(lc, ref_text[variant], cond, variant, comps.video_connector.inner_dim)
    assert _max_diff(ctx.video, r_video) <= TEXT_ATOL
    vm = lc.Modality(latent=video, sigma=v_sigma, timesteps=v_steps, positions=v_coords, context=r_video,
                     context_mask=r_mask)
    am = lc.Modality(latent=audio, sigma=a_sigma, timesteps=a_steps, positions=a_coords, context=r_audio,
                     context_mask=r_mask)
    with torch.no_grad():
        want_v, want_a = ref_transformers[variant](vm, am, _ref_perturbations(lc, kind))
    assert _max_diff(got_v, want_v) <= TRANSFORMER_ATOL  # measured 0.0 (all three passes, both variants)
    assert _max_diff(got_a, want_a) <= TRANSFORMER_ATOL
