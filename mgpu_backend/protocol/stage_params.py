"""The values a stage request carries that the ComfyUI nodes build (issue 17, Build 2): guidance per modality, the
sigma schedules, the stage-2 tile counts. A contract module: it imports nothing of the engine (no model, no process
group), so `nodes/` may import it (tests/test_layering.py); `engine/sampling.py` and `splits/tiling.py` use these same
classes and functions (and re-export them under their old names).

Sources: the sigma schedule is Lightricks' `LTX2Scheduler` (ltx-core `components/schedulers.py`; ComfyUI's
`LTXVScheduler` is the same formula); the guidance parameters mirror ltx-core's `MultiModalGuiderParams`
(`components/guiders.py`); the constants are ltx-pipelines' `utils/constants.py`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

BASE_SHIFT_ANCHOR = 1024
"""Token count at which the schedule shift equals ``base_shift`` (reference ``BASE_SHIFT_ANCHOR``)."""
MAX_SHIFT_ANCHOR = 4096
"""Token count at which the shift equals ``max_shift``; also the reference's default token count when the scheduler
is called without a latent -- which is how ``ti2vid_two_stages`` calls it for stage 1."""

DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0)
"""8-step schedule of the distilled model / distilled LoRA (reference ``DISTILLED_SIGMA_VALUES``)."""
DISTILLED_STAGE2_SIGMAS = (0.909375, 0.725, 0.421875, 0.0)
"""Stage-2 (2x upscale refinement with the distilled LoRA) schedule of ``ti2vid_two_stages``
(reference ``STAGE_2_DISTILLED_SIGMA_VALUES``); the upscaled latent is re-noised to ``sigmas[0]``."""
TDP_STAGE2_SIGMAS = (0.625, 0.4, 0.0)
"""Stage-2 schedule of the reference's tiled-data-parallel multi-GPU runner (``TDP_DISTILLED_SIGMAS``)."""


def ltx2_sigmas(
    steps: int,
    num_tokens: int | None = None,
    max_shift: float = 2.05,
    base_shift: float = 0.95,
    stretch: bool = True,
    terminal: float = 0.1,
) -> torch.Tensor:
    """The LTX-2 sigma schedule: float32 1-D tensor of ``steps + 1`` values from ~1 down to exactly 0.

    Formula (reference ``LTX2Scheduler.execute``; ComfyUI ``LTXVScheduler`` identical, same defaults):

    1. ``s = linspace(1, 0, steps + 1)`` (float32).
    2. ``shift = num_tokens * m + b`` with ``m = (max_shift - base_shift) / (4096 - 1024)``,
       ``b = base_shift - 1024 * m`` (so 1024 tokens -> base_shift, 4096 -> max_shift).
    3. ``s = e^shift / (e^shift + (1/s - 1))`` for ``s != 0`` (0 stays 0).
    4. If ``stretch``: with ``z`` the non-zero sigmas, ``k = (1 - z[-1]) / (1 - terminal)``,
       ``z <- 1 - (1 - z) / k`` (the last non-zero sigma becomes ``terminal``).

    Computed with the same float32 operations as the reference, so values match it bit for bit (the first
    value is 0.99999994, not 1.0, for some token counts -- as in the reference). Reference quirk kept: with
    ``steps=1`` and ``stretch=True`` the only non-zero sigma is stretched to ``terminal`` (``[0.1, 0.0]`` for
    4096 tokens). Deviation: where that sigma is exactly 1.0 (most token counts) the reference divides 0 by 0 and
    returns ``[nan, 0.0]``; here the stretch is skipped and ``[1.0, 0.0]`` is returned.

    Args:
        steps: number of denoising steps (>= 1).
        num_tokens: video tokens (``F_lat * H_lat * W_lat``, reference ``prod(latent.shape[2:])``). ``None`` ->
            4096, the reference's default; NB ``ti2vid_two_stages`` calls the scheduler without a latent, so its
            stage 1 always uses 4096 whatever the resolution. ComfyUI uses the latent's token count when a latent is
            connected.
        max_shift, base_shift: shift at 4096 / 1024 tokens (defaults 2.05 / 0.95).
        stretch: stretch so the last non-zero sigma equals ``terminal``.
        terminal: value of the last non-zero sigma after stretching (default 0.1), in [0, 1).

    Raises:
        ValueError: steps < 1, non-positive num_tokens, or terminal outside [0, 1).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    tokens = MAX_SHIFT_ANCHOR if num_tokens is None else int(num_tokens)
    if tokens < 1:
        raise ValueError(f"num_tokens must be >= 1; got {num_tokens}")
    if stretch and not (0.0 <= terminal < 1.0):
        raise ValueError(f"terminal must be in [0, 1); got {terminal}")
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    mm = (max_shift - base_shift) / (MAX_SHIFT_ANCHOR - BASE_SHIFT_ANCHOR)
    b = base_shift - mm * BASE_SHIFT_ANCHOR
    shift = tokens * mm + b
    e = math.exp(shift)
    sigmas = torch.where(sigmas != 0, e / (e + (1 / sigmas - 1)), 0)
    if stretch:
        nz = sigmas != 0
        one_minus_z = 1.0 - sigmas[nz]
        scale = one_minus_z[-1] / (1.0 - terminal)
        if float(scale) != 0.0:  # the reference divides by 0 here (NaN schedule) when steps=1 and sigma[0] == 1
            sigmas[nz] = 1.0 - one_minus_z / scale
    return sigmas.to(torch.float32)


def as_sigmas(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Validate a custom schedule (e.g. ComfyUI SIGMAS): 1-D float32, finite, non-increasing, ends in 0.

    Raises:
        ValueError: naming the problem.
    """
    s = torch.as_tensor(values, dtype=torch.float32).flatten().cpu()
    if s.numel() < 2:
        raise ValueError(f"a sigma schedule needs at least 2 values (one step); got {s.numel()}")
    if not torch.isfinite(s).all():
        raise ValueError("sigma schedule contains non-finite values")
    if float(s[-1]) != 0.0:
        raise ValueError(f"sigma schedule must end in 0; ends in {float(s[-1]):.6g}")
    if (s[1:] > s[:-1]).any() or float(s[0]) > 1.0 or float(s.min()) < 0.0:
        raise ValueError(f"sigma schedule must be non-increasing within [0, 1]; got "
                         f"[{', '.join(f'{v:.6g}' for v in s.tolist())}]")
    return s


