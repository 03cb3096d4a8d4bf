"""Tiny random-weight LTX-2 / LTX-2.3 models written in exactly the real file layouts.

These files are the fixtures of every test and the built-in default of the demo. Only widths and depths shrink;
everything the parallel code depends on keeps its real value: 128-channel video latents, 8 × 16 audio latents, the
real VAE compression (8 × 32 × 32), and 8 heads in both the video and the audio stream (so W = 2, 4, 8 splits are
testable). The `config` metadata uses the original field names (the same ComfyUI's loaders read), so the files load
through the real loading code of this project — and, for the transformer and video VAE, ComfyUI's.

Every parameter is filled explicitly (diffusers builds some with `torch.empty`,
docs/design/models.md#the-substrate-diffusers) and every tensor is checked finite before writing. Deterministic per
seed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..models import configs, keymaps, quant
from ..models.families import PROJECTION_DUAL, get_family
from ..models.fp8 import SCALE_SUFFIX, quantize_fp8
from .tiny_fill import _fill, tiny_vae_metadata  # noqa: F401 (re-exported: tiny_vae_metadata)

TINY_GEMMA_HIDDEN = 64
TINY_GEMMA_LAYERS = 2  # -> 3 hidden states (embeddings + 2 layers)
TINY_TEXT_FEATURES = TINY_GEMMA_HIDDEN * (TINY_GEMMA_LAYERS + 1)


def tiny_transformer_metadata(variant: str) -> dict[str, Any]:
    """`config.transformer` of the tiny model: video 8 heads × 8, audio 8 heads × 4, 2 blocks."""
    meta: dict[str, Any] = {
        "_class_name": "AVTransformer3DModel",
        "in_channels": 128, "out_channels": 128, "audio_in_channels": 128, "audio_out_channels": 128,
        "num_attention_heads": 8, "attention_head_dim": 8,
        "audio_num_attention_heads": 8, "audio_attention_head_dim": 4,
        "cross_attention_dim": 64, "audio_cross_attention_dim": 32,
        "caption_channels": TINY_GEMMA_HIDDEN, "num_layers": 2,
        "positional_embedding_theta": 10000.0, "positional_embedding_max_pos": [20, 2048, 2048],
        "audio_positional_embedding_max_pos": [20], "vae_scale_factors": [8, 32, 32],
        "use_middle_indices_grid": True, "rope_type": "split", "frequencies_precision": "float64",
        "timestep_scale_multiplier": 1000, "av_ca_timestep_scale_multiplier": 1000,
        "connector_num_attention_heads": 8, "connector_attention_head_dim": 8, "connector_num_layers": 1,
        # ComfyUI hard-codes the connector RoPE range to 4096 positions and diffusers defaults to it; ltx-core reads
        # this field (default [1]), so the file states it, as the released files do
        "connector_positional_embedding_max_pos": [4096],
        # the released files set it: ComfyUI then gives the first latent frame the time span [0, 1) pixel frames
        # like ltx-core and diffusers (which always do); without it ComfyUI's video RoPE positions differ
        "causal_temporal_positioning": True,
        # fixed architecture fields of the released files; ltx-core's `LTXModelConfigurator` asserts each value
        # (`check_config_value`), ComfyUI and diffusers ignore them
        "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None, "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": 1000, "use_linear_projection": False, "only_cross_attention": False,
        "cross_attention_norm": True, "double_self_attention": False, "upcast_attention": False,
        "standardization_norm": "rms_norm", "norm_elementwise_affine": False, "qk_norm": "rms_norm",
        "positional_embedding_type": "rope", "use_audio_video_cross_attention": True, "share_ff": False,
        "av_cross_ada_norm": True, "norm_eps": 1e-06, "attention_type": "default",
    }
    family = get_family(variant)  # raises ValueError naming the known families
    meta.update(family.transformer_flags)
    if family.splits_text:  # per-modality connectors: the audio one at the audio width
        meta.update({"audio_connector_num_attention_heads": 8, "audio_connector_attention_head_dim": 4})
    return meta


def tiny_audio_vae_metadata() -> dict[str, Any]:
    return {
        "model": {"params": {"sampling_rate": 16000, "ddconfig": {
            "ch": 16, "out_ch": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
            "in_channels": 2, "resolution": 256, "z_channels": 8, "double_z": True, "norm_type": "pixel",
            "causality_axis": "height", "mid_block_add_attention": False, "mel_bins": 64}}},
        "preprocessing": {"stft": {"hop_length": 160, "filter_length": 1024, "causal": True},
                          "mel": {"n_mel_channels": 64}},
    }


def tiny_vocoder_metadata(variant: str) -> dict[str, Any]:
    hifigan = {"upsample_initial_channel": 64, "upsample_rates": [6, 5, 2, 2, 2],
               "upsample_kernel_sizes": [16, 15, 8, 4, 4], "resblock_kernel_sizes": [3, 7, 11],
               "resblock_dilation_sizes": [[1, 3, 5]] * 3, "stereo": True, "resblock": "1", "num_mels": 64,
               "output_sample_rate": 24000}
    if not get_family(variant).vocoder_bwe:
        return hifigan
    amp = {"resblock": "AMP1", "activation": "snakebeta", "stereo": True, "num_mels": 64,
           "use_tanh_at_final": False, "use_bias_at_final": False, "resblock_kernel_sizes": [3, 7, 11],
           "resblock_dilation_sizes": [[1, 3, 5]] * 3, "upsample_initial_channel": 64}
    return {"vocoder": {**amp, "upsample_rates": [5, 2, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4]},
            "bwe": {**amp, "upsample_rates": [6, 5, 2, 2, 2], "upsample_kernel_sizes": [12, 11, 4, 4, 4],
                    "input_sampling_rate": 16000, "output_sampling_rate": 48000, "hop_length": 80, "n_fft": 512}}


def tiny_upsampler_metadata() -> dict[str, Any]:
    return {"_class_name": "LatentUpsampler", "in_channels": 128, "mid_channels": 32, "num_blocks_per_stage": 1,
            "dims": 3, "spatial_upsample": True, "temporal_upsample": False, "spatial_scale": 2.0,
            "rational_resampler": False}


def _original_state(module: nn.Module, prefix: str, to_original, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for key, tensor in module.state_dict().items():
        if not torch.isfinite(tensor.float()).all():
            raise AssertionError(f"tiny model tensor {key} is not finite")
        t = tensor.detach().clone()
        state[prefix + to_original(key)] = t.to(dtype) if t.is_floating_point() else t
    return state


def _quantize_linears(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """fp8 checkpoint layout: every 2-D `.weight` inside `transformer_blocks` -> float8_e4m3fn + `weight_scale`."""
    out = {}
    for key, tensor in state.items():
        block = key.startswith(prefix + "transformer_blocks.")
        if block and key.endswith(".weight") and tensor.ndim == 2:
            q, scale = quantize_fp8(tensor.float())
            out[key] = q
            out[key[: -len("weight")] + SCALE_SUFFIX] = scale
        else:
            out[key] = tensor
    return out


def build_tiny_modules(variant: str, seed: int) -> dict[str, nn.Module]:
    """The tiny diffusers modules with filled weights (before any file is written)."""
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2 import vocoder as vocoder_module
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d

    from ..models.loader import build_audio_vae
    from ..models.text_projection import TextProjection

    generator = torch.Generator().manual_seed(seed)
    family = get_family(variant)
    tmeta = tiny_transformer_metadata(variant)
    voc_cls, voc_kwargs = configs.vocoder_kwargs(tiny_vocoder_metadata(variant))
    kind = family.text_encoder.projection_kind
    modules = {
        "transformer": LTX2VideoTransformer3DModel(**configs.transformer_kwargs(
            tmeta, keyframes_embedding=family.keyframe_embedding)),
        "video_connector": LTX2ConnectorTransformer1d(**configs.connector_kwargs(tmeta, audio=False)),
        "audio_connector": LTX2ConnectorTransformer1d(**configs.connector_kwargs(tmeta, audio=True)),
        "text_projection": TextProjection(kind, TINY_TEXT_FEATURES,
                                          (64, 32) if kind == PROJECTION_DUAL else TINY_GEMMA_HIDDEN),
        "video_vae": AutoencoderKLLTX2Video(**configs.video_vae_kwargs(tiny_vae_metadata())),
        "audio_vae": build_audio_vae(**configs.audio_vae_kwargs(tiny_audio_vae_metadata())),
        "vocoder": getattr(vocoder_module, voc_cls)(**voc_kwargs),
        "upsampler": LTX2LatentUpsamplerModel(**configs.upsampler_kwargs(tiny_upsampler_metadata())),
    }
    for module in modules.values():
        _fill(module, generator)
    return modules


def write_tiny_checkpoint(path: Path, variant: str = "2.0", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                          fp8: bool = False, modules: dict[str, nn.Module] | None = None) -> Path:
    """Write a single-file checkpoint (`checkpoints/` layout) with `config` metadata.

    Args:
        dtype: storage dtype of the floating tensors (bf16 like the released files, or float32).
        fp8: store the transformer-block Linear weights as float8_e4m3fn with per-tensor `weight_scale` keys, like
            `ltx-2-19b-dev-fp8`.
        modules: reuse modules from `build_tiny_modules` (so an fp8 twin has the same weights).
    """
    modules = modules or build_tiny_modules(variant, seed)
    p = keymaps.TRANSFORMER_PREFIX
    state: dict[str, torch.Tensor] = {}
    state.update(_original_state(modules["transformer"], p, keymaps.transformer_to_original, dtype))
    state.update(_original_state(modules["video_connector"], p + "video_embeddings_connector.",
                                 keymaps.connector_to_original, dtype))
    state.update(_original_state(modules["audio_connector"], p + "audio_embeddings_connector.",
                                 keymaps.connector_to_original, dtype))
    state.update(_original_state(modules["text_projection"], keymaps.TEXT_PROJECTION_PREFIX, lambda k: k, dtype))
    state.update(_original_state(modules["video_vae"], keymaps.VIDEO_VAE_PREFIX, keymaps.video_vae_to_original,
                                 dtype))
    # statistics the released files carry beside the two that are used
    state[keymaps.VIDEO_VAE_PREFIX + "per_channel_statistics.mean-of-stds"] = torch.ones(128, dtype=dtype)
    state.update(_original_state(modules["audio_vae"], keymaps.AUDIO_VAE_PREFIX, keymaps.audio_vae_to_original,
                                 dtype))
    state.update(_original_state(modules["vocoder"], keymaps.VOCODER_PREFIX, keymaps.vocoder_to_original,
                                 torch.float32))
    if fp8:
        state = _quantize_linears(state, p)
    metadata = {"transformer": tiny_transformer_metadata(variant), "vae": tiny_vae_metadata(),
                "audio_vae": tiny_audio_vae_metadata(), "vocoder": tiny_vocoder_metadata(variant)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"config": json.dumps(metadata), "model_version": f"ltx-{variant}-tiny"})
    return path


# ---- per-component files (ComfyUI's folders: diffusion_models/, vae/, latent_upscale_models/) ----------------------

#: ConvRot group size of the tiny int8 twin: a power of 4 that divides every tiny Linear's input width (32 … 256);
#: ComfyUI's default (the released files) is 256.
TINY_CONVROT_GROUP = 16
TRANSFORMER_QUANTIZATIONS = ("int8-convrot", "int8", "fp8")


def _comfy_quantize(state: dict[str, torch.Tensor], quantization: str,
                    convrot_group: int = TINY_CONVROT_GROUP) -> dict[str, torch.Tensor]:
    """ComfyUI's quantized layout for every 2-D `.weight` inside `transformer_blocks` (bare keys):

    * "int8-convrot": `weight` int8 (rotated by the group Hadamard of `convrot_group`, then per-row scale),
      `weight_scale [out, 1]`, `comfy_quant` = `{"format": "int8_tensorwise", "convrot": true,
      "convrot_groupsize": convrot_group}` (the tiny files use 16, the released ones ComfyUI's default 256);
    * "int8": `weight` int8 with one per-tensor `weight_scale` (0-d), `comfy_quant` = `{"format": "int8_tensorwise"}`;
    * "fp8": `weight` float8_e4m3fn, per-tensor `weight_scale` and `input_scale`, `comfy_quant` =
      `{"format": "float8_e4m3fn"}`.
    Other tensors are kept as they are.
    """
    out = {}
    for key, tensor in state.items():
        if not (key.startswith("transformer_blocks.") and key.endswith(".weight") and tensor.ndim == 2):
            out[key] = tensor
            continue
        layer = key[: -len("weight")]
        if quantization == "int8-convrot":
            q, scale = quant.quantize_int8(tensor.float(), convrot_group)
            conf = {"format": quant.INT8_FORMAT, "convrot": True, "convrot_groupsize": convrot_group}
        elif quantization == "int8":
            q, scale = quant.quantize_int8(tensor.float())
            conf = {"format": quant.INT8_FORMAT}
        elif quantization == "fp8":
            q, scale = quantize_fp8(tensor.float())
            out[layer + "input_scale"] = torch.ones((), dtype=torch.float32)
            conf = {"format": "float8_e4m3fn"}
        else:
            raise ValueError(f"quantization={quantization!r}: choose one of {', '.join(TRANSFORMER_QUANTIZATIONS)}")
        out[key] = q
        out[layer + SCALE_SUFFIX] = scale
        out[layer + quant.COMFY_QUANT_SUFFIX] = quant.encode_comfy_quant(conf)
    return out


def _save(path: Path, state: dict[str, torch.Tensor], config: dict[str, Any], variant: str,
          model_version: str | None = None) -> Path:
    for key, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor.float()).all():
            raise AssertionError(f"tiny model tensor {key} is not finite")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"config": json.dumps(config), "model_version": model_version or f"ltx-{variant}-tiny"})
    return path


def write_tiny_transformer(path: Path, variant: str, seed: int = 0, modules: dict[str, nn.Module] | None = None,
                           quantization: str | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`diffusion_models/` layout (what ComfyUI's `UNETLoader` loads): bare transformer + text-connector keys
    (`video_embeddings_connector.*`, `audio_embeddings_connector.*`), `config` metadata with the `transformer`
    section. `quantization`: None (floating `dtype`), "int8-convrot", "int8" or "fp8" (ComfyUI `.comfy_quant`
    layouts)."""
    modules = modules or build_tiny_modules(variant, seed)
    return write_transformer_file(path, modules, tiny_transformer_metadata(variant), quantization, dtype,
                                  f"ltx-{variant}-tiny")


def write_transformer_file(path: Path, modules: dict[str, nn.Module], meta: dict[str, Any],
                           quantization: str | None = None, dtype: torch.dtype = torch.bfloat16,
                           model_version: str = "ltx-tiny", to_cpu: bool = False,
                           convrot_group: int = TINY_CONVROT_GROUP) -> Path:
    """`modules["transformer"]`, `["video_connector"]`, `["audio_connector"]` (any size, e.g. a real-size random
    model for bench/bench_sharded.py) in the `diffusion_models/` layout with `meta` as `config.transformer`.
    `to_cpu`: the tensors are moved to the host one at a time (modules built on a GPU). `convrot_group`: the
    Hadamard group of "int8-convrot" (see `_comfy_quantize`)."""
    state: dict[str, torch.Tensor] = {}
    state.update(_original_state(modules["transformer"], "", keymaps.transformer_to_original, dtype))
    for name, prefix in zip(("video_connector", "audio_connector"), keymaps.CONNECTOR_PREFIXES):
        state.update(_original_state(modules[name], prefix, keymaps.connector_to_original, dtype))
    if quantization is not None:
        state = _comfy_quantize(state, quantization, convrot_group)
    if to_cpu:
        state = {k: state.pop(k).cpu() for k in list(state)}
    return _save(path, state, {"transformer": meta}, "", model_version)


def write_tiny_video_vae(path: Path, variant: str, seed: int = 0, modules: dict[str, nn.Module] | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """`vae/` conv-decoder video VAE (`ltx-2.5-video-vae-conv` layout, what ComfyUI's `VAELoader` loads): bare
    `encoder.*`, `decoder.*`, `per_channel_statistics.*` keys, `config` metadata with the `vae` section."""
    modules = modules or build_tiny_modules(variant, seed)
    state = _original_state(modules["video_vae"], "", keymaps.video_vae_to_original, dtype)
    state["per_channel_statistics.mean-of-stds"] = torch.ones(128, dtype=dtype)
    return _save(path, state, {"vae": tiny_vae_metadata()}, variant)


def write_tiny_audio_vae(path: Path, variant: str, seed: int = 0, modules: dict[str, nn.Module] | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """`vae/` audio VAE + vocoder (`ltx-2.5-audio-vae` layout, ComfyUI's `VAELoader` detects it by the vocoder keys):
    `audio_vae.*` and `vocoder.*` keys (vocoder float32), `config` metadata with `audio_vae` and `vocoder`."""
    modules = modules or build_tiny_modules(variant, seed)
    state = _original_state(modules["audio_vae"], keymaps.AUDIO_VAE_PREFIX, keymaps.audio_vae_to_original, dtype)
    state.update(_original_state(modules["vocoder"], keymaps.VOCODER_PREFIX, keymaps.vocoder_to_original,
                                 torch.float32))
    return _save(path, state, {"audio_vae": tiny_audio_vae_metadata(), "vocoder": tiny_vocoder_metadata(variant)},
                 variant)


def write_tiny_component_files(directory: Path, variant: str = "2.5", seed: int = 0,
                               modules: dict[str, nn.Module] | None = None) -> dict[str, Path]:
    """The per-component files of a tiny model in ComfyUI's folder layouts (no text encoder, no diffusion decoder):

    `transformer` (bf16) and `transformer_int8` (its int8-convrot twin, same weights) for `diffusion_models/`,
    `video_vae` (conv decoder) and `audio_vae` for `vae/`, `upsampler` for `latent_upscale_models/`.
    """
    directory = Path(directory)
    modules = modules or build_tiny_modules(variant, seed)
    name = f"ltx-{variant}-tiny"
    return {
        "transformer": write_tiny_transformer(directory / f"{name}-transformer.safetensors", variant, seed, modules),
        "transformer_int8": write_tiny_transformer(directory / f"{name}-transformer-int8-convrot.safetensors",
                                                   variant, seed, modules, quantization="int8-convrot"),
        "video_vae": write_tiny_video_vae(directory / f"{name}-video-vae-conv.safetensors", variant, seed, modules),
        "audio_vae": write_tiny_audio_vae(directory / f"{name}-audio-vae.safetensors", variant, seed, modules),
        "upsampler": write_tiny_upsampler(directory / f"{name}-spatial-upscaler-x2.safetensors", seed, modules),
    }


def write_tiny_upsampler(path: Path, seed: int = 0, modules: dict[str, nn.Module] | None = None) -> Path:
    """`latent_upscale_models/` layout: bare keys + `config` metadata."""
    modules = modules or build_tiny_modules("2.0", seed)
    state = _original_state(modules["upsampler"], "", keymaps.upsampler_to_original, torch.bfloat16)
    save_file(state, str(path), metadata={"config": json.dumps(tiny_upsampler_metadata())})
    return path


def write_tiny_lora(path: Path, variant: str = "2.0", seed: int = 0, rank: int = 4, scale: float = 0.05,
                    metadata: dict[str, str] | None = None) -> Path:
    """A distilled-LoRA-style file: `diffusion_model.<original module path>.lora_A/lora_B.weight` for every
    attention and feed-forward Linear of the tiny transformer, plus `.alpha` (= rank, i.e. scale 1); `metadata`
    is added to the safetensors header."""
    from diffusers import LTX2VideoTransformer3DModel

    generator = torch.Generator().manual_seed(seed + 1000)
    model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(tiny_transformer_metadata(variant)))
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("transformer_blocks.") and "gate_logits" not in name:
            orig = "diffusion_model." + keymaps.transformer_to_original(name)
            state[orig + ".lora_A.weight"] = (torch.randn(rank, module.in_features, generator=generator)
                                              * scale).to(torch.bfloat16)
            state[orig + ".lora_B.weight"] = (torch.randn(module.out_features, rank, generator=generator)
                                              * scale).to(torch.bfloat16)
            state[orig + ".alpha"] = torch.tensor(float(rank))
    save_file(state, str(path), metadata={"format": "ltx-lora", "rank": str(rank), **(metadata or {})})
    return path


def write_tiny_ic_lora(path: Path, variant: str = "2.3", seed: int = 0, reference_downscale_factor: int = 2) -> Path:
    """An IC-LoRA-style file (LTX-2.3 union control, `...-ref0.5`): the same key layout as `write_tiny_lora`, other
    random weights (seed + 1), and the safetensors metadata `reference_downscale_factor` that ComfyUI's
    GetICLoRAParameters reads (its guides are encoded at 1 / factor of the latent size and dilated)."""
    return write_tiny_lora(path, variant, seed + 1, metadata={"reference_downscale_factor":
                                                              str(int(reference_downscale_factor))})


def make_tiny(directory: Path, variant: str = "2.0", seed: int = 0) -> dict[str, Path]:
    """Write the full tiny model set of a family into `directory`.

    Families whose releases are single files (LTX-2.0, 2.3): `checkpoint`, `checkpoint_fp8`, `upsampler`,
    `distilled_lora`, `gemma`. Families released per component (LTX-2.5): `write_tiny_component_files`'s files plus
    `text_encoder` (Gemma 4 with the text projection bundled) and `video_vae_diffusion` (the diffusion-decoder VAE).
    """
    from .tiny_gemma import write_tiny_gemma

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    family = get_family(variant)
    modules = build_tiny_modules(variant, seed)
    if not family.per_component_release:
        tag = variant.replace(".", "")
        return {
            "checkpoint": write_tiny_checkpoint(directory / f"ltx-{variant}-tiny.safetensors", variant, seed,
                                                modules=modules),
            "checkpoint_fp8": write_tiny_checkpoint(directory / f"ltx-{variant}-tiny-fp8.safetensors", variant, seed,
                                                    fp8=True, modules=modules),
            "upsampler": write_tiny_upsampler(directory / f"ltx-{tag}-tiny-spatial-upscaler-x2.safetensors", seed,
                                              modules=modules),
            "distilled_lora": write_tiny_lora(directory / f"ltx-{variant}-tiny-distilled-lora.safetensors", variant,
                                              seed),
            "gemma": write_tiny_gemma(directory / "gemma-3-tiny.safetensors", seed=seed,
                                      hidden_size=TINY_GEMMA_HIDDEN, num_layers=TINY_GEMMA_LAYERS),
        }
    paths = write_tiny_component_files(directory, variant, seed, modules)
    # ---- the parts written by the Gemma 4 and diffusion-decoder modules (issue 18: h18b, h18c) ----
    from .tiny_gemma4 import write_tiny_gemma4
    from .tiny_vae25 import write_tiny_diffusion_vae

    paths["text_encoder"] = write_tiny_gemma4(directory / f"gemma4-tiny-with-proj-ltx-{variant}.safetensors", seed)
    paths["video_vae_diffusion"] = write_tiny_diffusion_vae(directory / f"ltx-{variant}-tiny-video-vae.safetensors",
                                                            seed)
    return paths
