"""End-to-end two-stage generation on one GPU, seconds per stage: the baseline the multi-GPU runs are divided by.

Every component is built directly in GPU memory with random weights at its real LTX-2.0 shape (nothing is read from
disk): the 19B-shaped transformer (`bench_memory.LTX2_19B`, bench_sp's config; `--blocks` of the 48), the text
connectors and the text projection (188160 -> 3840), the video VAE (the released `config.vae` layout), the audio
VAE and the HiFi-GAN vocoder (the released defaults of `models/configs.py`; vocoder in float32 as the loader keeps
it), the 2× latent upscaler, and a Gemma 3 12B-shaped text encoder (48 layers, hidden 3840, the config the loader
infers from a real 12B file; the project's small test tokenizer). Then the real `TwoStagePipeline.generate` runs
the reference recipe in this process: text encode (prompt + the default negative prompt) -> stage 1 at half size
(the LTX-2.0 scheduler, 40 steps, CFG + STG + modality guidance = 4 transformer forwards per step) -> 2× latent
upscale -> stage 2 at full size (sigmas 0.909375, 0.725, 0.421875, 0: 3 steps, one forward each, audio frozen) ->
VAE decode -> audio VAE + vocoder decode; then `media.write_mp4` muxes H.264 + AAC (the CLI's last step).

One warm-up generation (2 stage-1 steps) runs first, as a persistent fleet is warm; the Gemma prompt cache is cleared
before the timed run. Scaling, labelled in the output:
- blocks: every transformer forward is timed (CUDA-synchronized); a transformer stage's time at 48 blocks is
  `wall - forwards + forwards × 48/N` — only the transformer stages scale, the rest is measured as is;
- stage-1 steps: with `--stage1-steps K` (or when the full count would exceed `--stage1-budget` seconds, estimated
  from the second warm-up step) K steps run and the stage-1 time is multiplied by steps/K.
Random weights can drive a latent out of range; any non-finite transformer output is replaced (nan_to_num, counted
and reported) so the pipeline's finite checks cannot end the run. The distilled LoRA of stage 2 is not fused (its
fuse + restore is bench_lora.py's figure).

    python bench/bench_e2e.py --blocks 48                      # one H200: no block scaling; ~2 min
    python bench/bench_e2e.py --blocks 8                       # faster: transformer stages scaled ×6
    python bench/bench_e2e.py --blocks 48 --fp8                # fp8-resident block Linears (FP8Linear)
    python bench/bench_e2e.py --tiny                           # CPU smoke check (tiny configs, 128×128×9)
`--out FILE` also writes the table to FILE (the shipped H200 figures: bench/results/e2e_h200.txt).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_gemma, bench_memory

from bench_memory import (LTX2_19B, LTX2_VIDEO_VAE, build_transformer, device_name, fill_random_,  # noqa: E402
                          quiet_diffusers, sync, tensor_bytes)

from mgpu_backend import sampling as S  # noqa: E402
from mgpu_backend.attention import LTX2AttnProcessor, use_processor  # noqa: E402
from mgpu_backend.models import configs  # noqa: E402
from mgpu_backend.models.loader import LTX2Components, build_audio_vae  # noqa: E402
from mgpu_backend.pipelines import GenerateRequest, TwoStagePipeline  # noqa: E402

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = ("A red fox trots through fresh snow at dawn, its breath visible in the cold air; the camera tracks it low "
          "to the ground while birds call from the pine trees and the snow crunches under its paws.")
STAGES = ("text", "stage 1", "upscale", "stage 2", "decode video", "decode audio", "mux")


# ---- components --------------------------------------------------------------------------------------------------

def _build(factory, device, dtype, seed):
    """A module built on the meta device, cast, allocated on `device` and filled (`bench_memory.fill_random_`)."""
    with torch.device("meta"):
        module = factory().to(dtype)
    return fill_random_(module.to_empty(device=device), seed)


def build_gemma(device, dtype, tiny: bool):
    """A `GemmaTextEncoder` around a random Gemma 3 model: 12B-shaped (the config `infer_text_config` derives from
    the 12B tensor shapes) or the tiny test shape; weights filled like bench_gemma.py's random file."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from bench_gemma import GEMMA3_12B
    from mgpu_backend.models.gemma import GemmaPromptTokenizer, GemmaTextEncoder, infer_text_config
    from mgpu_backend.models.tiny import TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS
    from mgpu_backend.models.tiny_gemma import tiny_spiece_model, tiny_text_config

    if tiny:
        text_config = tiny_text_config(TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS)
    else:
        with torch.device("meta"):
            shapes = Gemma3TextModel(Gemma3TextConfig(**GEMMA3_12B)).state_dict()
        text_config = infer_text_config({k: tuple(v.shape) for k, v in shapes.items()}, "12B shapes")
    cfg = {k: v for k, v in text_config.items() if k != "model_type"}
    config = Gemma3TextConfig(**cfg)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Gemma3TextModel(config).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.05 if name == "embed_tokens.weight" else 0.1 if p.ndim == 1 else 0.5 / p.shape[1] ** 0.5
            p.normal_(0.0, std, generator=gen)
    # the non-persistent buffers, as the loader recreates them (`models/gemma.py _build_model`)
    model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5, device=device)
    model.rotary_emb = type(model.rotary_emb)(config=config, device=device)
    tokenizer = GemmaPromptTokenizer.from_spiece_proto(tiny_spiece_model(), "test tokenizer")
    return GemmaTextEncoder(model.eval().requires_grad_(False), tokenizer, "random Gemma 3 (in memory)")


