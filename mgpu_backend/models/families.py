"""The model-family table: one `ModelFamily` record per LTX-2 release (LTX-2.0, 2.3, 2.5).

Code asks the family; it never compares version strings (docs/design/layer-contracts.md; `tests/test_families.py` greps
for such comparisons outside this module). A record holds:

* detection (`detect_family`): from the transformer's `config.transformer` metadata and its key names, as ComfyUI
  does it (`comfy/model_detection.py`: the metadata `config` overrides, `keyframes_abs_pos_embedding` detected from
  the keys);
* the component table (`ComponentSpec`): which user file ("file slot") holds the component, the ComfyUI models
  folder a per-component file lives in, the key prefixes (single file first, then a per-component file), the
  metadata `config` section, the key map, the dtype rule. A single-file checkpoint is all slots in one file; a
  per-component file slots in for its slot (after Lightricks' per-component builders and ComfyUI's loaders:
  `UNETLoader` → diffusion_models/, `VAELoader` → vae/, `CLIPLoader` → text_encoders/,
  `LatentUpscaleModelLoader` → latent_upscale_models/);
* the text-encoder spec (`TextEncoderSpec`);
* the recipe defaults (`Recipe`);
* the text-embedding split (`text_split`): how CONDITIONING `[B, T, C]` feeds the two connectors.

Sources: Lightricks ltx-core / ltx-pipelines constants (2.0, 2.3), diffusers 0.42.1
`scripts/convert_ltx2_to_diffusers.py` (`get_ltx2_transformer_config("2.5")`: the video feed-forward drops its
bias, `use_keyframes_abs_pos_embedding`, audio FF bias and prompt AdaLN unchanged), ComfyUI 0.33
`comfy/ldm/lightricks/model.py` / `av_model.py` / `comfy/text_encoders/lt.py`, and the `video_ltx2_5_t2v` template
of `comfyui-workflow-templates-json` 0.1.50 (sigmas, sampler, guider).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import keymaps

# ---- records ------------------------------------------------------------------------------------------------------

#: The user-facing file slots, in load order. `transformer` is the file the family is detected from; every other slot
#: falls back to it (a single-file checkpoint holds them all).
FILE_SLOTS = ("transformer", "video_vae", "audio_vae", "text_encoder", "upsampler")

#: dtype rules of `ComponentSpec.dtype_rule`.
DTYPE_COMPUTE = "compute"            # floating tensors cast to the compute dtype
DTYPE_QUANTIZED = "compute+quantized"  # as compute, but quantized Linear weights (fp8, int8) stay resident quantized
DTYPE_FLOAT32 = "float32"            # always float32 (the vocoder: small, and its output is what users hear)

#: `ModelFamily.text_split` values.
SPLIT_SHARED = "shared"          # one `[B, T, C]` tensor feeds both connectors (LTX-2.0)
SPLIT_VIDEO_AUDIO = "video+audio"  # `[..., :video_width]` video, the rest audio (ComfyUI `preprocess_text_embeds`)

#: `TextEncoderSpec.projection_kind` values (ComfyUI `lt.py::sd_detect` names).
PROJECTION_SINGLE = "single_linear"
PROJECTION_DUAL = "dual_linear"


@dataclass(frozen=True)
class ComponentSpec:
    """One component of a family and where its weights are.

    Attributes:
        name: component name (the `LTX2Components` field).
        file_slot: the user file that holds it (`FILE_SLOTS`); a single-file checkpoint is every slot at once.
        folder: the ComfyUI models folder a per-component file of this slot lives in.
        prefixes: key prefixes tried in order (single-file prefix first; '' = a bare per-component file).
        marker_keys: keys (after the prefix) whose presence shows the component is in a file.
        config_section: the metadata `config` section that configures it (None: the file's whole `config`).
        key_map: original key (without prefix) -> diffusers module key.
        dtype_rule: one of `DTYPE_COMPUTE`, `DTYPE_QUANTIZED`, `DTYPE_FLOAT32`.
        required: False for components a model runs without (the upsampler).
        notes: provenance / what is not known yet.
    """

    name: str
    file_slot: str
    folder: str
    prefixes: tuple[str, ...]
    marker_keys: tuple[str, ...]
    config_section: str | None
    key_map: Callable[[str], str] | None
    dtype_rule: str = DTYPE_COMPUTE
    required: bool = True
    notes: str = ""

    def __post_init__(self) -> None:
        if self.file_slot not in FILE_SLOTS:
            raise ValueError(f"ComponentSpec {self.name}: file_slot {self.file_slot!r} is not one of {FILE_SLOTS}")
        if self.dtype_rule not in (DTYPE_COMPUTE, DTYPE_QUANTIZED, DTYPE_FLOAT32):
            raise ValueError(f"ComponentSpec {self.name}: unknown dtype_rule {self.dtype_rule!r}")


@dataclass(frozen=True)
class TextEncoderSpec:
    """The text encoder a family is trained with, and where its text projection ("feature extractor") lives.

    Attributes:
        architecture: "gemma3" | "gemma4".
        model_class: transformers class that runs the language model (text only).
        config_class: transformers config class built from the file's shapes / config.
        decoder_layer_class: the layer class Accelerate must not split across devices (`no_split_module_classes`).
        tokenizer: where the tokenizer comes from, in ComfyUI's single file.
        hidden_states: Gemma hidden states the projection consumes (embeddings + every layer) for the released
            model; None = `num_hidden_layers + 1` of the file's config (Gemma 4, which is not one fixed checkpoint).
        hidden_size: width of one hidden state for the released model (None: from the file).
        projection_location: "checkpoint" (`text_embedding_projection.*` in the LTX checkpoint) or "text_encoder"
            (bundled in the text-encoder file, LTX-2.5's `gemma4-…-with-proj-…`).
        projection_kind: `PROJECTION_SINGLE` (LTX-2.0) or `PROJECTION_DUAL` (video + audio).
        comfy_clip_type: ComfyUI `CLIPLoader` type for this encoder.
        released_files: ComfyUI template file names (text_encoders/).
    """

    architecture: str
    model_class: str
    config_class: str
    decoder_layer_class: str
    tokenizer: str
    hidden_states: int | None
    hidden_size: int | None
    projection_location: str
    projection_kind: str
    comfy_clip_type: str = "ltxv"
    released_files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.projection_location not in ("checkpoint", "text_encoder"):
            raise ValueError(f"TextEncoderSpec: projection_location {self.projection_location!r}")
        if self.projection_kind not in (PROJECTION_SINGLE, PROJECTION_DUAL):
            raise ValueError(f"TextEncoderSpec: projection_kind {self.projection_kind!r}")


@dataclass(frozen=True)
class Recipe:
    """Default generation recipe for the family's files (what the CLI runs when the user names nothing else).

    Attributes:
        pipeline: "two-stage" (guided stage 1 + distilled LoRA stage 2) or "distilled" (a distilled transformer,
            no guidance on both stages).
        stage1_steps: LTX-2 scheduler steps of a guided stage 1 (two-stage recipe).
        stage1_sigmas: explicit stage-1 schedule (distilled recipe), ending in 0.
        stage2_sigmas: stage-2 schedule after the 2× upscale, ending in 0.
        sampler: "euler" or "euler_ancestral" (ComfyUI `KSamplerSelect` names), both stages.
        stg_block: the reference's STG block for a guided stage 1 (LTX-2.5: 2.3's, the same 48-block transformer;
            its distilled template runs unguided).
        fps: template frame rate.
        source: where the numbers come from.
    """

    pipeline: str
    stage1_steps: int | None
    stage1_sigmas: tuple[float, ...] | None
    stage2_sigmas: tuple[float, ...]
    sampler: str
    stg_block: int
    fps: float
    source: str


@dataclass(frozen=True)
class ModelFamily:
    """One LTX-2 release. See the module docstring.

    Attributes:
        name: "2.0" | "2.3" | "2.5" (the `--variant` spelling).
        display: "LTX-2.3" etc.
        transformer_flags: `config.transformer` fields the family's architecture sets (the tiny writer writes them;
            detection reads the ones marked in `detect_family`).
        components: the component table.
        text_encoder: the text-encoder spec.
        recipe: default recipe.
        text_split: `SPLIT_SHARED` or `SPLIT_VIDEO_AUDIO`.
        vocoder_bwe: the vocoder carries the bandwidth extension (48 kHz).
        keyframe_embedding: the transformer adds `keyframes_abs_pos_embedding` to single-pixel-frame tokens
            (generated frame-0 tokens, never guide tokens: ComfyUI `model.py::keyframes_abs_pos_mask`).
        per_component_release: released as one file per component (ComfyUI folders), not as a single checkpoint.
        released_files: ComfyUI file names per slot (documentation, UI hints).
    """

    name: str
    display: str
    transformer_flags: dict[str, Any]
    components: tuple[ComponentSpec, ...]
    text_encoder: TextEncoderSpec
    recipe: Recipe
    text_split: str
    vocoder_bwe: bool
    keyframe_embedding: bool = False
    per_component_release: bool = False
    released_files: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def component(self, name: str) -> ComponentSpec:
        """The spec of component `name`. Raises KeyError naming the family's components."""
        for spec in self.components:
            if spec.name == name:
                return spec
        raise KeyError(f"{self.display} has no component {name!r}; it has {[c.name for c in self.components]}")

    def slot_components(self, slot: str) -> tuple[ComponentSpec, ...]:
        return tuple(c for c in self.components if c.file_slot == slot)

    @property
    def splits_text(self) -> bool:
        """CONDITIONING is video features then audio features (split at the video connector's width)."""
        return self.text_split == SPLIT_VIDEO_AUDIO

    def conditioning_width(self, video_width: int, audio_width: int) -> int:
        """Width C of this family's CONDITIONING `[B, T, C]` given the connector input widths."""
        return video_width + audio_width if self.splits_text else video_width

    def __str__(self) -> str:
        return self.display


