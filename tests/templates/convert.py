"""ComfyUI workflow templates (UI format, subgraphs included) -> API graphs, and the pack's minimal swap.

What a user does by hand, done by a script so that the live tests can run ComfyUI's *own* LTX templates:

1. `ui_to_api(ui, object_info)` flattens the template as ComfyUI's frontend does when it queues it
   (`graphToPrompt`): subgraph instances are expanded (node ids `outer:inner`, as the frontend names them), Reroutes
   and bypassed nodes (mode 4) are passed through, muted nodes (mode 2) and notes dropped, and widget values are
   named — from the template's own `widgets_values_named` where it has them, else positionally through ComfyUI's
   `/object_info` (INT / COMBO widgets with `control_after_generate` and upload widgets carry one extra value;
   a V3 dynamic combo is followed by its chosen option's widgets, named `combo.widget`).
2. `swap_model_loader(api, ...)`: ONLY the MODEL output of the template's model loader (CheckpointLoaderSimple /
   UNETLoader) is rewired to the pack's native MODEL (`LTX2MGPU_LoadDiffusionModel`, or the `model` output of
   `LTX2MGPU_LoadCheckpoint` when the fleet must also encode text). The template's CheckpointLoaderSimple stays for
   its VAE (and the audio VAE loader for its audio VAE).
3. `swap_decode(api)`: optionally `VAEDecodeTiled` -> Distributed Decode (MGPU), its tile settings mapped.
4. `swap_text_encode(api, ...)`: ComfyUI's Gemma loaders (LTXAVTextEncoderLoader, CLIPLoader type ltxv) build the
   12B shape and cannot load a tiny Gemma, so tiny-model tests replace the positive/negative CLIPTextEncode pair by
   the pack's Text Encode (MGPU). Tests that do this say so; a user with the real Gemma keeps ComfyUI's text nodes.
5. `point_files(api, files)`: every model-file widget is pointed at the tiny files.
6. `swap_depth_for_canny(api)`: tiny-model tests of the IC-LoRA template only: its MoGe depth preprocessor (a
   ViT-L model, no tiny one) -> ComfyUI core's Canny on the same frames.

Standard library only (the tests run it in the project's venv; the templates are read from the
`comfyui-workflow-templates-json` package, never committed). `object_info.json` beside this file is a subset of
ComfyUI 0.33.0's `/object_info` for the node types of the LTX templates; `python tests/templates/convert.py
--refresh-object-info URL` regenerates it from a running server.
"""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OBJECT_INFO = HERE / "object_info.json"
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20
VIRTUAL = {"Reroute", "MarkdownNote", "Note", "PrimitiveNode"}  # frontend-only node types
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}
UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload", "upload")
BYPASS, MUTED = 4, 2

# the templates the issue names (file stems in comfyui_workflow_templates_json/templates/)
TEMPLATES = {
    "2.0": ["video_ltx2_t2v", "video_ltx2_i2v"],
    "2.3": ["video_ltx2_3_t2v", "video_ltx2_3_i2v", "video_ltx2_3_flf2v", "video_ltx2_3_ic_lora",
            "video_ltx2_3_id_lora"],
    "2.5": ["video_ltx2_5_t2v", "video_ltx2_5_i2v", "video_ltx2_5_flf2v"],
}


class ConversionError(ValueError):
    """A template this converter cannot turn into an API graph (names the node and the rule)."""


# ---- finding the templates -----------------------------------------------------------------------------------------


def templates_dir() -> Path | None:
    """The folder of ComfyUI's template JSON files: `$LTX2_TEMPLATES_DIR`, else the installed
    `comfyui_workflow_templates_json` package (ComfyUI's requirements install it), else None."""
    env = os.environ.get("LTX2_TEMPLATES_DIR")
    if env:
        return Path(env) if Path(env).is_dir() else None
    try:
        import comfyui_workflow_templates_json as pkg  # type: ignore[import-not-found]
    except ImportError:
        return None
    d = Path(pkg.__file__).resolve().parent / "templates"
    return d if d.is_dir() else None


def load_template(stem: str, directory: Path | None = None) -> dict:
    directory = directory or templates_dir()
    if directory is None:
        raise FileNotFoundError("no ComfyUI templates: set LTX2_TEMPLATES_DIR or install comfyui-workflow-templates")
    return json.loads((directory / f"{stem}.json").read_text())


def load_object_info(path: Path = OBJECT_INFO) -> dict:
    return json.loads(path.read_text())


