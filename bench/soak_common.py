"""Helpers shared by the soaks (bench/soak_controller.py, bench/soak_comfyui.py): process memory, liveness and
process trees from /proc, and the /dev/shm frames blocks a soak's workers left."""
from __future__ import annotations

import os
import re

from mgpu_backend.protocol.frames import SHM_DIR

# `frames.send_frames` names its blocks ltx2mgpu-<writer pid>-<ns>
SHM_BLOCK = re.compile(r"ltx2mgpu-(\d+)-")


def rss_kib(pid: int) -> int:
    """Resident plus swapped-out memory (VmRSS + VmSwap) in KiB: on a machine under memory pressure RSS alone falls
    when pages are swapped out, which is not the process shrinking. 0 where the process is gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmSwap:")):
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc PPid links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shm_blocks() -> set[str]:
    """Names of the files in /dev/shm (shared with every process of the machine)."""
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


def leaked_blocks(before: set[str], writers: set[int] | None = None) -> list[str]:
    """Frames blocks made since `before` and still there: those whose writer is one of `writers` (when given) or
    is gone (when not: a live writer of another run keeps its blocks)."""
    out = []
    for name in sorted(shm_blocks() - before):
        m = SHM_BLOCK.match(name)
        if m and (int(m.group(1)) in writers if writers is not None else not alive(int(m.group(1)))):
            out.append(name)
    return out
