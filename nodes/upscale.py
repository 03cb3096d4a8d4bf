"""TDP Upscale (MGPU): 2x latent upscale on the fleet, then a short refinement stage in tiles, one tile per device
(tiled data parallelism; stage 2 of the two-stage recipe). By default the audio stays the stage-1 audio, bit for bit
(the reference); on request it is re-denoised with the video as ComfyUI's LTX templates do. Every run shows the tile
drift per forward and whether the blend weights were normalized."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_api.latest import io, ui

from ..mgpu_backend.protocol.stage_requests import SampleRequest, UpscaleRequest
from .common import CATEGORY, NodeError, check_handle, fleet_input, guard, run_job
from .lora import loras_input, loras_payload
from .native_types import (audio_frames_for, comfy_nested, frame_rate_of, join_latent, sigmas_tensor,
                           split_conditioning, split_latent, split_noise, unnest)
from .widgets import read_widgets

NAME = "TDP Upscale (MGPU)"
AUDIO_FROZEN, AUDIO_DENOISE = "frozen stage-1 audio (reference)", "re-denoise with the video (templates)"
DEFAULT_MAX_FIRST_SIGMA = 0.7  # = mgpu_backend.splits.tiled.DEFAULT_MAX_FIRST_SIGMA (not imported at start-up)


def tile_config(tiles_height: int, tiles_width: int, overlap: int):
    """None (balanced grid from the device count) when both counts are 0, else an explicit spatial grid (a 0 on one
    axis means 1 tile there)."""
    if tiles_height == 0 and tiles_width == 0:
        return None
    from ..mgpu_backend.protocol.stage_params import TileCountConfig

    return TileCountConfig.spatial(max(1, int(tiles_height)), max(1, int(tiles_width)), int(overlap))


@dataclass(frozen=True)
class TiledStageWidgets:
    """TDP Upscale's widgets: upscale (run the fleet's 2× latent upscaler first), tiles_height / tiles_width (tile
    counts; 0 and 0 = a balanced grid from the device count), overlap (latent cells), max_first_sigma (the bound on
    the schedule's first sigma), audio (`AUDIO_FROZEN` or `AUDIO_DENOISE`). Raises ValueError for another audio
    choice."""

    upscale: bool
    tiles_height: int
    tiles_width: int
    overlap: int
    max_first_sigma: float = DEFAULT_MAX_FIRST_SIGMA
    audio: str = AUDIO_FROZEN

    def __post_init__(self) -> None:
        if self.audio not in (AUDIO_FROZEN, AUDIO_DENOISE):
            raise ValueError(f"audio={self.audio!r}: choose {AUDIO_FROZEN!r} or {AUDIO_DENOISE!r}")


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
                io.Float.Input("max_first_sigma", default=DEFAULT_MAX_FIRST_SIGMA, min=0.05, max=0.99, step=0.01,
                               optional=True,
                               tooltip="Refuse a schedule whose first sigma is above this. Each tile denoises with "
                                       "only its own part of the video as context, so the more noise stage 2 "
                                       "re-injects the more overlapping tiles disagree (seams). 0.7 is the "
                                       "reference's bound (its tiled stage 2 starts at 0.625). ComfyUI's LTX-2.3 / "
                                       "2.5 templates start stage 2 at 0.85: raise this to run them tiled and watch "
                                       "the tile drift shown on the node."),
                io.Combo.Input("audio", options=[AUDIO_FROZEN, AUDIO_DENOISE], default=AUDIO_FROZEN, optional=True,
                               tooltip="Default: the stage-1 audio passes through unchanged (the reference's final "
                                       "audio; every tile sees it as clean context). Re-denoise: the audio is "
                                       "re-noised to the first sigma and denoised with the video, every tile's audio "
                                       "output averaged - what ComfyUI's LTX templates do in their stage 2."),
            ],
            outputs=[io.Latent.Output(display_name="latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, fleet, latent, positive, noise, sigmas=None, loras=None, **widgets) -> io.NodeOutput:
        from ..mgpu_backend.protocol import stage_params as S

        with guard(NAME):
            # ComfyUI passes every widget by name: read into one record at once (`TiledStageWidgets`)
            w = read_widgets(TiledStageWidgets, widgets, NAME)
            upscale, overlap = w.upscale, w.overlap
            frozen = w.audio == AUDIO_FROZEN
            parts = split_latent(latent)
            if parts.audio_mask is not None:
                raise NodeError(f"{NAME}: an audio noise_mask (audio inpainting / audio conditioning) is not "
                                f"supported by the tiled stage (it runs the reference recipe); use SP Sampler (MGPU)")
            pos = split_conditioning(positive, "positive")
            fps = frame_rate_of(pos)
            video, video_mask = parts.video, parts.video_mask
            if upscale:
                if getattr(check_handle(fleet).config, "upscaler", None) is None:
                    raise NodeError(f"{NAME}: upscale is on but the fleet has no latent upscaler: choose one in "
                                    f"Load Checkpoint (MGPU) (models/latent_upscale_models/), or pass an already "
                                    f"upscaled latent with upscale off")
                video = run_job(fleet, "upscale", UpscaleRequest(video), node_id=cls.hidden.unique_id,
                                what=f"{NAME} (latent upscale)").video
                video_mask = None  # as ComfyUI's LTXVLatentUpsampler: the mask does not survive a resize
            # the stage-1 audio object itself goes back out (frozen: never re-noised, denoised or averaged)
            audio_in = unnest(latent["samples"])[1] if parts.nested else None
            audio = parts.audio if parts.audio is not None else torch.zeros(
                video.shape[0], 8, audio_frames_for(video.shape[2], fps), 16)  # context only; not returned
            if not frozen and not parts.nested:
                raise NodeError(f"{NAME}: audio is set to re-denoise but the latent has no audio (an audio+video "
                                f"LATENT from LTXVConcatAVLatent / the SP Sampler is needed)")
            noise_audio = None
            if parts.nested:
                noise_video, noise_audio = split_noise(noise.generate_noise({"samples": comfy_nested([video, audio])}),
                                                       video.shape, audio.shape)
            else:
                noise_video, _ = split_noise(noise.generate_noise({"samples": video}), video.shape)
            schedule = sigmas_tensor(sigmas) if sigmas is not None else torch.tensor(S.TDP_STAGE2_SIGMAS)
            request = SampleRequest(
                positive=pos.embeds, negative=None, video=video, audio=audio, video_mask=video_mask,
                noise_video=noise_video,
                noise_audio=torch.zeros_like(audio) if frozen else noise_audio.float(), sigmas=schedule,
                fps=fps, mode="tiled", semantics="reference",  # tile diffusion: the reference recipe
                tiles=tile_config(w.tiles_height, w.tiles_width, overlap),
                tile_overlap=int(overlap), audio_frozen=frozen, max_first_sigma=float(w.max_first_sigma),
                loras=loras_payload(loras),
            )
            result = run_job(fleet, "sample", request, node_id=cls.hidden.unique_id, what=NAME)
            text = "\n".join([str(result.report or "")] + [f"LoRA {r}" for r in result.lora_reports]).strip()
            out = join_latent(latent, result.video, audio_in if frozen else result.audio,
                              keep_mask=not upscale)
        return io.NodeOutput(out, ui=ui.PreviewText(text) if text else None)
