"""Distributed Decode (MGPU): the video VAE decodes spatial tiles on every device (blended in pixel space); the audio
VAE + vocoder decode the audio once. Outputs native IMAGE and AUDIO for CreateVideo / SaveVideo."""
from __future__ import annotations

from comfy_api.latest import io

from ..mgpu_backend.protocol.stage_requests import DecodeRequest
from .common import CATEGORY, fleet_input, guard, log, run_job
from .native_types import frames_to_image, split_latent, waveform_to_audio
from .upscale import tile_config

NAME = "Distributed Decode (MGPU)"


class DistributedDecodeMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_DistributedDecode",
            display_name="Distributed Decode (MGPU)",
            category=CATEGORY,
            description="Decodes an LTX-2 latent on the fleet: video in spatial tiles over the devices (full time "
                        "axis per tile), audio once. Frames come back through shared memory.",
            inputs=[
                fleet_input(),
                io.Latent.Input("latent", tooltip="LTX-2 latent: audio+video (decodes both) or video only."),
                io.Int.Input("tiles_height", default=0, min=0, max=16,
                             tooltip="Decode tiles along the height; 0 and 0 = a balanced grid from the device "
                                     "count, no tile under 256 px (one device, or a video under 448 px: "
                                     "untiled, as VAEDecode)."),
                io.Int.Input("tiles_width", default=0, min=0, max=16,
                             tooltip="Decode tiles along the width; 0 and 0 = a balanced grid from the device "
                                     "count."),
                io.Int.Input("overlap", default=2, min=0, max=16,
                             tooltip="Tile overlap in latent cells (x32 pixels), blended with trapezoid weights."),
            ],
            outputs=[io.Image.Output(display_name="images"), io.Audio.Output(display_name="audio")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, fleet, latent, tiles_height, tiles_width, overlap) -> io.NodeOutput:
        with guard(NAME):
            parts = split_latent(latent)
            request = DecodeRequest(video=parts.video, audio=parts.audio,
                                    tiles=tile_config(tiles_height, tiles_width, overlap), overlap=int(overlap))
            result = run_job(fleet, "decode", request, node_id=cls.hidden.unique_id, what=NAME)
            # the diffusion decoder would not have fit (tiled automatically, splits/decode.py), or ran its attention
            # without comfy-kitchen on a GPU (models/neighborhood.py)
            for note in (result.report.auto_tiling, result.report.attention) if result.report is not None else ():
                if note:
                    log.warning("%s: %s", NAME, note)
            images = frames_to_image(result.frames)
            audio = waveform_to_audio(result.audio, result.sample_rate)
        return io.NodeOutput(images, audio)
