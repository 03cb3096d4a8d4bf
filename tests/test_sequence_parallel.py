"""Faithful sequence parallelism (docs/design/sequence-parallel.md) on real process groups: gloo on CPU, tiny LTX-2 /
LTX-2.3, fp32.

Every SP result is compared with the one-process (W = 1) computation of the same inputs: one transformer forward, a
full guided stage 1 (CFG + STG + modality guidance, image-to-video per-token timesteps, a batch of 2), and the full
pipeline (two-stage on 3 ranks where SP uses 2; the distilled preset on 2). The W = 2 / 3 / 4 runs are real
processes (`tests/_dist.py`), the W = 1 references run in this process; everything uses one thread per process.

Tolerance: relative error `‖sp − ref‖ / ‖ref‖` (Frobenius, whole tensor, float64 arithmetic) below TOL = 1e-5.
SP changes no formula, only how reductions are blocked: the Linear layers see T/W instead of T rows, attention
runs per head slice and over Tp ≥ T keys (the padded ones add exact zeros after the −inf bias), the video→audio
keys are gathered. In fp32 (unit roundoff u ≈ 6e-8) each of those moves a result by a few u. Measured on this
machine: one forward ≤ 4e-7 (exactly 0 for W = 2 without padding), stage 1 (3 steps × 4 guidance passes)
≤ 1.6e-6, pipeline latents ≤ 9e-7. 1e-5 (≈ 170 u) leaves a margin for other CPUs / BLAS builds, while a real defect is orders of
magnitude above it: the negative controls (one key mask removed) measure 7e-3 to 7e-2.
Decoded frames / waveforms get DECODED_TOL = 1e-4: the LTX-2.3 vocoder (+ bandwidth extension) amplifies a 1e-7
latent difference about 50× (measured 4.5e-5), and `_check_pipeline` shows that this is all decoder: this process
decodes rank 0's latents to exactly rank 0's media.
"""
from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch
from PIL import Image

from _dist import run_ranks
from mgpu_backend.serving import client
from mgpu_backend.engine import latents as L
from mgpu_backend.engine import sampling as S
from mgpu_backend.engine.denoiser import LTX2Denoiser, TextContext, text_contexts
from mgpu_backend.models.gemma import load_gemma
from mgpu_backend.models.loader import ComponentFiles, load_components
from mgpu_backend.testing.tiny import make_tiny
from mgpu_backend.splits.exchange import Exchange
from mgpu_backend.splits.plan import ParallelPlan, PlanPolicy, build_plan
from mgpu_backend.protocol.fleet_rules import check_sp_degree, largest_sp_degree, valid_sp_degrees
from mgpu_backend.splits.apply import apply_plan
from mgpu_backend.splits.forward_plan import SEQUENCE, pad_and_slice
from mgpu_backend.splits.sequence import GatheredKeysCrossAttention, UlyssesSelfAttention, check_token_cap
from mgpu_backend.engine.attention import VideoKeys
from mgpu_backend.splits.tiling import default_tiling
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline
from mgpu_backend.protocol.validation import ValidationError

from _forward import SequenceDriver

torch.set_num_threads(1)

TOL = 1e-5  # relative error bound of everything SP computes, see the module docstring
DECODED_TOL = 1e-4  # decoded frames / waveform: the decoders amplify the latent difference (see _check_pipeline)
VARIANTS = ("2.0", "2.3")
FPS = 24.0
AUDIO_TOKENS = 5
CPU = torch.device("cpu")

# latent grids (frames, height, width) of one forward; the tiny models have 8 video heads -> W in {1, 2, 4, 8}
FORWARD_CASES = {
    "even": dict(grid=(2, 2, 2), batch=1, i2v=False),   # 8 tokens: divisible by 2 and 4, no padding
    "odd": dict(grid=(1, 3, 3), batch=1, i2v=False),    # 9 tokens: 9 % 2 = 9 % 4 = 1 -> padded keys
    "i2v": dict(grid=(3, 1, 3), batch=1, i2v=True),     # 9 tokens, timestep 0 on the first latent frame
    "batch2": dict(grid=(1, 3, 3), batch=2, i2v=True),  # two items, different prompts / sigmas, item 1 i2v
}
STAGE1_CASES = {
    "i2v": dict(grid=(3, 1, 3), batch=1),      # 9 tokens (padded), first latent frame conditioned (mask 0)
    "batch2": dict(grid=(1, 3, 3), batch=2),   # 9 tokens, item 0 text-to-video, item 1 image-to-video
}
STAGE1_STEPS = 3
VIDEO_GUIDANCE = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(1,), rescale=0.7, modality_scale=3.0)
AUDIO_GUIDANCE = S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(0,), rescale=0.7, modality_scale=3.0)
NEGATIVE_CONTROL_CASE = "odd"

