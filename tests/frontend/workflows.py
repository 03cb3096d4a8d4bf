"""The shipped UI workflows (`workflows/*.json`), made by ComfyUI's own frontend from their API twins.

Each UI workflow is its API twin (`workflows/api/<name>.json`, the headless, tiny-model-ready graph the live tests
queue) imported by the frontend's API-JSON loader (`app.loadApiJson`, in headless Chromium), with the user-facing
values of `SPEC[name]["overrides"]` (released model files, "all" devices, full sizes and steps), download hints
on the loader nodes (`properties.models`: name / url / directory, what the frontend's missing-models dialog offers
to download), a Markdown note, a column layout, then `app.graph.serialize()`. The preview (`workflows/<name>.jpg`,
the file name ComfyUI's template browser asks custom-node templates for) is a screenshot of that graph as the
frontend draws it after loading the saved JSON.

    COMFYUI_URL=http://127.0.0.1:8188 python tests/frontend/workflows.py build   # rewrite workflows/*.json + .jpg

Needs a live ComfyUI with this pack, Node.js with `playwright-core` (found through NODE_PATH, `$PLAYWRIGHT_CORE_DIR`,
`npm root -g` or ./node_modules) and Chromium (`$CHROMIUM` or /usr/bin/chromium). `tests/test_frontend.py` checks
the result in the same frontend.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
WORKFLOWS = ROOT / "workflows"
DRIVER = Path(__file__).resolve().parent / "driver.cjs"

HF = "https://huggingface.co"
MODELS = {  # file -> (download url, ComfyUI models folder)
    "ltx-2-19b-dev-fp8.safetensors": (f"{HF}/Lightricks/LTX-2/resolve/main/ltx-2-19b-dev-fp8.safetensors",
                                      "checkpoints"),
    "ltx-2-19b-distilled-fp8.safetensors": (
        f"{HF}/Lightricks/LTX-2/resolve/main/ltx-2-19b-distilled-fp8.safetensors", "checkpoints"),
    "ltx-2-19b-distilled-lora-384.safetensors": (
        f"{HF}/Lightricks/LTX-2/resolve/main/ltx-2-19b-distilled-lora-384.safetensors", "loras"),
    "ltx-2-spatial-upscaler-x2-1.0.safetensors": (
        f"{HF}/Lightricks/LTX-2/resolve/main/ltx-2-spatial-upscaler-x2-1.0.safetensors", "latent_upscale_models"),
    "gemma_3_12B_it.safetensors": (
        f"{HF}/Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/gemma_3_12B_it.safetensors", "text_encoders"),
}
LTX23 = {  # the LTX-2.3 counterparts, listed in the notes
    "ltx-2.3-22b-dev-fp8.safetensors": (f"{HF}/Lightricks/LTX-2.3-fp8/resolve/main/ltx-2.3-22b-dev-fp8.safetensors",
                                        "checkpoints"),
    "ltx-2.3-22b-distilled-fp8.safetensors": (
        f"{HF}/Lightricks/LTX-2.3-fp8/resolve/main/ltx-2.3-22b-distilled-fp8.safetensors", "checkpoints"),
    "ltx-2.3-22b-distilled-lora-384.safetensors": (
        f"{HF}/Lightricks/LTX-2.3/resolve/main/ltx-2.3-22b-distilled-lora-384.safetensors", "loras"),
    "ltx-2.3-spatial-upscaler-x2-1.1.safetensors": (
        f"{HF}/Lightricks/LTX-2.3/resolve/main/ltx-2.3-spatial-upscaler-x2-1.1.safetensors", "latent_upscale_models"),
}
# the released file each tiny test model stands for (tests/test_comfyui_live.py links the tiny files)
TINY = {
    "ltx-2-19b-dev-fp8.safetensors": "ltx-2.0-tiny.safetensors",
    "ltx-2-19b-distilled-fp8.safetensors": "ltx-2.0-tiny.safetensors",
    "gemma_3_12B_it.safetensors": "gemma-3-tiny.safetensors",
    "ltx-2-spatial-upscaler-x2-1.0.safetensors": "ltx-20-tiny-spatial-upscaler-x2.safetensors",
    "ltx-2-19b-distilled-lora-384.safetensors": "ltx-2.0-tiny-distilled-lora.safetensors",
}
# widget inputs that name model files (node class -> inputs)
MODEL_INPUTS = {
    "LTX2MGPU_LoadCheckpoint": ("checkpoint", "gemma", "upscaler", "video_vae", "audio_vae", "text_projection"),
    "LTX2MGPU_LoRA": ("lora_name",),
    "CheckpointLoaderSimple": ("ckpt_name",),
    "LTXVAudioVAELoader": ("ckpt_name",),
    "LatentUpscaleModelLoader": ("model_name",),
}


def _model_links(files) -> str:
    lines = []
    by_folder: dict[str, list[str]] = {}
    for name in files:
        url, folder = {**MODELS, **LTX23}[name]
        by_folder.setdefault(folder, []).append(f"- [{name}]({url})")
    for folder, entries in by_folder.items():
        lines += [f"**models/{folder}/**", *entries, ""]
    return "\n".join(lines)


COMMON_NOTE = """
## The multi-GPU nodes
The MGPU nodes are thin clients of a background controller that keeps one worker per GPU, each with a full copy of
the weights (a latency tool, not a memory tool). **Load Checkpoint (MGPU)** starts or reuses the fleet
(`devices`: `all`, a count, `0,1,3`, or `cpu:N`) and shows its plan; its output feeds every other MGPU node.
SP Sampler (MGPU) splits each transformer forward over the devices (equal to one device up to rounding);
TDP Upscale (MGPU) refines the 2x-upscaled latent in tiles, one per device; Distributed Decode (MGPU) decodes
video tiles on every device. Their inputs and outputs are ComfyUI's own LATENT / CONDITIONING / NOISE / SIGMAS /
IMAGE / AUDIO, so native LTX-2 nodes mix in.

