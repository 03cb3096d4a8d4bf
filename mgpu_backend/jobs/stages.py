"""Stage-level jobs for the ComfyUI nodes: sample one stage, upscale the latent, decode.

Payloads are plain dicts of tensors (no ComfyUI types: `nodes/` converts). Latents are in model space (what
ComfyUI's LATENT holds for LTX-2): video `[1, 128, F, H, W]`, audio `[1, 8, T, 16]`.
"""
from __future__ import annotations

import torch

from .. import latents as L
from .. import sampling as S
from ..lora import read_loras
from ..stage import SAMPLERS, SEMANTICS, ComfyGuides, SamplerSpec, StageSpec, TiledRunner, stage_contexts
from ..validation import ValidationError
from . import register

MODES = ("sequence_parallel", "tiled")


def _fit_guidance(p: dict, variant: str, n_blocks: int) -> tuple[S.GuidanceParams, S.GuidanceParams]:
    """The payload's guidance with `stg_blocks` resolved: "auto" = the reference's STG block for the model version
    (29 for LTX-2.0, 28 for 2.3), the last block on shallower models (as the CLI does); explicit blocks must exist."""
    import dataclasses

    video = p.get("video_guidance") or S.NO_GUIDANCE
    audio = p.get("audio_guidance") or S.NO_GUIDANCE
    blocks = p.get("stg_blocks")
    if blocks == "auto":
        default = S.default_guidance(variant)[0].stg_blocks
        blocks = tuple(min(b, n_blocks - 1) for b in default)
    elif blocks is not None:
        try:
            blocks = tuple(int(b) for b in blocks)
        except (TypeError, ValueError):
            raise ValidationError(f"stg_blocks={blocks!r}: 'auto' or a list of block indices") from None
    if blocks is not None:
        video = dataclasses.replace(video, stg_blocks=blocks)
        audio = dataclasses.replace(audio, stg_blocks=blocks)
    for name, g in (("video", video), ("audio", audio)):
        bad = [b for b in g.stg_blocks if not 0 <= b < n_blocks] if g.uses_perturbed else []
        if bad:
            raise ValidationError(f"{name} STG block(s) {bad} do not exist: this transformer has blocks "
                                  f"0..{n_blocks - 1} (use 'auto' for the model's default block)")
    return video, audio


def _sampler(p: dict) -> SamplerSpec:
    """`sampler` "euler" or "euler_ancestral" (`seed`, `eta`, `s_noise`, `noise_device`: where ComfyUI samples, "cpu"
    or "cuda"): per-step noise as ComfyUI draws it for an audio+video latent (one `randn` over the concatenated flat
    (video, audio) latent per step, seeded as `k_diffusion.sampling.default_noise_sampler` does: `SamplerSpec`)."""
    name = p.get("sampler", "euler")
    if name not in SAMPLERS:
        raise ValidationError(f"sampler={name!r}: choose one of {', '.join(SAMPLERS)}")
    return SamplerSpec(name, int(p.get("seed", 0)), float(p.get("eta", 1.0)), float(p.get("s_noise", 1.0)),
                       noise_layout="comfyui", noise_device=p.get("noise_device", "cpu"))  # the nodes' noise is ComfyUI's, whatever the forward's semantics


def _guides(g: dict | None) -> ComfyGuides | None:
    """The payload's `guides` (`keyframe_idxs`, `guide_attention_entries`, `denoise_mask`, `ref_audio_tokens`: what
    LTXVAddGuide / LTXVReferenceAudio put in the conditioning, `forward.ForwardRequest`'s fields) or None."""
    if not g:
        return None
    unknown = set(g) - {"keyframe_idxs", "guide_attention_entries", "denoise_mask", "ref_audio_tokens"}
    if unknown:
        raise ValidationError(f"guides: unknown keys {sorted(unknown)}")
    return ComfyGuides(keyframe_idxs=g.get("keyframe_idxs"),
                       guide_attention_entries=tuple(g.get("guide_attention_entries") or ()),
                       denoise_mask=g.get("denoise_mask"), ref_audio_tokens=g.get("ref_audio_tokens"))


def _stage_name(p: dict, mode: str, sigmas: torch.Tensor) -> str:
    """What errors and progress call this stage: the payload's `stage` ("stage 1", "stage 2", …), else "stage 2"
    for a tiled stage or one that starts below sigma 1 (a refinement of an earlier stage's latent), else
    "stage 1"."""
    stage = p.get("stage")
    if stage is not None:
        if not isinstance(stage, str) or not stage.strip():
            raise ValidationError(f"stage={stage!r}: a name such as 'stage 1' or 'stage 2'")
        return stage
    return "stage 2" if mode == "tiled" or float(sigmas[0]) < 1.0 else "stage 1"


