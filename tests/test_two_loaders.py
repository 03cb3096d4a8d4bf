"""Both MGPU loaders in one prompt (issue 36, items 9 and 10): Load Checkpoint (MGPU) and Load Diffusion Model (MGPU)
on the same file share one fleet — the controller keeps a whole-checkpoint fleet for the transformer-only
configuration it serves (`FleetIdentity.serves`) — and each loader's report describes the fleet that runs (no Gemma
or tiled stages for a transformer-only one).

The loaders' configurations come from the nodes' own builders (`nodes/loader_plan.py`, no ComfyUI); the fleet is a
real controller with a one-rank CPU fleet of the tiny model, the fleet starts counted in its log.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from mgpu_backend.protocol.fleet_config import FleetHandle, FleetPlan, FleetPolicy
from mgpu_backend.protocol.job_requests import JobSpec, NoopRequest
from mgpu_backend.protocol.job_results import FleetDescription
from mgpu_backend.serving.client import ControllerClient
from nodes.loader_plan import CheckpointOptions, checkpoint_config, describe_plan, diffusion_model_config
from _procs import deadline, stop_controller

GUARD_S = 240


@pytest.fixture(autouse=True)
def _hang_guard(request):
    with deadline(GUARD_S, request.node.name):
        yield


def _configs(tiny_dir, devices=("cpu",), **diffusion):
    files = tiny_dir["2.0"]
    full = checkpoint_config(devices, str(files["checkpoint"]), str(files["gemma"]), str(files["upsampler"]), "auto",
                             CheckpointOptions())
    return full, diffusion_model_config(devices, str(files["checkpoint"]), **diffusion)


def test_a_whole_checkpoint_fleet_serves_the_transformer_only_loader_of_the_same_file(tiny_dir):
    full, tonly = _configs(tiny_dir)
    assert full.identity != tonly.identity  # on main this inequality alone made the controller rebuild
    assert full.identity.serves(tonly.identity) and full.identity.serves(full.identity)
    assert not tonly.identity.serves(full.identity)  # no Gemma, VAEs or upscaler in it
    for other in (_configs(tiny_dir, ("cpu", "cpu"))[1], _configs(tiny_dir, weights="sharded")[1],
                  _configs(tiny_dir, int8_compute="w8a8")[1], _configs(tiny_dir, gpu_budget_gib=4.0)[1],
                  dataclasses.replace(tonly, dtype="bfloat16"),
                  dataclasses.replace(tonly, checkpoint=str(tiny_dir["2.3"]["checkpoint"]))):
        assert not full.identity.serves(other.identity), other.identity


def _starts(runtime: Path) -> list[int]:
    return [int(g) for g in re.findall(r"fleet generation (\d+) started", (runtime / "controller.log").read_text())]


def test_both_loaders_of_one_prompt_share_one_fleet(tiny_dir):
    """Issue 36 item 9: the two loaders' configurations each rebuilt the fleet, and each one's jobs found the other's
    fleet (a stale handle: rebuilt again) — 2-3 starts per prompt. Load Checkpoint first: one start for both, and
    jobs of either handle run on it. Load Diffusion Model first: its fleet is replaced once by the whole
    checkpoint's, whose fleet then runs the transformer-only handle's jobs (no third start)."""
    full, tonly = _configs(tiny_dir)
    runtime = Path(tempfile.mkdtemp(prefix="ltx2-2l-"))
    client = ControllerClient(runtime)
    try:
        accepted = []
        noop = JobSpec("noop", NoopRequest(steps=1))
        h_full = client.configure(full)
        configured = client.configure_fleet(tonly)
        h_tonly = configured.handle
        assert configured.replaced is None
        assert (h_tonly.generation, h_tonly.worker_pids) == (h_full.generation, h_full.worker_pids)
        for handle in (h_tonly, h_full, h_tonly):
            client.run(handle, noop, on_accepted=accepted.append)
        assert [a.generation for a in accepted] == [h_full.generation] * 3
        assert _starts(runtime) == [h_full.generation]
        status = client.status()
        assert status.fleet.transformer_only is False and status.fleet.generation == h_full.generation
        log = (runtime / "controller.log").read_text()
        assert f"fleet generation {h_full.generation} kept for " in log and "serves the transformer-only" in log

        # the other order: the transformer-only fleet first, then the whole checkpoint's replaces it once
        client.shutdown_fleet()
        first = client.configure(tonly)
        second = client.configure_fleet(full)
        assert second.replaced is not None and second.replaced.fleet.transformer_only is True
        accepted.clear()
        client.run(first, noop, on_accepted=accepted.append)
        client.run(second.handle, noop, on_accepted=accepted.append)
        assert [a.generation for a in accepted] == [second.handle.generation] * 2
        assert _starts(runtime) == [h_full.generation, first.generation, second.handle.generation]
    finally:
        client.close()
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def test_the_transformer_only_report_names_no_gemma_and_no_stage_tiles(tiny_dir):
    """Issue 36 item 10: Load Diffusion Model (MGPU)'s text said "tiled stage 2 / decode: all N ranks" and "Gemma mode
    replicated" for a fleet that has neither. It says the fleet holds the transformer only — or, when Load
    Checkpoint (MGPU)'s fleet of the same file serves it, that it runs there; Load Checkpoint's own text keeps both."""
    full, tonly = _configs(tiny_dir)
    plan = FleetPlan(1, 8, 1, (1,))
    description = FleetDescription(5, ("cpu",), (11,), full.checkpoint, "auto", 1.0, None, FleetPolicy(), plan, (1,))
    alone = describe_plan(FleetHandle(5, tonly, (11,), plan),
                          dataclasses.replace(description, transformer_only=True))
    assert "Gemma" not in alone and "tiled stage" not in alone and "SP Sampler" not in alone, alone
    assert "runs: the transformer only (ComfyUI's own loaders give the text encoder and the VAEs)" in alone
    assert "weights: auto (~" in alone
    shared = describe_plan(FleetHandle(5, tonly, (11,), plan), description)
    assert "Gemma" not in shared and "tiled stage" not in shared
    assert ("runs: the transformer, on the fleet of Load Checkpoint (MGPU) of the same file, which also holds the text "
            "encoder and the VAEs (one fleet for both loaders)") in shared
    whole = describe_plan(FleetHandle(5, full, (11,), plan), description)
    assert "tiled stage 2 / decode: all 1 ranks" in whole and "Gemma mode replicated" in whole
