"""Conversion between ComfyUI's native types and the engine's plain tensors (docs/design/comfyui-types.md).

Importable without ComfyUI (the tests run it on hand-built inputs): a `comfy.nested_tensor.NestedTensor` is
recognised by its `.tensors` attribute, and built through a factory that imports ComfyUI's class lazily.

ComfyUI conventions handled here:
- LATENT `{"samples": Tensor | NestedTensor((video, audio)), "noise_mask"?: same nesting, ...}`; video
  `[B, 128, F, H, W]`, audio `[B, 8, T, 16]`. `LTXVConcatAVLatent` fills a missing half of a nested `noise_mask` with
  `ones_like(samples)` and carries the audio latent's `"type": "audio"` key over.
- NOISE `.generate_noise(latent)`: a tensor for a plain latent, a NestedTensor of (video noise, audio noise) drawn in
  that order from one generator for a nested one.
- CONDITIONING `[[embeds [1, T, C], {"unprocessed_ltxav_embeds": True, "frame_rate"?: float, ...}], ...]`.
- IMAGE float32 `[N, H, W, 3]` in 0..1; AUDIO `{"waveform": [B, C, S], "sample_rate": int}`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_FRAME_RATE = 25.0  # ComfyUI's LTXAV model uses 25 fps when a conditioning has no `frame_rate`
AUDIO_LATENTS_PER_SECOND = 25.0  # 16 kHz / hop 160 / 4

# conditioning keys that change what the model computes and that the fleet does not implement yet
UNSUPPORTED_CONDITIONING_KEYS = {
    "keyframe_idxs": "keyframe guides (LTXVAddGuide)",
    "guide_attention_entries": "guide attention (LTXVAddGuide)",
    "ref_audio": "reference audio (LTXVReferenceAudio)",
    "control": "ControlNet",
    "gligen": "GLIGEN",
    "area": "area conditioning",
    "mask": "masked conditioning",
    "concat_latent_image": "concat latent",
    "concat_mask": "concat mask",
    "hooks": "conditioning hooks",
}


class UnsupportedInput(ValueError):
    """A native input this pack does not handle (yet); the message names it. Never silently dropped."""


# ---- NestedTensor ------------------------------------------------------------------------------------------------


def is_nested(x: Any) -> bool:
    """True for ComfyUI's `NestedTensor` (duck-typed: it has a `.tensors` list)."""
    return not isinstance(x, torch.Tensor) and isinstance(getattr(x, "tensors", None), (list, tuple))


def unnest(x: Any) -> list[torch.Tensor]:
    return list(x.tensors)


def comfy_nested(tensors) -> Any:
    """ComfyUI's NestedTensor of `tensors` (imports ComfyUI: call it only inside ComfyUI, or pass a factory)."""
    from comfy.nested_tensor import NestedTensor

    return NestedTensor(list(tensors))


NestFactory = Callable[[list[torch.Tensor]], Any]


# ---- LATENT ------------------------------------------------------------------------------------------------------


@dataclass
class LatentParts:
    """A native LATENT taken apart.

    video `[1, 128, F, H, W]` float32; audio `[1, 8, T, 16]` float32 or None (video-only latent); video_mask
    `[1, 1, F|1, H|1, W|1]` float32 or None (1 = generate); nested: whether `samples` was a NestedTensor;
    audio_mask `[1, 1, T, 1]` float32 or None (the audio half of a nested noise_mask; None when all ones, as the
    ones LTXVConcatAVLatent fills in).
    """

    video: torch.Tensor
    audio: torch.Tensor | None
    video_mask: torch.Tensor | None
    nested: bool
    audio_mask: torch.Tensor | None = None


