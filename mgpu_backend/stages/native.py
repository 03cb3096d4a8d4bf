"""The engine side of the native ComfyUI MODEL (issue 19): ComfyUI 0.33's LTX-AV forward on plain tensors.

`NativeEngine.forward(request)` reproduces `comfy.ldm.lightricks.av_model.LTXAVModel.forward` (ComfyUI 0.33.0, which
includes the upstream AdaLN sigma fix Comfy-Org/ComfyUI#14097) on the pack's resident diffusers
`LTX2VideoTransformer3DModel`: `prepare` turns the request into the engine's one `TokenBatch` with ComfyUI's inputs,
and `run_rows` runs the engine's one forward (`model_forward.run`) on it under the `COMFYUI` semantics (ComfyUI's
block order and q/k eps). ComfyUI's inputs:
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
- ComfyUI's block (`model_forward.comfy_block`): the video→audio cross-attention normalizes the video stream after the block's
  audio→video update (diffusers' block uses the video from before it); `run_vx` / `run_ax` False skip a stream's
  updates;
- reference-audio tokens at timestep 0, cut from the output; q/k RMS-norm eps 1e-5 (ComfyUI's, instead of the
  reference's 1e-6) in the transformer and the connectors while a native request runs.
LoRA: a request's `LoraSet` is fused into the resident weights by the fleet's `LoRAFuser` (each rank computes its
share of the layers, broadcast to all) and kept while the following requests name the same key; `lora=None` restores
the clean weights exactly. Its patches of the text connectors are fused for a `preprocess_text` call only.
Not supported yet, refused by name: a video-only call, `generated_keyframes` on a model with the LTX-2.5 keyframe
embedding.

Parallel: the plans of `splits/forward_plan.py` over the one forward — the video tokens split over the
sequence-parallel group (`SEQUENCE`: Ulysses video self-attention, gathered K/V for video→audio), or a batch's rows
spread over ranks (`ROWS`: the guidance-pass split of `splits/passes.py`, each rank one whole forward per row) —
`ParallelPlan.split` decides once per request (the cost model on CUDA,
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

from ..engine import cuda_graphs, forward as model_forward
from ..engine.attention import GuideBias
from ..engine.denoiser import skip_self_attention, text_contexts
from ..protocol.job_memory import GRAPH_GAIN, gain
from ..protocol.native_forward import ForwardContractError, ForwardOptions, ForwardRequest, GuideAttentionEntry, LoraSet, PreprocessTextReply, PreprocessTextRequest
from ..weights.lora import LoRAFile, LoRAFuser, LoRAPair
from ..engine.forward import Split, comfy_block, qk_eps, qk_norms  # noqa: F401 (re-exported)
from ..engine.latents import VAE_SPATIAL_COMPRESSION
from ..models import keymaps
from ..splits.apply import apply_plan
from ..splits.dispatch import dispatch
from ..splits.exchange import Exchange
from ..splits.sequence import UlyssesSplit
from ..engine.semantics import COMFYUI
from ..engine.tokens import TokenBatch
from ..protocol.validation import ValidationError

log = logging.getLogger("ltx2_mgpu.native")
COMFY_QK_EPS = COMFYUI.qk_eps  # ComfyUI's q/k RMSNorm eps (comfy/ldm/lightricks/model.py CrossAttention)
VAE_SCALE = (8, 32, 32)  # LTX-2 video VAE: time, height, width compression
AUDIO_HOP, AUDIO_RATE, AUDIO_DOWNSAMPLE = 160, 16000, 4  # ComfyUI AudioPatchifier defaults for LTX-AV


class NotSupported(ValidationError):
    """A request ComfyUI's forward accepts that the fleet does not run yet (named, never ignored)."""


@contextlib.contextmanager
def comfy_qk_eps(norms: list[torch.nn.Module], eps: float = COMFY_QK_EPS):
    """Within the block, the q/k RMSNorms `norms` (`qk_norms`) use `eps` (ComfyUI's by default); restored after."""
    with qk_eps(norms, eps):
        yield


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


