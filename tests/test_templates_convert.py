"""The template converter (tests/templates/convert.py), without a server.

A small hand-written UI graph covers the frontend rules (subgraph expansion and naming, Reroute, bypass, mute,
notes, positional widgets with control_after_generate / dynamic combos / multi-type widgets, promoted subgraph
widgets); ComfyUI's real LTX templates (when the `comfyui-workflow-templates-json` package or LTX2_TEMPLATES_DIR is
there) must convert with the template's own defaults, and the swaps must change only what they say.
"""
from __future__ import annotations

import pytest

from templates import convert as C

INFO = C.load_object_info()


def _node(nid, typ, widgets=None, inputs=(), outputs=(), mode=0, **extra):
    return {"id": nid, "type": typ, "mode": mode, "widgets_values": widgets or [],
            "inputs": [dict(i) for i in inputs], "outputs": [dict(o) for o in outputs], **extra}


def _inp(name, typ, link=None, widget=False):
    d = {"name": name, "type": typ, "link": link}
    if widget:
        d["widget"] = {"name": name}
    return d


def small_ui() -> dict:
    """Top: LoadImage -> [subgraph S] -> SaveVideo-like output; S holds a Reroute, a bypassed and a muted node."""
    sid = "11111111-2222-3333-4444-555555555555"
    sub = {
        "id": sid, "name": "S",
        "inputs": [{"name": "image", "type": "IMAGE", "linkIds": [101]},
                   {"name": "seed", "label": "seed", "type": "INT", "linkIds": [102]},
                   {"name": "frames", "label": "frames", "type": "INT", "linkIds": [103]}],
        "outputs": [{"name": "LATENT", "type": "LATENT", "linkIds": [110]}],
        "nodes": [
            _node(1, "RandomNoise", [7, "randomize"], [_inp("noise_seed", "INT", 102, True)],
                  [{"name": "NOISE", "type": "NOISE"}]),
            _node(2, "EmptyLTXVLatentVideo", [768, 512, 97, 1], [_inp("length", "INT", 103, True)],
                  [{"name": "LATENT", "type": "LATENT"}]),
            _node(3, "Reroute", None, [_inp("", "*", 104)], [{"name": "", "type": "LATENT"}]),
            _node(4, "LTXVCropGuides", None, [_inp("positive", "CONDITIONING"), _inp("negative", "CONDITIONING"),
                                              _inp("latent", "LATENT", 105)],
                  [{"name": "positive", "type": "CONDITIONING"}, {"name": "negative", "type": "CONDITIONING"},
                   {"name": "latent", "type": "LATENT"}], mode=C.BYPASS),
            _node(5, "LTXVEmptyLatentAudio", [97, 25, 1], [_inp("audio_vae", "VAE")],
                  [{"name": "Latent", "type": "LATENT"}], mode=C.MUTED),
            _node(6, "ResizeImageMaskNode", ["scale dimensions", 1920, 1088, "center", "lanczos"],
                  [_inp("input", "IMAGE,MASK", 101)], [{"name": "resized", "type": "IMAGE"}]),
            _node(7, "LTXVPreprocess", [18], [_inp("image", "IMAGE", 106)], [{"name": "output_image",
                                                                                 "type": "IMAGE"}]),
            _node(8, "MarkdownNote", ["# hello"]),
        ],
        "links": [
            {"id": 101, "origin_id": -10, "origin_slot": 0, "target_id": 6, "target_slot": 0, "type": "IMAGE"},
            {"id": 102, "origin_id": -10, "origin_slot": 1, "target_id": 1, "target_slot": 0, "type": "INT"},
            {"id": 103, "origin_id": -10, "origin_slot": 2, "target_id": 2, "target_slot": 0, "type": "INT"},
            {"id": 104, "origin_id": 2, "origin_slot": 0, "target_id": 3, "target_slot": 0, "type": "LATENT"},
            {"id": 105, "origin_id": 3, "origin_slot": 0, "target_id": 4, "target_slot": 2, "type": "LATENT"},
            {"id": 106, "origin_id": 6, "origin_slot": 0, "target_id": 7, "target_slot": 0, "type": "IMAGE"},
            {"id": 110, "origin_id": 4, "origin_slot": 2, "target_id": -20, "target_slot": 0, "type": "LATENT"},
        ],
    }
    return {
        "nodes": [
            _node(20, "LoadImage", ["a.png", "image"], [], [{"name": "IMAGE", "type": "IMAGE"}]),
            _node(21, sid, [42, 121], [_inp("image", "IMAGE", 1), _inp("seed", "INT", None, True),
                                       _inp("frames", "INT", None, True)], [{"name": "LATENT", "type": "LATENT"}]),
            _node(22, "SaveLatent", ["out"], [_inp("samples", "LATENT", 2)]),
        ],
        "links": [[1, 20, 0, 21, 0, "IMAGE"], [2, 21, 0, 22, 0, "LATENT"]],
        "definitions": {"subgraphs": [sub]},
    }


