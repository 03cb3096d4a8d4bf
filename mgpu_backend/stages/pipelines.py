"""The two-stage LTX-2 audio+video pipeline in one process (the reference recipe, Lightricks `ti2vid_two_stages`).

prompt + negative prompt -> Gemma hidden states -> feature extractor (CONDITIONING, docs/design/comfyui-types.md) ->
stage 1 at half width/height (LTX-2 scheduler sigmas, Euler, CFG with rescale + STG + modality guidance) ->
2× latent upscale -> stage 2 with the distilled LoRA fused, no guidance, sigmas 0.909375, 0.725, 0.421875, 0,
audio frozen (the clean stage-1 audio latent is context at audio timestep 0) -> VAE decode -> frames; audio decoded
from the stage-1 audio latent. Image-to-video conditions the first latent frame through the denoise mask (strength
0..1) in both stages.

Each stage is a `stage.StageSpec` (semantics "reference": this is Lightricks' recipe, not ComfyUI's sampler — the
nodes run theirs) run by the runner the fleet's plan chooses (`stage.run_stage`: one device, sequence parallel,
guidance passes in parallel, tiled), so the recipe does not change with the split.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine import cuda_graphs as G
from ..engine import latents as L
from ..engine import sampling as S
from ..protocol import job_memory as PJ
from ..protocol import validation as V
from ..engine.denoiser import speed_report, text_contexts
from ..weights.lora import LoRAFuser, LoRAReport, read_lora, read_loras
from ..weights.sharding import sharding_of
from ..models.diffusion_decoder import denormalize
from ..models.neighborhood import plain_fallback
from ..models.loader import LTX2Components
from ..protocol.fleet_config import FleetIdentity
from ..splits.decode import check_decodable, decode_tiles, decode_untiled, is_diffusion_decoder
from ..splits.tiled import DEFAULT_MAX_FIRST_SIGMA
from ..splits.tiling import TileCountConfig, split_axis
from ..protocol.job_requests import DEFAULT_NEGATIVE_PROMPT  # noqa: F401 (the requests' default, re-exported)
from ..protocol.job_results import DecodeReport, GenerateTimings, RankReport
from ..engine.semantics import REFERENCE
from . import job_memory as JM
from .stage import DECODE_TILES, CancelFn, ProgressFn, SamplerSpec, StageEnv, StageHooks, StageLimits, StageResult, StageSpec, TiledRunner, resolve_tiling, run_stage

log = logging.getLogger("ltx2_mgpu.pipeline")


PIPELINES = ("two-stage", "distilled")
SAMPLERS = ("euler", "euler_ancestral")


@dataclass(frozen=True)
class GenerateRequest:
    """One text/image-to-audio+video generation (the "generate" job's request). Sizes in pixels, fps in frames per
    second."""

    prompt: str
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    width: int = 768
    height: int = 512
    frames: int = 121
    fps: float = 24.0
    steps: int | None = None  # stage-1 steps; None = reference default for the model version
    seed: int = 0
    image: str | None = None  # first-frame image for image-to-video
    image_strength: float = 1.0
    video_guidance: S.GuidanceParams | None = None  # None = reference defaults for the model version
    audio_guidance: S.GuidanceParams | None = None
    stage2_sigmas: tuple[float, ...] | None = None  # None: the family's (2.0/2.3: 0.909375, 0.725, 0.421875, 0;
    # 2.5: 0.85, 0.725, 0.4219, 0) — or 0.625, 0.4, 0 tiled
    distilled_lora: tuple[str, float] | None = None  # fused for stage 2 only
    loras: tuple[tuple[str, float], ...] = ()  # user LoRAs (path, strength), fused for both stages
    pipeline: str | None = None  # "two-stage", "distilled" (a distilled checkpoint, SP on both stages, no guidance)
    # or None: the model family's recipe (2.0 / 2.3: two-stage; 2.5: distilled, ComfyUI's video_ltx2_5_t2v)
    sampler: str | None = None  # "euler" / "euler_ancestral" on both stages; None: the family's recipe
    tiles: TileCountConfig | None = None  # stage-2 TDP tiles; None: balanced grid from the fleet size (1 rank: none)
    tile_overlap: int = 5  # latent cells, for the default grid
    decode_tiles: TileCountConfig | None = None  # decode tiles; None: balanced grid from the fleet size
    decode_overlap: int = 2  # latent cells (× 32 px), for the default grid
    tdp_max_first_sigma: float = DEFAULT_MAX_FIRST_SIGMA

    def validate(self) -> None:
        """Raise `ValidationError` naming the value and the rule (before any work)."""
        if self.pipeline is not None and self.pipeline not in PIPELINES:
            raise V.ValidationError(f"pipeline={self.pipeline!r}: choose one of {', '.join(PIPELINES)}")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise V.ValidationError(f"sampler={self.sampler!r}: choose one of {', '.join(SAMPLERS)}")
        V.check_frames(self.frames)
        V.check_size(self.width, self.height, two_stage=True)
        V.check_positive("fps", self.fps)
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise V.ValidationError(f"steps={self.steps}: must be a positive integer")
        V.check_unit_interval("image_strength", self.image_strength)
        if self.image is not None:
            V.check_image(self.image)
        for name in ("tile_overlap", "decode_overlap"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise V.ValidationError(f"{name}={getattr(self, name)}: must be a non-negative number of latent cells")
        if self.distilled_lora is not None:
            V.check_file("distilled LoRA", self.distilled_lora[0])
        for path, strength in self.loras:
            V.check_file("LoRA", path)
            if not (isinstance(strength, (int, float)) and math.isfinite(strength)):
                raise V.ValidationError(f"LoRA {path}: strength {strength!r} must be a finite number")
        if self.stage2_sigmas is not None:
            try:
                S.as_sigmas(self.stage2_sigmas)
            except ValueError as exc:
                raise V.ValidationError(f"stage2_sigmas={list(self.stage2_sigmas)}: {exc}") from None


@dataclass
class GenerateResult:
    """frames: `[F, H, W, 3]` float32 in 0..1; audio: `[C, S]` float32 in -1..1 at `sample_rate` Hz;
    video_latent `[1, 128, F', H', W']` / audio_latent `[1, 8, T, 16]` (normalized model space, CPU);
    timings: this rank's `GenerateTimings`; lora_reports: coverage of every fused LoRA, per stage
    (`LoRAReport.stage`); parallel_report: the job's parallel summary; rank_reports: what every rank did (rank 0 of a
    fleet — None on the other ranks —; one entry in one process)."""

    frames: torch.Tensor
    audio: torch.Tensor
    sample_rate: int
    video_latent: torch.Tensor
    audio_latent: torch.Tensor
    timings: GenerateTimings = field(default_factory=GenerateTimings)
    lora_reports: list[LoRAReport] = field(default_factory=list)
    parallel_report: str = "one process"
    rank_reports: list[RankReport] | None = None


def _parallel_summary(report: RankReport, distilled: bool) -> str:
    """The job header: how stage 1 was split, and stage 2 too when it is also a split stage (distilled preset) that
    was split differently."""
    def named(stage: str) -> str:
        text = report.stage_1 if stage == "stage 1" else report.stage_2
        return text if text.startswith(f"{stage}:") else f"{stage}: {text}"
    if not distilled or report.stage_2 == report.stage_1:
        return report.stage_1
    return f"{named('stage 1')}; {named('stage 2')}"


def _weights_line(transformer) -> str:
    """Where the transformer's weights are on this rank (`ShardingReport.describe`); "" when no fleet placed them."""
    report = sharding_of(transformer)
    return report.describe() if report is not None else ""


