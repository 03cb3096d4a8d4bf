"""Tiny random-weight Gemma 4 text encoders for LTX-2.5 tests, in the single-file layout ComfyUI 0.33 loads with
`CLIPLoader(type="ltxv")` (`text_encoders/gemma4-12b-with-proj-ltx-2.5-{bf16,comfy-int8-convrot}.safetensors`).

Layout (facts from ComfyUI 0.33 `comfy/sd.py::detect_te_model` / `load_text_encoder_state_dicts`,
`comfy/text_encoders/gemma4.py` (`Gemma4_12B_Config`, `Gemma4Transformer`, `TransformerBlockGemma4`,
`Gemma4Attention`), `comfy/text_encoders/lt.py` (`LTXAVTEModel`, `DualLinearProjection`, `sd_detect`),
`comfy/ops.py` (`mixed_precision_ops`) and comfy-kitchen's `TensorWiseINT8Layout`; see `mgpu_backend.models.gemma`):

* language model under `model.`: `embed_tokens.weight` [V, H]; `layers.{0..47}.` with `self_attn.{q,k,o}_proj.weight`,
  `self_attn.{q,k}_norm.weight`, `mlp.{gate,up,down}_proj.weight`, `{input,post_attention,pre_feedforward,
  post_feedforward}_layernorm.weight`, the learned per-layer scalar `layer_scalar` [1]; sliding layers (5 of every 6,
  `i % 6 != 5`) have head_dim 256 and `self_attn.v_proj.weight`; full-attention layers (`i % 6 == 5`) have head_dim
  512, ONE key/value head and no `v_proj` (`attention_k_eq_v`: V is the raw K projection, RMS-normed without a
  weight); `norm.weight`. ComfyUI recognises the 12B by `model.layers.47.self_attn.q_norm.weight` present and
  `model.layers.5.self_attn.v_proj.weight` absent, so the tiny keeps all 48 layers (they are small).
* the LTX text projection bundled under `text_embedding_projection.`: `video_aggregate_embed.{weight,bias}`
  [video, H·49] and `audio_aggregate_embed.{weight,bias}` [audio, H·49] (ComfyUI's `dual_linear`; the sizes follow
  the Gemma config: in_features = hidden_size · (num_hidden_layers + 1)).
* the tokenizer as the 1-D uint8 tensor `tokenizer_json` (the UTF-8 bytes of a Hugging Face `tokenizer.json`; ComfyUI
  builds `tokenizers.Tokenizer.from_str` from it — Gemma 4 ships no SentencePiece model).
* dtype: bfloat16 for every weight (as released). The int8-convrot variant (`int8_convrot=True`) stores every Linear
  weight of the decoder layers as int8 with a float32 per-row `weight_scale` [out, 1] and a uint8 JSON
  `comfy_quant` = `{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": G}`: the weight was rotated
  group-wise by a normalized regular Hadamard matrix over the input axis (`W_rot = W · Hᵀ` per group of G columns)
  and then quantized per row (`q = round(W_rot / s)`, `s = max|row| / 127`); the embedding, the norms, the scalars
  and the projection stay bfloat16 (that split is what the released file's size says: 15.37 GB int8-convrot vs
  26.26 GB bf16). The real file uses G = 256; the tiny uses G = 16 (its hidden size 32 is not a multiple of 256).

Tiny shapes: hidden 32, 4 query heads, 2 key/value heads on sliding layers and 1 on full-attention layers (the
12B: 16 / 8 / 1), head_dim 256 / 512 as the 12B (ComfyUI fixes both), intermediate 128, 48 layers, projection
64 (video) + 32 (audio). `TINY_COMFY_CONFIG` is what ComfyUI's `Gemma4_12B_Config` needs overridden to build the
tiny (through `model_options={"_model_config": ...}` of `comfy.sd.load_clip`).

Tokenizer: a SentencePiece BPE model (byte fallback, no dummy prefix, like Gemma's) trained on the small built-in
corpus of `tiny_gemma`, with Gemma 4's chat/media markers (`<|turn>`, `<turn|>`, `<|channel>`, ...) as user-defined
pieces, converted to a `tokenizer.json` the way transformers converts Gemma tokenizers (`GemmaTokenizer`'s model,
normalizer, pre-tokenizer and decoder; merges from the piece scores with transformers' `generate_merges`), the
markers and `<pad>`/`<eos>`/`<bos>`/`<unk>` added as special tokens and a post-processor that prepends `<bos>`
(as Gemma's `tokenizer.json`). ids `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3. Deterministic (tests check that the
converted tokenizer encodes exactly as the SentencePiece model and that the bytes are stable).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

#: Gemma 4 chat / media markers kept whole by the tiny tokenizer (user-defined SentencePiece pieces 4..16)
SPECIAL_SYMBOLS = ["<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|image>", "<image|>",
                   "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
TINY_VOCAB_TARGET = 512
TINY_HIDDEN = 32
TINY_LAYERS = 48          # ComfyUI detects the Gemma 4 12B by model.layers.47
TINY_HEADS = 4
TINY_KV_HEADS = 2         # sliding layers
TINY_GLOBAL_KV_HEADS = 1  # full-attention layers (the 12B's value; ComfyUI fixes it)
TINY_INTERMEDIATE = 128
HEAD_DIM = 256            # sliding layers (ComfyUI's Gemma4Config.head_dim)
GLOBAL_HEAD_DIM = 512     # full-attention layers (Gemma4Config.global_head_dim)
FULL_ATTENTION_EVERY = 6  # layer i is full attention when i % 6 == 5 (Gemma4_12B_Config.sliding_attention)
TINY_VIDEO_DIM = 64
TINY_AUDIO_DIM = 32
TINY_CONVROT_GROUP = 16
PROJECTION_PREFIX = "text_embedding_projection."

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@functools.lru_cache(maxsize=2)
def tiny_gemma4_tokenizer_json(vocab_size: int = TINY_VOCAB_TARGET) -> bytes:
    """The tiny Gemma 4 `tokenizer.json` (UTF-8 bytes; see the module docstring). Deterministic, cached."""
    import sentencepiece as spm
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    from .tiny_gemma import tiny_spiece_model

    sp = spm.SentencePieceProcessor(model_proto=tiny_spiece_model(vocab_size, tuple(SPECIAL_SYMBOLS)))
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(n)}
    merged = {sp.id_to_piece(i) for i in range(n) if not (sp.is_unknown(i) or sp.is_control(i) or sp.is_byte(i))
              and sp.id_to_piece(i) not in SPECIAL_SYMBOLS}
    merges = generate_merges(vocab, scores, skip_tokens=set(vocab) - merged)
    backend = GemmaTokenizer(vocab=vocab, merges=merges).backend_tokenizer
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                for s in ["<pad>", "<eos>", "<bos>", "<unk>", *SPECIAL_SYMBOLS]])
    backend.post_processor = TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    return backend.to_str().encode("utf-8")


def tiny_gemma4_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tiny_gemma4_tokenizer_json().decode("utf-8")).get_vocab_size(with_added_tokens=True)


def is_full_attention(layer: int) -> bool:
    """Gemma 4 12B layer pattern: five sliding layers, then one full-attention layer."""
    return layer % FULL_ATTENTION_EVERY == FULL_ATTENTION_EVERY - 1


def tiny_gemma4_shapes(num_layers: int = TINY_LAYERS) -> dict[str, tuple[int, ...]]:
    """Language-model parameter shapes, keyed without the `model.` prefix (ComfyUI / transformers names)."""
    h, heads = TINY_HIDDEN, TINY_HEADS
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (tiny_gemma4_vocab_size(), h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        full = is_full_attention(i)
        hd = GLOBAL_HEAD_DIM if full else HEAD_DIM
        kv = TINY_GLOBAL_KV_HEADS if full else TINY_KV_HEADS
        shapes[p + "self_attn.q_proj.weight"] = (heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv * hd, h)
        if not full:
            shapes[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (TINY_INTERMEDIATE, h)
        shapes[p + "mlp.up_proj.weight"] = (TINY_INTERMEDIATE, h)
        shapes[p + "mlp.down_proj.weight"] = (h, TINY_INTERMEDIATE)
        for n in _NORMS:
            shapes[p + n + ".weight"] = (h,)
        shapes[p + "layer_scalar"] = (1,)
    shapes["norm.weight"] = (h,)
    return shapes


def tiny_gemma4_weights(seed: int = 0, num_layers: int = TINY_LAYERS) -> dict[str, torch.Tensor]:
    """Float32 weights: the language model (keys with `model.`) and the projection (`text_embedding_projection.`).

    Embeddings ~ N(0, 0.05²) (times sqrt(H) at run time); Linear weights ~ N(0, (0.5/sqrt(fan_in))²); norm weights
    1 + N(0, 0.1²) (Gemma 4 norms multiply by the weight itself, not 1 + weight), q/k norms d^-1/4 · (1 + N(0, 0.1²))
    (well-conditioned attention: logits ~N(0, 1) at scale 1.0); layer scalars ~ U(0.5, 1);
    projection weights ~ N(0, 1/fan_in), biases ~ N(0, 0.02²). Every tensor is filled and finite (asserted).
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tiny_gemma4_shapes(num_layers).items():
        if name == "embed_tokens.weight":
            t = torch.randn(shape, generator=g) * 0.05
        elif name.endswith("layer_scalar"):
            t = 0.5 + 0.5 * torch.rand(shape, generator=g)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # attention scale is 1.0 and q, k are RMS-normed: weights d^-1/4 keep the logits ~N(0, 1) (with 1.0
            # they would be ~N(0, d), a near-argmax attention that turns float rounding into O(1) differences)
            t = shape[0] ** -0.25 * (1.0 + 0.1 * torch.randn(shape, generator=g))
        elif len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (0.5 / shape[1] ** 0.5)
        out["model." + name] = t
    in_features = TINY_HIDDEN * (num_layers + 1)
    for part, width in (("video_aggregate_embed", TINY_VIDEO_DIM), ("audio_aggregate_embed", TINY_AUDIO_DIM)):
        out[f"{PROJECTION_PREFIX}{part}.weight"] = torch.randn(width, in_features, generator=g) / in_features ** 0.5
        out[f"{PROJECTION_PREFIX}{part}.bias"] = torch.randn(width, generator=g) * 0.02
    for k, v in out.items():
        assert torch.isfinite(v).all(), k
    return out