def test_flattens_subgraphs_reroutes_bypass_mute_and_notes():
    api = C.ui_to_api(small_ui(), INFO)
    # the frontend's ids for inner nodes; notes, the muted node and nodes no output needs are gone
    assert set(api) == {"21:2", "22"}  # LoadImage, RandomNoise, the resize feed no output node: pruned
    assert api["22"] == {"class_type": "SaveLatent", "inputs": {"filename_prefix": "out", "samples": ["21:2", 0]}}
    # subgraph widget inputs take the instance's values (positional over its widget inputs)
    assert api["21:2"]["inputs"] == {"width": 768, "height": 512, "length": 121, "batch_size": 1}
    # (RandomNoise is not reachable from the output here, but its value mapping is checked below)


def test_positional_widgets_follow_object_info():
    ui = small_ui()
    api = C._Flattener(ui, INFO).run()  # before pruning
    # control_after_generate consumed; the instance value (42) wins over the node's own (7)
    assert api["21:1"]["inputs"] == {"noise_seed": 42}
    # a V3 dynamic combo: its chosen option's widgets follow it, named combo.widget, in ComfyUI's order
    assert api["21:6"]["inputs"] == {"input": ["20", 0], "resize_type": "scale dimensions",
                                     "resize_type.width": 1920, "resize_type.height": 1088,
                                     "resize_type.crop": "center", "scale_method": "lanczos"}
    # a seed inside a dynamic combo without control_after_generate takes one value
    gen = C.widget_values(_node(9, "TextGenerateLTX2Prompt", ["", 2048, "on", 0.7, 64, 0.95, 0.05, 1.05, 0, 0,
                                                              False, True]), INFO)
    assert gen["sampling_mode.seed"] == 0 and gen["sampling_mode.presence_penalty"] == 0
    assert gen["thinking"] is False and gen["use_default_template"] is True
    # LoadImage's upload widget value ('image') is not an input
    assert api["20"]["inputs"] == {"image": "a.png"}
    # a multi-type widget ("FLOAT,INT" with widgetType FLOAT) takes its value; the muted node is not emitted
    assert "21:5" not in api
    audio = C.widget_values(_node(9, "LTXVEmptyLatentAudio", [97, 25, 1]), INFO)
    assert audio == {"frames_number": 97, "frame_rate": 25, "batch_size": 1}


def test_named_widget_values_win_and_unknown_names_are_dropped():
    node = _node(9, "CreateVideo", [24, "auto", "sRGB"],
                 widgets_values_named={"fps": 24, "bit_depth": 8, "color_space": "sRGB"})
    assert C.widget_values(node, INFO) == {"fps": 24, "bit_depth": 8}  # 0.33's CreateVideo has no color_space


def test_positional_widgets_without_object_info_are_refused():
    with pytest.raises(C.ConversionError, match="RandomNoise"):
        C.widget_values(_node(9, "RandomNoise", [1, "fixed"]), None)


