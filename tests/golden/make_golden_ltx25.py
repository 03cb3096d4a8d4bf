"""Regenerate `ltx25_golden.safetensors`: what ComfyUI 0.33 computes on the tiny LTX-2.5 per-component files.

Runs with this project's Python; ComfyUI runs in a subprocess with its own interpreter, in-process there (no server):

    COMFYUI_DIR=/path/to/ComfyUI-0.33 COMFYUI_PYTHON=/path/to/its/python python tests/golden/make_golden_ltx25.py

(ComfyUI 0.33.0 with its own venv, set up as docs/testing.md#a-live-comfyui says.)

What it does:
1. writes the tiny LTX-2.5 per-component files (`mgpu_backend.testing.tiny.write_tiny_component_files(…, "2.5",
   seed=0)`, what `make-tiny --variant 2.5` writes) and seeded inputs;
2. in ComfyUI, the way its loader nodes do it: `UNETLoader` → `comfy.sd.load_diffusion_model` on the bf16 transformer
   (compute float32) and on its int8-convrot twin; `VAELoader` → `comfy.sd.VAE` on the audio VAE and on the
   conv-decoder video VAE; `LatentUpscaleModelLoader.execute` on the upscaler;
3. records ComfyUI's results: one transformer forward of a sampler step (`extra_conds` + `apply_model`, velocities
   captured with a forward hook) as shipped, with the reference's q/k-norm eps (1e-6), and with the eps AND the
   reference's video->audio cross-attention input ("ref": ComfyUI 0.33 re-normalizes the video stream after the
   audio->video residual; ltx-core / diffusers use the norm from before it — the driver swaps that one line of
   `BasicAVTransformerBlock.forward`, as the 0.20 goldens patched the cross-attention AdaLN timestep), the "ref"
   forward with the keyframe embedding zeroed (to show it acts on frame-0 tokens), the dequantized weights of the
   int8-convrot layers (`QuantizedTensor.dequantize()`, comfy-kitchen's `TensorWiseINT8Layout`) and the "ref"
   forward of the int8-convrot twin (int8 layers W8A8 through comfy-kitchen's `int8_linear`), a video decode, an
   audio decode and an upscale; and the loaders' key coverage (missing / unexpected keys) as metadata;
4. writes them with the inputs, the spec and provenance (ComfyUI / torch versions, a fingerprint of the files).

`tests/test_ltx25.py` compares this project's loaders and modules with these tensors.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = HERE / "ltx25_golden.safetensors"
SPEC = {"variant": "2.5", "tiny_seed": 0, "input_seed": 11, "frames": 2, "height": 2, "width": 3,
        "audio_frames": 5, "prompt_tokens": 23, "fps": 24.0, "sigma": 0.7}
INT8_LAYERS = ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.ff.net.0.proj",
               "transformer_blocks.1.audio_ff.net.2", "transformer_blocks.1.audio_to_video_attn.to_k")

DRIVER = r'''
import json, logging, os, sys
sys.path.insert(0, os.getcwd())
files, inputs_path, out_path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
int8_layers = json.loads(sys.argv[4])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
records = []
class _Capture(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger().setLevel(logging.DEBUG)
logging.getLogger().addHandler(_Capture(level=logging.DEBUG))
import torch
import comfy.sd, comfy.utils, comfy.model_management
import folder_paths

inputs = torch.load(inputs_path)
info, out = {}, {}

def load_unet(path):
    # UNETLoader (nodes.py) with weight_dtype "default"; the model's compute dtype forced to float32 like our test
    return comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})

def forward(base, dm):
    video, audio, sigma = inputs["video"], inputs["audio"], inputs["sigma"]
    x, shapes = comfy.utils.pack_latents([video, audio])
    mask, _ = comfy.utils.pack_latents([torch.ones_like(video[:, :1]).expand_as(video),
                                        torch.ones_like(audio[:, :1]).expand_as(audio)])
    conds = base.extra_conds(cross_attn=inputs["cond"], unprocessed_ltxav_embeds=True, frame_rate=inputs["fps"],
                             device=torch.device("cpu"), denoise_mask=mask, latent_shapes=shapes)
    kwargs = {k: v.cond for k, v in conds.items()}
    raw = {}
    hook = dm.register_forward_hook(lambda module, args, output: raw.setdefault("out", output))
    try:
        with torch.no_grad():
            base.apply_model(x, sigma, **kwargs)
    finally:
        hook.remove()
    return raw["out"][0].float(), raw["out"][1].float()

# ---- the bf16 transformer -------------------------------------------------------------------------------------------
start = len(records)
patcher = load_unet(files["transformer"])
base, dm = patcher.model, patcher.model.diffusion_model
info["transformer"] = {
    "model_class": type(base).__name__, "diffusion_class": type(dm).__name__,
    "dtype": str(base.get_dtype_inference()),
    "keyframes_abs_pos_embedding": list(dm.keyframes_abs_pos_embedding.shape)
        if getattr(dm, "keyframes_abs_pos_embedding", None) is not None else None,
    "video_ff_bias": dm.transformer_blocks[0].ff.net[0].proj.bias is not None,
    "audio_ff_bias": dm.transformer_blocks[0].audio_ff.net[0].proj.bias is not None,
    "prompt_adaln_single": getattr(dm, "prompt_adaln_single", None) is not None,
    "log": [m for _, m in records[start:] if m.startswith(("unet missing", "unet unexpected"))],
}
out["velocity_video"], out["velocity_audio"] = forward(base, dm)
norms = [m for n, m in dm.named_modules() if n.endswith(("q_norm", "k_norm"))]
info["transformer"]["qk_norm_eps"] = sorted({float(m.eps) for m in norms})
for m in norms:
    m.eps = 1e-6
out["velocity_video_eps"], out["velocity_audio_eps"] = forward(base, dm)

# ComfyUI 0.33 normalizes the video stream for the video->audio cross-attention AFTER the audio->video residual was
# added (`rms_adaln(vx, …)` in `BasicAVTransformerBlock.forward`); Lightricks' reference (ltx-core) and diffusers use
# the norm taken before it (`vx_norm3`, computed once with `ax_norm3`). The "reference order" runs swap in that norm:
import inspect, textwrap
import comfy.ldm.lightricks.av_model as av
source = textwrap.dedent(inspect.getsource(av.BasicAVTransformerBlock.forward))
norm_line = "ax_norm3 = comfy.ldm.common_dit.rms_norm(ax)"
v2a_lines = ["vx_scaled = comfy.quant_ops.ck.rms_adaln(vx, scale_ca_video_hidden_states_v2a, "
             "shift_ca_video_hidden_states_v2a)",
             "vx_scaled = comfy.ldm.common_dit.rms_norm(vx) * (1 + scale_ca_video_hidden_states_v2a) + "
             "shift_ca_video_hidden_states_v2a"]
info["v2a_norm_after_a2v"] = norm_line in source and all(line in source for line in v2a_lines)
if info["v2a_norm_after_a2v"]:
    patched = source.replace(norm_line, norm_line + "; vx_norm3_ref = comfy.ldm.common_dit.rms_norm(vx)")
    for line in v2a_lines:
        patched = patched.replace(line, "vx_scaled = vx_norm3_ref * (1 + scale_ca_video_hidden_states_v2a) + "
                                        "shift_ca_video_hidden_states_v2a")
    namespace = dict(vars(av))
    exec(compile(patched, "<reference-order v2a>", "exec"), namespace)
    shipped_forward = av.BasicAVTransformerBlock.forward
    av.BasicAVTransformerBlock.forward = namespace["forward"]
out["velocity_video_ref"], out["velocity_audio_ref"] = forward(base, dm)
with torch.no_grad():
    saved = dm.keyframes_abs_pos_embedding.detach().clone()
    dm.keyframes_abs_pos_embedding.zero_()
    out["velocity_video_ref_nokf"], _ = forward(base, dm)
    dm.keyframes_abs_pos_embedding.copy_(saved)
if info["v2a_norm_after_a2v"]:
    av.BasicAVTransformerBlock.forward = shipped_forward

# ---- the int8-convrot twin ------------------------------------------------------------------------------------------
start = len(records)
patcher8 = load_unet(files["transformer_int8"])
dm8 = patcher8.model.diffusion_model
info["transformer_int8"] = {"log": [m for _, m in records[start:] if m.startswith(("unet missing", "unet unexpected"))],
                            "layers": {}}
for name in int8_layers:
    layer = dm8.get_submodule(name)
    w = layer.weight
    info["transformer_int8"]["layers"][name] = {
        "weight_class": type(w).__name__, "layout": str(getattr(w, "_layout_cls", None)),
        "convrot": bool(getattr(getattr(w, "_params", None), "convrot", False)),
        "convrot_groupsize": int(getattr(getattr(w, "_params", None), "convrot_groupsize", 0)),
        "quant_format": getattr(layer, "quant_format", None)}
    out["int8_dequantized." + name] = w.dequantize().float()
# its forward as ComfyUI computes it (each int8 layer W8A8 through comfy-kitchen's int8_linear), in the reference
# order with the reference's q/k eps, like the "ref" forward above
for n, m in dm8.named_modules():
    if n.endswith(("q_norm", "k_norm")):
        m.eps = 1e-6
if info["v2a_norm_after_a2v"]:
    av.BasicAVTransformerBlock.forward = namespace["forward"]
out["int8_velocity_video_ref"], out["int8_velocity_audio_ref"] = forward(patcher8.model, dm8)
if info["v2a_norm_after_a2v"]:
    av.BasicAVTransformerBlock.forward = shipped_forward
import importlib.metadata
info["comfy_kitchen"] = importlib.metadata.version("comfy-kitchen")

# ---- VAELoader: audio VAE, conv video VAE ----------------------------------------------------------------------------
for key in ("audio_vae", "video_vae"):
    sd, metadata = comfy.utils.load_torch_file(files[key], return_metadata=True)
    vae = comfy.sd.VAE(sd=sd, metadata=metadata)
    vae.throw_exception_if_invalid()
    model_keys = set(vae.first_stage_model.state_dict().keys())
    file_keys = set(comfy.utils.state_dict_prefix_replace(sd, {"audio_vae.": "autoencoder."}).keys()) \
        if key == "audio_vae" else set(sd.keys())
    info[key] = {"class": type(vae.first_stage_model).__name__, "missing": sorted(model_keys - file_keys),
                 "unexpected": sorted(file_keys - model_keys)}
    if key == "audio_vae":
        info[key]["sample_rate"] = int(vae.first_stage_model.output_sample_rate)
        out["audio_waveform"] = vae.decode(inputs["decode_audio_latent"]).movedim(-1, 1).float()
    else:
        out["video_frames"] = vae.decode(inputs["decode_latent"]).float()

# ---- LatentUpscaleModelLoader ---------------------------------------------------------------------------------------
folder_paths.add_model_folder_path("latent_upscale_models", os.path.dirname(files["upsampler"]))
from comfy_extras.nodes_hunyuan import LatentUpscaleModelLoader
upsampler = LatentUpscaleModelLoader.execute(os.path.basename(files["upsampler"])).result[0]
module = upsampler.model
info["upsampler"] = {"class": type(module).__name__}
with torch.no_grad():
    out["upscaled"] = module.float()(inputs["upscale_latent"]).float()

import comfyui_version
info["comfyui_version"] = comfyui_version.__version__
info["torch"] = torch.__version__
torch.save(out, out_path)
print("RESULT " + json.dumps(info))
'''


def make_inputs(spec: dict, cond_width: int):
    import torch

    g = torch.Generator().manual_seed(spec["input_seed"])
    f, h, w, a = spec["frames"], spec["height"], spec["width"], spec["audio_frames"]
    return {
        "video": torch.randn(1, 128, f, h, w, generator=g),
        "audio": torch.randn(1, 8, a, 16, generator=g),
        "sigma": torch.tensor([spec["sigma"]]),
        "cond": torch.randn(1, spec["prompt_tokens"], cond_width, generator=g),
        "fps": spec["fps"],
        "decode_latent": torch.randn(1, 128, 1, 2, 2, generator=g),
        "decode_audio_latent": torch.randn(1, 8, 6, 16, generator=g),
        "upscale_latent": torch.randn(1, 128, 2, 2, 3, generator=g),
    }


def fingerprint(paths: dict) -> str:
    """A digest of the files' tensors and metadata (not their bytes: safetensors writes the metadata entries in an
    arbitrary order)."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for name in sorted(paths):
        with safe_open(str(paths[name]), "pt") as f:
            digest.update(name.encode())
            digest.update(json.dumps(f.metadata(), sort_keys=True).encode())
            for key in sorted(f.keys()):
                tensor = f.get_tensor(key)
                digest.update(key.encode())
                digest.update(str(tensor.dtype).encode())
                digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                              if tensor.numel() else b"")
    return digest.hexdigest()[:16]


