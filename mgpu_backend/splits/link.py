"""The link probe: what the fleet's links and rank 0's GPU do, measured once when the fleet starts (issue 35 item 3),
and the facts the step-time prediction of `splits/weights_cost.py` reads from the loaded transformer.

`measure_link` (a collective: every rank of the group calls it) times all_gathers of `message_bytes` per rank after a
few untimed warm-ups: each rank times its loop between two synchronizations (an all_reduce; on CUDA
`torch.cuda.synchronize` too), the slowest rank's time is taken (one all_reduce MAX), and the bus bandwidth is
message_bytes × (W − 1) / (time per all_gather) — the nccl-tests definition (the gathered W × message_bytes ×
(W − 1)/W per second), what each rank receives per second. Rank 0 then checks P2P between every pair of the fleet's
CUDA devices (`torch.cuda.can_device_access_peer`) and times pinned host -> device copies of `message_bytes` and a
dense matmul (bfloat16 8192³ on CUDA, float32 256³ on CPU). Defaults: 64 MiB per rank, 3 warm-ups and 10 timed
all_gathers on CUDA (a PCIe link at 10 GB/s: ~0.2 s at W = 4); 256 KiB, 1 and 3 on gloo (milliseconds), so every
fleet runs it at start without a switch.

`probe_at_start` is what a worker calls once its process group is up and its weights are loaded
(`serving/worker.py`): the `LinkReport` (every rank gets the same all_gather figure; the rest is rank 0's) and, on
CUDA, the `weights_cost.FleetFacts` of the running fleet (None on CPU ranks: the compute model is of CUDA GPUs).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..protocol.link import LinkReport
from .cost import ModelShape
from .weights_cost import H200_MATMUL_TFLOPS, FleetFacts, ModelBytes

MIB = 2**20
CUDA_DEFAULTS = (64 * MIB, 3, 10)  # message bytes per rank, warm-ups, timed iterations
GLOO_DEFAULTS = (256 * 2**10, 1, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, nccl: bool, world_size: int) -> None:
    if nccl:
        dist.all_gather_into_tensor(out, inp, group=group)
    else:  # gloo: the list form (as splits/exchange.py)
        dist.all_gather(list(out.view(world_size, -1).unbind(0)), inp, group=group)


def time_all_gather(device: torch.device, message_bytes: int, warmups: int, iterations: int,
                    group=None) -> float | None:
    """Seconds of one all_gather of `message_bytes` per rank on `group` (the slowest rank's loop / iterations; the
    same value on every rank); None on every rank when one could not allocate its buffers. A collective: every rank
    of the group calls it."""
    world_size = dist.get_world_size(group)
    nccl = dist.get_backend(group) == "nccl"
    flag = torch.ones(1, dtype=torch.float64, device=device)
    try:
        inp = torch.ones(message_bytes, dtype=torch.uint8, device=device)
        out = torch.empty(world_size * message_bytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:  # a full card: no rank times (they agree first, so none waits in a collective)
        inp = out = None
        flag.zero_()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if not flag.item():
        return None
    for _ in range(warmups):
        _all_gather(out, inp, group, nccl, world_size)
    dist.all_reduce(flag, group=group)  # every rank starts the timed loop together
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iterations):
        _all_gather(out, inp, group, nccl, world_size)
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    del inp, out
    return float(elapsed.item()) / iterations


def peer_access(devices: Sequence[str]) -> bool | None:
    """True when every pair of the distinct CUDA devices in `devices` can access each other's memory (both
    directions), False when one pair cannot, None with fewer than two CUDA devices."""
    indices = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})
    if len(indices) < 2:
        return None
    return all(torch.cuda.can_device_access_peer(a, b) for a in indices for b in indices if a != b)


def time_h2d(device: torch.device, nbytes: int, warmups: int, iterations: int) -> float | None:
    """Pinned host -> `device` copy rate, GB/s (None off CUDA)."""
    if device.type != "cuda":
        return None
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(warmups):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iterations):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes * iterations / (time.perf_counter() - t0) / 1e9


def time_matmul(device: torch.device, warmups: int, iterations: int) -> float:
    """Dense matmul rate, TFLOPS (2·n³ per product): bfloat16 n = 8192 on CUDA, float32 n = 256 on CPU."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    for _ in range(max(1, warmups)):
        c = a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iterations):
        c = a @ b
    _sync(device)
    del c
    return 2 * n**3 * iterations / (time.perf_counter() - t0) / 1e12


