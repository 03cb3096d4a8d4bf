"""Latent geometry for LTX-2 / LTX-2.3: shapes, packing (patchify), RoPE coordinates, normalization, masks.

Everything here is pure tensor bookkeeping (no model weights, no ComfyUI). Conventions:

* Video latent: ``[B, C=128, F_lat, H_lat, W_lat]`` with ``F_lat = (F - 1) // 8 + 1``, ``H_lat = H // 32``,
  ``W_lat = W // 32`` (VAE compression 8x32x32, causal first frame). Packed (patch size 1):
  ``[B, F_lat*H_lat*W_lat, 128]``, token index ``(f*H_lat + h)*W_lat + w`` ("b c f h w -> b (f h w) c").
* Audio latent: ``[B, 8, T_lat, 16]`` (8 channels x 16 latent mel bins = 64 mel bins / 4). Packed:
  ``[B, T_lat, 128]`` with feature index ``c*16 + m`` ("b c t f -> b t (c f)").
* Audio latents per second: 16000 Hz / hop 160 / 4 (latent time downsampling) = 25.0.
* Denoise masks follow the reference: 1 = generate (fully noised / denoised), 0 = keep the clean latent;
  image conditioning with strength ``s`` puts ``1 - s`` on the conditioned latent frame.

Sources (formulas verified against, no code copied):

* Lightricks/LTX-2 ``packages/ltx-core/src/ltx_core/types.py`` (``VideoLatentShape.from_pixel_shape``,
  ``AudioLatentShape.from_duration``: ``round(duration * 25)``),
  ``packages/ltx-core/src/ltx_core/components/patchifiers.py`` (video/audio patchify layouts),
  ``packages/ltx-core/src/ltx_core/conditioning/types/latent_cond.py`` (``VideoConditionByLatentIndex``:
  ``denoise_mask = 1 - strength`` on the conditioned frame's tokens).
* diffusers 0.42.1 ``pipelines/ltx2/pipeline_ltx2.py`` (``_pack_latents``, ``_pack_audio_latents``,
  ``_normalize_latents``, ``_normalize_audio_latents``, ``audio_num_frames = round(duration_s * 25)``) and
  ``models/transformers/transformer_ltx2.py`` (``prepare_video_coords``, ``prepare_audio_coords``).
* ComfyUI (0.20.x) ``comfy_extras/nodes_lt.py`` (``LTXVImgToVideo``: ``noise_mask`` ``[B,1,F_lat,1,1]``, ``1 - strength``
  on conditioned frames), ``comfy/ldm/lightricks/vae/audio_vae.py`` (``num_of_latents_from_frames`` uses
  ``math.ceil`` -- note: differs from the reference's ``round``), ``comfy/ldm/lightricks/symmetric_patchifier.py``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

# ---------------------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------------------

VAE_TEMPORAL_COMPRESSION = 8
"""Pixel frames per latent frame (the first latent frame covers a single pixel frame: causal VAE)."""
VAE_SPATIAL_COMPRESSION = 32
"""Pixels per latent cell along height and width."""
VIDEO_LATENT_CHANNELS = 128
"""Channels of the video latent (= features of one packed video token, patch size 1)."""

AUDIO_LATENT_CHANNELS = 8
"""Channels of the audio latent ``[B, 8, T, 16]``."""
AUDIO_MEL_BINS = 64
"""Mel bins of the audio VAE's input spectrogram."""
AUDIO_MEL_COMPRESSION = 4
"""Mel-axis downsampling of the audio VAE (64 mel bins -> 16 latent bins)."""
AUDIO_LATENT_MEL_BINS = AUDIO_MEL_BINS // AUDIO_MEL_COMPRESSION  # 16
"""Latent mel bins of the audio latent."""
AUDIO_TOKEN_CHANNELS = AUDIO_LATENT_CHANNELS * AUDIO_LATENT_MEL_BINS  # 128
"""Features of one packed audio token."""
AUDIO_SAMPLE_RATE = 16000
"""Sample rate (Hz) of the audio VAE's mel front-end (the vocoder outputs 24 kHz for LTX-2.0, 48 kHz with BWE)."""
AUDIO_HOP_LENGTH = 160
"""Mel hop length in samples (10 ms at 16 kHz)."""
AUDIO_TEMPORAL_COMPRESSION = 4
"""Time-axis downsampling of the audio VAE (mel frames per latent frame)."""
AUDIO_LATENTS_PER_SECOND = AUDIO_SAMPLE_RATE / AUDIO_HOP_LENGTH / AUDIO_TEMPORAL_COMPRESSION  # 25.0
"""Audio latent frames (= audio tokens) per second of media."""

