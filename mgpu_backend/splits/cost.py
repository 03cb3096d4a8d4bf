"""A cost model of one transformer forward split W ways, and the SP degree it recommends (issue #9 items 5 and 6).

Predicted time in seconds of one sequence-parallel forward (batch 1: the denoiser runs one forward per guidance pass)
on each rank of a W-way split of T video tokens (padded to Tp = W·⌈T/W⌉):

    t(T, W) = max(host(W), compute(T, W) + comm(T, W))

- compute(T, W) = c0 + c_lin·Tp/W + c_attn·Tp²/W — GPU time of one rank: c0 (s) the replicated work (audio stream,
  text cross-attention keys, the many small kernels whose time does not shrink with tokens), c_lin (s per token) the
  per-token projections / feed-forward / elementwise work on the rank's Tp/W tokens, c_attn (s per token²) the video
  self-attention over all Tp tokens with H/W heads. Fitted by least squares on relative error (`fit_compute`,
  `fit_graphed_compute`) to per-rank times of a W-way split simulated on one GPU (the tables below).
- host(W) = h0 + n_coll(W)·h_coll — CPU time to issue one forward: a forward cannot run faster than its kernels are
  launched (launch-bound at few tokens). h0 (s) is the floor the simulated split reached; h_coll (s per collective)
  is fitted to a real two-GPU run (`fit_host_per_collective`). It bounds the host side only (the max), it is not
  added to the GPU time.
- comm(T, W) = Σ over the collectives of bytes / (link · η) + count · λ, with the bytes per rank computed exactly from
  the shapes in `sequence.py` / `exchange.py` (e = 2 bytes, bf16 activations):
    Ulysses (2 all_to_all per block: q, k, v stacked to head slices, the output back): each sends (W−1)/W of its
      [Tp/W, video_dim] buffer;
    video→audio (1 all_gather per block: the video K and V of `video_to_audio_attn`, stacked, width = the audio
      attention's inner dim): each rank receives (W−1)·Tp/W·audio_dim elements per tensor;
    output (1 all_gather per forward): (W−1)·Tp/W·128 elements;
    TDP (stage 2, 1 all_reduce per forward of the float32 [T, 128] blend buffer): ring, 2(W−1)/W of it.
  link (bytes/s per direction) from the interconnect's data sheet; λ (s per collective) assumed; η (the effective
  share of the link) fitted to real multi-GPU SP forwards (`fit_efficiency`). The collective counts are those of
  `sequence.py` today (3 per block + 1); update `CostModel.sp_collectives` when the exchange changes.

Two models: `H200_NVLINK` (the eager forward) and `H200_GRAPHED` (the CUDA-graphed forward, `engine/cuda_graphs.py`; its
host terms are assumed, not fitted). `default_model()` returns the graphed one while CUDA graphs are on. Both are
H200 figures used for every CUDA device. Other widths and block counts scale the terms: per-block terms ∝ blocks/48,
c_lin ∝ (video_dim/4096)², c_attn ∝ video_dim/4096.

`best_sp_degree` picks the degree with the lowest predicted time (ties go to fewer ranks), and 1 when no split is
predicted faster than one GPU. `choice_reason` is the job report's sentence. `python bench/scaling_model.py` prints
the predicted table (`bench/results/scaling_model_h200.txt`).

Sources: the tables below (ms per forward, from the `bench/results/` files named beside them); how each constant was
fitted, its residuals, and the limits of the fits are recorded in `bench/results/cost_model_fits.md`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

BF16 = 2
FP32 = 4

# ---- the measurements the constants are fitted to (ms per forward, 48 blocks unless said) -------------------------
# bench/results/sp_forward_h200.txt: one H200, per-rank compute of a W-way split simulated on one GPU (no comm)
SP_FORWARD_H200 = {3520: {1: 259.7, 2: 183.3, 4: 184.2, 8: 181.3},
                   14080: {1: 1075.0, 2: 577.0, 4: 323.2, 8: 188.9},
                   32640: {1: 3154.3, 2: 1636.9, 4: 853.8, 8: 448.6}}
SP_FORWARD_OUTLIERS: set[tuple[int, int]] = set()  # none in this run (the previous one had 3,520 tokens W = 4)
SP_FORWARD_FLOOR_POINTS = {(3520, 2), (3520, 4), (3520, 8)}  # launch-bound: fewer tokens per rank did not help
# compiled (mgpu_backend/engine/compile.py) over the eager reference forward, same run: not fitted (the model is the eager's)
SP_FORWARD_COMPILED_RATIO_H200 = {3520: 0.824, 14080: 0.889, 32640: 0.926}
# The runs below were measured with the earlier, slower eager forward (before the bf16 RoPE / fused norms): they
# calibrate η and h_coll and check TDP, each against the model scaled to its own one-GPU time (`CostModel.matched`).
# bench/results/scaling_2xh200.txt: real NCCL over 2 × H200 (SP forward; TDP forward of 1×2 tiles, overlap 5)
SCALING_2XH200 = {14080: {1: 1191.9, 2: 689.7}, 32640: {1: 3472.9, 2: 1925.1}}
TDP_2XH200 = {14080: 658.2, 32640: 1696.4}
# the 2×H200 runs were made when every block ran 6 collectives (q, k, v, out; K, V) — sequence.py now stacks
# q, k, v into one all_to_all and K, V into one all_gather (3 per block): same bytes, half the calls
MEASURED_COLLECTIVES_PER_BLOCK = 6
SMALL_2XH200 = {"tokens": 627, "blocks": 8, "scale": 6, "ms": {1: 238.3, 2: 475.1}}  # 17 frames, 8 blocks ×6
# bench/results/speed_h200.txt (a): one H200, the same simulated split replayed from CUDA graphs (48 blocks, no scaling)
SP_FORWARD_GRAPHED_H200 = {1536: {1: 108.8, 2: 73.6, 4: 54.2, 8: 46.6}, 3520: {1: 249.1, 2: 132.8, 4: 82.5, 8: 59.1},
                           6144: {1: 407.1, 2: 220.3, 4: 126.9, 8: 82.2},
                           14080: {1: 1049.3, 2: 572.0, 4: 309.8, 8: 164.5}}
# bench/results/tdp_decode_h200.txt: one H200, a stage-2 tile forward (8 blocks ×6) by tile tokens
TDP_TILES_H200 = {32640: 3621.2, 17952: 1764.6, 10560: 902.9, 6080: 498.6}


@dataclass(frozen=True)
class ModelShape:
    """What the cost depends on: blocks, the video attention width (heads × head dim), the video→audio attention's
    inner width (audio heads × audio head dim: the width of the gathered K/V), the output channels."""

    blocks: int = 48
    video_dim: int = 4096
    audio_dim: int = 2048
    out_channels: int = 128
    act_bytes: int = BF16

    @classmethod
    def of(cls, config) -> "ModelShape":
        """From a diffusers `LTX2VideoTransformer3DModel.config` (or any object with the same fields)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        return cls(blocks=int(get("num_layers", 48)),
                   video_dim=int(get("num_attention_heads", 32)) * int(get("attention_head_dim", 128)),
                   audio_dim=int(get("audio_num_attention_heads", 32)) * int(get("audio_attention_head_dim", 64)),
                   out_channels=int(get("out_channels", None) or get("in_channels", 128) or 128))


