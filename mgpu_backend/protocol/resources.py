"""What this host can run, checked before a fleet's first process starts, and the fleet's processes on record.

Bounds (`check_fleet`): at most `MAX_RANKS` ranks; CUDA ranks on GPUs that exist, one rank per GPU; CPU ranks within
`THREADS_PER_CORE` threads per core; and host memory (`memory_need`): every worker's RSS, plus — where a rank computes
on the CPU and so keeps the weights in host memory — the model files, mapped once in the page cache and shared by
every rank. On CUDA the weights pass through the page cache to the GPU, which can evict them again, so only the
workers count there (and the checkpoint mapped while sharded ranks take their shards). The memory available is
`MemAvailable` or, inside a container or any cgroup with a memory limit (v1 or v2), the room under that limit,
whichever is smaller (`memory_room`: a 2 GiB container on a host with 21.6 GB available has 2 GiB). A fleet that
does not fit is refused with the numbers and what would fit; a worker the kernel then kills anyway is reported as
probably killed by the out-of-memory killer, with the figures (`oom_text`).

Records (`write_pid_file`, `reap`): every worker the controller spawns has a pid file in the controller's
runtime directory until it has been reaped, so a controller that starts after one that died (SIGKILL, OOM killer)
ends the workers the dead one left.

Nothing here imports torch at module level (the client imports it to parse devices).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ltx2_mgpu.resources")

# A tiny-model CPU worker once it has reported ready: VmRSS 431-435 MiB (317 MiB of it anonymous: torch, diffusers
# and the interpreter), torch 2.13 CPU, Python 3.11 (bench/results/worker_rss_cpu.md). The weights are not in it (tiny).
WORKER_RSS_BYTES = 435 * 2**20
MAX_RANKS = 64  # one host; the largest single machines have 8-16 GPUs
THREADS_PER_CORE = 4  # CPU fleets may oversubscribe (tests run 4 ranks on 2 cores), not without bound
GIB = 2**30


# Bus bandwidth of the links between a fleet's GPUs, GB/s (docs/design/sharded-weights.md#links; consumer drivers
# disable P2P, and NCCL then goes through host memory). Configured figures for predictions, not measurements of this
# host.
LINKS_GBPS = {"PCIe 4.0 x16 without P2P": 10.0, "PCIe 4.0 x16 with P2P": 22.0, "NVLink (H100 / H200)": 350.0}


def sharded_gather_seconds(weight_bytes: int, world_size: int, gbps: float) -> float:
    """Seconds a sharded-weights rank spends per forward gathering the weights it does not hold, over a link of
    `gbps` GB/s: every block is gathered once per forward, a ring all-gather moving (W−1)/W of its bytes to each rank
    (not overlapped with the compute: an upper bound of what the link adds to a forward)."""
    return weight_bytes * (world_size - 1) / world_size / (gbps * 1e9)


class FleetTooLarge(ValueError):
    """A fleet this host cannot run; the message has the numbers and what would fit."""


@dataclass(frozen=True)
class Host:
    """What a fleet is checked against: CPU cores this process may use, CUDA devices, and the host memory available
    now (bytes; `memory_room`: the smaller of `MemAvailable` of /proc/meminfo and the room left under this process's
    cgroup memory limit; None where the system says neither). `memory_source` says where `available_bytes` came
    from, in the words a refusal quotes."""

    cores: int
    gpus: int
    available_bytes: int | None
    memory_source: str = "MemAvailable"

    @classmethod
    def probe(cls, root: str | Path = "/") -> Host:
        """This host now: `cpu_cores()`, `gpu_count()` and `memory_room(root)` (`root`: where /proc and /sys are
        read; "/" but in tests)."""
        room = memory_room(root)
        return cls(cpu_cores(), gpu_count(), room.available_bytes, room.source)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # a taskset / cpuset limit counts
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()  # asks NVML first: no CUDA initialisation in the controller


def mem_available(root: str | Path = "/") -> int | None:
    """`MemAvailable` of `root`/proc/meminfo in bytes (the kernel's estimate of what can be allocated without
    swapping, page cache it can drop included); None where the file or the line is missing (off Linux)."""
    try:
        with open(Path(root) / "proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page (9223372036854771712); anything this large is none
CGROUP_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit a process runs under (`cgroup_memory`): the cgroup level — its own or an ancestor's — that
    leaves the least room.

    version: 1 or 2. path: that level's directory (under the `root` it was read from). limit_bytes: its limit
    (v2 `memory.max`, v1 `memory.limit_in_bytes`). used_bytes: what is charged there now less the inactive file pages
    the kernel reclaims first (v2 `memory.current` − `memory.stat` inactive_file; v1 `memory.usage_in_bytes` −
    total_inactive_file: the working set `docker stats` and the kubelet show). oom_kills: processes the kernel's
    out-of-memory killer ended in it so far (v2 `memory.events` oom_kill, v1 `memory.oom_control` oom_kill; None
    where not reported)."""

    version: int
    path: str
    limit_bytes: int
    used_bytes: int
    oom_kills: int | None = None

    @property
    def room_bytes(self) -> int:
        """Bytes that can still be charged before the limit: limit − used, at least 0."""
        return max(0, self.limit_bytes - self.used_bytes)

    def describe(self) -> str:
        """"the cgroup v2 memory limit of /sys/fs/cgroup/x: 2.0 GiB, 1.2 GiB in use"."""
        return (f"the cgroup v{self.version} memory limit of {self.path}: {_gib(self.limit_bytes)}, "
                f"{_gib(self.used_bytes)} in use")