# ---- component tables ---------------------------------------------------------------------------------------------

_TRANSFORMER = ComponentSpec(
    "transformer", "transformer", "diffusion_models", (keymaps.TRANSFORMER_PREFIX, ""),
    ("adaln_single.emb.timestep_embedder.linear_1.bias",), "transformer", keymaps.transformer_to_diffusers,
    DTYPE_QUANTIZED, notes="fp8 (scaled, or ComfyUI `.comfy_quant` float8_e4m3fn) and int8_tensorwise(+convrot) "
                           "Linear weights stay resident quantized")
_VIDEO_CONNECTOR = ComponentSpec(
    "video_connector", "transformer", "diffusion_models",
    (keymaps.TRANSFORMER_PREFIX + "video_embeddings_connector.", "video_embeddings_connector."),
    ("transformer_1d_blocks.0.attn1.to_q.weight",), "transformer", keymaps.connector_to_diffusers)
_AUDIO_CONNECTOR = ComponentSpec(
    "audio_connector", "transformer", "diffusion_models",
    (keymaps.TRANSFORMER_PREFIX + "audio_embeddings_connector.", "audio_embeddings_connector."),
    ("transformer_1d_blocks.0.attn1.to_q.weight",), "transformer", keymaps.connector_to_diffusers)
_VIDEO_VAE = ComponentSpec(
    "video_vae", "video_vae", "vae", (keymaps.VIDEO_VAE_PREFIX, ""), ("per_channel_statistics.mean-of-means",),
    "vae", None, notes="conv decoder (the diffusion decoder of 2.5 is its own component: h18c)")
