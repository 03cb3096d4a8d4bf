"""The shipped API workflows queued headless into a live ComfyUI (`POST /prompt`), on the tiny models with 2 CPU
workers.

Needs a running ComfyUI with this pack in `custom_nodes/` and the server's models folder writable from here:

    LTX2_MGPU_RUNTIME_DIR=/tmp/ltx2-live-rt python main.py --cpu   # in ComfyUI's folder: docs/testing.md#a-live-comfyui
    COMFYUI_URL=http://127.0.0.1:8188 [COMFYUI_DIR=/tmp/comfyui] pytest -m comfyui tests/test_comfyui_live.py
    LTX2_MGPU_RUNTIME_DIR=/tmp/ltx2-live-rt python -m mgpu_backend stop; then stop the ComfyUI server

Skipped unless COMFYUI_URL is set and the server answers. The module fixture writes the tiny models
(`mgpu_backend.testing.tiny.make_tiny`, LTX-2.0 layout) and links them into `$COMFYUI_DIR/models/` (or
`$COMFYUI_MODELS_DIR`) under the names the workflows use. Results are read back through `/history` and `/view`;
progress through ComfyUI's websocket (a minimal client on the standard library).
"""
from __future__ import annotations

import base64
import json
import os
import socket
import struct
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui

ROOT = Path(__file__).resolve().parent.parent
# comfyui-*: ComfyUI's own templates with the minimal swap, queued by tests/test_templates_live.py
WORKFLOWS = sorted(p for p in (ROOT / "workflows" / "api").glob("*.json") if not p.name.startswith("comfyui-"))
# the API twin the previous release shipped (its loader without weights / int8_compute / gpu_budget_gib): still runs
SAVED_WORKFLOWS = [ROOT / "tests" / "fixtures" / "saved-workflows-098787a" / "api" / "ltx2-mgpu-two-stage-t2v.json"]
BASE_WORKFLOW = ROOT / "workflows" / "api" / "ltx2-mgpu-two-stage-t2v.json"  # what the error / interrupt tests vary
URL = os.environ.get("COMFYUI_URL", "").rstrip("/")
COMFY_DIR = Path(os.environ.get("COMFYUI_DIR", "/tmp/comfyui"))
TIMEOUT_S = 600

# models folder -> file name the workflows use -> key of make_tiny's result
MODEL_LINKS = {
    ("checkpoints", "ltx-2.0-tiny.safetensors"): "checkpoint",
    ("text_encoders", "gemma-3-tiny.safetensors"): "gemma",
    ("latent_upscale_models", "ltx-20-tiny-spatial-upscaler-x2.safetensors"): "upsampler",
    ("loras", "ltx-2.0-tiny-distilled-lora.safetensors"): "distilled_lora",
}


# ---- HTTP / websocket helpers ------------------------------------------------------------------------------------


def _get(path: str):
    with urllib.request.urlopen(URL + path, timeout=30) as r:
        return json.load(r)


def _post(path: str, body: dict):
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return json.loads(body) if body.strip() else {}
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {path}: HTTP {exc.code}: {exc.read().decode()[:4000]}") from None


def _answers() -> bool:
    if not URL:
        return False
    try:
        _get("/system_stats")
        return True
    except Exception:  # noqa: BLE001
        return False


class WebSocket:
    """Just enough of RFC 6455 to read ComfyUI's status messages (text frames; binary previews skipped)."""

    def __init__(self, client_id: str):
        u = urllib.parse.urlparse(URL)
        self.sock = socket.create_connection((u.hostname, u.port or 80), timeout=TIMEOUT_S)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws?clientId={client_id} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
                           f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        assert b" 101 " in head.split(b"\r\n", 1)[0], head

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed")
            buf += chunk
        return buf

    def messages(self):
        """Yields ComfyUI's JSON messages (dicts with `type` and `data`)."""
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            payload = self._read(n)
            if mask:
                payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
            if opcode == 8:
                return
            if opcode == 1:
                yield json.loads(payload)

    def close(self):
        self.sock.close()


def queue(workflow: dict, client_id: str | None = None) -> str:
    return _post("/prompt", {"prompt": workflow, "client_id": client_id or uuid.uuid4().hex})["prompt_id"]


