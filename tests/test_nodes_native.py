"""Conversion between ComfyUI's native types and engine tensors (`nodes/native_types.py`), on hand-built inputs.

Runs without ComfyUI: a stand-in NestedTensor mimics `comfy.nested_tensor.NestedTensor` (a `.tensors` list,
`.unbind()`, `.shape` of the first tensor), and native LATENT / CONDITIONING / NOISE values are built the way
ComfyUI's own nodes build them (EmptyLTXVLatentVideo, LTXVEmptyLatentAudio, LTXVConcatAVLatent, LTXVImgToVideo,
RandomNoise via `comfy.sample.prepare_noise`, the LTX-2 text encoder + LTXVConditioning).
"""
from __future__ import annotations

import math

import pytest
import torch

from mgpu_backend.protocol.stage_requests import ComfyGuides
from nodes import native_types as NT


class FakeNested:
    """Stand-in for comfy.nested_tensor.NestedTensor (only what ComfyUI's LTX nodes and ours touch)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def unbind(self):
        return self.tensors

    @property
    def shape(self):
        return self.tensors[0].shape


def empty_video(frames=25, width=256, height=128):  # EmptyLTXVLatentVideo
    return {"samples": torch.zeros(1, 128, (frames - 1) // 8 + 1, height // 32, width // 32)}


def empty_audio(frames=25, fps=25):  # LTXVEmptyLatentAudio
    return {"samples": torch.zeros(1, 8, math.ceil(frames / fps * 25), 16), "type": "audio"}


def concat(video, audio):  # LTXVConcatAVLatent
    out = {**video, **audio}
    vm, am = video.get("noise_mask"), audio.get("noise_mask")
    if vm is not None or am is not None:
        out["noise_mask"] = FakeNested([vm if vm is not None else torch.ones_like(video["samples"]),
                                        am if am is not None else torch.ones_like(audio["samples"])])
    out["samples"] = FakeNested([video["samples"], audio["samples"]])
    return out


def i2v(video, strength=0.8):  # LTXVImgToVideo's latent: mask 1 - strength on the first latent frame
    mask = torch.ones(1, 1, video["samples"].shape[2], 1, 1)
    mask[:, :, :1] = 1.0 - strength
    return {**video, "noise_mask": mask}


def conditioning(t=7, c=64, **extra):
    return [[torch.randn(1, t, c), {"pooled_output": None, "unprocessed_ltxav_embeds": True, **extra}]]


# ---- LATENT ------------------------------------------------------------------------------------------------------


def test_split_av_latent_and_join_keeps_structure():
    latent = concat(empty_video(), empty_audio())
    latent["samples"].tensors[0].normal_()
    parts = NT.split_latent(latent)
    assert parts.nested and parts.video_mask is None
    assert parts.video.shape == (1, 128, 4, 4, 8) and parts.audio.shape == (1, 8, 25, 16)
    assert torch.equal(parts.video, latent["samples"].tensors[0])
    v2, a2 = torch.randn_like(parts.video), torch.randn_like(parts.audio)
    out = NT.join_latent(latent, v2, a2, nest=FakeNested)
    assert NT.is_nested(out["samples"]) and out["type"] == "audio"  # other keys carried, like ComfyUI's nodes
    assert out["samples"].tensors[0] is v2 and out["samples"].tensors[1] is a2
    assert latent["samples"].tensors[0] is not v2  # the input is not modified


def test_split_video_only_latent():
    latent = empty_video()
    parts = NT.split_latent(latent)
    assert not parts.nested and parts.audio is None
    out = NT.join_latent(latent, torch.ones_like(parts.video), None)
    assert isinstance(out["samples"], torch.Tensor) and float(out["samples"].mean()) == 1.0


def test_i2v_mask_nested_like_concat():
    latent = concat(i2v(empty_video(), strength=0.75), empty_audio())
    parts = NT.split_latent(latent)
    assert parts.video_mask.shape == (1, 1, 4, 1, 1)
    assert parts.video_mask[0, 0, :, 0, 0].tolist() == [0.25, 1.0, 1.0, 1.0]


def test_full_shape_video_mask_is_reduced_to_one_channel_and_all_ones_is_no_mask():
    video = empty_video()
    full = torch.ones_like(video["samples"])
    assert NT.split_latent({**video, "noise_mask": full}).video_mask is None
    full[:, :, 0] = 0.5
    m = NT.split_latent({**video, "noise_mask": full}).video_mask
    assert m.shape == (1, 1, 4, 4, 8) and float(m[0, 0, 0, 0, 0]) == 0.5
    full[:, 3, 1] = 0.2  # channels disagree
    with pytest.raises(NT.UnsupportedInput, match="differs between channels"):
        NT.split_latent({**video, "noise_mask": full})


def test_audio_noise_mask_per_token_and_concat_filler():
    audio = empty_audio()
    mask = torch.ones_like(audio["samples"])
    mask[:, :, :3] = 0.0
    parts = NT.split_latent(concat(empty_video(), {**audio, "noise_mask": mask}))
    assert parts.audio_mask.shape == (1, 1, mask.shape[2], 1) and torch.equal(parts.audio_mask[0, 0, :, 0],
                                                                              mask[0, 0, :, 0])
    mask[:, 1, 5] = 0.5  # differs between channels within one token
    with pytest.raises(NT.UnsupportedInput, match="audio noise_mask.*within an audio token"):
        NT.split_latent(concat(empty_video(), {**audio, "noise_mask": mask}))
    # ComfyUI's concat fills the audio half with ones when only the video has a mask: that is no audio mask
    parts = NT.split_latent(concat(i2v(empty_video()), audio))
    assert parts.video_mask is not None and parts.audio_mask is None


def test_bad_latents_refused():
    with pytest.raises(NT.UnsupportedInput, match="audio-only"):
        NT.split_latent(empty_audio())
    with pytest.raises(NT.UnsupportedInput, match=r"\[B, 128, F, H, W\]"):
        NT.split_latent({"samples": torch.zeros(1, 16, 4, 4, 4)})
    with pytest.raises(NT.UnsupportedInput, match="3 parts"):
        NT.split_latent({"samples": FakeNested([torch.zeros(1, 128, 2, 2, 2)] * 3)})


def test_separated_video_latent_marked_audio_is_video():
    """ComfyUI's LTXVSeparateAVLatent copies the AV latent's keys into both outputs, so its video LATENT carries
    "type": "audio" (from LTXVEmptyLatentAudio): the 5-D shape decides (ComfyUI's own LTX-2.3 templates decode it)."""
    video = {**empty_video(), "type": "audio"}
    parts = NT.split_latent(video)
    assert parts.video.shape == empty_video()["samples"].shape and parts.audio is None


def test_av_length_check_names_8k_plus_1():
    NT.check_av_lengths(torch.zeros(1, 128, 4, 2, 4), torch.zeros(1, 8, 25, 16), 25.0)
    NT.check_av_lengths(torch.zeros(1, 128, 16, 2, 4), torch.zeros(1, 8, 127, 16), 24.0)  # 121 f @ 24: ceil
    NT.check_av_lengths(torch.zeros(1, 128, 16, 2, 4), torch.zeros(1, 8, 126, 16), 24.0)  # ... and round
    # 30 frames given to both native nodes: the video latent holds 25 frames, the audio latent 30 steps
    with pytest.raises(NT.UnsupportedInput, match="8k\\+1"):
        NT.check_av_lengths(empty_video(frames=30)["samples"], empty_audio(frames=30)["samples"], 25.0)
    assert NT.audio_frames_for(4, 25.0) == 25 and NT.audio_frames_for(16, 24.0) == 127


# ---- NOISE -------------------------------------------------------------------------------------------------------


def prepare_noise(samples, seed):  # comfy.sample.prepare_noise, nested case: one generator, tensors in order
    g = torch.manual_seed(seed)
    if NT.is_nested(samples):
        return FakeNested([torch.randn(t.size(), generator=g, dtype=torch.float32) for t in samples.unbind()])
    return torch.randn(samples.size(), generator=g, dtype=torch.float32)


def test_split_noise_nested_and_plain():
    latent = concat(empty_video(), empty_audio())
    n = prepare_noise(latent["samples"], 3)
    nv, na = NT.split_noise(n, (1, 128, 4, 4, 8), (1, 8, 25, 16))
    g = torch.manual_seed(3)
    assert torch.equal(nv, torch.randn(1, 128, 4, 4, 8, generator=g))
    assert torch.equal(na, torch.randn(1, 8, 25, 16, generator=g))
    nv, na = NT.split_noise(prepare_noise(empty_video()["samples"], 3), (1, 128, 4, 4, 8))
    assert na is None and nv.shape == (1, 128, 4, 4, 8)
    with pytest.raises(NT.UnsupportedInput, match="does not match"):
        NT.split_noise(torch.zeros(1, 128, 4, 4, 4), (1, 128, 4, 4, 8))


# ---- CONDITIONING ------------------------------------------------------------------------------------------------


def test_conditioning_round_trip():
    embeds = torch.randn(1, 9, 64)
    cond = NT.make_conditioning(embeds, 24.0)
    assert cond[0][1] == {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 24.0}
    parts = NT.split_conditioning(cond)
    assert torch.equal(parts.embeds, embeds) and parts.frame_rate == 24.0
    assert NT.frame_rate_of(parts) == 24.0
    assert NT.frame_rate_of(NT.split_conditioning(conditioning())) == NT.DEFAULT_FRAME_RATE == 25.0
    assert NT.make_conditioning(embeds)[0][1].get("frame_rate") is None


def test_native_text_encoder_conditioning_accepted():
    # ComfyUI's LTX-2 text encoder + LTXVConditioning: unprocessed embeddings, frame_rate as a float
    parts = NT.split_conditioning(conditioning(t=11, c=3840, frame_rate=25.0))
    assert parts.embeds.shape == (1, 11, 3840) and parts.frame_rate == 25.0


@pytest.mark.parametrize("key", ["keyframe_idxs", "guide_attention_entries", "ref_audio"])
def test_unhandled_conditioning_keys_are_named(key):
    with pytest.raises(NT.UnsupportedInput, match=key):
        NT.split_conditioning(conditioning(**{key: torch.zeros(1)}))
    NT.split_conditioning(conditioning(**{key: None}))  # present but empty is fine


def test_bad_conditionings_refused():
    with pytest.raises(NT.UnsupportedInput, match="unprocessed_ltxav_embeds"):
        NT.split_conditioning([[torch.zeros(1, 4, 64), {"pooled_output": None}]])
    with pytest.raises(NT.UnsupportedInput, match="2 conditioning entries"):
        NT.split_conditioning(conditioning() + conditioning())
    with pytest.raises(NT.UnsupportedInput, match="batch 2"):
        NT.split_conditioning([[torch.zeros(2, 4, 64), {"unprocessed_ltxav_embeds": True}]])
    with pytest.raises(NT.UnsupportedInput, match="timestep range"):
        NT.split_conditioning(conditioning(start_percent=0.2))


def test_attention_mask_keeps_valid_tokens():
    cond = conditioning(t=5, attention_mask=torch.tensor([[0, 0, 1, 1, 1]]))
    parts = NT.split_conditioning(cond)
    assert torch.equal(parts.embeds, cond[0][0][:, 2:])


# ---- SIGMAS, IMAGE, AUDIO ----------------------------------------------------------------------------------------


def test_sigmas_image_audio():
    assert NT.sigmas_tensor(torch.tensor([[1.0, 0.5, 0.0]], dtype=torch.float64)).tolist() == [1.0, 0.5, 0.0]
    frames = torch.rand(25, 128, 256, 3, dtype=torch.float64)
    image = NT.frames_to_image(frames)
    assert image.dtype == torch.float32 and image.shape == (25, 128, 256, 3)
    audio = NT.waveform_to_audio(torch.randn(2, 24000), 24000)
    assert audio["waveform"].shape == (1, 2, 24000) and audio["sample_rate"] == 24000
    assert NT.waveform_to_audio(None, None) is None
    with pytest.raises(ValueError):
        NT.frames_to_image(torch.zeros(25, 3, 128, 256))


# ---- the samplers the SP Sampler node offers (mgpu_backend.engine.sampling) ---------------------------------------------


def comfy_euler_ancestral_rf(x, denoised, sigma, sigma_next, noise, eta=1.0):
    """One step of ComfyUI's sample_euler_ancestral_RF (k_diffusion/sampling.py), written out for the test."""
    if sigma_next == 0:
        return denoised
    downstep_ratio = 1 + (sigma_next / sigma - 1) * eta
    sigma_down = sigma_next * downstep_ratio
    alpha_ip1, alpha_down = 1 - sigma_next, 1 - sigma_down
    renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_ip1 ** 2 / alpha_down ** 2) ** 0.5
    r = sigma_down / sigma
    x = r * x + (1 - r) * denoised
    return (alpha_ip1 / alpha_down) * x + noise * renoise


