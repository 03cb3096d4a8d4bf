"""Media I/O with PyAV: write an H.264 + AAC mp4, probe it, load a conditioning image.

Follows the Lightricks reference (GitHub Lightricks/LTX-2; re-implemented, no code copied):

* ``packages/ltx-pipelines/src/ltx_pipelines/utils/media_io/encode.py`` (``encode_video``: libx264, yuv420p,
  ``crf=19``, ``preset="veryfast"``, frames ``[F, H, W, 3]`` float 0..1) and
  ``packages/ltx-core/src/ltx_core/color/audio_mux.py`` (AAC stream, waveform clipped to [-1, 1] -> s16 ->
  resampled to the encoder's format).
* ``packages/ltx-pipelines/src/ltx_pipelines/utils/media_io/decode.py`` (``load_image_and_preprocess``: EXIF
  orientation, RGB, optional H.264 re-compression at the model's CRF -- ``DEFAULT_IMAGE_CRF = 33`` for LTX-2.0..2.3,
  18 for 2.4 (``utils/constants.py``) -- then ``resize_and_center_crop`` and ``x / 127.5 - 1``) and
  ``media_io/resize.py`` (``resize_and_center_crop``: scale ``max(H/h, W/w)``, ``ceil`` of the scaled size,
  bilinear ``align_corners=False``, center crop with floor offsets).

Differences from the reference, on purpose: non-finite frames or audio are refused with a ``ValueError`` *before*
anything is written (a NaN waveform otherwise fails only at mux time, after a full render); mono audio is accepted
(the reference requires stereo); if libx264 is not available the video falls back to MPEG-4 Part 2.
"""

from __future__ import annotations

import contextlib
import math
import os
from fractions import Fraction
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_CRF = 19
"""libx264 CRF of the reference's ``encode_video``."""
DEFAULT_PRESET = "veryfast"
DEFAULT_IMAGE_CRF = 33
"""CRF an image condition is re-compressed at for LTX-2.0 .. 2.3 (reference ``DEFAULT_IMAGE_CRF``; 2.4 uses 18)."""


def _av():
    try:
        import av  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - av is a hard dependency
        raise ImportError("PyAV (`pip install av`) is required for mp4 I/O") from e
    return av


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.cpu().numpy()
    return np.asarray(x)


def _frames_uint8(frames: Any) -> np.ndarray:
    """Validate and convert frames ``[N, H, W, 3]`` (uint8, or float 0..1) to contiguous uint8."""
    arr = _to_numpy(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"video frames must be [N, H, W, 3]; got shape {tuple(arr.shape)}")
    n, h, w, _ = arr.shape
    if n < 1:
        raise ValueError("video frames are empty (N = 0)")
    if h % 2 or w % 2:
        raise ValueError(f"video frame height and width must be even for yuv420p; got {h}x{w}")
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"video frames must be uint8 or float in [0, 1]; got dtype {arr.dtype}")
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise ValueError(f"video frames contain {bad} non-finite values (NaN/Inf); refusing to write")
    # Same rounding as a float->uint8 image conversion: clip then round to nearest.
    return np.ascontiguousarray(np.clip(np.rint(np.clip(arr, 0.0, 1.0) * 255.0), 0, 255).astype(np.uint8))


def _audio_channels_last(audio: Any) -> np.ndarray:
    """Validate audio ``[C, S]`` (or ``[S]``, or ComfyUI's ``[1, C, S]``) float -1..1 -> float32 ``[S, C]``."""
    arr = _to_numpy(audio)
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise ValueError(f"audio waveform [B, C, S] must have batch 1 to be muxed; got shape {tuple(arr.shape)}")
        arr = arr[0]
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"audio waveform must be [C, S]; got shape {tuple(arr.shape)}")
    c, s = arr.shape
    if c not in (1, 2):
        raise ValueError(f"audio waveform must be mono or stereo [C in (1, 2), S]; got {c} channels (shape {arr.shape})")
    if s < 1:
        raise ValueError("audio waveform is empty (0 samples); pass audio=None for no audio track")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"audio waveform must be float in [-1, 1]; got dtype {arr.dtype}")
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise ValueError(f"audio waveform contains {bad} non-finite samples (NaN/Inf); refusing to write")
    return np.ascontiguousarray(arr.T.astype(np.float32))


def _rate(fps: float) -> Fraction:
    """fps -> exact Fraction (23.976... -> 24000/1001); ValueError if not a positive finite number."""
    if isinstance(fps, Fraction):
        f = fps
    else:
        try:
            f = Fraction(float(fps)).limit_denominator(1001)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"fps must be a positive finite number; got {fps!r}") from None
    if not (f > 0):
        raise ValueError(f"fps must be a positive finite number; got {fps!r}")
    return f