def wait(prompt_id: str, timeout: float = TIMEOUT_S) -> dict:
    """The prompt's /history entry once it has ended (success, error or interrupt)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = _get(f"/history/{prompt_id}")
        if prompt_id in h and h[prompt_id].get("status", {}).get("completed") is not None:
            if h[prompt_id]["status"].get("status_str") in ("success", "error"):
                return h[prompt_id]
        time.sleep(0.5)
    raise AssertionError(f"prompt {prompt_id} did not end within {timeout} s")


def messages_of(entry: dict, kind: str) -> list[dict]:
    return [m[1] for m in entry["status"]["messages"] if m[0] == kind]


def fetch_output(item: dict, dest: Path) -> Path:
    q = urllib.parse.urlencode({"filename": item["filename"], "subfolder": item.get("subfolder", ""),
                                "type": item.get("type", "output")})
    dest.write_bytes(urllib.request.urlopen(f"{URL}/view?{q}", timeout=60).read())
    return dest


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def by_class(workflow: dict, class_type: str) -> str:
    ids = [k for k, v in workflow.items() if v["class_type"] == class_type]
    assert ids, f"no {class_type} node"
    return ids[0]


# ---- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    if not _answers():
        pytest.skip("no live ComfyUI: set COMFYUI_URL to a running server (see the module docstring)")
    info = _get("/object_info/LTX2MGPU_LoadCheckpoint")
    assert "LTX2MGPU_LoadCheckpoint" in info, "the ltx2-multigpu nodes are not loaded in this ComfyUI"
    return URL


def _tiny_dir() -> dict[str, str]:
    """The tiny LTX-2.0 set in a stable cache folder (`$LTX2_MGPU_CACHE` or ~/.cache/ltx2-multigpu): the server keeps
    reading the files after this test session (its cached fleet, later prompts), so not under pytest's tmp dirs,
    which other sessions rotate. Written once, atomically (make_tiny is deterministic for a seed)."""
    import shutil
    import tempfile

    from mgpu_backend.testing.tiny import make_tiny

    root = Path(os.environ.get("LTX2_MGPU_CACHE") or Path.home() / ".cache" / "ltx2-multigpu")
    final = root / "comfyui-tiny-2.0-seed0"
    names = {"checkpoint": "ltx-2.0-tiny.safetensors", "gemma": "gemma-3-tiny.safetensors",
             "upsampler": "ltx-20-tiny-spatial-upscaler-x2.safetensors",
             "distilled_lora": "ltx-2.0-tiny-distilled-lora.safetensors"}
    if not all((final / n).is_file() for n in names.values()):
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
        written = make_tiny(staging, "2.0", seed=0)
        assert all(Path(written[k]).name == n for k, n in names.items()), written
        try:
            if final.exists():  # an incomplete set
                shutil.rmtree(final)
            staging.rename(final)
        except OSError:  # written meanwhile by another session: use that one
            shutil.rmtree(staging, ignore_errors=True)
    return {k: str(final / n) for k, n in names.items()}


@pytest.fixture(scope="module")
def tiny_models(server):
    """Tiny LTX-2.0 models linked into the server's models folders under the workflows' names."""
    models = Path(os.environ.get("COMFYUI_MODELS_DIR", COMFY_DIR / "models"))
    if not models.is_dir():
        pytest.skip(f"the server's models folder {models} is not reachable from here (set COMFYUI_DIR or "
                    f"COMFYUI_MODELS_DIR)")
    written = _tiny_dir()
    for (folder, name), key in MODEL_LINKS.items():
        (models / folder).mkdir(parents=True, exist_ok=True)
        link = models / folder / name
        tmp = link.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(written[key]).resolve())
        os.replace(tmp, link)
    return written


@pytest.fixture(scope="module")
def example_image():
    """ComfyUI's input/example.png (shipped with ComfyUI; the image-to-video workflow's Load Image), written if absent."""
    inputs = COMFY_DIR / "input"
    if not inputs.is_dir():
        pytest.skip(f"the server's input folder {inputs} is not reachable from here (set COMFYUI_DIR)")
    path = inputs / "example.png"
    if not path.is_file():
        import numpy as np
        from PIL import Image

        Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(path)
    return path


def _stage1_size(wf: dict) -> dict:
    """width / height / length of the stage-1 video latent (EmptyLTXVLatentVideo or LTXVImgToVideo)."""
    for node in wf.values():
        if node["class_type"] in ("EmptyLTXVLatentVideo", "LTXVImgToVideo"):
            return node["inputs"]
    raise AssertionError("no EmptyLTXVLatentVideo / LTXVImgToVideo node")


# ---- tests -------------------------------------------------------------------------------------------------------


def test_workflows_are_api_format():
    assert WORKFLOWS, "no API workflows in workflows/api/"
    for path in WORKFLOWS:
        wf = load(path)
        for node_id, node in wf.items():
            assert set(node) >= {"class_type", "inputs"}, (path.name, node_id)
            for value in node["inputs"].values():
                if isinstance(value, list):  # a link [node id, output index]
                    assert value[0] in wf, (path.name, node_id, value)


@pytest.mark.parametrize("path", WORKFLOWS + SAVED_WORKFLOWS,
                         ids=[p.stem for p in WORKFLOWS] + [f"saved-098787a-{p.stem}" for p in SAVED_WORKFLOWS])
def test_shipped_workflow_writes_mp4_with_audio(server, tiny_models, example_image, path, tmp_path):
    from mgpu_backend.stages.media import probe_mp4

    wf = load(path)
    # a seed of its own, so that a server that already ran this graph computes it again (ComfyUI caches outputs)
    wf[by_class(wf, "RandomNoise")]["inputs"]["noise_seed"] = int.from_bytes(os.urandom(4), "little")
    client_id = uuid.uuid4().hex
    ws = WebSocket(client_id)
    try:
        prompt_id = queue(wf, client_id)
        progress_nodes, done = set(), False
        for msg in ws.messages():
            data = msg.get("data", {})
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if msg["type"] == "progress":
                progress_nodes.add(data["node"])
            if msg["type"] == "execution_error":
                raise AssertionError(f"{data.get('node_type')}: {data.get('exception_message')}")
            if msg["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                done = True
                break
        assert done
    finally:
        ws.close()
    entry = wait(prompt_id)
    assert entry["status"]["status_str"] == "success", entry["status"]
    # per-step progress reached ComfyUI from the fleet's sampling nodes
    assert by_class(wf, "LTX2MGPU_SPSamplerGuided") in progress_nodes
    videos = [item for out in entry["outputs"].values() for item in out.get("images", [])
              if item["filename"].endswith(".mp4")]
    assert videos, entry["outputs"]
    info = probe_mp4(fetch_output(videos[0], tmp_path / "out.mp4"))
    latent = _stage1_size(wf)
    upscaled = any(v["class_type"] == "LTX2MGPU_TDPUpscale" and v["inputs"].get("upscale") for v in wf.values()) \
        or any(v["class_type"] == "LTXVLatentUpsampler" for v in wf.values())
    factor = 2 if upscaled else 1
    assert (info["width"], info["height"]) == (latent["width"] * factor, latent["height"] * factor)
    assert info["video_frames"] == latent["length"]
    assert info["audio_channels"] == 2 and info["audio_sample_rate"] > 0
    assert info["audio_duration"] == pytest.approx(latent["length"] / info["fps"], abs=0.1)
    loader_ui = entry["outputs"].get(by_class(wf, "LTX2MGPU_LoadCheckpoint"))
    if loader_ui is not None:  # absent when the loader was cached from an earlier prompt
        plan = loader_ui["text"][0]
        assert "2 rank(s) on cpu, cpu" in plan and "sequence parallel up to degree 2" in plan
    pids = _fleet_pids()
    assert pids is None or len(pids) == 2

    # an unchanged graph queued again is served from ComfyUI's cache: nothing recomputed on the fleet
    again = wait(queue(wf))
    assert again["status"]["status_str"] == "success"
    cached = set(messages_of(again, "execution_cached")[0]["nodes"])
    fleet_nodes = {k for k, v in wf.items() if v["class_type"] in ("LTX2MGPU_SPSamplerGuided", "LTX2MGPU_TDPUpscale")}
    assert fleet_nodes and fleet_nodes <= cached


def _error_of(entry: dict) -> dict:
    assert entry["status"]["status_str"] == "error", entry["status"]
    errors = messages_of(entry, "execution_error")
    assert errors, entry["status"]
    return errors[0]


def test_frames_not_8k_plus_1_run_as_in_comfyui(server, tiny_models, tmp_path):
    """A length ComfyUI accepts though it is not 8k+1 (30: EmptyLTXVLatentVideo makes 4 latent frames = 25 frames,
    LTXVEmptyLatentAudio 30 audio steps) runs through SP Sampler (MGPU) as through ComfyUI's own sampler."""
    wf = load(BASE_WORKFLOW)
    wf[by_class(wf, "EmptyLTXVLatentVideo")]["inputs"]["length"] = 30
    wf[by_class(wf, "LTXVEmptyLatentAudio")]["inputs"]["frames_number"] = 30
    info = _mp4_of(wait(queue(wf)), tmp_path)
    assert info["video_frames"] == 25 and info["audio_channels"] == 2


