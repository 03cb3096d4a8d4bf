"""FLOPs of one LTX-2 transformer forward, counted from the model's shapes, and the GPUs' dense peaks (issue 27).

Why here (next to `cost.py`): the count is a property of the model's shapes and token counts, like the cost model's
terms (`cost.ModelShape`); the benchmarks divide measured times by it (`bench/bench_e2e.py`: achieved FLOP/s and
its fraction of the GPU's dense peak), and the cost model may use it to scale its fitted constants to other widths.
No torch import, no GPU: pure arithmetic on integers.

**Convention**: 1 multiply-add = 2 FLOPs; only matrix products are counted (every `nn.Linear`, the attention's
QKᵀ and PV) — the same convention as `torch.utils.flop_counter.FlopCounterMode` (which counts aten mm / addmm /
bmm / baddbmm / _scaled_mm / convolution / the fused SDPA kernels, 2·m·n·k each, and nothing else). Not counted,
here or there: bias adds, RMS / layer norms, RoPE, AdaLN scale / shift / gate multiplies, GELU, softmax, sigmoid
gates, the sinusoidal timestep features, casts — elementwise work of O(tokens × width) per layer, well under 1 % of
the products at the real widths (each is ~1 FLOP per element against the ~2·4096 per element of a Linear).

**Source of the formula**: diffusers 0.42.1 `models/transformers/transformer_ltx2.py` — the structure the engine's
one forward (`model_forward.run_eager`) calls, module by module (`LTX2VideoTransformerBlock.__init__` / `forward`,
`LTX2Attention`, `LTX2AdaLayerNormSingle`, `PixArtAlphaTextProjection`, `FeedForward(mult=4)`), and
docs/design/models.md. With D = video heads × head dim, Da = audio heads × audio head dim, N video tokens, Ta audio
tokens, L text tokens, per block and batch row (FLOPs):
- video self-attention: q, k, v, out 4·2·N·D²; QKᵀ + PV 4·N²·D; LTX-2.3+ gate logits 2·N·D·H;
- audio self-attention: the same with Ta, Da, Ha;
- text cross-attention (video): q, out 2·2·N·D²; k, v 2·2·L·Dc·D (Dc = cross_attention_dim); QKᵀ + PV 4·N·L·D;
  audio: the same with Ta, Da, Dac; (+ the gate logits on 2.3+);
- audio→video (q video, k / v audio, inner width Da): q + out 2·2·N·D·Da, k + v 2·2·Ta·Da², QKᵀ + PV 4·N·Ta·Da;
- video→audio (q audio, k / v video): q + out 2·2·Ta·Da², k + v 2·2·N·D·Da, QKᵀ + PV 4·Ta·N·Da;
- feed-forwards (GELU D→4D, Linear 4D→D): 16·N·D² and 16·Ta·Da².
Outside the blocks: proj_in / proj_out (2·N·Cin·D, 2·N·D·Cout; audio alike), the LTX-2.0 caption projections
(2·L·(C_cap·D + D²) and 2·L·(C_cap·Da + Da²)), and every AdaLN-single embedding: 2·rows·(256·W + W² + n·W²) for a
width W and n modulation parameters (timestep MLP 256→W→W, then W→n·W), where rows = batch × tokens for a per-token
timestep (the reference denoiser's, and ComfyUI's) or the batch for a per-row one. The STG pass skips the
attention of its blocks' self-attention (only v and out run: `LTX2PerturbedAttnProcessor`); the isolated pass
skips both cross-modal attentions.

At the released widths (D = 4096, Da = 2048, 48 blocks) the blocks' linear layers are exactly
48·2·(14·D² + 4·D·Da) = 25.77 GFLOP per video token per forward (the "≈ 25.8 GFLOP" of docs/design/models.md#shapes);
the per-token timestep embedding adds 0.24 (LTX-2.0: 6 parameters) / 0.34 GFLOP (2.3 / 2.5: 9 parameters) per token, the
gate logits of 2.3 / 2.5 0.04 GFLOP; attention adds 4·N·D per token per block (`tests/test_flops.py` checks all of
it against FlopCounterMode running the real diffusers modules).

**Dense peaks** (`dense_peak`): the vendor data-sheet figures without structured sparsity (the data sheets print the
2:4-sparse figure, twice the dense one, with an asterisk), looked up by `torch.cuda.get_device_name()`; a GPU or
dtype not in the table gives None ("unknown"), never a guess.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIMESTEP_CHANNELS = 256  # diffusers `Timesteps(num_channels=256)` of `PixArtAlphaCombinedTimestepSizeEmbeddings`
FF_MULT = 4  # diffusers `FeedForward(dim, mult=4)`


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOPs of an LTX-2 transformer forward depend on (diffusers `LTX2VideoTransformer3DModel` config).

    Attributes (ints are widths / counts; bools the architecture switches of the family):
        blocks: transformer blocks (48 released).
        video_heads, video_head_dim / audio_heads, audio_head_dim: attention layout (D = heads × head dim).
        cross_attention_dim / audio_cross_attention_dim: width of the text context the text cross-attention's k / v
            read (after the LTX-2.0 caption projection).
        in_channels, out_channels, audio_in_channels, audio_out_channels: latent widths (proj_in / proj_out).
        caption_channels: the text features' width entering the LTX-2.0 caption projection.
        caption_projection: LTX-2.0 (`use_prompt_embeddings`): the caption projections run inside the forward.
        video_gated / audio_gated: LTX-2.3+ per-head gate logits (`to_gate_logits`) in each attention.
        video_cross_adaln / audio_cross_adaln: LTX-2.3+ 9 instead of 6 timestep modulation parameters.
        prompt_adaln: LTX-2.3 / 2.5 prompt AdaLN (`prompt_adaln`, 2 parameters, per row).
    """

    blocks: int = 48
    video_heads: int = 32
    video_head_dim: int = 128
    audio_heads: int = 32
    audio_head_dim: int = 64
    cross_attention_dim: int = 4096
    audio_cross_attention_dim: int = 2048
    in_channels: int = 128
    out_channels: int = 128
    audio_in_channels: int = 128
    audio_out_channels: int = 128
    caption_channels: int = 3840
    caption_projection: bool = True
    video_gated: bool = False
    audio_gated: bool = False
    video_cross_adaln: bool = False
    audio_cross_adaln: bool = False
    prompt_adaln: bool = False

    def __post_init__(self):
        for name in ("blocks", "video_heads", "video_head_dim", "audio_heads", "audio_head_dim", "cross_attention_dim",
                     "audio_cross_attention_dim", "in_channels", "out_channels", "audio_in_channels",
                     "audio_out_channels", "caption_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerShape.{name} = {value!r}: must be a positive int")

    @property
    def video_dim(self) -> int:
        return self.video_heads * self.video_head_dim

    @property
    def audio_dim(self) -> int:
        return self.audio_heads * self.audio_head_dim

    @classmethod
    def of(cls, config: Any) -> "TransformerShape":
        """From a diffusers `LTX2VideoTransformer3DModel.config` (or its constructor kwargs, e.g.
        `models.configs.transformer_kwargs(meta)`), diffusers' defaults for missing fields."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        cross_mod, audio_cross_mod = bool(get("cross_attn_mod", False)), bool(get("audio_cross_attn_mod", False))
        in_ch, a_in = int(get("in_channels", 128)), int(get("audio_in_channels", 128))
        return cls(blocks=int(get("num_layers", 48)), video_heads=int(get("num_attention_heads", 32)),
                   video_head_dim=int(get("attention_head_dim", 128)),
                   audio_heads=int(get("audio_num_attention_heads", 32)),
                   audio_head_dim=int(get("audio_attention_head_dim", 64)),
                   cross_attention_dim=int(get("cross_attention_dim", 4096)),
                   audio_cross_attention_dim=int(get("audio_cross_attention_dim", 2048)),
                   in_channels=in_ch, out_channels=int(get("out_channels", None) or in_ch),
                   audio_in_channels=a_in, audio_out_channels=int(get("audio_out_channels", None) or a_in),
                   caption_channels=int(get("caption_channels", 3840)),
                   caption_projection=bool(get("use_prompt_embeddings", True)),
                   video_gated=bool(get("gated_attn", False)), audio_gated=bool(get("audio_gated_attn", False)),
                   video_cross_adaln=cross_mod, audio_cross_adaln=audio_cross_mod,
                   prompt_adaln=(cross_mod or audio_cross_mod) and bool(get("use_prompt_adaln_single", True)))


def family_shape(family, blocks: int = 48) -> TransformerShape:
    """The released transformer's shape of a model family (`models.families`: "2.0" = the 19B, "2.3" / "2.5" = the
    22B — the same 48 blocks and widths, docs/design/models.md#the-releases; the family's `transformer_flags` switch on
    the gates, the 9-parameter AdaLN, the prompt AdaLN and the caption projection moved into the connector)."""
    from ..models.configs import transformer_kwargs
    from ..models.families import get_family

    fam = get_family(family)
    meta = {"num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
            "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
            "caption_channels": 3840, "num_layers": blocks, **fam.transformer_flags}
    return TransformerShape.of(transformer_kwargs(meta))


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one forward by part (see the module docstring); `total` sums them.

    Attributes:
        parts: name -> FLOPs ("video linear", "audio linear", "cross-modal linear", "text linear",
            "video attention", "audio attention", "text attention", "cross-modal attention", "adaln", "io").
    """

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def attention(self) -> int:
        """The QKᵀ and PV products (what FlopCounterMode counts in the SDPA kernels)."""
        return sum(v for k, v in self.parts.items() if k.endswith("attention"))

    @property
    def linear(self) -> int:
        return self.total - self.attention

    def __add__(self, other: "FlopCount") -> "FlopCount":
        keys = list(dict.fromkeys([*self.parts, *other.parts]))
        return FlopCount({k: self.parts.get(k, 0) + other.parts.get(k, 0) for k in keys})

    def scaled(self, factor: int) -> "FlopCount":
        return FlopCount({k: v * factor for k, v in self.parts.items()})


