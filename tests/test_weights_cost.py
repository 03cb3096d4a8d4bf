"""The cost model of a step with weights moving (`splits/weights_cost.py`): the block-by-block timeline (the moves
in `gathered`'s order, one link shared with the exchange) against timelines worked out by hand, the fleet's and one card's
forwards against the cost model's formula written out here, the memory rules on round numbers, the activation fit
against the peaks it cites, and the report line."""
from __future__ import annotations

import pytest

from mgpu_backend.splits import cost as C
from mgpu_backend.splits import weights_cost as M

GiB = 2**30
LAMBDA = C.H200_NVLINK.latency


# ---- the timeline --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compute, gather, exchange, total, exposed", [
    # nothing moves: the compute and the exchanges in a row
    ([1, 2, 3], [0, 0, 0], [0.5, 0.5, 0.5], 7.5, 0.0),
    # block 1's move (0.5 s) hides under block 0's compute (1 s)
    ([1, 1, 1], [0, 0.5, 0], [0, 0, 0], 3.0, 0.0),
    # block 1's move (3 s) from 0 to 3: block 1 runs 3..4, block 2 4..5
    ([1, 1, 1], [0, 3, 0], [0, 0, 0], 5.0, 2.0),
    # block 0's move is exposed whole (0..2); block 1's (issued at 2) ends at 2.5, under block 0's compute (2..3)
    ([1, 1], [2, 0.5], [0, 0], 4.0, 2.0),
    # chained moves: 1 on 0..2, 2 issued when block 1 starts (2) on 2..4; blocks at 0..1, 2..3, 4..5
    ([1, 1, 1], [0, 2, 2], [0, 0, 0], 5.0, 2.0),
    # the first moving block's move is issued before the loop, as `gathered` does: 0..3 under blocks 0 and 1
    # (0..1, 1..2), block 2 3..4
    ([1, 1, 1], [0, 0, 3], [0, 0, 0], 4.0, 1.0),
    # the next moving block's move is issued when the current moving block starts: move 1 on 0..1 (under block 0),
    # block 1 1..2, move 4 issued at 1: 1..4 under blocks 1-3 (1..4), block 4 4..5 — hidden whole
    ([1, 1, 1, 1, 1], [0, 1, 0, 0, 3], [0, 0, 0, 0, 0], 5.0, 0.0),
    # one link: block 0's exchange waits for block 1's move (0..2): 2..2.5; block 1 2.5..3.5, its exchange ..4
    ([1, 1], [0, 2], [0.5, 0.5], 4.0, 1.0),
])
def test_timeline_by_hand(compute, gather, exchange, total, exposed):
    p = M.simulate_step(compute, gather, exchange)
    assert p.total == pytest.approx(total)
    assert p.exposed_gather == pytest.approx(exposed)
    assert p.compute == pytest.approx(sum(compute)) and p.exchange == pytest.approx(sum(exchange))
    assert p.gather == pytest.approx(sum(gather))
    assert p.gathered_blocks == sum(1 for g in gather if g > 0) and p.blocks == len(compute)


def test_link_bound_timeline_is_n_moves_and_exchanges_plus_one_block():
    """Every block moves g > c: move 0 on 0..g, block i waits for move i and its exchange queues behind move i+1, so
    block i ends at (i+2)·g + (i+1)·x and the last at N·(g + x) + c."""
    n, c, g, x = 6, 1.0, 3.0, 0.25
    p = M.simulate_step([c] * n, [g] * n, [x] * n)
    assert p.total == pytest.approx(n * (g + x) + c)
    assert p.exposed_gather == pytest.approx(n * (g + x) + c - n * c - n * x)


def test_timeline_refuses_bad_inputs():
    with pytest.raises(ValueError, match="2 compute, 1 gather"):
        M.simulate_step([1, 1], [0], [0, 0])
    with pytest.raises(ValueError, match="negative"):
        M.simulate_step([1], [-1], [0])


def test_spread_blocks():
    assert M.spread_blocks(48, 0) == ()
    assert M.spread_blocks(48, 48) == tuple(range(48))
    assert M.spread_blocks(48, 4) == (11, 23, 35, 47)
    assert M.spread_blocks(5, 2) == (2, 4)  # ⌈5/2⌉ − 1, ⌈10/2⌉ − 1
    with pytest.raises(ValueError):
        M.spread_blocks(4, 5)