AudioRounding = Literal["round", "ceil"]


# ---------------------------------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------------------------------


def _check_video_pixel_dims(frames: int, height: int, width: int) -> None:
    if frames < 1 or (frames - 1) % VAE_TEMPORAL_COMPRESSION != 0:
        raise ValueError(f"frames must be 8k+1 (1, 9, 17, ..., 121, ...); got {frames}")
    for name, v in (("height", height), ("width", width)):
        if v < VAE_SPATIAL_COMPRESSION or v % VAE_SPATIAL_COMPRESSION != 0:
            raise ValueError(f"{name} must be a positive multiple of {VAE_SPATIAL_COMPRESSION} pixels; got {v}")


def latent_frames(frames: int) -> int:
    """Latent frame count for ``frames`` pixel frames: ``(frames - 1) // 8 + 1``.

    Raises:
        ValueError: if ``frames`` is not of the form 8k+1.
    """
    if frames < 1 or (frames - 1) % VAE_TEMPORAL_COMPRESSION != 0:
        raise ValueError(f"frames must be 8k+1 (1, 9, 17, ..., 121, ...); got {frames}")
    return (frames - 1) // VAE_TEMPORAL_COMPRESSION + 1


def video_latent_shape(frames: int, height: int, width: int, batch: int = 1) -> tuple[int, int, int, int, int]:
    """Shape ``(B, 128, (F-1)//8+1, H//32, W//32)`` of the video latent for a clip of F frames at H x W pixels.

    Raises:
        ValueError: frames not 8k+1, or height/width not a positive multiple of 32, or batch < 1.
    """
    _check_video_pixel_dims(frames, height, width)
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    return (
        batch,
        VIDEO_LATENT_CHANNELS,
        latent_frames(frames),
        height // VAE_SPATIAL_COMPRESSION,
        width // VAE_SPATIAL_COMPRESSION,
    )


def video_token_count(frames: int, height: int, width: int) -> int:
    """Number of video tokens (patch size 1) for F frames at H x W pixels, e.g. 121 @ 1280x704 -> 16*22*40 = 14080."""
    _, _, f, h, w = video_latent_shape(frames, height, width)
    return f * h * w


def audio_latent_frames(frames: int, fps: float, rounding: AudioRounding = "round") -> int:
    """Audio latent frames (= audio tokens) for a clip of ``frames`` video frames at ``fps``.

    ``rounding="round"`` (default) is the Lightricks reference (``AudioLatentShape.from_duration``:
    Python ``round(frames / fps * 25)``, i.e. banker's rounding on exact halves) and diffusers'
    ``LTX2Pipeline`` (same ``round``). ``rounding="ceil"`` is ComfyUI's ``num_of_latents_from_frames``
    (``math.ceil``) -- use it to build an empty audio latent with exactly the shape ComfyUI's
    ``LTXVEmptyLatentAudio`` would make. Example: 121 frames @ 24 fps = 5.0417 s -> 126 (round) / 127 (ceil).

    Raises:
        ValueError: non-positive ``frames`` or ``fps``, or an unknown ``rounding``.
    """
    if frames < 1:
        raise ValueError(f"frames must be >= 1; got {frames}")
    if not (fps > 0) or not math.isfinite(fps):
        raise ValueError(f"fps must be a positive finite number; got {fps}")
    x = float(frames) / float(fps) * AUDIO_LATENTS_PER_SECOND
    if rounding == "round":
        return round(x)
    if rounding == "ceil":
        return math.ceil(x)
    raise ValueError(f"rounding must be 'round' (reference) or 'ceil' (ComfyUI); got {rounding!r}")


def audio_latent_shape(
    frames: int, fps: float, batch: int = 1, rounding: AudioRounding = "round"
) -> tuple[int, int, int, int]:
    """Shape ``(B, 8, T_lat, 16)`` of the audio latent that accompanies ``frames`` video frames at ``fps``."""
    return (batch, AUDIO_LATENT_CHANNELS, audio_latent_frames(frames, fps, rounding), AUDIO_LATENT_MEL_BINS)


# ---------------------------------------------------------------------------------------------------------------------
# Packing (patch size 1)
# ---------------------------------------------------------------------------------------------------------------------


