"""The worker fleet through the controller, with real processes (gloo on CPU).

One controller for the whole module (own runtime dir, test faults enabled), stopped at teardown. Fleets are reused
across tests where the configuration allows it; the tests run in file order and the fault tests leave a usable
fleet behind them (each failure test rebuilds once, on its "next job").

Covered (docs/design/fleet.md):
- a generation through the fleet equals the one-process `TwoStagePipeline` result (same files, float32, one
  thread per rank and in this process): bit for bit when every rank computes every stage (`sequence_parallel=False`,
  W = 1, 2, 4) and at W = 1 with the parallel plan; with sequence parallelism at W = 2 and 4 the stage-1 forward is
  split over ranks, which changes the floating-point reduction order: equal to 1e-4 there, and bit-for-bit
  reproducible from run to run;
- progress events in order with the right totals; cancel mid-job, then the same PIDs run the next job without
  reading the checkpoint again (OPEN_COUNT per worker, reported after every job) and produce the fresh-run output;
- a crash (injected, and a real SIGKILL), an error on one rank, a stalled rank: the fleet is torn down, the rank
  is named, and the next job runs on a new fleet (new PIDs, generation + 1) with the SAME handle;
- an error raised on every rank (invalid request, missing image, injected) keeps the fleet;
- host memory: W = 4 ranks share one memory-mapped copy of the weights (PSS).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from mgpu_backend.engine import sampling as S
from mgpu_backend.serving.client import ControllerClient
from mgpu_backend.testing import tiny
from mgpu_backend.models.gemma import load_gemma
from mgpu_backend.models.loader import ComponentFiles, load_components
from mgpu_backend.splits.tiling import default_tiling
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline
from mgpu_backend.protocol.errors import ControllerError, JobCancelled
from mgpu_backend.protocol.fleet_config import FleetConfig, FleetPlan
from mgpu_backend.protocol.job_requests import FaultSpec, JobSpec, NoopRequest
from mgpu_backend.protocol.job_results import FleetDescription, GenerateJobResult
from _procs import deadline, process_alive as _alive, wait_gone

torch.set_num_threads(1)

GUARD_S = 240  # a test still running after this long fails (hang guard) instead of blocking CI
CHAIN_STALL_S = 30.0  # stall timeout of the fleets that run generations (a cold first job must not look stalled)
STALL_S = 5.0  # the stall test's fleet
KEYS = ("frames", "audio", "video_latent", "audio_latent")
SP_TOLERANCE = 1e-4


# ---- guards and process helpers ---------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _hang_guard(request):
    with deadline(GUARD_S, request.node.name):
        yield


def pss_kib(pid: int, field: str = "Pss") -> int:
    """A `/proc/<pid>/smaps_rollup` field in KiB: "Pss" (all), "Pss_Anon" (private and anonymous memory: a copy of
    the weights would land here) or "Pss_File" (file-backed mappings: the memory-mapped checkpoint)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} line for pid {pid}")


def file_pss_kib(pid: int, path: str) -> int:
    """PSS of the mappings of `path` in process `pid` (from /proc/<pid>/smaps)."""
    total, current = 0, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping header line
                current = head[5] if len(head) >= 6 else None
            elif head and head[0] == "Pss:" and current == path:
                total += int(head[1])
    return total


# ---- files, reference, controller -------------------------------------------------------------------------------

def _wide_metadata(variant: str) -> dict:
    """The tiny transformer, 8× wider per head and 8× deeper: ~320 MB float32, so that the weights dominate what a
    wider model adds to a worker (its activations add ~7 MiB per rank, independent of the depth)."""
    meta = _ORIGINAL_METADATA(variant)
    meta.update(attention_head_dim=64, cross_attention_dim=512, num_layers=16)
    return meta