def test_invalid_device_spec_is_a_node_error(server, tiny_models):
    wf = load(BASE_WORKFLOW)
    wf[by_class(wf, "LTX2MGPU_LoadCheckpoint")]["inputs"]["devices"] = "gpu:7"
    err = _error_of(wait(queue(wf)))
    assert err["node_type"] == "LTX2MGPU_LoadCheckpoint"
    assert "devices='gpu:7'" in err["exception_message"] and "cpu:N" in err["exception_message"]
    assert _get("/system_stats")


def test_sp_degree_the_heads_do_not_allow_is_a_node_error(server, tiny_models):
    """An explicit SP degree of 3 on the tiny model (8 heads) over 2 ranks: refused by the controller from the
    checkpoint header before any worker starts; the message names the valid degrees; the fleet in use is kept."""
    pids_before = _fleet_pids()
    wf = load(BASE_WORKFLOW)
    wf[by_class(wf, "LTX2MGPU_LoadCheckpoint")]["inputs"]["sp_degree"] = 3
    err = _error_of(wait(queue(wf)))
    assert err["node_type"] == "LTX2MGPU_LoadCheckpoint"
    assert "degree 3" in err["exception_message"] and "valid degrees: 1, 2" in err["exception_message"]
    assert _get("/system_stats")
    assert _fleet_pids() == pids_before


def test_sp_degree_change_keeps_the_fleet(server, tiny_models):
    """Load Checkpoint (MGPU)'s sp_degree (a policy option) is applied to the running fleet: the prompt with
    sp_degree 1 runs on the same worker processes (same generation), which opened no file again."""
    if not os.environ.get("LTX2_MGPU_RUNTIME_DIR"):
        pytest.skip("set LTX2_MGPU_RUNTIME_DIR to the server's controller directory to find the worker PIDs")
    from mgpu_backend.serving.client import ControllerClient

    def fleet():
        c = ControllerClient(start=False)
        try:
            return c.status().fleet
        finally:
            c.close()

    wf = load(BASE_WORKFLOW)
    assert wait(queue(wf))["status"]["status_str"] == "success"
    before = fleet()
    wf[by_class(wf, "LTX2MGPU_LoadCheckpoint")]["inputs"]["sp_degree"] = 1
    wf[by_class(wf, "RandomNoise")]["inputs"]["noise_seed"] = int.from_bytes(os.urandom(4), "little")
    entry = wait(queue(wf))
    assert entry["status"]["status_str"] == "success", entry["status"]
    plan = entry["outputs"][by_class(wf, "LTX2MGPU_LoadCheckpoint")]["text"][0]
    assert "up to degree 1 on ranks 0-0, set by sp_degree" in plan
    after = fleet()
    assert (after.generation, after.worker_pids, after.open_counts) == \
        (before.generation, before.worker_pids, before.open_counts)
    assert after.policy.sp_degree == 1


