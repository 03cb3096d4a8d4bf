"""Load original LTX-2 / LTX-2.3 checkpoint files into diffusers modules, strictly and memory-mapped.

Files users have (docs/design/models.md#checkpoint-files):
- a single file in `checkpoints/`: `model.diffusion_model.*` (transformer + text connectors), `vae.*`, `audio_vae.*`,
  `vocoder.*`, `text_embedding_projection.*`, with the JSON `config` metadata;
- a transformer-only file in `diffusion_models/` (un-prefixed transformer + connector keys) combined with separate
  video-VAE, audio-VAE+vocoder and text-projection files (prefixed or bare keys);
- a latent upscaler file in `latent_upscale_models/` (bare keys, own `config`).

Tensors are read through `safetensors.safe_open` (a memory map: only the tensors asked for are paged in) and
assigned into modules built without parameter storage, so the weights exist once in memory. Linear weights stored
as float8 stay float8 (`FP8Linear`). Every component is loaded `strict`: a missing or unexpected key raises
`CheckpointError` naming the keys in the file's own spelling.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn

from . import configs, keymaps, quant
from .diffusion_decoder import (DIFFUSION_VAE_MARKER, REFUSED_SUFFIXES, STATISTICS, UNUSED_STATISTICS,
                                DiffusionDecoderConfig, build_decoder, decoder_key_to_diffusers, diffusers_key_to_file)
from ..protocol.fleet_rules import ACTIVATION_RESERVE_BYTES, WeightBytes, resolve_int8_compute
from .families import ModelFamily, detect_family
from .fp8 import FP8_DTYPES, INPUT_SCALE_SUFFIX, SCALE_SUFFIX, swap_in_fp8_linears
from .headers import LTX_MARKER as _LTX_MARKER
from .headers import metadata_config
from .headers import CheckpointError, transformer_prefix  # noqa: F401 - the loader's names too (headers.py)
# LTX-2.5(.1+): learned embedding of single-pixel-frame tokens; ComfyUI builds it when the key is present
KEYFRAME_EMBEDDING_KEY = "keyframes_abs_pos_embedding"


OPEN_COUNT = 0  # safetensors files opened by this process (the fleet reports it: weights are read once per worker)


class SafetensorsFile:
    """A memory-mapped safetensors file: key listing, metadata and per-tensor reads.

    Raises FileNotFoundError (missing file) or CheckpointError (not a readable safetensors file), naming the path.
    """

    def __init__(self, path: str | Path, counted: bool = True):
        global OPEN_COUNT
        self.path = Path(path)
        OPEN_COUNT += counted  # header-only reads (`weight_bytes`) pass counted=False: OPEN_COUNT counts weight reads
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint file not found: {self.path}")
        try:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for truncated / non-safetensors files
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({exc})") from exc
        self.keys = list(self._handle.keys())
        self.metadata: dict[str, str] = self._handle.metadata() or {}

    def config(self) -> dict[str, Any]:
        """The parsed JSON `config` metadata ({} when absent). Raises CheckpointError on invalid JSON."""
        return metadata_config(self.metadata, self.path)

    def tensor(self, key: str) -> torch.Tensor:
        return self._handle.get_tensor(key)

    def tensor_dtype(self, key: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._handle.get_slice(key).get_dtype()]

    def tensor_shape(self, key: str) -> list[int]:
        return list(self._handle.get_slice(key).get_shape())

    def keys_under(self, prefix: str) -> list[str]:
        return [k for k in self.keys if k.startswith(prefix)]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass
class LTX2Components:
    """The modules of one LTX-2 / LTX-2.3 / LTX-2.5 model, as diffusers runs them.

    `family` is the model-family record (`families.ModelFamily`): code asks it, never a version string.
    `text_projection` is the feature extractor (Gemma hidden states -> CONDITIONING, docs/design/comfyui-types.md; None
    when the family bundles it with a text encoder that was not given); `video_connector` / `audio_connector` turn that
    CONDITIONING into the transformer's context at sampling time.
    """

    family: ModelFamily
    transformer: nn.Module
    video_connector: nn.Module
    audio_connector: nn.Module
    text_projection: nn.Module | None
    video_vae: nn.Module | None  # None: a transformer-only load (`load_components(transformer_only=True)`)
    audio_vae: nn.Module | None
    vocoder: nn.Module | None
    upsampler: nn.Module | None = None
    config: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        """The family's name ("2.0", "2.3", "2.5"), for messages and file names."""
        return self.family.name

    def modules(self) -> dict[str, nn.Module]:
        names = ("transformer", "video_connector", "audio_connector", "text_projection", "video_vae", "audio_vae",
                 "vocoder", "upsampler")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(self, device: torch.device | str) -> "LTX2Components":
        for module in self.modules().values():
            module.to(device)
        return self


