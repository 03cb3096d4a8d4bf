"""Distributed Gemma text encoding (stages/text_encoder.py, serving/jobs/text.py; docs/design/text-encoder.md, issue 6).

Reference: the one-process encode of each prompt on its own — `load_gemma(...).encode([prompt])` followed by the
text projection, valid tokens only. Every mode (replicated, batch_parallel, sharded; W = 1 and 2 gloo ranks on
the CPU, float32, one thread) must equal it bit for bit (`torch.equal`). "Two devices" on a CPU machine: a sharded
run whose device map splits the layers over "cpu" and "disk" (Accelerate dispatch with disk offload: the disk
layers are streamed back at run time), planned by `plan_device_map` from two synthetic budgets.

Planner: synthetic budgets for 2, 4 and 8 devices and a device list "0,1,3" with 12B-shaped sizes (48 decoder
layers of 448 MiB, embed_tokens 1.88 GiB); every layer placed whole, devices in order with contiguous layers, no
device over its budget, and balanced: |load_d − total · budget_d / Σ budget| <= the largest entry (the stated
margin of the proportional plan).
"""
from __future__ import annotations

import datetime
import gc
import os
import tempfile
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mgpu_backend.models.gemma import load_gemma, read_gemma_header
from mgpu_backend.models.text_projection import TextProjection
from mgpu_backend.testing.tiny_gemma import write_tiny_gemma, write_tiny_gemma_hf_folder
from mgpu_backend.stages import text_encoder as G
from mgpu_backend.protocol.validation import ValidationError

torch.set_num_threads(1)

HIDDEN, LAYERS = 64, 4
PROMPTS = ["A cinematic shot of a red car driving along a coastal road at sunset, waves below.", "Rain.",
           "A dog jumps into the lake to fetch a stick.", "Rain."]  # mixed lengths and a duplicate
PLAN_TOKENS = 64  # keeps the activation estimate of the tiny model small


# ---- fixtures and helpers ----------------------------------------------------------------------------------------