def test_ancestral_step_matches_comfyui_formula():
    from mgpu_backend.engine import sampling as S

    g = torch.Generator().manual_seed(0)
    x, x0, n = (torch.randn(1, 6, 128, generator=g) for _ in range(3))
    for sigma, sigma_next, eta in ((1.0, 0.7, 1.0), (0.7, 0.3, 0.5), (0.3, 0.0, 1.0)):
        ours = S.ancestral_step(x, x0, sigma, sigma_next, n, eta=eta)
        torch.testing.assert_close(ours, comfy_euler_ancestral_rf(x, x0, sigma, sigma_next, n, eta),
                                   rtol=1e-5, atol=1e-6)
    # eta 0 is the plain Euler step
    torch.testing.assert_close(S.ancestral_step(x, x0, 0.8, 0.5, None, eta=0.0),
                               S.masked_euler_step(x, x0, 0.8, 0.5), rtol=1e-5, atol=1e-6)


def test_denoise_loop_ancestral_draws_noise_per_step_and_keeps_masked_tokens():
    from mgpu_backend.engine import sampling as S

    calls = []

    def noise_fn():
        calls.append(1)
        return torch.ones(1, 4, 128), torch.ones(1, 3, 128)

    clean = torch.randn(1, 4, 128)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    sigmas = torch.tensor([1.0, 0.6, 0.3, 0.0])

    def model(inp):  # velocity of a model that always predicts x0 = 0
        return inp.video / torch.clamp(inp.video_timesteps[..., None], min=1e-6), inp.audio / max(
            float(inp.audio_sigma[0]), 1e-6)

    start = S.noise_latent(clean, torch.randn(1, 4, 128), 1.0, mask)
    audio = torch.randn(1, 3, 128)
    sampler = S.AncestralSampler(noise_fn)
    v, a = S.denoise_loop(model, sigmas, S.ModalityStream(start, mask, clean), S.ModalityStream(audio),
                          sampler=sampler)
    assert len(calls) == 2  # no noise for the last step (sigma_next = 0), as ComfyUI
    assert torch.equal(v[:, 0], clean[:, 0])  # a mask-0 token stays clean
    v3, _ = S.denoise_loop(model, sigmas, S.ModalityStream(start, mask, clean),
                           S.ModalityStream(audio))  # no sampler: Euler
    assert len(calls) == 2 and not torch.equal(v3[:, 1:], v[:, 1:])


