"""Session fixtures shared by the loader / fp8 / LoRA / validation tests.

The tiny models are written once per session by the project's own writer (`mgpu_backend.testing.tiny`) in the real
single-file layout, for both model variants ("2.0" and "2.3"). `make_tiny` writes, per variant, a bf16 checkpoint
and its fp8 twin built from the SAME modules (`build_tiny_modules(variant, seed=0)`), so `tiny_modules` holds the
weights both files were written from.

Nothing outlives the run (`pytest_sessionfinish`): a controller, a worker or a /dev/shm frames block of the pack that
this session started and that is still there when it ends fails the run (and is ended / removed).
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mgpu_backend.testing.tiny import build_tiny_modules, make_tiny
from mgpu_backend.protocol.resources import pack_processes

torch.set_num_threads(1)

VARIANTS = ("2.0", "2.3")
TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> dict[str, dict]:
    """variant -> the paths `make_tiny` wrote (`checkpoint`, `checkpoint_fp8`, `upsampler`, `distilled_lora`,
    `gemma`), plus `dir` (the folder)."""
    root = tmp_path_factory.mktemp("tiny_ltx")
    out = {}
    for variant in VARIANTS:
        directory = root / f"ltx-{variant}"
        out[variant] = {"dir": directory, **make_tiny(directory, variant, seed=TINY_SEED)}
    return out


@pytest.fixture(scope="session")
def tiny_modules() -> dict[str, dict[str, torch.nn.Module]]:
    """variant -> the float32 modules the tiny files were written from (`build_tiny_modules(variant, 0)`; the
    builder is deterministic per seed, so these equal the modules `make_tiny` used)."""
    return {variant: build_tiny_modules(variant, TINY_SEED) for variant in VARIANTS}


@pytest.fixture
def seed() -> Callable[[int], torch.Generator]:
    """`seed(n)`: seed torch's global RNG with `n` and return a CPU `torch.Generator` seeded with `n`."""

    def _seed(n: int = 0) -> torch.Generator:
        torch.manual_seed(n)
        return torch.Generator().manual_seed(n)

    return _seed


# ---- nothing outlives the run -------------------------------------------------------------------------------------

# in the environment of every process this session starts (controllers and workers inherit it): how its leftovers
# are told from those of another session running beside it
SESSION_MARK = "LTX2_MGPU_TEST_SESSION"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "ltx2mgpu-"  # = mgpu_backend.protocol.frames.BLOCK_PREFIX + "<writer pid>-<ns>"
# a controller told to stop exits just after it answers: wait this long before blaming it
LEFTOVER_GRACE_S = float(os.environ.get("LTX2_MGPU_TEST_LEFTOVER_GRACE_S", "20"))


def pytest_configure(config):
    os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"
    config._ltx2_shm_before = _shm_blocks()


def _shm_blocks() -> set[str]:
    return {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")} if SHM_DIR.is_dir() else set()


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _pack_processes() -> dict[int, str]:
    """pid -> "name: command line" of this session's live controllers and workers (`resources.pack_processes`)."""
    return pack_processes(f"{SESSION_MARK}={os.environ[SESSION_MARK]}")


def _session_blocks(config) -> list[str]:
    """/dev/shm frames blocks made during the session whose writer is gone or is one of this session's processes
    (a live writer of another session keeps its blocks)."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    out = []
    for name in sorted(_shm_blocks() - config._ltx2_shm_before):
        pid = int(name[len(SHM_PREFIX):].split("-")[0])
        if not Path(f"/proc/{pid}").exists() or mark in _environ(pid).split(b"\0"):
            out.append(name)
    return out


def pytest_sessionfinish(session, exitstatus):
    if SESSION_MARK not in os.environ or not Path("/proc").is_dir():
        return  # the check needs /proc (Linux)
    end = time.monotonic() + LEFTOVER_GRACE_S
    while (left := _pack_processes()) and time.monotonic() < end:
        time.sleep(0.2)
    blocks = _session_blocks(session.config)
    if not left and not blocks:
        return
    lines = [f"left behind by this test run (issue 24): {len(left)} process(es), {len(blocks)} /dev/shm block(s)"]
    for pid, what in sorted(left.items()):
        lines.append(f"  process {pid} {what}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for name in blocks:
        lines.append(f"  /dev/shm/{name}")
        (SHM_DIR / name).unlink(missing_ok=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        (reporter.write_line if reporter else print)(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def require_golden_weights(matches: bool, rule: str) -> None:
    """Fail with `rule` when the tiny files this run wrote are not the ones a golden was made from — except under
    ATen's scalar CPU kernels (ATEN_CPU_CAPABILITY=default, or a CPU without AVX2), where skip: the tiny writers
    draw with float32 `torch.randn`, whose ATen kernel is vectorized Box-Muller with AVX2 and a scalar one without
    (~40 % of the values move by an ulp: other bf16 weights, other file bytes); the goldens came from the AVX2 draw,
    and only a real ComfyUI can remake them."""
    if matches:
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        pytest.skip(f"the tiny files drawn under ATen CPU capability {capability} (scalar torch.randn) are not the "
                    "ones the ComfyUI goldens were made from (the AVX2 draw)")
    raise AssertionError(rule)