def _video_mask(mask: torch.Tensor, video: torch.Tensor) -> torch.Tensor | None:
    """A ComfyUI video noise_mask as `[B, 1, ...]` (a full-shape mask must be equal over channels); None when it is
    all ones (no conditioning)."""
    m = mask.detach().to("cpu", torch.float32)
    while m.ndim < 5:  # e.g. a [F, H, W] mask from a MASK-style node
        m = m.unsqueeze(0)
    if m.ndim != 5:
        raise UnsupportedInput(f"video noise_mask of shape {tuple(mask.shape)}: expected [B, 1, F, H, W]")
    if m.shape[1] != 1:
        if not bool((m == m[:, :1]).all()):
            raise UnsupportedInput(f"video noise_mask of shape {tuple(mask.shape)} differs between channels; the "
                                   f"fleet takes one mask value per token (a [B, 1, F, H, W] mask)")
        m = m[:, :1]
    try:
        torch.broadcast_shapes(tuple(m.shape), (video.shape[0], 1, *video.shape[2:]))
    except RuntimeError:
        raise UnsupportedInput(f"video noise_mask of shape {tuple(mask.shape)} does not fit the video latent "
                               f"{tuple(video.shape)}") from None
    if bool((m == 1).all()):
        return None
    return m.contiguous()


def _audio_mask(mask: torch.Tensor, audio: torch.Tensor) -> torch.Tensor | None:
    """The audio half of a nested noise_mask as `[B, 1, T, 1]` (one value per audio token: ComfyUI's per-token
    timestep reads channel 0, bin 0, `LTXAV.process_timestep`); None when it is all ones. A mask that differs within
    a token is refused by name."""
    m = mask.detach().to("cpu", torch.float32)
    if m.ndim != 4:
        raise UnsupportedInput(f"audio noise_mask of shape {tuple(mask.shape)}: expected [B, C, T, F]")
    if not bool((m == m[:, :1, :, :1]).all()):
        raise UnsupportedInput(f"audio noise_mask of shape {tuple(mask.shape)} differs within an audio token "
                               f"(between channels or frequency bins); the fleet takes one value per token")
    m = m[:, :1, :, :1]
    try:
        torch.broadcast_shapes(tuple(m.shape), (audio.shape[0], 1, audio.shape[2], 1))
    except RuntimeError:
        raise UnsupportedInput(f"audio noise_mask of shape {tuple(mask.shape)} does not fit the audio latent "
                               f"{tuple(audio.shape)}") from None
    if bool((m == 1).all()):
        return None
    return m.contiguous()


def split_latent(latent: dict) -> LatentParts:
    """Native LATENT -> LatentParts. Refuses (UnsupportedInput) audio-only latents, more than two nested parts,
    a noise_mask that is not one value per token, and latents that are not LTX-2 shaped."""
    if not isinstance(latent, dict) or "samples" not in latent:
        raise UnsupportedInput("LATENT must be a dict with 'samples'")
    samples = latent["samples"]
    if is_nested(samples):
        parts = unnest(samples)
        if len(parts) != 2:
            raise UnsupportedInput(f"a nested LATENT with {len(parts)} parts: expected (video, audio) as "
                                   f"LTXVConcatAVLatent makes it")
        video, audio = parts
        nested = True
    else:
        # the shape decides: ComfyUI's LTXVSeparateAVLatent copies the AV latent's keys ("type": "audio" from
        # LTXVEmptyLatentAudio included) into its video output, so a 5-D latent marked "audio" is video
        if isinstance(samples, torch.Tensor) and (samples.ndim == 4 or (latent.get("type") == "audio"
                                                                       and samples.ndim != 5)):
            raise UnsupportedInput("an audio-only LATENT: give the video latent, or both joined with "
                                   "LTXVConcatAVLatent")
        video, audio, nested = samples, None, False
    if not isinstance(video, torch.Tensor) or video.ndim != 5 or video.shape[1] != 128:
        raise UnsupportedInput(f"video latent of shape {tuple(getattr(video, 'shape', ()))}: expected "
                               f"[B, 128, F, H, W] (an LTX-2 latent, e.g. from EmptyLTXVLatentVideo)")
    if audio is not None and (audio.ndim != 4 or audio.shape[1] != 8):
        raise UnsupportedInput(f"audio latent of shape {tuple(audio.shape)}: expected [B, 8, T, 16] "
                               f"(LTXVEmptyLatentAudio)")
    video_mask = audio_mask = None
    mask = latent.get("noise_mask")
    if mask is not None:
        if is_nested(mask):
            masks = unnest(mask)
            if len(masks) != 2:
                raise UnsupportedInput(f"a nested noise_mask with {len(masks)} parts: expected (video, audio)")
            vmask, amask = masks
            if amask is not None and audio is not None:
                audio_mask = _audio_mask(amask, audio)
        else:
            vmask = mask
        if vmask is not None:
            video_mask = _video_mask(vmask, video)
    return LatentParts(video.detach().to("cpu", torch.float32).contiguous(),
                       None if audio is None else audio.detach().to("cpu", torch.float32).contiguous(),
                       video_mask, nested, audio_mask)


