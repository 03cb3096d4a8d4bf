"""Predicted step times of LTX-2.3 / 2.5 22B on consumer boxes: the fleet (sequence parallel over the box's cards,
the fewest blocks FSDP-sharded that fit) against ONE card of the box with ComfyUI's weight streaming, from the cost
model of `mgpu_backend/splits/weights_cost.py` (issue 35 item 3). No GPU needed.

    python bench/box_model.py --out bench/results/box_model_cpu.txt   # the table (fp8 and bf16 files)
    python bench/box_model.py --count                                 # re-count one block's parameters (diffusers)

Inputs and their sources are printed in the header. The compute constants are the H200's (`splits/cost.py`,
fitted) scaled to a 4090-class card by the ratio of the data-sheet dense bf16 peaks (`engine/flops.py`): an
assumption, to be replaced by measured card figures.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend.engine.flops import dense_peak  # noqa: E402
from mgpu_backend.splits import cost as C  # noqa: E402
from mgpu_backend.splits import weights_cost as M  # noqa: E402

GiB = 2**30
BOXES = (("1 × 24 GB", (24,)), ("2 × 24 GB", (24, 24)), ("4 × 24 GB", (24, 24, 24, 24)), ("2 × 32 GB", (32, 32)),
         ("32 + 24 GB", (32, 24)))
LINKS = ("pcie4-host", "pcie4-p2p")
STAGES = (("stage 1", "640×352×121", 3520), ("stage 2", "1280×704×121", 14080))
MODELS = (("22B fp8", M.LTX23_22B_FP8), ("22B bf16", M.LTX23_22B_BF16))


def compute_scale() -> tuple[float, str]:
    """H200 over RTX 4090 dense bf16 peaks (engine/flops.py's data-sheet table)."""
    h200 = dense_peak("NVIDIA H200", "bf16").tflops
    rtx = dense_peak("NVIDIA GeForce RTX 4090", "bf16").tflops
    return h200 / rtx, f"{h200:g} / {rtx:g} TFLOP/s"


def count_block() -> None:
    """One block's parameters at the 22B shape on the meta device (the figures `weights_cost.LTX23_22B_FP8` cites)."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_sharded import shape_meta
    from mgpu_backend.models import configs

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(shape_meta(False, 8, "2.3")))
    block = model.transformer_blocks[0]
    linear = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in block.parameters())
    rest = sum(p.numel() for p in model.parameters()) - total * len(model.transformer_blocks)
    print(f"{len(model.transformer_blocks)} blocks; one block: {linear:,} Linear weights + {total - linear:,} other "
          f"parameters; outside the blocks: {rest:,} parameters")


def header(scale: float, scale_source: str) -> list[str]:
    m, a, b = C.H200_NVLINK, M.ACTIVATION_FIXED, M.ACTIVATION_PER_ROW
    fp8 = M.LTX23_22B_FP8
    links = ", ".join(f"{k} {ag:g} GB/s all_gather / {h2d:g} GB/s host->GPU" for k, (ag, h2d) in M.LINK_PRESETS.items())
    return [
        "Predicted step time (one forward: CFG 1, as the 720p templates) of the LTX-2.3 / 2.5 22B transformer — the "
        "fleet on a box vs one card of it with ComfyUI's weight streaming (mgpu_backend/splits/weights_cost.py)",
        "",
        "model: per block, forward = blocks in order; block i waits for its weights (resident, or moved g_i s), "
        "computes c_i, then its exchange x_i (Ulysses, on the link).",
        "  moves in gathered()'s order: the first moving block's at 0, the next moving block's when a moving block "
        "starts, after the moves queued; the link is one FIFO for moves and exchanges (simulated block by block);",
        "  exposed = total − Σc − Σx. Fleet: c_i = compute(T, W)/N, x_i = Σ sp_collectives(T, W)/N at the link's bus "
        "bandwidth (η = 1) + λ each,",
        "  g_i = block_bytes·(W−1)/W / all_gather GB/s for the sharded blocks (the fewest that fit the smallest card, "
        "spread over the blocks). One card: W = 1, no exchange,",
        "  g_i = block_bytes / host->GPU GB/s for the blocks that do not fit (assumed: ComfyUI streams from pinned "
        "memory on a second stream, in the same order, overlapped: optimistic).",
        f"compute(T, W) = scale × ({m.c0 * 1e3:.1f} ms + {m.c_lin * 1e6:.1f} µs·T/W + {m.c_attn * 1e9:.3f} ns·T²/W) "
        f"(splits/cost.py H200_NVLINK, the eager forward fitted to bench/results/sp_forward_h200.txt); λ = "
        f"{m.latency * 1e6:.0f} µs per collective",
        f"scale = {scale:.2f} = H200 / RTX 4090 dense bf16 peak ({scale_source}, engine/flops.py) — ASSUMED: the "
        f"forward's time follows the tensor-core peak; 32 GB cards (5090) assumed to compute like a 4090",
        f"model bytes: 22B fp8 = {fp8.blocks} blocks × {fp8.block_bytes / GiB:.3f} GiB (fp8 Linear weights, bf16 rest) "
        f"= {fp8.blocks * fp8.block_bytes / GiB:.2f} GiB + {fp8.other_bytes / GiB:.2f} GiB outside the blocks + "
        f"{fp8.text_bytes / GiB:.2f} GiB text connectors (= the 21.85 GiB file of bench/results/sharded_h200.txt); "
        f"bf16: blocks × 2 = {M.LTX23_22B_BF16.blocks * M.LTX23_22B_BF16.block_bytes / GiB:.2f} GiB",
        f"memory: budget = card − {M.RESERVE_BYTES / GiB:g} GiB (context, slack: assumed); activations = "
        f"{a / GiB:.3f} GiB + {b / 2**20:.3f} MiB per token row on a rank (tokens / W) "
        f"(fitted to the peaks of bench/results/sharded_h200.txt); a fleet rank: rest + connectors (1/W once sharded) "
        f"+ replicated blocks + shards + 2 gathered blocks; one card: rest + resident blocks + 2 buffers (connectors "
        f"run once per prompt, not counted)",
        f"links (GB/s): {links} (bench/bench_sharded.py's; pcie5 assumed 2× pcie4)",
        "columns: k = sharded blocks of 48 (fleet), s = streamed blocks (one card); rank GiB = a fleet rank's peak; "
        "gather / copy = the link time of the moves, exposed = what they add after the overlap; '—' = does not fit "
        "(the fleet does not stream from host memory: one rank must hold the whole model); ratio = fleet / one card "
        "(< 1: the fleet is faster)",
        "a box's fleet: every card, its k set by the smallest card; one card: the box's largest card alone",
    ]


def table(model: M.ModelBytes, scale: float) -> list[str]:
    head = (f"{'box':>11} {'link':>10} {'stage':>7} {'tokens':>6} | {'k':>2} {'rank GiB':>8} {'compute':>7} "
            f"{'exchange':>8} {'gather':>6} {'exposed':>7} {'fleet s':>7} | {'s':>2} {'copy':>5} {'exposed':>7} "
            f"{'1 card s':>8} | {'ratio':>5}")
    out = [head, "-" * len(head)]
    for label, cards in BOXES:
        for link in LINKS if len(cards) > 1 else LINKS[:1]:
            for stage, _, tokens in STAGES:
                p = M.predict_box(M.Box.of(cards, link), tokens, model, compute_scale=scale)
                f, o = p.fleet, p.one_card
                if f is None:
                    fleet = f"{'—':>2} {'—':>8} {'—':>7} {'—':>8} {'—':>6} {'—':>7} {'—':>7}"
                else:
                    rank = M.fleet_rank_bytes(p.placement, tokens) / GiB
                    fleet = (f"{p.sharded_blocks:>2} {rank:>8.1f} {f.compute:>7.2f} {f.exchange:>8.2f} "
                             f"{f.gather:>6.2f} {f.exposed_gather:>7.2f} {f.total:>7.2f}")
                one = ("—".rjust(2) + " " + "—".rjust(5) + " " + "—".rjust(7) + " " + "—".rjust(8) if o is None else
                       f"{p.streamed_blocks:>2} {o.gather:>5.2f} {o.exposed_gather:>7.2f} {o.total:>8.2f}")
                ratio = "—" if p.ratio is None else f"{p.ratio:.2f}"
                out.append(f"{label:>11} {link if len(cards) > 1 else '—':>10} {stage:>7} {tokens:>6} | {fleet} | "
                           f"{one} | {ratio:>5}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--count", action="store_true", help="count one block's parameters (diffusers, meta device)")
    p.add_argument("--compute-scale", type=float, default=None,
                   help="card compute time over the H200's (default: the dense bf16 peak ratio H200 / RTX 4090)")
    args = p.parse_args()
    if args.count:
        count_block()
        return
    scale, source = compute_scale()
    if args.compute_scale is not None:
        scale, source = args.compute_scale, "--compute-scale"
    lines = [f"# box_model.py — {datetime.date.today().isoformat()} — no GPU (a model, not a measurement)",
             f"# command: python bench/box_model.py{' --out ' + args.out if args.out else ''}"
             f"{f' --compute-scale {args.compute_scale:g}' if args.compute_scale is not None else ''}", ""]
    lines += header(scale, source)
    for name, model in MODELS:
        lines += ["", f"{name} (seconds per forward)"] + table(model, scale)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
