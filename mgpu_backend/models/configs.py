"""Checkpoint `config` metadata (the original LTX-2 / ComfyUI field names) -> diffusers constructor arguments.

An original single-file checkpoint stores a JSON object in the safetensors metadata key `config` with sections
`transformer`, `vae`, `audio_vae` and `vocoder`, written with the field names of Lightricks' `ltx-core` (which ComfyUI's
`LTXAVModel`, `VideoVAE` and audio VAE read too; see ComfyUI `comfy/model_detection.py`, `comfy/sd.py`,
`comfy/ldm/lightricks/*`). Absent fields take the defaults of the released 19B LTX-2 model. The functions below
translate each section to the keyword arguments of the diffusers class that runs it; the reverse direction
(`*_metadata`) is used by the tiny-model writer so both sides share one definition.
"""
from __future__ import annotations

from typing import Any

# ---- transformer --------------------------------------------------------------------------------------------------

# LTX-2.3 marks its text path with these transformer fields (ltx-core's V2 feature-extractor check)
_V23_FLAGS = ("caption_proj_before_connector", "cross_attention_adaln")


def is_ltx23(transformer_meta: dict[str, Any]) -> bool:
    """True for the LTX-2.3 architecture (gated attention, prompt AdaLN, per-modality text projection)."""
    return any(bool(transformer_meta.get(flag, False)) for flag in _V23_FLAGS)


def transformer_kwargs(meta: dict[str, Any], keyframes_embedding: bool = False) -> dict[str, Any]:
    """`config.transformer` -> `LTX2VideoTransformer3DModel(**kwargs)`.

    `keyframes_embedding`: build the LTX-2.5 `keyframes_abs_pos_embedding` `[1, inner_dim]` (ComfyUI and this
    loader detect it from the file's keys, not from the metadata). `ff_bias` / `audio_ff_bias` /
    `use_prompt_adaln_single` come from the metadata (LTX-2.5: `ff_bias: false`), as ComfyUI reads them.

    Raises ValueError when the video and audio head counts differ (ltx-core asserts they match; the a2v / v2a
    cross-attention runs on the audio head layout).
    """
    v23 = is_ltx23(meta)
    heads = int(meta.get("num_attention_heads", 32))
    audio_heads = int(meta.get("audio_num_attention_heads", 32))
    if heads != audio_heads:
        raise ValueError(f"transformer config: num_attention_heads={heads} differs from audio_num_attention_heads="
                         f"{audio_heads}; LTX-2 requires equal head counts in both streams")
    max_pos = meta.get("positional_embedding_max_pos", [20, 2048, 2048])
    audio_max_pos = meta.get("audio_positional_embedding_max_pos", [20])
    return dict(
        in_channels=int(meta.get("in_channels", 128)),
        out_channels=int(meta.get("out_channels", meta.get("in_channels", 128))),
        num_attention_heads=heads,
        attention_head_dim=int(meta.get("attention_head_dim", 128)),
        cross_attention_dim=int(meta.get("cross_attention_dim", 4096)),
        vae_scale_factors=tuple(meta.get("vae_scale_factors", (8, 32, 32))),
        pos_embed_max_pos=int(max_pos[0]),
        base_height=int(max_pos[1]),
        base_width=int(max_pos[2]),
        gated_attn=bool(meta.get("apply_gated_attention", False)),
        cross_attn_mod=bool(meta.get("cross_attention_adaln", False)),
        audio_in_channels=int(meta.get("audio_in_channels", 128)),
        audio_out_channels=int(meta.get("audio_out_channels", meta.get("audio_in_channels", 128))),
        audio_num_attention_heads=audio_heads,
        audio_attention_head_dim=int(meta.get("audio_attention_head_dim", 64)),
        audio_cross_attention_dim=int(meta.get("audio_cross_attention_dim", 2048)),
        audio_pos_embed_max_pos=int(audio_max_pos[0]),
        audio_gated_attn=bool(meta.get("apply_gated_attention", False)),
        audio_cross_attn_mod=bool(meta.get("cross_attention_adaln", False)),
        num_layers=int(meta.get("num_layers", 48)),
        caption_channels=int(meta.get("caption_channels", 3840)),
        rope_theta=float(meta.get("positional_embedding_theta", 10000.0)),
        rope_double_precision=meta.get("frequencies_precision", "float64") == "float64",
        timestep_scale_multiplier=int(meta.get("timestep_scale_multiplier", 1000)),
        cross_attn_timestep_scale_multiplier=int(meta.get("av_ca_timestep_scale_multiplier", 1000)),
        rope_type=str(meta.get("rope_type", "split")),
        use_prompt_embeddings=not v23,
        ff_bias=bool(meta.get("ff_bias", True)),
        audio_ff_bias=bool(meta.get("audio_ff_bias", True)),
        use_prompt_adaln_single=bool(meta.get("use_prompt_adaln_single", True)),
        use_keyframes_abs_pos_embedding=bool(keyframes_embedding),
    )