# ---- widgets -------------------------------------------------------------------------------------------------------


def _spec_inputs(info: dict) -> list[tuple[str, Any, dict]]:
    """(name, type, options) of a node's inputs in ComfyUI's order (required, then optional)."""
    out = []
    order = info.get("input_order") or {}
    for section in ("required", "optional"):
        specs = info.get("input", {}).get(section, {})
        for name in order.get(section, list(specs)):
            spec = specs[name]
            out.append((name, spec[0], spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}))
    return out


def _is_widget(typ: Any, opts: dict) -> bool:
    return (isinstance(typ, list) or typ in WIDGET_TYPES or opts.get("widgetType") in WIDGET_TYPES) \
        and not opts.get("forceInput")


def _known_names(info: dict | None) -> set[str] | None:
    """Every input name a node type accepts, dynamic-combo sub-inputs as `combo.sub` (None: type unknown)."""
    if info is None:
        return None
    names: set[str] = set()

    def walk(inputs: dict, prefix: str) -> None:
        for name, typ, opts in _spec_inputs({"input": inputs}):
            names.add(prefix + name)
            if typ == "COMFY_DYNAMICCOMBO_V3":
                for o in opts.get("options", []):
                    walk(o.get("inputs", {}), prefix + name + ".")

    walk(info.get("input", {}), "")
    return names


def widget_values(node: dict, object_info: dict | None) -> dict[str, Any]:
    """The node's widget values by input name (UI-only extras such as `control_after_generate` left out)."""
    named = node.get("widgets_values_named")
    if isinstance(named, dict):
        known = _known_names(object_info.get(node["type"])) if object_info else None
        return {k: v for k, v in named.items() if k not in ("control_after_generate", "upload")
                and (known is None or k in known)}
    values = node.get("widgets_values")
    if values is None or values == []:
        return {}
    if isinstance(values, dict):  # some nodes (e.g. VHS) store a dict already
        return dict(values)
    if object_info is None or node["type"] not in object_info:
        raise ConversionError(f"node {node['id']} ({node['type']}): positional widgets_values and no /object_info "
                              f"entry for {node['type']} to name them")
    out: dict[str, Any] = {}
    it = iter(values)

    def take(name: str, typ: Any, opts: dict, prefix: str = "") -> None:
        try:
            v = next(it)
        except StopIteration:
            return
        key = prefix + name
        out[key] = v
        if opts.get("control_after_generate"):
            next(it, None)  # the 'fixed' / 'randomize' value
        if any(opts.get(f) for f in UPLOAD_FLAGS):
            next(it, None)  # the upload button's value
        if typ == "COMFY_DYNAMICCOMBO_V3":
            chosen = next((o for o in opts.get("options", []) if o.get("key") == v), None)
            if chosen is not None:
                for sub, styp, sopts in _spec_inputs({"input": chosen.get("inputs", {})}):
                    if _is_widget(styp, sopts):
                        take(sub, styp, sopts, prefix=key + ".")

    for name, typ, opts in _spec_inputs(object_info[node["type"]]):
        if _is_widget(typ, opts):
            take(name, typ, opts)
    return out


# ---- flattening ------------------------------------------------------------------------------------------------------


class _Graph:
    """One graph level: the top level or a subgraph definition (links normalized to tuples)."""

    def __init__(self, nodes: list[dict], links: list, definition: dict | None = None):
        self.nodes = {n["id"]: n for n in nodes}
        self.links: dict[int, tuple[int, int, int, int]] = {}
        for link in links or []:
            if isinstance(link, dict):
                self.links[link["id"]] = (link["origin_id"], link["origin_slot"], link["target_id"],
                                          link["target_slot"])
            else:
                self.links[link[0]] = (link[1], link[2], link[3], link[4])
        self.definition = definition


