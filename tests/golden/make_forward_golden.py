"""Regenerate `ltx23_forward_golden.safetensors`: single forwards of ComfyUI 0.33's own LTX-AV transformer on the tiny
LTX-2.3 single file, for the native-MODEL forward contract (issue 19, `mgpu_backend/forward.py`).

Runs in-process with ComfyUI's interpreter and a ComfyUI 0.33 checkout on the path (no server):

    COMFYUI_DIR=/tmp/comfyui /tmp/comfyvenv/bin/python tests/golden/make_forward_golden.py

(`comfyui-harness.sh install /work/.mirror/yzkee+ComfyUI/repo <pack>` makes such a checkout and venv.)

What it does:
1. writes the tiny LTX-2.3 checkpoint with the project's own writer (`mgpu_backend.models.tiny.write_tiny_checkpoint`,
   seed 0, float32 storage) into a temporary folder and loads it the way `CheckpointLoaderSimple` does
   (`comfy.sd.load_checkpoint_guess_config`, weights float32);
2. runs `LTXAVModel.preprocess_text_embeds` on a seeded random CONDITIONING tensor (`text.raw` -> `text.processed`);
3. for every case in `CASES` builds ComfyUI's forward arguments exactly as ComfyUI's sampling path would hand them
   over (guide `keyframe_idxs` from `LTXVAddGuide.add_keyframe_index`, noise masks folded into per-token timesteps by
   `model_base.LTXAV.process_timestep`, guide attention entries as `LTXVAddGuide` appends them, reference-audio tokens
   as `LTXVReferenceAudio` patchifies them, STG / modality `transformer_options` as their nodes set them) and calls
   `diffusion_model.forward` directly;
4. saves inputs (`<case>.in.*`) and outputs (`<case>.out.video` / `.out.audio`) with the cases' JSON (`cases`) and
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
# base_frames (video frames before the guides), stg (blocks), modality (a2v/v2a off), ref_audio (tokens).
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
}


def weights_fingerprint(checkpoint: str | Path) -> str:
    """sha256 over the transformer tensors (`model.diffusion_model.*`: names, dtypes, shapes, bytes)."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in sorted(k for k in f.keys() if k.startswith("model.diffusion_model.")):
            t = f.get_tensor(key).contiguous()
            h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_checkpoint(directory: Path) -> Path:
    """The tiny LTX-2.3 single file both sides load (float32 storage: ComfyUI computes in float32 on it)."""
    import torch

    from mgpu_backend.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(Path(directory) / "ltx-2.3-tiny-f32.safetensors", "2.3", seed=0,
                                 dtype=torch.float32)


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
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp))
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
    import comfyui_version

    meta = {"cases": json.dumps(cases_meta), "sigma": str(SIGMA), "fps": str(FPS), "grid": json.dumps(GRID),
            "comfyui_version": comfyui_version.__version__, "torch": torch.__version__,
            "weights_sha256": fingerprint, "generated_by": "tests/golden/make_forward_golden.py"}
    save_file(tensors, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(tensors)} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
