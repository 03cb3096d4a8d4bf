"""SP Sampler (MGPU): one guided denoising stage, sequence parallel over the fleet (stage 1 of the two-stage recipe)."""
from __future__ import annotations

import torch
from comfy_api.latest import io, ui

from ..mgpu_backend.protocol.stage_requests import SampleRequest
from .common import CATEGORY, NodeError, fleet_input, guard, run_job
from .lora import loras_input, loras_payload
from .native_types import (GUIDE_CONDITIONING_KEYS, audio_frames_for, comfy_nested, frame_rate_of, guides_payload,
                           join_latent, sigmas_tensor, split_conditioning, split_latent, split_noise)

SAMPLERS = ("euler", "euler_ancestral")
NAME = "SP Sampler (MGPU)"


def parse_stg_blocks(text: str):
    """'auto' or a comma list of block indices -> ("auto" | tuple of ints)."""
    text = (text or "").strip().lower()
    if text in ("", "auto"):
        return "auto"
    try:
        blocks = tuple(int(b) for b in text.replace(" ", "").split(",") if b != "")
    except ValueError:
        raise ValueError(f"stg_blocks={text!r}: 'auto' or block indices like '29' or '28,29'") from None
    if not blocks or any(b < 0 for b in blocks):
        raise ValueError(f"stg_blocks={text!r}: 'auto' or non-negative block indices")
    return blocks


def comfy_sampling_device() -> str:
    """The device type ComfyUI's own sampler would hold the latent on for the MGPU MODEL (its `load_device`:
    `model_management.get_torch_device()`): euler_ancestral's noise stream depends on it (`SamplerSpec`)."""
    import comfy.model_management as mm

    return mm.get_torch_device().type


