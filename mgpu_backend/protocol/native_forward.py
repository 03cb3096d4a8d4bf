"""The native-MODEL forward contract: one call of ComfyUI's LTX-AV transformer `forward`, as plain tensors.

`nodes/` (the weightless proxy transformer inside a native ComfyUI MODEL, issue 19) translates every argument that
ComfyUI 0.33's `comfy.ldm.lightricks.av_model.LTXAVModel.forward` receives into a `ForwardRequest`; the fleet job
"forward" reproduces that forward on the pack's resident transformer (sequence parallel, or batch rows split over
ranks) and answers a `ForwardReply` (or a `ForwardMiss` when a cached piece is missing on the fleet). The caption
projection + connectors (`LTXAVModel.preprocess_text_embeds`, called by `model_base.LTXAV.extra_conds` once per
conditioning per sampling) are transformer weights, so they run on the fleet too: job "preprocess_text",
`PreprocessTextRequest` -> `PreprocessTextReply`.

Conventions (ComfyUI's, so that nodes copy values through without arithmetic):
- Latents are in model space, as `forward` receives them (`x` already scaled by the model sampling): video
  `[B, 128, F, H, W]` (latent frames, height, width; guide frames appended after the video frames along F by
  `LTXVAddGuide`, exactly as ComfyUI passes them), audio `[B, 8, T, 16]` (channels, latent time steps, frequency
  bins). Floating dtype (float32 / bfloat16 / float16); the reply has the video tensor's dtype.
- Timesteps are sigmas, **unscaled** (0..1; the model multiplies by 1000): per row `[B]`, or per token (noise masks:
  image-to-video, guides) `[B, F·H·W, 1]` for video and `[B, T, 1]` for audio, as `model_base.LTXAV.process_timestep`
  builds them (token order = ComfyUI's patchifier order: frame-major, then height, then width).
- Batch rows are what ComfyUI batched into one call: e.g. `cond_or_uncond = (1, 0)` means row 0 is the negative
  (uncond) and row 1 the positive (cond). Rows are independent; the fleet may run them as one forward or split them
  over ranks (guidance-pass split), the result is the same to float tolerance.
- The text context is ComfyUI's `c_crossattn` **after** `preprocess_text_embeds` (the connectors):
  `[B, L, C]` with C = 4096 + 2048 = 6144 (LTX-2.3 / 2.5: video then audio part) or 2 × 3840 (LTX-2.0: the caption
  projection runs inside the forward). It is ~90 % of a forward's bytes and constant within a sampling, so the fleet
  caches it per row under `context_keys` (see `ForwardRequest.context`).

Errors: every class validates itself in `__post_init__` and raises `ForwardContractError` (a `ValidationError`,
refused before any work) naming the field, its value or shape and the rule.

What ComfyUI's forward receives and where it goes here (ComfyUI 0.33 names -> fields):
  x[0], x[1] -> video, audio;  timestep (v, a) -> video_timestep, audio_timestep;  context -> context /
  context_keys;  attention_mask -> attention_mask;  frame_rate -> frame_rate;  keyframe_idxs -> keyframe_idxs;
  denoise_mask -> denoise_mask (only its −1 cells matter to the forward; the mask values are already folded into the
  per-token timesteps by process_timestep);  guide_attention_entries -> guide_attention_entries;
  ref_audio["tokens"] -> ref_audio_tokens;  generated_keyframes -> generated_keyframes;
  transformer_options["stg_self_attn_blocks" | "a2v_cross_attn" | "v2a_cross_attn" | "run_vx" | "run_ax"] ->
  options;  transformer_options["cond_or_uncond"] -> cond_or_uncond;  the sampling patcher's LoRA patches -> lora.
  Not carried (consumed by ComfyUI before the forward, or local to ComfyUI): audio_denoise_mask (folded into
  audio_timestep), latent_shapes (x arrives split), sigmas / sample_sigmas / uuids / wrappers / callbacks.
  Refused by nodes/ (need in-process callables or real weights): patches_replace, patches, attention overrides,
  object patches, non-LoRA weight patches.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .validation import ValidationError

VIDEO_CHANNELS = 128
AUDIO_CHANNELS = 8
AUDIO_BINS = 16
AUDIO_TOKEN_WIDTH = AUDIO_CHANNELS * AUDIO_BINS  # one patchified audio token: 8 channels × 16 bins = 128

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ForwardContractError(ValidationError):
    """A request or reply that breaks the forward contract (names the field, the value and the rule)."""


def _check_tensor(name: str, x, ndim: int | None = None, floating: bool = True) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ForwardContractError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ForwardContractError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if floating and x.dtype not in _FLOATS:
        raise ForwardContractError(f"{name}: expected a floating dtype, got {x.dtype}")
    if x.device.type == "meta":
        raise ForwardContractError(f"{name}: a meta tensor carries no values")
    return x


def _check_key(name: str, key) -> None:
    if not isinstance(key, str) or not key:
        raise ForwardContractError(f"{name}: expected a non-empty string key, got {key!r}")


@dataclass(frozen=True)
class ForwardOptions:
    """The per-call `transformer_options` ComfyUI 0.33's LTX-AV forward honours (all defaults = a plain pass).

    stg_self_attn_blocks: block indices whose video AND audio self-attention become a value passthrough
        (`out = V`, Spatio-Temporal Guidance; `LTXVSpatioTemporalGuidance` sets `stg_self_attn_blocks`; ComfyUI 0.33
        perturbs both streams of a listed block). Sorted, unique, ≥ 0; the fleet refuses indices ≥ its block count.
    a2v_cross_attn / v2a_cross_attn: False severs audio→video / video→audio cross-attention in every block
        (`LTXVModalityGuidance` sets both False).
    run_vx / run_ax: False skips the video / audio stream's block updates (the stream's hidden state passes through
        the blocks unchanged; a2v needs run_vx, v2a needs run_ax, as in ComfyUI).
    ff_chunk_tokens: the pack's own switch, not ComfyUI's: the video feed-forward over chunks of this many tokens
        (of a rank's part, batch rows flattened; `engine/forward.py feed_forward`: the same kernels on row slices,
        equal to the whole to float tolerance), lowering the forward's peak memory. None = automatic (`protocol/memory_plan.py
        auto_ff_chunk`: chunked only when the rank's 4×-wide FF hidden exceeds 256 MiB), 0 = never chunked, k > 0 =
        chunks of k tokens. Does not change what a pass computes (`is_plain` ignores it).
    """

    stg_self_attn_blocks: tuple[int, ...] = ()
    a2v_cross_attn: bool = True
    v2a_cross_attn: bool = True
    run_vx: bool = True
    run_ax: bool = True
    ff_chunk_tokens: int | None = None

    def __post_init__(self):
        blocks = self.stg_self_attn_blocks
        if isinstance(blocks, (set, frozenset, list)):
            blocks = tuple(blocks)
        if not isinstance(blocks, tuple) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
            raise ForwardContractError(f"options.stg_self_attn_blocks={self.stg_self_attn_blocks!r}: expected block "
                                       f"indices (ints)")
        if any(b < 0 for b in blocks):
            raise ForwardContractError(f"options.stg_self_attn_blocks={blocks!r}: block indices must be ≥ 0")
        object.__setattr__(self, "stg_self_attn_blocks", tuple(sorted(set(blocks))))
        for name in ("a2v_cross_attn", "v2a_cross_attn", "run_vx", "run_ax"):
            if not isinstance(getattr(self, name), bool):
                raise ForwardContractError(f"options.{name}={getattr(self, name)!r}: expected a bool")
        chunk = self.ff_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
            raise ForwardContractError(f"options.ff_chunk_tokens={chunk!r}: expected None (automatic), 0 (never "
                                       f"chunked) or a positive token count")

    @property
    def is_plain(self) -> bool:
        """No switch that changes what the forward computes (the feed-forward chunking does not)."""
        return dataclasses.replace(self, ff_chunk_tokens=None) == ForwardOptions()


@dataclass(frozen=True)
class GuideAttentionEntry:
    """One `LTXVAddGuide` guide's attention entry (ComfyUI `guide_attention_entries` item), in append order.

    pre_filter_count: the guide's token count before −1 cells are dropped (its latent F·H·W on the full grid);
        the entries' counts sum to keyframe_idxs' token count N.
    strength: the guide's attention weight; ≠ 1 (or a pixel mask) makes ComfyUI add a log-space bias between noisy
        and guide tokens in video self-attention (`_build_guide_self_attention_mask`). ≥ 0.
    pixel_mask: optional `[B, 1, F_pix, H_pix, W_pix]` float in 0..1 (pixel space), downsampled by ComfyUI's area /
        causal-temporal rule to the guide's latent grid and multiplied by strength. ComfyUI uses row 0 only.
    latent_shape: (F, H, W) of the guide latent before dilation; needed with a pixel mask.
    """

    pre_filter_count: int
    strength: float
    pixel_mask: torch.Tensor | None = None
    latent_shape: tuple[int, int, int] | None = None

    def __post_init__(self):
        if not isinstance(self.pre_filter_count, int) or self.pre_filter_count < 0:
            raise ForwardContractError(f"guide entry pre_filter_count={self.pre_filter_count!r}: expected an int ≥ 0")
        try:
            strength = float(self.strength)
        except (TypeError, ValueError):
            raise ForwardContractError(f"guide entry strength={self.strength!r}: expected a number") from None
        if not math.isfinite(strength) or strength < 0:
            raise ForwardContractError(f"guide entry strength={strength}: must be finite and ≥ 0")
        object.__setattr__(self, "strength", strength)
        if self.latent_shape is not None:
            shape = tuple(self.latent_shape)
            if len(shape) != 3 or not all(isinstance(s, int) and s > 0 for s in shape):
                raise ForwardContractError(f"guide entry latent_shape={self.latent_shape!r}: expected (F, H, W) > 0")
            object.__setattr__(self, "latent_shape", shape)
        if self.pixel_mask is not None:
            _check_tensor("guide entry pixel_mask", self.pixel_mask, ndim=5)
            if self.pixel_mask.shape[1] != 1:
                raise ForwardContractError(f"guide entry pixel_mask of shape {tuple(self.pixel_mask.shape)}: "
                                           f"expected [B, 1, F, H, W]")
            if self.latent_shape is None:
                raise ForwardContractError("guide entry with a pixel_mask needs latent_shape (F, H, W) (ComfyUI "
                                           "downsamples the mask to it)")

    @property
    def needs_bias(self) -> bool:
        """True when ComfyUI would build the dense attention bias for this entry."""
        return self.strength != 1.0 or self.pixel_mask is not None


@dataclass(frozen=True)
class GeneratedKeyframes:
    """ComfyUI's `generated_keyframes` conditioning (LTX-2.5 keyframe marker, `keyframes_abs_pos_mask`): latent
    frames [first_latent_frame, first_latent_frame + num_keyframes) of the video that encode single pixel frames, at
    tokens_per_frame tokens per latent frame. Only models with `keyframes_abs_pos_embedding` read it."""

    tokens_per_frame: int
    first_latent_frame: int
    num_keyframes: int

    def __post_init__(self):
        for name in ("tokens_per_frame", "first_latent_frame", "num_keyframes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ForwardContractError(f"generated_keyframes.{name}={v!r}: expected an int ≥ 0")


@dataclass(frozen=True)
class LoraPatch:
    """One plain LoRA on one Linear of the transformer (ComfyUI's `("lora", (up, down, alpha, None, None))` patch).

    module: the Linear's path in the original LTX / ComfyUI naming, without prefix, e.g.
        "transformer_blocks.0.attn1.to_q" (ComfyUI's patch key is f"diffusion_model.{module}.weight").
    down: `[rank, in_features]` (lora_A), up: `[out_features, rank]` (lora_B), float.
    alpha: None = rank (scale 1), else the delta is scaled by alpha / rank.
    strength: ComfyUI's strength_patch; the fused weight is W + strength · (alpha / rank) · up @ down (computed in
        float32, rounded once to W's dtype, several patches on one layer summed in the order given).
    """

    module: str
    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None = None
    strength: float = 1.0

    def __post_init__(self):
        _check_key("lora patch module", self.module)
        _check_tensor(f"lora patch {self.module} down", self.down, ndim=2)
        _check_tensor(f"lora patch {self.module} up", self.up, ndim=2)
        if self.up.shape[1] != self.down.shape[0]:
            raise ForwardContractError(f"lora patch {self.module}: up {tuple(self.up.shape)} and down "
                                       f"{tuple(self.down.shape)} disagree on the rank")
        if not math.isfinite(float(self.strength)):
            raise ForwardContractError(f"lora patch {self.module}: strength={self.strength!r} must be finite")
        if self.alpha is not None and not math.isfinite(float(self.alpha)):
            raise ForwardContractError(f"lora patch {self.module}: alpha={self.alpha!r} must be finite")


@dataclass(frozen=True)
class LoraSet:
    """The LoRA state a forward must run with, identified by `key` (e.g. ComfyUI's `patches_uuid` plus strengths).

    Patches of the transformer's Linears apply to forwards; patches of the text connectors
    (`video_embeddings_connector.*`, `audio_embeddings_connector.*`) to `preprocess_text` (send the set with that
    request too); a patch of another weight is named as "not in this model" in the reply's `lora_reports`.

    patches: the full set (shipped the first time a key is used, or again after a `ForwardMiss` naming it); None =
    "the fleet already holds this key" (the fleet answers `ForwardMiss(lora_key=key)` when it does not). A request
    with `lora=None` runs on the clean weights (the fleet restores them exactly if a LoRA was fused).
    """

    key: str
    patches: tuple[LoraPatch, ...] | None = None

    def __post_init__(self):
        _check_key("lora.key", self.key)
        if self.patches is not None:
            patches = tuple(self.patches)
            if not patches or not all(isinstance(p, LoraPatch) for p in patches):
                raise ForwardContractError(f"lora {self.key!r}: patches must be a non-empty sequence of LoraPatch "
                                           f"(None when the fleet holds the key)")
            object.__setattr__(self, "patches", patches)


@dataclass(frozen=True)
class ForwardRequest:
    """One call of ComfyUI 0.33's `LTXAVModel.forward`, as plain tensors (module docstring: conventions, mapping).

    video: `[B, 128, F, H, W]` float, model space, guide frames appended along F (N_v = F·H·W tokens in all).
    audio: `[B, 8, T, 16]` float (T ≥ 1), or None for a video-only call (ComfyUI then returns video only).
    video_timestep: sigma (unscaled) `[B]`, or per token `[B, N_v, 1]` (or `[B, N_v]`) (a noise mask: i2v, guides;
        cells that the denoise mask marks −1 carry any value, they are dropped).
    audio_timestep: sigma `[B]` or per token `[B, T, 1]` (or `[B, T]`); None = the video timestep (ComfyUI's
        non-tuple case; only valid with a `[B]` video timestep).
    context: `[B, L, C]` float, the processed text context (after the connectors), or None when every row's key in
        `context_keys` is cached on the fleet. With both context and keys the fleet (re)stores each row under its
        key; with neither it is refused.
    context_keys: one key per row naming that row's `[1, L, C]` context (stable within a sampling; e.g. the
        conditioning's uuid plus a content digest); () = no caching (then context is required).
    attention_mask: optional text mask `[B, L]` — integer / bool (1 = attend, 0 = masked; ComfyUI turns it into
        an additive −finfo.max bias) or float (an additive bias, used as is).
    frame_rate: frames per second of the video (RoPE time positions are latent frame times in seconds).
    keyframe_idxs: optional `[B, 3, N, 2]` pixel coordinates [start, end) of the N guide tokens appended at the end
        of the token sequence (`LTXVAddGuide`); integer or float. N must be a whole number of latent frames
        (N % (H·W) == 0) and N ≤ N_v.
    denoise_mask: optional `[B, 1 | 128, F, H | 1, W | 1]` float, ComfyUI's video denoise mask (H, W of 1 broadcast);
        the forward reads only where it is < 0 in row 0 (IC-LoRA sparse-grid padding cells, whose tokens are dropped;
        only with keyframe_idxs, as in ComfyUI). Nodes may send None when it has no negative cell.
    guide_attention_entries: one `GuideAttentionEntry` per appended guide, in order (needs keyframe_idxs; their
        pre_filter_counts sum to N).
    ref_audio_tokens: optional `[1 | B, T_ref, 128]` float, `LTXVReferenceAudio`'s patchified reference-audio tokens
        (8 channels × 16 bins per token), prepended to the audio tokens at timestep 0 with negative time positions and
        cut from the output. Needs audio.
    generated_keyframes: optional `GeneratedKeyframes` (LTX-2.5 keyframe marker).
    options: the per-call `ForwardOptions` (STG blocks, a2v/v2a off, run_vx / run_ax).
    cond_or_uncond: ComfyUI's per-row tags (0 = cond / positive, 1 = uncond / negative), for reports and the
        batch-split policy; () when unknown. Length B when given.
    lora: the `LoraSet` to run with, None = clean weights.
    """

    video: torch.Tensor
    audio: torch.Tensor | None
    video_timestep: torch.Tensor
    audio_timestep: torch.Tensor | None
    context: torch.Tensor | None
    frame_rate: float
    context_keys: tuple[str, ...] = ()
    attention_mask: torch.Tensor | None = None
    keyframe_idxs: torch.Tensor | None = None
    denoise_mask: torch.Tensor | None = None
    guide_attention_entries: tuple[GuideAttentionEntry, ...] = ()
    ref_audio_tokens: torch.Tensor | None = None
    generated_keyframes: GeneratedKeyframes | None = None
    options: ForwardOptions = field(default_factory=ForwardOptions)
    cond_or_uncond: tuple[int, ...] = ()
    lora: LoraSet | None = None

    def __post_init__(self):
        v = _check_tensor("video", self.video, ndim=5)
        b, c, f, h, w = v.shape
        if c != VIDEO_CHANNELS or b < 1 or f < 1 or h < 1 or w < 1:
            raise ForwardContractError(f"video of shape {tuple(v.shape)}: expected [B ≥ 1, 128, F, H, W]")
        n_v = f * h * w
        if self.audio is not None:
            a = _check_tensor("audio", self.audio, ndim=4)
            if a.shape[0] != b or a.shape[1] != AUDIO_CHANNELS or a.shape[3] != AUDIO_BINS or a.shape[2] < 1:
                raise ForwardContractError(f"audio of shape {tuple(a.shape)}: expected [{b}, 8, T ≥ 1, 16] "
                                           f"(batch of the video)")
        self._check_timestep("video_timestep", self.video_timestep, b, n_v)
        if self.audio_timestep is not None:
            if self.audio is None:
                raise ForwardContractError("audio_timestep given without an audio latent")
            self._check_timestep("audio_timestep", self.audio_timestep, b, self.audio.shape[2])
        elif self.audio is not None and self.video_timestep.ndim != 1:
            raise ForwardContractError("audio_timestep=None with a per-token video timestep: send the audio "
                                       "timestep (ComfyUI passes the pair (video, audio))")
        try:
            fr = float(self.frame_rate)
        except (TypeError, ValueError):
            raise ForwardContractError(f"frame_rate={self.frame_rate!r}: expected a number") from None
        if not math.isfinite(fr) or fr <= 0:
            raise ForwardContractError(f"frame_rate={self.frame_rate!r}: must be a positive number")
        object.__setattr__(self, "frame_rate", fr)
        self._check_context(b)
        self._check_guides(b, f, h, w)
        if self.ref_audio_tokens is not None:
            r = _check_tensor("ref_audio_tokens", self.ref_audio_tokens, ndim=3)
            if self.audio is None:
                raise ForwardContractError("ref_audio_tokens need an audio latent")
            if r.shape[0] not in (1, b) or r.shape[2] != AUDIO_TOKEN_WIDTH or r.shape[1] < 1:
                raise ForwardContractError(f"ref_audio_tokens of shape {tuple(r.shape)}: expected "
                                           f"[1 or {b}, T_ref ≥ 1, 128]")
        if self.generated_keyframes is not None and not isinstance(self.generated_keyframes, GeneratedKeyframes):
            raise ForwardContractError(f"generated_keyframes: expected GeneratedKeyframes, got "
                                       f"{type(self.generated_keyframes).__name__}")
        if not isinstance(self.options, ForwardOptions):
            raise ForwardContractError(f"options: expected ForwardOptions, got {type(self.options).__name__}")
        tags = tuple(self.cond_or_uncond)
        if tags and (len(tags) != b or not all(t in (0, 1) for t in tags)):
            raise ForwardContractError(f"cond_or_uncond={self.cond_or_uncond!r}: expected {b} tags of 0 (cond) or 1 "
                                       f"(uncond), or ()")
        object.__setattr__(self, "cond_or_uncond", tags)
        if self.lora is not None and not isinstance(self.lora, LoraSet):
            raise ForwardContractError(f"lora: expected LoraSet or None, got {type(self.lora).__name__}")

    @staticmethod
    def _check_timestep(name: str, t, b: int, n: int) -> None:
        _check_tensor(name, t)
        if tuple(t.shape) not in ((b,), (b, n, 1), (b, n)):
            raise ForwardContractError(f"{name} of shape {tuple(t.shape)}: expected [{b}] (per row) or [{b}, {n}, 1] "
                                       f"(per token; [{b}, {n}] is accepted too)")

    def _check_context(self, b: int) -> None:
        keys = tuple(self.context_keys)
        for i, k in enumerate(keys):
            _check_key(f"context_keys[{i}]", k)
        if keys and len(keys) != b:
            raise ForwardContractError(f"context_keys: {len(keys)} keys for a batch of {b} rows (one per row, or ())")
        object.__setattr__(self, "context_keys", keys)
        if self.context is None:
            if not keys:
                raise ForwardContractError("context=None needs context_keys naming rows cached on the fleet")
        else:
            ctx = _check_tensor("context", self.context, ndim=3)
            if ctx.shape[0] != b or ctx.shape[1] < 1:
                raise ForwardContractError(f"context of shape {tuple(ctx.shape)}: expected [{b}, L ≥ 1, C]")
        if self.attention_mask is not None:
            m = _check_tensor("attention_mask", self.attention_mask, floating=False)
            if m.ndim != 2 or m.shape[0] != b:
                raise ForwardContractError(f"attention_mask of shape {tuple(m.shape)}: expected [{b}, L]")
            if self.context is not None and m.shape[1] != self.context.shape[1]:
                raise ForwardContractError(f"attention_mask of shape {tuple(m.shape)} does not match the context's "
                                           f"{self.context.shape[1]} tokens")

    def _check_guides(self, b: int, f: int, h: int, w: int) -> None:
        entries = tuple(self.guide_attention_entries)
        if not all(isinstance(e, GuideAttentionEntry) for e in entries):
            raise ForwardContractError("guide_attention_entries: expected GuideAttentionEntry items")
        object.__setattr__(self, "guide_attention_entries", entries)
        kf = self.keyframe_idxs
        if kf is None:
            if entries:
                raise ForwardContractError("guide_attention_entries without keyframe_idxs")
            return
        _check_tensor("keyframe_idxs", kf, floating=False)
        if kf.ndim != 4 or kf.shape[0] not in (1, b) or kf.shape[1] != 3 or kf.shape[3] != 2:
            raise ForwardContractError(f"keyframe_idxs of shape {tuple(kf.shape)}: expected [{b}, 3, N, 2]")
        n = kf.shape[2]
        if n % (h * w) != 0 or n > f * h * w:
            raise ForwardContractError(
                f"keyframe_idxs holds {n} tokens, not a whole number of {h * w}-token latent frames within the "
                f"{f * h * w}-token video (the guides were recorded at another resolution: crop the guides before "
                f"upscaling)")
        if entries and sum(e.pre_filter_count for e in entries) != n:
            raise ForwardContractError(f"guide_attention_entries' pre_filter_counts sum to "
                                       f"{sum(e.pre_filter_count for e in entries)}, keyframe_idxs holds {n} tokens")
        if self.denoise_mask is not None:
            d = _check_tensor("denoise_mask", self.denoise_mask, ndim=5)
            if (d.shape[0] not in (1, b) or d.shape[1] not in (1, VIDEO_CHANNELS) or d.shape[2] != f
                    or d.shape[3] not in (1, h) or d.shape[4] not in (1, w)):
                raise ForwardContractError(f"denoise_mask of shape {tuple(d.shape)}: expected [{b}, 1 or 128, {f}, "
                                           f"{h} or 1, {w} or 1]")

    @property
    def batch(self) -> int:
        return self.video.shape[0]

    @property
    def video_tokens(self) -> int:
        """N_v: video tokens before −1 cells are dropped (guide tokens included)."""
        _, _, f, h, w = self.video.shape
        return f * h * w

    @property
    def guide_tokens(self) -> int:
        """N: appended guide tokens before −1 cells are dropped."""
        return 0 if self.keyframe_idxs is None else self.keyframe_idxs.shape[2]

    def without_context(self) -> "ForwardRequest":
        """The same request with the context left on the fleet (needs context_keys)."""
        import dataclasses

        return dataclasses.replace(self, context=None, attention_mask=self.attention_mask)


@dataclass(frozen=True)
class ForwardReply:
    """The forward's output, as ComfyUI's `LTXAVModel.forward` returns it.

    video: `[B, 128, F, H, W]` velocity in the request video's dtype (guide frames included; rows of −1 cells zero,
        as ComfyUI's scatter leaves them).
    audio: `[B, 8, T, 16]` in the same dtype (reference-audio tokens already cut), or None for a video-only call.
    report: how the fleet ran it (e.g. "sequence parallel over all 4 ranks", "forward: batch rows in parallel on 2
        ranks …").
    seconds: fleet wall time of the forward (rank 0), excluding transport.
    lora_reports: coverage of the fused LoRA set, one line per strength group (e.g. "lora <key>#0 @ 1: 56/56 layers
        applied"); () without a LoRA.
    slowdowns: what ran slower than it could in this forward, new since the last reply, with why and its cost (e.g.
        "native forward not capturable (OutOfMemoryError: …): forwards eager, ~3 % slower at 3,520 video tokens per
        rank"); () when nothing did.
    """

    video: torch.Tensor
    audio: torch.Tensor | None
    report: str = ""
    seconds: float = 0.0
    lora_reports: tuple[str, ...] = ()
    slowdowns: tuple[str, ...] = ()

    def __post_init__(self):
        _check_tensor("reply video", self.video, ndim=5)
        if self.audio is not None:
            _check_tensor("reply audio", self.audio, ndim=4)


@dataclass(frozen=True)
class ForwardMiss:
    """The fleet lacks a cached piece the request referred to (it restarted, switched model, or evicted it): resend
    the same request with those pieces included. Nothing ran.

    context_keys: the row keys whose context is not cached (resend with `context`).
    lora_key: the LoRA key not held (resend with `lora.patches`), or None.
    """

    context_keys: tuple[str, ...] = ()
    lora_key: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "context_keys", tuple(self.context_keys))
        if not self.context_keys and self.lora_key is None:
            raise ForwardContractError("ForwardMiss names nothing missing")


@dataclass(frozen=True)
class PreprocessTextRequest:
    """`LTXAVModel.preprocess_text_embeds(context, unprocessed)` on the fleet (caption projection + connectors).

    context: `[B, L, C_in]` float, a CONDITIONING tensor from ComfyUI's LTX-2 text encoder (Gemma features after the
        checkpoint's feature extractor: C_in = 3840 for LTX-2.0, 4096 + 2048 for 2.3 / 2.5).
    unprocessed: ComfyUI's `unprocessed_ltxav_embeds` flag. False and a width that is already the processed width
        -> returned unchanged (ComfyUI's rule).
    cache_keys: optional, one key per row: the fleet also stores each processed row in its context cache under that
        key, so the first forward need not ship it. () = do not cache.
    lora: the `LoraSet` in effect (ComfyUI runs the connectors with the sampling patcher's weights): its patches of
        the text connectors (`video_embeddings_connector.*`, `audio_embeddings_connector.*`) are fused for this call
        and restored after it; None = clean connectors. Patches None: the fleet must hold the key (from an earlier
        request), else the job answers `ForwardMiss(lora_key=…)`.
    """

    context: torch.Tensor
    unprocessed: bool = True
    cache_keys: tuple[str, ...] = ()
    lora: LoraSet | None = None

    def __post_init__(self):
        ctx = _check_tensor("context", self.context, ndim=3)
        if ctx.shape[0] < 1 or ctx.shape[1] < 1:
            raise ForwardContractError(f"context of shape {tuple(ctx.shape)}: expected [B ≥ 1, L ≥ 1, C]")
        if not isinstance(self.unprocessed, bool):
            raise ForwardContractError(f"unprocessed={self.unprocessed!r}: expected a bool")
        keys = tuple(self.cache_keys)
        for i, k in enumerate(keys):
            _check_key(f"cache_keys[{i}]", k)
        if keys and len(keys) != ctx.shape[0]:
            raise ForwardContractError(f"cache_keys: {len(keys)} keys for {ctx.shape[0]} rows (one per row, or ())")
        object.__setattr__(self, "cache_keys", keys)
        if self.lora is not None and not isinstance(self.lora, LoraSet):
            raise ForwardContractError(f"lora: expected LoraSet or None, got {type(self.lora).__name__}")


@dataclass(frozen=True)
class PreprocessTextReply:
    """The processed context `[B, L', C_out]` in the request's dtype (C_out = 4096 + 2048 for 2.3 / 2.5, 2 × 3840
    for 2.0: video then audio part; L' = the connectors' length, registers padded to ≥ 1024 tokens).
    lora_reports: coverage of the connector patches fused for the call (() without any)."""

    context: torch.Tensor
    lora_reports: tuple[str, ...] = ()

    def __post_init__(self):
        _check_tensor("reply context", self.context, ndim=3)


# the fleet job kinds that take these requests (mgpu_backend/serving/jobs/forward.py)
FORWARD_JOB = "forward"
PREPROCESS_TEXT_JOB = "preprocess_text"
