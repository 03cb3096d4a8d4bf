"""What differs between Lightricks' recipe and ComfyUI's, as one frozen record passed through (issue 25).

The engine runs one transformer forward (`engine/forward.py`) and one denoising loop (`sampling.denoise_loop`); the
two recipes it reproduces differ in a handful of rules, each a field of `Semantics`:

| field | `REFERENCE` (ltx-core / ltx-pipelines: the CLI) | `COMFYUI` (ComfyUI 0.33: the nodes, the native MODEL) |
|---|---|---|
| block_order | "diffusers": v2a cross-attention normalizes the video from before the block's a2v update | "comfyui": from after it (`model_forward.comfy_block`) |
| token_inputs | "reference": positions and timesteps as diffusers' arguments (`LTX2Denoiser`) | "comfyui": a `ForwardRequest` prepared as ComfyUI does (`ComfyDenoiser` -> `NativeEngine.prepare`) |
| qk_eps | None: the checkpoint's (1e-6) | 1e-5 (`comfy/ldm/lightricks/model.py` CrossAttention) |
| mask_rule | "reference": the denoise mask blended into x0 | "comfyui": `KSamplerX0Inpaint`'s blend (`sampling.MaskRule`) |
| start_noise_masked | True: start = lerp(clean, noised, mask) | False: every token noised (`CONST.noise_scaling`) |
| text_per_prompt | False: the prompts' connectors as one padded batch | True: each prompt alone (`preprocess_text_embeds`) |
| ancestral_noise_layout | None: any (`SamplerSpec.noise_layout`) | "comfyui": ComfyUI's flat latent layout |
| tiles / frozen_audio / guides | tiles and a frozen audio stream; no guides | guides and reference audio; no tiles, no frozen audio |

Code asks the record (`spec.semantics.mask_rule`, `semantics.qk_eps`, …); it never compares a semantics' name. A new
difference is a field here, its two values, and the one place that reads it.
The wire format (`SampleRequest.semantics`, the CLI) carries the name; `semantics_named` resolves it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..protocol.validation import ValidationError

BLOCK_ORDERS = ("diffusers", "comfyui")
MASK_RULES = ("reference", "comfyui")
TOKEN_INPUTS = ("reference", "comfyui")


@dataclass(frozen=True)
class Semantics:
    """One recipe's rules (see the module docstring's table). Raises ValidationError for a value outside its set."""

    name: str
    block_order: str
    token_inputs: str
    qk_eps: float | None
    mask_rule: str
    start_noise_masked: bool
    text_per_prompt: bool
    ancestral_noise_layout: str | None
    allows_tiles: bool
    allows_frozen_audio: bool
    allows_guides: bool

    def __post_init__(self):
        if self.block_order not in BLOCK_ORDERS:
            raise ValidationError(f"block_order={self.block_order!r}: choose one of {', '.join(BLOCK_ORDERS)}")
        if self.token_inputs not in TOKEN_INPUTS:
            raise ValidationError(f"token_inputs={self.token_inputs!r}: choose one of {', '.join(TOKEN_INPUTS)}")
        if self.mask_rule not in MASK_RULES:
            raise ValidationError(f"mask_rule={self.mask_rule!r}: choose one of {', '.join(MASK_RULES)}")
        if self.qk_eps is not None and not self.qk_eps > 0:
            raise ValidationError(f"qk_eps={self.qk_eps}: must be positive (or None: the checkpoint's own)")

    def __str__(self) -> str:
        return self.name


REFERENCE = Semantics(name="reference", block_order="diffusers", token_inputs="reference", qk_eps=None, mask_rule="reference",
                      start_noise_masked=True, text_per_prompt=False, ancestral_noise_layout=None,
                      allows_tiles=True, allows_frozen_audio=True, allows_guides=False)
COMFYUI = Semantics(name="comfyui", block_order="comfyui", token_inputs="comfyui", qk_eps=1e-5, mask_rule="comfyui",
                    start_noise_masked=False, text_per_prompt=True, ancestral_noise_layout="comfyui",
                    allows_tiles=False, allows_frozen_audio=False, allows_guides=True)
ALL = (REFERENCE, COMFYUI)
NAMES = tuple(s.name for s in ALL)


def semantics_named(value: "str | Semantics", what: str = "semantics") -> Semantics:
    """The record for a name from the wire ("reference" | "comfyui"), or `value` itself when it is a record.
    Raises ValidationError naming `what`, the value and the choices."""
    if isinstance(value, Semantics):
        return value
    for s in ALL:
        if s.name == value:
            return s
    raise ValidationError(f"{what}={value!r}: choose one of {', '.join(NAMES)}")


__all__ = ["ALL", "BLOCK_ORDERS", "COMFYUI", "MASK_RULES", "NAMES", "REFERENCE", "Semantics", "TOKEN_INPUTS",
           "semantics_named"]
