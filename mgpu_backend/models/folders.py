"""Per-component model files from a folder: which safetensors file fills which file slot of the family table.

A folder is either flat (what `make-tiny` writes, or a user's download directory) or a ComfyUI `models/` root with
its subfolders (`checkpoints/`, `diffusion_models/`, `vae/`, `text_encoders/`, `latent_upscale_models/`). Files are
recognized by their tensor names (the safetensors header only; nothing is loaded), the way ComfyUI's loaders detect
them (`comfy/sd.py`, `comfy/model_detection.py`, `comfy_extras/nodes_hunyuan.py`).
"""
from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from . import keymaps

#: ComfyUI subfolders searched below a `models/` root (a flat folder is searched itself).
COMFY_FOLDERS = ("checkpoints", "diffusion_models", "unet", "vae", "text_encoders", "clip", "latent_upscale_models")

#: kinds `classify_file` returns, beside the family file slots: a single-file checkpoint fills every slot it holds.
CHECKPOINT = "checkpoint"
DIFFUSION_VAE = "video_vae_diffusion"  # LTX-2.5's neighborhood-attention decoder VAE (decoded by its own module)


def classify_file(path: str | Path) -> str | None:
    """The kind of an LTX-2 model file: "checkpoint" (single file), "transformer", "video_vae",
    `DIFFUSION_VAE`, "audio_vae", "text_encoder", "upsampler", or None (not an LTX-2 component, e.g. a LoRA).

    Raises FileNotFoundError / ValueError naming the path when it is not a readable safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
    except Exception as exc:  # safetensors' own error types
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    marker = "adaln_single.emb.timestep_embedder.linear_1.bias"
    if keymaps.TRANSFORMER_PREFIX + marker in keys:
        return CHECKPOINT if any(k.startswith(keymaps.VIDEO_VAE_PREFIX) for k in keys) else "transformer"
    if marker in keys:
        return "transformer"
    if "decoder.conv_in_x_t.weight" in keys:
        return DIFFUSION_VAE
    stats = "per_channel_statistics.mean-of-means"
    if stats in keys or keymaps.VIDEO_VAE_PREFIX + stats in keys:
        return "video_vae"
    if keymaps.AUDIO_VAE_PREFIX + stats in keys:
        return "audio_vae"
    if "initial_conv.weight" in keys:
        return "upsampler"
    if "spiece_model" in keys or any(k.endswith("embed_tokens.weight") for k in keys):
        return "text_encoder"
    return None


def find_component_files(folder: str | Path, given: tuple[str, ...] = ()) -> dict[str, Path]:
    """`{kind: file}` for the LTX-2 files in `folder` (flat, or a ComfyUI `models/` root).

    `given`: kinds the caller names explicitly ("transformer" covers single-file checkpoints too): several files of
    such a kind are fine, and it need not be found.
    Raises FileNotFoundError when the folder does not exist, ValueError naming the files when two files are of one
    kind (e.g. a bf16 transformer and its int8 twin: name the one to use explicitly) or when none is a transformer
    or single-file checkpoint.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    roots = [folder / sub for sub in COMFY_FOLDERS if (folder / sub).is_dir()] or [folder]
    found: dict[str, list[Path]] = {}
    for root in roots:
        for path in sorted(root.glob("*.safetensors")):
            kind = classify_file(path)
            if kind is not None:
                found.setdefault(kind, []).append(path)
    skip = set(given) | ({CHECKPOINT} if "transformer" in given else set())
    ambiguous = {k: v for k, v in found.items() if len(v) > 1 and k not in skip}
    if ambiguous:
        parts = "; ".join(f"{kind}: {', '.join(p.name for p in paths)}" for kind, paths in sorted(ambiguous.items()))
        raise ValueError(f"{folder}: more than one file of a kind ({parts}); name the one to use with its own "
                         f"option (e.g. --checkpoint)")
    files = {kind: paths[0] for kind, paths in found.items() if kind not in skip}
    if CHECKPOINT not in files and "transformer" not in files and "transformer" not in skip:
        raise ValueError(f"{folder}: no LTX-2 transformer or single-file checkpoint among "
                         f"{sorted(p.name for p in folder.rglob('*.safetensors'))[:12]}")
    return files
