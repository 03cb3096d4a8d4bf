"""Small and odd latent sizes through a live ComfyUI 0.33 (issue 24, item 5): ComfyUI's own sampler on its native
MODEL against the same graph on the pack's MGPU MODEL (2 CPU ranks), and SP Sampler (MGPU) against that graph, at
the smallest grids ComfyUI makes (two and three cells wide or high), one latent frame, odd token counts and a frame
count that is not 8k + 1.

Run as tests/test_comfyui_live.py (its docstring: the server and the tiny models); this module reuses its graph
builder (`native_model_graph`: CFGGuider 3 + SamplerCustomAdvanced + euler over 4 sigmas) and its fixtures.
`tests/test_small_stages.py` covers the same sizes for stage 1, the upscale and stage 2 against one process, on CPU
ranks without ComfyUI.
"""
from __future__ import annotations

import os
import uuid

import pytest

from test_comfyui_live import (NATIVE_MODEL_ATOL, _latents, _test_nodes_or_skip, native_model_graph,  # noqa: F401
                               queue, server, sp_sampler_vs_model_graphs, tiny_models, wait)

pytestmark = pytest.mark.comfyui

# (width, height, length) in pixels / frames -> latent grid (frames, height, width): the smallest sizes ComfyUI's
# EmptyLTXVLatentVideo accepts (width / height ≥ 64 in steps of 32: two cells; any length ≥ 1). One-cell grids
# cannot be made by its nodes; tests/test_small_stages.py takes them.
SIZES = {
    "2x2x1": (64, 64, 1),     # one latent frame, 4 tokens
    "3x3x1": (96, 96, 1),     # 9 tokens: odd, padded over 2 ranks
    "2x3x2": (64, 96, 13),    # 13 frames (not 8k + 1: ComfyUI takes (13 - 1) // 8 + 1 = 2 latent frames)
    "2x2x2": (64, 64, 9),     # 8 tokens, divisible by 2 ranks
    "3x2x3": (96, 64, 17),    # 3 latent frames, 18 tokens
}


def _resize(graph: dict, width: int, height: int, length: int) -> dict:
    graph["3"]["inputs"].update(width=width, height=height, length=length)
    graph["5"]["inputs"]["frames_number"] = length
    return graph


@pytest.mark.parametrize("size", list(SIZES))
def test_small_sizes_mgpu_model_and_sp_sampler_equal_comfyui(server, tiny_models, size):
    """The MGPU MODEL equals ComfyUI's native MODEL, and SP Sampler (MGPU) equals the MGPU MODEL graph, at `size` —
    same bound as the 27-token case (`NATIVE_MODEL_ATOL`): only float summation order differs (sequence parallel
    over 2 ranks pads a token count that does not divide)."""
    _test_nodes_or_skip()
    width, height, length = SIZES[size]
    seed = int.from_bytes(os.urandom(4), "little")
    tag = f"ltx2-mgpu-small-{size}-{uuid.uuid4().hex[:8]}"
    native = _latents(wait(queue(_resize(native_model_graph("native", seed, f"{tag}/n"), width, height, length))))
    model_graph, sp_graph = sp_sampler_vs_model_graphs("plain", seed, tag)
    mgpu = _latents(wait(queue(_resize(model_graph, width, height, length))))
    sp = _latents(wait(queue(_resize(sp_graph, width, height, length))))
    frames = (length - 1) // 8 + 1
    assert tuple(native["video"].shape[2:]) == (frames, height // 32, width // 32)
    for modality in ("video", "audio"):
        d_model = float((mgpu[modality] - native[modality]).abs().max())
        d_sp = float((sp[modality] - mgpu[modality]).abs().max())
        print(f"{size} {modality} {tuple(native[modality].shape)}: max |MGPU - native| {d_model:.2e}, "
              f"max |SP Sampler - MGPU| {d_sp:.2e}")
        assert d_model <= NATIVE_MODEL_ATOL and d_sp <= NATIVE_MODEL_ATOL