_ORIGINAL_METADATA = tiny.tiny_transformer_metadata


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny 2.0 set plus float32-stored checkpoints (float32 file + float32 compute: no cast, no copy)."""
    base = tiny_dir["2.0"]
    out = tmp_path_factory.mktemp("fleet_files")
    small = tiny.write_tiny_checkpoint(out / "ltx-2.0-tiny-f32.safetensors", "2.0", 0, dtype=torch.float32)
    return {"small": str(small), "gemma": str(base["gemma"]), "upscaler": str(base["upsampler"]),
            "lora": str(base["distilled_lora"]), "dir": str(out)}


@pytest.fixture(scope="module")
def big_checkpoint(files) -> str:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "tiny_transformer_metadata", _wide_metadata)
        path = tiny.write_tiny_checkpoint(Path(files["dir"]) / "ltx-2.0-wide-f32.safetensors", "2.0", 0,
                                          dtype=torch.float32)
    return str(path)


def request(files, **overrides) -> GenerateRequest:
    args = dict(prompt="a red fox runs through fresh snow", width=128, height=128, frames=9, fps=24.0, steps=2,
                seed=5, distilled_lora=(files["lora"], 1.0))
    args.update(overrides)
    return GenerateRequest(**args)


def light_request(files) -> GenerateRequest:
    """One unguided stage-1 step and one stage-2 step, no LoRA: every transformer weight is read, nothing written."""
    return request(files, steps=1, video_guidance=S.NO_GUIDANCE, audio_guidance=S.NO_GUIDANCE,
                   stage2_sigmas=(0.625, 0.0), distilled_lora=None)


def tiled_fields(world: int) -> dict:
    """What a parallel fleet of `world` ranks picks by default for the 128 × 128 request (stage-2 tiles, decode
    tiles, the TDP stage-2 sigmas), stated explicitly so that one process runs the same recipe."""
    grid = (2, 4, 4)  # latent (frames, height, width) of stage 2 at 9 frames, 128 × 128
    return {"tiles": default_tiling(world, grid, 5), "decode_tiles": default_tiling(world, grid, 2),
            "stage2_sigmas": S.TDP_STAGE2_SIGMAS}


@pytest.fixture(scope="module")
def one_process(files):
    """`one_process(request)` -> the one-process result and progress events (this process, one thread; cached)."""
    components = load_components(files["small"], ComponentFiles(upsampler=files["upscaler"]), dtype=torch.float32)
    pipeline = TwoStagePipeline(components, load_gemma(files["gemma"]), dtype=torch.float32)
    cache: dict[str, dict] = {}

    def run_here(req: GenerateRequest) -> dict:
        key = repr(req)
        if key not in cache:
            events: list[tuple] = []
            result = pipeline.generate(req, progress=lambda *e: events.append(e))
            cache[key] = {"result": {k: getattr(result, k) for k in KEYS}, "sample_rate": result.sample_rate,
                          "events": events}
        return cache[key]

    return run_here


@pytest.fixture(scope="module")
def ctl():
    """The module's controller (faults honoured), stopped at teardown with its workers."""
    runtime = Path(tempfile.mkdtemp(prefix="ltx2-tf-"))
    saved = os.environ.get("LTX2_MGPU_TEST_FAULTS")
    os.environ["LTX2_MGPU_TEST_FAULTS"] = "1"  # inherited by the controller this client starts
    try:
        client = ControllerClient(runtime_dir=runtime)
    finally:
        if saved is None:
            del os.environ["LTX2_MGPU_TEST_FAULTS"]
        else:
            os.environ["LTX2_MGPU_TEST_FAULTS"] = saved
    assert client.started_pid is not None
    pid = client.ping().pid
    yield client
    workers = []
    try:  # a fresh connection: the module's may be mid-stream after a failed test
        other = ControllerClient(runtime, start=False)
        fleet = other.status().fleet
        workers = fleet.worker_pids if fleet else []
        other.stop()
    except (ControllerError, OSError):
        pass
    if not wait_gone([pid, *workers]):
        for p in (pid, *workers):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    shutil.rmtree(runtime, ignore_errors=True)


