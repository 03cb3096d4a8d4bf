"""One stage contract: `StageSpec` says what a denoising stage is, a `StageRunner` how it is split over the fleet.

Every denoising stage — stage 1 and stage 2 of the CLI `generate` recipe (`pipelines.TwoStagePipeline.generate`) and
the node jobs (`serving/jobs/stages.py::run_sample`: SP Sampler (MGPU), TDP Upscale (MGPU)) — is one frozen `StageSpec`,
validated once when it is built, and runs through `run_stage(spec, env, hooks)`: `choose_runner` asks the fleet's
plan which split runs it (one device; sequence parallel over the plan's SP group; the guidance passes spread over
ranks; tiled), the runner builds the model function and runs the denoising loop (`denoise`).

Two semantics (`StageSpec.semantics`, a `semantics.Semantics` record: the table of what differs is there), for the
same inputs:
- `REFERENCE`: Lightricks' recipe (ltx-core / ltx-pipelines; the CLI): diffusers' block order, the reference's
  positions, q/k RMS-norm eps 1e-6, the denoise mask blended into x0 (`sampling.masked_euler_step`: x0 ← x0·m +
  clean·(1 − m) with x0 = x − v·(m·σ)), start latent lerp(clean, lerp(clean, noise, σ0), m).
- `COMFYUI`: ComfyUI 0.33's LTX-AV model and samplers (the nodes): ComfyUI's block order, positions and eps (the same
  forward that serves the native MGPU MODEL), the text connectors per prompt as `LTXAVModel.preprocess_text_embeds`,
  and ComfyUI's inpainting blend (`comfy/samplers.py::KSamplerX0Inpaint` with `LTXAV.scale_latent_inpaint` = the
  clean latent): start x = σ0·noise + (1 − σ0)·clean for every token; before each model call x_in = x·m +
  clean·(1 − m), per-token timestep m·σ (`LTXAV.process_timestep`); x0 = x_in − v·σ with the step's σ; after
  guidance out = x0·m + clean·(1 − m); the sampler steps the unblended state x.
Code reads the record's fields (`mask_rule`, `start_noise_masked`, `text_per_prompt`, `token_inputs`, …), never its
name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..engine import latents as L
from ..engine import sampling as S
from ..protocol import validation as V
from ..engine.denoiser import LTX2Denoiser, TextContext, text_contexts
from ..engine.forward import qk_eps, qk_norms
from ..splits.decode import default_decode_tiling
from ..splits.tiling import TileCountConfig, default_tiling, make_tiles
from ..engine.semantics import ALL as ALL_SEMANTICS
from ..engine.semantics import Semantics, semantics_named
# ComfyGuides is re-exported: the request's guides, defined with the requests in protocol/stage_requests.py
from ..protocol.stage_requests import ComfyGuides, STAGE_NOISE_DEVICES, STAGE_SAMPLERS, STAGE_SEMANTICS  # noqa: F401

if TYPE_CHECKING:
    from ..models.families import ModelFamily
    from ..splits.plan import ParallelPlan

SEMANTICS = STAGE_SEMANTICS  # ("reference", "comfyui"): the sample request's semantics (protocol/stage_requests.py)
SAMPLERS = STAGE_SAMPLERS  # ("euler", "euler_ancestral")
NOISE_DEVICES = STAGE_NOISE_DEVICES  # ("cpu", "cuda"): where ComfyUI samples
NOISE_LAYOUTS = ("packed", "comfyui")

ProgressFn = Callable[[str, int, int], None]  # (stage, steps done, steps total)
CancelFn = Callable[[str, int, object], bool]  # (stage, step about to run, process group deciding) -> stop now


@dataclass(frozen=True)
class SamplerSpec:
    """The step rule of a stage.

    name: "euler" (the reference's Euler step / ComfyUI `sample_euler`) or "euler_ancestral" (ComfyUI
        `sample_euler_ancestral_RF`, `eta` and `s_noise`).
    seed: euler_ancestral's per-step noise comes from a generator on `noise_device` seeded as ComfyUI's
        `k_diffusion.sampling.default_noise_sampler` seeds it: `seed + 1` on the CPU, `seed` on a CUDA device (the
        same on every rank).
    noise_device: where ComfyUI's sampler state lives ("cpu", or "cuda" when ComfyUI samples on a GPU — what it does
        with the MGPU MODEL on a GPU host): CUDA draws another stream than the CPU, so the "comfyui" layout draws on
        this rank's CUDA device then. The "packed" layout (the CLI) always draws on the CPU.
    noise_layout: how one step's draw is laid out: "packed" (the CLI: one `randn` over the packed video tokens
        `[1, T, 128]` then the audio tokens, no audio draw for a frozen audio stream) or "comfyui" (ComfyUI's: one
        `randn` over the flattened `[1, 128, F, H, W]` video then `[1, 8, T, 16]` audio latent, always both).
    Raises ValidationError naming the field.
    """

    name: str = "euler"
    seed: int = 0
    eta: float = 1.0
    s_noise: float = 1.0
    noise_layout: str = "packed"
    noise_device: str = "cpu"

    def __post_init__(self):
        if self.name not in SAMPLERS:
            raise V.ValidationError(f"sampler={self.name!r}: choose one of {', '.join(SAMPLERS)}")
        if not 0.0 <= float(self.eta) <= 1.0:
            raise V.ValidationError(f"eta={self.eta}: must be in [0, 1]")
        if self.noise_layout not in NOISE_LAYOUTS:
            raise V.ValidationError(f"noise_layout={self.noise_layout!r}: choose one of {', '.join(NOISE_LAYOUTS)}")
        if self.name == "euler_ancestral" and self.noise_layout == "comfyui":
            if self.noise_device not in NOISE_DEVICES:
                raise V.ValidationError(f"noise_device={self.noise_device!r}: ComfyUI's euler_ancestral noise can be "
                                        f"drawn as on {' or '.join(NOISE_DEVICES)} only")
            if self.noise_device == "cuda" and not torch.cuda.is_available():
                raise V.ValidationError("noise_device='cuda': ComfyUI samples on a GPU, whose euler_ancestral noise "
                                        "stream only a CUDA device can draw, and this fleet's rank has none")

    def build(self, grid: tuple[int, int, int], audio_frames: int, audio_frozen: bool) -> S.AncestralSampler | None:
        """The loop's step rule: None for euler, else an `AncestralSampler` with its noise stream (a fresh generator
        per call: each stage run draws the same sequence)."""
        if self.name == "euler":
            return None
        f, h, w = grid
        generator = torch.Generator(device="cpu").manual_seed(int(self.seed) + 1)
        if self.noise_layout == "packed":
            nv, video_shape = f * h * w * 128, (1, f * h * w, 128)
            audio_shape = None if audio_frozen else (1, audio_frames, 128)
            na = 0 if audio_shape is None else audio_frames * 128

            def noise_fn():
                n = torch.randn(nv + na, generator=generator, dtype=torch.float32)
                return n[:nv].reshape(video_shape), (n[nv:].reshape(audio_shape) if audio_shape else None)

            return S.AncestralSampler(noise_fn, eta=float(self.eta), s_noise=float(self.s_noise))
        video_shape, audio_shape = (1, 128, f, h, w), (1, 8, audio_frames, 16)
        nv, na = 128 * f * h * w, 8 * audio_frames * 16
        if self.noise_device == "cuda":  # default_noise_sampler: a generator on x's device, `seed` unchanged
            draw_on = torch.device("cuda", torch.cuda.current_device())
            generator = torch.Generator(device=draw_on).manual_seed(int(self.seed))
        else:
            draw_on = torch.device("cpu")

        def comfy_noise_fn():
            n = torch.randn((1, 1, nv + na), generator=generator, dtype=torch.float32, device=draw_on).cpu()
            return (L.pack_video(n[..., :nv].reshape(video_shape)), L.pack_audio(n[..., nv:].reshape(audio_shape)))

        return S.AncestralSampler(comfy_noise_fn, eta=float(self.eta), s_noise=float(self.s_noise))


@dataclass(frozen=True, eq=False)
class StageSpec:
    """One denoising stage (frozen; validated when built, before any work).

    Latents are packed float32 `[1, T, 128]` in model space (`latents.pack_video` / `pack_audio`), CPU.
    name: what progress, errors and reports call the stage ("stage 1", "stage 2").
    semantics: a `Semantics` record (`REFERENCE`: the CLI recipe; `COMFYUI`: the nodes), or its name (resolved when
        the spec is built).
    positive / negative: processed text contexts (`stage_contexts`); negative None when no pass needs it.
    grid: latent (F, H, W) of the video; fps: frames per second (positions); audio_frames: audio latent steps T.
    video_clean / audio_clean: the clean latents (what masked tokens keep; zeros for text-to-video).
    sigmas: the schedule, 1-D, non-increasing, ending in 0.
    video_mask / audio_mask: per-token denoise masks `[1, T]` (1 = generate, 0 = keep clean) or None.
    noise: explicit packed (video, audio) start noise (ComfyUI's NOISE), or None: drawn from `seed`
        (`sampling.make_av_noise`).
    audio_frozen: the audio is context at timestep 0 and comes back unchanged (reference stage 2; "reference" only).
    video_guidance / audio_guidance: `GuidanceParams` per modality (STG blocks already resolved).
    sampler: `SamplerSpec`. tiling: tiles for a tiled stage (TDP; "reference" only), None otherwise.
    guides: `ComfyGuides` (semantics "comfyui"), None otherwise.
    Raises ValidationError naming the field and the rule.
    """

    name: str
    semantics: Semantics
    positive: TextContext
    negative: TextContext | None
    grid: tuple[int, int, int]
    fps: float
    audio_frames: int
    video_clean: torch.Tensor
    audio_clean: torch.Tensor
    sigmas: torch.Tensor
    video_guidance: S.GuidanceParams = S.NO_GUIDANCE
    audio_guidance: S.GuidanceParams = S.NO_GUIDANCE
    video_mask: torch.Tensor | None = None
    audio_mask: torch.Tensor | None = None
    noise: tuple[torch.Tensor, torch.Tensor] | None = None
    seed: int = 0
    audio_frozen: bool = False
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    tiling: TileCountConfig | None = None
    guides: ComfyGuides | None = None

    def __post_init__(self):
        stage = self.name
        if not isinstance(stage, str) or not stage.strip():
            raise V.ValidationError(f"stage={stage!r}: a name such as 'stage 1' or 'stage 2'")
        try:
            sem = semantics_named(self.semantics)
        except V.ValidationError as exc:
            raise V.ValidationError(f"{stage}: {exc}") from None
        object.__setattr__(self, "semantics", sem)
        grid = tuple(int(n) for n in self.grid)
        if len(grid) != 3 or min(grid) < 1:
            raise V.ValidationError(f"{stage}: latent grid {self.grid!r}: expected (F, H, W) ≥ 1")
        object.__setattr__(self, "grid", grid)
        if not float(self.fps) > 0:
            raise V.ValidationError(f"fps={self.fps}: must be positive")
        try:
            object.__setattr__(self, "sigmas", S.as_sigmas(self.sigmas))
        except ValueError as exc:
            raise V.ValidationError(f"sigmas: {exc}") from None
        tokens = grid[0] * grid[1] * grid[2]
        for what, x, n in (("video", self.video_clean, tokens), ("audio", self.audio_clean, self.audio_frames)):
            if x.ndim != 3 or tuple(x.shape) != (1, n, 128):
                raise V.ValidationError(f"{stage}: {what} latent of packed shape {tuple(x.shape)}: expected "
                                        f"(1, {n}, 128)")
        for what, m, n in (("video", self.video_mask, tokens), ("audio", self.audio_mask, self.audio_frames)):
            if m is not None and tuple(m.shape) != (1, n):
                raise V.ValidationError(f"{stage}: {what} denoise mask of shape {tuple(m.shape)}: expected (1, {n})")
        if self.noise is not None:
            for what, x, clean in zip(("video", "audio"), self.noise, (self.video_clean, self.audio_clean)):
                if tuple(x.shape) != tuple(clean.shape):
                    raise V.ValidationError(f"{stage}: {what} noise of packed shape {tuple(x.shape)} does not match "
                                            f"the latent {tuple(clean.shape)}")
        if (self.video_guidance.uses_uncond or self.audio_guidance.uses_uncond) and self.negative is None:
            raise V.ValidationError("CFG scale ≠ 1 needs a negative conditioning")
        allowed = {what: ", ".join(repr(s.name) for s in ALL_SEMANTICS if getattr(s, what))
                   for what in ("allows_frozen_audio", "allows_tiles", "allows_guides")}
        if self.audio_frozen and not sem.allows_frozen_audio:
            raise V.ValidationError(f"{stage}: a frozen audio stream is the recipe of semantics "
                                    f"{allowed['allows_frozen_audio']}; semantics {sem.name!r} denoises every "
                                    f"modality of the latent")
        if self.tiling is not None and not sem.allows_tiles:
            raise V.ValidationError(f"{stage}: a tiled stage runs the forward of semantics {allowed['allows_tiles']}, "
                                    f"not {sem.name!r}")
        layout = sem.ancestral_noise_layout
        if layout is not None and self.sampler.name == "euler_ancestral" and self.sampler.noise_layout != layout:
            raise V.ValidationError(f"{stage}: semantics {sem.name!r} draws ancestral noise in ComfyUI's layout "
                                    f"(SamplerSpec.noise_layout={layout!r})")
        if self.guides is not None and not self.guides.empty and not sem.allows_guides:
            raise V.ValidationError(f"{stage}: guides / reference audio need semantics {allowed['allows_guides']}")

    @property
    def video_tokens(self) -> int:
        f, h, w = self.grid
        return f * h * w

    @property
    def passes(self) -> int:
        """Guidance passes per step (a frozen audio stream is never guided)."""
        audio = S.NO_GUIDANCE if self.audio_frozen else self.audio_guidance
        return len(S.plan_passes(self.video_guidance, audio))


@dataclass(frozen=True)
class StageLimits:
    """What a stage's parameters are checked against before any work: the loaded transformer (its family and
    depth) and the fleet's plan (None: one process). Each rule is written here once, for the CLI recipe
    (`pipelines.TwoStagePipeline.plan_job`) and the node job (`jobs/stages.run_sample`); every check raises
    ValidationError naming the value and the rule."""

    family: ModelFamily | str  # or its name
    n_blocks: int
    plan: ParallelPlan | None = None
    heads: int | None = None  # the video attention heads (the SP degrees a refusal may name); None: not known

    @classmethod
    def of(cls, components, plan=None) -> StageLimits:
        """The limits of loaded `components` (`LTX2Components`) under `plan`."""
        tr = components.transformer
        return cls(components.family, len(tr.transformer_blocks), plan, tr.config.num_attention_heads)

    @property
    def ranks(self) -> int:
        return self.plan.world_size if self.plan is not None else 1

    def fit_blocks(self, blocks: tuple[int, ...]) -> tuple[int, ...]:
        """The reference's STG blocks (29 for LTX-2.0, 28 for 2.3 and 2.5) index the 48-block models; a shallower
        model (the tiny test models) uses its last block instead."""
        return tuple(min(b, self.n_blocks - 1) for b in blocks)

    def default_stg_blocks(self) -> tuple[int, ...]:
        """The family's reference STG block on this model (`fit_blocks`)."""
        return self.fit_blocks(S.default_guidance(self.family)[0].stg_blocks)

    def default_guidance(self) -> tuple[S.GuidanceParams, S.GuidanceParams]:
        """The family's guided stage-1 defaults (`sampling.default_guidance`) on this model's blocks."""
        video, audio = (dataclasses.replace(g, stg_blocks=self.fit_blocks(g.stg_blocks))
                        for g in S.default_guidance(self.family))
        return video, audio

    def guidance(self, video: S.GuidanceParams | S.GuidanceScales, audio: S.GuidanceParams | S.GuidanceScales,
                 stg_blocks: str | tuple[int, ...] | None = None) -> tuple[S.GuidanceParams, S.GuidanceParams]:
        """`(video, audio)` guidance with `stg_blocks` put in both (None: each keeps its own, a `GuidanceScales`
        gets the model's default; "auto": the model's default, `default_stg_blocks`), checked: the STG blocks of a
        modality that uses STG must exist."""
        if stg_blocks is not None:
            blocks = self.default_stg_blocks() if stg_blocks == "auto" else tuple(stg_blocks)
            video, audio = (g.with_blocks(blocks) for g in (video, audio))
        else:
            video, audio = (g.with_blocks(self.default_stg_blocks()) if isinstance(g, S.GuidanceScales) else g
                            for g in (video, audio))
        for name, g in (("video", video), ("audio", audio)):
            bad = [b for b in g.stg_blocks if not 0 <= b < self.n_blocks] if g.uses_perturbed else []
            if bad:
                raise V.ValidationError(f"{name} STG block(s) {bad} do not exist: this transformer has blocks "
                                        f"0..{self.n_blocks - 1} (its default STG block: "
                                        f"{list(self.default_stg_blocks())})")
        return video, audio

    def check_tokens(self, tokens: int, frame_tokens: int | None = None, size: str | None = None) -> None:
        """A split stage's `tokens` video tokens against the plan's per-rank token cap (`ParallelPlan.check`); in
        one process the cap a one-rank fleet applies (so a huge size is refused here, not by the allocator). With
        `frame_tokens` (latent tokens per latent frame of the stage) and `size` (the job's "width×height") the
        refusal names the longest clip that fits and the ranks that would hold this one. Raises ValidationError."""
        if self.plan is not None:
            self.plan.check(tokens, frame_tokens, size)
            return
        from ..protocol.fleet_rules import valid_sp_degrees
        from ..splits.plan import DEFAULT_TOKEN_CAP
        from ..splits.sequence import check_token_cap

        degrees = valid_sp_degrees(self.heads) if self.heads else None
        try:
            check_token_cap(tokens, 1, DEFAULT_TOKEN_CAP, frame_tokens, size, degrees)
        except ValueError as exc:
            raise V.ValidationError(str(exc)) from None

    def tiling(self, explicit: TileCountConfig | None, grid: tuple[int, int, int], overlap: int, what: str,
               ranks: int | None = None) -> TileCountConfig | None:
        """A tiled stage's (or the decode's) tiles: `explicit` checked against the latent `grid`, or the balanced
        default over `ranks` (None: the fleet's; none for one rank). `what` names the option in the error."""
        return resolve_tiling(explicit, self.ranks if ranks is None else ranks, grid, overlap, what)

    @staticmethod
    def check_tdp_sigmas(sigmas: torch.Tensor, max_first_sigma: float) -> None:
        """A tiled stage's schedule must start at or below `max_first_sigma` (`parallel.tiled.check_tdp_sigmas`)."""
        from ..splits.tiled import check_tdp_sigmas

        try:
            check_tdp_sigmas(sigmas, float(max_first_sigma))
        except ValueError as exc:
            raise V.ValidationError(str(exc)) from None


