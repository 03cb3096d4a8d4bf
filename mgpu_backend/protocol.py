"""What the client, the controller and the workers say to each other, and where the controller listens.

Transport: `multiprocessing.connection` over a Unix socket (pickled messages, HMAC challenge with a 32-byte auth
key). The socket and the key live in a private directory (mode 0700; socket and key file 0600), by default
`$XDG_RUNTIME_DIR/ltx2-multigpu` or `/tmp/ltx2-multigpu-<uid>`; nothing listens on a network address.

Client -> controller requests are dicts with an `op`:
- `{"op": "ping"}` -> `{"ok": True, "pid": …}`
- `{"op": "status"}` -> controller and fleet status (generation, devices, worker PIDs, busy job)
- `{"op": "configure", "config": FleetConfig}` -> `{"ok": True, "handle": FleetHandle}` (same `identity`: the
  running fleet is reused, whatever the policy; the handle carries the new policy, applied to each of its jobs, and
  the `FleetPlan` the fleet computed for it)
- `{"op": "submit", "handle": FleetHandle, "job": JobSpec}` -> a stream of events on the same connection, ending
  with one `result` or `error` event (or a single `busy` event). A job's payload is its kind's frozen request:
  `EncodeTextRequest`, `NoopRequest`, `FramesRequest`, `SampleRequest`, `UpscaleRequest`, `DecodeRequest` here,
  `pipelines.GenerateRequest`, `forward.ForwardRequest` / `PreprocessTextRequest`; frames in a result come back as a
  `frames.FramesRef` (shared memory)
- `{"op": "cancel", "job_id": str}`, `{"op": "shutdown_fleet"}`, `{"op": "stop"}`

`configure` answers `replaced` (what a rebuild replaced: `describe_fleet` of the old fleet, or None) and `stop` /
`shutdown_fleet` answer `stopped` (the fleet, the other clients connected, the job that was running), so the CLI
and the nodes can say what they stopped. A request the controller cannot read (not a pickled dict with a known
`op`, a `submit` without a handle and a job) is answered `{"ok": False, "event": "error", "kind": "protocol", …}`
and the connection stays; one longer than `MAX_MESSAGE_BYTES` is answered so and the connection is closed (its
bytes were never read). The authentication handshake has `HANDSHAKE_TIMEOUT_S` and runs beside other clients.

Error kinds: `ErrorKind` (`ControllerError.kind`); on the wire (the `kind` of an error event or reply) its plain
string value, e.g. "validation".

Fleet <-> worker messages (each worker's pipe): `RunJob` / `StopWorker` to the workers; `WorkerReady` /
`WorkerInitError` once, then per job `JobProgress` (rank 0) and one of `JobDone`, `JobStopped`, `JobFailed`.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import secrets
import stat
import sys
import tempfile
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

SOCKET_NAME = "controller.sock"
KEY_NAME = "authkey"

# what each job kind is doing before its first progress event (error, worker-death and stall reports name it)
JOB_STAGES = {"generate": "text encoding", "sample": "sampling", "upscale": "upscale", "decode": "decode",
              "encode_text": "text encoding", "noop": "noop", "frames": "frames hand-back"}

# a connection that has not passed the auth handshake within this long is dropped (it never blocks other clients)
HANDSHAKE_TIMEOUT_S = float(os.environ.get("LTX2_MGPU_HANDSHAKE_TIMEOUT_S", 10.0))
# the largest request the controller reads; stage payloads carry latents and Gemma embeddings (two prompts of 1024
# tokens of LTX-2's all-layer features are ~1.5 GB in float32). `LTX2_MGPU_MAX_MESSAGE_BYTES` overrides.
MAX_MESSAGE_BYTES = int(os.environ.get("LTX2_MGPU_MAX_MESSAGE_BYTES", 8 * 1024 ** 3))


# jobs whose payload and result travel between the controller and the workers pickled by value (one pickle for all
# ranks, written to each rank's pipe) instead of through torch's multiprocessing pickler, which moves every CPU
# tensor into a new shared-memory file and passes its descriptor (~ms per tensor: most of a native forward's
# round-trip overhead, bench/results/native_forward_h200.txt). Only small, frequent jobs: the native MODEL's forward
# (a few MB at the templates' sizes, its context cached on the fleet) and the diagnostics noop; the stage jobs'
# payloads (up to GBs) keep the shared-memory path, which copies them once for all ranks.
INLINE_JOBS = ("forward", "noop")
# a payload of an INLINE_JOBS job pickled larger than this takes the shared-memory path after all: by value, its bytes
# go down every rank's pipe in turn (a 25.8 MiB forward request, its context shipped: 138-141 ms by value, 101 ms
# through shared memory on the H200 machine, bench/results/native_forward_h200.txt)
INLINE_MAX_BYTES = int(os.environ.get("LTX2_MGPU_INLINE_MAX_BYTES", 8 << 20))


def send(conn, obj: Any) -> None:
    """Send with plain pickle: tensors travel by value. (`Connection.send` uses torch's ForkingPickler once torch is
    imported, which shares tensors through file descriptors only a parent/child pair can exchange.)"""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


# this package's import name: "mgpu_backend", or the mangled name ComfyUI imports the pack under
_PACKAGE = __name__.rpartition(".")[0]


class _Unpickler(pickle.Unpickler):
    """Resolves this package's classes whatever name the sender imported it under: ComfyUI imports the pack under a
    mangled module name, while the controller runs it as `mgpu_backend` (a `FleetConfig` pickled as
    `<mangled>.protocol.FleetConfig` is found here as `<this package>.protocol.FleetConfig`, and back). A class of
    this package always resolves to this copy, even where a second copy is importable (the pack also pip-installed):
    `isinstance` against this package's classes (e.g. `Pickled`, `FleetHandle`) must hold."""

    def find_class(self, module: str, name: str):
        parts = module.split(".")
        if "mgpu_backend" in parts:  # this package's class: take it from this copy of the package, never another
            own = ".".join([_PACKAGE, *parts[parts.index("mgpu_backend") + 1:]])
            try:
                return getattr(importlib.import_module(own), name)
            except (ImportError, AttributeError):
                pass
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            parts = module.split(".")
            for i in range(1, len(parts)):
                try:
                    candidate = importlib.import_module(f"{_PACKAGE}.{'.'.join(parts[i:])}")
                except ImportError:
                    continue
                if hasattr(candidate, name):
                    return getattr(candidate, name)
            raise