_AUDIO_VAE = ComponentSpec(
    "audio_vae", "audio_vae", "vae", (keymaps.AUDIO_VAE_PREFIX,), ("per_channel_statistics.mean-of-means",),
    "audio_vae", keymaps.audio_vae_to_diffusers)
_VOCODER = ComponentSpec(
    "vocoder", "audio_vae", "vae", (keymaps.VOCODER_PREFIX,), ("conv_pre.weight", "vocoder.conv_pre.weight"),
    "vocoder", keymaps.vocoder_to_diffusers, DTYPE_FLOAT32)
_UPSAMPLER = ComponentSpec(
    "upsampler", "upsampler", "latent_upscale_models", ("",), ("initial_conv.weight",), None,
    keymaps.upsampler_to_diffusers, required=False)


def _text_projection(slot: str, folder: str, notes: str = "") -> ComponentSpec:
    return ComponentSpec("text_projection", slot, folder, (keymaps.TEXT_PROJECTION_PREFIX, ""),
                         ("aggregate_embed.weight", "video_aggregate_embed.weight"), None, None, notes=notes)


_GEMMA3 = dict(architecture="gemma3", model_class="Gemma3TextModel", config_class="Gemma3TextConfig",
               decoder_layer_class="Gemma3DecoderLayer",
               tokenizer="SentencePiece proto in the uint8 tensor `spiece_model` (ComfyUI file) or tokenizer.model "
                         "(Hugging Face folder)",
               hidden_states=49, hidden_size=3840, projection_location="checkpoint",
               released_files=("gemma_3_12B_it.safetensors", "gemma_3_12B_it_fp8_scaled.safetensors"))