def test_set_template_inputs_by_label():
    ui = C.set_template_inputs(small_ui(), frames=33, seed=5)
    api = C._Flattener(ui, INFO).run()
    assert api["21:2"]["inputs"]["length"] == 33 and api["21:1"]["inputs"]["noise_seed"] == 5
    with pytest.raises(C.ConversionError, match="width"):
        C.set_template_inputs(small_ui(), width=3)


# ---- the swaps on a small LTX-like API graph ------------------------------------------------------------------------


def small_api() -> dict:
    n = lambda cls, **inputs: {"class_type": cls, "inputs": inputs}  # noqa: E731
    return {
        "1": n("CheckpointLoaderSimple", ckpt_name="ltx-2.3-22b-dev-fp8.safetensors"),
        "2": n("LoraLoaderModelOnly", model=["1", 0], lora_name="distilled.safetensors", strength_model=0.5),
        "3": n("LTXAVTextEncoderLoader", text_encoder="gemma.safetensors", ckpt_name="ltx-2.3-22b-dev-fp8.safetensors",
               device="default"),
        "4": n("CLIPTextEncode", clip=["3", 0], text="a cat"),
        "5": n("CLIPTextEncode", clip=["3", 0], text="blurry"),
        "6": n("LTXVConditioning", positive=["4", 0], negative=["5", 0], frame_rate=25),
        "7": n("CFGGuider", model=["2", 0], positive=["6", 0], negative=["6", 1], cfg=1),
        "8": n("SamplerCustomAdvanced", guider=["7", 0], latent_image=["9", 0]),
        "9": n("EmptyLTXVLatentVideo", width=768, height=512, length=97, batch_size=1),
        "10": n("VAEDecodeTiled", samples=["8", 0], vae=["1", 2], tile_size=768, overlap=64, temporal_size=4096,
                temporal_overlap=4),
        "11": n("SaveVideo", video=["10", 0], filename_prefix="x"),
    }


def test_model_swap_rewires_only_the_model_output():
    api = small_api()
    out = C.swap_model_loader(api, devices="cpu:2")
    new = C.nodes_of(out, "LTX2MGPU_LoadDiffusionModel")
    assert len(new) == 1 and out[new[0]]["inputs"] == {"unet_name": "ltx-2.3-22b-dev-fp8.safetensors",
                                                       "devices": "cpu:2", "world_size": 0}
    assert out["2"]["inputs"]["model"] == [new[0], 0]
    assert out["10"]["inputs"]["vae"] == ["1", 2] and "1" in out  # ComfyUI's loader stays for the VAE
    changed = {k for k in api if api[k] != out.get(k)}
    assert changed == {"2"}


def test_model_swap_via_checkpoint_uses_its_model_output_and_drops_an_unused_loader():
    api = small_api()
    del api["10"], api["11"]
    api["11"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0]}}
    out = C.swap_model_loader(api, via="checkpoint", checkpoint="t.safetensors", gemma="g.safetensors")
    loader = C.nodes_of(out, "LTX2MGPU_LoadCheckpoint")[0]
    assert out["2"]["inputs"]["model"] == [loader, 1] and "1" not in out


def test_model_swap_refuses_a_graph_without_one_model_loader():
    api = small_api()
    api["12"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "x"}}
    api["2b"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["12", 0]}}
    with pytest.raises(C.ConversionError, match="one model loader"):
        C.swap_model_loader(api)


def test_text_swap_replaces_the_pair_and_keeps_the_prompts():
    out = C.swap_text_encode(small_api(), checkpoint="t.safetensors", gemma="g.safetensors", devices="cpu:2")
    te = C.nodes_of(out, "LTX2MGPU_TextEncode")[0]
    assert out[te]["inputs"]["prompt"] == "a cat" and out[te]["inputs"]["negative_prompt"] == "blurry"
    assert out["6"]["inputs"]["positive"] == [te, 0] and out["6"]["inputs"]["negative"] == [te, 1]
    assert not C.nodes_of(out, "CLIPTextEncode") and not C.nodes_of(out, "LTXAVTextEncoderLoader")


