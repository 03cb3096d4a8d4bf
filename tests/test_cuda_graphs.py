"""CUDA graphs of the transformer forward and the fp8 matmul path (issue 16).

CPU (CI): the selection and fallback logic — a CPU forward never touches the graph machinery (unchanged), the key
separates what the captured kernels depend on (STG processors, isolation, fp8 weight generation), `collective` is
the plain collective outside a capture, modes are checked by name.
GPU (marked `gpu`, skipped without CUDA): on the tiny LTX-2.0 / 2.3 models in bf16, a forward replayed from graphs
equals its eager forward bit for bit (the same kernels on the same inputs) for every guidance pass, piecewise around
simulated collectives too, with compiled blocks to bf16 tolerance; a forward that synchronises with the host falls
back to eager with the reason in the report; batched passes equal the single passes to bf16 tolerance; fp8 matmuls
equal the quantized product to one bf16 rounding.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mgpu_backend.engine import cuda_graphs as G
from mgpu_backend.engine import latents as L
from mgpu_backend.engine import sampling as S
from mgpu_backend.engine.denoiser import LTX2Denoiser, skip_self_attention, text_contexts
from mgpu_backend.models import fp8 as F8
from mgpu_backend.models.loader import load_components
from mgpu_backend.splits.exchange import Exchange
from mgpu_backend.splits.apply import apply_plan
from mgpu_backend.splits.sequence import UlyssesSplit

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
GRID = (2, 2, 4)
AUDIO_TOKENS = 5
VIDEO = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(1,), rescale=0.7, modality_scale=3.0)
AUDIO = S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(0,), rescale=0.7, modality_scale=3.0)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _inputs(grid, seed: int = 4) -> S.ModelInputs:
    """A denoiser step's inputs for a latent of `grid` (frames, height, width) tokens, on the CPU."""
    f, h, w = grid
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, f * h * w, 128, generator=g)
    a = torch.randn(1, AUDIO_TOKENS, 128, generator=g)
    return S.ModelInputs(x, a, torch.full((1, f * h * w), 0.6), torch.full((1, AUDIO_TOKENS), 0.6),
                         torch.tensor([0.6]), torch.tensor([0.6]), S.GuidancePass("cond"), 0)


def _setup(tiny_dir, variant: str, device: str, dtype: torch.dtype, checkpoint: str = "checkpoint"):
    """(transformer, denoiser(split=None, grid=GRID) factory, inputs at GRID)."""
    components = load_components(tiny_dir[variant][checkpoint], dtype=dtype)
    transformer = components.transformer.to(device)
    components.video_connector.to(device)
    components.audio_connector.to(device)
    width = components.video_connector.inner_dim + (components.audio_connector.inner_dim
                                                    if components.variant == "2.3" else 0)
    g = torch.Generator().manual_seed(4)
    contexts = text_contexts(components, [torch.randn(1, 7, width, generator=g), torch.randn(1, 3, width, generator=g)],
                             dtype=dtype)

    def denoiser(split=None, grid=GRID) -> LTX2Denoiser:
        if split is not None:
            apply_plan(transformer, split.plan, split.exchange)
        f, h, w = grid
        return LTX2Denoiser(transformer, contexts.select(0), contexts.select(1),
                            L.video_coords(transformer, 1, f, h, w, 24.0, device=device),
                            L.audio_coords(transformer, 1, AUDIO_TOKENS, device=device), dtype, split=split)

    return transformer, denoiser, _inputs(GRID)


# ---- CPU: selection and fallback logic -------------------------------------------------------------------------------

def test_cpu_forward_is_unchanged_and_untouched(tiny_dir):
    transformer, denoiser, inputs = _setup(tiny_dir, "2.0", "cpu", torch.float32)
    d = denoiser()
    got = d(inputs)
    kwargs = dict(hidden_states=inputs.video)
    assert G.eligible(kwargs) == "not a CUDA forward"
    assert getattr(transformer, "_ltx2_forward_graphs", None) is None  # no cache: nothing captured or noted
    assert G.report(transformer) is None
    G.set_mode("off")
    try:
        assert torch.equal(d(inputs)[0], got[0])  # same forward either way on the CPU
        assert G.eligible({"x": torch.zeros(1)}) == "CUDA graphs set off"
    finally:
        G.set_mode("auto")
    with pytest.raises(ValueError, match="'always'.*auto, off"):
        G.set_mode("always")