def send_inline(conns, obj: Any) -> None:
    """Send `obj` pickled once by value to every connection in `conns` (controller <-> workers pipes; the receiver's
    `Connection.recv` reads it like any message)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    for conn in conns:
        conn.send_bytes(data)


def recv(conn) -> Any:
    return loads(conn.recv_bytes())


def loads(data: bytes) -> Any:
    """Unpickle a message (this package's classes found whatever name the sender imported it under)."""
    return _Unpickler(io.BytesIO(data)).load()


def default_runtime_dir(name: str = "ltx2-multigpu") -> Path:
    """Private per-user directory for the socket and the key (`$LTX2_MGPU_RUNTIME_DIR` overrides)."""
    explicit = os.environ.get("LTX2_MGPU_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / name
    return Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` with mode 0700, or check an existing one is ours and private.

    Raises PermissionError when the directory belongs to another user or is open to group/others.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def read_or_create_key(directory: Path) -> bytes:
    """The controller's auth key (created once, mode 0600)."""
    key_path = directory / KEY_NAME
    if not key_path.exists():
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return key_path.read_bytes()


DTYPES = ("float32", "bfloat16", "float16")
GUIDANCE_PARALLEL_MODES = ("auto", "on", "off")  # = parallel/passes.py MODES (not imported: no torch here)
GEMMA_MODES = ("replicated", "batch_parallel", "sharded")  # = parallel/gemma.py MODES
WEIGHT_MODES = ("replicated", "sharded")  # the transformer's weights over the ranks (parallel/sharding.py)


def _positive(what: str, value, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ValueError(f"{what}={value!r}: must be a positive {'integer' if integer else 'number'}"
                         f"{' or None' if allow_none else ''}")


@dataclass(frozen=True)
class FleetIdentity:
    """What a fleet's processes are: a different identity needs new workers (and a fresh load of the weights).

    The controller decides "same fleet" from this alone (`FleetConfig.identity`); everything else is `FleetPolicy`,
    applied to the running fleet per job.

    devices: one entry per rank, e.g. ("cuda:0", "cuda:1") or ("cpu", "cpu").
    checkpoint / gemma / upscaler / video_vae / audio_vae / text_projection: the model files the workers load.
    dtype: compute dtype name (`DTYPES`).
    threads_per_worker: torch intra-op threads per CPU worker (1 for tests, so reductions match).
    collective_timeout_s: bounded collective waits; it is given to `init_process_group` and every group at fleet start
        (PyTorch's defaults are 10 min for NCCL and 30 min for gloo), so it cannot change on running processes.
    sequence_parallel: False: every rank computes every stage whole, no parallel plan (debugging).
    transformer_only: the workers load the transformer and its text connectors only (a transformer-only
        `diffusion_models/` file is enough): the fleet of the native MODEL (Load Diffusion Model (MGPU)), where
        ComfyUI's own loaders provide the VAEs and the text encoder. Only the transformer's jobs run on it
        (`worker.TRANSFORMER_JOBS`); the stage jobs are refused by name.
    gemma_mode: Gemma text encoder layout (`GEMMA_MODES`, parallel/gemma.py): "replicated" (a replica per rank, each
        encodes everything), "batch_parallel" (a replica per rank, prompts split over ranks) or "sharded" (one copy
        over every device, run from rank 0, embeddings broadcast); it decides what is loaded at start (jobs may ask
        for another mode: Gemma is then reloaded).
    gemma_unload: free Gemma after each encode (reloaded on the next cache miss), not loaded at start.
    gemma_reserve_gib: kept free on every fleet device when planning Gemma's memory (for the transformer).
    gemma_max_memory: per-device caps for Gemma, Accelerate max_memory style: (("cuda:0", "20GiB"), ("cpu", "64GiB"));
        a device named here that is not a fleet device ("cpu", "disk") takes the sharded layers the GPUs cannot hold.
    weights: the transformer's weights over the ranks (`WEIGHT_MODES`): "replicated" (every rank holds the whole
        transformer: the latency mode) or "sharded" (each rank holds 1/W of every block layer, FSDP2, gathered layer by
        layer as it runs: the memory mode for GPUs that cannot hold a replica; every forward then runs sequence
        parallel over all ranks, and the world size must divide the attention heads — parallel/sharding.py).

    Raises ValueError (naming the field, the value and the rule) on construction.
    """

    devices: tuple[str, ...]
    checkpoint: str
    gemma: str | None
    upscaler: str | None = None
    video_vae: str | None = None
    audio_vae: str | None = None
    text_projection: str | None = None
    dtype: str = "float32"
    threads_per_worker: int = 1
    collective_timeout_s: float = 300.0
    sequence_parallel: bool = True
    transformer_only: bool = False
    gemma_mode: str = "replicated"
    gemma_unload: bool = False
    gemma_reserve_gib: float = 0.0
    gemma_max_memory: tuple[tuple[str, str], ...] | None = None
    weights: str = "replicated"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights={self.weights!r}: choose one of {', '.join(WEIGHT_MODES)}")
        if (not isinstance(self.devices, tuple) or not self.devices
                or not all(isinstance(d, str) and d for d in self.devices)):
            raise ValueError(f"devices={self.devices!r}: must be a non-empty tuple of device names, one per rank "
                             f"(e.g. ('cuda:0', 'cuda:1') or ('cpu', 'cpu'))")
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(f"checkpoint={self.checkpoint!r}: must be the path of a .safetensors file")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        _positive("threads_per_worker", self.threads_per_worker, integer=True)
        _positive("collective_timeout_s", self.collective_timeout_s)
        if self.gemma_mode not in GEMMA_MODES:
            raise ValueError(f"gemma_mode={self.gemma_mode!r}: choose one of {', '.join(GEMMA_MODES)}")
        if isinstance(self.gemma_reserve_gib, bool) or not isinstance(self.gemma_reserve_gib, (int, float)) \
                or self.gemma_reserve_gib < 0:
            raise ValueError(f"gemma_reserve_gib={self.gemma_reserve_gib!r}: must be 0 or a positive number of GiB")

    @property
    def world_size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class FleetPolicy:
    """How a running fleet splits and watches its jobs: changed per job, never restarting a worker or re-reading a
    file (the groups of every degree are built at fleet start: `parallel/plan.py build_plan`).

    sp_degree: the largest sequence-parallel degree a stage may use; None = the largest that divides the heads and
        fits the ranks (checked against the checkpoint's heads by the controller, `check_config`).
    min_tokens_per_rank: None = on CUDA the cost model (parallel/cost.py) picks each SP stage's degree, on CPU the
        full degree; an int = SP on fewer ranks when a stage has fewer video tokens per rank than this (0: always the
        full degree).
    guidance_parallel: guided stages (parallel/passes.py, `GUIDANCE_PARALLEL_MODES`): "auto" (CUDA: the guidance
        passes of each step on different ranks when the cost model predicts it faster than the stage's sequence
        parallelism; CPU: sequence parallel), "on" (whenever a stage has more than one pass per step and the fleet
        more than one rank) or "off".
    token_cap: video tokens per rank per SP forward; larger jobs are refused before work (None: no cap).
    init_timeout_s: how long a fleet start may take (used when the controller starts a fleet for this policy).
    stall_timeout_s: a job with no step progress for this long is declared hung and the fleet torn down.
    compile: regional torch.compile of the transformer blocks (mgpu_backend/compile.py): the first job at each size
        pays the compile, later jobs run faster (README, "compile"). Switching it off restores the eager blocks
        (`compile.uncompile_blocks`; dynamo keeps its cache for a later switch on).

    Raises ValueError (naming the field, the value and the rule) on construction.
    """

    sp_degree: int | None = None
    min_tokens_per_rank: int | None = None
    guidance_parallel: str = "auto"
    token_cap: int | None = 65536
    init_timeout_s: float = 120.0
    stall_timeout_s: float = 300.0
    compile: bool = False

    def __post_init__(self) -> None:
        _positive("sp_degree", self.sp_degree, integer=True, allow_none=True)
        if self.min_tokens_per_rank is not None and (isinstance(self.min_tokens_per_rank, bool) or not isinstance(
                self.min_tokens_per_rank, int) or self.min_tokens_per_rank < 0):
            raise ValueError(f"min_tokens_per_rank={self.min_tokens_per_rank!r}: must be 0 (always every rank), a "
                             f"positive video-token count, or None (the cost model on CUDA)")
        if self.guidance_parallel not in GUIDANCE_PARALLEL_MODES:
            raise ValueError(f"guidance_parallel={self.guidance_parallel!r}: choose one of "
                             f"{', '.join(GUIDANCE_PARALLEL_MODES)}")
        _positive("token_cap", self.token_cap, integer=True, allow_none=True)
        _positive("init_timeout_s", self.init_timeout_s)
        _positive("stall_timeout_s", self.stall_timeout_s)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r}: must be True or False")


_IDENTITY_FIELDS = tuple(f.name for f in fields(FleetIdentity))
_POLICY_FIELDS = tuple(f.name for f in fields(FleetPolicy))


@dataclass(frozen=True)
class FleetConfig:
    """What the CLI and the nodes ask for: a fleet identity (`FleetIdentity`: the processes and what they load) and a
    policy (`FleetPolicy`: how jobs are split), as one flat value. The controller reuses a running fleet whenever
    `identity` is unchanged and applies `policy` to each job; see the two classes for the fields.

    Raises ValueError on construction when a field breaks its rule (both parts validate themselves).
    """

    devices: tuple[str, ...]
    checkpoint: str
    gemma: str | None
    upscaler: str | None = None
    video_vae: str | None = None
    audio_vae: str | None = None
    text_projection: str | None = None
    dtype: str = "float32"
    threads_per_worker: int = 1
    init_timeout_s: float = 120.0
    collective_timeout_s: float = 300.0
    stall_timeout_s: float = 300.0
    token_cap: int | None = 65536
    sp_degree: int | None = None
    min_tokens_per_rank: int | None = None
    guidance_parallel: str = "auto"
    compile: bool = False
    sequence_parallel: bool = True
    transformer_only: bool = False
    gemma_mode: str = "replicated"
    gemma_unload: bool = False
    gemma_reserve_gib: float = 0.0
    gemma_max_memory: tuple[tuple[str, str], ...] | None = None
    weights: str = "replicated"

    def __post_init__(self) -> None:
        self.identity  # noqa: B018 - validates
        self.policy  # noqa: B018

    @property
    def identity(self) -> FleetIdentity:
        return FleetIdentity(**{name: getattr(self, name) for name in _IDENTITY_FIELDS})

    @property
    def policy(self) -> FleetPolicy:
        return FleetPolicy(**{name: getattr(self, name) for name in _POLICY_FIELDS})

    @classmethod
    def of(cls, identity: FleetIdentity, policy: FleetPolicy) -> FleetConfig:
        return cls(**{name: getattr(identity, name) for name in _IDENTITY_FIELDS},
                   **{name: getattr(policy, name) for name in _POLICY_FIELDS})

    @property
    def world_size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class FleetPlan:
    """How a fleet splits its stages under one policy, as the fleet computed it (`Fleet.plan_for`, from the heads of
    the transformer its workers loaded and the rule in `parallel/degrees.py`): shown by Load Checkpoint (MGPU).

    world_size: ranks in the fleet. heads: the transformer's video attention heads.
    sp_degree: the largest sequence-parallel degree a stage may use (ranks 0..sp_degree-1); 1 when the fleet runs
        without a parallel plan (`FleetIdentity.sequence_parallel` False). Each stage's own split (fewer ranks,
        guidance passes over ranks, one GPU) is chosen per job and reported with the job.
    valid_degrees: the degrees the heads allow on this fleet (`FleetPolicy.sp_degree` must be one of them).
    set_by_policy: `sp_degree` is the policy's explicit `FleetPolicy.sp_degree`, not the largest valid one.
    """

    world_size: int
    heads: int
    sp_degree: int
    valid_degrees: tuple[int, ...]
    set_by_policy: bool = False
    sequence_parallel: bool = True


@dataclass(frozen=True)
class FleetHandle:
    """A client's reference to a fleet; `generation` detects a handle from an older fleet. `config` is the client's
    own: its `identity` names the fleet, its `policy` is applied to each job the handle submits. `plan`: the split
    the fleet computed for that policy (None from a controller that predates it)."""

    generation: int
    config: FleetConfig
    worker_pids: tuple[int, ...] = ()
    plan: FleetPlan | None = None


@dataclass
class JobSpec:
    """One job. `kind` selects the worker function ("generate"); `payload` is its input (e.g. GenerateRequest).

    `fault` injects a failure for tests (honoured only when the controller runs with LTX2_MGPU_TEST_FAULTS=1):
    `{"rank": r, "stage": "stage 1", "step": k, "kind": "crash" | "stall" | "error" | "error_all" | "reread"}`.
    """

    kind: str
    payload: Any
    job_id: str = field(default_factory=lambda: secrets.token_hex(6))
    fault: dict | None = None


def _tensor(buf, dtype: str, shape: tuple) -> Any:
    """Rebuild a CPU tensor `_TensorPickler` wrote (its raw bytes, the dtype's name, the shape)."""
    import torch

    dt = getattr(torch, dtype)
    if not len(buf):
        return torch.empty(shape, dtype=dt)
    data = buf if isinstance(buf, bytearray) else bytearray(buf)
    return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(shape)


class _TensorPickler(pickle.Pickler):
    """Pickles plain CPU tensors as their raw bytes (one buffer, protocol 5) instead of torch's storage reduction,
    which goes through `torch.save` per storage: ~7× faster for a forward's latents (1.3 -> 0.2 ms for 1.8 MB)."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad \
                or obj.layout != torch.strided or obj.is_quantized or obj.is_conj() or obj.is_neg():
            return NotImplemented
        t = obj.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        return _tensor, (pickle.PickleBuffer(raw) if t.numel() else raw, str(t.dtype).removeprefix("torch."),
                         tuple(t.shape))


@dataclass(frozen=True)
class Pickled:
    """A job payload or result pickled once by its producer (the client; rank 0) and unpickled only by its consumer
    (every rank; the client): the controller passes the bytes through, with no tensor (de)serialisation in between.
    The client wraps the payloads of `INLINE_JOBS` so; a rank answers a `Pickled` payload with a `Pickled` result."""

    data: bytes

    @classmethod
    def of(cls, obj: Any) -> "Pickled":
        buf = io.BytesIO()
        _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return cls(buf.getvalue())

    def load(self) -> Any:
        """The object (this package's classes found whatever name the producer imported it under)."""
        return loads(self.data)


# ---- job requests (the payload of a `JobSpec`; the CLI's and the native MODEL's have their own modules) ----------

# the reference's negative prompt: the default of the generate request and of Text Encode (MGPU)
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
    """The "encode_text" job (jobs/text.py): prompts -> ComfyUI CONDITIONING on the fleet.

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
    """The "noop" job (jobs/diagnostics.py: controller overhead, busy / cancel tests): `steps` synchronized,
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
    """The "frames" job (jobs/diagnostics.py: the frame hand-back benchmark): rank 0 hands back float32 frames of
    `shape` `[F, H, W, 3]` (frame i filled with i / F) through shared memory (`frames.py`). Raises ValueError on
    construction for a shape that is not four non-negative integers."""

    shape: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        if (not isinstance(self.shape, (tuple, list)) or len(self.shape) != 4
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.shape)):
            raise ValueError(f"frames: shape={self.shape!r} must be four non-negative integers [F, H, W, 3]")
        object.__setattr__(self, "shape", tuple(self.shape))


# ---- the stage jobs' requests (jobs/stages.py: SP Sampler, TDP Upscale, Distributed Decode) -----------------------
# Tensors are CPU torch tensors, latents in model space (what ComfyUI's LATENT holds for LTX-2). torch and the value
# types (`stage_params`, `forward`) are imported when a request is built, never when this module is imported (the
# controller reads these requests without building them).

STAGE_MODES = ("sequence_parallel", "tiled")
STAGE_SEMANTICS = ("reference", "comfyui")  # = stage.SEMANTICS
STAGE_SAMPLERS = ("euler", "euler_ancestral")  # = stage.SAMPLERS
STAGE_NOISE_DEVICES = ("cpu", "cuda")  # = stage.NOISE_DEVICES (where ComfyUI samples)


def _torch():
    import torch

    return torch


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
    (LTXVReferenceAudio). See `forward.py`. Raises ValueError on construction for a value of another type."""

    keyframe_idxs: Any = None
    guide_attention_entries: tuple = ()
    denoise_mask: Any = None
    ref_audio_tokens: Any = None

    def __post_init__(self) -> None:
        from .forward import GuideAttentionEntry

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
    """The "sample" job (jobs/stages.py `run_sample`): one denoising stage — SP Sampler (MGPU) (sequence parallel,
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
        forward and samplers, what SP Sampler sends; "reference": Lightricks' recipe — `stage.py`).
    stage: name for progress and errors ("stage 1", "stage 2"); None = "stage 2" for a tiled stage or one starting
        below sigma 1, else "stage 1".
    video_guidance / audio_guidance: `stage_params.GuidanceParams` or None (no guidance). stg_blocks: None (keep the
        guidances' blocks), "auto" (the model's default STG block, resolved on the fleet) or block indices (replace
        both guidances' blocks; checked against the model on the fleet).
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
        from .stage_params import GuidanceParams, as_sigmas

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
            if g is not None and not isinstance(g, GuidanceParams):
                raise ValueError(f"{job}: {name}={type(g).__name__}: must be a stage_params.GuidanceParams or None "
                                 f"(no guidance)")
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
            raise ValueError(f"{job}: guides={type(self.guides).__name__}: must be a protocol.ComfyGuides or None")


@dataclass(frozen=True, eq=False)
class UpscaleRequest:
    """The "upscale" job (jobs/stages.py `run_upscale`): 2× spatial upscale of `video` `[1, 128, F, H, W]` (model
    space) with the fleet's latent upscaler. Raises ValueError on construction for another shape."""

    video: Any

    def __post_init__(self) -> None:
        _check_latent("upscale", "video latent", self.video, 128, "[1, 128, F, H, W]")


@dataclass(frozen=True, eq=False)
class DecodeRequest:
    """The "decode" job (jobs/stages.py `run_decode`): `video` `[1, C, F, H, W]` (model space) decoded in tiles over
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


# ---- fleet <-> worker messages (each worker's pipe; `multiprocessing.Connection` pickles them) ---------------------

@dataclass(frozen=True)
class RunJob:
    """Fleet -> every worker: run `spec` under `policy` (`WorkerState.apply_policy` first; no process restarts)."""

    spec: JobSpec
    policy: FleetPolicy


@dataclass(frozen=True)
class StopWorker:
    """Fleet -> worker: leave the job loop, destroy the process group and exit."""


@dataclass(frozen=True)
class WorkerReady:
    """Worker -> fleet, once: the process group is up and the weights are loaded. `open_count`: checkpoint opens so
    far (`models.loader.OPEN_COUNT`); `load_seconds`: from joining the group to ready; `heads`: the loaded
    transformer's attention heads (the SP degree must divide them; `FleetPlan`)."""

    rank: int
    pid: int
    open_count: int
    load_seconds: float
    heads: int


@dataclass(frozen=True)
class WorkerInitError:
    """Worker -> fleet, instead of `WorkerReady`: the start failed (`error` = "Type: message")."""

    rank: int
    error: str
    traceback: str


@dataclass(frozen=True)
class JobProgress:
    """Rank 0 -> fleet: `step` of `total` steps of `stage` done (forwarded to the client as a progress event)."""

    job_id: str
    stage: str
    step: int
    total: int


@dataclass(frozen=True)
class JobDone:
    """Worker -> fleet: the job ended on this rank; `result` is rank 0's answer (other ranks send `{}`).
    `open_count` is this rank's `models.loader.OPEN_COUNT` after the job (a re-read checkpoint shows in status)."""

    job_id: str
    rank: int
    result: Any
    open_count: int


@dataclass(frozen=True)
class JobStopped:
    """Worker -> fleet: the job was cancelled on this rank before `step` of `stage` (every rank stops at the same
    step boundary)."""

    job_id: str
    rank: int
    stage: str
    step: int
    open_count: int


@dataclass(frozen=True)
class JobFailed:
    """Worker -> fleet: the job raised on this rank during `step` of `stage`. `error_type` is the exception's class
    name, `message` its text; `bad_input`: a ValidationError / FileNotFoundError (refused before work: reported as
    kind "validation")."""

    job_id: str
    rank: int
    error_type: str
    message: str
    stage: str
    step: int
    bad_input: bool
    traceback: str
    open_count: int


WorkerMessage = WorkerReady | WorkerInitError | JobProgress | JobDone | JobStopped | JobFailed


class ErrorKind(str, Enum):
    """What kind of failure a `ControllerError` (or an error event) is. A `str` enum (`enum.StrEnum` needs Python
    3.11): a member equals and hashes as its value (`ErrorKind.BUSY == "busy"`), prints as it, and the value is what
    travels on the wire."""

    VALIDATION = "validation"  # bad input, refused on every rank before work; the fleet stays
    JOB_ERROR = "job_error"  # the same error on every rank; the fleet stays
    CANCELLED = "cancelled"  # every rank stopped at the same step boundary; the fleet stays
    BUSY = "busy"  # another job runs (answered at once, never queued)
    STALE_HANDLE = "stale_handle"  # the handle names a fleet another configuration replaced
    FLEET_LOST = "fleet_lost"  # a crash, stall or one-rank error tore the fleet down
    FLEET_STOPPED = "fleet_stopped"  # a `stop` / `shutdown_fleet` from another client ended the running job
    PROTOCOL = "protocol"  # an unreadable request
    START_FAILED = "start_failed"  # (client side) the controller did not start
    NOT_RUNNING = "not_running"  # (client side) no controller answers
    ERROR = "error"  # anything else (a failure inside the controller itself)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def wire_job(job: JobSpec) -> JobSpec:
    """The job as a client sends it: an `INLINE_JOBS` payload pickled once (`Pickled`: the controller passes the bytes
    on, by value to every rank) when it pickles to at most `INLINE_MAX_BYTES`; anything else unchanged (the
    controller hands its tensors to the ranks through shared memory)."""
    if job.kind not in INLINE_JOBS or isinstance(job.payload, Pickled):
        return job
    pickled = Pickled.of(job.payload)
    return replace(job, payload=pickled) if len(pickled.data) <= INLINE_MAX_BYTES else job


class ControllerError(RuntimeError):
    """An error reported by the controller or the fleet (message says rank, stage, step where known).

    `kind`: an `ErrorKind` or its string value (converted; an unknown one, e.g. from another controller version,
    becomes `ErrorKind.ERROR` with the original in `details["kind"]`)."""

    def __init__(self, message: str, kind: ErrorKind | str = ErrorKind.ERROR, fleet_lost: bool = False,
                 details: dict | None = None):
        super().__init__(message)
        try:
            self.kind = ErrorKind(kind)
        except ValueError:  # a kind from another version of the controller: keep its message, name the kind
            self.kind = ErrorKind.ERROR
            details = {**(details or {}), "kind": str(kind)}
        self.fleet_lost = fleet_lost
        self.details = details or {}


class FleetBusy(ControllerError):
    """The fleet is running another job (answered at once, never queued)."""


class JobCancelled(ControllerError):
    """The job was cancelled; every rank stopped at the same step boundary and the fleet stays."""
