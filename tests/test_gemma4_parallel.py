"""Gemma 4 (LTX-2.5) on the fleet: the text service (stages/text_encoder.py) sharded with Accelerate and batch-parallel,
with the projection bundled in the Gemma 4 file, on W = 1, 2 and 3 gloo ranks (CPU, float32, one thread).

Reference: the one-process encode of each prompt on its own — `load_gemma(file).encode([prompt])` followed by the
bundled projection (`load_bundled_projection`), valid tokens only. Every mode must equal it bit for bit
(`torch.equal`), as for Gemma 3 (tests/test_gemma_parallel.py). "Two devices" on a CPU machine: a sharded run whose
device map splits the decoder layers over "cpu" and "disk" (Accelerate `dispatch_model` with disk offload; each
`Gemma4UnifiedTextDecoderLayer` whole on one device). The tiny file has 12 layers here (two full-attention layers;
48 only matter for ComfyUI's detection) to keep the spawned ranks fast.
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.models.gemma import load_gemma, read_gemma_header
from mgpu_backend.models.text_projection import TextProjection, load_bundled_projection
from mgpu_backend.testing.tiny_gemma4 import write_tiny_gemma4
from mgpu_backend.stages import text_encoder as G
from mgpu_backend.protocol.job_requests import EncodeTextRequest
from mgpu_backend.protocol.validation import ValidationError

torch.set_num_threads(1)

PROMPTS = ["A cinematic shot of a red car driving along a coastal road at sunset, waves below.", "Rain.",
           "<|turn>user\nA dog jumps into the lake.<turn|>", "Rain.", "Snow covers the quiet mountain village."]
PLAN_TOKENS = 64


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> str:
    return str(write_tiny_gemma4(tmp_path_factory.mktemp("gemma4_fleet") / "gemma4-tiny.safetensors", seed=1,
                                 num_layers=12))


def _reference(path: str, prompts) -> list[torch.Tensor]:
    enc, proj = load_gemma(path), load_bundled_projection(path, dtype=torch.float32)
    out = []
    for p in prompts:
        hidden, mask = enc.encode([p])
        out.append(proj(hidden, mask).float()[:, -int(mask.sum()):])
    return out


@pytest.fixture(scope="module")
def reference(gemma4) -> list[torch.Tensor]:
    return _reference(gemma4, PROMPTS)


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _split_budgets(path: str) -> dict[str, int]:
    """cpu + disk: the CPU holds embed_tokens and three decoder layers besides its activations and one streamed
    layer; the rest must go to the disk."""
    header = read_gemma_header(path)
    layers, fixed = header.module_bytes(torch.float32)
    act = G.activation_bytes(header.text_config, PLAN_TOKENS, torch.float32)
    return {"cpu": act + max(layers) + fixed["embed_tokens"] + sum(layers[:3]) + 1024, "disk": 2**30}


def _scenarios(rank: int, world: int, path: str) -> dict:
    out: dict = {}
    # projection=None: the service takes the one bundled in the Gemma 4 file
    ranks = G.EncoderPlacement(rank=rank, world_size=world, devices=("cpu",) * world)
    svc = G.TextEncoderService(path, None, placement=ranks, settings=G.EncoderSettings(plan_tokens=PLAN_TOKENS))
    out["projection"] = (svc.projection.kind, svc.projection_source == path)
    out["replicated"] = svc.encode(PROMPTS).embeds
    svc.clear_cache()
    enc = svc.encode(PROMPTS, mode="batch_parallel")
    out["batch_parallel"], out["batch_parallel_report"] = enc.embeds, enc.report
    svc.clear_cache()
    enc = svc.encode(PROMPTS, mode="sharded")
    out["sharded"], out["sharded_report"] = enc.embeds, enc.report
    out["sharded_holds"] = svc.encoder is not None
    svc.unload()
    split = G.TextEncoderService(path, None, placement=ranks,
                                 settings=G.EncoderSettings(plan_tokens=PLAN_TOKENS, mode="sharded",
                                                            max_memory=_split_budgets(path)))
    out["split"] = split.encode(PROMPTS).embeds
    out["split_map"] = dict(split.device_map)
    if rank == 0:  # Accelerate's hooks sit on whole decoder layers
        out["hooked"] = sorted({type(m).__name__ for m in split.encoder.model.modules() if hasattr(m, "_hf_hook")})
    split.unload()
    try:
        svc.encode(["only one"], mode="batch_parallel")
    except ValidationError as exc:
        out["one_prompt_error"] = str(exc)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_mode_equals_the_one_process_encode(gemma4, reference, world):
    results = run_ranks(_scenarios, world, gemma4)
    for rank, r in enumerate(results):
        assert r["projection"] == ("dual_linear", True)
        for key in ("replicated", "batch_parallel", "sharded", "split"):
            assert _equal(r[key], reference), (world, rank, key)
        assert r["sharded_holds"] == (rank == 0)
        assert r["sharded_report"].forwards_here == (4 if rank == 0 else 0)  # 4 distinct prompts
        assert set(r["split_map"].values()) == {"cpu", "disk"}
        assert all(k in ("embed_tokens", "rotary_emb", "norm") or k.startswith("layers.") and k.count(".") == 1
                   for k in r["split_map"]), r["split_map"]
        assert "nothing to split" in r["one_prompt_error"]
    assert "Gemma4UnifiedTextDecoderLayer" in results[0]["hooked"]
    split = [r["batch_parallel_report"].forwards_here for r in results]
    assert sum(split) == 4 and min(split) >= 1, split  # the prompts were spread over every rank


def test_accelerate_plan_keeps_gemma4_layers_whole(gemma4):
    import transformers

    header = read_gemma_header(gemma4)
    config = transformers.Gemma4UnifiedTextConfig(**{k: v for k, v in header.text_config.items()
                                                      if k != "model_type"})
    with torch.device("meta"):
        model = transformers.Gemma4UnifiedTextModel(config)
    layers, fixed = header.module_bytes(torch.float32)
    total = sum(layers) + sum(fixed.values())
    budgets = {"cpu": total // 2, "disk": total}
    plan = G.accelerate_device_map(model, budgets, dtype=torch.float32)
    assert all(not k.startswith("layers.") or k.count(".") == 1 for k in plan), plan  # no layer split
    assert G.NO_SPLIT[1] == type(model.layers[0]).__name__


def test_projection_passed_next_to_a_bundled_one_must_match(gemma4):
    g = torch.Generator().manual_seed(0)
    wrong = TextProjection.from_state_dict({"aggregate_embed.weight": torch.randn(48, 32 * 13, generator=g)},
                                           prefix="")
    with pytest.raises(ValueError, match="the text projection passed .single_linear.*is not the one bundled"):
        G.TextEncoderService(gemma4, wrong)
    narrow = TextProjection("dual_linear", 32 * 13, (48, 32))
    with pytest.raises(ValueError, match="not the one bundled in the Gemma file"):
        G.TextEncoderService(gemma4, narrow)
    same = load_bundled_projection(gemma4, dtype=torch.float32)
    svc = G.TextEncoderService(gemma4, same, projection_source=gemma4)
    assert svc.projection is same


def test_the_gemma_file_must_be_the_family_s_text_encoder(gemma4):
    from mgpu_backend.models.families import get_family

    G.TextEncoderService(gemma4, None, family=get_family("2.5"))
    with pytest.raises(ValueError, match=r"is gemma4, but LTX-2.3 uses gemma3 \(gemma_3_12B_it"):
        G.TextEncoderService(gemma4, None, family=get_family("2.3"))


# ---- the encode_text job with a Gemma 4 service: ComfyUI's native 2.5 CONDITIONING ---------------------------------

def _job_on_ranks(rank: int, world: int, path: str, prompts: list[str]) -> dict:
    from types import SimpleNamespace

    from mgpu_backend.serving.jobs.text import run_encode_text

    service = G.TextEncoderService(path, None,
                                   placement=G.EncoderPlacement(rank=rank, world_size=world, devices=("cpu",) * world),
                                   settings=G.EncoderSettings(plan_tokens=PLAN_TOKENS, mode="batch_parallel"))
    ctx = SimpleNamespace(rank=rank, step_boundary=lambda stage, step: False, progress=lambda *a: None)
    return run_encode_text(SimpleNamespace(text=service), EncodeTextRequest(prompts=prompts, frame_rate=24.0), ctx)


def test_encode_text_job_gives_comfyui_s_conditioning_for_2_5(tmp_path):
    """The job (what Text Encode (MGPU) runs on the fleet) on 2 ranks, batch-parallel, on the 48-layer tiny file the
    ComfyUI golden was made from: each CONDITIONING is ComfyUI's `CLIPTextEncode` output (tolerance of
    tests/test_gemma4.py for our unpadded encode) plus the `frame_rate` LTXVConditioning adds, and the pack's own
    CONDITIONING reader takes it."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file

    from nodes import native_types as NT

    golden_path = Path(__file__).resolve().parent / "golden" / "gemma4_golden.safetensors"
    golden = load_file(str(golden_path))
    with safe_open(str(golden_path), framework="pt") as f:
        meta = f.metadata()
    prompts = json.loads(meta["prompts"])
    path = str(write_tiny_gemma4(tmp_path / "gemma4-12b-with-proj-ltx-2.5-tiny-bf16.safetensors", seed=0))
    result, other = run_ranks(_job_on_ranks, 2, path, prompts)
    assert other is None and result.report.mode == "batch_parallel" and min(result.forwards_per_rank) >= 1
    for i, conditioning in enumerate(result.conditioning):
        (cond, extra), = conditioning
        assert sorted(set(extra) - {"frame_rate"}) == json.loads(meta["extra_keys"])[f"p{i}.bf16"]
        assert extra["frame_rate"] == 24.0 and extra["pooled_output"] is None and extra["unprocessed_ltxav_embeds"]
        assert cond.dtype == torch.float32 and cond.shape == golden[f"p{i}.cond_bf16"].shape
        assert (cond - golden[f"p{i}.cond_bf16"]).abs().max() <= 2e-3, i
        parts = NT.split_conditioning(conditioning)
        assert torch.equal(parts.embeds, cond) and parts.frame_rate == 24.0


