"""LTX-2 sampling recipe: sigma schedules, noise, Euler steps, multi-modal guidance and the denoising loop.

Faithful to Lightricks' reference (GitHub Lightricks/LTX-2; formulas re-implemented, no code copied):

* ``packages/ltx-core/src/ltx_core/components/schedulers.py`` -- ``LTX2Scheduler`` (token-count sigma shift,
  stretch to terminal). ComfyUI's ``LTXVScheduler`` (``comfy_extras/nodes_lt.py``) is the same formula.
* ``packages/ltx-core/src/ltx_core/components/diffusion_steps.py`` -- ``EulerDiffusionStep``.
* ``packages/ltx-core/src/ltx_core/utils.py`` -- ``to_velocity`` / ``to_denoised``.
* ``packages/ltx-core/src/ltx_core/components/guiders.py`` -- ``MultiModalGuider.calculate`` /
  ``MultiModalGuiderParams``.
* ``packages/ltx-core/src/ltx_core/components/noisers.py`` -- ``GaussianNoiser``.
* ``packages/ltx-core/src/ltx_core/model/transformer/model.py`` -- ``X0Model`` (x0 = x - v * (mask * sigma)).
* ``packages/ltx-pipelines/src/ltx_pipelines/utils/denoisers.py`` -- ``_guided_denoise`` (which passes run).
* ``packages/ltx-pipelines/src/ltx_pipelines/utils/samplers.py`` -- ``euler_denoising_loop``.
* ``packages/ltx-pipelines/src/ltx_pipelines/utils/helpers.py`` -- ``post_process_latent``,
  ``timesteps_from_mask``, ``modality_from_latent_state`` (frozen modality: sigma forced to 0).
* ``packages/ltx-pipelines/src/ltx_pipelines/utils/constants.py`` -- distilled sigmas, guider defaults.
* ``packages/ltx-pipelines/src/ltx_pipelines/ti2vid_two_stages.py`` -- two-stage recipe.

Conventions: sigma in [0, 1] (1 = pure noise). Flow matching: ``x_sigma = (1 - sigma) * x0 + sigma * noise``,
velocity ``v = noise - x0 = (x - x0) / sigma``. The transformer (diffusers ``LTX2VideoTransformer3DModel``)
predicts ``v`` and takes timesteps scaled by ``TIMESTEP_SCALE`` (1000); this module hands the model function
timesteps in *sigma units* and the adapter multiplies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from ..protocol.stage_params import BASE_SHIFT_ANCHOR, DISTILLED_SIGMAS, DISTILLED_STAGE2_SIGMAS, MAX_SHIFT_ANCHOR, TDP_STAGE2_SIGMAS, GuidanceParams, GuidanceScales, as_sigmas, ltx2_sigmas, schedule_tokens
from ..protocol.validation import ValidationError

TIMESTEP_SCALE = 1000.0
"""diffusers ``timestep_scale_multiplier``: the transformer wants ``timestep = sigma * 1000`` (per token)."""

PassKind = Literal["cond", "uncond", "perturbed", "isolated"]
PASS_KINDS: tuple[PassKind, ...] = ("cond", "uncond", "perturbed", "isolated")


# ---------------------------------------------------------------------------------------------------------------------
# Noise
# ---------------------------------------------------------------------------------------------------------------------


def make_noise(
    shape: Sequence[int],
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Standard normal noise, deterministic for ``seed`` on every machine.

    Drawn in float32 from a CPU ``torch.Generator`` (so every rank and every GPU type gets identical noise;
    the reference draws from a generator on the compute device instead, hence not bit-identical to it on CUDA),
    then moved/cast to ``device``/``dtype``. Pass ``generator`` to continue an existing stream (``seed`` is then
    ignored). The reference draws noise in the *packed* token layout (``[B, T, C]``), video first, then audio,
    from one generator -- see :func:`make_av_noise`.
    """
    if generator is None:
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
    noise = torch.randn(tuple(int(s) for s in shape), generator=generator, dtype=torch.float32, device="cpu")
    return noise.to(device=device, dtype=dtype)