def hadamard(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized regular Hadamard matrix of ConvRot (`H4^{⊗k} / sqrt(size)`, size a power of 4; symmetric and
    orthogonal). Source: comfy-kitchen `tensor/int8_utils.py::_build_hadamard`. Raises ValueError otherwise."""
    if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
        raise ValueError(f"convrot group size must be a power of 4 (>= 4), got {size}")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return (h / size ** 0.5).to(dtype)


def quantize_int8_convrot(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's int8-convrot weight: rotate each group of `group_size` input columns by `Hᵀ`, then quantize per
    row. Returns `(q int8 [out, in], scale float32 [out, 1])` with `weight ≈ rotate_back(q · scale)`.
    Source: comfy-kitchen `backends/eager/quantization.py::quantize_int8_convrot_weight` / `quantize_int8_rowwise`.
    """
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of the convrot group size {group_size}")
    h = hadamard(group_size)
    rotated = (weight.float().reshape(out_f, in_f // group_size, group_size) @ h.T).reshape(out_f, in_f)
    scale = (rotated.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
    q = (rotated / scale).round().clamp(-128, 127).to(torch.int8)
    return q, scale.float()


def _json_tensor(obj: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)


def write_tiny_gemma4(path: Path, seed: int = 0, *, int8_convrot: bool = False, num_layers: int = TINY_LAYERS,
                      convrot_group: int = TINY_CONVROT_GROUP) -> Path:
    """Write a tiny Gemma 4 text encoder with the bundled LTX-2.5 text projection; returns `path`.

    Args:
        path: destination `.safetensors` (parent folders are created), e.g.
            `text_encoders/gemma4-12b-with-proj-ltx-2.5-tiny-bf16.safetensors`.
        seed: weight seed (the tokenizer does not depend on it).
        int8_convrot: store the decoder layers' Linear weights in ComfyUI's int8-convrot layout (module docstring).
        num_layers: 48 (ComfyUI recognises the file only with 48); fewer for faster unit tests (multiple of 6).
        convrot_group: the ConvRot group size written into `comfy_quant` (power of 4 dividing 32 and 128).
    Raises: ValueError for a layer count that is not a positive multiple of 6.
    """
    if num_layers <= 0 or num_layers % FULL_ATTENTION_EVERY:
        raise ValueError(f"num_layers must be a positive multiple of {FULL_ATTENTION_EVERY} (the last layer of "
                         f"Gemma 4 is a full-attention layer), got {num_layers}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd: dict[str, torch.Tensor] = {}
    for key, w in tiny_gemma4_weights(seed, num_layers).items():
        if int8_convrot and key.startswith("model.layers.") and key.endswith("_proj.weight"):
            layer = key[: -len(".weight")]
            q, scale = quantize_int8_convrot(w, convrot_group)
            sd[key] = q
            sd[layer + ".weight_scale"] = scale
            sd[layer + ".comfy_quant"] = _json_tensor({"format": "int8_tensorwise", "convrot": True,
                                                       "convrot_groupsize": convrot_group})
        else:
            sd[key] = w.to(torch.bfloat16)
    sd["tokenizer_json"] = torch.frombuffer(bytearray(tiny_gemma4_tokenizer_json()), dtype=torch.uint8).clone()
    for k, v in sd.items():
        if v.is_floating_point():
            assert torch.isfinite(v.float()).all(), k
    save_file(sd, str(path), metadata={"format": "pt"})
    return path


#: What ComfyUI's `Gemma4_12B_Config` needs changed to build this tiny model (its dataclass fields; head_dim 256,
#: global_head_dim 512, one global key/value head and the 5:1 sliding pattern are the 12B's and stay)
TINY_COMFY_CONFIG = {"hidden_size": TINY_HIDDEN, "intermediate_size": TINY_INTERMEDIATE,
                     "num_attention_heads": TINY_HEADS, "num_key_value_heads": TINY_KV_HEADS}


def tiny_comfy_config() -> dict:
    """`TINY_COMFY_CONFIG` plus the tiny tokenizer's vocabulary size."""
    return dict(TINY_COMFY_CONFIG, vocab_size=tiny_gemma4_vocab_size())
