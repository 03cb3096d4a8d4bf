"""Session fixtures shared by the loader / fp8 / LoRA / validation tests.

The tiny models are written once per session by the project's own writer (`mgpu_backend.models.tiny`) in the real
single-file layout, for both model variants ("2.0" and "2.3"). `make_tiny` writes, per variant, a bf16 checkpoint
and its fp8 twin built from the SAME modules (`build_tiny_modules(variant, seed=0)`), so `tiny_modules` holds the
weights both files were written from.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mgpu_backend.models.tiny import build_tiny_modules, make_tiny

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
