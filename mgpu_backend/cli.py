"""Command line: `python -m mgpu_backend {generate,demo,make-tiny}`.

`generate` runs the two-stage pipeline on real (or tiny) checkpoint files; `demo` writes the tiny models into a
cache directory and runs `generate` on them on the CPU; `make-tiny` only writes the tiny models.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEMO_PROMPT = "A red fox runs through fresh snow at dawn, its breath steaming; birds call in the distance."


def _cache_dir() -> Path:
    root = os.environ.get("LTX2_MGPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ltx2-multigpu")
    return Path(root)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _add_generate_args(p: argparse.ArgumentParser, demo: bool) -> None:
    if not demo:
        p.add_argument("--checkpoint", required=True, help="LTX-2 / LTX-2.3 single file, or a transformer-only file")
        p.add_argument("--gemma", required=True, help="Gemma 3 text encoder: ComfyUI single file or HF folder")
        p.add_argument("--upscaler", required=True, help="latent upscaler file (latent_upscale_models/)")
        p.add_argument("--distilled-lora", metavar="PATH[:STRENGTH]", help="LoRA fused for stage 2 (default 1.0)")
        p.add_argument("--video-vae", help="video VAE file, for a transformer-only checkpoint")
        p.add_argument("--audio-vae", help="audio VAE + vocoder file, for a transformer-only checkpoint")
        p.add_argument("--text-projection", help="text projection file, for a transformer-only checkpoint")
    else:
        p.add_argument("--variant", choices=("2.0", "2.3"), default="2.0", help="tiny model architecture")
    p.add_argument("--prompt", default=DEMO_PROMPT if demo else None, required=not demo)
    p.add_argument("--negative-prompt", default=None, help="default: the reference negative prompt")
    p.add_argument("--width", type=int, default=256 if demo else 768, help="pixels, multiple of 64")
    p.add_argument("--height", type=int, default=128 if demo else 512, help="pixels, multiple of 64")
    p.add_argument("--frames", type=int, default=25 if demo else 121, help="8k+1")
    p.add_argument("--fps", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=8 if demo else None, help="stage-1 steps (default: model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image", help="first-frame image for image-to-video")
    p.add_argument("--image-strength", type=float, default=1.0, help="0..1")
    p.add_argument("--device", default="cpu" if demo else None, help="cpu, cuda, cuda:1 … (default: cuda if any)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--output", default="ltx2-demo.mp4" if demo else "clip.mp4", help="mp4 to write")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_args(sub.add_parser("generate", help="two-stage text/image-to-audio+video"), demo=False)
    _add_generate_args(sub.add_parser("demo", help="tiny generated models, CPU, writes an mp4"), demo=True)
    tiny = sub.add_parser("make-tiny", help="write tiny random-weight models in the real file layouts")
    tiny.add_argument("directory")
    tiny.add_argument("--variant", choices=("2.0", "2.3"), default="2.0")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


class _Progress:
    """A tqdm bar per stage."""

    def __init__(self):
        self.bar, self.stage = None, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage, self.bar = stage, tqdm(total=total, desc=stage, unit="step", leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_generate(args: argparse.Namespace, paths: dict | None = None) -> dict:
    import torch

    from .lora import parse_lora_arg
    from .media import write_mp4
    from .models.gemma import load_gemma
    from .models.loader import load_components
    from .models.text_projection import check_gemma_matches
    from .pipelines import DEFAULT_NEGATIVE_PROMPT, GenerateRequest, TwoStagePipeline

    if paths is not None:  # demo
        checkpoint, gemma_path, upscaler = paths["checkpoint"], paths["gemma"], paths["upsampler"]
        lora, extra = (str(paths["distilled_lora"]), 1.0), {}
    else:
        checkpoint, gemma_path, upscaler = args.checkpoint, args.gemma, args.upscaler
        lora = parse_lora_arg(args.distilled_lora) if args.distilled_lora else None
        extra = {"video_vae": args.video_vae, "audio_vae": args.audio_vae, "text_projection": args.text_projection}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    request = GenerateRequest(
        prompt=args.prompt, negative_prompt=args.negative_prompt or DEFAULT_NEGATIVE_PROMPT, width=args.width,
        height=args.height, frames=args.frames, fps=args.fps, steps=args.steps, seed=args.seed, image=args.image,
        image_strength=args.image_strength, distilled_lora=lora)
    request.validate()  # before anything is loaded

    t = time.perf_counter()
    components = load_components(checkpoint, upsampler=upscaler, dtype=dtype, device=device, **extra)
    gemma = load_gemma(gemma_path, device=device, dtype=dtype)
    check_gemma_matches(components.text_projection, gemma, gemma_path)
    load_time = time.perf_counter() - t
    pipeline = TwoStagePipeline(components, gemma, device=device, dtype=dtype)
    progress = _Progress()
    try:
        result = pipeline.generate(request, progress=progress)
    finally:
        progress.close()
    t = time.perf_counter()
    write_mp4(args.output, result.frames, args.fps, result.audio, result.sample_rate)
    timings = {"load": load_time, **result.timings, "write mp4": time.perf_counter() - t}
    print(f"LTX-{components.variant} on {device} ({str(dtype).replace('torch.', '')}): "
          f"{args.frames} frames {args.width}x{args.height} @ {args.fps:g} fps, seed {args.seed}")
    for report in result.lora_reports:
        print(f"  LoRA {report}")
    for stage, seconds in timings.items():
        print(f"  {stage:<14} {seconds:8.3f} s")
    print(f"wrote {args.output}")
    return timings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .validation import ValidationError

    try:
        if args.command == "make-tiny":
            from .models.tiny import make_tiny

            for name, path in make_tiny(Path(args.directory), args.variant, args.seed).items():
                print(f"{name:<16} {path}")
            return 0
        if args.command == "demo":
            from .models.tiny import make_tiny

            directory = _cache_dir() / f"tiny-{args.variant}-seed0"
            paths = make_tiny(directory, args.variant, seed=0)
            print(f"tiny LTX-{args.variant} models in {directory}")
            run_generate(args, paths)
            return 0
        run_generate(args)
        return 0
    except (ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
