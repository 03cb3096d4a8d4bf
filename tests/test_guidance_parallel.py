"""Guidance-pass parallelism (`mgpu_backend/splits/passes.py`) on real gloo ranks, tiny LTX-2, fp32, CPU.

A guided stage with `guidance_parallel="on"` computes each step's guidance passes on different ranks (pass j on rank
j % g) and broadcasts their x0 predictions; nothing else changes, so its result must equal the one-process stage
**bit for bit** (`torch.equal`, no tolerance): P = 4 (CFG + STG + modality guidance), P = 3 (CFG + STG), P = 2
(CFG only, and CFG on video with a frozen audio stream: its audio guidance must not count), at W = 2, 3 and 4 —
including groups smaller than the fleet (W = 3: g = 2; W = 4 with P = 2 or 3: g = 2 or 3), whose other ranks receive
the result through `ParallelPlan.share`. Each rank of the group must have run only its own passes (forward counts).
The per-step cancel check is the fleet's (`worker.JobContext.step_boundary`): rank 0 decides, broadcast within
the group the runner passes — a wrong group would hang the test (collective timeout) instead of passing.

The whole two-stage pipeline at W = 2 with "on" is compared with the W = 1 pipeline given the same stage-2 and decode
tilings (a 2-rank fleet's default, stated explicitly for both): the stage-1 result (the audio latent is the stage-1
audio, bit for bit) must be identical; the stage-2 video latent, the frames and the waveform too (the stage-2 TDP
blend of 1×2 tiles and the decode reduce over two ranks add each value to zeros once, exactly; should another BLAS
make them differ, the bound would be test_sequence_parallel's 1e-5 relative for latents, not equality).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from mgpu_backend.engine import sampling as S
from mgpu_backend.engine.denoiser import text_contexts
from mgpu_backend.models.gemma import load_gemma
from mgpu_backend.models.loader import ComponentFiles, load_components
from mgpu_backend.testing.tiny import make_tiny
from mgpu_backend.splits import cost as C
from mgpu_backend.splits import passes as GP
from mgpu_backend.splits.plan import ParallelPlan, PlanPolicy, SPStage
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline
from mgpu_backend.stages.stage import StageSpec

torch.set_num_threads(1)

CPU = torch.device("cpu")
FPS = 24.0
GRID = (2, 2, 3)  # 12 video tokens, the first latent frame conditioned (image-to-video)
AUDIO_TOKENS = 5
STEPS = 3
VIDEO_FULL = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(1,), rescale=0.7, modality_scale=3.0)
AUDIO_FULL = S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(0,), rescale=0.7, modality_scale=3.0)
CASES = {  # name -> (video guidance, audio guidance, audio frozen, passes per step)
    "cfg_stg_modality": (VIDEO_FULL, AUDIO_FULL, False, 4),
    "cfg_stg": (dataclasses.replace(VIDEO_FULL, modality_scale=1.0),
                dataclasses.replace(AUDIO_FULL, modality_scale=1.0), False, 3),
    "cfg": (S.GuidanceParams(cfg_scale=3.0), S.GuidanceParams(cfg_scale=7.0), False, 2),
    "cfg_frozen_audio": (S.GuidanceParams(cfg_scale=3.0), AUDIO_FULL, True, 2),
}
CANCEL_AT = 1  # the cancel test stops before step 2 of 3
PIPELINE = dict(prompt="a fox in the snow", width=128, height=128, frames=9, steps=2, seed=5)


def _load(paths: dict):
    return load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)


def _stage_spec(components, case: str) -> StageSpec:
    """The `StageSpec` of one case: two random prompts through the real connectors, image-to-video mask, noise from
    the seed."""
    video_guidance, audio_guidance, frozen, _ = CASES[case]
    width = components.video_connector.inner_dim
    g = torch.Generator().manual_seed(11)
    contexts = text_contexts(components, [torch.randn(1, 7, width, generator=g), torch.randn(1, 4, width, generator=g)],
                             dtype=torch.float32)
    f, h, w = GRID
    video_clean = torch.zeros(1, f * h * w, 128)
    video_clean[:, : h * w] = torch.randn(1, h * w, 128, generator=g)
    video_mask = torch.ones(1, f * h * w)
    video_mask[:, : h * w] = 0.0
    audio_clean = torch.randn(1, AUDIO_TOKENS, 128, generator=g) if frozen else torch.zeros(1, AUDIO_TOKENS, 128)
    return StageSpec(name="stage 1", semantics="reference", positive=contexts.select(0), negative=contexts.select(1),
                     grid=GRID, fps=FPS, audio_frames=AUDIO_TOKENS, video_clean=video_clean, audio_clean=audio_clean,
                     sigmas=S.ltx2_sigmas(STEPS), seed=7, video_mask=video_mask, audio_frozen=frozen,
                     video_guidance=video_guidance, audio_guidance=audio_guidance)


def _boundary(plan, cancel_at: int | None, log: list):
    """The fleet's per-step cancel decision (`JobContext.step_boundary`): rank 0 decides, broadcast within the group
    of the stage that runs (the group its runner passes)."""
    def check(stage: str, step: int, group=None) -> bool:
        flag = torch.tensor([int(plan.rank == 0 and step == cancel_at)], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=group)
        log.append(step)
        return bool(flag.item())
    return check


class _Forwards:
    """Counts the transformer forwards this process runs (the one forward, `model_forward.run_eager`)."""

    def __init__(self, transformer):
        from mgpu_backend.engine import forward as model_forward

        self.n = 0
        real = model_forward.run_eager

        def counting(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        model_forward.run_eager = counting  # transparent; every later forward of this process is counted


def _rank(rank: int, world: int, paths: dict) -> dict:
    from mgpu_backend.protocol.fleet_config import FleetPolicy
    from mgpu_backend.splits.plan import build_plan

    components = _load(paths)
    plan = build_plan(components.transformer, rank, world, CPU, FleetPolicy(min_tokens_per_rank=0, guidance_parallel="on"))
    pipeline = TwoStagePipeline(components, None, plan=plan)
    count = _Forwards(components.transformer)
    out: dict = {"stages": {}, "pass_groups": sorted(plan.pass_groups)}
    for case in CASES:
        count.n, log = 0, []
        result = pipeline.run_stage(_stage_spec(components, case), None, _boundary(plan, None, log))
        video, audio = result.video, result.audio
        out["stages"][case] = dict(video=video, audio=audio, forwards=count.n, boundaries=len(log),
                                   degree=(result.runner.run_split.report.split.degree
                                           if result.runner.run_split.report.split else None),
                                   describe=result.report)
    log = []
    try:
        pipeline.run_stage(_stage_spec(components, "cfg_stg_modality"), None, _boundary(plan, CANCEL_AT, log))
        out["cancel"] = None
    except S.SamplingCancelled as exc:
        out["cancel"] = str(exc)
    out["cancel_boundaries"] = len(log)
    if world == 2:  # the whole two-stage pipeline, image-free, with the fleet's cancel check
        grid2 = (2, 4, 4)
        pipeline = TwoStagePipeline(components, load_gemma(paths["gemma"]), plan=plan)
        result = pipeline.generate(_pipeline_request(paths, grid2), cancel_check=_boundary(plan, None, []))
        out["pipeline"] = dict(video_latent=result.video_latent, audio_latent=result.audio_latent,
                               frames=result.frames, audio=result.audio, report=result.parallel_report,
                               rank_reports=result.rank_reports)
    return out


def _pipeline_request(paths: dict, grid2) -> GenerateRequest:
    """The distilled LoRA in stage 2; the stage-2 and decode tilings a 2-rank fleet picks, stated explicitly."""
    return GenerateRequest(**PIPELINE, distilled_lora=(paths["distilled_lora"], 1.0),
                           tiles=TwoStagePipeline.resolve_tiling(None, 2, grid2, 5, "tiles"),
                           decode_tiles=TwoStagePipeline.resolve_tiling(None, 2, grid2, 2, "decode tiles"))


# ---- fixtures -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    return {k: str(v) for k, v in make_tiny(tmp_path_factory.mktemp("guidance_parallel"), "2.0", seed=0).items()}


@pytest.fixture(scope="module")
def reference(paths) -> dict:
    """One process: every case's stage (sequential passes) with its forward count, and the two-stage pipeline."""
    components = _load(paths)
    count = _Forwards(components.transformer)
    pipeline = TwoStagePipeline(components, load_gemma(paths["gemma"]))
    out: dict = {"stages": {}}
    for case in CASES:
        count.n = 0
        result = pipeline.run_stage(_stage_spec(components, case))
        video, audio = result.video, result.audio
        out["stages"][case] = dict(video=video, audio=audio, forwards=count.n)
    out["pipeline"] = pipeline.generate(_pipeline_request(paths, (2, 4, 4)))
    return out


