"""What SP Sampler (MGPU) sends the fleet, built from typed inputs (no ComfyUI import: tested without ComfyUI).

The guidance travels as records: "LTX-2 Guidance (MGPU)" gives one modality's `GuidanceParams` (STG blocks named) or
`GuidanceScales` (STG blocks "auto": the model's default, resolved on the fleet); "LTX-2 Guider (MGPU)" bundles the
prompts with the video and audio guidance into a `SamplerGuider`; SP Sampler (MGPU) turns a guider, a latent, a
NOISE and its `SamplerSettings` into a `SampleRequest` (`sample_request`).

The old SP Sampler's eleven widgets (`LEGACY_WIDGETS`, in the order a saved workflow's `widgets_values` holds them)
are read into a `LegacyWidgets` record, which gives the same guider and settings.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

try:  # inside ComfyUI the pack is one package (mangled name); tests import `nodes` and `mgpu_backend` top-level
    from ..mgpu_backend.protocol import stage_params as S
    from ..mgpu_backend.protocol.stage_requests import SampleRequest
except ImportError:
    from mgpu_backend.protocol import stage_params as S
    from mgpu_backend.protocol.stage_requests import SampleRequest
from .native_types import (GUIDE_CONDITIONING_KEYS, audio_frames_for, comfy_nested, frame_rate_of, guides_payload,
                           sigmas_tensor, split_conditioning, split_latent, split_noise)
from .widgets import read_widgets

SAMPLERS = ("euler", "euler_ancestral")

# the reference's stage-1 scales (`engine/sampling.py` VIDEO_GUIDANCE_LTX2 / AUDIO_GUIDANCE_LTX2, the same for every
# family; only the STG block differs, hence "auto"): what a Guider with no guidance connected uses
VIDEO_DEFAULT = S.GuidanceScales(cfg_scale=3.0, stg_scale=1.0, rescale=0.7, modality_scale=3.0)
AUDIO_DEFAULT = S.GuidanceScales(cfg_scale=7.0, stg_scale=1.0, rescale=0.7, modality_scale=3.0)

# the old SP Sampler's widgets, in the order its saved workflows list them (`widgets_values`; ComfyUI maps by position)
LEGACY_WIDGETS = ("steps", "sampler", "video_cfg", "video_stg", "video_rescale", "video_modality", "audio_cfg",
                  "audio_stg", "audio_rescale", "audio_modality", "stg_blocks")

Guidance = S.GuidanceParams | S.GuidanceScales


def parse_stg_blocks(text: str) -> str | tuple[int, ...]:
    """'auto' (or '') or a comma list of block indices -> "auto" | tuple of ints. Raises ValueError naming the text
    for anything else (a word, a negative index, an empty list)."""
    text = (text or "").strip().lower()
    if text in ("", "auto"):
        return "auto"
    try:
        blocks = tuple(int(b) for b in text.replace(" ", "").split(",") if b != "")
    except ValueError:
        raise ValueError(f"stg_blocks={text!r}: 'auto' or block indices like '29' or '28,29'") from None
    if not blocks or any(b < 0 for b in blocks):
        raise ValueError(f"stg_blocks={text!r}: 'auto' or non-negative block indices")
    return blocks


@dataclass(frozen=True)
class ModalityGuidanceWidgets:
    """One modality's guidance as "LTX-2 Guidance (MGPU)" shows it: cfg (1 = off), stg (0 = off), rescale (0 = off,
    in [0, 1]), modality (1 = off) and stg_blocks ('auto' or block indices like '28,29')."""

    cfg: float
    stg: float
    rescale: float
    modality: float
    stg_blocks: str = "auto"

    def guidance(self) -> Guidance:
        """`GuidanceScales` for stg_blocks 'auto' (the model's default block, chosen on the fleet), else
        `GuidanceParams` with those blocks. Raises ValueError for bad stg_blocks or a non-finite scale."""
        scales = S.GuidanceScales(cfg_scale=float(self.cfg), stg_scale=float(self.stg), rescale=float(self.rescale),
                                  modality_scale=float(self.modality))
        blocks = parse_stg_blocks(self.stg_blocks)
        return scales if blocks == "auto" else scales.with_blocks(blocks)


@dataclass(frozen=True, eq=False)
class SamplerGuider:
    """What "LTX-2 Guider (MGPU)" gives SP Sampler (socket LTX2_MGPU_GUIDER): the prompts and each modality's
    guidance.

    positive / negative: ComfyUI CONDITIONING (negative None: no uncond pass — then neither modality may use CFG).
    video / audio: `GuidanceParams` or `GuidanceScales`.
    Raises ValueError when a CFG scale is not 1 and no negative is given (naming both scales).
    """

    positive: Any
    negative: Any = None
    video: Guidance = VIDEO_DEFAULT
    audio: Guidance = AUDIO_DEFAULT

    def __post_init__(self) -> None:
        for name in ("video", "audio"):
            g = getattr(self, name)
            if not isinstance(g, (S.GuidanceParams, S.GuidanceScales)):
                raise ValueError(f"{name} guidance: expected LTX-2 Guidance (MGPU), got {type(g).__name__}")
        if (self.video.uses_uncond or self.audio.uses_uncond) and self.negative is None:
            raise ValueError(f"a CFG scale is not 1 (video {self.video.cfg_scale}, audio {self.audio.cfg_scale}) "
                             f"but no negative conditioning is connected (connect one, or set both CFG scales to 1)")


@dataclass(frozen=True, eq=False)
class SamplerSettings:
    """SP Sampler's own settings.

    steps: steps of the built-in LTX-2 scheduler (≥ 1), used when `sigmas` is None. sampler: `SAMPLERS`.
    sigmas: ComfyUI SIGMAS (a custom schedule ending in 0) or None. loras: `[(path, strength), …]` (a LoRA (MGPU)
    chain's payload). noise_device: where ComfyUI would sample ("cpu" / "cuda": euler_ancestral's noise stream).
    stg_blocks: the old widget's value, put in both modalities on the fleet; None: each guidance keeps its own.
    """

    steps: int = 30
    sampler: str = "euler"
    sigmas: Any = None
    loras: tuple[tuple[str, float], ...] = ()
    noise_device: str = "cpu"
    stg_blocks: str | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r}: one of {list(SAMPLERS)}")
        if self.sigmas is None and (isinstance(self.steps, bool) or int(self.steps) < 1):
            raise ValueError(f"steps={self.steps!r}: at least 1")


@dataclass(frozen=True)
class LegacyWidgets:
    """The old SP Sampler's eleven widgets (`LEGACY_WIDGETS`), read from its saved workflows: the same values give
    the same request (`guider`, `settings`)."""

    steps: int
    sampler: str
    video_cfg: float
    video_stg: float
    video_rescale: float
    video_modality: float
    audio_cfg: float
    audio_stg: float
    audio_rescale: float
    audio_modality: float
    stg_blocks: str

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> LegacyWidgets:
        """From the node's widget values by name. Raises ValueError naming a missing or unknown widget."""
        return read_widgets(cls, values, "SP Sampler")

    @classmethod
    def from_saved(cls, widgets_values: list) -> LegacyWidgets:
        """From a saved workflow's `widgets_values` (positional, `LEGACY_WIDGETS` order). Raises ValueError for
        another length."""
        if len(widgets_values) != len(LEGACY_WIDGETS):
            raise ValueError(f"SP Sampler widgets_values: {len(widgets_values)} values, expected "
                             f"{len(LEGACY_WIDGETS)} ({list(LEGACY_WIDGETS)})")
        return cls(*widgets_values)

    def guider(self, positive, negative=None) -> SamplerGuider:
        """The guider these widgets mean: scales per modality, the STG blocks left to `settings().stg_blocks`."""
        video = S.GuidanceScales(cfg_scale=float(self.video_cfg), stg_scale=float(self.video_stg),
                                 rescale=float(self.video_rescale), modality_scale=float(self.video_modality))
        audio = S.GuidanceScales(cfg_scale=float(self.audio_cfg), stg_scale=float(self.audio_stg),
                                 rescale=float(self.audio_rescale), modality_scale=float(self.audio_modality))
        return SamplerGuider(positive, negative, video, audio)

    def settings(self, sigmas=None, loras=(), noise_device: str = "cpu") -> SamplerSettings:
        return SamplerSettings(int(self.steps), self.sampler, sigmas, tuple(loras), noise_device,
                               parse_stg_blocks(self.stg_blocks))


def make_noise(noise, latent: dict, video: torch.Tensor, audio: torch.Tensor, nested: bool):
    """Video and audio noise from a native NOISE. For a video-only latent, the noise is asked for an audio+video
    latent (the fleet always generates audio with the video; the audio is dropped from the output)."""
    if nested:
        return split_noise(noise.generate_noise(latent), video.shape, audio.shape)
    try:
        nv, na = split_noise(noise.generate_noise({"samples": comfy_nested([video, audio])}), video.shape,
                             audio.shape)
    except Exception:  # noqa: BLE001 - a third-party NOISE that only knows plain tensors
        nv, na = split_noise(noise.generate_noise(latent), video.shape), None
    if na is None:
        seed = int(getattr(noise, "seed", 0) or 0)
        na = torch.randn(audio.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return nv, na


def sample_request(guider: SamplerGuider, latent: dict, noise, settings: SamplerSettings) -> SampleRequest:
    """The "sample" job SP Sampler sends: ComfyUI's LATENT (video only or audio+video, with its noise_mask), a NOISE
    (its `generate_noise`, `seed`), the guider and the settings -> a `SampleRequest` (semantics "comfyui", sequence
    parallel). Raises UnsupportedInput / ValueError (naming the input) for what the fleet cannot take."""
    parts = split_latent(latent)
    pos = split_conditioning(guider.positive, "positive", allow=GUIDE_CONDITIONING_KEYS)
    neg = (split_conditioning(guider.negative, "negative", allow=GUIDE_CONDITIONING_KEYS)
           if guider.negative is not None else None)
    fps = frame_rate_of(pos, neg)
    video, audio = parts.video, parts.audio
    if audio is None:  # any audio length goes with any video length, as in ComfyUI (e.g. 126 frames)
        audio = torch.zeros(video.shape[0], 8, audio_frames_for(video.shape[2], fps), 16)
    noise_video, noise_audio = make_noise(noise, latent, video, audio, parts.nested)
    if settings.sigmas is None:
        schedule = S.ltx2_sigmas(int(settings.steps), S.schedule_tokens(video.shape))
    else:
        schedule = sigmas_tensor(settings.sigmas)
    return SampleRequest(
        positive=pos.embeds, negative=None if neg is None else neg.embeds,
        video=video, audio=audio, video_mask=parts.video_mask, audio_mask=parts.audio_mask,
        semantics="comfyui", guides=guides_payload(pos, neg, parts.video_mask),
        noise_video=noise_video, noise_audio=noise_audio, sigmas=schedule, fps=fps,
        video_guidance=guider.video, audio_guidance=guider.audio, stg_blocks=settings.stg_blocks,
        mode="sequence_parallel", sampler=settings.sampler, seed=int(getattr(noise, "seed", 0) or 0),
        noise_device=settings.noise_device, loras=tuple(settings.loras),
    )
