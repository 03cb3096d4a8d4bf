"""The LTX-2.5 diffusion video VAE file (`vae/` folder): load it strictly, memory-mapped, into diffusers'
`LTX2VideoDiffusionDecoderModel`, and decode the way ComfyUI 0.33 decodes it.

The file (what ComfyUI 0.33's `VAELoader` loads; ComfyUI calls the model "LTX 2.4", `CausalDiffusionVAE` in
`comfy/ldm/lightricks/vae/na_diffusion_decoder.py`; detected in `comfy/sd.py` by the key `decoder.conv_in_x_t.weight`):
- `encoder.*`: the conv encoder of LTX-2.3 (same latent space), keys as in a 2.3 VAE file (loaded into diffusers'
  `AutoencoderKLLTX2Video` with the 2.3 key map, its decoder dropped, attached as `conv_encoder`);
- `decoder.*`: the one-step neighborhood-attention diffusion decoder — `conv_in` (Linear latent → stage 1),
  `det_stages.{s}.{b}` NA blocks (`norm1`, `attn.qkv` fused / `attn.q_norm` / `attn.k_norm` / `attn.proj`, `norm2`,
  `mlp.w_up|w_gate|w_down`) with `upsamples.{s}.proj` linear pixel shuffles, then stage 5: `t_embedder.mlp.{0,2}`,
  `conv_in_x_t`, `shared_adaln.proj`, `diff_blocks.{b}` (+ `context_proj`, `scale_shift_table`), `norm_out`,
  `conv_out`;
- `per_channel_statistics.{mean-of-means,std-of-means}` (latent statistics; other statistics are unused);
- metadata `config` = JSON `{"vae": {"model_output_type", "encoder": {...}, "decoder": {...}}}` (ComfyUI reads
  `json.loads(metadata["config"])["vae"]`, defaults from its `LTX_24_VAE_CONFIG` for absent fields).

Key map to diffusers (the renames of diffusers' `scripts/convert_ltx2_to_diffusers.py`, LTX-2.5 diffusion VAE): the
fused `attn.qkv` splits into `attn.to_q|to_k|to_v` (rows 0:C, C:2C, 2C:3C); `attn.proj` → `attn.to_out.0`;
`attn.q_norm|k_norm` → `attn.norm_q|norm_k`; `t_embedder.mlp.0|2` → `t_embedder.timestep_embedder.linear_1|2`;
`per_channel_statistics.mean-of-means|std-of-means` → `latents_mean|latents_std`. The converter also folds static
AdaLN gates (`gate_msa`, `gate_mlp`, `gate_ctx`) of Lightricks' original checkpoints and drops `coarse_*` preview
heads; ComfyUI 0.33 ignores such keys ("folded at export"), so a file carrying them is refused here by name.

Semantics checked against ComfyUI 0.33 (line by line, and by the golden tensors of `tests/golden/make_golden_25.py`):
same blocks, RMS norms (eps 1e-6), q/k norm → ×head_dim^-½ → interleaved-pair 3-D RoPE (quarter of the head to
time), SwiGLU width `(int(4·C) + 15) // 16 · 16`, pixel shuffle channel order `(c, p_t, p_h, p_w)` dropping the
duplicated leading frame, `(k_t // 2) · 2` replicated trailing latent frames cropped after stage 4, AdaLN-Zero with 7
chunks of which scale/shift 0, 1, 3, 4 are used, timestep `1000 · 1`, a single x0 step. Two differences, both
resolved to ComfyUI's behaviour here:
- neighborhood attention: diffusers runs FlexAttention (or NATTEN from the Hub); we install our processor, which calls
  `comfy_kitchen.na3d` like ComfyUI (`mgpu_backend/models/neighborhood.py`);
- grids smaller than a kernel: diffusers' attention raises, ComfyUI (comfy-kitchen) clamps the window to the axis;
  we clamp (short or narrow videos decode as in ComfyUI).
Noise: ComfyUI draws `x_t` with a fresh `torch.Generator(device).manual_seed(0)` in the latent's dtype on its device
(`CausalDiffusionVAE.decode`); `decode_diffusion` does the same, so one untiled decode equals ComfyUI's VAEDecode.
"""
from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .neighborhood import na3d

