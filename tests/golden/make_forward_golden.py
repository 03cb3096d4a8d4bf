"""Regenerate `ltx23_forward_golden.safetensors`: single forwards of ComfyUI 0.33's own LTX-AV transformer on the tiny
LTX-2.3 single file, for the native-MODEL forward contract (issue 19, `mgpu_backend/protocol/native_forward.py`).

Runs in-process with ComfyUI's interpreter and a ComfyUI 0.33 checkout on the path (no server):

    COMFYUI_DIR=/tmp/comfyui /tmp/comfyvenv/bin/python tests/golden/make_forward_golden.py

(docs/testing.md#a-live-comfyui says how to make such a checkout and venv.)

What it does:
1. writes the tiny LTX-2.3 checkpoint with the project's own writer (`mgpu_backend.testing.tiny.write_tiny_checkpoint`,
   seed 0: the tests' `tiny_dir` file) into a temporary folder and loads it the way `CheckpointLoaderSimple` does
   (`comfy.sd.load_checkpoint_guess_config`, `model_options={"dtype": torch.float32}`: float32 compute);
2. runs `LTXAVModel.preprocess_text_embeds` on a seeded random CONDITIONING tensor (`text.raw` -> `text.processed`);
3. for every case in `CASES` builds ComfyUI's forward arguments exactly as ComfyUI's sampling path would hand them
   over (guide `keyframe_idxs` from `LTXVAddGuide.add_keyframe_index`, noise masks folded into per-token timesteps by
   `model_base.LTXAV.process_timestep`, guide attention entries as `LTXVAddGuide` appends them, reference-audio tokens
   as `LTXVReferenceAudio` patchifies them, STG / modality `transformer_options` as their nodes set them) and calls
   `diffusion_model.forward` directly;
4. applies the tiny LTX-2.3 LoRA plus seeded pairs for the text connectors' Linears (`lora.connector.*`) the way
   `LoraLoaderModelOnly` does (`comfy.sd.load_lora_for_models`, patches fused by `load_models_gpu`), runs
   `LORA["base"]`'s inputs again (`lora_<base>.out.*`) and the connectors on row 1 of `text.raw`
   (`lora.text.processed`);
5. runs `LTX20_CASES` on the tiny LTX-2.0 file too (`ltx20/…`: the caption projection inside the forward);
6. saves inputs (`<case>.in.*`) and outputs (`<case>.out.video` / `.out.audio`) with the cases' JSON (`cases`) and
   the provenance (ComfyUI version, torch, a fingerprint of the transformer weights) as metadata.

The test (`tests/test_native_forward.py`) rebuilds the same tiny file with the same writer, checks the fingerprint,
turns each case into a `ForwardRequest` and compares the fleet's forward with these outputs.
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
OUT = HERE / "ltx23_forward_golden.safetensors"

SIGMA = 0.7
FPS = 25.0
TEXT = {"seed": 7, "rows": 2, "tokens": 23}
# latent grids: (frames, height, width); every case's video token count is odd (not divisible by 2 or 4)
GRID = (3, 3, 3)
AUDIO_T = 5
# name -> what the case exercises. Fields: batch (rows; contexts are text.processed rows in `rows` order),
# i2v_strength (noise mask on latent frame 0), guides (list of {frame_idx, strength, pixel_mask, drop}),
# base_frames (video frames before the guides), stg (blocks), modality (a2v/v2a off), ref_audio (tokens),
# text_mask (row 0's last n context tokens masked), run_vx / run_ax (a stream's block updates skipped).
CASES: dict[str, dict] = {
    "t2v_b1": {"batch": 1, "rows": [1]},
    "t2v_b2": {"batch": 2, "rows": [0, 1], "cond_or_uncond": [1, 0]},
    "i2v_b2": {"batch": 2, "rows": [0, 1], "cond_or_uncond": [1, 0], "i2v_strength": 0.7},
    "stg_b1": {"batch": 1, "rows": [1], "stg": [1]},
    "modality_b1": {"batch": 1, "rows": [1], "modality": True},
    "guide_s1_b1": {"batch": 1, "rows": [1], "base_frames": 2,
                    "guides": [{"frame_idx": 8, "strength": 1.0}]},
    "guides_s07_b2": {"batch": 2, "rows": [0, 1], "cond_or_uncond": [1, 0], "base_frames": 3,
                      "guides": [{"frame_idx": 0, "strength": 0.7}, {"frame_idx": 16, "strength": 0.7}]},
    "guide_pixel_mask_b1": {"batch": 1, "rows": [1], "base_frames": 2,
                            "guides": [{"frame_idx": 8, "strength": 1.0, "pixel_mask": True}]},
    "iclora_drop_b1": {"batch": 1, "rows": [1], "base_frames": 2,
                       "guides": [{"frame_idx": 0, "strength": 1.0, "drop": [1, 3, 5, 7], "downscale": 2}]},
    "ref_audio_b2": {"batch": 2, "rows": [0, 1], "cond_or_uncond": [1, 0], "ref_audio": 4},
    "text_mask_b2": {"batch": 2, "rows": [0, 1], "text_mask": 40},
    "run_vx_off_b1": {"batch": 1, "rows": [1], "run_vx": False},
    "run_ax_off_b1": {"batch": 1, "rows": [1], "run_ax": False},
}

# (pixel frames, latent frames) of the pixel-mask downsampling checks ("mask.<F_pix>x<F>.in/out", 16×24 px -> 2×3)
MASK_FRAMES = ((9, 2), (17, 3), (12, 3), (2, 4), (1, 3), (5, 1))
# cases also run on the tiny LTX-2.0 file (tensors prefixed "ltx20/"; metadata "ltx20": cases, fingerprint)
LTX20_CASES = ("t2v_b1", "guide_pixel_mask_b1", "stg_b1")  # B = 1, on the one text row "ltx20/text.raw"
# (pixel frames, latent frames) of the pixel-mask downsampling checks ("mask.<F_pix>x<F>.in/out", 16×24 px -> 2×3)
MASK_FRAMES = ((9, 2), (17, 3), (12, 3), (2, 4), (1, 3), (5, 1))
# cases also run on the tiny LTX-2.0 file (tensors prefixed "ltx20/"; metadata "ltx20": cases, fingerprint)
LTX20_CASES = ("t2v_b1", "guide_pixel_mask_b1", "stg_b1")  # B = 1, on the one text row "ltx20/text.raw"
# the tiny LTX-2.3 LoRA (`write_tiny_lora(…, "2.3", seed=0)`: every block Linear, rank 4) through ComfyUI's LoRA
# loader at this strength, on the inputs of the case `base`
LORA = {"base": "t2v_b1", "strength": 1.5}


def weights_fingerprint(checkpoint: str | Path, prefix: str = "model.diffusion_model.") -> str:
    """sha256 over the tensors whose names start with `prefix` (names, dtypes, shapes, bytes; in name order — the
    file's own bytes are not stable: safetensors' header order varies between writes)."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in sorted(k for k in f.keys() if k.startswith(prefix)):
            t = f.get_tensor(key).contiguous()
            h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_checkpoint(directory: Path) -> Path:
    """The tiny LTX-2.3 single file both sides load: the file `make_tiny(dir, "2.3", seed=0)` writes (bf16 storage,
    as the tests' session fixture `tiny_dir`); both sides compute in float32 on its exact values."""
    from mgpu_backend.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(Path(directory) / "ltx-2.3-tiny.safetensors", "2.3", seed=0)


