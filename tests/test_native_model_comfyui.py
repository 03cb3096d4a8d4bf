"""The MGPU MODEL (Load Diffusion Model (MGPU) / Load Checkpoint (MGPU)'s `model`) inside a real ComfyUI equals
ComfyUI's native LTX-AV MODEL on the same tiny weights and inputs: whole samples through ComfyUI's own nodes.

Runs where a ComfyUI checkout (0.33) is at hand, like tests/test_comfyui_load.py:

    COMFYUI_DIR=/tmp/comfyui COMFYUI_PYTHON=/tmp/comfyvenv/bin/python \
        pytest -m comfyui tests/test_native_model_comfyui.py

`tests/native_model_driver.py` runs in ComfyUI's interpreter (cwd = the checkout) and samples every case twice, with
the native MODEL and with the MGPU MODEL, and reports max |MGPU − native| over the separated video and audio
latents. Two transports behind the same proxy:
- `local`: ComfyUI's own LTXAVModel answers the ForwardRequests (a lossless round trip of the contract: everything
  ComfyUI's forward needs travels; measured bit-identical, 0.0, on every case);
- `fleet`: the pack's fleet, W = 1, 2, 4 CPU ranks on a 27-token video (not divisible by 2 or 4), configured as
  Load Diffusion Model (MGPU) does (no Gemma), when the engine has the forward job (mgpu_backend/serving/jobs/forward.py);
  equal to float tolerance (measured ≤ 7.6e-6, max |latent| ~6).
Refused features (SkipLayerGuidanceDiT's block replacement, an attention patch, ModelMergeSimple, core's MultiGPU
CFG Split on a host of two devices — the second one faked as `meta`) fail with a message naming them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _procs import stop_controller

pytestmark = pytest.mark.comfyui

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "native_model_driver.py"
SAMPLE_CASES = ("t2v", "i2v07", "i2v10", "guides07", "guides10", "stg_modality", "dual_cfg", "euler_a", "lora",
                "lora_stack", "t2v_after_lora", "long126", "model_sampling", "easycache", "restart_mid_sampling",
                "ksampler")
REFUSALS = {"refuse_slg": "patches_replace", "refuse_attn_patch": "attention / block patches",
            "refuse_merge": "model merge", "refuse_save": "saving a checkpoint",
            "refuse_cfg_split": "MultiGPU CFG Split (MultiGPU_WorkUnits)"}
LOCAL_ATOL = 1e-6  # measured 0.0: the same ComfyUI module computes both
FLEET_ATOL = 1e-4  # the engine's transformer vs ComfyUI's over 4 steps; measured ≤ 7.6e-6 at W = 2 (max |x| ~6)


def _find_comfyui() -> tuple[Path, str] | None:
    directory = os.environ.get("COMFYUI_DIR")
    if not directory:
        return None
    root = Path(directory)
    python = os.environ.get("COMFYUI_PYTHON") or next(
        (str(c) for c in (root / "venv" / "bin" / "python", root / ".venv" / "bin" / "python") if c.exists()),
        sys.executable)
    return root, python


@pytest.fixture(scope="module")
def comfyui():
    found = _find_comfyui()
    if found is None or not (found[0] / "comfy" / "ldm" / "lightricks" / "av_model.py").is_file():
        pytest.skip("no ComfyUI: set COMFYUI_DIR (and COMFYUI_PYTHON) to a ComfyUI 0.33 checkout")
    return found


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mgpu_backend.testing.tiny import build_tiny_modules, write_tiny_checkpoint, write_tiny_lora

    d = tmp_path_factory.mktemp("native_model")
    modules = build_tiny_modules("2.0", 0)
    yield {"checkpoint": write_tiny_checkpoint(d / "ltx-2.0-tiny.safetensors", "2.0", 0, modules=modules),
           "lora": write_tiny_lora(d / "ltx-2.0-tiny-lora.safetensors", "2.0", 0), "dir": d}
    stop_controller(d / "rt")  # the fleet drivers' controller (run_driver) outlives each driver


def run_driver(comfyui, tiny, transport: str, cases, world_size: int = 1, timeout: int = 900) -> dict:
    root, python = comfyui
    out = tiny["dir"] / f"{transport}-{world_size}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("LTX2_MGPU_RUNTIME_DIR", str(tiny["dir"] / "rt"))
    proc = subprocess.run([python, str(DRIVER), str(tiny["checkpoint"]), str(out), "--transport", transport,
                           "--world-size", str(world_size), "--cases", ",".join(cases), "--lora", str(tiny["lora"])],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def local_run(comfyui, tiny):
    return run_driver(comfyui, tiny, "local", SAMPLE_CASES + tuple(REFUSALS))


def test_mgpu_model_is_built_without_weights(local_run):
    info = local_run["info"]
    assert info["params"] == 0  # no registered parameter: ComfyUI loads and counts nothing
    assert info["state_keys"] == info["native_state_keys"]  # the real key names (meta): LoRA mapping sees them all
    assert info["mgpu_dtype"] == info["native_dtype"] and info["manual_cast"][0] == info["manual_cast"][1]


@pytest.mark.parametrize("case", SAMPLE_CASES)
def test_whole_sample_equals_native_through_the_contract(local_run, case):
    r = local_run["results"][case]
    assert r["max_abs"] <= LOCAL_ATOL, r
    stats = r["stats"]
    if case == "restart_mid_sampling":  # the far side forgot its context and LoRA set before the 3rd forward:
        assert stats["misses"] == 2 and stats["context_sent"] == 3  # each ForwardMiss answered by resending
        return
    assert stats["context_sent"] == 1  # the processed context travels once per sampling (cond + uncond batched)
    assert stats["preprocess"] == 2  # the connectors ran on the far side, once per conditioning
    if case == "stg_modality":
        assert stats["forwards"] == 12  # CFG pair + STG pass + modality pass per step, 4 steps
    elif case == "easycache":
        assert stats["forwards"] < 12  # EasyCache (a DIFFUSION_MODEL wrapper, run locally) skipped steps (9 of 12)
    else:
        assert stats["forwards"] == 4  # cond and uncond stay one batched call per step


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_features_are_named(local_run, case):
    refused = local_run["results"][case]["refused"]
    assert refused is not None and REFUSALS[case] in refused and "MGPU model" in refused


def _engine_has_forward_job() -> bool:
    try:
        from mgpu_backend.serving.jobs import load_all

        return "forward" in load_all()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_whole_sample_on_the_fleet_equals_native(comfyui, tiny, world_size):
    if not _engine_has_forward_job():
        pytest.skip("the engine has no 'forward' job yet (mgpu_backend/serving/jobs/forward.py)")
    cases = ("t2v", "i2v07", "i2v10", "guides07", "guides10", "stg_modality", "dual_cfg", "euler_a", "lora",
             "lora_stack", "t2v_after_lora", "long126", "ksampler")
    run = run_driver(comfyui, tiny, "fleet", cases, world_size=world_size)
    for case in cases:
        r = run["results"][case]
        print(f"W={world_size} {case}: max |MGPU - native| = {r['max_abs']:.2e} (max |native| {r['max_ref']:.2f}); "
              f"{r['report']}")
        assert r["max_abs"] <= FLEET_ATOL, (case, r)
        assert r["stats"]["context_sent"] == 1 and r["stats"]["misses"] == 0


@pytest.fixture(scope="module")
def tiny23(tmp_path_factory):
    from mgpu_backend.testing.tiny import build_tiny_modules, write_tiny_checkpoint, write_tiny_lora

    d = tmp_path_factory.mktemp("native_model_23")
    modules = build_tiny_modules("2.3", 0)
    yield {"checkpoint": write_tiny_checkpoint(d / "ltx-2.3-tiny.safetensors", "2.3", 0, modules=modules),
           "lora": write_tiny_lora(d / "ltx-2.3-tiny-lora.safetensors", "2.3", 0), "dir": d}
    stop_controller(d / "rt")


def test_ltx23_on_the_fleet_equals_native(comfyui, tiny23):
    """LTX-2.3 (the templates' model: gated attention, prompt AdaLN, connectors before the caption projection) at
    W = 2: text-to-video, first + last frame guides at 0.7, STG + modality, a LoRA (the templates load the distilled
    LoRA through LoraLoaderModelOnly), a LoRA with pairs on the text connectors too (the fleet fuses those as
    well), the plain model after them."""
    if not _engine_has_forward_job():
        pytest.skip("the engine has no 'forward' job yet (mgpu_backend/serving/jobs/forward.py)")
    cases = ("t2v", "guides07", "stg_modality", "lora", "connector_lora", "t2v_after_lora")
    run = run_driver(comfyui, tiny23, "fleet", cases, world_size=2)
    for case in cases:
        r = run["results"][case]
        print(f"2.3 W=2 {case}: max |MGPU - native| = {r['max_abs']:.2e} (max |native| {r['max_ref']:.2f}); "
              f"{r['report']}")
        assert r["max_abs"] <= FLEET_ATOL, (case, r)
