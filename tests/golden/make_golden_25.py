"""Regenerate `ltx25_diffusion_vae_golden.safetensors`: ComfyUI 0.33's own LTX-2.5 ("LTX 2.4") diffusion video VAE
decoding latents with the tiny file of `mgpu_backend/testing/tiny_vae25.py`.

Runs in process with ComfyUI's Python (torch 2.14, comfy-kitchen) and a ComfyUI 0.33 checkout on the path — no
server needed:

    COMFYUI_DIR=/tmp/comfyui /tmp/comfyvenv/bin/python tests/golden/make_golden_25.py

What it does:
1. writes the tiny diffusion VAE (`write_tiny_diffusion_vae(path, seed=0)`, bf16, the file `make-tiny --variant 2.5`
   writes) and loads it as `VAELoader` does: `comfy.utils.load_torch_file(path, return_metadata=True)` →
   `comfy.sd.VAE(sd=sd, metadata=metadata)`; asserts ComfyUI picked `CausalDiffusionVAE`, that no key is missing
   and that the only leftover key is the unused statistic `per_channel_statistics.mean-of-stds`;
2. per case draws a model-space latent (float32, its own seed, stored in the file) and decodes it twice:
   `vae.first_stage_model.decode(latent)` (raw pixels `[1, 3, T, H, W]`, ComfyUI's fixed noise seed 0) and
   `vae.decode(latent)` (the VAEDecode output `[1, T, H, W, 3]`, 0..1);
3. stores latents, raw pixels (`case/raw`, every fourth row and column: `[..., ::4, ::4]`, to keep the file small)
   and the VAEDecode output of the smallest case, with the spec and provenance (ComfyUI / torch / comfy-kitchen
   versions, the VAE dtype ComfyUI chose, a sha256 of the tiny file's tensors) as metadata.

4. encodes a seeded pixel video `[1, 3, 9, 64, 64]` in -1..1 (stored bf16, decoded from it exactly) with
   `vae.first_stage_model.encode` (the conv encoder, then ComfyUI's latent normalization): `encode/latent`.

Cases: `base` (latent 2×3×3: every stage's window shifts at the borders, no clamping), `wide` (3×3×4: a third latent
frame, a non-square grid), `small` (1×2×2: a single frame and a 2×2 latent, smaller than the 3×3×3 stage-1 kernel
and the 5-frame stage-5 kernel, which ComfyUI clamps to the axis).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = HERE / "ltx25_diffusion_vae_golden.safetensors"

SPEC = {"tiny_seed": 0, "tiny_dtype": "bfloat16", "noise_seed": 0,
        "cases": {"base": {"latent": [2, 3, 3], "seed": 11}, "wide": {"latent": [3, 3, 4], "seed": 12},
                  "small": {"latent": [1, 2, 2], "seed": 13}},
        "stride": 4, "vae_decode_cases": ["small"], "encode": {"pixels": [9, 64, 64], "seed": 21}}


def fingerprint(path: Path) -> str:
    """sha256 over the file's tensors (names, dtypes, shapes, bytes)."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    comfy_dir = os.environ.get("COMFYUI_DIR")
    if not comfy_dir:
        sys.exit("set COMFYUI_DIR to a ComfyUI 0.33 checkout")
    sys.path[:0] = [str(ROOT), comfy_dir]
    import torch
    from importlib.metadata import version
    from safetensors.torch import save_file

    import comfy.cli_args
    comfy.cli_args.args.cpu = True  # as `main.py --cpu`: this script runs on a machine without a GPU
    import comfy.ldm.lightricks.vae.na_diffusion_decoder as nad
    import comfy.sd
    import comfy.utils
    import comfyui_version
    from mgpu_backend.testing.tiny_vae25 import write_tiny_diffusion_vae

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_diffusion_vae(Path(tmp) / "ltx-2.5-tiny-diffusion-vae.safetensors", SPEC["tiny_seed"])
        digest = fingerprint(path)
        sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
        vae = comfy.sd.VAE(sd=sd, metadata=metadata)
    model = vae.first_stage_model
    assert isinstance(model, nad.CausalDiffusionVAE), type(model)
    own = set(model.state_dict().keys())
    missing, leftover = sorted(own - sd.keys()), sorted(sd.keys() - own)
    assert not missing, f"ComfyUI misses keys: {missing}"
    assert leftover == ["per_channel_statistics.mean-of-stds"], f"ComfyUI leftover keys: {leftover}"
    assert vae.vae_dtype == torch.float32, vae.vae_dtype  # CPU: ComfyUI decodes in float32

    tensors = {}
    for name, case in SPEC["cases"].items():
        g = torch.Generator().manual_seed(case["seed"])
        latent = torch.randn(1, 128, *case["latent"], generator=g)
        with torch.inference_mode():  # as ComfyUI executes nodes (comfy-kitchen's in-place RoPE requires it)
            raw = model.decode(latent.clone())
        tensors[f"{name}/latent"] = latent
        tensors[f"{name}/raw"] = raw[..., ::SPEC["stride"], ::SPEC["stride"]].float().clone().contiguous()
        if name in SPEC["vae_decode_cases"]:
            with torch.inference_mode():
                tensors[f"{name}/vae_decode"] = vae.decode(latent.clone()).float().clone().contiguous()
        print(name, tuple(raw.shape), float(raw.abs().max()))
    enc = SPEC["encode"]
    g = torch.Generator().manual_seed(enc["seed"])
    pixels = torch.tanh(torch.randn(1, 3, *enc["pixels"], generator=g)).bfloat16()  # stored bf16: exact input
    with torch.inference_mode():
        tensors["encode/latent"] = model.encode(pixels.float()).float().clone().contiguous()
    tensors["encode/pixels"] = pixels
    provenance = {"comfyui": comfyui_version.__version__, "torch": torch.__version__,
                  "comfy_kitchen": version("comfy-kitchen"), "vae_dtype": str(vae.vae_dtype),
                  "tiny_sha256": digest}
    save_file(tensors, str(OUT), metadata={"spec": json.dumps(SPEC), "provenance": json.dumps(provenance)})
    print("wrote", OUT, provenance)


if __name__ == "__main__":
    main()
