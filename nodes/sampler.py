"""SP Sampler (MGPU): one guided denoising stage, sequence parallel over the fleet (stage 1 of the two-stage recipe).

The guidance comes as typed inputs, in the manner of ComfyUI's SamplerCustomAdvanced + CFGGuider: "LTX-2 Guidance
(MGPU)" gives one modality's guidance (socket LTX2_MGPU_GUIDANCE: a `GuidanceParams`, or a `GuidanceScales` whose
STG block is the model's default), "LTX-2 Guider (MGPU)" bundles the prompts with the video and audio guidance
(socket LTX2_MGPU_GUIDER: a `sampler_inputs.SamplerGuider`), and SP Sampler (MGPU) takes the guider.

The old SP Sampler, with its eleven widgets (`sampler_inputs.LEGACY_WIDGETS`), stays registered under its old id
(LTX2MGPU_SPSampler) as a deprecated node, so that workflows saved with it load and run as before: ComfyUI maps a
saved node's `widgets_values` onto its widgets by position.
"""
from __future__ import annotations

from comfy_api.latest import io, ui

from .common import CATEGORY, NodeError, fleet_input, guard, run_job
from .lora import loras_input, loras_payload
from .native_types import join_latent
from .sampler_inputs import (AUDIO_DEFAULT, SAMPLERS, VIDEO_DEFAULT, LegacyWidgets, ModalityGuidanceWidgets,
                             SamplerGuider, SamplerSettings, sample_request)
from .sampler_inputs import parse_stg_blocks  # noqa: F401 (re-exported: its home before the guidance nodes)

NAME = "SP Sampler (MGPU)"
GUIDANCE_TYPE = "LTX2_MGPU_GUIDANCE"
GUIDER_TYPE = "LTX2_MGPU_GUIDER"
GuidanceSocket = io.Custom(GUIDANCE_TYPE)
GuiderSocket = io.Custom(GUIDER_TYPE)


def comfy_sampling_device() -> str:
    """The device type ComfyUI's own sampler would hold the latent on for the MGPU MODEL (its `load_device`:
    `model_management.get_torch_device()`): euler_ancestral's noise stream depends on it (`SamplerSpec`)."""
    import comfy.model_management as mm

    return mm.get_torch_device().type


def _scale(name, default, tip, lo=0.0, hi=100.0):
    return io.Float.Input(name, default=default, min=lo, max=hi, step=0.05, tooltip=tip)


def _stg_blocks_input() -> io.String.Input:
    return io.String.Input("stg_blocks", default="auto",
                           tooltip="Transformer blocks whose self-attention the STG pass skips: 'auto' = the "
                                   "reference's block (29 for LTX-2.0, 28 for 2.3; the last block of a shallower "
                                   "model) or indices like '29' or '28,29'.")


def _schedule_inputs() -> list:
    return [
        io.Int.Input("steps", default=30, min=1, max=200,
                     tooltip="Steps of the built-in LTX-2 scheduler (token-count shift, stretched to 0.1), used when "
                             "no sigmas are connected."),
        io.Combo.Input("sampler", options=list(SAMPLERS), default="euler",
                       tooltip="euler: ComfyUI's euler. euler_ancestral: ComfyUI's euler_ancestral for flow models "
                               "(eta 1, noise from the NOISE seed)."),
    ]


def _latent_noise_inputs() -> list:
    return [
        io.Latent.Input("latent", tooltip="LTX-2 latent: video only (EmptyLTXVLatentVideo) or audio+video "
                                          "(LTXVConcatAVLatent); a noise_mask (LTXVImgToVideo) conditions frames."),
        io.Noise.Input("noise", tooltip="Noise source (RandomNoise); drawn for the whole latent as ComfyUI samplers "
                                        "do."),
    ]


def _optional_inputs() -> list:
    return [
        io.Sigmas.Input("sigmas", optional=True,
                        tooltip="Custom schedule (e.g. LTXVScheduler or ManualSigmas), ending in 0; when connected, "
                                "'steps' is ignored."),
        loras_input("LoRAs for this stage (a LoRA (MGPU) chain): fused on every device for this job and restored "
                    "after; the coverage (layers applied per LoRA) is shown on the node."),
    ]