DECODE_TILES = "decode tiles"  # the `what` of the decode's tiles (the decode job, `TwoStagePipeline._decode_tiling`)


def resolve_tiling(explicit: TileCountConfig | None, ranks: int, grid: tuple[int, int, int], overlap: int,
                   what: str) -> TileCountConfig | None:
    """An explicit tiling (checked against the grid), or the balanced default for `ranks` (none for one rank).
    The decode's default (`what` == `DECODE_TILES`) is `splits.decode.default_decode_tiling`: no tile smaller than
    ComfyUI's VAEDecode's own smallest, fewer tiles — down to the whole latent on one rank — on a smaller latent.
    Raises ValidationError naming `what`."""
    try:
        if explicit is not None:
            make_tiles(grid, explicit)
            return explicit
        if ranks <= 1:
            return None
        if what == DECODE_TILES:
            return default_decode_tiling(ranks, grid, overlap)
        return default_tiling(ranks, grid, overlap)
    except ValueError as exc:
        raise V.ValidationError(f"{what}: {exc}") from None


def stage_contexts(components, embeds: list[torch.Tensor], semantics: Semantics | str, dtype: torch.dtype
                   ) -> list[TextContext]:
    """CONDITIONING embeddings (`[1, T_i, C]` each) -> one `TextContext` per prompt, as the semantics computes them
    (`Semantics.text_per_prompt`): the prompts as one padded batch (`denoiser.text_contexts`, the reference), or each
    prompt alone (`LTXAVModel.preprocess_text_embeds`, called per conditioning by ComfyUI's `extra_conds`), with
    the semantics' q/k eps on the connectors. Raises ValidationError for embeddings of another model's width."""
    sem = semantics_named(semantics)
    norms = qk_norms(components.video_connector, components.audio_connector)
    try:
        with qk_eps(norms, sem.qk_eps):
            if sem.text_per_prompt:
                return [text_contexts(components, [e], dtype=dtype) for e in embeds]
            batch = text_contexts(components, embeds, dtype=dtype)
    except ValueError as exc:  # a conditioning from another model (width) is an input error, raised on every rank
        raise V.ValidationError(str(exc)) from None
    return [batch.select(i) for i in range(len(embeds))]


