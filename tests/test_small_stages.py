"""Small and odd latent sizes through the stage jobs (issue 24, Build 5): stage 1 sequence parallel (`sample`), the 2×
latent upscale (`upscale`) and stage 2 tiled data parallel (`sample` with mode "tiled", on the upscaled size, and on
the size itself as TDP Upscale (MGPU) with its upscale off sends it) — the jobs SP Sampler (MGPU) and TDP Upscale
(MGPU) send — for latents of 1 frame or an odd frame count, 1-3 cells high or wide, on the tiny LTX-2.0 model
(float32, CPU).

Each size either runs, and the result on 2 gloo ranks (`tests/_dist.py`, one spawn for every size) equals the
one-process result (the same job functions with no plan, in this process), or is refused before any work: a
ValidationError naming the value and the rule, raised on every rank alike, and no transformer block (no upscaler)
ran. Anything else (an error from inside torch, a crash) fails. The decode and the native forward have their own
small-size tests (test_decode.py, test_native_forward.py).

Tolerances, and why:
- stage 1 over 2 ranks vs one process: relative error ‖sp − ref‖ / ‖ref‖ ≤ SP_TOL = 1e-5, the bound of
  test_sequence_parallel.py and its reasoning: SP changes no formula, only how fp32 reductions are blocked (Linear
  layers on T/W rows, attention per head slice over padded keys that add exact zeros after the −inf bias); with
  fewer tokens than ranks the padding is most of the sequence but adds nothing. A few fp32 ulps per step.
- the upscale runs whole on every rank (the same code, shapes and one thread): `torch.equal`.
- stage 2 over 2 ranks vs the same tiling in one process: |Δ| ≤ TILED_TOL·(1 + |ref|), TILED_TOL = 1e-6, the bound
  of test_tdp.py: every tile forward is bit-identical in any process; only the order of the fp32 sum of the
  overlapping tiles' weighted outputs differs (≤ 4 terms: a few ulps of O(1) values).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.protocol import stage_requests as P
from mgpu_backend.protocol.validation import ValidationError

torch.set_num_threads(1)

SP_TOL = 1e-5
TILED_TOL = 1e-6
# (frames, height, width) latent cells of stage 1; stage 2 runs on the upscaled (frames, 2 height, 2 width)
SIZES = [(1, 1, 1), (1, 1, 3), (1, 3, 1), (1, 2, 2), (3, 1, 2), (5, 3, 3), (2, 2, 3)]
AUDIO_STEPS = 5
JOBS = ("stage 1", "upscale", "stage 2", "stage 2 unscaled")


def _requests(grid: tuple[int, int, int]) -> dict[str, object]:
    """The jobs of one size, seeded by the size (the same tensors in every process)."""
    f, h, w = grid
    g = torch.Generator().manual_seed(f * 100 + h * 10 + w)
    video, up = (1, 128, f, h, w), (1, 128, f, 2 * h, 2 * w)
    audio = (1, 8, AUDIO_STEPS, 16)
    common = dict(positive=torch.randn(1, 7, 64, generator=g), negative=torch.randn(1, 5, 64, generator=g), fps=24.0,
                  audio=torch.randn(audio, generator=g), noise_audio=torch.randn(audio, generator=g))
    return {
        "stage 1": P.SampleRequest(video=torch.randn(video, generator=g), noise_video=torch.randn(video, generator=g),
                                   sigmas=torch.tensor([1.0, 0.6, 0.0]), mode="sequence_parallel",
                                   video_guidance=None, **common),
        "upscale": P.UpscaleRequest(video=torch.randn(video, generator=g)),
        # stage 2 as TDP Upscale (MGPU) sends it: the upscaled size, tiled, from sigma 0.6, the node's overlap (5)
        "stage 2": P.SampleRequest(video=torch.randn(up, generator=g), noise_video=torch.randn(up, generator=g),
                                   sigmas=torch.tensor([0.6, 0.3, 0.0]), mode="tiled", audio_frozen=True, **common),
        # and with its `upscale` off: stage 2 on the size itself
        "stage 2 unscaled": P.SampleRequest(video=torch.randn(video, generator=g),
                                            noise_video=torch.randn(video, generator=g),
                                            sigmas=torch.tensor([0.6, 0.3, 0.0]), mode="tiled", audio_frozen=True,
                                            **common),
    }


def _run_sizes(rank: int, world: int, files: dict) -> list[dict]:
    """Every size's jobs on this rank (`world` 1: in one process, no plan). Per job: ("ok", outputs, block
    calls), ("refused", message, block calls) for a ValidationError, or ("error", repr, calls) for anything else."""
    from mgpu_backend.serving.jobs.stages import run_sample, run_upscale
    from mgpu_backend.models.loader import ComponentFiles, load_components
    from mgpu_backend.splits.plan import build_plan
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    cpu = torch.device("cpu")
    components = load_components(files["checkpoint"], ComponentFiles(upsampler=files["upsampler"]), dtype=torch.float32,
                                 device=cpu)
    plan = build_plan(components.transformer, rank, world, cpu) if world > 1 else None
    state = SimpleNamespace(pipeline=TwoStagePipeline(components, None, device=cpu, plan=plan))
    calls = []
    components.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.append("block"))
    components.upsampler.register_forward_pre_hook(lambda *_: calls.append("upsampler"))
    jobs = {"stage 1": run_sample, "upscale": run_upscale, "stage 2": run_sample, "stage 2 unscaled": run_sample}
    out = []
    for grid in SIZES:
        results = {}
        for name, request in _requests(grid).items():
            calls.clear()
            ctx = SimpleNamespace(rank=rank, stage=None, progress=None, step_boundary=None)
            try:
                value = jobs[name](state, request, ctx)
                fields = {} if value is None else vars(value)  # a typed result on rank 0, None elsewhere
                results[name] = ("ok", {k: v for k, v in fields.items() if isinstance(v, (torch.Tensor, str))},
                                 len(calls))
            except ValidationError as exc:
                results[name] = ("refused", str(exc), len(calls))
            except Exception as exc:  # noqa: BLE001 - reported by the test, with the size
                results[name] = ("error", f"{type(exc).__name__}: {exc}", len(calls))
        out.append(results)
    return out


@pytest.fixture(scope="module")
def runs(tiny_dir) -> tuple[list[dict], list[list[dict]]]:
    files = {k: str(v) for k, v in tiny_dir["2.0"].items() if k in ("checkpoint", "upsampler")}
    return _run_sizes(0, 1, files), run_ranks(_run_sizes, 2, files, timeout_s=300.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("index", range(len(SIZES)), ids=["x".join(map(str, s)) for s in SIZES])
def test_small_sizes_run_as_in_one_process_or_are_refused_before_work(runs, index):
    one, ranks = runs
    grid = SIZES[index]
    f, h, w = grid
    for name in JOBS:
        ref, r0, r1 = one[index][name], ranks[0][index][name], ranks[1][index][name]
        for where, got in (("one process", ref), ("rank 0", r0), ("rank 1", r1)):
            assert got[0] != "error", f"{grid} {name} ({where}) failed inside: {got[1]}"
        assert ref[0] == r0[0] == r1[0], f"{grid} {name}: one process {ref[0]}, ranks {r0[0]} / {r1[0]}"
        if ref[0] == "refused":
            for got in (ref, r0, r1):
                assert got[2] == 0, f"{grid} {name}: refused after {got[2]} forward(s): {got[1]}"
                assert got[1] == ref[1], (got[1], ref[1])
            assert "x".join(map(str, grid)) in ref[1] and "at least" in ref[1], ref[1]  # the size and the rule
            print(f"{grid} {name}: refused: {ref[1]}")
            continue
        video, video2 = ref[1]["video"], r0[1]["video"]
        scale = 2 if name in ("upscale", "stage 2") else 1
        expected = (1, 128, f, h * scale, w * scale)
        assert video.shape == video2.shape == expected and torch.isfinite(video).all(), (grid, name, video.shape)
        if name == "upscale":
            assert torch.equal(video, video2), grid
            continue
        audio, audio2 = ref[1]["audio"], r0[1]["audio"]
        assert audio.shape == audio2.shape == (1, 8, AUDIO_STEPS, 16) and torch.isfinite(audio).all()
        if name == "stage 1":
            assert _rel(video2, video) <= SP_TOL and _rel(audio2, audio) <= SP_TOL, \
                (grid, _rel(video2, video), _rel(audio2, audio))
        else:
            assert ((video2 - video).abs() <= TILED_TOL * (1 + video.abs())).all(), \
                (grid, float((video2 - video).abs().max()))
            assert torch.equal(audio, audio2), grid  # frozen: stage 1's audio comes back
        reports = [(got[1].get("report") or "").splitlines()[:1] for got in (ref, r0)]
        print(f"{grid} {name}: ran; {reports[0]} / {reports[1]}")