def schedule_tokens(latent_shape: Sequence[int]) -> int:
    """Token count the scheduler uses for a latent shape ``[B, C, F, H, W]``: ``F * H * W`` (``prod(shape[2:])``)."""
    return int(math.prod(latent_shape[2:]))


class _ScaleRules:
    """The scale fields' rules and what they imply, shared by :class:`GuidanceParams` and :class:`GuidanceScales`
    (both dataclasses declare cfg_scale, stg_scale, rescale, modality_scale and skip_step)."""

    def _check_scales(self) -> None:
        """Raises ValueError naming the field for a non-finite scale or a negative skip_step."""
        kind = type(self).__name__
        for name in ("cfg_scale", "stg_scale", "rescale", "modality_scale"):
            v = getattr(self, name)
            if not math.isfinite(float(v)):
                raise ValueError(f"{kind}.{name} must be finite; got {v}")
        if self.skip_step < 0:
            raise ValueError(f"{kind}.skip_step must be >= 0; got {self.skip_step}")

    # Which extra forwards this modality needs (reference MultiModalGuider.do_* use math.isclose).
    @property
    def uses_uncond(self) -> bool:
        return not math.isclose(self.cfg_scale, 1.0)

    @property
    def uses_perturbed(self) -> bool:
        return not math.isclose(self.stg_scale, 0.0)

    @property
    def uses_isolated(self) -> bool:
        return not math.isclose(self.modality_scale, 1.0)


@dataclass(frozen=True)
class GuidanceParams(_ScaleRules):
    """Guidance settings for one modality (reference ``MultiModalGuiderParams``; neutral defaults = no guidance).

    Attributes:
        cfg_scale: classifier-free guidance; 1.0 = off (no "uncond" pass needed for this modality).
        stg_scale: spatio-temporal guidance (self-attention skipped in ``stg_blocks``); 0.0 = off.
        stg_blocks: transformer block indices whose self-attention (of this modality) the "perturbed" pass skips.
        rescale: guidance rescale in [0, 1]; 0 = off. ``pred *= rescale * std(cond)/std(pred) + (1 - rescale)``.
        modality_scale: modality guidance: the "isolated" pass runs without audio<->video cross-attention;
            1.0 = off.
        skip_step: reuse the previous step's guided prediction on steps where ``step % (skip_step + 1) != 0``;
            0 = never.

    The two-stage stage-1 defaults of the reference are :data:`VIDEO_GUIDANCE_LTX2`,
    :data:`AUDIO_GUIDANCE_LTX2` (LTX-2.0: STG block 29) and :data:`VIDEO_GUIDANCE_LTX23`,
    :data:`AUDIO_GUIDANCE_LTX23` (LTX-2.3: STG block 28) in `engine/sampling.py`; see `sampling.default_guidance`.
    """

    cfg_scale: float = 1.0
    stg_scale: float = 0.0
    stg_blocks: tuple[int, ...] = field(default_factory=tuple)
    rescale: float = 0.0
    modality_scale: float = 1.0
    skip_step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stg_blocks", tuple(int(b) for b in (self.stg_blocks or ())))
        self._check_scales()
        if self.uses_perturbed and not self.stg_blocks:
            raise ValueError("GuidanceParams: stg_scale != 0 needs at least one block in stg_blocks")

    def skips(self, step: int) -> bool:
        """True when this step reuses the previous guided prediction (reference ``should_skip_step``)."""
        return self.skip_step != 0 and step % (self.skip_step + 1) != 0

    def with_blocks(self, blocks: Sequence[int]) -> GuidanceParams:
        """These settings with ``stg_blocks`` replaced by ``blocks`` (block indices)."""
        return dataclasses.replace(self, stg_blocks=tuple(blocks))


