"""End-to-end two-stage generation on one GPU, seconds per stage, in the modes users run (issue 27): the baseline
the multi-GPU runs are divided by, and each transformer stage's achieved FLOP/s against the GPU's dense peak.

Every component is built directly in GPU memory with random weights at its real LTX-2.0 shape (nothing is read from
disk): the 19B-shaped transformer (`bench_memory.LTX2_19B`, bench_sp's config; `--blocks` of the 48), the text
connectors and the text projection (188160 -> 3840), the video VAE (the released `config.vae` layout), the audio
VAE and the HiFi-GAN vocoder (the released defaults of `models/configs.py`; vocoder in float32 as the loader keeps
it), the 2× latent upscaler, and a Gemma 3 12B-shaped text encoder (48 layers, hidden 3840, the config the loader
infers from a real 12B file; the project's small test tokenizer). Then the real `TwoStagePipeline.generate` runs
the reference recipe in this process: text encode (prompt + the default negative prompt) -> stage 1 at half size
(the LTX-2.0 scheduler, 40 steps, CFG + STG + modality guidance = 4 transformer passes per step) -> 2× latent
upscale -> stage 2 at full size (sigmas 0.909375, 0.725, 0.421875, 0: 3 steps, one forward each, audio frozen) ->
VAE decode -> audio VAE + vocoder decode; then `media.write_mp4` muxes H.264 + AAC (the CLI's last step).

Modes (`--modes eager,default,compiled,fp8,int8`, any subset, each in a process of its own (below) and printed side
by side; `e2e_modes.py` says exactly what each switches on):
- default: what the fleet runs — guidance passes batched into one forward, forwards replayed from CUDA graphs;
- compiled: default + the blocks compiled (torch.compile);
- fp8: default with fp8 block Linears and fp8 compute forced on (refused by name where it cannot run: CPU, GPUs
  before compute capability 8.9);
- int8: default with int8-convrot block Linears computed W8A8 (the LTX-2.5 templates' transformer format);
- eager: the former measurement — each forward timed alone through a wrapper: passes one at a time, no graphs.
  compiled is refused on CPU (`--tiny`); every refusal is printed with its reason, no mode falls back to another.
Stages are timed whole (CUDA-synchronized before and after the stage); forwards are counted (and, in eager mode
only, timed one by one). For each transformer stage: its model FLOPs (`mgpu_backend.engine.flops`: counted
from the shapes, each guidance pass as its own forward — STG without its block's self-attention, the isolated pass
without cross-modal attention), the achieved TFLOP/s = FLOPs / stage seconds, and its fraction of the GPU's dense
peak for the mode's matmul dtype (bf16 / fp8 / int8; `flops.dense_peak`, by `torch.cuda.get_device_name()`;
"unknown" for a GPU or dtype not in the table, and on CPU). Attention runs in bf16 in every mode, so the fp8 and
int8 fractions are of a mixed workload against the low-precision peak.

`--reference` adds Lightricks' reference beside each transformer stage: ltx-core's `LTXModel` forward (bf16,
eager, the same weights, bench_sp.py's `build_reference`) timed at the stage's shape, × the stage's unbatched
forward count. ltx-core's whole pipeline is not run (ltx-core 1.0.0 cannot run its Gemma text path on
transformers 5 nor LTX-2.5, docs/design/models.md#the-substrate-diffusers): only its transformer forward is.

`--preset ltx25-distilled`: the LTX-2.5 distilled template's transformer stages at the 22B shape (2.5 flags:
gated attention, 9-parameter AdaLN, prompt AdaLN, no video feed-forward bias): stage 1 at half size, 8 steps, stage 2
at full size, 3 steps, one forward per step (CFG 1), 1920×1088×121 by default, `--text-tokens` of context. Only the
transformer stages run (the engine's one forward, `model_forward.run`, on the same inputs every step): the 2.5 text
encoder (Gemma 4), upscaler and diffusion decoder are not built here (bench_diffusion_decode.py times the decoder).

Each mode runs in its own process (this script started again with `--modes <mode>`; the parent prints the modes
side by side), so a mode meets the GPU as a fleet worker does — what one mode leaves (graphs, converted weights,
the allocator's cache) does not weigh on the next — and the job's own memory plan (`protocol/job_memory.py`:
the text encoder moved off the GPU, a stage's batching or graphs given up, each with its cost) decides what runs;
its lines are printed as "engine: memory plan: …". `--in-process` runs the modes one after the other in one
process instead (the former behaviour; `--reference` implies it).

One warm-up generation (2 stage-1 steps) runs first in every mode, as a persistent fleet is warm (it pays the
compile and the graph captures); the Gemma prompt cache is cleared before the timed run. Scaling, labelled in the
output:
- blocks: a transformer stage's time at 48 blocks is `wall - forwards + forwards × 48/N` in eager mode (forwards
  timed); in the other modes the whole stage wall × 48/N (its forwards are not timed one by one). FLOP/s and the
  fraction are of the blocks built (FLOPs and time both of N blocks);
- stage-1 steps: with `--stage1-steps K` (or when the full count would exceed `--stage1-budget` seconds, estimated
  from the second warm-up step) K steps run and the stage-1 time is multiplied by steps/K.
Random weights can drive a latent out of range; any non-finite transformer output is replaced (nan_to_num, counted
and reported) so the pipeline's finite checks cannot end the run. The distilled LoRA of stage 2 is not fused (its
fuse + restore is bench_lora.py's figure).

    python bench/bench_e2e.py --blocks 48                      # one H200, the default mode: ~2 min
    python bench/bench_e2e.py --blocks 48 --modes eager,default,compiled,fp8,int8 --reference
    python bench/bench_e2e.py --blocks 48 --preset ltx25-distilled --modes default,compiled,fp8,int8
    python bench/bench_e2e.py --blocks 8                       # faster: transformer stages scaled ×6
    python bench/bench_e2e.py --tiny --modes eager,default,int8  # CPU smoke check (tiny configs, 128×128×9)
`--fp8` is `--modes fp8`. `--out FILE` also writes the output to FILE (the shipped H200 figures of the former eager
measurement: bench/results/e2e_h200.txt).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import subprocess
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

from mgpu_backend.engine import cuda_graphs as G  # noqa: E402
from mgpu_backend.engine import sampling as S  # noqa: E402
from mgpu_backend.engine.attention import LTX2AttnProcessor, use_processor  # noqa: E402
from mgpu_backend.models import configs  # noqa: E402
from mgpu_backend.models.loader import LTX2Components, build_audio_vae  # noqa: E402
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline  # noqa: E402
from mgpu_backend.engine import flops as FL  # noqa: E402

import e2e_modes as M  # noqa: E402

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = ("A red fox trots through fresh snow at dawn, its breath visible in the cold air; the camera tracks it low "
          "to the ground while birds call from the pine trees and the snow crunches under its paws.")
STAGES = ("text", "stage 1", "upscale", "stage 2", "decode video", "decode audio", "mux")


# ---- components --------------------------------------------------------------------------------------------------


def _enter_mode(mode: str, model, device, dtype, log) -> bool:
    """`e2e_modes.enter_mode` with its notes logged; False (logged, nothing run in its place) when the mode is
    refused on this device."""
    try:
        notes = M.enter_mode(mode, model, device, dtype)
    except M.ModeRefused as exc:
        log(f"[{mode}] {exc}")
        return False
    for note in notes:
        log(f"[{mode}] {note}")
    return True

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
    from mgpu_backend.testing.tiny import TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS
    from mgpu_backend.testing.tiny_gemma import tiny_spiece_model, tiny_text_config

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

    from mgpu_backend.testing import tiny as T
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
        transformer=build_transformer(meta, device, dtype, seed=0),
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

def _finite(video, audio, counter: list):
    """nan_to_num of a forward's outputs, non-finite outputs counted on the device (no host synchronisation)."""
    bad = (~torch.isfinite(video)).any() | (~torch.isfinite(audio)).any()
    counter.append(bad)
    return torch.nan_to_num(video, nan=0.0, posinf=1e4, neginf=-1e4), torch.nan_to_num(audio, nan=0.0, posinf=1e4,
                                                                                           neginf=-1e4)