# ---- the table ----------------------------------------------------------------------------------------------------

_LTX23_FLAGS = {
    "apply_gated_attention": True, "cross_attention_adaln": True, "caption_proj_before_connector": True,
    "caption_projection_first_linear": False, "caption_proj_input_norm": False,
    "caption_projection_second_linear": False, "connector_apply_gated_attention": True,
}

LTX_2_0 = ModelFamily(
    name="2.0", display="LTX-2.0", transformer_flags={},
    components=(_TRANSFORMER, _VIDEO_CONNECTOR, _AUDIO_CONNECTOR, _text_projection("transformer", "checkpoints"),
                _VIDEO_VAE, _AUDIO_VAE, _VOCODER, _UPSAMPLER),
    text_encoder=TextEncoderSpec(**_GEMMA3, projection_kind=PROJECTION_SINGLE),
    recipe=Recipe(pipeline="two-stage", stage1_steps=40, stage1_sigmas=None,
                  stage2_sigmas=(0.909375, 0.725, 0.421875, 0.0), sampler="euler", stg_block=29, fps=24.0,
                  source="ltx-pipelines LTX_2_PARAMS, ti2vid_two_stages"),
    text_split=SPLIT_SHARED, vocoder_bwe=False,
    released_files={"transformer": ("ltx-2-19b-dev.safetensors", "ltx-2-19b-dev-fp8.safetensors")},
)

LTX_2_3 = ModelFamily(
    name="2.3", display="LTX-2.3", transformer_flags=_LTX23_FLAGS,
    components=LTX_2_0.components,
    text_encoder=TextEncoderSpec(**_GEMMA3, projection_kind=PROJECTION_DUAL),
    recipe=Recipe(pipeline="two-stage", stage1_steps=30, stage1_sigmas=None,
                  stage2_sigmas=(0.909375, 0.725, 0.421875, 0.0), sampler="euler", stg_block=28, fps=24.0,
                  source="ltx-pipelines LTX_2_3_PARAMS, ti2vid_two_stages"),
    text_split=SPLIT_VIDEO_AUDIO, vocoder_bwe=True,
    released_files={"transformer": ("ltx-2.3-22b-dev.safetensors", "ltx-2.3-22b-dev-fp8.safetensors")},
)