@dataclass(frozen=True)
class GuidanceScales(_ScaleRules):
    """One modality's guidance whose STG blocks are the model's default (``"auto"``): what a node sends when the
    user has not named blocks, resolved on the fleet, which knows the model (``stages.stage.StageLimits.guidance``).

    The fields mean what :class:`GuidanceParams`'s do (cfg_scale 1.0, stg_scale 0.0, rescale 0.0, modality_scale 1.0,
    skip_step 0 = off). Raises ValueError (naming the field) for a non-finite scale or a negative skip_step.
    """

    cfg_scale: float = 1.0
    stg_scale: float = 0.0
    rescale: float = 0.0
    modality_scale: float = 1.0
    skip_step: int = 0

    def __post_init__(self) -> None:
        self._check_scales()

    def with_blocks(self, blocks: Sequence[int]) -> GuidanceParams:
        """The :class:`GuidanceParams` of these scales with ``stg_blocks`` = ``blocks`` (block indices; ValueError
        when STG is on and ``blocks`` is empty)."""
        return GuidanceParams(cfg_scale=self.cfg_scale, stg_scale=self.stg_scale, stg_blocks=tuple(blocks),
                              rescale=self.rescale, modality_scale=self.modality_scale, skip_step=self.skip_step)


@dataclass(frozen=True)
class DimensionTilingConfig:
    """Tiles along one axis: a count (not a size) and the overlap in latent cells."""

    num_tiles: int = 1
    overlap: int = 0

    def __post_init__(self):
        if self.num_tiles < 1:
            raise ValueError(f"num_tiles={self.num_tiles}: must be at least 1")
        if self.overlap < 0:
            raise ValueError(f"overlap={self.overlap}: must be non-negative")


@dataclass(frozen=True)
class TileCountConfig:
    """Tile counts and overlaps per latent axis (frames, height, width)."""

    frames: DimensionTilingConfig = field(default_factory=DimensionTilingConfig)
    height: DimensionTilingConfig = field(default_factory=DimensionTilingConfig)
    width: DimensionTilingConfig = field(default_factory=DimensionTilingConfig)

    @property
    def axes(self) -> tuple[DimensionTilingConfig, DimensionTilingConfig, DimensionTilingConfig]:
        return self.frames, self.height, self.width

    @property
    def num_tiles(self) -> int:
        return math.prod(a.num_tiles for a in self.axes)

    @classmethod
    def spatial(cls, h_tiles: int, w_tiles: int, overlap: int = 5) -> "TileCountConfig":
        return cls(height=DimensionTilingConfig(h_tiles, overlap if h_tiles > 1 else 0),
                   width=DimensionTilingConfig(w_tiles, overlap if w_tiles > 1 else 0))


# ---- LoRA files (a stage request's `loras`): the form of a file, checked from its header -----------------------------

LORA_PAIR_SUFFIXES = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))
"""(A, B) key suffixes of one low-rank pair: the LTX / ComfyUI (PEFT) spelling and kohya's (`weights/lora.py`)."""


def open_lora(path: str | Path, strength: float = 1.0):
    """Open a LoRA file for reading: a `safetensors.safe_open` handle (the header is read; tensors only when asked
    for). Raises FileNotFoundError for a missing file, ValueError naming the file for a strength that is not a finite
    number or a file that is not readable safetensors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    if not math.isfinite(float(strength)):
        raise ValueError(f"{path}: strength {strength!r} must be a finite number")
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def lora_pair_keys(path: str | Path, keys: Sequence[str]) -> list[tuple[str, str, str]]:
    """`(base, A key, B key)` of every low-rank pair among a LoRA file's tensor names, in the file's order (`base`:
    the key without the pair suffix, e.g. `diffusion_model.transformer_blocks.0.attn1.to_q`). Raises ValueError
    naming the file when an A key has no B key, or when there is no pair at all."""
    key_set = set(keys)
    pairs = []
    for key in keys:
        for a_suffix, b_suffix in LORA_PAIR_SUFFIXES:
            if key.endswith(a_suffix):
                base = key[: -len(a_suffix)]
                b_key = base + b_suffix
                if b_key not in key_set:
                    raise ValueError(f"{path}: {key} has no matching {b_key}")
                pairs.append((base, key, b_key))
                break
    if not pairs:
        raise ValueError(f"{path}: no LoRA pairs found (expected keys like "
                         f"'diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight')")
    return pairs


def check_lora_file(path: str | Path, strength: float = 1.0) -> int:
    """The number of low-rank pairs in a LoRA file, from its header alone (what LoRA (MGPU) checks in ComfyUI's
    process; whether they fit the model is checked on the fleet, `lora.LoRAFuser.check`). Raises FileNotFoundError
    and ValueError as `open_lora` and `lora_pair_keys` do."""
    with open_lora(path, strength) as f:
        return len(lora_pair_keys(path, list(f.keys())))

