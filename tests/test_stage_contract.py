"""The stage contract (`mgpu_backend/stages/stage.py`, issue 17 item 1): one frozen `StageSpec` validated when built, and
the runner the plan picks.

`test_outputs_bit_identical_to_the_code_before_the_contract` runs `tests/stage_snapshot.py` (CLI `generate` in one
process and on 2 gloo ranks; the node "sample" job in one process, sequence parallel, guidance passes and tiled on 2
ranks) on the tree of `BEFORE` — the last commit before the contract, extracted with `git archive`, so the expected
tensors come from the old code — and on this tree, and asserts every tensor is bit-identical. It skips where the git
history is not at hand (e.g. a shallow CI checkout).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_backend.engine import latents as L
from mgpu_backend.engine.denoiser import TextContext
from mgpu_backend.engine.sampling import GuidanceParams
from mgpu_backend.stages.stage import OneDeviceRunner, SamplerSpec, StageEnv, StageSpec, TiledRunner, choose_runner
from mgpu_backend.splits.tiling import TileCountConfig
from mgpu_backend.protocol.validation import ValidationError

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "befdd65f7d534d84aa93b5b1264b8c74e2e65040"  # main before issue 34 (the layer packages, the executable plan)


def _context() -> TextContext:
    return TextContext(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), torch.ones(1, 4))


def _spec(**overrides) -> StageSpec:
    args = dict(name="stage 1", semantics="reference", positive=_context(), negative=None, grid=(2, 1, 3), fps=25.0,
                audio_frames=4, video_clean=torch.zeros(1, 6, 128), audio_clean=torch.zeros(1, 4, 128),
                sigmas=torch.tensor([1.0, 0.5, 0.0]))
    args.update(overrides)
    return StageSpec(**args)


def test_a_valid_spec_is_frozen_and_counts_its_passes():
    spec = _spec(negative=_context(), video_guidance=GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(0,)))
    assert spec.video_tokens == 6 and spec.passes == 3
    with pytest.raises(AttributeError):
        spec.fps = 24.0  # type: ignore[misc]


@pytest.mark.parametrize("overrides,words", [
    ({"semantics": "diffusers"}, ["semantics='diffusers'", "reference, comfyui"]),
    ({"video_clean": torch.zeros(1, 5, 128)}, ["video latent", "(1, 6, 128)"]),
    ({"audio_mask": torch.ones(1, 3)}, ["audio denoise mask", "(1, 4)"]),
    ({"noise": (torch.zeros(1, 6, 128), torch.zeros(1, 5, 128))}, ["audio noise", "(1, 4, 128)"]),
    ({"sigmas": torch.tensor([1.0, 0.5])}, ["sigmas", "end in 0"]),
    ({"fps": 0.0}, ["fps=0.0"]),
    ({"video_guidance": GuidanceParams(cfg_scale=3.0)}, ["CFG", "negative"]),
    ({"semantics": "comfyui", "audio_frozen": True, "sampler": SamplerSpec(noise_layout="comfyui")},
     ["frozen audio", "reference"]),
    ({"semantics": "comfyui", "tiling": TileCountConfig.spatial(1, 2, overlap=1),
      "sampler": SamplerSpec(noise_layout="comfyui")}, ["tiled", "reference"]),
    ({"semantics": "comfyui", "sampler": SamplerSpec("euler_ancestral")}, ["ComfyUI's layout"]),
    ({"semantics": "comfyui"}, None),  # euler: no noise to lay out
    ({"sampler": SamplerSpec("euler_ancestral")}, None),
])
def test_bad_specs_are_refused_by_name(overrides, words):
    if words is None:
        _spec(**overrides)
        return
    with pytest.raises(ValidationError) as info:
        _spec(**overrides)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("fields,words", [({"name": "dpmpp"}, ["sampler='dpmpp'"]), ({"eta": 1.5}, ["eta=1.5"]),
                                          ({"noise_layout": "flat"}, ["noise_layout='flat'"]),
                                          ({"name": "euler_ancestral", "noise_layout": "comfyui",
                                            "noise_device": "mps"}, ["noise_device='mps'", "cpu or cuda"])])
def test_bad_samplers_are_refused_by_name(fields, words):
    with pytest.raises(ValidationError) as info:
        SamplerSpec(**fields)
    assert all(w in str(info.value) for w in words)


def test_ancestral_noise_layouts():
    """"packed": one randn over the packed video tokens then audio (none for frozen audio); "comfyui": over
    ComfyUI's [1, 128, F, H, W] + [1, 8, T, 16] latent, packed afterwards."""
    grid, t = (2, 1, 3), 4
    packed = SamplerSpec("euler_ancestral", seed=5).build(grid, t, audio_frozen=False).noise_fn()
    flat = torch.randn(6 * 128 + t * 128, generator=torch.Generator().manual_seed(6))
    assert torch.equal(packed[0], flat[:768].reshape(1, 6, 128)) and torch.equal(packed[1],
                                                                                 flat[768:].reshape(1, t, 128))
    assert SamplerSpec("euler_ancestral", seed=5).build(grid, t, audio_frozen=True).noise_fn()[1] is None
    comfy = SamplerSpec("euler_ancestral", seed=5, noise_layout="comfyui").build(grid, t, False).noise_fn()
    assert torch.equal(comfy[0], L.pack_video(flat[:768].reshape(1, 128, 2, 1, 3)))
    assert torch.equal(comfy[1], L.pack_audio(flat[768:].reshape(1, 8, t, 16)))
    assert SamplerSpec("euler").build(grid, t, False) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_comfyui_noise_on_cuda_without_a_gpu_is_refused_by_name():
    """ComfyUI sampling on a GPU draws euler_ancestral's noise from a CUDA generator (seed unchanged), a stream a
    CPU-only rank cannot reproduce: refused when the spec is built, before any work."""
    with pytest.raises(ValidationError, match="noise_device='cuda'"):
        SamplerSpec("euler_ancestral", seed=5, noise_layout="comfyui", noise_device="cuda")
    SamplerSpec("euler", noise_layout="comfyui", noise_device="cuda")  # euler draws no noise: nothing to refuse


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_comfyui_noise_on_cuda_is_comfyuis_cuda_stream():
    """k_diffusion.sampling.default_noise_sampler on a CUDA latent: `torch.Generator(x.device).manual_seed(seed)`
    (no + 1) and `randn(x.size(), device=x.device)` over the flat (video, audio) latent."""
    grid, t = (2, 1, 3), 4
    got = SamplerSpec("euler_ancestral", seed=5, noise_layout="comfyui", noise_device="cuda").build(grid, t, False)
    video, audio = got.noise_fn()
    flat = torch.randn((1, 1, 6 * 128 + t * 128), generator=torch.Generator("cuda").manual_seed(5),
                       device="cuda").cpu().flatten()
    assert torch.equal(video, L.pack_video(flat[:768].reshape(1, 128, 2, 1, 3)))
    assert torch.equal(audio, L.pack_audio(flat[768:].reshape(1, 8, t, 16)))