def connector_kwargs(meta: dict[str, Any], audio: bool) -> dict[str, Any]:
    """`config.transformer` -> `LTX2ConnectorTransformer1d(**kwargs)` for the video or the audio text connector."""
    heads = int(meta.get("connector_num_attention_heads", 30))
    head_dim = int(meta.get("connector_attention_head_dim", 128))
    if audio:
        heads = int(meta.get("audio_connector_num_attention_heads", heads))
        head_dim = int(meta.get("audio_connector_attention_head_dim", head_dim))
    return dict(
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=int(meta.get("connector_num_layers", 2)),
        num_learnable_registers=int(meta.get("connector_num_learnable_registers", 128)),
        rope_base_seq_len=int(meta.get("connector_positional_embedding_max_pos", [4096])[0]),
        rope_theta=float(meta.get("positional_embedding_theta", 10000.0)),
        rope_double_precision=True,
        causal_temporal_positioning=bool(meta.get("causal_temporal_positioning", False)),
        rope_type=str(meta.get("rope_type", "split")),
        gated_attention=bool(meta.get("connector_apply_gated_attention", False)),
    )


# ---- video VAE ------------------------------------------------------------------------------------------------------

_DOWNSAMPLE = {"compress_space_res": "spatial", "compress_time_res": "temporal", "compress_all_res": "spatiotemporal"}


_UPSAMPLE = {"compress_all": "spatiotemporal", "compress_space": "spatial", "compress_time": "temporal"}


