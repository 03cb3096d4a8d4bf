"""The LTX-2 checkpoint's text "feature extractor" (`text_embedding_projection.*`) and ComfyUI's CONDITIONING form.

Gemma's stacked hidden states `[B, T, H, L]` (H = 3840, L = 49 for Gemma 3 12B) become per-token text features:

* LTX-2.0 ("2.0"): per sample and per layer, masked mean / range normalization over (valid tokens, H):
  `8 · (x - mean) / (max - min + 1e-6)` (mean = masked sum / (n_valid·H + 1e-6)), padded positions set to 0,
  flattened to `[B, T, H·L]`, then ONE Linear `aggregate_embed` H·L -> H **without bias** -> `[B, T, 3840]`.
  Source: ltx-core `text_encoders/gemma/feature_extractor.py` (`_norm_and_concat_padded_batch`,
  `FeatureExtractorV1`, built with `bias=False` in `encoder_configurator.py`), diffusers
  `pipelines/ltx2/connectors.py::per_layer_masked_mean_norm`; ComfyUI `text_encoders/lt.py` computes the same on
  the un-padded tokens (`Linear(3840*49, 3840, bias=False)`).
* LTX-2.3 ("2.3"): per-token RMS norm over H (`x · rsqrt(mean(x², H) + 1e-6)`), padded positions 0, flattened,
  then `video_aggregate_embed` (H·L -> 4096, with bias) applied to `normed · sqrt(4096 / H)` and
  `audio_aggregate_embed` (H·L -> 2048, with bias) applied to `normed · sqrt(2048 / H)`, concatenated
  video-then-audio -> `[B, T, 6144]`. Source: ltx-core `norm_and_concat_per_token_rms` / `FeatureExtractorV2`,
  diffusers `per_token_rms_norm` + `video_text_proj_in` / `audio_text_proj_in`, ComfyUI `lt.py::DualLinearProjection`
  (which concatenates `(video, audio)`; the transformer splits at its video cross-attention width,
  `av_model.py::preprocess_text_embeds`).

* LTX-2.5: the 2.3 formula (`dual_linear`: ComfyUI `lt.py::DualLinearProjection`, chosen by `sd_detect` from the
  `video_aggregate_embed` / `audio_aggregate_embed` keys) on Gemma 4 12B's hidden states; the projection is bundled
  in the Gemma 4 text-encoder file (`text_encoders/gemma4-12b-with-proj-ltx-2.5-*`, prefix
  `text_embedding_projection.`) and its sizes follow the Gemma config: in_features = hidden_size ·
  (num_hidden_layers + 1) (3840 · 49), video 4096 + audio 2048 for the 12B (`load_bundled_projection`).

Checkpoint keys (prefix `text_embedding_projection.`): 2.0 `aggregate_embed.weight` [3840, 188160] (ComfyUI's
re-saved files may use the bare `weight`); 2.3 `video_aggregate_embed.{weight,bias}` [4096, 188160] / [4096] and
`audio_aggregate_embed.{weight,bias}` [2048, 188160] / [2048] (also the layout of Kijai's
`ltx-2.3_text_projection_bf16.safetensors`).

ComfyUI CONDITIONING (`CLIPTextEncode` with an LTX-2 Gemma CLIP): `[[cond, {"pooled_output": None,
"unprocessed_ltxav_embeds": True}]]`, `cond` float32 `[1, n_valid, C]`: ComfyUI left-pads the prompt to 1024 tokens,
then cuts the padding off (`out[:, :, -sum(attention_mask):]`) BEFORE the feature extractor and returns a fresh
`extra` dict, so NO attention mask and no padding travel in the CONDITIONING. `LTXVConditioning` then adds
`"frame_rate"`. The connectors run at sampling time (`LTXAV.extra_conds` -> `preprocess_text_embeds`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .families import PROJECTION_DUAL, PROJECTION_SINGLE

DEFAULT_PREFIX = "text_embedding_projection."
KIND_MODELS = {PROJECTION_SINGLE: "LTX-2.0", PROJECTION_DUAL: "LTX-2.3 / 2.5"}  # for messages
EPS = 1e-6
SCALE_2_0 = 8.0
LTX23_VIDEO_DIM = 4096
LTX23_AUDIO_DIM = 2048


def masked_mean_range_norm(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """LTX-2.0 normalization. `[B,T,H,L]` float, mask `[B,T]` -> `[B,T,H·L]` float32, padded positions 0.

    Formula from ltx-core `feature_extractor.py::_norm_and_concat_padded_batch` (see module docstring).
    """
    x = hidden_states.float()
    b, _, h, l = x.shape  # noqa: E741
    valid = attention_mask.to(x.device).bool()[:, :, None, None]
    n = attention_mask.to(x.device).sum(dim=1).float()
    mean = x.masked_fill(~valid, 0.0).sum(dim=(1, 2), keepdim=True) / (n * h).view(b, 1, 1, 1).add(EPS)
    x_min = x.masked_fill(~valid, float("inf")).amin(dim=(1, 2), keepdim=True)
    x_max = x.masked_fill(~valid, float("-inf")).amax(dim=(1, 2), keepdim=True)
    normed = SCALE_2_0 * (x - mean) / (x_max - x_min + EPS)
    return normed.masked_fill(~valid, 0.0).reshape(b, -1, h * l)


def per_token_rms_norm(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """LTX-2.3 normalization. `[B,T,H,L]` float, mask `[B,T]` -> `[B,T,H·L]` float32, padded positions 0.

    Formula from ltx-core `feature_extractor.py::norm_and_concat_per_token_rms`.
    """
    x = hidden_states.float()
    b, t, h, l = x.shape  # noqa: E741
    normed = x * torch.rsqrt(x.pow(2).mean(dim=2, keepdim=True) + EPS)
    valid = attention_mask.to(x.device).bool()[:, :, None, None]
    return normed.masked_fill(~valid, 0.0).reshape(b, t, h * l)


class TextProjection(nn.Module):
    """The checkpoint's feature extractor (module docstring has formulas and sources).

    Attributes:
        kind: "single_linear" (LTX-2.0: one `aggregate_embed`, no bias) or "dual_linear" (LTX-2.3 / 2.5:
            `video_aggregate_embed` + `audio_aggregate_embed`); ComfyUI `lt.py::sd_detect` names,
            `families.PROJECTION_SINGLE` / `PROJECTION_DUAL`.
        in_features: H·L (188160 for Gemma 3 12B).
        out_features: 3840 (2.0) or video + audio widths, 6144 (2.3).
        video_dim: output width of the video part (3840 for 2.0, 4096 for 2.3).
    """

    def __init__(self, kind: str, in_features: int, out_features: int | tuple[int, int],
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if kind == PROJECTION_SINGLE:
            self.aggregate_embed = nn.Linear(in_features, int(out_features), bias=False, dtype=dtype, device=device)
            self.video_dim = int(out_features)
            self.out_features = int(out_features)
        elif kind == PROJECTION_DUAL:
            v, a = out_features
            self.video_aggregate_embed = nn.Linear(in_features, v, bias=True, dtype=dtype, device=device)
            self.audio_aggregate_embed = nn.Linear(in_features, a, bias=True, dtype=dtype, device=device)
            self.video_dim = v
            self.out_features = v + a
        else:
            raise ValueError(f"text projection kind must be {PROJECTION_SINGLE!r} or {PROJECTION_DUAL!r}, "
                             f"got {kind!r}")
        self.kind = kind
        self.in_features = in_features
        self.requires_grad_(False)

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], prefix: str = DEFAULT_PREFIX,
                        dtype: torch.dtype | None = None) -> TextProjection:
        """Build from the keys under `prefix` (other keys of `sd` are not looked at).

        2.0 expects exactly `aggregate_embed.weight` (or the bare `weight` of ComfyUI re-saves); 2.3 exactly
        `video_aggregate_embed.{weight,bias}` and `audio_aggregate_embed.{weight,bias}`. `dtype`: cast weights to it
        (default: keep the stored dtype; fp8-stored weights are refused).
        Raises: ValueError naming the missing / unexpected keys, a shape mismatch, or no keys under `prefix`.
        """
        sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if not sub:
            raise ValueError(f"no text projection keys under prefix {prefix!r} "
                             f"(expected {prefix}aggregate_embed.weight or {prefix}video_aggregate_embed.weight)")
        if any(k.startswith(("video_aggregate_embed.", "audio_aggregate_embed.")) for k in sub):
            kind = PROJECTION_DUAL
            expected = {f"{m}.{p}" for m in ("video_aggregate_embed", "audio_aggregate_embed")
                        for p in ("weight", "bias")}
        else:
            kind = PROJECTION_SINGLE
            expected = {"weight"} if "weight" in sub and "aggregate_embed.weight" not in sub \
                else {"aggregate_embed.weight"}
        missing = sorted(prefix + k for k in expected - sub.keys())
        unexpected = sorted(prefix + k for k in sub.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"text projection ({kind}) state dict mismatch: missing keys {missing}, "
                             f"unexpected keys {unexpected}")
        for k, v in sub.items():
            if not v.is_floating_point() or v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(f"{prefix}{k}: dtype {v.dtype} is not supported for the text projection")
        if kind == PROJECTION_SINGLE:
            w = sub["weight"] if "weight" in expected else sub["aggregate_embed.weight"]
            mod = cls(PROJECTION_SINGLE, w.shape[1], w.shape[0], dtype=dtype or w.dtype)
            mod.aggregate_embed.weight.copy_(w)
        else:
            vw, vb = sub["video_aggregate_embed.weight"], sub["video_aggregate_embed.bias"]
            aw, ab = sub["audio_aggregate_embed.weight"], sub["audio_aggregate_embed.bias"]
            if vw.shape[1] != aw.shape[1] or vb.shape != (vw.shape[0],) or ab.shape != (aw.shape[0],):
                raise ValueError(f"text projection ({kind}) shape mismatch: video weight {tuple(vw.shape)}, "
                                 f"bias {tuple(vb.shape)}; audio weight {tuple(aw.shape)}, bias {tuple(ab.shape)}")
            mod = cls(PROJECTION_DUAL, vw.shape[1], (vw.shape[0], aw.shape[0]), dtype=dtype or vw.dtype)
            mod.video_aggregate_embed.weight.copy_(vw)
            mod.video_aggregate_embed.bias.copy_(vb)
            mod.audio_aggregate_embed.weight.copy_(aw)
            mod.audio_aggregate_embed.bias.copy_(ab)
        return mod

    @torch.inference_mode()
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`hidden_states [B, T, H, L]`, `attention_mask [B, T]` (1 = valid) -> `[B, T, out_features]` float32.

        Normalization runs in float32, the Linear(s) in the weights' dtype. Padded positions carry `Linear(0)`
        (0 for 2.0, the biases for 2.3), like ltx-core / diffusers; `make_conditioning` drops them.
        Raises: ValueError if H·L != in_features or the shapes of the two inputs disagree.
        """
        if hidden_states.ndim != 4 or attention_mask.shape != hidden_states.shape[:2]:
            raise ValueError(f"expected hidden_states [B,T,H,L] and attention_mask [B,T], got "
                             f"{tuple(hidden_states.shape)} and {tuple(attention_mask.shape)}")
        _, _, h, l = hidden_states.shape  # noqa: E741
        if h * l != self.in_features:
            raise ValueError(f"text projection ({self.kind}) expects {self.in_features} features per token, "
                             f"got hidden {h} x {l} states = {h * l}")
        if self.kind == PROJECTION_SINGLE:
            lin = self.aggregate_embed
            x = masked_mean_range_norm(hidden_states.to(lin.weight.device), attention_mask)
            return lin(x.to(lin.weight.dtype)).float()
        v, a = self.video_aggregate_embed, self.audio_aggregate_embed
        x = per_token_rms_norm(hidden_states.to(v.weight.device), attention_mask)
        video = v((x * math.sqrt(v.out_features / h)).to(v.weight.dtype))
        audio = a((x * math.sqrt(a.out_features / h)).to(a.weight.dtype))
        return torch.cat([video.float(), audio.float()], dim=-1)


