"""Placeholder of the tiny LTX-2.5 diffusion-decoder VAE writer (issue 18, part of helper h18c).

The real module (h18c) writes a tiny `ltx-2.5-video-vae` (neighborhood-attention diffusion decoder) file in the layout
ComfyUI's `VAELoader` loads. This branch does not have it; the lead replaces this file with h18c's at merge.
"""
from __future__ import annotations

from pathlib import Path


def write_tiny_diffusion_vae(path: Path, seed: int) -> Path:
    """Raises NotImplementedError: the tiny diffusion-decoder VAE writer is not part of this branch."""
    raise NotImplementedError(f"writing {path}: the tiny LTX-2.5 diffusion-decoder VAE "
                              f"(mgpu_backend/models/tiny_vae25.py, issue 18 decoder part) is not in this build")
