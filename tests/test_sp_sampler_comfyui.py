"""SP Sampler (MGPU)'s stage (the "sample" job with semantics "comfyui", issue 19 Build 6) equals the MGPU MODEL
path on the same native inputs, on real gloo ranks (W = 1, 2 and 3; 27 video tokens, not divisible by 2).

Cases: image-to-video at strength 0.7 with CFG + STG + modality guidance (euler), text-to-video with euler_ancestral,
and an LTXVAddGuide guide at strength 0.7 (dense guide-attention bias) with LTXVReferenceAudio tokens.

The MGPU MODEL path is rebuilt here the way ComfyUI drives the proxy model, written out from ComfyUI 0.33's source
(not from `mgpu_backend/stages/stage.py`): `comfy/samplers.py::KSAMPLER.sample` (start x = CONST.noise_scaling = σ0·noise +
(1 − σ0)·latent), `KSamplerX0Inpaint` (x·m + latent·(1 − m) in, out·m + latent·(1 − m) out: `LTXAV.scale_latent_inpaint`
is the latent), `CFGGuider` batching cond and uncond into ONE forward request of 2 rows, `LTXAV.process_timestep`
(per-token m·σ), `CONST.calculate_denoised` (x − v·σ), the post-CFG functions of `LTXVSpatioTemporalGuidance` and
`LTXVModalityGuidance` (one extra single-row request each), and `k_diffusion.sampling.sample_euler` /
`sample_euler_ancestral_RF` (`default_noise_sampler`: CPU generator seeded with seed + 1, one randn over the packed
latent). Every forward is the fleet's "forward" job (`serving/jobs/forward.py`), the context from its "preprocess_text" job.

Tolerance: 2e-5 absolute on latents of max |x| ~5 (measured ≤ 6.2e-6, every split): the two paths differ only in
float summation order (a 2-row batch vs single rows, the guidance sums in another order, sequence parallel). The
negative control: the same stage with semantics "reference" (the CLI's recipe: diffusers' block order, x0 blend) is
far outside it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from mgpu_backend.testing.tiny import make_tiny

torch.set_num_threads(1)

ATOL = 2e-5
GRID, T_AUDIO, FPS = (3, 3, 3), 11, 25.0
SIGMAS = [1.0, 0.8, 0.55, 0.25, 0.0]
CASES = {
    # image-to-video at strength 0.7 (noise_mask 0.3 on the first latent frame; LTXVConcatAVLatent's ones for audio),
    # CFG 3 + STG (block 1) + modality guidance 3, euler
    "i2v07_stg_modality": dict(strength=0.7, cfg=3.0, stg=1.0, modality=3.0, sampler="euler"),
    # text-to-video, CFG 3, euler_ancestral
    "t2v_euler_a": dict(strength=None, cfg=3.0, stg=0.0, modality=1.0, sampler="euler_ancestral"),
    # LTXVAddGuide: one guide latent frame appended at pixel frame 16, strength 0.7 (noise mask 0.3 on it and the
    # dense guide-attention bias), + LTXVReferenceAudio's 4 reference tokens; CFG 3, euler
    "guide07_ref_audio": dict(strength=None, guide=0.7, cfg=3.0, stg=0.0, modality=1.0, sampler="euler"),
}


def _inputs(case: dict) -> dict:
    g = torch.Generator().manual_seed(21)
    f, h, w = GRID
    video = torch.zeros(1, 128, f, h, w)
    video_mask = audio_mask = None
    guides = None
    if case["strength"] is not None:
        video[:, :, :1] = torch.randn(1, 128, 1, h, w, generator=g)
        video_mask = torch.ones(1, 1, f, 1, 1)
        video_mask[:, :, 0] = 1.0 - case["strength"]
        audio_mask = torch.ones(1, 1, T_AUDIO, 1)
    if case.get("guide") is not None:
        from mgpu_backend.protocol.native_forward import GuideAttentionEntry
        from mgpu_backend.stages.native import video_pixel_coords

        video = torch.cat([video, torch.randn(1, 128, 1, h, w, generator=g)], dim=2)  # the guide frame
        f += 1
        video_mask = torch.ones(1, 1, f, 1, 1)
        video_mask[:, :, -1] = 1.0 - case["guide"]
        audio_mask = torch.ones(1, 1, T_AUDIO, 1)
        keyframe_idxs = video_pixel_coords(1, 1, h, w).float()
        keyframe_idxs[:, 0] += 16  # pixel frame 16
        guides = {"keyframe_idxs": keyframe_idxs,
                  "guide_attention_entries": (GuideAttentionEntry(pre_filter_count=h * w, strength=case["guide"]),),
                  "ref_audio_tokens": torch.randn(1, 4, 128, generator=g)}
    return {"video": video, "audio": torch.zeros(1, 8, T_AUDIO, 16), "video_mask": video_mask,
            "audio_mask": audio_mask, "positive": torch.randn(1, 9, 64, generator=g),
            "negative": torch.randn(1, 6, 64, generator=g), "noise_video": torch.randn(1, 128, f, h, w, generator=g),
            "noise_audio": torch.randn(1, 8, T_AUDIO, 16, generator=g), "seed": 5, "guides": guides}


def _payload(case: dict, x: dict, semantics: str = "comfyui"):
    from mgpu_backend.protocol.stage_requests import ComfyGuides, SampleRequest
    from mgpu_backend.engine.sampling import GuidanceParams

    g = GuidanceParams(cfg_scale=case["cfg"], stg_scale=case["stg"], stg_blocks=(1,), modality_scale=case["modality"])
    return SampleRequest(semantics=semantics, positive=x["positive"], negative=x["negative"], video=x["video"],
                         audio=x["audio"], video_mask=x["video_mask"], audio_mask=x["audio_mask"],
                         noise_video=x["noise_video"], noise_audio=x["noise_audio"], sigmas=torch.tensor(SIGMAS),
                         fps=FPS, video_guidance=g, audio_guidance=g, stg_blocks=[1], mode="sequence_parallel",
                         sampler=case["sampler"], seed=x["seed"], loras=[],
                         guides=None if x["guides"] is None else ComfyGuides(**x["guides"]))


def _mgpu_model_path(state, ctx, case: dict, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's SamplerCustomAdvanced + CFGGuider (+ STG, modality guidance) on the MGPU MODEL, transcribed."""
    from mgpu_backend.protocol.native_forward import ForwardOptions, ForwardRequest, PreprocessTextRequest
    from mgpu_backend.serving.jobs.forward import engine, run_forward

    def bcast(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        out = t.contiguous() if ctx.rank == 0 else torch.empty_like(like)
        if ctx.world_size > 1:
            dist.broadcast(out, src=0)
        return out

    def text(e: torch.Tensor) -> torch.Tensor:  # LTXAV.extra_conds -> preprocess_text_embeds, per conditioning
        # (the "preprocess_text" job's work, which every rank runs)
        return engine(state).preprocess_text(PreprocessTextRequest(context=e, unprocessed=True)).context

    pos, neg = text(x["positive"]), text(x["negative"])
    vm = x["video_mask"].expand(1, 1, *x["video"].shape[2:]) if x["video_mask"] is not None else None
    guides = x["guides"] or {}
    am = x["audio_mask"].expand(1, 1, T_AUDIO, 1) if x["audio_mask"] is not None else None
    clean_v, clean_a = x["video"], x["audio"]
    s0 = SIGMAS[0]
    xv = s0 * x["noise_video"] + (1.0 - s0) * clean_v
    xa = s0 * x["noise_audio"] + (1.0 - s0) * clean_a
    generator = torch.Generator().manual_seed(x["seed"] + 1)
    nv, na = xv.numel(), xa.numel()

    def model(in_v, in_a, sigma, contexts, options) -> tuple[torch.Tensor, torch.Tensor]:
        b = len(contexts)
        if vm is not None:  # per token, [B, N, 1], patchifier order (frame, height, width)
            v_ts = (vm * sigma).reshape(1, -1, 1).expand(b, -1, -1)
            a_ts = (am * sigma).reshape(1, -1, 1).expand(b, -1, -1)
        else:
            v_ts = a_ts = torch.full((b,), sigma)
        request = ForwardRequest(video=in_v.expand(b, -1, -1, -1, -1), audio=in_a.expand(b, -1, -1, -1),
                                 video_timestep=v_ts.contiguous(), audio_timestep=a_ts.contiguous(),
                                 context=torch.cat(contexts), frame_rate=FPS, options=options,
                                 keyframe_idxs=guides.get("keyframe_idxs"),
                                 guide_attention_entries=guides.get("guide_attention_entries", ()),
                                 ref_audio_tokens=guides.get("ref_audio_tokens"))
        reply = run_forward(state, request, ctx)
        v = bcast(reply.video if ctx.rank == 0 else None, request.video)
        a = bcast(reply.audio if ctx.rank == 0 else None, request.audio)
        return in_v - v * sigma, in_a - a * sigma  # CONST.calculate_denoised (global sigma)

    for i in range(len(SIGMAS) - 1):
        sigma, sigma_next = SIGMAS[i], SIGMAS[i + 1]
        in_v = xv * x["video_mask"] + clean_v * (1 - x["video_mask"]) if vm is not None else xv
        in_a = xa * x["audio_mask"] + clean_a * (1 - x["audio_mask"]) if am is not None else xa
        den_v, den_a = model(in_v, in_a, sigma, [pos, neg], ForwardOptions())  # cond_or_uncond = (0, 1)
        cond_v, uncond_v, cond_a, uncond_a = den_v[:1], den_v[1:], den_a[:1], den_a[1:]
        out_v = uncond_v + (cond_v - uncond_v) * case["cfg"]
        out_a = uncond_a + (cond_a - uncond_a) * case["cfg"]
        if case["stg"] != 0:  # LTXVSpatioTemporalGuidance's post-CFG function
            pv, pa = model(in_v, in_a, sigma, [pos], ForwardOptions(stg_self_attn_blocks=(1,)))
            out_v, out_a = out_v + (cond_v - pv) * case["stg"], out_a + (cond_a - pa) * case["stg"]
        if case["modality"] != 1:  # LTXVModalityGuidance's
            mv, ma = model(in_v, in_a, sigma, [pos], ForwardOptions(a2v_cross_attn=False, v2a_cross_attn=False))
            out_v = out_v + (cond_v - mv) * (case["modality"] - 1.0)
            out_a = out_a + (cond_a - ma) * (case["modality"] - 1.0)
        if vm is not None:  # KSamplerX0Inpaint's output blend
            out_v = out_v * x["video_mask"] + clean_v * (1 - x["video_mask"])
            out_a = out_a * x["audio_mask"] + clean_a * (1 - x["audio_mask"])
        if case["sampler"] == "euler":  # sample_euler
            xv = xv + (xv - out_v) / sigma * (sigma_next - sigma)
            xa = xa + (xa - out_a) / sigma * (sigma_next - sigma)
        elif sigma_next == 0:  # sample_euler_ancestral_RF, eta 1
            xv, xa = out_v, out_a
        else:
            sigma_down = sigma_next * (1 + (sigma_next / sigma - 1))
            alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
            renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
            ratio = sigma_down / sigma
            noise = torch.randn((1, 1, nv + na), generator=generator)
            xv = (alpha_next / alpha_down) * (ratio * xv + (1 - ratio) * out_v) + \
                noise[..., :nv].reshape(xv.shape) * renoise
            xa = (alpha_next / alpha_down) * (ratio * xa + (1 - ratio) * out_a) + \
                noise[..., nv:].reshape(xa.shape) * renoise
    return xv, xa


def _rank(rank: int, world: int, paths: dict, batch_mode: str = "auto", guidance_parallel: str = "auto") -> dict:
    from mgpu_backend.stages.comfy_stage import ComfyDenoiser
    from mgpu_backend.serving.jobs.stages import run_sample

    ComfyDenoiser.batch_mode = batch_mode  # "on": cond and uncond as one 2-row request, as ComfyUI batches them
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.splits.plan import build_plan
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    components = load_components(paths["checkpoint"], dtype=torch.float32)
    plan = (build_plan(components.transformer, rank, world, torch.device("cpu"), guidance_parallel=guidance_parallel)
            if world > 1 else None)
    pipe = TwoStagePipeline(components, None, plan=plan)
    state = SimpleNamespace(pipeline=pipe, components=components, plan=plan, dtype=torch.float32,
                            device=torch.device("cpu"))
    ctx = SimpleNamespace(rank=rank, world_size=world, progress=lambda *a: None, step_boundary=lambda *a: False,
                          stage="setup")
    out = {}
    for name, case in CASES.items():
        x = _inputs(case)
        sp = run_sample(state, _payload(case, x), ctx)
        model_v, model_a = _mgpu_model_path(state, ctx, case, x)
        if rank == 0:
            out[name] = {"sp": (sp.video, sp.audio), "model": (model_v, model_a), "report": sp.report,
                         "batch": pipe.batch_notes.get("stage 1")}
    if world == 1 and batch_mode == "auto":
        x = _inputs(CASES["i2v07_stg_modality"])
        ref = run_sample(state, _payload(CASES["i2v07_stg_modality"], x, "reference"), ctx)
        out["reference"] = (ref.video, ref.audio)
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    return {k: str(v) for k, v in make_tiny(tmp_path_factory.mktemp("sp_comfy"), "2.0", seed=0).items()}


@pytest.mark.parametrize("world,batch_mode,guidance_parallel", [
    (1, "auto", "auto"), (2, "auto", "auto"), (3, "auto", "auto"), (2, "on", "auto"), (3, "auto", "on")])
def test_sp_sampler_equals_the_mgpu_model_path(paths, world, batch_mode, guidance_parallel):
    """Sequence parallel at W = 2 and 3 (SP on ranks 0-1); `batch_mode` "on": the plain passes of a step (cond,
    uncond) as one request of 2 rows (what "auto" does on CUDA for small latents); `guidance_parallel` "on": the
    guidance passes of each step spread over the ranks (the plan's other split)."""
    out = run_ranks(_rank, world, paths, batch_mode, guidance_parallel, timeout_s=600)[0]
    if guidance_parallel == "on":
        assert "guidance passes" in out["i2v07_stg_modality"]["report"], out["i2v07_stg_modality"]["report"]
    if batch_mode == "on":
        assert out["t2v_euler_a"]["batch"] == "guidance passes: 4 steps: 2 passes as one request"
        assert "STG / modality passes carry their own options" in out["i2v07_stg_modality"]["batch"]
    else:
        assert out["t2v_euler_a"]["batch"] is None  # CPU, "auto": one request per pass
    for name in CASES:
        for i, modality in enumerate(("video", "audio")):
            sp, model = out[name]["sp"][i], out[name]["model"][i]
            diff = float((sp - model).abs().max())
            print(f"W={world} {name} {modality}: max |SP Sampler - MGPU MODEL path| = {diff:.2e} "
                  f"(max |x| {float(model.abs().max()):.2f}); {out[name]['report']}")
            assert torch.isfinite(sp).all() and diff <= ATOL, f"W={world} {name} {modality}: {diff:.3e}"
    if "reference" in out:  # the reference recipe on the same inputs: not ComfyUI's result
        diff = max(float((r - m).abs().max()) for r, m in zip(out["reference"], out["i2v07_stg_modality"]["model"]))
        print(f"semantics 'reference' vs MGPU MODEL path: {diff:.2e}")
        assert diff > 100 * ATOL
