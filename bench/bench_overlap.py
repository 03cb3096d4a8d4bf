"""Weights moving during a forward, on one GPU: how much of a rank's gather traffic its compute hides, and one card
with weight streaming beside it (issue 35: gathers hidden behind compute; the baseline users compare with).

A rank of a W-rank fleet is simulated on one GPU: the whole transformer resident (a replica: the compute of a block
does not depend on where its weights came from), its sequence-parallel share of the tokens through the W-way
exchange on one GPU (`bench_memory.MemoryExchange`), and the bytes the weights mode moves per forward copied through
host memory on two side streams in the order `weights.sharding.gathered` issues FSDP's all-gathers (the first moving
unit's before the first block, each next moving unit's when the current moving block starts, so that it overlaps the
whole blocks in between):

- a sharded unit of a W-rank fleet without P2P (NCCL's ring through host memory): the rank sends and receives
  (W−1)/W of the unit's bytes: a device→host copy and a host→device copy of that size, concurrently (one stream each);
- a streamed unit of one card (ComfyUI's dynamic VRAM: the blocks that do not fit are copied from host RAM each
  forward): a host→device copy of the whole unit from pinned memory. This models ComfyUI's streaming by our copies —
  it is not ComfyUI's own code: label its figures so.

Per weights layout and size it times three things in the same process: the forward alone (`compute`), the copies
alone in the same order (`copies`), and both together (`both`), and reports the fraction of the copy time hidden,
`hidden = (compute + copies − both) / copies` (1: fully hidden; 0: serialized). `--link-gbps` emulates a slower
link (a box's PCIe 4.0 without P2P) by moving proportionally more bytes on this machine's link
(bytes × measured rate / target rate), so that copy time : compute time is the box's.

Which units move comes from the 24 GiB budget (`--budget-gib`) the way the placed weights choose
(`protocol.fleet_rules` placement): the activation peak is measured first (the forward's peak above the resident
weights, scaled to the rank's tokens), then the units that do not fit are sharded (W ≥ 2) or streamed (W = 1),
spread evenly through the blocks.

    python bench/bench_sharded.py --write /tmp/ltx23-fp8.safetensors && \\
        python bench/bench_overlap.py --file /tmp/ltx23-fp8.safetensors --out bench/results/overlap_h100.txt
    python bench/bench_overlap.py --tiny          # CPU smoke check of the code paths (no streams: nothing timed)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GiB = 2**30
# (frames, width, height, batch): stage 1 and stage 2 of the two-stage 720p template (bench_sharded.SIZES)
SIZES = ((121, 640, 352, 2), (121, 1280, 704, 1))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeat: int) -> float:
    """Seconds per call of `fn`: one warm-up, then `repeat` calls, synchronized on `device`."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeat


# ---- the link --------------------------------------------------------------------------------------------------------