class _Flattener:
    def __init__(self, ui: dict, object_info: dict | None):
        self.object_info = object_info
        self.defs = {d["id"]: d for d in ui.get("definitions", {}).get("subgraphs", [])}
        self.graphs = {sid: _Graph(d["nodes"], d["links"], d) for sid, d in self.defs.items()}
        self.top = _Graph(ui["nodes"], ui["links"])
        self.api: dict[str, dict] = {}

    # a "frame" is (graph, path prefix, instance node in the parent, parent frame)
    def run(self) -> dict:
        self._emit(self.top, "", None, None)
        return self.api

    def _emit(self, graph: _Graph, prefix: str, instance: dict | None, parent) -> None:
        frame = (graph, prefix, instance, parent)
        for node in graph.nodes.values():
            if node.get("mode") in (BYPASS, MUTED) or node["type"] in VIRTUAL:
                continue
            if node["type"] in self.defs:
                self._emit(self.graphs[node["type"]], f"{prefix}{node['id']}:", node, frame)
                continue
            self.api[f"{prefix}{node['id']}"] = self._node(node, frame)

    def _node(self, node: dict, frame) -> dict:
        graph, prefix, instance, parent = frame
        inputs = dict(widget_values(node, self.object_info))
        inputs.update(self._proxy_overrides(node, frame))
        for inp in node.get("inputs", []):
            link = inp.get("link")
            if link is None:
                continue
            src = self._resolve_link(graph, link, frame, node)
            if src is _MISSING:
                if inp.get("widget") is None:
                    inputs.pop(inp["name"], None)
                continue
            inputs[inp["name"]] = src
        out = {"class_type": node["type"], "inputs": inputs}
        if node.get("title"):
            out["_meta"] = {"title": node["title"]}
        return out

    def _proxy_overrides(self, node: dict, frame) -> dict:
        """Values a subgraph instance's promoted widgets (properties.proxyWidgets) give this inner node."""
        _graph, _prefix, instance, _parent = frame
        if instance is None:
            return {}
        proxies = (instance.get("properties") or {}).get("proxyWidgets") or []
        values = instance.get("widgets_values") or []
        if not isinstance(values, list) or len(values) != len(proxies):
            return {}
        return {w: v for (nid, w), v in zip(proxies, values) if str(nid) == str(node["id"])}

    def _resolve_link(self, graph: _Graph, link_id: int, frame, target: dict | None = None):
        if link_id not in graph.links:
            raise ConversionError(f"link {link_id} missing from its graph")
        origin_id, origin_slot, _t, _ts = graph.links[link_id]
        return self._resolve_output(graph, origin_id, origin_slot, frame)

    def _resolve_output(self, graph: _Graph, origin_id: int, slot: int, frame):
        """The API source ([node id, slot] or a literal) of output `slot` of node `origin_id` in `graph`."""
        _g, prefix, instance, parent = frame
        if origin_id == SUBGRAPH_INPUT:
            return self._subgraph_input(graph, slot, frame)
        node = graph.nodes.get(origin_id)
        if node is None:
            raise ConversionError(f"link from unknown node {origin_id}")
        if node.get("mode") == MUTED:
            return _MISSING
        if node["type"] == "Reroute" or node.get("mode") == BYPASS:
            inp = self._pass_through_input(node, slot)
            if inp is None or inp.get("link") is None:
                return _MISSING
            return self._resolve_link(graph, inp["link"], frame)
        if node["type"] == "PrimitiveNode":  # legacy frontend primitive: its value
            vals = node.get("widgets_values") or []
            return vals[0] if vals else _MISSING
        if node["type"] in self.defs:  # output of a nested subgraph instance
            inner = self.graphs[node["type"]]
            out = inner.definition["outputs"][slot]
            link = next(iter(out.get("linkIds") or []), None)
            if link is None:
                return _MISSING
            return self._resolve_link(inner, link, (inner, f"{prefix}{node['id']}:", node, frame))
        return [f"{prefix}{origin_id}", slot]

    def _pass_through_input(self, node: dict, slot: int) -> dict | None:
        inputs = node.get("inputs", [])
        if node["type"] == "Reroute":
            return inputs[0] if inputs else None
        typ = node["outputs"][slot]["type"]
        if slot < len(inputs) and inputs[slot]["type"] == typ:
            return inputs[slot]
        return next((i for i in inputs if i["type"] == typ), None)

    def _subgraph_input(self, graph: _Graph, slot: int, frame):
        _g, _prefix, instance, parent = frame
        sg_input = graph.definition["inputs"][slot]
        name = sg_input["name"]
        inst_input = next((i for i in instance.get("inputs", []) if i["name"] == name), None)
        if inst_input is not None and inst_input.get("link") is not None:
            pgraph = parent[0]
            return self._resolve_link(pgraph, inst_input["link"], parent)
        values = self._instance_values(instance, graph.definition)
        if name in values:
            return values[name]
        return self._inner_widget_value(graph, sg_input, frame)

    def _inner_widget_value(self, graph: _Graph, sg_input: dict, frame):
        """An unlinked subgraph input with no value on the instance takes the value of the inner widget it drives
        (the widget the instance promotes, e.g. the IC-LoRA template's `prompt`, which feeds TextGenerateLTX2Prompt's
        prompt widget and the prompt switch's `on_false`), as the frontend queues it; _MISSING when it drives no
        widget (each inner node then keeps its own value)."""
        for link_id in sg_input.get("linkIds") or []:
            _o, _s, target_id, target_slot = graph.links[link_id]
            node = graph.nodes.get(target_id)
            if node is None or target_slot >= len(node.get("inputs", [])):
                continue
            widget = node["inputs"][target_slot].get("widget")
            if widget is None:
                continue
            values = {**widget_values(node, self.object_info), **self._proxy_overrides(node, frame)}
            if widget["name"] in values:
                return values[widget["name"]]
        return _MISSING

    def _instance_values(self, instance: dict, definition: dict) -> dict:
        named = instance.get("widgets_values_named")
        if isinstance(named, dict):
            return named
        values = instance.get("widgets_values") or []
        if (instance.get("properties") or {}).get("proxyWidgets") or not values:
            return {}
        widget_inputs = [i["name"] for i in definition["inputs"] if i["type"] in WIDGET_TYPES]
        if len(widget_inputs) != len(values):
            raise ConversionError(f"subgraph node {instance['id']} ({definition.get('name')}): {len(values)} "
                                  f"widget values for {len(widget_inputs)} widget inputs {widget_inputs}")
        return dict(zip(widget_inputs, values))