def config(files, world: int, sp: bool = True, checkpoint: str | None = None,
           stall: float = CHAIN_STALL_S) -> FleetConfig:
    return FleetConfig(devices=("cpu",) * world, checkpoint=checkpoint or files["small"], gemma=files["gemma"],
                       upscaler=files["upscaler"], dtype="float32", threads_per_worker=1, init_timeout_s=120.0,
                       collective_timeout_s=120.0, stall_timeout_s=stall, sequence_parallel=sp)


def run(ctl, handle, job: JobSpec, on_event=None, on_accepted=None) -> dict:
    return ctl.run(handle, job, on_event=on_event, on_accepted=on_accepted)


def generate(ctl, handle, req: GenerateRequest, events: list | None = None) -> dict:
    """The fleet's `GenerateJobResult` for `req`, as a dict of its fields (compared with the one-process run's)."""
    out = run(ctl, handle, JobSpec("generate", req),
              on_event=(lambda e: events.append((e.stage, e.step, e.total))) if events is not None else None)
    assert isinstance(out, GenerateJobResult), type(out)
    return dict(vars(out))


def fleet_status(ctl) -> FleetDescription:
    fleet = ctl.status().fleet
    assert fleet is not None, "no live fleet"
    return fleet


def assert_same(a, b, what: str) -> None:
    """`a`, `b`: dicts of `KEYS` or `GenerateJobResult`s (the fleet's typed result)."""
    a, b = (x if isinstance(x, dict) else vars(x) for x in (a, b))
    for k in KEYS:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max |diff| {float((a[k] - b[k]).abs().max()):.3g})"


# results of the fleet runs, reused by later tests ("equals a fresh run")
RESULTS: dict[tuple, dict] = {}


def w2_fresh(ctl, files) -> dict:
    """The W = 2 parallel fleet's result of `request(files)` (its default recipe) on a fresh fleet."""
    if (2, True, "default") not in RESULTS:
        handle = ctl.configure(config(files, 2))
        RESULTS[(2, True, "default")] = generate(ctl, handle, request(files))
    return RESULTS[(2, True, "default")]


# ---- memory ------------------------------------------------------------------------------------------------------

def test_weights_are_shared_between_ranks_pss(ctl, files, big_checkpoint, capsys):
    """W = 4: the ranks map the checkpoint file once between them. Big model minus small model (both float32 files
    read by a job): the file-backed part of the summed PSS grows by the file-size difference once (not 4×), and the
    private part by less than half of it — a private copy of the weights in even one rank would add the whole
    difference there (4 copies: 4×). The private part that does grow is the wider model's activations and
    allocator caches (~15 MiB per rank here; negligible beside a real checkpoint's weights)."""
    sums, anon, filed, mapped = {}, {}, {}, {}
    for name, checkpoint in (("big", big_checkpoint), ("small", files["small"])):
        handle = ctl.configure(config(files, 4, checkpoint=checkpoint))
        generate(ctl, handle, light_request(files))  # pages every transformer weight in
        pids = fleet_status(ctl).worker_pids
        sums[name] = sum(pss_kib(p) for p in pids) * 1024
        anon[name] = sum(pss_kib(p, "Pss_Anon") for p in pids) * 1024
        filed[name] = sum(pss_kib(p, "Pss_File") for p in pids) * 1024
        mapped[name] = sum(file_pss_kib(p, os.path.realpath(checkpoint)) for p in pids) * 1024
    size_big = os.path.getsize(big_checkpoint)
    size_delta = size_big - os.path.getsize(files["small"])
    pss_delta = sums["big"] - sums["small"]
    anon_delta, file_delta = anon["big"] - anon["small"], filed["big"] - filed["small"]
    with capsys.disabled():
        print(f"\n[pss] W=4 summed PSS: big {sums['big'] / 2**20:.1f} MiB, small {sums['small'] / 2**20:.1f} MiB, "
              f"delta {pss_delta / 2**20:.1f} MiB (file-backed {file_delta / 2**20:.1f}, private "
              f"{anon_delta / 2**20:.1f}); file size delta {size_delta / 2**20:.1f} MiB (ratio "
              f"{pss_delta / size_delta:.3f}); big file mapped: {mapped['big'] / 2**20:.1f} MiB PSS over the 4 ranks "
              f"for a {size_big / 2**20:.1f} MiB file")
    assert size_delta > 200 * 2**20
    assert file_delta < 1.1 * size_delta, (
        f"4 ranks map {file_delta / 2**20:.0f} MiB of files for {size_delta / 2**20:.0f} MiB of weights")
    assert anon_delta < 0.5 * size_delta, (
        f"4 ranks hold {anon_delta / 2**20:.0f} MiB more private memory for {size_delta / 2**20:.0f} MiB of weights: "
        f"a private copy")
    # the file's pages are mapped shared: counted once over the ranks, not once per rank
    assert 0.5 * size_big < mapped["big"] <= size_big


