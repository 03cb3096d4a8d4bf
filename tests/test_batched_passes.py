"""Guidance passes of a step as one batched forward (issue 16): equal to the unbatched passes to float tolerance.

The batch stacks the passes along the batch dimension: each item gets its own text context (negative for CFG's
"uncond"), the STG pass its skipped self-attention in its own blocks (video and audio blocks differ, as the
reference's perturbations do) and the isolated pass its audio↔video cross-attention switched off — per item, by
`torch.where` / a 0-1 factor (`denoiser.per_item_perturbations`). Tiny LTX-2.0 and 2.3 models (2.3: per-head gates,
which the STG value path goes through too), float32 on the CPU; tolerance 1e-5 relative (batched matmuls may sum in
another order; the per-item selection itself is exact).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mgpu_backend.engine import sampling as S
from mgpu_backend.engine.denoiser import LTX2Denoiser, text_contexts
from mgpu_backend.engine import latents as L
from mgpu_backend.models.loader import load_components
from mgpu_backend.splits.passes import PassParallel

torch.set_num_threads(1)
TOL = 1e-5
GRID = (2, 2, 3)
AUDIO_TOKENS = 5
VIDEO = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(1,), rescale=0.7, modality_scale=3.0)
AUDIO = S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(0,), rescale=0.7, modality_scale=3.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=["2.0", "2.3"])
def setup(request, tiny_dir):
    components = load_components(tiny_dir[request.param]["checkpoint"], dtype=torch.float32)
    transformer = components.transformer
    width = components.video_connector.inner_dim + (components.audio_connector.inner_dim
                                                    if components.variant == "2.3" else 0)
    g = torch.Generator().manual_seed(4)
    contexts = text_contexts(components, [torch.randn(1, 7, width, generator=g), torch.randn(1, 3, width, generator=g)],
                             dtype=torch.float32)
    f, h, w = GRID

    def denoiser(mode: str) -> LTX2Denoiser:
        d = LTX2Denoiser(transformer, contexts.select(0), contexts.select(1),
                         L.video_coords(transformer, 1, f, h, w, 24.0), L.audio_coords(transformer, 1, AUDIO_TOKENS),
                         torch.float32)
        d.batch_mode = mode
        return d

    x = torch.randn(1, f * h * w, 128, generator=g)
    a = torch.randn(1, AUDIO_TOKENS, 128, generator=g)
    ts = torch.full((1, f * h * w), 0.6)
    ts[:, : h * w] = 0.0  # a conditioned first frame: per-token timesteps differ
    inputs = S.ModelInputs(x, a, ts, torch.full((1, AUDIO_TOKENS), 0.6), torch.tensor([0.6]), torch.tensor([0.6]),
                           S.GuidancePass("cond"), 0)
    return denoiser, inputs, g


def test_batched_forward_equals_each_pass(setup):
    denoiser, inputs, _ = setup
    passes = S.plan_passes(VIDEO, AUDIO)
    assert [p.kind for p in passes] == ["cond", "uncond", "perturbed", "isolated"]
    d = denoiser("on")
    batched = d.batch(inputs, passes)
    assert d.forwards == 1
    singles = [d(dataclasses.replace(inputs, guidance=p)) for p in passes]
    for p, (bv, ba), (sv, sa) in zip(passes, batched, singles):
        assert bv.shape == sv.shape and ba.shape == sa.shape
        assert _rel(bv, sv) < TOL and _rel(ba, sa) < TOL, p.kind
    # the passes really differ (each perturbation reached its own item only)
    for i in range(len(passes)):
        for j in range(i + 1, len(passes)):
            assert _rel(singles[i][0], singles[j][0]) > 1e-3 or _rel(singles[i][1], singles[j][1]) > 1e-3
    # the processors are restored afterwards
    blocks = d.transformer.transformer_blocks
    assert all(type(b.attn1.processor).__name__ == "LTX2AttnProcessor" for b in blocks)
    assert all(type(b.audio_to_video_attn.processor).__name__ == "LTX2AttnProcessor" for b in blocks)


def test_denoise_loop_batched_equals_unbatched(setup):
    """The hook: `denoise_loop` hands `run_local` a `many` that batches; the whole guided loop agrees."""
    denoiser, inputs, g = setup
    sigmas = S.ltx2_sigmas(3)
    out = {}
    for mode in ("on", "off"):
        d = denoiser(mode)
        out[mode] = S.denoise_loop(d, sigmas, S.ModalityStream(inputs.video.clone(), guidance=VIDEO),
                                   S.ModalityStream(inputs.audio.clone(), guidance=AUDIO))
        out[mode + "_d"] = d
    assert out["on_d"].forwards == 3 and out["off_d"].forwards == 12
    assert "3 steps: 4 passes as one batched forward" in out["on_d"].batch_report()
    assert out["off_d"].batch_report() == "guidance passes: 3 steps: passes one at a time: set off"
    for got, want in zip(out["on"], out["off"]):
        assert _rel(got, want) < TOL


def test_pass_parallel_rank_with_several_passes_batches(setup):
    denoiser, inputs, _ = setup
    d = denoiser("on")
    passes = S.plan_passes(VIDEO, AUDIO)
    runner = PassParallel(None, 1, 0)
    calls = []

    def denoise(p):
        calls.append(p.kind)
        return d(dataclasses.replace(inputs, guidance=p))

    denoise.many = lambda ps: d.batch(inputs, ps)
    outs = runner(passes, denoise)
    assert calls == [] and d.forwards == 1 and len(outs) == 4 and runner.forwards == 4


def test_auto_does_not_batch_on_cpu_and_refusals_name_the_reason(setup, tiny_dir):
    denoiser, inputs, _ = setup
    d = denoiser("auto")
    passes = S.plan_passes(VIDEO, AUDIO)
    assert d.batch_choice(passes, inputs.video) is False
    assert d.batch_report() is None  # CPU: unchanged, nothing to report
    assert d.can_batch(passes[:1]) == "one pass"
    d.negative = type(d.positive)(torch.cat([d.positive.video] * 2, 1), torch.cat([d.positive.audio] * 2, 1),
                                  torch.cat([d.positive.mask] * 2, 1))
    assert "different lengths" in d.can_batch(passes)
    with pytest.raises(ValueError, match="cannot be batched: the prompts' contexts have different lengths"):
        d.batch(inputs, passes)
    d.batch_mode = "sometimes"
    with pytest.raises(ValueError, match="'sometimes'.*auto, on, off"):
        d.batch_choice(passes, inputs.video)


def test_batched_under_the_sequence_parallel_wrapper(setup):
    """The batch under the sequence split (W = 1 here; W = 2 on gloo below): the per-item wrappers of the STG and
    isolation passes wrap the split's processors and hand them its keys."""
    from mgpu_backend.splits.apply import apply_plan
    from mgpu_backend.splits.exchange import Exchange
    from mgpu_backend.splits.sequence import UlyssesSplit

    denoiser, inputs, _ = setup
    plain = denoiser("on")
    transformer = plain.transformer
    split = UlyssesSplit(Exchange(None, 1, 0))
    apply_plan(transformer, split.plan, split.exchange)
    d = LTX2Denoiser(transformer, plain.positive, plain.negative, plain.video_coords, plain.audio_coords,
                     torch.float32, split=split)
    passes = S.plan_passes(VIDEO, AUDIO)
    batched = d.batch(inputs, passes)
    singles = [d(dataclasses.replace(inputs, guidance=p)) for p in passes]
    for p, (bv, ba), (sv, sa) in zip(passes, batched, singles):
        assert _rel(bv, sv) < TOL and _rel(ba, sa) < TOL, p.kind