def build_components(args, device, dtype) -> LTX2Components:
    """Every LTX-2.0 module with random weights on `device` (real shapes, or the tiny test configs)."""
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2 import vocoder as vocoder_module
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d

    from mgpu_backend.models import tiny as T
    from mgpu_backend.models.text_projection import TextProjection

    if args.tiny:
        meta, vae, audio, voc, ups = (T.tiny_transformer_metadata("2.0"), T.tiny_vae_metadata(),
                                      T.tiny_audio_vae_metadata(), T.tiny_vocoder_metadata("2.0"),
                                      T.tiny_upsampler_metadata())
        text_features = T.TINY_TEXT_FEATURES
    else:
        meta, vae, audio, voc, ups = dict(LTX2_19B, num_layers=args.blocks), LTX2_VIDEO_VAE, {}, {}, {}
        text_features = 3840 * 49  # Gemma 3 12B: hidden 3840 × 49 hidden states
    voc_cls, voc_kwargs = configs.vocoder_kwargs(voc)
    from mgpu_backend.models.families import get_family

    return LTX2Components(
        family=get_family("2.0"),
        transformer=build_transformer(meta, device, dtype, fp8=args.fp8, seed=0),
        video_connector=_build(lambda: LTX2ConnectorTransformer1d(**configs.connector_kwargs(meta, audio=False)),
                               device, dtype, 1),
        audio_connector=_build(lambda: LTX2ConnectorTransformer1d(**configs.connector_kwargs(meta, audio=True)),
                               device, dtype, 2),
        text_projection=_build(lambda: TextProjection("single_linear", text_features, meta["caption_channels"]), device,
                               dtype, 3),
        video_vae=_build(lambda: AutoencoderKLLTX2Video(**configs.video_vae_kwargs(vae)), device, dtype, 4),
        audio_vae=_build(lambda: build_audio_vae(**configs.audio_vae_kwargs(audio)), device, dtype, 5),
        vocoder=_build(lambda: getattr(vocoder_module, voc_cls)(**voc_kwargs), device, torch.float32, 6),
        upsampler=_build(lambda: LTX2LatentUpsamplerModel(**configs.upsampler_kwargs(ups)), device, dtype, 7),
    )


# ---- instrumentation -------------------------------------------------------------------------------------------------

class TimedForward:
    """The one-process transformer forward (`LTX2Denoiser`'s default: the transformer with `LTX2AttnProcessor`),
    CUDA-synchronized and timed per stage; a non-finite output is replaced and counted."""

    def __init__(self, transformer, device):
        self.transformer, self.device = transformer, device
        self.transformer_blocks = transformer.transformer_blocks
        self.stage = None
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.nonfinite = 0

    def activate(self) -> None:
        use_processor(self.transformer, LTX2AttnProcessor())

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.nonfinite = 0

    def __call__(self, **kwargs):
        sync(self.device)
        start = time.perf_counter()
        video, audio = self.transformer(**kwargs)
        sync(self.device)
        self.seconds[self.stage] += time.perf_counter() - start
        self.calls[self.stage] += 1
        if not (torch.isfinite(video).all() and torch.isfinite(audio).all()):
            self.nonfinite += 1
            video, audio = (torch.nan_to_num(x, nan=0.0, posinf=1e4, neginf=-1e4) for x in (video, audio))
        return video, audio


