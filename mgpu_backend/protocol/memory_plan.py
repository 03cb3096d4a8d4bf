"""A rank's activation memory plan (issue 35): one forward's peak above its weights, from the shapes, and the
per-rank token cap and the longest clip that follow from it.

Standard library only (the controller and the nodes may ask before any process or torch starts). Sizes are bytes,
token counts are video latent tokens (`latent_tokens`: ((frames − 1)/8 + 1) · (H/32) · (W/32), the VAE's 8× temporal
and 32× spatial compression, `engine/latents.py`).

**The model** (`activation_terms`). One no-grad forward keeps one block's intermediates at a time, so a rank's peak
above its weights is what lives across the blocks plus the largest moment inside one block (at the reference block
order, diffusers 0.42.1 `LTX2VideoTransformerBlock.forward`, which the engine calls). Per video token of this rank
and batch row, in bytes, with e the compute dtype's bytes, u the video width (heads × head dim), a the audio width
(the audio stream's and the a2v / v2a attentions' inner width), M the video AdaLN parameters (6; 9 with the
cross-attention AdaLN of LTX-2.3 / 2.5), W = total / per-rank tokens:
- inputs: the latent (in_channels · e), the RoPE coordinates (3 × 2 float32), the per-token timesteps (float32);
- across the blocks: the hidden state (u·e); with per-token timesteps the AdaLN embedding and the embedded timestep
  ((M + 1)·u·e) and, when the cross-modal timesteps are per token too, their scale / shift and gate (5·u·e); the
  RoPE tables, float32 from the transformer and once more in the compute dtype (`engine/attention.py RopeTables`):
  split (u + a)·(4 + e), interleaved twice that;
- inside a block, for the whole block: the block's modulation values (M·u·e with per-token timesteps: diffusers'
  `get_mod_params` materialises all of them at once);
- the moments inside a block (the largest counts):
  - video self-attention: the modulated input, q, k, v and their concatenation (`splits/sequence.py`: one
    all_to_all for the three) — 7·u·e; at W > 1 the projections are dropped once stacked, and the stack, the
    all_to_all's send and receive buffers are held (1 + 9 = 10·u·e; 13 with a batch > 1, whose reordered result is
    a copy; `splits/exchange.py seq_to_heads`) — before issue 35 the projections were kept through the exchange
    (3·u·e more: `held_qkv`, what the fit's measurements ran). The attention itself is SDPA (memory-efficient: no
    T × T scores); with H/W heads over all T tokens its q / k / v hold as many elements as this rank's T/W tokens
    with all H heads, so the term is per local token;
  - feed-forward: the block's locals still held (attn2 and a2v outputs, the v2a input: 3·u·e; the cross-modal
    modulation 5·u·e when per token), its input (u·e), and the 4u-wide hidden of the tokens in one chunk:
    `FF_BYTES_PER_HIDDEN` bytes per hidden element by the block Linears' compute path (bf16 or fp8: the up
    projection's output and its GELU, 2e; int8 W8A8 in torch: 12, below); with chunking (`ff_chunk` tokens at a time,
    `engine/forward.py feed_forward`) the hidden is that of one chunk, and the output buffer (u·e) is there from
    the start;
  - video→audio attention: the same block locals, the video K / V of this rank and their concatenation (4·a·e),
    and at W > 1 the all_gather of every rank's K / V and its concatenation (4·W·a·e per local token: this term
    grows with the total tokens, not the per-rank tokens);
- per forward, not per video token: the text contexts with their modulated copies and the attn2 K / V
  (4 · L · (u + a) · e per row, L text tokens), the audio stream (`audio_tokens` · a · e · (2M + 14) per row), the
  gathered output (`out_channels` · e per total token, twice at W > 1: the all_gather's parts and their
  concatenation).
The sum is multiplied by `FUDGE[linear]`, fitted to measured peaks (below): what the itemisation misses (the
allocator's rounding, temporaries inside kernels, the norm temporaries, the time embedding's own intermediates).
For int8 W8A8 in torch the feed-forward's peak is its up projection's int32 accumulator, its float32 copy and the
scaled float32 product (12 bytes per hidden element, `models/quant.py int8_linear_torch`).

**The fit** (bench/results/activation_plan_fit.md, reproduced by `python bench/bench_long_clips.py --fit`): measured
peak − resident at known token counts, 121 frames, one no-grad forward, per-token video timesteps and per-row
cross-modal timesteps (what those benches fed):
- bench/results/memory_h200.txt: the 19B LTX-2.0 shape (M = 6), bf16 and fp8 (scaled_mm) weights, 640×352,
  1280×704, 1920×1088, W = 1, 2, 4, 8 (24 points; "act" = peak − weights − inputs);
- bench/results/sharded_h200.txt / .json: the 22B LTX-2.3 shape (M = 9), fp8, W = 1 (replica), 2, 4 (sharded),
  640×352 with a batch of 2 and 1280×704 (6 points);
- bench/results/sharded_ltx25_h200.txt / .json: the 22B LTX-2.5 shape, int8-convrot W8A8 in torch, 640×352,
  1280×704, 1920×1088, W = 1, 2, 4 (9 points).
For the sharded ranks the two gathered blocks (the running one and the prefetched next, `weights/sharding.py
gathered`: 2 × the largest unit, 403,005,504 bytes there) are taken off the measured figure: they are the
`gathered` bytes of `MemoryBudget`, not activations. The measurements ran the video self-attention before issue 35
(q, k, v held through the all_to_all: `held_qkv=True` for the fit). Each path's factor is the least-squares ratio
of measured to modelled through the origin; residuals (measured − planned):
- bf16 (memory_h200, 12 points): FUDGE 1.044, residuals −0.18 … +0.12 GiB (within 5 % from 3,520 tokens per rank
  at W ≤ 4; the W = 8 points are over-planned by 16–18 %: the gathered video→audio keys are counted in full);
- fp8 (memory_h200 12 points + sharded_h200 6 points): FUDGE 1.050, residuals −0.19 … +0.18 GiB (memory_h200's fp8
  points under 2,000 tokens per rank run +0.15–0.18 GiB above the plan — up to 45 % of 0.37 GiB —, what the
  `MemoryBudget.reserve` covers; at ≥ 7,040 tokens per rank within ±4 %, except the W = 8 over-plan);
- int8 (sharded_ltx25, 9 points): FUDGE 1.216, residuals −0.03 … +0.03 GiB (≤ 4 %).
The residual table per point: bench/results/activation_plan_fit.md (`python bench/bench_long_clips.py --fit`, which
checks the constants below against a fresh fit).

**The token cap** (`token_cap`): the largest tokens per rank n whose plan at W ranks (n·W tokens in all) fits
`budget − resident − gathered − reserve`; `longest_latent_frames` turns a per-rank cap into the longest clip at a size
and `ranks_needed` the fewest valid degrees that hold a clip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2 ** 30
FF_MULT = 4  # diffusers `FeedForward(dim)`: the hidden is 4 × the width
LINEAR_PATHS = ("bf16", "fp8", "int8")
TIMESTEP_MODES = ("row", "token", "token+cross")

FF_BYTES_PER_HIDDEN = {"bf16": lambda e: 2 * e, "fp8": lambda e: 2 * e, "int8": lambda e: 12}
"""Bytes per element of the feed-forward's 4u-wide hidden at its peak, by the block Linears' compute path (see the
module docstring)."""

FUDGE = {"bf16": 1.044, "fp8": 1.050, "int8": 1.216}
"""The fudge factor per compute path: measured ≈ FUDGE · modelled, least squares through the origin (the module
docstring's fit; bench/results/activation_plan_fit.md). No intercept: the plan serves every shape (a tiny model's
too), and a fitted intercept at the 22B scale (−86 MiB for bf16) would be meaningless there."""

FF_CHUNK_BYTES = 256 * 2 ** 20
"""The automatic feed-forward chunking (`auto_ff_chunk`): a rank whose 4u-wide FF hidden (batch · tokens · 4u · e)
is larger than this runs its feed-forward in equal token chunks of at most this hidden size (256 MiB: 8,192 tokens
at the 22B shape in bf16 — GEMMs of that many rows run at full rate)."""

VAE_TEMPORAL = 8  # engine/latents.py VAE_TEMPORAL_COMPRESSION
VAE_SPATIAL = 32  # engine/latents.py VAE_SPATIAL_COMPRESSION


class MemoryPlanError(ValueError):
    """A value the memory plan cannot take (names the value and the rule)."""


def _int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MemoryPlanError(f"{name}={value!r}: must be an integer ≥ {minimum}")
    return value


@dataclass(frozen=True)
class ActivationShape:
    """What a rank's activations depend on besides its token counts.

    video_dim: the video width u (heads × head dim; 4096 for the 19B / 22B models). audio_dim: the audio width a
    (audio heads × audio head dim; 2048). mod_params: the video AdaLN parameters M (6 for LTX-2.0, 9 with the
    cross-attention AdaLN of LTX-2.3 / 2.5). rope: "split" | "interleaved". in_channels / out_channels: the latent
    channels (128). text_tokens: the text context length L (1024: the connectors' minimum). act_bytes: the compute
    dtype's bytes e (2: bf16). linear: how the block Linears compute — "bf16" (bf16 weights, or fp8 / int8 weights
    dequantized per call), "fp8" (fp8 tensor cores), "int8" (W8A8 in torch). timesteps: "row" (one AdaLN timestep
    per batch row: text-to-video through ComfyUI), "token" (per-token video timesteps, per-row cross-modal ones:
    the reference denoiser), "token+cross" (both per token: ComfyUI with a noise mask) — the largest is the safe
    default. Raises MemoryPlanError for a value out of range.
    """

    video_dim: int = 4096
    audio_dim: int = 2048
    mod_params: int = 9
    rope: str = "split"
    in_channels: int = 128
    out_channels: int = 128
    text_tokens: int = 1024
    act_bytes: int = 2
    linear: str = "bf16"
    timesteps: str = "token+cross"

    def __post_init__(self):
        for name in ("video_dim", "audio_dim", "mod_params", "in_channels", "out_channels", "act_bytes"):
            _int(name, getattr(self, name), 1)
        _int("text_tokens", self.text_tokens)
        if self.rope not in ("split", "interleaved"):
            raise MemoryPlanError(f"rope={self.rope!r}: choose 'split' or 'interleaved'")
        if self.linear not in LINEAR_PATHS:
            raise MemoryPlanError(f"linear={self.linear!r}: choose one of {', '.join(LINEAR_PATHS)}")
        if self.timesteps not in TIMESTEP_MODES:
            raise MemoryPlanError(f"timesteps={self.timesteps!r}: choose one of {', '.join(TIMESTEP_MODES)}")

    @classmethod
    def of(cls, config, **overrides) -> ActivationShape:
        """From a diffusers `LTX2VideoTransformer3DModel.config` (or a dict with its fields); `overrides` set the
        fields the config does not say (linear, act_bytes, timesteps, text_tokens)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        values = dict(
            video_dim=int(get("num_attention_heads", 32)) * int(get("attention_head_dim", 128)),
            audio_dim=int(get("audio_num_attention_heads", 32)) * int(get("audio_attention_head_dim", 64)),
            mod_params=9 if get("cross_attn_mod", False) else 6, rope=str(get("rope_type", "split")),
            in_channels=int(get("in_channels", 128) or 128),
            out_channels=int(get("out_channels", None) or get("in_channels", 128) or 128))
        values.update(overrides)
        return cls(**values)


