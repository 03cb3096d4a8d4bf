"""Regional `torch.compile` (mgpu_backend/engine/compile.py) on real gloo ranks: the compiled sequence-parallel forward
equals the eager one, and the exchanges (custom ops `ltx2_mgpu::all_to_all` / `all_gather`) stay inside the
compiled block graphs — dynamo records no graph break.

The tiny LTX-2.0 checkpoint is loaded from the real single-file layout in each rank (float32). Cases: 9 video
tokens on W = 2 (padded keys), batch 1, with the guidance pass that swaps the self-attention processor (STG), so
each compile variant (local / SP processors, skipped self-attention) is exercised.

Tolerance: float32, relative L2 ≤ 1e-5 — inductor fuses the elementwise work and the RMS norms into other kernels
and may change the order of their reductions (one rounding of float32 is ~6e-8 relative; a few hundred ops deep).
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.engine import compile as C
from mgpu_backend.engine.denoiser import skip_self_attention
from mgpu_backend.splits.exchange import Exchange
from _forward import SequenceDriver
from test_sequence_parallel import _contexts, _forward, _forward_kwargs, _load

WORLD = 2
REL_TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _compile_rank(rank: int, world: int, files: dict) -> dict:
    components = _load(files, "2.0")
    sp = SequenceDriver(components.transformer, Exchange(None, world, rank))
    kwargs = _forward_kwargs(components, "odd", _contexts(components))  # 9 tokens over 2 ranks: padded keys
    out = {"eager": _forward(sp, kwargs)}
    with skip_self_attention(components.transformer, (1,), (0,)):
        out["eager_stg"] = _forward(sp, kwargs)
    assert C.compile_blocks(components.transformer) == len(components.transformer.transformer_blocks)
    assert C.compile_blocks(components.transformer) == 0  # already compiled: nothing to do
    out["compiled"] = _forward(sp, kwargs)
    with skip_self_attention(components.transformer, (1,), (0,)):
        out["compiled_stg"] = _forward(sp, kwargs)
    out["compiled_again"] = _forward(sp, kwargs)
    out["graph_breaks"] = C.graph_breaks()
    # the fleet's policy switch (a job with compile off, then on again) on this resident transformer
    from mgpu_backend.protocol.fleet_config import FleetIdentity, FleetPolicy
    from mgpu_backend.serving.worker import WorkerState

    blocks = components.transformer.transformer_blocks
    state = WorkerState.__new__(WorkerState)  # a rank's state without the fleet around it: no plan, just the model
    state.components, state.plan, state.policy, state.sharding = components, None, FleetPolicy(compile=True), None
    state.placement = "replicated"  # the fleet's weights (a mode, or the `WeightPlacement` a worker resolves)
    state.config = FleetIdentity(devices=("cpu",) * world, checkpoint=str(files["2.0"]["checkpoint"]),  # for the rules
                                 gemma=str(files["2.0"]["gemma"]))
    state.apply_policy(FleetPolicy(compile=False))
    out["compiled_blocks_off"] = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    out["eager_after_off"] = _forward(sp, kwargs)
    state.apply_policy(FleetPolicy(compile=True))
    out["compiled_blocks_on"] = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    out["compiled_after_on"] = _forward(sp, kwargs)
    out["blocks"] = len(blocks)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_dir):
    return run_ranks(_compile_rank, WORLD, {"2.0": tiny_dir["2.0"]}, timeout_s=600)


def test_compiled_sequence_parallel_equals_eager(ranks):
    for rank, out in enumerate(ranks):
        for eager, compiled in (("eager", "compiled"), ("eager_stg", "compiled_stg"), ("eager", "compiled_again")):
            for i, name in enumerate(("video", "audio")):
                err = _rel(out[compiled][i], out[eager][i])
                assert err <= REL_TOL, (rank, compiled, name, err)
        # the STG pass really ran another graph (its output differs from the plain pass)
        assert _rel(out["compiled_stg"][0], out["compiled"][0]) > 1e-3
    # every rank gathered the same full output
    assert torch.equal(ranks[0]["compiled"][0], ranks[1]["compiled"][0])


def test_exchanges_do_not_break_the_compiled_graph(ranks):
    assert [out["graph_breaks"] for out in ranks] == [0, 0]


def test_compile_policy_switches_off_to_eager_and_on_again(ranks):
    """`compile` is fleet policy: a job with it off restores the eager blocks (the forward equals the eager one bit
    for bit), a later job with it on compiles them again (dynamo's cache kept) — on the same resident weights."""
    for out in ranks:
        assert out["compiled_blocks_off"] == 0 and out["compiled_blocks_on"] == out["blocks"] > 0
        for i in range(2):
            assert torch.equal(out["eager_after_off"][i], out["eager"][i])
            assert _rel(out["compiled_after_on"][i], out["eager"][i]) <= REL_TOL
