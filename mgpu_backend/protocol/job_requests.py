"""A job as the client submits it (`JobSpec`: its kind and its payload; `FaultSpec`, a test fault) and the payloads
of the small jobs: `EncodeTextRequest` (Text Encode (MGPU)), `NoopRequest` and `FramesRequest` (diagnostics). The
stage jobs' requests are in `stage_requests.py`; the CLI's and the native MODEL's in `pipelines.GenerateRequest` and
`protocol/native_forward.py`; what the jobs hand back in `job_results.py`."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from .fleet_config import GEMMA_MODES

# what each job kind is doing before its first progress event (error, worker-death and stall reports name it)
JOB_STAGES = {"generate": "text encoding", "sample": "sampling", "upscale": "upscale", "decode": "decode",
              "encode_text": "text encoding", "noop": "noop", "frames": "frames hand-back"}


# what a test fault does at its step boundary (worker.JobContext): "crash" (the rank exits), "stall" (the rank sleeps
# an hour), "error" (the rank raises), "error_all" (every rank raises), "reread" (one more checkpoint open counted)
FAULT_KINDS = ("crash", "stall", "error", "error_all", "reread")


@dataclass(frozen=True)
class FaultSpec:
    """A failure injected into a job for tests (honoured only when the controller runs with
    LTX2_MGPU_TEST_FAULTS=1): at the step boundary of `stage` step `step`, rank `rank` does `kind` (`FAULT_KINDS`;
    "error_all" fires on every rank, and needs no rank). Raises ValueError on construction for an unknown kind, a
    negative step or rank, or a rank missing where the kind needs one."""

    stage: str
    step: int
    kind: str
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault: kind={self.kind!r}: choose one of {', '.join(FAULT_KINDS)}")
        if not isinstance(self.stage, str) or not self.stage:
            raise ValueError(f"fault: stage={self.stage!r} must name a stage (e.g. 'stage 1', 'noop')")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"fault: step={self.step!r} must be a non-negative integer")
        if self.rank is None and self.kind != "error_all":
            raise ValueError(f"fault: kind={self.kind!r} needs the rank it fires on (only 'error_all' fires on all)")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0):
            raise ValueError(f"fault: rank={self.rank!r} must be a non-negative integer or None")

    def fires(self, rank: int, stage: str, step: int) -> bool:
        """Whether this fault fires on `rank` at `stage` step `step`."""
        return stage == self.stage and step == self.step and (self.kind == "error_all" or rank == self.rank)


@dataclass(frozen=True)
class JobSpec:
    """One job. `kind` selects the worker function ("generate"); `payload` is its input (e.g. GenerateRequest);
    `job_id` names it in every event and log line; `fault` injects a failure for tests (`FaultSpec`). Frozen: a
    changed job is a new one (`dataclasses.replace`). Raises TypeError on construction for a `fault` that is not a
    `FaultSpec`."""

    kind: str
    payload: Any
    job_id: str = field(default_factory=lambda: secrets.token_hex(6))
    fault: FaultSpec | None = None

    def __post_init__(self) -> None:
        if self.fault is not None and not isinstance(self.fault, FaultSpec):
            raise TypeError(f"JobSpec.fault: expected a FaultSpec or None, got {type(self.fault).__name__} "
                            f"{self.fault!r:.120}")


DEFAULT_NEGATIVE_PROMPT = (
    "blurry, out of focus, overexposed, underexposed, low contrast, washed out colors, excessive noise, grainy "
    "texture, poor lighting, flickering, motion blur, distorted proportions, unnatural skin tones, deformed facial "
    "features, asymmetrical face, missing facial features, extra limbs, disfigured hands, wrong hand count, "
    "artifacts around text, inconsistent perspective, camera shake, incorrect depth of field, background too sharp, "
    "background clutter, distracting reflections, harsh shadows, inconsistent lighting direction, color banding, "
    "cartoonish rendering, 3D CGI look, unrealistic materials, uncanny valley effect, incorrect ethnicity, wrong "
    "gender, exaggerated expressions, wrong gaze direction, mismatched lip sync, silent or muted audio, distorted "
    "voice, robotic voice, echo, background noise, off-sync audio, incorrect dialogue, added dialogue, repetitive "
    "speech, jittery movement, awkward pauses, incorrect timing, unnatural transitions, inconsistent framing, tilted "
    "camera, flat lighting, inconsistent tone, cinematic oversaturation, stylized filters, or AI artifacts."
)  # reference DEFAULT_NEGATIVE_PROMPT (ltx_pipelines/utils/constants.py)


@dataclass(frozen=True)
class EncodeTextRequest:
    """The "encode_text" job (serving/jobs/text.py): prompts -> ComfyUI CONDITIONING on the fleet.

    prompts: one or more prompts (a single string is taken as one).
    mode: Gemma's layout for this job (`GEMMA_MODES`); None = the fleet's `FleetIdentity.gemma_mode` (another mode
        reloads Gemma).
    unload: free Gemma after this encode; None = the fleet's `FleetIdentity.gemma_unload`.
    frame_rate: frames per second written into the conditioning (None: not written).

    Raises ValueError (naming the field, the value and the rule) on construction.
    """

    prompts: tuple[str, ...]
    mode: str | None = None
    unload: bool | None = None
    frame_rate: float | None = None

    def __post_init__(self) -> None:
        prompts = (self.prompts,) if isinstance(self.prompts, str) else self.prompts
        if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"encode_text: 'prompts' must be a non-empty list of strings, got {self.prompts!r:.120}")
        object.__setattr__(self, "prompts", tuple(prompts))
        if self.mode is not None and self.mode not in GEMMA_MODES:
            raise ValueError(f"encode_text: mode={self.mode!r}: choose one of {', '.join(GEMMA_MODES)} or None (the "
                             f"fleet's)")
        if self.unload is not None and not isinstance(self.unload, bool):
            raise ValueError(f"encode_text: unload={self.unload!r} must be True, False or None (the fleet's)")
        if self.frame_rate is not None and (isinstance(self.frame_rate, bool) or not isinstance(
                self.frame_rate, (int, float)) or self.frame_rate <= 0):
            raise ValueError(f"encode_text: frame_rate={self.frame_rate!r} must be a positive number")


@dataclass(frozen=True)
class NoopRequest:
    """The "noop" job (serving/jobs/diagnostics.py: controller overhead, busy / cancel tests): `steps` synchronized,
    cancellable steps of `sleep_s` seconds each; a `[4]` float32 tensor back. `carry` travels with the job and is
    not read (transport benchmarks). Raises ValueError on construction for a negative or non-integer count."""

    steps: int = 0
    sleep_s: float = 0.0
    carry: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"noop: steps={self.steps!r} must be a non-negative integer")
        if isinstance(self.sleep_s, bool) or not isinstance(self.sleep_s, (int, float)) or self.sleep_s < 0:
            raise ValueError(f"noop: sleep_s={self.sleep_s!r} must be a non-negative number of seconds")


@dataclass(frozen=True)
class FramesRequest:
    """The "frames" job (serving/jobs/diagnostics.py: the frame hand-back benchmark): rank 0 hands back float32 frames of
    `shape` `[F, H, W, 3]` (frame i filled with i / F) through shared memory (`protocol/frames.py`). Raises ValueError on
    construction for a shape that is not four non-negative integers."""

    shape: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        if (not isinstance(self.shape, (tuple, list)) or len(self.shape) != 4
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.shape)):
            raise ValueError(f"frames: shape={self.shape!r} must be four non-negative integers [F, H, W, 3]")
        object.__setattr__(self, "shape", tuple(self.shape))