def pack_video(latent: torch.Tensor) -> torch.Tensor:
    """``[B, C, F, H, W] -> [B, F*H*W, C]`` (token order f, h, w; "b c f h w -> b (f h w) c").

    Matches diffusers ``LTX2Pipeline._pack_latents`` (patch size 1), Lightricks ``VideoLatentPatchifier`` and
    ComfyUI's ``SymmetricPatchifier`` with patch size 1. Dtype and device are preserved; the result is contiguous.

    Raises:
        ValueError: if ``latent`` is not 5-D.
    """
    if latent.ndim != 5:
        raise ValueError(f"pack_video expects [B, C, F, H, W]; got shape {tuple(latent.shape)}")
    b, c = latent.shape[:2]
    return latent.reshape(b, c, -1).transpose(1, 2).contiguous()


def unpack_video(tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_video`: ``[B, F*H*W, C] -> [B, C, F, H, W]`` (F, H, W in latent units).

    Raises:
        ValueError: if ``tokens`` is not 3-D or its token count is not ``frames*height*width``.
    """
    if tokens.ndim != 3:
        raise ValueError(f"unpack_video expects [B, T, C]; got shape {tuple(tokens.shape)}")
    b, t, c = tokens.shape
    if t != frames * height * width:
        raise ValueError(
            f"unpack_video: {t} tokens cannot be a {frames}x{height}x{width} latent grid ({frames * height * width})"
        )
    return tokens.transpose(1, 2).reshape(b, c, frames, height, width).contiguous()


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """``[B, C=8, T, M=16] -> [B, T, C*M=128]``, feature index ``c*M + m`` ("b c t f -> b t (c f)").

    Matches diffusers ``LTX2Pipeline._pack_audio_latents`` (default branch), Lightricks ``AudioPatchifier`` and
    ComfyUI's ``AudioPatchifier``.

    Raises:
        ValueError: if ``latent`` is not 4-D.
    """
    if latent.ndim != 4:
        raise ValueError(f"pack_audio expects [B, C, T, M]; got shape {tuple(latent.shape)}")
    return latent.transpose(1, 2).flatten(2, 3).contiguous()


def unpack_audio(
    tokens: torch.Tensor, channels: int = AUDIO_LATENT_CHANNELS, mel_bins: int = AUDIO_LATENT_MEL_BINS
) -> torch.Tensor:
    """Inverse of :func:`pack_audio`: ``[B, T, C*M] -> [B, C, T, M]``.

    Raises:
        ValueError: if ``tokens`` is not 3-D or its feature size is not ``channels * mel_bins``.
    """
    if tokens.ndim != 3:
        raise ValueError(f"unpack_audio expects [B, T, C*M]; got shape {tuple(tokens.shape)}")
    if tokens.shape[2] != channels * mel_bins:
        raise ValueError(f"unpack_audio: feature size {tokens.shape[2]} != channels*mel_bins = {channels * mel_bins}")
    b, t, _ = tokens.shape
    return tokens.reshape(b, t, channels, mel_bins).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# RoPE coordinates
# ---------------------------------------------------------------------------------------------------------------------


def _rope(obj: Any, attr: str) -> Any:
    rope = getattr(obj, attr, None)
    if rope is None:
        raise TypeError(f"expected an LTX2VideoTransformer3DModel (or an object with .{attr}); got {type(obj).__name__}")
    return rope


def video_coords(
    transformer: Any,
    batch: int,
    frames: int,
    height: int,
    width: int,
    fps: float,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Video RoPE positions ``[B, 3, F*H*W, 2]`` float32: per token, [start, end) on (time in seconds, y px, x px).

    ``frames``/``height``/``width`` are latent sizes. Delegates to diffusers'
    ``transformer.rope.prepare_video_coords`` (token order identical to :func:`pack_video`). The formula
    (reference ``get_pixel_coords`` with causal fix): time start ``max(8f + 1 - 8, 0) / fps``, end
    ``max(8(f+1) + 1 - 8, 0) / fps``; y ``[32h, 32(h+1))``; x ``[32w, 32(w+1))``.

    Args:
        transformer: a diffusers ``LTX2VideoTransformer3DModel`` (or any object with a ``rope`` attribute
            exposing ``prepare_video_coords``).
        fps: video frame rate (frames per second) of the generated clip.
        device: where to build the tensor (default CPU).
    """
    rope = _rope(transformer, "rope")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return rope.prepare_video_coords(batch, frames, height, width, dev, fps=float(fps))


def audio_coords(
    transformer: Any, batch: int, frames: int, device: torch.device | str | None = None, shift: int = 0
) -> torch.Tensor:
    """Audio RoPE positions ``[B, 1, T, 2]`` float32: per token [start, end) in seconds.

    Delegates to diffusers' ``transformer.audio_rope.prepare_audio_coords``. Formula: start
    ``max(4t + 1 - 4, 0) * 160 / 16000``, end ``max(4(t+1) + 1 - 4, 0) * 160 / 16000`` (t = latent index + shift).
    """
    rope = _rope(transformer, "audio_rope")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return rope.prepare_audio_coords(batch, frames, dev, shift=shift)


# ---------------------------------------------------------------------------------------------------------------------
# Normalization (per-channel VAE statistics)
# ---------------------------------------------------------------------------------------------------------------------


def _stats(stat: torch.Tensor, ref: torch.Tensor, n: int, what: str) -> torch.Tensor:
    stat = torch.as_tensor(stat)
    if stat.numel() != n:
        raise ValueError(f"{what}: expected {n} per-channel values; got shape {tuple(stat.shape)}")
    return stat.reshape(-1).to(device=ref.device, dtype=ref.dtype)


def normalize_latents(
    latent: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, scaling_factor: float = 1.0
) -> torch.Tensor:
    """VAE-space video latent -> model space: ``(x - mean[c]) * scaling_factor / std[c]``.

    ``latent`` is ``[B, C, F, H, W]`` (stats ``[C]`` broadcast over channel dim 1) or packed ``[B, T, C]`` (stats
    broadcast over the last dim). Matches diffusers ``LTX2Pipeline._normalize_latents`` (video VAE buffers
    ``latents_mean`` / ``latents_std``, config ``scaling_factor`` = 1.0) and the reference's
    ``per_channel_statistics``. Computed in the latent's dtype.
    """
    if latent.ndim == 5:
        c = latent.shape[1]
        m = _stats(mean, latent, c, "normalize_latents mean").view(1, c, 1, 1, 1)
        s = _stats(std, latent, c, "normalize_latents std").view(1, c, 1, 1, 1)
    elif latent.ndim == 3:
        c = latent.shape[2]
        m = _stats(mean, latent, c, "normalize_latents mean")
        s = _stats(std, latent, c, "normalize_latents std")
    else:
        raise ValueError(f"normalize_latents expects [B, C, F, H, W] or [B, T, C]; got {tuple(latent.shape)}")
    return (latent - m) * scaling_factor / s


def denormalize_latents(
    latent: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, scaling_factor: float = 1.0
) -> torch.Tensor:
    """Inverse of :func:`normalize_latents`: ``x * std[c] / scaling_factor + mean[c]`` (what the VAE decoder wants)."""
    if latent.ndim == 5:
        c = latent.shape[1]
        m = _stats(mean, latent, c, "denormalize_latents mean").view(1, c, 1, 1, 1)
        s = _stats(std, latent, c, "denormalize_latents std").view(1, c, 1, 1, 1)
    elif latent.ndim == 3:
        c = latent.shape[2]
        m = _stats(mean, latent, c, "denormalize_latents mean")
        s = _stats(std, latent, c, "denormalize_latents std")
    else:
        raise ValueError(f"denormalize_latents expects [B, C, F, H, W] or [B, T, C]; got {tuple(latent.shape)}")
    return latent * s / scaling_factor + m


def _audio_apply(latent: torch.Tensor, fn) -> torch.Tensor:
    if latent.ndim == 3:
        return fn(latent)
    if latent.ndim == 4:
        c, m = latent.shape[1], latent.shape[3]
        return unpack_audio(fn(pack_audio(latent)), channels=c, mel_bins=m)
    raise ValueError(f"audio latent must be [B, 8, T, 16] or packed [B, T, 128]; got {tuple(latent.shape)}")


def normalize_audio_latents(latent: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Audio VAE space -> model space: ``(x - mean) / std`` with stats over the 128 *packed* features.

    diffusers (``LTX2Pipeline._normalize_audio_latents``) and ComfyUI (``AudioLatentNormalizer``) apply the
    audio VAE's ``latents_mean`` / ``latents_std`` (shape ``[128]``) to the packed ``[B, T, 128]`` sequence
    (feature ``c*16 + m``). Accepts packed ``[B, T, 128]`` or unpacked ``[B, 8, T, 16]`` (returned in the same form).
    """
    return _audio_apply(
        latent,
        lambda p: (p - _stats(mean, p, p.shape[2], "audio mean")) / _stats(std, p, p.shape[2], "audio std"),
    )


def denormalize_audio_latents(latent: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`normalize_audio_latents`: ``x * std + mean`` over the 128 packed features."""
    return _audio_apply(
        latent,
        lambda p: p * _stats(std, p, p.shape[2], "audio std") + _stats(mean, p, p.shape[2], "audio mean"),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Denoise masks
# ---------------------------------------------------------------------------------------------------------------------


def image_conditioning_mask(
    batch: int,
    frames: int,
    strength: float = 1.0,
    conditioned_frames: int = 1,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """ComfyUI-style ``noise_mask`` ``[B, 1, F_lat, 1, 1]`` float32 for image-to-video.

    1.0 everywhere (generate) except the first ``conditioned_frames`` latent frames, which get ``1 - strength``
    (strength 1 = keep the encoded image exactly; 0 = ignore it). Same convention as ComfyUI's
    ``LTXVImgToVideo`` / ``LTXVImgToVideoInplace`` and the reference's ``VideoConditionByLatentIndex``
    (``denoise_mask = 1 - strength`` on that latent frame's tokens). ``frames`` is the latent frame count.

    Raises:
        ValueError: strength outside [0, 1], or conditioned_frames outside [0, frames].
    """
    if not (0.0 <= float(strength) <= 1.0):
        raise ValueError(f"strength must be in [0, 1]; got {strength}")
    if not (0 <= conditioned_frames <= frames):
        raise ValueError(f"conditioned_frames must be in [0, {frames}]; got {conditioned_frames}")
    mask = torch.ones((batch, 1, frames, 1, 1), dtype=torch.float32, device=device)
    mask[:, :, :conditioned_frames] = 1.0 - float(strength)
    return mask


def video_token_mask(mask: torch.Tensor | None, batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """Per-token denoise mask ``[B, F*H*W]`` float32 from a ComfyUI/reference latent mask.

    ``mask`` broadcastable to ``[B, 1, F, H, W]`` (e.g. ComfyUI's ``[B, 1, F, 1, 1]``); ``None`` -> all ones.
    Token order matches :func:`pack_video`. Per-token timesteps are ``mask * sigma`` (reference
    ``timesteps_from_mask``).

    Raises:
        ValueError: if the mask has more than one channel or cannot broadcast to the latent grid.
    """
    if mask is None:
        return torch.ones((batch, frames * height * width), dtype=torch.float32)
    if mask.ndim != 5:
        raise ValueError(f"video mask must be 5-D [B, 1, F, H, W] (broadcastable); got {tuple(mask.shape)}")
    if mask.shape[1] != 1:
        raise ValueError(f"video mask must have one channel; got shape {tuple(mask.shape)}")
    try:
        full = mask.to(torch.float32).expand(batch, 1, frames, height, width)
    except RuntimeError as e:
        raise ValueError(
            f"video mask of shape {tuple(mask.shape)} does not broadcast to [{batch}, 1, {frames}, {height}, {width}]"
        ) from e
    return full.reshape(batch, -1).contiguous()


def audio_token_mask(mask: torch.Tensor | None, batch: int, frames: int) -> torch.Tensor:
    """Per-token audio denoise mask ``[B, T]`` float32 from a mask broadcastable to ``[B, 1, T, 1]``; None -> ones."""
    if mask is None:
        return torch.ones((batch, frames), dtype=torch.float32)
    if mask.ndim != 4 or mask.shape[1] != 1:
        raise ValueError(f"audio mask must be [B, 1, T, 1] (broadcastable); got {tuple(mask.shape)}")
    try:
        full = mask.to(torch.float32).expand(batch, 1, frames, mask.shape[3])
    except RuntimeError as e:
        raise ValueError(f"audio mask of shape {tuple(mask.shape)} does not broadcast to [{batch}, 1, {frames}, M]") from e
    if full.shape[3] != 1 and not torch.all(full == full[..., :1]):
        raise ValueError("audio mask must be constant over the mel axis (one value per audio token)")
    return full[..., 0].reshape(batch, frames).contiguous()


__all__ = [
    "AUDIO_HOP_LENGTH",
    "AUDIO_LATENTS_PER_SECOND",
    "AUDIO_LATENT_CHANNELS",
    "AUDIO_LATENT_MEL_BINS",
    "AUDIO_MEL_BINS",
    "AUDIO_MEL_COMPRESSION",
    "AUDIO_SAMPLE_RATE",
    "AUDIO_TEMPORAL_COMPRESSION",
    "AUDIO_TOKEN_CHANNELS",
    "VAE_SPATIAL_COMPRESSION",
    "VAE_TEMPORAL_COMPRESSION",
    "VIDEO_LATENT_CHANNELS",
    "audio_coords",
    "audio_latent_frames",
    "audio_latent_shape",
    "audio_token_mask",
    "denormalize_audio_latents",
    "denormalize_latents",
    "image_conditioning_mask",
    "latent_frames",
    "normalize_audio_latents",
    "normalize_latents",
    "pack_audio",
    "pack_video",
    "unpack_audio",
    "unpack_video",
    "video_coords",
    "video_latent_shape",
    "video_token_count",
    "video_token_mask",
]