def test_key_separates_what_the_kernels_depend_on(tiny_dir):
    transformer, _, _ = _setup(tiny_dir, "2.0", "cpu", torch.float32)
    kwargs = dict(hidden_states=torch.zeros(1, 4, 128), isolate_modalities=False)
    base = G.forward_key(transformer, kwargs)
    assert G.forward_key(transformer, dict(kwargs)) == base
    assert G.forward_key(transformer, dict(kwargs, isolate_modalities=True)) != base
    assert G.forward_key(transformer, dict(kwargs, hidden_states=torch.zeros(1, 8, 128))) != base
    with skip_self_attention(transformer, (1,), ()):
        stg = G.forward_key(transformer, kwargs)
    with skip_self_attention(transformer, (0,), ()):
        assert G.forward_key(transformer, kwargs) not in (base, stg)
    assert G.forward_key(transformer, kwargs) == base  # processors restored
    F8.WEIGHT_GENERATION[0] += 1  # an fp8 layer's weight or scale replaced by another tensor object
    assert G.forward_key(transformer, kwargs) != base
    apply_plan(transformer, UlyssesSplit(Exchange(None, 1, 0)).plan, Exchange(None, 1, 0))
    assert G.forward_key(transformer, kwargs) != G.forward_key(transformer, kwargs, extra="other")


def test_collective_outside_a_capture_is_the_collective():
    out = torch.zeros(3)
    assert G.collective(lambda o, i: o.copy_(i * 2), torch.ones(3), out) is out
    assert torch.equal(out, torch.full((3,), 2.0)) and not G.capturing()


# ---- GPU ---------------------------------------------------------------------------------------------------------

@torch.library.custom_op("ltx2_mgpu_test::copy_exchange", mutates_args=())
def _copy_exchange(x: torch.Tensor) -> torch.Tensor:
    """A local copy standing in for a collective: a custom op like the real exchanges (opaque to the compiler) and a
    graph-segment boundary like them."""
    return G.collective(lambda out, inp: out.copy_(inp), x.contiguous(), torch.empty_like(x))


@_copy_exchange.register_fake
def _(x):
    return torch.empty_like(x)