def video_codec() -> str:
    """The video encoder :func:`write_mp4` uses: ``libx264`` when PyAV's FFmpeg has it, else ``mpeg4``."""
    return "libx264" if "libx264" in _av().codecs_available else "mpeg4"


def write_mp4(
    path: str | os.PathLike,
    frames: Any,
    fps: float,
    audio: Any | None = None,
    sample_rate: int | None = None,
    *,
    crf: int = DEFAULT_CRF,
    preset: str = DEFAULT_PRESET,
) -> Path:
    """Write ``frames`` (and optionally ``audio``) to an mp4: H.264 yuv420p (MPEG-4 fallback) + AAC.

    Args:
        path: output file; parent directories are created. A partial file is removed on failure.
        frames: ``[N, H, W, 3]`` RGB, uint8 or float in 0..1 (ComfyUI IMAGE layout; values outside are clipped),
            torch tensor or numpy array. H and W must be even.
        fps: frame rate (float such as 24, 25, 23.976 allowed).
        audio: waveform ``[C, S]`` float in -1..1 (C = 1 or 2; ``[S]`` and ComfyUI's ``[1, C, S]`` also
            accepted), clipped to [-1, 1]; ``None`` = no audio track.
        sample_rate: audio sample rate in Hz (required with ``audio``; e.g. 24000 for the LTX-2.0 vocoder).
        crf, preset: libx264 quality settings (reference defaults 19 / "veryfast"); ignored for the fallback.

    Returns:
        The written path.

    Raises:
        ValueError: before anything is written, naming the modality: bad frame shape/dtype, odd size, non-finite
            frames, bad audio shape, non-finite audio ("audio waveform contains ... non-finite"), missing or bad
            sample rate, bad fps.
    """
    rate = _rate(fps)
    video = _frames_uint8(frames)
    pcm = None
    if audio is not None:
        if sample_rate is None or int(sample_rate) != sample_rate or int(sample_rate) <= 0:
            raise ValueError(f"audio needs a positive integer sample_rate; got {sample_rate!r}")
        sample_rate = int(sample_rate)
        pcm = _audio_channels_last(audio)

    av = _av()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n, h, w, _ = video.shape
    codec = video_codec()
    container = av.open(str(path), mode="w")
    try:
        if codec == "libx264":
            stream = container.add_stream(codec, rate=rate, options={"crf": str(int(crf)), "preset": preset})
        else:
            stream = container.add_stream(codec, rate=rate)
            stream.bit_rate = max(1_000_000, int(w * h * float(rate) * 0.2))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.time_base = 1 / rate

        a_stream = None
        if pcm is not None:
            a_stream = container.add_stream("aac", rate=sample_rate)
            a_stream.codec_context.sample_rate = sample_rate
            a_stream.codec_context.layout = "stereo" if pcm.shape[1] == 2 else "mono"
            a_stream.codec_context.time_base = Fraction(1, sample_rate)

        for i in range(n):
            frame = av.VideoFrame.from_ndarray(video[i], format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)

        if a_stream is not None and pcm is not None:
            layout = "stereo" if pcm.shape[1] == 2 else "mono"
            s16 = (np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
            frame_in = av.AudioFrame.from_ndarray(s16.reshape(1, -1), format="s16", layout=layout)
            frame_in.sample_rate = sample_rate
            frame_in.pts = 0
            cc = a_stream.codec_context
            resampler = av.audio.resampler.AudioResampler(format=cc.format or "fltp", layout=layout, rate=sample_rate)
            pts = 0
            for rframe in list(resampler.resample(frame_in)) + list(resampler.resample(None)):
                rframe.pts = pts
                pts += rframe.samples
                for packet in a_stream.encode(rframe):
                    container.mux(packet)
            for packet in a_stream.encode():
                container.mux(packet)
    except BaseException:
        # clean-up never hides the error that stopped the write (a failing close or unlink is secondary)
        with contextlib.suppress(Exception):
            container.close()
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        raise
    try:
        container.close()  # flushes the trailer: a full disk shows here
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        raise
    return path


def probe_mp4(path: str | os.PathLike) -> dict[str, Any]:
    """Read back a media file's basic facts.

    Returns:
        dict with ``video_frames`` (int, counted by decoding), ``fps`` (float, average rate), ``width``,
        ``height``, ``video_codec``, ``audio_channels`` (0 when there is no audio stream),
        ``audio_sample_rate`` (0 without audio), ``audio_duration`` (seconds of decoded audio samples,
        0.0 without audio; AAC pads to 1024-sample frames, so it may exceed the input by up to ~1024 samples),
        ``audio_codec``.

    Raises:
        FileNotFoundError: the file does not exist; ValueError: it has no video stream.
    """
    av = _av()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(str(p))
    info: dict[str, Any] = {}
    with av.open(str(p)) as c:
        vs = next((s for s in c.streams if s.type == "video"), None)
        if vs is None:
            raise ValueError(f"{p} has no video stream")
        info["fps"] = float(vs.average_rate) if vs.average_rate else 0.0
        info["width"] = int(vs.codec_context.width)
        info["height"] = int(vs.codec_context.height)
        info["video_codec"] = vs.codec_context.name
        info["video_frames"] = sum(1 for _ in c.decode(vs))
    with av.open(str(p)) as c:
        aud = next((s for s in c.streams if s.type == "audio"), None)
        if aud is None:
            info.update(audio_channels=0, audio_sample_rate=0, audio_duration=0.0, audio_codec=None)
        else:
            info["audio_channels"] = int(aud.codec_context.channels)
            info["audio_sample_rate"] = int(aud.codec_context.sample_rate)
            info["audio_codec"] = aud.codec_context.name
            samples = sum(f.samples for f in c.decode(aud))
            info["audio_duration"] = samples / float(info["audio_sample_rate"]) if info["audio_sample_rate"] else 0.0
    return info


def _recompress(image: np.ndarray, crf: int) -> np.ndarray:
    """H.264-compress one RGB uint8 frame at ``crf`` and decode it back (reference ``preprocess``)."""
    av = _av()
    h, w = image.shape[0] // 2 * 2, image.shape[1] // 2 * 2
    image = np.ascontiguousarray(image[:h, :w])
    buf = BytesIO()
    c = av.open(buf, "w", format="mp4")
    try:
        s = c.add_stream("libx264", rate=1, options={"crf": str(int(crf)), "preset": "veryfast"})
        s.height, s.width = h, w
        frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")
        for pkt in s.encode(frame):
            c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    finally:
        c.close()
    with av.open(BytesIO(buf.getvalue())) as d:
        vs = next(st for st in d.streams if st.type == "video")
        out = next(d.decode(vs)).to_ndarray(format="rgb24")
    return out


def resize_and_center_crop(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[N, C, h, w]`` float -> ``[N, C, height, width]``: scale by ``max(height/h, width/w)`` (sizes ``ceil``-ed),
    bilinear (``align_corners=False``), then center crop (floor offsets). Reference ``resize_and_center_crop``."""
    _, _, src_h, src_w = image.shape
    scale = max(height / src_h, width / src_w)
    new_h, new_w = math.ceil(src_h * scale), math.ceil(src_w * scale)
    image = torch.nn.functional.interpolate(image, size=(new_h, new_w), mode="bilinear", align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return image[:, :, top : top + height, left : left + width]


def load_image(
    path: str | os.PathLike, width: int, height: int, crf: int | None = DEFAULT_IMAGE_CRF
) -> torch.Tensor:
    """Load a conditioning image as ``[1, 3, height, width]`` float32 in [-1, 1] (add a time axis with
    ``unsqueeze(2)`` for the video VAE's ``[B, 3, F, H, W]``).

    Steps (reference ``load_image_and_preprocess``): decode with PIL (EXIF orientation applied, ICC profile
    converted to sRGB when present, alpha dropped), re-compress through H.264 at ``crf`` (``None``/0 = skip; skipped
    when libx264 is unavailable), resize-and-center-crop, ``x / 127.5 - 1``.

    Raises:
        FileNotFoundError: missing file; ValueError: non-positive size.
    """
    from PIL import Image, ImageCms, ImageOps  # noqa: PLC0415

    if width < 1 or height < 1:
        raise ValueError(f"width and height must be positive; got {width}x{height}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(str(p))
    with Image.open(p) as src:
        img = ImageOps.exif_transpose(src)
        icc = img.info.get("icc_profile")
        if img.mode in ("RGBA", "LA", "P"):
            img = img.convert("RGBA").convert("RGB") if img.mode != "LA" else img.convert("L")
        if icc:
            try:
                img = ImageCms.profileToProfile(
                    img, ImageCms.ImageCmsProfile(BytesIO(icc)), ImageCms.createProfile("sRGB"), outputMode="RGB"
                )
            except Exception:  # noqa: BLE001 - a broken profile falls back to a plain conversion, like the reference
                img = img.convert("RGB")
        else:
            img = img.convert("RGB")
        arr = np.array(img, dtype=np.uint8)  # writable copy
    if crf and min(arr.shape[0], arr.shape[1]) >= 2 and "libx264" in _av().codecs_available:
        arr = _recompress(arr, crf)
    t = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.float32).permute(2, 0, 1).unsqueeze(0)
    t = resize_and_center_crop(t, height, width)
    return (t / 127.5 - 1.0).contiguous()


__all__ = [
    "DEFAULT_CRF",
    "DEFAULT_IMAGE_CRF",
    "DEFAULT_PRESET",
    "load_image",
    "probe_mp4",
    "resize_and_center_crop",
    "video_codec",
    "write_mp4",
]
