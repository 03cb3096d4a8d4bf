"""Stage-level jobs for the ComfyUI nodes: sample one stage, upscale the latent, decode.

Each job takes its kind's frozen request (`SampleRequest`, `UpscaleRequest`, `DecodeRequest`: built and
validated by `nodes/`, no ComfyUI types) and refuses any other payload by name. Latents are in model space (what
ComfyUI's LATENT holds for LTX-2): video `[1, 128, F, H, W]`, audio `[1, 8, T, 16]`. What a request cannot check
alone — against the loaded model and the fleet, and NaN / Inf values — is checked here, on every rank, before any
step.
"""
from __future__ import annotations

import torch

from ...engine import latents as L
from ...engine import sampling as S
from ...weights.lora import read_loras
from ...protocol.job_results import DecodeResult, SampleResult, UpscaleResult
from ...protocol.stage_requests import DecodeRequest, SampleRequest, UpscaleRequest
from ...engine.semantics import semantics_named
from ...stages.stage import SamplerSpec, StageLimits, StageSpec, TiledRunner, stage_contexts
from ...protocol.validation import ValidationError
from . import register


def _request(payload, cls, kind: str):
    if not isinstance(payload, cls):
        raise ValidationError(f"{kind} payload: expected a {cls.__name__}, got {type(payload).__name__}")
    return payload


def _sampler(r: SampleRequest) -> SamplerSpec:
    """`sampler` "euler" or "euler_ancestral" (`seed`, `eta`, `s_noise`, `noise_device`: where ComfyUI samples, "cpu"
    or "cuda"): per-step noise as ComfyUI draws it for an audio+video latent (one `randn` over the concatenated flat
    (video, audio) latent per step, seeded as `k_diffusion.sampling.default_noise_sampler` does: `SamplerSpec`)."""
    return SamplerSpec(r.sampler, int(r.seed), float(r.eta), float(r.s_noise), noise_layout="comfyui",
                       noise_device=r.noise_device)  # the nodes' noise is ComfyUI's, whatever the forward's semantics


def _stage_name(r: SampleRequest, sigmas: torch.Tensor) -> str:
    """What errors and progress call this stage: the request's `stage` ("stage 1", "stage 2", …), else "stage 2"
    for a tiled stage or one that starts below sigma 1 (a refinement of an earlier stage's latent), else
    "stage 1"."""
    if r.stage is not None:
        return r.stage
    return "stage 2" if r.mode == "tiled" or float(sigmas[0]) < 1.0 else "stage 1"


def _check_finite_inputs(stage: str, tensors: dict) -> None:
    """A NaN/Inf already in a latent, noise, mask or conditioning is bad input, refused before any step runs."""
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise ValidationError(f"{stage}: the input {name} has {bad} non-finite values (NaN/Inf) of "
                                  f"{x.numel()}; nothing was sampled (a bad input: e.g. a latent encoded from an "
                                  f"image with NaN pixels, or the output of a failed earlier stage)")