LTX22B = ActivationShape()
"""The LTX-2.3 / 2.5 22B shape (video 32 × 128, audio 32 × 64, M = 9), bf16 compute, bf16 Linears, every timestep
per token."""


@dataclass(frozen=True)
class ActivationTerms:
    """One forward's planned activation bytes on one rank, itemised (`activation_terms`); `peak` = FUDGE × (inputs +
    across + block + the largest moment + fixed), `moment` names the largest moment ("attention", "feed-forward",
    "video→audio")."""

    inputs: int
    across: int
    block: int
    attention: int
    feed_forward: int
    video_to_audio: int
    fixed: int
    fudge: float

    @property
    def moment(self) -> str:
        moments = {"attention": self.attention, "feed-forward": self.feed_forward,
                   "video→audio": self.video_to_audio}
        return max(moments, key=moments.get)

    @property
    def modelled(self) -> int:
        return (self.inputs + self.across + self.block + max(self.attention, self.feed_forward, self.video_to_audio)
                + self.fixed)

    @property
    def peak(self) -> int:
        """FUDGE · modelled, rounded up."""
        return math.ceil(self.fudge * self.modelled)


def activation_terms(tokens_per_rank: int, total_tokens: int, shape: ActivationShape = LTX22B, batch: int = 1,
                     ff_chunk: int | None = None, audio_tokens: int = 0, held_qkv: bool = False) -> ActivationTerms:
    """The itemised plan of one forward on a rank holding `tokens_per_rank` of `total_tokens` video tokens (the
    padded count: a multiple of the per-rank count; W = total / per-rank), `batch` rows, the feed-forward in chunks
    of `ff_chunk` tokens of the batch's rows flattened (None or ≥ batch · tokens_per_rank: whole), `audio_tokens`
    audio tokens (replicated); `held_qkv`: the video self-attention as before issue 35 (q, k, v kept through the
    all_to_all: the code the fit's measurements ran). Formula: the module docstring. Raises MemoryPlanError for a negative count, `total_tokens` < `tokens_per_rank`, a batch < 1 or
    a chunk < 1."""
    n = _int("tokens_per_rank", tokens_per_rank)
    total = _int("total_tokens", total_tokens)
    b = _int("batch", batch, 1)
    _int("audio_tokens", audio_tokens)
    if total < n:
        raise MemoryPlanError(f"total_tokens={total} < tokens_per_rank={n}: a rank holds a part of the tokens")
    if ff_chunk is not None:
        _int("ff_chunk", ff_chunk, 1)
    s = shape
    e, u, a, m = s.act_bytes, s.video_dim, s.audio_dim, s.mod_params
    world = 1 if n == 0 else max(1, -(-total // n))
    per_token = s.timesteps != "row"
    cross = s.timesteps == "token+cross"
    rope = (u + a) * (4 + e) * (1 if s.rope == "split" else 2)
    inputs = s.in_channels * e + 24 + 4 * (1 + per_token + 2 * cross)
    across = u * e * (1 + (m + 1) * per_token + 5 * cross) + rope
    block = m * u * e * per_token
    attention = u * e * (7 if world == 1 else (10 if b == 1 else 13) + (3 if held_qkv else 0))
    rows = b * n
    chunk = rows if ff_chunk is None or ff_chunk >= rows else ff_chunk
    held = u * e * (3 + 5 * cross)
    hidden = FF_BYTES_PER_HIDDEN[s.linear](e) * FF_MULT * u
    ff_total = rows * (held + u * e) + chunk * hidden + (rows * u * e if chunk < rows else 0)
    v2a = u * e * (2 + 1 + 5 * cross) + 4 * a * e
    v2a_total = b * n * v2a + (b * total * 4 * a * e if world > 1 else 0)
    fixed = b * (4 * s.text_tokens * (u + a) * e + audio_tokens * a * e * (2 * m + 14)
                 + total * s.out_channels * e * (2 if world > 1 else 1))
    return ActivationTerms(inputs=b * n * inputs, across=b * n * across, block=b * n * block,
                           attention=b * n * attention, feed_forward=ff_total, video_to_audio=v2a_total, fixed=fixed,
                           fudge=FUDGE[s.linear])


def activation_bytes(tokens_per_rank: int, total_tokens: int, shape: ActivationShape = LTX22B, batch: int = 1,
                     ff_chunk: int | None = None, audio_tokens: int = 0) -> int:
    """A rank's planned forward peak above its resident weights (bytes): `activation_terms(...).peak`. Gathered
    weights (sharded fleets) are not included: `token_cap` takes them apart."""
    return activation_terms(tokens_per_rank, total_tokens, shape, batch, ff_chunk, audio_tokens).peak


def auto_ff_chunk(tokens_per_rank: int, shape: ActivationShape = LTX22B, batch: int = 1,
                  limit_bytes: int = FF_CHUNK_BYTES) -> int | None:
    """The feed-forward chunk the engine uses by default (`ForwardOptions.ff_chunk_tokens` None): None (whole) while
    the FF hidden of the rank (batch · tokens · 4u · e) is at most `limit_bytes`, else the tokens split into the
    fewest equal chunks whose hidden is at most that: ⌈tokens / k⌉ with k = ⌈hidden / limit⌉. A pure function of
    the shape (a fixed Python int per shape: CUDA graphs and torch.compile see static slices). Chunks count the
    batch's tokens, rows flattened (`engine/forward.py feed_forward`)."""
    rows = _int("batch", batch, 1) * _int("tokens_per_rank", tokens_per_rank)
    hidden = rows * FF_MULT * shape.video_dim * shape.act_bytes
    if hidden <= limit_bytes:
        return None
    pieces = -(-hidden // limit_bytes)
    return -(-rows // pieces)


def resolve_ff_chunk(ff_chunk_tokens: int | None, tokens_per_rank: int, shape: ActivationShape = LTX22B,
                     batch: int = 1) -> int | None:
    """The chunk a forward runs its video feed-forward in: `ff_chunk_tokens` None = `auto_ff_chunk`, 0 = whole,
    k > 0 = chunks of k tokens; None (whole) when the chunk would hold every token anyway."""
    if ff_chunk_tokens is None:
        return auto_ff_chunk(tokens_per_rank, shape, batch)
    chunk = _int("ff_chunk_tokens", ff_chunk_tokens)
    return None if chunk == 0 or chunk >= tokens_per_rank * batch else chunk


# ---- the token cap ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryBudget:
    """One rank's memory for the forward, as the token cap reads it (bytes).

    budget: what the rank may use (the GPU's memory, or a per-process budget). resident: what is allocated before
    the forward (weights, the other resident components). gathered: the sharded blocks gathered at once during a
    forward (2 × the largest unit: the running block and the prefetched next; 0 when replicated). reserve: kept
    apart for what the plan does not model (the CUDA context, NCCL's buffers, the allocator's fragmentation).
    shape: the transformer's `ActivationShape`; batch: the rows of one forward (2: a CFG pair batched);
    ff_chunk_tokens: the forwards' chunk setting (None: `auto_ff_chunk`; 0: never chunked).
    """

    budget: int
    resident: int
    gathered: int = 0
    reserve: int = GiB
    shape: ActivationShape = LTX22B
    batch: int = 1
    ff_chunk_tokens: int | None = None

    def __post_init__(self):
        for name in ("budget", "resident", "gathered", "reserve"):
            _int(name, getattr(self, name))
        _int("batch", self.batch, 1)
        if self.ff_chunk_tokens is not None:
            _int("ff_chunk_tokens", self.ff_chunk_tokens)

    @property
    def available(self) -> int:
        """Bytes left for activations: budget − resident − gathered − reserve (may be ≤ 0)."""
        return self.budget - self.resident - self.gathered - self.reserve

    def peak(self, tokens_per_rank: int, world_size: int) -> int:
        """The planned activation bytes at `tokens_per_rank` on each of `world_size` ranks."""
        chunk = resolve_ff_chunk(self.ff_chunk_tokens, tokens_per_rank, self.shape, self.batch)
        return activation_bytes(tokens_per_rank, tokens_per_rank * world_size, self.shape, self.batch, chunk)

    def token_cap(self, world_size: int) -> int:
        """`token_cap(self, world_size)`."""
        return token_cap(self, world_size)


def token_cap(budget: MemoryBudget, world_size: int, limit: int = 1 << 24) -> int:
    """The largest video tokens per rank (≤ `limit`) whose planned peak at `world_size` ranks fits
    `budget.available` (0 when not even one token fits). The plan grows with the tokens (monotone), so a bisection
    finds it. Raises MemoryPlanError for a world size < 1."""
    world = _int("world_size", world_size, 1)
    avail = budget.available
    if avail <= 0 or budget.peak(1, world) > avail:
        return 0
    lo, hi = 1, limit
    if budget.peak(hi, world) <= avail:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if budget.peak(mid, world) <= avail:
            lo = mid
        else:
            hi = mid
    return lo


# ---- clips and ranks ----------------------------------------------------------------------------------------------

def latent_tokens(frames: int, height: int, width: int) -> int:
    """Video latent tokens of a clip: ((frames − 1)/8 + 1) · (height/32) · (width/32) (`engine/latents.py`'s
    `video_token_count`). Raises MemoryPlanError for frames not 8k+1 or sizes not multiples of 32."""
    if _int("frames", frames, 1) % VAE_TEMPORAL != 1 % VAE_TEMPORAL:
        raise MemoryPlanError(f"frames={frames}: must be 8k+1")
    for name, v in (("height", height), ("width", width)):
        if _int(name, v, VAE_SPATIAL) % VAE_SPATIAL:
            raise MemoryPlanError(f"{name}={v}: must be a positive multiple of {VAE_SPATIAL}")
    return ((frames - 1) // VAE_TEMPORAL + 1) * (height // VAE_SPATIAL) * (width // VAE_SPATIAL)


def longest_latent_frames(cap_per_rank: int, world_size: int, tokens_per_frame: int) -> int:
    """The most latent frames of `tokens_per_frame` tokens each whose ⌈tokens / W⌉ stays within `cap_per_rank`
    (0: not one frame)."""
    _int("tokens_per_frame", tokens_per_frame, 1)
    return _int("cap_per_rank", cap_per_rank) * _int("world_size", world_size, 1) // tokens_per_frame


def frames_of_latent(latent_frames: int) -> int:
    """Pixel frames of `latent_frames` latent frames: 8·(F − 1) + 1 (0 for none)."""
    return 0 if latent_frames < 1 else VAE_TEMPORAL * (latent_frames - 1) + 1


def ranks_needed(tokens: int, cap_at, degrees) -> int | None:
    """The fewest ranks among `degrees` (ascending valid SP degrees) whose per-rank share ⌈tokens / d⌉ is within
    `cap_at(d)` (the per-rank cap at d ranks), or None when none of them holds it."""
    for d in sorted(degrees):
        cap = cap_at(d)
        if cap is None or -(-tokens // d) <= cap:
            return d
    return None


def cap_refusal(tokens: int, world_size: int, cap_at, degrees=None, frame_tokens: int | None = None,
                size: str | None = None) -> str | None:
    """The refusal of a forward of `tokens` video tokens over `world_size` ranks, or None when its per-rank share
    ⌈tokens / W⌉ is within `cap_at(W)` (`cap_at`: degree -> per-rank cap or None for no cap).

    The message names the tokens, the share and the cap; with `frame_tokens` (latent tokens per latent frame of the
    checked stage, (H/32)·(W/32)) the longest 8k+1 clip that fits W ranks at this size (`size`: the job's
    "width×height", for the words); and the ranks that would hold the asked clip: the fewest of `degrees` (the valid
    sequence-parallel degrees, ascending) whose cap holds it (`ranks_needed`), or, without `degrees`, ⌈tokens /
    cap⌉ at W's cap. Example (hand-computed in tests/test_long_clips.py): 99,000 tokens at 1280×704 (880 per frame)
    over 2 ranks with a cap of 40,000: "99000 video tokens over 2 ranks is 49500 tokens per rank, above the cap of
    40000; at 1280×704 the longest clip that fits 2 ranks is 713 frames: use at least 4 GPUs, …" with degrees
    (1, 2, 4, 8) (⌊80,000 / 880⌋ = 90 latent frames = 713 frames; 3 GPUs would do without the degree rule)."""
    world = _int("world_size", world_size, 1)
    cap = cap_at(world)
    per_rank = -(-_int("tokens", tokens) // world)
    if cap is None or per_rank <= cap:
        return None
    ranks = "rank" if world == 1 else "ranks"
    msg = f"{tokens} video tokens over {world} {ranks} is {per_rank} tokens per rank, above the cap of {cap}"
    if frame_tokens:
        where = f"at {size}" if size else f"at {frame_tokens} tokens per latent frame"
        longest = longest_latent_frames(cap, world, frame_tokens)
        frames = frames_of_latent(longest)
        msg += (f"; {where} the longest clip that fits {world} {ranks} is {frames} frame{'s' if frames != 1 else ''}"
                if longest else f"; {where} not even one frame fits {world} {ranks}")
    if degrees:
        need = ranks_needed(tokens, cap_at, degrees)
        if need is None:
            return (f"{msg}: no sequence-parallel degree up to {max(degrees)} holds it (the degree must divide the "
                    f"attention heads) — use fewer frames or a smaller size, or raise the cap")
    else:
        need = -(-tokens // cap) if cap > 0 else None
        if need is None:
            return f"{msg}: use fewer frames or a smaller size, or raise the cap"
    return f"{msg}: use at least {need} GPUs, fewer frames or a smaller size, or raise the cap"


__all__ = ["ActivationShape", "ActivationTerms", "FF_BYTES_PER_HIDDEN", "FF_CHUNK_BYTES", "FUDGE", "LTX22B",
           "MemoryBudget", "MemoryPlanError", "activation_bytes", "activation_terms", "auto_ff_chunk", "cap_refusal",
           "frames_of_latent", "latent_tokens", "longest_latent_frames", "ranks_needed", "resolve_ff_chunk",
           "token_cap"]