class TimedForward:
    """The eager mode's forward: every `engine.forward.run` of the stages runs eagerly (`run_eager`, no CUDA graphs,
    under the stage's split), CUDA-synchronized and timed per stage, FLOPs counted; a non-finite output is replaced
    and counted. `installed()` puts it in place of `engine.forward.run` for a block."""

    def __init__(self, transformer, device, tally: M.FlopTally):
        self.transformer, self.device, self.tally = transformer, device, tally
        self.stage = None
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bad: list = []

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    @contextlib.contextmanager
    def installed(self):
        from mgpu_backend.engine import forward as model_forward

        original = model_forward.run

        def run(transformer, batch, semantics=model_forward.REFERENCE, split=None, options=model_forward.PLAIN,
                what="forward"):
            self.tally.count(transformer, batch, options)
            sync(self.device)
            start = time.perf_counter()
            video, audio = model_forward.run_eager(transformer, batch, semantics, split, options)
            sync(self.device)
            self.seconds[self.stage] += time.perf_counter() - start
            self.calls[self.stage] += 1
            return _finite(video, audio, self.bad)

        model_forward.run = run
        try:
            yield
        finally:
            model_forward.run = original


class TimedPipeline(TwoStagePipeline):
    """`TwoStagePipeline` whose stages are timed whole (synchronized before and after) and whose forwards are counted
    (`e2e_modes.FlopTally`); in the eager mode they run through a `TimedForward` (the recipe is untouched)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tally = M.FlopTally(FL.TransformerShape.of(self.components.transformer.config))
        self.timer = TimedForward(self.components.transformer, self.device, self.tally)
        self.mode = "default"
        self.stage_seconds: dict[str, float] = defaultdict(float)

    def run_stage(self, spec, *args, **kwargs):
        self.timer.stage = self.tally.stage = spec.name
        sync(self.device)
        start = time.perf_counter()
        result = super().run_stage(spec, *args, **kwargs)
        sync(self.device)
        self.stage_seconds[spec.name] += time.perf_counter() - start
        return result


def counting_forward(tally: M.FlopTally, bad: list):
    """`e2e_modes.counting_run` plus the non-finite replacement of `TimedForward`, for the modes without a wrapper."""
    from mgpu_backend.engine import forward as model_forward

    outer = M.counting_run(tally)

    class _Ctx:
        def __enter__(self):
            outer.__enter__()
            counted = model_forward.run

            def run(*a, **k):
                video, audio = counted(*a, **k)
                return _finite(video, audio, bad)

            model_forward.run = run
            self.counted = counted
            return self

        def __exit__(self, *exc):
            model_forward.run = self.counted
            return outer.__exit__(*exc)

    return _Ctx()


def nonfinite(bad: list) -> int:
    n = int(sum(int(b) for b in bad)) if bad else 0
    bad.clear()
    return n


# ---- reference ----------------------------------------------------------------------------------------------------

def reference_times(meta: dict, transformer, tally: M.FlopTally, device, dtype, log) -> dict[str, float]:
    """Seconds of one ltx-core `LTXModel` forward (same weights, bf16, eager) at each transformer stage's shape
    (the first forward's row 0); {} with a printed reason when ltx-core cannot be loaded or no bf16 mode ran yet."""
    if not tally.shapes:
        log("reference: not run — it is timed at the shapes a bf16 mode (eager / default / compiled) ran before the "
            "quantized ones, and none did")
        return {}
    try:
        from bench_sp import build_reference, reference_call

        lc, ref = build_reference(meta, device, dtype, weights_from=transformer)
    except Exception as exc:  # noqa: BLE001 - the bench goes on without the column
        log(f"reference: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        return {}
    out = {}
    for stage, shp in tally.shapes.items():
        row = shp.row
        kw = dict(hidden_states=row["video"], audio_hidden_states=row["audio"], timestep=row["video_timestep"],
                  audio_timestep=row["audio_timestep"], sigma=row["audio_cross_timestep"],
                  audio_sigma=row["video_cross_timestep"], video_coords=row["video_coords"],
                  audio_coords=row["audio_coords"], encoder_hidden_states=row["video_context"],
                  audio_encoder_hidden_states=row["audio_context"])
        try:
            call = reference_call(lc, ref, kw)
            with torch.no_grad():
                call()
                times = []
                for _ in range(3):
                    sync(device)
                    start = time.perf_counter()
                    call()
                    sync(device)
                    times.append(time.perf_counter() - start)
            out[stage] = sorted(times)[1]
        except Exception as exc:  # noqa: BLE001
            log(f"reference: {stage} forward failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- the two-stage run (preset ltx20-two-stage) -------------------------------------------------------------------

def run_mode(args, mode, pipeline: TimedPipeline, gemma, request, prompt_tokens, scale, device, log) -> dict:
    """One mode: warm-up generation, timed generation, mux; the per-stage table. Returns the stage rows."""
    blocks = len(pipeline.components.transformer.transformer_blocks)
    pipeline.mode = mode
    tally = pipeline.tally
    bad = pipeline.timer.bad
    ctx = counting_forward(tally, bad) if mode != "eager" else pipeline.timer.installed()
    per_step_estimate = None
    with ctx:
        if not args.no_warmup:
            t = time.perf_counter()
            warm_steps: list[float] = []
            try:
                warm = pipeline.generate(GenerateRequest(**request, steps=2), progress=lambda stage, done, total: (
                    warm_steps.append(time.perf_counter()) if stage == "stage 1" else None))
                per_step_estimate = warm_steps[1] - warm_steps[0]
                log(f"[{mode}] warm-up generation (2 stage-1 steps, the second {per_step_estimate:.2f} s) "
                    f"{time.perf_counter() - t:.1f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in warm.timings.as_dict().items())
                    + " s")
                del warm
            except Exception as exc:  # noqa: BLE001 - the timed run is still attempted
                log(f"[{mode}] warm-up failed after {time.perf_counter() - t:.1f} s: {type(exc).__name__}: {exc}")
        if hasattr(pipeline.gemma, "clear_cache"):
            pipeline.gemma.clear_cache()  # the timed run encodes its prompts again
        full = args.steps
        k = args.stage1_steps or full
        if args.stage1_steps is None and per_step_estimate and per_step_estimate * full > args.stage1_budget:
            k = max(2, int(args.stage1_budget / per_step_estimate))
            log(f"[{mode}] stage 1: {full} steps would take ~{per_step_estimate * full:.0f} s (warm step "
                f"{per_step_estimate:.2f} s) > --stage1-budget {args.stage1_budget:g} s: running {k} steps, time "
                f"scaled ×{full / k:.2f}")
        k = min(k, full)
        pipeline.timer.reset()
        tally.reset()
        pipeline.stage_seconds.clear()
        nonfinite(bad)
        step_times: dict[str, list[float]] = defaultdict(list)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        try:
            result = pipeline.generate(GenerateRequest(**request, steps=k),
                                       progress=lambda stage, done, total: step_times[stage].append(
                                           time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - report what was measured until then
            log(f"[{mode}] timed generation failed after {time.perf_counter() - t:.1f} s: {type(exc).__name__}: {exc}")
            return {}
    timings = result.timings.as_dict()
    peak_mem = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None
    try:  # mux, as the CLI does
        frames, audio = torch.nan_to_num(result.frames), torch.nan_to_num(result.audio)
        from mgpu_backend.stages.media import write_mp4

        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            path = write_mp4(Path(tmp) / "e2e.mp4", frames, args.fps, audio, result.sample_rate)
            timings["mux"] = time.perf_counter() - t
            mp4_mib = path.stat().st_size / 2**20
    except Exception as exc:  # noqa: BLE001
        log(f"[{mode}] mux failed: {type(exc).__name__}: {exc}")
        mp4_mib = float("nan")

    timer = pipeline.timer
    peak = FL.dense_peak(device_name(device), M.matmul_dtype(mode, pipeline.dtype))
    at48 = "" if args.tiny else " @48 blocks"
    rows = {}
    for stage in STAGES:
        if stage not in timings:
            continue
        wall = timings[stage]
        transformer_stage = stage in ("stage 1", "stage 2")
        fwd = timer.seconds.get(stage, 0.0) if mode == "eager" and transformer_stage else None
        synced = pipeline.stage_seconds.get(stage, wall)
        if transformer_stage:
            wall = synced
        scaled = (wall - fwd + fwd * scale) if fwd is not None else (wall * scale if transformer_stage else wall)
        note, rate, frac = "", "", ""
        calls, items = tally.calls.get(stage, 0), tally.items.get(stage, 0)
        if transformer_stage:
            rate, frac = M.rate_cells(tally.flops.get(stage, 0), wall, peak)
            shp = tally.shapes.get(stage)
            tokens = (f"{shp.video_tokens} video + {shp.audio_tokens} audio tokens, {shp.text_tokens} text, "
                      if shp else "")
        if stage == "text":
            note = (f"Gemma {'tiny' if args.tiny else '12B-shaped'}, 2 prompts ({prompt_tokens[0]} + "
                    f"{prompt_tokens[1]} test-tokenizer tokens), projection, connectors")
        elif stage == "stage 1":
            note = (f"{args.width // 2}×{args.height // 2}, {tokens}{items} passes = {k} steps × "
                    f"{items / max(k, 1):g} in {calls} forwards, {tally.flops.get(stage, 0):.6g} FLOP ({blocks} blocks)")
            if fwd is not None:
                note += f", {fwd / max(calls, 1) * scale * 1000:.0f} ms per forward{at48}"
            if k != full:
                scaled *= full / k
                note += f"; ×{full}/{k} steps"
            note += f"; {scaled / full:.2f} s per step"
        elif stage == "stage 2":
            note = (f"{args.width}×{args.height}, {tokens}{calls} forwards (3 steps, no guidance), "
                    f"{tally.flops.get(stage, 0):.6g} FLOP ({blocks} blocks)")
            if fwd is not None:
                note += f", {fwd / max(calls, 1) * scale * 1000:.0f} ms per forward{at48}"
        elif stage == "decode video":
            note = f"{args.frames} frames {args.width}×{args.height}, untiled, frames to the host"
        elif stage == "decode audio":
            note = f"{result.audio.shape[-1] / result.sample_rate:.2f} s at {result.sample_rate} Hz"
        elif stage == "mux":
            note = f"H.264 + AAC, {mp4_mib:.1f} MiB"
        rows[stage] = dict(wall=wall, fwd=fwd, scaled=scaled, note=note, rate=rate, frac=frac, items=items,
                           steps=k, full=full)
    total_wall = sum(r["wall"] for r in rows.values())
    total_scaled = sum(r["scaled"] for r in rows.values())
    log()
    log(f"[{mode}] two-stage {args.frames} frames at {args.width}×{args.height} (stage 1 at {args.width // 2}×"
        f"{args.height // 2}), LTX-2.0 recipe: stage 1 {full} steps, stage 2 3 steps; transformer {blocks} blocks; "
        f"scaled column: " + ("no block scaling" if scale == 1 else f"transformer stages ×48/{blocks}")
        + (f", stage 1 ×{full}/{k} steps (ran {k})" if k != full else "") + f"; peak: {peak.describe()}")
    log(f"{'stage':<13} {'measured s':>10} {'forwards s':>10} {'scaled s':>9} {'TFLOP/s':>8} {'of peak':>8}  note")
    for stage, r in rows.items():
        fwd_cell = "" if r["fwd"] is None else f"{r['fwd']:10.2f}"
        log(f"{stage:<13} {r['wall']:10.2f} {fwd_cell:>10} {r['scaled']:9.2f} {r['rate']:>8} {r['frac']:>8}  "
            f"{r['note']}")
    log(f"{'total':<13} {total_wall:10.2f} {'':>10} {total_scaled:9.2f}  (the pipeline's own total without the mux: "
        f"{timings.get('total', float('nan')):.2f} s measured)")
    if step_times.get("stage 1"):
        ts = step_times["stage 1"]
        gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
        if gaps:
            log(f"[{mode}] stage-1 step (measured, {blocks} blocks): median {gaps[len(gaps) // 2]:.3f} s, "
                f"min {gaps[0]:.3f}, max {gaps[-1]:.3f}")
    for line in result.rank_reports[0].speed if result.rank_reports else []:
        log(f"[{mode}] engine: {line}")
    bad_n = nonfinite(bad)
    if bad_n:
        log(f"[{mode}] note: {bad_n} transformer outputs were non-finite and replaced (random weights)")
    if peak_mem is not None:
        log(f"[{mode}] peak GPU memory allocated during the timed run: {peak_mem:.1f} GiB ({blocks}-block transformer)")
    return rows


def run_two_stage(args, modes, device, dtype, log) -> dict:
    t = time.perf_counter()
    components = build_components(args, device, dtype)
    gemma = build_gemma(device, dtype, args.tiny)
    sync(device)
    blocks = len(components.transformer.transformer_blocks)
    parts = {**{n: tensor_bytes(m) for n, m in components.modules().items()}, "gemma": tensor_bytes(gemma.model)}
    log(f"built in {time.perf_counter() - t:.1f} s: transformer {blocks} blocks, Gemma {gemma.num_layers} layers × "
        f"{gemma.hidden_size}; " + ", ".join(f"{n} {b / GiB:.2f}" for n, b in parts.items()) + " GiB"
        + (f"; {torch.cuda.memory_allocated(device) / GiB:.1f} GiB allocated" if device.type == "cuda" else ""))
    pipeline = TimedPipeline(components, gemma, device=device, dtype=dtype)
    scale = 48 / blocks if not args.tiny else 1.0
    request = dict(prompt=PROMPT, width=args.width, height=args.height, frames=args.frames, fps=args.fps, seed=0)
    prompt_tokens = [len(gemma.tokenizer.prompt_ids(p)) for p in (PROMPT, GenerateRequest(prompt="").negative_prompt)]
    from mgpu_backend.testing.tiny import tiny_transformer_metadata

    meta = tiny_transformer_metadata("2.0") if args.tiny else dict(LTX2_19B, num_layers=blocks)
    results, refs = {}, None
    for mode in modes:
        if args.reference and refs is None and mode in ("fp8", "int8"):
            refs = reference_times(meta, components.transformer, pipeline.tally, device, dtype, log)
        if not _enter_mode(mode, components.transformer, device, dtype, log):
            results[mode] = None
            continue
        try:
            results[mode] = run_mode(args, mode, pipeline, gemma, request, prompt_tokens, scale, device, log)
        finally:
            M.leave_mode(mode, components.transformer)
    if args.reference and refs is None:
        if any(m in ("fp8", "int8") for m in modes):
            refs = {}
        else:
            refs = reference_times(meta, components.transformer, pipeline.tally, device, dtype, log)
    summary(results, refs or {}, pipeline.tally, scale, log, args.reference)
    return results


def summary(results: dict, refs: dict, tally: M.FlopTally, scale: float, log, reference: bool) -> None:
    """The modes side by side: seconds (scaled column) per stage, the transformer stages' fraction of peak, and the
    reference column."""
    ran = {m: r for m, r in results.items() if r}
    if not results:
        return
    log()
    log("modes side by side (scaled s; transformer stages: s / TFLOP/s / fraction of the mode's dense peak)")
    header = f"{'stage':<13}" + "".join(f" {m:>26}" for m in results)
    if reference:
        header += f" {'reference (ltx-core)':>22}"
    log(header)
    stages = list(dict.fromkeys(s for r in ran.values() for s in r))
    for stage in stages:
        line = f"{stage:<13}"
        for r in results.values():
            if r is None:
                cell = "refused"
            elif stage not in r:
                cell = ""
            else:
                c = r[stage]
                cell = f"{c['scaled']:.2f}" + (f" / {c['rate']} / {c['frac']}" if c["rate"] else "")
            line += f" {cell:>26}"
        if reference:
            cell = ""
            if stage in refs and ran:
                any_rows = next(iter(ran.values()))
                c = any_rows.get(stage)
                if c:
                    forwards = c["items"] * (c["full"] / c["steps"] if stage == "stage 1" else 1)
                    est = refs[stage] * forwards * scale
                    cell = f"{est:.2f} ({refs[stage] * 1000:.0f} ms × {forwards:g})"
            line += f" {cell:>22}"
        log(line)
    cells = ["refused" if r is None else f"{sum(c['scaled'] for c in r.values()):.2f}" for r in results.values()]
    log(f"{'total':<13}" + "".join(f" {c:>26}" for c in cells))
    if reference:
        log("reference column: ltx-core's LTXModel forward (compute dtype, eager, same weights) at the stage's shape × the "
            "stage's unbatched forward count (scaled like the others); ltx-core's whole pipeline is not run (its "
            "1.0.0 Gemma path does not run on transformers 5, docs/design/models.md#the-substrate-diffusers)")


# ---- the LTX-2.5 distilled transformer stages (preset ltx25-distilled) --------------------------------------------

def ltx25_inputs(model, frames, width, height, fps, text_tokens, device, dtype):
    """The one forward's `TokenBatch` of one distilled-stage forward at this size, by the reference denoiser's input
    rules (`denoiser.LTX2Denoiser.token_batch`: per-token timesteps, sigma 0.9 × 1000 on both streams, the
    cross-attention inputs from the other stream's sigma; random latents and contexts, every text token attended)."""
    from mgpu_backend.engine import latents as L
    from mgpu_backend.engine.tokens import TokenBatch

    f, h, w = L.latent_frames(frames), height // 32, width // 32
    n = f * h * w
    ta = L.audio_latent_frames(frames, fps)
    cfg = model.config
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    video, audio = rnd(1, n, cfg.in_channels), rnd(1, ta, cfg.audio_in_channels)
    video_context = rnd(1, text_tokens, cfg.cross_attention_dim)
    audio_context = rnd(1, text_tokens, cfg.audio_cross_attention_dim)
    sigma = torch.tensor([900.0], device=device)
    factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
    prompt = sigma if getattr(cfg, "use_prompt_adaln_single", False) else None
    bias = torch.zeros(1, 1, 1, text_tokens, device=device, dtype=dtype)  # every text token attended
    return TokenBatch(
        video=video, audio=audio, video_timestep=torch.full((1, n), 900.0, device=device),
        audio_timestep=torch.full((1, ta), 900.0, device=device), video_cross_timestep=sigma,
        audio_cross_timestep=sigma, a2v_gate_timestep=sigma * factor, v2a_gate_timestep=sigma * factor,
        video_coords=L.video_coords(model, 1, f, h, w, fps, device=device),
        audio_coords=L.audio_coords(model, 1, ta, device=device), video_context=video_context,
        audio_context=audio_context, video_prompt_timestep=prompt, audio_prompt_timestep=prompt,
        video_text_bias=bias, audio_text_bias=bias)


def run_ltx25(args, modes, device, dtype, log) -> dict:
    from mgpu_backend.engine import forward as model_forward
    from mgpu_backend.models.families import get_family
    from mgpu_backend.testing.tiny import tiny_transformer_metadata

    family = get_family("2.5")
    meta = tiny_transformer_metadata("2.5") if args.tiny else {**LTX2_19B, **family.transformer_flags,
                                                                "num_layers": args.blocks}
    t = time.perf_counter()
    model = build_transformer(meta, device, dtype, seed=0)
    use_processor(model, LTX2AttnProcessor())
    blocks = len(model.transformer_blocks)
    scale = 48 / blocks if not args.tiny else 1.0
    sync(device)
    widths = "tiny widths" if args.tiny else "22B widths"
    log(f"built in {time.perf_counter() - t:.1f} s: LTX-2.5-shaped transformer ({widths}, 2.5 flags), {blocks} "
        f"blocks, {tensor_bytes(model) / GiB:.2f} GiB; {args.text_tokens} text tokens; the keyframe embedding is "
        "not built (one add on the frame-0 tokens)")
    steps = {"stage 1": len(family.recipe.stage1_sigmas) - 1, "stage 2": len(family.recipe.stage2_sigmas) - 1}
    sizes = {"stage 1": (args.width // 2, args.height // 2), "stage 2": (args.width, args.height)}
    batches = {}
    for stage, (w, h) in sizes.items():
        batches[stage] = ltx25_inputs(model, args.frames, w, h, args.fps, args.text_tokens, device, dtype)
    tally = M.FlopTally(FL.TransformerShape.of(model.config))
    if args.reference:
        log("reference: no column — ltx-core 1.0.0 (Lightricks' reference) cannot run LTX-2.5 "
            "(docs/design/models.md#the-substrate-diffusers)")
    results = {}
    for mode in modes:
        if not _enter_mode(mode, model, device, dtype, log):
            results[mode] = None
            continue
        peak = FL.dense_peak(device_name(device), M.matmul_dtype(mode, dtype))
        rows = {}
        try:
            for stage, batch in batches.items():
                tally.stage = stage
                forward = (lambda b=batch: model_forward.run_eager(model, b)) if mode == "eager" else \
                    (lambda b=batch: model_forward.run(model, b))
                with torch.no_grad():
                    t = time.perf_counter()
                    for _ in range(2):  # warm-up: compile, then the graph capture
                        forward()
                    sync(device)
                    warm = time.perf_counter() - t
                    tally.reset()
                    per_forward = []
                    sync(device)
                    start = time.perf_counter()
                    for _ in range(steps[stage]):
                        tally.count(model, batch, model_forward.PLAIN)
                        if mode == "eager":
                            sync(device)
                            t = time.perf_counter()
                            forward()
                            sync(device)
                            per_forward.append(time.perf_counter() - t)
                        else:
                            forward()
                    sync(device)
                    wall = time.perf_counter() - start
                rate, frac = M.rate_cells(tally.flops[stage], wall, peak)
                w, h = sizes[stage]
                rows[stage] = dict(wall=wall, fwd=sum(per_forward) if per_forward else None, scaled=wall * scale,
                                   rate=rate, frac=frac, items=steps[stage], steps=steps[stage], full=steps[stage],
                                   note=f"{w}×{h}×{args.frames}, {batch.video_tokens:,} video + "
                                        f"{batch.audio.shape[1]} audio tokens, {steps[stage]} forwards, "
                                        f"{tally.flops[stage]:.6g} FLOP ({blocks} blocks); warm-up "
                                        f"{warm:.1f} s")
        except Exception as exc:  # noqa: BLE001 - the other modes still run
            log(f"[{mode}] failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        finally:
            M.leave_mode(mode, model)
        results[mode] = rows
        log()
        log(f"[{mode}] LTX-2.5 distilled transformer stages, {blocks} blocks; scaled column ×48/{blocks}"
            if scale != 1 else f"[{mode}] LTX-2.5 distilled transformer stages, {blocks} blocks (tiny)")
        log(f"{'stage':<13} {'measured s':>10} {'scaled s':>9} {'TFLOP/s':>8} {'of peak':>8}  note ({peak.describe()})")
        for stage, r in rows.items():
            log(f"{stage:<13} {r['wall']:10.2f} {r['scaled']:9.2f} {r['rate']:>8} {r['frac']:>8}  {r['note']}")
        report = G.report(model)
        if report:
            log(f"[{mode}] engine: {report}")
    summary(results, {}, tally, scale, log, False)
    return results


# ---- main ---------------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", "--mode", dest="modes", default="default",
                    help=f"comma-separated, any of {', '.join(M.MODES)} (run in that order; default: default)")
    ap.add_argument("--preset", choices=("ltx20-two-stage", "ltx25-distilled"), default="ltx20-two-stage",
                    help="ltx20-two-stage: the whole LTX-2.0 two-stage pipeline (19B shape); ltx25-distilled: the "
                         "LTX-2.5 distilled template's transformer stages (22B shape, 8 + 3 steps, 1920×1088 default)")
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks built (times scaled to 48)")
    ap.add_argument("--width", type=int, default=None, help="default 1280 (ltx20-two-stage) / 1920 (ltx25-distilled)")
    ap.add_argument("--height", type=int, default=None, help="default 704 / 1088")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--fps", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=S.default_steps("2.0"), help="stage-1 steps of the LTX-2.0 recipe")
    ap.add_argument("--stage1-steps", type=int, default=None,
                    help="stage-1 steps actually run (time scaled ×steps/K); default: all, unless over the budget")
    ap.add_argument("--stage1-budget", type=float, default=100.0,
                    help="seconds the timed stage 1 may take before a step subset is run instead")
    ap.add_argument("--text-tokens", type=int, default=1024, help="text context length (ltx25-distilled)")
    ap.add_argument("--fp8", action="store_true", help="the same as --modes fp8")
    ap.add_argument("--reference", action="store_true",
                    help="time ltx-core's transformer forward at each stage's shape (ltx20-two-stage)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default=None, help="also write the output to this file")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny configs at 128×128×9")
    ap.add_argument("--in-process", action="store_true",
                    help="run several modes one after the other in this process (default: one process per mode)")
    ap.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)  # a child's results, for its parent
    args = ap.parse_args(argv)
    modes = M.parse_modes("fp8" if args.fp8 else args.modes)
    if len(modes) > 1 and not (args.in_process or args.reference):
        run_children(sys.argv[1:] if argv is None else list(argv), modes, args.out)
        return
    ltx25 = args.preset == "ltx25-distilled"
    args.width = args.width or (1920 if ltx25 else 1280)
    args.height = args.height or (1088 if ltx25 else 704)
    quiet_diffusers()
    # each job's memory plan with its figures as it is decided (also when the job then fails)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("ltx2_mgpu.pipeline").setLevel(logging.INFO)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.width, args.height, args.frames = 128, 128, 9
        args.text_tokens = min(args.text_tokens, 16)
        torch.set_num_threads(min(2, torch.get_num_threads()))
    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    def write_results() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("\n".join(lines) + "\n")
            print(f"written {args.out}")

    log(f"bench_e2e {datetime.datetime.now().isoformat(timespec='seconds')} on {device_name(device)} "
        f"(torch {torch.__version__}), {dtype}; modes {', '.join(modes)}; preset {args.preset}; command: "
        f"{' '.join(sys.argv)}")
    try:
        results = (run_ltx25 if ltx25 else run_two_stage)(args, modes, device, dtype, log)
        if args.rows_json:
            Path(args.rows_json).write_text(json.dumps(results))
    finally:
        write_results()


def _child_argv(argv: list[str], mode: str, rows_json: str) -> list[str]:
    """`argv` without its mode and output options, for one mode's process."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--modes", "--mode", "--out"):
            skip = True
        elif not (a.startswith(("--modes=", "--mode=", "--out=")) or a == "--fp8"):
            out.append(a)
    return out + ["--modes", mode, "--rows-json", rows_json]


def run_children(argv: list[str], modes: list[str], out: str | None) -> None:
    """Each mode in its own process (streamed output), then the modes side by side (`summary`)."""
    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            rows = Path(tmp) / "rows.json"
            cmd = [sys.executable, os.path.abspath(__file__), *_child_argv(argv, mode, str(rows))]
            log(f"== mode {mode}: a process of its own")
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
                for line in proc.stdout:
                    log(line.rstrip("\n"))
            results[mode] = json.loads(rows.read_text()).get(mode) if rows.exists() else {}
            if proc.returncode:
                log(f"[{mode}] its process ended with exit status {proc.returncode}")
    summary(results, {}, None, 1.0, log, False)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("\n".join(lines) + "\n")
        print(f"written {out}")


if __name__ == "__main__":
    main()
