"""A generate job's memory plan on one card (issue 37): what the job holds on a rank's GPU at each of its moments,
decided before the job starts — never out of memory where a plan exists, refused with the figures where none does —
and each fallback that costs speed named with its cost, for the job report (CLI / node output), not only a log.

Standard library only (the figures come from the engine: `stages/pipelines.py TwoStagePipeline.plan_memory`).
Sizes are bytes.

**The moments** (in job order; `budget` = what this process may hold on the GPU: its free memory plus what it
holds already):
- encode: the transformer (T), the other components (O: VAEs, connectors, projection, upscaler, vocoder), the CUDA
  graphs' pool kept from earlier jobs (P₀), the text encoder (E) and one encoder forward (`encoder_activation`);
- each transformer stage: T + O + E (when the encoder stays) + the stage's forward activations (A: one row's, or all
  the guidance passes' rows when they run batched, `protocol/memory_plan.activation_bytes`) + the graphs' pool.
  Capturing a forward needs its activations twice (its eager warm-up's memory stays cached by the allocator while
  the capture fills the pool: `engine/cuda_graphs.py`), so a graphed stage peaks at T + O + E + 2·A + P and leaves
  P + A: the graphs of one transformer share one pool, but forwards of other shapes reuse little of it (measured on
  an H100, 48 blocks, 1280×704×121: 7.7 GiB of pool after stage 1's batched forward and stage 2's, whose planned
  activations add up to 7.1: issue 37). The engine empties the allocator's cache between the stages
  (`TwoStagePipeline.generate`), so a stage's eager memory is its own.

**Decisions**, cheapest first, the first that fits every moment:
1. everything: the encoder stays, passes batched where the engine would batch them, forwards graphed;
2. the encoder leaves the GPU after encoding — to host memory when the host can hold it ("offload", back over the
   host link for the next prompt the prompt cache does not hold), else dropped ("drop", reloaded from disk then);
3. with the encoder off the GPU, per stage, the fallback that costs less at its token count first (`GRAPH_GAIN`,
   `BATCH_GAIN`): forwards eager (no graphs) or guidance passes one at a time; then both;
and, before encoding, the graphs kept from earlier jobs are dropped (recaptured at the next forwards) when the
encoder does not fit next to them. Otherwise `JobMemoryError` with the figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
ENCODER_MODES = ("keep", "offload", "drop")
RESERVE_BYTES = 2 * GiB
RESERVE_SHARE = 0.05
"""Kept apart from the plan: 2 GiB + 5 % of the budget (what the model does not itemise: the allocator's rounding
and fragmentation between differently shaped stages, kernels' workspaces, cuBLAS / cuDNN handles)."""
HOST_LINK_BYTES_PER_S = 1.1e9
"""Host ↔ GPU rate of moving the offloaded encoder (`Module.to`, pageable memory), for the cost shown in the report
only: ~1.1 GB/s seen on the H100 device machine (bench/results/issue37_h100.txt: the warm-up's text phase took
22.5 s with the 21.9 GiB offload against 2.2 s without it on the H200), far below PCIe's ~10-25 GB/s because each
move allocates fresh pageable host memory."""
GRAPH_GAIN = ((1536, 0.23), (3520, 0.03), (6144, 0.01), (14080, 0.01))
"""(video tokens per rank, share of a forward's time CUDA graphs save at W = 1) — bench/results/speed_h200.txt,
"per-rank forward, eager vs CUDA graphs" (1 − graphed / eager); linear in log tokens between, flat outside."""
BATCH_GAIN = ((1536, 0.11), (3520, 0.04), (6144, 0.0), (14080, 0.0))
"""(video tokens per rank, share of a step's time batching its 4 guidance passes saves, graphed) — the same file,
"guidance passes at W = 1" (1 − batched / 4 forwards; no gain, 0, where batching is slower)."""


class JobMemoryError(ValueError):
    """No plan fits the card: the message gives the moment, what it holds and the budget."""


def gain(table: tuple[tuple[int, float], ...], tokens: int) -> float:
    """`table`'s share at `tokens` (linear in log tokens between its points, its end values outside)."""
    if tokens <= table[0][0]:
        return table[0][1]
    for (t0, g0), (t1, g1) in zip(table, table[1:]):
        if tokens <= t1:
            f = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return g0 + f * (g1 - g0)
    return table[-1][1]


def gib(n: int | float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass(frozen=True)
class StageNeed:
    """One transformer stage's forwards on this rank: `name` ("stage 1"); `tokens`: video tokens per rank;
    `passes`: guidance passes per step; `batchable`: the engine would batch them (CUDA, passes > 1, tokens ≤
    `denoiser.BATCH_TOKENS`); `activation`: one row's forward activations, `batched_activation`: all `passes` rows'
    (bytes, `memory_plan.activation_bytes`)."""

    name: str
    tokens: int
    passes: int
    batchable: bool
    activation: int
    batched_activation: int


@dataclass(frozen=True)
class JobMemoryInputs:
    """What the plan reads (bytes): `budget` (free + already held by this process on its GPU); `transformer`,
    `others`, `encoder` (0: the encoder is not on this GPU: sharded elsewhere, placed on the CPU, not loaded;
    one an earlier plan moved to host memory counts: it comes back to encode) resident;
    `encoder_activation` (one encoder forward); `graph_pool` (held now by graphs of earlier jobs); `stages`;
    `graphs` (CUDA graphs on); `host_room` (host memory free for an offloaded encoder); `reserve` (kept apart for
    what is not modelled; None: `RESERVE_BYTES` + `RESERVE_SHARE` of the budget)."""

    budget: int
    transformer: int
    others: int
    encoder: int
    encoder_activation: int
    graph_pool: int
    stages: tuple[StageNeed, ...]
    graphs: bool = True
    host_room: int = 0
    reserve: int | None = None

    @property
    def kept_free(self) -> int:
        return self.reserve if self.reserve is not None else RESERVE_BYTES + int(RESERVE_SHARE * self.budget)


@dataclass(frozen=True)
class StagePlan:
    """A stage's decision: `batched` (guidance passes as one forward), `graphs` (forwards replayed from CUDA
    graphs), `peak` (bytes) and `fallbacks` (what it gave up, with the cost)."""

    name: str
    batched: bool
    graphs: bool
    peak: int
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobMemoryPlan:
    """The plan: `encoder` ("keep" | "offload" | "drop", after encoding), `drop_graphs` (before encoding),
    `encode_peak`, `stages`, `budget`, `fallbacks` (encoder and graph ones; the stages' are in `stages`)."""

    encoder: str
    drop_graphs: bool
    encode_peak: int
    stages: tuple[StagePlan, ...]
    budget: int
    fallbacks: tuple[str, ...] = ()

    def stage(self, name: str) -> StagePlan | None:
        return next((s for s in self.stages if s.name == name), None)

    @property
    def peak(self) -> int:
        return max([self.encode_peak] + [s.peak for s in self.stages])

    def lines(self) -> tuple[str, ...]:
        """The job report's lines: the plan's peak against the budget, then every fallback with its cost."""
        head = f"memory plan: peak {gib(self.peak)} of {gib(self.budget)}"
        kept = [] if self.fallbacks or any(s.fallbacks for s in self.stages) else \
            [" (text encoder kept, passes batched where they pay, forwards graphed)"]
        return (head + "".join(kept),) + tuple(f"memory plan: {f}" for f in self.fallbacks) + tuple(
            f"memory plan: {s.name}: {f}" for s in self.stages for f in s.fallbacks)


def _stage_options(stage: StageNeed, graphs: bool) -> list[tuple[bool, bool, tuple[str, ...]]]:
    """(batched, graphed, fallbacks) for `stage`, cheapest first."""
    batch = stage.batchable and stage.passes > 1
    g_cost, b_cost = gain(GRAPH_GAIN, stage.tokens), gain(BATCH_GAIN, stage.tokens)
    no_graphs = f"forwards eager, not graphed (~{100 * g_cost:.0f} % slower at {stage.tokens:,} tokens per rank)"
    one_at_a_time = (f"{stage.passes} guidance passes one at a time, not batched (~{100 * b_cost:.0f} % slower at "
                     f"{stage.tokens:,} tokens per rank)")
    options = [(batch, graphs, ())]
    singles = []
    if graphs:
        singles.append((g_cost, (batch, False, (no_graphs,))))
    if batch:
        singles.append((b_cost, (False, graphs, (one_at_a_time,))))
    options += [o for _, o in sorted(singles, key=lambda x: x[0])]
    if graphs and batch:
        options.append((False, False, (one_at_a_time, no_graphs)))
    return options


def _plan_stages(inputs: JobMemoryInputs, base: int, pool: int, limit: int, fallbacks_allowed: bool
                 ) -> tuple[StagePlan, ...] | None:
    plans = []
    for stage in inputs.stages:
        options = _stage_options(stage, inputs.graphs)
        for batched, graphed, fallbacks in options if fallbacks_allowed else options[:1]:
            act = stage.batched_activation if batched else stage.activation
            peak = base + pool + act * (2 if graphed else 1)
            if peak <= limit:
                plans.append(StagePlan(stage.name, batched, graphed, peak, fallbacks))
                pool += act if graphed else 0
                break
        else:
            return None
    return tuple(plans)


def plan_job_memory(inputs: JobMemoryInputs) -> JobMemoryPlan:
    """The cheapest plan that fits every moment of the job (module docstring). Raises JobMemoryError naming the
    moment that fits in no plan, with its figures."""
    i = inputs
    limit = i.budget - i.kept_free
    fixed = i.transformer + i.others
    if fixed > limit:
        raise JobMemoryError(
            f"the model does not fit this GPU: transformer {gib(i.transformer)} and other components "
            f"{gib(i.others)} of {gib(i.budget)} less {gib(i.kept_free)} kept free; use fp8 / int8 weights or shard "
            "the transformer over the fleet (weights 'sharded' / 'auto')")
    drop_graphs = False
    encode_peak = fixed + i.graph_pool + i.encoder + i.encoder_activation
    fallbacks: list[str] = []
    pool = i.graph_pool
    if encode_peak > limit and i.graph_pool:
        drop_graphs, pool = True, 0
        encode_peak -= i.graph_pool
        fallbacks.append(f"CUDA graphs of earlier jobs dropped before encoding ({gib(i.graph_pool)}; the next "
                         "forwards capture again: one more forward per graph)")
    if encode_peak > limit:
        raise JobMemoryError(
            f"the text encoder does not fit next to the transformer: encoding needs {gib(encode_peak)} (transformer "
            f"{gib(i.transformer)}, other components {gib(i.others)}, text encoder {gib(i.encoder)} and its forward "
            f"{gib(i.encoder_activation)}) of {gib(i.budget)} less {gib(i.kept_free)} kept free; shard the text "
            "encoder over the fleet (gemma_mode 'sharded'), give it a CPU share (gemma_max_memory), or use an fp8 "
            "Gemma file")
    leave = "offload" if i.host_room >= i.encoder else "drop"
    # the encoder stays only where nothing else has to give; off the GPU before any stage gives up a fast path
    tries = [("keep", False)] + ([(leave, False), (leave, True)] if i.encoder else [("keep", True)])
    for encoder, fallbacks_allowed in tries:
        base = fixed + (i.encoder if encoder == "keep" else 0)
        stages = _plan_stages(i, base, pool, limit, fallbacks_allowed)
        if stages is None:
            continue
        extra = []
        if encoder == "offload":
            move_s = 2 * i.encoder / HOST_LINK_BYTES_PER_S
            extra.append(f"text encoder ({gib(i.encoder)}) moved to host memory after encoding; a prompt the "
                         f"cache does not hold brings it back and out again (~{move_s:.0f} s over the host link)")
        elif encoder == "drop":
            extra.append(f"text encoder ({gib(i.encoder)}) released after encoding (the host cannot hold it: "
                         f"{gib(i.host_room)} free); a prompt the cache does not hold reloads it from disk")
        return JobMemoryPlan(encoder, drop_graphs, encode_peak, stages, i.budget, tuple(fallbacks + extra))
    worst = max(i.stages, key=lambda s: s.activation)
    need = fixed + worst.activation
    raise JobMemoryError(
        f"{worst.name} does not fit this GPU in any plan: one forward at {worst.tokens:,} video tokens needs "
        f"{gib(need)} (transformer {gib(i.transformer)}, other components {gib(i.others)}, activations "
        f"{gib(worst.activation)}) of {gib(i.budget)} less {gib(i.kept_free)} kept free, with the text encoder off "
        "the GPU, the passes one at a time and no CUDA graphs; use fp8 / int8 weights, a smaller size or fewer "
        "frames, or split the stage over more GPUs")


__all__ = ["BATCH_GAIN", "ENCODER_MODES", "GRAPH_GAIN", "RESERVE_BYTES", "RESERVE_SHARE", "JobMemoryError",
           "JobMemoryInputs", "JobMemoryPlan", "StageNeed", "StagePlan", "gain", "plan_job_memory"]
