"""What this host can run, checked before a fleet's first process starts, and the fleet's processes on record.

Bounds (`check_fleet`): at most `MAX_RANKS` ranks; CUDA ranks on GPUs that exist, one rank per GPU; CPU ranks within
`THREADS_PER_CORE` threads per core; and host memory (`memory_need`): every worker's RSS, plus — where a rank computes
on the CPU and so keeps the weights in host memory — the model files, mapped once in the page cache and shared by
every rank. On CUDA the weights pass through the page cache to the GPU, which can evict them again, so only the
workers count there. A fleet that does not fit is refused with the numbers and what would fit.

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
    now (`MemAvailable` of /proc/meminfo; None where the system does not say)."""

    cores: int
    gpus: int
    available_bytes: int | None

    @classmethod
    def probe(cls) -> Host:
        return cls(cpu_cores(), gpu_count(), available_memory())


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # a taskset / cpuset limit counts
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()  # asks NVML first: no CUDA initialisation in the controller


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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


def memory_need(config, files_bytes: int) -> int:
    """Host memory a fleet of `config` needs: `WORKER_RSS_BYTES` per rank, plus the model files once when a rank
    computes on the CPU (its weights stay mapped in the page cache)."""
    cpu = any(d == "cpu" for d in config.devices)
    return len(config.devices) * WORKER_RSS_BYTES + (files_bytes if cpu else 0)


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


def check_fleet(config, host: Host | None = None, freed_bytes: int = 0) -> None:
    """Every bound for a fleet of `config` (a FleetConfig): `check_rank_count`, then host memory (`memory_need` vs
    `host.available_bytes` plus `freed_bytes`, what a running fleet this one replaces gives back). Raises
    FleetTooLarge with the numbers and the most ranks that fit. Memory is not checked where the system does not
    report it (logged)."""
    host = host or Host.probe()
    check_rank_count(tuple(config.devices), config.threads_per_worker, host)
    if host.available_bytes is None:
        log.warning("host memory not checked for a %d-rank fleet: this system does not report MemAvailable",
                    len(config.devices))
        return
    files = model_files(config)
    files_bytes = sum(files.values())
    need = memory_need(config, files_bytes)
    available = host.available_bytes + freed_bytes
    if need <= available:
        return
    cpu = any(d == "cpu" for d in config.devices)
    mapped = files_bytes if cpu else 0
    fit = max(0, (available - mapped) // WORKER_RSS_BYTES)
    if cpu:
        fit = min(fit, max_cpu_ranks(host, config.threads_per_worker))
    freed = f" + {_gib(freed_bytes)} the running fleet frees" if freed_bytes else ""
    files_text = (f" + {_gib(files_bytes)} of model files mapped once in the page cache (a CPU rank computes from "
                  f"them)" if cpu else "")
    advice = (f"at most {fit} rank(s) fit" if fit else
              f"no rank fits: {'the model files alone need ' + _gib(files_bytes) if cpu else 'free some memory'}")
    raise FleetTooLarge(
        f"host memory: {len(config.devices)} rank(s) x {WORKER_RSS_BYTES / 2**20:.0f} MiB per worker (a tiny-model "
        f"worker's measured RSS){files_text} = {_gib(need)}, more than the {_gib(host.available_bytes)} available "
        f"(MemAvailable){freed} — {advice}; close other programs or ask for fewer ranks")


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