def test_runner_choice_without_a_plan(monkeypatch):
    from types import SimpleNamespace

    from mgpu_backend.splits import tiled

    monkeypatch.setattr(tiled, "TiledSplit", lambda transformer, grid, tiling: SimpleNamespace(grid=grid))
    env = StageEnv(SimpleNamespace(transformer=torch.nn.Linear(1, 1)), torch.float32, torch.device("cpu"))
    assert isinstance(choose_runner(_spec(), env), OneDeviceRunner)
    runner = choose_runner(_spec(grid=(1, 2, 3), audio_frames=4, video_clean=torch.zeros(1, 6, 128),
                                 tiling=TileCountConfig.spatial(1, 2, overlap=1)), env)
    assert isinstance(runner, TiledRunner) and runner.tiled.grid == (1, 2, 3)


@pytest.mark.slow
def test_outputs_bit_identical_to_the_code_before_the_contract(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"commit {BEFORE[:10]} is not in this checkout's history (shallow clone?)")
    old = tmp_path / "before"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "mgpu_backend", "nodes", "kernels"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    (old / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "stage_snapshot.py", old / "tests" / "stage_snapshot.py")
    shutil.copy(ROOT / "tests" / "old_layout.py", old / "tests" / "old_layout.py")
    tiny = tmp_path / "tiny"
    outputs = {}
    for name, tree in (("before", old), ("after", ROOT)):
        out = tmp_path / f"{name}.pt"
        env = {**__import__("os").environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run([sys.executable, str(tree / "tests" / "stage_snapshot.py"), str(out), "--tiny",
                               str(tiny)], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        outputs[name] = torch.load(out)
    before, after = outputs["before"], outputs["after"]
    assert before.keys() == after.keys() and len(before) == 12
    for case in before:
        for modality in ("video", "audio"):
            assert torch.equal(before[case][modality], after[case][modality]), (
                f"{case} {modality}: max |after - before| = "
                f"{float((after[case][modality] - before[case][modality]).abs().max()):.3e}")
