"""Longer clips (issue 35): the video feed-forward over token chunks, the activation memory plan, the token cap it
gives, and the refusal naming the longest clip that fits.

Tolerances (measured on this CPU, torch 2.13, the tiny models through `engine/forward.py run`): chunked against whole
is bit-equal in bf16 and within 1.8e-7 relative L2 in float32 (MKL's sgemm picks its kernel by the row count, so a
row slice of a float32 GEMM is not bit-equal to the whole on this machine); asserted: bf16 equal, float32 ≤ 1e-6.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_backend.engine import forward as model_forward
from mgpu_backend.engine.attention import use_processor
from mgpu_backend.engine.semantics import COMFYUI, REFERENCE
from mgpu_backend.protocol import memory_plan as MP
from mgpu_backend.protocol.native_forward import ForwardContractError, ForwardOptions
from mgpu_backend.protocol.validation import ValidationError
from mgpu_backend.splits.plan import DEFAULT_TOKEN_CAP, ParallelPlan, PlanGroups, PlanPolicy, SPStage
from mgpu_backend.stages.stage import StageLimits
from mgpu_backend.testing.tiny import build_tiny_modules

from _dist import run_ranks
from _forward import diffusers_batch

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
GiB = 2 ** 30


def _kwargs(cfg, n=37, ta=5, b=1, seed=0, dtype=torch.float32):
    """diffusers' forward keywords for a random clip of `n` video tokens (`b` rows, per-token timesteps)."""
    g = torch.Generator().manual_seed(seed)
    dv = cfg.num_attention_heads * cfg.attention_head_dim if not cfg.use_prompt_embeddings else cfg.caption_channels
    da = (cfg.audio_num_attention_heads * cfg.audio_attention_head_dim if not cfg.use_prompt_embeddings
          else cfg.caption_channels)
    coords = torch.rand(b, 3, n, 1, generator=g).cumsum(2)
    return dict(hidden_states=torch.randn(b, n, cfg.in_channels, generator=g).to(dtype),
                audio_hidden_states=torch.randn(b, ta, cfg.audio_in_channels, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(b, 6, dv, generator=g).to(dtype),
                audio_encoder_hidden_states=torch.randn(b, 6, da, generator=g).to(dtype),
                timestep=torch.rand(b, n, generator=g) * 1000, audio_timestep=torch.rand(b, ta, generator=g) * 1000,
                sigma=torch.rand(b, generator=g) * 1000, audio_sigma=torch.rand(b, generator=g) * 1000,
                encoder_attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * b),
                audio_encoder_attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * b),
                video_coords=torch.cat([coords, coords + 1], dim=-1),
                audio_coords=torch.stack([torch.arange(ta), torch.arange(ta) + 1], -1).float().view(1, 1, ta, 2)
                .expand(b, -1, -1, -1), use_cross_timestep=True)


@pytest.fixture(scope="module")
def tiny():
    """`tiny(variant, dtype)`: the tiny transformer (seed 0) in `dtype`, built once per pair."""
    cache = {}

    def get(variant: str, dtype: torch.dtype):
        if (variant, dtype) not in cache:
            tr = build_tiny_modules(variant, 0)["transformer"].eval().to(dtype)
            use_processor(tr)
            cache[(variant, dtype)] = tr
        return cache[(variant, dtype)]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---- the feed-forward over token chunks ----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["2.0", "2.3"])
@pytest.mark.parametrize("semantics", [REFERENCE, COMFYUI], ids=["reference", "comfyui"])
@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 1),
                                        (torch.bfloat16, 2)])
def test_chunked_feed_forward_equals_the_whole(tiny, variant, semantics, dtype, rows):
    """`run` with the video FF in chunks of 1, 5, 16 and 73 of the rows × 37 tokens against `ff_chunk_tokens=0`
    (whole): bf16 bit-equal, float32 ≤ 1e-6 relative; the FF really ran in ⌈rows·37 / chunk⌉ calls per block."""
    tr = tiny(variant, dtype)
    batch, options = diffusers_batch(tr.config, **_kwargs(tr.config, b=rows, dtype=dtype))
    calls = []
    hooks = [blk.ff.net[0].register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
             for blk in tr.transformer_blocks]  # the FF's up projection: once per chunk
    try:
        _run_chunks(tr, batch, options, semantics, dtype, rows, calls)
    finally:
        for hook in hooks:
            hook.remove()
    # the class swap keeps the name (ComfyUI's int8 fold looks for "FeedForward") and leaves no chunk behind
    for blk in tr.transformer_blocks:
        assert type(blk.ff).__name__ == "FeedForward" and "ff_chunk_tokens" not in vars(blk.ff)


