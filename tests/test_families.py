"""The model-family table: detection, the component table, recipes — and no version-string comparisons elsewhere."""
from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from mgpu_backend.engine import sampling as S
from mgpu_backend.models import families as FM
from mgpu_backend.testing.tiny import tiny_transformer_metadata

ROOT = Path(__file__).resolve().parent.parent
_VERSION = re.compile(r"^2\.\d$")


def _is_version(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(_VERSION.match(node.value))


def _holds_version(node) -> bool:
    if _is_version(node):
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_is_version(e) for e in node.elts)


def test_no_version_string_comparisons_outside_the_family_table():
    """`x == "2.3"`, `v in ("2.0", "2.3")` or a `{"2.0": …}` lookup table anywhere in the engine or the nodes is a
    family decision made outside `models/families.py` (docs/design/layer-contracts.md)."""
    found = []
    for path in sorted([*(ROOT / "mgpu_backend").rglob("*.py"), *(ROOT / "nodes").rglob("*.py")]):
        if path.name == "families.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and (_holds_version(node.left)
                                                  or any(_holds_version(c) for c in node.comparators)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Dict) and any(k is not None and _is_version(k) for k in node.keys):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "version-string decisions outside the family table:\n" + "\n".join(found)


@pytest.mark.parametrize("name", FM.NAMES)
def test_tiny_metadata_detects_its_own_family(name):
    family = FM.get_family(name)
    meta = tiny_transformer_metadata(name)
    keys = {"keyframes_abs_pos_embedding"} if family.keyframe_embedding else set()
    assert FM.detect_family(meta, keys) is family


def test_detection_rules():
    v23 = tiny_transformer_metadata("2.3")
    block = "transformer_blocks.0."
    with_bias = {block + "ff.net.0.proj.weight", block + "ff.net.0.proj.bias"}
    without_bias = {block + "ff.net.0.proj.weight"}
    assert FM.detect_family(tiny_transformer_metadata("2.0"), with_bias) is FM.LTX_2_0
    assert FM.detect_family(v23, with_bias) is FM.LTX_2_3
    # LTX-2.5: the video feed-forward has no bias (keys or metadata), or the keyframe embedding is there
    assert FM.detect_family(v23, without_bias) is FM.LTX_2_5
    assert FM.detect_family({**v23, "ff_bias": False}, ()) is FM.LTX_2_5
    assert FM.detect_family(v23, with_bias | {"keyframes_abs_pos_embedding"}) is FM.LTX_2_5
    prefixed = {"model.diffusion_model." + k for k in without_bias}
    assert FM.detect_family(v23, prefixed, "model.diffusion_model.") is FM.LTX_2_5


def test_get_family_names_the_known_families():
    assert FM.get_family("2.5") is FM.LTX_2_5 and FM.get_family(FM.LTX_2_3) is FM.LTX_2_3
    with pytest.raises(ValueError, match=r"'2\.4'.*2\.0, 2\.3, 2\.5"):
        FM.get_family("2.4")


def test_component_tables():
    for family in FM.FAMILIES.values():
        names = [c.name for c in family.components]
        assert len(names) == len(set(names))
        assert {"transformer", "video_connector", "audio_connector", "text_projection", "video_vae", "audio_vae",
                "vocoder", "upsampler"} <= set(names)
        assert family.component("vocoder").dtype_rule == FM.DTYPE_FLOAT32
        assert family.component("transformer").dtype_rule == FM.DTYPE_QUANTIZED
        assert not family.component("upsampler").required
        with pytest.raises(KeyError, match="no component"):
            family.component("nope")
    # where the text projection lives: the checkpoint (2.0 / 2.3) or the Gemma 4 file (2.5)
    assert FM.LTX_2_3.component("text_projection").file_slot == "transformer"
    assert FM.LTX_2_5.component("text_projection").file_slot == "text_encoder"
    assert FM.LTX_2_5.text_encoder.projection_location == "text_encoder"
    assert FM.LTX_2_5.per_component_release and not FM.LTX_2_3.per_component_release
    assert [f.text_split for f in (FM.LTX_2_0, FM.LTX_2_3, FM.LTX_2_5)] == [
        FM.SPLIT_SHARED, FM.SPLIT_VIDEO_AUDIO, FM.SPLIT_VIDEO_AUDIO]
    assert FM.LTX_2_0.conditioning_width(3840, 3840) == 3840
    assert FM.LTX_2_5.conditioning_width(4096, 2048) == 6144
    with pytest.raises(ValueError, match="file_slot"):
        FM.ComponentSpec("x", "nowhere", "vae", ("",), ("k",), None, None)


def test_recipes_and_guidance_defaults():
    assert S.default_steps("2.0") == 40 and S.default_steps("2.3") == 30 and S.default_steps("2.5") == 8
    assert S.default_guidance("2.0") == (S.VIDEO_GUIDANCE_LTX2, S.AUDIO_GUIDANCE_LTX2)
    assert S.default_guidance(FM.LTX_2_3) == (S.VIDEO_GUIDANCE_LTX23, S.AUDIO_GUIDANCE_LTX23)
    r = FM.LTX_2_5.recipe
    assert r.pipeline == "distilled" and r.sampler == "euler_ancestral" and r.fps == 24.0
    assert r.stage1_sigmas == S.DISTILLED_SIGMAS
    assert r.stage2_sigmas == (0.85, 0.725, 0.4219, 0.0)
    assert FM.LTX_2_3.recipe.stage2_sigmas == S.DISTILLED_STAGE2_SIGMAS


def _template(name: str) -> dict | None:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "templates" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def test_ltx25_recipe_equals_comfyui_template():
    """The `video_ltx2_5_t2v` template (PyPI `comfyui-workflow-templates-json`): `ManualSigmas` of both stages,
    `KSamplerSelect` euler_ancestral, `LTXVDualCFGGuider` 1 / 1. Skips where the package is not installed."""
    template = _template("video_ltx2_5_t2v")
    if template is None:
        pytest.skip("comfyui-workflow-templates-json with video_ltx2_5_t2v is not installed here")
    nodes = [n for sg in template["definitions"]["subgraphs"] for n in sg["nodes"]]
    sigmas = sorted((tuple(float(x) for x in n["widgets_values"][0].split(",")) for n in nodes
                     if n["type"] == "ManualSigmas"), key=len, reverse=True)
    r = FM.LTX_2_5.recipe
    assert sigmas == [r.stage1_sigmas, r.stage2_sigmas]
    assert {n["widgets_values"][0] for n in nodes if n["type"] == "KSamplerSelect"} == {r.sampler}
    assert all(n["widgets_values"][:2] == [1, 1] for n in nodes if n["type"] == "LTXVDualCFGGuider")
