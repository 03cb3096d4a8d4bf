"""The engine side of the native ComfyUI MODEL (issue 19): ComfyUI 0.33's LTX-AV forward on plain tensors.

`NativeEngine.forward(request)` reproduces `comfy.ldm.lightricks.av_model.LTXAVModel.forward` (ComfyUI 0.33.0, which
includes the upstream AdaLN sigma fix Comfy-Org/ComfyUI#14097) on the pack's resident diffusers
`LTX2VideoTransformer3DModel`, calling its modules (projections, AdaLN embeddings, RoPE, blocks, output layers) in
ComfyUI's order with ComfyUI's inputs:
- positions: ComfyUI's patchifier grid in pixel units (`latent_to_pixel_coords` with the causal first-frame fix),
  the appended guide tokens' positions replaced by `keyframe_idxs`, then time × (1 / frame_rate) — seconds;
  audio: ComfyUI's `AudioPatchifier` times (hop 160, 16 kHz, 4× downsampling, causal), reference-audio tokens
  before t = 0 (`LTXAVModel._process_input`);
- tokens whose denoise-mask cell is < 0 (IC-LoRA's sparse grid) are dropped when guides are present (row 0 decides,
  as in ComfyUI) and come back as zeros in the output;
- AdaLN inputs (× `timestep_scale_multiplier`): per-token or per-row sigmas of each modality for its own
  AdaLN and its own audio-video cross-attention scale/shift; the a2v gate from the audio sigma's maximum and the
  v2a gate from the video sigma's maximum over the whole batch (× cross / timestep multipliers); the prompt AdaLN
  (LTX-2.3) from each row's maximum sigma (`compute_prompt_timestep`);
- the dense guide-attention bias (`_build_guide_self_attention_mask`: strength ≠ 1 or a pixel mask): noisy queries
  see log(w) on the tracked guide keys, tracked guide queries log(w) on the noisy keys (0 → finfo.min), computed
  per query group inside the (sequence-parallel) video self-attention;
- STG (`stg_self_attn_blocks`): video and audio self-attention of those blocks return their value projection;
  modality guidance: a2v / v2a cross-attention off;
- ComfyUI's block (`comfy_block`): the video→audio cross-attention normalizes the video stream after the block's
  audio→video update (diffusers' block uses the video from before it); `run_vx` / `run_ax` False skip a stream's
  updates;
- reference-audio tokens at timestep 0, cut from the output; q/k RMS-norm eps 1e-5 (ComfyUI's, instead of the
  reference's 1e-6) in the transformer and the connectors while a native request runs.
LoRA: a request's `LoraSet` is fused into the resident weights by the fleet's `LoRAFuser` (each rank computes its
share of the layers, broadcast to all) and kept while the following requests name the same key; `lora=None` restores
the clean weights exactly. Its patches of the text connectors are fused for a `preprocess_text` call only.
Not supported yet, refused by name: a video-only call, `generated_keyframes` on a model with the LTX-2.5 keyframe
embedding.

Parallel: the video tokens are split over the sequence-parallel group (`parallel/sequence.py`: Ulysses video
self-attention, gathered K/V for video→audio), or a batch's rows are spread over ranks (the guidance-pass split of
`parallel/passes.py`, each rank one whole forward per row) — `ParallelPlan.split` decides (the cost model on CUDA,
sequence parallel on CPU unless `guidance_parallel="on"`). The batch-wide gate maxima are taken before the split, so
a row computed alone equals the row computed in its batch.

`preprocess_text` is `LTXAVModel.preprocess_text_embeds` (the connectors; `denoiser.text_contexts` pads and masks the
way ComfyUI's connector appends its registers). `ContextCache` keeps processed rows by key on every rank.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cuda_graphs
from .attention import LTX2AttnProcessor
from .denoiser import skip_self_attention, text_contexts
from .forward import (ForwardContractError, ForwardOptions, ForwardRequest, GuideAttentionEntry, LoraSet,
                      PreprocessTextRequest)
from .lora import LoRAFile, LoRAFuser, LoRAPair
from .models import keymaps
from .parallel.exchange import Exchange
from .parallel.sequence import NEG_INF, SequenceParallelTransformer
from .parallel.sharding import gathered
from .validation import ValidationError

log = logging.getLogger("ltx2_mgpu.native")
_ROPE = ("video_rotary_emb", "audio_rotary_emb", "ca_video_rotary_emb", "ca_audio_rotary_emb")
COMFY_QK_EPS = 1e-5  # ComfyUI's q/k RMSNorm eps (comfy/ldm/lightricks/model.py CrossAttention)
VAE_SCALE = (8, 32, 32)  # LTX-2 video VAE: time, height, width compression
AUDIO_HOP, AUDIO_RATE, AUDIO_DOWNSAMPLE = 160, 16000, 4  # ComfyUI AudioPatchifier defaults for LTX-AV


class NotSupported(ValidationError):
    """A request ComfyUI's forward accepts that the fleet does not run yet (named, never ignored)."""