@dataclass
class StageEnv:
    """What a stage runs on (one rank): the loaded components, compute dtype and device, the fleet's plan (None: one
    process), `native`, a callable returning this rank's `native.NativeEngine` (semantics "comfyui"), and
    `batch_mode`, the reference denoiser's guidance-pass batching (`denoiser.BATCH_MODES`)."""

    components: object
    dtype: torch.dtype
    device: torch.device
    plan: object = None
    native: Callable[[], object] | None = None
    batch_mode: str = "auto"


@dataclass(frozen=True)
class StageHooks:
    """progress(stage, done, total) after every step; cancel(stage, step, group) before every step (every rank of
    `group` calls it; True stops the stage with `SamplingCancelled`)."""

    progress: ProgressFn | None = None
    cancel: CancelFn | None = None


@dataclass
class StageResult:
    """video / audio: packed final latents (every rank); report: how the stage was split; batch_note: how the
    guidance passes ran (None: nothing to say); runner: the runner that ran it."""

    video: torch.Tensor
    audio: torch.Tensor
    report: str
    batch_note: str | None
    runner: "StageRunner"


# ---- the denoising loop of one spec --------------------------------------------------------------------------------

def _reference_denoiser(spec: StageSpec, env: StageEnv, split=None):
    """The reference's inputs (`latents.video_coords` / `audio_coords` positions, per-token timesteps) ->
    `denoiser.LTX2Denoiser` on `split` (None: local)."""
    transformer = env.components.transformer
    f, h, w = spec.grid
    video_coords = L.video_coords(transformer, 1, f, h, w, spec.fps, device=env.device)
    audio_coords = L.audio_coords(transformer, 1, spec.audio_frames, device=env.device)
    denoiser = LTX2Denoiser(transformer, spec.positive, spec.negative, video_coords, audio_coords, env.dtype,
                            split=split)
    denoiser.batch_mode = env.batch_mode
    return denoiser