def _check_finite_inputs(stage: str, tensors: dict) -> None:
    """A NaN/Inf already in a latent, noise, mask or conditioning is bad input, refused before any step runs."""
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise ValidationError(f"{stage}: the input {name} has {bad} non-finite values (NaN/Inf) of "
                                  f"{x.numel()}; nothing was sampled (a bad input: e.g. a latent encoded from an "
                                  f"image with NaN pixels, or the output of a failed earlier stage)")


def _check_batch(name: str, x: torch.Tensor | None) -> None:
    if x is not None and x.shape[0] != 1:
        raise ValidationError(f"{name}: batch size {x.shape[0]} — the multi-GPU samplers take one clip per job; "
                              f"queue the batch items separately")


@register("sample")
def run_sample(state, p: dict, ctx) -> dict:
    """One denoising stage.

    Payload: `semantics` ("comfyui": ComfyUI 0.33's forward and samplers, what the nodes send; "reference", the
    default: Lightricks' recipe — `stage.py`), `stage` (optional name for progress and errors: "stage 1", "stage 2"; default from the mode and the
    first sigma, `_stage_name`), `positive` / `negative` (CONDITIONING embeddings `[1, T, C]`; negative may be
    None), `video` `[1, 128, F, H, W]`,
    `audio` `[1, 8, T, 16]`, optional `video_mask` (ComfyUI `noise_mask`, broadcastable to
    `[1, 1, F, H, W]`; 1 = generate), `noise_video` / `noise_audio` (same shapes as the latents), `sigmas` (1-D,
    ending in 0), `fps`, `video_guidance` / `audio_guidance` (`sampling.GuidanceParams`), `mode`
    ("sequence_parallel" | "tiled"), `tiles` (TileCountConfig for tiled; None = balanced), `tile_overlap`,
    `audio_frozen` (default False, True for tiled: the clean stage-1 audio as context at timestep 0; a tiled stage
    with False re-noises and denoises the audio, every tile's audio output averaged), `max_first_sigma` (tiled
    bound, default `parallel.tiled.DEFAULT_MAX_FIRST_SIGMA`), `sampler` ("euler" |
    "euler_ancestral", with `seed`, `eta`, `s_noise`), `stg_blocks` ("auto" or block indices; replaces both
    guidances' blocks), `loras` (`[(path, strength), …]`: fused into every rank's transformer for this job — each
    rank computes its share and the fused layers are broadcast — and restored after it, exactly, without reading
    the checkpoint), `audio_mask` (the audio half of ComfyUI's noise_mask, broadcastable to `[1, 1, T, 1]`),
    `guides` (semantics "comfyui": `_guides`).
    Returns on rank 0: `{"video": [1, 128, F, H, W], "audio": [1, 8, T, 16], "report": str, "lora_reports":
    [str, …] (matched / total layers per LoRA)}`; a tiled stage adds `tile_drift` (one relative difference of
    overlapping tiles per forward, `TiledTransformer.drift`), `weights_normalized` and `audio_frozen`.
    Raises ValidationError before any work for bad shapes, modes, tile / sigma requests and LoRAs that do not fit the
    model (none of their layers found, another model width).
    """
    from ..parallel.tiled import DEFAULT_MAX_FIRST_SIGMA, check_tdp_sigmas

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
    stage = _stage_name(p, mode, sigmas)
    ctx.stage = stage
    _check_finite_inputs(stage, {"video latent": video, "audio latent": audio, "noise_video": p.get("noise_video"),
                                 "noise_audio": p.get("noise_audio"), "video_mask": p.get("video_mask"),
                                 "positive conditioning": p.get("positive"),
                                 "negative conditioning": p.get("negative")})
    _, _, f, h, w = video.shape
    grid = (f, h, w)
    semantics = p.get("semantics", "reference")
    if semantics not in SEMANTICS:
        raise ValidationError(f"semantics={semantics!r}: choose one of {', '.join(SEMANTICS)}")
    tiling = None
    if mode == "tiled":
        ranks = pipe.plan.world_size if pipe.plan is not None else 1
        tiling = pipe.resolve_tiling(p.get("tiles"), max(ranks, 2) if p.get("tiles") is None else ranks, grid,
                                     int(p.get("tile_overlap", 5)), "tiles")
        try:
            check_tdp_sigmas(sigmas, float(p.get("max_first_sigma", DEFAULT_MAX_FIRST_SIGMA)))
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
    elif pipe.plan is not None:
        pipe.plan.check(f * h * w)
    video_guidance, audio_guidance = _fit_guidance(p, pipe.components.variant,
                                                   len(pipe.components.transformer.transformer_blocks))
    negative = p.get("negative")
    embeds = [p["positive"]] + ([negative] if negative is not None else [])
    contexts = stage_contexts(pipe.components, [e.float() for e in embeds], semantics, pipe.dtype)
    video_mask = p.get("video_mask")
    try:
        token_mask = None if video_mask is None else L.video_token_mask(video_mask.float(), 1, f, h, w)
    except ValueError as exc:
        raise ValidationError(f"noise_mask: {exc}") from None
    audio_mask = p.get("audio_mask")
    try:
        audio_token_mask = None if audio_mask is None else L.audio_token_mask(audio_mask.float(), 1, audio.shape[2])
    except ValueError as exc:
        raise ValidationError(f"audio noise_mask: {exc}") from None
    # tiled: frozen stage-1 audio unless asked (the reference's final audio); else re-denoised, tiles averaged
    audio_frozen = bool(p.get("audio_frozen", mode == "tiled"))
    for name, n, x in (("noise_video", p["noise_video"], video), ("noise_audio", p["noise_audio"], audio)):
        if tuple(n.shape) != tuple(x.shape):
            raise ValidationError(f"{name} of shape {tuple(n.shape)} does not match the latent {tuple(x.shape)}")
    spec = StageSpec(name=stage, semantics=semantics, positive=contexts[0],
                     negative=contexts[1] if negative is not None else None, grid=grid, fps=float(p["fps"]),
                     audio_frames=audio.shape[2], video_clean=L.pack_video(video), audio_clean=L.pack_audio(audio),
                     sigmas=sigmas, video_guidance=video_guidance, audio_guidance=audio_guidance,
                     video_mask=token_mask, audio_mask=audio_token_mask, guides=_guides(p.get("guides")),
                     noise=(L.pack_video(p["noise_video"].float()), L.pack_audio(p["noise_audio"].float())),
                     audio_frozen=audio_frozen, sampler=_sampler(p), tiling=tiling)
    loras = read_loras(p.get("loras"))
    pipe.lora.check(loras)  # coverage and widths, on every rank alike, before any weight is touched
    try:
        lora_reports = pipe.lora.apply(loras)
        result = pipe.run_stage(spec, ctx.progress, ctx.step_boundary)
    except BaseException:
        pipe.lora.after_error()  # one process: restored now; a fleet: at its next job's apply (every rank)
        raise
    pipe.lora.restore()
    if ctx.rank != 0:
        return {}
    out = {"video": L.unpack_video(result.video, f, h, w), "audio": L.unpack_audio(result.audio),
           "report": result.report, "lora_reports": [r.detail() for r in lora_reports]}
    if isinstance(result.runner, TiledRunner):
        tiled = result.runner.tiled
        out.update(tile_drift=list(tiled.drift), weights_normalized=bool(tiled.normalized),
                   audio_frozen=audio_frozen)
    return out


