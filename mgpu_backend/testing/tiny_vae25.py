"""A tiny random-weight LTX-2.5 diffusion video VAE file, in exactly the layout ComfyUI 0.33's `VAELoader` loads.

Keys (no prefix, like the released `vae/` file): `encoder.*` (the tiny LTX-2.3 conv encoder of `tiny.py`, same
latent space), `decoder.*` (the diffusion decoder in ComfyUI's spelling: fused `attn.qkv`, `t_embedder.mlp.{0,2}`),
`per_channel_statistics.{mean-of-means,std-of-means,mean-of-stds}`; metadata `config` =
`{"vae": {"_class_name": "CausalDiffusionVAE", "model_output_type": "x0", "encoder": {...}, "decoder": {...}}}`.

What shrinks and what stays real: widths (stage channels 64/32/16/16/8, head 8), depths (1/1/1/1/2), the kernels
(3×3×3 deterministic stages, 5×5×5 stage 5) and the timestep width; kept are the 128-channel latent, the upsample
strides and channel reductions (so the 8 × 32 × 32 compression), patch size 4, the trailing-frame padding rule and
the single x0 step. Every tensor is filled (tiny_fill.py's `_fill`) and checked finite. Deterministic per seed.
Verified by ComfyUI's own loader: `tests/golden/make_golden_25.py` loads the file with `comfy.sd.VAE` (asserting
no missing or leftover key) and decodes a latent.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models import configs, keymaps
from ..models.diffusion_decoder import DiffusionDecoderConfig, build_decoder, decoder_state_to_comfy, metadata_json
from .tiny_fill import _fill, tiny_vae_metadata

TINY_DECODER = DiffusionDecoderConfig(
    in_channels=128, out_channels=3, patch_size=4, head_dim=8,
    stage_channels=(64, 32, 16, 16, 8), stage_depths=(1, 1, 1, 1, 2),
    stage_kernels=((3, 3, 3),) * 4, upsample_strides=((1, 2, 2), (2, 1, 1), (2, 2, 2), (2, 2, 2)),
    upsample_reductions=(2, 2, 1, 2), stage5_kernel=(5, 5, 5), t_emb_dim=32,
)


def tiny_encoder_section() -> dict:
    """`config.vae.encoder` (ComfyUI's `CausalDiffusionVAE` field names) for the tiny 2.3 encoder of `tiny.py`."""
    meta = tiny_vae_metadata()
    return {"dims": 3, "in_channels": meta["in_channels"], "out_channels": meta["latent_channels"],
            "blocks": meta["encoder_blocks"], "patch_size": meta["patch_size"],
            "latent_log_var": meta["latent_log_var"], "norm_layer": meta["norm_layer"],
            "base_channels": meta["encoder_base_channels"], "spatial_padding_mode": meta["spatial_padding_mode"]}


def build_tiny_diffusion_vae(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(the filled diffusers decoder, the filled encoder state in the file's spelling)."""
    from diffusers import AutoencoderKLLTX2Video

    generator = torch.Generator().manual_seed(seed)
    decoder = build_decoder(TINY_DECODER)
    _fill(decoder, generator)
    conv_vae = AutoencoderKLLTX2Video(**configs.video_vae_kwargs(tiny_vae_metadata()))
    _fill(conv_vae.encoder, generator)
    stages = len(conv_vae.config.block_out_channels)
    encoder = {keymaps.video_vae_to_original("encoder." + k, stages): v
               for k, v in conv_vae.encoder.state_dict().items()}
    return decoder, encoder


def write_tiny_diffusion_vae(path: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the tiny LTX-2.5 diffusion video VAE to `path` (safetensors, floating tensors in `dtype`, the latent
    statistics float32 like the released files). Returns `path`. Raises AssertionError if a tensor is not finite."""
    decoder, encoder = build_tiny_diffusion_vae(seed)
    state = {k: v.to(dtype) for k, v in encoder.items()}
    for key, tensor in decoder_state_to_comfy(decoder.state_dict()).items():
        state[key] = tensor.float() if key.startswith("per_channel_statistics.") else tensor.to(dtype)
    state["per_channel_statistics.mean-of-stds"] = torch.ones(TINY_DECODER.in_channels)
    for key, tensor in state.items():
        if not torch.isfinite(tensor.float()).all():
            raise AssertionError(f"tiny diffusion VAE tensor {key} is not finite")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path),
              metadata={"config": metadata_json(TINY_DECODER, tiny_encoder_section()),
                        "model_version": "ltx-2.5-tiny-diffusion-vae"})
    return path
