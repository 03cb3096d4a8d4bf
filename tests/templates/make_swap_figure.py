"""Draws workflows/template-swap.png: the one swap that moves an LTX template's transformer onto the fleet.

    python tests/templates/make_swap_figure.py          # rewrites workflows/template-swap.png

Pillow only (a dependency of the pack), its built-in font, no machine paths; the nodes are drawn in ComfyUI's colours
(MODEL wires lavender, VAE red, CLIP yellow) with the names and outputs ComfyUI 0.33 shows. What it shows is what
`tests/templates/convert.py`'s `swap_model_loader_ui` does to the shipped workflows.
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

OUT = Path(__file__).resolve().parents[2] / "workflows" / "template-swap.png"
W, H = 1240, 860
BG, PANEL, NODE, TITLE, TEXT, DIM = "#1e1e1e", "#262626", "#353535", "#222222", "#dddddd", "#8a8a8a"
WIDGET = "#2b2b2b"
COLOURS = {"MODEL": "#b39ddb", "VAE": "#ff6e6e", "CLIP": "#ffd500", "LTX2_MGPU_FLEET": "#7fb3d5",
           "LATENT": "#ff9cf9", "CONDITIONING": "#ffa931"}
SWAP = "#66bb6a"
F = {s: ImageFont.load_default(size=s) for s in (13, 15, 17, 22)}


class Node:
    """A ComfyUI-looking node: title bar, input slots on the left, output slots on the right, widget rows."""

    def __init__(self, x, y, w, title, inputs=(), outputs=(), widgets=(), outline=None, faded=()):
        self.x, self.y, self.w, self.title = x, y, w, title
        self.inputs, self.outputs, self.widgets = list(inputs), list(outputs), list(widgets)
        self.outline, self.faded = outline, set(faded)
        rows = max(len(self.inputs), len(self.outputs))
        self.h = 30 + 22 * rows + 24 * len(self.widgets) + 10

    def slot(self, name: str, side: str) -> tuple[int, int]:
        items = self.outputs if side == "out" else self.inputs
        i = [n for n, _t in items].index(name)
        return (self.x + self.w if side == "out" else self.x, self.y + 30 + 11 + 22 * i)

    def draw(self, d: ImageDraw.ImageDraw) -> None:
        x, y, w, h = self.x, self.y, self.w, self.h
        if self.outline:
            d.rounded_rectangle((x - 4, y - 4, x + w + 4, y + h + 4), 10, outline=self.outline, width=3)
        d.rounded_rectangle((x, y, x + w, y + h), 8, fill=NODE)
        d.rounded_rectangle((x, y, x + w, y + 26), 8, fill=TITLE)
        d.rectangle((x, y + 18, x + w, y + 26), fill=TITLE)
        d.text((x + 10, y + 5), self.title, font=F[15], fill=TEXT)
        for i, (name, typ) in enumerate(self.inputs):
            cx, cy = self.slot(name, "in")
            d.ellipse((cx - 5, cy - 5, cx + 5, cy + 5), fill=COLOURS[typ])
            d.text((cx + 10, cy - 8), name, font=F[13], fill=TEXT)
        for name, typ in self.outputs:
            cx, cy = self.slot(name, "out")
            col = DIM if name in self.faded else COLOURS[typ]
            d.ellipse((cx - 5, cy - 5, cx + 5, cy + 5), fill=col)
            tw = d.textlength(name, font=F[13])
            d.text((cx - 10 - tw, cy - 8), name, font=F[13], fill=DIM if name in self.faded else TEXT)
        wy = y + 30 + 22 * max(len(self.inputs), len(self.outputs)) + 4
        for label, value in self.widgets:
            d.rounded_rectangle((x + 8, wy, x + w - 8, wy + 20), 9, fill=WIDGET)
            d.text((x + 18, wy + 3), label, font=F[13], fill=DIM)
            tw = d.textlength(value, font=F[13])
            d.text((x + w - 18 - tw, wy + 3), value, font=F[13], fill=TEXT)
            wy += 24


def wire(d: ImageDraw.ImageDraw, a: tuple[int, int], b: tuple[int, int], colour: str, width: int = 4) -> None:
    """ComfyUI's spline link from output `a` to input `b` (a cubic Bézier with horizontal tangents)."""
    (x0, y0), (x3, y3) = a, b
    k = max(40, abs(x3 - x0) * 0.5)
    pts = []
    for i in range(41):
        t = i / 40
        x = (1 - t) ** 3 * x0 + 3 * (1 - t) ** 2 * t * (x0 + k) + 3 * (1 - t) * t ** 2 * (x3 - k) + t ** 3 * x3
        y = (1 - t) ** 3 * y0 + 3 * (1 - t) ** 2 * t * y0 + 3 * (1 - t) * t ** 2 * y3 + t ** 3 * y3
        pts.append((x, y))
    d.line(pts, fill=colour, width=width, joint="curve")