def qk_norms(*modules: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention q/k RMSNorms (`norm_q`, `norm_k`) of `modules`."""
    return [m for module in modules if module is not None for name, m in module.named_modules()
            if name.rsplit(".", 1)[-1] in ("norm_q", "norm_k") and hasattr(m, "eps")]


@contextlib.contextmanager
def comfy_qk_eps(norms: list[torch.nn.Module], eps: float = COMFY_QK_EPS):
    """Within the block, the q/k RMSNorms `norms` (`qk_norms`) use `eps`; their own eps is restored after."""
    saved = [m.eps for m in norms]
    try:
        for m in norms:
            m.eps = eps
        yield
    finally:
        for m, old in zip(norms, saved):
            m.eps = old


class ContextCache:
    """Processed text-context rows `[1, L, C]` by key (least recently used dropped first), on one rank.

    Every rank stores and looks up the same keys in the same order, so hits and misses agree across the fleet.
    Bounds: `max_rows` rows and `max_bytes` bytes. A fleet is one model: a model change is a new fleet and a new cache.
    """

    def __init__(self, max_rows: int = 64, max_bytes: int = 2 << 30):
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._rows.values())

    def put(self, key: str, row: torch.Tensor) -> None:
        self._rows.pop(key, None)
        self._rows[key] = row
        while len(self._rows) > self.max_rows or (len(self._rows) > 1 and self.nbytes > self.max_bytes):
            self._rows.popitem(last=False)

    def missing(self, keys) -> tuple[str, ...]:
        return tuple(k for k in dict.fromkeys(keys) if k not in self._rows)

    def get(self, key: str) -> torch.Tensor:
        row = self._rows[key]
        self._rows.move_to_end(key)
        return row

    def clear(self) -> None:
        self._rows.clear()


# ---- ComfyUI's positions ---------------------------------------------------------------------------------------

def video_pixel_coords(batch: int, frames: int, height: int, width: int, device=None) -> torch.Tensor:
    """ComfyUI's `SymmetricPatchifier.get_latent_coords` + `latent_to_pixel_coords(causal_fix=True)`: int64
    `[B, 3, F·H·W, 2]` [start, end) per token on (pixel frame, y px, x px); frame start/end `max(8f + 1 − 8, 0)`."""
    f, h, w = (torch.arange(n, device=device) for n in (frames, height, width))
    grid = torch.stack(torch.meshgrid(f, h, w, indexing="ij"), dim=0).reshape(3, -1)  # [3, N]
    coords = torch.stack([grid, grid + 1], dim=-1)  # [3, N, 2] latent [start, end)
    coords = coords * torch.tensor(VAE_SCALE, device=device).view(3, 1, 1)
    coords[0] = (coords[0] + 1 - VAE_SCALE[0]).clamp(min=0)
    return coords.unsqueeze(0).expand(batch, -1, -1, -1).clone()


def _audio_times(start: int, end: int, device=None) -> torch.Tensor:
    """ComfyUI `AudioPatchifier._get_audio_latent_time_in_sec` (float32, causal): seconds of latent steps."""
    mel = torch.arange(start, end, dtype=torch.float32, device=device) * AUDIO_DOWNSAMPLE
    mel = (mel + 1 - AUDIO_DOWNSAMPLE).clip(min=0)
    return mel * AUDIO_HOP / AUDIO_RATE


def audio_coords(batch: int, steps: int, ref_steps: int = 0, device=None) -> torch.Tensor:
    """`[B, 1, R + T, 2]` float32 seconds: R reference-audio tokens ending just before t = 0 (ID-LoRA convention of
    `LTXAVModel._process_input`), then the T audio latent steps."""
    coords = torch.stack([_audio_times(0, steps, device), _audio_times(1, steps + 1, device)], dim=-1)
    if ref_steps:
        tpl = AUDIO_HOP * AUDIO_DOWNSAMPLE / AUDIO_RATE
        ref_start, ref_end = _audio_times(0, ref_steps, device), _audio_times(1, ref_steps + 1, device)
        offset = ref_end[-1].item() + tpl
        coords = torch.cat([torch.stack([ref_start - offset, ref_end - offset], dim=-1), coords], dim=0)
    return coords.view(1, 1, -1, 2).expand(batch, -1, -1, -1)


def downsample_pixel_mask(mask: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """A pixel-space guide mask `[B, 1, F_pix, H_pix, W_pix]` -> per-token weights `[B, F·H·W]` (ComfyUI
    `LTXVModel._downsample_mask_to_latent`): area interpolation per frame to (H, W); the first pixel frame is the
    first latent frame, the other pixel frames are averaged in groups of (F_pix − 1) // (F − 1) (trailing frames that
    fill no group dropped; fewer pixel than latent frames: nearest repetition; one pixel frame: repeated)."""
    b, _, f_pix = mask.shape[:3]
    spatial = F.interpolate(mask.permute(0, 2, 1, 3, 4).reshape(b * f_pix, 1, *mask.shape[3:]), size=(height, width),
                            mode="area").reshape(b, f_pix, 1, height, width).permute(0, 2, 1, 3, 4)
    first = spatial[:, :, :1]
    if f_pix > 1 and frames > 1:
        group = (f_pix - 1) // (frames - 1)
        if group < 1:
            rest = spatial[:, :, 1:].permute(0, 3, 4, 1, 2).reshape(b * height * width, 1, f_pix - 1)
            rest = F.interpolate(rest, size=frames - 1, mode="nearest")
            rest = rest.reshape(b, height, width, 1, frames - 1).permute(0, 3, 4, 1, 2)
        else:
            rest = spatial[:, :, 1:1 + (frames - 1) * group].reshape(b, 1, frames - 1, group, height, width)
            rest = rest.mean(dim=3)
        latent = torch.cat([first, rest], dim=2)
    elif frames > 1:
        latent = first.expand(-1, -1, frames, -1, -1)
    else:
        latent = first
    return latent.reshape(b, -1)


# ---- LoRA patches from the request ----------------------------------------------------------------------------

@dataclass(eq=False)
class PatchLoRA(LoRAFile):
    """A `LoRAFile` whose pairs come from a request's `LoraPatch`es (in memory) instead of a file, so the fleet's
    `LoRAFuser` fuses, shares over the ranks and restores them exactly as it does LoRA files. One object holds at
    most one pair per layer, all of one strength (`patch_loras` splits a set into such groups, in order)."""

    tensors: dict = None  # module -> (down [r, in], up [out, r], alpha)

    @contextlib.contextmanager
    def reader(self):
        yield lambda name: self.tensors[name]


CONNECTOR_PREFIXES = ("video_embeddings_connector.", "audio_embeddings_connector.")


def patch_loras(lora: LoraSet, connectors: bool = False) -> list[PatchLoRA]:
    """A request's LoRA set -> `PatchLoRA` groups (first fit: a new group when the layer already has a pair in every
    group of that strength). `connectors` False: the patches of everything but the text connectors, named as the
    diffusers transformer's modules; True: the connectors' patches, named as `NativeEngine.connectors`' modules
    (`video_connector.transformer_blocks.…`)."""
    groups: list[tuple[float, dict]] = []
    for patch in lora.patches:
        if patch.module.startswith(CONNECTOR_PREFIXES) != connectors:
            continue
        name = (keymaps.connector_to_diffusers(patch.module) if connectors else
                keymaps.transformer_to_diffusers(patch.module))
        rank = patch.down.shape[0]
        entry = (patch.down, patch.up, float(rank if patch.alpha is None else patch.alpha))
        for strength, members in groups:
            if strength == float(patch.strength) and name not in members:
                members[name] = entry
                break
        else:
            groups.append((float(patch.strength), {name: entry}))
    out = []
    for i, (strength, members) in enumerate(groups):
        index = {name: LoRAPair(name, name, tuple(down.shape), tuple(up.shape), alpha)
                 for name, (down, up, alpha) in members.items()}
        what = "connectors" if connectors else "lora"
        out.append(PatchLoRA(path=f"{what} {lora.key}#{i}", strength=strength, index=index,
                             identity=("native", what, lora.key, i), tensors=members))
    return out


# ---- the guide-attention bias -----------------------------------------------------------------------------------

@dataclass
class GuideBias:
    """ComfyUI's `GuideAttentionMask` over the kept token sequence: queries [0, guide_start) add `log_w` on keys
    [guide_start, guide_start + tracked); tracked queries add their own `log_w` on keys [0, guide_start)."""

    guide_start: int
    log_w: torch.Tensor  # [tracked] in the compute dtype (finfo.min where the weight is 0)

    @property
    def tracked(self) -> int:
        return self.log_w.numel()

    def attend(self, q, k, v, key_mask):
        """The video self-attention kernel on the whole (padded) sequence: `[B, Tp, H, D]` in, out; `key_mask`
        additive `[1, 1, 1, Tp]` (−inf on padding) or None."""
        gs, te, tp = self.guide_start, self.guide_start + self.tracked, q.shape[1]
        log_w = self.log_w.to(q.dtype)
        base = torch.zeros(1, 1, 1, tp, dtype=q.dtype, device=q.device) if key_mask is None else key_mask.to(q.dtype)
        outs = []
        if gs > 0:
            noisy = base.clone()
            noisy[..., gs:te] += log_w
            outs.append(LTX2AttnProcessor.attend(q[:, :gs], k, v, noisy))
        tracked = base.expand(1, 1, te - gs, tp).clone()
        tracked[..., :gs] += log_w.view(1, 1, -1, 1)
        outs.append(LTX2AttnProcessor.attend(q[:, gs:te], k, v, tracked))
        if te < tp:
            outs.append(LTX2AttnProcessor.attend(q[:, te:], k, v, key_mask))
        return torch.cat(outs, dim=1)


def guide_bias(entries: tuple[GuideAttentionEntry, ...], kf_keep: torch.Tensor, kept_tokens: int,
               dtype: torch.dtype, device) -> GuideBias | None:
    """ComfyUI `_build_guide_self_attention_mask` on the resolved entries (None when no bias is needed).

    `kf_keep`: `[N]` bool, which of the N appended guide tokens survive the −1 drop; `kept_tokens`: the sequence
    length after the drop."""
    num_guide = int(kf_keep.sum())
    if num_guide == 0 or not entries or not any(e.needs_bias for e in entries):
        return None
    weights, offset = [], 0
    for e in entries:
        surviving = int(kf_keep[offset:offset + e.pre_filter_count].sum())
        offset += e.pre_filter_count
        if surviving == 0:
            continue
        if e.pixel_mask is not None:
            per_token = downsample_pixel_mask(e.pixel_mask.to(device=device, dtype=dtype), *e.latent_shape)[:1]
            w = per_token[:, :min(per_token.shape[1], surviving)] * e.strength
        else:
            w = torch.full((1, surviving), e.strength, dtype=dtype, device=device)
        weights.append(w)
    if not weights:
        return None
    w = torch.cat(weights, dim=1)[0]
    if bool((w == 1.0).all()):
        return None
    log_w = torch.full_like(w, torch.finfo(dtype).min)
    pos = w > 0
    log_w[pos] = torch.log(w[pos].clamp(min=torch.finfo(dtype).tiny))
    return GuideBias(kept_tokens - num_guide, log_w)


# ---- one block in ComfyUI's order -----------------------------------------------------------------------------------

def _mod(table: torch.Tensor, temb: torch.Tensor, b: int):
    """diffusers `get_mod_params`: per-layer table + per-token (or per-row) AdaLN embedding, unbound per parameter."""
    return (table[None, None].to(temb.dtype) + temb.reshape(b, temb.shape[1], table.shape[0], -1)).unbind(dim=2)


def comfy_block(block, vx, ax, *, v_ctx, a_ctx, text_mask, temb, temb_audio, video_ca_ss, audio_ca_ss, a2v_gate,
                v2a_gate, temb_prompt, temb_prompt_audio, rope, run_vx=True, run_ax=True, a2v=True, v2a=True):
    """ComfyUI 0.33 `BasicAVTransformerBlock.forward` on a diffusers `LTX2VideoTransformerBlock`'s modules.

    Differences from diffusers' block order (ComfyUI's win): the video→audio cross-attention normalizes the video
    stream *after* the audio→video update of the same block; `run_vx` / `run_ax` False skip a stream's self-attention,
    text cross-attention and feed-forward (a2v needs run_vx, v2a run_ax); a2v / v2a False skip those attentions.
    STG is the attention processor's business (`denoiser.skip_self_attention`)."""
    b = vx.shape[0]
    v_vals = _mod(block.scale_shift_table, temb, b)
    a_vals = _mod(block.audio_scale_shift_table, temb_audio, b)
    run_a2v = run_vx and a2v and ax.shape[1] > 0
    run_v2a = run_ax and v2a and ax.shape[1] > 0
    if block.cross_attn_adaln:
        kv = (_mod(block.prompt_scale_shift_table, temb_prompt, b) if temb_prompt is not None else
              block.prompt_scale_shift_table[None, None].to(vx.dtype).unbind(dim=2))
        a_kv = (_mod(block.audio_prompt_scale_shift_table, temb_prompt_audio, b) if temb_prompt_audio is not None
                else block.audio_prompt_scale_shift_table[None, None].to(ax.dtype).unbind(dim=2))
    if run_vx:
        shift, scale, gate = v_vals[:3]
        vx = vx + block.attn1(block.norm1(vx) * (1 + scale) + shift, None, None, rope["video_rotary_emb"], None) * gate
        q = block.norm2(vx)
        ctx = v_ctx
        if block.video_cross_attn_adaln:
            q = q * (1 + v_vals[7]) + v_vals[6]
        if block.cross_attn_adaln:
            ctx = ctx * (1 + kv[1]) + kv[0]
        out = block.attn2(q, ctx, text_mask, None, None)
        vx = vx + (out * v_vals[8] if block.video_cross_attn_adaln else out)
    if run_ax:
        shift, scale, gate = a_vals[:3]
        ax = ax + block.audio_attn1(block.audio_norm1(ax) * (1 + scale) + shift, None, None,
                                    rope["audio_rotary_emb"], None) * gate
        q = block.audio_norm2(ax)
        ctx = a_ctx
        if block.audio_cross_attn_adaln:
            q = q * (1 + a_vals[7]) + a_vals[6]
        if block.cross_attn_adaln:
            ctx = ctx * (1 + a_kv[1]) + a_kv[0]
        out = block.audio_attn2(q, ctx, text_mask, None, None)
        ax = ax + (out * a_vals[8] if block.audio_cross_attn_adaln else out)
    if run_a2v or run_v2a:
        ax_norm = block.video_to_audio_norm(ax)
        v_ss = _mod(block.video_a2v_cross_attn_scale_shift_table[:4], video_ca_ss, b)
        a_ss = _mod(block.audio_a2v_cross_attn_scale_shift_table[:4], audio_ca_ss, b)
        if run_a2v:
            v_in = block.audio_to_video_norm(vx) * (1 + v_ss[0]) + v_ss[1]
            a_in = ax_norm * (1 + a_ss[0]) + a_ss[1]
            out = block.audio_to_video_attn(v_in, a_in, None, rope["ca_video_rotary_emb"], rope["ca_audio_rotary_emb"])
            vx = vx + out * _mod(block.video_a2v_cross_attn_scale_shift_table[4:], a2v_gate, b)[0]
        if run_v2a:
            a_in = ax_norm * (1 + a_ss[2]) + a_ss[3]
            v_in = block.audio_to_video_norm(vx) * (1 + v_ss[2]) + v_ss[3]
            out = block.video_to_audio_attn(a_in, v_in, None, rope["ca_audio_rotary_emb"], rope["ca_video_rotary_emb"])
            ax = ax + out * _mod(block.audio_a2v_cross_attn_scale_shift_table[4:], v2a_gate, b)[0]
    if run_vx:
        shift, scale, gate = v_vals[3:6]
        vx = vx + block.ff(block.norm3(vx) * (1 + scale) + shift) * gate
    if run_ax:
        shift, scale, gate = a_vals[3:6]
        ax = ax + block.audio_ff(block.audio_norm3(ax) * (1 + scale) + shift) * gate
    return vx, ax