def _comfy_denoiser(spec: StageSpec, env: StageEnv, split=None):
    """ComfyUI's inputs (a `ForwardRequest` per pass, prepared by this rank's `native.NativeEngine`) ->
    `comfy_stage.ComfyDenoiser` on `split` (None: the engine's degree-1 sequence split)."""
    from .comfy_stage import ComfyDenoiser

    return ComfyDenoiser(env.native(), spec, split)


DENOISERS = {"reference": _reference_denoiser, "comfyui": _comfy_denoiser}
"""`Semantics.token_inputs` -> how a stage's latents become the one forward's `TokenBatch`."""


def model_fn(spec: StageSpec, env: StageEnv, split=None):
    """The loop's model function for `spec` on `split` (an `engine.forward.Split`: `UlyssesSplit`, `TiledSplit`;
    None: the semantics' own default), by the semantics' `token_inputs`. The denoiser's `split` says which plan
    the stage runs under (`applied`)."""
    return DENOISERS[spec.semantics.token_inputs](spec, env, split)


@contextlib.contextmanager
def applied(transformer, split):
    """Within the block, `split`'s plan is applied to the resident transformer (`splits.apply.apply_plan`: its
    processors installed); removed after (`remove_plan`: local processors). `split` None: nothing is installed
    (the denoiser runs locally and installed its local processors)."""
    from ..splits.apply import apply_plan, remove_plan

    if split is None:
        yield
        return
    apply_plan(transformer, split.plan, split.exchange)
    try:
        yield
    finally:
        remove_plan(transformer)