def _projection(path: str) -> TextProjection:
    return TextProjection.from_state_dict(load_file(path), prefix="", dtype=torch.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("gemma_parallel")
    g = torch.Generator().manual_seed(3)
    in_features = HIDDEN * (LAYERS + 1)
    proj = {"aggregate_embed.weight": torch.randn(48, in_features, generator=g) / in_features ** 0.5}
    save_file(proj, str(d / "projection.safetensors"))
    return {
        "gemma": str(write_tiny_gemma(d / "gemma.safetensors", seed=0, hidden_size=HIDDEN, num_layers=LAYERS)),
        "fp8": str(write_tiny_gemma(d / "gemma_fp8.safetensors", seed=0, hidden_size=HIDDEN, num_layers=LAYERS,
                                    fp8=True)),
        "hf": str(write_tiny_gemma_hf_folder(d / "hf", seed=0, hidden_size=HIDDEN, num_layers=LAYERS)),
        "proj": str(d / "projection.safetensors"),
    }


def _reference(gemma_path: str, proj_path: str, prompts) -> list[torch.Tensor]:
    enc, proj = load_gemma(gemma_path), _projection(proj_path)
    out = []
    for p in prompts:
        hidden, mask = enc.encode([p])
        out.append(proj(hidden, mask).float()[:, -int(mask.sum()):])
    return out


@pytest.fixture(scope="module")
def reference(files) -> list[torch.Tensor]:
    return _reference(files["gemma"], files["proj"], PROMPTS)


def _service(files, placement: G.EncoderPlacement = G.EncoderPlacement(), **settings) -> G.TextEncoderService:
    """The service over the tiny Gemma and projection; `settings`: `EncoderSettings` fields (plan_tokens: the tests')."""
    settings.setdefault("plan_tokens", PLAN_TOKENS)
    return G.TextEncoderService(files["gemma"], _projection(files["proj"]), projection_source=files["proj"],
                                placement=placement, settings=G.EncoderSettings(**settings))


def _ranks(rank: int, world: int) -> G.EncoderPlacement:
    return G.EncoderPlacement(rank=rank, world_size=world, devices=("cpu",) * world)


def _split_budgets(gemma_path: str) -> dict[str, int]:
    """max_memory for a cpu + disk split: the CPU holds embed_tokens and two layers besides its activations and one
    streamed layer; the rest must go to the disk."""
    layers, fixed = read_gemma_header(gemma_path).module_bytes(torch.float32)
    act = G.activation_bytes(read_gemma_header(gemma_path).text_config, PLAN_TOKENS, torch.float32)
    return {"cpu": act + max(layers) + fixed["embed_tokens"] + 2 * layers[0] + 1024, "disk": 2**30}


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


# ---- own spawn helper: W gloo ranks on the CPU (file:// rendezvous) -----------------------------------------------

def _entry(rank: int, fn, world_size: int, folder: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{folder}/rank{rank}.pt")


def spawn(fn, world_size: int, *args) -> list:
    """`fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; their return values in rank order."""
    with tempfile.TemporaryDirectory(prefix="gemma_ranks_") as folder:
        mp.spawn(_entry, args=(fn, world_size, folder, args), nprocs=world_size, join=True)
        return [torch.load(f"{folder}/rank{r}.pt", weights_only=False) for r in range(world_size)]


def _ranks_scenarios(rank: int, world: int, files: dict) -> dict:
    """Every mode on this rank; returns embeddings, reports and error messages for the parent to check."""
    out: dict = {}
    svc = _service(files, _ranks(rank, world))
    enc = svc.encode(PROMPTS)
    out["replicated"], out["replicated_report"] = enc.embeds, enc.report
    enc = svc.encode(PROMPTS, mode="batch_parallel")  # cache hits, whatever the mode
    out["repeat"], out["repeat_report"] = enc.embeds, enc.report
    svc.clear_cache()
    enc = svc.encode(PROMPTS, mode="batch_parallel")
    out["batch_parallel"], out["batch_parallel_report"] = enc.embeds, enc.report
    svc.clear_cache()
    enc = svc.encode(PROMPTS, mode="sharded")
    out["sharded"], out["sharded_report"] = enc.embeds, enc.report
    out["sharded_holds"] = svc.encoder is not None
    ref = weakref.ref(svc.encoder.model) if svc.encoder is not None else None
    out["unload_first"] = svc.encode(["A new prompt."], mode="sharded", unload=True).embeds
    gc.collect()
    out["unloaded"] = (svc.encoder is None, ref is None or ref() is None)
    try:
        svc.encode(["only one"], mode="batch_parallel")
    except ValidationError as exc:
        out["one_prompt_error"] = str(exc)
    # a real two-device split (cpu + disk), planned from synthetic budgets, driven from rank 0
    split = _service(files, _ranks(rank, world), mode="sharded", max_memory=_split_budgets(files["gemma"]))
    out["split"] = split.encode(PROMPTS).embeds
    out["split_map"] = split.device_map
    split.unload()
    # refusal before loading, on every rank
    for mode in ("replicated", "sharded"):
        small = _service(files, _ranks(rank, world), mode=mode, max_memory={"cpu": "64KiB"})
        try:
            small.encode(PROMPTS[:2])
        except G.GemmaMemoryError as exc:
            out[f"refused_{mode}"] = (str(exc), small.stats["loads"])
    out["stats"] = dict(svc.stats)
    return out


# ---- planner (pure) ---------------------------------------------------------------------------------------------

GIB = 2**30
L12 = 224_148_992 * 2  # one Gemma 3 12B decoder layer in bf16 (bytes; checked against Accelerate below)
E12 = 262_208 * 3840 * 2  # embed_tokens


def _check_plan(plan, layer_sizes, fixed, budgets, balanced=True):
    devices = list(budgets)
    assert all(f"layers.{i}" in plan for i in range(len(layer_sizes))), "every layer placed"
    assert set(fixed) <= set(plan)
    names = ["embed_tokens"] + [f"layers.{i}" for i in range(len(layer_sizes))] + (["norm"] if "norm" in fixed else [])
    order = [devices.index(plan[n]) for n in names]
    assert order == sorted(order), "devices in the given order, each with one contiguous run of layers"
    loads = G.plan_loads(plan, layer_sizes, fixed)
    for d, load in loads.items():
        assert load <= G.parse_size(budgets[d]), f"{d} over budget: {load} > {budgets[d]}"
    if balanced:
        total = sum(layer_sizes) + sum(fixed.values())
        caps = {d: G.parse_size(b) for d, b in budgets.items()}
        largest = max(list(layer_sizes) + list(fixed.values()))
        for d in devices:
            share = total * caps[d] / sum(caps.values())
            assert abs(loads.get(d, 0) - share) <= largest, (d, loads.get(d, 0), share)
    return loads


@pytest.mark.parametrize("n", [2, 4, 8])
def test_planner_equal_and_unequal_budgets(n):
    layers = [L12] * 48
    fixed = {"embed_tokens": E12, "rotary_emb": 0, "norm": 7680}
    equal = {f"cuda:{i}": "60GiB" for i in range(n)}
    loads = _check_plan(G.plan_device_map(layers, fixed, equal), layers, fixed, equal)
    assert len(loads) == n
    unequal = {f"cuda:{i}": (20 + 13 * i) * GIB for i in range(n)}
    _check_plan(G.plan_device_map(layers, fixed, unequal), layers, fixed, unequal)


def test_planner_device_list_0_1_3():
    devices = [G.device_key(s) for s in "0,1,3".split(",")]
    budgets = {d: 30 * GIB for d in devices}
    layers, fixed = [L12] * 48, {"embed_tokens": E12, "norm": 7680}
    plan = G.plan_device_map(layers, fixed, budgets)
    assert set(plan.values()) == {"cuda:0", "cuda:1", "cuda:3"} and plan["embed_tokens"] == "cuda:0"
    _check_plan(plan, layers, fixed, budgets)


def test_planner_tight_budgets_fall_back_and_stay_within_budget():
    layers, fixed = [L12] * 48, {"embed_tokens": E12, "norm": 7680}
    # exactly enough: 1 KiB to spare per device
    budgets = {"cuda:0": E12 + 2 * L12 + 1024, "cuda:1": 40 * L12 + 1024, "cuda:2": 6 * L12 + 7680 + 1024}
    loads = _check_plan(G.plan_device_map(layers, fixed, budgets), layers, fixed, budgets, balanced=False)
    assert loads == {"cuda:0": E12 + 2 * L12, "cuda:1": 40 * L12, "cuda:2": 6 * L12 + 7680}
    # where the proportional split would overflow a device, the min-max-ratio placement is used
    u = 100 * 2**20
    small_layers, small_fixed, tight = [3 * u] * 5, {"embed_tokens": 2 * u}, {"a": 12 * u, "b": u, "c": 9 * u}
    items = [("embed_tokens", 2 * u)] + [(f"layers.{i}", 3 * u) for i in range(5)]
    assert G._proportional(items, list(tight), tight) is None
    plan = G.plan_device_map(small_layers, small_fixed, tight)
    assert G.plan_loads(plan, small_layers, small_fixed) == {"a": 11 * u, "c": 6 * u}  # max ratio 11/12, not 9/9
    # overhead (activations) comes off each device's budget
    plan = G.plan_device_map(layers, fixed, {"a": 20 * GIB, "b": 20 * GIB}, overhead=GIB)
    assert all(v <= 19 * GIB for v in G.plan_loads(plan, layers, fixed).values())


def test_planner_spill_devices_take_only_the_overflow():
    layers, fixed = [L12] * 48, {"embed_tokens": E12, "norm": 7680}
    budgets = {"cuda:0": 10 * GIB, "cuda:1": 10 * GIB, "cpu": 100 * GIB}
    plan = G.plan_device_map(layers, fixed, budgets, spill=["cpu"])
    loads = G.plan_loads(plan, layers, fixed)
    assert loads["cuda:0"] > 9 * GIB and loads["cuda:1"] > 9 * GIB  # GPUs filled first
    assert plan["layers.47"] == "cpu" and plan["norm"] == "cpu"  # the tail spills
    roomy = {"cuda:0": 40 * GIB, "cuda:1": 40 * GIB, "cpu": 100 * GIB}
    assert "cpu" not in G.plan_device_map(layers, fixed, roomy, spill=["cpu"]).values()


def test_planner_refuses_with_numbers():
    layers, fixed = [L12] * 48, {"embed_tokens": E12, "norm": 7680}
    with pytest.raises(G.GemmaMemoryError) as info:
        G.plan_device_map(layers, fixed, {"cuda:0": "8GiB", "cuda:1": "8GiB"})
    msg = str(info.value)
    total = 48 * L12 + E12 + 7680
    assert f"needs {G.fmt_bytes(total)}" in msg and "cuda:0 8.00 GiB" in msg and "cuda:1 8.00 GiB" in msg, msg
    assert f"48 whole decoder layers of up to {G.fmt_bytes(L12)}" in msg and "total 16.00 GiB" in msg, msg
    with pytest.raises(G.GemmaMemoryError, match="as whole layers"):  # enough in total, not as whole layers
        G.plan_device_map([100, 100, 100], {}, {"a": 150, "b": 150})
    assert isinstance(info.value, ValidationError)


def test_parse_size_and_accelerate_max_memory():
    assert G.parse_size("20GiB") == 20 * GIB and G.parse_size("1.5 GB") == 1_500_000_000 and G.parse_size(7) == 7
    with pytest.raises(ValueError, match="20 parsecs"):
        G.parse_size("20 parsecs")
    mm = G.to_accelerate_max_memory({"cuda:0": "1GiB", "cuda:3": 5, "cpu": "2GiB"})
    assert mm == {0: GIB, 3: 5, "cpu": 2 * GIB}


def test_plan_matches_accelerate_module_sizes_on_a_12b_shaped_meta_model():
    """Our header-based sizes equal Accelerate's `compute_module_sizes` per module for a 12B-shaped model (meta
    device, nothing allocated), and Accelerate's own planner keeps every decoder layer whole on the same budgets."""
    from accelerate.utils import compute_module_sizes
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from mgpu_backend.models.gemma import GemmaHeader, infer_text_config

    cfg = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
               num_key_value_heads=8, head_dim=256, vocab_size=262208)
    with torch.device("meta"):
        model = Gemma3TextModel(Gemma3TextConfig(**cfg)).to(torch.bfloat16)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    header = GemmaHeader("12b-shaped", infer_text_config(shapes, "12b-shaped"), shapes, {k: "BF16" for k in shapes})
    layers, fixed = header.module_bytes(torch.bfloat16)
    sizes = compute_module_sizes(model, dtype=torch.bfloat16)
    assert layers == [sizes[f"layers.{i}"] for i in range(48)]
    assert sizes["embed_tokens"] - fixed["embed_tokens"] == 2  # + the 0-d bf16 embed_scale buffer (not in files)
    assert layers[0] == L12 and fixed["embed_tokens"] == E12
    budgets = {"cuda:0": 12 * GIB, "cuda:1": 12 * GIB}
    ours = G.plan_device_map(layers, {"rotary_emb": 0, **fixed}, budgets)
    _check_plan(ours, layers, fixed, budgets)
    theirs = G.accelerate_device_map(model, budgets, dtype=torch.bfloat16)
    assert all(k in ("embed_tokens", "rotary_emb", "norm", "layers") or k.startswith("layers.") for k in theirs)
    assert not any(k.count(".") > 1 for k in theirs), "Accelerate split a decoder layer"
    # the 12B-shaped model does not fit two 8 GiB budgets: refused with its size and each device's budget
    b = {"cuda:0": G.DeviceBudget("cuda:0", free=80 * GIB, reserve=72 * GIB),
         "cuda:1": G.DeviceBudget("cuda:1", free=10 * GIB, cap=8 * GIB)}
    with pytest.raises(G.GemmaMemoryError) as info:
        G.plan_gemma(header, torch.bfloat16, b, tokens=256)
    msg = str(info.value)
    assert f"needs {G.fmt_bytes(sum(layers) + sum(fixed.values()))} of weights" in msg, msg
    assert "cuda:0 budget 8.00 GiB (free 80.00 GiB − reserve 72.00 GiB)" in msg, msg
    assert "cuda:1 budget 8.00 GiB (free 10.00 GiB, capped at 8.00 GiB by gemma_max_memory)" in msg, msg


# ---- one process --------------------------------------------------------------------------------------------------

def test_one_process_modes_equal_reference_and_cpu_disk_split(files, reference):
    svc = _service(files)
    first = svc.encode(PROMPTS)
    assert _equal(first.embeds, reference)
    assert first.report.encoded == 3 and svc.stats["forwards"] == 3  # the duplicate is encoded once
    again = svc.encode(PROMPTS)
    assert _equal(again.embeds, reference) and svc.stats["forwards"] == 3  # cache
    assert again.report.cache_hits == 3 and again.report.encoded == 0
    split = _service(files, mode="sharded", max_memory=_split_budgets(files["gemma"]))
    encoding = split.encode(PROMPTS)
    out = encoding.embeds
    assert set(split.device_map.values()) == {"cpu", "disk"}, split.device_map
    assert split.device_map["embed_tokens"] == "cpu" and split.device_map["layers.3"] == "disk"
    assert _equal(out, reference)
    assert encoding.report.device_map == {"cpu": "embed_tokens, rotary_emb, layers.0-1",
                                               "disk": "norm, layers.2-3"}


def test_cache_key_follows_the_files(files, reference, tmp_path):
    import shutil

    gemma = tmp_path / "g.safetensors"
    shutil.copy(files["gemma"], gemma)
    svc = G.TextEncoderService(gemma, _projection(files["proj"]), projection_source=files["proj"],
                               settings=G.EncoderSettings(plan_tokens=PLAN_TOKENS))
    assert _equal(svc.encode(PROMPTS[:2]).embeds, reference[:2]) and svc.stats["forwards"] == 2
    svc.encode(PROMPTS[:2])
    assert svc.stats["forwards"] == 2
    st = gemma.stat()
    os.utime(gemma, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "a new file": re-encode (and reload)
    assert _equal(svc.encode(PROMPTS[:2]).embeds, reference[:2])
    assert svc.stats["forwards"] == 4 and svc.stats["loads"] == 2
    proj_copy = tmp_path / "p.safetensors"
    shutil.copy(files["proj"], proj_copy)
    svc.projection_source = str(proj_copy)  # another checkpoint's projection: another key
    svc.encode(PROMPTS[:2])
    assert svc.stats["forwards"] == 6


def test_unload_releases_the_weights_and_a_later_encode_reloads(files, reference):
    svc = _service(files)
    svc.encode(PROMPTS[:1])
    model_ref = weakref.ref(svc.encoder.model)
    param_ref = weakref.ref(next(svc.encoder.model.parameters()))
    svc.encode(PROMPTS[1:2], unload=True)
    gc.collect()
    assert svc.encoder is None and model_ref() is None and param_ref() is None
    assert svc.stats["unloads"] == 1
    assert _equal(svc.encode(PROMPTS[2:3]).embeds, reference[2:3])  # reloaded
    assert svc.stats["loads"] == 2 and svc.encoder is not None
    # sharded (dispatched) models are released too
    split = _service(files, mode="sharded", max_memory=_split_budgets(files["gemma"]), unload=True)
    split.encode(PROMPTS[:1])
    gc.collect()
    assert split.encoder is None and split.stats["unloads"] == 1


def test_layouts_and_fp8(files, reference):
    hf = G.TextEncoderService(files["hf"], _projection(files["proj"]), projection_source=files["proj"],
                              settings=G.EncoderSettings(plan_tokens=PLAN_TOKENS))
    assert _equal(hf.encode(PROMPTS).embeds, reference)  # same bf16 weights as the single file
    fp8 = G.TextEncoderService(files["fp8"], _projection(files["proj"]), projection_source=files["proj"],
                               settings=G.EncoderSettings(mode="sharded", max_memory=_split_budgets(files["fp8"]),
                                                          plan_tokens=PLAN_TOKENS))
    out = fp8.encode(PROMPTS).embeds
    assert _equal(out, _reference(files["fp8"], files["proj"], PROMPTS))
    assert set(fp8.device_map.values()) == {"cpu", "disk"}
    assert not _equal(out, reference)  # fp8 weights really are different (quantized)


def test_refusals(files):
    small = _service(files, max_memory={"cpu": "64KiB"})
    with pytest.raises(G.GemmaMemoryError) as info:
        small.encode(PROMPTS)
    msg = str(info.value)
    layers, fixed = read_gemma_header(files["gemma"]).module_bytes(torch.float32)
    weights = G.fmt_bytes(sum(layers) + sum(fixed.values()))
    assert "does not fit" in msg and "cpu budget 64.00 KiB" in msg, msg
    assert f"{weights} of weights" in msg and "each replica needs" in msg and small.stats["loads"] == 0
    small = _service(files, mode="sharded", max_memory={"cpu": "64KiB", "disk": "128KiB"})
    with pytest.raises(G.GemmaMemoryError) as info:
        small.encode(PROMPTS)
    msg = str(info.value)
    assert "cpu budget 64.00 KiB" in msg and "disk budget 128.00 KiB" in msg and f"needs {weights}" in msg, msg
    svc = _service(files)
    with pytest.raises(ValidationError, match="nothing to split"):
        svc.encode(["one", "one"], mode="batch_parallel")
    with pytest.raises(ValidationError, match="choose one of"):
        svc.encode(["one"], mode="pipelined")
    with pytest.raises(ValidationError, match="non-empty list"):
        svc.encode("one")


def test_pipeline_encode_prompts_goes_through_the_service(files, reference):
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    pipe = object.__new__(TwoStagePipeline)  # only the text half of the pipeline
    pipe.gemma = load_gemma(files["gemma"])
    pipe.components = SimpleNamespace(text_projection=_projection(files["proj"]))
    assert _equal(pipe.encode_prompts(PROMPTS[:2]), reference[:2])
    assert isinstance(pipe.gemma, G.TextEncoderService) and pipe.gemma.stats["forwards"] == 2
    assert _equal(pipe.encode_prompts(PROMPTS[:1]), reference[:1])  # one prompt: no refusal, a cache hit
    assert pipe.gemma.stats["forwards"] == 2


def test_conditioning_form(reference):
    cond = G.TextEncoderService.conditioning(reference[0], frame_rate=24.0)
    (tensor, extra), = cond
    assert torch.equal(tensor, reference[0]) and tensor.shape[0] == 1
    assert extra == {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 24.0}


def test_split_prompts_balances_tokens():
    assert G.split_prompts([10, 3, 7, 2], 2) == [[0, 3], [1, 2]]
    assert G.split_prompts([5], 2) == [[0], []]
    counts = [7, 1, 9, 4, 4, 12, 3, 8, 2]
    split = G.split_prompts(counts, 4)
    assert sorted(sum(split, [])) == list(range(9)) and all(r == sorted(r) for r in split)
    loads = [sum(counts[i] for i in r) for r in split]
    assert max(loads) - min(loads) <= max(counts), loads


# ---- W = 1, 2 gloo ranks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2])
def test_ranks_every_mode_equals_the_one_process_encode(files, reference, world):
    results = spawn(_ranks_scenarios, world, files)
    for rank, r in enumerate(results):
        for key in ("replicated", "repeat", "batch_parallel", "sharded", "split"):
            assert _equal(r[key], reference), (rank, key)
        assert _equal(r["unload_first"], _reference(files["gemma"], files["proj"], ["A new prompt."]))
        assert r["replicated_report"].forwards_here == 3
        assert r["repeat_report"].cache_hits == 3 and r["repeat_report"].forwards_here == 0
        assert r["sharded_holds"] == (rank == 0)  # only the driver holds the sharded copy
        assert r["sharded_report"].forwards_here == (3 if rank == 0 else 0)
        assert r["unloaded"] == (True, True)
        assert "nothing to split" in r["one_prompt_error"]
        assert set(r["split_map"].values()) == {"cpu", "disk"}
        for mode in ("replicated", "sharded"):
            message, loads = r[f"refused_{mode}"]
            assert "does not fit" in message and "64.00 KiB" in message and loads == 0
        assert r["refused_replicated"][0] == results[0]["refused_replicated"][0]  # the same error on every rank
    split = [r["batch_parallel_report"].forwards_here for r in results]
    assert sum(split) == 3 and (world == 1 or min(split) >= 1), split  # the prompts were split over the ranks
    if world == 2:
        assert "2 replica(s)" in results[0]["refused_replicated"][0]  # two ranks share the CPU


# ---- the encode_text job on a fleet ---------------------------------------------------------------------------

def test_encode_text_job_on_a_two_rank_fleet(tiny_dir):
    from mgpu_backend.serving.fleet import Fleet
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.protocol.errors import ControllerError
    from mgpu_backend.protocol.fleet_config import FleetConfig
    from mgpu_backend.protocol.job_requests import EncodeTextRequest, JobSpec

    paths = tiny_dir["2.0"]
    projection = load_components(paths["checkpoint"], dtype=torch.float32).text_projection
    enc = load_gemma(paths["gemma"])

    def ref(p):
        hidden, mask = enc.encode([p])
        return projection(hidden, mask).float()

    prompts = ["A cat sleeps on a warm windowsill in the soft afternoon light.", "Rain falls.", "Two children."]
    config = FleetConfig(devices=("cpu", "cpu"), checkpoint=str(paths["checkpoint"]), gemma=str(paths["gemma"]),
                         gemma_mode="batch_parallel", stall_timeout_s=60.0, init_timeout_s=120.0)
    fleet = Fleet(config, generation=1)
    try:
        events: list = []
        r = fleet.run(JobSpec("encode_text", EncodeTextRequest(prompts=prompts, mode="sharded", frame_rate=25.0)),
                      events.append)
        assert _equal(r.embeds, [ref(p) for p in prompts])
        assert r.forwards_per_rank == (3, 0) and r.report.mode == "sharded"
        (tensor, extra), = r.conditioning[1]
        assert torch.equal(tensor, r.embeds[1]) and extra["unprocessed_ltxav_embeds"] is True
        assert extra["frame_rate"] == 25.0 and extra["pooled_output"] is None
        assert [e.stage for e in events] == ["text"]
        # the fleet's default mode
        r = fleet.run(JobSpec("encode_text", EncodeTextRequest(prompts=prompts[::-1])), events.append)
        assert r.report.cache_hits == 3 and r.forwards_per_rank == (3, 0)
        assert _equal(r.embeds, [ref(p) for p in prompts[::-1]])
        new = ["A drone flies over a forest.", "Snow.", "The orchestra begins to play."]
        r = fleet.run(JobSpec("encode_text", EncodeTextRequest(prompts=new, unload=True)), events.append)
        assert _equal(r.embeds, [ref(p) for p in new])
        assert r.report.mode == "batch_parallel" and r.report.unloaded
        assert sum(r.forwards_per_rank) == 6 and r.forwards_per_rank[1] >= 1
        with pytest.raises(ControllerError) as info:  # asked for explicitly: refused, the fleet stays
            fleet.run(JobSpec("encode_text", EncodeTextRequest(prompts=["one"], mode="batch_parallel")), events.append)
        assert info.value.kind == "validation" and "nothing to split" in str(info.value)
        # the fleet's default mode with one prompt: encoded on the replicas (reloaded after the unload)
        r = fleet.run(JobSpec("encode_text", EncodeTextRequest(prompts=["Reloaded after the unload."])),
                      events.append)
        assert _equal(r.embeds, [ref("Reloaded after the unload.")])
        assert r.stats.loads == 4 and r.report.mode == "replicated"
        assert fleet.alive()
    finally:
        fleet.shutdown()
