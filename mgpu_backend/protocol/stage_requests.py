"""The stage jobs' requests (serving/jobs/stages.py: SP Sampler, TDP Upscale, Distributed Decode): `SampleRequest`,
`UpscaleRequest`, `DecodeRequest` and the guides a "comfyui" sample carries (`ComfyGuides`).

Tensors are CPU torch tensors, latents in model space (what ComfyUI's LATENT holds for LTX-2). torch and the value
types (`stage_params`, `forward`) are imported when a request is built, never when this module is imported (the
controller reads these requests without building them).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

STAGE_MODES = ("sequence_parallel", "tiled")
STAGE_SEMANTICS = ("reference", "comfyui")  # = stage.SEMANTICS
STAGE_SAMPLERS = ("euler", "euler_ancestral")  # = stage.SAMPLERS
STAGE_NOISE_DEVICES = ("cpu", "cuda")  # = stage.NOISE_DEVICES (where ComfyUI samples)


def _is_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _check_tensor(job: str, name: str, x, optional: bool = False, ndim: int | None = None) -> None:
    if x is None and optional:
        return
    if not _is_tensor(x):
        raise ValueError(f"{job}: {name}={type(x).__name__}: must be a torch tensor{' or None' if optional else ''}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{job}: {name} of shape {tuple(x.shape)}: must have {ndim} dimensions")


def _check_latent(job: str, name: str, x, channels: int | None, layout: str, optional: bool = False) -> None:
    """A model-space latent: a tensor of `layout`'s rank, batch 1 (one clip per job), `channels` channels."""
    if x is None and optional:
        return
    _check_tensor(job, name, x)
    rank = layout.count(",") + 1
    if x.ndim == rank and x.shape[0] != 1:
        raise ValueError(f"{job}: {name}: batch size {x.shape[0]} — the multi-GPU samplers take one clip per job; "
                         f"queue the batch items separately")
    if x.ndim != rank or (channels is not None and x.shape[1] != channels):
        raise ValueError(f"{job}: {name} of shape {tuple(x.shape)}: expected {layout}")


def _check_number(job: str, name: str, value, *, positive: bool = False, integer: bool = False,
                  allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kind) and value == value and abs(value) != float("inf")
    if not ok or (positive and value <= 0) or (integer and not positive and value < 0):
        rule = ("a positive" if positive else "a non-negative" if integer else "a finite") + \
               (" integer" if integer else " number")
        raise ValueError(f"{job}: {name}={value!r}: must be {rule}{' or None' if allow_none else ''}")


