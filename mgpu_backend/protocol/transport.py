"""How the client, the controller and the workers pass messages, and where the controller listens.

Transport: `multiprocessing.connection` over a Unix socket (pickled messages, HMAC challenge with a 32-byte auth
key). The socket and the key live in a private directory (mode 0700; socket and key file 0600), by default
`$XDG_RUNTIME_DIR/ltx2-multigpu` or `/tmp/ltx2-multigpu-<uid>`; nothing listens on a network address. A request
longer than `MAX_MESSAGE_BYTES` is refused unread; the authentication handshake has `HANDSHAKE_TIMEOUT_S`.

Messages are pickled with plain pickle (`send`, `recv`) and read back with an unpickler that finds this package's
classes whatever name the sender imported it under (`loads`). `Pickled` carries a payload pickled once by its
producer through the controller untouched (`wire_job`: the `INLINE_JOBS`); its large tensors may ride in a
shared-memory lane instead of the bytes (`shm_lane`: the socket then carries only their offsets).
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import shm_lane
from .job_requests import JobSpec

SOCKET_NAME = "controller.sock"
KEY_NAME = "authkey"

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
_PACKAGE = __name__.rsplit(".", 2)[0]


class _Unpickler(pickle.Unpickler):
    """Resolves this package's classes whatever name the sender imported it under: ComfyUI imports the pack under a
    mangled module name, while the controller runs it as `mgpu_backend` (a `FleetConfig` pickled as
    `<mangled>.protocol.fleet_config.FleetConfig` is found here as `<this package>.protocol.fleet_config.FleetConfig`,
    and back). A class of
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


def _tensor(buf, dtype: str, shape: tuple) -> Any:
    """Rebuild a CPU tensor `_TensorPickler` wrote (its raw bytes, the dtype's name, the shape)."""
    import torch

    dt = getattr(torch, dtype)
    if not len(buf):
        return torch.empty(shape, dtype=dt)
    data = buf if isinstance(buf, bytearray) else bytearray(buf)
    return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(shape)


def _plain(obj, torch) -> bool:
    """A CPU tensor whose raw bytes are all of it (no grad, strided, not quantized, no lazy conj / neg bit)."""
    return (type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad
            and obj.layout == torch.strided and not obj.is_quantized and not obj.is_conj() and not obj.is_neg())


