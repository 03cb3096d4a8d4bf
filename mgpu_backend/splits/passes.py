"""Guidance-pass parallelism ("CFG parallel"): the guidance passes of one denoising step on different ranks.

A guided LTX-2 step runs P independent transformer forwards of the same latent and combines their x0 predictions
(`sampling.plan_passes`, reference `_guided_denoise`): "cond" (positive prompt), "uncond" (negative prompt, CFG),
"perturbed" (STG: self-attention skipped in the chosen blocks) and "isolated" (modality guidance: no audio<->video
cross-attention) — P = 4 for the two-stage recipe's stage 1, P = 2 with CFG only, P = 1 without guidance. Where one
forward is launch-bound (small sizes, `cost.py`) sequence parallelism does not pay, and without this the other GPUs
would idle through the guided stages. The passes of a step need no communication while they run: give each its own
rank and exchange only their outputs.

Source: xDiT's "CFG parallel" (J. Fang et al., "xDiT: an Inference Engine for Diffusion Transformers (DiTs) with
Massive Parallelism", arXiv:2411.01738): the conditional and unconditional forwards of classifier-free guidance on
two GPUs, their outputs exchanged once per step. Here the same for LTX-2's up to four guidance passes.

Layout: ranks 0..g-1 of `group` (a plan's groups are ranks 0..g-1 of the world, so a rank's number is the same in
both). Pass j (in `plan_passes` order) runs on rank j % g: with P = 4 and g = 4 one forward per rank, with g = 2 two
(cond + perturbed on rank 0, uncond + isolated on rank 1). Every rank of the group holds the same sampling state
(same seed, same noise, same combine and Euler step), so after the exchange every rank continues with the same
latent and the loop stays in lockstep without any other collective.

Exchange per step: when a rank has computed its passes, each pass's outputs are broadcast from its owner rank within
the group, in pass order — P broadcasts per step, each of one flat buffer holding the pass's x0 predictions
`[B, Tv, 128]` (video) and `[B, Ta, 128]` (audio), float32 as `sampling.denoise_loop` makes them (a modality that
is absent, `None`, takes no room): 4·B·(Tv + Ta)·128 bytes per pass. At 640×352×121 with 5 s of audio (Tv = 3,520,
Ta = 126, B = 1) that is 1.87 MB per pass, 7.5 MB per step for P = 4 — against 4 forwards of ~260 ms: on NVLink
(~130 GB/s effective, `cost.py`) ~60 µs, 0.02 % of the step. The sampling state lives on the CPU (`denoise_loop`),
so the buffers go to the communication device and back: the rank's CUDA device for NCCL fleets, the CPU for gloo.

Exactness: pass j is the same forward of the same inputs on the same kind of device with the same weights as in the
one-process loop — only which process computes it differs — and the exchange copies its bits. The guided prediction,
the step and hence the whole stage are therefore bit-identical to the sequential loop (tested on gloo ranks with
`torch.equal`). The STG pass swaps the attention processors of its blocks on the rank that runs it, inside its
forward (`denoiser.skip_self_attention`): the swap is local to that rank and undone before the exchange.
A rank that owns several passes runs them as one batched forward where the denoiser chooses to
(`LTX2Denoiser.batch_choice`: CUDA, small per-rank token counts; never on CPU unless set "on"): then its passes
equal their unbatched forwards to float tolerance rather than bitwise (batched kernels order reductions differently).

Contract on `denoise`: every pass of a step returns the same structure — the same modalities present, with the same
shapes, dtypes and devices (true of `denoise_loop`: every x0 has its latent's shape, float32). The receiving ranks
take the layout from their own first pass (each rank of the group owns at least one, as g ≤ P); a rank whose own
passes disagree raises ValueError before any exchange.

Cost per rank against sequence parallelism (SP) of the same stage: every rank of the group runs whole forwards, so a
rank's activation memory is the one-GPU forward's (SP's is ~1/W of it), and the stage's time per step is
⌈P/g⌉ forwards at one-GPU speed plus the exchange — against P forwards at the SP degree's speed. `choose_split` makes
that comparison with the cost model on CUDA fleets.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.sampling import PASS_KINDS, GuidancePass, run_local
from .cost import DEFAULT, LTX2_19B, CostModel, ModelShape, predict_sp
from .forward_plan import ROWS

MAX_PASSES = len(PASS_KINDS)  # cond, uncond, perturbed, isolated
MODES = ("auto", "on", "off")
"""`FleetConfig.guidance_parallel`: "auto" (CUDA: the cost model decides per stage; CPU: sequence parallel as
before), "on" (guidance passes in parallel whenever a stage has more than one pass and the fleet more than one rank),
"off" (never)."""

Output = tuple[torch.Tensor | None, torch.Tensor | None]


def check_mode(mode: str) -> str:
    """Raise ValueError unless `mode` is one of `MODES`."""
    if mode not in MODES:
        raise ValueError(f"guidance_parallel={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def _layout(out: Output) -> tuple:
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in out)


class PassParallel:
    """`run_passes` of `sampling.denoise_loop` over ranks 0..size-1 of `group` (see the module docstring): the `ROWS`
    plan's split of a step's branches (guidance passes, or a native request's batch rows), with the methods of
    `engine.forward.Split` over branches — `shard` (this rank's), `key_mask` (none), `gather` (broadcast from each
    owner) — and `__call__` = gather(shard, each run here). Made by the dispatcher (`dispatch.py`).

    Args:
        group: the process group of ranks 0..size-1 (None: the default group, when size is the world size).
        size: g, the number of ranks the passes are spread over.
        rank: this rank (0 ≤ rank < size; its number in the world and in the group alike).
        comm_device: where the broadcast buffers live: the rank's CUDA device (NCCL) or the CPU (gloo).

    Attributes (statistics of this stage, on this rank): `forwards` run here, `exchanged_bytes` broadcast or
    received here, `steps` exchanged.
    """

    plan = ROWS
    cuda_graph_safe = False  # not a forward of its own: each branch is one (graphed) forward

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int,
                 comm_device: torch.device | str = "cpu"):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"PassParallel: rank {rank} is not one of the {size} ranks")
        self.group, self.size, self.rank = group, size, rank
        self.comm_device = torch.device(comm_device)
        self.forwards = 0
        self.exchanged_bytes = 0
        self.steps = 0

    def owner(self, index: int) -> int:
        """The rank that computes pass `index` (in `plan_passes` order)."""
        return index % self.size

    def shard(self, passes: Sequence[GuidancePass]) -> list[GuidancePass]:
        """The branches this rank computes (pass j on rank j % size), in order (the `engine.forward.Split`
        methods over a step's branches instead of a batch's tokens). Raises ValueError for fewer branches than
        ranks."""
        n = len(passes)
        if self.size > 1 and n < self.size:
            raise ValueError(f"{n} guidance passes cannot occupy {self.size} ranks (every rank needs one)")
        return [passes[j] for j in range(n) if self.owner(j) == self.rank]

    def key_mask(self, passes: Sequence[GuidancePass], part: GuidancePass) -> None:
        """Whole forwards: nothing is padded."""
        return None

    def gather(self, passes: Sequence[GuidancePass], outputs: list[Output]) -> list[Output]:
        """Every branch's outputs on every rank of the group, in `passes` order, from this rank's `outputs` (of
        `shard(passes)`, in that order): each branch broadcast from its owner. Raises ValueError when this rank's
        branches returned different layouts."""
        n = len(passes)
        if self.size == 1:
            self.forwards += n
            return list(outputs)
        own = [j for j in range(n) if self.owner(j) == self.rank]
        mine = dict(zip(own, outputs))
        self.forwards += len(mine)
        layout = _layout(next(iter(mine.values())))
        for j, out in mine.items():
            if _layout(out) != layout:
                raise ValueError(f"guidance pass {passes[j].kind!r} returned {_layout(out)}, another pass of this "
                                 f"step {layout}: the passes must return the same modalities, shapes and dtypes")
        results: list[Output] = []
        for j in range(n):
            src = self.owner(j)
            out = self._exchange(mine.get(j), layout, src)
            results.append(mine[j] if src == self.rank else out)
        self.steps += 1
        return results

    def __call__(self, passes: Sequence[GuidancePass], denoise: Callable[[GuidancePass], Output]) -> list[Output]:
        # several passes on this rank: one batched forward where the model function offers it (sampling.run_local)
        return self.gather(passes, run_local(denoise, self.shard(passes)))

    def _exchange(self, out: Output | None, layout: tuple, src: int) -> Output:
        """Broadcast pass outputs from `src`: one flat buffer when every present tensor has the same dtype (the
        sampling loop's float32 x0), else one broadcast per tensor."""
        present = [spec for spec in layout if spec is not None]
        if not present:
            return (None,) * len(layout)  # type: ignore[return-value]
        dtypes = {dtype for _, dtype, _ in present}
        groups = [present] if len(dtypes) == 1 else [[spec] for spec in present]
        sending = src == self.rank
        tensors = [t for t in out if t is not None] if sending else None  # type: ignore[union-attr]
        received: list[torch.Tensor] = []
        k = 0
        for specs in groups:
            numels = [math.prod(shape) for shape, _, _ in specs]
            dtype = specs[0][1]
            if sending:
                buf = torch.cat([t.reshape(-1) for t in tensors[k:k + len(specs)]]).to(self.comm_device)
            else:
                buf = torch.empty(sum(numels), dtype=dtype, device=self.comm_device)
            dist.broadcast(buf, src=src, group=self.group)
            self.exchanged_bytes += buf.numel() * buf.element_size()
            if not sending:
                for part, (shape, _, device) in zip(buf.split(numels), specs):
                    received.append(part.reshape(shape).to(device))
            k += len(specs)
        if sending:
            return out  # type: ignore[return-value]
        it = iter(received)
        return tuple(None if spec is None else next(it) for spec in layout)  # type: ignore[return-value]


# ---- the per-stage choice ------------------------------------------------------------------------------------------

def pass_bytes(video_shape: Sequence[int] | None, audio_shape: Sequence[int] | None, element_bytes: int = 4) -> int:
    """Bytes of one pass's outputs (the packed x0 predictions `[B, T, C]` of each present modality, float32)."""
    return sum(math.prod(s) for s in (video_shape, audio_shape) if s is not None) * element_bytes


def pass_degree(passes: int, available: Iterable[int], world_size: int) -> int:
    """The group size g for `passes` passes: the smallest of the `available` sizes (≤ the world size and ≤ the pass
    count) that reaches the fewest forwards per rank, ⌈P/g⌉ — e.g. P = 4 on 3 ranks: 2 (2 forwards per rank either
    way, one broadcast peer fewer), P = 3 on 4 ranks: 3. 1 when no size above 1 is available."""
    sizes = sorted({1} | {g for g in available if 1 <= g <= min(world_size, passes)})
    best = 1
    for g in sizes:
        if -(-passes // g) < -(-passes // best):
            best = g
    return best


def predict_passes(tokens: int, passes: int, degree: int, nbytes: float, shape: ModelShape = LTX2_19B,
                   model: CostModel = DEFAULT) -> float:
    """Predicted seconds of one step with the passes over `degree` ranks: ⌈P/g⌉ one-GPU forwards
    (`cost.predict_sp(tokens, 1)`) plus, when g > 1, P broadcasts of `nbytes` each (bytes over the model's effective
    link bandwidth, plus its per-collective latency)."""
    step = -(-passes // degree) * predict_sp(tokens, 1, shape, model)
    if degree > 1:
        step += passes * (nbytes / model.bandwidth + model.latency)
    return step


def predict_sequence(tokens: int, passes: int, degree: int, shape: ModelShape = LTX2_19B,
                     model: CostModel = DEFAULT) -> float:
    """Predicted seconds of one step with the passes one after the other, each sequence parallel over `degree`."""
    return passes * predict_sp(tokens, degree, shape, model)


@dataclass(frozen=True)
class StageSplit:
    """How one stage runs: `kind` "sequence" (every pass SP over ranks 0..degree-1) or "passes" (the passes spread
    over ranks 0..degree-1, each forward on one rank). `reason`: why (None when nothing needs saying); the predicted
    seconds per step of both options when the cost model was asked."""

    kind: str
    degree: int
    passes: int
    stage: str = "stage"
    reason: str | None = None
    predicted_passes_s: float | None = None
    predicted_sequence_s: float | None = None

    @property
    def forwards_per_rank(self) -> int:
        return -(-self.passes // self.degree)

    def describe(self, world_size: int) -> str:
        """The job report's line for a guidance-parallel stage."""
        where = f"{self.degree} ranks" if self.degree == world_size else f"ranks 0-{self.degree - 1} of {world_size}"
        k = self.forwards_per_rank
        rest = "; the other ranks wait for its result" if self.degree < world_size else ""
        text = (f"{self.stage}: guidance passes in parallel on {where} ({self.passes} passes per step: {k} "
                f"forward{'s' if k != 1 else ''} per rank{rest})")
        return f"{text}; {self.reason}" if self.reason else text


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


@dataclass(frozen=True)
class StageWork:
    """What one stage (or native request) asks of the fleet: `stage` (its name in the report), `tokens` video tokens
    per forward, `passes` branches per step (guidance passes, or a request's batch rows), `nbytes` of one branch's
    outputs (the per-step exchange when they are spread)."""

    stage: str
    tokens: int
    passes: int
    nbytes: float = 0.0


@dataclass(frozen=True)
class SplitChoices:
    """What a plan lets a stage choose between (`ParallelPlan.split` fills it): `mode` ("auto" | "on" | "off",
    `MODES`), the fleet's `world_size`, `sp_degree` (the plan's sequence-parallel choice for the stage's tokens),
    `pass_degrees` (the guidance-pass group sizes built), the `cost_model` (None: no predictions; CPU fleets) and the
    transformer's `shape` for it, and the per-rank `token_cap` (None: no cap)."""

    mode: str
    world_size: int
    sp_degree: int
    pass_degrees: tuple[int, ...] = ()
    cost_model: CostModel | None = None
    shape: ModelShape = LTX2_19B
    token_cap: int | None = None


def choose_split(work: StageWork, choices: SplitChoices) -> StageSplit:
    """Sequence parallel at `choices.sp_degree` (the plan's choice for the tokens) or the guidance passes in
    parallel.

    `mode` "off": always SP. "on": the passes in parallel whenever P > 1, W > 1 and a group of 2 or more exists.
    "auto": with a `cost_model` (CUDA fleets), the passes in parallel when their predicted step time
    (`predict_passes`: ⌈P/g⌉·t(T, 1) + the exchange) is below SP's (`predict_sequence`: P·t(T, d)); without one (CPU
    fleets) SP, as before. In every mode a forward of all `tokens` on one rank must respect `token_cap` (SP splits
    them; the passes do not). `pass_degrees`: the group sizes the plan built (see `pass_degree`).

    Returns a `StageSplit`; for "sequence" its `reason` is what the report should add to the SP line (or None).
    Raises ValueError for an unknown mode.
    """
    mode, tokens, passes, stage, nbytes = choices.mode, work.tokens, work.passes, work.stage, work.nbytes
    world_size, sp_degree, cost_model, shape = (choices.world_size, choices.sp_degree, choices.cost_model,
                                                choices.shape)
    token_cap, pass_degrees = choices.token_cap, choices.pass_degrees
    check_mode(mode)
    g = pass_degree(passes, pass_degrees, world_size)
    sequence = StageSplit("sequence", sp_degree, passes, stage)
    if mode == "off" or passes < 2 or world_size < 2 or g < 2 or (mode == "auto" and cost_model is None):
        return sequence
    if token_cap is not None and tokens > token_cap:
        why = (f"guidance passes in parallel not used: {tokens:,} video tokens in one forward would exceed the "
               f"per-rank cap of {token_cap:,}") if mode == "on" else None
        return StageSplit("sequence", sp_degree, passes, stage, why)
    t_pass = t_seq = None
    if cost_model is not None:
        t_pass = predict_passes(tokens, passes, g, nbytes, shape, cost_model)
        t_seq = predict_sequence(tokens, passes, sp_degree, shape, cost_model)
    if mode == "auto" and t_pass >= t_seq:  # type: ignore[operator]
        why = (f"guidance passes in parallel on {g} ranks would be predicted {t_pass / t_seq:.1f}× slower "
               f"({_ms(t_pass)} against {_ms(t_seq)} per step)")
        return StageSplit("sequence", sp_degree, passes, stage, why, t_pass, t_seq)
    if t_pass is None:
        why = "set by guidance_parallel='on'"
    else:
        sp_what = ("sequence parallel" if sp_degree > 1 else
                   "sequence parallel (its best degree here: 1 rank, the passes in turn)")
        if t_seq > t_pass:
            why = f"{sp_what} would be predicted {t_seq / t_pass:.1f}× slower"
        else:
            why = f"{sp_what} would be predicted {t_pass / t_seq:.1f}× faster"
        why += f" ({_ms(t_seq)} against {_ms(t_pass)} per step)"
        if mode == "on":
            why += "; set by guidance_parallel='on'"
    return StageSplit("passes", g, passes, stage, why, t_pass, t_seq)


__all__ = ["MAX_PASSES", "MODES", "PassParallel", "SplitChoices", "StageSplit", "StageWork", "check_mode",
           "choose_split", "pass_bytes", "pass_degree", "predict_passes", "predict_sequence"]
