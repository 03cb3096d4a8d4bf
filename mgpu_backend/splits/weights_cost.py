"""A cost model of one denoising step with weights moving (issue 35 item 3): the fleet (sequence parallel over W
ranks, some blocks all-gathered every forward) against ONE card with ComfyUI's weight streaming (the blocks that do
not fit copied from pinned host memory every forward). Pure python; times in seconds, bytes in bytes.

**One forward, block by block** (`simulate_step`, a loop over the N blocks, not a closed form). Block i needs its
weights (resident, or moved: g_i seconds), computes (c_i), then waits for its exchange (x_i: the Ulysses
collectives, in the block's critical path). The moves run in the order `weights.sharding.gathered` issues FSDP's
all-gathers: the first moving block's at 0 (before the loop), each next moving block's when the current moving block
starts, once the link is free — so a move overlaps the compute of every whole block before its own, and at most two
moved blocks are held at once. The link is one FIFO resource shared by the moves and the exchanges (a block's
exchange waits for a move issued before it). So, with s_i the start of block i, e_i its end, L the time the link is
free and j the next moving block after a moving block i:

    s_i = max(e_{i-1}, end of move i);  move j on [max(L, s_i), +g_j];
    exchange i on [max(L, s_i + c_i), +x_i];  e_i = its end (s_i + c_i without an exchange);  total = e_{N-1}.

The exposed move time is total − Σc − Σx (≥ 0): what the moves add to a forward after the overlap.

**The fleet** (`fleet_step`): compute = `CostModel.compute(tokens, W)` of one rank (splits/cost.py), spread evenly over
the blocks; exchange = Σ `CostModel.sp_collectives(tokens, W)` with the link's bus bandwidth (η = 1: a measured bus
bandwidth is already what a collective reaches), spread evenly; a gathered (FSDP-sharded) block moves
block_bytes × (W−1)/W into each rank at the all_gather bus bandwidth (the nccl-tests definition: what each rank
receives per second).

**One card with weight streaming** (`one_card_step`): the same loop at W = 1: no exchange; each streamed block moves
block_bytes host -> device at the pinned copy rate. Assumption (not measured here): ComfyUI's dynamic VRAM copies
asynchronously on a second stream from pinned host memory, in the same order, overlapped with the compute — an
optimistic baseline. Resident = what fits the card's budget after the rest of the transformer, the activations and
two block buffers (the one computing, the one arriving).

**Memory** (bytes; `card_budget` = the card's memory − `RESERVE_BYTES`):
- activations of one forward with r token rows (tokens × batch / W) per rank: `activation_bytes(r)` =
  a + b·r, fitted (`fit_activations`) to the peaks of bench/results/sharded_h200.txt (`SHARDED_PEAKS_H200`: replica and
  one rank of 2 and 4, an LTX-2.3-shaped fp8 file): peak − resident (− 2 gathered blocks on a sharded rank);
- a fleet rank holds what the fleet's own placement rule gives it (`fleet_placement`: `protocol.fleet_rules.
  place_weights`, the fewest sharded units that fit with `PLACEMENT_RESERVE_BYTES` kept free, the text connectors
  sharded first) plus the stage's activations (`fleet_rank_bytes`);
- one card holds `other_bytes`, the resident blocks, two block buffers when it streams, the activations; the text
  connectors run once per prompt and are not counted (ComfyUI loads them by need).

`predict_box` puts the two side by side for a box of W cards (the smallest card sets the fleet's k, the largest is
the one-card baseline) and `python bench/box_model.py` prints the table (bench/results/box_model_cpu.txt).
`FleetFacts` is the same for a running fleet, from what it measured at start (`splits/link.py`).

Compute constants are the H200's (`cost.H200_NVLINK`, the eager forward: sharded fleets and ComfyUI run eagerly) ×
a compute scale (the card's time over the H200's): the bench states its factor as an assumption; a running fleet
uses its measured matmul rate (`H200_MATMUL_TFLOPS` over `LinkReport.matmul_TFLOPS`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..protocol.errors import ValidationError
from ..protocol.fleet_rules import WeightBytes, WeightPlacement, place_weights
from .cost import H200_NVLINK, LTX2_19B, CostModel, ModelShape

GiB = 2**30
# per-process memory a card cannot give to tensors (CUDA context, allocator slack): an assumption
RESERVE_BYTES = 1.0 * GiB

# bus bandwidth of an all_gather between two cards (GB/s) and pinned host -> device copy rate (GB/s) per link.
# pcie4-host / pcie4-p2p / nvlink: the figures of bench/bench_sharded.py (docs/design/sharded-weights.md#links:
# without P2P NCCL goes through host memory); host -> device: PCIe 4.0 x16 25 GB/s (25–27 in that table), PCIe 5.0
# ≈ 50. pcie5-*: assumed twice PCIe 4's (the per-lane rate doubles); nvlink's host copy: the PCIe 5 figure.
LINK_PRESETS: dict[str, tuple[float, float]] = {
    "pcie4-host": (10.0, 25.0), "pcie4-p2p": (22.0, 25.0), "pcie5-host": (20.0, 50.0), "pcie5-p2p": (44.0, 50.0),
    "nvlink": (350.0, 50.0)}

# bench/results/sharded_h200.txt (one H200, LTX-2.3-shaped fp8 file, 21.85 GiB): (W, token rows per rank, resident
# GiB, peak GiB) — rows = video tokens × batch / W (stage 1 ran the two guidance passes batched, B = 2)
SHARDED_PEAKS_H200 = ((1, 7040, 21.85, 24.04), (1, 14080, 21.85, 26.07), (2, 3520, 11.33, 13.21),
                      (2, 7040, 11.33, 14.29), (4, 1760, 6.06, 7.44), (4, 3520, 6.06, 7.95))


@dataclass(frozen=True)
class ModelBytes:
    """The transformer's bytes as a step moves them: `blocks` blocks of `block_bytes` each, `other_bytes` of the
    transformer outside the blocks (embeddings, projections, norms: every rank and the one card hold them),
    `text_bytes` of text connectors (run once per prompt)."""

    blocks: int
    block_bytes: float
    other_bytes: float
    text_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.blocks * self.block_bytes + self.other_bytes + self.text_bytes


# LTX-2.3 / 2.5 22B: one block of the diffusers transformer at the 22B shape (bench_sharded.LTX23_SHAPE: video
# 32 × 128, audio 32 × 64, 48 blocks) has 386,465,792 Linear weights and 229,568 other parameters (counted on the
# meta device: bench/box_model.py --count); fp8 file: Linear weights 1 byte, the rest bf16; the transformer outside
# the blocks 427,460,864 bf16 parameters (0.80 GiB: "replicated 0.80" in bench/results/sharded_h200.txt); the text
# connectors the rest of that file's 21.85 GiB (3.76 GiB, bf16).
LTX23_22B_FP8 = ModelBytes(blocks=48, block_bytes=386_465_792 + 2 * 229_568, other_bytes=2 * 427_460_864,
                           text_bytes=21.85 * GiB - 48 * (386_465_792 + 2 * 229_568) - 2 * 427_460_864)
LTX23_22B_BF16 = replace(LTX23_22B_FP8, block_bytes=2 * (386_465_792 + 229_568))


@dataclass(frozen=True)
class StepPrediction:
    """One forward on one rank (seconds): `compute` (Σ c_i), `gather` (Σ g_i: the link time of the weight moves, all
    of it), `exposed_gather` (what the moves add after the overlap: total − compute − exchange), `exchange`
    (Σ x_i),
    `total` (the simulated timeline's end); `blocks` and `gathered_blocks` (how many moved)."""

    compute: float
    gather: float
    exposed_gather: float
    exchange: float
    total: float
    blocks: int
    gathered_blocks: int


def simulate_step(compute: Sequence[float], gather: Sequence[float], exchange: Sequence[float]) -> StepPrediction:
    """The block-by-block timeline of the module docstring. compute / gather / exchange: seconds per block (gather 0
    for a resident block, exchange 0 without a split). Raises ValueError when the three lengths differ or a time is
    negative."""
    n = len(compute)
    if len(gather) != n or len(exchange) != n:
        raise ValueError(f"simulate_step: {n} compute, {len(gather)} gather and {len(exchange)} exchange times")
    if min((*compute, *gather, *exchange), default=0.0) < 0:
        raise ValueError("simulate_step: a negative time")
    arrive = [0.0] * n  # when each block's weights are there (0: resident)
    moving = [i for i in range(n) if gather[i] > 0]
    following = dict(zip(moving, moving[1:]))
    link = 0.0  # when the link is free
    if moving:  # the first moving block's move is issued before the loop (`weights.sharding.gathered`)
        link = arrive[moving[0]] = gather[moving[0]]
    end = 0.0
    for i in range(n):
        start = max(end, arrive[i])
        nxt = following.get(i)
        if nxt is not None:  # the next moving block's move, issued when this moving block starts, after the queue
            link = arrive[nxt] = max(link, start) + gather[nxt]
        end = start + compute[i]
        if exchange[i] > 0:
            link = end = max(link, end) + exchange[i]
    total_compute, total_exchange = sum(compute), sum(exchange)
    return StepPrediction(total_compute, sum(gather), max(0.0, end - total_compute - total_exchange), total_exchange,
                          end, n, sum(1 for g in gather if g > 0))


def spread_blocks(blocks: int, moved: int) -> tuple[int, ...]:
    """`moved` block indices spread evenly over `blocks` (the last block always among them, block 0 only when every
    block moves): index ⌈(j+1)·N/k⌉ − 1 for j = 0..k−1."""
    if not 0 <= moved <= blocks:
        raise ValueError(f"spread_blocks: {moved} moved blocks of {blocks}")
    return tuple(-(-(j + 1) * blocks // moved) - 1 for j in range(moved))


def _even(total: float, n: int) -> list[float]:
    return [total / n] * n


def fleet_step(tokens: int, world_size: int, gathered: Sequence[int], block_bytes: float, all_gather_GBps: float,
               cost: CostModel = H200_NVLINK, shape: ModelShape = LTX2_19B) -> StepPrediction:
    """One forward of `tokens` video tokens on each rank of a `world_size`-rank sequence-parallel fleet whose blocks
    `gathered` (indices) are FSDP-sharded: each moves block_bytes·(W−1)/W into each rank at `all_gather_GBps` (bus
    bandwidth, GB/s); the exchange over the same link (`CostModel.sp_collectives`, η = 1, the model's λ per
    collective). `cost`: the compute model (already scaled to the card)."""
    n, w = shape.blocks, world_size
    link = replace(cost, link_GBps=all_gather_GBps, efficiency=1.0)
    exchange = sum(c.seconds for c in link.sp_collectives(tokens, w, shape).values())
    move = block_bytes * (w - 1) / w / (all_gather_GBps * 1e9) if w > 1 else 0.0
    moved = set(gathered)
    return simulate_step(_even(cost.compute(tokens, w, shape), n), [move if i in moved else 0.0 for i in range(n)],
                         _even(exchange, n))


def one_card_step(tokens: int, streamed: Sequence[int], block_bytes: float, h2d_GBps: float,
                  cost: CostModel = H200_NVLINK, shape: ModelShape = LTX2_19B) -> StepPrediction:
    """One forward of `tokens` video tokens on one card whose blocks `streamed` are copied host -> device every
    forward at `h2d_GBps` (pinned, GB/s), in `gathered`'s order (the module docstring's assumption)."""
    n = shape.blocks
    copy = block_bytes / (h2d_GBps * 1e9)
    moved = set(streamed)
    return simulate_step(_even(cost.compute(tokens, 1, shape), n), [copy if i in moved else 0.0 for i in range(n)],
                         [0.0] * n)


# ---- memory ----------------------------------------------------------------------------------------------------------

def fit_activations(data=SHARDED_PEAKS_H200, block_bytes: float = LTX23_22B_FP8.block_bytes) -> tuple[float, float]:
    """(a bytes, b bytes per token row) of `activation_bytes`: least squares of peak − resident (− 2 gathered blocks
    on a sharded rank, W > 1) on the token rows per rank."""
    xs = [rows for _, rows, _, _ in data]
    ys = [(peak - resident) * GiB - (2 * block_bytes if w > 1 else 0.0) for w, _, resident, peak in data]
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - b * sx) / n, b


ACTIVATION_FIXED, ACTIVATION_PER_ROW = 0.1546 * GiB, 2.898e-4 * GiB  # fit_activations(), rounded (tests check)


def activation_bytes(rows: float) -> float:
    """Peak activation bytes of one forward with `rows` token rows (tokens × batch) on a rank (module docstring)."""
    return ACTIVATION_FIXED + ACTIVATION_PER_ROW * rows


# the 22B files' text connectors: 8 blocks for video and 8 for audio (bench_sharded --connector-layers 8), the units
# `weights.sharding.units_of` lists after the transformer's blocks
TEXT_UNITS = 16


def weight_bytes_of(model: ModelBytes, text_units: int = TEXT_UNITS) -> WeightBytes:
    """`model` as the fleet's placement rule reads a checkpoint (`protocol.fleet_rules.WeightBytes`): its blocks, then
    its text connectors in `text_units` equal units, and the rest."""
    blocks = (int(model.block_bytes),) * model.blocks
    text = (int(model.text_bytes // text_units),) * text_units if model.text_bytes else ()
    return WeightBytes(blocks=sum(blocks) + sum(text), rest=int(model.other_bytes), block_units=blocks,
                       connector_units=text)


def fleet_placement(model: ModelBytes, world_size: int, card_bytes: float) -> WeightPlacement | None:
    """Where a fleet of `world_size` cards of `card_bytes` puts `model`'s weights: the fleet's own rule
    (`protocol.fleet_rules.place_weights`, weights="auto": the fewest sharded units that fit, the text connectors
    first, `PLACEMENT_RESERVE_BYTES` kept free) in the card's budget (card − `RESERVE_BYTES`); None when not even
    every unit sharded fits."""
    try:
        return place_weights(weight_bytes_of(model), world_size, int(card_bytes - RESERVE_BYTES), "auto")
    except ValidationError:
        return None


def gathered_blocks(model: ModelBytes, placement: WeightPlacement) -> tuple[int, ...]:
    """The transformer blocks a placement gathers every forward (its sharded units that are blocks, not connectors)."""
    return tuple(i for i in placement.sharded if i < model.blocks)


def fleet_rank_bytes(placement: WeightPlacement, tokens: int) -> float:
    """What one rank holds at its peak in a forward of `tokens` video tokens: its resident weights, the gathered
    blocks and the activations of its tokens / W rows (`activation_bytes`)."""
    return placement.resident_bytes + placement.transient_bytes + activation_bytes(tokens / placement.world_size)


def resident_blocks(model: ModelBytes, card_bytes: float, tokens: int) -> int | None:
    """How many blocks one card keeps resident while it streams the rest (None: not even the rest of the
    transformer, two block buffers and the activations fit)."""
    room = card_bytes - RESERVE_BYTES - model.other_bytes - activation_bytes(tokens)
    if room >= model.blocks * model.block_bytes:
        return model.blocks
    room -= 2 * model.block_bytes
    return None if room < 0 else min(model.blocks, int(room // model.block_bytes))


# ---- a box: W cards, a link ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    """W cards (`cards_GiB`, GiB each) joined by a link: all_gather bus bandwidth `all_gather_GBps` and pinned host ->
    device `h2d_GBps`, GB/s; `link` names it."""

    cards_GiB: tuple[float, ...]
    all_gather_GBps: float
    h2d_GBps: float
    link: str = ""

    @classmethod
    def of(cls, cards_GiB: Sequence[float], link: str) -> Box:
        """Cards joined by a `LINK_PRESETS` link. Raises KeyError naming the presets for an unknown one."""
        if link not in LINK_PRESETS:
            raise KeyError(f"link {link!r}: one of {', '.join(LINK_PRESETS)}")
        ag, h2d = LINK_PRESETS[link]
        return cls(tuple(float(c) for c in cards_GiB), ag, h2d, link)

    @property
    def world_size(self) -> int:
        return len(self.cards_GiB)


@dataclass(frozen=True)
class BoxPrediction:
    """`predict_box`'s answer for one stage: the fleet's forward (None: it does not fit, `sharded_blocks` None too)
    with `sharded_blocks` of the blocks sharded, and one card's (None: it does not fit) streaming `streamed_blocks`;
    `ratio` = fleet / one card (None unless both run)."""

    box: Box
    tokens: int
    fleet: StepPrediction | None
    sharded_blocks: int | None
    one_card: StepPrediction | None
    streamed_blocks: int | None
    placement: WeightPlacement | None = None  # the fleet's (None: it does not fit)

    @property
    def ratio(self) -> float | None:
        if self.fleet is None or self.one_card is None:
            return None
        return self.fleet.total / self.one_card.total


def predict_box(box: Box, tokens: int, model: ModelBytes = LTX23_22B_FP8, compute_scale: float = 1.0,
                cost: CostModel = H200_NVLINK, shape: ModelShape = LTX2_19B) -> BoxPrediction:
    """The fleet on `box` (sequence parallel over all its cards, the fewest sharded blocks that fit its smallest
    card, spread over the blocks) against its largest card alone with weight streaming, for one forward of `tokens`
    video tokens (one step at CFG 1, the templates). `compute_scale`: the card's compute time over the H200's (the
    compute terms of `cost` × it; the link terms are the box's)."""
    card = cost.scaled(compute_scale)
    w = box.world_size
    smallest = min(box.cards_GiB) * GiB
    placement = fleet_placement(model, w, smallest)
    if placement is not None and fleet_rank_bytes(placement, tokens) > smallest - RESERVE_BYTES:
        placement = None  # the weights fit, this stage's activations beside them do not
    gathered = None if placement is None else gathered_blocks(model, placement)
    k = None if gathered is None else len(gathered)
    fleet = (None if gathered is None else
             fleet_step(tokens, w, gathered, model.block_bytes, box.all_gather_GBps, card, shape))
    resident = resident_blocks(model, max(box.cards_GiB) * GiB, tokens)
    streamed = None if resident is None else model.blocks - resident
    one = (None if streamed is None else
           one_card_step(tokens, spread_blocks(model.blocks, streamed), model.block_bytes, box.h2d_GBps, card, shape))
    return BoxPrediction(box, tokens, fleet, k, one, streamed, placement)


# ---- a running fleet ---------------------------------------------------------------------------------------------

# The rate `splits/link.py`'s probe (a bf16 8192³ matmul) would measure on one H200; a running fleet's compute scale is
# this over its rank 0's measured rate. ASSUMED, not measured: 0.8 × the H200's dense bf16 peak (989.4 TFLOP/s,
# `engine/flops.py` DENSE_PEAKS_TFLOPS), the share a large bf16 matmul usually reaches; `python bench/link_probe.py` on
# an H200 measures it (not run: no GPU in the session that wrote this).
H200_MATMUL_TFLOPS = 0.8 * 989.4
# the 720p two-stage template (1280×720, 121 frames): stage 1 at 640×352, stage 2 at 1280×704 — video tokens
# = 16 latent frames × (H/32) × (W/32)
TEMPLATE_STAGES = (("stage 1", "640×352×121", 16 * 11 * 20), ("stage 2", "1280×704×121", 16 * 22 * 40))


@dataclass(frozen=True)
class FleetFacts:
    """What a running fleet knows for the prediction (`splits/link.py` builds it at start): its ranks, rank 0's
    card (`card_bytes`), the transformer's bytes and shape, which blocks are gathered every forward (`gathered`:
    the FSDP-sharded ones), the measured link (all_gather bus GB/s; None at W = 1) and host -> device copy rate
    (GB/s), and the compute scale (rank 0's card over the H200: `H200_MATMUL_TFLOPS` / its measured matmul rate)."""

    world_size: int
    card_bytes: float
    model: ModelBytes
    shape: ModelShape
    gathered: tuple[int, ...]
    all_gather_GBps: float | None
    h2d_GBps: float
    compute_scale: float

    def predict(self, tokens: int, cost: CostModel = H200_NVLINK) -> tuple[StepPrediction, StepPrediction | None,
                                                                            int | None]:
        """(this fleet's forward, one card's with streaming or None when it does not fit, the blocks it streams)."""
        card = cost.scaled(self.compute_scale)
        link = self.all_gather_GBps or LINK_PRESETS["nvlink"][0]  # W = 1: no collective, any figure
        fleet = fleet_step(tokens, self.world_size, self.gathered, self.model.block_bytes, link, card, self.shape)
        resident = resident_blocks(self.model, self.card_bytes, tokens)
        if resident is None:
            return fleet, None, None
        streamed = self.model.blocks - resident
        return fleet, one_card_step(tokens, spread_blocks(self.model.blocks, streamed), self.model.block_bytes,
                                    self.h2d_GBps, card, self.shape), streamed

    def line(self, stage: str, tokens: int, size: str = "") -> str:
        """"predicted step time at stage 1 (640×352×121, 3,520 video tokens): 1.19 s on this fleet (2 ranks) vs
        1.59 s on one card with weight streaming (0.75×)" — one forward per step (CFG 1); the blocks gathered (and
        what they add after the overlap) and the blocks one card streams are named when there are any."""
        fleet, one, streamed = self.predict(tokens)
        n, w = self.model.blocks, self.world_size
        where = f"{size}, {tokens:,} video tokens" if size else f"{tokens:,} video tokens"
        text = f"predicted step time at {stage} ({where}): {fleet.total:.2f} s on this fleet ({w} rank{'s' * (w > 1)}"
        if self.gathered:
            text += f", {len(self.gathered)} of {n} blocks gathered: {fleet.exposed_gather:.2f} s exposed"
        if one is None:
            return text + "); one card like rank 0's cannot run it, even with weight streaming"
        moved = f", {streamed} of {n} blocks streamed" if streamed else ""
        return (text + f") vs {one.total:.2f} s on one card with weight streaming{moved} "
                       f"({fleet.total / one.total:.2f}×)")

    def lines(self) -> tuple[str, ...]:
        """`line` for each stage of the 720p template (`TEMPLATE_STAGES`)."""
        return tuple(self.line(stage, tokens, size) for stage, size, tokens in TEMPLATE_STAGES)