def make_av_noise(
    video_shape: Sequence[int] | None,
    audio_shape: Sequence[int] | None,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Noise for both modalities from one CPU generator seeded with ``seed``: video drawn first, then audio
    (the reference's order in ``DiffusionStage``). Shapes are the packed token shapes ``[B, T, 128]``."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    v = make_noise(video_shape, seed, dtype, device, generator=g) if video_shape is not None else None
    a = make_noise(audio_shape, seed, dtype, device, generator=g) if audio_shape is not None else None
    return v, a


def noise_latent(
    clean: torch.Tensor,
    noise: torch.Tensor,
    noise_scale: float,
    denoise_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Noised start state, reference ``GaussianNoiser``: ``x = lerp(clean, noise, noise_scale)`` then
    ``x = lerp(clean, x, mask)`` -- tokens with mask 0 stay clean, mask 1 get the full ``noise_scale``.

    ``noise_scale`` is 1.0 for stage 1 (pure noise) and ``sigmas[0]`` for a refinement stage (stage 2 re-noises
    the upscaled latent to 0.909375). ``denoise_mask`` is per token, broadcastable to ``clean`` (e.g. ``[B, T, 1]``
    for packed ``[B, T, C]``; a ``[B, T]`` mask is unsqueezed). Computed in float32, returned in ``clean.dtype``.
    """
    x = torch.lerp(clean.float(), noise.float(), float(noise_scale))
    if denoise_mask is not None:
        m = _token_mask(denoise_mask, clean)
        x = torch.lerp(clean.float(), x, m)
    return x.to(clean.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Steps and conversions
# ---------------------------------------------------------------------------------------------------------------------


def _token_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-token mask ``[B, T]`` or ``[B, T, 1]`` as float32 ``[B, T, 1]`` on ``like``'s device."""
    m = mask.to(device=like.device, dtype=torch.float32)
    if m.ndim == like.ndim - 1:
        m = m.unsqueeze(-1)
    return m


def to_x0(x: torch.Tensor, velocity: torch.Tensor, timesteps: torch.Tensor | float) -> torch.Tensor:
    """Denoised estimate from a velocity: ``x0 = x - v * t`` in float32, ``t`` the per-token timestep in sigma units
    (``mask * sigma``; ``[B, T]``, ``[B, T, 1]`` or a scalar). Reference ``X0Model`` / ``to_denoised``."""
    if isinstance(timesteps, torch.Tensor):
        t = _token_mask(timesteps, x) if timesteps.ndim >= 1 else timesteps.to(x.device, torch.float32)
    else:
        t = float(timesteps)
    return x.float() - velocity.float() * t


def to_velocity(x: torch.Tensor, x0: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """``v = (x - x0) / sigma`` in float32 (reference ``to_velocity``).

    Raises:
        ValueError: if sigma is 0.
    """
    s = float(sigma)
    if s == 0.0:
        raise ValueError("sigma can't be 0 when converting x0 to a velocity")
    return (x.float() - x0.float()) / s


def euler_step(
    x: torch.Tensor, velocity: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor
) -> torch.Tensor:
    """Flow-matching Euler step ``x_next = x + (sigma_next - sigma) * v`` (float32 math, result in ``x.dtype``)."""
    dt = float(sigma_next) - float(sigma)
    return (x.float() + velocity.float() * dt).to(x.dtype)


def masked_euler_step(
    x: torch.Tensor,
    x0: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    denoise_mask: torch.Tensor | None = None,
    clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """One reference Euler step from a (guided) x0 prediction, honouring a per-token denoise mask.

    Reference order (``euler_denoising_loop`` -> ``post_process_latent`` -> ``EulerDiffusionStep``):

    1. ``x0 <- x0 * m + clean * (1 - m)`` (mask ``m`` per token; conditioned tokens are pulled to ``clean``),
    2. ``v = (x - x0) / sigma``,  3. ``x_next = x + (sigma_next - sigma) * v``.

    For a token with ``m = 0`` that starts at ``clean`` (as :func:`noise_latent` leaves it) ``x`` stays exactly
    ``clean``; for ``0 < m < 1`` the blend happens in x0 space (not ``m * x_step + (1 - m) * clean``).
    ``x``/``x0``/``clean`` packed ``[B, T, C]``; ``denoise_mask`` ``[B, T]`` or ``[B, T, 1]``.

    Raises:
        ValueError: sigma == 0, or a mask without ``clean``.
    """
    if denoise_mask is not None:
        if clean is None:
            raise ValueError("masked_euler_step: a denoise_mask needs the clean latent")
        m = _token_mask(denoise_mask, x)
        x0 = x0.float() * m + clean.float() * (1.0 - m)
    v = to_velocity(x, x0, sigma)
    return euler_step(x, v, sigma, sigma_next)


def ancestral_step(
    x: torch.Tensor,
    x0: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise: torch.Tensor | None,
    eta: float = 1.0,
    s_noise: float = 1.0,
) -> torch.Tensor:
    """One Euler-ancestral step for flow matching (ComfyUI ``euler_ancestral`` on a CONST/flow model, i.e.
    ``comfy/k_diffusion/sampling.py::sample_euler_ancestral_RF``; formula re-implemented, float32 math).

    With ``sigma_next == 0`` the result is ``x0``. Otherwise ``sigma_down = sigma_next * (1 + (sigma_next / sigma - 1)
    * eta)``, ``x' = (sigma_down / sigma) x + (1 - sigma_down / sigma) x0``, then
    ``x_next = ((1 - sigma_next) / (1 - sigma_down)) x' + s_noise * c * noise`` with
    ``c = sqrt(sigma_next^2 - sigma_down^2 (1 - sigma_next)^2 / (1 - sigma_down)^2)``. ``eta = 0`` is plain Euler.

    Raises:
        ValueError: sigma == 0, or a noise tensor is needed (eta > 0, sigma_next > 0) but missing.
    """
    s, sn = float(sigma), float(sigma_next)
    if s == 0.0:
        raise ValueError("ancestral_step: sigma can't be 0")
    if sn == 0.0:
        return x0.float().to(x.dtype)
    sigma_down = sn * (1.0 + (sn / s - 1.0) * float(eta))
    ratio = sigma_down / s
    out = ratio * x.float() + (1.0 - ratio) * x0.float()
    if eta > 0:
        if noise is None:
            raise ValueError("ancestral_step: eta > 0 needs a noise tensor")
        alpha_next, alpha_down = 1.0 - sn, 1.0 - sigma_down
        renoise = math.sqrt(max(0.0, sn ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2))
        out = (alpha_next / alpha_down) * out + noise.to(out.device, torch.float32) * (float(s_noise) * renoise)
    return out.to(x.dtype)


@dataclass(frozen=True)
class AncestralSampler:
    """Selects Euler-ancestral steps in :func:`denoise_loop` (default there: the reference's Euler step).

    Attributes:
        noise_fn: ``noise_fn() -> (video_noise, audio_noise)`` packed ``[B, T, 128]`` (either may be None for an
            absent modality); called once per step whose ``sigma_next`` is not 0 (as ComfyUI draws it), in step order.
            It must give the same values on every rank (e.g. a seeded CPU generator).
        eta, s_noise: ComfyUI's ``euler_ancestral`` parameters (defaults 1.0, 1.0).
    A stage's sampler is described by ``stage.SamplerSpec`` and built per run (no process-wide default).
    """

    noise_fn: Callable[[], tuple[torch.Tensor | None, torch.Tensor | None]]
    eta: float = 1.0
    s_noise: float = 1.0


def _masked_ancestral_step(x, x0, sigma, sigma_next, noise, mask, clean, sampler: AncestralSampler):
    """Ancestral step honouring a per-token mask: tokens blend between the masked Euler result (mask 0: stays
    ``clean``) and the ancestral result (mask 1) with the mask as weight; x0 is pulled to ``clean`` first, as in
    :func:`masked_euler_step`."""
    if mask is None:
        return ancestral_step(x, x0, sigma, sigma_next, noise, sampler.eta, sampler.s_noise)
    m = _token_mask(mask, x)
    if bool((m == 1).all()):
        return ancestral_step(x, x0, sigma, sigma_next, noise, sampler.eta, sampler.s_noise)
    x0 = x0.float() * m + clean.float() * (1.0 - m)
    anc = ancestral_step(x, x0, sigma, sigma_next, noise, sampler.eta, sampler.s_noise).float()
    euler = euler_step(x, to_velocity(x, x0, sigma), sigma, sigma_next).float()
    return torch.lerp(euler, anc, m.expand_as(anc)).to(x.dtype)  # weight 0 / 1 give euler / anc exactly


# ---------------------------------------------------------------------------------------------------------------------
# Guidance
# ---------------------------------------------------------------------------------------------------------------------


NO_GUIDANCE = GuidanceParams()
"""Conditional pass only (what stage 2 / the distilled model uses: reference ``SimpleDenoiser``)."""

VIDEO_GUIDANCE_LTX2 = GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(29,), rescale=0.7, modality_scale=3.0)
"""Reference ``LTX_2_PARAMS.video_guider_params`` (ltx_pipelines/utils/constants.py)."""
AUDIO_GUIDANCE_LTX2 = GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(29,), rescale=0.7, modality_scale=3.0)
"""Reference ``LTX_2_PARAMS.audio_guider_params``."""
VIDEO_GUIDANCE_LTX23 = GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(28,), rescale=0.7, modality_scale=3.0)
"""Reference ``LTX_2_3_PARAMS.video_guider_params`` (same as 2.0 but STG on block 28; 30 steps by default)."""
AUDIO_GUIDANCE_LTX23 = GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(28,), rescale=0.7, modality_scale=3.0)
"""Reference ``LTX_2_3_PARAMS.audio_guider_params``."""

def default_steps(family) -> int:
    """Reference default stage-1 step count of a guided stage 1 for the model family (name or `ModelFamily`):
    ``LTX_2_PARAMS`` / ``LTX_2_3_PARAMS.num_inference_steps`` (40 / 30); a distilled family's schedule length.

    Raises ValueError for an unknown family."""
    from ..models.families import get_family

    recipe = get_family(family).recipe
    return recipe.stage1_steps or len(recipe.stage1_sigmas) - 1


def default_guidance(family) -> tuple[GuidanceParams, GuidanceParams]:
    """``(video, audio)`` guided stage-1 defaults of the reference for the model family (name or `ModelFamily`):
    CFG 3 / 7, STG 1 on the family's block (29 for LTX-2.0, 28 for 2.3 and 2.5), rescale 0.7, modality 3.

    Raises:
        ValueError: unknown family.
    """
    from ..models.families import get_family

    block = get_family(family).recipe.stg_block
    if block == 29:
        return VIDEO_GUIDANCE_LTX2, AUDIO_GUIDANCE_LTX2
    if block == 28:
        return VIDEO_GUIDANCE_LTX23, AUDIO_GUIDANCE_LTX23
    return (GuidanceParams(3.0, 1.0, (block,), 0.7, 3.0), GuidanceParams(7.0, 1.0, (block,), 0.7, 3.0))


@dataclass(frozen=True)
class GuidancePass:
    """One model forward that guidance needs.

    Attributes:
        kind: "cond" (positive prompt), "uncond" (negative prompt, for CFG), "perturbed" (STG: skip
            self-attention in the listed blocks), "isolated" (modality guidance: audio->video and video->audio
            cross-attention switched off in every block).
        video_stg_blocks: for "perturbed": blocks whose *video* self-attention is skipped (empty if video STG is off).
        audio_stg_blocks: for "perturbed": blocks whose *audio* self-attention is skipped (empty if audio STG is off).

    Reference ``_guided_denoise``: one "perturbed" forward perturbs both modalities at once (each in its own
    blocks, only if that modality's STG is on). NB diffusers' ``spatio_temporal_guidance_blocks`` skips both
    modalities' self-attention in the same blocks; that is only equivalent when both lists are equal.
    """

    kind: PassKind
    video_stg_blocks: tuple[int, ...] = ()
    audio_stg_blocks: tuple[int, ...] = ()


def plan_passes(video: GuidanceParams, audio: GuidanceParams) -> list[GuidancePass]:
    """The forwards one guided step needs, in reference order: cond, [uncond], [perturbed], [isolated].

    A pass runs when either modality needs it (reference ``_guided_denoise``); a modality that does not use it
    ignores its output.
    """
    passes = [GuidancePass("cond")]
    if video.uses_uncond or audio.uses_uncond:
        passes.append(GuidancePass("uncond"))
    if video.uses_perturbed or audio.uses_perturbed:
        passes.append(
            GuidancePass(
                "perturbed",
                video_stg_blocks=video.stg_blocks if video.uses_perturbed else (),
                audio_stg_blocks=audio.stg_blocks if audio.uses_perturbed else (),
            )
        )
    if video.uses_isolated or audio.uses_isolated:
        passes.append(GuidancePass("isolated"))
    return passes


def combine_guidance(
    params: GuidanceParams,
    cond: torch.Tensor,
    uncond: torch.Tensor | None = None,
    perturbed: torch.Tensor | None = None,
    isolated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Guided x0 prediction for one modality (reference ``MultiModalGuider.calculate``), float32 math.

    ``pred = cond + (cfg - 1)(cond - uncond) + stg (cond - perturbed) + (mod - 1)(cond - isolated)``;
    if ``rescale != 0``: ``pred *= rescale * cond.std() / pred.std() + (1 - rescale)`` where ``std`` is over the
    *whole* tensor (all batch items together; unbiased) exactly like the reference (diffusers' variant uses a
    per-sample std; identical for batch 1). Inputs are **x0 (denoised) predictions**: the reference combines
    x0, and the rescale step is not equivalent in velocity space. A term whose pass did not run (``None``) is
    omitted; it is required when its scale makes it active.

    Returns:
        Tensor in ``cond.dtype``.

    Raises:
        ValueError: an active term's prediction is missing.
    """
    c = cond.float()
    pred = c
    for active, other, scale, name in (
        (params.uses_uncond, uncond, params.cfg_scale - 1.0, "uncond (CFG)"),
        (params.uses_perturbed, perturbed, params.stg_scale, "perturbed (STG)"),
        (params.uses_isolated, isolated, params.modality_scale - 1.0, "isolated (modality guidance)"),
    ):
        if not active:
            continue
        if other is None:
            raise ValueError(f"guidance needs the {name} prediction for scale {scale}")
        pred = pred + scale * (c - other.float())
    if params.rescale != 0:
        factor = c.std() / pred.std()
        factor = params.rescale * factor + (1.0 - params.rescale)
        pred = pred * factor
    return pred.to(cond.dtype)


DenoiseFn = Callable[[GuidancePass], tuple[torch.Tensor | None, torch.Tensor | None]]
BatchedDenoiseFn = Callable[[list[GuidancePass]], list[tuple[torch.Tensor | None, torch.Tensor | None]]]
RunPassesFn = Callable[[list[GuidancePass], DenoiseFn], list[tuple[torch.Tensor | None, torch.Tensor | None]]]


def run_local(denoise_fn: DenoiseFn, passes: list[GuidancePass]) -> list[tuple[torch.Tensor | None,
                                                                               torch.Tensor | None]]:
    """The passes computed in this process: as ONE batched forward when `denoise_fn` offers it (``denoise_fn.many``,
    set by :func:`denoise_loop` for a model function with ``batch``; it returns None when it declines), else one
    forward per pass, in order. The pass-batching hook: `guided_prediction` and ``PassParallel`` call it."""
    many = getattr(denoise_fn, "many", None)
    if many is not None and len(passes) > 1:
        outs = many(passes)
        if outs is not None:
            return list(outs)
    return [denoise_fn(p) for p in passes]
"""``run_passes(passes, denoise) -> [denoise(p) for p in passes]``, computed however the caller likes (e.g.
``parallel.passes.PassParallel``: each pass on another rank, the results exchanged); one pair per pass, in order."""


def guided_prediction(
    denoise_fn: DenoiseFn | BatchedDenoiseFn,
    video_params: GuidanceParams = NO_GUIDANCE,
    audio_params: GuidanceParams = NO_GUIDANCE,
    *,
    step: int = 0,
    last: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    batched: bool = False,
    run_passes: RunPassesFn | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the forwards guidance needs and combine them per modality (reference ``_guided_denoise``).

    Args:
        denoise_fn: ``denoise_fn(GuidancePass) -> (video_x0, audio_x0)`` (either may be ``None`` for an absent
            modality). With ``batched=True`` it is called once with the list of passes and returns one pair per
            pass (so an adapter can stack the passes in the batch dimension, as the reference does).
            Predictions must be **x0** (see :func:`combine_guidance`).
        video_params, audio_params: per-modality guidance.
        step: step index, for ``skip_step``.
        last: previous step's ``(video, audio)`` guided result, returned for a modality that skips this step.
            If both modalities skip, no forward runs.
        run_passes: computes the passes instead of ``[denoise_fn(p) for p in passes]`` (see :data:`RunPassesFn`);
            ``None``: one after the other here. Not with ``batched``.

    Passes whose scales make them unused are not run (cfg == 1, stg == 0, modality == 1 for both modalities ->
    one forward).

    Returns:
        ``(video_x0, audio_x0)`` guided predictions (``None`` where the modality is absent).

    Raises:
        ValueError: a modality skips a step but ``last`` has nothing for it; ``batched`` with ``run_passes``; a
            result count that is not the pass count.
    """
    if batched and run_passes is not None:
        raise ValueError("guided_prediction: batched and run_passes exclude each other")
    v_skip, a_skip = video_params.skips(step), audio_params.skips(step)
    if (v_skip or a_skip) and last is None:
        raise ValueError(f"step {step} is a skip step but no previous prediction was given")
    if v_skip and a_skip:
        return last  # type: ignore[return-value]
    passes = plan_passes(video_params, audio_params)
    if batched:
        outs = list(denoise_fn(passes))  # type: ignore[arg-type]
        if len(outs) != len(passes):
            raise ValueError(f"batched denoise_fn returned {len(outs)} results for {len(passes)} passes")
    elif run_passes is not None:
        outs = list(run_passes(passes, denoise_fn))  # type: ignore[arg-type]
        if len(outs) != len(passes):
            raise ValueError(f"run_passes returned {len(outs)} results for {len(passes)} passes")
    else:
        outs = run_local(denoise_fn, passes)  # type: ignore[arg-type]
    r = {p.kind: o for p, o in zip(passes, outs)}

    def pick(i: int) -> tuple[torch.Tensor | None, ...]:
        return tuple(r[k][i] if k in r else None for k in PASS_KINDS)

    vc, vu, vp, vi = pick(0)
    ac, au, ap, ai = pick(1)
    video = None if vc is None else combine_guidance(video_params, vc, vu, vp, vi)
    audio = None if ac is None else combine_guidance(audio_params, ac, au, ap, ai)
    if v_skip:
        video = last[0]  # type: ignore[index]
    if a_skip:
        audio = last[1]  # type: ignore[index]
    return video, audio


# ---------------------------------------------------------------------------------------------------------------------
# Denoising loop
# ---------------------------------------------------------------------------------------------------------------------


class SamplingCancelled(RuntimeError):
    """Raised by :func:`denoise_loop` when ``LoopHooks.cancel()`` returns True."""


class NonFiniteLatentError(FloatingPointError):
    """A latent became NaN/Inf during sampling; the message names the modality and the step."""


class NonFiniteInputError(ValidationError):
    """A latent was already NaN/Inf before the first step (bad input: e.g. encoded from a NaN image)."""


MaskRule = Literal["reference", "comfyui"]
MASK_RULES: tuple[MaskRule, ...] = ("reference", "comfyui")


def _comfy_blend(x: torch.Tensor | None, clean: torch.Tensor | None, mask: torch.Tensor | None):
    """ComfyUI's inpainting blend ``x·m + clean·(1 − m)`` (float32; ``x`` itself without a mask)."""
    if x is None or mask is None:
        return x
    m = _token_mask(mask, x)
    return x.float() * m + clean.float() * (1.0 - m)


def _comfy_step(x, x0, sigma, sigma_next, noise, sampler: AncestralSampler | None):
    """ComfyUI ``sample_euler`` (``x + (x − x0)/sigma · (sigma_next − sigma)``) or ``sample_euler_ancestral_RF`` on
    the unblended state."""
    if sampler is None:
        return euler_step(x, to_velocity(x, x0, sigma), sigma, sigma_next)
    return ancestral_step(x, x0, sigma, sigma_next, noise, sampler.eta, sampler.s_noise)


class _ReferenceMasks:
    """The reference's mask rule: the model sees the state x; x0 = x − v·(m·σ) per token; the step pulls the
    conditioned tokens to their clean latent (`masked_euler_step`, `_masked_ancestral_step`)."""

    @staticmethod
    def model_input(x, clean, mask, timesteps, sigma):
        return x, timesteps

    @staticmethod
    def blend(x0, clean, mask):
        return x0

    @staticmethod
    def step(x, x0, sigma, sigma_next, noise, token_mask, clean, sampler):
        if sampler is None:
            return masked_euler_step(x, x0, sigma, sigma_next, token_mask, clean)
        return _masked_ancestral_step(x, x0, sigma, sigma_next, noise, token_mask, clean, sampler)


class _ComfyMasks:
    """ComfyUI's `KSamplerX0Inpaint` for LTX-AV: the model sees x·m + clean·(1 − m), x0 = x_in − v·σ with the step's
    σ, the guided x0 is blended the same way, and the sampler steps the unblended state of every token."""

    @staticmethod
    def model_input(x, clean, mask, timesteps, sigma):
        return _comfy_blend(x, clean, mask), sigma

    @staticmethod
    def blend(x0, clean, mask):
        return _comfy_blend(x0, clean, mask)

    @staticmethod
    def step(x, x0, sigma, sigma_next, noise, token_mask, clean, sampler):
        return _comfy_step(x, x0, sigma, sigma_next, noise, sampler)


_MASK_RULE_STEPS = {"reference": _ReferenceMasks, "comfyui": _ComfyMasks}


@dataclass(frozen=True)
class ModelInputs:
    """What :func:`denoise_loop` hands the model function for one forward.

    Attributes:
        video, audio: current packed latents ``[B, Tv, 128]`` / ``[B, Ta, 128]`` (``None`` if absent).
        video_timesteps, audio_timesteps: per-token timesteps ``[B, T]`` float32 in **sigma units**
            (``mask * sigma``; multiply by :data:`TIMESTEP_SCALE` for diffusers' ``timestep``/``audio_timestep``).
            A frozen modality has all zeros.
        video_sigma, audio_sigma: ``[B]`` float32 scalar sigma per item, sigma units (diffusers ``sigma`` /
            ``audio_sigma`` x 1000: LTX-2.3 prompt AdaLN and, with ``use_cross_timestep=True``, the cross-modal
            gates). 0 for a frozen modality (reference ``modality_from_latent_state``).
        guidance: which guidance pass this forward is.
        step: step index.
    """

    video: torch.Tensor | None
    audio: torch.Tensor | None
    video_timesteps: torch.Tensor | None
    audio_timesteps: torch.Tensor | None
    video_sigma: torch.Tensor | None
    audio_sigma: torch.Tensor | None
    guidance: GuidancePass
    step: int


ModelFn = Callable[[ModelInputs], tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True, eq=False)
class ModalityStream:
    """One modality's input to :func:`denoise_loop` (video or audio).

    Attributes:
        latent: the noised packed start latent ``[B, T, C]`` (model space, i.e. normalized), e.g. from
            :func:`noise_latent`.
        mask: per-token denoise mask ``[B, T]`` or ``[B, T, 1]`` (1 = generate, 0 = keep clean); None: ones.
        clean: the clean latent ``[B, T, C]`` masked tokens keep; None: the start latent itself (with the
            reference's noiser, masked tokens of the start latent *are* clean).
        guidance: the modality's `GuidanceParams` (stage 1 of the two-stage recipe: :func:`default_guidance`;
            stage 2: none).
        frozen: context only (audio only): the model sees it at timestep 0 / sigma 0, it is never guided and comes
            back unchanged (docs/design/tiled-data-parallel.md#audio: stage-2 audio stays the stage-1 audio; reference
            ``ModalitySpec(frozen=True, noise_scale=0)``).
    """

    latent: torch.Tensor
    mask: torch.Tensor | None = None
    clean: torch.Tensor | None = None
    guidance: GuidanceParams = NO_GUIDANCE
    frozen: bool = False


@dataclass(frozen=True)
class LoopHooks:
    """The caller's hooks into :func:`denoise_loop`.

    Attributes:
        progress: ``progress(steps_done, total_steps)`` after every step.
        cancel: ``cancel()`` before every step; True raises :class:`SamplingCancelled` (it may also raise its own
            exception, e.g. ComfyUI's interrupt).
    """

    progress: Callable[[int, int], None] | None = None
    cancel: Callable[[], bool] | None = None

    def before_step(self, step: int, total: int) -> None:
        """Raise SamplingCancelled when ``cancel()`` says so (``step``: 0-based)."""
        if self.cancel is not None and self.cancel():
            raise SamplingCancelled(f"sampling cancelled before step {step + 1}/{total}")

    def after_step(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


NO_HOOKS = LoopHooks()


def denoise_loop(
    model_fn: ModelFn,
    sigmas: torch.Tensor | Sequence[float],
    video: ModalityStream | None,
    audio: ModalityStream | None,
    *,
    sampler: AncestralSampler | None = None,
    run_passes: RunPassesFn | None = None,
    mask_rule: MaskRule = "reference",
    hooks: LoopHooks = NO_HOOKS,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Joint audio+video Euler sampling with guidance (reference ``euler_denoising_loop`` + ``GuidedDenoiser``).

    Per step ``i`` (``sigma = sigmas[i]``, ``sigma_next = sigmas[i + 1]``):

    1. per-token timesteps ``mask * sigma`` (frozen audio: 0 and sigma 0),
    2. every needed guidance pass calls ``model_fn(ModelInputs)`` -> velocities ``(v_video, v_audio)``, turned into
       x0 with the per-token timesteps (reference ``X0Model``),
    3. :func:`guided_prediction` combines the x0 predictions,
    4. :func:`masked_euler_step` per modality (conditioned tokens pulled to their clean latent),
    5. ``hooks.progress(i + 1, total)``.

    Args:
        model_fn: the transformer adapter (velocity prediction, diffusers convention).
        sigmas: schedule, 1-D, ending in 0 (see :func:`ltx2_sigmas`, :data:`DISTILLED_STAGE2_SIGMAS`).
        video, audio: each modality's :class:`ModalityStream` (start latent, mask, clean latent, guidance, frozen);
            either may be ``None`` (modality absent), not both; only audio can be frozen.
        sampler: :class:`AncestralSampler` for Euler-ancestral steps (default ``None``: the reference Euler step).
        run_passes: how a step's guidance passes are computed (:data:`RunPassesFn`; default ``None``: one after the
            other in this process). ``parallel.passes.PassParallel`` spreads them over ranks.
        mask_rule: how the denoise masks act (:data:`MaskRule`): "reference" (steps 2 and 4 above) or "comfyui"
            (ComfyUI's ``KSamplerX0Inpaint`` for LTX-AV: the model sees ``x·m + clean·(1 − m)``, x0 is
            ``x_in − v·sigma`` with the step's sigma, the guided x0 is blended ``x0·m + clean·(1 − m)``, and the
            step moves the unblended state ``x`` of every token). Not with a frozen audio stream.
        hooks: :class:`LoopHooks` (progress after every step, cancel before every step).

    Returns:
        ``(video, audio)`` final packed latents (audio is the input object itself when frozen).

    Raises:
        ValueError: bad schedule, shapes or streams; NonFiniteInputError (a ValidationError): a start latent is
        already NaN/Inf; SamplingCancelled; NonFiniteLatentError: a latent went NaN/Inf (naming the modality and
        the step; checked after every step).
    """
    s = as_sigmas(sigmas)
    total = s.numel() - 1
    rule = _check_loop_inputs(video, audio, mask_rule)
    tracks = (_Track.of(video, "video"), _Track.of(audio, "audio"))
    x = (None if video is None else video.latent, None if audio is None else audio.latent)
    last: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
    for i in range(total):
        hooks.before_step(i, total)
        sigma, sigma_next = float(s[i]), float(s[i + 1])
        denoise = _step_model(model_fn, *_model_inputs(rule, tracks, x, sigma, i))
        last = guided_prediction(denoise, *(_guidance(t) for t in tracks), step=i, last=last,
                                 run_passes=run_passes)
        noise = _step_noise(sampler, sigma_next)
        x = tuple(t.step(rule, xt, g, sigma, sigma_next, n, sampler) if t is not None else None
                  for t, xt, g, n in zip(tracks, x, last, noise))
        _check_finite(tracks, x, i + 1)
        hooks.after_step(i + 1, total)
    return x


@dataclass(frozen=True, eq=False)
class _Track:
    """A `ModalityStream` prepared for the loop: the mask as given (what the mask rule blends with), the per-token
    mask float32 ``[B, T]`` (ones by default, zeros when frozen: the timesteps and the step use it), the clean latent
    (None when frozen), and the guidance (none when frozen)."""

    name: str
    mask: torch.Tensor | None
    token_mask: torch.Tensor
    clean: torch.Tensor | None
    guidance: GuidanceParams
    frozen: bool

    @classmethod
    def of(cls, stream: ModalityStream | None, name: str) -> _Track | None:
        if stream is None:
            return None
        x = stream.latent
        if stream.frozen:
            zeros = torch.zeros(x.shape[:2], dtype=torch.float32, device=x.device)
            return cls(name, stream.mask, zeros, None, NO_GUIDANCE, True)
        clean = stream.clean if stream.clean is not None else x
        return cls(name, stream.mask, _prep_mask(stream.mask, x, name), clean, stream.guidance, False)

    def model_input(self, rule, x, sigma: float, batch: int, device):
        """What the model sees of this modality at step sigma `sigma`, by the mask rule: (latent, x0 scale, per-token
        timesteps ``token_mask * sigma`` ``[B, T]``, per-item sigma ``[B]`` on `device`; both 0 when frozen)."""
        own = 0.0 if self.frozen else sigma
        timesteps = self.token_mask * own
        model_x, scale = rule.model_input(x, self.clean, self.mask, timesteps, sigma)
        return model_x, scale, timesteps, torch.full((batch,), own, dtype=torch.float32, device=device)

    def step(self, rule, x, x0, sigma, sigma_next, noise, sampler):
        """`x` after one step to `sigma_next` from the guided `x0` (the mask rule's blend and step); a frozen
        stream's `x` unchanged. Raises ValueError when the model gave no prediction for this modality."""
        if self.frozen:
            return x
        if x0 is None:
            raise ValueError(f"model_fn returned no {self.name} prediction")
        x0 = rule.blend(x0, self.clean, self.mask)
        return rule.step(x, x0, sigma, sigma_next, noise, self.token_mask, self.clean, sampler)


def _check_finite(tracks, x, step: int) -> None:
    """Raise NonFiniteLatentError naming the first modality (video, then audio; a frozen one is never checked) whose
    latent is NaN/Inf after step `step` (1-based)."""
    for track, xt in zip(tracks, x):
        if track is not None and not track.frozen and not bool(torch.isfinite(xt).all()):
            raise NonFiniteLatentError(f"{track.name} latent became non-finite (NaN/Inf) at sampling step {step}")


def _guidance(track: _Track | None) -> GuidanceParams:
    return NO_GUIDANCE if track is None else track.guidance


def _model_inputs(rule, tracks, x, sigma: float, step: int):
    """One step's `ModelInputs` (the guidance pass left None) and the video's and audio's x0 scales."""
    first = x[0] if x[0] is not None else x[1]
    (v_in, v_scale, v_ts, v_sig), (a_in, a_scale, a_ts, a_sig) = (
        t.model_input(rule, xt, sigma, first.shape[0], first.device) if t is not None else (None,) * 4
        for t, xt in zip(tracks, x))
    return ModelInputs(v_in, a_in, v_ts, a_ts, v_sig, a_sig, None, step), v_scale, a_scale


def _step_noise(sampler: AncestralSampler | None, sigma_next: float):
    """The ancestral sampler's ``(video, audio)`` noise for a step to `sigma_next` (drawn only when it adds noise:
    ``eta > 0`` and ``sigma_next != 0``), else ``(None, None)``."""
    if sampler is not None and sigma_next != 0.0 and sampler.eta > 0:
        return sampler.noise_fn()
    return None, None


def _check_loop_inputs(video: ModalityStream | None, audio: ModalityStream | None, mask_rule: str):
    """`denoise_loop`'s refusals before any step; returns the mask rule's step functions."""
    if mask_rule not in MASK_RULES:
        raise ValueError(f"mask_rule={mask_rule!r}: choose one of {', '.join(MASK_RULES)}")
    if video is None and audio is None:
        raise ValueError("denoise_loop needs at least one of video / audio")
    for name, stream in (("video", video), ("audio", audio)):
        if stream is not None and not isinstance(stream, ModalityStream):
            raise TypeError(f"denoise_loop: {name} must be a ModalityStream (or None), got {type(stream).__name__}")
    if video is not None and video.frozen:
        raise ValueError("video=ModalityStream(frozen=True): only the audio stream can be frozen (context at "
                         "timestep 0)")
    if mask_rule == "comfyui" and audio is not None and audio.frozen:
        raise ValueError("mask_rule 'comfyui' has no frozen audio stream (the reference recipe's)")
    latents = [(name, s.latent) for name, s in (("video", video), ("audio", audio)) if s is not None]
    for name, x in latents:
        if x.ndim != 3:
            raise ValueError(f"{name} latent must be packed [B, T, C]; got shape {tuple(x.shape)}")
    if len(latents) == 2 and latents[0][1].shape[0] != latents[1][1].shape[0]:
        raise ValueError(f"video batch {latents[0][1].shape[0]} != audio batch {latents[1][1].shape[0]}")
    for name, x in latents:  # a NaN in the input is the input's fault, not step 1's
        if not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise NonFiniteInputError(f"the input {name} latent has {bad} non-finite values (NaN/Inf) before "
                                      f"sampling step 1: a bad input (e.g. encoded from an image with NaN "
                                      f"pixels, or a latent from a failed earlier stage)")
    return _MASK_RULE_STEPS[mask_rule]


def _prep_mask(mask: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor:
    """A denoise mask `[B, T]` (or `[B, T, 1]`, or None: ones) as float32 on x's device. Raises ValueError for
    another shape."""
    if mask is None:
        return torch.ones(x.shape[:2], dtype=torch.float32, device=x.device)
    m = mask.to(device=x.device, dtype=torch.float32)
    if m.ndim == 3 and m.shape[-1] == 1:
        m = m[..., 0]
    if tuple(m.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{name} mask shape {tuple(mask.shape)} does not match tokens {tuple(x.shape[:2])}")
    return m


def _step_model(model_fn, inputs: ModelInputs, x0_scale_v, x0_scale_a):
    """One step's model function for `guided_prediction`: `denoise(pass)` runs `model_fn` on the step's `inputs`
    (the pass filled in) and turns the velocities into x0 with the mask rule's scales; where `model_fn` offers a
    batched forward (`batch` / `batch_choice`), `denoise.many(passes)` runs the passes as one (None: declined)."""
    def x0(vel_v, vel_a):
        x_v, x_a = inputs.video, inputs.audio
        return (to_x0(x_v, vel_v, x0_scale_v) if (x_v is not None and vel_v is not None) else None,
                to_x0(x_a, vel_a, x0_scale_a) if (x_a is not None and vel_a is not None) else None)

    def denoise(p: GuidancePass):
        return x0(*model_fn(dataclasses.replace(inputs, guidance=p)))

    if hasattr(model_fn, "batch") and hasattr(model_fn, "batch_choice"):
        def many(ps: list[GuidancePass]):
            if not model_fn.batch_choice(ps, inputs.video):
                return None
            return [x0(v, a) for v, a in model_fn.batch(dataclasses.replace(inputs, guidance=ps[0]), ps)]

        denoise.many = many  # type: ignore[attr-defined]
    return denoise


__all__ = [
    "AUDIO_GUIDANCE_LTX2",
    "AncestralSampler",
    "AUDIO_GUIDANCE_LTX23",
    "BASE_SHIFT_ANCHOR",
    "default_steps",
    "DISTILLED_SIGMAS",
    "DISTILLED_STAGE2_SIGMAS",
    "GuidanceParams",
    "GuidanceScales",
    "GuidancePass",
    "LoopHooks",
    "MAX_SHIFT_ANCHOR",
    "ModalityStream",
    "ModelInputs",
    "NO_HOOKS",
    "NO_GUIDANCE",
    "NonFiniteLatentError",
    "PASS_KINDS",
    "RunPassesFn",
    "run_local",
    "SamplingCancelled",
    "TDP_STAGE2_SIGMAS",
    "TIMESTEP_SCALE",
    "VIDEO_GUIDANCE_LTX2",
    "VIDEO_GUIDANCE_LTX23",
    "ancestral_step",
    "as_sigmas",
    "combine_guidance",
    "default_guidance",
    "denoise_loop",
    "euler_step",
    "guided_prediction",
    "ltx2_sigmas",
    "make_av_noise",
    "make_noise",
    "MASK_RULES",
    "masked_euler_step",
    "noise_latent",
    "plan_passes",
    "schedule_tokens",
    "to_velocity",
    "to_x0",
]