_MISSING = object()


def ui_to_api(ui: dict, object_info: dict | None = None) -> dict[str, dict]:
    """The API graph ComfyUI's frontend would queue for this UI-format workflow (see the module docstring).

    Inputs whose source is dropped (muted node, unlinked bypass) fall back to the node's own widget value, else are
    left out, as the frontend does. Raises ConversionError naming the node when widget values cannot be named."""
    api = _Flattener(ui, object_info).run()
    return prune(api, object_info)


def prune(api: dict[str, dict], object_info: dict | None = None) -> dict[str, dict]:
    """Only the nodes an output node depends on (what ComfyUI would execute), in a stable order."""
    info = object_info or {}
    outputs = [k for k, v in api.items() if info.get(v["class_type"], {}).get("output_node")
               or v["class_type"] in OUTPUT_NODES]
    keep: set[str] = set()
    stack = list(outputs)
    while stack:
        k = stack.pop()
        if k in keep or k not in api:
            continue
        keep.add(k)
        stack.extend(v[0] for v in api[k]["inputs"].values() if is_link(v))
    return {k: api[k] for k in api if k in keep}


OUTPUT_NODES = {"SaveVideo", "SaveImage", "PreviewImage", "PreviewAny", "SaveLatent", "SaveAudio", "PreviewAudio",
                "SaveAnimatedWEBP", "SaveWEBM"}


def is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


# ---- graph queries ---------------------------------------------------------------------------------------------------


def nodes_of(api: dict, class_type: str) -> list[str]:
    return [k for k, v in api.items() if v["class_type"] == class_type]


def consumers(api: dict, node_id: str, slot: int | None = None) -> list[tuple[str, str]]:
    """(node id, input name) of every input fed by `node_id` (output `slot`, or any)."""
    return [(k, name) for k, v in api.items() for name, val in v["inputs"].items()
            if is_link(val) and val[0] == node_id and (slot is None or val[1] == slot)]


def rewire(api: dict, old: list, new: list) -> int:
    n = 0
    for v in api.values():
        for name, val in v["inputs"].items():
            if is_link(val) and val == old:
                v["inputs"][name] = list(new)
                n += 1
    return n


def rewire_to_value(api: dict, old: list, value: Any) -> int:
    """Every input fed by output `old` ([node id, slot]) set to the literal `value` (what a user does by typing a
    value where a link was); returns how many inputs changed."""
    n = 0
    for v in api.values():
        for name, val in v["inputs"].items():
            if is_link(val) and val == old:
                v["inputs"][name] = value
                n += 1
    return n


def _fresh_id(api: dict, stem: str) -> str:
    i = 0
    while f"{stem}{i or ''}" in api:
        i += 1
    return f"{stem}{i or ''}"


# ---- the swaps -------------------------------------------------------------------------------------------------------

MODEL_LOADERS = {"CheckpointLoaderSimple": 0, "UNETLoader": 0}  # class -> index of its MODEL output


