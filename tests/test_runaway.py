"""No runaway (issue 24): a fleet's size is checked against this host before any process starts, a failed or
interrupted start reaps what it spawned, workers end with their controller, a controller ends the workers a dead one
left, and `status` lists every process the controller owns with its memory.

Real processes (a controller, gloo CPU ranks of the tiny model); the rule arithmetic is checked on given `Host`
values, the refusals on this host's own numbers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mgpu_backend.protocol import resources as R
from mgpu_backend.serving.client import ControllerClient, parse_devices
from mgpu_backend.serving.fleet import Fleet
from mgpu_backend.protocol.errors import ControllerError, ErrorKind
from mgpu_backend.protocol.fleet_config import FleetConfig
from mgpu_backend.protocol.job_requests import JobSpec, NoopRequest
from mgpu_backend.protocol.job_results import ProcessInfo
from mgpu_backend.serving.worker_start import EXIT_PARENT_GONE
from _procs import bound_child, deadline, process_alive, stop_controller, wait_gone

GUARD_S = 240
MIB = 2**20


@pytest.fixture(autouse=True)
def _hang_guard(request):
    with deadline(GUARD_S, request.node.name):
        yield


def short_runtime_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ltx2-ra-"))  # AF_UNIX paths are limited to 107 bytes


def config(tiny_dir, ranks: int = 1, **overrides) -> FleetConfig:
    files = tiny_dir["2.0"]
    args = dict(devices=("cpu",) * ranks, checkpoint=str(files["checkpoint"]), gemma=str(files["gemma"]),
                upscaler=str(files["upsampler"]), dtype="float32", threads_per_worker=1, init_timeout_s=120.0)
    args.update(overrides)
    return FleetConfig(**args)


def sparse_checkpoint(source: Path, dest: Path, extra: int) -> Path:
    """`source` (a safetensors file) with one more tensor of `extra` bytes that take no disk (a sparse tail): a
    valid checkpoint header of any file size."""
    raw = source.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    header["padding.not_loaded"] = {"dtype": "U8", "shape": [extra], "data_offsets": [len(data), len(data) + extra]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(dest, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)
        f.truncate(8 + len(text) + len(data) + extra)
    return dest


def pid_files(directory: Path) -> dict[int, dict]:
    out = {}
    for p in directory.glob("*.json"):
        try:
            out[int(p.stem)] = json.loads(p.read_text())
        except (OSError, ValueError):  # being written
            pass
    return out


def wait_for(predicate, what: str, poll: float = 0.05):
    """Poll until `predicate()` is truthy (the hang guard bounds it); returns its value."""
    while not (value := predicate()):
        time.sleep(poll)
    return value


# ---- the rules, on given hosts ----------------------------------------------------------------------------------

def test_rank_rules_name_the_numbers_and_what_fits():
    two_cores = R.Host(cores=2, gpus=0, available_bytes=None)
    R.check_rank_count(("cpu",) * 8, 1, two_cores)  # 4 threads per core
    with pytest.raises(R.FleetTooLarge) as e:
        R.check_rank_count(("cpu",) * 9, 1, two_cores)
    assert "9 CPU rank(s) x 1 thread(s) = 9 threads on 2 core(s)" in str(e.value)
    assert "at most 8 CPU ranks fit here (devices 'cpu:8')" in str(e.value)
    with pytest.raises(R.FleetTooLarge, match=r"12 threads on 2 core\(s\).*at most 2 CPU ranks fit"):
        R.check_rank_count(("cpu",) * 4, 3, two_cores)
    with pytest.raises(R.FleetTooLarge, match=rf"{R.MAX_RANKS + 1} ranks; a fleet has at most {R.MAX_RANKS}"):
        R.check_rank_count(("cpu",) * (R.MAX_RANKS + 1), 1, R.Host(cores=256, gpus=0, available_bytes=None))
    two_gpus = R.Host(cores=8, gpus=2, available_bytes=None)
    R.check_rank_count(("cuda:0", "cuda:1"), 1, two_gpus)
    with pytest.raises(R.FleetTooLarge, match=r"CUDA device\(s\) \[2\] do not exist: this machine has 2"):
        R.check_rank_count(("cuda:0", "cuda:2"), 1, two_gpus)
    with pytest.raises(R.FleetTooLarge, match="cuda:1 is given to more than one rank"):
        R.check_rank_count(("cuda:1", "cuda:1"), 1, two_gpus)
    with pytest.raises(R.FleetTooLarge, match="no CUDA GPU"):
        R.check_rank_count(("cuda:0",), 1, two_cores)


def test_memory_preflight_counts_each_worker_and_the_mapped_files_once(tiny_dir, tmp_path):
    cfg = config(tiny_dir, 2)
    files = R.model_files(cfg)
    on_disk = {os.path.realpath(p): os.path.getsize(p) for p in (cfg.checkpoint, cfg.gemma, cfg.upscaler)}
    assert files == on_disk
    need = 2 * R.WORKER_RSS_BYTES + sum(on_disk.values())
    assert R.memory_need(cfg, sum(files.values())) == need
    R.check_fleet(cfg, R.Host(cores=2, gpus=0, available_bytes=need))  # exactly enough
    with pytest.raises(R.FleetTooLarge) as e:
        R.check_fleet(cfg, R.Host(cores=2, gpus=0, available_bytes=need - 1))
    message = str(e.value)
    assert f"2 rank(s) x {R.WORKER_RSS_BYTES // MIB} MiB per worker" in message and "MemAvailable" in message
    assert "at most 1 rank(s) fit" in message
    # what a replaced fleet gives back counts; an unloaded Gemma is not read at start
    R.check_fleet(cfg, R.Host(cores=2, gpus=0, available_bytes=need - MIB), freed_bytes=MIB)
    unloaded = config(tiny_dir, 2, gemma_unload=True)
    assert os.path.realpath(cfg.gemma) not in R.model_files(unloaded)

    # 1 TiB of model files: no CPU rank fits; on CUDA the files stream to the GPUs and only the workers count
    huge = sparse_checkpoint(Path(cfg.checkpoint), tmp_path / "huge.safetensors", 2**40)
    big = config(tiny_dir, 2, checkpoint=str(huge))
    with pytest.raises(R.FleetTooLarge, match=r"no rank fits: the model files alone need 1024\.\d GiB"):
        R.check_fleet(big, R.Host(cores=2, gpus=0, available_bytes=64 * 2**30))
    R.check_fleet(config(tiny_dir, 2, checkpoint=str(huge), devices=("cuda:0", "cuda:1")),
                  R.Host(cores=2, gpus=2, available_bytes=2 * R.WORKER_RSS_BYTES))


def test_parse_devices_bounds_a_count_before_anything_starts():
    most = R.max_cpu_ranks(R.Host.probe())
    assert parse_devices(f"cpu:{most}") == ("cpu",) * most
    with pytest.raises(R.FleetTooLarge) as e:
        parse_devices(f"cpu:{most + 1}")
    assert f"devices='cpu:{most + 1}'" in str(e.value) and f"(devices 'cpu:{most}')" in str(e.value)
    if R.gpu_count() == 0:  # the report: a width typed into devices on a host without CUDA
        with pytest.raises(R.FleetTooLarge, match="devices='512': 512 ranks.*a plain number in devices is a rank "
                                                  "count"):
            parse_devices("512")


# ---- host memory under a cgroup's limit (issue 36 item 1), on fake /proc and /sys trees ---------------------------

GIB = 2**30


def fake_host(tmp_path: Path, cgroup_lines: str, files: dict[str, str], mem_available_kib: int = 21_600_000) -> Path:
    """A root with proc/self/cgroup, proc/meminfo and the cgroup files given (path under the root -> text)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_lines)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 65000000 kB\nMemAvailable: {mem_available_kib} kB\n")
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def v2_host(tmp_path, leaf_max="max", parent_max="max", current=300 * MIB, inactive=100 * MIB, oom_kill=0):
    base = "sys/fs/cgroup"
    return fake_host(tmp_path, "0::/user.slice/comfy.scope\n", {
        f"{base}/cgroup.controllers": "cpu memory pids\n",
        f"{base}/user.slice/memory.max": f"{parent_max}\n",
        f"{base}/user.slice/memory.current": f"{current}\n",
        f"{base}/user.slice/memory.stat": f"anon 1\ninactive_file {inactive}\n",
        f"{base}/user.slice/comfy.scope/memory.max": f"{leaf_max}\n",
        f"{base}/user.slice/comfy.scope/memory.current": f"{current}\n",
        f"{base}/user.slice/comfy.scope/memory.stat": f"anon 1\ninactive_file {inactive}\n",
        f"{base}/user.slice/comfy.scope/memory.events": f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {oom_kill}\n"})


def test_cgroup_v2_limit_is_read_from_the_processs_own_cgroup_or_an_ancestor(tmp_path):
    root = v2_host(tmp_path / "a", leaf_max=2 * GIB)
    group = R.cgroup_memory(root)
    assert (group.version, group.limit_bytes, group.used_bytes, group.oom_kills) == (2, 2 * GIB, 200 * MIB, 0)
    assert group.path == str(root / "sys/fs/cgroup/user.slice/comfy.scope")
    assert group.room_bytes == 2 * GIB - 200 * MIB  # the inactive file pages are reclaimable: not counted as used
    room = R.memory_room(root)
    assert room.available_bytes == R.available_memory(root) == 2 * GIB - 200 * MIB
    assert room.mem_available_bytes == 21_600_000 * 1024
    assert room.source == (f"under the cgroup v2 memory limit of {group.path}: 2.0 GiB, 0.2 GiB in use; MemAvailable "
                           f"20.6 GiB")
    # the limit set on a parent slice (the leaf says "max"): the tighter level counts
    parent = R.cgroup_memory(v2_host(tmp_path / "b", parent_max=3 * GIB))
    assert parent.limit_bytes == 3 * GIB and parent.path.endswith("sys/fs/cgroup/user.slice")
    # "max" everywhere: no limit, MemAvailable alone
    unlimited = v2_host(tmp_path / "c")
    assert R.cgroup_memory(unlimited) is None
    assert R.memory_room(unlimited) == R.MemoryRoom(21_600_000 * 1024, "MemAvailable", 21_600_000 * 1024, None)
    # a limit above MemAvailable: MemAvailable is the smaller room
    roomy = R.memory_room(v2_host(tmp_path / "d", leaf_max=64 * GIB))
    assert roomy.available_bytes == 21_600_000 * 1024 and roomy.source == "MemAvailable"


def v1_host(tmp_path, limit, usage=500 * MIB, inactive=200 * MIB, path="/docker/abc", at=None, oom_kill=2):
    at = "sys/fs/cgroup/memory" + (path if at is None else at)
    return fake_host(tmp_path, f"12:pids:/docker/abc\n4:memory:{path}\n1:name=systemd:/docker/abc\n0::/\n", {
        f"{at}/memory.limit_in_bytes": f"{limit}\n", f"{at}/memory.usage_in_bytes": f"{usage}\n",
        f"{at}/memory.stat": f"cache 1\ninactive_file 5\ntotal_inactive_file {inactive}\n",
        f"{at}/memory.oom_control": f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n"})


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    group = R.cgroup_memory(v1_host(tmp_path / "a", 2 * GIB))
    assert (group.version, group.limit_bytes, group.used_bytes, group.oom_kills) == (1, 2 * GIB, 300 * MIB, 2)
    assert group.path == str(tmp_path / "a/sys/fs/cgroup/memory/docker/abc")
    # a container without a cgroup namespace: /proc/self/cgroup names the host's path, its own cgroup is the mount
    mounted = R.cgroup_memory(v1_host(tmp_path / "b", 2 * GIB, at=""))
    assert mounted.limit_bytes == 2 * GIB and mounted.path == str(tmp_path / "b/sys/fs/cgroup/memory")
    # v1 writes "no limit" as LONG_MAX rounded to a page
    assert R.cgroup_memory(v1_host(tmp_path / "c", 9223372036854771712)) is None
    assert R.memory_room(v1_host(tmp_path / "d", 9223372036854771712)).source == "MemAvailable"
    # nothing to read (off Linux): no limit, no MemAvailable
    assert R.cgroup_memory(tmp_path / "empty") is None and R.available_memory(tmp_path / "empty") is None


def test_a_fleet_over_a_2_gib_cgroup_is_refused_with_the_numbers(tiny_dir, tmp_path):
    """The issue's case: a 2 GiB container on a host with 21.6 GB available, 3 CPU workers. The room is the
    cgroup's (2 GiB less the ~1.4 GiB ComfyUI and the controller hold), and the refusal says so with the numbers,
    before any worker starts; a fleet that fits returns the figures a SIGKILL is later told with."""
    root = v2_host(tmp_path, leaf_max=2 * GIB, current=1500 * MIB, inactive=100 * MIB, oom_kill=0)
    host = R.Host.probe(root)
    assert host.available_bytes == 2 * GIB - 1400 * MIB and host.memory_source.startswith("under the cgroup v2")
    before = set(R.children(os.getpid()))
    with pytest.raises(R.FleetTooLarge) as e:
        R.check_fleet(config(tiny_dir, 3), root=root)
    message = str(e.value)
    files = sum(R.model_files(config(tiny_dir, 3)).values())
    need = 3 * R.WORKER_RSS_BYTES + files
    assert message.startswith(f"host memory: 3 rank(s) x {R.WORKER_RSS_BYTES // MIB} MiB per worker (a tiny-model "
                              f"worker's measured RSS) + {files / GIB:.1f} GiB of model files mapped once in the page "
                              f"cache (a CPU rank computes from them) = {need / GIB:.1f} GiB, more than the 0.6 GiB "
                              f"available (under the cgroup v2 memory limit of "), message
    assert ": 2.0 GiB, 1.4 GiB in use; MemAvailable 20.6 GiB) — at most 1 rank(s) fit; raise the container's " \
           "memory limit, close other programs or ask for fewer ranks" in message
    assert set(R.children(os.getpid())) <= before
    one = R.check_fleet(config(tiny_dir, 1), root=root)
    assert one == R.MemoryCheck(R.WORKER_RSS_BYTES + files, 2 * GIB - 1400 * MIB, host.memory_source, 1, 0)


def test_a_sigkilled_worker_is_told_as_the_oom_killers_work_with_the_figures(tmp_path):
    check = R.MemoryCheck(3 * R.WORKER_RSS_BYTES, 2 * GIB, "under the cgroup v2 memory limit of x: 2.0 GiB", 3, 0)
    killed = v2_host(tmp_path / "a", leaf_max=2 * GIB, current=1900 * MIB, inactive=0, oom_kill=1)
    assert R.oom_text(check, killed) == (
        "killed by the out-of-memory killer (the cgroup counts 1 new OOM kill(s) since the fleet started): the "
        "fleet's 3 worker(s) needed about 1.3 GiB of host memory at start, of 2.0 GiB available (under the cgroup v2 "
        f"memory limit of x: 2.0 GiB); 0.1 GiB available now (under the cgroup v2 memory limit of "
        f"{killed / 'sys/fs/cgroup/user.slice/comfy.scope'}: 2.0 GiB, 1.9 GiB in use; MemAvailable 20.6 GiB) — a job "
        "can take more than a worker's start figure; use fewer ranks, raise the memory limit, or free memory "
        "(`dmesg` or the container's OOM events say for sure)")
    # no new OOM kill counted (a user's kill -9), or no cgroup: "probably"
    quiet = v2_host(tmp_path / "b", leaf_max=2 * GIB, oom_kill=0)
    assert R.oom_text(check, quiet).startswith("probably killed by the out-of-memory killer (or a kill -9): the "
                                               "fleet's 3 worker(s) needed about 1.3 GiB")
    assert R.oom_text(None, tmp_path / "empty").startswith("probably killed by the out-of-memory killer (or a kill "
                                                           "-9) — a job can take more")


@pytest.mark.parametrize("spec", ["100000000", "3000000000", "cpu:3000000000"])
def test_a_huge_device_count_is_refused_before_any_list_is_built(spec):
    """Issue 36: "100000000" was refused only after building a 100-million-entry tuple (+760 MB) and "3000000000"
    ended in a bare MemoryError. The count is held to MAX_RANKS first: the refusal names the value and the limit, and
    nothing of that size is allocated (tracemalloc's peak stays under 1 MiB)."""
    import tracemalloc

    if spec[0].isdigit() and R.gpu_count():
        pytest.skip("with CUDA a plain count is a GPU count, refused against the GPUs present")
    tracemalloc.start()
    try:
        with pytest.raises(R.FleetTooLarge) as e:
            parse_devices(spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    count = int(spec.split(":")[-1])
    assert f"devices={spec!r}: {count} ranks; a fleet has at most {R.MAX_RANKS}" in str(e.value)
    assert peak < MIB, f"{peak} bytes allocated while refusing {spec!r}"
    with pytest.raises(R.FleetTooLarge, match=rf"world_size=3000000000: 3000000000 ranks; a fleet has at most "
                                               rf"{R.MAX_RANKS}"):
        parse_devices("cpu", world_size=3_000_000_000)


# ---- refusals and starts, with real processes ---------------------------------------------------------------------

def test_a_fleet_too_large_for_this_host_spawns_nothing(tiny_dir):
    before = set(R.children(os.getpid()))
    too_many = R.max_cpu_ranks(R.Host.probe()) + 1
    with pytest.raises(ControllerError) as e:
        Fleet(config(tiny_dir, too_many), 1)
    assert e.value.kind == ErrorKind.VALIDATION and f"{too_many} CPU rank(s)" in str(e.value)
    assert set(R.children(os.getpid())) <= before  # refused before the first spawn


def test_an_interrupted_start_reaps_every_worker_it_spawned(tiny_dir, tmp_path, caplog):
    """A start interrupted (here by a signal's exception while the workers load) kills and reaps what it spawned,
    removes their pid files and logs why. The workers block opening a FIFO as their upscaler: never ready."""
    fifo = tmp_path / "upscaler.fifo"
    os.mkfifo(fifo)
    pid_dir = tmp_path / "workers"

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted("a test's signal")

    spawned: list[int] = []

    def interrupt_when_spawned():
        records = wait_for(lambda: len(pid_files(pid_dir)) == 2 and pid_files(pid_dir), "pid files")
        spawned.extend(sorted(records, key=lambda pid: records[pid]["rank"]))
        # both run the worker's code (named by it): the fleet waits for them to be ready
        wait_for(lambda: all(R.process_name(p).startswith("ltx2mgpu-rank") for p in spawned), "worker names")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=interrupt_when_spawned, daemon=True).start()
        with pytest.raises(Interrupted):
            Fleet(config(tiny_dir, 2, upscaler=str(fifo)), 7, pid_dir=pid_dir)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(spawned) == 2 and wait_gone(spawned)
    assert not process_alive(spawned[0]) and not process_alive(spawned[1])
    assert pid_files(pid_dir) == {}
    logged = [r.getMessage() for r in caplog.records if "did not start" in r.getMessage()]
    assert logged == [f"fleet generation 7 did not start (2 of 2 worker(s) spawned, pids {spawned}, all "
                      f"reaped): interrupted by Interrupted: a test's signal"]


def test_the_watched_pipe_ends_a_worker_when_its_parent_end_closes():
    """The portable half of `worker_start.bind_to_parent` on its own: the parent stays, only its end of the pipe closes
    (as when a parent dies), and the worker exits with EXIT_PARENT_GONE."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    watch, keep = ctx.Pipe(duplex=False)
    child = ctx.Process(target=bound_child, args=(os.getpid(), watch), daemon=True)
    child.start()
    watch.close()
    keep.close()
    child.join(GUARD_S / 2)
    assert child.exitcode == EXIT_PARENT_GONE


@pytest.fixture(scope="module")
def runtime():
    path = short_runtime_dir()
    yield path
    stop_controller(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl(runtime):
    client = ControllerClient(runtime_dir=runtime)
    yield client
    client.close()


def test_status_lists_every_owned_process_with_its_memory(ctl, tiny_dir):
    handle = ctl.configure(config(tiny_dir, 2))
    status = ctl.status()
    processes = status.processes
    assert all(isinstance(p, ProcessInfo) for p in processes), processes
    assert processes[0].pid == status.pid == ctl.ping().pid and processes[0].role == "controller"
    workers = {p.role: p for p in processes if p.role.startswith("worker")}
    assert sorted(workers) == ["worker rank 0", "worker rank 1"]
    assert tuple(workers[f"worker rank {r}"].pid for r in range(2)) == handle.worker_pids == status.fleet.worker_pids
    for p in processes:  # torch alone is more than 64 MiB resident (the controller and each worker import it)
        assert p.rss_bytes is not None and p.rss_bytes > 0, p
        if p.role == "controller" or p.role.startswith("worker"):
            assert p.rss_bytes > 64 * MIB, p
    # every other process the controller has is a helper (multiprocessing's resource tracker), never a worker
    assert all(p.role.startswith("helper (") for p in processes[1:] if p.pid not in handle.worker_pids)
    # the JSON of `python -m mgpu_backend status` keeps the keys of the dicts these were
    assert dataclasses.asdict(status)["processes"][0] == {"pid": status.pid, "role": "controller",
                                                          "rss_bytes": processes[0].rss_bytes}
    assert {R.process_name(p) for p in handle.worker_pids} == {"ltx2mgpu-rank0", "ltx2mgpu-rank1"}
    assert R.process_name(status.pid) == "ltx2mgpu-ctl"


def test_the_controller_refuses_a_fleet_the_host_cannot_run_and_keeps_the_running_one(ctl, tiny_dir, tmp_path):
    handle = ctl.configure(config(tiny_dir, 2))
    too_many = R.max_cpu_ranks(R.Host.probe()) + 1
    with pytest.raises(ControllerError) as e:
        ctl.configure(config(tiny_dir, too_many))
    assert e.value.kind == ErrorKind.VALIDATION and f"{too_many} CPU rank(s)" in str(e.value)
    huge = sparse_checkpoint(Path(tiny_dir["2.0"]["checkpoint"]), tmp_path / "huge.safetensors", 2**40)
    with pytest.raises(ControllerError) as e:
        ctl.configure(config(tiny_dir, 1, checkpoint=str(huge)))
    assert e.value.kind == ErrorKind.VALIDATION
    assert "host memory" in str(e.value) and "the model files alone need 1024" in str(e.value)
    status = ctl.status()
    assert status.fleet.worker_pids == handle.worker_pids  # untouched
    workers = tuple(p.pid for p in status.processes if p.role.startswith("worker"))
    assert workers == handle.worker_pids  # no process beyond the configured ranks


def test_workers_outlive_the_connection_that_started_them(runtime, tiny_dir):
    """PR_SET_PDEATHSIG fires when the *thread* that spawned a worker ends; the controller starts fleets from each
    client's connection thread, so workers are spawned from one long-lived thread (fleet._SPAWNER)."""
    second = ControllerClient(runtime, start=False)
    others = len(second.status().clients)  # this one and the module's
    first = ControllerClient(runtime, start=False)
    handle = first.configure(config(tiny_dir, 2, collective_timeout_s=299.0))  # another identity: a new fleet
    first.close()
    try:
        wait_for(lambda: len(second.status().clients) == others, "the first connection's thread to end", poll=0.2)
        accepted = []
        second.run(handle, JobSpec("noop", NoopRequest(steps=1)), on_accepted=accepted.append)
        assert list(accepted[0].worker_pids) == list(handle.worker_pids)
        assert all(process_alive(p) for p in handle.worker_pids)
    finally:
        second.close()


def test_workers_die_with_their_controller_and_the_next_one_clears_their_records(tiny_dir):
    runtime = short_runtime_dir()
    try:
        client = ControllerClient(runtime_dir=runtime)
        handle = client.configure(config(tiny_dir, 2))
        controller = client.status().pid
        client.close()
        assert sorted(pid_files(runtime / "workers")) == sorted(handle.worker_pids)
        os.kill(controller, signal.SIGKILL)  # no teardown, no reaping: as the OOM killer would
        assert wait_gone([controller, *handle.worker_pids])
        # the next controller finds the records of the dead one's workers (they ended by themselves)
        client = ControllerClient(runtime_dir=runtime)
        client.ping()
        log = (runtime / "controller.log").read_text()
        for pid in handle.worker_pids:
            assert f"stale worker pid {pid} " in log and f"controller pid {controller}, which is gone): had " \
                                                         f"already exited" in log
        assert pid_files(runtime / "workers") == {}
        client.close()
    finally:
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_starting_controller_ends_stale_workers_and_their_frames(tmp_path):
    """A worker whose controller is gone (recorded in the runtime directory) is killed and its /dev/shm blocks
    removed; a worker recorded by a controller that still runs (this test process) is left alone."""
    runtime = short_runtime_dir()
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    stale, owned = subprocess.Popen(sleep), subprocess.Popen(sleep)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        workers = runtime / "workers"
        workers.mkdir(parents=True)
        (workers / f"{stale.pid}.json").write_text(json.dumps({
            "pid": stale.pid, "start_time": R.start_time(stale.pid), "controller_pid": gone.pid,
            "controller_start_time": 1, "rank": 3, "generation": 9}))
        R.write_pid_file(workers, owned.pid, rank=0, generation=1)  # this process as its controller
        block = Path("/dev/shm") / f"ltx2mgpu-{stale.pid}-1"
        block.write_bytes(b"frames")
        client = ControllerClient(runtime_dir=runtime)
        client.close()
        assert stale.wait(timeout=GUARD_S / 2) == -signal.SIGKILL
        assert owned.poll() is None and sorted(pid_files(workers)) == [owned.pid]
        assert not block.exists()
        log = (runtime / "controller.log").read_text()
        assert (f"stale worker pid {stale.pid} (rank 3 of fleet generation 9, controller pid {gone.pid}, which is "
                f"gone): ended") in log
    finally:
        for p in (stale, owned):
            p.kill()
            p.wait()
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_signal_while_a_fleet_starts_ends_its_workers(tiny_dir, tmp_path):
    """SIGTERM to the controller while its workers load (they block opening a FIFO upscaler): every worker it
    spawned ends (from their pid files: the fleet is not built yet), the log says why, the controller exits."""
    fifo = tmp_path / "upscaler.fifo"
    os.mkfifo(fifo)
    runtime = short_runtime_dir()
    try:
        client = ControllerClient(runtime_dir=runtime)
        controller = client.ping().pid
        errors = []

        def configure():
            try:
                client.configure(config(tiny_dir, 2, upscaler=str(fifo)))
            except (ControllerError, EOFError, OSError) as exc:
                errors.append(exc)

        thread = threading.Thread(target=configure, daemon=True)
        thread.start()
        spawned = sorted(wait_for(lambda: len(pid_files(runtime / "workers")) == 2 and pid_files(runtime / "workers"),
                                  "pid files"))
        os.kill(controller, signal.SIGTERM)
        thread.join(GUARD_S / 2)
        assert len(errors) == 1  # the client hears the controller go
        assert wait_gone([controller, *spawned])
        log = (runtime / "controller.log").read_text()
        assert f"stopping on SIGTERM: ended worker pids {spawned}" in log
        assert pid_files(runtime / "workers") == {}
    finally:
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_controller_that_never_answers_is_killed_not_left(monkeypatch):
    """The client's own start: a controller process that does not listen within START_TIMEOUT_S is killed with the
    error (here a stand-in that sleeps, started as the client starts a controller)."""
    from mgpu_backend.serving import client as client_module

    launched = []

    def launch(runtime_dir, log_path):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        launched.append(proc)
        return proc

    monkeypatch.setattr(client_module, "_launch", launch)
    monkeypatch.setattr(client_module, "START_TIMEOUT_S", 0.5)
    runtime = short_runtime_dir()
    try:
        with pytest.raises(ControllerError) as e:
            ControllerClient(runtime_dir=runtime)
        assert e.value.kind == ErrorKind.START_FAILED
        assert f"(pid {launched[0].pid}) did not answer within 0.5 s and was killed" in str(e.value)
        assert launched[0].returncode == -signal.SIGKILL and not process_alive(launched[0].pid)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_the_cli_refuses_an_oversized_fleet_before_a_controller_starts(tiny_dir, tmp_path, monkeypatch, capsys):
    from mgpu_backend.serving import cli

    runtime = short_runtime_dir()
    monkeypatch.setenv("LTX2_MGPU_RUNTIME_DIR", str(runtime))
    files = tiny_dir["2.0"]
    too_many = R.max_cpu_ranks(R.Host.probe()) + 1
    try:
        code = cli.main(["generate", "--checkpoint", str(files["checkpoint"]), "--gemma", str(files["gemma"]),
                         "--upscaler", str(files["upsampler"]), "--prompt", "a fox", "--width", "128", "--height",
                         "128", "--frames", "9", "--output", str(tmp_path / "clip.mp4"), "--devices",
                         f"cpu:{too_many}"])
        err = capsys.readouterr().err
        assert code == 2 and f"error: devices='cpu:{too_many}':" in err and "fit here" in err, err
        assert not (runtime / "controller.sock").exists()  # no controller was started
    finally:
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)