# ---- equality with one process, progress -------------------------------------------------------------------------

@pytest.mark.parametrize("world,sp", [(4, True), (4, False), (1, True), (2, False), (2, True)],
                         ids=["W4-parallel", "W4-whole", "W1", "W2-whole", "W2-parallel"])
def test_fleet_equals_one_process(ctl, files, one_process, world, sp, capsys):
    """`sp=False`: every rank computes every stage whole (the fleet mechanics alone): bit for bit. The parallel
    plan (default): stage 1 sequence parallel, stage 2 and the decode tiled over the ranks; one process runs the
    same tiled recipe, and stage 1's split changes the reduction order (1e-4; bit for bit run to run)."""
    parallel = sp and world > 1
    req = request(files, **(tiled_fields(world) if parallel else {}))
    reference = one_process(req)
    handle = ctl.configure(config(files, world, sp=sp))
    # the plan the fleet computed from the heads its workers loaded (the tiny transformer has 8)
    assert handle.plan == (FleetPlan(world, 8, world, tuple(d for d in (1, 2, 4) if d <= world)) if sp
                           else FleetPlan(world, 8, 1, (1,), sequence_parallel=False))
    events: list[tuple] = []
    out = generate(ctl, handle, req, events)
    assert events == reference["events"], "progress events out of order or with wrong totals"
    stage2_steps = len(req.stage2_sigmas or S.DISTILLED_STAGE2_SIGMAS) - 1
    assert events == [("stage 1", 1, 2), ("stage 1", 2, 2)] + [("stage 2", i, stage2_steps)
                                                                  for i in range(1, stage2_steps + 1)]
    assert out["sample_rate"] == reference["sample_rate"]
    assert out["frames"].shape == (9, 128, 128, 3) and out["frames"].dtype == torch.float32
    ref = reference["result"]
    if parallel:
        assert out["parallel"] == f"sequence parallel over all {world} ranks"
        diffs = {k: float((out[k] - ref[k]).abs().max()) for k in KEYS}
        with capsys.disabled():
            print(f"\n[parallel] W={world} max |fleet - one process|: "
                  + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))
        assert all(v < SP_TOLERANCE for v in diffs.values()), diffs
        again = generate(ctl, handle, req)  # deterministic run to run
        assert_same(again, out, f"W={world} parallel, second run")
    else:
        assert_same(out, ref, f"W={world} sequence_parallel={sp}")


# ---- cancel, OPEN_COUNT ------------------------------------------------------------------------------------------