# full pipeline: 192×192, 17 frames -> stage-1 latent 3×3×3 = 27 tokens (odd: padded at W = 2), stage 2 3×6×6
PIPELINE_SIZE = dict(width=192, height=192, frames=17, fps=FPS)
PIPELINE_GRID2 = (3, 6, 6)  # stage-2 latent grid


# ---- shared computations (the same code runs in the reference process and in every rank) -------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = _rel(a, b)
    print(f"{what}: relative error {err:.3e}")
    assert err < tol, f"{what}: relative error {err:.3e} is not below {tol:g}"


def _load(files: dict, variant: str):
    return load_components(files[variant]["checkpoint"], ComponentFiles(upsampler=files[variant]["upsampler"]),
                           dtype=torch.float32)


def _contexts(components) -> TextContext:
    """Two random prompts (7 and 4 CONDITIONING tokens) through the checkpoint's real text connectors: batch 2."""
    width = components.video_connector.inner_dim
    if components.variant == "2.3":
        width += components.audio_connector.inner_dim
    g = torch.Generator().manual_seed(11)
    embeds = [torch.randn(1, 7, width, generator=g), torch.randn(1, 4, width, generator=g)]
    return text_contexts(components, embeds, dtype=torch.float32)


def _flip(ctx: TextContext) -> TextContext:
    return TextContext(ctx.video.flip(0), ctx.audio.flip(0), ctx.mask.flip(0))


def _forward_kwargs(components, case: str, contexts: TextContext) -> dict:
    """The keyword arguments `LTX2Denoiser` passes the transformer, for one `FORWARD_CASES` entry."""
    spec = FORWARD_CASES[case]
    (f, h, w), b = spec["grid"], spec["batch"]
    t = f * h * w
    g = torch.Generator().manual_seed(100 + list(FORWARD_CASES).index(case))
    video = torch.randn(b, t, 128, generator=g)
    audio = torch.randn(b, AUDIO_TOKENS, 128, generator=g)
    sigma = torch.tensor([0.8, 0.45])[:b]
    mask = torch.ones(b, t)
    if spec["i2v"]:
        mask[-1, : h * w] = 0.0  # the last item's first latent frame is the (clean) conditioning image
    ctx = contexts if b == 2 else contexts.select(0)
    tf = components.transformer
    return dict(
        hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=ctx.video,
        audio_encoder_hidden_states=ctx.audio, timestep=mask * sigma[:, None] * S.TIMESTEP_SCALE,
        audio_timestep=torch.ones(b, AUDIO_TOKENS) * sigma[:, None] * S.TIMESTEP_SCALE,
        sigma=sigma * S.TIMESTEP_SCALE, audio_sigma=sigma * S.TIMESTEP_SCALE,
        encoder_attention_mask=ctx.mask, audio_encoder_attention_mask=ctx.mask,
        video_coords=L.video_coords(tf, b, f, h, w, FPS), audio_coords=L.audio_coords(tf, b, AUDIO_TOKENS),
        use_cross_timestep=True, return_dict=False)


