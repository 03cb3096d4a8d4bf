"""The one-process two-stage pipeline and the CLI, on the tiny models in the real file layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mgpu_backend.serving import cli
from mgpu_backend.engine import latents as L
from mgpu_backend.stages.media import probe_mp4
from mgpu_backend.models.gemma import load_gemma
from mgpu_backend.models.loader import ComponentFiles, load_components
from mgpu_backend.testing.tiny import make_tiny
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline

torch.set_num_threads(1)

SMALL = dict(width=128, height=128, frames=9, fps=24.0, steps=3)


@pytest.fixture(scope="session", params=["2.0", "2.3"])
def tiny_pipeline(request, tmp_path_factory):
    paths = make_tiny(tmp_path_factory.mktemp(f"pipe{request.param}"), request.param, seed=0)
    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)
    return TwoStagePipeline(components, load_gemma(paths["gemma"])), paths


def _run(pipeline, paths, **overrides):
    args = dict(SMALL, prompt="a fox in the snow", seed=3, distilled_lora=(str(paths["distilled_lora"]), 1.0))
    args.update(overrides)
    return pipeline.generate(GenerateRequest(**args))


def test_deterministic_per_seed_and_shapes(tiny_pipeline):
    pipeline, paths = tiny_pipeline
    a, b = _run(pipeline, paths), _run(pipeline, paths)
    assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)
    assert a.frames.shape == (9, 128, 128, 3)
    assert 0.0 <= float(a.frames.min()) and float(a.frames.max()) <= 1.0
    assert a.video_latent.shape == (1, 128, 2, 4, 4)
    # audio latent length follows the reference rule round(frames / fps * 25)
    assert a.audio_latent.shape == (1, 8, L.audio_latent_frames(9, 24.0), 16)
    assert a.audio.ndim == 2 and a.audio.shape[0] == 2 and torch.isfinite(a.audio).all()
    c = _run(pipeline, paths, seed=4)
    assert not torch.equal(a.video_latent, c.video_latent)


def test_stage2_lora_is_restored_and_applied(tiny_pipeline):
    pipeline, paths = tiny_pipeline
    before = {k: v.clone() for k, v in pipeline.components.transformer.state_dict().items()}
    with_lora = _run(pipeline, paths)
    after = pipeline.components.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "LoRA fuse was not exactly undone"
    assert [r.matched for r in with_lora.lora_reports] == [r.total for r in with_lora.lora_reports]
    without = _run(pipeline, paths, distilled_lora=None)
    # stage 1 never sees the LoRA: the audio (decoded from the stage-1 latent) is identical …
    assert torch.equal(with_lora.audio_latent, without.audio_latent)
    # … while stage 2 does
    assert not torch.equal(with_lora.video_latent, without.video_latent)


def test_audio_is_frozen_through_stage2(tiny_pipeline, monkeypatch):
    pipeline, paths = tiny_pipeline
    seen = {}
    original = pipeline.run_stage

    def spy(spec, *args, **kwargs):
        result = original(spec, *args, **kwargs)
        seen[spec.name] = (spec.audio_clean.clone(), result.audio.clone())
        return result

    monkeypatch.setattr(pipeline, "run_stage", spy)
    result = _run(pipeline, paths)
    stage1_out = seen["stage 1"][1]
    stage2_in, stage2_out = seen["stage 2"]
    assert torch.equal(stage2_in, stage1_out) and torch.equal(stage2_out, stage1_out)
    assert torch.equal(result.audio_latent, L.unpack_audio(stage1_out))


def test_image_to_video_keeps_the_first_latent_frame(tiny_pipeline, tmp_path):
    pipeline, paths = tiny_pipeline
    image = tmp_path / "first.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (128, 128, 3), dtype=np.uint8)).save(image)
    result = _run(pipeline, paths, image=str(image), image_strength=1.0)
    clean, mask = pipeline._conditioning_latent(str(image), 1.0, 2, 128, 128)
    first = L.pack_video(result.video_latent)[:, mask[0] < 1]
    # strength 1: the conditioned tokens are pulled to the clean image latent at every step (exact up to float32
    # rounding of the masked Euler step: x0·0 + clean·1 then x + dt·(x − clean)/sigma)
    torch.testing.assert_close(first, clean[:, mask[0] < 1], rtol=0, atol=1e-5)
    free = _run(pipeline, paths)
    assert not torch.allclose(L.pack_video(free.video_latent)[:, mask[0] < 1], first, atol=1e-3)


def test_non_finite_latent_is_reported_with_stage(tiny_pipeline, monkeypatch):
    pipeline, paths = tiny_pipeline
    monkeypatch.setattr(pipeline, "upscale", lambda latent: torch.full_like(
        torch.zeros(1, 128, 2, 4, 4), float("nan")))
    with pytest.raises(FloatingPointError, match="upscale: the video latent has 4096 non-finite"):
        _run(pipeline, paths)


def test_demo_cli_writes_mp4_with_audio(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LTX2_MGPU_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo.mp4"
    assert cli.main(["demo", "--frames", "9", "--width", "128", "--height", "128", "--steps", "2",
                     "--output", str(out)]) == 0
    info = probe_mp4(out)
    assert info["video_frames"] == 9 and (info["width"], info["height"]) == (128, 128)
    assert info["audio_channels"] == 2 and info["audio_sample_rate"] == 24000
    printed = capsys.readouterr().out
    for stage in ("stage 1", "stage 2", "decode video", "decode audio"):
        assert stage in printed


def test_cli_refuses_bad_frames_before_loading(tmp_path, capsys):
    code = cli.main(["generate", "--checkpoint", str(tmp_path / "none.safetensors"), "--gemma", "x",
                     "--upscaler", "y", "--prompt", "p", "--frames", "120", "--width", "128", "--height", "128"])
    assert code == 2
    assert "frames=120" in capsys.readouterr().err


def test_decode_tiles_of_one_cell_refused_before_sampling(tiny_pipeline, monkeypatch):
    """64 px wide (2 latent cells at full size) in two decode tiles without overlap: 1-cell tiles, which the conv
    decoder's reflection padding cannot take — refused before any sampling, with the rule."""
    from mgpu_backend.splits.tiling import TileCountConfig
    from mgpu_backend.protocol.validation import ValidationError

    pipeline, paths = tiny_pipeline
    monkeypatch.setattr(pipeline, "run_stage", lambda *a, **k: pytest.fail("sampled before refusing"))
    with pytest.raises(ValidationError, match=r"decode tiles: decode: a width tile of the 2-tile split is 1 latent cell "
                                              r"\(32 px\) in width; .* at least 2 latent cells \(64 px\)"):
        _run(pipeline, paths, width=64, decode_tiles=TileCountConfig.spatial(1, 2, overlap=0))
