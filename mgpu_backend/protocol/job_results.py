"""What the jobs hand back (rank 0's answer, in `messages.JobResult`) and the controller's status (`StatusReply`),
frozen. Every job function (`mgpu_backend/jobs`) returns one of these on rank 0 and None on the other ranks (their
answers are dropped); the native MODEL's jobs answer with `forward.ForwardReply` / `ForwardMiss` /
`PreprocessTextReply`.

Frames cross the process boundary through shared memory: on the wire `frames` is a `frames.FramesRef`, and
`ControllerClient.run` hands the result back with a `[F, H, W, 3]` float32 tensor in its place
(`frames.receive_frames`). Tensors are CPU tensors (pickled by value). A dict where one of these is expected comes
from a controller started by an older version of the pack: the client raises a ControllerError naming the
process to stop (`ControllerClient.run` / `status`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerateJobResult:
    """The "generate" job (`jobs/generate.py`, CLI `generate --devices`): `pipelines.GenerateResult` as it crosses.

    frames: `[F, H, W, 3]` float32 in [0, 1] (a `frames.FramesRef` on the wire); audio: waveform `[C, S]` float32
    (None: no audio decoder) at `sample_rate` Hz; video_latent `[1, 128, F', H', W']` / audio_latent `[1, 8, T, 16]`
    float32 (model space); timings: seconds per phase ("text", "stage 1", …, "total"); lora_reports: one line per
    LoRA fused; parallel: how the stages split over the fleet; rank_reports: every rank's report (rank order)."""

    frames: Any
    audio: Any
    sample_rate: int
    video_latent: Any
    audio_latent: Any
    timings: dict
    lora_reports: tuple[str, ...] = ()
    parallel: str = ""
    rank_reports: tuple[dict, ...] | None = None


@dataclass(frozen=True)
class SampleResult:
    """The "sample" job (`jobs/stages.py`: SP Sampler, TDP Upscale): the stage's final latents in ComfyUI's layout,
    video `[1, 128, F, H, W]` and audio `[1, 8, T, 16]` float32; report: how the stage was split (the SP degree and
    why, or the tiles); lora_reports: one line per LoRA fused. Tiled stages only (else None): tile_drift (per tile,
    how far its overlap strayed), weights_normalized (the blend weights were normalized), audio_frozen."""

    video: Any
    audio: Any
    report: str = ""
    lora_reports: tuple[str, ...] = ()
    tile_drift: tuple | None = None
    weights_normalized: bool | None = None
    audio_frozen: bool | None = None


@dataclass(frozen=True)
class UpscaleResult:
    """The "upscale" job: the 2× upscaled latent `[1, 128, F, 2H, 2W]` float32 (model space)."""

    video: Any


@dataclass(frozen=True)
class DecodeResult:
    """The "decode" job: frames `[F, H, W, 3]` float32 in [0, 1] (a `frames.FramesRef` on the wire), the audio
    waveform `[C, S]` float32 at `sample_rate` Hz (both None without an audio latent), and the decode's report
    (tiles, seconds, per rank)."""

    frames: Any
    audio: Any = None
    sample_rate: int | None = None
    report: dict | None = None


@dataclass(frozen=True)
class EncodeTextResult:
    """The "encode_text" job (Text Encode (MGPU)): per prompt, embeds[i] `[1, T_i, C]` float32 (valid tokens only)
    and conditioning[i], ComfyUI's CONDITIONING `[[embeds[i], {"pooled_output": None, "unprocessed_ltxav_embeds":
    True[, "frame_rate"]}]]`; report: the encode's {mode, cache_hits, encoded, seconds, device_map, …};
    forwards_per_rank: Gemma forwards each rank has run since the fleet started; stats: rank 0's counters."""

    embeds: tuple
    conditioning: tuple
    report: dict
    forwards_per_rank: tuple[int, ...] = ()
    stats: dict | None = None


@dataclass(frozen=True)
class NoopResult:
    """The "noop" job (diagnostics): `tensor`, `[4]` float32 `arange(4) + rank` (rank 0's: 0, 1, 2, 3)."""

    tensor: Any


@dataclass(frozen=True)
class FramesResult:
    """The "frames" job (diagnostics): `frames` `[F, H, W, 3]` float32, frame i filled with i / F (a
    `frames.FramesRef` on the wire); sent_at: the wall time (s since the epoch) just before the hand-back began."""

    frames: Any
    sent_at: float


JobOutcome = GenerateJobResult | SampleResult | UpscaleResult | DecodeResult | EncodeTextResult | NoopResult | \
    FramesResult


@dataclass(frozen=True)
class ControllerStatus:
    """The controller's and the fleet's state (`StatusReply.status`).

    pid / socket: the controller's process and socket path; busy_job / busy_kind: the running job's id and kind
    (None: idle); last_failure: why the last fleet was lost or failed to start (None: nothing to say); clients: the
    connected clients, described; fleet: the running fleet (`Fleet.describe()` with "open_counts", each worker's
    checkpoint opens) or None; processes: every process the controller owns, itself first, as {"pid", "role",
    "rss_bytes"}."""

    pid: int
    socket: str
    busy_job: str | None = None
    busy_kind: str | None = None
    last_failure: str | None = None
    clients: tuple[str, ...] = ()
    fleet: dict | None = None
    processes: tuple[dict, ...] = ()