class TimedPipeline(TwoStagePipeline):
    """`TwoStagePipeline` whose transformer stages run through a `TimedForward` (the recipe is untouched)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = TimedForward(self.components.transformer, self.device)

    def stage_env(self):
        return dataclasses.replace(super().stage_env(), forward=self.timer)

    def run_stage(self, spec, *args, **kwargs):
        self.timer.stage = spec.name
        return super().run_stage(spec, *args, **kwargs)


# ---- the run ----------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks built (forward times scaled to 48)")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--fps", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=S.default_steps("2.0"), help="stage-1 steps of the recipe")
    ap.add_argument("--stage1-steps", type=int, default=None,
                    help="stage-1 steps actually run (time scaled ×steps/K); default: all, unless over the budget")
    ap.add_argument("--stage1-budget", type=float, default=100.0,
                    help="seconds the timed stage 1 may take before a step subset is run instead")
    ap.add_argument("--fp8", action="store_true", help="transformer block Linears resident in fp8 (FP8Linear)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default=None,
                    help="also write the table to this file (the shipped H200 figures: bench/results/e2e_h200.txt)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny configs at 128×128×9")
    args = ap.parse_args(argv)
    quiet_diffusers()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.width, args.height, args.frames = 128, 128, 9
        torch.set_num_threads(min(2, torch.get_num_threads()))
    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    def write_results() -> None:
        out = args.out
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text("\n".join(lines) + "\n")
            print(f"written {out}")

    log(f"bench_e2e {datetime.datetime.now().isoformat(timespec='seconds')} on {device_name(device)} "
        f"(torch {torch.__version__}), {dtype}; command: {' '.join(sys.argv)}")

    # 1. build
    t = time.perf_counter()
    try:
        components = build_components(args, device, dtype)
        gemma = build_gemma(device, dtype, args.tiny)
    except Exception as exc:  # noqa: BLE001 - nothing else can run
        log(f"build failed: {type(exc).__name__}: {exc}")
        write_results()
        raise
    sync(device)
    blocks = len(components.transformer.transformer_blocks)
    parts = {**{n: tensor_bytes(m) for n, m in components.modules().items()}, "gemma": tensor_bytes(gemma.model)}
    fp8_note = " (fp8 block Linears)" if args.fp8 else ""
    log(f"built in {time.perf_counter() - t:.1f} s: transformer {blocks} blocks{fp8_note}"
        f", Gemma {gemma.num_layers} layers × {gemma.hidden_size}; "
        + ", ".join(f"{n} {b / GiB:.2f}" for n, b in parts.items()) + " GiB"
        + (f"; {torch.cuda.memory_allocated(device) / GiB:.1f} GiB allocated" if device.type == "cuda" else ""))
    pipeline = TimedPipeline(components, gemma, device=device, dtype=dtype)
    scale = 48 / blocks if not args.tiny else 1.0
    request = dict(prompt=PROMPT, width=args.width, height=args.height, frames=args.frames, fps=args.fps, seed=0)
    prompt_tokens = [len(gemma.tokenizer.prompt_ids(p)) for p in (PROMPT, GenerateRequest(prompt="").negative_prompt)]

    # 2. warm-up: two stage-1 steps (the second one estimates a warm step), the rest of the recipe whole
    per_step_estimate = None
    if not args.no_warmup:
        t = time.perf_counter()
        warm_steps: list[float] = []
        try:
            warm = pipeline.generate(GenerateRequest(**request, steps=2), progress=lambda stage, done, total: (
                warm_steps.append(time.perf_counter()) if stage == "stage 1" else None))
            per_step_estimate = warm_steps[1] - warm_steps[0]
            log(f"warm-up generation (2 stage-1 steps, the second {per_step_estimate:.2f} s) "
                f"{time.perf_counter() - t:.1f} s: "
                + ", ".join(f"{k} {v:.2f}" for k, v in warm.timings.items()) + " s")
            del warm
        except Exception as exc:  # noqa: BLE001 - the timed run is still attempted
            log(f"warm-up failed after {time.perf_counter() - t:.1f} s: {type(exc).__name__}: {exc}")
    if hasattr(pipeline.gemma, "clear_cache"):
        pipeline.gemma.clear_cache()  # the timed run encodes its prompts again
    full = args.steps
    k = args.stage1_steps or full
    if args.stage1_steps is None and per_step_estimate and per_step_estimate * full > args.stage1_budget:
        k = max(2, int(args.stage1_budget / per_step_estimate))
        log(f"stage 1: {full} steps would take ~{per_step_estimate * full:.0f} s (warm step {per_step_estimate:.2f} s)"
            f" > --stage1-budget {args.stage1_budget:g} s: running {k} steps, time scaled ×{full / k:.2f}")
    k = min(k, full)

    # 3. the timed generation
    pipeline.timer.reset()
    step_times: dict[str, list[float]] = defaultdict(list)

    def progress(stage, done, total):
        step_times[stage].append(time.perf_counter())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    result = None
    try:
        result = pipeline.generate(GenerateRequest(**request, steps=k), progress=progress)
    except Exception as exc:  # noqa: BLE001 - report what was measured until then
        log(f"timed generation failed after {time.perf_counter() - t:.1f} s: {type(exc).__name__}: {exc}")
        log("forwards so far: " + ", ".join(f"{s}: {pipeline.timer.calls[s]} in {pipeline.timer.seconds[s]:.2f} s"
                                             for s in pipeline.timer.calls))
        write_results()
        raise SystemExit(1)
    timings = dict(result.timings)
    peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None

    # 4. mux, as the CLI does
    try:
        frames, audio = result.frames, result.audio
        if not (torch.isfinite(frames).all() and torch.isfinite(audio).all()):
            log("decoded frames/audio not finite (random weights): replaced by nan_to_num before the mux")
            frames, audio = torch.nan_to_num(frames), torch.nan_to_num(audio)
        from mgpu_backend.media import write_mp4

        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            path = write_mp4(Path(tmp) / "e2e.mp4", frames, args.fps, audio, result.sample_rate)
            timings["mux"] = time.perf_counter() - t
            mp4_mib = path.stat().st_size / 2**20
    except Exception as exc:  # noqa: BLE001
        log(f"mux failed: {type(exc).__name__}: {exc}")
        mp4_mib = float("nan")

    # 5. report
    timer = pipeline.timer
    at48 = "" if args.tiny else " @48 blocks"
    rows = []
    for stage in STAGES:
        if stage not in timings:
            continue
        wall = timings[stage]
        fwd, calls = timer.seconds.get(stage, 0.0), timer.calls.get(stage, 0)
        scaled = wall - fwd + fwd * scale
        note = ""
        if stage == "text":
            note = (f"Gemma {'tiny' if args.tiny else '12B-shaped'}, 2 prompts ({prompt_tokens[0]} + "
                    f"{prompt_tokens[1]} test-tokenizer tokens), projection, connectors")
        elif stage == "stage 1":
            passes = calls / k if k else 0
            note = (f"{args.width // 2}×{args.height // 2}, {calls} forwards = {k} steps × {passes:g} passes, "
                    f"{fwd / max(calls, 1) * scale * 1000:.0f} ms per forward{at48}")
            if k != full:
                scaled *= full / k
                note += f"; ×{full}/{k} steps"
            note += f"; {scaled / full:.2f} s per step"
        elif stage == "stage 2":
            note = f"{args.width}×{args.height}, {calls} forwards (3 steps, no guidance), " \
                   f"{fwd / max(calls, 1) * scale * 1000:.0f} ms per forward{at48}"
        elif stage == "decode video":
            note = f"{args.frames} frames {args.width}×{args.height}, untiled, frames to the host"
        elif stage == "decode audio":
            note = f"{result.audio.shape[-1] / result.sample_rate:.2f} s at {result.sample_rate} Hz"
        elif stage == "mux":
            note = f"H.264 + AAC, {mp4_mib:.1f} MiB"
        rows.append((stage, wall, fwd if calls else None, scaled, note))
    total_wall = sum(r[1] for r in rows)
    total_scaled = sum(r[3] for r in rows)
    log()
    log(f"two-stage {args.frames} frames at {args.width}×{args.height} (stage 1 at {args.width // 2}×"
        f"{args.height // 2}), LTX-2.0 recipe: stage 1 {full} steps × {timer.calls['stage 1'] / max(k, 1):g} guidance "
        f"passes, stage 2 3 steps; transformer {blocks} blocks measured{' (fp8)' if args.fp8 else ''}; scaled column: "
        + ("no block scaling (tiny)" if args.tiny else "transformer forwards ×48/" + str(blocks))
        + (f", stage 1 ×{full}/{k} steps (ran {k})" if k != full else ""))
    log(f"{'stage':<13} {'measured s':>10} {'forwards s':>10} {'scaled s':>12}  note")
    for stage, wall, fwd, scaled, note in rows:
        log(f"{stage:<13} {wall:10.2f} {'' if fwd is None else f'{fwd:10.2f}':>10} {scaled:12.2f}  {note}")
    log(f"{'total':<13} {total_wall:10.2f} {'':>10} {total_scaled:12.2f}  (the pipeline's own total without the mux: "
        f"{timings.get('total', float('nan')):.2f} s measured)")
    if step_times.get("stage 1"):
        ts = step_times["stage 1"]
        gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
        if gaps:
            log(f"stage-1 step (measured, {blocks} blocks): median {gaps[len(gaps) // 2]:.3f} s, "
                f"min {gaps[0]:.3f}, max {gaps[-1]:.3f}")
    if timer.nonfinite:
        log(f"note: {timer.nonfinite} transformer outputs were non-finite and replaced (random weights)")
    if peak is not None:
        log(f"peak GPU memory allocated during the timed run: {peak:.1f} GiB ({blocks}-block transformer)")
    write_results()


if __name__ == "__main__":
    main()