DIFFUSION_VAE_MARKER = "decoder.conv_in_x_t.weight"  # ComfyUI's detection key (comfy/sd.py)
NOISE_SEED = 0  # ComfyUI's fixed decode noise seed (CausalDiffusionVAE.decode)
UNUSED_STATISTICS = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds",
                     "per_channel_statistics.mean-of-stds_over_std-of-means")
REFUSED_SUFFIXES = (".gate_msa", ".gate_mlp", ".gate_ctx")  # static gates ComfyUI 0.33 would silently ignore

# ComfyUI 0.33's LTX_24_VAE_CONFIG["decoder"] (the released model's shape): defaults for absent fields
COMFY_DECODER_DEFAULTS: dict[str, Any] = {
    "in_channels": 128, "out_channels": 3, "patch_size": 4, "head_dim": 64,
    "stage_channels": [2048, 1024, 512, 512, 256], "stage_depths": [4, 6, 4, 2, 8],
    "stage_kernels": [[3, 7, 7], [3, 7, 7], [3, 5, 5], [3, 5, 5], [11, 11, 11]],
    "upsamples": [[[1, 2, 2], 2], [[2, 1, 1], 2], [[2, 2, 2], 1], [[2, 2, 2], 2]],
    "stage5_kernel": [11, 11, 11], "t_emb_dim": 384, "timestep_scale_multiplier": 1000.0,
    "default_num_inference_steps": 1,
}


