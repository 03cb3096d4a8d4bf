"""Writes the shipped workflows made from ComfyUI's own LTX templates with the minimal swap (the model loader's
MODEL output -> Load Diffusion Model (MGPU)); nothing else of the template changes.

    LTX2_TEMPLATES_DIR=.../comfyui_workflow_templates_json/templates python tests/templates/make_workflows.py

Reads the templates of the `comfyui-workflow-templates-json` version that ComfyUI 0.33.0 pins (0.1.50, installed
with ComfyUI's requirements); writes `workflows/comfyui-<name>-mgpu.json` (UI, with a generated preview .jpg) and
`workflows/api/comfyui-<name>-mgpu.json` (the API twin, as ComfyUI's frontend would queue it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__:
    from . import convert as C
else:  # run as a script
    sys.path.insert(0, str(HERE))
    import convert as C  # noqa: E402

ROOT = HERE.parent.parent
SHIPPED = {  # template stem -> shipped name
    "video_ltx2_3_t2v": "comfyui-ltx2.3-t2v-mgpu",
    "video_ltx2_3_i2v": "comfyui-ltx2.3-i2v-mgpu",
    "video_ltx2_3_flf2v": "comfyui-ltx2.3-flf2v-mgpu",
    "video_ltx2_5_t2v": "comfyui-ltx2.5-t2v-mgpu",
    "video_ltx2_5_i2v": "comfyui-ltx2.5-i2v-mgpu",
    "video_ltx2_5_flf2v": "comfyui-ltx2.5-flf2v-mgpu",
}


def preview(path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (512, 288), (24, 28, 36))
    d = ImageDraw.Draw(img)
    d.rectangle([16, 16, 495, 271], outline=(90, 160, 255), width=3)
    d.text((36, 40), "ComfyUI template + ltx2-multigpu", fill=(200, 210, 230))
    d.text((36, 90), title, fill=(255, 255, 255))
    d.text((36, 200), "model loader -> Load Diffusion Model (MGPU)", fill=(150, 200, 150))
    d.text((36, 225), "everything else: the template's own nodes", fill=(150, 200, 150))
    img.save(path, quality=90)


def main() -> int:
    info = C.load_object_info()
    for stem, name in SHIPPED.items():
        ui = C.swap_model_loader_ui(C.load_template(stem))
        (ROOT / "workflows" / f"{name}.json").write_text(json.dumps(ui, indent=2, ensure_ascii=False) + "\n")
        api = C.ui_to_api(ui, info)
        (ROOT / "workflows" / "api" / f"{name}.json").write_text(json.dumps(api, indent=2, ensure_ascii=False)
                                                                + "\n")
        preview(ROOT / "workflows" / f"{name}.jpg", f"{stem}  (native MODEL on the fleet)")
        print(f"wrote workflows/{name}.json (+ api/, .jpg): {len(api)} API nodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
