"""ComfyUI's LTX-AV forward arguments -> the engine's `ForwardRequest` (mgpu_backend/protocol/native_forward.py), and the reply back.

Importable without ComfyUI: plain tensors and dicts in, contract objects out (tests build the arguments by hand the
way ComfyUI 0.33's `model_base.LTXAV._apply_model` / `LTXAVModel.forward` pass them; docs/design/native-model.md lists
them).

Context caching: ComfyUI passes the same processed text context at every step of a sampling (~90 % of a forward's
bytes). Each batch row gets a key `"<cond uuid>/<row>:<digest>"` — the conditioning's uuid (stable within one
sampling, `transformer_options["uuids"]`) plus a digest of the row's shape, dtype and a strided sample of its values
(cheap on a 24 MiB tensor; it catches a row whose values changed under the same uuid). The request carries the
context only when the fleet is not known to hold every row's key; a `ForwardMiss` makes the caller resend it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

try:  # inside ComfyUI the pack is one package (mangled name); tests import `nodes` and `mgpu_backend` top-level
    from ..mgpu_backend.protocol import native_forward as F
except ImportError:
    from mgpu_backend.protocol import native_forward as F
from .native_patches import refuse_transformer_options
from .native_types import UnsupportedInput

DIGEST_SAMPLES = 4096  # values of a context row that enter its cache-key digest (strided over the whole row)

# forward keyword arguments that carry nothing the forward computes with (or that are handled before)
_IGNORED_KWARGS = {"audio_denoise_mask", "latent_shapes", "a_timestep", "c_concat", "y"}
_KNOWN_KWARGS = {"denoise_mask", "guide_attention_entries", "ref_audio", "generated_keyframes", "control"}


def row_digest(row: torch.Tensor) -> str:
    """A short digest of one context row `[L, C]`: shape, dtype and DIGEST_SAMPLES strided values (exact bytes)."""
    flat = row.detach().reshape(-1)
    step = max(1, flat.numel() // DIGEST_SAMPLES)
    sample = flat[::step][:DIGEST_SAMPLES].float().contiguous().cpu()
    h = hashlib.blake2b(digest_size=10)
    h.update(repr((tuple(row.shape), str(row.dtype))).encode())
    h.update(sample.numpy().tobytes())
    return h.hexdigest()


def _per_row(values: list, batch: int, what: str) -> list:
    """ComfyUI lists one entry per batched conditioning chunk (`uuids`, `cond_or_uncond`); a chunk may hold several
    rows (a latent batch > 1): spread each entry over its rows."""
    if not values:
        return []
    if batch % len(values) != 0:
        raise UnsupportedInput(f"{what} lists {len(values)} chunks for a batch of {batch} rows")
    per = batch // len(values)
    return [(v, i) for v in values for i in range(per)]


def context_keys(context: torch.Tensor, transformer_options: dict) -> tuple[str, ...]:
    """One cache key per row of `context` `[B, L, C]` (module docstring); () when ComfyUI gave no uuids."""
    uuids = list(transformer_options.get("uuids") or ())
    rows = _per_row(uuids, context.shape[0], "transformer_options['uuids']")
    return tuple(f"{u}/{i}:{row_digest(context[b])}" for b, (u, i) in enumerate(rows))


def _options(transformer_options: dict) -> F.ForwardOptions:
    blocks = transformer_options.get("stg_self_attn_blocks", ()) or ()
    return F.ForwardOptions(
        stg_self_attn_blocks=tuple(int(b) for b in blocks),
        a2v_cross_attn=bool(transformer_options.get("a2v_cross_attn", True)),
        v2a_cross_attn=bool(transformer_options.get("v2a_cross_attn", True)),
        run_vx=bool(transformer_options.get("run_vx", True)),
        run_ax=bool(transformer_options.get("run_ax", True)))


def _guide_entries(entries) -> tuple[F.GuideAttentionEntry, ...]:
    out = []
    for e in entries or ():
        shape = e.get("latent_shape")
        mask = e.get("pixel_mask")
        out.append(F.GuideAttentionEntry(
            pre_filter_count=int(e["pre_filter_count"]), strength=float(e.get("strength", 1.0)),
            pixel_mask=None if mask is None else mask.detach().float().cpu(),
            latent_shape=None if shape is None else tuple(int(s) for s in list(shape)[-3:])))
    return tuple(out)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


@dataclass(frozen=True, eq=False)
class ComfyForwardCall:
    """The arguments of ComfyUI 0.33's `LTXAVModel.forward(x, timestep, context, attention_mask, frame_rate,
    transformer_options, keyframe_idxs, **kwargs)`, as the MGPU model's forward receives them.

    x: `[video [B,128,F,H,W], audio [B,8,T,16]]` (a one-element list: video only). timestep: `(video, audio)` from
    `model_base.LTXAV.process_timestep`, or one tensor. context: `[B, L, C]` or None. attention_mask: the text mask
    or None. frame_rate: frames per second. transformer_options: ComfyUI's dict (None: empty). keyframe_idxs: the
    guides' positions or None. kwargs: the other keyword arguments (denoise_mask, ref_audio, …).
    """

    x: Any
    timestep: Any
    context: Any
    attention_mask: Any = None
    frame_rate: float = 25
    transformer_options: dict | None = None
    keyframe_idxs: Any = None
    kwargs: dict | None = None


def build_request(call: ComfyForwardCall, known_contexts: set | frozenset = frozenset(),
                  lora: F.LoraSet | None = None) -> F.ForwardRequest:
    """A `ComfyForwardCall` -> ForwardRequest (tensors moved to the CPU, dtypes kept). known_contexts: the row keys
    the fleet is known to hold (the context is then left out); lora: the patcher's LoRA set (None: none). Raises
    UnsupportedInput naming an argument the fleet cannot honour."""
    x, timestep, context, attention_mask = call.x, call.timestep, call.context, call.attention_mask
    frame_rate, keyframe_idxs = call.frame_rate, call.keyframe_idxs
    transformer_options = call.transformer_options or {}
    kwargs = dict(call.kwargs or {})
    refuse_transformer_options(transformer_options)
    if kwargs.get("control") is not None:
        raise UnsupportedInput("ControlNet (a 'control' input) cannot run on the fleet: the MGPU model's transformer "
                               "is in other processes")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN_KWARGS | _IGNORED_KWARGS)
    if unknown:
        raise UnsupportedInput(f"model input(s) {', '.join(unknown)} are not known to the MGPU model's forward")
    if torch.is_tensor(x) or not isinstance(x, (list, tuple)) or not 1 <= len(x) <= 2:
        raise UnsupportedInput("the MGPU model takes an audio+video latent (LTXVConcatAVLatent) or a video latent "
                               "as ComfyUI's LTX-AV model receives it (a list of tensors)")
    video, audio = x[0], (x[1] if len(x) > 1 else None)
    if audio is not None and audio.numel() == 0:
        audio = None
    if isinstance(timestep, (tuple, list)) and len(timestep) == 2:
        v_t, a_t = timestep
    else:
        v_t, a_t = timestep, kwargs.get("a_timestep", timestep)
    if audio is None:
        a_t = None
    batch = video.shape[0]
    keys = context_keys(context, transformer_options) if context is not None else ()
    send_context = not keys or not all(k in known_contexts for k in keys)
    denoise_mask = kwargs.get("denoise_mask")
    if keyframe_idxs is None or denoise_mask is None or not bool((denoise_mask < 0).any()):
        denoise_mask = None  # the forward reads only its −1 cells, and only with guides (protocol/native_forward.py)
    ref_audio = kwargs.get("ref_audio")
    ref_tokens = None
    if ref_audio is not None:
        ref_tokens = ref_audio["tokens"] if isinstance(ref_audio, dict) else ref_audio
    gk = kwargs.get("generated_keyframes")
    if gk is not None:
        gk = F.GeneratedKeyframes(int(gk["tokens_per_frame"]), int(gk["first_latent_frame"]),
                                  int(gk["num_keyframes"]))
    tags = [t for t, _ in _per_row(list(transformer_options.get("cond_or_uncond") or ()), batch,
                                   "transformer_options['cond_or_uncond']")]
    fr = frame_rate
    if torch.is_tensor(fr):
        fr = float(fr.reshape(-1)[0])
    return F.ForwardRequest(
        video=_cpu(video), audio=_cpu(audio), video_timestep=_cpu(v_t).float(),
        audio_timestep=None if a_t is None else _cpu(a_t).float(),
        context=_cpu(context) if send_context else None, context_keys=keys, frame_rate=float(fr),
        attention_mask=_cpu(attention_mask), keyframe_idxs=_cpu(keyframe_idxs), denoise_mask=_cpu(denoise_mask),
        guide_attention_entries=_guide_entries(kwargs.get("guide_attention_entries")),
        ref_audio_tokens=_cpu(ref_tokens), generated_keyframes=gk, options=_options(transformer_options),
        cond_or_uncond=tuple(int(t) for t in tags), lora=lora)


def with_context(request: F.ForwardRequest, context: torch.Tensor) -> F.ForwardRequest:
    """The same request carrying the context (after a ForwardMiss)."""
    import dataclasses

    return dataclasses.replace(request, context=_cpu(context))


def reply_output(reply: F.ForwardReply, x) -> Any:
    """ForwardReply -> what ComfyUI's LTX-AV forward returns: `[video, audio]` (video alone without audio) in the
    input's device and dtype."""
    video = x[0]
    v = reply.video.to(device=video.device, dtype=video.dtype)
    if reply.audio is None:
        return v
    return [v, reply.audio.to(device=video.device, dtype=video.dtype)]


def lora_set(patches: dict, key: str, known: bool) -> F.LoraSet | None:
    """The sampling patcher's patches -> LoraSet (None without patches). `known`: the fleet holds `key` (the patches
    are left out). Raises UnsupportedInput for anything but plain LoRAs on weights (native_patches.lora_terms)."""
    from .native_patches import lora_terms

    if not patches:
        return None
    if known:
        return F.LoraSet(key, None)
    terms = lora_terms(patches)
    out = []
    for t in terms:
        if not t.key.endswith(".weight"):
            raise UnsupportedInput(f"a LoRA on {t.key} (not a Linear weight) cannot be applied on the fleet")
        out.append(F.LoraPatch(module=t.key[: -len(".weight")], down=t.down.detach().cpu(),
                               up=t.up.detach().cpu(), alpha=t.alpha, strength=t.strength))
    return F.LoraSet(key, tuple(out))

