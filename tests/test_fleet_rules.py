"""The fleet's rules (`protocol/fleet_rules.py`): each refusal names the value and the rule, the allowed cases pass;
the module stays torch-free; and the checkpoint-header service (`models/headers.py`) gives the facts the rules read
from the header alone."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_backend.protocol import fleet_rules as F
from mgpu_backend.protocol.errors import ValidationError
from mgpu_backend.protocol.fleet_config import FleetConfig, FleetIdentity, FleetPolicy

ROOT = Path(__file__).resolve().parent.parent
GiB = 2 ** 30
BASE = {"devices": ("cpu",) * 4, "checkpoint": "x.safetensors", "gemma": None}


def test_one_error_type():
    from mgpu_backend.protocol.validation import ValidationError as Same

    assert Same is ValidationError and issubclass(ValidationError, ValueError)


def test_the_module_is_pure():
    """Standard library only: the nodes import the rules (and the fleet config) without torch."""
    code = ("import sys; import mgpu_backend.protocol.fleet_rules, mgpu_backend.protocol.fleet_config; "
            "print(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- degrees and heads -----------------------------------------------------------------------------------------


def test_degrees():
    assert F.valid_sp_degrees(32) == [1, 2, 4, 8, 16, 32]
    assert F.valid_sp_degrees(32, 6) == [1, 2, 4]
    assert F.largest_sp_degree(32, 6) == 4 and F.largest_sp_degree(8, 12) == 8
    assert F.top_sp_degree(32, 6) == 4 and F.top_sp_degree(32, 6, 2) == 2
    F.check_sp_degree(8, 4)
    F.check_requested_degree(32, 4, 4)
    with pytest.raises(ValidationError, match=r"^sequence parallel degree 3 does not divide the 8 attention heads; "
                                              r"valid degrees: 1, 2, 4, 8$"):
        F.check_sp_degree(8, 3)
    with pytest.raises(ValidationError, match=r"sequence parallel degree 3 is not possible with 32 attention heads on "
                                              r"4 rank\(s\).*valid degrees: 1, 2, 4$"):
        F.check_requested_degree(32, 3, 4)
    with pytest.raises(ValidationError, match="degree 8 is not possible with 32 attention heads on 4 rank"):
        F.top_sp_degree(32, 4, 8)  # divides the heads, more than the ranks


# ---- sharded weights × the split, × compile --------------------------------------------------------------------


def test_sharded_policy():
    F.check_sharded_policy(4, None, None, "auto", heads=32)
    F.check_sharded_policy(4, 4, 0, "off", heads=32)  # the full degree, stated, is fine
    F.check_sharded_policy(3, None, None, "auto")  # heads unknown: their rule is not applied
    with pytest.raises(ValidationError, match=r"sharded weights over 3 ranks: .* must divide the transformer's 32 "
                                              r"attention heads \(use 2, 4, 8 ranks, or replicated weights\)"):
        F.check_sharded_policy(3, None, None, "auto", heads=32)
    with pytest.raises(ValidationError, match="^sp_degree=2 with sharded weights: every forward runs on all 4"):
        F.check_sharded_policy(4, 2, None, "auto")
    with pytest.raises(ValidationError, match="^min_tokens_per_rank=4096 with sharded weights"):
        F.check_sharded_policy(4, None, 4096, "auto")
    with pytest.raises(ValidationError, match="^guidance_parallel='on' with sharded weights"):
        F.check_sharded_policy(2, None, None, "on")


def test_sharded_tiles():
    F.check_sharded_tiles(4, 2)
    F.check_sharded_tiles(2, 2)
    with pytest.raises(ValidationError, match=r"^3 tiles over 2 ranks: with sharded weights .* must be a multiple of "
                                              r"2; choose tiles such as 1x2$"):
        F.check_sharded_tiles(3, 2)


def test_compile():
    F.check_compile("replicated", True)
    F.check_compile("sharded", False)
    with pytest.raises(ValidationError, match=r"^compile=True with weights='sharded': .* use replicated weights to "
                                              r"compile$"):
        F.check_compile("sharded", True)


# ---- int8 modes ------------------------------------------------------------------------------------------------


def test_int8_mode():
    for mode in F.INT8_COMPUTE_MODES:
        F.check_int8_mode("replicated", mode)
    F.check_int8_mode("sharded", "auto")
    F.check_int8_mode("sharded", "w8a8")
    with pytest.raises(ValidationError, match="^int8_compute='dequantize' with weights='sharded': the memory mode"):
        F.check_int8_mode("sharded", "dequantize")
    with pytest.raises(ValidationError, match="^int8_compute='int4': choose one of auto, w8a8, dequantize$"):
        F.check_int8_mode("replicated", "int4")
    # the identity applies the same rule when it is built
    with pytest.raises(ValidationError, match="^int8_compute='dequantize' with weights='sharded'"):
        FleetIdentity(**BASE, weights="sharded", int8_compute="dequantize")


def test_resolve_int8_compute_names_the_sizes():
    kw = {"int8_bytes": 22 * GiB, "dequantized_bytes": 44 * GiB, "reserve_bytes": 3 * GiB}
    assert F.resolve_int8_compute("auto", device_type="cuda", weights="replicated", free_bytes=47 * GiB,
                                  **kw)[0] == "dequantize"
    assert F.resolve_int8_compute("auto", device_type="cuda", weights="replicated", free_bytes=46 * GiB,
                                  **kw)[0] == "w8a8"
    with pytest.raises(ValidationError, match=r"^int8_compute='dequantize': 46.0 GiB free on this GPU, the weights "
                                              r"need 44.0 GiB dequantized"):
        F.resolve_int8_compute("dequantize", device_type="cuda", weights="replicated", free_bytes=46 * GiB, **kw)
    with pytest.raises(ValidationError, match="with weights='sharded'"):
        F.resolve_int8_compute("dequantize", device_type="cuda", weights="sharded", free_bytes=139 * GiB, **kw)


# ---- memory ----------------------------------------------------------------------------------------------------


def test_weight_bytes_and_fits():
    sizes = F.WeightBytes(blocks=10 * GiB, rest=GiB)
    assert sizes.per_rank("replicated", 4) == 11 * GiB
    assert sizes.per_rank("sharded", 4) == 10 * GiB // 4 + GiB
    assert F.WeightBytes(blocks=3, rest=0).per_rank("sharded", 2) == 2  # rounded up per rank
    F.check_fits("cuda:0", 14 * GiB, sizes, "replicated", 1)  # 11 + 3 reserved, exactly
    F.check_fits("cuda:0", 3 * GiB + 1, F.WeightBytes(0, 1), "replicated", 1)
    with pytest.raises(ValidationError, match=r"^cuda:0 has 13.0 GiB free; this fleet needs 14.0 GiB on each GPU "
                                              r"\(replicated weights: 11.0 GiB of weights \+ 3 GiB for one forward\)\. "
                                              r"Would fit: sharded over 2 GPUs \(9.0 GiB per GPU\)"):
        F.check_fits("cuda:0", 13 * GiB, sizes, "replicated", 1)
    assert F.ACTIVATION_RESERVE_BYTES == 3 * GiB


# ---- placement ---------------------------------------------------------------------------------------------------

# 8 transformer blocks of 1 GiB, 2 connector blocks of 0.5 GiB, 1 GiB of the rest; W = 2, reserve 3 GiB. The need
# of k sharded units (hand-derived, GiB): the rest + whole units + 1/2 of each sharded one + the largest sharded one
# (twice from 2 sharded on) + 3:
#   k:    0     1      2     3    4     5    6     7    8     9    10
#   need: 13  13.25  13.5   14  13.5   13  12.5   12  11.5   11  10.5
SIZES = F.WeightBytes(blocks=9 * GiB, rest=GiB, block_units=(GiB,) * 8, connector_units=(GiB // 2,) * 2)


def test_spread_and_sharded_units():
    assert F.spread(3, 12) == (2, 6, 10) and F.spread(4, 8) == (1, 3, 5, 7) and F.spread(5, 8) == (0, 2, 4, 5, 7)
    assert F.spread(0, 5) == () and F.spread(5, 5) == (0, 1, 2, 3, 4) and F.spread(1, 48) == (24,)
    # the connectors' blocks first (units 8, 9: one gather per text encoding), then blocks spread
    assert F.sharded_units(1, 8, 2) == (8,) and F.sharded_units(2, 8, 2) == (8, 9)
    assert F.sharded_units(3, 8, 2) == (4, 8, 9) and F.sharded_units(6, 8, 2) == (1, 3, 5, 7, 8, 9)
    assert F.sharded_units(10, 8, 2) == tuple(range(10)) and F.sharded_units(2, 4, 0) == (1, 3)
    with pytest.raises(ValueError, match="count=11 must be between 0 and the 10 units"):
        F.sharded_units(11, 8, 2)
    with pytest.raises(ValueError, match="count=-1 must be between 0 and total=3"):
        F.spread(-1, 3)


def test_weight_bytes_units():
    assert SIZES.units == (GiB,) * 8 + (GiB // 2,) * 2
    assert F.WeightBytes(5, 1).units == ()  # per-unit sizes unknown: per_rank only
    with pytest.raises(ValueError, match="the units sum to 3 bytes, blocks=4"):
        F.WeightBytes(blocks=4, rest=0, block_units=(1, 2))
    with pytest.raises(ValueError, match="per-unit sizes are unknown"):
        F.place_weights(F.WeightBytes(5, 1), 2, None, "placed")


def test_placement_arithmetic():
    p = F.placement_of(SIZES, 2, (1, 3, 5, 7, 8, 9))
    assert (p.resident_bytes, p.transient_bytes, p.need_bytes) == (7.5 * GiB, 2 * GiB, 13.5 * GiB)  # + 4 reserved
    assert p.gathered_bytes == 4 * GiB // 2  # 4 sharded blocks, each rank receives the other half of each
    assert p.gather_seconds(10.0) == pytest.approx(0.2147, abs=1e-4)
    only_connectors = F.placement_of(SIZES, 2, (8, 9))
    assert only_connectors.gathered_bytes == 0 and only_connectors.need_bytes == 14.5 * GiB
    assert F.placement_of(SIZES, 4, range(10)).need_bytes == 9.25 * GiB  # 1 + 2 + 0.25 resident, 2 gathered, 4
    with pytest.raises(ValueError, match=r"sharded units \(3, 3\) must be distinct indices of the 10 units"):
        F.placement_of(SIZES, 2, (3, 3))
    with pytest.raises(ValueError, match="world_size=0 must be a positive integer"):
        F.placement_of(SIZES, 0, ())


@pytest.mark.parametrize("weights, budget_gib, sharded", [
    ("auto", None, ()), ("placed", None, ()), ("auto", 14, ()),  # a replica and the reserve fit exactly
    ("auto", 13.9, (1, 3, 5, 7, 8, 9)), ("placed", 13.9, (1, 3, 5, 7, 8, 9)),  # k = 6: the first need <= 13.9
    ("auto", 13, (0, 2, 4, 5, 7, 8, 9)), ("auto", 11.5, tuple(range(10))),
    ("sharded", 13.9, tuple(range(10))), ("sharded", None, tuple(range(10))), ("replicated", 14, ()),
])
def test_place_weights(weights, budget_gib, sharded):
    budget = None if budget_gib is None else int(budget_gib * GiB)
    p = F.place_weights(SIZES, 2, budget, weights)
    assert p.sharded == sharded and p.budget_bytes == budget and p.requested == weights
    assert p.any_sharded == bool(sharded) and p.replicated_units == 10 - len(sharded)
    assert p.mode == ("replicated" if not sharded else "sharded" if len(sharded) == 10 else "placed")


def test_place_weights_describes_itself():
    p = F.place_weights(SIZES, 2, int(13.9 * GiB), "auto")
    assert p.describe() == ("placed: 4 of 10 units replicated, 6 sharded over 2 ranks; resident 7.50 GiB; gathers "
                            "2.15 GB per forward (budget 13.90 GiB per GPU, weights='auto')")
    assert F.place_weights(SIZES, 2, None, "replicated").describe() == (
        "replicated: 10 of 10 units replicated, 0 sharded; resident 10.00 GiB; gathers 0.00 GB per forward "
        "(unbounded budget)")


def test_place_weights_refuses_naming_the_budget_the_need_and_what_fits():
    with pytest.raises(ValidationError) as info:
        F.place_weights(SIZES, 2, int(13.9 * GiB), "replicated", budget_from="gpu_budget_gib=13.9")
    assert str(info.value) == (
        "a budget of 13.9 GiB per GPU (gpu_budget_gib=13.9) cannot hold replicated weights: that needs 14.0 GiB "
        "(10.0 GiB of weights resident + 0.0 GiB of gathered blocks + 4.0 GiB kept free for one forward). Would fit: "
        "weights='placed' (4 of 10 units replicated, 13.5 GiB per GPU); sharded over 4 GPUs (9.2 GiB per GPU); "
        "sharded over 8 GPUs (8.1 GiB per GPU) (also: free the GPU, raise gpu_budget_gib, or use an fp8 / int8 file)")
    with pytest.raises(ValidationError) as info:  # even fully sharded over 2 GPUs: 11.5 GiB
        F.place_weights(SIZES, 2, int(11.4 * GiB), "placed")
    assert str(info.value).startswith(
        "a budget of 11.4 GiB per GPU cannot hold weights='placed' (its smallest need: 10 of 10 units sharded over 2 GPU(s)): "
        "that needs 11.5 GiB (5.5 GiB of weights resident + 2.0 GiB of gathered blocks + 4.0 GiB kept free for one forward). "
        "Would fit: sharded over 4 GPUs (9.2 GiB per GPU); sharded over 8 GPUs (8.1 GiB per GPU)"), str(info.value)
    with pytest.raises(ValidationError, match="cannot hold weights sharded over 8 GPU.*Would fit: nothing on this "
                                              "fleet"):
        F.place_weights(SIZES, 8, 8 * GiB, "sharded")
    with pytest.raises(ValueError, match="weights='fsdp': choose one of auto, replicated, placed, sharded"):
        F.place_weights(SIZES, 2, None, "fsdp")


def test_placement_keeps_one_forward_and_the_allocator_margin():
    """The default reserve of a placement: 3 GiB for one forward + 1 GiB for the caching allocator (a placement with
    the 3 GiB alone peaked at 22.36 GiB of 24 on the H100, bench/results/sharded_lora_h100.txt)."""
    assert F.PLACEMENT_RESERVE_BYTES == 4 * GiB
    assert F.place_weights(SIZES, 2, 14 * GiB, "auto").sharded == ()  # 10 GiB replica + 4 GiB
    assert F.place_weights(SIZES, 2, 14 * GiB - 1, "auto").sharded != ()
    assert F.place_weights(SIZES, 2, 13 * GiB, "auto", reserve_bytes=3 * GiB).sharded == ()


def test_mixed_cards_agree_on_the_smallest_budget():
    """Ranks with different budgets place in the smallest (every rank must shard the same units)."""
    assert F.agreed_budget([14 * GiB, int(13.9 * GiB)]) == int(13.9 * GiB)
    assert F.agreed_budget([None, 5 * GiB, None]) == 5 * GiB and F.agreed_budget([None, None]) is None
    budget = F.agreed_budget([80 * GiB, int(13.9 * GiB)])
    assert F.place_weights(SIZES, 2, budget, "auto").sharded == (1, 3, 5, 7, 8, 9)  # the 80 GB card holds no more


def test_the_sharded_rules_apply_to_any_sharded_unit():
    placed = F.place_weights(SIZES, 2, int(13.9 * GiB), "auto")
    whole = F.place_weights(SIZES, 2, 14 * GiB, "placed")  # placed, and nothing sharded: a replicated fleet
    assert F.shards("sharded") and not F.shards("placed") and not F.shards("auto") and F.shards(placed)
    assert not F.shards(whole)
    F.check_compile(whole, True)
    with pytest.raises(ValidationError, match=r"^compile=True with weights='auto' \(6 of 10 units sharded\): .* use "
                                              r"replicated weights to compile \(GPUs or a gpu_budget_gib that hold a "
                                              r"replica\)$"):
        F.check_compile(placed, True)
    F.check_int8_mode(whole, "dequantize")
    with pytest.raises(ValidationError, match=r"^int8_compute='dequantize' with weights='auto' \(6 of 10 units "
                                              r"sharded\): the memory mode"):
        F.check_int8_mode(placed, "dequantize")
    F.check_policy(whole, 2, FleetPolicy(guidance_parallel="on", compile=True), heads=8)
    with pytest.raises(ValidationError, match="^guidance_parallel='on' with sharded weights"):
        F.check_policy(placed, 2, FleetPolicy(guidance_parallel="on"), heads=8)
    with pytest.raises(ValidationError, match="sharded weights over 3 ranks"):
        F.check_policy(F.placement_of(SIZES, 3, (0,)), 3, FleetPolicy(), heads=8)
    # before the load "auto" / "placed" are not known to shard: the configuration's rules let them through
    F.check_fleet(FleetIdentity(**BASE, weights="placed"), FleetPolicy(compile=True, guidance_parallel="on"), 32)
    kw = {"device_type": "cuda", "int8_bytes": 22 * GiB, "dequantized_bytes": 44 * GiB, "free_bytes": 47 * GiB,
          "reserve_bytes": 3 * GiB}
    assert F.resolve_int8_compute("auto", weights="placed", **kw)[0] == "dequantize"  # a dequantized replica fits
    assert F.resolve_int8_compute("auto", weights=placed, **kw)[0] == "w8a8"


def test_gpu_budget_and_the_default_weights():
    identity = FleetIdentity(**BASE)
    assert identity.weights == "auto" and identity.gpu_budget_gib is None
    assert FleetIdentity(**BASE, gpu_budget_gib=24).gpu_budget_gib == 24
    assert FleetIdentity(**BASE, gpu_budget_gib=21.5, weights="placed").weights == "placed"
    for bad in (0, -1.0, float("nan"), float("inf"), True, "24"):
        with pytest.raises(ValueError, match=r"^gpu_budget_gib=.*: must be a positive, finite number of GiB per GPU, "
                                             r"or None \(each GPU's free memory at load\)$"):
            FleetIdentity(**BASE, gpu_budget_gib=bad)
    assert F.WEIGHT_MODES == ("auto", "replicated", "placed", "sharded")
    assert FleetConfig(**BASE, gpu_budget_gib=12.0).identity.gpu_budget_gib == 12.0  # an identity field: new workers


# ---- a whole configuration -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, heads, message", [
    ({"weights": "sharded", "compile": True}, 32, "compile=True with weights='sharded'"),
    ({"weights": "sharded", "sp_degree": 2}, 32, "sp_degree=2 with sharded weights"),
    ({"weights": "sharded", "guidance_parallel": "on"}, None, "guidance_parallel='on' with sharded weights"),
    ({"weights": "sharded", "min_tokens_per_rank": 64}, 32, "min_tokens_per_rank=64 with sharded weights"),
    ({"weights": "sharded", "devices": ("cpu",) * 3}, 32, "sharded weights over 3 ranks"),
    ({"sp_degree": 3}, 32, "sequence parallel degree 3 is not possible with 32 attention heads on 4 rank"),
])
def test_check_fleet_refuses(fields, heads, message):
    config = FleetConfig(**{**BASE, **fields})
    with pytest.raises(ValidationError, match=message):
        F.check_fleet(config.identity, config.policy, heads)


@pytest.mark.parametrize("fields, heads", [
    ({}, 32), ({"compile": True, "sp_degree": 2, "guidance_parallel": "on", "min_tokens_per_rank": 0}, 32),
    ({"weights": "sharded"}, 32), ({"weights": "sharded", "sp_degree": 4, "guidance_parallel": "off"}, 32),
    ({"sp_degree": 3}, None),  # heads unknown (the nodes, before a header is read): the degree waits for them
    ({"weights": "sharded", "devices": ("cpu",) * 3, "sequence_parallel": False}, 32),  # no plan: no heads rule
])
def test_check_fleet_allows(fields, heads):
    config = FleetConfig(**{**BASE, **fields})
    F.check_fleet(config.identity, config.policy, heads)


def test_check_policy_is_what_a_running_fleet_applies():
    F.check_policy("replicated", 4, FleetPolicy(compile=True, sp_degree=2), heads=8)
    with pytest.raises(ValidationError, match="compile=True with weights='sharded'"):
        F.check_policy("sharded", 4, FleetPolicy(compile=True), heads=8)
    with pytest.raises(ValidationError, match="degree 8 is not possible with 8 attention heads on 4 rank"):
        F.check_policy("replicated", 4, FleetPolicy(sp_degree=8), heads=8)


# ---- the checkpoint-header service -----------------------------------------------------------------------------


def test_checkpoint_facts_from_the_header(tiny_dir):
    from safetensors import safe_open

    from mgpu_backend.models import loader
    from mgpu_backend.models.headers import checkpoint_facts

    opened = loader.OPEN_COUNT
    for variant, key, fp8 in (("2.0", "checkpoint", False), ("2.3", "checkpoint", False),
                              ("2.0", "checkpoint_fp8", True)):
        path = tiny_dir[variant][key]
        facts = checkpoint_facts(path)
        with safe_open(str(path), "pt") as f:
            keys = [k for k in f.keys() if k.startswith("model.diffusion_model.")]
            stored = {k: f.get_slice(k).get_dtype() for k in keys}
            nbytes = sum(f.get_tensor(k).nbytes for k in keys)
        assert facts.family == variant and facts.heads == 8 and facts.blocks == 2, facts
        fp8_weights = sum(d.startswith("F8_") for k, d in stored.items() if k.endswith(".weight"))
        assert facts.fp8_layers == fp8_weights and (fp8_weights > 0) == fp8, facts
        assert facts.int8_layers == 0 and facts.transformer_bytes == nbytes
    assert loader.OPEN_COUNT == opened  # a header read is not a weight read


def test_checkpoint_facts_of_an_int8_file(tmp_path):
    from mgpu_backend.models.headers import checkpoint_facts
    from mgpu_backend.testing.tiny import write_tiny_component_files

    files = write_tiny_component_files(tmp_path, "2.3", seed=0)
    facts = checkpoint_facts(files["transformer_int8"])
    assert facts.int8_layers > 0 and facts.fp8_layers == 0 and facts.heads == 8, facts
    assert checkpoint_facts(files["transformer"]).int8_layers == 0


def test_headers_refuse_by_name(tmp_path, tiny_dir):
    from mgpu_backend.models.headers import CheckpointError, checkpoint_facts, read_header

    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        checkpoint_facts(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match="junk.safetensors: not a readable safetensors file"):
        read_header(junk)
    data = Path(tiny_dir["2.0"]["checkpoint"]).read_bytes()
    for cut in (len(data) // 2, 100):  # torn data section; torn header
        torn = tmp_path / f"torn-{cut}.safetensors"
        torn.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=f"torn-{cut}.safetensors: not a readable safetensors file"):
            checkpoint_facts(torn)
    with pytest.raises(CheckpointError, match="not an LTX-2 checkpoint"):
        checkpoint_facts(tiny_dir["2.0"]["upsampler"])
    other = tmp_path / "heads.safetensors"
    header = json.dumps({"__metadata__": {"config": json.dumps({"transformer": {"num_attention_heads": "many"}})},
                         "model.diffusion_model.adaln_single.emb.timestep_embedder.linear_1.bias":
                             {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "model.diffusion_model.audio_adaln_single.linear.weight":
                             {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
    other.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match="num_attention_heads='many' is not a number"):
        checkpoint_facts(other)


def test_cli_weights_and_budget_flags_reach_the_fleet_config(tiny_dir, monkeypatch):
    """`--weights placed --gpu-budget-gib 22` send the run to a fleet with that identity (a stand-in client stops it
    at configure); without them the fleet gets weights="auto" and no budget; a bad budget is refused by name."""
    from mgpu_backend.serving import cli, client

    class Stop(Exception):
        pass

    seen = []

    class FakeClient:
        def configure_fleet(self, config):
            seen.append(config)
            raise Stop

        def close(self):
            pass

    monkeypatch.setattr(client, "ControllerClient", FakeClient)
    files = tiny_dir["2.0"]
    base = ["generate", "--checkpoint", str(files["checkpoint"]), "--gemma", str(files["gemma"]), "--upscaler",
            str(files["upsampler"]), "--prompt", "p",
            "--width", "128", "--height", "128", "--frames", "9"]
    for options in (["--weights", "placed", "--gpu-budget-gib", "22"], ["--devices", "cpu:2"]):
        args = cli.build_parser().parse_args(base + options)
        assert cli.on_fleet(args)
        with pytest.raises(Stop):
            cli.run_generate(args)
    assert (seen[0].weights, seen[0].gpu_budget_gib) == ("placed", 22.0)
    assert (seen[1].weights, seen[1].gpu_budget_gib) == ("auto", None)
    with pytest.raises(ValueError, match=r"gpu_budget_gib=-1.0: must be a positive, finite number"):
        cli.run_generate(cli.build_parser().parse_args(base + ["--gpu-budget-gib", "-1"]))