@contextmanager
def _timed(timings: dict[str, float], key: str):
    """`timings[key]`: the seconds the block took (set when it finishes)."""
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


@dataclass(frozen=True)
class GenerateJob:
    """A `GenerateRequest` resolved against the model's recipe and the fleet (`TwoStagePipeline.plan_job`): the
    latent grids (frames; stage 1 h1 × w1, stage 2 h2 × w2), guidance, sampler, sigmas, tiles and LoRAs per stage."""

    distilled: bool
    sampler: str
    video_guidance: S.GuidanceParams
    audio_guidance: S.GuidanceParams
    frames: int
    h1: int
    w1: int
    h2: int
    w2: int
    stage2_tiling: TileCountConfig | None
    decode_tiling: TileCountConfig | None
    sigmas1: torch.Tensor
    sigmas2: torch.Tensor
    stage1_loras: tuple
    stage2_loras: tuple


def check_upscale_size(upsampler, grid: tuple[int, int, int]) -> None:
    """Refuse a video latent of `grid` (frames, height, width) cells too small for the latent upscaler, before it
    runs: its first GroupNorm (on the input size, `initial_norm`) normalizes each group over (channels per group) x
    F x H x W values and needs at least 2 (torch raises "Expected more than 1 value per channel" inside the forward
    otherwise). The released upscalers (1024 or 512 channels in 32 groups) take any latent; one with one channel per
    group (the tiny test models) needs 2 cells. Raises ValidationError naming the size and the rule."""
    norm = getattr(upsampler, "initial_norm", None)
    if not isinstance(norm, torch.nn.GroupNorm):
        return
    per_group = norm.num_channels // norm.num_groups
    cells = math.prod(grid)
    if per_group * cells < 2:
        need = math.ceil(2 / per_group)
        raise V.ValidationError(
            f"upscale: the video latent is {'x'.join(map(str, grid))} cells (frames x height x width): {cells} "
            f"value(s) per group of the latent upscaler's first group norm ({norm.num_groups} groups of "
            f"{per_group} channel(s)); it needs at least 2, so a latent of at least {need} cells (e.g. 2 latent "
            f"frames = 9 frames, or 2 cells = 64 px in height or width)")


