"""Gemma text encoders for LTX-2: Gemma 3 12B (LTX-2.0 / 2.3) and Gemma 4 12B (LTX-2.5). Loads ComfyUI's single
file (or, for Gemma 3, a Hugging Face folder) and returns ALL hidden states (embeddings + every layer), as ComfyUI's
LTX-2 text encoders do.

Runs on transformers' `Gemma3TextModel` / `Gemma4UnifiedTextModel` (language model only; vision/audio embedders and
projectors are not loaded). The two architectures are described by `GEMMA3` / `GEMMA4` (`TextEncoderArch`) and
told apart by their keys (`detect_architecture`: Gemma 4 decoder layers carry a learned `layer_scalar`).

Gemma 4 (LTX-2.5; facts from ComfyUI 0.33 `comfy/sd.py` (`detect_te_model` -> GEMMA_4_12B, `load_text_encoder_
state_dicts`), `comfy/text_encoders/gemma4.py` (`Gemma4_12B_Config`, `Gemma4Transformer`, `TransformerBlockGemma4`,
`Gemma4Attention`, `Gemma4SDTokenizer`), `comfy/text_encoders/lt.py` (`ltxav_gemma4_tokenizer`, `LTXAVTEModel`) and
transformers 5 `models/gemma4_unified` (`Gemma4UnifiedTextConfig`, `Gemma4UnifiedTextModel`)):
* File `models/text_encoders/gemma4-12b-with-proj-ltx-2.5-{bf16,comfy-int8-convrot}.safetensors`: the language model
  under `model.` (`embed_tokens.weight` [262144, 3840]; 48 `layers.N.` with q/k/o projections, q/k norms, the MLP,
  four norms and `layer_scalar` [1]; sliding layers (5 of every 6) have head_dim 256, 8 key/value heads and a
  `v_proj`; full-attention layers (`N % 6 == 5`) have head_dim 512, ONE key/value head and no `v_proj` — V is the
  raw K projection (`attention_k_eq_v`); `norm.weight`), the LTX text projection under `text_embedding_projection.`
  (read by `text_projection.load_bundled_projection`), the tokenizer as the uint8 tensor `tokenizer_json` (a
  Hugging Face tokenizer.json), and multimodal embedders (`vision_model.*`, `multi_modal_projector.*`,
  `audio_projector.*`, ignored here). No config is stored: it is inferred from shapes (`infer_gemma4_text_config`).
* Forward (both implementations agree): embeddings · sqrt(H); per layer pre-norm attention with RMS-normed q and k
  (weights), V RMS-normed WITHOUT a weight, attention scale 1.0, RoPE theta 1e4 on sliding layers and theta 1e6 on
  a quarter of the 512 dims ("proportional") on full layers, sliding window 1024, norms multiply by the weight
  itself (not 1 + weight), and the layer output multiplied by `layer_scalar`.
* int8-convrot file: every decoder-layer Linear weight is int8 with a float32 per-row `weight_scale` [out, 1] and a
  `comfy_quant` JSON `{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": G}`: dequantized here once
  at load (resident in `dtype`) as `(q · scale)` rotated back group-wise by the normalized regular Hadamard matrix
  (comfy-kitchen `TensorWiseINT8Layout.dequantize` / `dequantize_int8_convrot_weight`; the math is
  `models.quant`'s, shared with the transformer's resident int8 layers); plain `int8_tensorwise` (no rotation,
  scalar or per-row scale) is read the same way.
* Prompt handling (ComfyUI `Gemma4SDTokenizer` with `min_length` 1024 from `ltxav_gemma4_tokenizer`): no template
  (CLIPTextEncode passes `skip_template=True`), ids = [<bos>=2] + tokenizer.json ids of the text (no special-token
  splitting of our own and no dropped first id: the tokenizer matches its added tokens itself); `\\(`/`\\)` become
  `(`/`)`. ComfyUI's textual-inversion syntax (` embedding:NAME`) is not interpreted (it is tokenized as text).

Layouts accepted (facts from ComfyUI 0.20.1 `comfy/sd.py`, `comfy/text_encoders/lt.py`, `llama.py`, `utils.py`,
`ops.py`, `quant_ops.py` and Lightricks' `ltx-core` `text_encoders/gemma/gemma_assets.py`, `encoder_configurator.py`):

* ComfyUI single file (`models/text_encoders/gemma_3_12B_it*.safetensors`): language model under `model.`
  (`model.embed_tokens.weight` [262208, 3840], `model.layers.{0..47}.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
  mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
  post_feedforward_layernorm}.weight`, `model.norm.weight`); ComfyUI recognises it by
  `model.layers.47.self_attn.q_norm.weight`. Optional vision keys `vision_model.*`, `multi_modal_projector.*` and
  `lm_head`/`model.lm_head` are ignored here. The SentencePiece model is the 1-D uint8 tensor `spiece_model`
  (the serialized model proto bytes, `SPieceTokenizer.serialize_model()`). No config is stored: it is inferred
  from tensor shapes (`infer_text_config`). Quantized variants:
  - scaled fp8 (`*_fp8_scaled`): Linear `weight` in float8_e4m3fn (or e5m2) + 0-d float32 `weight_scale`, with the
    format in a per-layer uint8 JSON tensor `<layer>.comfy_quant` (`{"format": "float8_e4m3fn"}`) or in the
    safetensors metadata `_quantization_metadata` (`{"layers": {<layer>: {"format": …}}}`); legacy files carry a
    `scaled_fp8` marker tensor and `<layer>.scale_weight` / `<layer>.scale_input`. Dequantized weight =
    `weight.float() * scale` (ComfyUI's TensorCoreFP8Layout); input scales are ignored (we compute in `dtype`).
  - fp4-mixed (`*_fp4_mixed`): layers with format `nvfp4` (uint8-packed e2m1 pairs, float8 block scales
    `weight_scale` per 16 values in a tensor-core tiled layout, float32 `weight_scale_2`), or `mxfp8`; these are
    REFUSED with a ValueError naming the file and the layer (the block-scale layout is comfy_kitchen's, not
    reproduced here).
* Hugging Face folder (`google/gemma-3-12b-it` style, as Lightricks ship it): `config.json` (`model_type` "gemma3"
  with `text_config`, or "gemma3_text"), `*.safetensors` with keys under `language_model.model.` (as published),
  `model.language_model.` (transformers >= 4.52 save) or `model.` (Gemma3ForCausalLM), and `tokenizer.model`
  (SentencePiece; `tokenizer.json` is used through `tokenizers` if no `tokenizer.model` is present).
* ltx-core's packed TE files (`gemma_config` metadata + `tokenizer_json` tensor) are recognised by their keys and
  use the stored config and tokenizer.

Prompt handling (ComfyUI `Gemma3_12BTokenizer` / `SDTokenizer` / `SPieceTokenizer`, not ltx-core's): no template,
no strip, no truncation; ids = [<bos>=2] + SentencePiece ids of the text; `\\(`/`\\)` become `(`/`)`; the strings
`<end_of_turn>` / `<image_soft_token>` map to ids 106 / 262144 (looked up in the vocabulary for non-Gemma-sized
tokenizers), and, as ComfyUI does on that path, the first id after <bos> is dropped. ComfyUI left-pads with
<pad>=0 to at least 1024 tokens (`min_length=1024`) with an attention mask, runs Gemma on that, takes ALL hidden
states, and then keeps only the last `sum(mask)` positions (the padding is cut off before the feature extractor).
Here `tokenize`/`encode` left-pad to the longest prompt of the batch (or to `min_length` if given); valid-token
hidden states do not depend on the amount of left padding (masked keys; RoPE is relative). `encode` returns
`[B, T, hidden, num_layers+1]` float32 with `[..., 0]` = scaled embeddings and `[..., -1]` = final-norm output,
the same order as ComfyUI's `intermediate_output="all"` and transformers' `hidden_states`.

Prompt length: Lightricks' text encoder takes at most `MAX_PROMPT_TOKENS` = 1024 tokens (ltx-core
`LTXVGemmaTokenizer(tokenizer_root, 1024)`, diffusers `LTX2Pipeline(max_sequence_length=1024)`, both truncating
silently; the fleet's Gemma memory plan assumes as many). ComfyUI pads to 1024 but never truncates, so cutting a
prompt would change what the same graph computes there: a longer prompt is refused, naming its token count.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
#: ComfyUI left-pads every Gemma prompt to this many tokens (`Gemma3_12BTokenizer(min_length=1024)`).
COMFY_MIN_LENGTH = 1024
#: The longest prompt, in Gemma tokens with <bos>, that LTX-2's text encoder is run on (Lightricks ltx-core
#: `LTXVGemmaTokenizer(..., 1024)`, diffusers `max_sequence_length=1024`).
MAX_PROMPT_TOKENS = 1024
#: Special strings ComfyUI maps to fixed ids (`Gemma3_12BTokenizer.special_tokens`).
COMFY_SPECIAL_TOKENS = {"<image_soft_token>": 262144, "<end_of_turn>": 106}
#: Constants not visible in tensor shapes: those of ComfyUI's `Gemma3_12B_Config` (equal to google/gemma-3-12b-it's
#: config.json): global layers RoPE theta 1e6 with linear scaling x8, local (sliding) layers theta 1e4 unscaled,
#: sliding window 1024, every 6th layer global, RMSNorm eps 1e-6, attention scale 1/sqrt(head_dim).
GEMMA3_12B_CONSTANTS = {
    "rope_theta_global": 1_000_000.0, "rope_linear_factor_global": 8.0, "rope_theta_local": 10_000.0,
    "sliding_window": 1024, "sliding_window_pattern": 6, "rms_norm_eps": 1e-6,
}

_LM_PREFIXES = ("language_model.model.", "model.language_model.", "model.")
_IGNORED_PREFIXES = ("vision_model.", "vision_tower.", "multi_modal_projector.", "audio_projector.",
                     "model.vision_tower.", "model.multi_modal_projector.", "language_model.lm_head.", "lm_head.", "model.lm_head.",
                     "text_embedding_projection.", "hf_asset__")
_IGNORED_KEYS = ("spiece_model", "tokenizer_json", "scaled_fp8")
_FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
#: ComfyUI's int8 layout (comfy/quant_ops.py QUANT_ALGOS): int8 weight + float32 weight_scale, optional ConvRot
INT8_FORMATS = ("int8_tensorwise",)
#: quantization side tensors next to a weight (not weights themselves)
_AUX_SUFFIXES = (".comfy_quant", ".weight_scale", ".scale_weight", ".input_scale", ".scale_input", ".weight_scale_2")
#: Constants of ComfyUI's `Gemma4_12B_Config` not visible in tensor shapes (equal to transformers'
#: `Gemma4UnifiedTextConfig` defaults): sliding window 1024, RoPE theta 1e4 (sliding) / 1e6 on a quarter of the
#: dims (full attention, "proportional"), RMSNorm eps 1e-6, max positions 131072.
GEMMA4_12B_CONSTANTS = {
    "sliding_window": 1024, "rope_theta_sliding": 10_000.0, "rope_theta_full": 1_000_000.0,
    "partial_rotary_factor_full": 0.25, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
}


@dataclass(frozen=True)
class TextEncoderArch:
    """One Gemma generation as the LTX-2 text encoder (the text-encoder part of a model family).

    Attributes:
        name: "gemma3" | "gemma4".
        config_class / model_class: transformers classes building the language model.
        no_split_module: the decoder-layer class Accelerate must keep whole on one device.
        tokenizer_key: the tensor holding the tokenizer in ComfyUI's single file ("spiece_model": SentencePiece
            model proto; "tokenizer_json": a tokenizer.json).
        projection_prefix: where the LTX text projection lives: None = in the LTX checkpoint (LTX-2.0 / 2.3);
            "text_embedding_projection." = bundled in the text-encoder file (LTX-2.5).
        drops_first_id_with_specials: ComfyUI's Gemma 3 path drops the first tokenizer id when a prompt contains
            its special strings; Gemma 4 does not.
    The number of hidden states is always num_hidden_layers + 1 (embeddings first).
    """

    name: str
    config_class: str
    model_class: str
    no_split_module: str
    tokenizer_key: str
    projection_prefix: str | None
    drops_first_id_with_specials: bool


GEMMA3 = TextEncoderArch("gemma3", "Gemma3TextConfig", "Gemma3TextModel", "Gemma3DecoderLayer", "spiece_model",
                         None, True)
GEMMA4 = TextEncoderArch("gemma4", "Gemma4UnifiedTextConfig", "Gemma4UnifiedTextModel",
                         "Gemma4UnifiedTextDecoderLayer", "tokenizer_json", "text_embedding_projection.", False)
ARCHITECTURES = {a.name: a for a in (GEMMA3, GEMMA4)}


def detect_architecture(lm_keys) -> TextEncoderArch:
    """GEMMA4 when the language model's decoder layers carry `layer_scalar` (keys without the `model.` prefix),
    else GEMMA3. (ComfyUI's own rule for the 12B: `model.layers.47.self_attn.q_norm.weight` present and
    `model.layers.5.self_attn.v_proj.weight` absent.)"""
    return GEMMA4 if any(re.fullmatch(r"layers\.\d+\.layer_scalar", k) for k in lm_keys) else GEMMA3


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

class GemmaPromptTokenizer:
    """Prompt -> Gemma ids the way ComfyUI's LTX-2 Gemma tokenizer does it (see module docstring).

    Built from a SentencePiece model proto (`from_spiece_proto`) or a Hugging Face `tokenizer.json`
    (`from_tokenizer_json`, through the `tokenizers` library).
    """

    def __init__(self, encode_fn, vocab_lookup, vocab_size: int, source: str, architecture: TextEncoderArch = GEMMA3):
        self._encode = encode_fn          # str -> list[int], no BOS/EOS
        self._lookup = vocab_lookup       # piece -> id or None
        self.vocab_size = vocab_size
        self.source = source
        self.architecture = architecture
        if not architecture.drops_first_id_with_specials:
            self.special_tokens = {}      # Gemma 4: the tokenizer.json matches its own added tokens
        elif vocab_size >= 262144:
            self.special_tokens = dict(COMFY_SPECIAL_TOKENS)
        else:
            self.special_tokens = {s: i for s in COMFY_SPECIAL_TOKENS if (i := vocab_lookup(s)) is not None}

    @classmethod
    def from_spiece_proto(cls, proto: bytes, source: str = "<spiece_model>") -> GemmaPromptTokenizer:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_proto=proto)

        def lookup(piece):
            i = sp.piece_to_id(piece)
            return None if i == sp.unk_id() and piece != sp.id_to_piece(i) else i

        return cls(lambda s: sp.encode(s, add_bos=False, add_eos=False), lookup, sp.get_piece_size(), source)

    @classmethod
    def from_tokenizer_json(cls, data: bytes, source: str = "<tokenizer.json>",
                            architecture: TextEncoderArch = GEMMA3) -> GemmaPromptTokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(data.decode("utf-8"))
        return cls(lambda s: tok.encode(s, add_special_tokens=False).ids, tok.token_to_id,
                   tok.get_vocab_size(with_added_tokens=True), source, architecture)

    def prompt_ids(self, text: str) -> list[int]:
        """Ids for one prompt: `[BOS] + ids(text)` with ComfyUI's escapes and special-token handling."""
        text = text.replace("\\(", "(").replace("\\)", ")")
        if self.special_tokens:
            pattern = "|".join(re.escape(t) for t in self.special_tokens)
            if re.search(pattern, text):
                ids: list[int] = []
                for part in re.split(f"({pattern})", text):
                    if part in self.special_tokens:
                        ids.append(self.special_tokens[part])
                    elif part:
                        ids.extend(self._encode(part))
                # ComfyUI strips the first tokenizer output position (meant for BOS) on this path too.
                return [BOS_ID] + ids[1:]
        return [BOS_ID] + list(self._encode(text))