def make_conditioning(embeds: torch.Tensor, attention_mask: torch.Tensor, frame_rate: float | None = None) -> list:
    """ComfyUI CONDITIONING from projected embeddings: `[[cond, {"pooled_output": None,
    "unprocessed_ltxav_embeds": True[, "frame_rate": float]}]]`.

    Args:
        embeds: `[B, T, C]` (`TextProjection.forward` output).
        attention_mask: `[B, T]`; only valid positions are kept (as ComfyUI, which cuts the padding off).
        frame_rate: if given, stored as `"frame_rate"` (what `LTXVConditioning` adds).
    Returns: a one-entry list; `cond` is float32, contiguous, on the CPU, `[B, n_valid, C]`.
    Raises: ValueError if rows have different numbers of valid tokens (ComfyUI encodes one prompt per
        CONDITIONING; call once per prompt), or on shape mismatch.
    """
    if embeds.ndim != 3 or attention_mask.shape != embeds.shape[:2]:
        raise ValueError(f"expected embeds [B,T,C] and attention_mask [B,T], got {tuple(embeds.shape)} and "
                         f"{tuple(attention_mask.shape)}")
    counts = attention_mask.sum(dim=1).tolist()
    if len(set(counts)) > 1:
        raise ValueError(f"prompts have different numbers of valid tokens {counts}; a ComfyUI CONDITIONING "
                         f"holds unpadded tokens, so build one CONDITIONING per prompt")
    valid = attention_mask.bool().to(embeds.device)
    cond = torch.stack([embeds[i][valid[i]] for i in range(embeds.shape[0])]).float().cpu().contiguous()
    extra: dict = {"pooled_output": None, "unprocessed_ltxav_embeds": True}
    if frame_rate is not None:
        extra["frame_rate"] = float(frame_rate)
    return [[cond, extra]]


