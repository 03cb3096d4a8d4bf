"""Latent geometry: shapes, packing, audio frame rule, RoPE coordinates, normalization, masks (CPU, fast)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mgpu_backend.engine import latents as L


# --- constants and shapes -------------------------------------------------------------------------------------------


def test_constants():
    assert (L.VAE_TEMPORAL_COMPRESSION, L.VAE_SPATIAL_COMPRESSION, L.VIDEO_LATENT_CHANNELS) == (8, 32, 128)
    assert (L.AUDIO_LATENT_CHANNELS, L.AUDIO_LATENT_MEL_BINS, L.AUDIO_TOKEN_CHANNELS) == (8, 16, 128)
    assert L.AUDIO_LATENTS_PER_SECOND == 25.0  # 16000 / 160 / 4


@pytest.mark.parametrize(
    "frames,height,width,tokens",
    # Token counts measured in docs/design/models.md#shapes.
    [(121, 352, 640, 3520), (121, 704, 1280, 14080), (121, 1088, 1920, 32640), (241, 704, 1280, 27280)],
)
def test_video_token_counts(frames, height, width, tokens):
    assert L.video_token_count(frames, height, width) == tokens


def test_video_latent_shape():
    assert L.video_latent_shape(121, 704, 1280) == (1, 128, 16, 22, 40)
    assert L.video_latent_shape(1, 32, 64, batch=2) == (2, 128, 1, 1, 2)
    with pytest.raises(ValueError, match="8k\\+1"):
        L.video_latent_shape(120, 704, 1280)
    with pytest.raises(ValueError, match="height"):
        L.video_latent_shape(121, 700, 1280)
    with pytest.raises(ValueError, match="width"):
        L.video_latent_shape(121, 704, 1270)


@pytest.mark.parametrize(
    "frames,fps,ref,comfy",
    [
        (121, 24, 126, 127),  # 5.0417 s * 25 = 126.04
        (241, 24, 251, 252),  # 251.04
        (121, 25, 121, 121),  # exact
        (97, 24, 101, 102),  # 101.04
        (9, 24, 9, 10),  # 9.375
        (121, 30, 101, 101),  # 100.83
    ],
)
def test_audio_latent_frames(frames, fps, ref, comfy):
    # Reference (ltx_core.types.AudioLatentShape.from_duration) and diffusers use round(); ComfyUI uses ceil().
    assert L.audio_latent_frames(frames, fps) == ref == round(frames / fps * 25)
    assert L.audio_latent_frames(frames, fps, rounding="ceil") == comfy == math.ceil(frames / fps * 25)
    assert L.audio_latent_shape(frames, fps, batch=2) == (2, 8, ref, 16)


def test_audio_latent_frames_errors():
    with pytest.raises(ValueError, match="fps"):
        L.audio_latent_frames(121, 0)
    with pytest.raises(ValueError, match="rounding"):
        L.audio_latent_frames(121, 24, rounding="floor")  # type: ignore[arg-type]


# --- packing ------------------------------------------------------------------------------------------------------------


def test_pack_video_roundtrip_and_order():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, 3, 4, 5, generator=g)
    tok = L.pack_video(x)
    assert tok.shape == (2, 60, 128)
    # token index (f*H + h)*W + w carries channel vector x[:, :, f, h, w]
    f, h, w = 2, 1, 3
    assert torch.equal(tok[:, (f * 4 + h) * 5 + w], x[:, :, f, h, w])
    assert torch.equal(L.unpack_video(tok, 3, 4, 5), x)


def test_pack_video_matches_diffusers():
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    x = torch.randn(1, 128, 2, 3, 4)
    assert torch.equal(L.pack_video(x), LTX2Pipeline._pack_latents(x))
    assert torch.equal(L.unpack_video(L.pack_video(x), 2, 3, 4), LTX2Pipeline._unpack_latents(L.pack_video(x), 2, 3, 4))


def test_pack_audio_roundtrip_and_order():
    x = torch.randn(2, 8, 7, 16)
    tok = L.pack_audio(x)
    assert tok.shape == (2, 7, 128)
    c, t, m = 5, 3, 11
    assert tok[1, t, c * 16 + m] == x[1, c, t, m]  # feature index c*M + m ("b c t f -> b t (c f)")
    assert torch.equal(L.unpack_audio(tok), x)


def test_pack_audio_matches_diffusers():
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    x = torch.randn(1, 8, 5, 16)
    assert torch.equal(L.pack_audio(x), LTX2Pipeline._pack_audio_latents(x))
    assert torch.equal(L.unpack_audio(L.pack_audio(x)), LTX2Pipeline._unpack_audio_latents(L.pack_audio(x), 5, 16))


def test_pack_errors():
    with pytest.raises(ValueError, match="tokens"):
        L.unpack_video(torch.zeros(1, 10, 128), 2, 2, 2)
    with pytest.raises(ValueError, match="B, C, F, H, W"):
        L.pack_video(torch.zeros(1, 128, 2, 2))
    with pytest.raises(ValueError, match="feature size"):
        L.unpack_audio(torch.zeros(1, 3, 100))


# --- RoPE coordinates ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rope_model():
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    rope = LTX2AudioVideoRotaryPosEmbed(dim=24, scale_factors=(8, 32, 32), modality="video", num_attention_heads=2)
    audio_rope = LTX2AudioVideoRotaryPosEmbed(dim=24, scale_factors=[4], modality="audio", num_attention_heads=2)
    return SimpleNamespace(rope=rope, audio_rope=audio_rope)


def test_video_coords(tiny_rope_model):
    fps = 24.0
    c = L.video_coords(tiny_rope_model, 2, 3, 2, 4, fps)
    assert c.shape == (2, 3, 24, 2) and c.dtype == torch.float32
    # independent formula: reference get_pixel_coords with causal fix (first latent frame = 1 pixel frame)
    for f in range(3):
        for h in range(2):
            for w in range(4):
                i = (f * 2 + h) * 4 + w
                t0 = max(8 * f + 1 - 8, 0) / fps
                t1 = max(8 * (f + 1) + 1 - 8, 0) / fps
                exp = torch.tensor([[t0, t1], [32 * h, 32 * (h + 1)], [32 * w, 32 * (w + 1)]], dtype=torch.float32)
                torch.testing.assert_close(c[1, :, i], exp)


def test_audio_coords(tiny_rope_model):
    c = L.audio_coords(tiny_rope_model, 1, 5)
    assert c.shape == (1, 1, 5, 2)
    exp = torch.tensor(
        [[max(4 * t + 1 - 4, 0) * 160 / 16000, max(4 * (t + 1) + 1 - 4, 0) * 160 / 16000] for t in range(5)]
    )
    torch.testing.assert_close(c[0, 0], exp)  # [0, .01], [.01, .05], [.05, .09], ...


def test_coords_need_rope():
    with pytest.raises(TypeError, match="rope"):
        L.video_coords(object(), 1, 1, 1, 1, 24)


# --- normalization ----------------------------------------------------------------------------------------------------


def test_normalize_video_matches_diffusers_and_roundtrips():
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    x = torch.randn(1, 128, 2, 3, 4, dtype=torch.float64)
    mean, std = torch.randn(128, dtype=torch.float64), torch.rand(128, dtype=torch.float64) + 0.5
    n = L.normalize_latents(x, mean, std)
    torch.testing.assert_close(n, LTX2Pipeline._normalize_latents(x, mean, std, 1.0))
    torch.testing.assert_close(n[0, 7, 1, 2, 3], (x[0, 7, 1, 2, 3] - mean[7]) / std[7])
    torch.testing.assert_close(L.denormalize_latents(n, mean, std), x)
    # packed form applies the same per-channel statistics
    torch.testing.assert_close(L.normalize_latents(L.pack_video(x), mean, std), L.pack_video(n))


def test_normalize_audio_packed_stats():
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    x = torch.randn(1, 8, 6, 16, dtype=torch.float64)
    mean, std = torch.randn(128, dtype=torch.float64), torch.rand(128, dtype=torch.float64) + 0.5
    packed = L.normalize_audio_latents(L.pack_audio(x), mean, std)
    torch.testing.assert_close(packed, LTX2Pipeline._normalize_audio_latents(L.pack_audio(x), mean, std))
    unpacked = L.normalize_audio_latents(x, mean, std)
    assert unpacked.shape == x.shape
    torch.testing.assert_close(L.pack_audio(unpacked), packed)
    # channel c, mel bin m uses statistic index c*16 + m
    torch.testing.assert_close(unpacked[0, 3, 2, 9], (x[0, 3, 2, 9] - mean[3 * 16 + 9]) / std[3 * 16 + 9])
    torch.testing.assert_close(L.denormalize_audio_latents(unpacked, mean, std), x)


def test_normalize_bad_stats():
    with pytest.raises(ValueError, match="128"):
        L.normalize_latents(torch.zeros(1, 128, 1, 1, 1), torch.zeros(64), torch.ones(64))


# --- masks ----------------------------------------------------------------------------------------------------------------


def test_image_conditioning_mask():
    m = L.image_conditioning_mask(2, 4, strength=0.8)
    assert m.shape == (2, 1, 4, 1, 1) and m.dtype == torch.float32
    torch.testing.assert_close(m[:, 0, :, 0, 0], torch.tensor([[0.2, 1, 1, 1]] * 2))
    assert torch.all(L.image_conditioning_mask(1, 3, strength=1.0)[0, 0, 0] == 0)
    with pytest.raises(ValueError, match="strength"):
        L.image_conditioning_mask(1, 3, strength=1.5)


def test_video_token_mask_layout():
    m = L.image_conditioning_mask(1, 3, strength=1.0)
    tok = L.video_token_mask(m, 1, 3, 2, 5)
    assert tok.shape == (1, 30)
    assert torch.all(tok[0, :10] == 0) and torch.all(tok[0, 10:] == 1)  # first latent frame = first H*W tokens
    assert torch.all(L.video_token_mask(None, 2, 3, 2, 5) == 1)
    full = torch.rand(1, 1, 3, 2, 5)
    torch.testing.assert_close(L.video_token_mask(full, 1, 3, 2, 5), L.pack_video(full)[..., 0])
    with pytest.raises(ValueError, match="broadcast"):
        L.video_token_mask(torch.ones(1, 1, 4, 1, 1), 1, 3, 2, 5)


def test_audio_token_mask():
    m = torch.ones(1, 1, 5, 1)
    m[:, :, :2] = 0
    torch.testing.assert_close(L.audio_token_mask(m, 1, 5), torch.tensor([[0.0, 0, 1, 1, 1]]))
    assert L.audio_token_mask(None, 2, 5).shape == (2, 5)
