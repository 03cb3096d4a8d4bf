"""What every tiny test model is made with: the fill of its tensors (`_fill`) and the tiny video-VAE config
(`tiny_vae_metadata`), shared by `tiny.py` (LTX-2.0 / 2.3 / 2.5 components) and `tiny_vae25.py` (the LTX-2.5
diffusion decoder) without either importing the other's module.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def tiny_vae_metadata() -> dict[str, Any]:
    """`config.vae`: the LTX-2 block pattern (4 compressions, 32× space / 8× time) with narrow channels."""
    res = lambda n=1: ["res_x", {"num_layers": n}]  # noqa: E731
    return {
        "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
        "latent_channels": 128, "encoder_base_channels": 128, "decoder_base_channels": 8, "patch_size": 4,
        "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False,
        "timestep_conditioning": False, "spatial_padding_mode": "reflect",
        # multiplier 1 keeps the encoder at 128 channels (the real file doubles per compression)
        "encoder_blocks": [res(), ["compress_space_res", {"multiplier": 1}], res(),
                           ["compress_time_res", {"multiplier": 1}], res(), ["compress_all_res", {"multiplier": 1}],
                           res(), ["compress_all_res", {"multiplier": 1}], res()],
        "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                           ["compress_all", {"residual": True, "multiplier": 2}]] * 3
                          + [["res_x", {"num_layers": 1, "inject_noise": False}]],
    }


def _fill(module: nn.Module, generator: torch.Generator) -> None:
    """Small, fan-in-scaled normal values for every parameter; norm gains near 1; computed buffers kept.

    `latents_mean` / `latents_std` (VAE statistics) get mean ≈ 0 and std ≈ 1 (positive).
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim >= 2 and "scale_shift_table" not in leaf and leaf != "learnable_registers":
                std = 1.0 / math.sqrt(p[0].numel())
                p.copy_(torch.randn(p.shape, generator=generator) * std)
            elif "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
        for name, b in module.named_buffers():
            if name.endswith("latents_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))
            elif name.endswith("latents_std"):
                b.copy_(0.5 + torch.rand(b.shape, generator=generator))
            elif name.endswith(("stft_fn.forward_basis", "stft_fn.inverse_basis")):
                b.copy_(_stft_basis(b.shape[-1]))  # LTX-2.3 BWE vocoder: stored bases (zeros in diffusers)
            elif name.endswith("mel_stft.mel_basis"):
                b.copy_(_mel_basis(b.shape[0], b.shape[1]))


def _stft_basis(n_fft: int) -> torch.Tensor:
    """`[2·(n_fft/2+1), 1, n_fft]`: Hann-windowed DFT rows, real parts then imaginary parts (the layout of the
    LTX-2.3 vocoder's `mel_stft.stft_fn.forward_basis`)."""
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)[:, None]
    n = torch.arange(n_fft, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * k * n / n_fft
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    return (torch.cat([torch.cos(angle), -torch.sin(angle)]) * window).float().unsqueeze(1)


def _mel_basis(n_mels: int, n_freqs: int) -> torch.Tensor:
    """`[n_mels, n_freqs]` triangular filters evenly spaced on the HTK mel scale over 0..Nyquist."""
    mel = lambda f: 2595.0 * torch.log10(1.0 + f / 700.0)  # noqa: E731
    hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)  # noqa: E731
    nyquist = 8000.0
    edges = hz(torch.linspace(0.0, float(mel(torch.tensor(nyquist))), n_mels + 2, dtype=torch.float64))
    freqs = torch.linspace(0.0, nyquist, n_freqs, dtype=torch.float64)
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rise = (freqs - lower) / (center - lower)
    fall = (upper - freqs) / (upper - center)
    return torch.clamp(torch.minimum(rise, fall), min=0.0).float()