def copy_rates(device, nbytes: int = 512 * 2**20, repeat: int = 5) -> dict:
    """GB/s (1e9 bytes per second) of this GPU's host link: host→device from pinned and from pageable memory,
    device→host into pinned memory, and both directions at once (two streams: full duplex)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def duplex():
        with torch.cuda.stream(s1):
            dev.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            pinned2.copy_(dev2, non_blocking=True)

    out = {"h2d_pinned": nbytes / _timed(lambda: dev.copy_(pinned, non_blocking=True), device, repeat) / 1e9,
           "h2d_pageable": nbytes / _timed(lambda: dev.copy_(pageable), device, repeat) / 1e9,
           "d2h_pinned": nbytes / _timed(lambda: pinned2.copy_(dev2, non_blocking=True), device, repeat) / 1e9}
    out["duplex_each"] = nbytes / _timed(duplex, device, repeat) / 1e9
    out["bytes"] = nbytes
    return out


# ---- which units move ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Moves:
    """The bytes one rank moves per forward: `h2d[i]` / `d2h[i]` for block i (0 where the block is resident)."""

    layout: str  # "replica" | "placed" | "sharded" | "streamed"
    world: int
    moved_units: int
    h2d: tuple[int, ...]
    d2h: tuple[int, ...]

    @property
    def h2d_bytes(self) -> int:
        return sum(self.h2d)


def spread(count: int, total: int) -> list[int]:
    """`count` indices of `total` spread evenly (the first at 0): which blocks move."""
    if count <= 0:
        return []
    return sorted({min(total - 1, math.floor(i * total / count)) for i in range(count)})


def units_that_move(unit_bytes: list[int], rest_bytes: int, activation_bytes: int, world: int, budget: int) -> int:
    """How many of the blocks must move so that a rank fits `budget` bytes: resident = rest + replicated blocks +
    1/W of the moved ones (W = 1: nothing of a streamed block stays) + 2 moving blocks in flight + activations."""
    n, unit = len(unit_bytes), max(unit_bytes)
    for moved in range(n + 1):
        held = (n - moved) * unit + (moved * unit // world if world > 1 else 0)
        if rest_bytes + held + (2 * unit if moved else 0) + activation_bytes <= budget:
            return moved
    return n


def moves(layout: str, unit_bytes: list[int], world: int, moved: int, scale: float) -> Moves:
    """The per-block copies of `layout` with `moved` units moving (`scale`: the link emulation factor)."""
    n = len(unit_bytes)
    which = set(range(n)) if layout == "sharded" else set(spread(moved, n))
    if layout == "replica":
        which = set()
    h2d, d2h = [0] * n, [0] * n
    for i in which:
        if layout == "streamed":
            h2d[i] = int(unit_bytes[i] * scale)
        else:
            h2d[i] = d2h[i] = int(unit_bytes[i] * (world - 1) / world * scale)
    return Moves(layout, world, len(which), tuple(h2d), tuple(d2h))


class Copier:
    """Host-staged copies on two side streams, issued ahead of the compute in `gathered`'s order (see the module docstring)."""

    def __init__(self, device, largest: int):
        self.device = device
        self.recv = torch.cuda.Stream(device)
        self.send = torch.cuda.Stream(device)
        self.host_in = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
        self.host_out = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
        self.dev_in = torch.empty(largest, dtype=torch.uint8, device=device)
        self.dev_out = torch.empty(largest, dtype=torch.uint8, device=device)

    def only(self, m: Moves) -> None:
        """The copies alone, back to back in the order `gathering` issues them."""
        for i in range(len(m.h2d)):
            self._queue(m, i, None)

    @contextlib.contextmanager
    def gathering(self, m: Moves):
        """Within: the forward's block loop (`engine.forward.gathered`) issues the next moving block's copies when a
        moving block starts, and each moving block waits for its own."""
        from mgpu_backend.engine import forward as fwd

        original = fwd.gathered
        copier = self

        def gathered(blocks):  # the order of `weights.sharding.gathered`: the next moving block's copies are
            blocks = list(blocks)  # issued when the current moving block starts (the first: before the loop)
            current = torch.cuda.current_stream(copier.device)
            moving = [i for i in range(len(blocks)) if m.h2d[i] or m.d2h[i]]
            following = dict(zip(moving, moving[1:]))
            pending = {moving[0]: copier._queue(m, moving[0], None)} if moving else {}
            for i, block in enumerate(original(blocks)):
                if i in pending:
                    nxt = following.get(i)
                    if nxt is not None:
                        start = torch.cuda.Event()
                        start.record(current)
                        pending[nxt] = copier._queue(m, nxt, start)
                    for ev in pending.pop(i):
                        current.wait_event(ev)
                yield block

        fwd.gathered = gathered
        try:
            yield
        finally:
            fwd.gathered = original

    def _queue(self, m: Moves, i: int, after) -> list:
        """Block i's copies on the side streams after `after`; the events that mark them done."""
        events = []
        for stream, n, dst, src in ((self.recv, m.h2d[i], self.dev_in, self.host_in),
                                    (self.send, m.d2h[i], self.host_out, self.dev_out)):
            if not n:
                continue
            if after is not None:
                stream.wait_event(after)
            with torch.cuda.stream(stream):
                for off in range(0, n, dst.numel()):
                    k = min(dst.numel(), n - off)
                    dst[:k].copy_(src[:k], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            events.append(ev)
        return events


# ---- one run ---------------------------------------------------------------------------------------------------------


def measure(path: str, worlds: list[int], sizes, budget_gib: float, link_gbps: float | None,
            stream_gbps: float | None, repeat: int, device) -> dict:
    from bench_memory import MemoryExchange, quiet_diffusers
    from bench_sharded import _inputs
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.testing.diffusers_inputs import SequenceDriver

    quiet_diffusers()
    torch.zeros(1, device=device)
    rates = copy_rates(device)
    c = load_components(path, dtype=torch.bfloat16, device=torch.device("cpu"), transformer_only=True)
    model = c.transformer.to(device)
    blocks = list(model.transformer_blocks)
    unit_bytes = [sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())) for b in blocks]
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    rest = total - sum(unit_bytes)
    resident = torch.cuda.memory_allocated(device)
    # emulated links: more bytes on this link so that the copy takes what it would on the box's
    link_scale = rates["duplex_each"] / link_gbps if link_gbps else 1.0
    stream_scale = rates["h2d_pinned"] / stream_gbps if stream_gbps else 1.0
    largest = max(unit_bytes)
    copier = Copier(device, largest)
    out = {"rates": rates, "unit_bytes": largest, "units": len(unit_bytes), "rest_bytes": rest,
           "resident": resident, "link_gbps": link_gbps, "stream_gbps": stream_gbps, "link_scale": link_scale,
           "stream_scale": stream_scale, "budget_gib": budget_gib, "rows": []}

    for frames, width, height, batch in sizes:
        kw, tokens = _inputs(model, frames, width, height, batch, device, torch.bfloat16)
        for world in worlds:
            row = {"size": f"{width}x{height}x{frames}", "batch": batch, "tokens": tokens, "world": world}
            driver = SequenceDriver(model, MemoryExchange(world))
            driver.activate()
            try:
                with torch.no_grad():
                    torch.cuda.reset_peak_memory_stats(device)
                    row["compute_s"] = _timed(lambda: driver(**kw), device, repeat)
                    row["activation_bytes"] = torch.cuda.max_memory_allocated(device) - resident
                    budget = int(budget_gib * GiB)
                    moved = units_that_move(unit_bytes, rest, row["activation_bytes"], world, budget)
                    layouts = ["streamed"] if world == 1 else ["placed", "sharded"]
                    row["moved_units"] = moved
                    row["layouts"] = {}
                    for layout in layouts:
                        m = moves(layout, unit_bytes, world, moved, stream_scale if world == 1 else link_scale)
                        if not m.h2d_bytes:
                            row["layouts"][layout] = {"moved_units": 0, "both_s": row["compute_s"], "hidden": 1.0}
                            continue
                        copies = _timed(lambda: copier.only(m), device, repeat)

                        def both():
                            with copier.gathering(m):
                                driver(**kw)

                        both_s = _timed(both, device, repeat)
                        hidden = (row["compute_s"] + copies - both_s) / copies
                        emulated = 1 / (stream_scale if world == 1 else link_scale)
                        row["layouts"][layout] = {"moved_units": m.moved_units, "copies_s": copies, "both_s": both_s,
                                                  "hidden": max(0.0, min(1.0, hidden)), "hidden_raw": hidden,
                                                  "bytes_per_forward": int(m.h2d_bytes * emulated)}
            except torch.OutOfMemoryError as exc:
                row["error"] = f"OOM: {str(exc).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
            out["rows"].append(row)
            print("ROW " + json.dumps(row), flush=True)
        del kw
    return out


