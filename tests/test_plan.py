"""The parallel plan picks a split that pays: fewer SP ranks for stages with few tokens per rank."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.models.gemma import load_gemma
from mgpu_backend.models.loader import ComponentFiles, load_components
from mgpu_backend.testing.tiny import make_tiny
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline

torch.set_num_threads(1)

REQUEST = dict(prompt="a fox in the snow", width=128, height=128, frames=9, steps=2, seed=5)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {k: str(v) for k, v in make_tiny(tmp_path_factory.mktemp("plan"), "2.0", seed=0).items()}


def _degrees(rank, world, checkpoint):
    from mgpu_backend.protocol.fleet_config import FleetPolicy
    from mgpu_backend.splits.plan import build_plan

    components = load_components(checkpoint, dtype=torch.float32)
    plan = build_plan(components.transformer, rank, world, torch.device("cpu"), FleetPolicy(min_tokens_per_rank=8))
    return {tokens: plan.stage(tokens).degree for tokens in (40, 32, 20, 12, 3)}


def test_stage_degree_keeps_enough_tokens_per_rank(paths):
    """8 heads on 4 ranks, at least 8 tokens per rank: 40 and 32 tokens -> 4 ranks, 20 -> 2, 12 and 3 -> 1 —
    the same decision on every rank (each builds every group)."""
    results = run_ranks(_degrees, 4, paths["checkpoint"])
    assert results == [{40: 4, 32: 4, 20: 2, 12: 1, 3: 1}] * 4


def _policies(rank, world, checkpoint):
    """The plan's degree policy per device type and configuration (no CUDA needed: only the policy is read)."""
    from mgpu_backend.protocol.fleet_config import FleetPolicy
    from mgpu_backend.splits.plan import build_plan

    transformer = load_components(checkpoint, dtype=torch.float32).transformer
    out = {}
    for name, device, min_tokens in (("cuda default", "cuda", None), ("cuda explicit", "cuda", 8),
                                     ("cpu default", "cpu", None)):
        plan = build_plan(transformer, rank, world, torch.device(device), FleetPolicy(min_tokens_per_rank=min_tokens))
        degrees = {tokens: plan.stage(tokens).degree for tokens in (40, 12, 10 ** 6)}
        out[name] = {"cost": plan.cost_model is not None, "stages": sorted(plan.stages), "degrees": degrees,
                     "describe": plan.describe(plan.choose(10 ** 6)), "shape": plan.shape}
    return out


def test_cuda_fleets_pick_the_degree_by_the_cost_model(paths):
    """On CUDA (FleetConfig.min_tokens_per_rank None) every degree's group is built and each stage runs at the cost
    model's choice for this transformer's shape, the report saying why; an explicit minimum replaces the model; CPU
    fleets keep the full degree."""
    from mgpu_backend.splits import cost as C

    results = run_ranks(_policies, 4, paths["checkpoint"])
    assert all(r == results[0] for r in results[1:])
    got = results[0]
    shape = got["cuda default"]["shape"]
    assert got["cuda default"]["cost"] and shape.blocks < 48 and got["cuda default"]["stages"] == [1, 2, 4]
    assert got["cuda default"]["degrees"] == {t: C.best_sp_degree(t, [1, 2, 4], shape, C.default_model())
                                              for t in (40, 12, 10 ** 6)}
    assert "the cost model predicts" in got["cuda default"]["describe"]
    assert not got["cuda explicit"]["cost"] and got["cuda explicit"]["degrees"] == {40: 4, 12: 1, 10 ** 6: 4}
    assert not got["cpu default"]["cost"] and got["cpu default"]["stages"] == [4]
    assert got["cpu default"]["degrees"] == {40: 4, 12: 4, 10 ** 6: 4}


def _generate(rank, world, paths):
    from mgpu_backend.protocol.fleet_config import FleetPolicy
    from mgpu_backend.splits.plan import build_plan

    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)
    plan = build_plan(components.transformer, rank, world, torch.device("cpu"), FleetPolicy(min_tokens_per_rank=10 ** 6))
    pipeline = TwoStagePipeline(components, load_gemma(paths["gemma"]), plan=plan)
    result = pipeline.generate(GenerateRequest(**REQUEST))
    return {"audio_latent": result.audio_latent, "report": result.parallel_report}


