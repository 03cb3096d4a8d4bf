"""Command line: `python -m mgpu_backend {generate,demo,make-tiny}`.

`generate` runs the two-stage pipeline on real (or tiny) checkpoint files; `demo` writes the tiny models into a
cache directory and runs `generate` on them on the CPU; `make-tiny` only writes the tiny models.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.headers import FAMILY_NAMES
from ..protocol.fleet_rules import WEIGHT_MODES
from ..protocol.job_results import FleetTeardown, RankReport

DEFAULT_BUSY_WAIT_S = 3600.0  # how long a fleet run waits for another client's job (--busy-wait)
BUSY_RETRY_S = 2.0
DEMO_PROMPT = "A red fox runs through fresh snow at dawn, its breath steaming; birds call in the distance."


def _cache_dir() -> Path:
    root = os.environ.get("LTX2_MGPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ltx2-multigpu")
    return Path(root)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _add_generate_args(p: argparse.ArgumentParser, demo: bool) -> None:
    if not demo:
        p.add_argument("--models", metavar="FOLDER",
                       help="a folder of per-component files (flat, or a ComfyUI models/ root with diffusion_models/, "
                            "vae/, text_encoders/, latent_upscale_models/): each file is recognized by its tensors; "
                            "the options below name or override single files")
        p.add_argument("--checkpoint", "--transformer", dest="checkpoint",
                       help="LTX-2 / 2.3 single file, or a transformer file (diffusion_models/: bf16, fp8, or "
                            "ComfyUI's int8-convrot); required unless --models holds exactly one")
        p.add_argument("--gemma", "--text-encoder", dest="gemma",
                       help="text encoder: Gemma 3 (LTX-2.0 / 2.3; ComfyUI single file or HF folder) or Gemma 4 with "
                            "the bundled projection (LTX-2.5)")
        p.add_argument("--upscaler", help="latent upscaler file (latent_upscale_models/)")
        p.add_argument("--distilled-lora", metavar="PATH[:STRENGTH]",
                       help="LoRA fused for stage 2 only (default strength 1.0)")
        p.add_argument("--video-vae", help="video VAE file, for a transformer-only checkpoint")
        p.add_argument("--audio-vae", help="audio VAE + vocoder file, for a transformer-only checkpoint")
        p.add_argument("--text-projection", help="text projection file, for a transformer-only checkpoint "
                                                 "(LTX-2.5: the text-encoder file, the default)")
    else:
        p.add_argument("--variant", choices=FAMILY_NAMES, default=FAMILY_NAMES[0], help="tiny model family")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="a LoRA fused for both stages (default strength 1.0); repeatable. Each prints its coverage "
                        "(layers applied / in the file); one that fits no layer, or another model width, is refused")
    p.add_argument("--prompt", default=DEMO_PROMPT if demo else None, required=not demo, help="what to generate")
    p.add_argument("--negative-prompt", default=None, help="default: the reference negative prompt")
    p.add_argument("--width", type=int, default=256 if demo else 768, help="pixels, multiple of 64")
    p.add_argument("--height", type=int, default=128 if demo else 512, help="pixels, multiple of 64")
    p.add_argument("--frames", type=int, default=25 if demo else 121, help="8k+1")
    p.add_argument("--fps", type=float, default=24.0, help="frames per second")
    p.add_argument("--steps", type=int, default=8 if demo else None, help="stage-1 steps" + ("" if demo else " (default: the model family's)"))
    p.add_argument("--seed", type=int, default=0, help="noise seed (≥ 0, as ComfyUI's)")
    p.add_argument("--pipeline", choices=("two-stage", "distilled"), default=None,
                   help="two-stage: guided stage 1 + distilled-LoRA stage 2; distilled: a distilled checkpoint, "
                        "8 + 3 steps, no guidance, sequence parallel on both stages (default: the model family's "
                        "recipe: two-stage for LTX-2.0 / 2.3, distilled for LTX-2.5 as ComfyUI's template)")
    p.add_argument("--sampler", choices=("euler", "euler_ancestral"), default=None,
                   help="sampler of both stages (default: the family's: euler; LTX-2.5 euler_ancestral)")
    p.add_argument("--tiles", default=None, metavar="HxW",
                   help="stage-2 tiled data parallel grid, e.g. 2x2 (default: balanced from the rank count)")
    p.add_argument("--tile-overlap", type=int, default=5, help="stage-2 tile overlap in latent cells")
    p.add_argument("--decode-tiles", default=None, metavar="HxW", help="VAE decode tile grid (default: balanced)")
    p.add_argument("--decode-overlap", type=int, default=2, help="decode tile overlap in latent cells (×32 px)")
    p.add_argument("--stage2-sigmas", default=None, help="comma list ending in 0 (default: the family's, "
                                                          "0.909375,0.725,0.421875,0 or LTX-2.5 0.85,0.725,0.4219,0; "
                                                          "tiled: 0.625,0.4,0)")
    p.add_argument("--image", help="first-frame image for image-to-video: scaled to cover --width × --height "
                                   "and center-cropped (the reference's resize_and_center_crop)")
    p.add_argument("--image-strength", type=float, default=1.0, help="0..1")
    p.add_argument("--device", default="cpu" if demo else None, help="in-process device: cpu, cuda, cuda:1 …" + ("" if demo else " (default: cuda if any)"))
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--output", default="ltx2-demo.mp4" if demo else "clip.mp4", help="mp4 to write")
    p.add_argument("--devices", default=None,
                   help="run on a worker fleet: 'all', a count, a CUDA list like '0,1,3', or 'cpu:N' "
                        "(default: in this process)")
    p.add_argument("--world-size", type=int, default=None, help="number of ranks (with --devices, or CPU ranks)")
    p.add_argument("--weights", choices=WEIGHT_MODES, default=None,
                   help="the transformer's weights over the fleet's ranks: auto (default: replicated when a replica "
                        "fits every GPU, else placed), replicated (every GPU holds the whole transformer: fastest; "
                        "refused when it does not fit), placed (as many blocks whole as each GPU's budget allows, "
                        "the rest sharded over the GPUs) or sharded (each GPU holds 1/N of every block, gathered "
                        "block by block as they run); fleet runs only")
    p.add_argument("--gpu-budget-gib", type=float, default=None, metavar="GIB",
                   help="memory the fleet may use per GPU for the transformer's weights and one forward (a hard cap "
                        "on CUDA); the weights are placed in it (default: each GPU's free memory at load); fleet "
                        "runs only")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks: the first job at a size pays the compile, later "
                        "jobs on the same fleet run faster")
    p.add_argument("--int8-compute", choices=("auto", "w8a8", "dequantize"), default=None,
                   help="an int8(-convrot) transformer file: w8a8 (int8 weights resident, ComfyUI's result), "
                        "dequantize (weights dequantized to the compute dtype at load: bf16 speed, 2x their memory; "
                        "refused when they would not fit the GPU or with --weights sharded) or auto (default: on "
                        "CUDA dequantize when it fits, else w8a8; on CPU w8a8)")
    p.add_argument("--min-tokens-per-rank", type=int, default=None, metavar="N",
                   help="split a stage over fewer ranks when it has fewer than N video tokens per rank (0: always "
                        "every rank); default: on GPUs the cost model picks each stage's split")
    p.add_argument("--sp-degree", type=int, default=None,
                   help="sequence parallel degree (must divide the attention heads; default: the largest valid)")
    p.add_argument("--guidance-parallel", choices=("auto", "on", "off"), default=None,
                   help="run a guided stage's guidance passes (cond, uncond, perturbed, isolated) on different ranks "
                        "instead of sequence parallel: auto (default: on GPUs when the cost model predicts it "
                        "faster), on, off; fleet runs only")
    p.add_argument("--busy-wait", type=float, default=None, metavar="SECONDS",
                   help="when the fleet is busy with another client's job (ComfyUI, another CLI run), wait up to "
                        f"this long for it, retrying every {BUSY_RETRY_S:g} s (0: fail at once); fleet runs only "
                        f"(default: {DEFAULT_BUSY_WAIT_S:g})")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help where there is a default worth showing (not None / off / empty)."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = not (action.default is None or action.default is False or action.default == []
                     or action.default is argparse.SUPPRESS)
        if (action.option_strings and shown
                and "%(default)" not in text and "default" not in text):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`--pipeline foo` names the choices, not the whole usage) and the defaults in
    `--help`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="python -m mgpu_backend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ltx2-multigpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_args(sub.add_parser("generate", help="two-stage text/image-to-audio+video"), demo=False)
    _add_generate_args(sub.add_parser("demo", help="tiny generated models, CPU, writes an mp4"), demo=True)
    sub.add_parser("status", help="controller and fleet status")
    sub.add_parser("stop", help="stop the background controller and its fleet")
    tiny = sub.add_parser("make-tiny", help="write tiny random-weight models in the real file layouts")
    tiny.add_argument("directory", help="folder to write the files into")
    tiny.add_argument("--variant", choices=FAMILY_NAMES, default=FAMILY_NAMES[0])
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


def _in_process_identity(args: argparse.Namespace, files: dict, dtype, device):
    """This process as a one-rank fleet (`FleetIdentity`), for the fleet's rules and the int8 path: replicated
    weights on `device`."""
    from ..protocol.fleet_config import FleetIdentity

    return FleetIdentity(devices=(str(device),), checkpoint=files["checkpoint"], gemma=files.get("gemma"),
                         upscaler=files.get("upscaler"), video_vae=files.get("video_vae"),
                         audio_vae=files.get("audio_vae"), text_projection=files.get("text_projection"),
                         dtype=str(dtype).replace("torch.", ""), weights="replicated",
                         int8_compute=getattr(args, "int8_compute", None) or "auto")


def on_fleet(args: argparse.Namespace) -> bool:
    """A fleet option given: the job runs on the background controller's fleet, else in this process."""
    return any(getattr(args, name, None) is not None for name in
               ("devices", "world_size", "sp_degree", "guidance_parallel", "min_tokens_per_rank", "weights",
                "gpu_budget_gib", "busy_wait"))


