"""Sharded weights (issue 26): the transformer's block layers sharded over the ranks with FSDP2
(`mgpu_backend/weights/sharding.py`), on real gloo process groups.

What is asserted:
- the native MODEL's forward with sharded weights equals the same fleet with replicated weights **bit for bit**
  (an FSDP all-gather copies bytes, so every layer computes with the very weights of a replica), and equals ComfyUI
  0.33's own forward (the goldens of test_native_forward.py) within that file's tolerance — on 2 and 4 ranks
  (sequence parallel over all of them, weights sharded over all of them), for the float32 single file and the bf16
  and int8-convrot transformer-only files;
- a LoRA fused into the shards (each rank its own rows) gives the replicated fleet's fused output bit for bit, and
  `lora=None` gives the clean weights back exactly (every rank's shards equal the loaded shards);
- the stage jobs (SP Sampler / CLI stage 1, tiled stage 2 with the distilled LoRA, stage 1 again) on the bf16 and
  fp8 checkpoints: sharded equals replicated bit for bit; fp8 weights stay float8 in their shards;
- what a rank holds: its shards are 1/W of the units' bytes (to one row per parameter), the rest is replicated;
- the policies a sharded fleet cannot follow are refused by name before any work (a sub-group SP degree, batch rows
  or guidance passes spread over ranks, a tile count that is not a multiple of W, compile);
- placed weights (issue 35: some blocks whole, the rest sharded; `fleet_rules.place_weights`): the workers'
  `WorkerState` places an 8-block tiny transformer in the budget — given per GPU (`gpu_budget_gib`, 4 ranks) or
  different on each rank (2 ranks: they agree on the smallest) — as the hand-derived mix of whole and sharded units,
  and its native forwards and LoRA equal the replicated fleet's bit for bit, sequence parallel over the same ranks;
  an explicit mix (one block sharded, one whole) gives the stage jobs' bits on the fp8 file; a budget too small is
  refused on every rank before any weight is read, naming the budget, the need and what would fit.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _dist import run_ranks
from test_native_forward import _check_lora, _run_jobs, _run_lora, check_outputs, golden, load_golden  # noqa: F401

torch.set_num_threads(1)

CASES = ("t2v_b2", "i2v_b2", "stg_b1", "guides_s07_b2", "ic_lora_b1", "ref_audio_b2")


def _components(checkpoint: str, dtype: torch.dtype, transformer_only: bool):
    from mgpu_backend.models.loader import load_components

    return load_components(checkpoint, dtype=dtype, device=torch.device("cpu"), transformer_only=transformer_only)


def _state(components, rank: int, world: int, sharded: bool, dtype: torch.dtype, units: tuple[int, ...] | None = None):
    """What the jobs need of a worker (components, plan, dtype, device): replicated, or `sharded` — every unit, or
    the `units` given (the others whole: a placement)."""
    from mgpu_backend.protocol.fleet_config import FleetPolicy
    from mgpu_backend.protocol.fleet_rules import WeightPlacement
    from mgpu_backend.splits.plan import build_plan
    from mgpu_backend.weights.sharding import shard_transformer, units_of

    device = torch.device("cpu")
    connectors = (components.video_connector, components.audio_connector)
    placement = None if units is None else WeightPlacement(  # only which units: no budget, no sizes
        requested="placed", world_size=world, units=len(units_of(components.transformer, connectors)),
        block_units=len(components.transformer.transformer_blocks), sharded=units, budget_bytes=None,
        reserve_bytes=0, resident_bytes=0, gathered_bytes=0, transient_bytes=0)
    report = shard_transformer(components.transformer, device, connectors=connectors,
                               placement=placement) if sharded else None
    plan = build_plan(components.transformer, rank, world, device,
                      FleetPolicy(min_tokens_per_rank=0, guidance_parallel="off"), sharded=sharded)
    return SimpleNamespace(components=components, plan=plan, dtype=dtype, device=device), report


def _native_rank(rank: int, world: int, checkpoint: str, lora_path: str, dtype_name: str,
                 transformer_only: bool) -> dict:
    """The golden cases and the LoRA sequence, replicated then sharded, on this rank; rank 0 returns the outputs."""
    from mgpu_backend.models.quant import Int8Linear
    from mgpu_backend.weights.sharding import units_of

    meta, tensors = load_golden()
    dtype = getattr(torch, dtype_name)
    out = {}
    for sharded in (False, True):
        components = _components(checkpoint, dtype, transformer_only)
        state, report = _state(components, rank, world, sharded, dtype)
        if sharded:
            connectors = (components.video_connector, components.audio_connector)
            loaded = [p.to_local().clone() for u in units_of(components.transformer, connectors)
                      for p in u.parameters()]
        jobs = _run_jobs(state, rank, meta, tensors, CASES)
        lora = _run_lora(state, rank, meta, tensors, lora_path)
        entry = {"jobs": jobs, "lora": lora}
        if sharded:
            after = [p.to_local() for u in units_of(components.transformer, connectors) for p in u.parameters()]
            entry["restored_exactly"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                            for a, b in zip(loaded, after))
            entry["report"] = report
            # as the layers read them: int8 weights are held as float8 views of their bytes (sharding.py)
            entry["dtypes"] = sorted({str((m.int8_weight(p.to_local()) if isinstance(m, Int8Linear) and n == "weight"
                                           else p.to_local()).dtype)
                                      for u in units_of(components.transformer) for m in u.modules()
                                      for n, p in m.named_parameters(recurse=False)})
            entry["plan"] = state.plan.describe()
        out["sharded" if sharded else "replicated"] = entry
    return out


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_equal_outputs(sharded: dict, replicated: dict) -> None:
    for name, (video, audio) in replicated["jobs"]["outputs"].items():
        s_video, s_audio = sharded["jobs"]["outputs"][name]
        assert _same(s_video, video) and _same(s_audio, audio), f"{name}: sharded differs from replicated"
    assert _same(sharded["jobs"]["text"], replicated["jobs"]["text"]), "the connectors differ"
    for key in ("text", "text_clean"):  # the connectors with and without their LoRA
        assert _same(sharded["lora"][key].context, replicated["lora"][key].context), key
    for key in ("clean", "fused", "kept", "restored"):
        assert _same(sharded["lora"][key].video, replicated["lora"][key].video), key
        assert _same(sharded["lora"][key].audio, replicated["lora"][key].audio), key


@pytest.mark.parametrize("world", [2, 4])
def test_native_forward_sharded_equals_replicated_and_comfyui(golden, world):
    ranks = run_ranks(_native_rank, world, golden.checkpoint, golden.lora, "float32", False, timeout_s=300.0)
    replicated, sharded = ranks[0]["replicated"], ranks[0]["sharded"]
    _assert_equal_outputs(sharded, replicated)
    check_outputs(sharded["jobs"]["outputs"], golden.tensors)  # ComfyUI 0.33's own forward
    _check_lora(sharded["lora"], golden)
    assert all(r["sharded"]["restored_exactly"] for r in ranks), "a LoRA restore left a shard changed"
    assert sharded["plan"].startswith(f"sequence parallel over all {world} ranks, weights sharded")
    assert set(sharded["jobs"]["reports"].values()) == {sharded["plan"]}
    for r in ranks:  # each rank holds 1/W of the units (to one row per parameter) and the whole rest
        rep = r["sharded"]["report"]
        assert rep.world_size == world and rep.units == 2 + 2  # the tiny model: 2 blocks, 2 connectors of 1 block
        # dim 0 split as torch.chunk does: the first ranks hold one row more of a parameter whose rows W does not
        # divide (the tiny model's narrow rows: a few KiB)
        assert rep.sharded_bytes <= rep.unit_bytes / world * 1.05 + 4096
        assert rep.resident_bytes < rep.replica_bytes
    assert sum(r["sharded"]["report"].sharded_bytes for r in ranks) == ranks[0]["sharded"]["report"].unit_bytes


@pytest.mark.parametrize("file,dtype,expect", [("transformer", "bfloat16", "torch.bfloat16"),
                                               ("transformer_int8", "bfloat16", "torch.int8")])
def test_native_forward_sharded_quantized_files(golden, tiny_components_23, file, dtype, expect):
    """bf16 and int8-convrot transformer-only files (the native MODEL's `diffusion_models/` files): sharded equals
    replicated bit for bit on 2 ranks, int8 weights stay int8 in the shards."""
    ranks = run_ranks(_native_rank, 2, str(tiny_components_23[file]), golden.lora, dtype, True, timeout_s=300.0)
    replicated, sharded = ranks[0]["replicated"], ranks[0]["sharded"]
    _assert_equal_outputs(sharded, replicated)
    assert expect in sharded["dtypes"], sharded["dtypes"]
    assert all(r["sharded"]["restored_exactly"] for r in ranks)


@pytest.fixture(scope="module")
def tiny_components_23(tmp_path_factory):
    from mgpu_backend.testing.tiny import write_tiny_component_files

    return write_tiny_component_files(tmp_path_factory.mktemp("sharded_files"), "2.3", seed=0)


# ---- the stage jobs (CLI, SP Sampler, TDP Upscale) -----------------------------------------------------------------

def _stage_rank(rank: int, world: int, checkpoint: str, distilled: str, placed: bool = False) -> dict:
    """Stage 1 (sequence parallel), stage 2 (tiled, distilled LoRA), stage 1 again, replicated then sharded (and,
    `placed`, with transformer block 0 sharded and block 1 and the connectors whole)."""
    from test_lora_fleet import _Ctx, _payload

    from mgpu_backend.serving.jobs import stages
    from mgpu_backend.weights.lora import read_loras
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    jobs = [("stage1", "sequence_parallel", []), ("stage2", "tiled", [(distilled, 1.0)]),
            ("stage1 again", "sequence_parallel", [])]
    out = {}
    for mode in ("replicated", "sharded") + (("placed",) if placed else ()):
        sharded = mode != "replicated"
        components = _components(checkpoint, torch.bfloat16, False)
        state, _ = _state(components, rank, world, sharded, torch.bfloat16, (0,) if mode == "placed" else None)
        pipe = TwoStagePipeline(components, None, dtype=torch.bfloat16, plan=state.plan)
        results = {}
        for name, split, loras in jobs:
            r = stages.run_sample(SimpleNamespace(pipeline=pipe), _payload(split, loras), _Ctx(rank))
            results[name] = (getattr(r, "video", None), getattr(r, "audio", None), getattr(r, "lora_reports", None))
        read_loras  # noqa: B018 - the LoRA files are read by the job itself
        if sharded:
            from mgpu_backend.weights.sharding import local_shard, sharding_of, units_of

            results["dtypes"] = sorted({str(local_shard(p).dtype) for u in units_of(components.transformer)
                                        for p in u.parameters()})
            results["report"] = sharding_of(components.transformer)
        out[mode] = results
    return out


@pytest.mark.parametrize("file,expect,placed", [("checkpoint", "torch.bfloat16", False),
                                                ("checkpoint_fp8", "torch.float8_e4m3fn", True)])
def test_stage_jobs_sharded_equal_replicated(tiny_dir, file, expect, placed):
    """Sharded — and on the fp8 file placed, block 0 sharded and block 1 whole (an fp8 block in each form, the tiled
    stage's lockstep rule in force) — equal replicated bit for bit through the stage jobs."""
    files = tiny_dir["2.0"]
    ranks = run_ranks(_stage_rank, 2, str(files[file]), str(files["distilled_lora"]), placed, timeout_s=300.0)
    replicated = ranks[0]["replicated"]
    for mode in ("sharded", "placed") if placed else ("sharded",):
        sharded = ranks[0][mode]
        for name in ("stage1", "stage2", "stage1 again"):
            for i, what in enumerate(("video", "audio")):
                a, b = sharded[name][i], replicated[name][i]
                assert (a is None) == (b is None), (name, what)
                if a is not None:
                    assert _same(a, b), f"{name} {what}: {mode} differs from replicated"
            assert sharded[name][2] == replicated[name][2], name  # the LoRA coverage reports
        assert _same(sharded["stage1 again"][0], sharded["stage1"][0]), "the LoRA was not restored exactly"
        assert expect in sharded["dtypes"], sharded["dtypes"]
    if placed:  # 4 units: blocks 0 and 1, one block per connector; only block 0 sharded
        report = ranks[0]["placed"]["report"]
        assert (report.units, report.replicated_units, report.sharded_units) == (4, 3, 1)
        assert report.describe().startswith("weights placed: 3 of 4 units replicated, 1 sharded over 2 ranks;")


# ---- placed weights: the workers place the blocks in the fleet's budget ---------------------------------------------

PLACED_CASES = ("t2v_b2", "i2v_b2", "stg_b1")
DEEP_BLOCKS = 8  # the placed tests' transformer: the tiny model with 8 blocks (2 blocks never pay for a gather)
# the fewest sharded units whose placement fits, of the 8 blocks + 2 connector units (hand-derived from the sizes:
# each sharded float32 block of ~0.40 MB saves (W - 1)/W of it, the first sharded block adds two gathered blocks)
PLACED = {2: (6, (1, 3, 5, 7, 8, 9)), 4: (5, (1, 4, 6, 8, 9))}


@pytest.fixture(scope="module")
def deep_transformer(tmp_path_factory) -> str:
    """The tiny LTX-2.3 transformer with 8 blocks (float32, `diffusion_models/` layout)."""
    from mgpu_backend.testing import tiny

    original = tiny.tiny_transformer_metadata
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "tiny_transformer_metadata", lambda variant: {**original(variant), "num_layers": DEEP_BLOCKS})
        return str(tiny.write_tiny_transformer(tmp_path_factory.mktemp("placed") / "ltx-2.3-tiny-8-blocks.safetensors",
                                               "2.3", seed=0, dtype=torch.float32))


def _placed_rank(rank: int, world: int, checkpoint: str, lora_path: str, uneven: bool) -> dict:
    """A replicated `WorkerState`, then one with weights="placed" in a budget where the fewest sharded units that fit
    are `PLACED[world]`'s count: `gpu_budget_gib` on every rank (even), or (uneven) each rank's GPU reporting a
    different budget, the last rank the smallest. The golden cases and the LoRA sequence on each; then the
    refusals of a budget too small."""
    from mgpu_backend.models.loader import weight_bytes
    from mgpu_backend.protocol import fleet_rules as F
    from mgpu_backend.protocol.fleet_config import FleetIdentity, FleetPolicy
    from mgpu_backend.protocol.validation import ValidationError
    from mgpu_backend.serving.worker import WorkerState
    from mgpu_backend.weights import sharding

    meta, tensors = load_golden()
    policy = FleetPolicy(min_tokens_per_rank=0, guidance_parallel="off")  # sequence parallel over all ranks
    base = dict(devices=("cpu",) * world, checkpoint=checkpoint, gemma=None, transformer_only=True, dtype="float32")
    sizes = weight_bytes([checkpoint], torch.float32, transformer_only=True)
    needs = [F.placement_of(sizes, world, F.sharded_units(k, DEEP_BLOCKS, 2)).need_bytes
             for k in range(DEEP_BLOCKS + 3)]
    count = PLACED[world][0]
    assert needs[count] < min(needs[:count]), needs  # the model's sizes make `count` the first that fits
    budget = (needs[count] + min(needs[:count])) // 2
    out = {"budget": budget}
    rank_budget = sharding.rank_budget
    for weights in ("replicated", "placed"):
        gib = budget / F.GiB if weights == "placed" and not uneven else None
        if weights == "placed" and uneven:  # this rank's GPU: rank 0 has the most memory (enough for a replica)
            sharding.rank_budget = lambda device, cap, mine=budget + (world - 1 - rank) * F.GiB: mine
        try:
            state = WorkerState(FleetIdentity(**base, weights=weights, gpu_budget_gib=gib), policy, rank,
                                torch.device("cpu"))
        finally:
            sharding.rank_budget = rank_budget
        entry = {"jobs": _run_jobs(state, rank, meta, tensors, PLACED_CASES),
                 "lora": _run_lora(state, rank, meta, tensors, lora_path), "placement": state.placement,
                 "report": state.sharding, "agreed": state.budget}
        out[weights] = entry
    refusals = {}
    # replicated in the budget that holds the placement; placed in a budget below every placement's need
    for weights, gib in (("replicated", budget / F.GiB), ("placed", (min(needs) - 2 ** 20) / F.GiB)):
        try:
            WorkerState(FleetIdentity(**base, weights=weights, gpu_budget_gib=gib), policy, rank, torch.device("cpu"))
            refusals[weights] = "accepted"
        except ValidationError as exc:
            refusals[weights] = str(exc)
    out["refusals"] = refusals
    out["needs"] = needs
    return out


@pytest.mark.parametrize("world,uneven", [(2, True), (4, False)], ids=["W2-uneven-budgets", "W4-gpu_budget_gib"])
def test_placed_weights_equal_replicated(golden, deep_transformer, world, uneven):
    ranks = run_ranks(_placed_rank, world, deep_transformer, golden.lora, uneven, timeout_s=300.0)
    count, units = PLACED[world]
    replicated, placed = ranks[0]["replicated"], ranks[0]["placed"]
    _assert_equal_outputs(placed, replicated)
    assert set(replicated["jobs"]["outputs"]) == set(PLACED_CASES)
    budget = ranks[0]["budget"]
    for r in ranks:
        p = r["placed"]["placement"]
        # every rank placed the same units in the smallest budget (uneven: the last rank's)
        assert r["placed"]["agreed"] == budget and p.budget_bytes == budget
        assert p.sharded == units and p.mode == "placed" and p.replicated_units == 10 - count
        assert p.need_bytes <= budget
        assert r["replicated"]["placement"].sharded == () and r["replicated"]["agreed"] is None  # CPU: unbounded
        rep = r["placed"]["report"]
        assert (rep.units, rep.replicated_units, rep.world_size) == (10, 10 - count, world)
        assert rep.resident_bytes < rep.replica_bytes and not r["replicated"]["report"].sharded_units
        # what a rank holds and receives, as the header predicted (FSDP rounds each parameter's rows up: the first
        # ranks hold a row more of a parameter whose rows W does not divide — a few KiB here)
        assert abs(rep.resident_bytes - p.resident_bytes) <= 16 * 1024, (rep.resident_bytes, p.resident_bytes)
        assert abs(rep.gathered_bytes - p.gathered_bytes) <= 16 * 1024, (rep.gathered_bytes, p.gathered_bytes)
    whole = ranks[0]["placed"]["report"]  # the ranks' shards together are the sharded units, byte for byte
    assert sum(r["placed"]["report"].sharded_bytes for r in ranks) == whole.unit_bytes - whole.whole_unit_bytes
    assert ranks[0]["placed"]["report"].describe().startswith(
        f"weights placed: {10 - count} of 10 units replicated, {count} sharded over {world} ranks; resident ")
    needs = ranks[0]["needs"]
    for r in ranks:  # refused on every rank before any weight, naming the budget, the need and what would fit
        message = r["refusals"]["replicated"]
        assert message.startswith(f"cpu: a budget of {budget / 2 ** 30:.1f} GiB per GPU (gpu_budget_gib=")
        assert f"cannot hold replicated weights: that needs {needs[0] / 2 ** 30:.1f} GiB" in message, message
        assert f"Would fit: weights='placed' ({10 - count} of 10 units replicated, " in message, message
        assert r["refusals"]["placed"].startswith("cpu: a budget of "), r["refusals"]["placed"]
        assert f"cannot hold weights='placed' (its smallest need: " in r["refusals"]["placed"]


# ---- refusals -------------------------------------------------------------------------------------------------------

def test_sharded_policy_refusals():
    from mgpu_backend.protocol.fleet_rules import check_sharded_policy
    from mgpu_backend.protocol.validation import ValidationError

    check_sharded_policy(4, None, None, "auto", heads=32)  # the default policy is fine
    check_sharded_policy(2, 2, 0, "off", heads=8)
    with pytest.raises(ValidationError, match="must divide the transformer's 32 attention heads"):
        check_sharded_policy(3, None, None, "auto", heads=32)
    with pytest.raises(ValidationError, match="sp_degree=2 with sharded weights"):
        check_sharded_policy(4, 2, None, "auto")
    with pytest.raises(ValidationError, match="min_tokens_per_rank=4096 with sharded weights"):
        check_sharded_policy(4, None, 4096, "auto")
    with pytest.raises(ValidationError, match="guidance_parallel='on' with sharded weights"):
        check_sharded_policy(2, None, None, "on")
    from mgpu_backend.protocol.fleet_config import FleetIdentity

    with pytest.raises(ValueError, match="weights='fsdp': choose one of auto, replicated, placed, sharded"):
        FleetIdentity(devices=("cpu",), checkpoint="x.safetensors", gemma=None, weights="fsdp")


def _tiles_rank(rank: int, world: int, checkpoint: str) -> str:
    from mgpu_backend.splits.tiling import TileCountConfig
    from mgpu_backend.protocol.validation import ValidationError

    components = _components(checkpoint, torch.float32, False)
    state, _ = _state(components, rank, world, True, torch.float32)
    tiled = state.plan.tiled(components.transformer, (2, 4, 4), TileCountConfig.spatial(1, 2, 1))  # 2 tiles: fine
    assert len(tiled.my_tiles) == 1  # each rank one of the 2 tiles, in lockstep
    try:
        state.plan.tiled(components.transformer, (2, 4, 6), TileCountConfig.spatial(1, 3, 1))
    except ValidationError as exc:
        return str(exc)
    return "accepted"


def test_sharded_tiles_must_be_a_multiple_of_the_ranks(tiny_dir):
    messages = run_ranks(_tiles_rank, 2, str(tiny_dir["2.0"]["checkpoint"]), timeout_s=120.0)
    assert all(m.startswith("3 tiles over 2 ranks: with sharded weights") for m in messages), messages


# ---- memory planning -------------------------------------------------------------------------------------------------

def test_weight_bytes_from_the_header_equal_what_a_rank_holds(tiny_dir, tiny_components_23):
    """The header-only byte count the workers check the GPU's free memory with equals the modules the loader builds
    (bf16 single file, fp8 single file, int8 transformer-only file)."""
    from mgpu_backend.models.loader import load_components, weight_bytes
    from mgpu_backend.weights.sharding import units_of

    def held(components, transformer_only):
        mods = ((components.transformer, components.video_connector, components.audio_connector) if transformer_only
                else tuple(components.modules().values()))
        blocks = rest = 0
        for m in mods:
            for name, t in list(m.named_parameters()) + list(m.named_buffers()):
                n = t.numel() * t.element_size()
                if "transformer_blocks." in name:
                    blocks += n
                else:
                    rest += n
        return blocks, rest

    for path, only in ((tiny_dir["2.0"]["checkpoint"], False), (tiny_dir["2.0"]["checkpoint_fp8"], False),
                       (tiny_components_23["transformer_int8"], True)):
        sizes = weight_bytes([str(path)], torch.bfloat16, transformer_only=only)
        components = load_components(str(path), dtype=torch.bfloat16, transformer_only=only)
        blocks, rest = held(components, only)
        assert sizes.blocks == blocks, path
        # per unit, in the units' order (what a placement shards): the transformer's blocks, then the connectors'
        units = units_of(components.transformer, (components.video_connector, components.audio_connector))
        held_units = tuple(sum(t.numel() * t.element_size() for t in (*u.parameters(), *u.buffers())) for u in units)
        assert sizes.units == held_units and len(sizes.block_units) == 2 and len(sizes.connector_units) == 2, path
        if only:
            assert sizes.rest == rest, path
        else:  # the rest of a single file is an estimate: the loader keeps the vocoder in float32 (counted in the
            # compute dtype here) and builds some buffers the file does not hold; measured 3.4 % under on this file
            assert abs(sizes.rest - rest) <= 0.05 * rest, (path, sizes.rest, rest)


def test_check_fits_names_the_need_and_what_would_fit():
    from mgpu_backend.protocol.fleet_rules import GiB, WeightBytes, check_fits
    from mgpu_backend.protocol.validation import ValidationError

    sizes = WeightBytes(blocks=int(21 * GiB), rest=int(0.8 * GiB))  # the 22B fp8 file of bench_sharded
    check_fits("cuda:0", int(80 * GiB), sizes, "replicated", 1)
    check_fits("cuda:1", int(23 * GiB), sizes, "sharded", 2)
    with pytest.raises(ValidationError) as info:
        check_fits("cuda:1", int(23.5 * GiB), sizes, "replicated", 2)
    message = str(info.value)
    assert message.startswith("cuda:1 has 23.5 GiB free; this fleet needs 24.8 GiB on each GPU (replicated weights: "
                              "21.8 GiB of weights + 3 GiB for one forward)"), message
    assert "Would fit: sharded over 2 GPUs (14.3 GiB per GPU); sharded over 4 GPUs (9.0 GiB per GPU); sharded over 8 " \
           "GPUs (6.4 GiB per GPU)" in message
    with pytest.raises(ValidationError, match="Would fit: none of replicated or sharded over 2, 4 or 8 GPUs"):
        check_fits("cuda:0", int(4 * GiB), sizes, "sharded", 4)


def test_predicted_gather_seconds_per_link():
    """What the loader node reports per link: the bytes a rank does not hold, once per forward (22B fp8 at W = 2:
    ~1.1 s over PCIe without P2P, as bench/results/sharded_h200.txt predicts)."""
    from mgpu_backend.protocol.resources import LINKS_GBPS, sharded_gather_seconds

    bytes_22b_fp8 = 22_603_156_480  # the blocks of the 22B-shaped fp8 file (bench/results/sharded_h200.json)
    assert sharded_gather_seconds(bytes_22b_fp8, 2, LINKS_GBPS["PCIe 4.0 x16 without P2P"]) == pytest.approx(1.13, abs=0.01)
    assert sharded_gather_seconds(bytes_22b_fp8, 4, LINKS_GBPS["PCIe 4.0 x16 without P2P"]) == pytest.approx(1.69, abs=0.01)
    assert sharded_gather_seconds(bytes_22b_fp8, 1, 10.0) == 0.0
