"""TDP Upscale (MGPU): 2x latent upscale on the fleet, then a short refinement stage in tiles, one tile per device
(tiled data parallelism; stage 2 of the two-stage recipe). The audio stays the stage-1 audio, bit for bit."""
from __future__ import annotations

import torch
from comfy_api.latest import io, ui

from .common import CATEGORY, NodeError, check_handle, fleet_input, guard, run_job
from .lora import loras_input, loras_payload
from .native_types import (audio_frames_for, comfy_nested, frame_rate_of, join_latent, sigmas_tensor,
                           split_conditioning, split_latent, split_noise, unnest)

NAME = "TDP Upscale (MGPU)"


def tile_config(tiles_height: int, tiles_width: int, overlap: int):
    """None (balanced grid from the device count) when both counts are 0, else an explicit spatial grid (a 0 on one
    axis means 1 tile there)."""
    if tiles_height == 0 and tiles_width == 0:
        return None
    from ..mgpu_backend.parallel.tiling import TileCountConfig

    return TileCountConfig.spatial(max(1, int(tiles_height)), max(1, int(tiles_width)), int(overlap))


class TDPUpscaleMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_TDPUpscale",
            display_name="TDP Upscale (MGPU)",
            category=CATEGORY,
            description="Stage 2: upscales the stage-1 latent 2x with the fleet's latent upscaler and refines it in "
                        "overlapping tiles spread over the devices (blended with trapezoid weights). The stage-1 "
                        "audio is kept unchanged.",
            inputs=[
                fleet_input(),
                io.Latent.Input("latent", tooltip="The stage-1 latent (SP Sampler (MGPU) output), or an already "
                                                  "upscaled one (set upscale off)."),
                io.Conditioning.Input("positive", tooltip="Prompt conditioning (no guidance in this stage); its "
                                                          "frame_rate times the clip."),
                io.Noise.Input("noise", tooltip="Noise source (RandomNoise) for re-noising the upscaled latent to the "
                                                "first sigma."),
                io.Boolean.Input("upscale", default=True,
                                 tooltip="On: run the 2x latent upscaler of the fleet (Load Checkpoint's upscaler) "
                                         "first. Off: the latent is already upscaled."),
                io.Int.Input("tiles_height", default=0, min=0, max=16,
                             tooltip="Tiles along the height; 0 and 0 = a balanced grid from the device count "
                                     "(2 -> 1x2, 4 -> 2x2, 8 -> 2x4)."),
                io.Int.Input("tiles_width", default=0, min=0, max=16,
                             tooltip="Tiles along the width; 0 and 0 = a balanced grid from the device count."),
                io.Int.Input("overlap", default=5, min=0, max=32,
                             tooltip="Tile overlap in latent cells (x32 pixels); the balanced grid shrinks it to fit "
                                     "a small latent."),
                io.Sigmas.Input("sigmas", optional=True,
                                tooltip="Stage-2 schedule ending in 0; default 0.625, 0.4, 0 (the reference's tiled "
                                        "stage 2). Tiles drift apart for a high first sigma: it is bounded."),
                loras_input("LoRAs for this stage (a LoRA (MGPU) chain), e.g. the LTX-2 distilled LoRA at 1.0: "
                            "fused on every device for this job and restored after; the coverage is shown on the "
                            "node."),
            ],
            outputs=[io.Latent.Output(display_name="latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, fleet, latent, positive, noise, upscale, tiles_height, tiles_width, overlap,
                sigmas=None, loras=None) -> io.NodeOutput:
        from ..mgpu_backend import sampling as S

        with guard(NAME):
            parts = split_latent(latent)
            pos = split_conditioning(positive, "positive")
            fps = frame_rate_of(pos)
            video, video_mask = parts.video, parts.video_mask
            if upscale:
                if getattr(check_handle(fleet).config, "upscaler", None) is None:
                    raise NodeError(f"{NAME}: upscale is on but the fleet has no latent upscaler: choose one in "
                                    f"Load Checkpoint (MGPU) (models/latent_upscale_models/), or pass an already "
                                    f"upscaled latent with upscale off")
                video = run_job(fleet, "upscale", {"video": video}, node_id=cls.hidden.unique_id,
                                what=f"{NAME} (latent upscale)")["video"]
                video_mask = None  # as ComfyUI's LTXVLatentUpsampler: the mask does not survive a resize
            # the stage-1 audio object itself goes back out (frozen: never re-noised, denoised or averaged)
            audio_in = unnest(latent["samples"])[1] if parts.nested else None
            audio = parts.audio if parts.audio is not None else torch.zeros(
                video.shape[0], 8, audio_frames_for(video.shape[2], fps), 16)  # context only; not returned
            if parts.nested:
                noise_video, _ = split_noise(noise.generate_noise({"samples": comfy_nested([video, audio])}),
                                             video.shape, audio.shape)
            else:
                noise_video, _ = split_noise(noise.generate_noise({"samples": video}), video.shape)
            schedule = sigmas_tensor(sigmas) if sigmas is not None else torch.tensor(S.TDP_STAGE2_SIGMAS)
            payload = {
                "positive": pos.embeds, "negative": None, "video": video, "audio": audio, "video_mask": video_mask,
                "noise_video": noise_video, "noise_audio": torch.zeros_like(audio), "sigmas": schedule, "fps": fps,
                "mode": "tiled", "tiles": tile_config(tiles_height, tiles_width, overlap),
                "tile_overlap": int(overlap), "audio_frozen": True, "loras": loras_payload(loras),
            }
            result = run_job(fleet, "sample", payload, node_id=cls.hidden.unique_id, what=NAME)
            lora_text = "\n".join(f"LoRA {r}" for r in result.get("lora_reports") or ())
            out = join_latent(latent, result["video"], audio_in, keep_mask=not upscale)
        return io.NodeOutput(out, ui=ui.PreviewText(lora_text) if lora_text else None)
