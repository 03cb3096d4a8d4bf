"""Key maps between the original Lightricks single-file layout and the diffusers LTX-2 modules.

Every map is a bijection on dotted key names, written as whole-segment renames (never substring replacement, so
`adaln_single` cannot clobber `av_ca_a2v_gate_adaln_single`). `to_diffusers` is used by the loaders,
`to_original` by the tiny-model writer, so the two directions are tested against each other and against diffusers'
own single-file converters (`diffusers.loaders.single_file_utils.convert_ltx2_*_to_diffusers`).

Sources of the renames: diffusers `scripts/convert_ltx2_to_diffusers.py` and `loaders/single_file_utils.py`
(transformer, connectors, video VAE, audio VAE, vocoder), and Lightricks' `ltx-core` module names for the LTX-2.3
additions (`prompt_adaln_single`, the bandwidth-extension vocoder).
"""
from __future__ import annotations

import re

# Component prefixes inside an original single-file checkpoint (docs/design/models.md#checkpoint-files).
TRANSFORMER_PREFIX = "model.diffusion_model."
VIDEO_VAE_PREFIX = "vae."
AUDIO_VAE_PREFIX = "audio_vae."
VOCODER_PREFIX = "vocoder."
TEXT_PROJECTION_PREFIX = "text_embedding_projection."
CONNECTOR_PREFIXES = ("video_embeddings_connector.", "audio_embeddings_connector.")

# original segment -> diffusers segment, for the transformer and the text connectors
_TRANSFORMER_SEGMENTS = {
    "patchify_proj": "proj_in",
    "audio_patchify_proj": "audio_proj_in",
    "adaln_single": "time_embed",
    "audio_adaln_single": "audio_time_embed",
    "prompt_adaln_single": "prompt_adaln",  # LTX-2.3; diffusers' converter leaves it un-renamed (docs/design/models.md)
    "audio_prompt_adaln_single": "audio_prompt_adaln",
    "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
    "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
    "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
    "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate",
    "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
    "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
}
_CONNECTOR_SEGMENTS = {
    "video_embeddings_connector": "video_connector",
    "audio_embeddings_connector": "audio_connector",
    "transformer_1d_blocks": "transformer_blocks",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
}
_VAE_SEGMENTS = {"res_blocks": "resnets"}
# timestep-conditioned decoders: the decoder-level (not per-block) embedder and output modulation
_VAE_DECODER_TOP = {"decoder.last_time_embedder.": "decoder.time_embedder.",
                    "decoder.last_scale_shift_table": "decoder.scale_shift_table"}
_VOCODER_SEGMENTS = {"ups": "upsamplers", "resblocks": "resnets", "conv_pre": "conv_in", "conv_post": "conv_out",
                     "act_post": "act_out"}
_LOWPASS = (".downsample.lowpass.filter", ".downsample.filter")  # anti-aliased activations of the AMP1 resblocks
# LTX-2.3 vocoder: ltx-core's `VocoderWithBWE` holds `vocoder.*` (main) and `bwe_generator.*`, plus `mel_stft.*`
_STATS = {"per_channel_statistics.mean-of-means": "latents_mean", "per_channel_statistics.std-of-means": "latents_std"}
# statistics the original files carry that diffusers does not use (loaded and dropped, never an error)
VAE_IGNORED_SUFFIXES = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds",
                        "per_channel_statistics.mean-of-stds_over_std-of-means")


def _rename_segments(key: str, table: dict[str, str]) -> str:
    return ".".join(table.get(seg, seg) for seg in key.split("."))


def _invert(table: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in table.items()}


def transformer_to_diffusers(key: str) -> str:
    """Original transformer key (without `model.diffusion_model.`) -> `LTX2VideoTransformer3DModel` key."""
    return _rename_segments(key, _TRANSFORMER_SEGMENTS)


def transformer_to_original(key: str) -> str:
    return _rename_segments(key, _invert(_TRANSFORMER_SEGMENTS))


def connector_to_diffusers(key: str) -> str:
    """`video_embeddings_connector.transformer_1d_blocks.0.attn1.q_norm.weight` ->
    `video_connector.transformer_blocks.0.attn1.norm_q.weight` (keys of diffusers' `LTX2TextConnectors`)."""
    return _rename_segments(key, _CONNECTOR_SEGMENTS)


def connector_to_original(key: str) -> str:
    return _rename_segments(key, _invert(_CONNECTOR_SEGMENTS))


COMFYUI_MODEL_PREFIX = "diffusion_model."  # ComfyUI's `BaseModel` holds the LTX(AV) model as `diffusion_model`
_CONNECTOR_MODULES = ("video_connector.", "audio_connector.")  # the connectors' diffusers module names