def run_generate(args: argparse.Namespace, paths: dict | None = None) -> dict:
    """Run one generation in this process (or on the fleet with --devices / --world-size); write the mp4."""
    import torch

    from ..protocol.fleet_config import FleetPolicy
    from ..protocol.fleet_rules import check_fleet
    from ..stages.pipelines import load_one_process

    if on_fleet(args):
        return run_on_fleet(args, paths)
    request, files = _request_and_files(args, paths)  # validated before anything is loaded
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    identity = _in_process_identity(args, files, dtype, device)
    from ..models.headers import checkpoint_facts

    # the fleet's rules, as for a fleet (with the header's facts: --int8-compute needs a file with int8 layers)
    check_fleet(identity, FleetPolicy(compile=bool(args.compile)), facts=checkpoint_facts(files["checkpoint"]))
    t = time.perf_counter()
    pipeline = load_one_process(identity, dtype=dtype, device=device, compile_blocks=bool(args.compile))
    components = pipeline.components
    load_time = time.perf_counter() - t
    progress = _Progress()
    try:
        result = pipeline.generate(request, progress=progress)
    finally:
        progress.close()
    return _finish(args, Generated(result.frames, result.audio, result.sample_rate,
                                   {"load": load_time, **result.timings.as_dict()},
                                   tuple(r.detail() for r in result.lora_reports), result.rank_reports,
                                   f"LTX-{components.variant} on {device} ({str(dtype).replace('torch.', '')})"))


