"""The native-MODEL forward contract (mgpu_backend/protocol/native_forward.py): valid requests build, bad ones are refused by name."""
from __future__ import annotations

import pytest
import torch

from mgpu_backend.protocol.native_forward import ForwardContractError, ForwardMiss, ForwardOptions, ForwardRequest, GuideAttentionEntry, LoraPatch, LoraSet, PreprocessTextRequest
from mgpu_backend.protocol.validation import ValidationError


def _req(**kw):
    args = dict(video=torch.zeros(2, 128, 3, 2, 3), audio=torch.zeros(2, 8, 5, 16), video_timestep=torch.ones(2),
                audio_timestep=torch.ones(2), context=torch.zeros(2, 16, 24), frame_rate=25)
    args.update(kw)
    return ForwardRequest(**args)


def test_plain_request_and_properties():
    r = _req(cond_or_uncond=[1, 0], context_keys=["neg", "pos"])
    assert r.batch == 2 and r.video_tokens == 18 and r.guide_tokens == 0
    assert r.cond_or_uncond == (1, 0) and r.options.is_plain
    assert r.without_context().context is None


def test_per_token_timesteps_and_guides():
    kf = torch.zeros(2, 3, 6, 2, dtype=torch.int64)
    r = _req(video_timestep=torch.ones(2, 18, 1), audio_timestep=torch.ones(2, 5, 1), keyframe_idxs=kf,
             guide_attention_entries=[GuideAttentionEntry(6, 0.7)], denoise_mask=torch.ones(1, 1, 3, 2, 3))
    assert r.guide_tokens == 6 and r.guide_attention_entries[0].needs_bias
    _req(video_timestep=torch.ones(2, 18), keyframe_idxs=kf, denoise_mask=torch.ones(2, 1, 3, 1, 1))  # broadcast


@pytest.mark.parametrize("kw, words", [
    (dict(video=torch.zeros(2, 64, 3, 2, 3)), "video of shape"),
    (dict(audio=torch.zeros(1, 8, 5, 16)), "audio of shape"),
    (dict(video_timestep=torch.ones(2, 17, 1)), "video_timestep of shape"),
    (dict(frame_rate=0), "frame_rate"),
    (dict(context=None), "context_keys"),
    (dict(context_keys=("a",)), "2 rows"),
    (dict(keyframe_idxs=torch.zeros(2, 3, 4, 2)), "whole number"),
    (dict(keyframe_idxs=torch.zeros(2, 3, 6, 2), guide_attention_entries=[GuideAttentionEntry(5, 1.0)]),
     "pre_filter_counts"),
    (dict(guide_attention_entries=[GuideAttentionEntry(6, 1.0)]), "without keyframe_idxs"),
    (dict(ref_audio_tokens=torch.zeros(1, 4, 64)), "ref_audio_tokens"),
    (dict(cond_or_uncond=(0, 2)), "cond_or_uncond"),
    (dict(video_timestep=torch.ones(2, 18, 1), audio_timestep=None), "audio_timestep=None"),
])
def test_bad_requests_are_refused_by_name(kw, words):
    with pytest.raises(ForwardContractError, match=words):
        _req(**kw)


def test_options_lora_miss_preprocess():
    assert ForwardOptions(stg_self_attn_blocks=frozenset({3, 1})).stg_self_attn_blocks == (1, 3)
    with pytest.raises(ValidationError, match="≥ 0"):
        ForwardOptions(stg_self_attn_blocks=(-1,))
    with pytest.raises(ForwardContractError, match="rank"):
        LoraPatch("transformer_blocks.0.attn1.to_q", torch.zeros(4, 8), torch.zeros(8, 3))
    LoraSet("k", (LoraPatch("transformer_blocks.0.attn1.to_q", torch.zeros(4, 8), torch.zeros(8, 4)),))
    with pytest.raises(ForwardContractError, match="names nothing"):
        ForwardMiss()
    with pytest.raises(ForwardContractError, match="pixel_mask needs latent_shape"):
        GuideAttentionEntry(6, 1.0, pixel_mask=torch.ones(1, 1, 9, 64, 64))
    with pytest.raises(ForwardContractError, match="cache_keys"):
        PreprocessTextRequest(torch.zeros(2, 4, 8), cache_keys=("a",))


def test_context_cache_bounds_and_recency():
    from mgpu_backend.stages.native import ContextCache

    cache = ContextCache(max_rows=3, max_bytes=3 * 4 * 16)
    for k in "abc":
        cache.put(k, torch.zeros(1, 4, 4))
    cache.get("a")  # a is now the most recent
    cache.put("d", torch.zeros(1, 4, 4))
    assert cache.missing(["a", "b", "c", "d"]) == ("b",)
    cache.put("big", torch.zeros(1, 8, 4))  # 128 bytes: evicts the oldest until the bytes fit
    assert cache.missing(["a", "c", "d", "big"]) == ("a", "c") and cache.nbytes <= 3 * 4 * 16
    cache.clear()
    assert len(cache) == 0 and cache.missing(["d"]) == ("d",)