def _positive_input() -> io.Conditioning.Input:
    return io.Conditioning.Input("positive", tooltip="Prompt conditioning (Text Encode (MGPU) or ComfyUI's LTX-2 text "
                                                     "encoder); its frame_rate times the clip.")


def _negative_input() -> io.Conditioning.Input:
    return io.Conditioning.Input("negative", optional=True,
                                 tooltip="Negative conditioning, needed when a CFG scale is not 1.")


def _run(fleet, guider: SamplerGuider, latent: dict, noise, settings: SamplerSettings, node_id) -> io.NodeOutput:
    """Send the stage to the fleet; the node's output and its report (the SP degree and why, the LoRA coverage)."""
    request = sample_request(guider, latent, noise, settings)
    result = run_job(fleet, "sample", request, node_id=node_id, what=NAME)
    lines = [str(result.report)] if result.report else []
    lines += [f"LoRA {r}" for r in result.lora_reports]
    out = join_latent(latent, result.video, result.audio)
    return io.NodeOutput(out, ui=ui.PreviewText("\n".join(lines)) if lines else None)


class GuidanceMGPU(io.ComfyNode):
    """One modality's guidance (CFG, STG, rescale, modality guidance, STG blocks) for LTX-2 Guider (MGPU)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_Guidance",
            display_name="LTX-2 Guidance (MGPU)",
            category=CATEGORY,
            description="Guidance of one modality (video or audio) for LTX-2 Guider (MGPU): classifier-free, "
                        "spatio-temporal (STG) and modality guidance, with the reference's rescale. The reference's "
                        "stage-1 values: video cfg 3, stg 1, rescale 0.7, modality 3; audio cfg 7, the rest the "
                        "same.",
            inputs=[
                _scale("cfg", 3.0, "Classifier-free guidance scale (1 = off). The reference: 3 for video, 7 for "
                                   "audio."),
                _scale("stg", 1.0, "Spatio-temporal guidance scale (0 = off)."),
                _scale("rescale", 0.7, "Guidance rescale (0 = off; the reference's formula — ComfyUI's LTX guiders "
                                       "have none, so 0 equals LTXVDualCFGGuider + STG + modality nodes).", 0.0, 1.0),
                _scale("modality", 3.0, "Modality guidance scale: audio<->video attention off in the extra pass "
                                        "(1 = off)."),
                _stg_blocks_input(),
            ],
            outputs=[GuidanceSocket.Output(display_name="guidance")],
        )

    @classmethod
    def execute(cls, cfg, stg, rescale, modality, stg_blocks) -> io.NodeOutput:
        with guard("LTX-2 Guidance (MGPU)"):
            return io.NodeOutput(ModalityGuidanceWidgets(cfg, stg, rescale, modality, stg_blocks).guidance())


class GuiderMGPU(io.ComfyNode):
    """The prompts and both modalities' guidance, for SP Sampler (MGPU)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_Guider",
            display_name="LTX-2 Guider (MGPU)",
            category=CATEGORY,
            description="The prompts and the guidance of SP Sampler (MGPU), as ComfyUI's CFGGuider is for "
                        "SamplerCustomAdvanced. Without a guidance connected, a modality gets the reference's "
                        "stage-1 guidance (video cfg 3 / audio cfg 7, stg 1, rescale 0.7, modality 3, the model's "
                        "STG block).",
            inputs=[
                _positive_input(),
                _negative_input(),
                GuidanceSocket.Input("video_guidance", optional=True,
                                     tooltip="Video guidance (LTX-2 Guidance (MGPU)); default: the reference's "
                                             "(cfg 3, stg 1, rescale 0.7, modality 3)."),
                GuidanceSocket.Input("audio_guidance", optional=True,
                                     tooltip="Audio guidance (LTX-2 Guidance (MGPU)); default: the reference's "
                                             "(cfg 7, stg 1, rescale 0.7, modality 3)."),
            ],
            outputs=[GuiderSocket.Output(display_name="guider")],
        )

    @classmethod
    def execute(cls, positive, negative=None, video_guidance=None, audio_guidance=None) -> io.NodeOutput:
        with guard("LTX-2 Guider (MGPU)"):
            return io.NodeOutput(SamplerGuider(positive, negative, video_guidance or VIDEO_DEFAULT,
                                               audio_guidance or AUDIO_DEFAULT))


class SPSamplerGuidedMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_SPSamplerGuided",
            display_name=NAME,
            category=CATEGORY,
            description="Denoises an LTX-2 audio+video latent on the fleet, each transformer forward split over the "
                        "devices (sequence parallel; equal to one device up to rounding), with ComfyUI's LTX-AV "
                        "model and sampler semantics (noise masks, guides, reference audio as ComfyUI's own "
                        "sampler treats them). The prompts and the guidance (CFG, STG and modality guidance per "
                        "modality) come from LTX-2 Guider (MGPU).",
            inputs=[fleet_input(),
                    GuiderSocket.Input("guider", tooltip="The prompts and the guidance: LTX-2 Guider (MGPU)."),
                    *_latent_noise_inputs(), *_schedule_inputs(), *_optional_inputs()],
            outputs=[io.Latent.Output(display_name="latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, fleet, guider, latent, noise, steps, sampler, sigmas=None, loras=None) -> io.NodeOutput:
        with guard(NAME):
            if not isinstance(guider, SamplerGuider) and type(guider).__name__ != "SamplerGuider":
                raise NodeError(f"{NAME}: guider input: expected LTX-2 Guider (MGPU), got {type(guider).__name__}")
            settings = SamplerSettings(int(steps), sampler, sigmas, tuple(loras_payload(loras)),
                                       comfy_sampling_device())
            return _run(fleet, guider, latent, noise, settings, cls.hidden.unique_id)


class SPSamplerMGPU(io.ComfyNode):
    """The old SP Sampler, its guidance as eleven widgets: kept (deprecated) so that saved workflows still load."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_SPSampler",
            display_name="SP Sampler (MGPU, guidance widgets — deprecated)",
            category=CATEGORY,
            is_deprecated=True,
            description="The SP Sampler with its guidance as widgets, kept so that workflows saved with it still "
                        "load and run as before; new graphs use SP Sampler (MGPU) with LTX-2 Guider (MGPU).",
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
                _scale("video_cfg", 3.0, "Video classifier-free guidance scale (1 = off)."),
                _scale("video_stg", 1.0, "Video spatio-temporal guidance scale (0 = off)."),
                _scale("video_rescale", 0.7, "Video guidance rescale (0 = off; the reference's formula — ComfyUI's "
                                             "LTX guiders have none, so 0 equals LTXVDualCFGGuider + STG + modality "
                                             "nodes).", 0.0, 1.0),
                _scale("video_modality", 3.0, "Video modality guidance scale: audio<->video attention off in the "
                                              "extra pass (1 = off)."),
                _scale("audio_cfg", 7.0, "Audio classifier-free guidance scale (1 = off)."),
                _scale("audio_stg", 1.0, "Audio spatio-temporal guidance scale (0 = off)."),
                _scale("audio_rescale", 0.7, "Audio guidance rescale (0 = off).", 0.0, 1.0),
                _scale("audio_modality", 3.0, "Audio modality guidance scale (1 = off)."),
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
    def execute(cls, fleet, positive, latent, noise, negative=None, sigmas=None, loras=None,
                **widgets) -> io.NodeOutput:
        # ComfyUI passes every widget by name: the eleven of `LEGACY_WIDGETS` are read into one record at once
        with guard(NAME):
            old = LegacyWidgets.from_values(widgets)
            settings = old.settings(sigmas, tuple(loras_payload(loras)), comfy_sampling_device())
            return _run(fleet, old.guider(positive, negative), latent, noise, settings, cls.hidden.unique_id)
