"""Test-only access to Lightricks' `ltx-core` 1.0.0 (the reference implementation of LTX-2 / LTX-2.3).

`ltx-core` is never used by the engine (docs/design/models.md#the-substrate-diffusers); tests use it to check that our
diffusers-based components compute what the reference computes on the same checkpoint file. Install (the `reference`
extra):

    pip install --no-deps ltx-core==1.0.0
    pip install einops

(`--no-deps` because ltx-core 1.0.0 hard-depends on torchaudio, which it only needs for its audio *encoder*
pre-processing; it also lists scipy, which only its beta-scheduler uses. Neither is needed here.)

What this module does:
- `import_ltx_core()` imports the ltx-core modules the tests use. When torchaudio is not installed it puts an empty
  stand-in module under `sys.modules["torchaudio"]` for the duration of the import (ltx-core's
  `model/audio_vae/ops.py` imports it at module level) and removes it again afterwards, so nothing else in the
  process sees a fake torchaudio. `transformers` and `diffusers` are imported first: they probe for torchaudio
  with `importlib.util.find_spec`, which fails on a module without `__spec__`.
- `load_strict()` builds an ltx-core module and loads the original-layout tensors of a checkpoint file into it
  with `load_state_dict(strict=True)`: every key the module has must come from the file and every selected file key
  must land in the module. The key renames are ltx-core's own `SDOps` (the ones its `SingleGPUModelBuilder` uses).
  We do not use `SingleGPUModelBuilder.build` itself because it loads with `strict=False` (a key mismatch would
  pass silently) and builds on the meta device.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import torch


def import_ltx_core() -> SimpleNamespace:
    """Import the ltx-core pieces the reference tests use. Raises ImportError when ltx-core (or einops) is missing."""
    import diffusers  # noqa: F401  (probe torchaudio before the stand-in exists)
    import transformers
    from transformers.utils import import_utils

    import_utils.is_torchaudio_available()  # cached: decided now, with the real import system
    del transformers
    stub = None
    if "torchaudio" not in sys.modules and importlib.util.find_spec("torchaudio") is None:
        stub = types.ModuleType("torchaudio")
        sys.modules["torchaudio"] = stub
    try:
        from ltx_core.guidance.perturbations import BatchedPerturbationConfig
        from ltx_core.loader.sd_ops import SDOps
        from ltx_core.loader.sft_loader import SafetensorsModelStateDictLoader
        from ltx_core.model.audio_vae.model_configurator import (
            AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
            VOCODER_COMFY_KEYS_FILTER,
            AudioDecoderConfigurator,
            VocoderConfigurator,
        )
        from ltx_core.model.audio_vae.vocoder import VocoderWithBWE
        from ltx_core.model.transformer.modality import Modality
        from ltx_core.model.transformer.model_configurator import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModelConfigurator
        from ltx_core.model.upsampler.model_configurator import LatentUpsamplerConfigurator
        from ltx_core.model.video_vae.model_configurator import (
            VAE_DECODER_COMFY_KEYS_FILTER,
            VAE_ENCODER_COMFY_KEYS_FILTER,
            VideoDecoderConfigurator,
            VideoEncoderConfigurator,
        )
        from ltx_core.text_encoders.gemma.embeddings_connector import (
            AudioEmbeddings1DConnectorConfigurator,
            Embeddings1DConnectorConfigurator,
        )
        from ltx_core.text_encoders.gemma.embeddings_processor import EmbeddingsProcessor, convert_to_additive_mask
        from ltx_core.text_encoders.gemma.encoders.encoder_configurator import EMBEDDINGS_PROCESSOR_KEY_OPS
        from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV1, FeatureExtractorV2
    finally:
        if stub is not None and sys.modules.get("torchaudio") is stub:
            del sys.modules["torchaudio"]
    return SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("_") and k != "stub"})


def read_config(lc: SimpleNamespace, path) -> dict:
    """The checkpoint's `config` metadata as ltx-core's own loader reads it."""
    return lc.SafetensorsModelStateDictLoader().metadata(str(path))


def read_state(lc: SimpleNamespace, path, sd_ops=None, drop_prefixes: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Tensors of `path` renamed by an ltx-core `SDOps` (None: all keys as stored), as float32.

    `drop_prefixes`: renamed keys to leave out because ltx-core loads them into a different module from the same
    file (e.g. the connectors inside `model.diffusion_model.`, which ltx-core's transformer does not hold).
    """
    state = lc.SafetensorsModelStateDictLoader().load(str(path), sd_ops=sd_ops, device=torch.device("cpu")).sd
    drop = tuple(drop_prefixes)
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items() if not k.startswith(drop)}


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`load_state_dict(strict=True, assign=True)` into a module built on the CPU (computed non-persistent buffers
    keep their values; ltx-core creates the 2.0 caption projections on the meta device even then, hence `assign`).
    Asserts nothing is left on the meta device. Returns the module in eval mode, float32, without gradients."""
    result = module.load_state_dict(state, strict=True, assign=True)  # assign: ltx-core builds some parts on meta
    assert not result.missing_keys and not result.unexpected_keys, result
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
    assert not left, f"tensors not loaded: {left}"
    return module.float().eval().requires_grad_(False)


def build(configurator, config: dict, fix: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """`configurator.from_config(config)` on the CPU (ltx-core's builder does the same on the meta device)."""
    with torch.device("cpu"):
        module = configurator.from_config(config)
    if fix is not None:
        fix(module)
    return module