def test_cancel_mid_job_keeps_fleet_and_weights(ctl, files):
    fresh = w2_fresh(ctl, files)
    handle = ctl.configure(config(files, 2))
    before = fleet_status(ctl)
    job = JobSpec("generate", request(files, steps=8))
    stage1 = threading.Event()
    events, cancel_errors = [], []

    def on_event(event):
        events.append((event.stage, event.step))
        if event.stage == "stage 1":
            stage1.set()

    def canceller():
        if stage1.wait(120):
            try:
                ctl.cancel(job.job_id)
            except ControllerError as exc:
                cancel_errors.append(exc)

    thread = threading.Thread(target=canceller)
    thread.start()
    with pytest.raises(JobCancelled) as info:
        run(ctl, handle, job, on_event=on_event)
    thread.join(30)
    assert not cancel_errors, cancel_errors
    assert info.value.kind == "cancelled" and not info.value.fleet_lost
    assert f"job {job.job_id} cancelled before stage" in str(info.value)
    assert events and events[0] == ("stage 1", 1)
    after = fleet_status(ctl)
    assert after.worker_pids == before.worker_pids and after.generation == before.generation
    # the next job: same processes, no checkpoint opened again, the output of a fresh run
    out = generate(ctl, handle, request(files))
    status = fleet_status(ctl)
    assert status.worker_pids == before.worker_pids
    assert status.open_counts == before.open_counts, "a worker opened a checkpoint file again"
    assert_same(out, fresh, "after cancel")


def test_open_counts_are_reported_after_jobs(ctl, files):
    """status().fleet.open_counts is each worker's loader.OPEN_COUNT as of its last job (not only at start):
    a job that opens one more file on rank 1 shows there."""
    handle = ctl.configure(config(files, 2))
    before = fleet_status(ctl).open_counts
    assert len(before) == 2 and all(n >= 2 for n in before)  # checkpoint + upscaler at least
    run(ctl, handle, JobSpec("noop", NoopRequest(steps=2), fault=FaultSpec(rank=1, stage="noop", step=0,
                                                                            kind="reread")))
    after = fleet_status(ctl).open_counts
    assert after == (before[0], before[1] + 1)


# ---- errors on every rank keep the fleet ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["frames", "image", "injected"])
def test_error_on_every_rank_keeps_fleet(ctl, files, case):
    handle = ctl.configure(config(files, 2))
    before = fleet_status(ctl)
    missing = os.path.join(files["dir"], "no-such-image.png")
    if case == "frames":
        job, kind, needles = JobSpec("generate", request(files, frames=10)), "validation", ["frames=10", "8k+1"]
    elif case == "image":
        job, kind, needles = JobSpec("generate", request(files, image=missing)), "validation", ["file not found",
                                                                                                missing]
    else:
        job = JobSpec("generate", request(files), fault=FaultSpec(stage="stage 1", step=1, kind="error_all"))
        kind, needles = "job_error", ["injected fault on rank 0 at stage 1 step 1"]
    with pytest.raises(ControllerError) as info:
        run(ctl, handle, job)
    assert info.value.kind == kind and not info.value.fleet_lost, (info.value.kind, str(info.value))
    for needle in needles:
        assert needle in str(info.value)
    # the same processes take the next job
    out = run(ctl, handle, JobSpec("noop", NoopRequest(steps=1)))
    assert torch.equal(out.tensor, torch.arange(4, dtype=torch.float32))
    after = fleet_status(ctl)
    assert after.worker_pids == before.worker_pids and after.generation == before.generation


# ---- failures that tear the fleet down ------------------------------------------------------------------------------

def _next_job_on_new_fleet(ctl, files, handle, lost: dict) -> None:
    """After a lost fleet: the SAME handle runs the next job on a new fleet (new PIDs, generation + 1) with the
    output of a fresh run, and keeps working on it."""
    assert ctl.status().fleet is None
    accepted = []
    out = run(ctl, handle, JobSpec("generate", request(files)), on_accepted=accepted.append)
    now = fleet_status(ctl)
    assert now.generation == lost.generation + 1 == accepted[0].generation
    assert not set(now.worker_pids) & set(lost.worker_pids)
    assert wait_gone(lost.worker_pids), "workers of the lost fleet still run"
    assert_same(out, w2_fresh(ctl, files), "next job on the new fleet")
    run(ctl, handle, JobSpec("noop", NoopRequest(steps=1)))  # not "stale": same config, same model