def make_noise(noise, latent: dict, video: torch.Tensor, audio: torch.Tensor, nested: bool):
    """Video and audio noise from a native NOISE. For a video-only latent, the noise is asked for an audio+video
    latent (the fleet always generates audio with the video; the audio is dropped from the output)."""
    if nested:
        return split_noise(noise.generate_noise(latent), video.shape, audio.shape)
    try:
        nv, na = split_noise(noise.generate_noise({"samples": comfy_nested([video, audio])}), video.shape,
                             audio.shape)
    except Exception:  # noqa: BLE001 - a third-party NOISE that only knows plain tensors
        nv, na = split_noise(noise.generate_noise(latent), video.shape), None
    if na is None:
        seed = int(getattr(noise, "seed", 0) or 0)
        na = torch.randn(audio.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return nv, na


def guidance(cfg: float, stg: float, rescale: float, modality: float):
    from ..mgpu_backend.protocol.stage_params import GuidanceParams

    # stg_blocks is resolved on the fleet (payload "stg_blocks"); (0,) only satisfies the constructor's check
    return GuidanceParams(cfg_scale=float(cfg), stg_scale=float(stg), stg_blocks=(0,), rescale=float(rescale),
                          modality_scale=float(modality))


class SPSamplerMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        def scale(name, default, tip, lo=0.0, hi=100.0):
            return io.Float.Input(name, default=default, min=lo, max=hi, step=0.05, tooltip=tip)

        return io.Schema(
            node_id="LTX2MGPU_SPSampler",
            display_name="SP Sampler (MGPU)",
            category=CATEGORY,
            description="Denoises an LTX-2 audio+video latent on the fleet, each transformer forward split over the "
                        "devices (sequence parallel; equal to one device up to rounding), with ComfyUI's LTX-AV "
                        "model and sampler semantics (noise masks, guides, reference audio as ComfyUI's own "
                        "sampler treats them). Guidance: CFG, STG and modality guidance per modality.",
            inputs=[
                fleet_input(),
                io.Conditioning.Input("positive", tooltip="Prompt conditioning (Text Encode (MGPU) or ComfyUI's "
                                                          "LTX-2 text encoder); its frame_rate times the clip."),
                io.Latent.Input("latent", tooltip="LTX-2 latent: video only (EmptyLTXVLatentVideo) or audio+video "
                                                  "(LTXVConcatAVLatent); a noise_mask (LTXVImgToVideo) conditions "
                                                  "frames."),
                io.Noise.Input("noise", tooltip="Noise source (RandomNoise); drawn for the whole latent as ComfyUI "
                                                "samplers do."),
                io.Int.Input("steps", default=30, min=1, max=200,
                             tooltip="Steps of the built-in LTX-2 scheduler (token-count shift, stretched to 0.1), "
                                     "used when no sigmas are connected."),
                io.Combo.Input("sampler", options=list(SAMPLERS), default="euler",
                               tooltip="euler: ComfyUI's euler. euler_ancestral: ComfyUI's euler_ancestral "
                                       "for flow models (eta 1, noise from the NOISE seed)."),
                scale("video_cfg", 3.0, "Video classifier-free guidance scale (1 = off)."),
                scale("video_stg", 1.0, "Video spatio-temporal guidance scale (0 = off)."),
                scale("video_rescale", 0.7, "Video guidance rescale (0 = off; the reference's formula — ComfyUI's LTX "
                                            "guiders have none, so 0 equals LTXVDualCFGGuider + STG + modality "
                                            "nodes).", 0.0, 1.0),
                scale("video_modality", 3.0, "Video modality guidance scale: audio<->video attention off in the "
                                             "extra pass (1 = off)."),
                scale("audio_cfg", 7.0, "Audio classifier-free guidance scale (1 = off)."),
                scale("audio_stg", 1.0, "Audio spatio-temporal guidance scale (0 = off)."),
                scale("audio_rescale", 0.7, "Audio guidance rescale (0 = off).", 0.0, 1.0),
                scale("audio_modality", 3.0, "Audio modality guidance scale (1 = off)."),
                io.String.Input("stg_blocks", default="auto",
                                tooltip="Transformer blocks whose self-attention the STG pass skips: 'auto' = the "
                                        "reference's block (29 for LTX-2.0, 28 for 2.3; the last block of a "
                                        "shallower model) or indices like '29' or '28,29'."),
                io.Conditioning.Input("negative", optional=True,
                                      tooltip="Negative conditioning, needed when a CFG scale is not 1."),
                io.Sigmas.Input("sigmas", optional=True,
                                tooltip="Custom schedule (e.g. LTXVScheduler or ManualSigmas), ending in 0; when "
                                        "connected, 'steps' is ignored."),
                loras_input("LoRAs for this stage (a LoRA (MGPU) chain): fused on every device for this job and "
                            "restored after; the coverage (layers applied per LoRA) is shown on the node."),
            ],
            outputs=[io.Latent.Output(display_name="latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, fleet, positive, latent, noise, steps, sampler, video_cfg, video_stg, video_rescale,
                video_modality, audio_cfg, audio_stg, audio_rescale, audio_modality, stg_blocks, negative=None,
                sigmas=None, loras=None) -> io.NodeOutput:
        from ..mgpu_backend.protocol import stage_params as S

        with guard(NAME):
            parts = split_latent(latent)
            pos = split_conditioning(positive, "positive", allow=GUIDE_CONDITIONING_KEYS)
            neg = (split_conditioning(negative, "negative", allow=GUIDE_CONDITIONING_KEYS) if negative is not None
                   else None)
            fps = frame_rate_of(pos, neg)
            video = parts.video
            audio = parts.audio
            if audio is None:  # any audio length goes with any video length, as in ComfyUI (e.g. 126 frames)
                audio = torch.zeros(video.shape[0], 8, audio_frames_for(video.shape[2], fps), 16)
            guides = guides_payload(pos, neg, parts.video_mask)
            noise_video, noise_audio = make_noise(noise, latent, video, audio, parts.nested)
            if sigmas is None:
                schedule = S.ltx2_sigmas(int(steps), S.schedule_tokens(video.shape))
            else:
                schedule = sigmas_tensor(sigmas)
            video_g = guidance(video_cfg, video_stg, video_rescale, video_modality)
            audio_g = guidance(audio_cfg, audio_stg, audio_rescale, audio_modality)
            if (video_g.uses_uncond or audio_g.uses_uncond) and neg is None:
                raise NodeError(f"{NAME}: a CFG scale is not 1 but no negative conditioning is connected (connect "
                                f"one, or set video_cfg and audio_cfg to 1)")
            request = SampleRequest(
                positive=pos.embeds, negative=None if neg is None else neg.embeds,
                video=video, audio=audio, video_mask=parts.video_mask, audio_mask=parts.audio_mask,
                semantics="comfyui", guides=guides,
                noise_video=noise_video, noise_audio=noise_audio, sigmas=schedule, fps=fps,
                video_guidance=video_g, audio_guidance=audio_g, stg_blocks=parse_stg_blocks(stg_blocks),
                mode="sequence_parallel", sampler=sampler, seed=int(getattr(noise, "seed", 0) or 0),
                noise_device=comfy_sampling_device(), loras=loras_payload(loras),
            )
            result = run_job(fleet, "sample", request, node_id=cls.hidden.unique_id, what=NAME)
            # the job report: the SP degree this stage ran at and why (the cost model's choice), then the LoRAs
            lines = [str(result.report)] if result.report else []
            lines += [f"LoRA {r}" for r in result.lora_reports]
            out = join_latent(latent, result.video, result.audio)
        return io.NodeOutput(out, ui=ui.PreviewText("\n".join(lines)) if lines else None)