@pytest.fixture(scope="module")
def ranks(paths):
    cache: dict[int, list] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = run_ranks(_rank, world, paths, timeout_s=120.0)
        return cache[world]

    return get


# ---- parity on real ranks -------------------------------------------------------------------------------------------

def _expected_degree(passes: int, world: int) -> int:
    return GP.pass_degree(passes, range(2, min(world, GP.MAX_PASSES) + 1), world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_guided_stage_equals_one_process_bit_for_bit(reference, ranks, world):
    results = ranks(world)
    assert all(r["pass_groups"] == list(range(2, min(world, 4) + 1)) for r in results)
    for case, (_, _, _, passes) in CASES.items():
        ref = reference["stages"][case]
        assert ref["forwards"] == passes * STEPS
        g = _expected_degree(passes, world)
        for rank, r in enumerate(results):
            got = r["stages"][case]
            assert got["degree"] == g, (case, rank, got["degree"])
            for modality in ("video", "audio"):
                a, b = got[modality], ref[modality]
                assert torch.equal(a, b), (f"W={world} {case} rank {rank} {modality}: max |diff| "
                                           f"{float((a - b).abs().max()):.3e}")
            # rank r of the group ran only passes j with j % g == r; the ranks outside ran nothing
            own = sum(1 for j in range(passes) if j % g == rank) if rank < g else 0
            assert got["forwards"] == own * STEPS, (case, rank, got["forwards"])
            assert got["boundaries"] == (STEPS if rank < g else 0), (case, rank)


def test_describe_says_what_ran(ranks):
    two, three, four = ranks(2)[0], ranks(3)[0], ranks(4)[0]
    assert two["stages"]["cfg_stg_modality"]["describe"] == (
        "stage 1: guidance passes in parallel on 2 ranks (4 passes per step: 2 forwards per rank); "
        "set by guidance_parallel='on'")
    assert four["stages"]["cfg_stg_modality"]["describe"].startswith(
        "stage 1: guidance passes in parallel on 4 ranks (4 passes per step: 1 forward per rank)")
    assert four["stages"]["cfg_stg"]["describe"].startswith(
        "stage 1: guidance passes in parallel on ranks 0-2 of 4 (3 passes per step: 1 forward per rank; the other "
        "ranks wait for its result)")
    assert three["stages"]["cfg"]["describe"].startswith("stage 1: guidance passes in parallel on ranks 0-1 of 3")


@pytest.mark.parametrize("world", [2, 3])
def test_cancel_mid_stage_stops_every_rank(ranks, world):
    """Rank 0 cancels before step 2: every rank of the group stops at that boundary; at W = 3 (g = 2) rank 2, which
    waits outside the group, is told instead of waiting for the result."""
    results = ranks(world)
    g = _expected_degree(4, world)
    for rank, r in enumerate(results):
        assert r["cancel"], f"rank {rank} was not stopped"
        assert r["cancel_boundaries"] == (CANCEL_AT + 1 if rank < g else 0)
    if world > g:
        assert "cancelled on the guidance-parallel ranks" in results[g]["cancel"]
        assert "before step 2/3" in results[0]["cancel"]


def test_two_stage_pipeline_w2_equals_one_process(reference, ranks):
    ref = reference["pipeline"]
    results = [r["pipeline"] for r in ranks(2)]
    for rank, r in enumerate(results):
        assert torch.equal(r["audio_latent"], ref.audio_latent), f"rank {rank}: stage-1 audio differs"
        assert torch.equal(r["video_latent"], ref.video_latent), (
            f"rank {rank}: video latent max |diff| {float((r['video_latent'] - ref.video_latent).abs().max()):.3e}")
    assert torch.equal(results[0]["frames"], ref.frames) and torch.equal(results[0]["audio"], ref.audio)
    report = results[0]["report"]
    assert report.startswith("stage 1: guidance passes in parallel on 2 ranks (4 passes per step: 2 forwards per "
                             "rank)"), report
    assert results[0]["rank_reports"][1].stage_1 == report


# ---- the choice (no ranks) ------------------------------------------------------------------------------------------

def test_pass_degree():
    assert GP.pass_degree(4, [2, 3, 4], 4) == 4
    assert GP.pass_degree(4, [2, 3], 3) == 2  # 2 forwards per rank either way: the smaller group
    assert GP.pass_degree(3, [2, 3, 4], 4) == 3
    assert GP.pass_degree(2, [2, 3], 3) == 2
    assert GP.pass_degree(4, [2, 4], 8) == 4
    assert GP.pass_degree(1, [2, 4], 8) == 1
    assert GP.pass_degree(4, [], 4) == 1


def _cuda_plan(world: int, mode: str = "auto", **kw) -> ParallelPlan:
    """A CUDA-like plan as build_plan makes it for the LTX-2 19B shape (no GPU needed: only the policy is read, no
    collective runs)."""
    degrees = [d for d in (1, 2, 4, 8) if d <= world]
    policy = PlanPolicy(max(degrees), cost_model=C.DEFAULT, shape=C.LTX2_19B, guidance_parallel=mode, **kw)
    return ParallelPlan.hand_built(0, world, torch.device("cuda"), policy,
                                   stages={d: SPStage(d, None, None) for d in degrees},
                                   pass_groups={g: None for g in range(2, min(world, 4) + 1)})


@pytest.mark.parametrize("tokens,passes,world", [(3520, 4, 4), (3520, 4, 2), (3520, 2, 8), (14080, 4, 4),
                                                 (32640, 3, 2), (32640, 4, 8), (14080, 3, 4)])
def test_auto_on_cuda_follows_the_cost_model(tokens, passes, world):
    """"auto" on CUDA: the passes in parallel exactly when ⌈P/g⌉·t(T, 1) + the exchange is predicted below
    P·t(T, d) (d the SP degree the plan picks for T), with t from cost.py."""
    plan = _cuda_plan(world)
    nbytes = GP.pass_bytes((1, tokens, 128), (1, 126, 128))
    run = plan.split("stage 1", tokens, passes, nbytes)
    d = C.best_sp_degree(tokens, [x for x in (1, 2, 4, 8) if x <= world], C.LTX2_19B)
    g = GP.pass_degree(passes, range(2, min(world, 4) + 1), world)
    t_pass = -(-passes // g) * C.predict_sp(tokens, 1) + passes * (nbytes / C.DEFAULT.bandwidth + C.DEFAULT.latency)
    t_seq = passes * C.predict_sp(tokens, d)
    expected = "passes" if t_pass < t_seq else "sequence"
    assert run.kind == expected, (run.split, t_pass, t_seq)
    assert run.degree == (g if expected == "passes" else d)
    text = plan.describe(run.report)
    if expected == "passes":
        assert text.startswith("stage 1: guidance passes in parallel on ")
        assert f"would be predicted {t_seq / t_pass:.1f}× slower" in text, text
    else:
        assert f"guidance passes in parallel on {g} ranks would be predicted {t_pass / t_seq:.1f}× slower" in text


def test_auto_on_cuda_flagship_stage1_and_a_large_three_pass_stage():
    """The flagship stage 1 (640×352×121: 3,520 tokens, 4 passes) on 4 H200s runs one pass per rank (SP does not
    pay there: the model keeps it on one GPU, so all 4 passes would run in turn); a 3-pass stage at 1920×1088 on 2
    ranks stays sequence parallel (2 one-GPU forwards per step against 3 half-size ones)."""
    plan = _cuda_plan(4)
    run = plan.split("stage 1", 3520, 4, GP.pass_bytes((1, 3520, 128), (1, 126, 128)))
    assert (run.kind, run.degree) == ("passes", 4)
    assert plan.describe(run.report).startswith("stage 1: guidance passes in parallel on 4 ranks (4 passes per step: "
                                                "1 forward per rank); sequence parallel")
    assert "slower" in plan.describe(run.report)
    plan = _cuda_plan(2)
    run = plan.split("stage 1", 32640, 3, GP.pass_bytes((1, 32640, 128), (1, 126, 128)))
    assert (run.kind, run.degree) == ("sequence", 2)
    assert plan.describe(run.report).startswith("sequence parallel over all 2 ranks")
    assert "guidance passes in parallel on 2 ranks would be predicted" in plan.describe(run.report)


def test_modes_cpu_off_on_and_the_token_cap():
    cpu = ParallelPlan.hand_built(0, 4, CPU, PlanPolicy(4, guidance_parallel="auto"), pass_groups={})
    run = cpu.split("stage 1", 3520, 4)
    assert run.kind == "sequence"  # CPU "auto": SP as before
    assert cpu.describe(run.report) == "sequence parallel over all 4 ranks"
    off = _cuda_plan(4, "off")
    assert off.split("stage 1", 3520, 4).kind == "sequence"
    on = _cuda_plan(4, "on")
    run = on.split("stage 1", 3520, 4)
    assert (run.kind, run.report.split.degree) == ("passes", 4)
    assert on.describe(run.report).endswith("set by guidance_parallel='on'")
    run = on.split("stage 2", 3520, 1)
    assert run.kind == "sequence" and run.report.split is None  # one pass: nothing to spread
    assert on.describe(run.report).startswith("sequence parallel")
    capped = _cuda_plan(4, "on", token_cap=1000)
    run = capped.split("stage 1", 3520, 4)
    assert run.kind == "sequence" and "exceed the per-rank cap of 1,000" in capped.describe(run.report)
    assert run.token_cap == 1000  # carried down to the stage's forwards
    with pytest.raises(ValueError, match="guidance_parallel='sometimes'"):
        GP.check_mode("sometimes")


def test_pass_parallel_of_one_rank_and_the_layout_check():
    """size 1: the passes in turn here; a rank whose own passes disagree in layout refuses before any exchange."""
    calls = []
    runner = GP.PassParallel(None, 1, 0)
    passes = S.plan_passes(VIDEO_FULL, AUDIO_FULL)
    outs = runner(passes, lambda p: (calls.append(p.kind) or torch.full((1, 2, 3), len(calls)), None))
    assert calls == ["cond", "uncond", "perturbed", "isolated"] and [float(o[0][0, 0, 0]) for o in outs] == [1, 2, 3, 4]
    two = GP.PassParallel(None, 2, 0)
    shapes = iter([(1, 2, 3), (1, 2, 4)])
    with pytest.raises(ValueError, match="must return the same modalities, shapes and dtypes"):
        two(passes, lambda p: (torch.zeros(next(shapes)), None))
    with pytest.raises(ValueError, match="1 guidance passes cannot occupy 2 ranks"):
        two(passes[:1], lambda p: (torch.zeros(1), None))
    assert GP.pass_bytes((1, 3520, 128), (1, 126, 128)) == 4 * (3520 + 126) * 128


def test_run_passes_in_the_denoising_loop():
    """`denoise_loop(run_passes=…)` hands each step's passes to the runner; one computing them in reverse order
    gives the same result bit for bit; `batched` and `run_passes` exclude each other."""
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(8, 8, generator=g) for k in S.PASS_KINDS}

    def model(inputs: S.ModelInputs):
        w = weights[inputs.guidance.kind]
        return inputs.video @ w, inputs.audio @ w.T

    video, audio = torch.randn(1, 5, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    seen = []

    def reverse(passes, denoise):
        seen.append([p.kind for p in passes])
        return [denoise(p) for p in passes[::-1]][::-1]

    streams = (S.ModalityStream(video, guidance=VIDEO_FULL), S.ModalityStream(audio, guidance=AUDIO_FULL))
    a = S.denoise_loop(model, S.ltx2_sigmas(3), *streams)
    b = S.denoise_loop(model, S.ltx2_sigmas(3), *streams, run_passes=reverse)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert seen == [["cond", "uncond", "perturbed", "isolated"]] * 3
    with pytest.raises(ValueError, match="exclude each other"):
        S.guided_prediction(lambda ps: [], VIDEO_FULL, batched=True, run_passes=reverse)
    with pytest.raises(ValueError, match="run_passes returned 0 results for 4 passes"):
        S.guided_prediction(lambda p: (video, audio), VIDEO_FULL, AUDIO_FULL, run_passes=lambda ps, d: [])


def _fleet_config_from_cli(paths, monkeypatch, *options: str):
    """The FleetConfig `generate` with `options` would hand the controller (a stand-in client stops it there)."""
    from mgpu_backend.serving import cli, client

    seen = {}

    class Stop(Exception):
        pass

    class FakeClient:
        def configure_fleet(self, config):
            seen["config"] = config
            raise Stop

        def close(self):
            seen["closed"] = True

    monkeypatch.setattr(client, "ControllerClient", FakeClient)
    args = cli.build_parser().parse_args(
        ["generate", "--checkpoint", paths["checkpoint"], "--gemma", paths["gemma"], "--upscaler", paths["upsampler"],
         "--prompt", "p", "--width", "128", "--height", "128", "--frames", "9", *options])
    with pytest.raises(Stop):
        cli.run_generate(args)
    return seen["config"]


def test_fleet_config_cli_and_controller(paths, monkeypatch):
    """`--guidance-parallel` reaches FleetConfig (the worker hands it to build_plan); the controller refuses an
    unknown mode when the config is built, before anything is sent."""
    from mgpu_backend.protocol.fleet_config import FleetConfig

    config = _fleet_config_from_cli(paths, monkeypatch, "--devices", "cpu:2", "--guidance-parallel", "on")
    assert config.guidance_parallel == "on"
    assert FleetConfig(devices=("cpu",), checkpoint="c", gemma="g").guidance_parallel == "auto"
    with pytest.raises(ValueError, match="guidance_parallel='always'"):  # FleetPolicy checks itself
        FleetConfig(devices=("cpu",), checkpoint=paths["checkpoint"], gemma=paths["gemma"], guidance_parallel="always")


def test_min_tokens_per_rank_and_compile_flags_reach_the_fleet_config(paths, monkeypatch):
    """`--min-tokens-per-rank N` alone sends the run to a fleet with that override, `--compile` sets
    FleetConfig.compile; a negative minimum is refused when the config is built, before anything is sent."""
    from mgpu_backend.protocol.fleet_config import FleetConfig

    config = _fleet_config_from_cli(paths, monkeypatch, "--min-tokens-per-rank", "0", "--compile")
    assert config.min_tokens_per_rank == 0 and config.compile is True
    with pytest.raises(ValueError, match="min_tokens_per_rank=-5"):  # FleetPolicy checks itself
        FleetConfig(devices=("cpu",), checkpoint=paths["checkpoint"], gemma=paths["gemma"], min_tokens_per_rank=-5)