def test_interrupt_cancels_the_fleet_job_and_the_next_prompt_runs(server, tiny_models):
    """ComfyUI's interrupt mid-sampling cancels the fleet job at a step boundary; the same workers serve the next
    prompt."""
    wf = load(BASE_WORKFLOW)
    sampler = by_class(wf, "LTX2MGPU_SPSamplerGuided")
    wf[sampler]["inputs"]["steps"] = 200
    wf[by_class(wf, "RandomNoise")]["inputs"]["noise_seed"] = int.from_bytes(os.urandom(4), "little")
    client_id = uuid.uuid4().hex
    ws = WebSocket(client_id)
    try:
        prompt_id = queue(wf, client_id)
        interrupted_at = None
        for msg in ws.messages():
            data = msg.get("data", {})
            if msg["type"] == "progress" and data.get("node") == sampler and interrupted_at is None \
                    and data["value"] >= 2:
                _post("/interrupt", {})
                interrupted_at = data["value"]
            if msg["type"] == "execution_interrupted" and data.get("prompt_id") == prompt_id:
                break
            if msg["type"] == "execution_error":
                raise AssertionError(data.get("exception_message"))
            if msg["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                raise AssertionError("the prompt ran to the end despite the interrupt")
    finally:
        ws.close()
    assert interrupted_at is not None and interrupted_at < 200
    before = _fleet_pids()
    # the next prompt (euler_ancestral this time, and a Fleet status node) runs on the same workers
    wf2 = load(BASE_WORKFLOW)
    wf2[by_class(wf2, "RandomNoise")]["inputs"]["noise_seed"] = int.from_bytes(os.urandom(4), "little")
    wf2[by_class(wf2, "LTX2MGPU_SPSamplerGuided")]["inputs"]["sampler"] = "euler_ancestral"
    wf2["900"] = {"class_type": "LTX2MGPU_Fleet", "inputs": {"fleet": [by_class(wf2, "LTX2MGPU_LoadCheckpoint"), 0],
                                                            "action": "status"}}
    entry = wait(queue(wf2))
    assert entry["status"]["status_str"] == "success", entry["status"]
    status = entry["outputs"]["900"]["text"][0]
    assert "idle" in status and "2 rank(s) on cpu, cpu" in status
    if before is not None:  # the same worker processes (the cancel kept the fleet)
        assert _fleet_pids() == before and ", ".join(map(str, before)) in status


def _fleet_pids():
    """The worker PIDs of the server's fleet, read from its controller when this process knows the runtime
    directory (LTX2_MGPU_RUNTIME_DIR as given to the server); else None."""
    if not os.environ.get("LTX2_MGPU_RUNTIME_DIR"):
        return None
    from mgpu_backend.serving.client import ControllerClient

    c = ControllerClient(start=False)
    try:
        fleet = c.status().fleet
        return None if fleet is None else list(fleet.worker_pids)
    finally:
        c.close()


def test_killed_worker_is_a_node_error_and_requeue_succeeds(server, tiny_models):
    """A worker killed mid-sampling: the node shows the fleet's error (rank, stage, step), ComfyUI stays up, and
    queuing the unchanged graph again runs on a fresh fleet started from the cached handle's configuration."""
    if _fleet_pids() is None and not os.environ.get("LTX2_MGPU_RUNTIME_DIR"):
        pytest.skip("set LTX2_MGPU_RUNTIME_DIR to the server's controller directory to find the worker PIDs")
    import signal

    wf = load(BASE_WORKFLOW)
    sampler = by_class(wf, "LTX2MGPU_SPSamplerGuided")
    wf[sampler]["inputs"]["steps"] = 60
    wf[by_class(wf, "RandomNoise")]["inputs"]["noise_seed"] = int.from_bytes(os.urandom(4), "little")
    client_id = uuid.uuid4().hex
    ws = WebSocket(client_id)
    killed = None
    try:
        prompt_id = queue(wf, client_id)
        for msg in ws.messages():
            data = msg.get("data", {})
            if msg["type"] == "progress" and data.get("node") == sampler and killed is None and data["value"] >= 2:
                killed = _fleet_pids()[-1]
                os.kill(killed, signal.SIGKILL)
            if msg["type"] in ("execution_error", "execution_success") and data.get("prompt_id") == prompt_id:
                break
    finally:
        ws.close()
    assert killed is not None
    err = _error_of(wait(prompt_id))
    assert err["node_type"] == "LTX2MGPU_SPSamplerGuided"
    assert f"pid {killed}" in err["exception_message"] and "died" in err["exception_message"]
    assert _get("/system_stats")
    again = wait(queue(wf))  # the unchanged graph
    assert again["status"]["status_str"] == "success", again["status"]
    assert killed not in (_fleet_pids() or [])


# ---- native LTX-2 nodes mixed with ours, and the golden graph (need the server's test nodes) ---------------------


def _test_nodes_or_skip():
    if "LTX2MGPU_TestConditioning" not in _get("/object_info/LTX2MGPU_TestConditioning"):
        pytest.skip("the server has no test nodes: start it with LTX2_MGPU_TEST_NODES=1 (nodes/testing.py)")


def _mp4_of(entry: dict, tmp_path: Path) -> dict:
    from mgpu_backend.stages.media import probe_mp4

    assert entry["status"]["status_str"] == "success", entry["status"]
    videos = [item for out in entry["outputs"].values() for item in out.get("images", [])
              if item["filename"].endswith(".mp4")]
    assert videos, entry["outputs"]
    return probe_mp4(fetch_output(videos[0], tmp_path / "out.mp4"))


def mixed_graph(source: str, seed: int) -> dict:
    """ComfyUI's own LTX-2 nodes around SP Sampler (MGPU): the test node's native CONDITIONING, EmptyLTXVLatentVideo
    + LTXVEmptyLatentAudio + LTXVConcatAVLatent, RandomNoise, LTXVScheduler sigmas in; LTXVSeparateAVLatent,
    VAEDecode (CheckpointLoaderSimple's VAE), LTXVAudioVAEDecode, CreateVideo, SaveVideo out."""
    base = load(BASE_WORKFLOW)
    loader = base[by_class(base, "LTX2MGPU_LoadCheckpoint")]  # the same fleet configuration as the workflows
    ckpt = loader["inputs"]["checkpoint"]
    n = lambda cls, **inputs: {"class_type": cls, "inputs": inputs}  # noqa: E731
    return {
        "1": n("CheckpointLoaderSimple", ckpt_name=ckpt),
        "2": n("LTX2MGPU_TestConditioning", source=source, seed=5, positive_tokens=12, negative_tokens=9, width=64,
               frame_rate=25.0, prompt="a lighthouse in a storm, waves crashing", negative_prompt="blurry",
               gemma=loader["inputs"]["gemma"], checkpoint=ckpt),
        "3": n("EmptyLTXVLatentVideo", width=128, height=64, length=17, batch_size=1),
        "4": n("LTXVAudioVAELoader", ckpt_name=ckpt),
        "5": n("LTXVEmptyLatentAudio", frames_number=17, frame_rate=25, batch_size=1, audio_vae=["4", 0]),
        "6": n("LTXVConcatAVLatent", video_latent=["3", 0], audio_latent=["5", 0]),
        "7": n("RandomNoise", noise_seed=seed),
        "8": n("LTXVScheduler", steps=4, max_shift=2.05, base_shift=0.95, stretch=True, terminal=0.1,
               latent=["6", 0]),
        "9": {"class_type": "LTX2MGPU_LoadCheckpoint", "inputs": dict(loader["inputs"])},
        "10": n("LTX2MGPU_SPSampler", fleet=["9", 0], positive=["2", 0], negative=["2", 1], latent=["6", 0],
                noise=["7", 0], sigmas=["8", 0], steps=4, sampler="euler", video_cfg=3.0, video_stg=1.0,
                video_rescale=0.7, video_modality=3.0, audio_cfg=7.0, audio_stg=1.0, audio_rescale=0.7,
                audio_modality=3.0, stg_blocks="auto"),
        "11": n("LTXVSeparateAVLatent", av_latent=["10", 0]),
        "12": n("VAEDecode", samples=["11", 0], vae=["1", 2]),
        "13": n("LTXVAudioVAEDecode", samples=["11", 1], audio_vae=["4", 0]),
        "14": n("CreateVideo", images=["12", 0], audio=["13", 0], fps=25.0),
        "15": n("SaveVideo", video=["14", 0], filename_prefix="ltx2-mgpu/mixed", format="mp4", codec="h264"),
    }


@pytest.mark.parametrize("source", ["random", "tiny gemma"])
def test_mixed_native_graph_runs(server, tiny_models, source, tmp_path):
    """Native CONDITIONING (test node: seeded random, or the tiny Gemma through the checkpoint's projection) and
    native latent / noise / scheduler nodes into SP Sampler (MGPU); its LATENT into ComfyUI's own
    LTXVSeparateAVLatent, VAEDecode, LTXVAudioVAEDecode, CreateVideo, SaveVideo."""
    _test_nodes_or_skip()
    wf = mixed_graph(source, int.from_bytes(os.urandom(4), "little"))
    entry = wait(queue(wf))
    info = _mp4_of(entry, tmp_path)
    assert (info["width"], info["height"]) == (128, 64) and info["video_frames"] == 17
    assert info["audio_channels"] == 2 and info["audio_sample_rate"] > 0
    assert info["audio_duration"] == pytest.approx(17 / info["fps"], abs=0.1)


def test_golden_graph_reproduces_the_committed_goldens(server, tiny_models):
    """ComfyUI's native sampling graph of tests/golden/make_golden.py, run on this server now, reproduces the
    committed golden (t2v, euler, reference-aligned): the goldens tests/test_golden.py holds us to are current."""
    _test_nodes_or_skip()
    import importlib.util

    from safetensors.torch import load_file

    golden_dir = ROOT / "tests" / "golden"
    spec = importlib.util.spec_from_file_location("make_golden", golden_dir / "make_golden.py")
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    goldens = load_file(str(golden_dir / "ltx2_golden.safetensors"))
    entry = mg.run(URL, mg.graph("t2v_euler", "aligned", f"ltx2-mgpu-golden-check-{uuid.uuid4().hex[:8]}/t2v"))
    for node, modality in (("13", "video"), ("14", "audio")):
        got = mg.fetch_latent(URL, entry, node)
        diff = float((got - goldens[f"t2v_euler.aligned.{modality}"]).abs().max())
        print(f"golden {modality}: max |now - committed| = {diff:.2e}")
        assert diff <= 1e-5  # same ComfyUI and weights: only thread-count-dependent CPU summation order


# ---- the native MGPU MODEL (issue 19): Load Checkpoint (MGPU)'s `model` / Load Diffusion Model (MGPU) ------------


def test_native_model_loaders_have_the_documented_sockets(server):
    """Load Diffusion Model (MGPU): unet_name / devices / world_size in, MODEL + fleet out; Load Checkpoint (MGPU)
    gains a MODEL output after its fleet (existing graphs keep their links)."""
    info = _get("/object_info/LTX2MGPU_LoadDiffusionModel")["LTX2MGPU_LoadDiffusionModel"]
    assert set(info["input"]["required"]) == {"unet_name", "devices", "world_size"}
    assert info["output"] == ["MODEL", "LTX2_MGPU_FLEET"]
    loader = _get("/object_info/LTX2MGPU_LoadCheckpoint")["LTX2MGPU_LoadCheckpoint"]
    assert loader["output"] == ["LTX2_MGPU_FLEET", "MODEL"]


def _engine_has_forward_job() -> bool:
    try:
        from mgpu_backend.serving.jobs import load_all

        return "forward" in load_all()
    except Exception:  # noqa: BLE001
        return False


def native_model_graph(model_source: str, seed: int, prefix: str, lora: float | None = None,
                       guidance: bool = False) -> dict:
    """ComfyUI's own sampling graph (test conditioning, empty AV latent, CFGGuider, SamplerCustomAdvanced, euler,
    SaveLatent ×2) on the MODEL of `model_source`: "native" (CheckpointLoaderSimple) or "mgpu" (Load Checkpoint
    (MGPU)'s `model`, the workflows' fleet configuration); optionally LoraLoaderModelOnly and STG + modality
    guidance on that MODEL."""
    base = load(BASE_WORKFLOW)
    loader = base[by_class(base, "LTX2MGPU_LoadCheckpoint")]
    ckpt = loader["inputs"]["checkpoint"]
    n = lambda cls, **inputs: {"class_type": cls, "inputs": inputs}  # noqa: E731
    g = {
        "1": n("CheckpointLoaderSimple", ckpt_name=ckpt),
        "2": n("LTX2MGPU_TestConditioning", source="random", seed=5, positive_tokens=12, negative_tokens=9, width=64,
               frame_rate=25.0, prompt="", negative_prompt="", gemma="none", checkpoint="none"),
        "3": n("EmptyLTXVLatentVideo", width=96, height=96, length=17, batch_size=1),  # 27 tokens: odd
        "4": n("LTXVAudioVAELoader", ckpt_name=ckpt),
        "5": n("LTXVEmptyLatentAudio", frames_number=17, frame_rate=25, batch_size=1, audio_vae=["4", 0]),
        "6": n("LTXVConcatAVLatent", video_latent=["3", 0], audio_latent=["5", 0]),
        "7": n("RandomNoise", noise_seed=seed),
        "9": n("KSamplerSelect", sampler_name="euler"),
        "10": n("ManualSigmas", sigmas="1.0, 0.85, 0.6, 0.3, 0.0"),
        "12": n("LTXVSeparateAVLatent", av_latent=["11", 0]),
        "13": n("SaveLatent", samples=["12", 0], filename_prefix=f"{prefix}/video"),
        "14": n("SaveLatent", samples=["12", 1], filename_prefix=f"{prefix}/audio"),
    }
    model = ["1", 0]
    if model_source == "mgpu":
        g["40"] = {"class_type": "LTX2MGPU_LoadCheckpoint", "inputs": dict(loader["inputs"])}
        model = ["40", 1]
    elif model_source == "mgpu_ldm":  # Load Diffusion Model (MGPU): a fleet of the transformer's file, no Gemma
        g["40"] = n("LTX2MGPU_LoadDiffusionModel", unet_name=ckpt, devices=loader["inputs"]["devices"], world_size=0)
        model = ["40", 0]
    if lora is not None:
        g["41"] = n("LoraLoaderModelOnly", model=model, lora_name=MODEL_LINKS_NAMES["distilled_lora"],
                    strength_model=lora)
        model = ["41", 0]
    if guidance:
        g["42"] = n("LTXVSpatioTemporalGuidance", model=model, scale=1.0, blocks="1", start_percent=0.0,
                    end_percent=1.0)
        g["43"] = n("LTXVModalityGuidance", model=["42", 0], modality_scale=3.0, start_percent=0.0, end_percent=1.0)
        model = ["43", 0]
    g["8"] = n("CFGGuider", model=model, positive=["2", 0], negative=["2", 1], cfg=3.0)
    g["11"] = n("SamplerCustomAdvanced", noise=["7", 0], guider=["8", 0], sampler=["9", 0], sigmas=["10", 0],
                latent_image=["6", 0])
    return g


MODEL_LINKS_NAMES = {key: name for (_, name), key in MODEL_LINKS.items()}
NATIVE_MODEL_ATOL = 1e-4  # the engine vs ComfyUI over 4 steps (tests/test_native_model_comfyui.py: ≤ 7.6e-6)


def _latents(entry: dict) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "tests" / "golden" / "make_golden.py")
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    assert entry["status"]["status_str"] == "success", entry["status"]
    return {m: mg.fetch_latent(URL, entry, node) for node, m in (("13", "video"), ("14", "audio"))}