def video_vae_kwargs(meta: dict[str, Any]) -> dict[str, Any]:
    """`config.vae` (ltx-core block list) -> `AutoencoderKLLTX2Video(**kwargs)`.

    Encoder: `res_x` stages separated by `compress_{space,time,all}_res` downsamplers (each with a channel
    `multiplier`). Decoder: `res_x` stages separated by `compress_all` (LTX-2.0) or `compress_space` /
    `compress_time` / `compress_all` (LTX-2.3) depth-to-space upsamplers, each dividing the width by its
    `multiplier` (1 keeps it); the decoder starts at `decoder_base_channels` × the product of the multipliers
    (ComfyUI's rule; ltx-core hard-codes × 8, the same for the released files). One `spatial_padding_mode` applies to
    both encoder and decoder, as in ltx-core and ComfyUI (absent: zeros / reflect). Compression is always 32× spatial,
    8× temporal (set explicitly, docs/design/models.md#the-substrate-diffusers).

    Raises ValueError naming the block for any other layout.
    """
    enc_layers, downsample, enc_channels = [], [], []
    channels = int(meta.get("encoder_base_channels", meta.get("latent_channels", 128)))
    for name, params in meta.get("encoder_blocks", []):
        if name == "res_x":
            enc_layers.append(int(params["num_layers"]))
        elif name in _DOWNSAMPLE:
            downsample.append(_DOWNSAMPLE[name])
            channels *= int(params.get("multiplier", 2))
            enc_channels.append(channels)
        else:
            raise ValueError(f"video VAE config: unsupported encoder block {name!r}")
    # decoder, from the latent side (ltx-core builds `reversed(decoder_blocks)`)
    dec_layers, noise, residual, factors, kinds = [], [], [], [], []
    for name, params in reversed(list(meta.get("decoder_blocks", []))):
        if name == "res_x":
            dec_layers.append(int(params["num_layers"]))
            noise.append(bool(params.get("inject_noise", False)))
        elif name in _UPSAMPLE:
            kinds.append(_UPSAMPLE[name])
            residual.append(bool(params.get("residual", False)) if name == "compress_all" else False)
            factors.append(int(params.get("multiplier", 1)))
        else:
            raise ValueError(f"video VAE config: unsupported decoder block {name!r}")
    width = int(meta.get("decoder_base_channels", 128))
    for factor in factors:
        width *= factor
    widths = []  # the width entering each upsampler (diffusers' `decoder_block_out_channels`, latent side first)
    for factor in factors:
        widths.append(width)
        width //= factor
    mode = meta.get("spatial_padding_mode")
    return dict(
        in_channels=int(meta.get("in_channels", 3)),
        out_channels=int(meta.get("out_channels", 3)),
        latent_channels=int(meta.get("latent_channels", 128)),
        block_out_channels=tuple(enc_channels),
        down_block_types=("LTX2VideoDownBlock3D",) * len(enc_channels),
        # diffusers' decoder reverses these (it takes them pixel side first, like the file's list) ...
        decoder_block_out_channels=tuple(reversed(widths)),
        layers_per_block=tuple(enc_layers),
        decoder_layers_per_block=tuple(reversed(dec_layers)),
        spatio_temporal_scaling=(True,) * len(enc_channels),
        decoder_spatio_temporal_scaling=(True,) * len(factors),
        decoder_inject_noise=tuple(reversed(noise)),
        downsample_type=tuple(downsample),
        upsample_residual=tuple(reversed(residual)),
        upsample_factor=tuple(reversed(factors)),
        upsample_type=tuple(kinds),  # ... but indexes this one latent side first
        timestep_conditioning=bool(meta.get("timestep_conditioning", False)),
        patch_size=int(meta.get("patch_size", 4)),
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=bool(meta.get("causal_decoder", False)),
        encoder_spatial_padding_mode=str(mode or "zeros"),
        decoder_spatial_padding_mode=str(mode or "reflect"),
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )


# ---- audio VAE and vocoder ------------------------------------------------------------------------------------------

def audio_vae_kwargs(meta: dict[str, Any]) -> dict[str, Any]:
    """`config.audio_vae` (`model.params.ddconfig`, `preprocessing.stft`) -> `AutoencoderKLLTX2Audio(**kwargs)`."""
    params = meta.get("model", {}).get("params", {})
    dd = params.get("ddconfig", {})
    stft = meta.get("preprocessing", {}).get("stft", {})
    return dict(
        base_channels=int(dd.get("ch", 128)),
        output_channels=int(dd.get("out_ch", 2)),
        ch_mult=tuple(dd.get("ch_mult", (1, 2, 4))),
        num_res_blocks=int(dd.get("num_res_blocks", 2)),
        attn_resolutions=tuple(dd.get("attn_resolutions", ())) or None,
        in_channels=int(dd.get("in_channels", 2)),
        resolution=int(dd.get("resolution", 256)),
        latent_channels=int(dd.get("z_channels", 8)),
        norm_type=str(dd.get("norm_type", "pixel")),
        causality_axis=str(dd.get("causality_axis", "height")),
        mid_block_add_attention=bool(dd.get("mid_block_add_attention", False)),
        sample_rate=int(params.get("sampling_rate", 16000)),
        mel_hop_length=int(stft.get("hop_length", 160)),
        is_causal=bool(stft.get("causal", True)),
        mel_bins=int(dd.get("mel_bins", 64)),
        double_z=bool(dd.get("double_z", True)),
    )


