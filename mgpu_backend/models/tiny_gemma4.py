"""Placeholder of the tiny Gemma 4 text-encoder writer (issue 18, part of helper h18b).

The real module (h18b) writes a tiny Gemma 4 file with the LTX-2.5 text projection bundled, in the layout ComfyUI's
`CLIPLoader(type="ltxv")` loads. This branch does not have it; the lead replaces this file with h18b's at merge.
"""
from __future__ import annotations

from pathlib import Path


def write_tiny_gemma4(path: Path, seed: int) -> Path:
    """Raises NotImplementedError: the tiny Gemma 4 writer is not part of this branch."""
    raise NotImplementedError(f"writing {path}: the tiny Gemma 4 text encoder (mgpu_backend/models/tiny_gemma4.py, "
                              f"issue 18 Gemma 4 part) is not in this build")
