"""What the fleet measured of its links when it started (`LinkReport`), carried from rank 0 to the controller in
`worker_messages.WorkerReady` and shown in the fleet's status (`job_results.FleetDescription.link`).

Measured by `splits/link.py`'s `measure_link` on the fleet's process group right after the workers loaded their
weights; the cost model of a step with weights moving (`splits/weights_cost.py`) reads it. Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkReport:
    """The fleet's links and rank 0's GPU, measured once at start.

    backend: the process group's backend ("nccl", "gloo"); world_size: its ranks; devices: one device string per
    rank ("cuda:0", "cpu").
    message_bytes: bytes each rank contributes to one timed all_gather (the output is world_size × that).
    all_gather_seconds: mean seconds of one all_gather (the slowest rank's loop time / iterations: every rank ends
        a collective together); None at world_size 1 (no collective to time) or when a rank could not allocate the
        buffers.
    all_gather_GBps: bus bandwidth, GB/s (1e9 bytes/s), as nccl-tests defines it for all_gather: the gathered
        bytes × (W−1)/W / time = message_bytes × (W−1) / all_gather_seconds — what each rank received per second;
        None where all_gather_seconds is.
    p2p: every pair of the fleet's distinct CUDA devices can access each other's memory
        (`torch.cuda.can_device_access_peer`, both directions); False when one pair cannot (NCCL then goes through
        host memory); None where it does not apply (CPU ranks, or every rank on one GPU).
    h2d_GBps: rank 0's pinned host -> device copy rate, GB/s (the rate a one-card weight-streaming baseline copies
        at); None on CPU (and on a card too full for the probe's buffers).
    matmul_TFLOPS: rank 0's dense matmul rate, 1e12 FLOP/s (2·n³ per n×n product; bfloat16 on CUDA, float32 on CPU);
        None when not measured.
    iterations: timed repetitions of each measurement (after `warmups` untimed ones).
    seconds: wall time of the whole probe on rank 0.

    Raises ValueError for a measured figure that is not finite and positive.
    """

    backend: str
    world_size: int
    devices: tuple[str, ...]
    message_bytes: int
    all_gather_seconds: float | None
    all_gather_GBps: float | None
    p2p: bool | None
    h2d_GBps: float | None
    matmul_TFLOPS: float | None
    iterations: int
    warmups: int
    seconds: float

    def __post_init__(self):
        for name in ("all_gather_seconds", "all_gather_GBps", "h2d_GBps", "matmul_TFLOPS"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"LinkReport.{name} = {value!r}: a measured figure must be finite and positive")

    def describe(self) -> str:
        """One line for the fleet's report, e.g. "link (measured at start): all_gather 9.8 GB/s bus bandwidth (nccl,
        2 ranks, 64 MiB per rank), no P2P between the GPUs, host -> GPU 24.6 GB/s pinned, matmul 160 TFLOPS"."""
        mib = self.message_bytes / 2**20
        size = f"{mib:g} MiB" if mib >= 1 else f"{self.message_bytes / 2**10:g} KiB"
        parts = [f"all_gather {self.all_gather_GBps:.1f} GB/s bus bandwidth ({self.backend}, {self.world_size} "
                 f"ranks, {size} per rank)" if self.all_gather_GBps is not None
                 else f"no all_gather timed ({self.backend}, one rank)" if self.world_size == 1
                 else f"all_gather not timed ({self.backend}, {self.world_size} ranks: its buffers did not fit)"]
        if self.p2p is not None:
            parts.append("P2P between the GPUs" if self.p2p else "no P2P between the GPUs (through host memory)")
        if self.h2d_GBps is not None:
            parts.append(f"host -> GPU {self.h2d_GBps:.1f} GB/s pinned")
        if self.matmul_TFLOPS is not None:
            parts.append(f"matmul {self.matmul_TFLOPS:.3g} TFLOPS")
        return "link (measured at start): " + ", ".join(parts)
