"""The frame hand-back, both halves: rank 0 of a job writes its decoded frames to shared memory (`send_frames`), the
job's result carries a `FramesRef` to the block, and the client copies them out and frees it (`receive_frames`).
The fleet frees what no client will read (`free_frames`, `remove_orphans`).

A job imports `send_frames` from here (never the worker); the client and the fleet import the rest. Nothing here
knows the worker or the controller.

Blocks: on Linux a file in `SHM_DIR` (/dev/shm, where POSIX `shm_open` names live) named
`ltx2mgpu-<writer pid>-<monotonic ns>`, mode 0600; elsewhere a `multiprocessing.shared_memory` block. Either way the
block is not registered with the writer's resource tracker (the persistent worker must not unlink it when it exits):
whoever reads it unlinks it.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

# where POSIX shared memory lives on Linux (`shm_open` names are files here); frames are handed back through it
SHM_DIR = "/dev/shm"
BLOCK_PREFIX = "ltx2mgpu-"  # + "<writer pid>-<ns>"


@dataclass(frozen=True)
class FramesRef:
    """A block of frames in shared memory: `name` (a file in `SHM_DIR`, or a `SharedMemory` name), `shape`
    (`[F, H, W, 3]`) and `dtype` (a numpy dtype name, "float32")."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def send_frames(frames: torch.Tensor) -> FramesRef:
    """Put `[F, H, W, 3]` float32 frames in a new shared-memory block; the client unlinks it after reading.

    On Linux the block is a file in /dev/shm written with `os.write` (the kernel allocates and fills its pages
    without a fault per 4 KiB page: bench/results/docstring_figures.md); elsewhere a `SharedMemory` mapping. Raises
    OSError when /dev/shm has no room (the message says how much was needed).
    """
    array = frames.contiguous().numpy()
    if os.path.isdir(SHM_DIR):
        name = f"{BLOCK_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            view, done = memoryview(array.reshape(-1)).cast("B"), 0  # flat: an empty clip has a 0 in its shape
            while done < len(view):
                done += os.write(fd, view[done:done + (1 << 30)])
        except OSError as exc:
            os.unlink(path)
            raise OSError(exc.errno, f"cannot hand back {array.nbytes / 2**30:.2f} GiB of frames through {SHM_DIR}: "
                                     f"{exc.strerror} (make /dev/shm larger, e.g. docker --shm-size)") from None
        finally:
            os.close(fd)
        return FramesRef(name, tuple(array.shape), str(array.dtype))
    shm = shared_memory.SharedMemory(create=True, size=max(1, array.nbytes))
    try:
        view = np.ndarray(array.shape, dtype=array.dtype, buffer=shm.buf)
        view[...] = array
        del view
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (documented workaround, py<3.13)
        return FramesRef(shm.name, tuple(array.shape), str(array.dtype))
    finally:
        shm.close()


def receive_frames(result: Any) -> Any:
    """Replace the `FramesRef` in a job result's `frames` field (a frozen dataclass of `protocol/job_results.py`) by
    a tensor and free the block; any other result is returned as it is.

    On Linux the block's file is mapped with MAP_POPULATE (its pages mapped in one call, not faulted in one by one)
    and copied into ordinary memory by torch on all threads, so /dev/shm is free again as soon as this returns —
    ComfyUI may keep the frames for a long time (a zero-copy view would hold /dev/shm that long)."""
    ref = frames_ref(result)
    if ref is None:
        return result
    shape, dtype = tuple(ref.shape), np.dtype(ref.dtype)
    path = os.path.join(SHM_DIR, ref.name)
    if os.path.exists(path):
        nbytes = int(np.prod(shape)) * dtype.itemsize
        try:
            if nbytes == 0:
                return dataclasses.replace(result, frames=torch.from_numpy(np.empty(shape, dtype=dtype)))
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            with mapped:
                torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
                view = torch.frombuffer(mapped, dtype=torch_dtype).view(shape)
                # torch's copy runs on all threads: the fresh destination's page faults are shared out too
                frames = torch.empty(shape, dtype=torch_dtype).copy_(view)
                del view
        finally:
            os.unlink(path)
        return dataclasses.replace(result, frames=frames)
    shm = shared_memory.SharedMemory(name=ref.name)
    try:
        array = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
        frames = torch.from_numpy(array.copy())
        del array
    finally:
        shm.close()
        shm.unlink()
    return dataclasses.replace(result, frames=frames)


def frames_ref(result: Any) -> FramesRef | None:
    """The `FramesRef` a job result (a dataclass with a `frames` field) carries, or None."""
    frames = getattr(result, "frames", None) if dataclasses.is_dataclass(result) else None
    return frames if isinstance(frames, FramesRef) else None


def unlink_shm(name: str) -> None:
    """Free a shared-memory block of frames by name (a /dev/shm file on Linux); one already gone is fine."""
    if os.path.isdir(SHM_DIR):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
        return
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()


def free_frames(result: Any) -> None:
    """Free the frames block a job result refers to, for a result nobody will read."""
    ref = frames_ref(result)
    if ref is not None:
        unlink_shm(ref.name)


def remove_orphans(writer_pids: tuple[int, ...], keep: Any = ()) -> None:
    """Unlink the /dev/shm blocks the processes `writer_pids` wrote, except the names in `keep` (those handed to a
    client, which unlinks them)."""
    if not os.path.isdir(SHM_DIR):
        return
    prefixes = tuple(f"{BLOCK_PREFIX}{pid}-" for pid in writer_pids)
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefixes) and name not in keep:
            unlink_shm(name)