def comfyui_weight_key(module: str) -> str:
    """The key ComfyUI's model state dict gives the weight of the Linear at diffusers module path `module`:
    `transformer_blocks.0.attn1.to_q` -> `diffusion_model.transformer_blocks.0.attn1.to_q.weight`; the text
    connectors (`video_connector.transformer_blocks.0.attn1.to_q`, the connector modules' diffusers names) sit inside
    ComfyUI's LTX-AV model: `diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight`
    (ComfyUI 0.33 `comfy/ldm/lightricks/av_model.py`). The key ComfyUI seeds a LoRA's re-quantization with."""
    original = connector_to_original(module) if module.startswith(_CONNECTOR_MODULES) else \
        transformer_to_original(module)
    return f"{COMFYUI_MODEL_PREFIX}{original}.weight"


# Video VAE block numbering. The original encoder is a flat list: resnet stage i at 2i, its downsampler at 2i+1,
# the mid block last; the decoder starts with the mid block, then (upsampler, resnet stage) pairs.
_ENC = re.compile(r"^encoder\.down_blocks\.(\d+)\.(.*)$")
_DEC = re.compile(r"^decoder\.up_blocks\.(\d+)\.(.*)$")
_D_ENC_STAGE = re.compile(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)$")
_D_ENC = re.compile(r"^encoder\.down_blocks\.(\d+)\.(.*)$")
_D_DEC_UP = re.compile(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$")
_D_DEC = re.compile(r"^decoder\.up_blocks\.(\d+)\.(.*)$")


def video_vae_to_diffusers(key: str, num_down_stages: int = 4) -> str:
    """Original video-VAE key (without `vae.`) -> `AutoencoderKLLTX2Video` key.

    `num_down_stages` is the number of encoder stages (4 for LTX-2: the flat original list has 2·4 + 1 blocks).
    """
    for orig, new in _STATS.items():
        if key == orig:
            return new
    for orig, new in _VAE_DECODER_TOP.items():
        if key.startswith(orig):
            return new + key[len(orig):]
    m = _ENC.match(key)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx == 2 * num_down_stages:
            key = f"encoder.mid_block.{rest}"
        elif idx % 2 == 0:
            key = f"encoder.down_blocks.{idx // 2}.{rest}"
        else:
            key = f"encoder.down_blocks.{idx // 2}.downsamplers.0.{rest}"
    m = _DEC.match(key)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx == 0:
            key = f"decoder.mid_block.{rest}"
        elif idx % 2 == 1:
            key = f"decoder.up_blocks.{(idx - 1) // 2}.upsamplers.0.{rest}"
        else:
            key = f"decoder.up_blocks.{(idx - 2) // 2}.{rest}"
    return _rename_segments(key, _VAE_SEGMENTS)


def video_vae_to_original(key: str, num_down_stages: int = 4) -> str:
    for orig, new in _STATS.items():
        if key == new:
            return orig
    for orig, new in _VAE_DECODER_TOP.items():
        if key.startswith(new):
            return orig + key[len(new):]
    key = _rename_segments(key, _invert(_VAE_SEGMENTS))
    if key.startswith("encoder.mid_block."):
        return f"encoder.down_blocks.{2 * num_down_stages}." + key[len("encoder.mid_block."):]
    if key.startswith("decoder.mid_block."):
        return "decoder.up_blocks.0." + key[len("decoder.mid_block."):]
    m = _D_ENC_STAGE.match(key)
    if m:
        return f"encoder.down_blocks.{2 * int(m.group(1)) + 1}.{m.group(2)}"
    m = _D_ENC.match(key)
    if m:
        return f"encoder.down_blocks.{2 * int(m.group(1))}.{m.group(2)}"
    m = _D_DEC_UP.match(key)
    if m:
        return f"decoder.up_blocks.{2 * int(m.group(1)) + 1}.{m.group(2)}"
    m = _D_DEC.match(key)
    if m:
        return f"decoder.up_blocks.{2 * int(m.group(1)) + 2}.{m.group(2)}"
    return key


def audio_vae_to_diffusers(key: str) -> str:
    """Original audio-VAE key (without `audio_vae.`) -> `AutoencoderKLLTX2Audio` key."""
    return _STATS.get(key, key)


def audio_vae_to_original(key: str) -> str:
    return _invert(_STATS).get(key, key)


def vocoder_to_diffusers(key: str) -> str:
    """Original vocoder key (without `vocoder.`) -> `LTX2Vocoder` / `LTX2VocoderWithBWE` key.

    The LTX-2.3 file nests `vocoder.vocoder.*`, `vocoder.bwe_generator.*` and `vocoder.mel_stft.*`; diffusers'
    `LTX2VocoderWithBWE` uses the same three sub-module names, so only the generator-internal renames apply.
    """
    if key.endswith(_LOWPASS[0]):
        key = key[: -len(_LOWPASS[0])] + _LOWPASS[1]
    return _rename_segments(key, _VOCODER_SEGMENTS)


def vocoder_to_original(key: str) -> str:
    if key.endswith(_LOWPASS[1]):
        key = key[: -len(_LOWPASS[1])] + _LOWPASS[0]
    return _rename_segments(key, _invert(_VOCODER_SEGMENTS))


def upsampler_to_diffusers(key: str) -> str:
    """The latent-upscaler file uses the module names of `LTX2LatentUpsamplerModel` already."""
    return key


def upsampler_to_original(key: str) -> str:
    return key