# ---- the fleet and one card --------------------------------------------------------------------------------------

def _compute(tokens: int, w: int, scale: float) -> float:
    """CostModel.compute written out: 48 blocks at the LTX-2 widths, tokens padded to a multiple of W."""
    m = C.H200_NVLINK
    tp = w * -(-tokens // w)
    return scale * (m.c0 + m.c_lin * tp / w + m.c_attn * tp * tp / w)


def _exchange(tokens: int, w: int, gbps: float) -> float:
    """Ulysses (2 all_to_all per block: 4 × [T/W, 4096] bf16 × (W−1)/W), video→audio (1 all_gather per block: 2 ×
    (W−1) × T/W × 2048 bf16), the output (1 all_gather: (W−1) × T/W × 128 bf16), at `gbps`, plus λ each."""
    local = tokens // w
    nbytes = (4 * 48 * local * 4096 * 2 * (w - 1) / w + 2 * 48 * (w - 1) * local * 2048 * 2
              + (w - 1) * local * 128 * 2)
    return nbytes / (gbps * 1e9) + (2 * 48 + 48 + 1) * LAMBDA


def test_fleet_step_without_moves_is_compute_plus_exchange():
    p = M.fleet_step(3520, 2, (), 1e9, 10.0, C.H200_NVLINK.scaled(6.0))
    assert p.compute == pytest.approx(_compute(3520, 2, 6.0))
    assert p.exchange == pytest.approx(_exchange(3520, 2, 10.0))
    assert p.total == pytest.approx(_compute(3520, 2, 6.0) + _exchange(3520, 2, 10.0))
    assert p.gather == 0 and p.exposed_gather == pytest.approx(0, abs=1e-12)


def test_fleet_step_link_bound_moves_half_a_block_each():
    """W = 2, every block sharded, a slow link: each block moves bytes/2 at 1 GB/s (g > c per block), so the
    forward is N·(g + x) + c by the link-bound rule."""
    block_bytes, gbps, w = 2e9, 1.0, 2
    g = block_bytes / 2 / 1e9
    c, x = _compute(3520, w, 1.0) / 48, _exchange(3520, w, gbps) / 48
    assert g > c
    p = M.fleet_step(3520, w, range(48), block_bytes, gbps)
    assert p.gather == pytest.approx(48 * g)
    assert p.total == pytest.approx(48 * (g + x) + c)


def test_one_card_streaming():
    """One card: no exchange; resident: the compute alone; every block streamed over a slow copy: N·g + c."""
    c = _compute(14080, 1, 6.0)
    resident = M.one_card_step(14080, (), 1e9, 25.0, C.H200_NVLINK.scaled(6.0))
    assert resident.total == pytest.approx(c) and resident.exchange == 0
    g = 4e9 / (2.0 * 1e9)
    streamed = M.one_card_step(14080, range(48), 4e9, 2.0, C.H200_NVLINK.scaled(6.0))
    assert g > c / 48
    assert streamed.total == pytest.approx(48 * g + c / 48)
    # a fast copy hides under the compute but the first streamed block's: spread over 12 of 48 blocks (11, 23, …),
    # each 0.05 s against ~0.13 s of compute per block
    fast = M.one_card_step(14080, M.spread_blocks(48, 12), 1e9, 20.0, C.H200_NVLINK.scaled(6.0))
    assert c / 48 > 1e9 / 20e9
    assert fast.total == pytest.approx(c) and fast.gathered_blocks == 12


# ---- memory --------------------------------------------------------------------------------------------------------

def test_activation_fit_is_the_cited_peaks():
    a, b = M.fit_activations()
    assert a == pytest.approx(M.ACTIVATION_FIXED, rel=2e-3) and b == pytest.approx(M.ACTIVATION_PER_ROW, rel=2e-3)
    # the replica's stage-2 peak (26.07 GiB) over its 21.85 GiB resident, and one rank of 4's stage-2 peak (7.95)
    # over its 6.06 resident and 2 gathered blocks, from bench/results/sharded_h200.txt, within 0.05 GiB
    assert M.activation_bytes(14080) / GiB == pytest.approx(26.07 - 21.85, abs=0.05)
    block = (386_465_792 + 2 * 229_568) / GiB
    assert M.activation_bytes(3520) / GiB == pytest.approx(7.95 - 6.06 - 2 * block, abs=0.05)


def test_ltx23_fp8_bytes():
    """48 blocks of 386,465,792 fp8 Linear weights + 229,568 bf16 parameters; the file is 21.85 GiB in all."""
    m = M.LTX23_22B_FP8
    assert m.blocks * m.block_bytes / GiB == pytest.approx(48 * 386_924_928 / GiB)
    assert m.blocks * m.block_bytes / GiB == pytest.approx(17.30, abs=0.01)
    assert m.total / GiB == pytest.approx(21.85)
    assert M.LTX23_22B_BF16.block_bytes == 2 * 386_695_360


TOY = M.ModelBytes(blocks=10, block_bytes=1 * GiB, other_bytes=1 * GiB)


def test_fleet_placement_is_the_fleets_rule():
    """W = 2, 10 blocks of 1 GiB, 1 GiB besides, no connectors; the fleet's rule keeps 4 GiB free and holds the largest
    sharded block twice from two on: need(0) = 1 + 10 + 4 = 15, need(1) = 15.5, need(k ≥ 2) = 1 + (10 − k) + k/2 + 2
    + 4 = 17 − k/2 GiB. A budget (card − 1 GiB) of 15: k = 0; 14: k = 6; 11.9: none (all 10 need 12)."""
    card = lambda budget: budget * GiB + M.RESERVE_BYTES  # noqa: E731
    assert M.fleet_placement(TOY, 2, card(15)).sharded == ()
    six = M.fleet_placement(TOY, 2, card(14))
    assert len(six.sharded) == 6 and M.gathered_blocks(TOY, six) == six.sharded
    assert M.fleet_rank_bytes(six, 0) == pytest.approx((1 + 4 + 3 + 2) * GiB + M.ACTIVATION_FIXED)
    assert M.fleet_placement(TOY, 2, card(11.9)) is None
    assert M.fleet_placement(TOY, 1, card(10)) is None  # one rank cannot shard its way into less memory


def test_resident_blocks_on_round_numbers():
    """room = budget − 1 GiB − a: all 10 blocks when it holds them; else ⌊(room − 2 buffers) / 1 GiB⌋."""
    a = M.ACTIVATION_FIXED
    card = lambda budget: budget * GiB + a + M.RESERVE_BYTES  # noqa: E731
    assert M.resident_blocks(TOY, card(11), 0) == 10
    assert M.resident_blocks(TOY, card(8.5), 0) == 5
    assert M.resident_blocks(TOY, card(2.5), 0) is None


# ---- a box ---------------------------------------------------------------------------------------------------------

def test_predict_box_two_24gb_cards_stage_1():
    """2 × 24 GiB over PCIe 4.0 without P2P, the 22B fp8 model, stage 1 (3,520 tokens), compute × 6. The fleet's rule
    in a 23 GiB budget with 4 GiB kept free: the 16 connector units (t = 0.235 GiB) sharded first still need
    0.796 + 17.297 (48 blocks of b = 0.3604 GiB) + 16·t/2 + 2t + 4 = 24.44 GiB; then m blocks: 0.796 + (48 − m)·b +
    m·b/2 + 1.88 + 2b + 4 = 24.69 − 0.18·m ≤ 23 → m = 10 blocks gathered every forward, spread through the 48. Each
    move (b/2 at 10 GB/s: 19 ms) runs under the ~5 whole blocks before it (20 ms of compute each) and is off the link
    before the moving block's exchange: nothing exposed, the fleet = compute(W=2) + exchange. One card holds
    0.80 + 17.30 + 1.17 ≤ 23: nothing streamed, compute(W=1)."""
    p = M.predict_box(M.Box.of((24, 24), "pcie4-host"), 3520, compute_scale=6.0)
    assert p.sharded_blocks == 10 and p.streamed_blocks == 0 and len(p.placement.sharded) == 26
    fleet = _compute(3520, 2, 6.0) + _exchange(3520, 2, 10.0)
    assert p.fleet.exposed_gather == pytest.approx(0.0, abs=1e-9)
    assert p.fleet.total == pytest.approx(fleet)
    assert p.one_card.total == pytest.approx(_compute(3520, 1, 6.0))
    assert p.ratio == pytest.approx(fleet / _compute(3520, 1, 6.0))


def test_predict_box_bf16_streams_on_one_card():
    """The bf16 22B model (48 × 0.72 GiB) on one 24 GiB card at stage 1: room 23 − 0.80 − 1.17 = 21.03 GiB, minus
    2 buffers: ⌊19.59 / 0.72⌋ = 27 resident, 21 streamed; 2 cards cannot hold it, 4 shard some blocks."""
    p = M.predict_box(M.Box.of((24, 24), "pcie4-host"), 3520, model=M.LTX23_22B_BF16, compute_scale=6.0)
    b = M.LTX23_22B_BF16.block_bytes
    room = 23 * GiB - M.LTX23_22B_BF16.other_bytes - (M.ACTIVATION_FIXED + 3520 * M.ACTIVATION_PER_ROW) - 2 * b
    assert p.streamed_blocks == 48 - int(room // b) == 21
    assert p.one_card.gathered_blocks == 21 and p.one_card.gather == pytest.approx(21 * b / 25e9)
    # 2 ranks: even every unit sharded needs 0.80 + 34.6/2 + 3.76/2 + 2 × 0.72 (gathered) + 4 kept free = 25.4 GiB
    assert p.fleet is None and p.sharded_blocks is None and p.ratio is None
    four = M.predict_box(M.Box.of((24,) * 4, "pcie4-host"), 3520, model=M.LTX23_22B_BF16, compute_scale=6.0)
    assert 0 < four.sharded_blocks < 48 and four.fleet.gathered_blocks == four.sharded_blocks


def test_box_of_unknown_link():
    with pytest.raises(KeyError, match="pcie4-host"):
        M.Box.of((24, 24), "carrier-pigeon")


def test_one_24gb_card_cannot_hold_the_fleets_replica():
    """A one-rank fleet holds the connectors too (0.80 + 3.76 + 17.30 + 4 GiB kept free > 23 GiB): it does not fit,
    while one card with ComfyUI's loading (connectors by need) does."""
    p = M.predict_box(M.Box.of((24,), "pcie4-host"), 3520, compute_scale=6.0)
    assert p.fleet is None and p.sharded_blocks is None and p.ratio is None
    assert p.one_card is not None


# ---- the running fleet's line --------------------------------------------------------------------------------------

def test_fleet_facts_line():
    """A 2-rank fleet of 24 GiB cards, nothing gathered, measured link 10 GB/s, compute × 6: the line's figures are
    the formula's (fleet = compute(W=2) + exchange; one card = compute(W=1), nothing streamed)."""
    facts = M.FleetFacts(2, 24 * GiB, M.LTX23_22B_FP8, C.LTX2_19B, (), 10.0, 25.0, 6.0)
    fleet = _compute(3520, 2, 6.0) + _exchange(3520, 2, 10.0)
    one = _compute(3520, 1, 6.0)
    assert facts.line("stage 1", 3520, "640×352×121") == (
        f"predicted step time at stage 1 (640×352×121, 3,520 video tokens): {fleet:.2f} s on this fleet (2 ranks) "
        f"vs {one:.2f} s on one card with weight streaming ({fleet / one:.2f}×)")
    assert [line.split(" (")[0] for line in facts.lines()] == ["predicted step time at stage 1",
                                                              "predicted step time at stage 2"]
    assert "(640×352×121, 3,520 video tokens)" in facts.lines()[0]
    assert "(1280×704×121, 14,080 video tokens)" in facts.lines()[1]


def test_fleet_facts_line_names_the_moves():
    """Every block gathered over a slow link, one 16 GiB card that cannot hold the 17.3 GiB of blocks: the line
    names the gathered blocks and what one card streams."""
    facts = M.FleetFacts(2, 16 * GiB, M.LTX23_22B_FP8, C.LTX2_19B, tuple(range(48)), 1.0, 25.0, 6.0)
    line = facts.line("stage 1", 3520)
    fleet, one, streamed = facts.predict(3520)
    assert fleet.gathered_blocks == 48 and streamed and one.gathered_blocks == streamed
    assert f"48 of 48 blocks gathered: {fleet.exposed_gather:.2f} s exposed" in line
    assert f"{streamed} of 48 blocks streamed" in line