def report(res: dict, command: str) -> list[str]:
    r = res["rates"]
    lines = [f"# bench_overlap.py — {datetime.date.today()} — {torch.cuda.get_device_name()} — torch "
             f"{torch.__version__}",
             f"# command: python bench/bench_overlap.py {command}",
             f"# link of this GPU: host→device pinned {r['h2d_pinned']:.1f} GB/s, pageable {r['h2d_pageable']:.1f}, "
             f"device→host pinned {r['d2h_pinned']:.1f}, both directions at once {r['duplex_each']:.1f} each",
             f"# emulated: fleet link {res['link_gbps'] or 'this GPU'} GB/s (bytes × {res['link_scale']:.2f}), "
             f"one card's streaming {res['stream_gbps'] or 'this GPU'} GB/s (bytes × {res['stream_scale']:.2f}); "
             f"budget {res['budget_gib']} GiB per GPU",
             f"# {res['units']} blocks of {res['unit_bytes'] / GiB:.3f} GiB, rest {res['rest_bytes'] / GiB:.2f} GiB; "
             f"'streamed' = one card with weight streaming modelled by our copies (not ComfyUI's code)", ""]
    for row in res["rows"]:
        head = f"{row['size']} B={row['batch']} W={row['world']} ({row['tokens']} tokens)"
        if "error" in row:
            lines.append(f"{head}: {row['error']}")
            continue
        lines.append(f"{head}: compute {row['compute_s'] * 1000:.0f} ms/forward, activations "
                     f"{row['activation_bytes'] / GiB:.2f} GiB")
        for layout, v in row["layouts"].items():
            if not v["moved_units"]:
                lines.append(f"  {layout}: nothing moves under the budget")
                continue
            lines.append(f"  {layout}: {v['moved_units']} blocks move, {v['bytes_per_forward'] / 1e9:.2f} GB per "
                         f"forward; copies alone {v['copies_s'] * 1000:.0f} ms, with compute {v['both_s'] * 1000:.0f}"
                         f" ms -> {v['hidden'] * 100:.0f} % of the copy time hidden")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", help="a transformer file (bench_sharded.py --write)")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--sizes", default=None, help="FRAMESxWIDTHxHEIGHTxBATCH,…")
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulate a fleet link of this many GB/s each way (e.g. 10: PCIe 4.0 through host)")
    p.add_argument("--stream-gbps", type=float, default=None,
                   help="emulate one card's host→device rate (e.g. 25: PCIe 4.0 x16 pinned)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:  # the arithmetic and the file path on the CPU (streams need CUDA)
        from bench_sharded import write_file

        path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
        write_file(path, True, 1, "fp8", torch.device("cpu"))
        units = [100] * 8
        moved = units_that_move(units, 10, 50, 2, 10 + 5 * 100 + 50 + 200)
        m = moves("placed", units, 2, moved, 1.0)
        print(json.dumps({"moved": moved, "which": spread(moved, 8), "h2d": m.h2d}))
        return
    device = torch.device("cuda", 0)
    sizes = (tuple(tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")) if args.sizes else SIZES)
    res = measure(args.file, [int(w) for w in args.worlds.split(",")], sizes, args.budget_gib, args.link_gbps,
                  args.stream_gbps, args.repeat, device)
    lines = report(res, " ".join(argv if argv is not None else sys.argv[1:]))
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