def build_inputs(name: str, spec: dict, processed, gen):
    """-> (ComfyUI forward kwargs, tensors to store, JSON-able extras) for one case."""
    import torch
    from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier, AudioPatchifier
    from comfy_extras.nodes_lt import LTXVAddGuide

    b = spec["batch"]
    f, h, w = GRID
    guides = spec.get("guides", [])
    base_frames = spec.get("base_frames", f)
    frames = base_frames + len(guides)
    video = torch.randn(b, 128, frames, h, w, generator=gen)
    audio = torch.randn(b, 8, AUDIO_T, 16, generator=gen)
    sigma = torch.full((b,), SIGMA)
    context = processed[spec["rows"]].clone()
    store = {"video": video, "audio": audio}  # the context is text.processed[rows] (stored once)
    extras: dict = {}
    kwargs: dict = {"frame_rate": FPS, "transformer_options": {}}

    mask = None
    if "i2v_strength" in spec or guides:
        mask = torch.ones(b, 1, base_frames, 1, 1)
        if "i2v_strength" in spec:
            mask[:, :, 0] = 1.0 - spec["i2v_strength"]
    if guides:
        cond = [[torch.zeros(1), {}]]
        entries = []
        mask = mask.expand(b, 1, base_frames, h, w).clone()
        for i, g in enumerate(guides):
            guide_latent = torch.randn(1, 128, 1, h, w, generator=gen)
            video[:, :, base_frames + i] = guide_latent[:, :, 0]
            cond = LTXVAddGuide.add_keyframe_index(cond, g["frame_idx"], guide_latent, (8, 32, 32),
                                                   g.get("downscale", 1), causal_fix=True)
            gmask = torch.full((b, 1, 1, h, w), max(0.0, 1.0 - g["strength"]))
            for cell in g.get("drop", []):
                gmask[:, :, 0, cell // w, cell % w] = -1.0  # IC-LoRA sparse-grid padding cells
            mask = torch.cat([mask, gmask], dim=2)
            pixel_mask = None
            if g.get("pixel_mask"):
                pixel_mask = torch.rand(1, 1, 1, h * 32, w * 32, generator=gen)
                store[f"pixel_mask{i}"] = pixel_mask
            entries.append({"pre_filter_count": h * w, "strength": g["strength"], "pixel_mask": pixel_mask,
                            "latent_shape": [1, h, w]})
            extras.setdefault("guide_entries", []).append(
                {"pre_filter_count": h * w, "strength": g["strength"], "latent_shape": [1, h, w],
                 "pixel_mask": f"pixel_mask{i}" if pixel_mask is not None else None})
        keyframe_idxs = cond[0][1]["keyframe_idxs"].expand(b, -1, -1, -1).contiguous()
        kwargs["keyframe_idxs"] = keyframe_idxs
        kwargs["guide_attention_entries"] = entries
        store["keyframe_idxs"] = keyframe_idxs
    if mask is not None:
        # model_base.LTXAV.process_timestep: per-token sigma = patchify(mask · sigma)[:, :1]
        full = mask.expand(b, 1, frames, h, w) if mask.shape[3] == 1 else mask
        v_ts = SymmetricPatchifier(1, start_end=True).patchify(full * sigma.view(b, 1, 1, 1, 1))[0]
        a_ts = AudioPatchifier(1, start_end=True).patchify(
            (torch.ones(b, 8, AUDIO_T, 16) * sigma.view(b, 1, 1, 1))[:, :1, :, :1])[0]
        kwargs["denoise_mask"] = full.contiguous()
        store["denoise_mask"] = full.contiguous()
        timestep = (v_ts, a_ts)
    else:
        timestep = (sigma, sigma)
    store["video_timestep"], store["audio_timestep"] = timestep
    if "stg" in spec:
        kwargs["transformer_options"]["stg_self_attn_blocks"] = frozenset(spec["stg"])
    if spec.get("modality"):
        kwargs["transformer_options"].update({"a2v_cross_attn": False, "v2a_cross_attn": False})
    if "ref_audio" in spec:
        # LTXVReferenceAudio: encoded latent [1, 8, T_ref, 16] -> tokens [1, T_ref, 128] (channel-major)
        ref_latent = torch.randn(1, 8, spec["ref_audio"], 16, generator=gen)
        tokens = ref_latent.permute(0, 2, 1, 3).reshape(1, spec["ref_audio"], 128)
        kwargs["ref_audio"] = {"tokens": tokens}
        store["ref_audio_tokens"] = tokens
    if "text_mask" in spec:
        # an integer text mask (1 = attend): row 0 masks its last `text_mask` context tokens
        mask = torch.ones(b, context.shape[1], dtype=torch.int64)
        mask[0, -spec["text_mask"]:] = 0
        kwargs["attention_mask"] = mask
        store["attention_mask"] = mask
    for key in ("run_vx", "run_ax"):
        if key in spec:
            kwargs["transformer_options"][key] = spec[key]
    if "cond_or_uncond" in spec:
        kwargs["transformer_options"]["cond_or_uncond"] = list(spec["cond_or_uncond"])
    return [video, audio], timestep, context, kwargs, store, extras


def main() -> int:
    comfy_dir = Path(os.environ.get("COMFYUI_DIR", "/tmp/comfyui"))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(comfy_dir))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch
    import comfy.sd
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    tensors: dict[str, torch.Tensor] = {}
    tmp = tempfile.TemporaryDirectory()
    ckpt = write_checkpoint(Path(tmp.name))
    fingerprint = weights_fingerprint(ckpt)
    model, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(ckpt), output_vae=False, output_clip=False, model_options={"dtype": torch.float32})
    dm = model.model.diffusion_model
    dtypes = {p.dtype for p in dm.parameters()}
    assert dtypes == {torch.float32}, f"ComfyUI built the transformer in {dtypes}, expected float32"
    gen = torch.Generator().manual_seed(TEXT["seed"])
    raw = torch.randn(TEXT["rows"], TEXT["tokens"], dm.cross_attention_dim + dm.audio_cross_attention_dim,
                      generator=gen)
    with torch.no_grad():
        processed = dm.preprocess_text_embeds(raw, unprocessed=True).float()
    tensors["text.raw"], tensors["text.processed"] = raw, processed.contiguous()
    print(f"text: {tuple(raw.shape)} -> {tuple(processed.shape)}")
    cases_meta = {}
    for i, (name, spec) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(100 + i)
        x, timestep, context, kwargs, store, extras = build_inputs(name, spec, processed, gen)
        with torch.no_grad():
            out = dm(x, timestep, context, **kwargs)
        for k, v in store.items():
            tensors[f"{name}.in.{k}"] = v.clone().contiguous()
        tensors[f"{name}.out.video"] = out[0].float().contiguous()
        tensors[f"{name}.out.audio"] = out[1].float().contiguous()
        cases_meta[name] = {**spec, **extras}
        print(f"{name}: video {tuple(out[0].shape)} audio {tuple(out[1].shape)} "
              f"max|v| {out[0].abs().max():.3f}")
    # the pixel-mask downsampling rule alone (`LTXVModel._downsample_mask_to_latent`), every branch
    from comfy.ldm.lightricks.model import LTXVModel

    gen = torch.Generator().manual_seed(300)
    for f_pix, f_lat in MASK_FRAMES:
        mask = torch.rand(1, 1, f_pix, 16, 24, generator=gen)
        tensors[f"mask.{f_pix}x{f_lat}.in"] = mask
        tensors[f"mask.{f_pix}x{f_lat}.out"] = LTXVModel._downsample_mask_to_latent(mask, f_lat, 2, 3).contiguous()
    # LoRA: ComfyUI's LoraLoaderModelOnly path (load_lora_for_models -> ModelPatcher patches, fused on load) with
    # the tiny LTX-2.3 LoRA file, on the inputs of LORA["base"]
    import comfy.model_management
    import comfy.utils
    from mgpu_backend.testing.tiny import write_tiny_lora

    lora_path = write_tiny_lora(Path(tmp.name) / "ltx-2.3-tiny-distilled-lora.safetensors", "2.3", seed=0)
    lora_sd = comfy.utils.load_torch_file(str(lora_path))
    # plus pairs for every Linear of the text connectors (stored: "lora.connector.<module>.A / .B", alpha = rank)
    gen = torch.Generator().manual_seed(400)
    for module, layer in dm.named_modules():
        if module.startswith(("video_embeddings_connector.", "audio_embeddings_connector.")) and \
                isinstance(layer, torch.nn.Linear):
            a = torch.randn(4, layer.in_features, generator=gen) * 0.05
            b = torch.randn(layer.out_features, 4, generator=gen) * 0.05
            lora_sd[f"diffusion_model.{module}.lora_A.weight"] = a
            lora_sd[f"diffusion_model.{module}.lora_B.weight"] = b
            tensors[f"lora.connector.{module}.A"], tensors[f"lora.connector.{module}.B"] = a, b
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora_sd, LORA["strength"], 0)
    comfy.model_management.load_models_gpu([patched])
    with torch.no_grad():
        tensors["lora.text.processed"] = patched.model.diffusion_model.preprocess_text_embeds(
            raw[1:], unprocessed=True).float().contiguous()  # row 1 of text.raw
    base = LORA["base"]
    name = f"lora_{base}"
    g = {k[len(base) + 4:]: v for k, v in tensors.items() if k.startswith(f"{base}.in.")}
    with torch.no_grad():
        out = patched.model.diffusion_model([g["video"], g["audio"]], (g["video_timestep"], g["audio_timestep"]),
                                            processed[CASES[base]["rows"]], frame_rate=FPS, transformer_options={})
    tensors[f"{name}.out.video"] = out[0].float().contiguous()
    tensors[f"{name}.out.audio"] = out[1].float().contiguous()
    print(f"{name}: max |Δ| from {base} {(out[0] - tensors[f'{base}.out.video']).abs().max():.3f}")
    lora_meta = {**LORA, "sha256": weights_fingerprint(lora_path, prefix="")}
    # LTX-2.0 (caption projection inside the forward, no prompt AdaLN, no attention gates): a few cases
    from mgpu_backend.testing.tiny import write_tiny_checkpoint

    ckpt20 = write_tiny_checkpoint(Path(tmp.name) / "ltx-2.0-tiny.safetensors", "2.0", seed=0)
    model20, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(ckpt20), output_vae=False, output_clip=False, model_options={"dtype": torch.float32})
    dm20 = model20.model.diffusion_model
    gen = torch.Generator().manual_seed(TEXT["seed"])
    raw20 = torch.randn(1, TEXT["tokens"], dm20.caption_channels, generator=gen)  # one row: B = 1 cases
    with torch.no_grad():
        processed20 = dm20.preprocess_text_embeds(raw20, unprocessed=True).float()
    tensors["ltx20/text.raw"], tensors["ltx20/text.processed"] = raw20, processed20.contiguous()
    ltx20_meta = {"weights_sha256": weights_fingerprint(ckpt20), "cases": {}}
    for i, name in enumerate(LTX20_CASES):
        gen = torch.Generator().manual_seed(200 + i)
        spec = {**CASES[name], "rows": [0]}
        x, timestep, context, kwargs, store, extras = build_inputs(name, spec, processed20, gen)
        with torch.no_grad():
            out = dm20(x, timestep, context, **kwargs)
        for k, v in store.items():
            tensors[f"ltx20/{name}.in.{k}"] = v.clone().contiguous()
        tensors[f"ltx20/{name}.out.video"] = out[0].float().contiguous()
        tensors[f"ltx20/{name}.out.audio"] = out[1].float().contiguous()
        ltx20_meta["cases"][name] = {**spec, **extras}
        print(f"LTX-2.0 {name}: video {tuple(out[0].shape)} max|v| {out[0].abs().max():.3f}")
    tmp.cleanup()
    import comfyui_version

    meta = {"cases": json.dumps(cases_meta), "lora": json.dumps(lora_meta), "ltx20": json.dumps(ltx20_meta),
            "sigma": str(SIGMA), "fps": str(FPS), "grid": json.dumps(GRID),
            "comfyui_version": comfyui_version.__version__, "torch": torch.__version__,
            "weights_sha256": fingerprint, "generated_by": "tests/golden/make_forward_golden.py"}
    save_file(tensors, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(tensors)} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