@pytest.mark.parametrize("source,variant", [("mgpu", "plain"), ("mgpu_ldm", "plain"),
                                            ("mgpu", "lora_stg_modality")])
def test_mgpu_model_equals_native_model_through_prompt(server, tiny_models, source, variant):
    """The same ComfyUI graph queued twice through /prompt — ComfyUI's native MODEL, then the MGPU MODEL of Load
    Checkpoint (MGPU) or Load Diffusion Model (MGPU) (transformer on 2 CPU ranks, 27 video tokens) — gives the same
    latents; with LoraLoaderModelOnly 0.5 and STG + modality guidance on the MODEL too; then the plain MGPU graph
    again equals native (the LoRA was removed on the fleet). Measured ≤ 5e-6 (max |latent| ~6)."""
    _test_nodes_or_skip()
    if not _engine_has_forward_job():
        pytest.skip("the engine has no 'forward' job yet (mgpu_backend/serving/jobs/forward.py)")
    seed = int.from_bytes(os.urandom(4), "little")
    kw = {"lora": 0.5, "guidance": True} if variant == "lora_stg_modality" else {}
    tag = uuid.uuid4().hex[:8]
    native = _latents(wait(queue(native_model_graph("native", seed, f"ltx2-mgpu-native-{tag}/n", **kw))))
    mgpu = _latents(wait(queue(native_model_graph(source, seed, f"ltx2-mgpu-native-{tag}/m", **kw))))
    for modality in ("video", "audio"):
        diff = float((mgpu[modality] - native[modality]).abs().max())
        print(f"{source} {variant} {modality}: max |MGPU - native| = {diff:.2e}")
        assert diff <= NATIVE_MODEL_ATOL
    if kw:
        plain_native = _latents(wait(queue(native_model_graph("native", seed, f"ltx2-mgpu-native-{tag}/pn"))))
        plain_mgpu = _latents(wait(queue(native_model_graph(source, seed, f"ltx2-mgpu-native-{tag}/pm"))))
        assert float((plain_mgpu["video"] - plain_native["video"]).abs().max()) <= NATIVE_MODEL_ATOL