def join_latent(template: dict, video: torch.Tensor, audio: torch.Tensor | None, *, keep_mask: bool = True,
                nest: NestFactory | None = None) -> dict:
    """A native LATENT with the same structure as `template` (its other keys kept) holding `video` / `audio`.

    `audio` is required when `template` is nested and ignored otherwise. `keep_mask=False` drops `noise_mask` (after
    a resize, as ComfyUI's LTXVLatentUpsampler does). `nest` builds the NestedTensor (default: ComfyUI's).
    """
    out = dict(template)
    out.pop("downscale_ratio_spacial", None)
    if is_nested(template["samples"]):
        if audio is None:
            raise ValueError("join_latent: a nested LATENT needs the audio latent")
        out["samples"] = (nest or comfy_nested)([video, audio])
    else:
        out["samples"] = video
    if not keep_mask:
        out.pop("noise_mask", None)
    return out


def audio_frames_for(video_frames_latent: int, fps: float) -> int:
    """ComfyUI's audio latent length (`LTXVEmptyLatentAudio`: ceil) for a video latent of F latent frames."""
    frames = (video_frames_latent - 1) * 8 + 1
    return int(math.ceil(frames / fps * AUDIO_LATENTS_PER_SECOND))


def check_av_lengths(video: torch.Tensor, audio: torch.Tensor, fps: float) -> None:
    """The audio latent must cover the video's duration at `fps` (what ComfyUI's nodes build for an 8k+1 frame count
    given to both EmptyLTXVLatentVideo and LTXVEmptyLatentAudio). Raises UnsupportedInput naming both."""
    f_lat = video.shape[2]
    frames = (f_lat - 1) * 8 + 1
    expected = frames / fps * AUDIO_LATENTS_PER_SECOND
    t = audio.shape[2]
    if abs(t - expected) >= 1.0 + 1e-6:
        raise UnsupportedInput(
            f"the audio latent has {t} steps but the video latent holds {f_lat} latent frames = {frames} frames, "
            f"which at {fps:g} fps need {math.ceil(expected)} audio steps. Use a frame count of the form 8k+1 "
            f"(e.g. {frames} or {frames + 8}) in both EmptyLTXVLatentVideo and LTXVEmptyLatentAudio, and the same "
            f"frame rate there as in the conditioning (frame_rate)")


# ---- NOISE -------------------------------------------------------------------------------------------------------


