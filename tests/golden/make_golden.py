"""Regenerate the golden tensors (`ltx2_golden.safetensors`) with ComfyUI's NATIVE sampler on the tiny LTX-2.0 model.

Runs with this project's Python against a live ComfyUI that has this pack (and its test nodes) loaded:

    LTX2_MGPU_TEST_NODES=1 LTX2_MGPU_RUNTIME_DIR=/tmp/ltx2-rt python main.py --cpu   # in ComfyUI's folder: docs/testing.md#a-live-comfyui
    COMFYUI_URL=http://127.0.0.1:8188 COMFYUI_DIR=/tmp/comfyui python tests/golden/make_golden.py

What it does:
1. writes the tiny LTX-2.0 set (`mgpu_backend.testing.tiny.make_tiny(…, "2.0", seed=0)`, the same files the live
   tests and `tests/conftest.py` make) and links it into `$COMFYUI_DIR/models/` (as `tests/test_comfyui_live.py`);
2. for every (case, mode) queues an API graph over HTTP that is ComfyUI's own sampling path:
   `CheckpointLoaderSimple` (our tiny single file) → [`LTX2MGPU_TestLTXAVFix`] → `CFGGuider` (cfg) with
   `LTX2MGPU_TestConditioning` (seeded random native CONDITIONING), `EmptyLTXVLatentVideo` (or `LoadImage` →
   `LTXVImgToVideo`) + `LTXVEmptyLatentAudio` → `LTXVConcatAVLatent`, `RandomNoise`, `KSamplerSelect`,
   `ManualSigmas` → `SamplerCustomAdvanced` → `LTXVSeparateAVLatent` → `SaveLatent` ×2;
3. reads the saved latents back through `/view` and writes them, with the spec (seeds, sizes, sigmas, cfg) and the
   provenance (ComfyUI / torch versions, a fingerprint of the tiny transformer weights) as metadata.

Modes (see tests/test_golden.py for why):
- `as_is`: ComfyUI unpatched (0.20.x: unscaled sigma into the audio-video cross-attention AdaLNs; q/k eps 1e-5);
- `fixed`: with the upstream fix of Comfy-Org/ComfyUI#14097 (test node), q/k RMS-norm eps as shipped (1e-5);
- `aligned`: the fix plus the reference's q/k eps 1e-6.
"""
from __future__ import annotations

import hashlib
import io as _io
import json
import os
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = HERE / "ltx2_golden.safetensors"

SPEC = {
    "variant": "2.0",
    "tiny_seed": 0,
    "checkpoint": "ltx-2.0-tiny.safetensors",
    "width": 64, "height": 64, "length": 9, "fps": 25.0,
    "noise_seed": 42,
    "cond_seed": 7, "positive_tokens": 16, "negative_tokens": 11, "cond_width": 64,
    "cfg": 3.0,
    "sigmas": [1.0, 0.9, 0.7, 0.4, 0.1, 0.0],
    "image_seed": 3,
    "i2v_strength": 1.0,
}
CASES = {
    "t2v_euler": {"sampler": "euler", "i2v": False},
    "t2v_euler_ancestral": {"sampler": "euler_ancestral", "i2v": False},
    "i2v_euler": {"sampler": "euler", "i2v": True},
    # strength < 1: ComfyUI blends the sampler state (KSamplerX0Inpaint), the reference recipe the x0 prediction
    "i2v07_euler": {"sampler": "euler", "i2v": True, "i2v_strength": 0.7},
}
MODES = {"aligned": {"fix": True, "eps": 1e-6}, "fixed": {"fix": True, "eps": 0.0}, "as_is": None}
RUNS = [(case, "aligned") for case in CASES if case != "i2v07_euler"] + [
    ("t2v_euler", "fixed"), ("i2v07_euler", "fixed"), ("t2v_euler", "as_is")]  # i2v07: as shipped only (file size)
IMAGE_NAME = "ltx2-mgpu-golden-first-frame.png"