def _guided(kf, strength=0.7, ref=None):
    """CONDITIONING as LTXVAddGuide (+ LTXVReferenceAudio) leave it."""
    extras = {"unprocessed_ltxav_embeds": True, "frame_rate": 25.0, "keyframe_idxs": kf,
              "guide_attention_entries": [{"pre_filter_count": kf.shape[2], "strength": strength,
                                           "pixel_mask": None, "latent_shape": [1, 2, 2]}]}
    if ref is not None:
        extras["ref_audio"] = {"tokens": ref}
    return [[torch.zeros(1, 4, 64), extras]]


def test_guides_travel_from_the_conditioning_to_the_sample_job():
    kf = torch.zeros(1, 3, 4, 2)
    ref = torch.ones(1, 3, 128)
    pos = NT.split_conditioning(_guided(kf, ref=ref), "positive", allow=NT.GUIDE_CONDITIONING_KEYS)
    neg = NT.split_conditioning(_guided(kf, ref=ref), "negative", allow=NT.GUIDE_CONDITIONING_KEYS)
    g = NT.guides_payload(pos, neg)
    assert isinstance(g, ComfyGuides)
    assert torch.equal(g.keyframe_idxs, kf) and torch.equal(g.ref_audio_tokens, ref)
    (entry,) = g.guide_attention_entries
    assert entry.pre_filter_count == 4 and entry.strength == 0.7 and entry.needs_bias
    assert g.denoise_mask is None
    mask = torch.ones(1, 1, 3, 2, 2)
    mask[:, :, 2, 0, 0] = -1.0  # IC-LoRA's dropped cell: the forward needs the mask
    assert NT.guides_payload(pos, neg, mask).denoise_mask is mask
    plain = NT.split_conditioning([[torch.zeros(1, 4, 64), {"unprocessed_ltxav_embeds": True}]])
    assert NT.guides_payload(plain, plain) is None
    with pytest.raises(NT.UnsupportedInput, match="different guides"):
        NT.guides_payload(pos, plain)
    with pytest.raises(NT.UnsupportedInput, match="keyframe_idxs"):  # other nodes still refuse them by name
        NT.split_conditioning(_guided(kf), "positive")