def _read_int(path: Path) -> int | None:
    """An integer file of a cgroup ("max" and a missing or unreadable file: None)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_key(path: Path, key: str) -> int | None:
    """The value of `key` in a "key value" file of a cgroup (memory.stat, memory.events, memory.oom_control)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """(the v1 memory controller's cgroup path, the v2 cgroup path) of this process, from root/proc/self/cgroup
    ("4:memory:/docker/abc", "0::/user.slice/x.scope"); None for each not listed."""
    v1 = v2 = None
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _levels(mount: Path, path: str) -> list[Path]:
    """The cgroup directories from `path` (under `mount`) up to the mount itself, those that exist. A path that is
    not under the mount (a container without a cgroup namespace sees the host's path, with its own cgroup mounted
    at the mount point) leaves only the mount."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    out = []
    for n in range(len(parts), -1, -1):
        d = mount.joinpath(*parts[:n])
        if d.is_dir():
            out.append(d)
    return out or ([mount] if mount.is_dir() else [])


def cgroup_memory(root: str | Path = "/") -> CgroupMemory | None:
    """The memory limit this process runs under, read from the cgroup files (nothing is written): the process's
    cgroup from `root`/proc/self/cgroup, then each level from it up to the mount, v1 (`root`/sys/fs/cgroup/memory:
    memory.limit_in_bytes, memory.usage_in_bytes, memory.stat, memory.oom_control) where the memory controller is
    a v1 one, else v2 (`root`/sys/fs/cgroup, or /sys/fs/cgroup/unified in hybrid mode: memory.max, memory.current,
    memory.stat, memory.events). The level leaving the least room (`CgroupMemory.room_bytes`) is returned; None when
    no level has a limit ("max", v1's `CGROUP_V1_UNLIMITED`, no cgroup files: off Linux). `root`: "/" but in tests
    (a fake tree)."""
    root = Path(root)
    v1, v2 = _cgroup_paths(root)
    found: list[CgroupMemory] = []
    if v1 is not None:
        for d in _levels(root / "sys/fs/cgroup/memory", v1):
            limit, usage = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is None or usage is None or limit >= CGROUP_V1_UNLIMITED:
                continue
            inactive = _read_key(d / "memory.stat", "total_inactive_file") or 0
            found.append(CgroupMemory(1, str(d), limit, max(0, usage - inactive),
                                      _read_key(d / "memory.oom_control", "oom_kill")))
    elif v2 is not None:
        mounts = [m for m in (root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified")
                  if (m / "cgroup.controllers").is_file()]
        for d in (_levels(mounts[0], v2) if mounts else []):
            limit, current = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            if limit is None or current is None:
                continue
            inactive = _read_key(d / "memory.stat", "inactive_file") or 0
            found.append(CgroupMemory(2, str(d), limit, max(0, current - inactive),
                                      _read_key(d / "memory.events", "oom_kill")))
    return min(found, key=lambda c: c.room_bytes) if found else None


@dataclass(frozen=True)
class MemoryRoom:
    """The host memory a fleet may still take (`memory_room`): available_bytes, the smaller of `MemAvailable` and
    the room under the cgroup's limit (None when neither is known); source, where it came from in words;
    mem_available_bytes and cgroup, the two readings (None where missing)."""

    available_bytes: int | None
    source: str
    mem_available_bytes: int | None = None
    cgroup: CgroupMemory | None = None


def memory_room(root: str | Path = "/") -> MemoryRoom:
    """Host memory available to this process now: `MemAvailable` beside the room its cgroup's limit leaves
    (`cgroup_memory`), the smaller of the two — in a container of 2 GiB on a host with 21.6 GB available the
    container's room is what counts (issue 36). `root`: "/" but in tests."""
    host, cgroup = mem_available(root), cgroup_memory(root)
    if cgroup is not None and (host is None or cgroup.room_bytes < host):
        also = f"; MemAvailable {_gib(host)}" if host is not None else ""
        return MemoryRoom(cgroup.room_bytes, f"under {cgroup.describe()}{also}", host, cgroup)
    return MemoryRoom(host, "MemAvailable", host, cgroup)


def available_memory(root: str | Path = "/") -> int | None:
    """Bytes of host memory this process may still take: `memory_room(root).available_bytes` (the smaller of
    MemAvailable and its cgroup's room; None where neither is known)."""
    return memory_room(root).available_bytes


def rss_bytes(pid: int) -> int | None:
    """A process's resident memory (VmRSS), None where it is gone or /proc has no such file."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid it names one
    process, not a later one that reuses the pid. None where the process is gone (or off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc; empty off Linux)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return sorted(out)


def peer_pid(conn) -> int | None:
    """The pid of the process at the other end of a Unix-socket connection (SO_PEERCRED; None off Linux or when the
    socket cannot say)."""
    import socket
    import struct

    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        finally:
            sock.close()
        return pid or None
    except (OSError, AttributeError):
        return None


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def command_line(pid: int, limit: int = 80) -> str:
    """The first `limit` characters of a process's command line ("" where unknown)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return ""


def pack_processes(env_mark: str | None = None) -> dict[int, str]:
    """pid -> "name: command line" of the pack's live processes (from /proc; empty off Linux): controllers and
    workers by the names they give themselves (`ltx2mgpu-ctl`, `ltx2mgpu-rankN`), the controller's module, or
    multiprocessing's spawn entry (a worker still importing). env_mark ("NAME=value"): only processes with that
    entry in their environment (the controllers and workers a test session or a soak started inherit it)."""
    mark = env_mark.encode() if env_mark else None
    out = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            name = process_name(pid)
            if state == "Z" or not (name.startswith("ltx2mgpu-") or "mgpu_backend.serving.controller" in cmdline
                                      or "spawn_main" in cmdline):
                continue
            if mark is not None:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
        except (OSError, IndexError):
            continue
        out[pid] = f"{name}: {cmdline[:160]}"
    return out


# ---- bounds ---------------------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def model_files(config) -> dict[str, int]:
    """path -> size of the files a fleet of `config` (a FleetConfig / FleetIdentity) loads at start; each once."""
    paths = [config.checkpoint]
    if not getattr(config, "transformer_only", False):
        paths += [config.upscaler, config.video_vae, config.audio_vae, config.text_projection]
        if not config.gemma_unload:
            paths.append(config.gemma)
    out: dict[str, int] = {}
    for p in paths:
        if p and os.path.isfile(p):
            out[os.path.realpath(p)] = os.path.getsize(p)
    return out


def mapped_bytes(config, files: dict[str, int]) -> int:
    """Bytes of model files a fleet of `config` keeps mapped in host memory while it starts (`files`: `model_files`):
    every file when a rank computes on the CPU (its weights stay in the page cache, shared by the ranks); on GPUs,
    the checkpoint with weights="sharded" (memory-mapped on the host while each rank takes its shards:
    serving/worker.py); else 0 — the files pass through the page cache, which the kernel can drop."""
    if any(d == "cpu" for d in config.devices):
        return sum(files.values())
    if getattr(config, "weights", "auto") == "sharded" and config.checkpoint and os.path.isfile(config.checkpoint):
        return files.get(os.path.realpath(config.checkpoint), 0)
    return 0


def memory_need(config, files_bytes: int, mapped: int | None = None) -> int:
    """Host memory (bytes) a fleet of `config` needs: `WORKER_RSS_BYTES` per rank, plus the model files it keeps
    mapped (`mapped`, from `mapped_bytes`; None: `files_bytes` when a rank computes on the CPU, else 0). Pinned host
    memory a job takes later (a LoRA's clean bytes on a GPU fleet: weights/lora.py `backup_device_for`) is not part
    of a fleet's start."""
    if mapped is None:
        mapped = files_bytes if any(d == "cpu" for d in config.devices) else 0
    return len(config.devices) * WORKER_RSS_BYTES + mapped


def max_cpu_ranks(host: Host, threads_per_worker: int = 1) -> int:
    """The most CPU ranks of `threads_per_worker` threads the core rule allows (`THREADS_PER_CORE`), within
    `MAX_RANKS`."""
    return max(0, min(MAX_RANKS, THREADS_PER_CORE * host.cores // threads_per_worker))


def check_rank_total(count: int, what: str, host: Host, threads_per_worker: int = 1) -> None:
    """`MAX_RANKS` on a rank count alone, before any list of that many devices is built (`client.parse_devices`
    calls it on the count a string asks for: "3000000000" is refused, not a 3-billion-entry tuple built first).
    Raises FleetTooLarge naming `what` (the value as given), the count, the limit and what would fit here."""
    if count > MAX_RANKS:
        raise FleetTooLarge(f"{what}: {count} ranks; a fleet has at most {MAX_RANKS} (one process per rank, "
                            f"on one host){_cpu_fit(host, threads_per_worker)}")


def check_rank_count(devices: tuple[str, ...], threads_per_worker: int = 1, host: Host | None = None,
                     what: str | None = None) -> None:
    """The rules that need no model file: `MAX_RANKS`, CUDA devices that exist (one rank each), CPU threads within
    `THREADS_PER_CORE` per core. Raises FleetTooLarge naming the value, the rule and what would fit."""
    host = host or Host(cpu_cores(), gpu_count(), None)
    what = what or f"devices={_short(devices)}"
    check_rank_total(len(devices), what, host, threads_per_worker)
    indices = []
    for d in devices:
        if d.startswith("cuda"):
            index = d.split(":", 1)[1] if ":" in d else "0"
            if not index.isdigit():
                raise FleetTooLarge(f"{what}: {d!r} is not a CUDA device; write 'cuda:N'")
            indices.append(int(index))
    missing = sorted({i for i in indices if i >= host.gpus})
    if missing:
        have = (f"this machine has {host.gpus} (cuda:0..cuda:{host.gpus - 1})" if host.gpus
                else "this machine has no CUDA GPU")
        raise FleetTooLarge(f"{what}: CUDA device(s) {missing} do not exist: {have}")
    doubled = sorted({i for i in indices if indices.count(i) > 1})
    if doubled:
        raise FleetTooLarge(f"{what}: cuda:{doubled[0]} is given to more than one rank; one rank per GPU (NCCL "
                            f"refuses two ranks on one device)")
    cpu_ranks = sum(d == "cpu" for d in devices)
    threads = cpu_ranks * threads_per_worker
    if threads > THREADS_PER_CORE * host.cores:
        raise FleetTooLarge(f"{what}: {cpu_ranks} CPU rank(s) x {threads_per_worker} thread(s) = {threads} threads on "
                            f"{host.cores} core(s); a CPU fleet runs at most {THREADS_PER_CORE} threads per core"
                            f"{_cpu_fit(host, threads_per_worker)}")


def _cpu_fit(host: Host, threads_per_worker: int) -> str:
    n = max_cpu_ranks(host, threads_per_worker)
    return (f" — at most {n} CPU ranks fit here (devices 'cpu:{n}'); a plain number in devices is a rank count"
            if n else " — no CPU rank of that many threads fits here")


def _short(devices: tuple[str, ...]) -> str:
    if len(set(devices)) == 1 and len(devices) > 2:
        return f"({devices[0]!r},) x {len(devices)}"
    return repr(devices)


@dataclass(frozen=True)
class MemoryCheck:
    """What `check_fleet` found of a fleet's host memory: need_bytes (`memory_need`), available_bytes (the host's
    room, `Host.available_bytes`, plus what a fleet it replaces frees), source (where the room came from:
    "MemAvailable" or the cgroup's limit, `Host.memory_source`), ranks, and oom_kills (the cgroup's out-of-memory
    kills when checked, `CgroupMemory.oom_kills`; None without a cgroup limit). A fleet keeps it to word a worker's
    SIGKILL (`oom_text`)."""

    need_bytes: int
    available_bytes: int
    source: str
    ranks: int
    oom_kills: int | None = None


def check_fleet(config, host: Host | None = None, freed_bytes: int = 0, root: str | Path = "/") -> MemoryCheck | None:
    """Every bound for a fleet of `config` (a FleetConfig): `check_rank_count`, then host memory (`memory_need` vs
    `host.available_bytes` — MemAvailable or the room under the cgroup's memory limit, the smaller: `memory_room` —
    plus `freed_bytes`, what a running fleet this one replaces gives back). Returns the `MemoryCheck` (None where the
    system reports no memory: not checked, logged). Raises FleetTooLarge with the numbers — the need, the room and
    where it came from — and the most ranks that fit. `root`: where /proc and /sys are read when `host` is None."""
    host = host or Host.probe(root)
    check_rank_count(tuple(config.devices), config.threads_per_worker, host)
    if host.available_bytes is None:
        log.warning("host memory not checked for a %d-rank fleet: this system does not report MemAvailable",
                    len(config.devices))
        return None
    files = model_files(config)
    files_bytes = sum(files.values())
    mapped = mapped_bytes(config, files)
    need = memory_need(config, files_bytes, mapped)
    available = host.available_bytes + freed_bytes
    cgroup = host.memory_source.startswith("under the cgroup")
    if need <= available:
        group = cgroup_memory(root)  # its OOM kills so far: a worker's SIGKILL later is told against them
        return MemoryCheck(need, available, host.memory_source, len(config.devices),
                           group.oom_kills if group is not None else None)
    cpu = any(d == "cpu" for d in config.devices)
    fit = max(0, (available - mapped) // WORKER_RSS_BYTES)
    if cpu:
        fit = min(fit, max_cpu_ranks(host, config.threads_per_worker))
    freed = f" + {_gib(freed_bytes)} the running fleet frees" if freed_bytes else ""
    files_text = (f" + {_gib(mapped)} of model files mapped once in the page cache (a CPU rank computes from "
                  f"them)" if cpu else f" + {_gib(mapped)} of the checkpoint mapped on the host while the ranks take "
                  f"their shards (weights='sharded')" if mapped else "")
    advice = (f"at most {fit} rank(s) fit" if fit else
              f"no rank fits: {'the model files alone need ' + _gib(mapped) if mapped else 'free some memory'}")
    where = "raise the container's memory limit, " if cgroup else ""
    raise FleetTooLarge(
        f"host memory: {len(config.devices)} rank(s) x {WORKER_RSS_BYTES / 2**20:.0f} MiB per worker (a tiny-model "
        f"worker's measured RSS){files_text} = {_gib(need)}, more than the {_gib(host.available_bytes)} available "
        f"({host.memory_source}){freed} — {advice}; {where}close other programs or ask for fewer ranks")


def oom_text(check: MemoryCheck | None, root: str | Path = "/") -> str:
    """What a worker ended by SIGKILL is told with: the kernel's out-of-memory killer is the likely cause (the cgroup
    counted a new OOM kill since `check`, or "probably" where it cannot tell: a user's `kill -9` reads the same),
    with the figures — what the fleet needed at start, the room then and where it came from, the room now."""
    now = memory_room(root)
    kills = now.cgroup.oom_kills if now.cgroup is not None else None
    if check is not None and check.oom_kills is not None and kills is not None and kills > check.oom_kills:
        head = (f"killed by the out-of-memory killer (the cgroup counts {kills - check.oom_kills} new OOM kill(s) "
                f"since the fleet started)")
    else:
        head = "probably killed by the out-of-memory killer (or a kill -9)"
    figures = []
    if check is not None:
        figures.append(f"the fleet's {check.ranks} worker(s) needed about {_gib(check.need_bytes)} of host memory at "
                       f"start, of {_gib(check.available_bytes)} available ({check.source})")
    if now.available_bytes is not None:
        figures.append(f"{_gib(now.available_bytes)} available now ({now.source})")
    more = (": " + "; ".join(figures)) if figures else ""
    return (f"{head}{more} — a job can take more than a worker's start figure; use fewer ranks, raise the memory "
            f"limit, or free memory (`dmesg` or the container's OOM events say for sure)")


# ---- pid files ------------------------------------------------------------------------------------------------------

def write_pid_file(directory: Path, pid: int, **info) -> Path:
    """Record a spawned worker (`pid`, its start time, the controller's pid and start time, and `info`)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{pid}.json"
    record = {"pid": pid, "start_time": start_time(pid), "controller_pid": os.getpid(),
              "controller_start_time": start_time(os.getpid()), **info}
    tmp = directory / f".{pid}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def same_process(pid: int, recorded_start: int | None) -> bool:
    """True while `pid` runs and is the process that was recorded (not a later one reusing the pid)."""
    now = start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)  # off Linux: alive is all we can tell
        except OSError:
            return False
        return recorded_start is None
    return recorded_start is None or now == recorded_start


def reap(directory: Path, own: bool = False) -> list[dict]:
    """End recorded workers and remove their pid files; return their records (`was_running`: it still ran and was
    killed). own=False (a controller starting): the workers whose controller is gone (it died without reaping
    them); a live controller's are left to it. own=True (a controller stopping on a signal): this process's."""
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("*.json"), key=lambda p: (len(p.stem), p.stem)):  # by pid
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        owner = record.get("controller_pid")
        mine = owner == os.getpid() and record.get("controller_start_time") == start_time(os.getpid())
        if mine != own or (not own and owner and same_process(owner, record.get("controller_start_time"))):
            continue
        record["was_running"] = same_process(record["pid"], record.get("start_time"))
        records.append((path, record))
    for _, record in records:  # every one first, then wait: a fleet's own teardown may race with this
        if record["was_running"]:
            try:
                os.kill(record["pid"], getattr(signal, "SIGKILL", signal.SIGTERM))
            except OSError:
                pass
    end = time.monotonic() + 5.0
    for path, record in records:
        while same_process(record["pid"], record.get("start_time")) and time.monotonic() < end:
            try:
                os.waitpid(record["pid"], os.WNOHANG)  # our own child: reap it, or it stays a zombie
            except ChildProcessError:
                pass
            time.sleep(0.05)
        path.unlink(missing_ok=True)
    return [record for _, record in records]

# ---- process names and parent death (Linux prctl; elsewhere these do nothing) -----------------------------------

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, value) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_process_name(name: str) -> None:
    """The name `ps -o comm`, `pgrep` and /proc/<pid>/comm show (15 bytes at most): `ltx2mgpu-ctl`, `ltx2mgpu-rank0`."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def kill_on_parent_death() -> bool:
    """Linux: the kernel sends SIGKILL to this process when the thread that spawned it ends (PR_SET_PDEATHSIG)."""
    return _prctl(_PR_SET_PDEATHSIG, int(getattr(signal, "SIGKILL", 9)))