def _format_keys(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(sorted(keys)[:limit])
    return shown + (f", … ({len(keys)} in all)" if len(keys) > limit else "")


def kept_as_stored(dtype: torch.dtype, key: str) -> bool:
    """A tensor the loader keeps in its file dtype (fp8 / int8 weights and their scales); other floating tensors are
    cast to the compute dtype."""
    return dtype in FP8_DTYPES or dtype == torch.int8 or key.endswith((SCALE_SUFFIX, INPUT_SCALE_SUFFIX))


def _layout_error(path, what: str, missing: list[str], unexpected: list[str]) -> CheckpointError | None:
    """The error naming a component's missing and unexpected keys (None when there are none)."""
    parts = []
    if missing:
        parts.append(f"missing keys: {_format_keys(missing)}")
    if unexpected:
        parts.append(f"unexpected keys: {_format_keys(unexpected)}")
    return CheckpointError(f"{path}: {what} does not match the expected layout; " + "; ".join(parts)) if parts else None


@dataclass(frozen=True)
class KeyMap:
    """How a component's file keys map onto its diffusers module.

    prefix: the component's key prefix in the file ("" for bare keys).
    to_diffusers: maps a key without `prefix` to the module's key.
    to_original: inverse of `to_diffusers`; when given, missing keys are named in the file's spelling (`prefix` +
        original key), the names a user finds in other files of the same model.
    ignored_suffixes: original keys the diffusers module has no slot for (dropped on purpose).
    """

    prefix: str
    to_diffusers: Callable[[str], str]
    to_original: Callable[[str], str] | None = None
    ignored_suffixes: tuple[str, ...] = ()


def load_module(factory: Callable[[], nn.Module], file: SafetensorsFile, file_keys: list[str], keys: KeyMap,
                dtype: torch.dtype, component: str) -> nn.Module:
    """Build a module without storage, map the file's keys onto it (`keys`) and load it strictly.

    Args:
        factory: builds the diffusers module (called under `init_empty_weights`, buffers stay real).
        file_keys: the file keys of this component (with `keys.prefix`).
        dtype: dtype for floating tensors; float8 Linear weights and their float32 scales are kept as stored.
        component: its name in messages ("transformer", "video VAE", …).
    Raises: CheckpointError naming the missing and unexpected keys (file spelling; missing keys in the module's
        spelling when `keys.to_original` is not given).
    """
    prefix, to_diffusers, to_original = keys.prefix, keys.to_diffusers, keys.to_original
    ignored_suffixes = keys.ignored_suffixes
    with init_empty_weights(include_buffers=False):
        module = factory()
    mapped: dict[str, str] = {}
    markers: dict[str, dict] = {}  # module path of a quantized layer -> its `.comfy_quant` dict
    for key in file_keys:
        if key.endswith(ignored_suffixes):
            continue
        if key.endswith("." + quant.COMFY_QUANT_SUFFIX):
            layer_key = key[len(prefix): -len(quant.COMFY_QUANT_SUFFIX)] + "weight"
            try:
                markers[to_diffusers(layer_key)[: -len(".weight")]] = quant.parse_comfy_quant(file.tensor(key), key)
            except ValueError as exc:
                raise CheckpointError(f"{file.path}: {component}: {exc}") from exc
            continue
        mapped[to_diffusers(key[len(prefix):])] = key
    int8_layers, fp8_weights = _quantized_layers(file, component, mapped, markers)
    if fp8_weights:
        input_scaled = {mk[: -len(INPUT_SCALE_SUFFIX) - 1] for mk in mapped if mk.endswith("." + INPUT_SCALE_SUFFIX)}
        try:
            swap_in_fp8_linears(module, fp8_weights, compute_dtype=dtype, input_scale_names=input_scaled)
        except (ValueError, AttributeError) as exc:  # an fp8 weight of a non-Linear, or of no layer at all
            raise CheckpointError(f"{file.path}: {component}: {exc}") from exc
    if int8_layers:
        scale_shapes = {path: tuple(file.tensor_shape(mapped[path + "." + SCALE_SUFFIX]))
                        for path in int8_layers if path + "." + SCALE_SUFFIX in mapped}
        try:
            quant.swap_in_int8_linears(module, int8_layers, dtype, scale_shapes)
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{file.path}: {component}: {exc}") from exc
    expected = set(module.state_dict().keys())
    missing = sorted(expected - mapped.keys())
    if to_original is not None:
        missing = sorted(prefix + to_original(k) for k in missing)
    unexpected = sorted(mapped[k] for k in mapped.keys() - expected)
    error = _layout_error(file.path, component, missing, unexpected)
    if error is not None:
        raise error
    state = {}
    own = module.state_dict()
    for mk, fk in mapped.items():
        tensor = file.tensor(fk)
        if mk in fp8_weights and tensor.dtype == torch.uint8:  # legacy ComfyUI files: fp8 bytes stored as uint8
            tensor = tensor.view(fp8_weights[mk])
        keep = kept_as_stored(tensor.dtype, mk)
        if tensor.is_floating_point() and not keep:
            tensor = tensor.to(dtype)
        if keep and tensor.shape != own[mk].shape and tensor.numel() == own[mk].numel() == 1:
            tensor = tensor.reshape(own[mk].shape)  # a per-tensor scale stored as [1]
        state[mk] = tensor
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def _quantized_layers(file: SafetensorsFile, component: str, mapped: dict[str, str], markers: dict[str, dict]
                      ) -> tuple[dict[str, dict], dict[str, torch.dtype]]:
    """Sort the quantized Linear weights of a component: `(int8 layers {path: marker}, fp8 weights {key: dtype})`.

    fp8 weights are found by their stored dtype (Lightricks' scaled-fp8 files carry no marker) or by a float8
    `.comfy_quant` marker (legacy uint8 storage included); int8 weights need an `int8_tensorwise` marker.
    Raises CheckpointError naming the layer for an unsupported format, a marker without its weight, or an int8
    weight without a marker (it would otherwise be read as plain numbers).
    """
    int8_layers: dict[str, dict] = {}
    fp8_weights: dict[str, torch.dtype] = {}
    for path, conf in markers.items():
        fmt = conf["format"]
        weight = path + ".weight"
        if weight not in mapped:
            raise CheckpointError(f"{file.path}: {component}: quantization marker for {path} has no weight")
        if fmt in quant.FLOAT8_FORMATS:
            fp8_weights[weight] = quant.FLOAT8_FORMATS[fmt]
        elif fmt == quant.INT8_FORMAT:
            if file.tensor_dtype(mapped[weight]) != torch.int8:
                raise CheckpointError(f"{file.path}: {mapped[weight]}: marked {fmt} but stored as "
                                      f"{file.tensor_dtype(mapped[weight])}")
            int8_layers[path] = conf
        else:
            raise CheckpointError(f"{file.path}: {component}: layer {mapped[weight]} uses the quantization format "
                                  f"{fmt!r}; supported: {', '.join(quant.SUPPORTED_FORMATS)}")
    for mk, fk in mapped.items():
        if not mk.endswith(".weight"):
            continue
        stored = file.tensor_dtype(fk)
        if stored in FP8_DTYPES and mk not in fp8_weights:
            fp8_weights[mk] = stored
        elif stored == torch.int8 and mk[: -len(".weight")] not in int8_layers:
            raise CheckpointError(f"{file.path}: {fk} is stored as int8 without a '.comfy_quant' marker naming its "
                                  f"format")
    return int8_layers, fp8_weights


_UNIT_KEY = re.compile(r"(transformer_blocks|transformer_1d_blocks)\.(\d+)\.")


def _unit_of(key: str) -> tuple[int, int] | None:
    """The FSDP unit a tensor belongs to, as (0 transformer / 1 video connector / 2 audio connector, block index):
    the order of `weights.sharding.units_of(transformer, (video_connector, audio_connector))`; None: not a block."""
    m = _UNIT_KEY.search(key)
    if m is None:
        return None
    owner = key[:m.start()]
    kind = (2 if "audio" in owner else 1) if "connector" in owner else 0
    return kind, int(m.group(2))


def weight_bytes(paths, dtype: torch.dtype, transformer_only: bool = False,
                 int8_dequantized: bool = False) -> WeightBytes:
    """The bytes the ranks will hold of these files (header reads only): a `WeightBytes` with the
    transformer's and text connectors' block tensors apart, and per block (`block_units`: the transformer's blocks
    in order; `connector_units`: the video connector's blocks, then the audio connector's — the units of
    `weights.sharding.units_of`). Floating tensors count in `dtype`, fp8 / int8 weights and their scales as stored.
    `transformer_only`: only the transformer's keys of the first file. `int8_dequantized`: int8 weights count in
    `dtype` and their scales not at all (the fleet option `int8_compute="dequantize"`,
    `quant.dequantize_int8_linears`)."""
    blocks = rest = 0
    units: dict[tuple[int, int], int] = {}
    for i, path in enumerate(dict.fromkeys(p for p in paths if p)):
        file = path if isinstance(path, SafetensorsFile) else SafetensorsFile(path, counted=False)
        keys = file.keys
        if transformer_only:
            if i:
                break
            prefix = transformer_prefix(file)
            keys = file.keys_under(prefix) if prefix else keys
        key_set = set(file.keys)
        for key in keys:
            if key.endswith("." + quant.COMFY_QUANT_SUFFIX):  # a format marker, not held
                continue
            stored = file.tensor_dtype(key)
            keep = kept_as_stored(stored, key)
            size = stored.itemsize if keep or not stored.is_floating_point else dtype.itemsize
            if int8_dequantized and stored == torch.int8:
                size = dtype.itemsize
            elif int8_dequantized and key.endswith(SCALE_SUFFIX) and \
                    key[: -len(SCALE_SUFFIX)] + quant.COMFY_QUANT_SUFFIX in key_set and \
                    file.tensor_dtype(key[: -len(SCALE_SUFFIX)] + "weight") == torch.int8:
                size = 0  # the int8 layer's scale: gone with the int8 weight
            n = math.prod(file.tensor_shape(key)) * size
            unit = _unit_of(key)
            if unit is not None:  # a transformer block or a connector's block (transformer_1d_blocks)
                blocks += n
                units[unit] = units.get(unit, 0) + n
            else:
                rest += n
    order = sorted(units)
    return WeightBytes(blocks, rest, block_units=tuple(units[u] for u in order if u[0] == 0),
                       connector_units=tuple(units[u] for u in order if u[0] != 0))


def identity_files(identity) -> tuple[str | None, ...]:
    """The files a fleet's ranks load of a `FleetIdentity`: the checkpoint alone for a transformer-only fleet."""
    if identity.transformer_only:
        return (identity.checkpoint,)
    return (identity.checkpoint, identity.video_vae, identity.audio_vae, identity.upscaler, identity.text_projection)


def int8_path_for(identity, dtype: torch.dtype, device: torch.device,
                  reserve_bytes: int = ACTIVATION_RESERVE_BYTES, budget_bytes: int | None = None) -> tuple[str, str]:
    """The int8 path ("w8a8" or "dequantize") and its reason for a rank of a fleet (`FleetIdentity`, its compute
    `dtype`, the rank's `device`), from the fleet option `identity.int8_compute` (the fleet's rule,
    `protocol.fleet_rules.resolve_int8_compute`: against `budget_bytes`, the fleet's per-GPU budget for the weights
    (`weights.sharding.agree_budget`: every rank then takes the same path), else on CUDA this GPU's free memory,
    `torch.cuda.mem_get_info`; with `reserve_bytes` kept for one forward). Header reads only. ("w8a8", "") for files
    without int8 layers. Raises ValidationError naming the device for "dequantize" when the dequantized weights would
    not fit (naming the sizes)."""
    from ..protocol.validation import ValidationError

    files = identity_files(identity)
    as_int8 = weight_bytes(files, dtype, transformer_only=identity.transformer_only)
    dequantized = weight_bytes(files, dtype, transformer_only=identity.transformer_only, int8_dequantized=True)
    if as_int8 == dequantized:
        return "w8a8", ""
    free = budget_bytes if budget_bytes is not None else (
        torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
    try:
        return resolve_int8_compute(
            identity.int8_compute, device_type=device.type, weights=identity.weights,
            int8_bytes=as_int8.per_rank(identity.weights, identity.world_size),
            dequantized_bytes=dequantized.per_rank(identity.weights, identity.world_size), free_bytes=free,
            reserve_bytes=reserve_bytes)
    except ValueError as exc:
        raise ValidationError(f"{device}: {exc}") from None


def _component_prefix(file: SafetensorsFile, prefix: str, marker_keys: tuple[str, ...], what: str) -> str:
    """Separate component files may keep the single-file prefix (`vae.`) or drop it; find which."""
    for candidate in (prefix, ""):
        if any(candidate + m in file.keys for m in marker_keys):
            return candidate
    hint = ""
    if any(p + _LTX_MARKER in file.keys for p in (keymaps.TRANSFORMER_PREFIX, "")):  # a transformer-only file
        flag = {"video VAE": "--video-vae", "audio VAE": "--audio-vae"}.get(what, "--text-projection")
        hint = (f"; it holds a transformer only: give the {what} file of its own (generate's {flag}, or --models "
                f"FOLDER)")
    raise CheckpointError(f"{file.path}: no {what} weights (looked for {prefix}{marker_keys[0]}){hint}")


def _section(file: SafetensorsFile, name: str) -> dict[str, Any]:
    config = file.config()
    if name in config:
        return config[name]
    raise CheckpointError(f"{file.path}: metadata 'config' has no '{name}' section (LTX-2 files carry the model "
                          f"configuration in the safetensors metadata)")


def _open(path_or_file: str | Path | SafetensorsFile) -> SafetensorsFile:
    return path_or_file if isinstance(path_or_file, SafetensorsFile) else SafetensorsFile(path_or_file)


def load_transformer(file: SafetensorsFile, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, nn.Module, dict]:
    """Transformer and the two text connectors from a single file or a transformer-only file.

    Returns (transformer, video_connector, audio_connector, transformer_metadata).
    """
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d

    prefix = transformer_prefix(file)
    meta = _section(file, "transformer")
    all_keys = file.keys_under(prefix) if prefix else [k for k in file.keys if not k.startswith(_OTHER_PREFIXES)]
    connector_keys = {c: [k for k in all_keys if k[len(prefix):].startswith(c)] for c in keymaps.CONNECTOR_PREFIXES}
    transformer_keys = [k for k in all_keys if not k[len(prefix):].startswith(keymaps.CONNECTOR_PREFIXES)]
    kwargs = configs.transformer_kwargs(
        meta, keyframes_embedding=prefix + KEYFRAME_EMBEDDING_KEY in file.keys)  # from the keys, as ComfyUI
    transformer = load_module(lambda: LTX2VideoTransformer3DModel(**kwargs), file, transformer_keys,
                              KeyMap(prefix, keymaps.transformer_to_diffusers, keymaps.transformer_to_original),
                              dtype, "transformer")
    connectors = []
    for connector_prefix, audio in zip(keymaps.CONNECTOR_PREFIXES, (False, True)):
        ckw = configs.connector_kwargs(meta, audio=audio)
        connectors.append(load_module(
            lambda ckw=ckw: LTX2ConnectorTransformer1d(**ckw), file, connector_keys[connector_prefix],
            KeyMap(prefix + connector_prefix, keymaps.connector_to_diffusers, keymaps.connector_to_original), dtype,
            connector_prefix.rstrip(".")))
    return transformer, connectors[0], connectors[1], meta


# ---- the LTX-2.5 diffusion video VAE file (its model: diffusion_decoder.py) -----------------------------------------

@dataclass
class DiffusionVideoVAE:
    """A loaded LTX-2.5 diffusion video VAE file: the model (diffusers' decoder with the conv encoder attached as
    `conv_encoder`), its decoder config, and the file's encoder keys."""

    decoder: nn.Module
    config: DiffusionDecoderConfig
    encoder_keys: list[str] = field(default_factory=list)
    path: str = ""


def is_diffusion_vae(file: SafetensorsFile) -> bool:
    return DIFFUSION_VAE_MARKER in file.keys


def load_diffusion_vae(path: str | Path | SafetensorsFile, dtype: torch.dtype = torch.bfloat16,
                       backend: str = "auto") -> DiffusionVideoVAE:
    """Load the decoder of an LTX-2.5 diffusion video VAE file strictly and memory-mapped.

    Tensors are read through the memory map and assigned (no second copy beyond a dtype cast; the fused `qkv`
    rows become three views). Floating tensors are cast to `dtype`; the latent statistics stay float32.
    Raises CheckpointError: not a diffusion VAE file (no `decoder.conv_in_x_t.weight`), bad `config` metadata,
    missing or unexpected keys (named in the file's spelling), or static gates ComfyUI would ignore.
    """
    file = path if isinstance(path, SafetensorsFile) else SafetensorsFile(path)
    if not is_diffusion_vae(file):
        raise CheckpointError(f"{file.path}: not an LTX-2.5 diffusion video VAE (no '{DIFFUSION_VAE_MARKER}' key)")
    try:
        config = DiffusionDecoderConfig.from_vae_section(file.config().get("vae", {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{file.path}: metadata config.vae: {exc}") from exc
    encoder_keys = [k for k in file.keys if k.startswith("encoder.")]
    gated = [k for k in file.keys if k.endswith(REFUSED_SUFFIXES) or ".coarse_" in k]
    if gated:
        raise CheckpointError(f"{file.path}: the decoder carries static gates / preview heads ComfyUI 0.33 ignores "
                              f"(convert the file with the gates folded): {_format_keys(gated)}")
    with init_empty_weights(include_buffers=False):
        model = build_decoder(config, backend)
    mapped: dict[str, tuple[str, int | None]] = {}
    unexpected = []
    for key in file.keys:
        if key in encoder_keys or key in UNUSED_STATISTICS:
            continue
        if not (key.startswith("decoder.") or key in STATISTICS):
            unexpected.append(key)
            continue
        for mk, third in decoder_key_to_diffusers(key):
            mapped[mk] = (key, third)
    expected = set(model.state_dict().keys())
    unexpected += sorted({fk for mk, (fk, _) in mapped.items() if mk not in expected})
    missing = sorted(expected - mapped.keys())
    error = _layout_error(file.path, "diffusion video VAE", sorted({diffusers_key_to_file(k) for k in missing}),
                          unexpected)
    if error is not None:
        raise error
    state = {}
    cache: dict[str, torch.Tensor] = {}
    for mk, (fk, third) in mapped.items():
        tensor = cache.get(fk)
        if tensor is None:
            tensor = file.tensor(fk)
            if mk in ("latents_mean", "latents_std"):
                tensor = tensor.float()
            elif tensor.is_floating_point():
                tensor = tensor.to(dtype)
            cache[fk] = tensor
        if third is not None:
            rows = tensor.shape[0] // 3
            tensor = tensor[third * rows:(third + 1) * rows]
        state[mk] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    if encoder_keys:
        model.conv_encoder = _load_encoder(file, file.config().get("vae", {}).get("encoder", {}), encoder_keys,
                                           {k: state[k] for k in ("latents_mean", "latents_std")}, dtype)
    return DiffusionVideoVAE(decoder=model.eval().requires_grad_(False), config=config, encoder_keys=encoder_keys,
                             path=str(file.path))


def encoder_vae_metadata(encoder: dict[str, Any]) -> dict[str, Any]:
    """The file's `config.vae.encoder` (ComfyUI's `CausalDiffusionVAE` fields and defaults) -> the LTX-2.3 `config.vae`
    fields `configs.video_vae_kwargs` reads (with a minimal stand-in decoder, dropped after construction)."""
    defaults = {"in_channels": 3, "out_channels": 128, "patch_size": 4, "norm_layer": "pixel_norm",
                "latent_log_var": "constant", "base_channels": 128, "spatial_padding_mode": "zeros"}
    enc = {**defaults, **encoder}
    if "blocks" not in enc:
        raise ValueError("config.vae.encoder has no 'blocks'")
    return {"in_channels": enc["in_channels"], "out_channels": 3, "latent_channels": enc["out_channels"],
            "encoder_base_channels": enc["base_channels"], "patch_size": enc["patch_size"],
            "norm_layer": enc["norm_layer"], "latent_log_var": enc["latent_log_var"],
            "spatial_padding_mode": enc["spatial_padding_mode"], "encoder_blocks": enc["blocks"],
            "decoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all", {"multiplier": 1}],
                               ["res_x", {"num_layers": 1}]], "decoder_base_channels": 8}


def _load_encoder(file: SafetensorsFile, encoder: dict[str, Any], keys: list[str],
                  statistics: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    """The file's `encoder.*` into an `AutoencoderKLLTX2Video` (its decoder dropped), strictly (the 2.3 key map).
    Both `latent_log_var` "uniform" and "constant" have 129 output channels and the same mean (channels 0..127)."""
    from diffusers import AutoencoderKLLTX2Video

    try:
        kwargs = configs.video_vae_kwargs(encoder_vae_metadata(encoder))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{file.path}: metadata config.vae.encoder: {exc}") from exc
    stages = len(kwargs["block_out_channels"])
    with init_empty_weights(include_buffers=False):
        vae = AutoencoderKLLTX2Video(**kwargs)
    vae.decoder = None
    mapped = {keymaps.video_vae_to_diffusers(k, stages): k for k in keys}
    expected = set(vae.state_dict().keys()) - set(statistics)
    missing = sorted(keymaps.video_vae_to_original(k, stages) for k in expected - mapped.keys())
    unexpected = sorted(mapped[k] for k in mapped.keys() - expected)
    if missing or unexpected:
        parts = ([f"missing keys: {_format_keys(missing)}"] if missing else []) + \
                ([f"unexpected keys: {_format_keys(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"{file.path}: the encoder does not match the expected layout; " + "; ".join(parts))
    state = {mk: file.tensor(fk).to(dtype) for mk, fk in mapped.items()}
    state.update(statistics)
    vae.load_state_dict(state, strict=True, assign=True)
    return vae.eval().requires_grad_(False)


_OTHER_PREFIXES = (keymaps.VIDEO_VAE_PREFIX, keymaps.AUDIO_VAE_PREFIX, keymaps.VOCODER_PREFIX,
                   keymaps.TEXT_PROJECTION_PREFIX)


def load_video_vae(file: SafetensorsFile, dtype: torch.dtype) -> nn.Module:
    from diffusers import AutoencoderKLLTX2Video

    if is_diffusion_vae(file):  # LTX-2.5's diffusion-decoder video VAE file (ComfyUI's detection key)
        return load_diffusion_vae(file, dtype).decoder

    prefix = _component_prefix(file, keymaps.VIDEO_VAE_PREFIX, ("per_channel_statistics.mean-of-means",), "video VAE")
    meta = _section(file, "vae")
    kwargs = configs.video_vae_kwargs(meta)
    stages = len(kwargs["block_out_channels"])
    keys = file.keys_under(prefix) if prefix else [k for k in file.keys if k.startswith(("encoder.", "decoder.",
                                                                                              "per_channel"))]
    key_map = KeyMap(prefix, lambda k: keymaps.video_vae_to_diffusers(k, stages),
                     lambda k: keymaps.video_vae_to_original(k, stages), keymaps.VAE_IGNORED_SUFFIXES)
    return load_module(lambda: AutoencoderKLLTX2Video(**kwargs), file, keys, key_map, dtype, "video VAE")


def build_audio_vae(**kwargs) -> nn.Module:
    """`AutoencoderKLLTX2Audio` with its statistics sized by the packed latent features (8 channels × 16 mel bins =
    128, what the files and ComfyUI hold); diffusers sizes them by `base_channels`, which is 128 only at the
    released width."""
    from diffusers import AutoencoderKLLTX2Audio

    module = AutoencoderKLLTX2Audio(**kwargs)
    features = module.config.latent_channels * (module.config.mel_bins // 4)
    for name in ("latents_mean", "latents_std"):
        if getattr(module, name).numel() != features:
            module.register_buffer(name, torch.full((features,), 0.0 if name == "latents_mean" else 1.0))
    return module


def load_audio_vae_and_vocoder(file: SafetensorsFile, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    from diffusers.pipelines.ltx2 import vocoder as vocoder_module

    prefix = _component_prefix(file, keymaps.AUDIO_VAE_PREFIX, ("per_channel_statistics.mean-of-means",), "audio VAE")
    if not prefix:
        raise CheckpointError(f"{file.path}: audio VAE keys must carry the '{keymaps.AUDIO_VAE_PREFIX}' prefix")
    akw = configs.audio_vae_kwargs(_section(file, "audio_vae"))
    audio_vae = load_module(lambda: build_audio_vae(**akw), file, file.keys_under(prefix),
                            KeyMap(prefix, keymaps.audio_vae_to_diffusers, keymaps.audio_vae_to_original,
                                   keymaps.VAE_IGNORED_SUFFIXES), dtype, "audio VAE")
    cls_name, vkw = configs.vocoder_kwargs(_section(file, "vocoder"))
    cls = getattr(vocoder_module, cls_name)
    # the vocoder runs in float32: it is small and its output is the waveform users hear
    vocoder = load_module(lambda: cls(**vkw), file, file.keys_under(keymaps.VOCODER_PREFIX),
                          KeyMap(keymaps.VOCODER_PREFIX, keymaps.vocoder_to_diffusers, keymaps.vocoder_to_original),
                          torch.float32, "vocoder")
    return audio_vae, vocoder


def load_text_projection(file: SafetensorsFile, dtype: torch.dtype) -> nn.Module:
    from .text_projection import TextProjection

    prefix = _component_prefix(file, keymaps.TEXT_PROJECTION_PREFIX,
                               ("aggregate_embed.weight", "video_aggregate_embed.weight"), "text projection")
    state = {k: file.tensor(k).to(dtype) for k in file.keys_under(prefix)} if prefix else \
        {keymaps.TEXT_PROJECTION_PREFIX + k: file.tensor(k).to(dtype) for k in file.keys
         if "aggregate_embed" in k}
    try:
        return TextProjection.from_state_dict(state, prefix=keymaps.TEXT_PROJECTION_PREFIX).eval()
    except ValueError as exc:
        raise CheckpointError(f"{file.path}: {exc}") from exc


def load_upsampler(path: str | Path | SafetensorsFile, dtype: torch.dtype) -> nn.Module:
    """The latent upscaler file (`latent_upscale_models/`): bare keys, `config` metadata of its own."""
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    file = _open(path)
    if "initial_conv.weight" not in file.keys:
        raise CheckpointError(f"{file.path}: not an LTX-2 latent upscaler (no 'initial_conv.weight' key)")
    kwargs = configs.upsampler_kwargs(file.config())
    return load_module(lambda: LTX2LatentUpsamplerModel(**kwargs), file, file.keys,
                       KeyMap("", keymaps.upsampler_to_diffusers, keymaps.upsampler_to_original), dtype,
                       "latent upscaler")


@dataclass(frozen=True)
class ComponentFiles:
    """The files beside the transformer file that `load_components` reads (each None when not given).

    video_vae, audio_vae: per-component files of those slots (`vae/`); each falls back to the checkpoint.
    text_projection: the file holding the text projection: for LTX-2.0 / 2.3 a projection file (falls back to the
        checkpoint), for LTX-2.5 the text-encoder file it is bundled in (without one: no projection).
    upsampler: optional latent-upscaler file (`latent_upscale_models/`).
    text_encoder: the text-encoder file; read for the text projection only when the family bundles it there
        (LTX-2.5) and `text_projection` is not given.
    """

    video_vae: str | Path | None = None
    audio_vae: str | Path | None = None
    text_projection: str | Path | None = None
    upsampler: str | Path | None = None
    text_encoder: str | Path | None = None

    def given(self) -> list[str]:
        """The names of the slots given a file."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


def load_components(checkpoint: str | Path, files: ComponentFiles | None = None, *,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    transformer_only: bool = False, int8_compute: str = "w8a8",
                    int8_reason: str = "") -> LTX2Components:
    """Load every component of an LTX-2 / LTX-2.3 / LTX-2.5 model, slot by slot of its family's component table.

    Args:
        checkpoint: the transformer file: a single-file checkpoint (every slot in one file) or a transformer-only
            file (`diffusion_models/`; bf16, scaled fp8, or ComfyUI's `.comfy_quant` fp8 / int8(-convrot)).
        files: the other components' files (`ComponentFiles`; None: every slot from `checkpoint`).
        dtype: compute dtype of the modules (quantized Linear weights stay resident quantized; the vocoder stays
            float32).
        transformer_only: load the transformer and its text connectors only (every other field None; the other
            `files` must name none): what the native MODEL's fleet needs.
        int8_compute: the resolved int8 path ("w8a8" or "dequantize": `fleet_rules.resolve_int8_compute` picks it
            from the fleet option): "dequantize" replaces the int8 layers of the transformer and connectors by bf16 / fp32
            Linears on `device` after the move (`quant.dequantize_int8_linears`); `int8_reason` goes in the report.
    Raises: FileNotFoundError, CheckpointError (family, metadata, strict key mismatch), each naming the file;
        ValueError when `transformer_only` is given other files.
    """
    files = files if files is not None else ComponentFiles()
    main = SafetensorsFile(checkpoint)
    if transformer_only and files.given():
        raise ValueError(f"transformer_only loads the transformer alone; got files for "
                         f"{', '.join(sorted(files.given()))}")
    transformer, video_connector, audio_connector, meta = load_transformer(main, dtype)
    family = detect_family(meta, main.keys, transformer_prefix(main))
    if transformer_only:
        return _int8_path(LTX2Components(family=family, transformer=transformer, video_connector=video_connector,
                                         audio_connector=audio_connector, text_projection=None, video_vae=None,
                                         audio_vae=None, vocoder=None, config=main.config(),
                                         sources={"checkpoint": str(main.path)}).to(device), int8_compute, int8_reason)
    given = {"video_vae": files.video_vae, "audio_vae": files.audio_vae, "upsampler": files.upsampler}
    opened: dict[str, SafetensorsFile | None] = {"transformer": main}
    for slot, path in given.items():
        if path is not None:
            opened[slot] = SafetensorsFile(path)
        elif any(spec.required for spec in family.slot_components(slot)):
            opened[slot] = main  # a single-file checkpoint holds this slot too
        else:
            opened[slot] = None
    # the text projection: in the checkpoint (2.0 / 2.3, or a file of its own) or in the text-encoder file (2.5)
    projection_slot = family.component("text_projection").file_slot
    if files.text_projection is not None:
        projection_file = SafetensorsFile(files.text_projection)
    elif projection_slot == "transformer":
        projection_file = main
    elif files.text_encoder is not None and Path(files.text_encoder).is_file():
        projection_file = SafetensorsFile(files.text_encoder)
    else:
        projection_file = None
    components = LTX2Components(
        family=family,
        transformer=transformer,
        video_connector=video_connector,
        audio_connector=audio_connector,
        text_projection=load_text_projection(projection_file, dtype) if projection_file is not None else None,
        video_vae=load_video_vae(opened["video_vae"], dtype),
        audio_vae=None, vocoder=None,
        upsampler=load_upsampler(opened["upsampler"], dtype) if opened["upsampler"] is not None else None,
        config=main.config(),
        sources={"checkpoint": str(main.path), "video_vae": str(opened["video_vae"].path),
                 "audio_vae": str(opened["audio_vae"].path),
                 **({"text_projection": str(projection_file.path)} if projection_file is not None else {}),
                 **({"upsampler": str(opened["upsampler"].path)} if opened["upsampler"] is not None else {})},
    )
    components.audio_vae, components.vocoder = load_audio_vae_and_vocoder(opened["audio_vae"], dtype)
    return _int8_path(components.to(device), int8_compute, int8_reason)


def _int8_path(components: LTX2Components, mode: str, reason: str) -> LTX2Components:
    """The int8 layers of the transformer and connectors on their path (`quant.apply_int8_compute`), after the move
    to the device (the float32 dequantization runs there, one layer at a time)."""
    if mode not in ("w8a8", "dequantize"):
        raise ValueError(f"int8_compute={mode!r}: the loader takes a resolved path, 'w8a8' or 'dequantize' "
                         f"(fleet_rules.resolve_int8_compute resolves 'auto')")
    quant.apply_int8_compute((components.transformer, components.video_connector, components.audio_connector), mode,
                             reason)
    return components