def _sp_rank(rank: int, world: int, checkpoint: str) -> list:
    import torch.distributed as dist

    from mgpu_backend.splits.apply import apply_plan
    from mgpu_backend.splits.exchange import Exchange
    from mgpu_backend.splits.sequence import UlyssesSplit

    components = load_components(checkpoint, dtype=torch.float32)
    transformer = components.transformer
    g = torch.Generator().manual_seed(4)
    width = components.video_connector.inner_dim + (components.audio_connector.inner_dim
                                                    if components.variant == "2.3" else 0)
    contexts = text_contexts(components, [torch.randn(1, 7, width, generator=g), torch.randn(1, 3, width, generator=g)],
                             dtype=torch.float32)
    f, h, w = GRID
    x = torch.randn(1, f * h * w, 128, generator=g)
    a = torch.randn(1, AUDIO_TOKENS, 128, generator=g)
    inputs = S.ModelInputs(x, a, torch.full((1, f * h * w), 0.6), torch.full((1, AUDIO_TOKENS), 0.6),
                           torch.tensor([0.6]), torch.tensor([0.6]), S.GuidancePass("cond"), 0)
    split = UlyssesSplit(Exchange(dist.group.WORLD if world > 1 else None, world, rank))
    apply_plan(transformer, split.plan, split.exchange)
    d = LTX2Denoiser(transformer, contexts.select(0), contexts.select(1),
                     L.video_coords(transformer, 1, f, h, w, 24.0), L.audio_coords(transformer, 1, AUDIO_TOKENS),
                     torch.float32, split=split)
    passes = S.plan_passes(VIDEO, AUDIO)
    return [d.batch(inputs, passes), [d(dataclasses.replace(inputs, guidance=p)) for p in passes]]


def test_batched_sequence_parallel_w2_equals_unbatched(tiny_dir):
    from _dist import run_ranks

    results = run_ranks(_sp_rank, 2, str(tiny_dir["2.0"]["checkpoint"]))
    batched, singles = results[0]
    for (bv, ba), (sv, sa) in zip(batched, singles):
        assert _rel(bv, sv) < TOL and _rel(ba, sa) < TOL
    # and equal to one process, unbatched (SP at W = 2 equals W = 1 to 1e-6: tests/test_sequence_parallel.py)
    one = _sp_rank(0, 1, str(tiny_dir["2.0"]["checkpoint"]))[1]
    for (bv, ba), (sv, sa) in zip(batched, one):
        assert _rel(bv, sv) < TOL and _rel(ba, sa) < TOL