def _check_choice(job: str, name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{job}: {name}={value!r}: choose one of {', '.join(choices)}")


def _check_tiles(job: str, name: str, tiles) -> None:
    from .stage_params import TileCountConfig

    if tiles is not None and not isinstance(tiles, TileCountConfig):
        raise ValueError(f"{job}: {name}={tiles!r}: must be a stage_params.TileCountConfig or None (a balanced grid "
                         f"from the device count)")


@dataclass(frozen=True)
class ComfyGuides:
    """What ComfyUI's LTX-AV forward receives besides the latents for guides and reference audio (semantics
    "comfyui" only), carried into every forward's `forward.ForwardRequest` unchanged: `keyframe_idxs`
    `[1, 3, N, 2]` (LTXVAddGuide), `guide_attention_entries` (`forward.GuideAttentionEntry`, in order), the raw
    video `denoise_mask` `[1, 1, F, H|1, W|1]` (its −1 cells drop tokens), `ref_audio_tokens` `[1, R, 128]`
    (LTXVReferenceAudio). See `protocol/native_forward.py`. Raises ValueError on construction for a value of another type."""

    keyframe_idxs: Any = None
    guide_attention_entries: tuple = ()
    denoise_mask: Any = None
    ref_audio_tokens: Any = None

    def __post_init__(self) -> None:
        from .native_forward import GuideAttentionEntry

        for name in ("keyframe_idxs", "denoise_mask", "ref_audio_tokens"):
            _check_tensor("guides", name, getattr(self, name), optional=True)
        entries = tuple(self.guide_attention_entries or ())
        bad = [type(e).__name__ for e in entries if not isinstance(e, GuideAttentionEntry)]
        if bad:
            raise ValueError(f"guides: guide_attention_entries holds {bad}: must be forward.GuideAttentionEntry")
        object.__setattr__(self, "guide_attention_entries", entries)

    @property
    def empty(self) -> bool:
        return (self.keyframe_idxs is None and not self.guide_attention_entries and self.denoise_mask is None
                and self.ref_audio_tokens is None)


@dataclass(frozen=True, eq=False)
class SampleRequest:
    """The "sample" job (serving/jobs/stages.py `run_sample`): one denoising stage — SP Sampler (MGPU) (sequence parallel,
    semantics "comfyui") and TDP Upscale (MGPU)'s refinement (tiled, the reference recipe).

    positive / negative: text embeddings `[1, T, C]` float (CONDITIONING, valid tokens only); negative None when no
        guidance pass needs it.
    video `[1, 128, F, H, W]`, audio `[1, 8, T, 16]`: the latents (model space); noise_video / noise_audio: the start
        noise, the same shapes (ComfyUI's NOISE; zeros for a frozen audio).
    sigmas: the schedule, 1-D, non-increasing within [0, 1], ending in 0 (stored as float32, `stage_params.as_sigmas`).
    fps: frames per second (> 0: the positions of the video tokens).
    video_mask: ComfyUI's `noise_mask`, broadcastable to `[1, 1, F, H, W]` (1 = generate); audio_mask: its audio half,
        broadcastable to `[1, 1, T, 1]`; None = generate everything.
    mode: `STAGE_MODES` ("sequence_parallel" | "tiled"). semantics: `STAGE_SEMANTICS` ("comfyui": ComfyUI 0.33's
        forward and samplers, what SP Sampler sends; "reference": Lightricks' recipe — `stages/stage.py`).
    stage: name for progress and errors ("stage 1", "stage 2"); None = "stage 2" for a tiled stage or one starting
        below sigma 1, else "stage 1".
    video_guidance / audio_guidance: `stage_params.GuidanceParams`, `stage_params.GuidanceScales` (its STG blocks: the
        model's default, resolved on the fleet) or None (no guidance). stg_blocks: None (keep the guidances' blocks),
        "auto" (the model's default STG block, resolved on the fleet) or block indices (replace both guidances'
        blocks; checked against the model on the fleet).
    sampler: `STAGE_SAMPLERS`; seed / eta / s_noise: euler_ancestral's per-step noise; noise_device: where ComfyUI
        samples (`STAGE_NOISE_DEVICES`: its noise stream is seeded `seed + 1` on the CPU, `seed` on a CUDA device —
        `stage.SamplerSpec`).
    tiles: `stage_params.TileCountConfig` for a tiled stage (None: a balanced grid); tile_overlap: latent cells (≥ 0).
    audio_frozen: the clean audio as context at timestep 0, returned unchanged; None = True for a tiled stage.
    max_first_sigma: the tiled stage's bound on `sigmas[0]` (None: `parallel.tiled.DEFAULT_MAX_FIRST_SIGMA`).
    loras: `((path, strength), …)` fused for this job on every rank and restored after it.
    guides: `ComfyGuides` (semantics "comfyui") or None.

    Raises ValueError (naming the field, the value and the rule) on construction. What needs the model (STG blocks
    that exist, tile counts and token caps that fit the fleet, LoRAs that fit the layers) and values (NaN / Inf
    inputs) are checked by the job on every rank before any step.
    """

    positive: Any
    video: Any
    audio: Any
    noise_video: Any
    noise_audio: Any
    sigmas: Any
    fps: float
    negative: Any = None
    video_mask: Any = None
    audio_mask: Any = None
    mode: str = "sequence_parallel"
    semantics: str = "reference"
    stage: str | None = None
    video_guidance: Any = None
    audio_guidance: Any = None
    stg_blocks: str | tuple[int, ...] | None = None
    sampler: str = "euler"
    seed: int = 0
    eta: float = 1.0
    s_noise: float = 1.0
    noise_device: str = "cpu"
    tiles: Any = None
    tile_overlap: int = 5
    audio_frozen: bool | None = None
    max_first_sigma: float | None = None
    loras: tuple[tuple[str, float], ...] = ()
    guides: ComfyGuides | None = None

    def __post_init__(self) -> None:
        from .stage_params import GuidanceParams, GuidanceScales, as_sigmas

        job = "sample"
        _check_choice(job, "mode", self.mode, STAGE_MODES)
        _check_choice(job, "semantics", self.semantics, STAGE_SEMANTICS)
        _check_choice(job, "sampler", self.sampler, STAGE_SAMPLERS)
        _check_choice(job, "noise_device", self.noise_device, STAGE_NOISE_DEVICES)
        if self.stage is not None and (not isinstance(self.stage, str) or not self.stage.strip()):
            raise ValueError(f"{job}: stage={self.stage!r}: a name such as 'stage 1' or 'stage 2', or None")
        _check_tensor(job, "positive", self.positive, ndim=3)
        _check_tensor(job, "negative", self.negative, optional=True, ndim=3)
        _check_latent(job, "video latent", self.video, 128, "[1, 128, F, H, W]")
        _check_latent(job, "audio latent", self.audio, 8, "[1, 8, T, 16]")
        for name, noise, latent in (("noise_video", self.noise_video, self.video),
                                    ("noise_audio", self.noise_audio, self.audio)):
            _check_tensor(job, name, noise)
            if tuple(noise.shape) != tuple(latent.shape):
                raise ValueError(f"{job}: {name} of shape {tuple(noise.shape)} does not match the latent "
                                 f"{tuple(latent.shape)}")
        _check_tensor(job, "video_mask", self.video_mask, optional=True)
        _check_tensor(job, "audio_mask", self.audio_mask, optional=True)
        try:
            sigmas = as_sigmas(self.sigmas)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{job}: sigmas: {exc}") from None
        object.__setattr__(self, "sigmas", sigmas)
        _check_number(job, "fps", self.fps, positive=True)
        for name in ("video_guidance", "audio_guidance"):
            g = getattr(self, name)
            if g is not None and not isinstance(g, (GuidanceParams, GuidanceScales)):
                raise ValueError(f"{job}: {name}={type(g).__name__}: must be a stage_params.GuidanceParams, a "
                                 f"stage_params.GuidanceScales or None (no guidance)")
        blocks = self.stg_blocks
        if blocks is not None and blocks != "auto":
            if isinstance(blocks, str) or not isinstance(blocks, (tuple, list)) or not blocks or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
                raise ValueError(f"{job}: stg_blocks={blocks!r}: None, 'auto' or a non-empty list of block indices "
                                 f"(non-negative integers)")
            object.__setattr__(self, "stg_blocks", tuple(blocks))
        _check_number(job, "seed", self.seed, integer=True)
        _check_number(job, "eta", self.eta)
        _check_number(job, "s_noise", self.s_noise)
        _check_tiles(job, "tiles", self.tiles)
        _check_number(job, "tile_overlap", self.tile_overlap, integer=True)
        if self.audio_frozen is not None and not isinstance(self.audio_frozen, bool):
            raise ValueError(f"{job}: audio_frozen={self.audio_frozen!r}: must be True, False or None (frozen for a "
                             f"tiled stage)")
        _check_number(job, "max_first_sigma", self.max_first_sigma, positive=True, allow_none=True)
        loras = []
        for entry in self.loras or ():
            try:
                path, strength = entry
            except (TypeError, ValueError):
                raise ValueError(f"{job}: loras entry {entry!r}: expected (path, strength)") from None
            if not isinstance(path, str) or not path:
                raise ValueError(f"{job}: loras entry {entry!r}: the path must be a non-empty string")
            _check_number(job, f"strength of LoRA {path!r}", strength)
            loras.append((path, strength))
        object.__setattr__(self, "loras", tuple(loras))
        if self.guides is not None and not isinstance(self.guides, ComfyGuides):
            raise ValueError(f"{job}: guides={type(self.guides).__name__}: must be a ComfyGuides or None")


@dataclass(frozen=True, eq=False)
class UpscaleRequest:
    """The "upscale" job (serving/jobs/stages.py `run_upscale`): 2× spatial upscale of `video` `[1, 128, F, H, W]` (model
    space) with the fleet's latent upscaler. Raises ValueError on construction for another shape."""

    video: Any

    def __post_init__(self) -> None:
        _check_latent("upscale", "video latent", self.video, 128, "[1, 128, F, H, W]")


@dataclass(frozen=True, eq=False)
class DecodeRequest:
    """The "decode" job (serving/jobs/stages.py `run_decode`): `video` `[1, C, F, H, W]` (model space) decoded in tiles over
    the fleet, `audio` `[1, 8, T, 16]` (or None) once on rank 0.

    tiles: `stage_params.TileCountConfig` or None (a balanced grid from the device count; one rank: untiled).
    overlap: tile overlap in latent cells (≥ 0). seed: the conv decoder's decode noise (LTX-2.5's diffusion decoder
    uses ComfyUI's fixed seed 0). Raises ValueError (naming the field, the value and the rule) on construction.
    """

    video: Any
    audio: Any = None
    tiles: Any = None
    overlap: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        job = "decode"
        _check_latent(job, "video latent", self.video, None, "[1, C, F, H, W]")
        _check_latent(job, "audio latent", self.audio, 8, "[1, 8, T, 16]", optional=True)
        _check_tiles(job, "tiles", self.tiles)
        _check_number(job, "overlap", self.overlap, integer=True)
        _check_number(job, "seed", self.seed, integer=True)
