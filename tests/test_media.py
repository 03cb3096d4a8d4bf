"""Media I/O: mp4 round trip with PyAV, refusal of non-finite input, conditioning image loading (CPU, fast)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mgpu_backend.stages import media


def _tone(seconds: float, sr: int, channels: int = 2) -> torch.Tensor:
    t = torch.arange(int(round(seconds * sr)), dtype=torch.float32) / sr
    return torch.stack([0.5 * torch.sin(2 * math.pi * (440 + 220 * c) * t) for c in range(channels)])


def test_mp4_round_trip_with_audio(tmp_path):
    frames = torch.rand(17, 64, 96, 3)  # ComfyUI IMAGE layout, float 0..1
    fps, sr = 24, 24000
    audio = _tone(17 / fps, sr)
    out = media.write_mp4(tmp_path / "sub" / "a.mp4", frames, fps, audio, sr)
    info = media.probe_mp4(out)
    assert info["video_frames"] == 17
    assert info["fps"] == pytest.approx(24.0)
    assert (info["width"], info["height"]) == (96, 64)
    assert info["audio_channels"] == 2 and info["audio_sample_rate"] == sr
    # AAC pads to 1024-sample frames
    assert 17 / fps - 1e-3 <= info["audio_duration"] <= 17 / fps + 1024 / sr + 1e-3
    assert info["video_codec"] in ("h264", "mpeg4")


def test_mp4_uint8_mono_fractional_fps(tmp_path):
    frames = (torch.rand(9, 32, 32, 3) * 255).to(torch.uint8).numpy()
    sr = 16000
    out = media.write_mp4(tmp_path / "b.mp4", frames, 24000 / 1001, _tone(0.4, sr, channels=1), sr)
    info = media.probe_mp4(out)
    assert info["video_frames"] == 9
    assert info["fps"] == pytest.approx(24000 / 1001, rel=1e-4)
    assert info["audio_channels"] == 1
    assert info["audio_duration"] == pytest.approx(0.4, abs=1024 / sr + 1e-3)


def test_mp4_without_audio_and_pixels_survive(tmp_path):
    frames = np.zeros((5, 64, 64, 3), dtype=np.float32)
    frames[:, :, 32:] = 1.0  # left black, right white
    out = media.write_mp4(tmp_path / "c.mp4", frames, 25)
    info = media.probe_mp4(out)
    assert info["video_frames"] == 5 and info["audio_channels"] == 0 and info["audio_duration"] == 0.0
    import av

    with av.open(str(out)) as c:
        img = next(c.decode(video=0)).to_ndarray(format="rgb24")
    assert img[:, :16].mean() < 20 and img[:, 48:].mean() > 235


def test_non_finite_audio_refused_before_writing(tmp_path):
    audio = _tone(0.5, 24000)
    audio[1, 100] = float("nan")
    path = tmp_path / "nan.mp4"
    with pytest.raises(ValueError, match="audio.*non-finite"):
        media.write_mp4(path, torch.rand(9, 32, 32, 3), 24, audio, 24000)
    assert not path.exists()


def test_non_finite_frames_refused_before_writing(tmp_path):
    frames = torch.rand(9, 32, 32, 3)
    frames[3, 1, 1, 0] = float("inf")
    path = tmp_path / "inf.mp4"
    with pytest.raises(ValueError, match="video frames.*non-finite"):
        media.write_mp4(path, frames, 24)
    assert not path.exists()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(frames=torch.rand(9, 32, 32)), "N, H, W, 3"),
        (dict(frames=torch.rand(9, 33, 32, 3)), "even"),
        (dict(audio=torch.zeros(3, 100), sample_rate=24000), "mono or stereo"),
        (dict(audio=torch.zeros(2, 100)), "sample_rate"),
        (dict(fps=0), "fps"),
    ],
)
def test_write_mp4_argument_errors(tmp_path, kwargs, match):
    args = dict(frames=torch.rand(9, 32, 32, 3), fps=24, audio=None, sample_rate=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        media.write_mp4(tmp_path / "x.mp4", **args)
    assert not (tmp_path / "x.mp4").exists()


def test_load_image_resize_center_crop(tmp_path):
    from PIL import Image

    # 100 x 200 (H x W) image: left quarter red, rest blue. Target 64 x 64: scale 0.64 -> 64 x 128, crop 32 px each side,
    # so the red quarter (32 px after scaling) is cropped away entirely.
    arr = np.zeros((100, 200, 3), dtype=np.uint8)
    arr[:, :50, 0] = 255
    arr[:, 50:, 2] = 255
    Image.fromarray(arr).save(tmp_path / "img.png")
    t = media.load_image(tmp_path / "img.png", width=64, height=64, crf=0)
    assert t.shape == (1, 3, 64, 64) and t.dtype == torch.float32
    assert float(t.min()) >= -1.0 and float(t.max()) <= 1.0
    torch.testing.assert_close(t[0, 2, :, 2:], torch.ones(64, 62))  # blue
    assert float(t[0, 0, :, 2:].max()) == -1.0  # no red left after the crop

    # reference resize rule: ceil(src * max(H/h, W/w)), bilinear, floor-centered crop
    ref = torch.from_numpy(arr).float().permute(2, 0, 1)[None]
    ref = torch.nn.functional.interpolate(ref, size=(64, 128), mode="bilinear", align_corners=False)[:, :, :, 32:96]
    torch.testing.assert_close(t, ref / 127.5 - 1.0)


def test_load_image_with_crf_and_alpha(tmp_path):
    from PIL import Image

    rgba = np.full((48, 80, 4), 128, dtype=np.uint8)
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "a.png")
    t = media.load_image(tmp_path / "a.png", width=32, height=32)  # default CRF 33 re-compression
    assert t.shape == (1, 3, 32, 32)
    assert float((t - (128 / 127.5 - 1)).abs().max()) < 0.05  # flat grey survives H.264
    with pytest.raises(FileNotFoundError):
        media.load_image(tmp_path / "missing.png", 32, 32)