@dataclass(frozen=True, eq=False)
class Generated:
    """A generate run's output as the CLI writes and prints it.

    frames `[F, H, W, 3]` float32 in [0, 1]; audio `[C, S]` float32 (None: no audio) at `sample_rate` Hz; timings:
    seconds per phase in print order ("load" or "fleet ready", then `GenerateTimings.as_dict()`); lora_reports: one
    line per fused LoRA; rank_reports: every rank's `RankReport` (None: not known); header: the first line's model
    and devices.
    """

    frames: Any
    audio: Any
    sample_rate: int | None
    timings: dict[str, float]
    lora_reports: tuple[str, ...]
    rank_reports: tuple[RankReport, ...] | list[RankReport] | None
    header: str


def _finish(args, out: Generated) -> dict[str, float]:
    """Write `args.output` and print the run's report; returns the timings with "write mp4" added."""
    from ..stages.media import write_mp4

    t = time.perf_counter()
    write_mp4(args.output, out.frames, args.fps, out.audio, out.sample_rate)
    timings = {**out.timings, "write mp4": time.perf_counter() - t}
    print(f"{out.header}: "
          f"{args.frames} frames {args.width}x{args.height} @ {args.fps:g} fps, seed {args.seed}")
    for report in out.lora_reports:
        print(f"  LoRA {report}")
    for stage, seconds in timings.items():
        print(f"  {stage:<14} {seconds:8.3f} s")
    for report in out.rank_reports or []:
        decode = report.decode
        print(f"  rank {report.rank}: stage 2: {report.stage_2}; decode tiles {decode.tiles_text} "
              f"in {decode.seconds:.3f} s" + "".join(f" ({note})" for note in (decode.auto_tiling, decode.attention)
                                                    if note))
        for line in report.speed if report.rank == 0 else []:
            # which int8 path ran (--int8-compute); the job's memory plan and its fallbacks with their cost
            if line.startswith(("int8 compute", "memory plan")):
                print(f"  {line}")
        if report.rank == 0 and report.weights:  # where the weights went (--weights, --gpu-budget-gib)
            print(f"  {report.weights}")
    print(f"wrote {args.output}")
    return timings


