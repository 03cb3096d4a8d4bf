"""Issue 25, item 4: `sampling.denoise_loop` on typed inputs (`ModalityStream` per modality, `LoopHooks`) and the
stage rules written once (`stage.StageLimits`, used by the CLI recipe's `plan_job` and the node job `run_sample`).

`test_denoise_loop_bit_identical_to_the_keyword_form` runs `tests/loop_snapshot.py` (577 loop configurations and
the refusals) on the tree of `BEFORE` — main before the typed inputs, extracted with `git archive`, so the expected
tensors come from the old code — and on this tree, and asserts every tensor, progress call and error is identical.
It skips where the git history is not at hand (a shallow CI checkout).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_backend.engine import sampling as S
from mgpu_backend.stages.stage import StageLimits
from mgpu_backend.protocol.stage_params import TileCountConfig
from mgpu_backend.protocol.validation import ValidationError

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "befdd65f7d534d84aa93b5b1264b8c74e2e65040"  # main before issue 34 (the layer packages, the executable plan)


def test_denoise_loop_bit_identical_to_the_keyword_form(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"], capture_output=True,
                           check=False)
    if probe.returncode != 0:
        pytest.skip(f"commit {BEFORE} is not in this checkout's history (shallow clone?)")
    old = tmp_path / "before"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "mgpu_backend"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    (old / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "loop_snapshot.py", old / "tests" / "loop_snapshot.py")
    shutil.copy(ROOT / "tests" / "old_layout.py", old / "tests" / "old_layout.py")
    outputs = {}
    for name, tree in (("before", old), ("after", ROOT)):
        out = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, str(tree / "tests" / "loop_snapshot.py"), str(out)], cwd=tree,
                              env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        outputs[name] = torch.load(out)
    before, after = outputs["before"], outputs["after"]
    assert before.keys() == after.keys() and len(before) == 577
    assert before.pop("refusals") == after.pop("refusals")
    for case, want in before.items():
        got = after[case]
        for modality in ("video", "audio"):
            assert (want[modality] is None) == (got[modality] is None), case
            if want[modality] is not None:
                assert torch.equal(want[modality], got[modality]), f"{case} {modality}"
        assert (got["progress"], got["cancels"], got["audio_is_input"]) == (
            want["progress"], want["cancels"], want["audio_is_input"]), case


def test_loop_streams_are_refused_by_name():
    x = torch.zeros(1, 3, 8)

    def model(inp):
        return torch.zeros_like(x), torch.zeros_like(x)

    with pytest.raises(ValueError, match=r"video=ModalityStream\(frozen=True\): only the audio stream"):
        S.denoise_loop(model, [0.9, 0.0], S.ModalityStream(x, frozen=True), None)
    with pytest.raises(TypeError, match="audio must be a ModalityStream .* got Tensor"):
        S.denoise_loop(model, [0.9, 0.0], S.ModalityStream(x), x)
    with pytest.raises(AttributeError):
        S.ModalityStream(x).frozen = True  # type: ignore[misc]


def test_loop_hooks_count_steps_and_cancel_before_the_step():
    x = torch.zeros(1, 3, 8)
    forwards, progress = [], []

    def model(inp):
        forwards.append(inp.step)
        return torch.zeros_like(x), None

    hooks = S.LoopHooks(progress=lambda i, n: progress.append((i, n)), cancel=lambda: len(forwards) == 2)
    with pytest.raises(S.SamplingCancelled, match="before step 3/3"):
        S.denoise_loop(model, [0.9, 0.6, 0.3, 0.0], S.ModalityStream(x), None, hooks=hooks)
    assert forwards == [0, 1] and progress == [(1, 3), (2, 3)]


def test_stage_limits_rules():
    """One rule each, the same for the CLI recipe and the node job: the reference's STG block (29 for LTX-2.0)
    clipped to a 2-block model's last block; explicit blocks must exist; the one-process token cap (65536)."""
    limits = StageLimits(family="2.0", n_blocks=2)
    assert limits.default_stg_blocks() == (1,) and limits.ranks == 1
    video, audio = limits.default_guidance()
    assert (video.stg_blocks, audio.stg_blocks, video.cfg_scale, audio.cfg_scale) == ((1,), (1,), 3.0, 7.0)
    stg = S.GuidanceParams(stg_scale=1.0, stg_blocks=(0,))
    assert limits.guidance(stg, S.NO_GUIDANCE, "auto")[0].stg_blocks == (1,)
    assert limits.guidance(stg, S.NO_GUIDANCE, (0,))[1].stg_blocks == (0,)  # unused by audio: not checked
    with pytest.raises(ValidationError, match=r"^video STG block\(s\) \[5\] do not exist: this transformer has "
                                              r"blocks 0\.\.1"):
        limits.guidance(stg, S.NO_GUIDANCE, (5,))
    limits.check_tokens(65536)
    with pytest.raises(ValidationError, match="^65537 video tokens over 1 rank is 65537 tokens per rank, above the cap of 65536"):
        limits.check_tokens(65537)
    assert limits.tiling(None, (2, 4, 4), 1, "tiles") is None  # one rank: untiled
    assert limits.tiling(None, (2, 4, 4), 1, "tiles", ranks=2) is not None
    with pytest.raises(ValidationError, match="^stage-2 tiles: "):
        limits.tiling(TileCountConfig.spatial(1, 9, overlap=1), (2, 4, 4), 1, "stage-2 tiles")
    limits.check_tdp_sigmas(torch.tensor([0.625, 0.4, 0.0]), 0.7)
    with pytest.raises(ValidationError, match="sigma 0.9 is above the bound 0.7"):
        limits.check_tdp_sigmas(torch.tensor([0.9, 0.0]), 0.7)