def split_noise(noise: Any, video_shape, audio_shape=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output of `NOISE.generate_noise(latent)` -> (video noise, audio noise or None), checked against the
    latent shapes."""
    if is_nested(noise):
        parts = unnest(noise)
        if len(parts) != 2:
            raise UnsupportedInput(f"nested noise with {len(parts)} parts: expected (video, audio)")
        nv, na = parts
    else:
        nv, na = noise, None
    if tuple(nv.shape) != tuple(video_shape):
        raise UnsupportedInput(f"video noise of shape {tuple(nv.shape)} does not match the latent "
                               f"{tuple(video_shape)}")
    if audio_shape is not None and na is not None and tuple(na.shape) != tuple(audio_shape):
        raise UnsupportedInput(f"audio noise of shape {tuple(na.shape)} does not match the latent "
                               f"{tuple(audio_shape)}")
    to = lambda t: None if t is None else t.detach().to("cpu", torch.float32).contiguous()  # noqa: E731
    return to(nv), to(na)


# ---- CONDITIONING ------------------------------------------------------------------------------------------------


@dataclass
class Conditioning:
    """One CONDITIONING taken apart: `embeds` `[1, T, C]` float32 (valid tokens only) and its options."""

    embeds: torch.Tensor
    frame_rate: float | None
    extras: dict


GUIDE_CONDITIONING_KEYS = ("keyframe_idxs", "guide_attention_entries", "ref_audio")
"""What LTXVAddGuide / LTXVReferenceAudio put in a CONDITIONING: forward inputs the SP Sampler carries (`allow`)."""


def split_conditioning(cond: Any, what: str = "conditioning", allow: tuple[str, ...] = ()) -> Conditioning:
    """ComfyUI CONDITIONING (LTX-2, unprocessed form) -> Conditioning. Refuses (UnsupportedInput, naming the key)
    several entries, processed (connector-output) embeddings, and the keys in UNSUPPORTED_CONDITIONING_KEYS that are
    not in `allow` (e.g. GUIDE_CONDITIONING_KEYS, for a caller that passes them on: `Conditioning.extras`)."""
    if not isinstance(cond, (list, tuple)) or not cond:
        raise UnsupportedInput(f"{what}: expected a CONDITIONING list [[tensor, dict]]")
    if len(cond) != 1:
        raise UnsupportedInput(f"{what}: {len(cond)} conditioning entries (combined / concatenated "
                               f"conditionings); the multi-GPU sampler takes one")
    entry = cond[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2:
        raise UnsupportedInput(f"{what}: expected [tensor, dict] entries")
    embeds, options = entry[0], dict(entry[1] or {})
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3:
        raise UnsupportedInput(f"{what}: embeddings of shape {tuple(getattr(embeds, 'shape', ()))}: expected "
                               f"[1, T, C]")
    if embeds.shape[0] != 1:
        raise UnsupportedInput(f"{what}: batch {embeds.shape[0]} of prompts; the multi-GPU sampler takes one")
    if not options.get("unprocessed_ltxav_embeds", False):
        raise UnsupportedInput(f"{what}: not LTX-2 text-encoder output in the unprocessed form "
                               f"('unprocessed_ltxav_embeds' missing): use Text Encode (MGPU) or ComfyUI's LTX-2 "
                               f"text encoder (LTXAVTextEncoderLoader + CLIPTextEncode)")
    for key, label in UNSUPPORTED_CONDITIONING_KEYS.items():
        if options.get(key) is not None and key not in allow:
            raise UnsupportedInput(f"{what}: '{key}' ({label}) is not supported by the multi-GPU nodes yet")
    start, end = options.get("start_percent", 0.0), options.get("end_percent", 1.0)
    if float(start) != 0.0 or float(end) != 1.0:
        raise UnsupportedInput(f"{what}: a timestep range (start_percent={start}, end_percent={end}) is not "
                               f"supported by the multi-GPU nodes yet")
    x = embeds.detach().to("cpu", torch.float32)
    mask = options.get("attention_mask")
    if mask is not None:
        m = torch.as_tensor(mask).reshape(-1).bool().cpu()
        if m.numel() != x.shape[1]:
            raise UnsupportedInput(f"{what}: attention_mask of {m.numel()} tokens for {x.shape[1]} embeddings")
        x = x[:, m]  # the engine takes valid tokens only
    fr = options.get("frame_rate")
    return Conditioning(x.contiguous(), None if fr is None else float(fr), options)


def guides_payload(pos: Conditioning, neg: Conditioning | None,
                   video_mask: torch.Tensor | None = None):
    """LTXVAddGuide's keyframe_idxs / guide_attention_entries and LTXVReferenceAudio's ref_audio from the
    conditioning -> the sample request's `guides`, a `protocol.stage_requests.ComfyGuides` (None without them). ComfyUI passes each conditioning's own values to
    its forward; the fleet runs one set for every pass, so positive and negative must carry the same (as those nodes
    make them). `video_mask` (`LatentParts.video_mask`): sent as the forward's `denoise_mask` when it has IC-LoRA's
    −1 cells (their tokens are dropped). Raises UnsupportedInput naming what does not fit."""
    try:  # inside ComfyUI the pack is one package (mangled name); tests import `nodes` and `mgpu_backend` top-level
        from ..mgpu_backend.protocol import native_forward as F
        from ..mgpu_backend.protocol.stage_requests import ComfyGuides
    except ImportError:
        from mgpu_backend.protocol import native_forward as F
        from mgpu_backend.protocol.stage_requests import ComfyGuides

    def of(c):
        return {k: c.extras.get(k) for k in GUIDE_CONDITIONING_KEYS if c.extras.get(k) is not None}

    found = of(pos)
    if neg is not None:
        other = of(neg)
        if set(other) != set(found) or any(not _same(found[k], other[k]) for k in found):
            raise UnsupportedInput("positive and negative carry different guides / reference audio "
                                   f"({sorted(found)} vs {sorted(other)}); apply LTXVAddGuide / LTXVReferenceAudio "
                                   "to both, as those nodes do")
    if not found:
        return None
    if "guide_attention_entries" in found and "keyframe_idxs" not in found:
        raise UnsupportedInput("guide_attention_entries without keyframe_idxs")
    entries = []
    for e in found.get("guide_attention_entries") or ():
        shape, mask = e.get("latent_shape"), e.get("pixel_mask")
        entries.append(F.GuideAttentionEntry(
            pre_filter_count=int(e["pre_filter_count"]), strength=float(e.get("strength", 1.0)),
            pixel_mask=None if mask is None else mask.detach().float().cpu(),
            latent_shape=None if shape is None else tuple(int(s) for s in list(shape)[-3:])))
    ref = found.get("ref_audio")
    if isinstance(ref, dict):
        ref = ref["tokens"]
    kf = found.get("keyframe_idxs")
    dropped = video_mask is not None and kf is not None and bool((video_mask < 0).any())
    return ComfyGuides(keyframe_idxs=None if kf is None else kf.detach().cpu(),
                       guide_attention_entries=tuple(entries),
                       ref_audio_tokens=None if ref is None else ref.detach().float().cpu(),
                       denoise_mask=video_mask if dropped else None)


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def make_conditioning(embeds: torch.Tensor, frame_rate: float | None = None) -> list:
    """Embeddings `[1, T, C]` -> ComfyUI CONDITIONING in the unprocessed LTX-2 form (what ComfyUI's own LTX-2 text
    encoder returns, plus `frame_rate` as LTXVConditioning sets it)."""
    options: dict = {"pooled_output": None, "unprocessed_ltxav_embeds": True}
    if frame_rate is not None:
        options["frame_rate"] = float(frame_rate)
    return [[embeds.detach().to("cpu", torch.float32).contiguous(), options]]


def frame_rate_of(*conds: Conditioning | None) -> float:
    """The frame rate the sampler uses: the first conditioning's `frame_rate` (positive before negative), else
    ComfyUI's default 25."""
    for c in conds:
        if c is not None and c.frame_rate is not None:
            if c.frame_rate <= 0:
                raise UnsupportedInput(f"frame_rate={c.frame_rate}: must be positive")
            return c.frame_rate
    return DEFAULT_FRAME_RATE


# ---- SIGMAS, IMAGE, AUDIO ----------------------------------------------------------------------------------------


def sigmas_tensor(sigmas: Any) -> torch.Tensor:
    """ComfyUI SIGMAS -> 1-D float32 CPU tensor (validated by the engine)."""
    return torch.as_tensor(sigmas, dtype=torch.float32).detach().reshape(-1).cpu()


def frames_to_image(frames: torch.Tensor) -> torch.Tensor:
    """Decoded frames `[F, H, W, 3]` -> IMAGE float32 `[N, H, W, 3]` in 0..1."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"decoded frames of shape {tuple(frames.shape)}: expected [F, H, W, 3]")
    return frames.to(torch.float32).clamp(0.0, 1.0).contiguous()


def waveform_to_audio(waveform: torch.Tensor | None, sample_rate: int | None) -> dict | None:
    """A decoded waveform `[C, S]` (or `[1, C, S]`) -> AUDIO `{"waveform": [1, C, S], "sample_rate"}`."""
    if waveform is None:
        return None
    w = waveform.detach().to("cpu", torch.float32)
    if w.ndim == 1:
        w = w.unsqueeze(0)
    if w.ndim == 2:
        w = w.unsqueeze(0)
    if w.ndim != 3:
        raise ValueError(f"waveform of shape {tuple(waveform.shape)}: expected [C, S]")
    return {"waveform": w.contiguous(), "sample_rate": int(sample_rate)}
