"""TDP's report (issue 20): tile drift per forward, whether the blend weights were normalized, and the audio choice
(frozen stage-1 audio, the reference; or re-denoised with every tile's audio output averaged, what ComfyUI's LTX
templates do). The first-sigma bound is a parameter of the stage.

Drift is checked against a brute-force computation over the tiles' raw outputs (recorded by a stand-in transformer),
and W = 2 / 3 gloo ranks against one rank.
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.protocol.stage_requests import SampleRequest
from mgpu_backend.splits.tiled import DEFAULT_MAX_FIRST_SIGMA, check_tdp_sigmas

from _forward import TiledDriver  # the TiledSplit's shard / gather on diffusers' arguments
from mgpu_backend.splits.tiling import DimensionTilingConfig, TileCountConfig, make_tiles

GRID = (2, 4, 9)
TWO = TileCountConfig.spatial(1, 2, overlap=3)
FOUR = TileCountConfig.spatial(2, 2, overlap=1)
NORMALIZED = TileCountConfig(width=DimensionTilingConfig(4, 3))  # 2·overlap exceeds a tile: three tiles overlap


class Disagreeing:
    """A stand-in transformer whose tiles disagree: tile k (k-th call) returns `hidden · (1 + 0.1·k)` and an audio
    output `audio + k`; records every output."""

    transformer_blocks: list = []

    def __init__(self, first: int = 0, step: int = 1):
        self.calls, self.first, self.step = 0, first, step  # on W ranks: this rank's tiles are first, first + W, …

    def __call__(self, *, hidden_states, audio_hidden_states, return_dict=False, **kwargs):
        k = self.first + self.calls * self.step
        self.calls += 1
        return hidden_states * (1 + 0.1 * k), audio_hidden_states + k


def _inputs(grid=GRID, seed=0):
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    n = f * h * w
    fi, hi, wi = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
    coords = torch.stack([torch.stack([v.reshape(-1).float(), v.reshape(-1).float() + 1], -1)
                          for v in (fi, hi, wi)])[None]
    return dict(hidden_states=torch.randn(1, n, 16, generator=g), timestep=torch.ones(1, n), video_coords=coords,
                audio_hidden_states=torch.randn(1, 5, 8, generator=g))


def _brute_drift(grid, tiling, kwargs) -> float:
    """Per token covered by ≥ 2 tiles: the tiles' raw outputs (tile k: hidden·(1 + 0.1 k)); sqrt(Σ 2 s²)/sqrt(Σ m²)
    with s² the unbiased variance over the tiles and m their mean — written out from the definition."""
    tiles, _ = make_tiles(grid, tiling)
    hidden = kwargs["hidden_states"][0].double()
    per_token: dict[int, list[torch.Tensor]] = {}
    for k, tile in enumerate(tiles):
        for tok in tile.token_index(grid).tolist():
            per_token.setdefault(tok, []).append(hidden[tok] * (1 + 0.1 * k))
    num = den = 0.0
    for outs in per_token.values():
        if len(outs) < 2:
            continue
        v = torch.stack(outs)
        num += float(2 * v.var(dim=0, unbiased=True).sum())
        den += float((v.mean(dim=0) ** 2).sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("tiling", [TWO, FOUR, NORMALIZED], ids=["1x2", "2x2", "1x3-normalized"])
def test_drift_matches_the_definition(tiling):
    kwargs = _inputs()
    tiled = TiledDriver(Disagreeing(), GRID, tiling)
    tiled(**kwargs)
    tiled(**kwargs)
    assert len(tiled.drift) == 2  # one value per forward
    ref = _brute_drift(GRID, tiling, kwargs)
    assert tiled.drift[0] == pytest.approx(ref, rel=1e-5)
    assert ref > 0.01
    text = tiled.describe()
    assert "tile drift per forward" in text and f"{tiled.drift[0]:.3g}" in text
    assert ("normalized: yes" in text) == (tiling is NORMALIZED) == tiled.normalized


def test_two_tiles_drift_is_the_relative_difference():
    """1×2: drift = ‖v₁ − v₂‖ / ‖(v₁ + v₂)/2‖ over the overlap (v₂ = 1.1 v₁ here: 0.1 / 1.05)."""
    tiled = TiledDriver(Disagreeing(), GRID, TWO)
    tiled(**_inputs())
    assert tiled.drift[0] == pytest.approx(0.1 / 1.05, rel=1e-5)


def test_agreeing_tiles_have_zero_drift_and_one_tile_has_none():
    class Identity(Disagreeing):
        def __call__(self, *, hidden_states, audio_hidden_states, return_dict=False, **kwargs):
            return hidden_states.clone(), audio_hidden_states

    tiled = TiledDriver(Identity(), GRID, FOUR)
    tiled(**_inputs())
    assert tiled.drift[0] == pytest.approx(0.0, abs=1e-6)
    one = TiledDriver(Identity(), GRID, TileCountConfig())
    one(**_inputs())
    assert one.drift == [] and "n/a" in one.describe()


def test_audio_frozen_by_default_and_averaged_when_re_denoised():
    kwargs = _inputs()
    frozen = TiledDriver(Disagreeing(), GRID, FOUR)
    _, audio = frozen(**kwargs)
    assert torch.equal(audio, torch.zeros_like(audio)) and "frozen stage-1 audio" in frozen.describe()
    denoised = TiledDriver(Disagreeing(), GRID, FOUR)
    denoised.denoise_audio = True
    _, audio = denoised(**kwargs)
    # tiles 0..3 return audio + k: the average is audio + 1.5
    assert torch.allclose(audio, kwargs["audio_hidden_states"] + 1.5)
    assert "re-denoised" in denoised.describe()


def test_first_sigma_bound_is_a_parameter():
    assert DEFAULT_MAX_FIRST_SIGMA == 0.7
    template = torch.tensor([0.85, 0.725, 0.4219, 0.0])  # ComfyUI's LTX-2.3 / 2.5 stage 2
    with pytest.raises(ValueError, match="0.85 is above the bound 0.7"):
        check_tdp_sigmas(template)
    check_tdp_sigmas(template, max_first_sigma=0.9)
    with pytest.raises(ValueError, match="first stage"):
        check_tdp_sigmas(torch.tensor([1.0, 0.5, 0.0]), max_first_sigma=0.99)


def _ranks(rank: int, world: int, denoise: bool) -> dict:
    out = {}
    for name, tiling in (("1x2", TWO), ("2x2", FOUR), ("normalized", NORMALIZED)):
        tiled = TiledDriver(Disagreeing(first=rank, step=world), GRID, tiling, None, world, rank)
        tiled.denoise_audio = denoise
        video, audio = tiled(**_inputs())
        out[name] = (video, audio, list(tiled.drift))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_w_ranks_report_the_drift_of_one_rank(world):
    one = _ranks(0, 1, True)
    results = run_ranks(_ranks, world, True)
    for name in one:
        for r in range(world):
            video, audio, drift = results[r][name]
            assert torch.allclose(video, one[name][0], rtol=1e-6, atol=1e-6)
            assert torch.allclose(audio, one[name][1], rtol=1e-6, atol=1e-6)
            assert drift == pytest.approx(one[name][2], rel=1e-6)


# ---- the stage job (what TDP Upscale (MGPU) sends the fleet), one process, the tiny LTX-2.0 model --------------------

TEMPLATE_STAGE2 = torch.tensor([0.85, 0.725, 0.4219, 0.0])  # ComfyUI's LTX-2.3 / 2.5 templates


class _Ctx:
    rank, progress, step_boundary = 0, None, None


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    return TwoStagePipeline(load_components(tiny_dir["2.0"]["checkpoint"], dtype=torch.float32), None)


def _payload(pipe, **extra):
    g = torch.Generator().manual_seed(5)
    width = pipe.components.text_projection.out_features if hasattr(pipe.components.text_projection,
                                                                    "out_features") else None
    video, audio = torch.randn(1, 128, 2, 4, 6, generator=g), torch.randn(1, 8, 5, 16, generator=g)
    p = {"positive": torch.randn(1, 7, width or 64, generator=g), "negative": None, "video": video, "audio": audio,
         "noise_video": torch.randn(video.shape, generator=g), "noise_audio": torch.randn(audio.shape, generator=g),
         "fps": 24.0, "mode": "tiled", "tiles": TileCountConfig.spatial(1, 2, overlap=2), "sigmas": TEMPLATE_STAGE2}
    p.update(extra)
    return SampleRequest(**p)


def _run(pipe, payload):
    from mgpu_backend.serving.jobs.stages import run_sample

    return run_sample(type("State", (), {"pipeline": pipe})(), payload, _Ctx())


def test_stage_job_refuses_the_template_sigmas_by_default_and_runs_them_with_a_raised_bound(pipe):
    from mgpu_backend.protocol.validation import ValidationError

    with pytest.raises(ValidationError, match="max_first_sigma"):
        _run(pipe, _payload(pipe))
    frozen = _run(pipe, _payload(pipe, max_first_sigma=0.9))
    assert frozen.audio_frozen is True and frozen.weights_normalized is False
    assert len(frozen.tile_drift) == 3 and all(d > 0 for d in frozen.tile_drift)  # 3 steps, no guidance
    assert "tile drift per forward" in frozen.report
    assert torch.equal(frozen.audio, _payload(pipe).audio)  # the stage-1 audio, bit for bit
    denoised = _run(pipe, _payload(pipe, max_first_sigma=0.9, audio_frozen=False))
    assert denoised.audio_frozen is False and "re-denoised" in denoised.report
    assert torch.isfinite(denoised.audio).all()
    assert not torch.equal(denoised.audio, frozen.audio)
    # the video of the two runs differs only through the audio (the audio stream feeds the video's cross-attention)
    assert torch.isfinite(denoised.video).all()
