"""What the jobs hand back (rank 0's answer, in `messages.JobResult`) and what the controller reports — its status
(`StatusReply`: `ControllerStatus`, with `FleetDescription` and `ProcessInfo`) and what a stop or a rebuild ended
(`Stopped` / `Configured.replaced`: `FleetTeardown`) —, frozen. Every job function (`mgpu_backend/jobs`) returns one
of the job results on rank 0 and None on the other ranks (their answers are dropped); the native MODEL's jobs answer
with `forward.ForwardReply` / `ForwardMiss` / `PreprocessTextReply`.

Frames cross the process boundary through shared memory: on the wire `frames` is a `frames.FramesRef`, and
`ControllerClient.run` hands the result back with a `[F, H, W, 3]` float32 tensor in its place
(`frames.receive_frames`). Tensors are CPU tensors (pickled by value). A dict where one of these is expected comes
from a controller started by an older version of the pack: the client raises a ControllerError naming the
process to stop (`ControllerClient.run`, `status`, `configure`, `shutdown_fleet`, `stop`).

The controller's reports print as JSON through `dataclasses.asdict` (`python -m mgpu_backend status`): their field
names are the keys users' scripts read, kept from when they were dicts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fleet_config import FleetPlan, FleetPolicy
from .link import LinkReport


@dataclass(frozen=True)
class GenerateTimings:
    """Seconds per phase of one generate job (`stages.pipelines.TwoStagePipeline.generate`), wall time on this rank.

    text: the prompts' text contexts; stage_1 / stage_2: the two denoising stages; upscale: the 2× latent upscale;
    decode_video / decode_audio: the decoders; total: the whole job. `as_dict()` names them as the CLI prints them.
    """

    text: float = 0.0
    stage_1: float = 0.0
    upscale: float = 0.0
    stage_2: float = 0.0
    decode_video: float = 0.0
    decode_audio: float = 0.0
    total: float = 0.0

    @classmethod
    def from_phases(cls, phases: dict[str, float]) -> GenerateTimings:
        """From `{"text": s, "stage 1": s, …}` (the printed names). Raises ValueError naming an unknown phase."""
        names = {f.replace("_", " "): f for f in cls.__dataclass_fields__}
        unknown = sorted(set(phases) - set(names))
        if unknown:
            raise ValueError(f"GenerateTimings: unknown phase(s) {unknown} (known: {list(names)})")
        return cls(**{names[k]: float(v) for k, v in phases.items()})

    def as_dict(self) -> dict[str, float]:
        """`{"text": s, "stage 1": s, "upscale": s, "stage 2": s, "decode video": s, "decode audio": s, "total": s}`,
        in the order the phases run."""
        return {f.replace("_", " "): getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class DecodeReport:
    """How one rank decoded the video (`splits.decode.decode_tiles`, `TwoStagePipeline.decode_video`).

    tiles: the indices of the tiles this rank decoded (row-major over the tile grid), or "untiled"; seconds: the
    decode's wall time on this rank; rank: this rank; auto_tiling: why the decode was tiled automatically (the
    diffusion decoder's memory estimate, e.g. "tiled 2×2 automatically: untiled needs ~85 GiB, 60 GiB free"), else
    None; attention: the slower attention the decode ran with, and its cost (the diffusion decoder's neighborhood
    attention without comfy-kitchen on a GPU: `models.neighborhood.PLAIN_ON_GPU`), else None.
    """

    tiles: tuple[int, ...] | str
    seconds: float
    rank: int = 0
    auto_tiling: str | None = None
    attention: str | None = None

    @property
    def tiles_text(self) -> str:
        """The tiles as the CLI prints them: "[0, 2]" or "untiled"."""
        return self.tiles if isinstance(self.tiles, str) else str(list(self.tiles))


@dataclass(frozen=True)
class RankReport:
    """What one rank did in a generate job.

    rank: the rank; stage_1 / stage_2: how each stage ran on it (the split and why, "local" in one process);
    decode: its `DecodeReport`; timings: its `GenerateTimings`; speed: lines on CUDA graphs, fp8 / int8 compute and
    batched guidance passes (`speed_report`; () when there is nothing to say); weights: where its transformer weights
    are (`weights.sharding.ShardingReport.describe`: "weights placed: 40 of 52 units replicated, 12 sharded over 2
    ranks; resident … GiB; gathers … GB per forward …"; "" in one process).
    """

    rank: int
    stage_1: str
    stage_2: str
    decode: DecodeReport
    timings: GenerateTimings
    speed: tuple[str, ...] = ()
    weights: str = ""


@dataclass(frozen=True)
class GenerateJobResult:
    """The "generate" job (`serving/jobs/generate.py`, CLI `generate --devices`): `pipelines.GenerateResult` as it crosses.

    frames: `[F, H, W, 3]` float32 in [0, 1] (a `frames.FramesRef` on the wire); audio: waveform `[C, S]` float32
    (None: no audio decoder) at `sample_rate` Hz; video_latent `[1, 128, F', H', W']` / audio_latent `[1, 8, T, 16]`
    float32 (model space); timings: rank 0's `GenerateTimings`; lora_reports: one line per LoRA fused; parallel: how
    the stages split over the fleet; rank_reports: every rank's `RankReport` (rank order)."""

    frames: Any
    audio: Any
    sample_rate: int
    video_latent: Any
    audio_latent: Any
    timings: GenerateTimings
    lora_reports: tuple[str, ...] = ()
    parallel: str = ""
    rank_reports: tuple[RankReport, ...] | None = None


@dataclass(frozen=True)
class SampleResult:
    """The "sample" job (`serving/jobs/stages.py`: SP Sampler, TDP Upscale): the stage's final latents in ComfyUI's layout,
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
    waveform `[C, S]` float32 at `sample_rate` Hz (both None without an audio latent), and rank 0's `DecodeReport`."""

    frames: Any
    audio: Any = None
    sample_rate: int | None = None
    report: DecodeReport | None = None


@dataclass(frozen=True)
class TextEncodeReport:
    """How one text encode ran (`stages.text_encoder.TextEncoderService.encode`).

    mode: the Gemma mode it ran in ("replicated" | "batch_parallel" | "sharded"); requested_mode: the one asked for
    (batch_parallel with one distinct prompt runs replicated when not strict). prompts / distinct: prompts given /
    distinct among them; cache_hits: distinct prompts served from the cache; encoded: distinct prompts run through
    Gemma; forwards_here: Gemma forwards this rank ran; unloaded: Gemma was dropped afterwards; seconds: wall time;
    device_map: for "sharded", {device: "embed_tokens, rotary_emb, layers.0-11"} (None otherwise).
    """

    mode: str
    requested_mode: str
    prompts: int
    distinct: int
    cache_hits: int
    encoded: int
    forwards_here: int
    unloaded: bool
    seconds: float
    device_map: dict[str, str] | None = None


@dataclass(frozen=True)
class TextEncoderCounters:
    """A text-encoder service's counters since its fleet started: Gemma forwards, cache hits and misses (distinct
    prompts), loads and unloads of Gemma."""

    forwards: int = 0
    hits: int = 0
    misses: int = 0
    loads: int = 0
    unloads: int = 0


@dataclass(frozen=True)
class EncodeTextResult:
    """The "encode_text" job (Text Encode (MGPU)): per prompt, embeds[i] `[1, T_i, C]` float32 (valid tokens only)
    and conditioning[i], ComfyUI's CONDITIONING `[[embeds[i], {"pooled_output": None, "unprocessed_ltxav_embeds":
    True[, "frame_rate"]}]]`; report: how the encode ran (rank 0's `TextEncodeReport`); forwards_per_rank: Gemma
    forwards each rank has run since the fleet started; stats: rank 0's `TextEncoderCounters`."""

    embeds: tuple
    conditioning: tuple
    report: TextEncodeReport
    forwards_per_rank: tuple[int, ...] = ()
    stats: TextEncoderCounters | None = None


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


# ---- the controller's reports ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetDescription:
    """A running fleet, as the controller reports it (built by `Fleet.describe`): in `ControllerStatus.fleet`, and
    in `FleetTeardown.fleet` for a fleet a stop or a rebuild ended.

    generation: the fleet's number (it grows by one with every fleet this controller starts); devices: one torch
    device string per rank ("cuda:0", "cpu"); worker_pids: one worker process id per rank (rank order);
    checkpoint: the transformer checkpoint's path; weights: the mode asked for (`FleetIdentity.weights`; where the
    workers placed them: `plan.weights`);
    load_seconds: the slowest rank's load time at start, seconds; int8_compute: the int8 path rank 0's layers take
    (None: not an int8 checkpoint); policy: the policy of the fleet's last job (its start policy before any job);
    plan: the split its jobs get under that policy (`Fleet.plan_for`); open_counts: per rank, how many times the
    worker has opened a checkpoint file (`loader.OPEN_COUNT`) as of its last report (start or last job) — it stays
    put while the same fleet serves; link: what the fleet measured of its links at start (`LinkReport`, rank 0's;
    None from a fleet that did not measure); predicted: the predicted step times of the 720p template's stages on
    this fleet against one card with weight streaming, one line per stage (`splits/weights_cost.py`; () on CPU
    ranks); transformer_only: the fleet holds the transformer alone (`FleetIdentity.transformer_only`: Load
    Diffusion Model (MGPU)'s fleet), False for one that holds the whole checkpoint.

    Raises ValueError when devices, worker_pids and open_counts do not give one entry per rank each."""

    generation: int
    devices: tuple[str, ...]
    worker_pids: tuple[int, ...]
    checkpoint: str
    weights: str
    load_seconds: float
    int8_compute: str | None
    policy: FleetPolicy
    plan: FleetPlan
    open_counts: tuple[int, ...]
    link: LinkReport | None = None
    predicted: tuple[str, ...] = ()
    transformer_only: bool = False

    def __post_init__(self):
        if not len(self.devices) == len(self.worker_pids) == len(self.open_counts):
            raise ValueError(f"FleetDescription: devices {self.devices}, worker_pids {self.worker_pids} and "
                             f"open_counts {self.open_counts} must give one entry per rank each")


@dataclass(frozen=True)
class ProcessInfo:
    """A process the controller owns (`ControllerStatus.processes`, built by `Controller.processes`).

    pid: its process id; role: "controller", "worker rank R" (R its rank in the running fleet) or
    "helper (<its command line>)" (e.g. multiprocessing's resource tracker); rss_bytes: its resident memory in
    bytes (None where it cannot be read: off Linux, or the process has just exited)."""

    pid: int
    role: str
    rss_bytes: int | None = None


@dataclass(frozen=True)
class FleetTeardown:
    """What a `ShutdownFleet` / `Stop` (`messages.Stopped.stopped`) or a rebuild for another configuration
    (`messages.Configured.replaced`) ended.

    fleet: the fleet it tore down (None: none was running); clients: the other clients connected to the controller
    at the time, "pid N (name)" each (ComfyUI and the CLI share one controller); job: what was running and was
    cancelled, e.g. "a generate job (<id>)" (None: nothing ran; always None for a rebuild, which is refused while a
    job runs)."""

    fleet: FleetDescription | None
    clients: tuple[str, ...] = ()
    job: str | None = None


@dataclass(frozen=True)
class ControllerStatus:
    """The controller's and the fleet's state (`StatusReply.status`).

    pid / socket: the controller's process and socket path; busy_job / busy_kind: the running job's id and kind
    (None: idle); last_failure: why the last fleet was lost or failed to start (None: nothing to say); clients: the
    connected clients, "pid N (name)" each; fleet: the running fleet, or None; processes: every process the
    controller owns, itself first."""

    pid: int
    socket: str
    busy_job: str | None = None
    busy_kind: str | None = None
    last_failure: str | None = None
    clients: tuple[str, ...] = ()
    fleet: FleetDescription | None = None
    processes: tuple[ProcessInfo, ...] = ()