class _CopyExchange(Exchange):
    """A W-way exchange on one GPU: the shapes of the collectives, local copies as the data, each a graph-segment
    boundary (`cuda_graphs.collective`) like the real all_to_all / all_gather."""

    def __init__(self, world_size: int):
        super().__init__(None, world_size, 0)
        self.calls = 0

    def _copy(self, x):
        self.calls += 1
        return _copy_exchange(x)

    def seq_to_heads(self, x):
        return self._copy(x[:, :, : x.shape[2] // self.world_size].repeat(1, self.world_size, 1, 1))

    def heads_to_seq(self, x):
        return self._copy(x[:, : x.shape[1] // self.world_size].repeat(1, 1, self.world_size, 1))

    def all_gather_seq(self, x, dim=1):
        return self._copy(torch.cat([x] * self.world_size, dim=dim))


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_graphed_passes_equal_eager_bitwise(tiny_dir, variant, mark):
    transformer, denoiser, inputs = _setup(tiny_dir, variant, "cuda", torch.bfloat16)
    passes = S.plan_passes(VIDEO, AUDIO)
    d = denoiser()
    G.set_mode("off")
    try:
        eager = [d(dataclasses.replace(inputs, guidance=p)) for p in passes]
    finally:
        G.set_mode("auto")
    for _ in range(3):  # warm-up, capture, replay
        got = [d(dataclasses.replace(inputs, guidance=p)) for p in passes]
        for p, (gv, ga), (ev, ea) in zip(passes, got, eager):
            assert torch.equal(gv, ev) and torch.equal(ga, ea), p.kind
    cache = G.graphs_of(transformer)
    # one graph per pass set: cond and uncond differ only in their inputs' values (they share one), STG, isolated
    assert len(cache.entries) == 3 and not cache.failed
    assert sum(e.replays for e in cache.entries.values()) == 9  # uncond from round 1, all but 2 warm-ups later
    print(G.report(transformer))
    # new inputs go through the captured graphs (copied into their static inputs)
    other = dataclasses.replace(inputs, video=inputs.video * 0.5, guidance=passes[2])
    G.set_mode("off")
    try:
        want = d(other)
    finally:
        G.set_mode("auto")
    assert torch.equal(d(other)[0], want[0])
    cache.clear()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_piecewise_around_collectives_and_compiled(tiny_dir, mark):
    from mgpu_backend.engine import compile as C

    transformer, denoiser, inputs = _setup(tiny_dir, "2.0", "cuda", torch.bfloat16)
    exchange = _CopyExchange(2)
    d = denoiser(UlyssesSplit(exchange))
    G.set_mode("off")
    try:
        want = d(inputs)
    finally:
        G.set_mode("auto")
    per_forward = exchange.calls
    for _ in range(3):
        got = d(inputs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    entry = next(iter(G.graphs_of(transformer).entries.values()))
    assert entry.capture.segments == per_forward + 1  # a segment between each pair of collectives
    print(G.report(transformer))
    C.compile_blocks(transformer)
    try:
        compiled = [d(inputs) for _ in range(3)]
        assert all(_rel(c[0], want[0]) < 2e-2 for c in compiled)
        assert torch.equal(compiled[1][0], compiled[2][0])
    finally:
        C.uncompile_blocks(transformer)
        G.graphs_of(transformer).clear()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_capture_failure_falls_back_with_reason(tiny_dir, mark):
    transformer, _, _ = _setup(tiny_dir, "2.0", "cuda", torch.bfloat16)
    x = torch.randn(4, 16, device="cuda")

    def syncing(x):
        return x * float(x.sum().item() != 0)  # a host synchronisation: not capturable

    outs = [G.call(transformer, syncing, {"x": x}, extra="syncing", what="test forward") for _ in range(3)]
    assert all(torch.equal(o, x) for o in outs)
    assert "test forward not capturable" in G.report(transformer)
    G.graphs_of(transformer).clear()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_failed_capture_leaves_the_process_usable(tiny_dir, mark):
    """A capture invalidated after a random op (the generator entered capture mode, `capture_end` raised) leaves
    random ops and later captures working: the sampler's noise and the compiler's autotuning draw random numbers."""
    transformer, _, _ = _setup(tiny_dir, "2.0", "cuda", torch.bfloat16)
    x = torch.randn(4, 16, device="cuda")

    def random_then_sync(x):
        noise = torch.randn_like(x)  # advances the generator's offset inside the capture
        return x + noise * float(noise.sum().item() > 1e9)  # a host synchronisation: the capture is invalidated

    for _ in range(3):
        G.call(transformer, random_then_sync, {"x": x}, extra="random", what="random forward")
    assert "random forward not capturable" in G.report(transformer)
    torch.cuda.manual_seed(3)
    a = torch.randn(8, device="cuda")  # raised "Offset increment outside graph capture" before the recovery
    torch.cuda.manual_seed(3)
    assert torch.equal(torch.randn(8, device="cuda"), a)
    outs = [G.call(transformer, lambda x: x * 2 + 1, {"x": x}, extra="good", what="good forward") for _ in range(3)]
    assert all(torch.equal(o, x * 2 + 1) for o in outs)
    good = [e for e in G.graphs_of(transformer).entries.values() if e.what == "good forward"]
    assert len(good) == 1 and good[0].replays == 2  # warm-up; capture + replay; replay
    G.graphs_of(transformer).clear()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_compiled_blocks_keep_their_graphs_through_a_recompile(tiny_dir, mark):
    """Compiled blocks + CUDA graphs, the compiled mode's path: the batched guidance passes (per-item STG and
    isolation) are captured and replayed at one size, a second size recompiles the blocks mid-run and is captured
    too, and the first size's graphs replay afterwards; every forward equals the eager one to bf16 tolerance, none
    stays eager, and random numbers still draw (the sampler's noise between the stages)."""
    from mgpu_backend.engine import compile as C

    passes = S.plan_passes(VIDEO, AUDIO)
    transformer, denoiser, first = _setup(tiny_dir, "2.0", "cuda", torch.bfloat16)
    second = _inputs((3, 2, 2), 5)
    G.set_mode("off")
    try:
        want = {id(i): denoiser(grid=g).batch(i, passes) for g, i in ((GRID, first), ((3, 2, 2), second))}
    finally:
        G.set_mode("auto")
    cache = G.graphs_of(transformer)
    C.compile_blocks(transformer)
    try:
        for grid, inputs, rounds in ((GRID, first, 3), ((3, 2, 2), second, 3), (GRID, first, 2)):
            d = denoiser(grid=grid)
            for _ in range(rounds):  # compile + warm-up; capture; replay (the first size again: replays only)
                for (gv, ga), (ev, ea) in zip(d.batch(inputs, passes), want[id(inputs)]):
                    assert _rel(gv, ev) < 2e-2 and _rel(ga, ea) < 2e-2
            torch.randn(4, device="cuda")
        assert not cache.failed, cache.failed
        assert len(cache.entries) == 2 and cache.captures == 2
        assert sorted(e.replays for e in cache.entries.values()) == [2, 4]
        print(G.report(transformer))
    finally:
        C.uncompile_blocks(transformer)
        cache.clear()


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_batched_passes_on_gpu(tiny_dir, variant, mark):
    transformer, denoiser, inputs = _setup(tiny_dir, variant, "cuda", torch.bfloat16)
    passes = S.plan_passes(VIDEO, AUDIO)
    d = denoiser()
    singles = [d(dataclasses.replace(inputs, guidance=p)) for p in passes]
    for _ in range(3):  # eager, captured, replayed
        batched = d.batch(inputs, passes)
        for p, (bv, ba), (sv, sa) in zip(passes, batched, singles):
            assert _rel(bv, sv) < 2e-2 and _rel(ba, sa) < 2e-2, p.kind
    d.batch_mode = "auto"
    assert d.batch_choice(passes, inputs.video)
    print(d.batch_report())
    G.graphs_of(transformer).clear()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_fp8_matmul_path_on_gpu(tiny_dir, mark):
    transformer, denoiser, inputs = _setup(tiny_dir, "2.0", "cuda", torch.bfloat16, "checkpoint_fp8")
    layers = [m for m in transformer.modules() if isinstance(m, F8.FP8Linear)]
    x = torch.randn(77, layers[0].in_features, device="cuda", dtype=torch.bfloat16)
    layer = layers[0]
    expect = "scaled_mm" if F8.scaled_mm_capable(x.device) and layer.in_features % 16 == 0 \
        and layer.out_features % 16 == 0 else "dequantize"
    assert F8.compute_path(layer, x)[0] == expect
    got = layer(x)
    exact = torch.nn.functional.linear(x.float(), layer.dequantized_weight().float(), layer.bias.float())
    assert _rel(got, exact) < 0.06
    if expect == "scaled_mm":
        xq, sa = F8.quantize_rows(x)
        torch_q, torch_s = F8._quantize_rows_torch(x)  # the Triton kernel = the torch expression (but its division
        # may round differently in the last bit: a code may differ by one step, rarely)
        assert torch.allclose(sa, torch_s, rtol=1e-6, atol=0)
        assert float((xq.float() != torch_q.float()).float().mean()) < 1e-2
        want = (xq.float() * sa) @ (layer.weight.float() * layer.weight_scale).t() + layer.bias.float()
        assert _rel(got, want) < 2 ** -7
    d = denoiser()
    video, audio = d(inputs)
    F8.set_compute("off")
    try:
        ref = d(inputs)
    finally:
        F8.set_compute("auto")
    print(F8.compute_report(transformer), _rel(video, ref[0]), _rel(audio, ref[1]))
    assert _rel(video, ref[0]) < 0.1 and _rel(audio, ref[1]) < 0.1
    G.graphs_of(transformer).clear()


def test_speed_report_lines(tiny_dir):
    """The job report's `speed` entry: nothing for a CPU bf16 job; the fp8 path and the batching notes when there."""
    from mgpu_backend.engine.denoiser import speed_report

    transformer, denoiser, inputs = _setup(tiny_dir, "2.0", "cpu", torch.float32)
    denoiser()(inputs)
    assert speed_report(transformer) == []
    fp8, denoiser8, _ = _setup(tiny_dir, "2.0", "cpu", torch.float32, "checkpoint_fp8")
    denoiser8()(inputs)
    lines = speed_report(fp8, {"stage 1": "guidance passes: 3 steps: 4 passes as one batched forward"})
    assert lines[0].startswith("fp8 compute: 0 of ") and "CPU" in lines[0]
    assert lines[1] == "stage 1: guidance passes: 3 steps: 4 passes as one batched forward"