def main() -> int:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from mgpu_backend.testing.tiny import build_tiny_modules, write_tiny_component_files

    comfy_dir = os.environ.get("COMFYUI_DIR")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    if not comfy_dir or not (Path(comfy_dir) / "comfy" / "sd.py").is_file():
        print("set COMFYUI_DIR to a ComfyUI 0.33 checkout (and COMFYUI_PYTHON to its interpreter)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        modules = build_tiny_modules(SPEC["variant"], SPEC["tiny_seed"])
        paths = write_tiny_component_files(work, SPEC["variant"], SPEC["tiny_seed"], modules)
        cond_width = modules["video_connector"].inner_dim + modules["audio_connector"].inner_dim
        inputs = make_inputs(SPEC, cond_width)
        torch.save(inputs, work / "inputs.pt")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.run([python, "-c", DRIVER, json.dumps({k: str(v) for k, v in paths.items()}),
                               str(work / "inputs.pt"), str(work / "out.pt"), json.dumps(INT8_LAYERS)],
                              cwd=comfy_dir, env=env, capture_output=True, text=True, timeout=1200)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stderr[-6000:], file=sys.stderr)
            return 1
        info = json.loads(lines[-1][len("RESULT "):])
        out = torch.load(work / "out.pt")
        tensors = {f"comfy.{k}": v.contiguous() for k, v in out.items()}
        tensors.update({f"input.{k}": v.contiguous() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        metadata = {"spec": json.dumps(SPEC), "info": json.dumps(info), "int8_layers": json.dumps(INT8_LAYERS),
                    "files_fingerprint": fingerprint(paths),
                    "command": "COMFYUI_DIR=… COMFYUI_PYTHON=… python tests/golden/make_golden_ltx25.py"}
        save_file(tensors, str(OUT), metadata=metadata)
    print(json.dumps(info, indent=1)[:4000])
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
