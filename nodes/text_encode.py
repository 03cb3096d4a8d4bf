"""Text Encode (MGPU): Gemma on the fleet -> two CONDITIONING in ComfyUI's native (unprocessed LTX-2) form.

The fleet's text encoder is the file picked from `models/text_encoders/` in the loader: Gemma 3 12B for LTX-2.0 / 2.3
(with the checkpoint's text projection) or, for LTX-2.5, Gemma 4 12B with its projection bundled
(`gemma4-12b-with-proj-ltx-2.5-{bf16,comfy-int8-convrot}`). Either way the outputs are what ComfyUI's own
`CLIPLoader(type="ltxv")` + `CLIPTextEncode` + `LTXVConditioning` give (`[[cond [1, T, C], {"pooled_output": None,
"unprocessed_ltxav_embeds": True, "frame_rate": fps}]]`, checked against ComfyUI 0.33 for 2.5 in
tests/test_gemma4_parallel.py), so graphs built from ComfyUI's 2.5 templates can swap their text nodes for this one.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..mgpu_backend.protocol.job_requests import DEFAULT_NEGATIVE_PROMPT, EncodeTextRequest
from ..mgpu_backend.protocol.job_results import EncodeTextResult
from .common import CATEGORY, NodeError, fleet_input, guard, run_job
from .native_types import DEFAULT_FRAME_RATE, make_conditioning

MODES = ("fleet default", "sharded", "batch_parallel", "replicated")


class TextEncodeMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_TextEncode",
            display_name="Text Encode (MGPU)",
            category=CATEGORY,
            description="Encodes the prompt and the negative prompt with the fleet's Gemma (Gemma 3 with the "
                        "checkpoint's text projection for LTX-2.0 / 2.3; Gemma 4 with the projection bundled in its "
                        "file for LTX-2.5). The outputs are ordinary LTX-2 CONDITIONING (as ComfyUI's own CLIPLoader "
                        "type ltxv + CLIP Text Encode make them) and also work with ComfyUI's samplers.",
            inputs=[
                fleet_input(),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="What the clip shows and sounds like."),
                io.String.Input("negative_prompt", multiline=True, default=DEFAULT_NEGATIVE_PROMPT,
                                tooltip="What to steer away from (used by CFG in the SP Sampler). Default: the "
                                        "reference pipeline's negative prompt."),
                io.Combo.Input("mode", options=list(MODES), default="fleet default",
                               tooltip="How Gemma runs: sharded = one copy split over the devices (least memory), "
                                       "batch_parallel = a replica per device with the two prompts on different "
                                       "devices, replicated = a replica per device; fleet default = the fleet's "
                                       "setting. Changing the mode reloads Gemma."),
                io.Float.Input("frame_rate", default=DEFAULT_FRAME_RATE, min=1.0, max=240.0, step=0.01,
                               tooltip="Frames per second written into the conditioning (as LTXVConditioning does): "
                                       "the samplers time video and audio with it. Use the same rate in "
                                       "LTXVEmptyLatentAudio and CreateVideo."),
            ],
            outputs=[io.Conditioning.Output(display_name="positive"),
                     io.Conditioning.Output(display_name="negative")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, fleet, prompt, negative_prompt, mode, frame_rate) -> io.NodeOutput:
        with guard("Text Encode (MGPU)"):
            payload = EncodeTextRequest(prompts=(prompt, negative_prompt),
                                        mode=None if mode == "fleet default" else mode, frame_rate=float(frame_rate))
            result = run_job(fleet, "encode_text", payload, node_id=cls.hidden.unique_id, what="Text Encode (MGPU)")
            embeds = result.embeds if isinstance(result, EncodeTextResult) else None
            if not embeds or len(embeds) != 2:
                raise NodeError("Text Encode (MGPU): the fleet returned no embeddings")
            return io.NodeOutput(make_conditioning(embeds[0], frame_rate), make_conditioning(embeds[1], frame_rate))