def test_12b_shaped_sizes_equal_accelerate_s_and_the_plan_keeps_layers_whole():
    """Header-based sizes of a Gemma 4 12B-shaped model (meta device, nothing allocated; shapes inferred by our own
    rules from the state dict) equal Accelerate's `compute_module_sizes` per decoder layer; both planners keep every
    `Gemma4UnifiedTextDecoderLayer` whole; the activation estimate plans for the 512-wide heads."""
    from accelerate.utils import compute_module_sizes
    from transformers import Gemma4UnifiedTextConfig, Gemma4UnifiedTextModel

    from mgpu_backend.models.gemma import GEMMA4, GemmaHeader, infer_gemma4_text_config

    config = Gemma4UnifiedTextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                     global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
                                     vocab_size=262144)
    with torch.device("meta"):
        model = Gemma4UnifiedTextModel(config).to(torch.bfloat16)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    text_config = infer_gemma4_text_config(shapes, "12b-shaped")
    assert text_config["layer_types"] == list(config.layer_types)
    header = GemmaHeader("12b-shaped", text_config, shapes, {k: "BF16" for k in shapes}, GEMMA4)
    layers, fixed = header.module_bytes(torch.bfloat16)
    sizes = compute_module_sizes(model, dtype=torch.bfloat16)
    assert layers == [sizes[f"layers.{i}"] for i in range(48)]
    assert layers[0] == 224_148_993 * 2 and layers[5] == 241_844_225 * 2  # sliding / full-attention layer
    assert sum(layers) + sum(fixed.values()) == 11_907_350_320 * 2  # the 12B language model in bf16
    budgets = {"cuda:0": 12 * 2**30, "cuda:1": 12 * 2**30}
    ours = G.plan_device_map(layers, {"rotary_emb": 0, **fixed}, budgets)
    assert all(k in ("embed_tokens", "rotary_emb", "norm") or k.count(".") == 1 for k in ours)
    theirs = G.accelerate_device_map(model, budgets, dtype=torch.bfloat16)
    assert not any(k.count(".") > 1 for k in theirs), "Accelerate split a decoder layer"
    act = G.activation_bytes(text_config, 1024, torch.bfloat16)
    q_full = 1024 * 16 * 512 * 2  # one full-attention query tensor at 1024 tokens, bf16
    assert act >= 2 * 1024 * 3840 * 49 + q_full