Frames must be 8k+1 (25, 97, 121, ...), width and height multiples of 32 (stage 1 at half the final size); use the
same frame rate in Text Encode (MGPU), the audio latent and Create Video.

## Model files
Download links are also on the loader nodes (the missing-models dialog offers them).
Gemma: the bf16 `gemma_3_12B_it.safetensors` (or `..._fp8_scaled`, or a Hugging Face `google/gemma-3-12b-it` folder
in `models/text_encoders/`); the fp4-mixed file is refused.
"""


def _note(title: str, intro: str, files: list[str], ltx23: list[str]) -> dict:
    text = (f"# {title}\n{intro.strip()}\n" + COMMON_NOTE + "\n" + _model_links(files)
            + "\n**LTX-2.3** (22B) instead: the same graph with\n\n" + _model_links(ltx23))
    return {"title": "Read me: " + title, "text": text, "width": 560, "height": 780}


def _hints(*names: str) -> dict:
    return {"models": [{"name": n, "url": MODELS[n][0], "directory": MODELS[n][1]} for n in names]}


FULL = {"width": 768, "height": 512, "length": 121}  # stage 1 at half size: 1536 x 1024 after the 2x upscale

SPEC: dict[str, dict] = {
    "ltx2-mgpu-two-stage-t2v": {
        "overrides": {
            "1": {"checkpoint": "ltx-2-19b-dev-fp8.safetensors", "gemma": "gemma_3_12B_it.safetensors",
                  "upscaler": "ltx-2-spatial-upscaler-x2-1.0.safetensors", "devices": "all"},
            "3": dict(FULL),
            "4": {"ckpt_name": "ltx-2-19b-dev-fp8.safetensors"},
            "5": {"frames_number": FULL["length"]},
            "8": {"steps": 30},
            "12": {"filename_prefix": "ltx2-mgpu/two-stage-t2v"},
            "13": {"lora_name": "ltx-2-19b-distilled-lora-384.safetensors"},
        },
        "properties": {
            "1": _hints("ltx-2-19b-dev-fp8.safetensors", "gemma_3_12B_it.safetensors",
                        "ltx-2-spatial-upscaler-x2-1.0.safetensors"),
            "4": _hints("ltx-2-19b-dev-fp8.safetensors"),
            "13": _hints("ltx-2-19b-distilled-lora-384.safetensors"),
        },
        "note": _note(
            "LTX-2 two-stage text-to-video on several GPUs",
            "Stage 1: SP Sampler (MGPU), 30 steps with CFG / STG / modality guidance at half size (768x512, 121 "
            "frames). Stage 2: TDP Upscale (MGPU) upscales the latent 2x with the spatial upscaler and refines it "
            "with the distilled LoRA (sigmas 0.625, 0.4, 0) in tiles, one per GPU; the stage-1 audio is kept. "
            "Distributed Decode (MGPU) decodes on every GPU.",
            ["ltx-2-19b-dev-fp8.safetensors", "gemma_3_12B_it.safetensors",
             "ltx-2-spatial-upscaler-x2-1.0.safetensors", "ltx-2-19b-distilled-lora-384.safetensors"],
            ["ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors",
             "ltx-2.3-22b-distilled-lora-384.safetensors"]),
    },
    "ltx2-mgpu-two-stage-i2v": {
        "overrides": {
            "1": {"checkpoint": "ltx-2-19b-dev-fp8.safetensors", "gemma": "gemma_3_12B_it.safetensors",
                  "upscaler": "ltx-2-spatial-upscaler-x2-1.0.safetensors", "devices": "all"},
            "5": {"ckpt_name": "ltx-2-19b-dev-fp8.safetensors"},
            "6": dict(FULL),
            "7": {"ckpt_name": "ltx-2-19b-dev-fp8.safetensors"},
            "8": {"frames_number": FULL["length"]},
            "11": {"steps": 30},
            "12": {"lora_name": "ltx-2-19b-distilled-lora-384.safetensors"},
        },
        "properties": {
            "1": _hints("ltx-2-19b-dev-fp8.safetensors", "gemma_3_12B_it.safetensors",
                        "ltx-2-spatial-upscaler-x2-1.0.safetensors"),
            "5": _hints("ltx-2-19b-dev-fp8.safetensors"),
            "7": _hints("ltx-2-19b-dev-fp8.safetensors"),
            "12": _hints("ltx-2-19b-distilled-lora-384.safetensors"),
        },
        "note": _note(
            "LTX-2 two-stage image-to-video on several GPUs",
            "ComfyUI's own LTXVImgToVideo encodes the first frame (strength 1: the frame is kept as given) and sets "
            "the latent's noise_mask; its VAE comes from CheckpointLoaderSimple on the same checkpoint (ComfyUI "
            "keeps that file in host RAM; only its VAE runs here). SP Sampler (MGPU) honours the mask in stage 1; "
            "TDP Upscale (MGPU) refines the upscaled latent with the distilled LoRA (the mask does not survive the "
            "resize, as with LTXVLatentUpsampler). Pick your image in Load Image.",
            ["ltx-2-19b-dev-fp8.safetensors", "gemma_3_12B_it.safetensors",
             "ltx-2-spatial-upscaler-x2-1.0.safetensors", "ltx-2-19b-distilled-lora-384.safetensors"],
            ["ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors",
             "ltx-2.3-22b-distilled-lora-384.safetensors"]),
    },
    "ltx2-mgpu-distilled": {
        "overrides": {
            "1": {"checkpoint": "ltx-2-19b-distilled-fp8.safetensors", "gemma": "gemma_3_12B_it.safetensors",
                  "devices": "all"},
            "3": dict(FULL),
            "4": {"ckpt_name": "ltx-2-19b-distilled-fp8.safetensors"},
            "5": {"frames_number": FULL["length"]},
            "11": {"ckpt_name": "ltx-2-19b-distilled-fp8.safetensors"},
            "12": {"model_name": "ltx-2-spatial-upscaler-x2-1.0.safetensors"},
        },
        "properties": {
            "1": _hints("ltx-2-19b-distilled-fp8.safetensors", "gemma_3_12B_it.safetensors"),
            "4": _hints("ltx-2-19b-distilled-fp8.safetensors"),
            "11": _hints("ltx-2-19b-distilled-fp8.safetensors"),
            "12": _hints("ltx-2-spatial-upscaler-x2-1.0.safetensors"),
        },
        "note": _note(
            "LTX-2 distilled pipeline on several GPUs (SP -> SP)",
            "The distilled checkpoint, no guidance (CFG 1, STG 0, modality 1; no negative prompt needed). Stage 1: "
            "SP Sampler (MGPU) with the 8 distilled sigmas at half size. Between the stages ComfyUI's own nodes "
            "split the latent (LTXVSeparateAVLatent), upscale the video 2x (LTXVLatentUpsampler with the spatial "
            "upscaler; its VAE, for the latent statistics, from CheckpointLoaderSimple, which keeps the file in "
            "host RAM) and join the stage-1 audio back (LTXVConcatAVLatent). Stage 2: SP Sampler (MGPU) again, at "
            "full size, re-noised to 0.909375 and denoised in 3 steps (0.909375, 0.725, 0.421875, 0): sequence "
            "parallel on both stages, as the reference's distilled pipeline. Distributed Decode (MGPU) decodes.",
            ["ltx-2-19b-distilled-fp8.safetensors", "gemma_3_12B_it.safetensors",
             "ltx-2-spatial-upscaler-x2-1.0.safetensors"],
            ["ltx-2.3-22b-distilled-fp8.safetensors", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"]),
    },
}


# ---- helpers shared with tests/test_frontend.py ------------------------------------------------------------------


def api_twin(name: str) -> dict:
    return json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())


def expected_prompt(name: str) -> dict:
    """The API prompt the UI workflow must queue: its API twin with the UI's overrides."""
    api = copy.deepcopy(api_twin(name))
    for node_id, values in SPEC[name]["overrides"].items():
        for key, value in values.items():
            assert key in api[node_id]["inputs"], (name, node_id, key)
            api[node_id]["inputs"][key] = value
    return api


