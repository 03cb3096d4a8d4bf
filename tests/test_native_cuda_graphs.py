"""The native MODEL's forward (`NativeEngine.run_rows` -> `model_forward.run`) replayed from CUDA graphs (issue 19 / 20 on CUDA).

GPU (marked `gpu`, skipped without CUDA): on the tiny LTX-2.3 model in bf16, every golden case of
`test_native_forward.py` — text-to-video at B = 1 and 2, per-token timesteps, STG, modality guidance, guides at
strength 1 and 0.7 (the dense guide-attention bias), a pixel-mask guide, an IC-LoRA guide with dropped tokens,
reference audio — forwarded eagerly (graphs off) and then three times through the graphs (warm-up, capture, replay)
gives the same bits, in one process and on a simulated 2-way sequence-parallel rank (the collectives are local copies
and graph-segment boundaries, like the real ones); new inputs at a captured key are honoured (the guide bias's
weights are a graph input); a block loop that cannot be captured falls back to eager, logged by name.
CPU (CI): a CPU forward never touches the graph machinery.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from mgpu_backend.engine import cuda_graphs as G
from mgpu_backend.stages import native as N
from mgpu_backend.models.loader import load_components
from mgpu_backend.splits.sequence import SequenceParallelTransformer
from test_cuda_graphs import _CopyExchange  # one simulated W-way exchange on one GPU
from test_native_forward import golden_requests, load_golden

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def _engine(tiny_dir, device: str, dtype: torch.dtype) -> N.NativeEngine:
    components = load_components(tiny_dir["2.3"]["checkpoint"], dtype=dtype, device=torch.device(device))
    return N.NativeEngine(components, None, dtype, torch.device(device))


def _forward(eng: N.NativeEngine, req):
    context, missing = eng.resolve_context(req)
    assert not missing
    result = eng.forward(req, context)
    return result.video, result.audio


def _eager(eng, req):
    G.set_mode("off")
    try:
        return _forward(eng, req)
    finally:
        G.set_mode("auto")


def test_cpu_native_forward_never_touches_graphs(tiny_dir):
    eng = _engine(tiny_dir, "cpu", torch.float32)
    req = golden_requests(*load_golden())["stg_b1"]
    _forward(eng, req)
    assert getattr(eng.transformer, "_ltx2_forward_graphs", None) is None and eng.graph_fallbacks == []


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_graphed_native_equals_eager_bitwise(tiny_dir, world, mark):
    eng = _engine(tiny_dir, "cuda", torch.bfloat16)
    if world > 1:  # one simulated rank of a W-way sequence-parallel split
        eng._local = SequenceParallelTransformer(eng.transformer, _CopyExchange(world))
    requests = golden_requests(*load_golden())
    eager = {name: _eager(eng, req) for name, req in requests.items()}
    for _ in range(3):  # warm-up, capture, replay
        for name, req in requests.items():
            video, audio = _forward(eng, req)
            assert torch.equal(video, eager[name][0]) and torch.equal(audio, eager[name][1]), name
    cache = G.graphs_of(eng.transformer)
    assert not cache.failed and eng.graph_fallbacks == [], cache.failed
    assert cache.captures >= 1 and sum(e.replays for e in cache.entries.values()) >= len(requests)
    if world > 1:
        assert max(e.capture.segments for e in cache.entries.values()) > 1  # piecewise around the collectives
    print(G.report(eng.transformer))
    # new values at a captured key: other latents, and other guide strengths (the bias's weights are graph inputs)
    for name in ("guides_s07_b2", "t2v_b2"):
        req = requests[name]
        other = dataclasses.replace(req, video=req.video * 0.5, guide_attention_entries=tuple(
            dataclasses.replace(e, strength=0.4) for e in req.guide_attention_entries))
        want = _eager(eng, other)
        got = _forward(eng, other)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        assert not torch.equal(got[0], eager[name][0]), name
    cache.clear()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_uncapturable_native_forward_falls_back_by_name(tiny_dir, mark, monkeypatch, caplog):
    eng = _engine(tiny_dir, "cuda", torch.bfloat16)
    req = golden_requests(*load_golden())["t2v_b1"]
    want = _eager(eng, req)
    from mgpu_backend.engine import forward as model_forward

    block = model_forward.comfy_block  # the one forward's ComfyUI block order (issue 25)

    def syncing(*args, **kwargs):  # a host synchronisation inside the loop: not capturable
        vx, ax = block(*args, **kwargs)
        return vx * float(vx.abs().sum().item() >= 0), ax

    monkeypatch.setattr(model_forward, "comfy_block", syncing)
    with caplog.at_level(logging.WARNING, logger="ltx2_mgpu.native"):
        outs = [_forward(eng, req) for _ in range(3)]
    assert all(torch.equal(v, want[0]) and torch.equal(a, want[1]) for v, a in outs)
    assert any("native forward runs eagerly: native forward not capturable" in r.message for r in caplog.records)
    assert len(eng.graph_fallbacks) == 1 and "not capturable" in G.report(eng.transformer)
    G.graphs_of(eng.transformer).clear()
