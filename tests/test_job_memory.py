"""The job memory plan on one card (issue 37): `protocol/job_memory.py`, on the figures of the H100 80GB run that
ran out of memory (bench_e2e, 48 blocks, LTX-2.0 two-stage 1280×704×121: 63.4 GiB resident before any forward —
transformer 35.16 GiB, Gemma 3 12B 21.92 GiB, the other components the remaining 6.3 —) and on tighter budgets."""
from __future__ import annotations

import pytest
import torch

from mgpu_backend.protocol import job_memory as J
from mgpu_backend.protocol import memory_plan as M

GiB = 2**30
SHAPE = M.ActivationShape(mod_params=6, timesteps="token")  # LTX-2.0 through the reference denoiser


def _stage(name, tokens, passes):
    return J.StageNeed(name, tokens, passes, batchable=passes > 1 and tokens <= 4096,
                       activation=M.activation_bytes(tokens, tokens, SHAPE),
                       batched_activation=M.activation_bytes(tokens, tokens, SHAPE, batch=passes))


STAGES = (_stage("stage 1", 3520, 4), _stage("stage 2", 14080, 1))
OTHERS = int(6.3 * GiB)
FIXED = int(35.16 * GiB) + OTHERS


def _inputs(budget_gib, **kw):
    values = dict(budget=int(budget_gib * GiB), transformer=int(35.16 * GiB), others=OTHERS,
                  encoder=int(21.92 * GiB), encoder_activation=2 * GiB, graph_pool=0, stages=STAGES,
                  host_room=100 * GiB)
    values.update(kw)
    return J.JobMemoryInputs(**values)


def plan_reserve(budget_gib):
    return J.RESERVE_BYTES + int(J.RESERVE_SHARE * int(budget_gib * GiB))


def test_h200_keeps_everything():
    plan = J.plan_job_memory(_inputs(139))
    assert plan.encoder == "keep" and not plan.drop_graphs and not plan.fallbacks
    assert [(s.batched, s.graphs) for s in plan.stages] == [(True, True), (False, True)]
    assert plan.peak <= 139 * GiB - plan_reserve(139)
    s1, s2 = STAGES
    assert plan.stages[1].peak == FIXED + int(21.92 * GiB) + s1.batched_activation + 2 * s2.activation
    assert plan.lines() == (f"memory plan: peak {plan.peak / GiB:.1f} GiB of 139.0 GiB (text encoder kept, passes "
                            "batched where they pay, forwards graphed)",)


def test_h100_moves_the_encoder_to_host_memory_and_keeps_the_fast_paths():
    plan = J.plan_job_memory(_inputs(79))
    assert plan.encoder == "offload"
    assert [(s.batched, s.graphs) for s in plan.stages] == [(True, True), (False, True)]
    # the stage peaks hold without the encoder, the encode peak with it
    assert plan.encode_peak == FIXED + int(21.92 * GiB) + 2 * GiB
    assert plan.peak <= 79 * GiB - plan_reserve(79)
    assert "text encoder (21.9 GiB) moved to host memory after encoding" in plan.lines()[1]
    assert "brings it back and out again (~43 s over the host link)" in plan.lines()[1]  # 2 × 21.92 GiB at 1.1 GB/s


def test_no_host_room_drops_the_encoder():
    plan = J.plan_job_memory(_inputs(79, host_room=8 * GiB))
    assert plan.encoder == "drop" and "reloads it from disk" in plan.lines()[1]


def test_a_tight_card_gives_up_the_cheapest_fast_path_first():
    s1, s2 = STAGES
    # stage 2 graphed needs 2·A2 above stage 1's pool; give it a GiB less: its graphs go (1 %), stage 1 keeps its own
    need2 = FIXED + s1.batched_activation + 2 * s2.activation
    budget = need2 - GiB
    plan = J.plan_job_memory(_inputs(budget / GiB, encoder=0, encoder_activation=0, reserve=0))
    st1, st2 = plan.stages
    assert (st1.batched, st1.graphs) == (True, True)
    assert (st2.batched, st2.graphs) == (False, False)
    assert st2.fallbacks == ("forwards eager, not graphed (~1 % slower at 14,080 tokens per rank)",)
    assert st2.peak == FIXED + s1.batched_activation + s2.activation <= budget
    assert plan.lines()[-1] == "memory plan: stage 2: forwards eager, not graphed (~1 % slower at 14,080 tokens " \
                               "per rank)"


def test_stage_one_drops_batching_before_graphs_where_graphs_pay_more():
    (one,) = small = (_stage("stage 1", 1536, 4),)
    budget = FIXED + 2 * one.activation  # room for one row graphed, not four
    plan = J.plan_job_memory(_inputs(budget / GiB, encoder=0, encoder_activation=0, stages=small, reserve=0))
    (st,) = plan.stages
    assert (st.batched, st.graphs) == (False, True)
    assert st.fallbacks == ("4 guidance passes one at a time, not batched (~11 % slower at 1,536 tokens per rank)",)