def denoise(spec: StageSpec, fn, hooks: StageHooks, group=None, run_passes=None
            ) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """Noise `spec`'s clean latents to `sigmas[0]` and denoise them with `fn` (`model_fn`), by the spec's semantics.
    `group`: the process group whose ranks take the per-step cancel decision together. Returns (video, audio,
    how the guidance passes ran). Raises SamplingCancelled, NonFiniteLatentError (naming the stage)."""
    steps = itertools.count()
    stage, sigma0 = spec.name, float(spec.sigmas[0])
    if spec.noise is not None:
        noise_v, noise_a = spec.noise
    else:
        noise_v, noise_a = S.make_av_noise(spec.video_clean.shape, spec.audio_clean.shape, spec.seed)
    sem = spec.semantics
    # the reference: start = lerp(clean, noised, mask); ComfyUI (CONST.noise_scaling): every token noised, the mask
    # acts inside the loop
    video_mask, audio_mask = (spec.video_mask, spec.audio_mask) if sem.start_noise_masked else (None, None)
    start_v = S.noise_latent(spec.video_clean, noise_v, sigma0, video_mask)
    start_a = (spec.audio_clean if spec.audio_frozen else
               S.noise_latent(spec.audio_clean, noise_a, sigma0, audio_mask))
    hooks = hooks or StageHooks()
    loop_hooks = S.LoopHooks(progress=(lambda i, n: hooks.progress(stage, i, n)) if hooks.progress else None,
                             cancel=(lambda: hooks.cancel(stage, next(steps), group)) if hooks.cancel else None)
    video = S.ModalityStream(start_v, spec.video_mask, spec.video_clean, spec.video_guidance)
    audio = S.ModalityStream(start_a, spec.audio_mask, None if spec.audio_mask is None else spec.audio_clean,
                             spec.audio_guidance, frozen=spec.audio_frozen)
    try:
        video, audio = S.denoise_loop(
            fn, spec.sigmas, video, audio, run_passes=run_passes, mask_rule=sem.mask_rule, hooks=loop_hooks,
            sampler=spec.sampler.build(spec.grid, spec.audio_frames, spec.audio_frozen))
    except S.NonFiniteLatentError as exc:
        raise S.NonFiniteLatentError(f"{stage}: {exc}") from None
    report = getattr(fn, "batch_report", None)
    note = report() if report is not None else None
    V.check_finite(video, stage, "video")
    V.check_finite(audio, stage, "audio")
    return video, audio, note