def _forward(fn, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        video, audio = fn(**kwargs)
    return video.clone(), audio.clone()


def _stage1(components, case: str, contexts: TextContext, forward=None) -> dict:
    """A full guided stage 1 (`sampling.denoise_loop` + `LTX2Denoiser`) of one `STAGE1_CASES` entry."""
    spec = STAGE1_CASES[case]
    (f, h, w), b = spec["grid"], spec["batch"]
    t = f * h * w
    g = torch.Generator().manual_seed(200 + list(STAGE1_CASES).index(case))
    video_clean = torch.zeros(b, t, 128)
    video_clean[:, : h * w] = torch.randn(b, h * w, 128, generator=g)  # the encoded first frame
    video_mask = torch.ones(b, t)
    video_mask[-1, : h * w] = 0.0  # image strength 1 on the last item
    audio_clean = torch.zeros(b, AUDIO_TOKENS, 128)
    noise_v, noise_a = S.make_av_noise(video_clean.shape, audio_clean.shape, seed=7)
    start_v = S.noise_latent(video_clean, noise_v, 1.0, video_mask)
    start_a = S.noise_latent(audio_clean, noise_a, 1.0)
    positive = contexts if b == 2 else contexts.select(0)
    negative = _flip(contexts) if b == 2 else contexts.select(1)
    tf = components.transformer
    # a driver on a device (test_cuda_parity's `_OnDevice`) names the device and compute dtype of the forwards
    device, dtype = getattr(forward, "device", None), getattr(forward, "dtype", torch.float32)
    positive, negative = (TextContext(c.video.to(device, dtype), c.audio.to(device, dtype), c.mask.to(device, dtype))
                          for c in (positive, negative))
    model = LTX2Denoiser(tf, positive, negative, L.video_coords(tf, b, f, h, w, FPS).to(device),
                         L.audio_coords(tf, b, AUDIO_TOKENS).to(device), dtype, split=getattr(forward, "split", None))
    model.batch_mode = "off"  # one forward per pass, also on CUDA (batched passes: tests/test_batched_passes.py)
    video, audio = S.denoise_loop(model, S.ltx2_sigmas(STAGE1_STEPS),
                                  S.ModalityStream(start_v, video_mask, video_clean, VIDEO_GUIDANCE),
                                  S.ModalityStream(start_a, guidance=AUDIO_GUIDANCE))
    return dict(video=video, audio=audio, forwards=model.forwards,
                first_frame_kept=bool(torch.equal(video[-1, : h * w], video_clean[-1, : h * w])))


def _pipeline_result(result) -> dict:
    return dict(video_latent=result.video_latent, audio_latent=result.audio_latent, frames=result.frames,
                audio=result.audio, report=result.parallel_report)


def _two_stage_request(files: dict, variant: str, image: str) -> GenerateRequest:
    """Image-to-video, guided stage 1 (the reference defaults: CFG + STG + modality), distilled LoRA in stage 2.
    The stage-2 / decode tilings are the ones a 3-rank fleet picks, stated explicitly so that the one-process
    reference tiles the same way (tiling is not what this file tests; SP is)."""
    return GenerateRequest(prompt="a fox in the snow", steps=3, seed=3, image=image,
                           distilled_lora=(str(files[variant]["distilled_lora"]), 1.0),
                           tiles=default_tiling(3, PIPELINE_GRID2, 5),
                           decode_tiles=default_tiling(3, PIPELINE_GRID2, 2),
                           **PIPELINE_SIZE)


def _distilled_request(image: str) -> GenerateRequest:
    """The distilled preset, image-to-video: SP on both stages (stage 1: 27 tokens, padded at W = 2; stage 2: 108,
    both with timestep 0 on the first latent frame); the decode tiling of a 2-rank fleet, stated explicitly."""
    return GenerateRequest(prompt="a fox in the snow", seed=5, pipeline="distilled", image=image,
                           decode_tiles=default_tiling(2, PIPELINE_GRID2, 2), **PIPELINE_SIZE)


def _sp_processors(sp: SequenceDriver) -> list:
    """The distinct video self-attention / video→audio processors installed by the plan (shared by the blocks)."""
    sp.activate()
    procs = []
    for block in sp.transformer_blocks:
        for proc in (block.attn1.processor, block.video_to_audio_attn.processor):
            if not any(proc is p for p in procs):
                procs.append(proc)
    assert {type(p) for p in procs} == {UlyssesSelfAttention, GatheredKeysCrossAttention}, procs
    return procs


def _spy_masks(sp: SequenceDriver) -> list:
    """Record (processor kind, key count, additive key mask) of every video self- / video→audio attention call."""
    seen = []
    for proc in _sp_processors(sp):
        def attend(q, k, v, mask, _kind=type(proc).__name__, _inner=proc.attend):
            seen.append((_kind, k.shape[1], None if mask is None else mask.clone()))
            return _inner(q, k, v, mask)
        proc.attend = attend
    return seen


def _unspy(sp: SequenceDriver) -> None:
    for proc in _sp_processors(sp):
        proc.__dict__.pop("attend", None)


def _without_mask(sp: SequenceDriver, processor_type: type, kwargs: dict):
    """Forward with the key mask removed from the processors of `processor_type` only (negative control): they are
    replaced by a subclass that drops the mask of the `VideoKeys` it is given."""
    class NoMask(processor_type):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kw):
            if isinstance(attention_mask, VideoKeys):
                attention_mask = VideoKeys(None, attention_mask.self_attention)
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kw)

    sp.activate()
    try:
        for block in sp.transformer_blocks:
            for name in ("attn1", "video_to_audio_attn"):
                attn = getattr(block, name)
                if isinstance(attn.processor, processor_type):
                    attn.processor = NoMask(sp.split.exchange)
        return _forward(sp, kwargs)
    finally:
        sp.activate()