def test_decode_swap_maps_the_tile_overlap():
    api = C.swap_model_loader(small_api(), devices="cpu:2")
    out = C.swap_decode(api)
    d = out["10"]
    assert d["class_type"] == "LTX2MGPU_DistributedDecode"
    assert d["inputs"]["overlap"] == 2 and d["inputs"]["latent"] == ["8", 0]
    assert d["inputs"]["fleet"] == [C.nodes_of(out, "LTX2MGPU_LoadDiffusionModel")[0], 1]


def test_point_files():
    out = C.point_files(small_api(), {"checkpoint": "t.safetensors", "gemma": "g.safetensors"},
                        loras={"*": "l.safetensors"})
    assert out["1"]["inputs"]["ckpt_name"] == "t.safetensors"
    assert out["3"]["inputs"] == {"text_encoder": "g.safetensors", "ckpt_name": "t.safetensors", "device": "default"}
    assert out["2"]["inputs"]["lora_name"] == "l.safetensors"


def test_rewire_to_value_replaces_links_by_a_literal():
    api = {"1": {"class_type": "ResolutionSelector", "inputs": {}},
           "2": {"class_type": "PrimitiveInt", "inputs": {"value": ["1", 0]}},
           "3": {"class_type": "PrimitiveInt", "inputs": {"value": ["1", 1]}}}
    assert C.rewire_to_value(api, ["1", 0], 256) == 1
    assert api["2"]["inputs"]["value"] == 256 and api["3"]["inputs"]["value"] == ["1", 1]


def test_point_files_tells_the_ltx25_vae_loaders_apart():
    """LTX-2.5 templates load the video and the audio VAE through two VAELoaders: each gets its own file."""
    api = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "ltx-2.5-video-vae-bf16.safetensors"}},
           "2": {"class_type": "VAELoader", "inputs": {"vae_name": "ltx-2.5-audio-vae-bf16.safetensors"}},
           "3": {"class_type": "UNETLoader", "inputs": {"unet_name": "x.safetensors", "weight_dtype": "default"}}}
    out = C.point_files(api, {"video_vae": "v.safetensors", "audio_vae": "a.safetensors",
                              "diffusion_model": "t.safetensors"})
    assert [out[k]["inputs"].get("vae_name", out[k]["inputs"].get("unet_name")) for k in "123"] == [
        "v.safetensors", "a.safetensors", "t.safetensors"]
    assert C.point_files(api, {})["1"] == api["1"]  # a file the mapping does not cover is left as it is


# ---- ComfyUI's own templates (skipped without the package) -----------------------------------------------------------

TEMPLATE_DIR = C.templates_dir()
needs_templates = pytest.mark.skipif(TEMPLATE_DIR is None, reason="no comfyui-workflow-templates-json package "
                                                                  "(or LTX2_TEMPLATES_DIR)")


def _one(api, cls):
    ids = C.nodes_of(api, cls)
    assert ids, cls
    return [api[i]["inputs"] for i in ids]


@needs_templates
@pytest.mark.parametrize("stem", C.TEMPLATES["2.0"] + C.TEMPLATES["2.3"] + C.TEMPLATES["2.5"])
def test_every_ltx_template_converts(stem):
    api = C.ui_to_api(C.load_template(stem), INFO)
    assert C.nodes_of(api, "SaveVideo")
    for k, v in api.items():
        assert v["class_type"] in INFO, (k, v["class_type"])
        known = C._known_names(INFO[v["class_type"]])
        unknown = {n for n in v["inputs"] if n not in known and n.split(".")[0] not in known}  # autogrow: values.a
        assert not unknown, (k, v["class_type"], unknown)
        for val in v["inputs"].values():
            if C.is_link(val):
                assert val[0] in api, (k, val)
        # every required input has a value or a link, as ComfyUI's prompt validation demands (the IC-LoRA template's
        # prompt switch takes `on_false` from the subgraph's promoted prompt widget)
        given = set(v["inputs"]) | {n.split(".")[0] for n in v["inputs"]}  # autogrow / dynamic combo: values.a
        missing = set(INFO[v["class_type"]]["input"].get("required", {})) - given
        assert not missing, (k, v["class_type"], missing)