def test_graphs_of_earlier_jobs_are_dropped_when_the_encoder_needs_the_room():
    plan = J.plan_job_memory(_inputs(74, graph_pool=8 * GiB))
    assert plan.drop_graphs and plan.encoder == "offload"
    assert plan.fallbacks[0].startswith("CUDA graphs of earlier jobs dropped before encoding (8.0 GiB")


def test_refusals_name_the_moment_and_the_figures():
    with pytest.raises(J.JobMemoryError, match=r"text encoder does not fit next to the transformer: encoding "
                                               r"needs 65\.4 GiB .* of 48\.0 GiB less 4\.4 GiB kept free"):
        J.plan_job_memory(_inputs(48))
    with pytest.raises(J.JobMemoryError, match=r"stage 2 does not fit this GPU in any plan: one forward at "
                                               r"14,080 video tokens needs 44\.9 GiB .* of 46\.0 GiB less 4\.3 GiB"):
        J.plan_job_memory(_inputs(46, encoder=0, encoder_activation=0))
    with pytest.raises(J.JobMemoryError, match=r"the model does not fit this GPU: transformer 35\.2 GiB and other "
                                               r"components 6\.3 GiB of 42\.0 GiB less 4\.1 GiB kept free"):
        J.plan_job_memory(_inputs(42))


def test_gain_tables_interpolate_in_log_tokens():
    assert J.gain(J.GRAPH_GAIN, 100) == 0.23 and J.gain(J.GRAPH_GAIN, 10**6) == 0.01
    mid = int((1536 * 3520) ** 0.5)
    assert J.gain(J.GRAPH_GAIN, mid) == pytest.approx(0.13, abs=1e-3)


# ---- the engine's figures and the plan applied (stages/job_memory.py, TwoStagePipeline.generate) ------------------

CUDA = torch.cuda.is_available()
SMALL = dict(width=128, height=128, frames=9, fps=24.0, steps=3, prompt="a fox in the snow", seed=3)


def _pipeline(tmp_path, device, dtype):
    from mgpu_backend.models.gemma import load_gemma
    from mgpu_backend.models.loader import ComponentFiles, load_components
    from mgpu_backend.stages.pipelines import TwoStagePipeline
    from mgpu_backend.testing.tiny import make_tiny

    paths = make_tiny(tmp_path, "2.0", seed=0)
    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=dtype,
                                 device=device)
    return TwoStagePipeline(components, load_gemma(paths["gemma"], device=device, dtype=dtype), device=device,
                            dtype=dtype)