# ---- one forward ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Prepared:
    """A request turned into the one forward's `TokenBatch` for the whole batch (before any row or token split),
    with what `unpack` needs to give ComfyUI its layout back."""

    batch: TokenBatch
    keep: torch.Tensor | None  # [N_full] bool (None: nothing dropped)
    full_shape: tuple[int, int, int]  # (F, H, W)
    audio_steps: int


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
        # the text connectors as one module (names `video_connector.…`, `audio_connector.…`): their LoRA patches are
        # fused for a preprocess_text call and restored after it
        self.connectors = torch.nn.ModuleDict({"video_connector": components.video_connector,
                                               "audio_connector": components.audio_connector})
        self.connector_lora = (LoRAFuser(self.connectors) if plan is None else
                               LoRAFuser(self.connectors, rank=plan.rank, world_size=plan.world_size))
        # a degree-1 sequence split: the same processors (and the guide-bias kernel) without collectives
        self.local_split = UlyssesSplit(Exchange(None, 1, 0))
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
            h, w = request.video.shape[-2:]
            self.plan.check(request.video_tokens, h * w, f"{w * VAE_SPATIAL_COMPRESSION}×{h * VAE_SPATIAL_COMPRESSION}")

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

    def apply_lora(self, request: ForwardRequest) -> tuple[str, ...]:
        """Make the request's LoRA set the fused one (every rank, in lockstep): nothing when it is fused already,
        the clean weights for `lora=None`. Returns the fused set's coverage, one line per strength group
        (`ForwardReply.lora_reports`; () without a LoRA). Raises LoRAError (a ValidationError) before any weight is
        touched when the patches do not fit this model."""
        if request.lora is None:
            self.lora.apply([])
            return ()
        self._resolve_lora(request.lora)
        return tuple(r.detail() for r in self.lora.apply(self._lora_files))

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
        dv = context.shape[-1] // 2 if cfg.use_prompt_embeddings else cfg.num_attention_heads * cfg.attention_head_dim
        batch = TokenBatch(
            video=video, audio=audio, video_timestep=v_scaled, audio_timestep=a_scaled,
            video_cross_timestep=v_scaled, audio_cross_timestep=a_scaled,
            # the gates from the whole batch's maxima (ComfyUI), so a row computed alone equals it in its batch
            a2v_gate_timestep=(a_scaled.max() * gate_factor).expand(b),
            v2a_gate_timestep=(v_scaled.max() * gate_factor).expand(b),
            video_coords=seconds, audio_coords=audio_coords(b, t_steps, ref, dev),
            video_context=context[..., :dv], audio_context=context[..., dv:],
            video_prompt_timestep=v_scaled.max(dim=1).values, audio_prompt_timestep=a_scaled.max(dim=1).values,
            video_text_bias=text_mask, audio_text_bias=text_mask, keyframe_marker=marker,
            guide_log_w=None if bias is None else bias.log_w, guide_start=None if bias is None else bias.guide_start,
            audio_prefix=ref)
        return _Prepared(batch, keep, (f, h, w), t_steps)

    # ---- run ----
    def run_rows(self, p: _Prepared, rows: list[int], split: Split,
                 options: ForwardOptions) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of batch `rows` under `split` (its group; degree 1: local), whose plan the caller applied
        (`splits.apply.apply_plan`): the one forward (`model_forward.run`, ComfyUI's semantics; replayed from CUDA
        graphs where it can be — a forward that cannot be captured runs eagerly, the reason logged once by name and
        kept for the report). -> packed video `[b, N, 128]` (kept tokens) and audio `[b, T, 128]` (reference tokens
        cut), on every rank of the group."""
        t = self.transformer
        batch = p.batch.select_rows(rows)
        cache = cuda_graphs.graphs_of(t) if batch.video.is_cuda and cuda_graphs.mode() != "off" else None
        seen = len(cache.events) if cache is not None else 0
        stg = options.stg_self_attn_blocks
        with skip_self_attention(t, stg, stg):
            out = model_forward.run(t, batch, COMFYUI, split, options, what="native forward")
        if cache is not None:
            for reason in cache.events[seen:]:
                log.warning("native forward runs eagerly: %s", reason)
            self.graph_fallbacks.extend(cache.events[seen:])
        return out

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

    def forward(self, request: ForwardRequest, context: torch.Tensor) -> NativeForwardResult:
        """Run the request (called on every rank of the fleet in lockstep). Returns a `NativeForwardResult`: video
        and audio in ComfyUI's layout and the request's dtype on the ranks that hold the result (rank 0 always),
        else None; how the fleet ran it; the wall time."""
        t0 = time.perf_counter()
        o = request.options
        with torch.no_grad(), comfy_qk_eps(self._qk_norms):
            p = self.prepare(request, context)
            rows = list(range(request.batch))
            fleet = self.plan if self.plan is not None and self.plan.world_size > 1 else None
            nbytes = 4 * (p.batch.video.shape[1] + p.batch.audio.shape[1]) * 128  # one row's outputs, float32
            chosen = dispatch(fleet, "forward", p.batch.video.shape[1], request.batch, nbytes)
            if not chosen.joins:
                return NativeForwardResult(None, None, "", time.perf_counter() - t0)
            split = chosen.split or self.local_split
            # applied once and left in place for the next request (a no-op while it stays): a stage job applies its
            # own plan before it runs, and removes it after
            apply_plan(self.transformer, split.plan, split.exchange)
            eager_before = len(self.graph_fallbacks)
            if chosen.kind == "passes":
                rows_out = chosen.spread([_Row(r) for r in rows], lambda r: self.run_rows(p, [r.index], split, o))
                video = torch.cat([v for v, _ in rows_out])
                audio = torch.cat([a for _, a in rows_out])
                report = chosen.run.split.describe(self.plan.world_size).replace("guidance passes", "batch rows")
            else:
                video, audio = self.run_rows(p, rows, split, o)
                report = self.plan.describe(chosen.run.report) if chosen.run is not None else "one rank"
            self.forwards += 1
            per_rank = p.batch.video.shape[1] // (chosen.run.degree if chosen.kind == "sequence" else 1)
            slowdowns = eager_cost(self.graph_fallbacks[eager_before:], per_rank)
            video, audio = self.unpack(p, video, audio, request.video.dtype)
        return NativeForwardResult(video, audio, report, time.perf_counter() - t0, slowdowns)

    # ---- text ----
    def preprocess_text(self, request: PreprocessTextRequest) -> PreprocessTextReply:
        """ComfyUI `LTXAVModel.preprocess_text_embeds(context, unprocessed)` -> a `PreprocessTextReply`: the context
        `[B, L, C_out]` in the request's dtype (CPU) and the coverage of the connector LoRA patches fused for the
        call; stores the rows under `request.cache_keys`."""
        if not isinstance(request, PreprocessTextRequest):
            raise ForwardContractError(f"preprocess_text payload: expected a PreprocessTextRequest, got "
                                       f"{type(request).__name__}")
        ctx = request.context
        lora_reports: tuple[str, ...] = ()
        if not request.unprocessed and ctx.shape[-1] == self.context_width:
            out = ctx.to(self.device, self.dtype)
        else:
            rows = [ctx[i:i + 1].to(self.device, torch.float32) for i in range(ctx.shape[0])]
            files = patch_loras(self._resolve_lora(request.lora), connectors=True) if request.lora else []
            if files:  # fused for this call only (every rank, in lockstep), restored exactly after it
                lora_reports = tuple(r.detail() for r in self.connector_lora.fuse(files))
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
        return PreprocessTextReply(out.to("cpu", ctx.dtype).contiguous(), lora_reports)


@dataclass(frozen=True)
class NativeForwardResult:
    """What `NativeEngine.forward` returns on every rank.

    video: `[B, 128, F, H, W]` and audio: `[B, 8, T, 16]` in ComfyUI's layout and the request's dtype (CPU) on the ranks
    that hold the result (rank 0 always), else None. report: how the fleet ran it (`ForwardReply.report`; "" on a
    rank that held no part). seconds: this rank's wall time of the forward. slowdowns: `ForwardReply.slowdowns`.
    """

    video: torch.Tensor | None
    audio: torch.Tensor | None
    report: str
    seconds: float
    slowdowns: tuple[str, ...] = ()


def eager_cost(reasons: list[str], tokens: int) -> tuple[str, ...]:
    """`ForwardReply.slowdowns` for forwards that ran eagerly (cuda_graphs' reasons) at `tokens` video tokens per
    rank: each reason with the share of a forward's time graphs save there (`protocol.job_memory.GRAPH_GAIN`)."""
    cost = gain(GRAPH_GAIN, tokens)
    return tuple(f"{reason}: forwards eager, ~{100 * cost:.0f} % slower at {tokens:,} video tokens per rank"
                 for reason in dict.fromkeys(reasons))


@dataclass(frozen=True)
class _Row:
    """One batch row as a "pass" of `PassParallel` (its `kind` names it in errors)."""

    index: int

    @property
    def kind(self) -> str:
        return f"batch row {self.index}"


__all__ = ["COMFY_QK_EPS", "CONNECTOR_PREFIXES", "ContextCache", "GuideBias", "NativeEngine", "NativeForwardResult", "NotSupported",
           "PatchLoRA", "audio_coords", "comfy_block", "comfy_qk_eps", "downsample_pixel_mask", "guide_bias",
           "patch_loras", "qk_norms", "video_pixel_coords"]