def test_small_stage_runs_on_one_rank_and_equals_one_process(paths):
    """With a minimum no stage reaches, stage 1 runs on rank 0 alone (the others receive its result): its latent
    equals the one-process run bit for bit, on every rank, and the report says why."""
    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)
    reference = TwoStagePipeline(components, load_gemma(paths["gemma"])).generate(GenerateRequest(**REQUEST))
    results = run_ranks(_generate, 2, paths)
    for r in results:
        assert torch.equal(r["audio_latent"], reference.audio_latent)
    assert "on 1 of 2 ranks" in results[0]["report"] and "would not pay" in results[0]["report"]


def _policy_switches(rank, world, paths):
    """One fleet's groups, a plan per policy the way a fleet makes one per job (no group is created; each plan a
    new frozen value, the earlier ones unchanged)."""
    import dataclasses

    import torch.distributed as dist

    from mgpu_backend.splits.plan import ParallelPlan, build_plan
    from mgpu_backend.protocol.validation import ValidationError

    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)
    plan = build_plan(components.transformer, rank, world, torch.device("cpu"))  # CPU default: full degree
    first, first_policy = plan, plan.policy
    created = []
    new_group = dist.new_group
    dist.new_group = lambda *a, **k: created.append(a) or new_group(*a, **k)
    try:
        out = {"built": sorted(plan.all_stages), "pass groups built": sorted(plan.all_pass_groups)}
        for name, policy in (("sp1 on", dict(sp_degree=1, guidance_parallel="on")),
                             ("min8", dict(min_tokens_per_rank=8, guidance_parallel="off")),
                             ("sp2", dict(sp_degree=2, min_tokens_per_rank=0, guidance_parallel="off"))):
            plan = ParallelPlan.for_policy(plan.groups, **policy)
            out[name] = {"degree": plan.sp_degree, "stages": sorted(plan.stages), "passes": sorted(plan.pass_groups),
                         "at 40": plan.stage(40).degree, "at 12": plan.stage(12).degree,
                         "same groups": all(plan.stages[d] is plan.all_stages[d] for d in plan.stages)}
        try:
            plan = plan.for_policy(plan.groups, sp_degree=3)
        except ValidationError as exc:
            out["refused"] = str(exc)
        out["kept"] = plan.sp_degree
        try:
            plan.policy = first_policy
        except dataclasses.FrozenInstanceError:
            out["frozen"] = True
        out["first unchanged"] = first.policy is first_policy and first.sp_degree == 4 and plan.groups is first.groups
        # every stage on rank 0 alone
        plan = ParallelPlan.for_policy(plan.groups, min_tokens_per_rank=10 ** 6, guidance_parallel="off")
        pipeline = TwoStagePipeline(components, load_gemma(paths["gemma"]), plan=plan)
        result = pipeline.generate(GenerateRequest(**REQUEST))
        out["audio_latent"], out["report"] = result.audio_latent, result.parallel_report
    finally:
        dist.new_group = new_group
    out["created"] = created
    return out


def test_policy_changes_pick_among_the_groups_built_at_start(paths):
    """`ParallelPlan.for_policy` (what a fleet does when a job brings another policy): every SP degree's group and
    every guidance-pass group exists from `build_plan` on; a policy only picks among them (no collective, no new
    group) in a new frozen plan, the earlier plans unchanged; a degree the heads do not allow is refused, and a run
    under the new policy equals the one-process run bit for bit."""
    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)
    reference = TwoStagePipeline(components, load_gemma(paths["gemma"])).generate(GenerateRequest(**REQUEST))
    results = run_ranks(_policy_switches, 4, paths)
    for r in results:
        assert r["created"] == []
        assert torch.equal(r["audio_latent"], reference.audio_latent)
    got = results[0]
    assert got["built"] == [1, 2, 4] and got["pass groups built"] == [2, 3, 4]
    assert got["sp1 on"] == {"degree": 1, "stages": [1], "passes": [2, 3, 4], "at 40": 1, "at 12": 1,
                             "same groups": True}
    assert got["min8"] == {"degree": 4, "stages": [1, 2, 4], "passes": [], "at 40": 4, "at 12": 1,
                           "same groups": True}
    assert got["sp2"] == {"degree": 2, "stages": [2], "passes": [], "at 40": 2, "at 12": 2, "same groups": True}
    assert "degree 3 is not possible" in got["refused"] and got["kept"] == 2
    assert got["frozen"] and got["first unchanged"]
    assert "on 1 of 4 ranks" in got["report"] and "would not pay" in got["report"]