@dataclass(frozen=True)
class DiffusionDecoderConfig:
    """The decoder half of the file's `config.vae` (ComfyUI field names, ComfyUI defaults).

    `stage_kernels` has one `(k_t, k_h, k_w)` per deterministic stage (ComfyUI's list may carry a fifth entry for
    stage 5, which it does not read; `stage5_kernel` is the stage-5 kernel). `upsamples`: per deterministic stage,
    the pixel-shuffle stride `(t, h, w)` and the channel reduction factor.
    """

    in_channels: int = 128
    out_channels: int = 3
    patch_size: int = 4
    head_dim: int = 64
    stage_channels: tuple[int, ...] = (2048, 1024, 512, 512, 256)
    stage_depths: tuple[int, ...] = (4, 6, 4, 2, 8)
    stage_kernels: tuple[tuple[int, int, int], ...] = ((3, 7, 7), (3, 7, 7), (3, 5, 5), (3, 5, 5))
    upsample_strides: tuple[tuple[int, int, int], ...] = ((1, 2, 2), (2, 1, 1), (2, 2, 2), (2, 2, 2))
    upsample_reductions: tuple[int, ...] = (2, 2, 1, 2)
    stage5_kernel: tuple[int, int, int] = (11, 11, 11)
    t_emb_dim: int = 384
    timestep_scale_multiplier: float = 1000.0
    num_inference_steps: int = 1
    model_output_type: str = "x0"

    @classmethod
    def from_vae_section(cls, vae: dict[str, Any]) -> "DiffusionDecoderConfig":
        """From `config["vae"]` of the file. Raises ValueError naming an inconsistent field."""
        dec = {**COMFY_DECODER_DEFAULTS, **vae.get("decoder", {})}
        n = len(dec["stage_channels"]) - 1
        if len(dec["upsamples"]) != n or len(dec["stage_depths"]) != n + 1 or len(dec["stage_kernels"]) < n:
            raise ValueError(f"diffusion VAE config: {n + 1} stage_channels need {n} upsamples, {n + 1} "
                             f"stage_depths and {n} stage_kernels, got {dec['upsamples']}, {dec['stage_depths']}, "
                             f"{dec['stage_kernels']}")
        cfg = cls(
            in_channels=int(dec["in_channels"]), out_channels=int(dec["out_channels"]),
            patch_size=int(dec["patch_size"]), head_dim=int(dec["head_dim"]),
            stage_channels=tuple(int(c) for c in dec["stage_channels"]),
            stage_depths=tuple(int(d) for d in dec["stage_depths"]),
            stage_kernels=tuple(tuple(int(k) for k in ks) for ks in dec["stage_kernels"][:n]),
            upsample_strides=tuple(tuple(int(s) for s in stride) for stride, _ in dec["upsamples"]),
            upsample_reductions=tuple(int(r) for _, r in dec["upsamples"]),
            stage5_kernel=tuple(int(k) for k in dec["stage5_kernel"]),
            t_emb_dim=int(dec.get("t_emb_dim", 384)),
            timestep_scale_multiplier=float(dec["timestep_scale_multiplier"]),
            num_inference_steps=int(dec["default_num_inference_steps"]),
            model_output_type=str(vae.get("model_output_type", "x0")),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for i, r in enumerate(self.upsample_reductions):
            if self.stage_channels[i + 1] != self.stage_channels[i] // r:
                raise ValueError(f"diffusion VAE config: stage_channels[{i + 1}]={self.stage_channels[i + 1]} must be "
                                 f"stage_channels[{i}] // reduction = {self.stage_channels[i] // r}")
        for c in self.stage_channels:
            if c % self.head_dim:
                raise ValueError(f"diffusion VAE config: stage width {c} is not a multiple of head_dim "
                                 f"{self.head_dim}")
        if self.model_output_type not in ("x0", "v"):
            raise ValueError(f"diffusion VAE config: model_output_type {self.model_output_type!r} is not x0 or v")

    @property
    def temporal_ratio(self) -> int:
        return int(torch.tensor([s[0] for s in self.upsample_strides]).prod())

    @property
    def spatial_ratio(self) -> int:
        return int(torch.tensor([s[1] for s in self.upsample_strides]).prod()) * self.patch_size

    def diffusers_kwargs(self) -> dict[str, Any]:
        """`LTX2VideoDiffusionDecoderModel(**kwargs)`."""
        return dict(
            out_channels=self.out_channels, latent_channels=self.in_channels, patch_size=self.patch_size,
            decoder_head_dim=self.head_dim, decoder_stage_channels=self.stage_channels,
            decoder_stage_depths=self.stage_depths, decoder_stage_kernels=self.stage_kernels,
            decoder_upsample_strides=self.upsample_strides,
            decoder_upsample_channel_reductions=self.upsample_reductions, decoder_stage5_kernel=self.stage5_kernel,
            decoder_t_emb_dim=self.t_emb_dim, decoder_timestep_scale_multiplier=self.timestep_scale_multiplier,
            decoder_model_output_type=self.model_output_type, decoder_num_inference_steps=self.num_inference_steps,
            spatial_compression_ratio=self.spatial_ratio, temporal_compression_ratio=self.temporal_ratio,
        )

    def comfy_decoder_section(self) -> dict[str, Any]:
        """The `config.vae.decoder` JSON ComfyUI 0.33 reads (for files we write)."""
        return {
            "in_channels": self.in_channels, "out_channels": self.out_channels, "patch_size": self.patch_size,
            "head_dim": self.head_dim, "stage_channels": list(self.stage_channels),
            "stage_depths": list(self.stage_depths),
            "stage_kernels": [list(k) for k in self.stage_kernels] + [list(self.stage5_kernel)],
            "upsamples": [[list(s), r] for s, r in zip(self.upsample_strides, self.upsample_reductions)],
            "stage5_kernel": list(self.stage5_kernel), "t_emb_dim": self.t_emb_dim,
            "timestep_scale_multiplier": self.timestep_scale_multiplier,
            "default_num_inference_steps": self.num_inference_steps,
        }


# ---- key map -------------------------------------------------------------------------------------------------------

_RENAMES = (  # file (ComfyUI) spelling -> diffusers spelling, inside `decoder.`
    ("t_embedder.mlp.0.", "t_embedder.timestep_embedder.linear_1."),
    ("t_embedder.mlp.2.", "t_embedder.timestep_embedder.linear_2."),
    (".attn.proj.", ".attn.to_out.0."),
    (".attn.q_norm.", ".attn.norm_q."),
    (".attn.k_norm.", ".attn.norm_k."),
)
STATISTICS = {"per_channel_statistics.mean-of-means": "latents_mean",
               "per_channel_statistics.std-of-means": "latents_std"}
_QKV = ("to_q", "to_k", "to_v")


def decoder_key_to_diffusers(key: str) -> list[tuple[str, int | None]]:
    """A file key (`decoder.*` or a used statistic) -> [(diffusers key, row-third index or None)].

    A fused `attn.qkv.{weight,bias}` gives three entries (its row thirds 0, 1, 2 → `to_q`, `to_k`, `to_v`).
    """
    if key in STATISTICS:
        return [(STATISTICS[key], None)]
    new = key
    for old, rep in _RENAMES:
        new = new.replace(old, rep)
    for leaf in ("weight", "bias"):
        if new.endswith(f".attn.qkv.{leaf}"):
            stem = new[: -len(f"qkv.{leaf}")]
            return [(f"{stem}{name}.{leaf}", i) for i, name in enumerate(_QKV)]
    return [(new, None)]


def diffusers_key_to_file(key: str) -> str:
    """Inverse of `decoder_key_to_diffusers` (`to_q|to_k|to_v` all name the fused `qkv`)."""
    inverse = {v: k for k, v in STATISTICS.items()}
    if key in inverse:
        return inverse[key]
    for name in _QKV:
        key = key.replace(f".attn.{name}.", ".attn.qkv.")
    for old, rep in _RENAMES:
        key = key.replace(rep, old)
    return key


def decoder_state_to_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers `LTX2VideoDiffusionDecoderModel.state_dict()` -> the file's keys (q/k/v fused into `qkv`)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        file_key = diffusers_key_to_file(key)
        if ".attn.qkv." not in file_key:
            out[file_key] = tensor
        elif ".attn.to_q." in key:
            stem, leaf = key.rsplit(".to_q.", 1)
            out[file_key] = torch.cat([state[f"{stem}.{name}.{leaf}"] for name in _QKV])
    return out


# ---- attention processor -------------------------------------------------------------------------------------------

class NeighborhoodAttnProcessor:
    """diffusers attention processor for `LTX2VideoVaeNeighborhoodAttention`: project (norm, scale, RoPE — diffusers'
    `project_qkv`), `na3d` from `models/neighborhood.py` (comfy-kitchen when installed), output projection.
    Takes no block mask (the decoder builds none for a processor that is not diffusers' flex one)."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend

    def __call__(self, attn, hidden_states: torch.Tensor, block_mask=None) -> torch.Tensor:
        b, t, h, w, c = hidden_states.shape
        q, k, v = attn.project_qkv(hidden_states)
        out = na3d(q, k, v, attn.kernel_size, scale=1.0, backend=self.backend)  # the query is pre-scaled
        return attn.to_out[0](out.reshape(b, t, h, w, c))


def _clamped_forward(self, hidden_states: torch.Tensor, block_mask=None) -> torch.Tensor:
    """`LTX2VideoVaeNeighborhoodAttention.forward` without its grid-smaller-than-kernel refusal: the window clamps
    to the axis, as in ComfyUI (comfy-kitchen's `na3d`)."""
    return self.processor(self, hidden_states, block_mask)


def _video_vae_class():
    from diffusers import LTX2VideoDiffusionDecoderModel

    class LTX25DiffusionVideoVAE(LTX2VideoDiffusionDecoderModel):
        """diffusers' `LTX2VideoDiffusionDecoderModel` plus the file's conv encoder (`conv_encoder`: an
        `AutoencoderKLLTX2Video` whose decoder is dropped, or None when the file has no encoder), so one module is
        the whole LTX-2.5 video VAE: `encode` as the conv VAE's (`.latent_dist.mode()`), decode through
        `decode_diffusion` / `splits/decode.py`."""

        def encode(self, x: torch.Tensor, return_dict: bool = True):
            encoder = self._modules.get("conv_encoder")
            if encoder is None:
                raise ValueError("this diffusion video VAE file has no encoder.* keys: it cannot encode images")
            return encoder.encode(x, return_dict=return_dict)

    return LTX25DiffusionVideoVAE


def build_decoder(config: DiffusionDecoderConfig, backend: str = "auto") -> nn.Module:
    """An `LTX2VideoDiffusionDecoderModel` (a subclass that can also hold the conv encoder; storage as the caller's
    context gives it) with our NA processor."""
    from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoVaeNeighborhoodAttention

    model = _video_vae_class()(**config.diffusers_kwargs())
    for module in model.modules():
        if isinstance(module, LTX2VideoVaeNeighborhoodAttention):
            module.set_processor(NeighborhoodAttnProcessor(backend))
            module.forward = types.MethodType(_clamped_forward, module)
    return model


# ---- decode --------------------------------------------------------------------------------------------------------

def denormalize(decoder: nn.Module, latent: torch.Tensor) -> torch.Tensor:
    """Model-space latent -> VAE space in the decoder's dtype and device, as ComfyUI's `un_normalize` (in the
    latent's dtype after the cast: `x · std + mean`)."""
    param = next(decoder.parameters())
    x = latent.to(param.device, param.dtype)
    std = decoder.latents_std.view(1, -1, 1, 1, 1).to(x)
    mean = decoder.latents_mean.view(1, -1, 1, 1, 1).to(x)
    return x * std + mean


def noise_canvas(decoder: nn.Module, z: torch.Tensor, seed: int = NOISE_SEED) -> torch.Tensor:
    """The stage-5 start noise `x_t` for the whole video `[B, 3, (F-1)·8+1, 32·H, 32·W]` as ComfyUI draws it: a fresh
    generator on z's device seeded `seed`, `torch.randn` in z's dtype."""
    cfg = decoder.config
    b, _, f, h, w = z.shape
    frames = (f - 1) * cfg.temporal_compression_ratio + 1
    shape = (b, cfg.out_channels, frames, h * cfg.spatial_compression_ratio, w * cfg.spatial_compression_ratio)
    generator = torch.Generator(device=z.device).manual_seed(seed)
    return torch.randn(shape, generator=generator, device=z.device, dtype=z.dtype)


def decode_vae_space(decoder: nn.Module, z: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
    """VAE-space latent `z` `[B, 128, F, H, W]` and its noise `x_t` -> pixels `[B, 3, (F-1)·8+1, 32H, 32W]` (about
    -1..1, not clamped): stages 1-4, then the stage-5 step(s)."""
    inner = decoder.decoder
    with torch.no_grad():
        context = inner.forward_stage_4(inner.forward_stages_1_to_3(z))
        if tuple(x_t.shape[2:]) != (context.shape[1], context.shape[2] * inner.patch_size,
                                    context.shape[3] * inner.patch_size):
            raise ValueError(f"noise shape {tuple(x_t.shape)} does not fit the context grid {tuple(context.shape)}")
        return inner.denoise(context, x_t, inner.default_num_inference_steps)


def decode_diffusion(decoder: nn.Module, latent: torch.Tensor, seed: int = NOISE_SEED) -> torch.Tensor:
    """Model-space latent `[B, 128, F, H, W]` -> pixels `[B, 3, (F-1)·8+1, 32H, 32W]`, untiled; equal to ComfyUI 0.33's
    `CausalDiffusionVAE.decode` (before VAEDecode's `(x + 1) / 2` clamp to 0..1)."""
    z = denormalize(decoder, latent)
    return decode_vae_space(decoder, z, noise_canvas(decoder, z, seed))


def metadata_json(config: DiffusionDecoderConfig, encoder: dict[str, Any]) -> str:
    """The file's `config` metadata string."""
    return json.dumps({"vae": {"_class_name": "CausalDiffusionVAE", "dims": 3,
                               "model_output_type": config.model_output_type, "encoder": encoder,
                               "decoder": config.comfy_decoder_section()}})