def weights_fingerprint(checkpoint: str | Path) -> str:
    """sha256 over the transformer tensors (`model.diffusion_model.*`: names, dtypes, shapes, bytes) of a checkpoint."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in sorted(k for k in f.keys() if k.startswith("model.diffusion_model.")):
            t = f.get_tensor(key).contiguous()
            h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def first_frame_image(seed: int, width: int, height: int):
    """The deterministic test image for the image-to-video case (PIL RGB)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(1, width - 1), y * 255 / max(1, height - 1), (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def graph(case: str, mode: str, prefix: str) -> dict:
    s, c, m = SPEC, CASES[case], MODES[mode]
    g: dict = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": s["checkpoint"]}},
        "2": {"class_type": "LTX2MGPU_TestConditioning", "inputs": {
            "source": "random", "seed": s["cond_seed"], "positive_tokens": s["positive_tokens"],
            "negative_tokens": s["negative_tokens"], "width": s["cond_width"], "frame_rate": s["fps"],
            "prompt": "", "negative_prompt": "", "gemma": "none", "checkpoint": "none"}},
        "4": {"class_type": "LTXVAudioVAELoader", "inputs": {"ckpt_name": s["checkpoint"]}},
        "5": {"class_type": "LTXVEmptyLatentAudio", "inputs": {"frames_number": s["length"], "frame_rate": int(s["fps"]),
                                                               "batch_size": 1, "audio_vae": ["4", 0]}},
        "7": {"class_type": "RandomNoise", "inputs": {"noise_seed": s["noise_seed"]}},
        "9": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": c["sampler"]}},
        "10": {"class_type": "ManualSigmas", "inputs": {"sigmas": ", ".join(repr(float(x)) for x in s["sigmas"])}},
        "12": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["11", 0]}},
        "13": {"class_type": "SaveLatent", "inputs": {"samples": ["12", 0], "filename_prefix": f"{prefix}/video"}},
        "14": {"class_type": "SaveLatent", "inputs": {"samples": ["12", 1], "filename_prefix": f"{prefix}/audio"}},
    }
    model = ["1", 0]
    if m is not None:
        g["20"] = {"class_type": "LTX2MGPU_TestLTXAVFix", "inputs": {
            "model": model, "fix_av_cross_attention_timesteps": m["fix"], "qk_norm_eps": m["eps"]}}
        model = ["20", 0]
    positive, negative = ["2", 0], ["2", 1]
    if c["i2v"]:
        g["30"] = {"class_type": "LoadImage", "inputs": {"image": IMAGE_NAME}}
        g["31"] = {"class_type": "LTXVImgToVideo", "inputs": {
            "positive": positive, "negative": negative, "vae": ["1", 2], "image": ["30", 0], "width": s["width"],
            "height": s["height"], "length": s["length"], "batch_size": 1,
            "strength": c.get("i2v_strength", s["i2v_strength"])}}
        positive, negative, video = ["31", 0], ["31", 1], ["31", 2]
        g["32"] = {"class_type": "SaveLatent", "inputs": {"samples": video, "filename_prefix": f"{prefix}/input"}}
    else:
        g["3"] = {"class_type": "EmptyLTXVLatentVideo", "inputs": {"width": s["width"], "height": s["height"],
                                                                  "length": s["length"], "batch_size": 1}}
        video = ["3", 0]
    g["6"] = {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": video, "audio_latent": ["5", 0]}}
    g["8"] = {"class_type": "CFGGuider", "inputs": {"model": model, "positive": positive, "negative": negative,
                                                    "cfg": s["cfg"]}}
    g["11"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["7", 0], "guider": ["8", 0],
                                                                 "sampler": ["9", 0], "sigmas": ["10", 0],
                                                                 "latent_image": ["6", 0]}}
    return g


def _http(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
    return raw


def run(url: str, g: dict, timeout: float = 900) -> dict:
    prompt_id = json.loads(_http(url + "/prompt", {"prompt": g, "client_id": uuid.uuid4().hex}))["prompt_id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = json.loads(_http(f"{url}/history/{prompt_id}"))
        entry = h.get(prompt_id)
        if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
            if entry["status"]["status_str"] != "success":
                raise RuntimeError(f"ComfyUI run failed: {json.dumps(entry['status'])[:3000]}")
            return entry
        time.sleep(0.5)
    raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s")


def fetch_latent(url: str, entry: dict, node: str):
    from safetensors.torch import load

    item = entry["outputs"][node]["latents"][0]
    q = urllib.parse.urlencode({"filename": item["filename"], "subfolder": item.get("subfolder", ""),
                                "type": item.get("type", "output")})
    return load(_http(f"{url}/view?{q}"))["latent_tensor"].float().contiguous()


def main() -> int:
    import torch
    from safetensors.torch import save_file

    url = os.environ.get("COMFYUI_URL", "http://127.0.0.1:8188").rstrip("/")
    comfy_dir = Path(os.environ.get("COMFYUI_DIR", "/tmp/comfyui"))
    models = Path(os.environ.get("COMFYUI_MODELS_DIR", comfy_dir / "models"))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import test_comfyui_live as live  # the tiny set and its link names, shared with the live tests

    info = json.loads(_http(url + "/object_info/LTX2MGPU_TestConditioning"))
    if "LTX2MGPU_TestConditioning" not in info:
        raise SystemExit("the server has no test nodes: start it with LTX2_MGPU_TEST_NODES=1")
    written = live._tiny_dir()
    for (folder, name), key in live.MODEL_LINKS.items():
        (models / folder).mkdir(parents=True, exist_ok=True)
        link = models / folder / name
        tmp = link.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(written[key]).resolve())
        os.replace(tmp, link)
    (comfy_dir / "input").mkdir(parents=True, exist_ok=True)
    first_frame_image(SPEC["image_seed"], SPEC["width"], SPEC["height"]).save(comfy_dir / "input" / IMAGE_NAME)

    stats = json.loads(_http(url + "/system_stats"))["system"]
    tensors: dict[str, torch.Tensor] = {}
    tag = uuid.uuid4().hex[:8]
    for case, mode in RUNS:
        t0 = time.perf_counter()
        g = graph(case, mode, f"ltx2-mgpu-golden-{tag}/{case}-{mode}")
        entry = run(url, g)
        tensors[f"{case}.{mode}.video"] = fetch_latent(url, entry, "13")
        tensors[f"{case}.{mode}.audio"] = fetch_latent(url, entry, "14")
        if CASES[case]["i2v"] and f"{case}.input.first_frame" not in tensors:
            clean = fetch_latent(url, entry, "32")
            assert bool((clean[:, :, 1:] == 0).all()), "LTXVImgToVideo: only the first latent frame is set"
            tensors[f"{case}.input.first_frame"] = clean[:, :, :1].contiguous()
        print(f"{case} / {mode}: video {tuple(tensors[f'{case}.{mode}.video'].shape)} audio "
              f"{tuple(tensors[f'{case}.{mode}.audio'].shape)} in {time.perf_counter() - t0:.1f} s")
    meta = {
        "spec": json.dumps(SPEC), "cases": json.dumps(CASES), "modes": json.dumps(MODES),
        "comfyui_version": str(stats.get("comfyui_version")), "comfyui_pytorch": str(stats.get("pytorch_version")),
        "weights_sha256": weights_fingerprint(written["checkpoint"]), "generated_by": "tests/golden/make_golden.py",
    }
    save_file(tensors, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {', '.join(sorted(tensors))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
