"""LoRA (MGPU): picks a LoRA from models/loras with a strength and chains it onto a list (LTX2_MGPU_LORAS) that SP
Sampler (MGPU) and TDP Upscale (MGPU) fuse on the fleet for their stage — and restore after it, exactly, without
reloading the checkpoint. Per-stage sets come from wiring: the distilled LoRA into TDP Upscale only, a user LoRA into
both samplers."""
from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from .common import CATEGORY, NodeError, guard

LORAS_TYPE = "LTX2_MGPU_LORAS"
Loras = io.Custom(LORAS_TYPE)
NAME = "LoRA (MGPU)"


def loras_input(tooltip: str) -> io.Input:
    """The optional `loras` input of the sampling nodes."""
    return Loras.Input("loras", optional=True, tooltip=tooltip)


def loras_payload(loras) -> list[tuple[str, float]]:
    """A LTX2_MGPU_LORAS value (None: none) -> the job payload's `[(path, strength), …]`."""
    out = []
    for entry in loras or ():
        path, strength = entry
        out.append((str(path), float(strength)))
    return out


class LoRAMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_LoRA",
            display_name=NAME,
            category=CATEGORY,
            description="Adds a LoRA (LTX / ComfyUI key naming: diffusion_model.*.lora_A / lora_B, alpha) to a chain "
                        "for SP Sampler (MGPU) or TDP Upscale (MGPU). The sampler fuses the chain into every "
                        "device's weights for its stage and restores them after (no checkpoint reload) and reports "
                        "the layers each LoRA applied to; a LoRA that fits no layer, or was made for another model "
                        "width, is refused.",
            inputs=[
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"),
                               tooltip="A LoRA file in models/loras/ (e.g. the LTX-2 distilled LoRA for stage 2)."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="Multiplies the LoRA's delta (W + strength * alpha/rank * B @ A); 0 leaves "
                                       "it out; may be negative."),
                loras_input("LoRAs chained before this one (another LoRA (MGPU) node); their deltas add up."),
            ],
            outputs=[Loras.Output(display_name="loras",
                                  tooltip="The chain so far, for the 'loras' input of SP Sampler (MGPU) / TDP "
                                          "Upscale (MGPU) or another LoRA (MGPU).")],
        )

    @classmethod
    def execute(cls, lora_name, strength, loras=None) -> io.NodeOutput:
        from ..mgpu_backend.protocol.stage_params import check_lora_file

        with guard(NAME):
            chain = list(loras_payload(loras))
            if float(strength) != 0.0:
                try:
                    path = folder_paths.get_full_path_or_raise("loras", lora_name)
                    check_lora_file(path, float(strength))  # holds LoRA pairs (header only; the fleet checks fit)
                except FileNotFoundError as exc:
                    raise NodeError(f"{NAME}: {exc}") from None
                chain.append((path, float(strength)))
        return io.NodeOutput(tuple(chain))