def measure_link(device: torch.device, devices: Sequence[str], group=None, message_bytes: int | None = None,
                 warmups: int | None = None, iterations: int | None = None) -> LinkReport:
    """The `LinkReport` of `group` (the default group: the fleet) seen from this rank; a collective at W > 1.
    `devices`: the fleet's device per rank (for the P2P check); `message_bytes` / `warmups` / `iterations`: the
    backend's defaults (module docstring) when None. Rank 0 alone runs the P2P check, the host copy and the matmul
    (the other ranks report None for them: only rank 0's report is kept)."""
    t0 = time.perf_counter()
    backend = dist.get_backend(group)
    world_size = dist.get_world_size(group)
    size, warm, iters = CUDA_DEFAULTS if device.type == "cuda" else GLOO_DEFAULTS
    size = int(message_bytes or size)
    warm = warm if warmups is None else warmups
    iters = iters if iterations is None else iterations
    seconds = time_all_gather(device, size, warm, iters, group) if world_size > 1 else None
    gbps = None if seconds is None else size * (world_size - 1) / seconds / 1e9
    p2p = h2d = tflops = None
    if dist.get_rank(group) == 0:
        p2p = peer_access(devices)
        try:  # rank 0 alone: a full card leaves these unmeasured (None), it does not stop the fleet
            h2d = time_h2d(device, size, warm, iters)
            tflops = time_matmul(device, warm, iters)
        except torch.OutOfMemoryError:
            pass
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's buffers back to the device before the first job
    return LinkReport(backend, world_size, tuple(devices), size, seconds, gbps, p2p, h2d, tflops, iters, warm,
                      time.perf_counter() - t0)


def _bytes(tensors) -> float:
    """Bytes of the tensors at their full (global) shape: a DTensor shard counts as the whole parameter."""
    return float(sum(t.numel() * t.element_size() for t in tensors))


def model_bytes(transformer, connectors: Sequence = ()) -> tuple[ModelBytes, tuple[int, ...]]:
    """The transformer's `ModelBytes` (its blocks' mean bytes, the rest, the text connectors') and the indices of the
    blocks that are gathered every forward (FSDP2 modules: `weights/sharding.py`)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = list(transformer.transformer_blocks)
    block_bytes = [_bytes([*b.parameters(), *b.buffers()]) for b in blocks]
    everything = _bytes([*transformer.parameters(), *transformer.buffers()])
    text = sum(_bytes([*c.parameters(), *c.buffers()]) for c in connectors if c is not None)
    gathered = tuple(i for i, b in enumerate(blocks) if isinstance(b, FSDPModule))
    mean = sum(block_bytes) / max(1, len(blocks))
    return ModelBytes(len(blocks), mean, everything - sum(block_bytes), text), gathered


def probe_at_start(transformer, device: torch.device, devices: Sequence[str], connectors: Sequence = ()
                   ) -> tuple[LinkReport, FleetFacts | None]:
    """What a worker measures once at start (every rank calls it: a collective at W > 1): the fleet's `LinkReport`
    and, on rank 0 of a CUDA fleet, the `FleetFacts` of the step-time prediction (its card; None elsewhere: the
    other ranks' reports are not kept, and the compute model is of CUDA GPUs)."""
    link = measure_link(device, devices)
    if device.type != "cuda" or link.matmul_TFLOPS is None or link.h2d_GBps is None:  # CPU, or not rank 0
        return link, None
    model, gathered = model_bytes(transformer, connectors)
    facts = FleetFacts(link.world_size, float(torch.cuda.get_device_properties(device).total_memory), model,
                       ModelShape.of(transformer.config), gathered, link.all_gather_GBps, link.h2d_GBps,
                       H200_MATMUL_TFLOPS / link.matmul_TFLOPS)
    return link, facts