def check_prompt_lengths(prompts: list[str], rows: list[list[int]]) -> None:
    """Refuse a prompt longer than `MAX_PROMPT_TOKENS` tokens (ValidationError naming its tokens and characters)."""
    from ..protocol.validation import ValidationError

    for i, (prompt, ids) in enumerate(zip(prompts, rows)):
        if len(ids) > MAX_PROMPT_TOKENS:
            which = f"prompt {i + 1} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
            raise ValidationError(
                f"{which} is {len(ids)} Gemma tokens ({len(prompt)} characters, starting {prompt[:40]!r}): LTX-2's "
                f"text encoder takes at most {MAX_PROMPT_TOKENS} tokens (Lightricks ltx-core and diffusers truncate "
                f"there; ComfyUI would encode all of them): shorten it by about "
                f"{(len(ids) - MAX_PROMPT_TOKENS) * len(prompt) // len(ids)} characters")


# ----------------------------------------------------------------------------------------------------------------
# Encoder
# ----------------------------------------------------------------------------------------------------------------

class GemmaTextEncoder(nn.Module):
    """A loaded Gemma 3 language model + tokenizer that returns all hidden states.

    Attributes:
        model: transformers `Gemma3TextModel` (weights in `dtype`, on `device`).
        tokenizer: `GemmaPromptTokenizer`.
        source: the file or folder it was loaded from (used in error messages).
        text_config: the `Gemma3TextConfig`.
    """

    def __init__(self, model: nn.Module, tokenizer: GemmaPromptTokenizer, source: str,
                 architecture: TextEncoderArch = GEMMA3):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self.architecture = architecture
        self.text_config = model.config
        #: where the input ids go: the embedding's device, or for a model dispatched over several devices with
        #: Accelerate (`load_gemma(device_map=...)`) the first device of the map (its main/execution device)
        self.input_device: torch.device | None = None
        #: the Accelerate device map this model was dispatched with (None: one device, no hooks)
        self.device_map: dict | None = None

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_hidden_states(self) -> int:
        """num_layers + 1 (the scaled embeddings are the first hidden state); 49 for Gemma 3 12B."""
        return self.num_layers + 1

    @property
    def device(self) -> torch.device:
        return self.input_device or self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def tokenize(self, prompts: list[str], min_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask.

        Args:
            prompts: list of B strings.
            min_length: pad to at least this many tokens (ComfyUI uses `COMFY_MIN_LENGTH`=1024); default: the
                longest prompt.
        Returns: `(input_ids [B, T] long, attention_mask [B, T] long)` on the CPU; pads are <pad>=0 with mask 0
            on the left, every row starts its valid part with <bos>=2.
        Raises: TypeError if `prompts` is a bare string; ValidationError for a prompt over `MAX_PROMPT_TOKENS`.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, not a single string")
        rows = [self.tokenizer.prompt_ids(p) for p in prompts]
        check_prompt_lengths(prompts, rows)
        t = max([len(r) for r in rows] + [min_length or 0])
        ids = torch.full((len(rows), t), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(rows), t), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, t - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, t - len(r):] = 1
        return ids, mask

    @torch.inference_mode()
    def encode(self, prompts: list[str], min_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run Gemma on the prompts and stack all hidden states.

        Returns: `(hidden_states [B, T, hidden_size, num_layers+1] float32 on the CPU, attention_mask [B, T] long)`;
            padded positions are zero. Hidden state 0 = embeddings · sqrt(hidden_size), k = output of layer k,
            last = final RMSNorm of the last layer's output (transformers `output_hidden_states` order, equal to
            ComfyUI `Llama2_.forward(intermediate_output="all")`).
        Raises: ValueError if a hidden state is not finite (names the source).
        """
        ids, mask = self.tokenize(prompts, min_length)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         output_hidden_states=True, use_cache=False)
        # each hidden state is converted and brought to the CPU on its own: with a device map they live on the
        # device of the layer that produced them, and the float32 stack is never materialized on an accelerator
        hs = torch.stack([h.float().cpu() for h in out.hidden_states], dim=-1)
        hs = hs * mask[:, :, None, None].to(hs.dtype)
        if not torch.isfinite(hs).all():
            raise ValueError(f"Gemma hidden states from {self.source} contain non-finite values")
        return hs, mask


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class _Collected:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)   # LM keys without prefix -> tensor
    ignored: list[str] = field(default_factory=list)


def infer_text_config(shapes: dict[str, tuple[int, ...]], source: str) -> dict:
    """Gemma 3 text config from language-model tensor shapes (keys without prefix).

    Rules: hidden_size = embed_tokens.weight.shape[1]; vocab_size = shape[0]; num_hidden_layers = 1 + the largest
    `layers.{i}` index; head_dim = layers.0.self_attn.q_norm.weight.shape[0] (Gemma 3 normalizes q/k per head, so
    the norm width IS head_dim); num_attention_heads = q_proj.shape[0] / head_dim; num_key_value_heads =
    k_proj.shape[0] / head_dim; intermediate_size = mlp.gate_proj.shape[0]; query_pre_attn_scalar = head_dim
    (ComfyUI scales attention by 1/sqrt(head_dim)). Everything else: `GEMMA3_12B_CONSTANTS`.
    For the 12B file: 3840, 262208, 48 layers, head_dim 256, 16 heads, 8 kv heads, 15360.

    Raises: ValueError naming `source` and the rule when a needed tensor is absent or shapes are inconsistent.
    """
    def need(k):
        if k not in shapes:
            raise ValueError(f"{source}: cannot infer the Gemma 3 config, tensor {k!r} is missing "
                             f"(rule: a Gemma 3 language model has embed_tokens, layers.N.self_attn.q_norm, ...)")
        return shapes[k]

    vocab, hidden = need("embed_tokens.weight")
    layer_ids = {int(m.group(1)) for k in shapes if (m := re.match(r"layers\.(\d+)\.", k))}
    if not layer_ids:
        raise ValueError(f"{source}: no 'layers.N.' tensors found")
    num_layers = max(layer_ids) + 1
    if layer_ids != set(range(num_layers)):
        raise ValueError(f"{source}: layer indices are not contiguous 0..{num_layers - 1}: "
                         f"missing {sorted(set(range(num_layers)) - layer_ids)}")
    (head_dim,) = need("layers.0.self_attn.q_norm.weight")
    q_out = need("layers.0.self_attn.q_proj.weight")[0]
    k_out = need("layers.0.self_attn.k_proj.weight")[0]
    if q_out % head_dim or k_out % head_dim:
        raise ValueError(f"{source}: q_proj/k_proj widths {q_out}/{k_out} are not multiples of head_dim {head_dim} "
                         f"(rule: head_dim = q_norm width)")
    c = GEMMA3_12B_CONSTANTS
    return {
        "model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": num_layers,
        "head_dim": head_dim, "num_attention_heads": q_out // head_dim, "num_key_value_heads": k_out // head_dim,
        "intermediate_size": need("layers.0.mlp.gate_proj.weight")[0], "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta_global"],
        "rope_local_base_freq": c["rope_theta_local"],
        "rope_scaling": {"rope_type": "linear", "factor": c["rope_linear_factor_global"]},
        "sliding_window": c["sliding_window"], "sliding_window_pattern": c["sliding_window_pattern"],
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": BOS_ID,
    }


def infer_gemma4_text_config(shapes: dict[str, tuple[int, ...]], source: str) -> dict:
    """Gemma 4 (transformers `Gemma4UnifiedTextConfig`) text config from language-model tensor shapes (keys without
    prefix).

    Rules: hidden_size, vocab_size from `embed_tokens.weight`; num_hidden_layers = 1 + the largest layer index; each
    layer's head width = its `self_attn.q_norm.weight` width; head_dim = the smaller width (sliding layers),
    global_head_dim = the larger (full-attention layers; the two must differ); layer_types: "full_attention" where
    the width is global_head_dim, else "sliding_attention" (the last layer must be full attention);
    attention_k_eq_v = the full-attention layers have no `v_proj` (all or none; every sliding layer has one);
    num_attention_heads = q_proj rows / head width (equal on both kinds); num_key_value_heads = k_proj rows /
    head_dim on sliding layers, num_global_key_value_heads = k_proj rows / global_head_dim on full layers;
    intermediate_size = `mlp.gate_proj` rows (equal on every layer). Everything else: `GEMMA4_12B_CONSTANTS`.
    For the 12B file: 3840, 262144, 48 layers, 256 / 512, 16 heads, 8 / 1 key/value heads, 15360, every 6th full.

    Raises: ValueError naming `source`, the layer and the rule when a tensor is missing or shapes disagree.
    """
    def need(k):
        if k not in shapes:
            raise ValueError(f"{source}: cannot infer the Gemma 4 config, tensor {k!r} is missing (rule: a Gemma 4 "
                             f"language model has embed_tokens, layers.N.self_attn.{{q,k}}_proj/q_norm, mlp, ...)")
        return shapes[k]

    vocab, hidden = need("embed_tokens.weight")
    layer_ids = {int(m.group(1)) for k in shapes if (m := re.match(r"layers\.(\d+)\.", k))}
    if not layer_ids:
        raise ValueError(f"{source}: no 'layers.N.' tensors found")
    n = max(layer_ids) + 1
    if layer_ids != set(range(n)):
        raise ValueError(f"{source}: layer indices are not contiguous 0..{n - 1}: missing "
                         f"{sorted(set(range(n)) - layer_ids)}")
    widths = [need(f"layers.{i}.self_attn.q_norm.weight")[0] for i in range(n)]
    head_dim, global_head_dim = min(widths), max(widths)
    if head_dim == global_head_dim:
        raise ValueError(f"{source}: every layer has head width {head_dim}; rule: Gemma 4 full-attention layers have "
                         f"a wider head (q_norm width) than sliding layers, which is how they are told apart")
    full = [i for i in range(n) if widths[i] == global_head_dim]
    if full[-1] != n - 1:
        raise ValueError(f"{source}: the last layer ({n - 1}) has head width {widths[-1]}, not {global_head_dim}; "
                         f"rule: the last Gemma 4 layer is a full-attention layer")
    has_v = [f"layers.{i}.self_attn.v_proj.weight" in shapes for i in range(n)]
    no_v_sliding = [i for i in range(n) if i not in full and not has_v[i]]
    if no_v_sliding:
        raise ValueError(f"{source}: sliding layers {no_v_sliding[:8]} have no self_attn.v_proj.weight (rule: only "
                         f"full-attention layers may reuse K as V)")
    k_eq_v = {has_v[i] for i in full}
    if len(k_eq_v) > 1:
        raise ValueError(f"{source}: some full-attention layers have a v_proj and some do not "
                         f"({[i for i in full if has_v[i]][:8]} have one); rule: all or none")
    heads, kv, global_kv, inter = None, None, None, None
    for i in range(n):
        hd = widths[i]
        q_rows = need(f"layers.{i}.self_attn.q_proj.weight")[0]
        k_rows = need(f"layers.{i}.self_attn.k_proj.weight")[0]
        g_rows = need(f"layers.{i}.mlp.gate_proj.weight")[0]
        if q_rows % hd or k_rows % hd:
            raise ValueError(f"{source}: layer {i}: q_proj/k_proj rows {q_rows}/{k_rows} are not multiples of its "
                             f"head width {hd} (q_norm width)")
        h = q_rows // hd
        if heads not in (None, h):
            raise ValueError(f"{source}: layer {i} has {h} query heads, layer 0 has {heads}; rule: one head count")
        heads = h
        if i in full:
            if global_kv not in (None, k_rows // hd):
                raise ValueError(f"{source}: layer {i} has {k_rows // hd} key/value heads, other full-attention layers "
                                 f"{global_kv}")
            global_kv = k_rows // hd
        else:
            if kv not in (None, k_rows // hd):
                raise ValueError(f"{source}: layer {i} has {k_rows // hd} key/value heads, other sliding layers {kv}")
            kv = k_rows // hd
        if inter not in (None, g_rows):
            raise ValueError(f"{source}: layer {i} has MLP width {g_rows}, layer 0 has {inter}; rule: one MLP width")
        inter = g_rows
    c = GEMMA4_12B_CONSTANTS
    return {
        "model_type": "gemma4_unified_text", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": n, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv, "attention_k_eq_v": not has_v[full[0]],
        "layer_types": ["full_attention" if i in full else "sliding_attention" for i in range(n)],
        "sliding_window": c["sliding_window"], "rms_norm_eps": c["rms_norm_eps"],
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": c["max_position_embeddings"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": c["rope_theta_sliding"]},
            "full_attention": {"rope_type": "proportional", "rope_theta": c["rope_theta_full"],
                               "partial_rotary_factor": c["partial_rotary_factor_full"]}},
        "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "final_logit_softcapping": 30.0,
        "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": BOS_ID,
    }


def infer_config(shapes: dict[str, tuple[int, ...]], source: str, architecture: TextEncoderArch) -> dict:
    """The text config of `architecture` from language-model shapes (`infer_text_config` or
    `infer_gemma4_text_config`)."""
    if architecture is GEMMA4:
        return infer_gemma4_text_config(shapes, source)
    return infer_text_config(shapes, source)


def quant_configs(f, keys: set[str], meta: dict, source: str) -> dict[str, dict]:
    """Layer name (full key prefix) -> its quantization config (`{"format": ..., ...}`), from the safetensors
    metadata `_quantization_metadata` and the per-layer uint8 JSON tensors `<layer>.comfy_quant`; legacy
    `scaled_fp8` files give `{"format": "float8_e4m3fn"}` for each `<layer>.scale_weight`.
    Raises ValueError naming the file for an unreadable config."""
    confs: dict[str, dict] = {}
    if "_quantization_metadata" in meta:
        try:
            layers = json.loads(meta["_quantization_metadata"]).get("layers", {})
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{source}: unreadable '_quantization_metadata' metadata: {e}") from e
        confs.update({k: dict(v) for k, v in layers.items()})
    for k in keys:
        if k.endswith(".comfy_quant"):
            raw = bytes(f.get_tensor(k).to(torch.uint8).tolist())
            try:
                confs[k[: -len(".comfy_quant")]] = dict(json.loads(raw.decode("utf-8")))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{source}: unreadable quantization config {k!r}: {e}") from e
    if "scaled_fp8" in keys:
        for k in keys:
            if k.endswith(".scale_weight"):
                confs.setdefault(k[: -len(".scale_weight")], {"format": "float8_e4m3fn"})
    return confs


def _quant_formats(f, keys: set[str], meta: dict, source: str) -> dict[str, str]:
    """Layer name (full key prefix) -> quantization format (`quant_configs`' "format" values)."""
    return {k: v.get("format") for k, v in quant_configs(f, keys, meta, source).items()}


def _refuse_unsupported(formats: dict[str, str], keys: set[str], source: str) -> None:
    bad = {k: v for k, v in formats.items() if v not in _FP8_FORMATS and v not in INT8_FORMATS}
    if not bad:
        bad = {k[: -len(".weight_scale_2")]: "nvfp4" for k in keys if k.endswith(".weight_scale_2")}
    if bad:
        layer, fmt = sorted(bad.items())[0]
        raise ValueError(
            f"{source}: layer {layer!r} is stored as {fmt!r} ({len(bad)} such layers; an fp4-mixed ComfyUI text "
            f"encoder such as gemma_3_12B_it_fp4_mixed.safetensors). Rule: Gemma files must be bf16/fp16/fp32, "
            f"per-tensor scaled fp8 (float8_e4m3fn/float8_e5m2 + weight_scale) or ComfyUI's int8 "
            f"(int8_tensorwise, optionally convrot); nvfp4/mxfp8 block-scaled weights are not supported. Use "
            f"gemma_3_12B_it.safetensors / gemma_3_12B_it_fp8_scaled.safetensors, or for LTX-2.5 "
            f"gemma4-12b-with-proj-ltx-2.5-bf16 / -comfy-int8-convrot.")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, conf: dict, name: str = "") -> torch.Tensor:
    """ComfyUI `int8_tensorwise` weight -> float32 (`models.quant.dequantize_int8`: `q · scale`, scale 0-d or per
    row [out, 1], rotated back group-wise by the ConvRot Hadamard matrix when `conf` says `convrot`).
    Raises ValueError naming `name` for a scale that does not broadcast or a bad group size."""
    from .quant import convrot_group
    from .quant import dequantize_int8 as _dequantize

    if scale.numel() != 1 and (scale.ndim != q.ndim or scale.shape[0] != q.shape[0] or scale.shape[1:] != (1,)):
        raise ValueError(f"{name}: int8 weight {tuple(q.shape)} has a weight_scale of shape {tuple(scale.shape)} "
                         f"(rule: one scale, or one per row [out, 1])")
    try:
        return _dequantize(q, scale.reshape(()) if scale.numel() == 1 else scale, convrot_group(conf))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def read_weight(f, key: str, keys: set[str], confs: dict[str, dict], source: str) -> torch.Tensor:
    """Tensor `key` of the open safetensors file `f`, dequantized when stored quantized: scaled fp8
    (`weight · weight_scale` / legacy `scale_weight`, per tensor) or ComfyUI int8 (`dequantize_int8`), float32 then;
    otherwise the stored floating tensor as is. Raises ValueError naming the file and key for an integer tensor
    without an int8 config, a non-scalar fp8 scale or a missing int8 scale."""
    t = f.get_tensor(key)
    layer = key[: -len(".weight")] if key.endswith(".weight") else None
    if t.dtype in _FP8_FORMATS.values():
        scale = torch.ones((), dtype=torch.float32)
        for sfx in (".weight_scale", ".scale_weight"):
            if layer is not None and layer + sfx in keys:
                scale = f.get_tensor(layer + sfx).float()
        if scale.numel() != 1:
            raise ValueError(f"{source}: fp8 tensor {key!r} has a non-scalar scale of shape "
                             f"{tuple(scale.shape)}; only per-tensor scaled fp8 is supported")
        return t.float() * scale
    if t.dtype == torch.int8 and layer is not None and confs.get(layer, {}).get("format") in INT8_FORMATS:
        if layer + ".weight_scale" not in keys:
            raise ValueError(f"{source}: int8 weight {key!r} has no {layer + '.weight_scale'!r}")
        return dequantize_int8(t, f.get_tensor(layer + ".weight_scale"), confs[layer], f"{source}: {key}")
    if not t.is_floating_point():
        raise ValueError(f"{source}: tensor {key!r} has dtype {t.dtype}; rule: weights must be floating point or "
                         f"quantized in a supported layout (scaled fp8, int8_tensorwise with its comfy_quant config)")
    return t