class TwoStagePipeline:
    """Runs `GenerateRequest`s on loaded components and a Gemma encoder, in one process.

    Args:
        components: `LTX2Components` (the transformer and VAEs, on `device`).
        gemma: a `GemmaTextEncoder` (anything with `.encode(prompts) -> (hidden [B,T,H,L], mask [B,T])`).
        dtype: compute dtype of the transformer forward (bf16 on GPU, float32 on CPU for exact tests).
        plan: how the stages split over a fleet (`parallel.plan.ParallelPlan`); None runs everything here.
    """

    def __init__(self, components: LTX2Components, gemma, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, plan=None):
        self.plan = plan  # a parallel.plan.ParallelPlan on a fleet; None in one process
        self.components = components
        self.gemma = gemma
        self.device = torch.device(device)
        self.dtype = dtype
        # on a fleet the ranks fuse together: each computes its share of the layers and keeps their clean weights
        self.lora = (LoRAFuser(components.transformer) if plan is None else
                     LoRAFuser(components.transformer, rank=plan.rank, world_size=plan.world_size))
        self.batch_notes: dict[str, str] = {}  # stage -> how its guidance passes ran (this job; job report "speed")

    # ---- text ----------------------------------------------------------------------------------------------------

    def text_service(self):
        """The text service (stages/text_encoder.py: one prompt per forward, prompt cache, the fleet's Gemma mode);
        a bare `GemmaTextEncoder` is wrapped in a one-process service on first use."""
        if not hasattr(self.gemma, "encode_embeds"):
            from .text_encoder import TextEncoderService

            self.gemma = TextEncoderService.wrap(self.gemma, self.components.text_projection)
        return self.gemma

    def encode_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        """Prompts -> CONDITIONING embeddings `[1, T_i, C]` each (valid tokens only, as ComfyUI stores them), through
        the text service (`text_service`)."""
        return self.text_service().encode_embeds(prompts, strict=False)

    # ---- stages ----------------------------------------------------------------------------------------------------

    def _conditioning_latent(self, image: str, strength: float, frames_lat: int, height: int, width: int):
        """Encode the first-frame image at (height, width); returns (clean first-frame latent tokens placed in a
        full zero latent [1, T, 128], per-token denoise mask [1, T])."""
        from .media import load_image

        vae = self.components.video_vae
        param = next(vae.parameters())
        pixels = load_image(image, width=width, height=height).to(param.device, param.dtype).unsqueeze(2)
        with torch.no_grad():
            first = vae.encode(pixels).latent_dist.mode()  # [1, 128, 1, h, w]
        first = L.normalize_latents(first.float(), vae.latents_mean.float(), vae.latents_std.float())
        clean = torch.zeros(1, 128, frames_lat, height // 32, width // 32)
        clean[:, :, :1] = first.cpu()
        mask = L.image_conditioning_mask(1, frames_lat, strength)
        return L.pack_video(clean), L.video_token_mask(mask, 1, frames_lat, height // 32, width // 32)

    def native_engine(self):
        """This rank's `native.NativeEngine` (ComfyUI's forward: stages with semantics "comfyui" and the native
        MODEL's forward job), made on first use and kept; it shares this pipeline's LoRA fuser."""
        if getattr(self, "_native", None) is None:
            from .native import NativeEngine

            self._native = NativeEngine(self.components, self.plan, self.dtype, self.device, lora=self.lora)
        return self._native

    def use_plan(self, plan) -> None:
        """Run the next jobs under `plan` (a `ParallelPlan` of the same fleet's groups under a job's policy:
        `WorkerState.apply_policy`), here and in the native engine; the plan itself is a frozen value."""
        self.plan = plan
        if getattr(self, "_native", None) is not None:
            self._native.plan = plan

    def stage_env(self, batch_mode: str = "auto") -> StageEnv:
        """What this pipeline's stages run on (`stage.StageEnv`)."""
        return StageEnv(self.components, self.dtype, self.device, self.plan, native=self.native_engine,
                        batch_mode=batch_mode)

    def run_stage(self, spec: StageSpec, progress: ProgressFn | None = None,
                  cancel_check: CancelFn | None = None, batch_mode: str = "auto") -> StageResult:
        """Run one stage (`stage.run_stage`: the plan's runner) and keep how its guidance passes ran for the job
        report. `cancel_check(stage, step, group)` runs before every step on the ranks that run it; `batch_mode`:
        the guidance passes' batching (`denoiser.BATCH_MODES`; "off" where the job's memory plan says so)."""
        result = run_stage(spec, self.stage_env(batch_mode), StageHooks(progress, cancel_check))
        if result.batch_note is not None:
            self.batch_notes[spec.name] = result.batch_note
        return result

    def upscale(self, video_latent: torch.Tensor) -> torch.Tensor:
        """2× spatial latent upscale `[1, 128, F, H, W] -> [1, 128, F, 2H, 2W]` (model space in and out): the
        upsampler works on VAE-space latents (diffusers `LTX2LatentUpsamplePipeline`)."""
        upsampler = self.components.upsampler
        if upsampler is None:
            raise V.ValidationError("the two-stage pipeline needs a latent upscaler file (--upscaler)")
        check_upscale_size(upsampler, tuple(video_latent.shape[2:]))
        vae = self.components.video_vae
        mean, std = vae.latents_mean.float().cpu(), vae.latents_std.float().cpu()
        param = next(upsampler.parameters())
        with torch.no_grad():
            x = L.denormalize_latents(video_latent.float(), mean, std).to(param.device, param.dtype)
            x = upsampler(x).float().cpu()
        return L.normalize_latents(x, mean, std)

    def decode_video(self, video_latent: torch.Tensor, seed: int = 0, tiling: TileCountConfig | None = None,
                     overlap: int = 2) -> tuple[torch.Tensor | None, DecodeReport]:
        """`[1, 128, F', H', W']` model-space latent -> (frames `[F, H, W, 3]` float32 0..1, this rank's
        `DecodeReport`).

        With `tiling`: the spatial tiles are decoded round-robin over the plan's ranks (or all here in one process)
        and blended; the frames exist on rank 0 only (None elsewhere). The LTX-2.5 diffusion decoder ignores `seed`:
        its noise is ComfyUI's fixed seed 0 (`models/diffusion_decoder.py`).

        Never out of memory on a GPU (the diffusion decoder): its peak is estimated from the latent shape
        (`parallel.decode.diffusion_decode_peak_bytes`) against the smallest free memory of the ranks that decode;
        when it would not fit, the smallest balanced tiling (`overlap` latent cells) that fits is used instead,
        and the report says so (`DecodeReport.auto_tiling`, e.g. "tiled 2×2 automatically: untiled needs ~85 GiB, 60
        GiB free"); the result is then the tiled decode's. Raises ValidationError when no tiling fits."""
        vae = self.components.video_vae
        param = next(vae.parameters())
        auto_note = None
        if is_diffusion_decoder(vae):
            tiling, auto_note = self._fit_decode(vae, tuple(video_latent.shape[2:]), tiling, overlap)
        if is_diffusion_decoder(vae):  # de-normalized in the VAE's dtype, as ComfyUI's `un_normalize`
            x = denormalize(vae, video_latent.float())
        else:
            x = L.denormalize_latents(video_latent.float(), vae.latents_mean.float().cpu(),
                                      vae.latents_std.float().cpu())
        temb = None
        # the conv decoder's decode noise, as the reference applies it (timestep 0.05, scale 0.025)
        if vae.config.get("timestep_conditioning", False):
            noise = S.make_noise(x.shape, seed)
            x = 0.975 * x + 0.025 * noise
            temb = torch.tensor([0.05], device=param.device, dtype=param.dtype)
        start = time.perf_counter()
        if tiling is not None:
            if self.plan is not None:
                pixels, report = self.plan.decode(vae, x, tiling, temb)
            else:
                pixels, report = decode_tiles(vae, x, tiling, temb)
        else:
            pixels = decode_untiled(vae, x, temb)
            report = DecodeReport(tiles="untiled", seconds=time.perf_counter() - start,
                                  rank=self.plan.rank if self.plan is not None else 0)
        if auto_note is not None:
            report = dataclasses.replace(report, auto_tiling=auto_note)
        if is_diffusion_decoder(vae):
            report = dataclasses.replace(report, attention=plain_fallback(param.device))
        if pixels is None:
            return None, report
        return ((pixels[0].float().cpu().clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0).contiguous(), report

    def _fit_decode(self, vae, grid: tuple[int, int, int], tiling: TileCountConfig | None, overlap: int
                    ) -> tuple[TileCountConfig | None, str | None]:
        """`parallel.decode.fit_decode_tiling` against the smallest free memory over the decoding ranks (one
        all-reduce when the plan has several: every rank must choose the same tiles)."""
        from ..splits import decode as D

        param = next(vae.parameters())
        free = D.free_decode_bytes(param.device)
        ranks = self.plan.world_size if self.plan is not None else 1
        if ranks > 1:
            t = torch.tensor([free if free is not None else -1], dtype=torch.int64,
                             device=param.device if param.device.type == "cuda" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            free = None if int(t) < 0 else int(t)
        try:
            return D.fit_decode_tiling(grid, tiling, free, overlap, param.element_size())
        except ValueError as exc:
            raise V.ValidationError(str(exc)) from None

    def decode_audio(self, audio_latent: torch.Tensor) -> tuple[torch.Tensor, int]:
        """`[1, 8, T, 16]` model-space audio latent -> (waveform `[C, S]` float32, sample rate)."""
        audio_vae, vocoder = self.components.audio_vae, self.components.vocoder
        param = next(audio_vae.parameters())
        x = L.denormalize_audio_latents(audio_latent.float(), audio_vae.latents_mean.float().cpu(),
                                        audio_vae.latents_std.float().cpu())
        with torch.no_grad():
            mel = audio_vae.decode(x.to(param.device, param.dtype), return_dict=False)[0]
            voc_param = next(vocoder.parameters())
            wav = vocoder(mel.to(voc_param.device, voc_param.dtype))
        return wav[0].float().cpu(), int(vocoder.config.output_sampling_rate)

    # ---- the recipe --------------------------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 cancel_check: CancelFn | None = None) -> GenerateResult:
        """Run the recipe. `progress(stage, done, total)` after every step; `cancel_check(stage, step, group)` before
        every step (group: the process group of the ranks running the stage, None: all).

        Raises ValidationError (before any work), SamplingCancelled, FloatingPointError (non-finite latent)."""
        job = self.plan_job(request)  # every refusal happens here, before any work
        memory = self.plan_memory(job)
        self.batch_notes = {}
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        transformer = self.components.transformer
        with _timed(timings, "text"):
            if memory is not None and memory.drop_graphs:
                G.graphs_of(transformer).clear()
                torch.cuda.empty_cache()
            positive, negative = self._text(request, job)
            if memory is not None and memory.encoder == "offload":
                self.text_service().offload()
            elif memory is not None and memory.encoder == "drop":
                self.text_service().unload()
        with _timed(timings, "stage 1"), JM.stage_memory(memory, "stage 1", transformer, self.device) as batch:
            # half size (guided for the two-stage recipe), split by the plan
            result1, reports = self._run_with_loras(self._stage1_spec(request, job, positive, negative),
                                                    job.stage1_loras, progress, cancel_check, batch_mode=batch)
        with _timed(timings, "upscale"):  # 2× latent upscale
            upscaled = self.upscale(L.unpack_video(result1.video, job.frames, job.h1, job.w1))
            V.check_finite(upscaled, "upscale", "video")
        with _timed(timings, "stage 2"), JM.stage_memory(memory, "stage 2", transformer, self.device) as batch:
            # full size, no guidance, audio frozen; the distilled LoRA (two-stage)
            result2, more = self._run_with_loras(self._stage2_spec(request, job, positive, upscaled, result1.audio),
                                                 job.stage2_loras, progress, cancel_check, restore=True,
                                                 batch_mode=batch)
        stage_1 = result1.report if self.plan else "local"
        stage_2 = self._stage2_report(result2, job.distilled)
        with _timed(timings, "decode video"):
            video_latent = L.unpack_video(result2.video, job.frames, job.h2, job.w2)
            frames, decode = self.decode_video(video_latent, request.seed, job.decode_tiling, request.decode_overlap)
        with _timed(timings, "decode audio"):  # once, on the driver rank
            audio_latent = L.unpack_audio(result1.audio)
            driver = self.plan is None or self.plan.rank == 0
            waveform, sample_rate = self.decode_audio(audio_latent) if driver else (None, 0)
        timings["total"] = time.perf_counter() - t0
        seconds = GenerateTimings.from_phases(timings)
        report = RankReport(rank=self.plan.rank if self.plan is not None else 0, stage_1=stage_1, stage_2=stage_2,
                            decode=decode, timings=seconds,
                            speed=(memory.lines() if memory is not None else ())
                            + tuple(speed_report(self.components.transformer, self.batch_notes) or ()),
                            weights=_weights_line(self.components.transformer))
        summary, rank_reports = self._job_report(report, job.distilled)
        return GenerateResult(frames, waveform, sample_rate, video_latent, audio_latent, seconds, reports + more,
                              summary, rank_reports)

    def plan_memory(self, job: GenerateJob) -> PJ.JobMemoryPlan | None:
        """The job's memory plan on this process's GPU (`protocol/job_memory.py`: the text encoder kept, offloaded
        or released after encoding; each stage's batching and graphs), from the components' bytes, the GPU's budget
        and the stages' activations (`stages/job_memory.py`). None off CUDA and on a fleet (its ranks are planned by
        the token cap and the weight placement). Raises ValidationError with the figures where no plan fits, before
        any work."""
        if self.device.type != "cuda" or self.plan is not None:
            return None
        c, device = self.components, self.device
        t = c.transformer
        passes = 1 if job.distilled else len(S.plan_passes(job.video_guidance, job.audio_guidance))
        stages = (JM.stage_need("stage 1", t, job.frames * job.h1 * job.w1, passes, self.dtype, device),
                  JM.stage_need("stage 2", t, job.frames * job.h2 * job.w2, 1, self.dtype, device))
        encoder, encoder_activation = JM.encoder_figures(self.text_service(), device)
        others = (c.video_connector, c.audio_connector, c.text_projection, c.video_vae, c.audio_vae, c.vocoder,
                  c.upsampler)
        inputs = PJ.JobMemoryInputs(
            budget=JM.gpu_budget(device), transformer=JM.module_bytes(t, device),
            others=sum(JM.module_bytes(m, device) for m in others), encoder=encoder,
            encoder_activation=encoder_activation, graph_pool=G.graphs_of(t).held_bytes, stages=stages,
            graphs=G.mode() == "auto", host_room=JM.host_room(self.text_service()) if encoder else 0)
        try:
            plan = PJ.plan_job_memory(inputs)
        except PJ.JobMemoryError as exc:
            raise V.ValidationError(str(exc)) from None
        log.info("%s (%s)", "; ".join(plan.lines()), inputs)  # the plan and its figures, before the job runs
        return plan

    def _text(self, request: GenerateRequest, job: GenerateJob):
        """The prompt's (and, when a pass needs it, the negative prompt's) text contexts: (positive, negative or
        None), the prompts as one padded batch (the reference's)."""
        uses_negative = job.video_guidance.uses_uncond or job.audio_guidance.uses_uncond
        embeds = self.encode_prompts([request.prompt] + ([request.negative_prompt] if uses_negative else []))
        contexts = text_contexts(self.components, embeds, dtype=self.dtype)
        return contexts.select(0), (contexts.select(1) if uses_negative else None)

    def _job_report(self, report: RankReport, distilled: bool) -> tuple[str, list[RankReport] | None]:
        """This rank's report -> (the job's parallel summary, every rank's report: gathered on a fleet's rank 0,
        None on its other ranks)."""
        if self.plan is None:
            return "one process", [report]
        return _parallel_summary(report, distilled), self.plan.gather_reports(report)

    def plan_job(self, request: GenerateRequest) -> GenerateJob:
        """The request checked against this model and fleet and resolved against the family's recipe (guidance,
        sampler, sigmas, tiles, LoRAs per stage), before any work. Raises ValidationError naming the value."""
        request.validate()
        limits = StageLimits.of(self.components, self.plan)  # the rules every stage is checked by (run_sample's too)
        recipe = self.components.family.recipe
        distilled = (request.pipeline or recipe.pipeline) == "distilled"
        # the distilled model runs without guidance (reference distilled pipeline)
        default_v, default_a = (S.NO_GUIDANCE, S.NO_GUIDANCE) if distilled else limits.default_guidance()
        video_guidance, audio_guidance = limits.guidance(request.video_guidance or default_v,
                                                         request.audio_guidance or default_a)
        frames_lat = L.latent_frames(request.frames)
        h1, w1 = request.height // 64, request.width // 64
        h2, w2 = 2 * h1, 2 * w1
        frame_tokens = h2 * w2 if distilled else h1 * w1  # the larger split stage's (stage 2 of TDP is tiled)
        limits.check_tokens(frames_lat * frame_tokens, frame_tokens, f"{request.width}×{request.height}")
        grid2 = (frames_lat, h2, w2)
        stage2_tiling = None if distilled else limits.tiling(request.tiles, grid2, request.tile_overlap,
                                                             "stage-2 tiles")
        decode_tiling = self._decode_tiling(limits, request, grid2)
        sigmas1, sigmas2 = self._sigmas(request, distilled, stage2_tiling is not None)
        if stage2_tiling is not None:
            limits.check_tdp_sigmas(sigmas2, request.tdp_max_first_sigma)
        stage1_loras, stage2_loras = self._stage_loras(request)
        return GenerateJob(distilled, request.sampler or recipe.sampler, video_guidance, audio_guidance, frames_lat,
                           h1, w1, h2, w2, stage2_tiling, decode_tiling, sigmas1, sigmas2, stage1_loras,
                           stage2_loras)

    def _decode_tiling(self, limits: StageLimits, request: GenerateRequest, grid: tuple[int, int, int]
                       ) -> TileCountConfig | None:
        """The decode's tiles of the full-size latent `grid` (`StageLimits.tiling`), refused before sampling when
        they split the frame axis or give a tile the conv decoder cannot take."""
        tiling = limits.tiling(request.decode_tiles, grid, request.decode_overlap, DECODE_TILES)
        if tiling is None:
            return None
        if tiling.frames.num_tiles != 1:
            raise V.ValidationError("decode tiles: the decode never splits the frame axis (LTX's causal first "
                                    "frame); use height × width tiles")
        try:
            check_decodable(self.components.video_vae,
                            split_axis(grid[1], tiling.height.num_tiles, tiling.height.overlap),
                            split_axis(grid[2], tiling.width.num_tiles, tiling.width.overlap))
        except ValueError as exc:
            raise V.ValidationError(f"decode tiles: {exc}") from None
        return tiling

    def _sigmas(self, request: GenerateRequest, distilled: bool, tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(stage-1, stage-2) schedules: the request's or the family's recipe (a tiled stage 2: the TDP schedule)."""
        family = self.components.family
        recipe = family.recipe
        if distilled:
            sigmas1 = S.as_sigmas((recipe.stage1_sigmas or S.DISTILLED_SIGMAS) if request.steps is None else
                                  S.ltx2_sigmas(request.steps))
        else:  # reference ti2vid_two_stages: the scheduler at its default 4096 tokens
            sigmas1 = S.ltx2_sigmas(request.steps or S.default_steps(family))
        if request.stage2_sigmas is not None:
            return sigmas1, S.as_sigmas(request.stage2_sigmas)
        return sigmas1, S.as_sigmas(S.TDP_STAGE2_SIGMAS if tiled else recipe.stage2_sigmas)

    def _stage_loras(self, request: GenerateRequest) -> tuple[tuple, tuple]:
        """Per-stage LoRA sets: the user's on both stages, the distilled LoRA on stage 2 only; indexed and checked
        against the transformer (coverage, widths) before any work."""
        user_loras = read_loras(request.loras)
        stage2_loras = user_loras + ([read_lora(*request.distilled_lora)] if request.distilled_lora else [])
        for loras in (user_loras, stage2_loras):
            self.lora.check(loras)
        return tuple(user_loras), tuple(stage2_loras)

    def _stage1_spec(self, request: GenerateRequest, job: GenerateJob, positive, negative) -> StageSpec:
        """Stage 1 at half size: text-to-video from zeros, or the image's first frame through the denoise mask."""
        audio_frames = L.audio_latent_frames(request.frames, request.fps)
        video_clean = torch.zeros(1, job.h1 * job.w1 * job.frames, 128)
        video_mask = None
        if request.image is not None:
            video_clean, video_mask = self._conditioning_latent(request.image, request.image_strength, job.frames,
                                                                request.height // 2, request.width // 2)
        return StageSpec(name="stage 1", semantics=REFERENCE, positive=positive, negative=negative,
                         grid=(job.frames, job.h1, job.w1), fps=request.fps, audio_frames=audio_frames,
                         video_clean=video_clean, audio_clean=torch.zeros(1, audio_frames, 128), sigmas=job.sigmas1,
                         video_guidance=job.video_guidance, audio_guidance=job.audio_guidance, video_mask=video_mask,
                         seed=request.seed, sampler=SamplerSpec(job.sampler, request.seed))

    def _stage2_spec(self, request: GenerateRequest, job: GenerateJob, positive, upscaled, audio1) -> StageSpec:
        """Stage 2 at full size on the upscaled latent (the image's tokens put back), audio frozen, no guidance; the
        distilled preset splits it like stage 1 (the plan's choice), the two-stage recipe tiles it over the fleet."""
        video_clean, video_mask = L.pack_video(upscaled), None
        if request.image is not None:
            image_tokens, video_mask = self._conditioning_latent(request.image, request.image_strength, job.frames,
                                                                 request.height, request.width)
            first = video_mask[0] < 1.0
            video_clean[:, first] = image_tokens[:, first]
        seed = request.seed + 1
        return StageSpec(name="stage 2", semantics=REFERENCE, positive=positive, negative=None,
                         grid=(job.frames, job.h2, job.w2), fps=request.fps, audio_frames=audio1.shape[1],
                         video_clean=video_clean, audio_clean=audio1, sigmas=job.sigmas2, video_mask=video_mask,
                         seed=seed, audio_frozen=True, sampler=SamplerSpec(job.sampler, seed),
                         tiling=None if job.distilled else job.stage2_tiling)

    def _run_with_loras(self, spec: StageSpec, loras, progress, cancel_check, restore: bool = False,
                        batch_mode: str = "auto"):
        """Fuse `loras` for `spec`'s stage, run it; on any failure restore the weights (`after_error`); `restore`:
        the clean weights after it too. -> (StageResult, the LoRA reports)."""
        try:
            reports = self.lora.apply(list(loras), spec.name)
            result = self.run_stage(spec, progress, cancel_check, batch_mode)
        except BaseException:
            self.lora.after_error()
            raise
        if restore:
            self.lora.restore()
        return result, reports

    def _stage2_report(self, result: StageResult, distilled: bool) -> str:
        if isinstance(result.runner, TiledRunner):
            tiled = result.runner.tiled
            return f"{tiled.describe()}; {tiled.compute_seconds:.3f} s in tile forwards"
        if distilled:  # its own split: the cost model may differ from stage 1's
            return result.report if self.plan else "local"
        return "local"

    resolve_tiling = staticmethod(resolve_tiling)  # `stage.resolve_tiling` (the decode job and tests call it here)


def load_one_process(identity: FleetIdentity, *, dtype: torch.dtype, device: torch.device,
                     compile_blocks: bool = False) -> TwoStagePipeline:
    """The pipeline of a one-process run (the CLI's `generate` without a fleet): what one replicated fleet rank loads,
    from `identity`'s files (checkpoint, Gemma, upscaler and the optional separate VAE / projection files) on
    `device` in `dtype`, the int8 path resolved as a rank resolves it (`models.loader.int8_path_for`), the blocks
    compiled when asked. Raises ValidationError / ValueError (the int8 rule, a Gemma that does not match the
    checkpoint's text projection) before the transformer runs."""
    from ..models.gemma import load_gemma
    from ..models.loader import ComponentFiles, int8_path_for, load_components
    from ..models.text_projection import check_gemma_matches

    int8_mode, int8_reason = int8_path_for(identity, dtype, device)
    slots = ComponentFiles(video_vae=identity.video_vae, audio_vae=identity.audio_vae,
                           text_projection=identity.text_projection, upsampler=identity.upscaler,
                           text_encoder=identity.gemma)
    components = load_components(identity.checkpoint, slots, dtype=dtype, device=device, int8_compute=int8_mode,
                                 int8_reason=int8_reason)
    if compile_blocks:
        from ..engine.compile import compile_blocks as compile_all

        compile_all(components.transformer)
    gemma = load_gemma(identity.gemma, device=device, dtype=dtype)
    check_gemma_matches(components.text_projection, gemma, identity.gemma)
    return TwoStagePipeline(components, gemma, device=device, dtype=dtype)