def swap_model_loader(api: dict, *, devices: str = "all", world_size: int = 0, via: str = "diffusion_model",
                      unet_name: str | None = None, checkpoint: str | None = None, gemma: str | None = None,
                      upscaler: str = "none", weights: str | None = None) -> dict:
    """Rewire the MODEL output of the template's model loader to the pack's native MODEL; nothing else changes.

    `weights`: the loader's `weights` input ("replicated" / "sharded"); None leaves the node's default.

    via="diffusion_model": `LTX2MGPU_LoadDiffusionModel` (unet_name = the template's file unless given).
    via="checkpoint": the `model` output (index 1) of `LTX2MGPU_LoadCheckpoint`, whose fleet also encodes text
    (use with swap_text_encode; checkpoint and gemma must be given). Returns a new graph; the template's loader is
    kept when anything else (VAE, CLIP) still reads it. Raises ConversionError when the template has no (or more
    than one) model loader."""
    api = copy.deepcopy(api)
    loaders = [k for k, v in api.items() if v["class_type"] in MODEL_LOADERS and consumers(api, k, 0)]
    if len(loaders) != 1:
        raise ConversionError(f"expected one model loader feeding a MODEL input, found {loaders}")
    old = loaders[0]
    src = api[old]["inputs"]
    name = unet_name or src.get("ckpt_name") or src.get("unet_name")
    if via == "diffusion_model":
        new_id = _fresh_id(api, "mgpu_model")
        api[new_id] = {"class_type": "LTX2MGPU_LoadDiffusionModel",
                       "inputs": {"unet_name": name, "devices": devices, "world_size": world_size}}
        slot = 0
    elif via == "checkpoint":
        if not checkpoint or not gemma:
            raise ConversionError("via='checkpoint' needs checkpoint= and gemma= file names")
        new_id = existing = next(iter(nodes_of(api, "LTX2MGPU_LoadCheckpoint")), None)
        if existing is None:
            new_id = _fresh_id(api, "mgpu_loader")
            api[new_id] = {"class_type": "LTX2MGPU_LoadCheckpoint", "inputs": {}}
        api[new_id]["inputs"].update({"checkpoint": checkpoint, "gemma": gemma, "upscaler": upscaler,
                                      "devices": devices, "world_size": world_size, "weight_dtype": "auto"})
        slot = 1
    else:
        raise ConversionError(f"via must be 'diffusion_model' or 'checkpoint', got {via!r}")
    if weights is not None:
        api[new_id]["inputs"]["weights"] = weights
    rewire(api, [old, MODEL_LOADERS[api[old]["class_type"]]], [new_id, slot])
    if not consumers(api, old):
        del api[old]
    return api


# Load Diffusion Model (MGPU)'s widgets in its input order (nodes/loader.py; checked against the node's /object_info
# entry in `object_info.json`): (name, type, optional — the frontend draws an optional input's socket with shape 7),
# and the values the swap gives the fleet options (the node's defaults)
DIFFUSION_LOADER_WIDGETS = (("unet_name", "COMBO", False), ("devices", "STRING", False), ("world_size", "INT", False),
                            ("weights", "COMBO", True), ("int8_compute", "COMBO", True),
                            ("gpu_budget_gib", "FLOAT", True))
DIFFUSION_LOADER_DEFAULTS = {"weights": "auto", "int8_compute": "auto", "gpu_budget_gib": 0.0}
# the pack's loaders, whose /object_info entries `object_info.json` keeps too: a saved workflow's positional widget
# values are named through them (tests/test_templates_convert.py, the workflows saved by the previous release)
PACK_LOADERS = ("LTX2MGPU_LoadCheckpoint", "LTX2MGPU_LoadDiffusionModel")


