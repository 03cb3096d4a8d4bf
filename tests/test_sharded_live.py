"""Sharded weights (docs/sharded-weights.md) inside a live ComfyUI 0.33: ComfyUI's own LTX templates with only the
model loader swapped for Load Checkpoint (MGPU) with `weights` = "sharded" on a 2-rank CPU fleet — every block
FSDP-sharded over the two ranks, gathered as it runs — give the native run's latents. The same fleet encodes the
text (Text Encode (MGPU)), so the text encoder also runs beside sharded transformer weights.

Run as tests/test_templates_live.py (its docstring: the server, the templates, the tiny models); this module reuses
its graph builders and fixtures.
"""
from __future__ import annotations

import pytest

from test_templates_live import (INT8_MAX, INT8_REL_L2, TOL, _native, _stats, _tiny_for, images, live,  # noqa: F401
                                 run_graph, template_graph, tiny_23, tiny_25)
from templates import convert as C

pytestmark = pytest.mark.comfyui


def _sharded_vs_native(live, images, stem: str, tiny: dict, tmp_path, tag: str):
    native = _native(live, stem, tiny, images, "cpu:2", tmp_path)
    api = template_graph(stem, tiny, images, devices="cpu:2", swap=False, tag=f"{stem}-sharded{tag}")
    api = C.swap_model_loader(api, via="checkpoint", checkpoint=tiny["checkpoint"], gemma=tiny["gemma"],
                              devices="cpu:2", weights="sharded")
    (loader,) = C.nodes_of(api, "LTX2MGPU_LoadCheckpoint")
    assert api[loader]["inputs"]["weights"] == "sharded"
    got = run_graph(live, api, tmp_path)
    assert got["mp4"]["audio_channels"] >= 1 and got["mp4"]["video_frames"] == native["mp4"]["video_frames"]
    dv, da = _stats(got["video"], native["video"]), _stats(got["audio"], native["audio"])
    print(f"{stem} cpu:2 sharded{tag}: |sharded - native| video max {dv['max']:.2e} rel L2 {dv['rel_l2']:.2e}; "
          f"audio max {da['max']:.2e} rel L2 {da['rel_l2']:.2e}")
    return dv, da


@pytest.mark.parametrize("stem", ["video_ltx2_3_t2v", "video_ltx2_5_t2v"])
def test_sharded_template_matches_native(live, images, stem, tmp_path, request):
    """bf16 tiny files (LTX-2.3's template also applies its distilled LoRA: fused per rank into the rank's rows):
    the bound of the replicated swap (`TOL`) holds — FSDP gathers the very weights, so only the sequence-parallel
    split differs from one process, as in the replicated fleet."""
    dv, da = _sharded_vs_native(live, images, stem, _tiny_for(stem, request), tmp_path, "")
    assert dv["max"] <= TOL and da["max"] <= TOL


def test_sharded_int8_convrot_template_matches_native(live, images, tiny_25, tmp_path):
    """LTX-2.5's own weight format, int8-convrot, kept int8 in the shards (gathered as bytes): as close to the native
    run as the replicated int8 swap is (`INT8_REL_L2`: W8A8 rounding flips, reasoned in test_templates_live)."""
    dv, da = _sharded_vs_native(live, images, "video_ltx2_5_t2v",
                                {**tiny_25, "checkpoint": tiny_25["checkpoint_int8"]}, tmp_path, " int8-convrot")
    assert dv["rel_l2"] <= INT8_REL_L2 and da["rel_l2"] <= INT8_REL_L2
    assert dv["max"] <= INT8_MAX and da["max"] <= INT8_MAX