def tiny_variant(workflow: dict) -> dict:
    """A UI workflow with its released model files replaced by the tiny test models of the same role."""
    wf = copy.deepcopy(workflow)
    for node in wf["nodes"]:
        if isinstance(node.get("widgets_values"), list):
            node["widgets_values"] = [TINY.get(v, v) if isinstance(v, str) else v for v in node["widgets_values"]]
        for hint in node.get("properties", {}).get("models", []) or []:
            hint["name"] = TINY.get(hint["name"], hint["name"])
    return wf


def model_files(workflow: dict) -> set[str]:
    """Released model files a UI workflow names in its model widgets (those with download hints)."""
    out = set()
    for node in workflow["nodes"]:
        for hint in node.get("properties", {}).get("models", []) or []:
            out.add(hint["name"])
    return out


def find_playwright() -> str | None:
    """A folder that holds node_modules/playwright-core (for NODE_PATH), or None."""
    candidates = []
    if os.environ.get("PLAYWRIGHT_CORE_DIR"):
        candidates.append(Path(os.environ["PLAYWRIGHT_CORE_DIR"]))
    candidates += [Path(p) for p in os.environ.get("NODE_PATH", "").split(os.pathsep) if p]
    candidates.append(ROOT / "node_modules")
    if shutil.which("npm"):
        try:
            out = subprocess.run(["npm", "root", "-g"], capture_output=True, text=True, timeout=30).stdout.strip()
            if out:
                candidates.append(Path(out))
        except (OSError, subprocess.SubprocessError):
            pass
    for c in candidates:
        if c.name == "playwright-core" and (c / "package.json").is_file():
            return str(c.parent)
        if (c / "playwright-core" / "package.json").is_file():
            return str(c)
    return None