def test_stage_need_reads_the_transformer_and_the_cpu_plans_nothing(tmp_path, monkeypatch):
    from mgpu_backend.stages import job_memory as JM
    from mgpu_backend.stages.pipelines import GenerateRequest

    torch.set_num_threads(1)
    pipeline = _pipeline(tmp_path, "cpu", torch.float32)
    t = pipeline.components.transformer
    need = JM.stage_need("stage 1", t, 64, 4, torch.float32, torch.device("cpu"))
    shape = M.ActivationShape.of(t.config, act_bytes=4, linear="bf16", timesteps="token")
    assert shape.video_dim == t.config.num_attention_heads * t.config.attention_head_dim
    assert need.activation == M.activation_bytes(64, 64, shape) > 0
    assert not need.batchable and need.batched_activation == need.activation  # CPU: one forward per pass
    assert JM.module_bytes(t, torch.device("cpu")) == sum(p.numel() * p.element_size() for p in t.parameters()) + \
        sum(b.numel() * b.element_size() for b in t.buffers())
    assert JM.module_bytes(t, torch.device("meta")) == 0
    job = pipeline.plan_job(GenerateRequest(**SMALL))
    assert pipeline.plan_memory(job) is None
    # an encoder an earlier job moved to host memory still counts for the GPU: a prompt the cache misses brings it
    # back (counted as absent, the H100's second job kept it there after encoding and ran out of memory)
    service = pipeline.text_service()
    service.ensure_loaded("replicated")
    gpu = torch.device("meta")  # stands in for the GPU the encoder left
    assert JM.encoder_figures(service, gpu) == (0, 0)
    service.offloaded = True
    held, act = JM.encoder_figures(service, gpu)
    assert held == JM.module_bytes(service.encoder.model, torch.device("cpu")) > 0 and act > 0
    # ... and the host room it takes is its own: an offload plan stays an offload plan, not a "drop"
    from mgpu_backend.stages import text_encoder

    monkeypatch.setattr(text_encoder, "free_bytes", lambda device: 10 * J.GiB)
    assert JM.host_room(service) == 10 * J.GiB - JM.HOST_MARGIN_BYTES + held
    service.offloaded = False
    assert JM.host_room(service) == JM.host_room() == 10 * J.GiB - JM.HOST_MARGIN_BYTES


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_plan_moves_the_encoder_and_takes_graphs_away_without_changing_the_result(tmp_path, monkeypatch):
    """On a budget cut to the tiny models' figures: the encoder goes to host memory after encoding and comes back for
    a new prompt; with less, stage 2 runs eagerly; the frames equal the unplanned job's and the report says so."""
    from mgpu_backend.stages import job_memory as JM
    from mgpu_backend.stages.pipelines import GenerateRequest

    pipeline = _pipeline(tmp_path, "cuda", torch.bfloat16)
    want = pipeline.generate(GenerateRequest(**SMALL))
    assert "text encoder kept" in want.rank_reports[0].speed[0]
    job = pipeline.plan_job(GenerateRequest(**SMALL))
    monkeypatch.setattr(J, "RESERVE_BYTES", 0)
    monkeypatch.setattr(J, "RESERVE_SHARE", 0.0)
    service = pipeline.text_service()
    device = torch.device("cuda")
    encoder, encoder_act = JM.encoder_figures(service, device)
    assert encoder == JM.module_bytes(service.encoder.model, device) > 0 and encoder_act > 0
    # the plan's view from here on: the encoder's bytes wherever it is, its forward never the peak
    monkeypatch.setattr(JM, "encoder_figures", lambda service, device: (encoder, 0))
    pipeline.components.transformer._ltx2_forward_graphs.clear()
    free_plan = pipeline.plan_memory(job)
    assert free_plan.encoder == "keep" and not free_plan.fallbacks
    peak = max(s.peak for s in free_plan.stages)  # = base (with the encoder) + graph pool + 2 × activations
    # room to encode (base) and for every stage without the encoder, not for the largest with it
    budget = max(free_plan.encode_peak, peak - encoder)
    assert budget < peak
    monkeypatch.setattr(JM, "gpu_budget", lambda d: budget)
    plan = pipeline.plan_memory(job)
    assert plan.encoder == "offload"
    got = pipeline.generate(GenerateRequest(**SMALL))
    assert service.offloaded and next(service.encoder.model.parameters()).device.type == "cpu"
    assert any("moved to host memory after encoding" in line for line in got.rank_reports[0].speed)
    assert torch.equal(got.frames, want.frames)
    graphs = pipeline.components.transformer._ltx2_forward_graphs
    before = {key: entry.replays for key, entry in graphs.entries.items()}
    captures = graphs.captures
    # a plan without room for stage 2's graphs (the decision itself: the tests above): it runs eagerly
    eager_plan = J.JobMemoryPlan("keep", False, plan.encode_peak, (
        plan.stages[0], J.StagePlan("stage 2", False, False, 0, ("forwards eager, not graphed (~1 % slower)",))),
        budget)
    monkeypatch.setattr(pipeline, "plan_memory", lambda job: eager_plan)
    eager = pipeline.generate(GenerateRequest(**SMALL))
    speed = eager.rank_reports[0].speed
    assert any(line.startswith("memory plan: stage 2: forwards eager, not graphed") for line in speed)
    assert any("stage 2: forwards eager (the job's memory plan)" in line for line in speed)
    replayed = [key for key, entry in graphs.entries.items() if entry.replays > before.get(key, 0)]
    # stage 1 replayed the graphs `got` captured; stage 2's (the other token count) did not replay, none captured
    assert 0 < len(replayed) < len(before) and graphs.captures == captures
    assert float((eager.frames - want.frames).abs().max()) < 2e-2
    monkeypatch.setattr(pipeline, "plan_memory", lambda job: plan)  # offload: a new prompt brings the encoder back
    again = pipeline.generate(GenerateRequest(**dict(SMALL, prompt="a hare in the snow")))  # a cache miss
    assert service.offloaded and again.frames.shape == want.frames.shape


def test_eager_native_forwards_are_named_with_their_cost():
    """`stages.native.eager_cost`: each distinct reason once, with GRAPH_GAIN's share at the forward's token count
    (23 % at 1,536 tokens, 3 % at 3,520: the table's points)."""
    from mgpu_backend.stages.native import eager_cost

    why = "native forward not capturable (OutOfMemoryError: no room)"
    assert eager_cost([why, why], 1536) == (f"{why}: forwards eager, ~23 % slower at 1,536 video tokens per rank",)
    assert eager_cost([why], 3520) == (f"{why}: forwards eager, ~3 % slower at 3,520 video tokens per rank",)
    assert eager_cost([], 3520) == ()