def _sigmas(value: str | None):
    """`"0.625,0.4,0"` -> a tuple of floats (None stays None). Raises ValidationError naming the value."""
    from ..protocol.validation import ValidationError

    if value is None:
        return None
    try:
        return tuple(float(x) for x in value.split(","))
    except ValueError:
        raise ValidationError(f"--stage2-sigmas={value!r}: use a comma list of numbers ending in 0, "
                              f"e.g. 0.625,0.4,0") from None


def _grid(value: str | None, overlap: int, what: str):
    """`"HxW"` -> a spatial TileCountConfig (None stays None). Raises ValidationError naming the value."""
    from ..splits.tiling import TileCountConfig
    from ..protocol.validation import ValidationError

    if value is None:
        return None
    try:
        h, w = (int(x) for x in value.lower().split("x"))
        return TileCountConfig.spatial(h, w, overlap)
    except ValueError:
        raise ValidationError(f"{what}={value!r}: use HxW with positive counts, e.g. 2x2") from None


def _demo_files(paths: dict) -> tuple[dict, tuple[str, float] | None]:
    """`make_tiny`'s paths -> (the generate file slots, the distilled LoRA). Single-file families (2.0 / 2.3): the
    checkpoint, Gemma 3, upscaler and distilled LoRA; per-component families (2.5): transformer, video / audio VAE,
    the Gemma 4 text encoder (which holds the text projection), upscaler, and no LoRA (a distilled transformer)."""
    if "checkpoint" in paths:
        return ({"checkpoint": paths["checkpoint"], "gemma": paths["gemma"], "upscaler": paths["upsampler"]},
                (str(paths["distilled_lora"]), 1.0))
    return ({"checkpoint": paths["transformer"], "gemma": paths["text_encoder"], "upscaler": paths["upsampler"],
             "video_vae": paths["video_vae"], "audio_vae": paths["audio_vae"]}, None)


def _model_files(args) -> dict:
    """The file slots from --models FOLDER and the single-file options (which win). Raises ValidationError naming
    what is missing."""
    from ..models.headers import CHECKPOINT, find_component_files
    from ..protocol.validation import ValidationError

    explicit = {"checkpoint": args.checkpoint, "gemma": args.gemma, "upscaler": args.upscaler,
                "video_vae": args.video_vae, "audio_vae": args.audio_vae, "text_projection": args.text_projection}
    files = dict(explicit)
    if args.models is not None:
        kinds = {"checkpoint": "transformer", "gemma": "text_encoder", "upscaler": "upsampler",
                 "video_vae": "video_vae", "audio_vae": "audio_vae"}
        try:
            found = find_component_files(args.models, given=tuple(kinds[k] for k, v in explicit.items()
                                                                  if v is not None and k in kinds))
        except (FileNotFoundError, ValueError) as exc:
            raise ValidationError(f"--models: {exc}") from None
        found.setdefault("transformer", found.get(CHECKPOINT))
        for slot, kind in kinds.items():
            if files[slot] is None and found.get(kind) is not None:
                files[slot] = found[kind]
    missing = [f"--{name}" for name in ("checkpoint", "gemma", "upscaler") if files[name] is None]
    if missing:
        raise ValidationError(f"no {', '.join(missing)} given (name the files, or a --models folder holding them)")
    return files