def swap_model_loader_ui(ui: dict, *, devices: str = "all", world_size: int = 0) -> dict:
    """The same minimal swap in the UI format (for the shipped workflows): a Load Diffusion Model (MGPU) node is
    added beside the template's model loader (in whichever graph or subgraph holds it) and every link from the
    loader's MODEL output now starts at the new node's `model` output; the loader keeps its VAE (and CLIP) links.
    The new node's `devices` and `world_size` are promoted onto the subgraph node where the template promotes
    widgets (`proxyWidgets`). Returns a new workflow; raises ConversionError unless exactly one model loader feeds a
    MODEL input."""
    ui = copy.deepcopy(ui)
    ui.get("extra", {}).pop("prompt", None)  # an embedded API prompt of the unswapped graph would be stale
    graphs = [(None, ui)] + [(d, d) for d in ui.get("definitions", {}).get("subgraphs", [])]
    found = []
    for owner, g in graphs:
        for n in g["nodes"]:
            if n["type"] in MODEL_LOADERS and n.get("mode", 0) == 0 and n["outputs"][0].get("links"):
                found.append((owner, g, n))
    if len(found) != 1:
        raise ConversionError(f"expected one model loader feeding a MODEL input, found {len(found)}")
    owner, g, loader = found[0]
    state = ui.setdefault("state", {})
    new_id = max([int(ui.get("last_node_id") or 0), int(state.get("lastNodeId") or 0)]
                 + [n["id"] for _o, gg in graphs for n in gg["nodes"]]) + 1
    ui["last_node_id"] = state["lastNodeId"] = new_id
    links = loader["outputs"][0]["links"]
    name = (loader.get("widgets_values") or [None])[0]
    x, y = loader.get("pos", [0, 0])
    values = {"unet_name": name, "devices": devices, "world_size": world_size, **DIFFUSION_LOADER_DEFAULTS}
    node = {
        "id": new_id, "type": "LTX2MGPU_LoadDiffusionModel", "pos": [x, y - 220], "size": [430, 230], "flags": {},
        "order": loader.get("order", 0), "mode": 0,
        "inputs": [{"localized_name": w, "name": w, **({"shape": 7} if optional else {}), "type": t,
                    "widget": {"name": w}, "link": None} for w, t, optional in DIFFUSION_LOADER_WIDGETS],
        "outputs": [{"localized_name": "model", "name": "model", "type": "MODEL", "links": list(links)},
                    {"localized_name": "fleet", "name": "fleet", "type": "LTX2_MGPU_FLEET", "links": []}],
        "title": "Load Diffusion Model (MGPU) - the model runs on the fleet",
        "properties": {"Node name for S&R": "LTX2MGPU_LoadDiffusionModel", "cnr_id": "ltx2-multigpu"},
        "widgets_values": [values[w] for w, _t, _o in DIFFUSION_LOADER_WIDGETS],
        "widgets_values_named": values,
    }
    g["nodes"].append(node)
    loader["outputs"][0]["links"] = []
    for link in g["links"]:
        if isinstance(link, dict) and link["id"] in links:
            link["origin_id"], link["origin_slot"] = new_id, 0
        elif isinstance(link, list) and link[0] in links:
            link[1], link[2] = new_id, 0
    if owner is not None:  # promote devices / world_size on the subgraph node(s) that show promoted widgets
        for n in ui["nodes"]:
            props = n.get("properties") or {}
            if n["type"] == owner["id"] and props.get("proxyWidgets") is not None and not n.get("widgets_values"):
                props["proxyWidgets"] += [[str(new_id), "devices"], [str(new_id), "world_size"]]
    return ui