def test_error_on_one_rank_tears_fleet_down(ctl, files):
    w2_fresh(ctl, files)
    handle = ctl.configure(config(files, 2))
    lost = fleet_status(ctl)
    job = JobSpec("generate", request(files), fault=FaultSpec(rank=1, stage="stage 1", step=1, kind="error"))
    with pytest.raises(ControllerError) as info:
        run(ctl, handle, job)
    message = str(info.value)
    assert info.value.fleet_lost and info.value.kind == "fleet_lost", message
    assert "rank 1 failed during stage 1 step 1" in message and "injected fault on rank 1" in message
    assert "ranks [0] did not fail" in message
    assert ctl.status().last_failure == message
    _next_job_on_new_fleet(ctl, files, handle, lost)


def test_crash_fault_is_reported_with_rank(ctl, files):
    w2_fresh(ctl, files)
    handle = ctl.configure(config(files, 2))
    lost = fleet_status(ctl)
    job = JobSpec("generate", request(files), fault=FaultSpec(rank=1, stage="stage 1", step=1, kind="crash"))
    with pytest.raises(ControllerError) as info:
        run(ctl, handle, job)
    message = str(info.value)
    assert info.value.fleet_lost, message
    assert f"worker rank 1 (pid {lost.worker_pids[1]}) died with exit code 17 during stage 1" in message
    _next_job_on_new_fleet(ctl, files, handle, lost)


def test_sigkill_of_a_worker_mid_job(ctl, files):
    w2_fresh(ctl, files)
    handle = ctl.configure(config(files, 2))
    lost = fleet_status(ctl)
    victim = lost.worker_pids[1]
    killed = []

    def on_event(event):
        if event.stage == "stage 1" and not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append(event)

    with pytest.raises(ControllerError) as info:
        run(ctl, handle, JobSpec("generate", request(files, steps=8)), on_event=on_event)
    message = str(info.value)
    assert killed and info.value.fleet_lost, message
    assert f"worker rank 1 (pid {victim}) died with exit code -9" in message
    _next_job_on_new_fleet(ctl, files, handle, lost)


def test_stalled_rank_is_detected_and_named(ctl, files):
    """A rank that hangs before a step boundary: the others wait in the broadcast; the controller sees no step
    progress for stall_timeout_s, names the rank, tears the fleet down (the hang guard fails a test that hangs)."""
    handle = ctl.configure(config(files, 2, stall=STALL_S))
    lost = fleet_status(ctl)
    job = JobSpec("noop", NoopRequest(steps=4, sleep_s=0.05), fault=FaultSpec(rank=1, stage="noop", step=2,
                                                                              kind="stall"))
    with deadline(STALL_S + 60, "stall detection"):
        with pytest.raises(ControllerError) as info:
            run(ctl, handle, job)
    message = str(info.value)
    assert info.value.fleet_lost, message
    assert f"no progress for {STALL_S:g} s: rank 1 stalled" in message
    assert "steps begun per rank: [3, 2]" in message
    assert ctl.status().fleet is None
    assert wait_gone(lost.worker_pids), "the stalled fleet's workers still run"
    print(json.dumps({"stall_message": message}))


def test_a_worker_death_in_a_stage_job_names_the_stage(ctl, files):
    """A stage job's worker-death report names its stage ("stage 2" for a tiled one), not the word "stage"; the
    failure is the controller's `last_failure`."""
    from test_controller_serving import sample_payload

    handle = ctl.configure(config(files, 2))
    lost = fleet_status(ctl)
    job = JobSpec("sample", sample_payload("tiled"), fault=FaultSpec(rank=1, stage="stage 2", step=1,
                                                                     kind="crash"))
    with pytest.raises(ControllerError) as info:
        run(ctl, handle, job)
    message = str(info.value)
    assert info.value.fleet_lost, message
    assert f"worker rank 1 (pid {lost.worker_pids[1]}) died with exit code 17 during stage 2 (rank 0 at step " \
           in message, message
    assert ctl.status().last_failure == message