def _cancel_on_three(rank, world, paths):
    from mgpu_backend.protocol.fleet_config import FleetPolicy
    from mgpu_backend.splits.plan import build_plan
    from mgpu_backend.engine.sampling import SamplingCancelled

    components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]), dtype=torch.float32)
    plan = build_plan(components.transformer, rank, world, torch.device("cpu"))
    pipeline = TwoStagePipeline(components, load_gemma(paths["gemma"]), plan=plan)
    try:
        pipeline.generate(GenerateRequest(**REQUEST), cancel_check=lambda stage, step, group: step == 1)
    except SamplingCancelled as exc:
        return {"degree": plan.sp_degree, "cancelled": str(exc)}
    return {"degree": plan.sp_degree, "cancelled": None}


def test_cancel_on_the_sp_subgroup_reaches_the_other_ranks(paths):
    """3 ranks, SP on ranks 0-1: a cancel taken by the SP group stops rank 2 too (it is told, instead of waiting
    forever for the stage result)."""
    results = run_ranks(_cancel_on_three, 3, paths, timeout_s=60.0)
    assert [r["degree"] for r in results] == [2, 2, 2]
    assert all(r["cancelled"] for r in results), results
    assert "sequence-parallel ranks" in results[2]["cancelled"]


def test_explicit_sp_degree_the_heads_do_not_allow_is_refused_before_any_worker(paths, tmp_path, monkeypatch,
                                                                                 capsys):
    """`--sp-degree 3` with 8 heads: refused by the controller from the checkpoint header, before a fleet starts,
    naming the valid degrees; the CLI prints the message (no traceback) and exits 2."""
    from mgpu_backend.serving import cli
    from mgpu_backend.serving.controller import check_config
    from mgpu_backend.protocol.errors import ControllerError
    from mgpu_backend.protocol.fleet_config import FleetConfig

    config = FleetConfig(devices=("cpu",) * 4, checkpoint=paths["checkpoint"], gemma=paths["gemma"], sp_degree=3)
    with pytest.raises(ControllerError, match=r"degree 3 is not possible with 8 attention heads on 4 rank\(s\).*"
                                              r"valid degrees: 1, 2, 4"):
        check_config(config)
    check_config(FleetConfig(devices=("cpu",) * 4, checkpoint=paths["checkpoint"], gemma=paths["gemma"],
                             sp_degree=2))  # allowed
    monkeypatch.setenv("LTX2_MGPU_RUNTIME_DIR", str(tmp_path / "rt"))
    code = cli.main(["generate", "--checkpoint", paths["checkpoint"], "--gemma", paths["gemma"], "--upscaler",
                     paths["upsampler"], "--prompt", "p", "--width", "128", "--height", "128", "--frames", "9",
                     "--world-size", "4", "--sp-degree", "3", "--output", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    try:
        assert code == 2 and "valid degrees: 1, 2, 4" in err, err
    finally:
        cli.main(["stop"])


def test_a_bad_checkpoint_is_refused_before_the_running_fleet_is_torn_down(paths, tmp_path):
    """The controller checks the new checkpoint's header first: a non-LTX file is refused with the file named."""
    from safetensors.torch import save_file

    from mgpu_backend.serving.controller import check_config
    from mgpu_backend.protocol.errors import ControllerError
    from mgpu_backend.protocol.fleet_config import FleetConfig

    other = tmp_path / "other.safetensors"
    save_file({"model.layers.0.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(ControllerError, match="other.safetensors: not an LTX-2 checkpoint"):
        check_config(FleetConfig(devices=("cpu",), checkpoint=str(other), gemma=paths["gemma"]))


def test_distilled_job_header_names_each_stages_own_split():
    """The distilled preset splits both stages, possibly differently (the cost model sees different token counts):
    the job header then names each; one line when they agree; the two-stage header is stage 1's."""
    from mgpu_backend.protocol.job_results import DecodeReport, GenerateTimings, RankReport
    from mgpu_backend.stages.pipelines import _parallel_summary

    def report(stage_1: str, stage_2: str) -> RankReport:
        return RankReport(0, stage_1, stage_2, DecodeReport("untiled", 0.0), GenerateTimings())

    differ = report("sequence parallel on 1 of 2 ranks: few tokens", "sequence parallel over all 2 ranks: many tokens")
    assert _parallel_summary(differ, distilled=True) == ("stage 1: sequence parallel on 1 of 2 ranks: few tokens; "
                                                         "stage 2: sequence parallel over all 2 ranks: many tokens")
    assert _parallel_summary(differ, distilled=False) == differ.stage_1
    assert _parallel_summary(report("same", "same"), distilled=True) == "same"
    passes = report("stage 1: guidance passes in parallel on 2 ranks", "sequence parallel over all")
    assert _parallel_summary(passes, distilled=True) == ("stage 1: guidance passes in parallel on 2 ranks; "
                                                         "stage 2: sequence parallel over all")