def panel(d, y0, y1, heading):
    d.rounded_rectangle((16, y0, W - 16, y1), 12, fill=PANEL)
    d.text((32, y0 + 10), heading, font=F[17], fill=TEXT)


def downstream(d, y, lora_in_from, vae_from):
    """The template's nodes after the loader, unchanged by the swap."""
    lora = Node(470, y, 220, "LoraLoaderModelOnly", [("model", "MODEL")], [("MODEL", "MODEL")],
                [("lora_name", "distilled-lora…"), ("strength_model", "0.50")])
    guider = Node(790, y - 6, 300, "SamplerCustomAdvanced + CFGGuider", [("model", "MODEL"),
                                                                     ("positive", "CONDITIONING")],
                  [("LATENT", "LATENT")], [("stage 1 + stage 2", "the template's sigmas")])
    dec = Node(790, y + 118, 300, "VAE Decode (Tiled)", [("samples", "LATENT"), ("vae", "VAE")],
               [("IMAGE", "LATENT")], [("tile_size", "768")])
    dec.outputs = []  # drawn without its IMAGE output (not a wire type of this picture)
    for n in (lora, guider, dec):
        n.draw(d)
    wire(d, lora_in_from, lora.slot("model", "in"), COLOURS["MODEL"], 5)
    wire(d, lora.slot("MODEL", "out"), guider.slot("model", "in"), COLOURS["MODEL"])
    wire(d, vae_from, dec.slot("vae", "in"), COLOURS["VAE"])
    return lora


def main() -> None:
    img = Image.new("RGB", (W, H), BG)
    d = ImageDraw.Draw(img)

    # ---- before ----
    panel(d, 16, 316, "Before: ComfyUI's own LTX-2.3 template (inside its subgraph)")
    ckpt = Node(40, 70, 330, "Load Checkpoint", [], [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")],
                [("ckpt_name", "ltx-2.3-22b-dev-fp8.safetensors")])
    ckpt.draw(d)
    downstream(d, 70, ckpt.slot("MODEL", "out"), ckpt.slot("VAE", "out"))
    d.text((40, 230), "The whole 22B transformer is loaded into ComfyUI and runs on one GPU.", font=F[15], fill=DIM)

    # ---- after ----
    panel(d, 332, 716, "After: one swap, the MODEL wire now starts at Load Diffusion Model (MGPU)")
    mgpu = Node(40, 388, 370, "Load Diffusion Model (MGPU)", [],
                [("model", "MODEL"), ("fleet", "LTX2_MGPU_FLEET")],
                [("unet_name", "ltx-2.3-22b-dev-fp8.safetensors"), ("devices", "all"), ("world_size", "0")],
                outline=SWAP)
    mgpu.draw(d)
    ckpt2 = Node(40, 574, 330, "Load Checkpoint", [], [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")],
                 [("ckpt_name", "ltx-2.3-22b-dev-fp8.safetensors")], faded={"MODEL"})
    ckpt2.draw(d)
    downstream(d, 388, mgpu.slot("model", "out"), ckpt2.slot("VAE", "out"))
    d.text((430, 510), "added: the MODEL wire starts here;", font=F[13], fill=SWAP)
    d.text((430, 526), "the transformer stays on the fleet", font=F[13], fill=SWAP)
    d.text((790, 636), "Load Checkpoint stays for its VAE; its MODEL output", font=F[13], fill=DIM)
    d.text((790, 652), "is no longer wired, so no sampler moves the", font=F[13], fill=DIM)
    d.text((790, 668), "transformer onto a GPU in ComfyUI (the loader", font=F[13], fill=DIM)
    d.text((790, 684), "still reads the file)", font=F[13], fill=DIM)

    # ---- what runs where ----
    d.rounded_rectangle((16, 732, W - 16, H - 16), 12, fill=PANEL)
    d.text((32, 742), "ComfyUI's process:", font=F[15], fill=TEXT)
    d.text((196, 742), "Gemma text encoder and prompt enhancer, samplers, guiders, sigmas, LoRA loaders (their "
                       "patches are sent to the fleet),", font=F[15], fill=DIM)
    d.text((196, 762), "latent upscaler, VAE and audio VAE decode: all unchanged.", font=F[15], fill=DIM)
    d.text((32, 788), "The fleet:", font=F[15], fill=SWAP)
    d.text((196, 788), "every transformer forward of both stages, split over the GPUs in `devices` (sequence "
                       "parallel).", font=F[15], fill=DIM)
    d.text((32, 814), "LTX-2.5 templates: the same swap on Load Diffusion Model (UNETLoader); their VAELoaders and "
                      "CLIPLoaders stay.", font=F[15], fill=DIM)
    img.save(OUT, optimize=True)
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