def _adaln(width: int, params: int, rows: int) -> int:
    """`LTX2AdaLayerNormSingle(width, params)` on `rows` timesteps: Linear 256→W, W→W, then W→params·W."""
    return 2 * rows * (TIMESTEP_CHANNELS * width + width * width + params * width * width)


@dataclass(frozen=True)
class ForwardVariant:
    """How a forward runs, for `forward_flops` (the defaults: the reference denoiser's conditional pass).

    timestep_per_token: the video / audio AdaLN timesteps are per token (`[B, N]`: the reference denoiser and
        ComfyUI) — their embeddings then run on every token; False: per row.
    cross_timestep_per_token: the audio↔video cross-attention AdaLN inputs are per token (ComfyUI's native forward)
        rather than per row (the reference with `use_cross_timestep`). The gates are per row.
    cross_modal: False for the isolated (modality-guidance) pass: no a2v / v2a attention.
    video_skip_blocks / audio_skip_blocks: blocks whose self-attention is skipped (the STG pass).
    """

    timestep_per_token: bool = True
    cross_timestep_per_token: bool = False
    cross_modal: bool = True
    video_skip_blocks: int = 0
    audio_skip_blocks: int = 0


def forward_flops(shape: TransformerShape, video_tokens: int, audio_tokens: int, text_tokens: int, batch: int = 1, *,
                  audio_text_tokens: int | None = None, variant: ForwardVariant = ForwardVariant()) -> FlopCount:
    """FLOPs of one transformer forward (module docstring: convention, formula, source).

    Args:
        shape: the transformer (`TransformerShape.of(config)`, `family_shape`).
        video_tokens / audio_tokens: N and Ta per batch row (all tokens the forward holds: guides included).
        text_tokens: L of the video text context (padded length: attention runs over every position).
        batch: rows (guidance passes batched into one forward are rows).
        audio_text_tokens: L of the audio text context (default: `text_tokens`).
        variant: how the forward runs (`ForwardVariant`: per-token timesteps, cross-modal attention, STG blocks).
    Returns a `FlopCount`. Raises ValueError for a negative count or more skipped blocks than blocks.
    """
    timestep_per_token, cross_timestep_per_token = variant.timestep_per_token, variant.cross_timestep_per_token
    cross_modal = variant.cross_modal
    video_skip_blocks, audio_skip_blocks = variant.video_skip_blocks, variant.audio_skip_blocks
    la = text_tokens if audio_text_tokens is None else audio_text_tokens
    for name, value in (("video_tokens", video_tokens), ("audio_tokens", audio_tokens), ("text_tokens", text_tokens),
                        ("audio_text_tokens", la), ("batch", batch), ("video_skip_blocks", video_skip_blocks),
                        ("audio_skip_blocks", audio_skip_blocks)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"forward_flops: {name} = {value!r} must be an int ≥ 0")
    if max(video_skip_blocks, audio_skip_blocks) > shape.blocks:
        raise ValueError(f"forward_flops: {max(video_skip_blocks, audio_skip_blocks)} skipped blocks > "
                         f"{shape.blocks} blocks")
    s, n, ta = shape, video_tokens, audio_tokens
    d, da, h, ha = s.video_dim, s.audio_dim, s.video_heads, s.audio_heads
    blocks = s.blocks
    vgate, agate = (2 * d * h if s.video_gated else 0), (2 * da * ha if s.audio_gated else 0)

    # linear layers inside the blocks (per row)
    v_self_full = n * (8 * d * d + vgate)
    v_self_skip = n * (4 * d * d + vgate)  # STG: v and out only
    a_self_full = ta * (8 * da * da + agate)
    a_self_skip = ta * (4 * da * da + agate)
    video_linear = ((blocks - video_skip_blocks) * v_self_full + video_skip_blocks * v_self_skip
                    + blocks * n * (4 * d * d + vgate + 16 * d * d))  # + text q / out (+ gate) + feed-forward
    audio_linear = ((blocks - audio_skip_blocks) * a_self_full + audio_skip_blocks * a_self_skip
                    + blocks * ta * (4 * da * da + agate + 16 * da * da))
    text_linear = blocks * (4 * text_tokens * s.cross_attention_dim * d + 4 * la * s.audio_cross_attention_dim * da)
    a2v_gate = 2 * d * ha if s.video_gated else 0  # audio_to_video_attn: query width D, audio heads
    cross_linear = blocks * (n * (4 * d * da + a2v_gate) + ta * 4 * da * da  # a2v: q, out (+ gate); k, v
                             + ta * (4 * da * da + agate) + n * 4 * d * da) if cross_modal else 0  # v2a
    # attention products (per row)
    video_attention = (blocks - video_skip_blocks) * 4 * n * n * d
    audio_attention = (blocks - audio_skip_blocks) * 4 * ta * ta * da
    text_attention = blocks * (4 * n * text_tokens * d + 4 * ta * la * da)
    cross_attention = blocks * 8 * n * ta * da if cross_modal else 0
    # outside the blocks
    io = 2 * n * (s.in_channels * d + d * s.out_channels) + 2 * ta * (s.audio_in_channels * da + da * s.audio_out_channels)
    if s.caption_projection:
        text_linear += 2 * text_tokens * (s.caption_channels * d + d * d) + 2 * la * (s.caption_channels * da + da * da)
    rows_v, rows_a = (n, ta) if timestep_per_token else (1, 1)
    rows_cv, rows_ca = (n, ta) if cross_timestep_per_token else (1, 1)
    adaln = (_adaln(d, 9 if s.video_cross_adaln else 6, rows_v) + _adaln(da, 9 if s.audio_cross_adaln else 6, rows_a)
             + _adaln(d, 4, rows_cv) + _adaln(d, 1, 1) + _adaln(da, 4, rows_ca) + _adaln(da, 1, 1))
    if s.prompt_adaln:
        adaln += _adaln(d, 2, 1) + _adaln(da, 2, 1)
    parts = {"video linear": video_linear, "audio linear": audio_linear, "cross-modal linear": cross_linear,
             "text linear": text_linear, "video attention": video_attention, "audio attention": audio_attention,
             "text attention": text_attention, "cross-modal attention": cross_attention, "adaln": adaln, "io": io}
    return FlopCount({k: v * batch for k, v in parts.items()})


