"""Stage-level jobs for the ComfyUI nodes: sample one stage, upscale the latent, decode.

Payloads are plain dicts of tensors (no ComfyUI types: `nodes/` converts). Latents are in model space (what
ComfyUI's LATENT holds for LTX-2): video `[1, 128, F, H, W]`, audio `[1, 8, T, 16]`.
"""
from __future__ import annotations

import torch

from .. import latents as L
from .. import sampling as S
from ..denoiser import text_contexts
from ..validation import ValidationError
from . import register

MODES = ("sequence_parallel", "tiled")


def _check_batch(name: str, x: torch.Tensor | None) -> None:
    if x is not None and x.shape[0] != 1:
        raise ValidationError(f"{name}: batch size {x.shape[0]} — the multi-GPU samplers take one clip per job; "
                              f"queue the batch items separately")


@register("sample")
def run_sample(state, p: dict, ctx) -> dict:
    """One denoising stage.

    Payload: `positive` / `negative` (CONDITIONING embeddings `[1, T, C]`; negative may be None), `video`
    `[1, 128, F, H, W]`, `audio` `[1, 8, T, 16]`, optional `video_mask` (ComfyUI `noise_mask`, broadcastable to
    `[1, 1, F, H, W]`; 1 = generate), `noise_video` / `noise_audio` (same shapes as the latents), `sigmas` (1-D,
    ending in 0), `fps`, `video_guidance` / `audio_guidance` (`sampling.GuidanceParams`), `mode`
    ("sequence_parallel" | "tiled"), `tiles` (TileCountConfig for tiled; None = balanced), `tile_overlap`,
    `audio_frozen` (tiled stages always freeze audio), `max_first_sigma` (tiled bound).
    Returns on rank 0: `{"video": [1, 128, F, H, W], "audio": [1, 8, T, 16], "report": str}`.
    Raises ValidationError before any work for bad shapes, modes and tile / sigma requests.
    """
    from ..parallel.tiled import DEFAULT_MAX_FIRST_SIGMA, TiledTransformer, check_tdp_sigmas

    pipe = state.pipeline
    mode = p.get("mode", "sequence_parallel")
    if mode not in MODES:
        raise ValidationError(f"mode={mode!r}: choose one of {', '.join(MODES)}")
    video, audio = p["video"].float(), p["audio"].float()
    _check_batch("video latent", video)
    _check_batch("audio latent", audio)
    if video.ndim != 5 or video.shape[1] != 128:
        raise ValidationError(f"video latent of shape {tuple(video.shape)}: expected [1, 128, F, H, W]")
    if audio.ndim != 4 or audio.shape[1] != 8:
        raise ValidationError(f"audio latent of shape {tuple(audio.shape)}: expected [1, 8, T, 16]")
    try:
        sigmas = S.as_sigmas(p["sigmas"])
    except ValueError as exc:
        raise ValidationError(f"sigmas: {exc}") from None
    _, _, f, h, w = video.shape
    grid = (f, h, w)
    tiled = None
    if mode == "tiled":
        ranks = pipe.plan.world_size if pipe.plan is not None else 1
        tiling = pipe._tiling(p.get("tiles"), max(ranks, 2) if p.get("tiles") is None else ranks, grid,
                              int(p.get("tile_overlap", 5)), "tiles")
        try:
            check_tdp_sigmas(sigmas, float(p.get("max_first_sigma", DEFAULT_MAX_FIRST_SIGMA)))
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        tiled = (pipe.plan.tiled(pipe.components.transformer, grid, tiling) if pipe.plan is not None
                 else TiledTransformer(pipe.components.transformer, grid, tiling))
    elif pipe.plan is not None:
        pipe.plan.check(f * h * w)
    video_guidance = p.get("video_guidance") or S.NO_GUIDANCE
    audio_guidance = p.get("audio_guidance") or S.NO_GUIDANCE
    negative = p.get("negative")
    embeds = [p["positive"]] + ([negative] if negative is not None else [])
    contexts = text_contexts(pipe.components, [e.float() for e in embeds], dtype=pipe.dtype)
    positive_ctx = contexts.select(0)
    negative_ctx = contexts.select(1) if negative is not None else None
    if (video_guidance.uses_uncond or audio_guidance.uses_uncond) and negative_ctx is None:
        raise ValidationError("CFG scale ≠ 1 needs a negative conditioning")
    video_mask = p.get("video_mask")
    token_mask = None if video_mask is None else L.video_token_mask(video_mask.float(), 1, f, h, w)
    audio_frozen = bool(p.get("audio_frozen", False)) or mode == "tiled"
    noise = (L.pack_video(p["noise_video"].float()), L.pack_audio(p["noise_audio"].float()))
    args = ("stage", positive_ctx, negative_ctx, grid, audio.shape[2], float(p["fps"]), L.pack_video(video),
            L.pack_audio(audio), sigmas, 0, token_mask, audio_frozen, video_guidance, audio_guidance, ctx.progress,
            ctx.step_boundary)
    if mode == "tiled":
        out_video, out_audio = pipe.local_stage(*args, forward=tiled, noise=noise)
        report = tiled.describe()
    else:
        out_video, out_audio = pipe.sequence_parallel_stage(*args, noise=noise)
        report = pipe.plan.describe() if pipe.plan is not None else "one rank"
    if ctx.rank != 0:
        return {}
    return {"video": L.unpack_video(out_video, f, h, w), "audio": L.unpack_audio(out_audio), "report": report}


@register("upscale")
def run_upscale(state, p: dict, ctx) -> dict:
    """2× spatial latent upscale of `p["video"]` `[1, 128, F, H, W]` with the fleet's upscaler (same on every rank)."""
    video = p["video"].float()
    _check_batch("video latent", video)
    out = state.pipeline.upscale(video)
    return {"video": out} if ctx.rank == 0 else {}


@register("decode")
def run_decode(state, p: dict, ctx) -> dict:
    """Decode `p["video"]` (model space) in tiles over the fleet (`p["tiles"]`: TileCountConfig or None for the
    balanced default; one rank: untiled) and `p["audio"]` once on rank 0.

    Returns on rank 0: frames through shared memory, `audio` waveform `[C, S]` and `sample_rate` (None without an
    audio latent), `report`.
    """
    from ..worker import send_frames

    pipe = state.pipeline
    video = p["video"].float()
    _check_batch("video latent", video)
    ranks = pipe.plan.world_size if pipe.plan is not None else 1
    tiling = pipe._tiling(p.get("tiles"), ranks, tuple(video.shape[2:]), int(p.get("overlap", 2)), "decode tiles")
    frames, report = pipe.decode_video(video, int(p.get("seed", 0)), tiling)
    if ctx.rank != 0:
        return {}
    waveform, sample_rate = None, None
    if p.get("audio") is not None:
        waveform, sample_rate = pipe.decode_audio(p["audio"].float())
    return {"frames": send_frames(frames), "audio": waveform, "sample_rate": sample_rate, "report": report}