# ---- runners ---------------------------------------------------------------------------------------------------------

class StageRunner(ABC):
    """How one stage is split over the ranks. `run` is called on every rank of the fleet, in lockstep, and returns
    the same final latents on every rank."""

    kind: str = ""

    @abstractmethod
    def run(self, spec: StageSpec, env: StageEnv, hooks: StageHooks) -> StageResult:
        ...


class OneDeviceRunner(StageRunner):
    """The whole stage on this rank's device (one process, no plan)."""

    kind = "one device"

    def run(self, spec, env, hooks):
        fn = model_fn(spec, env)
        with applied(env.components.transformer, fn.split):
            video, audio, note = denoise(spec, fn, hooks)
        return StageResult(video, audio, "one rank", note, self)


class TiledRunner(StageRunner):
    """Every rank runs the whole loop; each forward is split into tiles over the ranks (`splits/tiled.py`)."""

    kind = "tiled"

    def __init__(self, tiled):
        self.tiled = tiled

    def run(self, spec, env, hooks):
        self.tiled.denoise_audio = not spec.audio_frozen
        with applied(env.components.transformer, self.tiled):
            video, audio, note = denoise(spec, model_fn(spec, env, split=self.tiled), hooks)
        return StageResult(video, audio, self.tiled.describe(), note, self)


