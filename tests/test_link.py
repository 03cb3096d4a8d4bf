"""The link probe (`splits/link.py`, `protocol/link.py`): on a real gloo group of 2 ranks it measures a positive,
finite all_gather bus bandwidth (no threshold: the figure depends on the machine) that is the nccl-tests formula of
its own timing, the same on both ranks; the bytes the prediction reads off a transformer (a sharded block counts
whole); and a real 2-rank CPU fleet carries the report to its status."""
from __future__ import annotations

import math

import pytest
import torch

from _dist import run_ranks
from mgpu_backend.protocol.link import LinkReport
from mgpu_backend.splits import link as L


def _probe(rank: int, world_size: int) -> dict:
    report = L.measure_link(torch.device("cpu"), ("cpu",) * world_size)
    return {"report": report}


def test_gloo_probe_measures_a_positive_finite_bandwidth():
    reports = [r["report"] for r in run_ranks(_probe, 2)]
    r0, r1 = reports
    for r in reports:
        assert isinstance(r, LinkReport)
        assert r.backend == "gloo" and r.world_size == 2 and r.devices == ("cpu", "cpu")
        assert r.message_bytes == 256 * 2**10 and r.iterations == 3 and r.warmups == 1  # gloo's tiny defaults
        assert math.isfinite(r.all_gather_GBps) and r.all_gather_GBps > 0
        # bus bandwidth = bytes per rank × (W − 1) / seconds per all_gather (nccl-tests), from the report's own time
        assert r.all_gather_GBps == pytest.approx(256 * 2**10 * (2 - 1) / r.all_gather_seconds / 1e9)
        assert r.p2p is None and r.h2d_GBps is None  # CPU ranks: no peer access, no host -> device copy
    assert r0.all_gather_seconds == r1.all_gather_seconds  # the slowest rank's time, on both (all_reduce MAX)
    assert r0.matmul_TFLOPS > 0 and r1.matmul_TFLOPS is None  # rank 0's alone
    assert "all_gather" in r0.describe() and "GB/s bus bandwidth (gloo, 2 ranks, 256 KiB per rank)" in r0.describe()


def test_link_report_refuses_a_figure_that_is_not_positive():
    fields = dict(backend="nccl", world_size=2, devices=("cuda:0", "cuda:1"), message_bytes=64 * 2**20,
                  all_gather_seconds=0.01, all_gather_GBps=6.7, p2p=False, h2d_GBps=24.0, matmul_TFLOPS=150.0,
                  iterations=10, warmups=3, seconds=0.4)
    report = LinkReport(**fields)
    assert report.describe() == ("link (measured at start): all_gather 6.7 GB/s bus bandwidth (nccl, 2 ranks, 64 MiB "
                                 "per rank), no P2P between the GPUs (through host memory), host -> GPU 24.0 GB/s "
                                 "pinned, matmul 150 TFLOPS")
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="all_gather_GBps"):
            LinkReport(**{**fields, "all_gather_GBps": bad})


class _Toy(torch.nn.Module):
    """Three float32 blocks of Linear(4, 8) (32 weights + 8 biases = 160 bytes each) and a bf16 Linear(2, 3)
    outside them (6 + 3 = 9 parameters = 18 bytes)."""

    def __init__(self):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(4, 8) for _ in range(3))
        self.proj = torch.nn.Linear(2, 3).to(torch.bfloat16)


def test_model_bytes_of_a_replicated_transformer():
    connector = torch.nn.Linear(5, 5)  # 25 + 5 float32 = 120 bytes
    model, gathered = L.model_bytes(_Toy(), (connector, None))
    assert (model.blocks, model.block_bytes, model.other_bytes, model.text_bytes) == (3, 160, 18, 120)
    assert gathered == ()


def _sharded_bytes(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    toy = _Toy()
    fully_shard(toy.transformer_blocks[1])  # one block sharded over the 2 ranks (FSDP2)
    model, gathered = L.model_bytes(toy)
    return {"model": (model.blocks, model.block_bytes, model.other_bytes), "gathered": gathered}


def test_model_bytes_counts_a_sharded_block_whole():
    """On 2 gloo ranks with block 1 FSDP-sharded: each rank holds half of it, the bytes count it whole (160) and
    it is the one gathered."""
    for r in run_ranks(_sharded_bytes, 2):
        assert r["model"] == (3, 160, 18) and r["gathered"] == (1,)


def test_a_cpu_fleet_reports_its_link(tiny_dir):
    """A real 2-rank CPU fleet (transformer only): its status (`Fleet.describe`, what the controller's status, Fleet
    (MGPU) and Load Checkpoint (MGPU) show) carries rank 0's measured link; CPU ranks predict no step time."""
    from mgpu_backend.protocol.fleet_config import FleetConfig
    from mgpu_backend.serving.fleet import Fleet

    config = FleetConfig(devices=("cpu",) * 2, checkpoint=str(tiny_dir["2.3"]["checkpoint"]), gemma=None,
                         transformer_only=True, gemma_unload=True, dtype="float32", init_timeout_s=120.0)
    fleet = Fleet(config, generation=1)
    try:
        status = fleet.describe()
    finally:
        fleet.shutdown()
    link = status.link
    assert isinstance(link, LinkReport) and link.backend == "gloo" and link.world_size == 2
    assert math.isfinite(link.all_gather_GBps) and link.all_gather_GBps > 0
    assert link.matmul_TFLOPS > 0  # rank 0's report
    assert status.predicted == ()