def split_video_audio(embeds: torch.Tensor, kind: str, video_dim: int = LTX23_VIDEO_DIM
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Video and audio text features from CONDITIONING embeddings `[..., C]`.

    2.0: both streams get the same 3840-wide tensor. 2.3: `[..., :video_dim]` and `[..., video_dim:]` (4096 + 2048),
    as ComfyUI `av_model.py::preprocess_text_embeds` splits them.
    `kind`: the projection kind (`single_linear`: 2.0, `dual_linear`: 2.3 / 2.5).
    Raises: ValueError for an unknown kind or a dual tensor not wider than `video_dim`.
    """
    if kind == PROJECTION_SINGLE:
        return embeds, embeds
    if kind == PROJECTION_DUAL:
        if embeds.shape[-1] <= video_dim:
            raise ValueError(f"video+audio embeddings must be wider than video_dim={video_dim}, got {embeds.shape[-1]}")
        return embeds[..., :video_dim], embeds[..., video_dim:]
    raise ValueError(f"text projection kind must be {PROJECTION_SINGLE!r} or {PROJECTION_DUAL!r}, got {kind!r}")


def load_bundled_projection(path, dtype: torch.dtype | None = None, device=None) -> TextProjection:
    """The LTX-2.5 text projection bundled in a Gemma 4 text-encoder file (keys `text_embedding_projection.
    {video,audio}_aggregate_embed.{weight,bias}`), kind `dual_linear`.

    Reads only those tensors (memory-mapped through safetensors); floating tensors as stored (or cast to `dtype`),
    ComfyUI int8 (`int8_tensorwise`, optionally convrot) dequantized once (`models.gemma.read_weight`) into `dtype`
    (default bfloat16 then). Strict: any other key under the prefix, or a missing one, is named in the ValueError.
    Raises: FileNotFoundError; ValueError naming the file when it bundles no projection or a wrong layout.
    """
    from pathlib import Path

    from safetensors import safe_open

    from .gemma import _AUX_SUFFIXES, quant_configs, read_weight

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text encoder file not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        names = sorted(k for k in keys if k.startswith(DEFAULT_PREFIX) and not k.endswith(_AUX_SUFFIXES))
        if not names:
            raise ValueError(f"{path}: no text projection bundled (rule: LTX-2.5's Gemma 4 file carries "
                             f"{DEFAULT_PREFIX}video_aggregate_embed.* / audio_aggregate_embed.*)")
        confs = quant_configs(f, keys, f.metadata() or {}, str(path))
        sd = {}
        for k in names:
            stored_float = f.get_slice(k).get_dtype() in ("BF16", "F16", "F32")
            t = read_weight(f, k, keys, confs, str(path))
            sd[k] = t.to(dtype or (t.dtype if stored_float else torch.bfloat16))
    try:
        mod = TextProjection.from_state_dict(sd, prefix=DEFAULT_PREFIX)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if mod.kind != PROJECTION_DUAL:
        raise ValueError(f"{path}: the bundled text projection is {mod.kind}; rule: LTX-2.5's is {PROJECTION_DUAL}")
    return mod.to(device) if device is not None else mod


def check_gemma_matches(projection: TextProjection, encoder, gemma_path) -> None:
    """Raise ValueError naming the widths and `gemma_path` if the encoder's `hidden_size · num_hidden_states`
    differs from `projection.in_features` (e.g. a Gemma 3 4B file with an LTX-2 checkpoint expecting 3840 x 49)."""
    got = encoder.hidden_size * encoder.num_hidden_states
    if got != projection.in_features:
        raise ValueError(
            f"Gemma text encoder {gemma_path} gives hidden_size {encoder.hidden_size} x {encoder.num_hidden_states} "
            f"hidden states = {got} features per token, but the checkpoint's text projection ("
            f"{KIND_MODELS[projection.kind]}, {projection.kind}) expects in_features={projection.in_features} "
            f"(the 12B Gemma 3 and Gemma 4: 3840 x 49 = 188160)")
