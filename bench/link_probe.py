"""The fleet's start-up link probe (`mgpu_backend/splits/link.py` `measure_link`) on this machine, outside a fleet:
W ranks (one per visible GPU, NCCL; or `--cpu N` gloo ranks) at several all_gather sizes, with rank 0's pinned
host -> GPU copy rate and bf16 matmul rate against its data-sheet dense peak (`engine/flops.py`). On one H200 the
matmul figure is the reference a running fleet scales the cost model by (`weights_cost.H200_MATMUL_TFLOPS`, today
an assumption).

    python bench/link_probe.py --out bench/results/link_probe_h200.txt     # every visible GPU
    python bench/link_probe.py --no-p2p                                    # NCCL_P2P_DISABLE=1: through host memory
    python bench/link_probe.py --cpu 2                                     # gloo smoke check
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MIB = 2**20


def _rank(rank: int, world: int, folder: str, cpu: bool, sizes: list[int], queue) -> None:
    from mgpu_backend.splits.link import measure_link

    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world)
    devices = tuple("cpu" if cpu else f"cuda:{r}" for r in range(world))
    reports = [measure_link(device, devices, message_bytes=s) for s in sizes]
    if rank == 0:
        queue.put(reports)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", type=int, default=0, help="gloo ranks on the CPU instead of the GPUs")
    p.add_argument("--sizes-mib", default="16,64,256", help="all_gather bytes per rank, MiB (CPU: KiB)")
    p.add_argument("--no-p2p", action="store_true", help="NCCL_P2P_DISABLE=1 (NCCL through host memory)")
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args()
    cpu = args.cpu > 0 or not torch.cuda.is_available()
    world = args.cpu or (torch.cuda.device_count() if not cpu else 2)
    unit = 2**10 if cpu else MIB
    sizes = [int(float(s) * unit) for s in args.sizes_mib.split(",")]
    if args.no_p2p:
        os.environ["NCCL_P2P_DISABLE"] = "1"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="link_probe_") as folder:
        mp.start_processes(_rank, args=(world, folder, cpu, sizes, queue), nprocs=world, start_method="spawn")
        reports = queue.get()
    name = "CPU" if cpu else torch.cuda.get_device_name(0)
    lines = [f"# link_probe.py — {datetime.date.today().isoformat()} — {name} × {world} — torch {torch.__version__}"
             f"{' — NCCL_P2P_DISABLE=1' if args.no_p2p else ''}",
             f"# command: python bench/link_probe.py {' '.join(sys.argv[1:])}".rstrip()]
    for r in reports:
        lines.append(r.describe() + f" (probe {r.seconds * 1e3:.0f} ms)")
    if not cpu:
        from mgpu_backend.engine.flops import dense_peak

        peak = dense_peak(name, "bf16")
        share = peak.fraction(reports[-1].matmul_TFLOPS * 1e12)
        lines.append(f"matmul {reports[-1].matmul_TFLOPS:.1f} TFLOPS vs {peak.describe()}"
                     + (f": {share:.2f} of it" if share is not None else ""))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