def linear_flops_per_video_token(shape: TransformerShape) -> int:
    """The blocks' linear-layer FLOPs per video token per forward: 2·blocks·(14·D² + 4·D·Da) (+ the gate logits on
    2.3+) — the "≈ 25.8 GFLOP" of docs/design/models.md#shapes at the released widths. Excludes attention, AdaLN and
    projections."""
    d, da = shape.video_dim, shape.audio_dim
    gates = 2 * d * (2 * shape.video_heads + shape.audio_heads) if shape.video_gated else 0  # attn1, attn2, a2v
    return shape.blocks * (2 * (14 * d * d + 4 * d * da) + gates)


# ---- dense peaks ----------------------------------------------------------------------------------------------------

# TFLOP/s (TOPS for int8) of the tensor cores without sparsity, per data-sheet product; matmul dtype -> peak.
# Sources (vendor data sheets; their starred figures are 2:4 sparse = 2 × these):
#   H100 SXM / H200 (SXM): NVIDIA H100 Tensor Core GPU data sheet and H200 data sheet — BF16 / FP16 1,979*, FP8 3,958*,
#     INT8 3,958* TOPS, TF32 989* -> dense 989.4 / 1,978.9 / 1,978.9 / 494.7 (the Hopper whitepaper's dense table:
#     989.4 / 1,978.9).
#   H100 PCIe: H100 data sheet, PCIe column — BF16 1,513*, FP8 3,026*, INT8 3,026* -> 756.5 / 1,513 / 1,513.
#   A100 (SXM and PCIe, 40 / 80 GB): NVIDIA A100 data sheet — BF16 312 (624*), INT8 624 (1,248*) TOPS, TF32 156; no FP8.
#   L40S: NVIDIA L40S data sheet — BF16 362.05 (733*), FP8 733 (1,466*), INT8 733 (1,466*).
#   L40: NVIDIA L40 data sheet — BF16 181.05 (362.1*), FP8 362 (724*), INT8 362 (724*).
#   RTX 4090: NVIDIA Ada Lovelace GPU architecture whitepaper, appendix table "GeForce RTX 4090" — peak FP16 / BF16
#     tensor TFLOPS with FP32 accumulate 165.2 (330.4*), FP8 with FP32 accumulate 330.3 (660.6*), INT8 660.6
#     (1,321.2*) TOPS. PyTorch's bf16 / fp8 GEMMs accumulate in FP32, so these (not the FP16-accumulate figures)
#     are the peaks.
# Listed with no figure (names that would otherwise match a row above; not checked against a data sheet this
# session): H100 NVL, H200 NVL, GH200. Not listed at all (-> unknown): RTX 5090, B200, and every other device.
_HOPPER_SXM = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9, "tf32": 494.7}
DENSE_PEAKS_TFLOPS: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    # (substrings the lower-case device name must all contain, product, {dtype: dense TFLOP/s}); first match wins
    (("gh200",), "GH200", {}),
    (("h200", "nvl"), "H200 NVL", {}),
    (("h200",), "H200 SXM", _HOPPER_SXM),
    (("h100", "nvl"), "H100 NVL", {}),
    (("h100", "pcie"), "H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "int8": 1513.0}),
    (("h100", "hbm3"), "H100 SXM", _HOPPER_SXM),  # "NVIDIA H100 80GB HBM3": the SXM5 board
    (("h100", "sxm"), "H100 SXM", _HOPPER_SXM),
    (("a100",), "A100", {"bf16": 312.0, "fp16": 312.0, "int8": 624.0, "tf32": 156.0}),
    (("l40s",), "L40S", {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "int8": 733.0}),
    (("l40",), "L40", {"bf16": 181.05, "fp16": 181.05, "fp8": 362.0, "int8": 362.0}),
    (("rtx 4090",), "GeForce RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6}),
)

_DTYPE_NAMES = {"torch.bfloat16": "bf16", "bfloat16": "bf16", "torch.float16": "fp16", "float16": "fp16",
                "torch.float8_e4m3fn": "fp8", "float8_e4m3fn": "fp8", "torch.int8": "int8", "int8": "int8",
                "torch.float32": "fp32", "float32": "fp32"}


@dataclass(frozen=True)
class Peak:
    """A dense peak: `product` of the table, `dtype` ("bf16", "fp8", "int8", …), `tflops` (None: unknown) and why
    unknown (`reason`)."""

    device_name: str
    dtype: str
    product: str | None
    tflops: float | None
    reason: str = ""

    def fraction(self, flops_per_second: float) -> float | None:
        """Achieved / peak (None when the peak is unknown)."""
        return None if self.tflops is None else flops_per_second / (self.tflops * 1e12)

    def describe(self) -> str:
        if self.tflops is None:
            return f"peak unknown ({self.reason})"
        return f"{self.product} dense {self.dtype} {self.tflops:g} TFLOP/s"


def dense_peak(device_name: str, dtype: Any) -> Peak:
    """The dense tensor-core peak of `device_name` (`torch.cuda.get_device_name()`, e.g. "NVIDIA H200") for the
    matmul dtype `dtype` (a torch dtype or "bf16" / "fp16" / "fp8" / "int8" / "tf32"). A device or dtype not in
    `DENSE_PEAKS_TFLOPS` (a CPU, an unlisted GPU, fp8 on an A100, float32 matmuls) gives `tflops=None` and the
    reason — the fraction is then reported unknown, not guessed."""
    key = _DTYPE_NAMES.get(str(dtype), str(dtype))
    name = device_name.lower()
    for needles, product, peaks in DENSE_PEAKS_TFLOPS:
        if all(x in name for x in needles):
            if not peaks:
                return Peak(device_name, key, product, None, f"no data-sheet figure for {product} in the table")
            if key not in peaks:
                return Peak(device_name, key, product, None, f"{product} has no {key} figure in the table")
            return Peak(device_name, key, product, peaks[key])
    return Peak(device_name, key, None, None, f"{device_name!r} is not in the dense-peak table")


__all__ = ["DENSE_PEAKS_TFLOPS", "FlopCount", "ForwardVariant", "Peak", "TransformerShape", "dense_peak", "family_shape",
           "forward_flops", "linear_flops_per_video_token"]