@needs_templates
def test_an_unlinked_subgraph_input_takes_the_inner_widget_it_drives():
    """The IC-LoRA template's `prompt` subgraph input feeds TextGenerateLTX2Prompt's prompt widget (promoted on the
    subgraph node) and the prompt switch's `on_false`: both get the widget's text, as the frontend queues it."""
    api = C.ui_to_api(C.load_template("video_ltx2_3_ic_lora"), INFO)
    (gen,) = C.nodes_of(api, "TextGenerateLTX2Prompt")
    (switch,) = [k for k in C.nodes_of(api, "ComfySwitchNode") if api[k]["inputs"].get("on_true") == [gen, 0]]
    prompt = api[gen]["inputs"]["prompt"]
    assert isinstance(prompt, str) and prompt.startswith("A slow forward dolly shot")
    assert api[switch]["inputs"]["on_false"] == prompt


@needs_templates
def test_ltx23_t2v_keeps_the_template_defaults():
    api = C.ui_to_api(C.load_template("video_ltx2_3_t2v"), INFO)
    sigmas = sorted(v["sigmas"] for v in _one(api, "ManualSigmas"))
    assert sigmas == ["0.85, 0.7250, 0.4219, 0.0",
                      "1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"]
    assert {v["sampler_name"] for v in _one(api, "KSamplerSelect")} == {"euler"}
    assert _one(api, "LoraLoaderModelOnly")[0]["strength_model"] == 0.5
    assert _one(api, "VAEDecodeTiled")[0] == {"samples": _one(api, "VAEDecodeTiled")[0]["samples"],
                                               "vae": _one(api, "VAEDecodeTiled")[0]["vae"], "tile_size": 768,
                                               "overlap": 64, "temporal_size": 4096, "temporal_overlap": 4}
    prims = {tuple(sorted(v.items())) for v in _one(api, "PrimitiveInt")}
    assert {(("value", 1280),), (("value", 720),), (("value", 5),), (("value", 25),)} <= prims


@needs_templates
@pytest.mark.parametrize("stem", C.TEMPLATES["2.0"] + C.TEMPLATES["2.3"] + C.TEMPLATES["2.5"])
def test_swapped_template_differs_only_in_the_model_source(stem):
    """Every change is a MODEL input that read the template's loader (now the MGPU model), or that loader itself
    (removed when nothing else read it: LTX-2.5's UNETLoader; LTX-2.0 / 2.3's CheckpointLoaderSimple stays for the
    VAE). The text encoder, prompt enhancer, guiders' settings, sigmas, samplers and decode are untouched."""
    api = C.ui_to_api(C.load_template(stem), INFO)
    out = C.swap_model_loader(api, devices="cpu:2")
    (mgpu,) = C.nodes_of(out, "LTX2MGPU_LoadDiffusionModel")
    for k in api:
        if k not in out:
            assert api[k]["class_type"] in C.MODEL_LOADERS, (stem, k, api[k]["class_type"])
            continue
        for name, old in api[k]["inputs"].items():
            new = out[k]["inputs"][name]
            if new != old:
                assert new == [mgpu, 0] and api[old[0]]["class_type"] in C.MODEL_LOADERS and old[1] == 0, \
                    (stem, k, name, old, new)
    assert set(out) - set(api) == {mgpu}


# ---- the shipped workflows made from the templates (workflows/comfyui-*.json) ----------------------------------------

SHIPPED = sorted(p.stem for p in (C.HERE.parent.parent / "workflows").glob("comfyui-*.json"))
WF = C.HERE.parent.parent / "workflows"