LTX2_19B = ModelShape()


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a forward: how many, the bytes one rank moves over all of them, and their time."""

    count: int
    bytes: float
    seconds: float


@dataclass(frozen=True)
class Prediction:
    """One predicted forward on each rank of a split (seconds)."""

    tokens: int
    degree: int
    compute: float
    comm: dict[str, Collective] = field(default_factory=dict)
    host: float = 0.0

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for c in self.comm.values())

    @property
    def gpu(self) -> float:
        return self.compute + self.comm_seconds

    @property
    def total(self) -> float:
        return max(self.host, self.gpu)

    @property
    def launch_bound(self) -> bool:
        return self.host > self.gpu


@dataclass(frozen=True)
class CostModel:
    """Constants of one GPU + interconnect (module docstring: form, sources, fit). Times in seconds for 48 blocks at
    the LTX-2 widths; `ModelShape` scales them."""

    name: str
    c0: float
    c_lin: float
    c_attn: float
    host_floor: float
    host_per_collective: float
    link_GBps: float
    efficiency: float
    latency: float
    # the exchange: True = q, k, v stacked into one all_to_all and K, V into one all_gather (sequence.py today,
    # 3 collectives per block); False = one collective each (6 per block: the code of the 2×H200 runs)
    stacked: bool = True
    forward: str = "eager"  # which forward the constants are of: "eager" or "CUDA-graphed" (the job report says it)

    @property
    def bandwidth(self) -> float:
        """Effective bytes per second of a collective on one rank."""
        return self.link_GBps * 1e9 * self.efficiency

    def scaled(self, factor: float) -> "CostModel":
        """The forward's own terms (c0, c_lin, c_attn, the host floor) × `factor`; the communication terms (link, η,
        λ, host per collective) unchanged: the same exchange around a slower or faster forward."""
        return replace(self, c0=self.c0 * factor, c_lin=self.c_lin * factor, c_attn=self.c_attn * factor,
                       host_floor=self.host_floor * factor)

    def matched(self, tokens: int, one_gpu_ms: float, shape: ModelShape = LTX2_19B,
                stacked: bool = False) -> "CostModel":
        """`scaled` so that one forward of `tokens` on one GPU takes `one_gpu_ms`: the model of a run measured with
        another forward (the real 2×H200 runs: the earlier eager forward), compared on its own footing; `stacked`:
        that run's exchange (False for the 2×H200 runs, which exchanged q, k, v, K, V one by one)."""
        return replace(self.scaled(one_gpu_ms / 1e3 / self.sp(tokens, 1, shape).total), stacked=stacked)

    def compute(self, tokens: int, degree: int, shape: ModelShape = LTX2_19B) -> float:
        """GPU compute of one rank (no communication)."""
        padded = degree * -(-tokens // degree)
        blocks = shape.blocks / 48
        lin = self.c_lin * (shape.video_dim / 4096) ** 2
        attn = self.c_attn * shape.video_dim / 4096
        return blocks * (self.c0 + lin * padded / degree + attn * padded * padded / degree)

    def host(self, degree: int, collectives: int, shape: ModelShape = LTX2_19B) -> float:
        return self.host_floor * shape.blocks / 48 + (collectives * self.host_per_collective if degree > 1 else 0.0)

    def _collective(self, count: int, nbytes: float) -> Collective:
        return Collective(count, nbytes, nbytes / self.bandwidth + count * self.latency)

    def sp_collectives(self, tokens: int, degree: int, shape: ModelShape = LTX2_19B) -> dict[str, Collective]:
        """Bytes one rank sends (all_to_all) or receives (all_gather) per SP forward, by kind."""
        if degree == 1:
            return {}
        w, local, e = degree, -(-tokens // degree), shape.act_bytes
        return {
            # stacked: q, k, v in one all_to_all, the output in another; K and V in one all_gather (same bytes)
            "ulysses": self._collective((2 if self.stacked else 4) * shape.blocks,
                                        4 * shape.blocks * local * shape.video_dim * e * (w - 1) / w),
            "v2a": self._collective((1 if self.stacked else 2) * shape.blocks,
                                    2 * shape.blocks * (w - 1) * local * shape.audio_dim * e),
            "gather": self._collective(1, (w - 1) * local * shape.out_channels * e),
        }

    def sp(self, tokens: int, degree: int, shape: ModelShape = LTX2_19B) -> Prediction:
        """One sequence-parallel forward of `tokens` video tokens over `degree` ranks."""
        comm = self.sp_collectives(tokens, degree, shape)
        return Prediction(tokens, degree, self.compute(tokens, degree, shape), comm,
                          self.host(degree, sum(c.count for c in comm.values()), shape))

    def tdp(self, tiles_per_rank: list[list[int]], tokens: int, shape: ModelShape = LTX2_19B) -> Prediction:
        """One tiled (TDP) forward: each rank runs its tiles (token counts) whole, then one all_reduce of the float32
        [tokens, out_channels] blend buffer. The slowest rank sets the time."""
        w = len(tiles_per_rank)
        per_tile = lambda t: max(self.host(1, 0, shape), self.compute(t, 1, shape))  # noqa: E731
        compute = max(sum(per_tile(t) for t in tiles) for tiles in tiles_per_rank)
        comm = {} if w == 1 else {"all_reduce": self._collective(1, 2 * (w - 1) / w * tokens * shape.out_channels
                                                                 * FP32)}
        return Prediction(tokens, w, compute, comm, 0.0)


# Fitted constants (rounded; `fit_compute`, `fit_host_per_collective` and `fit_efficiency` recompute them from the
# measurements above, and tests/test_cost.py checks they agree).
H200_NVLINK = CostModel(name="H200, NVLink 4 (450 GB/s per direction)", c0=61.2e-3, c_lin=53.5e-6, c_attn=1.312e-9,
                        host_floor=182.9e-3, host_per_collective=0.805e-3, link_GBps=450.0, efficiency=0.30,
                        latency=25e-6)
DEFAULT = H200_NVLINK
H200_GRAPHED = CostModel(name="H200, NVLink 4 (450 GB/s per direction), CUDA-graphed forward", c0=35.0e-3,
                         c_lin=48.8e-6, c_attn=1.868e-9, host_floor=5e-3, host_per_collective=0.1e-3,
                         link_GBps=450.0, efficiency=0.30, latency=25e-6, forward="CUDA-graphed")


def default_model() -> CostModel:
    """The model of the forward CUDA fleets run: `H200_GRAPHED` while CUDA graphs are on, else the eager one."""
    from ..engine import cuda_graphs

    return H200_GRAPHED if cuda_graphs.mode() != "off" else H200_NVLINK


# ---- the policy ------------------------------------------------------------------------------------------------------

def predict_sp(tokens: int, degree: int, shape: ModelShape = LTX2_19B, model: CostModel = DEFAULT) -> float:
    """Predicted seconds of one SP forward of `tokens` video tokens over `degree` ranks."""
    return model.sp(tokens, degree, shape).total


def best_sp_degree(tokens: int, candidates, shape: ModelShape = LTX2_19B, model: CostModel = DEFAULT) -> int:
    """The candidate degree with the lowest predicted forward time; ties go to fewer ranks, and 1 (one GPU) is always
    a candidate — so the choice is never predicted slower than one GPU."""
    degrees = sorted(set(candidates) | {1})
    times = {d: predict_sp(tokens, d, shape, model) for d in degrees}
    best = 1
    for d in degrees:
        if times[d] < times[best]:
            best = d
    return best


def choice_reason(tokens: int, chosen: int, candidates, shape: ModelShape = LTX2_19B,
                  model: CostModel = DEFAULT) -> str:
    """The job report's sentence: the tokens, the predicted time of the chosen degree, and why not more ranks."""
    degrees = sorted(set(candidates) | {1})
    t = {d: predict_sp(tokens, d, shape, model) for d in degrees}
    ms = lambda d: f"{t[d] * 1e3:,.0f} ms"  # noqa: E731
    text = f"{tokens:,} video tokens; the cost model predicts {ms(chosen)} per forward on {chosen} rank" \
           f"{'s' if chosen > 1 else ''}"
    if model.forward != "eager":
        text += f" ({model.forward})"
    if chosen > 1:
        text += f" ({t[1] / t[chosen]:.2f}× one GPU)"
    larger = [d for d in degrees if d > chosen]
    if larger:
        nxt = larger[0]
        pred = model.sp(tokens, nxt, shape)
        why = ("launch-bound: too few tokens per rank to hide the collectives" if pred.launch_bound
               else "the exchange costs more than the compute it saves")
        text += (f"; {nxt} ranks would run at {t[chosen] / t[nxt]:.2f}× that speed ({ms(nxt)}, {why})")
    return text


def crossover_tokens(degree: int, lower: int, shape: ModelShape = LTX2_19B, model: CostModel = DEFAULT,
                     hi: int = 1 << 22) -> int | None:
    """The smallest token count at which `degree` ranks are predicted faster than `lower` (bisection; None when not
    below `hi`). The policy's threshold between the two."""
    faster = lambda t: predict_sp(t, degree, shape, model) < predict_sp(t, lower, shape, model)  # noqa: E731
    if not faster(hi):
        return None
    lo = 1
    if faster(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if faster(mid) else (mid, hi)
    return hi


def tdp_tile_tokens(grid: tuple[int, int, int], degree: int, overlap: int = 5) -> list[list[int]]:
    """Token counts of each rank's tiles for the default stage-2 tiling of `degree` ranks (tile i -> rank i mod W)."""
    from .tiling import default_tiling, make_tiles

    tiles, _ = make_tiles(tuple(grid), default_tiling(degree, tuple(grid), overlap))
    per_rank: list[list[int]] = [[] for _ in range(degree)]
    for tile in tiles:
        per_rank[tile.index % degree].append(math.prod(tile.shape))
    return per_rank


def predict_tdp(grid: tuple[int, int, int], degree: int, overlap: int = 5, shape: ModelShape = LTX2_19B,
                model: CostModel = DEFAULT) -> Prediction:
    """One stage-2 forward tiled over `degree` ranks (the default tiling), or untiled on one rank."""
    tokens = math.prod(grid)
    if degree == 1:
        return model.tdp([[tokens]], tokens, shape)
    return model.tdp(tdp_tile_tokens(grid, degree, overlap), tokens, shape)


# ---- the fits (documentation that runs: the constants above come from these) ----------------------------------------

def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small dense systems)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_compute(data: dict = SP_FORWARD_H200) -> dict[str, float]:
    """(host_floor, c0, c_lin, c_attn) in seconds from the simulated-split measurements (module docstring)."""
    floor = sum(data[t][w] for t, w in SP_FORWARD_FLOOR_POINTS) / len(SP_FORWARD_FLOOR_POINTS) / 1e3
    rows, ys = [], []
    for t, by_w in data.items():
        for w, ms in by_w.items():
            if (t, w) in SP_FORWARD_OUTLIERS or ms / 1e3 <= 1.15 * floor:
                continue
            rows.append([1.0, t / w, t * t / w])
            ys.append(ms / 1e3)
    # least squares on relative error: scale each row by 1/y
    a = [[r[i] / y for i in range(3)] for r, y in zip(rows, ys)]
    ata = [[sum(r[i] * r[j] for r in a) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] for r in a) for i in range(3)]
    c0, c_lin, c_attn = _solve(ata, atb)
    return {"host_floor": floor, "c0": c0, "c_lin": c_lin, "c_attn": c_attn}


def fit_graphed_compute(data: dict = SP_FORWARD_GRAPHED_H200) -> dict[str, float]:
    """(c0, c_lin, c_attn) in seconds of the CUDA-graphed forward: least squares on relative error over every point
    (none is host-bound once replayed)."""
    rows = [([1.0, t / w, t * t / w], ms / 1e3) for t, by_w in data.items() for w, ms in by_w.items()]
    a = [[r[i] / y for i in range(3)] for r, y in rows]
    ata = [[sum(r[i] * r[j] for r in a) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] for r in a) for i in range(3)]
    c0, c_lin, c_attn = _solve(ata, atb)
    return {"c0": c0, "c_lin": c_lin, "c_attn": c_attn}


def fit_host_per_collective(small: dict = SMALL_2XH200) -> float:
    """Host seconds per collective: the extra time of the launch-bound 2-GPU run over one GPU, per collective."""
    extra = (small["ms"][2] - small["ms"][1]) / 1e3 / small["scale"]
    return extra / (MEASURED_COLLECTIVES_PER_BLOCK * small["blocks"] + 1)


def fit_efficiency(model: CostModel = DEFAULT, data: dict = SCALING_2XH200) -> float:
    """η from the real 2×H200 SP forwards: the time over the predicted compute (scaled by the run's W = 1 time against
    the model) is the exchange; least squares of bytes / (link·η) + count·λ on it."""
    num = den = 0.0
    for tokens, ms in data.items():
        run = model.matched(tokens, ms[1])
        comm = run.sp_collectives(tokens, 2)  # the exchange those runs had (not stacked)
        exchange = ms[2] / 1e3 - run.compute(tokens, 2) - sum(c.count for c in comm.values()) * model.latency
        nbytes = sum(c.bytes for c in comm.values())
        num += nbytes * exchange
        den += nbytes * nbytes
    return den / num / (model.link_GBps * 1e9)
