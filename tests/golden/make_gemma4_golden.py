"""Regenerate `gemma4_golden.safetensors`: ComfyUI 0.33's own LTX-2.5 text encoding of the tiny Gemma 4 files.

Run with ComfyUI's Python, ComfyUI's checkout on the path, from the repository root (nothing of ComfyUI is committed):

    COMFY_DIR=/tmp/comfyui /tmp/comfyvenv/bin/python tests/golden/make_gemma4_golden.py

What it does:
1. writes the tiny Gemma 4 + LTX-2.5 projection files (`mgpu_backend.testing.tiny_gemma4.write_tiny_gemma4`, seed 0,
   bf16 and int8-convrot) into a temporary `models/text_encoders/` folder registered with ComfyUI's `folder_paths`;
2. loads each with ComfyUI's `CLIPLoader` node, `type="ltxv"` (`comfy.sd.load_clip` -> `detect_te_model` finds
   GEMMA_4_12B -> `lt.ltxav_te(... gemma4 ...)` with the `dual_linear` projection, `ltxav_gemma4_tokenizer`). The one
   change: ComfyUI builds the 12B from the hard-coded `Gemma4_12B_Config`, so `load_clip` is given
   `model_options={"_model_config": tiny_comfy_config()}` (ComfyUI's own per-model config override, read by
   `sd1_clip.SDClipModel`) to build the tiny widths; head dims, the 5:1 sliding pattern, RoPE and norms are the 12B's;
3. for each prompt: the token ids (`clip.tokenize`), ComfyUI's stacked Gemma hidden states for the bf16 file
   (`LTXAVTEModel.gemma3_12b.encode_token_weights`, padding cut off, `[1, 49, T, H]` -> stored as `[1, T, H, 49]`)
   for the second prompt, and the CONDITIONING tensor of `CLIPTextEncode` for both files (`[1, T, 96]`), with the
   CONDITIONING's extra dict keys;
4. writes them with the provenance (ComfyUI / torch versions, a sha256 of each tiny file) as metadata.

ComfyUI runs Gemma in float32 on the CPU (bf16 weights cast up; `SDClipModel.forward(dtype=torch.float32)`), left-pads
every prompt to 1024 tokens and cuts the padding off before the projection.
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
OUT = HERE / "gemma4_golden.safetensors"

PROMPTS = [
    "A cinematic shot of a red car driving along a coastal road at sunset.",
    'The hero turns around, smiles, and says: "We did it!" \\(really\\)',
    "<|turn>user\nA cat sleeps on a warm windowsill.<turn|>\n<|turn>model\n",
    "Numbers like 12, 345 and 2026 appear; ünïcode 日本 fades away.",
    "",
]
HIDDEN_FOR = (1,)   # prompts whose hidden states are stored too (~220 KB each)
FILES = {"bf16": "gemma4-12b-with-proj-ltx-2.5-tiny-bf16.safetensors",
         "int8": "gemma4-12b-with-proj-ltx-2.5-tiny-comfy-int8-convrot.safetensors"}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main() -> None:
    comfy_dir = Path(os.environ.get("COMFY_DIR", "/tmp/comfyui")).resolve()
    sys.path[:0] = [str(comfy_dir), str(ROOT)]
    import torch
    from safetensors.torch import save_file

    from comfy.cli_args import args

    args.cpu = True  # as ComfyUI's own unit tests do on a machine without a GPU
    import comfy.sd
    import folder_paths
    import nodes

    from mgpu_backend.testing.tiny_gemma4 import tiny_comfy_config, write_tiny_gemma4

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="gemma4-golden-"))
    te_dir = tmp / "text_encoders"
    paths = {"bf16": write_tiny_gemma4(te_dir / FILES["bf16"], seed=0),
             "int8": write_tiny_gemma4(te_dir / FILES["int8"], seed=0, int8_convrot=True)}
    folder_paths.add_model_folder_path("text_encoders", str(te_dir), is_default=True)

    real_load_clip = comfy.sd.load_clip

    def load_clip_tiny(ckpt_paths, embedding_directory=None, clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
                       model_options={}, disable_dynamic=False):  # noqa: B006 (ComfyUI's signature)
        model_options = dict(model_options, _model_config=tiny_comfy_config())
        return real_load_clip(ckpt_paths, embedding_directory, clip_type, model_options, disable_dynamic)

    comfy.sd.load_clip = load_clip_tiny
    out: dict[str, torch.Tensor] = {}
    extras = {}
    for kind, path in paths.items():
        (clip,) = nodes.CLIPLoader().load_clip(path.name, type="ltxv")
        te = clip.cond_stage_model
        assert type(te).__name__.startswith("LTXAVTEModel"), type(te)
        assert te.text_projection_type == "dual_linear", te.text_projection_type
        for i, prompt in enumerate(PROMPTS):
            tokens = clip.tokenize(prompt)
            ids = [t for t, _w in tokens["gemma4"][0]]
            if kind == "bf16":
                out[f"p{i}.ids"] = torch.tensor(_strip_left_pad(ids), dtype=torch.long)
                if i in HIDDEN_FOR:
                    hs, _pooled, extra = te.gemma3_12b.encode_token_weights(tokens["gemma4"])
                    n = int(extra["attention_mask"].sum())
                    out[f"p{i}.hidden"] = hs[:, :, -n:].movedim(1, -1).float().contiguous()
            (cond,) = nodes.CLIPTextEncode().encode(clip, prompt)
            out[f"p{i}.cond_{kind}"] = cond[0][0].float().contiguous()
            extras[f"p{i}.{kind}"] = sorted(cond[0][1])
    import comfyui_version

    meta = {"prompts": json.dumps(PROMPTS), "hidden_for": json.dumps(list(HIDDEN_FOR)),
            "files": json.dumps({k: {"name": FILES[k], "sha256": file_sha256(p)} for k, p in paths.items()}),
            "extra_keys": json.dumps(extras), "tiny_comfy_config": json.dumps(tiny_comfy_config()),
            "comfyui_version": comfyui_version.__version__, "torch_version": torch.__version__}
    save_file(out, str(OUT), metadata=meta)
    print(f"wrote {OUT}: {len(out)} tensors; ComfyUI {comfyui_version.__version__}, torch {torch.__version__}")
    for k, v in sorted(out.items()):
        print(f"  {k}: {tuple(v.shape)} {v.dtype}")


def _strip_left_pad(ids: list[int]) -> list[int]:
    """The ids after ComfyUI's left padding (<pad>=0 before the leading <bos>=2)."""
    start = ids.index(2)
    return ids[start:]


if __name__ == "__main__":
    main()