def sp_sampler_vs_model_graphs(variant: str, seed: int, prefix: str) -> tuple[dict, dict]:
    """(MGPU MODEL graph, SP Sampler graph) on the same native inputs: ComfyUI's CFGGuider (cfg 3) +
    SamplerCustomAdvanced + euler on Load Checkpoint (MGPU)'s MODEL, and SP Sampler (MGPU) on its fleet with
    video_cfg = audio_cfg = 3, no STG / rescale / modality guidance. `variant`: "plain" (17 frames), "long126" (126
    frames at 25 fps, which ComfyUI accepts: 16 latent frames with 126 audio steps), "i2v07"
    (LTXVImgToVideoInplace at strength 0.7)."""
    model_graph = native_model_graph("mgpu", seed, f"{prefix}/model")
    if variant == "long126":
        model_graph["3"]["inputs"]["length"] = 126
        model_graph["5"]["inputs"]["frames_number"] = 126
    if variant == "i2v07":
        import importlib.util

        spec = importlib.util.spec_from_file_location("make_golden", ROOT / "tests" / "golden" / "make_golden.py")
        mg = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mg)
        (COMFY_DIR / "input").mkdir(exist_ok=True)
        mg.first_frame_image(3, 96, 96).save(COMFY_DIR / "input" / "ltx2-mgpu-sp-i2v.png")
        model_graph["30"] = {"class_type": "LoadImage", "inputs": {"image": "ltx2-mgpu-sp-i2v.png"}}
        model_graph["31"] = {"class_type": "LTXVImgToVideoInplace", "inputs": {
            "vae": ["1", 2], "image": ["30", 0], "latent": ["3", 0], "strength": 0.7, "bypass": False}}
        model_graph["6"]["inputs"]["video_latent"] = ["31", 0]
    sp_graph = {k: dict(v, inputs=dict(v["inputs"])) for k, v in model_graph.items() if k not in ("8", "9", "11")}
    sp_graph["11"] = {"class_type": "LTX2MGPU_SPSampler", "inputs": dict(
        fleet=["40", 0], positive=["2", 0], negative=["2", 1], latent=["6", 0], noise=["7", 0], sigmas=["10", 0],
        steps=4, sampler="euler", video_cfg=3.0, video_stg=0.0, video_rescale=0.0, video_modality=1.0,
        audio_cfg=3.0, audio_stg=0.0, audio_rescale=0.0, audio_modality=1.0, stg_blocks="auto")}
    for node in ("13", "14"):
        sp_graph[node]["inputs"]["filename_prefix"] = sp_graph[node]["inputs"]["filename_prefix"].replace(
            "/model/", "/sp/")
    return model_graph, sp_graph


