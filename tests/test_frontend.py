"""The shipped UI workflows (`workflows/*.json`) in ComfyUI's own frontend, in headless Chromium.

How it runs: `tests/frontend/driver.cjs` (Node.js + playwright-core, Debian's Chromium; nothing downloaded) opens the
live server's frontend (ComfyUI 0.33 serves frontend 1.49.6, the `comfyui-frontend-package` of its requirements;
0.20.1 served 1.43.18), loads each workflow (the pack's own and the swapped official templates) with
`app.loadGraphData` as a drag-and-drop does, and reads back what the frontend reports: its error overlay ("Some nodes are missing…",
"N required models are missing"), node types it does not know, required inputs without a link or value (checked
against the server's node definitions), the API prompt `app.graphToPrompt()` would queue, and a screenshot.

    LTX2_MGPU_RUNTIME_DIR=/tmp/ltx2-live-rt python main.py --cpu   # in ComfyUI's folder: docs/testing.md#a-live-comfyui
    npm install --prefix /tmp/pw playwright-core; apt-get install -y chromium
    COMFYUI_URL=http://127.0.0.1:8188 PLAYWRIGHT_CORE_DIR=/tmp/pw/node_modules pytest -m comfyui tests/test_frontend.py

Skipped cleanly without a server (COMFYUI_URL), Node.js, playwright-core or Chromium. The UI workflows name the
released model files (with download hints); the tiny test server has none of them, so each workflow is checked
twice: as shipped (the frontend must flag exactly its released model files as missing, offering the hinted
downloads, and nothing else) and with those files mapped to the tiny models of the same role (the frontend must
report no error at all). The tests without the `comfyui` mark check the files themselves (run in CI).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from frontend import workflows as W
from templates import convert as C
from test_comfyui_live import URL, _get, server, tiny_models  # noqa: F401 - fixtures shared with the live tests

NAMES = sorted(W.SPEC)
# ComfyUI's own LTX templates with the minimal swap (tests/templates/make_workflows.py); their API twins are what
# tests/test_templates_live.py queues on the tiny models
SWAPPED = sorted(p.stem for p in W.WORKFLOWS.glob("comfyui-*.json"))
SHOTS = Path(tempfile.gettempdir()) / "ltx2-mgpu-frontend"


# ---- the files (no ComfyUI needed) -------------------------------------------------------------------------------


def test_every_ui_workflow_has_a_preview_and_an_api_twin():
    # comfyui-*: ComfyUI's own templates with the minimal swap (tests/test_templates_convert.py checks those)
    ui = sorted(p.stem for p in W.WORKFLOWS.glob("*.json") if not p.name.startswith("comfyui-"))
    assert ui == NAMES
    for name in NAMES:
        preview = W.WORKFLOWS / f"{name}.jpg"  # ComfyUI's frontend asks custom-node templates for <name>.jpg
        assert preview.is_file() and preview.read_bytes()[:3] == b"\xff\xd8\xff", preview
        assert (W.WORKFLOWS / "api" / f"{name}.json").is_file()


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_is_its_api_twin_with_user_values(name):
    """Same nodes (ids, classes), same links, and the widget values of the twin but for SPEC's overrides; model
    widgets carry download hints."""
    wf = json.loads((W.WORKFLOWS / f"{name}.json").read_text())
    expected = W.expected_prompt(name)
    nodes = {str(n["id"]): n for n in wf["nodes"] if n["type"] != "MarkdownNote"}
    assert {k: n["type"] for k, n in nodes.items()} == {k: v["class_type"] for k, v in expected.items()}
    links = {(str(link[3]), link[4]): [str(link[1]), link[2]] for link in wf["links"]}
    for node_id, node in nodes.items():
        wanted = {k: v for k, v in expected[node_id]["inputs"].items() if isinstance(v, list)}
        names = {slot["name"]: i for i, slot in enumerate(node.get("inputs", []))}
        got = {k: links[(node_id, i)] for k, i in names.items() if (node_id, i) in links}
        assert got == wanted, (name, node_id)
        values = [v for v in expected[node_id]["inputs"].values() if not isinstance(v, list)]
        # frontend-only widgets: a seed's control_after_generate, LoadImage's upload button ("image")
        widgets = [v for v in node.get("widgets_values") or [] if v not in ("fixed", "randomize")]
        assert widgets[:len(values)] == values and widgets[len(values):] in ([], ["image"]), (name, node_id, widgets)
        for key in W.MODEL_INPUTS.get(node["type"], ()):
            value = expected[node_id]["inputs"].get(key)
            if value not in (None, "none"):
                hints = {h["name"]: h for h in node["properties"].get("models", [])}
                assert value in hints and hints[value]["url"].startswith("https://huggingface.co/"), (name, key)
                assert hints[value]["url"].endswith("/" + value)
    notes = [n for n in wf["nodes"] if n["type"] == "MarkdownNote"]
    assert len(notes) == 1 and "huggingface.co" in notes[0]["widgets_values"][0]


# ---- in the frontend ---------------------------------------------------------------------------------------------


def _tools_or_skip():
    missing = [what for what, ok in (("node", shutil.which("node")), ("playwright-core", W.find_playwright()),
                                     ("chromium", W.find_chromium())) if not ok]
    if missing:
        pytest.skip(f"headless frontend check needs {', '.join(missing)} (npm install playwright-core; set "
                    f"PLAYWRIGHT_CORE_DIR / CHROMIUM)")


@pytest.fixture(scope="module")
def frontend(server, tiny_models):  # noqa: F811 - the fixtures imported above
    """name -> {"shipped": report, "tiny": report}, plus the negative controls under "_controls"."""
    _tools_or_skip()
    SHOTS.mkdir(parents=True, exist_ok=True)
    tasks = []
    for name in NAMES:
        wf = json.loads((W.WORKFLOWS / f"{name}.json").read_text())
        tasks.append({"kind": "check", "name": f"{name}:shipped", "workflow": wf})
        tasks.append({"kind": "check", "name": f"{name}:tiny", "workflow": W.tiny_variant(wf),
                      "screenshot": str(SHOTS / f"{name}.png")})
    base = W.tiny_variant(json.loads((W.WORKFLOWS / f"{NAMES[0]}.json").read_text()))
    bogus = json.loads(json.dumps(base))
    bogus["nodes"][0]["type"] = "LTX2MGPU_NoSuchNode"
    unlinked = json.loads(json.dumps(base))
    dropped = unlinked["links"].pop()  # a required LATENT/… link removed, as a hand-edited file might have it
    for node in unlinked["nodes"]:
        for slot in node.get("inputs", []):
            if slot.get("link") == dropped[0]:
                slot["link"] = None
    for name in SWAPPED:
        tasks.append({"kind": "check", "name": f"{name}:swapped", "workflow": json.loads(
            (W.WORKFLOWS / f"{name}.json").read_text()), "screenshot": str(SHOTS / f"{name}.png")})
    tasks.append({"kind": "check", "name": "control:bogus-node", "workflow": bogus})
    tasks.append({"kind": "check", "name": "control:missing-link", "workflow": unlinked})
    out: dict = {"_controls": {}}
    for res in W.run_driver(URL, tasks):
        assert "exception" not in res, f"{res['name']}: {res['exception']}"
        name, kind = res["name"].split(":")
        (out["_controls"] if name == "control" else out.setdefault(name, {}))[kind] = res
    return out


@pytest.mark.comfyui
@pytest.mark.parametrize("name", NAMES)
def test_opens_without_missing_nodes_or_inputs(frontend, name):
    """With the models present (tiny stand-ins), the frontend reports nothing: no missing node, model or input, no
    page error; the screenshot was taken."""
    r = frontend[name]["tiny"]
    assert r["unknown_types"] == [] and r["missing_inputs"] == []
    assert r["error_count"] == 0 and not [t for t in r["errors_text"] if "missing" in t.lower()], r["errors_text"]
    assert r["page_errors"] == []
    assert not [c for c in r["console"] if c.startswith("error:") and "ERR_NAME_NOT_RESOLVED" not in c
                and "Failed to load resource" not in c], r["console"]
    shot = Path(r["screenshot"])
    assert shot.is_file() and shot.stat().st_size > 10_000
    print(f"{name}: screenshot {shot} ({shot.stat().st_size} bytes), {r['node_count']} nodes")


@pytest.mark.comfyui
@pytest.mark.parametrize("name", NAMES)
def test_as_shipped_only_the_released_models_are_missing(frontend, name):
    """As shipped, on a server without the released files: no missing node or input; the only errors are the
    missing model files, which the frontend offers to download from the hints."""
    r = frontend[name]["shipped"]
    wf = json.loads((W.WORKFLOWS / f"{name}.json").read_text())
    folders = {W.MODELS[f][1] for f in W.model_files(wf)}
    present = {f for folder in folders for f in _get(f"/models/{folder}")}
    absent = W.model_files(wf) - present
    assert r["unknown_types"] == [] and r["missing_inputs"] == [] and r["page_errors"] == []
    assert not [t for t in r["errors_text"] if "nodes are missing" in t.lower()], r["errors_text"]
    if absent:  # frontend 1.43: "N required models are missing"; 1.49: "Missing Models" + "K nodes — N errors"
        lines = [t for t in r["errors_text"] if "model" in t.lower() and "missing" in t.lower()]
        assert lines, r["errors_text"]
        count = int(lines[0].split()[0]) if lines[0].split()[0].isdigit() else r["error_count"]
        assert 1 <= count <= len(W.model_files(wf)), (lines, absent)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", NAMES)
def test_frontend_queues_the_api_twin(frontend, name):
    """`app.graphToPrompt()` of the UI workflow = its API twin with the UI's values (the twin with the tiny
    models is what tests/test_comfyui_live.py queues)."""
    prompt = frontend[name]["shipped"]["prompt"]
    expected = W.expected_prompt(name)
    info = _get("/object_info")
    assert set(prompt) == set(expected)
    for node_id, node in expected.items():
        assert prompt[node_id]["class_type"] == node["class_type"]
        _only_defaults_added(prompt[node_id], node, info)
        assert prompt[node_id]["_meta"]["title"] == node["_meta"]["title"], (name, node_id)


def _only_defaults_added(got: dict, expected: dict, info: dict) -> None:
    """The frontend's node `got` = the API node `expected` on every input the server's node declares, but for inputs
    the frontend adds itself: an optional input the saved workflow predates (e.g. the loaders' `weights`), sent at
    its default (what the server uses when it is absent), and on frontend 1.49 a dynamic combo's sub-widgets
    (SaveVideo's "format.codec", …, and its bare "codec", which 0.33's SaveVideo no longer declares: the server
    ignores undeclared inputs). Never an added link."""
    spec = info[expected["class_type"]]["input"]
    optional = spec.get("optional", {})
    declared = set(spec.get("required", {})) | set(optional)
    # SaveVideo's codec: 1.49 moves a saved "codec" under "format.codec" and sends the bare one at "auto"
    codec = lambda inputs: inputs.get("format.codec", inputs.get("codec"))  # noqa: E731
    assert codec(got["inputs"]) == codec(expected["inputs"]), got
    dynamic = lambda key: key == "codec" or "." in key  # noqa: E731
    for key, value in expected["inputs"].items():
        if key in declared and not dynamic(key):
            assert got["inputs"].get(key) == value, (key, got)
    for key, value in got["inputs"].items():
        if key in expected["inputs"] or dynamic(key):
            continue
        assert not isinstance(value, list), (key, value)
        if key in optional:
            assert value == optional[key][1].get("default"), (key, value, optional[key])
        else:
            assert key not in declared, (key, value)  # a required input the API node lacks


@pytest.mark.comfyui
@pytest.mark.parametrize("name", SWAPPED)
def test_swapped_template_opens_and_queues_its_api_twin(frontend, name):
    """A swapped official template (subgraphs, Load Diffusion Model (MGPU) instead of ComfyUI's loader) in this
    frontend: no unknown node type, no required input without a link or value, no page error, no missing-nodes
    error (its released model files may be missing on the test server); `app.graphToPrompt()` flattens it into
    exactly its API twin (workflows/api/), the graph tests/test_templates_live.py queues."""
    r = frontend[name]["swapped"]
    assert r["unknown_types"] == [] and r["missing_inputs"] == [] and r["page_errors"] == [], r
    assert not [t for t in r["errors_text"] if "nodes are missing" in t.lower()], r["errors_text"]
    twin = json.loads((W.WORKFLOWS / "api" / f"{name}.json").read_text())
    # what ComfyUI executes of it: the swap leaves ComfyUI's own model loader without links, the frontend still
    # sends it, the server never runs it
    info = _get("/object_info")
    prompt = C.prune(r["prompt"], info)
    assert set(prompt) == set(twin), sorted(set(prompt) ^ set(twin))
    for node_id, node in twin.items():
        got = prompt[node_id]
        assert got["class_type"] == node["class_type"], (name, node_id)
        assert {k: v for k, v in got["inputs"].items() if k in node["inputs"]} == node["inputs"], (name, node_id)
        _only_defaults_added(got, node, info)


@pytest.mark.comfyui
def test_negative_controls_are_detected(frontend):
    """The checks can fail: an unknown node type shows the frontend's missing-nodes error; a dropped link is a
    missing input."""
    bogus, unlinked = frontend["_controls"]["bogus-node"], frontend["_controls"]["missing-link"]
    assert bogus["unknown_types"] == ["LTX2MGPU_NoSuchNode"]
    assert bogus["error_count"] >= 1 and any("nodes are missing" in t.lower() or "missing node" in t.lower()
                                             for t in bogus["errors_text"]), bogus["errors_text"]
    assert len(unlinked["missing_inputs"]) == 1, unlinked["missing_inputs"]


@pytest.mark.comfyui
def test_template_browser_lists_the_workflows(server):  # noqa: F811
    """ComfyUI lists the pack's workflows/ folder as templates and serves each JSON and its .jpg thumbnail."""
    import urllib.request

    listed = _get("/workflow_templates")
    pack = next((k for k, v in listed.items() if set(NAMES) <= set(v)), None)
    assert pack is not None, listed
    for name in NAMES:
        with urllib.request.urlopen(f"{URL}/api/workflow_templates/{pack}/{name}.jpg", timeout=30) as r:
            assert r.read()[:3] == b"\xff\xd8\xff"
        with urllib.request.urlopen(f"{URL}/api/workflow_templates/{pack}/{name}.json", timeout=30) as r:
            assert json.load(r)["nodes"]
    assert not any(name.startswith("api") for name in listed[pack])  # the API twins are one level down