# ---- rank functions ------------------------------------------------------------------------------------------------

def _round_trip_rank(rank: int, world: int, transformer) -> dict:
    """Exchange round trips on real tensors; the head slices are checked in the parent by plain indexing."""
    ex = Exchange(None, world, rank)
    g = torch.Generator().manual_seed(31)
    x = torch.randn(2, 3 * world, 8, 5, generator=g)  # [B, T, H, D], T divisible by W
    per = x.shape[1] // world
    local = x[:, rank * per:(rank + 1) * per]
    heads = ex.seq_to_heads(local)
    back = ex.heads_to_seq(heads)
    gathered = ex.all_gather_seq(local)
    try:
        ex.seq_to_heads(torch.zeros(1, 1, 3, 4))
        odd_heads_error = None
    except ValueError as exc:
        odd_heads_error = str(exc)

    # the plan's pad-and-slice + all_gather_seq: the identity on real tensors, with padding (T = 9)
    t = 9
    padded = -(-t // world) * world
    tensors = dict(
        latent=(torch.randn(2, t, 128, generator=g), 1),
        timesteps=(torch.rand(2, t, generator=g), 1),
        positions=(L.video_coords(transformer, 2, 1, 3, 3, FPS), 2),  # [B, 3, T, 2]
        mask=(torch.bernoulli(torch.full((2, t), 0.5), generator=g), 1),
    )
    sharded = {name: pad_and_slice(v, dim, padded, rank, world) for name, (v, dim) in tensors.items()}
    regathered = {name: ex.all_gather_seq(sharded[name], dim) for name, (v, dim) in tensors.items()}
    return dict(local=local, heads=heads, back=back, gathered=gathered, odd_heads_error=odd_heads_error,
                inputs={k: v for k, (v, _) in tensors.items()}, sharded=sharded, regathered=regathered)


def _sp_rank(rank: int, world: int, files: dict) -> dict:
    """W = 2 / 4: forwards, stage 1, masks seen, negative controls; the distilled preset at W = 2."""
    out = {}
    for variant in VARIANTS:
        components = _load(files, variant)
        if "round_trip" not in out:
            out["round_trip"] = _round_trip_rank(rank, world, components.transformer)
        sp = SequenceDriver(components.transformer, Exchange(None, world, rank))
        contexts = _contexts(components)
        res: dict = {"forward": {}, "stage1": {}}
        for case in FORWARD_CASES:
            res["forward"][case] = _forward(sp, _forward_kwargs(components, case, contexts))
        for case in STAGE1_CASES:
            res["stage1"][case] = _stage1(components, case, contexts, forward=sp)
        kwargs = _forward_kwargs(components, NEGATIVE_CONTROL_CASE, contexts)
        seen = _spy_masks(sp)
        try:
            _forward(sp, kwargs)
        finally:
            _unspy(sp)
        res["masks_seen"] = seen
        res["no_v2a_mask"] = _without_mask(sp, GatheredKeysCrossAttention, kwargs)
        res["no_self_mask"] = _without_mask(sp, UlyssesSelfAttention, kwargs)
        if world == 2:
            plan = build_plan(components.transformer, rank, world, CPU)
            pipeline = TwoStagePipeline(components, load_gemma(files[variant]["gemma"]), plan=plan)
            res["distilled"] = _pipeline_result(pipeline.generate(_distilled_request(files["image"])))
            res["distilled_sp_degree"] = plan.sp_degree
        out[variant] = res
    return out


def _three_rank(rank: int, world: int, files: dict, image: str) -> dict:
    """3 ranks, SP on 2: the plan, share(), and the whole two-stage image-to-video pipeline."""
    out = {}
    for variant in VARIANTS:
        components = _load(files, variant)
        plan = build_plan(components.transformer, rank, world, CPU)
        pipeline = TwoStagePipeline(components, load_gemma(files[variant]["gemma"]), plan=plan)
        res = _pipeline_result(pipeline.generate(_two_stage_request(files, variant, image)))
        mine = torch.full((1, 4, 3), float(rank + 1))
        shared = plan.share(mine.clone() if plan.in_sp_group else None,
                            (mine * 10).clone() if plan.in_sp_group else None, (1, 4, 3), (1, 4, 3))
        res.update(sp_degree=plan.sp_degree, in_sp_group=plan.in_sp_group, has_sp_forward=plan.sp_forward is not None,
                   describe=plan.describe(), shared=shared)
        out[variant] = res
    return out


# ---- fixtures -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sp_tiny")
    out = {variant: make_tiny(root / variant, variant, seed=0) for variant in VARIANTS}
    pixels = np.random.default_rng(0).integers(0, 256, (192, 192, 3), dtype=np.uint8)
    image = root / "first_frame.png"
    Image.fromarray(pixels).save(image)
    out["image"] = str(image)
    return out


@pytest.fixture(scope="module")
def reference(files) -> dict:
    """W = 1 in this process: the plain diffusers transformer, a W = 1 SP wrapper around a second copy, stage 1,
    and the two pipelines."""
    out = {}
    for variant in VARIANTS:
        untouched = _load(files, variant)  # diffusers' own attention processors, never replaced
        plain = _load(files, variant)  # one process: LTX2Denoiser installs our local processor
        wrapped = _load(files, variant)
        sp1 = SequenceDriver(wrapped.transformer, Exchange(None, 1, 0))
        contexts = _contexts(plain)
        res: dict = {"forward": {}, "forward_sp1": {}, "stage1": {}, "stage1_sp1": {}}
        for case in FORWARD_CASES:
            res["forward"][case] = _forward(untouched.transformer, _forward_kwargs(untouched, case, contexts))
            res["forward_sp1"][case] = _forward(sp1, _forward_kwargs(wrapped, case, contexts))
        for case in STAGE1_CASES:
            res["stage1"][case] = _stage1(plain, case, contexts)
            res["stage1_sp1"][case] = _stage1(wrapped, case, contexts, forward=sp1)
        gemma = load_gemma(files[variant]["gemma"])
        pipeline = TwoStagePipeline(plain, gemma)
        res["two_stage"] = _pipeline_result(pipeline.generate(_two_stage_request(files, variant, files["image"])))
        res["distilled"] = _pipeline_result(pipeline.generate(_distilled_request(files["image"])))
        res.update(components=plain, gemma=gemma, contexts=contexts, pipeline=pipeline, files=files)
        out[variant] = res
    return out


@pytest.fixture(scope="module")
def sp_run(files):
    """`sp_run(W)`: the per-rank results of `_sp_rank` on W gloo ranks (run once per W)."""
    cache = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = run_ranks(_sp_rank, world, files)
        return cache[world]

    return get


@pytest.fixture(scope="module")
def three_rank(files) -> list[dict]:
    return run_ranks(_three_rank, 3, files, files["image"])


# ---- W = 1 -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_w1_wrapper_is_the_plain_transformer(reference, variant):
    """W = 1: the SP wrapper (our processors, no collectives) reproduces the diffusers forward bit for bit."""
    ref = reference[variant]
    for case in FORWARD_CASES:
        for i, modality in enumerate(("video", "audio")):
            a, b = ref["forward_sp1"][case][i], ref["forward"][case][i]
            assert torch.equal(a, b), f"{variant} {case} {modality}: max |diff| {float((a - b).abs().max()):.3e}"
    for case in STAGE1_CASES:
        for modality in ("video", "audio"):
            assert torch.equal(ref["stage1_sp1"][case][modality], ref["stage1"][case][modality]), (variant, case)


# ---- exchange round trips -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_exchange_round_trip(sp_run, world):
    results = sp_run(world)
    x = torch.randn(2, 3 * world, 8, 5, generator=torch.Generator().manual_seed(31))  # what every rank built
    per, hp = x.shape[1] // world, 8 // world
    for rank, r in enumerate(results):
        rt = r["round_trip"]
        assert torch.equal(rt["local"], x[:, rank * per:(rank + 1) * per])
        # the head slice this rank should hold, all tokens, by plain indexing
        assert torch.equal(rt["heads"], x[:, :, rank * hp:(rank + 1) * hp]), f"rank {rank}: wrong head slice"
        assert torch.equal(rt["back"], rt["local"]), f"rank {rank}: heads_to_seq(seq_to_heads(x)) != x"
        assert torch.equal(rt["gathered"], x)
        assert rt["odd_heads_error"] == f"3 heads cannot be split over {world} ranks (the SP degree must divide " \
                                        "the heads)"


@pytest.mark.parametrize("world", [2, 4])
def test_shard_then_gather_is_identity_with_padding(sp_run, world):
    results = sp_run(world)
    t, padded = 9, -(-9 // world) * world
    per = padded // world
    inputs = results[0]["round_trip"]["inputs"]
    dims = dict(latent=1, timesteps=1, positions=2, mask=1)
    for rank, r in enumerate(results):
        rt = r["round_trip"]
        for name, dim in dims.items():
            x = inputs[name]
            assert torch.equal(rt["inputs"][name], x), f"rank {rank} built different {name}"
            full = rt["regathered"][name]
            assert full.shape[dim] == padded
            assert torch.equal(full.narrow(dim, 0, t), x), f"{name}: shard + gather is not the identity"
            assert not full.narrow(dim, t, padded - t).any(), f"{name}: padding is not zero"
            # this rank's shard is the contiguous slice [r·Tp/W, (r+1)·Tp/W)
            assert torch.equal(rt["sharded"][name], full.narrow(dim, rank * per, per))


# ---- parity: one forward, stage 1 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_parity(reference, sp_run, variant, world):
    results = sp_run(world)
    for case in FORWARD_CASES:
        for i, modality in enumerate(("video", "audio")):
            ref = reference[variant]["forward"][case][i]
            got = results[0][variant]["forward"][case][i]
            _assert_close(got, ref, f"forward {variant} W={world} {case} {modality}")
            for rank, r in enumerate(results[1:], 1):  # every rank holds the same full output
                assert torch.equal(r[variant]["forward"][case][i], results[0][variant]["forward"][case][i]), \
                    f"rank {rank} {case} {modality} differs from rank 0"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_stage1_parity(reference, sp_run, variant, world):
    """Guided stage 1 (CFG + STG + modality guidance with rescale), image-to-video, batch 1 and 2."""
    results = sp_run(world)
    for case in STAGE1_CASES:
        ref = reference[variant]["stage1"][case]
        got = results[0][variant]["stage1"][case]
        assert got["forwards"] == ref["forwards"] == 4 * STAGE1_STEPS  # cond, uncond, perturbed, isolated
        assert got["first_frame_kept"] and ref["first_frame_kept"]
        for modality in ("video", "audio"):
            _assert_close(got[modality], ref[modality], f"stage 1 {variant} W={world} {case} {modality}")
            for r in results[1:]:
                assert torch.equal(r[variant]["stage1"][case][modality], got[modality])


# ---- the padded keys are masked (self-attention and video→audio), and the test notices when they are not ---------

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_keys_are_masked(reference, sp_run, variant, world):
    t = 9
    padded = -(-t // world) * world
    assert padded != t
    for rank, r in enumerate(sp_run(world)):
        seen = r[variant]["masks_seen"]
        kinds = [kind for kind, _, _ in seen]
        n_blocks = 2
        assert kinds.count("UlyssesSelfAttention") == kinds.count("GatheredKeysCrossAttention") == n_blocks
        for kind, keys, mask in seen:
            assert keys == padded, f"rank {rank} {kind}: {keys} keys, expected all {padded} (padded) tokens"
            assert mask is not None, f"rank {rank} {kind}: padded keys not masked"
            expected = torch.zeros(padded)
            expected[t:] = float("-inf")
            assert torch.equal(mask.reshape(-1), expected), f"rank {rank} {kind}: mask {mask.reshape(-1)}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_negative_control_unmasked_keys_change_the_output(reference, sp_run, variant, world):
    """With T % W != 0 the audio equals W = 1 (test_forward_parity); dropping the key mask of the video→audio
    attention only makes the audio differ — far above the tolerance — so the parity test would catch it. Likewise
    for the video self-attention and the video output."""
    ref_video, ref_audio = reference[variant]["forward"][NEGATIVE_CONTROL_CASE]
    r = sp_run(world)[0][variant]
    _assert_close(r["forward"][NEGATIVE_CONTROL_CASE][1], ref_audio, f"masked v2a {variant} W={world} audio")
    err_audio = _rel(r["no_v2a_mask"][1], ref_audio)
    assert err_audio > 100 * TOL, f"audio without the video→audio key mask: relative error only {err_audio:.3e}"
    err_video = _rel(r["no_self_mask"][0], ref_video)
    assert err_video > 100 * TOL, f"video without the self-attention key mask: relative error only {err_video:.3e}"
    print(f"negative controls {variant} W={world}: audio {err_audio:.3e}, video {err_video:.3e}")


# ---- the full pipeline ---------------------------------------------------------------------------------------------

LATENTS = ("video_latent", "audio_latent")  # on every rank
DECODED = ("frames", "audio")  # on rank 0 (the driver) only


def _check_pipeline(results: list[dict], ref: dict, what: str, pipeline: TwoStagePipeline,
                    request: GenerateRequest) -> None:
    """Latents (what SP computes) within TOL of W = 1 and identical on every rank; decoded frames / waveform within
    DECODED_TOL, and exactly what this process decodes from rank 0's latents — so any difference beyond TOL is the
    decoders' amplification of the latent difference, not the parallel run."""
    for name in LATENTS:
        _assert_close(results[0][name], ref[name], f"{what} {name}")
        for rank, r in enumerate(results[1:], 1):
            assert torch.equal(r[name], results[0][name]), f"{what}: rank {rank} {name} differs from rank 0"
    for name in DECODED:
        _assert_close(results[0][name], ref[name], f"{what} {name}", DECODED_TOL)
        for rank, r in enumerate(results[1:], 1):
            assert r[name] is None or torch.equal(r[name], results[0][name]), f"{what}: rank {rank} {name}"
    frames, _ = pipeline.decode_video(results[0]["video_latent"], request.seed, request.decode_tiles)
    _assert_close(frames, results[0]["frames"], f"{what} frames re-decoded here from rank 0's latent")
    waveform, _ = pipeline.decode_audio(results[0]["audio_latent"])
    _assert_close(waveform, results[0]["audio"], f"{what} waveform re-decoded here from rank 0's latent")


@pytest.mark.parametrize("variant", VARIANTS)
def test_three_ranks_sp_on_two(reference, three_rank, variant):
    """build_plan on 3 gloo ranks: SP on ranks 0-1, rank 2 waits and receives rank 0's stage-1 result; the whole
    two-stage image-to-video pipeline gives every rank the W = 1 result."""
    results = [r[variant] for r in three_rank]
    assert [r["sp_degree"] for r in results] == [2, 2, 2]
    assert [r["in_sp_group"] for r in results] == [True, True, False]
    assert [r["has_sp_forward"] for r in results] == [True, True, False]
    assert "ranks 0-1 of 3" in results[0]["describe"] and results[0]["report"] == results[0]["describe"]
    for r in results:  # share(): rank 0's tensors everywhere (ranks 0/1 offered 1 and 2, rank 2 nothing)
        assert torch.equal(r["shared"][0], torch.full((1, 4, 3), 1.0))
        assert torch.equal(r["shared"][1], torch.full((1, 4, 3), 10.0))
    ref = reference[variant]
    _check_pipeline(results, ref["two_stage"], f"two-stage {variant} 3 ranks (SP 2)", ref["pipeline"],
                    _two_stage_request(ref["files"], variant, ref["files"]["image"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_distilled_preset_w2(reference, sp_run, variant):
    """pipeline="distilled": SP on both stages at W = 2 equals W = 1."""
    results = [r[variant] for r in sp_run(2)]
    assert results[0]["distilled_sp_degree"] == 2
    assert results[0]["distilled"]["report"] == "sequence parallel over all 2 ranks"
    ref = reference[variant]
    _check_pipeline([r["distilled"] for r in results], ref["distilled"], f"distilled {variant} W=2", ref["pipeline"],
                    _distilled_request(ref["files"]["image"]))


# ---- refusals --------------------------------------------------------------------------------------------------------

def test_invalid_degree_is_refused_naming_the_valid_ones(reference):
    with pytest.raises(ValueError) as exc:
        check_sp_degree(8, 3)
    assert str(exc.value) == ("sequence parallel degree 3 does not divide the 8 attention heads; "
                              "valid degrees: 1, 2, 4, 8")
    # apply_plan refuses before any work: it installs no processor on the transformer
    components = types.SimpleNamespace(transformer=copy.deepcopy(reference["2.0"]["components"].transformer))
    before = [type(b.attn1.processor) for b in components.transformer.transformer_blocks]
    with pytest.raises(ValueError, match="valid degrees: 1, 2, 4, 8"):
        apply_plan(components.transformer, SEQUENCE, Exchange(None, 3, 0))
    assert [type(b.attn1.processor) for b in components.transformer.transformer_blocks] == before
    check_sp_degree(8, 4)  # valid: no error


def test_valid_and_largest_degrees(monkeypatch):
    assert valid_sp_degrees(32) == [1, 2, 4, 8, 16, 32]
    assert valid_sp_degrees(8) == [1, 2, 4, 8]
    assert valid_sp_degrees(32, 6) == [1, 2, 4]
    assert largest_sp_degree(32, 6) == 4
    assert largest_sp_degree(32, 3) == 2
    assert largest_sp_degree(32, 8) == 8 and largest_sp_degree(32, 1) == 1
    assert largest_sp_degree(8, 12) == 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    devices = client.parse_devices("0,1,3")
    assert devices == ("cuda:0", "cuda:1", "cuda:3")
    assert largest_sp_degree(32, len(devices)) == 2


def test_token_cap_refusals(reference):
    with pytest.raises(ValueError) as exc:
        check_token_cap(100, 2, 10)
    assert str(exc.value) == ("100 video tokens over 2 ranks is 50 tokens per rank, above the cap of 10: use at "
                              "least 10 GPUs, fewer frames or a smaller size, or raise the cap")
    check_token_cap(100, 2, 50)  # exactly at the cap: allowed
    check_token_cap(10 ** 9, 1, None)  # no cap
    plan = ParallelPlan.hand_built(0, 4, CPU, PlanPolicy(4, token_cap=8))
    with pytest.raises(ValidationError) as exc:
        plan.check(100)
    assert "100 video tokens over 4 ranks is 25 tokens per rank, above the cap of 8: use at least 13 GPUs" \
        in str(exc.value)
    plan.check(32)


def test_token_cap_refused_before_any_work(reference, monkeypatch):
    """The pipeline checks the cap of its largest SP stage before encoding a prompt; the SP forward before any
    transformer call."""
    ref = reference["2.0"]
    plan = ParallelPlan.hand_built(0, 1, CPU, PlanPolicy(1, token_cap=4))
    pipeline = TwoStagePipeline(ref["components"], ref["gemma"], plan=plan)
    monkeypatch.setattr(pipeline, "encode_prompts", lambda *a: pytest.fail("work started before the token cap check"))
    with pytest.raises(ValidationError, match="27 video tokens over 1 rank is 27 tokens per rank, above the cap of "
                                              "4; at 192×192 not even one frame fits 1 rank: use at least 7 GPUs"):
        pipeline.generate(GenerateRequest(prompt="x", steps=1, **PIPELINE_SIZE))

    tf = copy.deepcopy(ref["components"].transformer)
    sp = SequenceDriver(tf, Exchange(None, 1, 0))  # the job's cap comes with its split (StageRun.forward)
    monkeypatch.setattr(tf, "forward", lambda *a, **k: pytest.fail("forward ran above the token cap"))
    kwargs = _forward_kwargs(ref["components"], "odd", ref["contexts"])
    with pytest.raises(ValueError, match="9 video tokens over 1 rank is 9 tokens per rank, above the cap of 4: use "
                                         "at least 3 GPUs"):
        sp(token_cap=4, **kwargs)