def _request_and_files(args, paths):
    """The validated request and the model files; everything a user can get wrong is refused here, before any
    model is loaded or a controller is started (files, seed, the output destination)."""
    from ..protocol import validation as V
    from ..weights.lora import parse_lora_arg
    from ..stages.pipelines import DEFAULT_NEGATIVE_PROMPT, GenerateRequest
    from ..protocol.validation import ValidationError

    try:
        user_loras = tuple(parse_lora_arg(a) for a in getattr(args, "lora", None) or ())
        if paths is not None:  # demo
            files, lora = _demo_files(paths)
        else:
            files = _model_files(args)
            lora = parse_lora_arg(args.distilled_lora) if args.distilled_lora else None
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    request = GenerateRequest(
        prompt=args.prompt, negative_prompt=args.negative_prompt or DEFAULT_NEGATIVE_PROMPT, width=args.width,
        height=args.height, frames=args.frames, fps=args.fps, steps=args.steps, seed=args.seed, image=args.image,
        image_strength=args.image_strength, distilled_lora=lora, loras=user_loras, pipeline=args.pipeline,
        sampler=args.sampler,
        tiles=_grid(args.tiles, args.tile_overlap, "--tiles"), tile_overlap=args.tile_overlap,
        decode_tiles=_grid(args.decode_tiles, args.decode_overlap, "--decode-tiles"),
        decode_overlap=args.decode_overlap,
        stage2_sigmas=_sigmas(args.stage2_sigmas))
    request.validate()  # the values first, then the files they name, then where the result goes
    V.check_seed(args.seed)
    for what, path in files.items():
        V.check_file(what.replace("_", " "), path, required=what in ("checkpoint", "gemma", "upscaler"),
                     folder_ok=what == "gemma")
    V.check_output(args.output)
    return request, {k: (str(v) if v is not None else None) for k, v in files.items()}