# ---- one forward ----------------------------------------------------------------------------------------------------

@dataclass
class _Prepared:
    """A request turned into the transformer's inputs for the whole batch (before any row or token split)."""

    video: torch.Tensor  # [B, N, 128] kept tokens (compute dtype)
    video_ts: torch.Tensor  # [B, N] or [B, 1] scaled sigmas (float32)
    video_coords: torch.Tensor  # [B, 3, N, 2] seconds / pixels (float32)
    keyframe_marker: torch.Tensor | None  # [B, N] for models with the keyframe embedding
    audio: torch.Tensor  # [B, R + T, 128]
    audio_ts: torch.Tensor  # [B, R + T] or [B, 1] scaled
    audio_coords: torch.Tensor  # [B, 1, R + T, 2]
    a2v_gate_ts: torch.Tensor  # 0-d: max scaled audio sigma × gate factor (whole batch)
    v2a_gate_ts: torch.Tensor  # 0-d: max scaled video sigma × gate factor (whole batch)
    context: torch.Tensor  # [B, L, C]
    text_mask: torch.Tensor | None  # additive [B, 1, 1, L]
    bias: GuideBias | None
    keep: torch.Tensor | None  # [N_full] bool (None: nothing dropped)
    full_shape: tuple[int, int, int]  # (F, H, W)
    audio_steps: int
    ref_steps: int