def swap_decode(api: dict) -> dict:
    """VAEDecodeTiled -> Distributed Decode (MGPU) on the fleet of the graph's MGPU loader: its spatial tile size
    (pixels) and overlap (pixels) become the node's tile grid and latent overlap; the temporal settings have no
    counterpart (the distributed decode keeps the whole time axis per tile) and are reported in `_meta`."""
    api = copy.deepcopy(api)
    fleet = _fleet_source(api)
    for k in nodes_of(api, "VAEDecodeTiled"):
        v = api[k]["inputs"]
        api[k] = {"class_type": "LTX2MGPU_DistributedDecode",
                  "inputs": {"fleet": fleet, "latent": v["samples"], "tiles_height": 0, "tiles_width": 0,
                             "overlap": max(0, int(v.get("overlap", 64)) // 32)},
                  "_meta": {"title": f"Distributed Decode (was VAEDecodeTiled tile_size={v.get('tile_size')} "
                                     f"temporal_size={v.get('temporal_size')})"}}
    return api


def _fleet_source(api: dict) -> list:
    for cls in ("LTX2MGPU_LoadCheckpoint", "LTX2MGPU_LoadDiffusionModel"):
        ids = nodes_of(api, cls)
        if ids:
            return [ids[0], 0 if cls == "LTX2MGPU_LoadCheckpoint" else 1]
    raise ConversionError("no MGPU loader in the graph to take the fleet from")


def text_pair(api: dict) -> tuple[str, str]:
    """(positive, negative) CLIPTextEncode ids, read from the conditioning node both feed (LTXVConditioning or a
    guider's positive / negative)."""
    encoders = set(nodes_of(api, "CLIPTextEncode"))
    for v in api.values():
        pos, neg = v["inputs"].get("positive"), v["inputs"].get("negative")
        if is_link(pos) and is_link(neg) and pos[0] in encoders and neg[0] in encoders:
            return pos[0], neg[0]
    raise ConversionError(f"no node takes a positive and a negative CLIPTextEncode (encoders: {sorted(encoders)})")


def swap_text_encode(api: dict, *, checkpoint: str, gemma: str, devices: str = "cpu:2", world_size: int = 0,
                     upscaler: str = "none") -> dict:
    """The positive / negative CLIPTextEncode pair -> one Text Encode (MGPU) on a `LTX2MGPU_LoadCheckpoint` fleet.

    Only for tiny-model tests: ComfyUI's LTXAVTextEncoderLoader / CLIPLoader(ltxv) build Gemma at the 12B shape
    and cannot load the project's tiny Gemma. The prompt texts (literal or linked, e.g. from the prompt-enhancer
    switch) are kept. The Gemma loader node stays only where something else (the prompt enhancer) reads it."""
    api = copy.deepcopy(api)
    pos, neg = text_pair(api)
    loader = next(iter(nodes_of(api, "LTX2MGPU_LoadCheckpoint")), None) or _fresh_id(api, "mgpu_loader")
    api.setdefault(loader, {"class_type": "LTX2MGPU_LoadCheckpoint", "inputs": {}})["inputs"].update(
        {"checkpoint": checkpoint, "gemma": gemma, "upscaler": upscaler, "devices": devices,
         "world_size": world_size, "weight_dtype": "auto"})
    te = _fresh_id(api, "mgpu_text")
    api[te] = {"class_type": "LTX2MGPU_TextEncode",
               "inputs": {"fleet": [loader, 0], "prompt": api[pos]["inputs"]["text"],
                          "negative_prompt": api[neg]["inputs"]["text"], "mode": "fleet default",
                          "frame_rate": 25.0}}
    rewire(api, [pos, 0], [te, 0])
    rewire(api, [neg, 0], [te, 1])
    del api[pos], api[neg]
    return prune(api)


CANNY = {"low_threshold": 0.4, "high_threshold": 0.8}  # ComfyUI's Canny defaults


def swap_depth_for_canny(api: dict) -> dict:
    """The IC-LoRA template's depth preprocessor -> ComfyUI core's Canny, on the same frames.

    Replaced: the 'Video Depth Estimation (MoGe)' subgraph's MoGeInference + MoGeRender('depth') (its LoadMoGeModel
    needs moge_2_vitl_normal_fp16.safetensors, a ViT-L geometry model of hundreds of MB; no tiny MoGe exists).
    Canny (comfy_extras/nodes_canny.py, kornia) is deterministic, needs no weights, and is one of the controls the
    union-control IC-LoRA is trained for (the template's own note: 'Users can swap in other preprocessors').
    Everything downstream — GetImageSize (the length), LTXVAddGuide with the IC-LoRA parameters — is the
    template's. Raises ConversionError unless exactly one MoGeRender('depth') feeds the graph."""
    api = copy.deepcopy(api)
    renders = [k for k in nodes_of(api, "MoGeRender") if api[k]["inputs"].get("output") == "depth"
               and consumers(api, k)]
    if len(renders) != 1:
        raise ConversionError(f"expected one MoGeRender('depth') feeding the graph, found {renders}")
    (render,) = renders
    inference = api[render]["inputs"]["moge_geometry"][0]
    frames = api[inference]["inputs"]["image"]
    api["ic_control_canny"] = {"class_type": "Canny", "inputs": {"image": frames, **CANNY},
                               "_meta": {"title": "Canny (stands in for the MoGe depth preprocessor)"}}
    rewire(api, [render, 0], ["ic_control_canny", 0])
    return prune(api, load_object_info())


FILE_INPUTS = {  # class -> (input name, key of the files mapping)
    "CheckpointLoaderSimple": [("ckpt_name", "checkpoint")],
    "LTXVAudioVAELoader": [("ckpt_name", "checkpoint")],
    "LTXAVTextEncoderLoader": [("text_encoder", "gemma"), ("ckpt_name", "checkpoint")],
    "LatentUpscaleModelLoader": [("model_name", "upsampler")],
    "UNETLoader": [("unet_name", "diffusion_model")],
    "LTX2MGPU_LoadDiffusionModel": [("unet_name", "diffusion_model")],
    "VAELoader": [("vae_name", "vae")],
    "CLIPLoader": [("clip_name", "gemma")],
}


def _vae_role(name: str) -> str:
    """The files key of a VAELoader's file: LTX-2.5 templates load the video and the audio VAE each through a
    VAELoader, told apart by the file name ('...audio-vae...' -> audio_vae, else video_vae)."""
    return "audio_vae" if "audio" in name.lower() else "video_vae"


def point_files(api: dict, files: dict[str, str], loras: dict[str, str] | None = None) -> dict:
    """Every model-file widget pointed at the given files (`files`: checkpoint, gemma, upsampler, diffusion_model,
    video_vae / audio_vae (VAELoaders, by their file name), ... ; `loras`:
    template LoRA name -> tiny LoRA name, '*' for the rest). Linked file inputs (subgraph widgets already resolved
    to literals) are literals here. A file the mapping does not cover is left as it is."""
    api = copy.deepcopy(api)
    for v in api.values():
        for name, key in FILE_INPUTS.get(v["class_type"], ()):
            if name in v["inputs"] and not is_link(v["inputs"][name]) and key in files:
                v["inputs"][name] = files[key]
        if v["class_type"] == "VAELoader" and not is_link(v["inputs"].get("vae_name")):
            key = _vae_role(v["inputs"].get("vae_name", ""))
            if key in files:
                v["inputs"]["vae_name"] = files[key]
        if v["class_type"] in ("LoraLoaderModelOnly", "LoraLoader") and loras is not None:
            cur = v["inputs"].get("lora_name")
            if not is_link(cur):
                v["inputs"]["lora_name"] = loras.get(cur, loras.get("*", cur))
    return api


def set_inputs(api: dict, class_type: str, **values) -> list[str]:
    """Set literal inputs on every node of a class; returns their ids (an empty list is an error)."""
    ids = nodes_of(api, class_type)
    if not ids:
        raise ConversionError(f"no {class_type} node")
    for k in ids:
        api[k]["inputs"].update(values)
    return ids


def set_template_inputs(ui: dict, **values) -> dict:
    """A copy of the template with the widgets its subgraph node exposes set by label or name (what a user types
    into the template's panel: width, height, duration, fps, prompt_enhance, seed, ...). Raises ConversionError for
    a label no subgraph node has."""
    ui = copy.deepcopy(ui)
    defs = {d["id"]: d for d in ui.get("definitions", {}).get("subgraphs", [])}
    fl = _Flattener(ui, None)
    left = dict(values)
    for node in ui["nodes"]:
        d = defs.get(node["type"])
        if d is None:
            continue
        current = dict(fl._instance_values(node, d))
        for i in d["inputs"]:
            for key in (i.get("label"), i["name"]):
                if key in left:
                    current[i["name"]] = left.pop(key)
                    break
        node["widgets_values_named"] = current
    if left:
        raise ConversionError(f"no subgraph input labelled {sorted(left)}")
    return ui


# ---- regenerating object_info.json -----------------------------------------------------------------------------------


def refresh_object_info(url: str, directory: Path | None = None, out: Path = OBJECT_INFO) -> None:
    """Write the /object_info entries of every node type the LTX templates use (ComfyUI 0.33.0 server at `url`)."""
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/object_info", timeout=60) as r:
        info = json.load(r)
    types: set[str] = {"SaveLatent", *PACK_LOADERS}  # what the live tests add; the pack's loaders (saved workflows)
    d = directory or templates_dir()
    for stems in TEMPLATES.values():
        for stem in stems:
            ui = load_template(stem, d)
            for n in ui["nodes"] + [n for s in ui.get("definitions", {}).get("subgraphs", []) for n in s["nodes"]]:
                types.add(n["type"])
    keep = {}
    for t in sorted(types):
        if t in info:
            entry = {k: info[t][k] for k in ("input", "input_order", "output", "output_name", "output_node")
                     if k in info[t]}
            keep[t] = _strip_tooltips(entry)
    out.write_text(json.dumps(keep, indent=1) + "\n")


def _strip_tooltips(obj):
    if isinstance(obj, dict):
        return {k: _strip_tooltips(v) for k, v in obj.items() if k != "tooltip"}
    if isinstance(obj, list):
        return [_strip_tooltips(v) for v in obj]
    return obj


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--refresh-object-info":
        refresh_object_info(sys.argv[2])
        print(f"wrote {OBJECT_INFO}")
    elif len(sys.argv) == 2:
        print(json.dumps(ui_to_api(load_template(sys.argv[1]), load_object_info()), indent=1))
    else:
        raise SystemExit("usage: convert.py TEMPLATE_STEM | --refresh-object-info URL")