class _TensorPickler(pickle.Pickler):
    """Pickles plain CPU tensors as their raw bytes (one buffer, protocol 5) instead of torch's storage reduction,
    which goes through `torch.save` per storage: ~7× faster for a forward's latents (1.3 -> 0.2 ms for 1.8 MB).

    With a `lane` (`shm_lane.Lane`), a tensor of at least `shm_lane.LANE_MIN_TENSOR_BYTES` that fits in the lane's
    request (or, `reply=True`, reply) region is copied there and pickled as its offset, dtype and shape (a persistent
    id); `wanted` counts every such tensor's aligned bytes, `short` those that did not fit."""

    def __init__(self, file, lane=None, reply: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.lane = lane
        self.cursor, self.end = lane.region(reply) if lane is not None else (0, 0)
        self.wanted = self.short = self.placed = 0

    def persistent_id(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor or not _plain(obj, torch):
            return None
        n = obj.numel() * obj.element_size()
        if n < shm_lane.LANE_MIN_TENSOR_BYTES:
            return None
        size = shm_lane.align(n)
        self.wanted += size
        if self.lane is None or self.cursor + size > self.end:
            self.short += size
            return None
        offset, self.cursor = self.cursor, self.cursor + size
        t = obj.detach().contiguous()
        self.lane.write(offset, t)
        self.placed += 1
        return (offset, str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or not _plain(obj, torch):
            return NotImplemented
        t = obj.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        return _tensor, (pickle.PickleBuffer(raw) if t.numel() else raw, str(t.dtype).removeprefix("torch."),
                         tuple(t.shape))


class _LaneUnpickler(_Unpickler):
    """Reads the tensors a `_TensorPickler` put in a lane (copies: the lane is rewritten at the next call)."""

    def __init__(self, file, lane):
        super().__init__(file)
        self.lane = lane

    def persistent_load(self, pid):
        offset, dtype, shape = pid
        return self.lane.read(offset, dtype, shape)


def _pickle(obj: Any, lane=None, reply: bool = False) -> tuple[bytes, _TensorPickler]:
    buf = io.BytesIO()
    pickler = _TensorPickler(buf, lane, reply)
    pickler.dump(obj)
    return buf.getvalue(), pickler


@dataclass(frozen=True)
class Pickled:
    """A job payload or result pickled once by its producer (the client; rank 0) and unpickled only by its consumer
    (every rank; the client): the controller passes the bytes through, with no tensor (de)serialisation in between.
    The client wraps the payloads of `INLINE_JOBS` so; a rank answers a `Pickled` payload with a `Pickled` result
    (`reply`).

    `lane`: the shared-memory lane (`shm_lane.LaneRef`) holding the large tensors' bytes (request region for a
    payload, reply region for a result; `data` then carries their offsets), or None (all in `data`). `lane_short`
    (a result only): the reply region's bytes this result would have needed where they did not fit (0: all fit;
    the client makes a larger lane for its next job)."""

    data: bytes
    lane: shm_lane.LaneRef | None = None
    lane_short: int = 0

    @classmethod
    def of(cls, obj: Any, lane=None) -> Pickled:
        """`obj` pickled (CPU tensors as raw bytes); with a `shm_lane.Lane`, its large tensors in the request region
        where they fit."""
        data, p = _pickle(obj, lane)
        return cls(data, lane.ref if p.placed else None)

    def reply(self, result: Any) -> Pickled:
        """`result` pickled as this payload's answer: its large tensors in the reply region of this payload's lane
        where they fit (a rank calls it after `load`, which mapped the lane)."""
        lane = shm_lane.lane_for(self.lane) if self.lane is not None else None
        data, p = _pickle(result, lane, reply=True)
        return Pickled(data, lane.ref if p.placed else None, p.wanted if lane is not None and p.short else 0)

    def load(self) -> Any:
        """The object (this package's classes found whatever name the producer imported it under; the lane's tensors
        copied out of it). Raises shm_lane.LaneMissing where this process cannot map the lane."""
        if self.lane is None:
            return loads(self.data)
        return _LaneUnpickler(io.BytesIO(self.data), shm_lane.lane_for(self.lane)).load()


def wire_job(job: JobSpec, lanes: shm_lane.ClientLanes | None = None) -> JobSpec:
    """The job as a client sends it: an `INLINE_JOBS` payload pickled once (`Pickled`: the controller passes the bytes
    on, by value to every rank) when it pickles to at most `INLINE_MAX_BYTES`; anything else unchanged (the
    controller hands its tensors to the ranks through shared memory).

    With `lanes` (the client process's `shm_lane.ClientLanes`, held for this job), the payload's large tensors go
    into its lane — made, or replaced by a larger one, to hold them (up to `shm_lane.LANE_MAX_BYTES`)."""
    if job.kind not in INLINE_JOBS or isinstance(job.payload, Pickled):
        return job
    lane = None
    if lanes is not None and lanes.lane is not None:  # a reply region found too small last time grows here
        lane = lanes.ensure(lanes.lane.ref.request_bytes)
    data, p = _pickle(job.payload, lane)
    if lanes is not None and p.short:  # a larger lane (or none: by value)
        lane = lanes.ensure(p.wanted)
        data, p = _pickle(job.payload, lane)
    pickled = Pickled(data, lane.ref if lane is not None and p.placed else None)
    return replace(job, payload=pickled) if len(pickled.data) <= INLINE_MAX_BYTES else job