def _generator_kwargs(meta: dict[str, Any], prefix: str = "", final_activation: bool = True) -> dict[str, Any]:
    """One HiFi-GAN / BigVGAN generator. As ltx-core's and ComfyUI's `Vocoder`: `activation` only matters for AMP
    blocks (resblock "1" is always leaky ReLU); the output ends in tanh when `use_tanh_at_final`, otherwise in a
    clamp to [-1, 1], and in nothing for the BWE generator (`final_activation=False`: its output is a residual)."""
    amp = meta.get("resblock", "1") == "AMP1"
    if not final_activation:
        final = None
    else:
        final = "tanh" if meta.get("use_tanh_at_final", not amp) else "clamp"
    return {
        f"{prefix}in_channels": int(meta.get("num_mels", 64)) * (2 if meta.get("stereo", True) else 1),
        f"{prefix}hidden_channels": int(meta.get("upsample_initial_channel", 1024)),
        f"{prefix}out_channels": 2 if meta.get("stereo", True) else 1,
        f"{prefix}upsample_kernel_sizes": list(meta.get("upsample_kernel_sizes", [16, 15, 8, 4, 4])),
        f"{prefix}upsample_factors": list(meta.get("upsample_rates", [6, 5, 2, 2, 2])),
        f"{prefix}resnet_kernel_sizes": list(meta.get("resblock_kernel_sizes", [3, 7, 11])),
        f"{prefix}resnet_dilations": [list(d) for d in meta.get("resblock_dilation_sizes", [[1, 3, 5]] * 3)],
        f"{prefix}act_fn": str(meta.get("activation", "snakebeta")) if amp else "leaky_relu",
        f"{prefix}antialias": amp,
        f"{prefix}final_act_fn": final,
        f"{prefix}final_bias": bool(meta.get("use_bias_at_final", not amp)),
    }


def vocoder_kwargs(meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`config.vocoder` -> (`"LTX2Vocoder"` | `"LTX2VocoderWithBWE"`, kwargs).

    LTX-2.0 stores a flat HiFi-GAN config; LTX-2.3 nests `{"vocoder": {...}, "bwe": {...}}` (bandwidth extension:
    16 kHz mel -> vocoder at `bwe.input_sampling_rate` -> BWE generator at `bwe.output_sampling_rate`).
    """
    if "bwe" in meta:
        main, bwe = meta["vocoder"], meta["bwe"]
        kwargs = _generator_kwargs(main)
        kwargs.update(_generator_kwargs(bwe, prefix="bwe_", final_activation=False))
        kwargs.update(
            filter_length=int(bwe.get("n_fft", 512)),
            hop_length=int(bwe.get("hop_length", 80)),
            window_length=int(bwe.get("n_fft", 512)),
            num_mel_channels=int(bwe.get("num_mels", 64)),
            input_sampling_rate=int(bwe.get("input_sampling_rate", 16000)),
            output_sampling_rate=int(bwe.get("output_sampling_rate", 48000)),
        )
        return "LTX2VocoderWithBWE", kwargs
    kwargs = _generator_kwargs(meta)
    kwargs["output_sampling_rate"] = int(meta.get("output_sample_rate", meta.get("output_sampling_rate", 24000)))
    return "LTX2Vocoder", kwargs


# ---- latent upscaler ------------------------------------------------------------------------------------------------

def upsampler_kwargs(meta: dict[str, Any]) -> dict[str, Any]:
    """Upscaler file `config` metadata -> `LTX2LatentUpsamplerModel(**kwargs)`."""
    return dict(
        in_channels=int(meta.get("in_channels", 128)),
        mid_channels=int(meta.get("mid_channels", 1024)),
        num_blocks_per_stage=int(meta.get("num_blocks_per_stage", 4)),
        dims=int(meta.get("dims", 3)),
        spatial_upsample=bool(meta.get("spatial_upsample", True)),
        temporal_upsample=bool(meta.get("temporal_upsample", False)),
        rational_spatial_scale=float(meta.get("spatial_scale", 2.0)),
        use_rational_resampler=bool(meta.get("rational_resampler", False)),
    )