@register("upscale")
def run_upscale(state, p: dict, ctx) -> dict:
    """2× spatial latent upscale of `p["video"]` `[1, 128, F, H, W]` with the fleet's upscaler (same on every rank)."""
    video = p["video"].float()
    _check_batch("video latent", video)
    _check_finite_inputs("upscale", {"video latent": video})
    out = state.pipeline.upscale(video)
    return {"video": out} if ctx.rank == 0 else {}


@register("decode")
def run_decode(state, p: dict, ctx) -> dict:
    """Decode `p["video"]` (model space) in tiles over the fleet (`p["tiles"]`: TileCountConfig or None for the
    balanced default; one rank: untiled) and `p["audio"]` once on rank 0.

    Returns on rank 0: frames through shared memory, `audio` waveform `[C, S]` and `sample_rate` (None without an
    audio latent), `report`. Either video decoder: the conv VAE, or LTX-2.5's diffusion decoder (same tiles; its
    noise is ComfyUI's fixed seed 0, `p["seed"]` only drives the conv decoder's decode noise).
    """
    from ..frames import send_frames

    pipe = state.pipeline
    video = p["video"].float()
    _check_batch("video latent", video)
    _check_finite_inputs("decode", {"video latent": video, "audio latent": p.get("audio")})
    ranks = pipe.plan.world_size if pipe.plan is not None else 1
    tiling = pipe.resolve_tiling(p.get("tiles"), ranks, tuple(video.shape[2:]), int(p.get("overlap", 2)),
                                 "decode tiles")
    frames, report = pipe.decode_video(video, int(p.get("seed", 0)), tiling)
    if ctx.rank != 0:
        return {}
    waveform, sample_rate = None, None
    if p.get("audio") is not None:
        waveform, sample_rate = pipe.decode_audio(p["audio"].float())
    return {"frames": send_frames(frames), "audio": waveform, "sample_rate": sample_rate, "report": report}