class _GroupRunner(StageRunner):
    """A stage on ranks 0..degree-1 of the plan's group (`splits.dispatch.Dispatch`); the others skip it and
    receive rank 0's result."""

    def __init__(self, chosen):
        self.dispatch = chosen

    @property
    def run_split(self):
        return self.dispatch.run

    def run(self, spec, env, hooks):
        plan, run = env.plan, self.dispatch.run
        video = audio = note = failure = None
        if self.dispatch.joins:
            fn = model_fn(spec, env, split=self.dispatch.split)
            try:
                with applied(env.components.transformer, fn.split):
                    video, audio, note = denoise(spec, fn, hooks, group=run.group, run_passes=self.dispatch.spread)
            except Exception as exc:  # the ranks outside the group must hear of it, or they wait in the broadcast
                failure = exc
        plan.announce(spec.name, failure, run.degree, self.who)  # raises on every rank when the group stopped
        video, audio = plan.share(video, audio, spec.video_clean.shape, spec.audio_clean.shape, run.degree)
        return StageResult(video, audio, plan.describe(run.report), note, self)


class SequenceParallelRunner(_GroupRunner):
    """Every transformer forward sequence parallel over the plan's SP group for this size (`splits/sequence.py`)."""

    kind = "sequence parallel"
    who = "sequence-parallel ranks"


