"""Shared-memory lanes: the latents of the small, frequent jobs (`transport.INLINE_JOBS`: the native MODEL's
"forward", the diagnostics "noop") between the client and the ranks without crossing a socket (issue 27).

A lane is one file in /dev/shm (`SHM_DIR`), mode 0600, named `ltx2mgpu-<client pid>-lane-<random>`, made by a client
process and mapped once by it and by every rank that runs one of its jobs; it is reused call after call (no page
faults after the first one), and replaced by a larger one when a request does not fit. Two regions:

    [0, request_bytes)        the request's tensors, written by the client (`transport.Pickled.of(obj, lane)`)
    [request_bytes, size)     the reply's tensors, written by rank 0 (`payload.reply(result)`)

Only the tensor bytes go there (CPU tensors of at least `LANE_MIN_TENSOR_BYTES`, 64-byte aligned); the pickle,
with the tensors' offsets, dtypes and shapes (`LaneRef` + a few KB), still travels the ordinary way: client ->
controller -> ranks -> controller -> client, so the controller keeps admission (one job at a time), cancellation,
timeouts and fault handling exactly as for any job. A tensor that does not fit travels by value as before; each
reader copies its tensors out of the lane (`read`: a tensor that aliases the lane would change under its owner at the
next call).

Who writes when: the client writes the request region only between jobs (its `run` has returned: every rank has
ended the job, the controller waits for all of them); rank 0 writes the reply region only inside the job; the client
reads it after the job's result arrived. After a lost connection the client drops its lane (a rank of the old fleet
could still be alive for a moment).

Names and leaks: the name is unlinked as soon as every rank has mapped it — after the first job that carried it, by
the controller (`unlink_lane`, whatever the outcome) and by the client (on that job's final answer); the mappings
live on unnamed until the processes drop them. A client killed before its first lane job reached a rank leaves a
name whose pid is dead: `remove_dead_lanes` (run by the controller when it starts and at each fleet teardown, and by
a client before it makes a lane) unlinks it. `/dev/shm` room is reserved when a lane is made (`posix_fallocate`,
never a SIGBUS later), and a lane takes at most a quarter of the free room (`shm_free`) and `LANE_MAX_BYTES`: no room
-> no lane (the jobs take the old path). Off Linux (no /dev/shm) there are no lanes.
`LTX2_MGPU_SHM_LANE=0` turns lanes off for a client process (`ControllerClient(shm_lane=False)` for one client).
"""
from __future__ import annotations

import atexit
import collections
import mmap
import os
import secrets
import threading
from dataclasses import dataclass

SHM_DIR = "/dev/shm"  # = frames.SHM_DIR
LANE_TAG = "-lane-"  # a lane's name: f"ltx2mgpu-{pid}{LANE_TAG}{token}" (the frames blocks' prefix, see conftest.py)
PREFIX = "ltx2mgpu-"
# tensors smaller than this travel by value (their copy costs less than the bookkeeping)
LANE_MIN_TENSOR_BYTES = int(os.environ.get("LTX2_MGPU_LANE_MIN_BYTES", 16 << 10))
# the largest lane a client makes (request + reply regions; and at most a quarter of /dev/shm's free room, `shm_free`);
# a request that needs more takes the old path
LANE_MAX_BYTES = int(os.environ.get("LTX2_MGPU_LANE_MAX_BYTES", 512 << 20))
ALIGN = 64
ATTACHED_MAX = 2  # lanes a rank keeps mapped (one per client process, the newest first)


class LaneMissing(RuntimeError):
    """A rank could not map the lane a job names (its name already unlinked: a fleet started after the lane was
    made). The client drops the lane and sends the job again by value (`ControllerClient.run`)."""


@dataclass(frozen=True)
class LaneRef:
    """Which lane a `Pickled` payload or result uses: `name` (a file in /dev/shm), `size` (bytes) and
    `request_bytes` (the request region's length; the reply region follows it)."""

    name: str
    size: int
    request_bytes: int