@register("sample")
def run_sample(state, request: SampleRequest, ctx) -> SampleResult | None:
    """One denoising stage: `request` is a `SampleRequest` (its fields and rules are documented there).

    LoRAs are fused into every rank's transformer for this job — each rank computes its share and the fused layers
    are broadcast — and restored after it, exactly, without reading the checkpoint.
    Returns on rank 0 a `SampleResult`: video `[1, 128, F, H, W]`, audio `[1, 8, T, 16]`, the split's report and
    the LoRA reports (matched / total layers per LoRA); a tiled stage adds `tile_drift` (one relative difference of
    overlapping tiles per forward, `TiledSplit.drift`), `weights_normalized` and `audio_frozen`. None
    elsewhere.
    Raises ValidationError on every rank before any work for another payload type, NaN / Inf inputs, STG blocks,
    tile counts, masks, sigmas of a tiled stage or token counts that do not fit the model and the fleet, and LoRAs
    that do not fit the model (none of their layers found, another model width).
    """
    from ...splits.tiled import DEFAULT_MAX_FIRST_SIGMA

    r = _request(request, SampleRequest, "sample")
    pipe = state.pipeline
    mode, semantics, sigmas = r.mode, semantics_named(r.semantics), r.sigmas
    video, audio = r.video.float(), r.audio.float()
    stage = _stage_name(r, sigmas)
    ctx.stage = stage
    _check_finite_inputs(stage, {"video latent": video, "audio latent": audio, "noise_video": r.noise_video,
                                 "noise_audio": r.noise_audio, "video_mask": r.video_mask,
                                 "positive conditioning": r.positive, "negative conditioning": r.negative})
    _, _, f, h, w = video.shape
    grid = (f, h, w)
    limits = StageLimits.of(pipe.components, pipe.plan)
    tiling = None
    if mode == "tiled":  # the node's tiled mode always tiles (2 tiles on one rank)
        tiling = limits.tiling(r.tiles, grid, int(r.tile_overlap), "tiles",
                               ranks=max(limits.ranks, 2) if r.tiles is None else None)
        limits.check_tdp_sigmas(sigmas, DEFAULT_MAX_FIRST_SIGMA if r.max_first_sigma is None else r.max_first_sigma)
    else:
        px = L.VAE_SPATIAL_COMPRESSION
        limits.check_tokens(f * h * w, h * w, f"{w * px}×{h * px}")
    # stg_blocks "auto": the model's default STG block (the CLI's); explicit blocks must exist
    video_guidance, audio_guidance = limits.guidance(r.video_guidance or S.NO_GUIDANCE,
                                                     r.audio_guidance or S.NO_GUIDANCE, r.stg_blocks)
    embeds = [r.positive] + ([r.negative] if r.negative is not None else [])
    contexts = stage_contexts(pipe.components, [e.float() for e in embeds], semantics, pipe.dtype)
    try:
        token_mask = None if r.video_mask is None else L.video_token_mask(r.video_mask.float(), 1, f, h, w)
    except ValueError as exc:
        raise ValidationError(f"noise_mask: {exc}") from None
    try:
        audio_token_mask = (None if r.audio_mask is None
                            else L.audio_token_mask(r.audio_mask.float(), 1, audio.shape[2]))
    except ValueError as exc:
        raise ValidationError(f"audio noise_mask: {exc}") from None
    # tiled: frozen stage-1 audio unless asked (the reference's final audio); else re-denoised, tiles averaged
    audio_frozen = mode == "tiled" if r.audio_frozen is None else r.audio_frozen
    spec = StageSpec(name=stage, semantics=semantics, positive=contexts[0],
                     negative=contexts[1] if r.negative is not None else None, grid=grid, fps=float(r.fps),
                     audio_frames=audio.shape[2], video_clean=L.pack_video(video), audio_clean=L.pack_audio(audio),
                     sigmas=sigmas, video_guidance=video_guidance, audio_guidance=audio_guidance,
                     video_mask=token_mask, audio_mask=audio_token_mask, guides=r.guides,
                     noise=(L.pack_video(r.noise_video.float()), L.pack_audio(r.noise_audio.float())),
                     audio_frozen=audio_frozen, sampler=_sampler(r), tiling=tiling)
    loras = read_loras(r.loras)
    pipe.lora.check(loras)  # coverage and widths, on every rank alike, before any weight is touched
    try:
        lora_reports = pipe.lora.apply(loras)
        result = pipe.run_stage(spec, ctx.progress, ctx.step_boundary)
    except BaseException:
        pipe.lora.after_error()  # one process: restored now; a fleet: at its next job's apply (every rank)
        raise
    pipe.lora.restore()
    if ctx.rank != 0:
        return None
    tiled = {}
    if isinstance(result.runner, TiledRunner):
        t = result.runner.tiled
        tiled = {"tile_drift": tuple(t.drift), "weights_normalized": bool(t.normalized), "audio_frozen": audio_frozen}
    report = result.report
    speed = getattr(state, "speed", None)  # splits.weights_cost.FleetFacts: rank 0 of a CUDA fleet (worker start)
    if speed is not None and not tiled:  # this stage's predicted step time on the fleet vs one streaming card
        report = "; ".join(filter(None, (report, speed.line(stage, f * h * w))))
    return SampleResult(L.unpack_video(result.video, f, h, w), L.unpack_audio(result.audio), report,
                        tuple(r.detail() for r in lora_reports), **tiled)


@register("upscale")
def run_upscale(state, request: UpscaleRequest, ctx) -> UpscaleResult | None:
    """2× spatial latent upscale of the `UpscaleRequest`'s `video` `[1, 128, F, H, W]` with the fleet's
    upscaler (same on every rank). Returns on rank 0 an `UpscaleResult` (`[1, 128, F, 2H, 2W]`), None elsewhere."""
    r = _request(request, UpscaleRequest, "upscale")
    video = r.video.float()
    _check_finite_inputs("upscale", {"video latent": video})
    out = state.pipeline.upscale(video)
    return UpscaleResult(out) if ctx.rank == 0 else None


@register("decode")
def run_decode(state, request: DecodeRequest, ctx) -> DecodeResult | None:
    """Decode a `DecodeRequest`: `video` (model space) in tiles over the fleet (`tiles`: TileCountConfig or
    None for the balanced default; one rank: untiled) and `audio` once on rank 0.

    Returns on rank 0 a `DecodeResult`: frames through shared memory, `audio` waveform `[C, S]` and `sample_rate`
    (None without an audio latent), `report`; None elsewhere. Either video decoder: the conv VAE, or LTX-2.5's
    diffusion decoder (same tiles; its noise is ComfyUI's fixed seed 0, `seed` only drives the conv decoder's
    decode noise).
    """
    from ...protocol.frames import send_frames

    r = _request(request, DecodeRequest, "decode")
    pipe = state.pipeline
    video = r.video.float()
    _check_finite_inputs("decode", {"video latent": video, "audio latent": r.audio})
    ranks = pipe.plan.world_size if pipe.plan is not None else 1
    tiling = pipe.resolve_tiling(r.tiles, ranks, tuple(video.shape[2:]), int(r.overlap), "decode tiles")
    frames, report = pipe.decode_video(video, int(r.seed), tiling, int(r.overlap))
    if ctx.rank != 0:
        return None
    waveform, sample_rate = None, None
    if r.audio is not None:
        waveform, sample_rate = pipe.decode_audio(r.audio.float())
    return DecodeResult(send_frames(frames), waveform, sample_rate, report)