def _run_chunks(tr, batch, options, semantics, dtype, rows, calls):
    """Whole, then chunks of 1, 5, 16, 73: the up projection called once per chunk per block, outputs as stated."""
    with torch.no_grad():
        whole = model_forward.run(tr, batch, semantics, None, dataclasses.replace(options, ff_chunk_tokens=0))
        assert len(calls) == len(tr.transformer_blocks)
        for chunk in (1, 5, 16, 73):
            calls.clear()
            got = model_forward.run(tr, batch, semantics, None,
                                    dataclasses.replace(options, ff_chunk_tokens=chunk))
            expected_calls = -(-rows * 37 // chunk) if chunk < rows * 37 else 1
            assert len(calls) == expected_calls * len(tr.transformer_blocks), (chunk, calls)
            for out, ref in zip(got, whole):
                if dtype == torch.bfloat16:
                    assert torch.equal(out, ref), (chunk, _rel(out, ref))
                else:
                    assert _rel(out, ref) <= 1e-6, (chunk, _rel(out, ref))


def test_feed_forward_slices_and_buffer():
    """`feed_forward` on a row-wise function: the slices are the batch's tokens in order, rows flattened."""
    seen = []

    def ff(x):
        seen.append(tuple(x.shape))
        return torch.cat([x, -x], dim=-1)

    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    out = model_forward.feed_forward(ff, x, 4)
    assert seen == [(4, 3), (4, 3), (2, 3)]
    assert torch.equal(out, torch.cat([x, -x], dim=-1))
    seen.clear()
    assert torch.equal(model_forward.feed_forward(ff, x, None), torch.cat([x, -x], dim=-1)) and seen == [(2, 5, 3)]


def test_options_validate_the_chunk_and_plain_ignores_it():
    assert ForwardOptions(ff_chunk_tokens=0).is_plain and ForwardOptions(ff_chunk_tokens=4096).is_plain
    assert not ForwardOptions(run_ax=False, ff_chunk_tokens=8).is_plain
    for bad in (-1, True, 2.5, "8"):
        with pytest.raises(ForwardContractError, match=r"options.ff_chunk_tokens=.*: expected None \(automatic\), 0"):
            ForwardOptions(ff_chunk_tokens=bad)


def test_auto_chunk_by_hand():
    """22B shape, bf16: the FF hidden is 4 × 4096 × 2 = 32,768 bytes per token; the limit 256 MiB = 8,192 tokens."""
    assert MP.auto_ff_chunk(8192) is None
    assert MP.auto_ff_chunk(8193) == 4097  # 2 pieces
    assert MP.auto_ff_chunk(32640) == 8160  # 1,069,547,520 B / 268,435,456 B = 3.98 -> 4 pieces
    assert MP.auto_ff_chunk(4096, batch=3) == 6144  # 12,288 tokens -> 2 pieces
    assert MP.resolve_ff_chunk(0, 10 ** 6) is None and MP.resolve_ff_chunk(500, 400) is None
    assert MP.resolve_ff_chunk(500, 400, batch=2) == 500
    tiny = MP.ActivationShape(video_dim=64, act_bytes=4)
    assert MP.auto_ff_chunk(10 ** 5, tiny) is None  # 10⁵ × 1,024 B = 98 MiB: under the limit


def _sp_chunk_rank(rank: int, world: int) -> dict:
    from mgpu_backend.splits.apply import apply_plan
    from mgpu_backend.splits.exchange import Exchange
    from mgpu_backend.splits.sequence import UlyssesSplit

    out = {}
    for variant in ("2.0", "2.3"):
        tr = build_tiny_modules(variant, 0)["transformer"].eval()
        use_processor(tr)
        split = UlyssesSplit(Exchange(None, world, rank))
        apply_plan(tr, split.plan, split.exchange)
        batch, options = diffusers_batch(tr.config, **_kwargs(tr.config))
        with torch.no_grad():
            for chunk in (0, 4):
                out[(variant, chunk)] = model_forward.run(tr, batch, REFERENCE, split,
                                                          dataclasses.replace(options, ff_chunk_tokens=chunk))
    return out


def test_chunked_feed_forward_under_a_sequence_split():
    """W = 2 gloo ranks, 37 tokens (19 per rank, one padded): chunks of 4 against whole on every rank, and against
    the one-process forward (float32: ≤ 1e-6 chunked vs whole; the split itself within 1e-5, the SP tests' bound)."""
    ranks = run_ranks(_sp_chunk_rank, 2)
    for variant in ("2.0", "2.3"):
        tr = build_tiny_modules(variant, 0)["transformer"].eval()
        use_processor(tr)
        batch, options = diffusers_batch(tr.config, **_kwargs(tr.config))
        with torch.no_grad():
            one = model_forward.run(tr, batch, REFERENCE, None, dataclasses.replace(options, ff_chunk_tokens=0))
        for res in ranks:
            for out, whole, ref in zip(res[(variant, 4)], res[(variant, 0)], one):
                assert _rel(out, whole) <= 1e-6
                assert _rel(out, ref) <= 1e-5


# ---- the activation plan -------------------------------------------------------------------------------------------

TINY = MP.ActivationShape(video_dim=64, audio_dim=32, mod_params=9, rope="split", in_channels=128, out_channels=128,
                          text_tokens=6, act_bytes=4, linear="bf16", timesteps="token+cross")


def test_plan_terms_by_hand():
    """10 of 20 video tokens (W = 2), 1 row, 5 audio tokens, u = 64, a = 32, e = 4, M = 9, every timestep per token
    (bytes, from the module docstring's items):
    inputs 10 × (128·4 + 24 + 4·4) = 5,520; across 10 × (256·(1 + 10 + 5) + 96·8) = 48,640; block 10 × 9·256 =
    23,040; attention 10 × 10·256 = 25,600; FF 10 × (256·8 + 256) + 10 × 2·4·4·64 = 43,520; v2a 10 × (256·8 +
    4·32·4) + 20 × 4·32·4 = 35,840; fixed 4·6·96·4 + 5·32·4·(18 + 14) + 20·128·4·2 = 50,176. Largest moment: the FF;
    modelled 170,896; peak ⌈1.044 × 170,896⌉ = 178,416 (bf16's FUDGE)."""
    t = MP.activation_terms(10, 20, TINY, 1, None, 5)
    assert (t.inputs, t.across, t.block, t.attention, t.feed_forward, t.video_to_audio, t.fixed) == \
        (5520, 48640, 23040, 25600, 43520, 35840, 50176)
    assert t.moment == "feed-forward" and t.modelled == 170896
    assert MP.FUDGE["bf16"] == 1.044 and t.peak == 178416
    # chunks of 3 tokens: 10 × (2,048 + 256) + 3 × 2,048 + the 10 × 256 output buffer = 31,744 -> v2a is the peak
    c = MP.activation_terms(10, 20, TINY, 1, 3, 5)
    assert c.feed_forward == 31744 and c.moment == "video→audio" and c.modelled == 170896 - 43520 + 35840
    # W = 1 (no exchange): attention 7 units; v2a without the gather 10 × 2,560
    one = MP.activation_terms(10, 10, TINY, 1, None, 5)
    assert one.attention == 10 * 7 * 256 and one.video_to_audio == 25600
    assert one.fixed == 9216 + 20480 + 10 * 128 * 4


def test_plan_is_monotone_and_chunking_never_costs():
    for shape in (TINY, MP.LTX22B, dataclasses.replace(MP.LTX22B, linear="int8", timesteps="row")):
        for world in (1, 2, 4, 8):
            previous = -1
            for n in (1, 10, 100, 1000, 4097, 8192, 8193, 20000, 50000, 100000):
                whole = MP.activation_bytes(n, n * world, shape)
                assert whole > previous
                previous = whole
                assert MP.activation_bytes(n, n * world, shape, 1, MP.auto_ff_chunk(n, shape)) <= whole
                assert MP.activation_bytes(n, n * world, shape, 1, 1024) <= whole or n <= 1024
    with pytest.raises(MP.MemoryPlanError, match="total_tokens=5 < tokens_per_rank=10"):
        MP.activation_bytes(10, 5)
    with pytest.raises(MP.MemoryPlanError, match=r"linear='fp16': choose one of bf16, fp8, int8"):
        MP.ActivationShape(linear="fp16")


def test_token_cap_is_the_largest_that_fits():
    for shape, world in ((MP.LTX22B, 1), (MP.LTX22B, 2), (dataclasses.replace(MP.LTX22B, linear="fp8"), 4)):
        for chunk in (0, None):
            budget = MP.MemoryBudget(24 * GiB, int(11.5 * GiB), 0, GiB, shape, 1, chunk)
            cap = MP.token_cap(budget, world)
            assert 0 < cap < 1 << 24
            assert budget.peak(cap, world) <= budget.available < budget.peak(cap + 1, world)
    full = MP.MemoryBudget(24 * GiB, 24 * GiB)
    assert MP.token_cap(full, 2) == 0
    assert MP.latent_tokens(121, 704, 1280) == 16 * 22 * 40
    with pytest.raises(MP.MemoryPlanError, match="frames=120: must be 8k\\+1"):
        MP.latent_tokens(120, 704, 1280)


def test_plan_cap_per_degree_reaches_the_splits():
    """An "auto" cap: the plan's cap at each degree; the stage's forward carries the cap of its degree, the spread
    guidance passes the cap of one rank; without a budget "auto" falls back to the fixed default."""
    budget = MP.MemoryBudget(24 * GiB, int(11.5 * GiB), shape=dataclasses.replace(MP.LTX22B, linear="fp8"))
    plan = ParallelPlan.hand_built(0, 2, CPU, PlanPolicy(2, token_cap=None, memory=budget), heads=32)
    cap1, cap2 = MP.token_cap(budget, 1), MP.token_cap(budget, 2)
    assert cap1 != cap2 and plan.cap_at(1) == cap1 and plan.token_cap == cap2
    run = plan.split("stage 1", 2 * cap2, 1)
    assert run.token_cap == cap2
    plan.check(2 * cap2)
    with pytest.raises(ValidationError, match=f"above the cap of {cap2}"):
        plan.check(2 * cap2 + 2)
    groups = PlanGroups(0, 2, CPU, {1: SPStage(1, None, None), 2: SPStage(2, None, None)}, {}, 32)
    assert ParallelPlan.for_policy(groups, token_cap="auto").token_cap == DEFAULT_TOKEN_CAP
    with_memory = dataclasses.replace(groups, memory=budget)
    assert ParallelPlan.for_policy(with_memory, token_cap="auto").cap_at(2) == cap2
    assert ParallelPlan.for_policy(with_memory, token_cap=5000).cap_at(2) == 5000  # an explicit int still wins
    with pytest.raises(ValidationError, match=r"token_cap='lots': must be a positive number"):
        ParallelPlan.for_policy(groups, token_cap="lots")


# ---- the refusal -------------------------------------------------------------------------------------------------

def test_refusal_names_the_longest_clip_and_the_ranks():
    """721 frames at 1280×704: 91 latent frames × 880 tokens = 80,080 tokens, 40,040 per rank on 2 ranks, above a
    cap of 30,000. Longest on 2 ranks: ⌊60,000 / 880⌋ = 68 latent frames = 8·67 + 1 = 537 frames. Ranks: the 8
    heads allow 1, 2, 4, 8; 80,080 / 4 = 20,020 ≤ 30,000 -> 4."""
    plan = ParallelPlan.hand_built(0, 2, CPU, PlanPolicy(2, token_cap=30000), heads=8)
    with pytest.raises(ValidationError) as exc:
        plan.check(80080, 880, "1280×704")
    assert str(exc.value) == ("80080 video tokens over 2 ranks is 40040 tokens per rank, above the cap of 30000; at "
                              "1280×704 the longest clip that fits 2 ranks is 537 frames: use at least 4 GPUs, fewer "
                              "frames or a smaller size, or raise the cap")
    plan.check(60000, 880, "1280×704")  # exactly at the cap: allowed


def test_in_process_refusal_names_the_longest_clip():
    """One process (no plan): the default cap 65,536 on one rank. 2048×2048 two-stage: stage 1 at 1024×1024 has
    32 × 32 = 1,024 tokens per latent frame; 1001 frames = 126 latent frames = 129,024 tokens. Longest: ⌊65,536 /
    1,024⌋ = 64 latent frames = 505 frames; 129,024 / 2 = 64,512 ≤ 65,536 -> 2 GPUs."""
    limits = StageLimits(family="2.0", n_blocks=2, heads=8)
    with pytest.raises(ValidationError) as exc:
        limits.check_tokens(129024, 1024, "2048×2048")
    assert str(exc.value) == ("129024 video tokens over 1 rank is 129024 tokens per rank, above the cap of 65536; at "
                              "2048×2048 the longest clip that fits 1 rank is 505 frames: use at least 2 GPUs, fewer "
                              "frames or a smaller size, or raise the cap")


def test_refusal_with_a_planned_cap_names_a_clip_that_fits():
    budget = MP.MemoryBudget(24 * GiB, int(11.5 * GiB), shape=dataclasses.replace(MP.LTX22B, linear="fp8"))
    plan = ParallelPlan.hand_built(0, 2, CPU, PlanPolicy(2, token_cap=None, memory=budget), heads=32)
    asked = MP.latent_tokens(1601, 704, 1280)
    with pytest.raises(ValidationError) as exc:
        plan.check(asked, 880, "1280×704")
    frames = int(re.search(r"the longest clip that fits 2 ranks is (\d+) frames", str(exc.value)).group(1))
    ranks = int(re.search(r"use at least (\d+) GPUs", str(exc.value)).group(1))
    fits = -(-MP.latent_tokens(frames, 704, 1280) // 2)
    more = -(-MP.latent_tokens(frames + 8, 704, 1280) // 2)
    assert budget.peak(fits, 2) <= budget.available < budget.peak(more, 2)
    assert ranks in (4, 8, 16, 32) and -(-asked // ranks) <= plan.cap_at(ranks)
    assert -(-asked // (ranks // 2)) > plan.cap_at(ranks // 2)


# ---- the bench ---------------------------------------------------------------------------------------------------

def _bench(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_long_clips.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_tiny_search_finds_the_planned_clip():
    """`--tiny`: the plan is the oracle on the CPU, so the doubling + bisection must land on the plan's frames."""
    out = _bench("--tiny")
    summary = out[out.index("summary:"):]
    lines = re.findall(r"^  W=(\d) ff (\w+): longest (\d+) frames .*the plan: (\d+) frames$", summary, re.M)
    assert len(lines) == 9, out
    assert all(found == planned for _, _, found, planned in lines)
    by = {(w, m): int(f) for w, m, f, _ in lines}
    assert by[("1", "64")] > by[("1", "off")]  # chunking lengthens the tiny model's clip at W = 1


def test_bench_fit_matches_the_plans_constants():
    out = _bench("--fit")
    rows = re.findall(r"^\| (bf16|fp8|int8) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    assert [(p, int(n)) for p, n, _, _ in rows] == [("bf16", 12), ("fp8", 18), ("int8", 9)]
    assert all(fitted == kept for _, _, fitted, kept in rows)


def test_chunked_feed_forward_in_compiled_blocks():
    """The blocks compiled (dynamo with the aot_eager backend: the tracing `compile_blocks` does, no C++ compiler
    needed): no graph break, the chunked forward equals the eager chunked one exactly, and a repeated chunk reuses
    its graph (one graph per chunk value, fixed Python-int slices)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from mgpu_backend.engine.compile import graph_breaks

    torch._dynamo.reset()
    counters.clear()
    tr = build_tiny_modules("2.3", 0)["transformer"].eval()
    use_processor(tr)
    batch, options = diffusers_batch(tr.config, **_kwargs(tr.config))
    try:
        with torch.no_grad():
            eager = model_forward.run(tr, batch, REFERENCE, None, dataclasses.replace(options, ff_chunk_tokens=5))
            for blk in tr.transformer_blocks:
                blk.compile(dynamic=False, backend="aot_eager")
            for chunk in (5, 5, 16):
                got = model_forward.run(tr, batch, REFERENCE, None,
                                        dataclasses.replace(options, ff_chunk_tokens=chunk))
                if chunk == 5:
                    assert all(torch.equal(g, e) for g, e in zip(got, eager))
        assert graph_breaks() == 0
        assert counters["stats"]["unique_graphs"] == 2  # chunks 5 and 16; the second call of 5 reused its graph
    finally:
        torch._dynamo.reset()