def run_on_fleet(args: argparse.Namespace, paths: dict | None) -> dict:
    """Run the job on the background controller's fleet (started on demand, reused by later calls)."""
    from .client import ControllerClient, parse_devices
    from .controller import check_config
    from ..protocol.fleet_config import FleetConfig
    from ..protocol.errors import FleetBusy
    from ..protocol.job_requests import JobSpec
    from ..protocol.validation import ValidationError

    wait_s = DEFAULT_BUSY_WAIT_S if args.busy_wait is None else args.busy_wait
    if not 0 <= wait_s < float("inf"):
        raise ValidationError(f"--busy-wait must be a number of seconds >= 0, got {wait_s}")
    request, files = _request_and_files(args, paths)
    devices = parse_devices(args.devices if args.devices is not None else "all", args.world_size)
    on_gpu = devices[0].startswith("cuda")
    if not on_gpu and not str(args.devices or "all").lower().startswith("cpu"):
        print(f"note: no CUDA device here: running {len(devices)} CPU rank(s) (gloo)", file=sys.stderr)
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    threads = 1 if on_gpu else max(1, (os.cpu_count() or 1) // len(devices))
    config = FleetConfig(devices=devices, dtype=dtype, threads_per_worker=threads, sp_degree=args.sp_degree,
                         compile=args.compile, guidance_parallel=args.guidance_parallel or "auto",
                         min_tokens_per_rank=args.min_tokens_per_rank, weights=args.weights or "auto",
                         gpu_budget_gib=getattr(args, "gpu_budget_gib", None), int8_compute=args.int8_compute or "auto",
                         **files)
    # headers, the fleet's rules and rank counts: a bad degree or file is refused before a controller is started (the
    # controller checks host memory, knowing what a running fleet would give back)
    check_config(config, memory=False)
    client = ControllerClient()
    progress, job = _Progress(), JobSpec("generate", request)
    deadline, configure_time, waiting = time.monotonic() + wait_s, 0.0, False
    try:
        while True:  # another client's job (ComfyUI, a second CLI run): wait for it, then configure and run
            try:
                t = time.perf_counter()
                configured = client.configure_fleet(config)
                handle, replaced = configured.handle, configured.replaced
                configure_time = time.perf_counter() - t
                if replaced:  # another configuration was loaded (maybe by ComfyUI): say what this run replaced
                    print(f"note: {replaced_note(handle, replaced)}", file=sys.stderr)
                result = client.run(handle, job, on_event=lambda e: progress(e.stage, e.step, e.total))
                break
            except FleetBusy as exc:
                if wait_s == 0:
                    raise
                if time.monotonic() + BUSY_RETRY_S > deadline:
                    raise FleetBusy(f"{exc} (waited {wait_s:g} s: --busy-wait)", kind=exc.kind) from None
                if not waiting:
                    print(f"note: {exc}: waiting up to {wait_s:g} s (--busy-wait)", file=sys.stderr)
                    waiting = True
                time.sleep(BUSY_RETRY_S)
    except KeyboardInterrupt:
        client.cancel(job.job_id)
        raise
    finally:
        progress.close()
        client.close()
    return _finish(args, Generated(
        result.frames, result.audio, result.sample_rate, {"fleet ready": configure_time, **result.timings.as_dict()},
        tuple(result.lora_reports), result.rank_reports,
        f"fleet generation {handle.generation}, {len(devices)} rank(s) on {','.join(devices)} ({dtype}); "
        f"{result.parallel}"))


def replaced_note(handle, replaced: FleetTeardown) -> str:
    """The note a `generate` prints when its configure replaced another fleet: this run's fleet (its generation and
    checkpoint, from `handle`, a `FleetHandle`) first, then what it replaced (`describe_stopped`), so the old fleet's
    checkpoint is never read as this run's (issue 36)."""
    return (f"this run's fleet (generation {handle.generation}, {handle.config.checkpoint}) "
            f"{describe_stopped(replaced, 'replaced')}")


def describe_stopped(stopped: FleetTeardown, verb: str) -> str:
    """What a `stop` / a replacing `generate` stopped, in words: the fleet (generation, ranks, devices, the checkpoint
    it held), the other clients connected to the controller (the CLI and ComfyUI share one per user), the running
    job."""
    fleet = stopped.fleet
    if fleet is not None:
        parts = [f"{verb} fleet generation {fleet.generation}: {len(fleet.devices)} rank(s) on "
                 f"{','.join(fleet.devices)} (pids {', '.join(map(str, fleet.worker_pids))}) that held "
                 f"{fleet.checkpoint}"]
    else:
        parts = ["no fleet was loaded"]
    if stopped.clients:
        parts.append(f"{len(stopped.clients)} other client(s) were connected to this controller "
                     f"({'; '.join(stopped.clients)}) — ComfyUI and the CLI share it; their next job starts a fleet "
                     f"of their own configuration")
    if stopped.job:
        parts.append(f"{stopped.job} was running and was stopped")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..protocol.validation import ValidationError

    try:
        if args.command == "make-tiny":
            from ..testing.tiny import make_tiny

            for name, path in make_tiny(Path(args.directory), args.variant, args.seed).items():
                print(f"{name:<16} {path}")
            return 0
        if args.command == "demo":
            from ..testing.tiny import make_tiny

            directory = _cache_dir() / f"tiny-{args.variant}-seed0"
            paths = make_tiny(directory, args.variant, seed=0)
            print(f"tiny LTX-{args.variant} models in {directory}")
            run_generate(args, paths)
            return 0
        if args.command in ("status", "stop"):
            from .client import ControllerClient
            from ..protocol.errors import ControllerError

            try:
                client = ControllerClient(start=False)
            except ControllerError:
                print("no controller is running")
                return 0
            if args.command == "stop":
                stopped = client.stop()
                print(f"controller stopped; {describe_stopped(stopped, 'stopped')}")
            else:
                import dataclasses
                import json

                print(json.dumps(dataclasses.asdict(client.status()), indent=2, default=str))
            return 0
        run_generate(args)
        return 0
    except (ValidationError, FileNotFoundError, NotImplementedError) as exc:  # the last: a part not in this build
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the fleet job is cancelled at its next step; the workers stay loaded)"
              if args.command in ("generate", "demo") and on_fleet(args) else "interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # engine and fleet errors: the message, not a traceback from deep in the fleet
        from ..models.headers import CheckpointError
        from ..protocol.errors import ControllerError, ErrorKind

        if isinstance(exc, ControllerError):
            print(f"error: {exc}", file=sys.stderr)
            return 2 if exc.kind in (ErrorKind.VALIDATION, ErrorKind.BUSY, ErrorKind.STALE_HANDLE) else 1
        if isinstance(exc, (CheckpointError, ValueError)):  # bad files and bad values, named by the message
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