def _rows(x: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    return None if x is None else x[rows]


class NativeEngine:
    """ComfyUI's LTX-AV forward on one rank of a fleet (or in one process: `plan=None`).

    Args:
        components: the fleet's `LTX2Components` (the transformer and the connectors are used).
        plan: the fleet's `ParallelPlan` (None: one process, every forward local).
        dtype / device: the compute dtype and device of the resident weights.
    """

    def __init__(self, components, plan, dtype: torch.dtype, device: torch.device, lora: LoRAFuser | None = None):
        self.components, self.plan, self.dtype, self.device = components, plan, dtype, torch.device(device)
        self.transformer = components.transformer
        self._qk_norms = qk_norms(self.transformer)
        self._connector_qk_norms = qk_norms(components.video_connector, components.audio_connector)
        self.cache = ContextCache()
        # the fleet's LoRA fuser (shared with the stage jobs, which re-apply their own sets), or one of our own
        self.lora = lora or (LoRAFuser(self.transformer) if plan is None else
                             LoRAFuser(self.transformer, rank=plan.rank, world_size=plan.world_size))
        self._lora_set: LoraSet | None = None  # the last LoRA set shipped with its patches (held by key)
        self._lora_files: list[PatchLoRA] = []  # its transformer groups
        self.last_lora_reports: list[str] = []
        # the text connectors as one module (names `video_connector.…`, `audio_connector.…`): their LoRA patches are
        # fused for a preprocess_text call and restored after it
        self.connectors = torch.nn.ModuleDict({"video_connector": components.video_connector,
                                               "audio_connector": components.audio_connector})
        self.connector_lora = (LoRAFuser(self.connectors) if plan is None else
                               LoRAFuser(self.connectors, rank=plan.rank, world_size=plan.world_size))
        # a degree-1 "sequence parallel" wrapper: the same processors (and the guide-bias hook) without collectives
        self._local = SequenceParallelTransformer(self.transformer, Exchange(None, 1, 0), None)
        self.last_report = ""
        self.forwards = 0
        self.graph_fallbacks: list[str] = []  # why native forwards ran eagerly on CUDA (cuda_graphs' reasons)

    # ---- checks (every rank, before any work) ----
    @property
    def context_width(self) -> int:
        cfg = self.transformer.config
        if cfg.use_prompt_embeddings:  # LTX-2.0: caption projection inside the forward, both halves caption-wide
            return 2 * cfg.caption_channels
        return cfg.num_attention_heads * cfg.attention_head_dim + \
            cfg.audio_num_attention_heads * cfg.audio_attention_head_dim

    def check(self, request: ForwardRequest) -> None:
        """Raise ValidationError / NotSupported for what this model or engine cannot run (named)."""
        if not isinstance(request, ForwardRequest):
            raise ForwardContractError(f"forward payload: expected a ForwardRequest, got {type(request).__name__}")
        o = request.options
        if request.audio is None:
            raise NotSupported("a video-only forward (no audio latent) is not supported by the fleet yet")
        n_blocks = len(self.transformer.transformer_blocks)
        bad = [b for b in o.stg_self_attn_blocks if b >= n_blocks]
        if bad:
            raise ValidationError(f"stg_self_attn_blocks {bad} do not exist: this transformer has blocks "
                                  f"0..{n_blocks - 1}")
        if request.context is not None and request.context.shape[-1] != self.context_width:
            raise ValidationError(f"context of width {request.context.shape[-1]} does not fit this model (expected "
                                  f"{self.context_width}: the processed context from preprocess_text)")
        if request.generated_keyframes is not None and self.transformer.config.use_keyframes_abs_pos_embedding:
            raise NotSupported("generated_keyframes on a model with the keyframe embedding (LTX-2.5) are not "
                               "supported by the fleet yet")
        if self.plan is not None:
            self.plan.check(request.video_tokens)

    # ---- LoRA ----
    def lora_missing(self, request) -> str | None:
        """The request's LoRA key when the fleet does not hold its patches (the request did not ship them)."""
        lora = request.lora
        if lora is None or lora.patches is not None or (self._lora_set is not None and
                                                         lora.key == self._lora_set.key):
            return None
        return lora.key

    def _resolve_lora(self, lora: LoraSet) -> LoraSet:
        """The full set for a request's `lora` (its own patches, or the held set of that key); a newly shipped set
        becomes the held one (its transformer groups checked against the model first: LoRAError before any weight
        is touched)."""
        if lora.patches is None:
            return self._lora_set
        if self._lora_set is None or lora.key != self._lora_set.key:
            files = patch_loras(lora)
            if files:
                self.lora.check(files)
            self._lora_set, self._lora_files = lora, files
        return self._lora_set

    def apply_lora(self, request: ForwardRequest) -> None:
        """Make the request's LoRA set the fused one (every rank, in lockstep): nothing when it is fused already,
        the clean weights for `lora=None`. Raises LoRAError (a ValidationError) before any weight is touched when
        the patches do not fit this model."""
        if request.lora is None:
            self.lora.apply([])
            self.last_lora_reports = []
            return
        self._resolve_lora(request.lora)
        self.last_lora_reports = [r.detail() for r in self.lora.apply(self._lora_files)]

    # ---- context ----
    def store_context(self, keys, context: torch.Tensor) -> None:
        for i, key in enumerate(keys):  # a copy per row: a cached row never pins a whole request's batch
            self.cache.put(key, context[i:i + 1].to(self.device, self.dtype, copy=True))

    def resolve_context(self, request: ForwardRequest) -> tuple[torch.Tensor | None, tuple[str, ...]]:
        """The request's context in the compute dtype (stored under its keys), or the missing keys."""
        if request.context is not None:
            if request.context_keys:
                self.store_context(request.context_keys, request.context)
            return request.context.to(self.device, self.dtype), ()
        missing = self.cache.missing(request.context_keys)
        if missing:
            self.cache.misses += 1
            return None, missing
        self.cache.hits += 1
        rows = [self.cache.get(k) for k in request.context_keys]
        if len({tuple(r.shape) for r in rows}) != 1:
            raise ValidationError(f"cached context rows of different shapes {[tuple(r.shape) for r in rows]} cannot "
                                  f"form one batch")
        return torch.cat(rows), ()

    # ---- inputs ----
    def prepare(self, request: ForwardRequest, context: torch.Tensor) -> _Prepared:
        cfg = self.transformer.config
        dev, dt = self.device, self.dtype
        b, _, f, h, w = request.video.shape
        n_full = f * h * w
        mult = float(cfg.timestep_scale_multiplier)
        gate_factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
        video = request.video.to(dev, dt).permute(0, 2, 3, 4, 1).reshape(b, n_full, -1)
        coords = video_pixel_coords(b, f, h, w, dev)
        v_ts = request.video_timestep.to(dev, torch.float32)
        v_ts = v_ts.view(b, 1) if v_ts.ndim == 1 else v_ts.view(b, n_full)
        keep, bias, kf_keep = None, None, None
        if request.guide_tokens > 0:
            n_kf = request.guide_tokens
            keep = torch.ones(n_full, dtype=torch.bool, device=dev)
            if request.denoise_mask is not None:
                negative = (request.denoise_mask[0].to(dev) < 0).any(dim=0)  # [F, H | 1, W | 1]
                keep = ~negative.expand(f, h, w).reshape(-1)
            kf_keep = keep[-n_kf:]
            video, coords = video[:, keep], coords[:, :, keep]
            if v_ts.shape[1] > 1:
                v_ts = v_ts[:, keep]
            kf = request.keyframe_idxs.to(dev)[..., kf_keep, :].expand(b, -1, -1, -1)
            if kf.shape[2] > 0:
                coords[:, :, -kf.shape[2]:] = kf.to(coords.dtype)
            if bool(keep.all()):
                keep = None
        n = video.shape[1]
        marker = None
        if cfg.use_keyframes_abs_pos_embedding:  # ComfyUI keyframes_abs_pos_mask: frame-start 0, guides excluded
            marker = coords[:, 0, :, 0] == 0
            if kf_keep is not None and int(kf_keep.sum()):
                marker[:, -int(kf_keep.sum()):] = False
        seconds = coords.to(torch.float32)
        seconds[:, 0] = seconds[:, 0] * (1.0 / request.frame_rate)
        if request.guide_attention_entries:
            bias = guide_bias(request.guide_attention_entries, kf_keep, n, dt, dev)
        # audio (ComfyUI: "b c t f -> b t (c f)"), reference tokens first at timestep 0
        audio = request.audio.to(dev, dt)
        t_steps = audio.shape[2]
        audio = audio.permute(0, 2, 1, 3).reshape(b, t_steps, -1)
        a_ts = request.audio_timestep if request.audio_timestep is not None else request.video_timestep
        a_ts = a_ts.to(dev, torch.float32)
        a_ts = a_ts.view(b, 1) if a_ts.ndim == 1 else a_ts.view(b, t_steps)
        ref = 0
        if request.ref_audio_tokens is not None:
            tokens = request.ref_audio_tokens.to(dev, dt).expand(b, -1, -1)
            ref = tokens.shape[1]
            audio = torch.cat([tokens, audio], dim=1)
            a_ts = torch.cat([torch.zeros(b, ref, device=dev), a_ts.expand(b, t_steps)], dim=1)
        v_scaled, a_scaled = v_ts * mult, a_ts * mult
        text_mask = None
        if request.attention_mask is not None:
            m = request.attention_mask.to(dev)
            if torch.is_floating_point(m):
                text_mask = m.to(dt).view(b, 1, 1, -1)
            else:  # ComfyUI _prepare_attention_mask: (mask − 1) · finfo.max
                text_mask = ((m - 1).to(dt) * torch.finfo(dt).max).view(b, 1, 1, -1)
        return _Prepared(video, v_scaled, seconds, marker, audio, a_scaled, audio_coords(b, t_steps, ref, dev),
                         a_scaled.max() * gate_factor, v_scaled.max() * gate_factor, context, text_mask, bias, keep,
                         (f, h, w), t_steps, ref)

    # ---- run ----
    def run_rows(self, p: _Prepared, rows: list[int], sp: SequenceParallelTransformer,
                 options: ForwardOptions) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of batch `rows` over `sp`'s group (degree 1: local). -> packed video `[b, N, 128]` (kept
        tokens) and audio `[b, T, 128]` (reference tokens cut), on every rank of the group."""
        t, cfg, dt = self.transformer, self.transformer.config, self.dtype
        b = len(rows)
        video, v_ts, coords = p.video[rows], p.video_ts[rows], p.video_coords[rows]
        audio, a_ts, a_coords = p.audio[rows], p.audio_ts[rows], p.audio_coords[rows]
        n = video.shape[1]
        w = sp.exchange.world_size
        padded = -(-n // w) * w
        per_token = v_ts.shape[1] > 1
        hidden = t.proj_in(sp.shard(video, 1, padded))
        if p.keyframe_marker is not None:
            marker = sp.shard(p.keyframe_marker[rows].to(dt), 1, padded).unsqueeze(-1)
            hidden = hidden + marker * t.keyframes_abs_pos_embedding.to(dt)
        audio_hidden = t.audio_proj_in(audio)
        v_local = sp.shard(v_ts, 1, padded) if per_token else v_ts
        coords_local = sp.shard(coords, 2, padded)

        def embed(module, ts):
            out, emb = module(ts.flatten(), batch_size=b, hidden_dtype=dt)
            return out.view(b, -1, out.shape[-1]), emb.view(b, -1, emb.shape[-1])

        temb, emb = embed(t.time_embed, v_local)
        temb_audio, a_emb = embed(t.audio_time_embed, a_ts)
        temb_prompt = temb_prompt_audio = None
        if t.prompt_modulation and cfg.use_prompt_adaln_single:
            temb_prompt = embed(t.prompt_adaln, v_ts.max(dim=1).values)[0]
            temb_prompt_audio = embed(t.audio_prompt_adaln, a_ts.max(dim=1).values)[0]
        video_ca_ss = embed(t.av_cross_attn_video_scale_shift, v_local)[0]
        audio_ca_ss = embed(t.av_cross_attn_audio_scale_shift, a_ts)[0]
        a2v_gate = embed(t.av_cross_attn_video_a2v_gate, p.a2v_gate_ts.expand(b))[0]
        v2a_gate = embed(t.av_cross_attn_audio_v2a_gate, p.v2a_gate_ts.expand(b))[0]
        context = p.context[rows]
        dv = context.shape[-1] // 2 if cfg.use_prompt_embeddings else cfg.num_attention_heads * cfg.attention_head_dim
        v_ctx, a_ctx = context[..., :dv], context[..., dv:]
        if cfg.use_prompt_embeddings:  # LTX-2.0 (ComfyUI _prepare_context: caption projection in the forward)
            v_ctx = t.caption_projection(v_ctx).view(b, -1, hidden.shape[-1])
            a_ctx = t.audio_caption_projection(a_ctx).view(b, -1, audio_hidden.shape[-1])
        text_mask = _rows(p.text_mask, rows)
        rope = dict(video_rotary_emb=t.rope(coords_local, device=hidden.device),
                    audio_rotary_emb=t.audio_rope(a_coords, device=hidden.device),
                    ca_video_rotary_emb=t.cross_attn_rope(coords_local[:, 0:1], device=hidden.device),
                    ca_audio_rotary_emb=t.cross_attn_audio_rope(a_coords[:, 0:1], device=hidden.device))
        key_mask = None
        if padded != n:
            key_mask = torch.zeros(1, 1, 1, padded, device=hidden.device)
            key_mask[..., n:] = NEG_INF
        if t.transformer_blocks[0].attn1.processor is not sp._self_attention:  # noqa: SLF001
            sp.activate()  # another job used the shared transformer since
        # the block loop's tensor inputs, contiguous (a CUDA graph's static copies are; eager runs on the same layout)
        inputs = dict(hidden=hidden, audio_hidden=audio_hidden, v_ctx=v_ctx, a_ctx=a_ctx, text_mask=text_mask,
                      temb=temb, temb_audio=temb_audio, video_ca_ss=video_ca_ss, audio_ca_ss=audio_ca_ss,
                      a2v_gate=a2v_gate, v2a_gate=v2a_gate, temb_prompt=temb_prompt,
                      temb_prompt_audio=temb_prompt_audio, key_mask=key_mask,
                      guide_log_w=p.bias.log_w if p.bias is not None else None)
        for name, (cos, sin) in rope.items():
            inputs[name + "_cos"], inputs[name + "_sin"] = cos, sin
        inputs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        guide_start = p.bias.guide_start if p.bias is not None else None
        stg = options.stg_self_attn_blocks
        with skip_self_attention(t, stg, stg):
            hidden, audio_hidden = self._blocks(sp, options, guide_start, inputs)
        shift, scale = (t.scale_shift_table[None, None].to(dt) + emb[:, :, None]).unbind(dim=2)
        out = t.proj_out(t.norm_out(hidden) * (1 + scale) + shift)
        out = sp.exchange.all_gather_seq(out)[:, :n]
        a_shift, a_scale = (t.audio_scale_shift_table[None, None].to(dt) + a_emb[:, :, None]).unbind(dim=2)
        audio_out = t.audio_proj_out(t.audio_norm_out(audio_hidden) * (1 + a_scale) + a_shift)
        return out, audio_out[:, p.ref_steps:]

    def _blocks(self, sp: SequenceParallelTransformer, options: ForwardOptions, guide_start: int | None,
                inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The block loop on `inputs` (`run_rows`' tensors), replayed from CUDA graphs where it can be
        (`cuda_graphs.call`, keyed on the tensors' shapes, the installed processors — STG's skipped self-attention,
        the sequence-parallel group — and the options below; piecewise around the sequence-parallel collectives).
        The guide bias's weights and the padding key mask are graph inputs, so a replay honours new values. A forward
        that cannot be captured runs eagerly; the reason is logged once by name and kept for the report."""
        def loop(**kw):
            return self._run_blocks(sp, options, guide_start, kw)

        if cuda_graphs.eligible(inputs) is not None:  # a CPU forward, or graphs set off
            return loop(**inputs)
        cache = cuda_graphs.graphs_of(self.transformer)
        seen = len(cache.events)
        extra = ("native blocks", options.stg_self_attn_blocks, options.run_vx, options.run_ax,
                 options.a2v_cross_attn, options.v2a_cross_attn, guide_start, COMFY_QK_EPS)
        out = cuda_graphs.call(self.transformer, loop, inputs, extra=extra, what="native forward")
        for reason in cache.events[seen:]:
            log.warning("native forward runs eagerly: %s", reason)
        self.graph_fallbacks.extend(cache.events[seen:])
        return out

    def _run_blocks(self, sp: SequenceParallelTransformer, options: ForwardOptions, guide_start: int | None,
                    kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """ComfyUI's blocks in order on `kw` (a pure function of those tensors and the arguments)."""
        t = self.transformer
        rope = {name: (kw[name + "_cos"], kw[name + "_sin"]) for name in _ROPE}
        hidden, audio_hidden = kw["hidden"], kw["audio_hidden"]
        log_w = kw["guide_log_w"]
        sp.state.key_mask = kw["key_mask"]
        sp.state.self_attention = GuideBias(guide_start, log_w).attend if log_w is not None else None
        try:
            for block in gathered(t.transformer_blocks):  # sharded weights: each block gathered as it runs
                hidden, audio_hidden = comfy_block(
                    block, hidden, audio_hidden, v_ctx=kw["v_ctx"], a_ctx=kw["a_ctx"], text_mask=kw["text_mask"],
                    temb=kw["temb"], temb_audio=kw["temb_audio"], video_ca_ss=kw["video_ca_ss"],
                    audio_ca_ss=kw["audio_ca_ss"], a2v_gate=kw["a2v_gate"], v2a_gate=kw["v2a_gate"],
                    temb_prompt=kw["temb_prompt"], temb_prompt_audio=kw["temb_prompt_audio"], rope=rope,
                    run_vx=options.run_vx, run_ax=options.run_ax, a2v=options.a2v_cross_attn,
                    v2a=options.v2a_cross_attn)
        finally:
            sp.state.key_mask = sp.state.self_attention = None
        return hidden, audio_hidden

    def unpack(self, p: _Prepared, video: torch.Tensor, audio: torch.Tensor, dtype: torch.dtype):
        """Packed outputs -> ComfyUI's `[B, 128, F, H, W]` (dropped tokens zero) and `[B, 8, T, 16]`, CPU, `dtype`."""
        f, h, w = p.full_shape
        b = video.shape[0]
        if p.keep is not None:
            full = video.new_zeros(b, f * h * w, video.shape[-1])
            full[:, p.keep] = video
            video = full
        video = video.reshape(b, f, h, w, -1).permute(0, 4, 1, 2, 3)
        audio = audio.reshape(b, p.audio_steps, 8, -1).permute(0, 2, 1, 3)
        return video.to("cpu", dtype).contiguous(), audio.to("cpu", dtype).contiguous()

    def forward(self, request: ForwardRequest, context: torch.Tensor):
        """Run the request (called on every rank of the fleet in lockstep). Returns `(video, audio)` in ComfyUI's
        layout and the request's dtype on the ranks that hold the result (rank 0 always), else `(None, None)`."""
        t0 = time.perf_counter()
        o = request.options
        with torch.no_grad(), comfy_qk_eps(self._qk_norms):
            p = self.prepare(request, context)
            rows = list(range(request.batch))
            run = None
            if self.plan is not None and self.plan.world_size > 1:
                nbytes = 4 * (p.video.shape[1] + p.audio.shape[1]) * 128  # one row's outputs, float32
                run = self.plan.split("forward", p.video.shape[1], request.batch, nbytes)
            if run is not None and run.kind == "passes":
                from .parallel.passes import PassParallel

                if self.plan.rank >= run.degree:
                    return None, None
                spread = PassParallel(run.group, run.degree, self.plan.rank, self.plan._comm_device())  # noqa: SLF001
                rows_out = spread([_Row(r) for r in rows], lambda r: self.run_rows(p, [r.index], self._local, o))
                video = torch.cat([v for v, _ in rows_out])
                audio = torch.cat([a for _, a in rows_out])
                self.last_report = run.split.describe(self.plan.world_size).replace("guidance passes", "batch rows")
            else:
                sp = self._local if run is None or run.forward is None else run.forward
                if run is not None and self.plan.rank >= run.degree:
                    return None, None
                video, audio = self.run_rows(p, rows, sp, o)
                self.last_report = self.plan.describe() if run is not None else "one rank"
            self.forwards += 1
            out = self.unpack(p, video, audio, request.video.dtype)
        self.last_seconds = time.perf_counter() - t0
        return out

    # ---- text ----
    def preprocess_text(self, request: PreprocessTextRequest) -> torch.Tensor:
        """ComfyUI `LTXAVModel.preprocess_text_embeds(context, unprocessed)` -> `[B, L, C_out]` in the request's
        dtype (CPU); stores the rows under `request.cache_keys`."""
        if not isinstance(request, PreprocessTextRequest):
            raise ForwardContractError(f"preprocess_text payload: expected a PreprocessTextRequest, got "
                                       f"{type(request).__name__}")
        ctx = request.context
        self.last_lora_reports = []
        if not request.unprocessed and ctx.shape[-1] == self.context_width:
            out = ctx.to(self.device, self.dtype)
        else:
            rows = [ctx[i:i + 1].to(self.device, torch.float32) for i in range(ctx.shape[0])]
            files = patch_loras(self._resolve_lora(request.lora), connectors=True) if request.lora else []
            if files:  # fused for this call only (every rank, in lockstep), restored exactly after it
                self.last_lora_reports = [r.detail() for r in self.connector_lora.fuse(files)]
            try:
                with torch.no_grad(), comfy_qk_eps(self._connector_qk_norms):
                    tc = text_contexts(self.components, rows, dtype=self.dtype)
            except ValueError as exc:
                raise ValidationError(str(exc)) from None
            finally:
                self.connector_lora.restore()
            out = torch.cat([tc.video, tc.audio], dim=-1)
        if request.cache_keys:
            self.store_context(request.cache_keys, out)
        return out.to("cpu", ctx.dtype).contiguous()


@dataclass(frozen=True)
class _Row:
    """One batch row as a "pass" of `PassParallel` (its `kind` names it in errors)."""

    index: int

    @property
    def kind(self) -> str:
        return f"batch row {self.index}"


__all__ = ["COMFY_QK_EPS", "CONNECTOR_PREFIXES", "ContextCache", "GuideBias", "NativeEngine", "NotSupported",
           "PatchLoRA", "audio_coords", "comfy_block", "comfy_qk_eps", "downsample_pixel_mask", "guide_bias",
           "patch_loras", "qk_norms", "video_pixel_coords"]