def find_chromium() -> str | None:
    for c in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


PREVIEW_VIEWPORT = {"width": 2600, "height": 1300}


def run_driver(url: str, tasks: list[dict], timeout: float = 900, viewport: dict | None = None) -> list[dict]:
    """Run `driver.cjs` on `tasks`; returns its per-task results. Raises RuntimeError when Node / playwright-core /
    Chromium are missing or the driver fails."""
    node, pw, chromium = shutil.which("node"), find_playwright(), find_chromium()
    if not (node and pw and chromium):
        raise RuntimeError(f"needs node ({node}), playwright-core ({pw}) and chromium ({chromium})")
    with tempfile.TemporaryDirectory(prefix="ltx2-frontend-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"url": url, "chromium": chromium, "tasks": tasks,
                                   **({"viewport": viewport} if viewport else {})}))
        env = dict(os.environ, NODE_PATH=pw)
        proc = subprocess.run([node, str(DRIVER), str(job), str(result)], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(f"driver failed ({proc.returncode}): {proc.stderr[-3000:]}{proc.stdout[-2000:]}")
        return json.loads(result.read_text())


def build(url: str) -> list[Path]:
    """Rebuild workflows/<name>.json (UI) and workflows/<name>.jpg (preview) for every SPEC entry."""
    tasks = [{"kind": "build", "name": name, "api": api_twin(name), "overrides": spec["overrides"],
              "properties": spec["properties"], "note": spec["note"]} for name, spec in SPEC.items()]
    built = run_driver(url, tasks)
    written = []
    checks = []
    for res in built:
        if "exception" in res:
            raise RuntimeError(f"{res['name']}: {res['exception']}")
        wf = res["workflow"]
        path = WORKFLOWS / f"{res['name']}.json"
        path.write_text(json.dumps(wf, indent=2) + "\n")
        written.append(path)
        checks.append({"kind": "check", "name": res["name"], "workflow": wf, "scan": False})
    with tempfile.TemporaryDirectory(prefix="ltx2-previews-") as tmp:
        for task in checks:
            task["preview"] = str(Path(tmp) / f"{task['name']}.png")
        for res in run_driver(url, checks, viewport=PREVIEW_VIEWPORT):
            if "exception" in res:
                raise RuntimeError(f"{res['name']}: {res['exception']}")
            written.append(save_preview(Path(res["preview"]), WORKFLOWS / f"{res['name']}.jpg"))
    return written


def save_preview(png: Path, jpg: Path, width: int = 1280) -> Path:
    """The screenshot cropped to the drawn graph (plus a margin), scaled to `width`, as JPEG."""
    from PIL import Image, ImageChops

    im = Image.open(png).convert("RGB")
    background = Image.new("RGB", im.size, im.getpixel((2, 2)))
    box = ImageChops.difference(im, background).convert("L").point(lambda v: 255 if v > 12 else 0).getbbox()
    if box:
        m = 24
        im = im.crop((max(0, box[0] - m), max(0, box[1] - m), min(im.width, box[2] + m), min(im.height, box[3] + m)))
    if im.width > width:
        im = im.resize((width, round(im.height * width / im.width)), Image.LANCZOS)
    im.save(jpg, "JPEG", quality=85, optimize=True)
    return jpg


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit(__doc__)
    for p in build(os.environ.get("COMFYUI_URL", "http://127.0.0.1:8188").rstrip("/")):
        print(f"wrote {p.relative_to(ROOT)} ({p.stat().st_size} bytes)")