@pytest.mark.parametrize("variant", ["plain", "long126", "i2v07"])
def test_sp_sampler_equals_the_mgpu_model_graph(server, tiny_models, variant):
    """SP Sampler (MGPU) follows ComfyUI's semantics (issue 19, Build 6): on the same native inputs it equals
    ComfyUI's own sampler driving the MGPU MODEL of the same fleet — also at 126 frames / 25 fps and for
    image-to-video at strength 0.7 (ComfyUI blends the sampler state; the reference recipe differs by ~1 %).
    Measured ≤ 3.8e-6 (max |latent| ~6)."""
    _test_nodes_or_skip()
    seed = int.from_bytes(os.urandom(4), "little")
    model_graph, sp_graph = sp_sampler_vs_model_graphs(variant, seed, f"ltx2-mgpu-sp-vs-model-{uuid.uuid4().hex[:8]}")
    model = _latents(wait(queue(model_graph)))
    sp = _latents(wait(queue(sp_graph)))
    for modality in ("video", "audio"):
        assert sp[modality].shape == model[modality].shape
        diff = float((sp[modality] - model[modality]).abs().max())
        print(f"{variant} {modality} {tuple(sp[modality].shape)}: max |SP Sampler - MGPU MODEL| = {diff:.2e} "
              f"(max |x| {float(model[modality].abs().max()):.2f})")
        assert diff <= NATIVE_MODEL_ATOL


def test_mgpu_model_refuses_a_block_replacement_by_name(server, tiny_models):
    """SkipLayerGuidanceDiT (a block replacement that must run inside the transformer) on the MGPU MODEL: the
    sampler node fails naming it; the server stays up."""
    _test_nodes_or_skip()
    if not _engine_has_forward_job():
        pytest.skip("the engine has no 'forward' job yet (the connectors run on the fleet before the refusal)")
    g = native_model_graph("mgpu", int.from_bytes(os.urandom(4), "little"), f"ltx2-mgpu-refuse-{uuid.uuid4().hex[:8]}")
    g["44"] = {"class_type": "SkipLayerGuidanceDiT", "inputs": {
        "model": g["8"]["inputs"]["model"], "double_layers": "1", "single_layers": "", "scale": 3.0,
        "start_percent": 0.0, "end_percent": 1.0, "rescaling_scale": 0.0}}
    g["8"]["inputs"]["model"] = ["44", 0]
    err = _error_of(wait(queue(g)))
    assert err["node_type"] == "SamplerCustomAdvanced"
    assert "MGPU model" in err["exception_message"] and "patches_replace" in err["exception_message"]
    assert _get("/system_stats")


def _core_multigpu_nodes_or_skip():
    if "MultiGPU_WorkUnits" not in _get("/object_info/MultiGPU_WorkUnits"):
        pytest.skip("this ComfyUI has no core multi-GPU nodes (ComfyUI >= 0.33: comfy_extras/nodes_multigpu.py)")


@pytest.mark.parametrize("sampler", ["SamplerCustomAdvanced", "KSampler"])
def test_mgpu_model_refuses_core_cfg_split_by_name(server, tiny_models, sampler):
    """ComfyUI core's MultiGPU CFG Split (MultiGPU_WorkUnits) after the MGPU MODEL: the sampler node fails naming it
    and what to use instead, before ComfyUI's sampling starts (the pack's OUTER_SAMPLE check: no inner_sample in the
    traceback). On this one-device host core leaves no mark on the model: the node is found on the prompt's model
    links (tests/test_native_model_comfyui.py covers core's marks on a host of two devices)."""
    _test_nodes_or_skip()
    _core_multigpu_nodes_or_skip()
    g = native_model_graph("mgpu", int.from_bytes(os.urandom(4), "little"), f"ltx2-mgpu-split-{uuid.uuid4().hex[:8]}")
    g["45"] = {"class_type": "MultiGPU_WorkUnits", "inputs": {"model": g["8"]["inputs"]["model"], "max_gpus": 2}}
    g["8"]["inputs"]["model"] = ["45", 0]
    if sampler == "KSampler":
        g["11"] = {"class_type": "KSampler", "inputs": {
            "model": ["45", 0], "seed": 1, "steps": 2, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["6", 0], "denoise": 1.0}}
    err = _error_of(wait(queue(g)))
    message = err["exception_message"]
    assert err["node_type"] == sampler, err
    assert "MGPU model" in message and "MultiGPU CFG Split (MultiGPU_WorkUnits)" in message, message
    assert "guidance passes" in message and "give the MGPU loader more devices" in message, message
    assert not any("inner_sample" in line for line in err["traceback"]), err["traceback"]
    assert _get("/system_stats")