def _collect(files: list[Path], prefix: str, dtype: torch.dtype, source: str) -> _Collected:
    """Read the language-model tensors of `files`, strip `prefix`, dequantize fp8 / int8, cast to `dtype` (CPU)."""
    from safetensors import safe_open

    col = _Collected()
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            meta = f.metadata() or {}
            confs = quant_configs(f, keys, meta, f"{path}")
            _refuse_unsupported({k: v.get("format") for k, v in confs.items()}, keys, f"{path}")
            for k in sorted(keys):
                if k in _IGNORED_KEYS or k.startswith(_IGNORED_PREFIXES):
                    col.ignored.append(k)
                    continue
                if not k.startswith(prefix):
                    unexpected.append(k)
                    continue
                if k.endswith(_AUX_SUFFIXES):
                    continue
                col.tensors[k[len(prefix):]] = read_weight(f, k, keys, confs, str(path)).to(dtype)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors outside the language model prefix {prefix!r}: "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return col


def _detect_prefix(keys: set[str], source: str) -> str:
    for p in _LM_PREFIXES:
        if p + "embed_tokens.weight" in keys:
            return p
    if "embed_tokens.weight" in keys:
        return ""
    raise ValueError(f"{source}: no Gemma language model found (rule: expected one of "
                     f"{[p + 'embed_tokens.weight' for p in _LM_PREFIXES]})")