def supported() -> bool:
    return os.path.isdir(SHM_DIR)


def shm_free() -> int:
    """Bytes free in /dev/shm (0 without it). A lane takes at most a quarter of them: a small /dev/shm (Docker's
    64 MB default) stays for the frames hand-back and NCCL, and its first, context-shipping forward takes the old
    path."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pid_of(name: str) -> int | None:
    if not name.startswith(PREFIX) or LANE_TAG not in name:
        return None
    text = name[len(PREFIX):].split("-", 1)[0]
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lane:
    """One lane mapped in this process (`create` in the client, `attach` in a rank)."""

    def __init__(self, ref: LaneRef, mapping: mmap.mmap, owner: bool):
        import torch

        self.ref, self.owner, self._mmap = ref, owner, mapping
        self._flat = torch.frombuffer(mapping, dtype=torch.uint8) if ref.size else torch.empty(0, dtype=torch.uint8)
        self.named = owner  # the creator unlinks the name once (unlink)

    @classmethod
    def create(cls, request_bytes: int, reply_bytes: int) -> Lane:
        """A new lane of `request_bytes` + `reply_bytes` (each rounded up to 64), its /dev/shm room reserved.
        Raises OSError (no room in /dev/shm, no /dev/shm); nothing is left behind then."""
        request_bytes, reply_bytes = align(max(ALIGN, request_bytes)), align(max(ALIGN, reply_bytes))
        size = request_bytes + reply_bytes
        name = f"{PREFIX}{os.getpid()}{LANE_TAG}{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # the pages exist now: a full /dev/shm fails here, not as a SIGBUS later
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(LaneRef(name, size, request_bytes), mapping, owner=True)

    @classmethod
    def attach(cls, ref: LaneRef) -> Lane:
        """Map the lane `ref` names. Raises LaneMissing when its name is gone or its size is not `ref.size`;
        ValueError for a name that is not a lane's."""
        if not isinstance(ref.name, str) or _pid_of(ref.name) is None or "/" in ref.name:
            raise ValueError(f"{ref.name!r} is not a shared-memory lane name")
        try:
            fd = os.open(os.path.join(SHM_DIR, ref.name), os.O_RDWR)
        except FileNotFoundError:
            raise LaneMissing(f"shared-memory lane {ref.name} is gone (its name is unlinked once every rank of the "
                              f"fleet that first ran it has mapped it; this fleet started later)") from None
        try:
            if os.fstat(fd).st_size != ref.size:
                raise LaneMissing(f"shared-memory lane {ref.name}: {os.fstat(fd).st_size} bytes, expected {ref.size}")
            mapping = mmap.mmap(fd, ref.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(ref, mapping, owner=False)

    def region(self, reply: bool) -> tuple[int, int]:
        """(start, end) byte offsets of the request or the reply region."""
        return (self.ref.request_bytes, self.ref.size) if reply else (0, self.ref.request_bytes)

    def write(self, offset: int, tensor) -> None:
        """Copy a contiguous CPU tensor's bytes to `offset`."""
        n = tensor.numel() * tensor.element_size()
        self._flat[offset:offset + n].copy_(tensor.reshape(-1).view(self._flat.dtype))

    def read(self, offset: int, dtype: str, shape: tuple[int, ...]):
        """A copy (in ordinary memory) of the tensor at `offset`."""
        import torch

        dt = getattr(torch, dtype)
        n = dt.itemsize
        for s in shape:
            n *= s
        return self._flat[offset:offset + n].view(dt).reshape(shape).clone()

    def unlink(self) -> None:
        """Remove the lane's name (the mappings stay valid); a name already gone is fine."""
        if self.named:
            self.named = False
            unlink_lane(self.ref.name)

    def close(self) -> None:
        """Unmap (and unlink the name where this process made it and it is still there)."""
        if self.owner:
            self.unlink()
        self._flat = None
        try:
            self._mmap.close()
        except (BufferError, ValueError):  # a tensor still views it: the mapping goes with the last view
            pass


def unlink_lane(name: str) -> None:
    """Unlink a lane's name (nothing happens to mappings of it; a name already gone is fine). Only lane names."""
    if LANE_TAG not in name or "/" in name:
        raise ValueError(f"{name!r} is not a shared-memory lane name")
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def remove_dead_lanes() -> list[str]:
    """Unlink the lanes in /dev/shm whose creating process is gone (killed before a rank mapped them); returns their
    names."""
    if not supported():
        return []
    out = []
    for name in os.listdir(SHM_DIR):
        pid = _pid_of(name)
        if pid is not None and not _alive(pid):
            unlink_lane(name)
            out.append(name)
    return out


# ---- a rank's lanes -----------------------------------------------------------------------------------------------

_attached: collections.OrderedDict[str, Lane] = collections.OrderedDict()
_own: dict[str, Lane] = {}  # lanes this process made (a client's), by name
_lock = threading.Lock()


def lane_for(ref: LaneRef) -> Lane:
    """This process's mapping of `ref`: its own lane (a client), or one mapped before (a rank), or a new mapping —
    the oldest beyond `ATTACHED_MAX` dropped, and any of a process that is gone. Raises LaneMissing."""
    with _lock:
        lane = _own.get(ref.name)
        if lane is None:
            lane = _attached.get(ref.name)
            if lane is not None and lane.ref != ref:
                lane = None
        if lane is not None:
            if ref.name in _attached:
                _attached.move_to_end(ref.name)
            return lane
        for name in [n for n in _attached if not _alive(_pid_of(n) or 0)]:
            _attached.pop(name).close()
        lane = Lane.attach(ref)
        _attached[ref.name] = lane
        while len(_attached) > ATTACHED_MAX:
            _attached.popitem(last=False)[1].close()
        return lane


# ---- a client's lane ---------------------------------------------------------------------------------------------

class ClientLanes:
    """The lane of one client process (kept across connections: ComfyUI opens one per job). `take` hands it to one
    job at a time (another thread's job meanwhile takes the old path)."""

    def __init__(self):
        self.lane: Lane | None = None
        self.busy = threading.Lock()
        self.reply_bytes = 0  # the largest reply region asked for (a reply that overflowed grows it)
        self.failed = False  # /dev/shm had no room: no more lanes in this process

    def ensure(self, request_bytes: int) -> Lane | None:
        """A lane whose request region holds `request_bytes`, its reply region `self.reply_bytes` (at least as large
        as the request region) where possible: the lane, or a new larger one that replaces it (over
        `LANE_MAX_BYTES`, without /dev/shm room or without /dev/shm the old one where it holds the request, else
        None)."""
        reply_bytes = max(self.reply_bytes, request_bytes)
        lane = self.lane
        holds = lane is not None and lane.ref.request_bytes >= request_bytes
        if holds and lane.ref.size - lane.ref.request_bytes >= reply_bytes:
            return lane
        if self.failed or not supported() or request_bytes + reply_bytes > min(LANE_MAX_BYTES, shm_free() // 4):
            return lane if holds else None
        remove_dead_lanes()
        try:
            new = Lane.create(request_bytes, reply_bytes)
        except OSError:
            self.failed = True  # no room in /dev/shm: this process stays on the old path
            return lane if holds else None
        self.drop()
        with _lock:
            _own[new.ref.name] = new
        self.lane = new
        return new

    def drop(self) -> None:
        lane, self.lane = self.lane, None
        if lane is not None:
            with _lock:
                _own.pop(lane.ref.name, None)
            lane.close()


_clients: dict[str, ClientLanes] = {}


def client_lanes(key: str) -> ClientLanes:
    """The process's lanes towards the controller at `key` (its runtime directory)."""
    with _lock:
        return _clients.setdefault(key, ClientLanes())


def enabled_by_default() -> bool:
    return os.environ.get("LTX2_MGPU_SHM_LANE", "1") not in ("0", "false", "no", "off") and supported()


def _close_all() -> None:
    for c in list(_clients.values()):
        c.drop()


atexit.register(_close_all)