LTX_2_5 = ModelFamily(
    name="2.5", display="LTX-2.5",
    # diffusers `get_ltx2_transformer_config("2.5")`: 2.3 plus `ff_bias=False` (video feed-forward) and the keyframe
    # embedding (2.5.1+); `audio_ff_bias` and `use_prompt_adaln_single` keep their True defaults
    transformer_flags={**_LTX23_FLAGS, "ff_bias": False},
    components=(_TRANSFORMER, _VIDEO_CONNECTOR, _AUDIO_CONNECTOR,
                _text_projection("text_encoder", "text_encoders",
                                 notes="bundled in `gemma4-12b-with-proj-ltx-2.5-*` "
                                       "(text_projection.load_bundled_projection)"),
                _VIDEO_VAE, _AUDIO_VAE, _VOCODER, _UPSAMPLER),
    text_encoder=TextEncoderSpec(
        # Gemma 4 12B ("unified", encoder-free) fine-tuned for LTX; transformers 5 `models/gemma4_unified`, ComfyUI
        # 0.33 `comfy/text_encoders/gemma4.py::Gemma4_12B` (`models.gemma.GEMMA4` runs it)
        architecture="gemma4", model_class="Gemma4UnifiedTextModel", config_class="Gemma4UnifiedTextConfig",
        decoder_layer_class="Gemma4UnifiedTextDecoderLayer",
        tokenizer="Hugging Face tokenizer.json in the uint8 tensor `tokenizer_json` (ComfyUI file)",
        hidden_states=49, hidden_size=3840, projection_location="text_encoder", projection_kind=PROJECTION_DUAL,
        released_files=("gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot.safetensors",
                        "gemma4-12b-with-proj-ltx-2.5-bf16.safetensors")),
    recipe=Recipe(pipeline="distilled", stage1_steps=None,
                  stage1_sigmas=(1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0),
                  stage2_sigmas=(0.85, 0.725, 0.4219, 0.0), sampler="euler_ancestral", stg_block=28, fps=24.0,
                  source="ComfyUI template video_ltx2_5_t2v (comfyui-workflow-templates-json 0.1.50): ManualSigmas, "
                         "KSamplerSelect euler_ancestral, LTXVDualCFGGuider 1/1"),
    text_split=SPLIT_VIDEO_AUDIO, vocoder_bwe=True, keyframe_embedding=True, per_component_release=True,
    released_files={
        "transformer": ("ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors",),
        "video_vae": ("ltx-2.5-video-vae-bf16.safetensors", "ltx-2.5-video-vae-conv-bf16.safetensors"),
        "audio_vae": ("ltx-2.5-audio-vae-bf16.safetensors",),
        "text_encoder": ("gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot.safetensors",),
        "upsampler": ("ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors",),
    },
)

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LTX_2_0, LTX_2_3, LTX_2_5)}
NAMES = tuple(FAMILIES)


def get_family(name: str | ModelFamily) -> ModelFamily:
    """The family called `name` ("2.0", "2.3", "2.5"; a `ModelFamily` is returned as is).

    Raises ValueError naming the known families.
    """
    if isinstance(name, ModelFamily):
        return name
    try:
        return FAMILIES[str(name)]
    except KeyError:
        raise ValueError(f"unknown LTX-2 model family {name!r}; known: {', '.join(NAMES)}") from None


def _flag(meta: dict[str, Any], name: str, default: Any) -> Any:
    return meta.get(name, default)


def detect_family(transformer_meta: dict[str, Any], keys: Iterable[str] = (), prefix: str = "") -> ModelFamily:
    """The family of a transformer from its `config.transformer` metadata and its key names (with `prefix`).

    * LTX-2.3 and later: `caption_proj_before_connector` or `cross_attention_adaln` set (ltx-core's V2 text path).
    * LTX-2.5: additionally the video feed-forward without bias (`ff_bias: false` in the metadata, or no
      `transformer_blocks.0.ff.net.0.proj.bias` key) or a `keyframes_abs_pos_embedding` key.
    * otherwise LTX-2.0.
    """
    keys = set(keys)
    v23 = any(bool(_flag(transformer_meta, f, False)) for f in ("caption_proj_before_connector",
                                                                 "cross_attention_adaln"))
    if not v23:
        return LTX_2_0
    ff_key = prefix + "transformer_blocks.0.ff.net.0.proj.bias"
    has_block_keys = any(k.startswith(prefix + "transformer_blocks.0.") for k in keys)
    no_ff_bias = _flag(transformer_meta, "ff_bias", True) is False or (has_block_keys and ff_key not in keys)
    if no_ff_bias or (prefix + "keyframes_abs_pos_embedding") in keys:
        return LTX_2_5
    return LTX_2_3