def _map_device(device_map: dict | None, name: str, default: torch.device) -> torch.device:
    """Where tensor/module `name` is first placed under an Accelerate-style `device_map` (longest module-name
    prefix; "cpu" and "disk" entries stay on the CPU until `dispatch_model` offloads them; an int is a CUDA index)."""
    if not device_map:
        return default
    best = None
    for module in device_map:
        if (module == "" or name == module or name.startswith(module + ".")) and (best is None or
                                                                                    len(module) > len(best)):
            best = module
    if best is None:
        raise ValueError(f"device_map places no module holding {name!r} (modules: {sorted(device_map)})")
    return _as_device(device_map[best])


def _as_device(where) -> torch.device:
    """An Accelerate device-map value as a torch device ("disk" -> the CPU, an int -> that CUDA index)."""
    if where == "disk":
        return torch.device("cpu")
    return torch.device(f"cuda:{where}") if isinstance(where, int) else torch.device(where)


def _build_model(text_config: dict, tensors: dict[str, torch.Tensor], device, source: str,
                 device_map: dict | None = None, architecture: TextEncoderArch = GEMMA3) -> nn.Module:
    import transformers

    cfg = dict(text_config)
    cfg.pop("model_type", None)
    config = getattr(transformers, architecture.config_class)(**cfg)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = getattr(transformers, architecture.model_class)(config)
    try:
        model.load_state_dict({k: v.to(_map_device(device_map, k, device)) for k, v in tensors.items()},
                              strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{source}: weights do not match the {architecture.name} config "
                         f"(hidden={config.hidden_size}, layers={config.num_hidden_layers}): {e}") from e
    # Non-persistent buffers are not in the checkpoint: recreate them for real (they were built on meta).
    model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5,
                                                  device=_map_device(device_map, "embed_tokens", device))
    model.rotary_emb = type(model.rotary_emb)(config=config, device=_map_device(device_map, "rotary_emb", device))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{source}: tensors left uninitialized after loading: {left}")
    return model.eval().requires_grad_(False)