def test_core_device_select_nodes_beside_the_mgpu_model(server, tiny_models):
    """ComfyUI core's Select Model Device ("cpu") on the MGPU MODEL and Select VAE Device ("default") on the
    checkpoint's VAE, decoding the sampled video: the graph completes and its latents equal the same graph without
    the two nodes (the MODEL's ComfyUI side only moves inputs; its transformer stays on the fleet)."""
    _test_nodes_or_skip()
    _core_multigpu_nodes_or_skip()
    seed = int.from_bytes(os.urandom(4), "little")
    tag = uuid.uuid4().hex[:8]
    plain = _latents(wait(queue(native_model_graph("mgpu", seed, f"ltx2-mgpu-devsel-{tag}/plain"))))
    g = native_model_graph("mgpu", seed, f"ltx2-mgpu-devsel-{tag}/selected")
    g["46"] = {"class_type": "SelectModelDevice", "inputs": {"model": g["8"]["inputs"]["model"], "device": "cpu"}}
    g["8"]["inputs"]["model"] = ["46", 0]
    g["47"] = {"class_type": "SelectVAEDevice", "inputs": {"vae": ["1", 2], "device": "default"}}
    g["48"] = {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["47", 0]}}
    g["49"] = {"class_type": "PreviewImage", "inputs": {"images": ["48", 0]}}
    entry = wait(queue(g))
    selected = _latents(entry)
    assert entry["outputs"]["49"]["images"], entry["outputs"]
    for modality in ("video", "audio"):
        assert float((selected[modality] - plain[modality]).abs().max()) <= NATIVE_MODEL_ATOL


def test_interrupt_stops_a_sampling_on_the_mgpu_model_and_the_next_prompt_runs(server, tiny_models):
    """ComfyUI's interrupt during a long sampling on the MGPU MODEL stops it (between forwards, or cancelling the
    forward job on the fleet); the same fleet then runs the next prompt."""
    _test_nodes_or_skip()
    if not _engine_has_forward_job():
        pytest.skip("the engine has no 'forward' job yet")
    g = native_model_graph("mgpu", int.from_bytes(os.urandom(4), "little"), f"ltx2-mgpu-int-{uuid.uuid4().hex[:8]}")
    g["10"]["inputs"]["sigmas"] = ", ".join(f"{1 - i / 200:.4f}" for i in range(200)) + ", 0.0"
    client_id = uuid.uuid4().hex
    ws = WebSocket(client_id)
    try:
        prompt_id = queue(g, client_id)
        interrupted_at = None
        for msg in ws.messages():
            data = msg.get("data", {})
            if msg["type"] == "progress" and data.get("node") == "11" and interrupted_at is None \
                    and data["value"] >= 2:
                _post("/interrupt", {})
                interrupted_at = data["value"]
            if msg["type"] == "execution_interrupted" and data.get("prompt_id") == prompt_id:
                break
            if msg["type"] == "execution_error":
                raise AssertionError(data.get("exception_message"))
            if msg["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                raise AssertionError("the prompt ran to the end despite the interrupt")
    finally:
        ws.close()
    assert interrupted_at is not None and interrupted_at < 200
    again = native_model_graph("mgpu", int.from_bytes(os.urandom(4), "little"), f"ltx2-mgpu-int-{uuid.uuid4().hex[:8]}")
    assert wait(queue(again))["status"]["status_str"] == "success"


COVERAGE_LINE = re.compile(r"MGPU model: LoRA fused on the fleet in the transformer: lora (\S+)#0 @ ([0-9.]+): "
                           r"(\d+)/(\d+) layers applied")


def test_lora_coverage_line_in_comfyuis_log(server, tiny_models):
    """LoraLoaderModelOnly at 0.5 and at 1.0 on the MGPU MODEL (Load Checkpoint (MGPU)'s `model`, 2 CPU ranks): each
    sampling puts the fleet's coverage of that LoRA set in ComfyUI's log — what its console prints, read back through
    ComfyUI's own `/internal/logs/raw` — as docs/nodes.md promises: one line per LoRA set, every layer of the tiny
    distilled LoRA applied. A ModelSamplingLTXV with a shift of this run in front of the LoRA loader makes the LoRA
    a new patch set (ComfyUI caches the loader's output otherwise, and the proxy logs a set once). Before issue 36
    no such line appeared (the patches travelled with preprocess_text, the forward logged only what it shipped)."""
    import random

    _test_nodes_or_skip()
    if not _engine_has_forward_job():
        pytest.skip("the engine has no 'forward' job yet (mgpu_backend/serving/jobs/forward.py)")
    since = time.time()
    shift = round(random.uniform(1.5, 2.5), 2)
    for strength in (0.5, 1.0):
        g = native_model_graph("mgpu", int.from_bytes(os.urandom(4), "little"),
                               f"ltx2-mgpu-lora-log-{uuid.uuid4().hex[:8]}", lora=strength)
        g["44"] = {"class_type": "ModelSamplingLTXV", "inputs": {"model": g["41"]["inputs"]["model"],
                                                                 "max_shift": shift, "base_shift": 0.95}}
        g["41"]["inputs"]["model"] = ["44", 0]
        entry = wait(queue(g))
        assert entry["status"]["status_str"] == "success", entry["status"]
    entries = _get("/internal/logs/raw")["entries"]
    lines = [m for e in entries if _log_time(e["t"]) >= since - 1 for m in e["m"].splitlines()]
    found = {}
    for line in lines:
        m = COVERAGE_LINE.search(line)
        if m:
            found.setdefault(float(m[2]), []).append((m[1], int(m[3]), int(m[4])))
    assert set(found) == {0.5, 1.0}, "\n".join(lines[-40:])
    for strength, hits in found.items():
        assert len(hits) == 1, (strength, hits)  # once per LoRA set, not once per forward
        _key, applied, total = hits[0]
        assert applied == total > 0, (strength, hits)
    assert found[0.5][0][0] != found[1.0][0][0]  # two LoRA sets


def _log_time(stamp: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(stamp).timestamp()
