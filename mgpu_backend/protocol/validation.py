"""Checks that run before any work. Each error names the value, the rule and (where one is involved) the file."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .errors import ValidationError  # noqa: F401 - defined torch-free in errors (the fleet's rules raise it)


def nearest_valid_frames(frames: int) -> tuple[int, int]:
    """The valid frame counts (8k + 1) just below and above `frames`."""
    below = max(1, ((frames - 1) // 8) * 8 + 1)
    return below, below + 8


def check_frames(frames: int) -> None:
    """LTX-2's VAE compresses time 8× with a causal first frame: frames must be 8k + 1 (1, 9, …, 121)."""
    if not isinstance(frames, int) or frames < 1 or (frames - 1) % 8 != 0:
        if isinstance(frames, int) and frames >= 1:
            below, above = nearest_valid_frames(frames)
            hint = f"; nearest valid counts: {below} or {above}" if below != frames else ""
        else:
            hint = ""
        raise ValidationError(f"frames={frames}: the frame count must be 8k+1 (1, 9, 17, …, 121){hint}")


def check_size(width: int, height: int, two_stage: bool) -> None:
    """Width and height must be multiples of 64 for the two-stage pipeline (stage 1 runs at half size on the 32×
    compressed latent grid), of 32 for a single stage."""
    multiple = 64 if two_stage else 32
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or value < multiple or value % multiple != 0:
            lower = max(multiple, (int(value) // multiple) * multiple) if isinstance(value, int) else multiple
            raise ValidationError(
                f"{name}={value}: must be a positive multiple of {multiple} "
                f"({'two-stage: stage 1 runs at half size' if two_stage else 'one stage'}); try {lower} or "
                f"{lower + multiple}")


def check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValidationError(f"{name}={value}: must be a positive finite number")


def check_unit_interval(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValidationError(f"{name}={value}: must be in [0, 1]")


def check_file(what: str, path: str | Path | None, required: bool = True, folder_ok: bool = False) -> Path | None:
    """The file must exist; a folder only where `folder_ok` (Gemma, which may be a Hugging Face folder)."""
    if path is None:
        if required:
            raise ValidationError(f"{what}: no file given")
        return None
    p = Path(path)
    if not p.exists():
        raise ValidationError(f"{what}: file not found: {p}")
    if p.is_dir() and not folder_ok:
        raise ValidationError(f"{what}: {p} is a directory, not a file: give the .safetensors file in it")
    return p


def check_seed(seed: int) -> None:
    """Seeds are integers in [0, 2**64 - 1], as ComfyUI's seed inputs (`min=0, max=0xffffffffffffffff`)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= 0xFFFFFFFFFFFFFFFF:
        raise ValidationError(f"seed={seed}: must be an integer from 0 to 18446744073709551615 (2**64 - 1), as in "
                              f"ComfyUI")


def check_image(path: str | Path) -> Path:
    """The first-frame image must exist and be a readable image file."""
    p = check_file("image", path)
    try:
        from PIL import Image

        with Image.open(p) as image:
            image.verify()
    except Exception as exc:  # PIL raises several types for unreadable files
        raise ValidationError(f"image: {p} is not a readable image ({type(exc).__name__}: {exc})") from None
    return p


def check_finite(tensor: torch.Tensor | None, stage: str, modality: str) -> None:
    """Non-finite latents after a stage fail early, naming the stage and modality (docs/design/distributed-decode.md:
    non-finite audio would otherwise crash the muxer after a full render)."""
    if tensor is not None and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise FloatingPointError(f"{stage}: the {modality} latent has {bad} non-finite values (NaN/Inf); "
                                 f"check the checkpoint dtype, the inputs and the guidance scales")


def check_output(path: str | Path) -> Path:
    """The output file can be written: not a directory, and a file can be created in its folder (the nearest
    existing one: the writer creates missing folders) or the existing file opened for writing — tried, not guessed
    from permission bits (root, read-only mounts). Nothing is left behind. Checked before any work, so a long job
    never ends on an unwritable destination."""
    import tempfile

    p = Path(path)
    if p.is_dir():
        raise ValidationError(f"output: {p} is a directory; give a file name such as {p / 'clip.mp4'}")
    try:
        if p.exists():
            where = "the file is not writable"
            with open(p, "ab"):
                pass
        else:
            folder = p.parent
            while not folder.exists():
                folder = folder.parent
            if not folder.is_dir():
                raise ValidationError(f"output: cannot write {p}: {folder} is a file, not a folder")
            where = f"no file can be created in {folder}"
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as exc:
        raise ValidationError(f"output: cannot write {p}: {where} ({exc.strerror or exc})") from None
    return p
