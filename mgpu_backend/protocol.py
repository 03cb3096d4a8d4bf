"""What the client, the controller and the workers say to each other, and where the controller listens.

Transport: `multiprocessing.connection` over a Unix socket (pickled messages, HMAC challenge with a 32-byte auth
key). The socket and the key live in a private directory (mode 0700; socket and key file 0600), by default
`$XDG_RUNTIME_DIR/ltx2-multigpu` or `/tmp/ltx2-multigpu-<uid>`; nothing listens on a network address.

Client -> controller requests are dicts with an `op`:
- `{"op": "ping"}` -> `{"ok": True, "pid": …}`
- `{"op": "status"}` -> controller and fleet status (generation, devices, worker PIDs, busy job)
- `{"op": "configure", "config": FleetConfig}` -> `{"ok": True, "handle": FleetHandle}` (same config: reused)
- `{"op": "submit", "handle": FleetHandle, "job": JobSpec}` -> a stream of events on the same connection, ending
  with one `result` or `error` event (or a single `busy` event)
- `{"op": "cancel", "job_id": str}`, `{"op": "shutdown_fleet"}`, `{"op": "stop"}`

`configure` answers `replaced` (what a rebuild replaced: `describe_fleet` of the old fleet, or None) and `stop` /
`shutdown_fleet` answer `stopped` (the fleet, the other clients connected, the job that was running), so the CLI
and the nodes can say what they stopped. A request the controller cannot read (not a pickled dict with a known
`op`, a `submit` without a handle and a job) is answered `{"ok": False, "event": "error", "kind": "protocol", …}`
and the connection stays; one longer than `MAX_MESSAGE_BYTES` is answered so and the connection is closed (its
bytes were never read). The authentication handshake has `HANDSHAKE_TIMEOUT_S` and runs beside other clients.

Error kinds (`ControllerError.kind`, the `kind` of an error event): "validation" (bad input, refused on every rank
before work; the fleet stays), "job_error" (the same error on every rank; the fleet stays), "cancelled",
"busy", "stale_handle", "fleet_lost" (a crash, stall or one-rank error tore the fleet down), "fleet_stopped" (a
`stop` / `shutdown_fleet` from another client ended the running job), "protocol" (an unreadable request),
"start_failed" / "not_running" (client side).
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import secrets
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOCKET_NAME = "controller.sock"
KEY_NAME = "authkey"

# where POSIX shared memory lives on Linux (`shm_open` names are files here); frames are handed back through it
SHM_DIR = "/dev/shm"

# what each job kind is doing before its first progress event (error, worker-death and stall reports name it)
JOB_STAGES = {"generate": "text encoding", "sample": "sampling", "upscale": "upscale", "decode": "decode",
              "encode_text": "text encoding", "noop": "noop", "frames": "frames hand-back"}

# a connection that has not passed the auth handshake within this long is dropped (it never blocks other clients)
HANDSHAKE_TIMEOUT_S = float(os.environ.get("LTX2_MGPU_HANDSHAKE_TIMEOUT_S", 10.0))
# the largest request the controller reads; stage payloads carry latents and Gemma embeddings (two prompts of 1024
# tokens of LTX-2's all-layer features are ~1.5 GB in float32). `LTX2_MGPU_MAX_MESSAGE_BYTES` overrides.
MAX_MESSAGE_BYTES = int(os.environ.get("LTX2_MGPU_MAX_MESSAGE_BYTES", 8 * 1024 ** 3))


def send(conn, obj: Any) -> None:
    """Send with plain pickle: tensors travel by value. (`Connection.send` uses torch's ForkingPickler once torch is
    imported, which shares tensors through file descriptors only a parent/child pair can exchange.)"""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


# this package's import name: "mgpu_backend", or the mangled name ComfyUI imports the pack under
_PACKAGE = __name__.rpartition(".")[0]


class _Unpickler(pickle.Unpickler):
    """Resolves this package's classes whatever name the sender imported it under: ComfyUI imports the pack under a
    mangled module name, while the controller runs it as `mgpu_backend` (a `FleetConfig` pickled as
    `<mangled>.protocol.FleetConfig` is found here as `<this package>.protocol.FleetConfig`, and back)."""

    def find_class(self, module: str, name: str):
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


def recv(conn) -> Any:
    return loads(conn.recv_bytes())


def loads(data: bytes) -> Any:
    """Unpickle a message (this package's classes found whatever name the sender imported it under)."""
    return _Unpickler(io.BytesIO(data)).load()


def unlink_shm(name: str) -> None:
    """Free a shared-memory block of frames by name (a /dev/shm file on Linux); one already gone is fine."""
    if os.path.isdir(SHM_DIR):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
        return
    from multiprocessing import shared_memory

    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()


def free_frames(result: Any) -> None:
    """Free the frames block a job result refers to (`{"frames": {"name", …}}`), for a result nobody will read."""
    if isinstance(result, dict) and isinstance(result.get("frames"), dict):
        unlink_shm(result["frames"]["name"])


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


@dataclass(frozen=True)
class FleetConfig:
    """What a fleet is built from; a different config means a different fleet.

    devices: one entry per rank, e.g. ("cuda:0", "cuda:1") or ("cpu", "cpu").
    dtype: compute dtype name ("float32", "bfloat16", "float16").
    threads_per_worker: torch intra-op threads per CPU worker (1 for tests, so reductions match).
    init_timeout_s / collective_timeout_s: bounded process-group init and collective waits (set explicitly:
        PyTorch's defaults are 10 min for NCCL and 30 min for gloo).
    stall_timeout_s: a job with no step progress for this long is declared hung and the fleet torn down.
    """

    devices: tuple[str, ...]
    checkpoint: str
    gemma: str
    upscaler: str | None = None
    video_vae: str | None = None
    audio_vae: str | None = None
    text_projection: str | None = None
    dtype: str = "float32"
    threads_per_worker: int = 1
    init_timeout_s: float = 120.0
    collective_timeout_s: float = 300.0
    stall_timeout_s: float = 300.0
    token_cap: int | None = 65536  # video tokens per rank per SP forward; larger jobs are refused before work
    sp_degree: int | None = None  # None: the largest degree ≤ the rank count that divides the heads
    # None: on CUDA the cost model (parallel/cost.py) picks each SP stage's degree, on CPU the full degree; an int:
    # SP on fewer ranks when a stage has fewer video tokens per rank than this (0: always the full degree)
    min_tokens_per_rank: int | None = None
    # guided stages (parallel/passes.py): "auto" (CUDA: the guidance passes of each step on different ranks when the
    # cost model predicts it faster than the stage's sequence parallelism; CPU: sequence parallel), "on" (whenever a
    # stage has more than one pass per step and the fleet more than one rank) or "off"
    guidance_parallel: str = "auto"
    # regional torch.compile of the transformer blocks (mgpu_backend/compile.py): the first job at each size pays the
    # compile (~10-20 s per shape on an H200), later jobs run ~10 % faster
    compile: bool = False
    sequence_parallel: bool = True  # False: every rank computes every stage whole (fleet mechanics, debugging)
    # True: the workers load the transformer and its text connectors only (a transformer-only `diffusion_models/`
    # file is enough): the fleet of the native MODEL (Load Diffusion Model (MGPU)), where ComfyUI's own loaders
    # provide the VAEs and the text encoder. Only the transformer's jobs run on it (`TRANSFORMER_JOBS`); the stage
    # jobs are refused by name.
    transformer_only: bool = False
    # Gemma text encoder (parallel/gemma.py): "replicated" (a replica per rank, each encodes everything),
    # "batch_parallel" (a replica per rank, prompts split over ranks) or "sharded" (one copy over every device,
    # run from rank 0, embeddings broadcast); jobs may ask for another mode (Gemma is then reloaded)
    gemma_mode: str = "replicated"
    gemma_unload: bool = False  # free Gemma after each encode (reloaded on the next cache miss), not loaded at start
    gemma_reserve_gib: float = 0.0  # kept free on every fleet device when planning Gemma's memory (transformer)
    # per-device caps for Gemma, Accelerate max_memory style: (("cuda:0", "20GiB"), ("cpu", "64GiB")); a device
    # named here that is not a fleet device ("cpu", "disk") takes the sharded layers the GPUs cannot hold
    gemma_max_memory: tuple[tuple[str, str], ...] | None = None

    @property
    def world_size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class FleetHandle:
    """A client's reference to a fleet; `generation` detects a handle from an older fleet."""

    generation: int
    config: FleetConfig
    worker_pids: tuple[int, ...] = ()


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


class ControllerError(RuntimeError):
    """An error reported by the controller or the fleet (message says rank, stage, step where known)."""

    def __init__(self, message: str, kind: str = "error", fleet_lost: bool = False, details: dict | None = None):
        super().__init__(message)
        self.kind = kind
        self.fleet_lost = fleet_lost
        self.details = details or {}


class FleetBusy(ControllerError):
    """The fleet is running another job (answered at once, never queued)."""


class JobCancelled(ControllerError):
    """The job was cancelled; every rank stopped at the same step boundary and the fleet stays."""