def test_shipped_template_workflows_exist():
    assert {"comfyui-ltx2.3-t2v-mgpu", "comfyui-ltx2.3-i2v-mgpu", "comfyui-ltx2.5-t2v-mgpu",
            "comfyui-ltx2.5-i2v-mgpu"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_workflow_is_the_minimal_swap_and_its_api_twin(name):
    import json

    ui = json.loads((WF / f"{name}.json").read_text())
    api = json.loads((WF / "api" / f"{name}.json").read_text())
    assert (WF / f"{name}.jpg").read_bytes()[:3] == b"\xff\xd8\xff"
    assert C.ui_to_api(ui, INFO) == api  # the API twin is what the frontend queues for the UI file
    mgpu = C.nodes_of(api, "LTX2MGPU_LoadDiffusionModel")
    assert len(mgpu) == 1 and api[mgpu[0]]["inputs"]["devices"] == "all"
    models = [(k, n) for k, v in api.items() for n, val in v["inputs"].items()
              if C.is_link(val) and api[val[0]]["class_type"] in C.MODEL_LOADERS and val[1] == 0]
    assert not models, models  # no MODEL comes from ComfyUI's loader any more ...
    if "ltx2.5" in name:  # ... LTX-2.5: the VAELoaders and CLIPLoaders stay; 2.0 / 2.3: the checkpoint, for its VAE
        assert len(C.nodes_of(api, "VAELoader")) == 2 and not C.nodes_of(api, "UNETLoader")
    else:
        assert C.nodes_of(api, "CheckpointLoaderSimple")
    assert all(v["class_type"] in INFO or v["class_type"] == "LTX2MGPU_LoadDiffusionModel" for v in api.values())


@needs_templates
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_workflow_equals_the_template_swapped_now(name):
    import json

    from templates import make_workflows

    stem = {v: k for k, v in make_workflows.SHIPPED.items()}[name]
    ui = json.loads((WF / f"{name}.json").read_text())
    assert ui == json.loads(json.dumps(C.swap_model_loader_ui(C.load_template(stem)))), \
        "regenerate with tests/templates/make_workflows.py"


@needs_templates
def test_ic_lora_depth_preprocessor_becomes_canny_and_nothing_else_changes():
    """The MoGe depth branch of the IC-LoRA template -> Canny on the same frames: the nodes that read the depth
    images (LTXVAddGuide's guide image, GetImageSize for the length) read Canny; no MoGe node is left; every other
    node is the template's, unchanged."""
    api = C.ui_to_api(C.load_template("video_ltx2_3_ic_lora"), INFO)
    out = C.swap_depth_for_canny(api)
    (render,) = [k for k in C.nodes_of(api, "MoGeRender") if api[k]["inputs"]["output"] == "depth"]
    (inference,) = C.nodes_of(api, "MoGeInference")
    assert out["ic_control_canny"]["inputs"] == {"image": api[inference]["inputs"]["image"], **C.CANNY}
    readers = {k for k, _name in C.consumers(api, render)}
    assert readers and {k for k, _name in C.consumers(out, "ic_control_canny")} == readers
    assert {out[k]["class_type"] for k in readers} >= {"LTXVAddGuide", "GetImageSize"}
    assert not [k for k, v in out.items() if "MoGe" in v["class_type"]]
    moge = {k for k, v in api.items() if "MoGe" in v["class_type"]}
    for k, v in api.items():
        if k not in moge and k not in readers:
            assert out[k] == v, k
    with pytest.raises(C.ConversionError, match="MoGeRender"):
        C.swap_depth_for_canny(out)


# ---- workflows saved by the previous release (issue 36): the loaders' new inputs --------------------------------------

SAVED = C.HERE.parent / "fixtures" / "saved-workflows-098787a"
NEW_LOADER_INPUTS = ("weights", "int8_compute", "gpu_budget_gib")


def _widget_specs(node_type: str) -> list[tuple[str, bool, object]]:
    """(name, optional, default) of a node type's widgets in ComfyUI's order, from `object_info.json`."""
    info = INFO[node_type]
    optional = set(info["input_order"].get("optional", []))
    return [(name, name in optional, opts.get("default")) for name, typ, opts in C._spec_inputs(info)
            if C._is_widget(typ, opts)]


def test_the_loaders_entries_are_the_loaders_inputs():
    """`object_info.json` holds the pack's two loaders as their /object_info (refreshed from a live ComfyUI 0.33 with
    this pack): Load Diffusion Model (MGPU)'s widgets are what the template swap writes (`DIFFUSION_LOADER_WIDGETS`,
    in order, the optional ones drawn as such) with `DIFFUSION_LOADER_DEFAULTS`; Load Checkpoint (MGPU)'s widgets
    are, in order, the inputs of the shipped API workflows (which carry every widget). Both end with the inputs the
    previous release's workflows lack."""
    import json

    specs = _widget_specs("LTX2MGPU_LoadDiffusionModel")
    assert [(n, o) for n, o, _d in specs] == [(n, o) for n, _t, o in C.DIFFUSION_LOADER_WIDGETS]
    assert {n: d for n, _o, d in specs if n in NEW_LOADER_INPUTS} == C.DIFFUSION_LOADER_DEFAULTS
    names = [n for n, _o, _d in _widget_specs("LTX2MGPU_LoadCheckpoint")]
    assert tuple(names[-3:]) == NEW_LOADER_INPUTS == tuple(n for n, _o, _d in specs[-3:])
    for path in sorted(WF.glob("api/ltx2-mgpu-*.json")):
        api = json.loads(path.read_text())
        (loader,) = C.nodes_of(api, "LTX2MGPU_LoadCheckpoint")
        assert list(api[loader]["inputs"]) == names, path.name  # the shipped workflows have the current inputs


@pytest.mark.parametrize("name", ["ltx2-mgpu-two-stage-t2v", "comfyui-ltx2.5-t2v-mgpu"])
def test_a_workflow_saved_by_the_previous_release_still_loads(name):
    """A UI workflow saved before the loaders had `weights` / `int8_compute` / `gpu_budget_gib` (the shipped file at
    098787a, committed under tests/fixtures/) loads as the frontend loads it: its loader's widget values named by
    position (Load Checkpoint (MGPU), 11 values) or by name (Load Diffusion Model (MGPU)) onto the loader's current
    widgets give the values it was saved with, every required widget among them and no unknown one; the widgets it
    lacks take the node's defaults — and that is exactly the loader of the workflow shipped now. For the template
    workflow the whole queued graph equals the current API twin but for those three inputs."""
    import json

    old = json.loads((SAVED / f"{name}.json").read_text())
    new = json.loads((WF / f"{name}.json").read_text())

    def loader(ui):
        graphs = [ui] + ui.get("definitions", {}).get("subgraphs", [])
        (node,) = [n for g in graphs for n in g["nodes"] if n["type"] in C.PACK_LOADERS]
        return node

    node = loader(old)
    specs = _widget_specs(node["type"])
    got = C.widget_values(node, INFO)
    required = [n for n, optional, _d in specs if not optional]
    assert set(required) <= set(got) <= {n for n, _o, _d in specs}, got
    assert not set(got) & set(NEW_LOADER_INPUTS)  # saved before they existed
    if "widgets_values_named" not in node:  # positional: the first values, in the widgets' order
        assert list(got) == [n for n, _o, _d in specs][:len(node["widgets_values"])]
        assert list(got.values()) == node["widgets_values"]
    loaded = {**{n: d for n, _o, d in specs if n not in got}, **got}  # the frontend: defaults for the rest
    assert loaded == C.widget_values(loader(new), INFO)
    if name.startswith("comfyui-"):
        old_api, new_api = C.ui_to_api(old, INFO), json.loads((WF / "api" / f"{name}.json").read_text())
        assert old_api == json.loads((SAVED / "api" / f"{name}.json").read_text())
        (k,) = C.nodes_of(new_api, "LTX2MGPU_LoadDiffusionModel")
        assert {**old_api[k]["inputs"], **C.DIFFUSION_LOADER_DEFAULTS} == new_api[k]["inputs"]
        assert {j: v for j, v in old_api.items() if j != k} == {j: v for j, v in new_api.items() if j != k}