class GuidancePassRunner(_GroupRunner):
    """The guidance passes of each step spread over ranks 0..g-1 (`splits/passes.py::PassParallel`), each pass a
    plain forward on its rank."""

    kind = "guidance passes"
    who = "guidance-parallel ranks"


def choose_runner(spec: StageSpec, env: StageEnv) -> StageRunner:
    """The plan's choice for `spec` (the same on every rank): tiled when the spec has tiles; one device without a
    plan; else the dispatcher's (`splits.dispatch.dispatch`: the plan's split) — sequence parallel, or the guidance
    passes in parallel."""
    from ..splits.dispatch import dispatch
    from ..splits.passes import pass_bytes

    plan, transformer = env.plan, env.components.transformer
    if spec.tiling is not None:
        from ..splits.tiled import TiledSplit

        tiled = (plan.tiled(transformer, spec.grid, spec.tiling) if plan is not None
                 else TiledSplit(transformer, spec.grid, spec.tiling))
        return TiledRunner(tiled)
    if plan is None:
        return OneDeviceRunner()
    chosen = dispatch(plan, spec.name, spec.video_tokens, spec.passes,
                      pass_bytes(spec.video_clean.shape, spec.audio_clean.shape))
    return GuidancePassRunner(chosen) if chosen.kind == "passes" else SequenceParallelRunner(chosen)


def run_stage(spec: StageSpec, env: StageEnv, hooks: StageHooks | None = None) -> StageResult:
    """Run `spec` on every rank with the runner the plan chooses."""
    return choose_runner(spec, env).run(spec, env, hooks or StageHooks())


__all__ = ["ComfyGuides", "DECODE_TILES", "GuidancePassRunner", "NOISE_LAYOUTS", "OneDeviceRunner", "SAMPLERS", "SEMANTICS",
           "SamplerSpec", "SequenceParallelRunner", "StageEnv", "StageHooks", "StageLimits", "StageResult",
           "StageRunner", "StageSpec", "TiledRunner", "applied", "choose_runner", "denoise", "model_fn", "resolve_tiling",
           "run_stage", "stage_contexts"]