def load_gemma(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32, *,
               device_map: dict | None = None, offload_dir: str | Path | None = None) -> GemmaTextEncoder:
    """Load a Gemma 3 text encoder from ComfyUI's single file or a Hugging Face folder.

    Args:
        path: a `.safetensors` file (ComfyUI `models/text_encoders/` layout, or ltx-core's packed TE file) or a
            folder with `config.json` + `*.safetensors` + `tokenizer.model` (or `tokenizer.json`).
        device: where the model runs (ignored when `device_map` is given).
        dtype: weight/compute dtype; fp8-stored weights are dequantized (`weight·scale`) to it.
        device_map: Accelerate device map, module name -> device ("cuda:1", 1, "cpu", "disk"), e.g. from
            `parallel.gemma.plan_device_map`: each tensor goes straight to its module's device and the model is
            dispatched with `accelerate.dispatch_model` (main device = the device of the first entry; "cpu"/"disk"
            entries are offloaded and run on the main device, or on the CPU when every entry is "cpu"/"disk").
            A map naming one device only is loaded there without hooks.
        offload_dir: folder for the "disk" entries of `device_map`.
    Returns: `GemmaTextEncoder`.
    Raises: FileNotFoundError if `path` does not exist; ValueError naming the file and the rule for: an fp4-mixed /
        nvfp4 / mxfp8 file, a missing tokenizer (`spiece_model`), a missing/unknown config, tensors outside the
        language model, shapes that contradict the config, missing or unexpected language-model tensors, a
        device map that leaves a module unplaced or names "disk" without `offload_dir`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Gemma text encoder not found: {path}")
    device = torch.device(device)
    single = None
    if device_map:
        places = list(dict.fromkeys(device_map.values()))
        if "disk" in places and offload_dir is None:
            raise ValueError(f"{path}: the device map offloads to 'disk' but no offload_dir was given")
        if len(places) == 1 and places[0] != "disk":
            single, device_map = _as_device(places[0]), None
    enc = (_load_folder if path.is_dir() else _load_single_file)(path, single or device, dtype, device_map)
    if device_map:
        from accelerate import dispatch_model

        accel = [d for d in device_map.values() if d not in ("cpu", "disk")]
        main = _as_device(accel[0] if accel else "cpu")  # offloaded ("cpu"/"disk") entries execute here
        # main_device as a str: Accelerate compares it with "cpu" (a torch.device never equals a str)
        dispatch_model(enc.model, device_map=dict(device_map), main_device=str(main),
                       offload_dir=str(offload_dir) if offload_dir is not None else None)
        enc.input_device, enc.device_map = main, dict(device_map)
    return enc


def _load_single_file(path: Path, device, dtype, device_map: dict | None = None) -> GemmaTextEncoder:
    from safetensors import safe_open

    source = str(path)
    with safe_open(source, framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata() or {}
        prefix = _detect_prefix(keys, source)
        arch = detect_architecture(k[len(prefix):] for k in keys if k.startswith(prefix))
        if arch is GEMMA4:
            if "tokenizer_json" not in keys:
                raise ValueError(f"{source}: Gemma 4 file without a tokenizer (rule: ComfyUI's Gemma 4 files embed "
                                 f"the Hugging Face tokenizer.json as the uint8 tensor 'tokenizer_json')")
            tokenizer = GemmaPromptTokenizer.from_tokenizer_json(
                bytes(f.get_tensor("tokenizer_json").to(torch.uint8).numpy().tobytes()), source, GEMMA4)
        elif "spiece_model" in keys:
            tokenizer = GemmaPromptTokenizer.from_spiece_proto(
                bytes(f.get_tensor("spiece_model").to(torch.uint8).numpy().tobytes()), source)
        elif "tokenizer_json" in keys:
            tokenizer = GemmaPromptTokenizer.from_tokenizer_json(
                bytes(f.get_tensor("tokenizer_json").to(torch.uint8).numpy().tobytes()), source)
        else:
            raise ValueError(f"{source}: no tokenizer in the file (rule: ComfyUI Gemma files embed the SentencePiece "
                             f"model as the uint8 tensor 'spiece_model')")
    col = _collect([path], prefix, dtype, source)
    if "gemma_config" in meta and arch is GEMMA3:   # ltx-core packed TE file
        text_config = _text_config_from_json(json.loads(meta["gemma_config"]), source)
    else:
        text_config = infer_config({k: tuple(v.shape) for k, v in col.tensors.items()}, source, arch)
    return GemmaTextEncoder(_build_model(text_config, col.tensors, device, source, device_map, arch), tokenizer,
                            source, arch)


def _text_config_from_json(config: dict, source: str) -> dict:
    mt = config.get("model_type")
    if mt == "gemma3":
        if "text_config" not in config:
            raise ValueError(f"{source}: gemma3 config without 'text_config'")
        return dict(config["text_config"])
    if mt == "gemma3_text":
        return {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype",
                                                               "transformers_version")}
    raise ValueError(f"{source}: unsupported model_type {mt!r} (rule: 'gemma3' or 'gemma3_text' — Gemma 3 only)")


def _load_folder(folder: Path, device, dtype, device_map: dict | None = None) -> GemmaTextEncoder:
    source = str(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{source}: no config.json (rule: a Hugging Face Gemma folder has config.json, "
                         f"*.safetensors and tokenizer.model)")
    text_config = _text_config_from_json(json.loads(cfg_path.read_text()), str(cfg_path))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source}: no *.safetensors weight files")
    if (folder / "tokenizer.model").is_file():
        tokenizer = GemmaPromptTokenizer.from_spiece_proto((folder / "tokenizer.model").read_bytes(),
                                                           str(folder / "tokenizer.model"))
    elif (folder / "tokenizer.json").is_file():
        tokenizer = GemmaPromptTokenizer.from_tokenizer_json((folder / "tokenizer.json").read_bytes(),
                                                             str(folder / "tokenizer.json"))
    else:
        raise ValueError(f"{source}: no tokenizer.model or tokenizer.json")
    from safetensors import safe_open

    keys: set[str] = set()
    for p in files:
        with safe_open(str(p), framework="pt") as f:
            keys |= set(f.keys())
    prefix = _detect_prefix(keys, source)
    col = _collect(files, prefix, dtype, source)
    return GemmaTextEncoder(_build_model(text_config, col.tensors, device, source, device_map), tokenizer, source)


# ----------------------------------------------------------------------------------------------------------------
# Headers only (memory planning, cache keys): nothing is loaded
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class GemmaHeader:
    """What the safetensors headers (and config.json) of a Gemma file or folder say, without reading weights.

    Attributes:
        source: the file or folder.
        text_config: the text config dict (as `load_gemma` builds the model from).
        shapes: language-model tensor name (no prefix, e.g. "layers.3.mlp.up_proj.weight") -> shape; the
            quantization side tensors (`weight_scale`, `comfy_quant`, ...) are not listed.
        stored_dtypes: the same names -> safetensors dtype string ("BF16", "F8_E4M3", ...).
    """

    source: str
    text_config: dict
    shapes: dict[str, tuple[int, ...]]
    stored_dtypes: dict[str, str]
    architecture: TextEncoderArch = GEMMA3
    #: the bundled LTX text projection's tensors (keys under `architecture.projection_prefix`, prefix stripped,
    #: quantization side tensors left out) -> shape; empty when the file has none
    projection_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def num_hidden_states(self) -> int:
        return self.num_layers + 1

    def module_bytes(self, dtype: torch.dtype) -> tuple[list[int], dict[str, int]]:
        """Bytes of the weights once loaded in `dtype` (fp8 is dequantized to it): `(per decoder layer in order,
        {"embed_tokens": …, "norm": …})` — the input of `parallel.gemma.plan_device_map`."""
        size = torch.empty((), dtype=dtype).element_size()
        layers = [0] * self.num_layers
        fixed: dict[str, int] = {}
        for name, shape in self.shapes.items():
            n = size
            for d in shape:
                n *= int(d)
            m = re.match(r"layers\.(\d+)\.", name)
            if m:
                layers[int(m.group(1))] += n
            else:
                module = name.rsplit(".", 1)[0]
                fixed[module] = fixed.get(module, 0) + n
        return layers, fixed


def read_gemma_header(path: str | Path) -> GemmaHeader:
    """The config and tensor shapes of a Gemma 3 file or folder from headers only (same layouts and refusals as
    `load_gemma`: fp4-mixed files, missing config, no language model are refused with the same ValueErrors).

    Raises: FileNotFoundError if `path` does not exist; ValueError naming the file and the rule.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Gemma text encoder not found: {path}")
    source = str(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{source}: no config.json (rule: a Hugging Face Gemma folder has config.json, "
                             f"*.safetensors and tokenizer.model)")
        if not files:
            raise ValueError(f"{source}: no *.safetensors weight files")
    infos: dict[str, tuple[tuple[int, ...], str]] = {}
    meta: dict = {}
    for p in files:
        with safe_open(str(p), framework="pt") as f:
            keys = set(f.keys())
            meta = f.metadata() or {}
            _refuse_unsupported(_quant_formats(f, keys, meta, str(p)), keys, str(p))
            for k in keys:
                sl = f.get_slice(k)
                infos[k] = (tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
    prefix = _detect_prefix(set(infos), source)
    shapes, dtypes, projection = {}, {}, {}
    for k, (shape, dt) in infos.items():
        if k.endswith(_AUX_SUFFIXES):
            continue
        if k.startswith(GEMMA4.projection_prefix):
            projection[k[len(GEMMA4.projection_prefix):]] = shape
        if k in _IGNORED_KEYS or k.startswith(_IGNORED_PREFIXES) or not k.startswith(prefix):
            continue
        shapes[k[len(prefix):]] = shape
        dtypes[k[len(prefix):]] = dt
    arch = detect_architecture(shapes)
    if path.is_dir():
        text_config = _text_config_from_json(json.loads((path / "config.json").read_text()),
                                             str(path / "config.json"))
    elif "gemma_config" in meta and arch is GEMMA3:
        text_config = _text_config_from_json(json.loads(meta["gemma_config"]), source)
    else:
        text_config = infer_config(shapes, source, arch)
    return GemmaHeader(source, text_config, shapes, dtypes, arch, projection if arch is GEMMA4 else {})


def gemma_fingerprint(path: str | Path) -> tuple:
    """Identity of a Gemma file or folder for caches: (resolved path, and per file: name, size, mtime_ns).
    A folder contributes its config, tokenizer and `*.safetensors` files. Raises FileNotFoundError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Gemma text encoder not found: {path}")
    path = path.resolve()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and (
            p.suffix == ".safetensors" or p.name in ("config.json", "tokenizer.model", "tokenizer.json")))
    else:
        files = [path]
    return (str(path),) + tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
