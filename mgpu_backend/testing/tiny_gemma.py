"""Tiny random-weight Gemma 3 text encoders for tests, in ComfyUI's single-file layout and as a Hugging Face folder.

`write_tiny_gemma` writes the same key names and dtypes as ComfyUI's `models/text_encoders/gemma_3_12B_it*.safetensors`
(see `mgpu_backend.models.gemma` for the layout): `model.embed_tokens.weight`, `model.layers.{i}.…`,
`model.norm.weight` in bfloat16, plus the SentencePiece model embedded as the 1-D uint8 tensor `spiece_model`.
The fp8 variant stores every Linear weight of the language model as float8_e4m3fn with a 0-d float32
`<layer>.weight_scale` and a `<layer>.comfy_quant` uint8 JSON tensor (`{"format": "float8_e4m3fn"}`), the layout
ComfyUI's `comfy/utils.py::convert_old_quants` / `comfy/ops.py::mixed_precision_ops` read; `fp8_format="scaled_fp8"`
writes the older `scaled_fp8` marker + `<layer>.scale_weight` layout instead. `fp4_mixed=True` writes a file
shaped like an nvfp4-mixed checkpoint (packed uint8 weights, float8 block scales `weight_scale`, float32
`weight_scale_2`) that exists only to exercise the loader's refusal.

`write_tiny_gemma_hf_folder` writes the SAME weights (bf16) as a Hugging Face folder in the layout of
`google/gemma-3-12b-it` (Gemma3ForConditionalGeneration: `config.json` with `model_type: "gemma3"` and a
`text_config`, weights under `language_model.model.`), with `tokenizer.model`, `tokenizer_config.json` and
`special_tokens_map.json`.

Tokenizer: a SentencePiece BPE model (byte fallback, no dummy prefix, like Gemma's) trained on the fly on a small
built-in English corpus; ids `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3 as in Gemma; user-defined symbols
`<start_of_turn>` and `<end_of_turn>`. Training is single-threaded and deterministic (identical bytes on every
call; checked by tests) and is cached per process.

Model shape for `hidden_size=H`: head_dim = H // 2, 2 query heads, 1 key/value head, intermediate 4·H (the 12B
ratio 15360/3840), Gemma-3-12B RoPE/sliding-window constants (see `gemma.GEMMA3_12B_CONSTANTS`).
"""
from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_VOCAB_TARGET = 512
SPECIAL_SYMBOLS = ["<start_of_turn>", "<end_of_turn>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog.
A cinematic shot of a red car driving along a coastal road at sunset.
Waves crash against the rocks while seagulls fly overhead in the evening wind.
A woman in a blue dress walks slowly through a field of tall golden grass.
The camera pans across a busy city street filled with people and yellow taxis.
Rain falls on the window of a small cafe as an old man reads a newspaper.
A cat sleeps on a warm windowsill in the soft afternoon light.
Two children laugh and run along the beach, chasing a green kite.
A close-up of a chef slicing fresh vegetables on a wooden cutting board.
Snow covers the quiet mountain village while smoke rises from the chimneys.
An astronaut floats inside the space station, looking back at the blue planet.
The orchestra begins to play as the lights dim in the grand concert hall.
A drone flies over a dense green forest and a winding silver river.
She opens the ancient book and dust swirls in the beam of the flashlight.
A dog jumps into the lake to fetch a stick, splashing water everywhere.
The market is crowded with vendors selling fruit, spices and bright fabrics.
Thunder rolls across the dark sky and lightning strikes a distant hill.
A young musician plays the guitar on a street corner at night.
The train moves through the countryside, passing farms and small towns.
Candles flicker on the table during a quiet dinner for two.
A hummingbird hovers near a bright red flower in the garden.
Steam rises from a cup of coffee on a rainy morning.
The hero turns around, smiles, and says: "We did it!"
Numbers like 12, 345 and 2026 appear on the screen, then fade away.
"""


@functools.lru_cache(maxsize=4)
def tiny_spiece_model(vocab_size: int = TINY_VOCAB_TARGET, symbols: tuple[str, ...] = tuple(SPECIAL_SYMBOLS)) -> bytes:
    """Serialized SentencePiece model proto trained on the built-in corpus (deterministic, cached); `symbols`: the
    user-defined special tokens (Gemma 3's chat markers by default; the tiny Gemma 4 passes its own).

    Returns: the model proto bytes (what ComfyUI stores as the uint8 tensor `spiece_model`).
    """
    import sentencepiece as spm

    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 8), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, num_threads=1,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=list(symbols), add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, normalization_rule_name="identity", minloglevel=2)
    return buf.getvalue()


def _tiny_shapes(hidden_size: int, num_layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Language-model parameter shapes, keyed without prefix (Hugging Face `Gemma3TextModel` names)."""
    if hidden_size % 2:
        raise ValueError(f"hidden_size must be even, got {hidden_size}")
    head_dim = hidden_size // 2
    n_heads, n_kv = 2, 1
    inter = 4 * hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden_size)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (n_heads * head_dim, hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (n_kv * head_dim, hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (n_kv * head_dim, hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (hidden_size, n_heads * head_dim)
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (hidden_size, inter)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            shapes[p + n + ".weight"] = (hidden_size,)
    shapes["norm.weight"] = (hidden_size,)
    return shapes


def tiny_gemma_weights(seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Float32 language-model weights (Hugging Face `Gemma3TextModel` key names), every one filled explicitly.

    Embeddings ~ N(0, 0.05²) (times sqrt(H) at run time), Linear weights ~ N(0, (1/sqrt(fan_in))²)·0.5,
    norm weights ~ N(0, 0.1²) (Gemma norms multiply by 1 + weight). Raises AssertionError if any value is not finite.
    """
    vocab = _vocab_size()
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in _tiny_shapes(hidden_size, num_layers, vocab).items():
        if name == "embed_tokens.weight":
            std = 0.05
        elif len(shape) == 1:
            std = 0.1
        else:
            std = 0.5 / shape[1] ** 0.5
        out[name] = torch.randn(shape, generator=g, dtype=torch.float32) * std
        assert torch.isfinite(out[name]).all(), name
    return out


def _vocab_size() -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=tiny_spiece_model()).get_piece_size()


def _is_linear(name: str) -> bool:
    return name.endswith("_proj.weight")


def write_tiny_gemma(path: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, fp8: bool = False, *,
                     fp8_format: str = "comfy_quant", fp4_mixed: bool = False) -> Path:
    """Write a tiny Gemma 3 text encoder in ComfyUI's single-file layout; returns `path`.

    Args:
        path: destination `.safetensors` file (parent folders are created).
        seed: weight seed (the tokenizer does not depend on it).
        hidden_size, num_layers: model size (see module docstring for the derived shapes).
        fp8: store the Linear weights as scaled float8_e4m3fn (bf16 otherwise).
        fp8_format: "comfy_quant" (per-layer `comfy_quant` JSON + `weight_scale`) or "scaled_fp8" (legacy marker
            `scaled_fp8` + `scale_weight`).
        fp4_mixed: write an nvfp4-mixed lookalike (every MLP Linear as nvfp4) that loaders must refuse.
    Raises: ValueError for an unknown fp8_format.
    """
    if fp8_format not in ("comfy_quant", "scaled_fp8"):
        raise ValueError(f"fp8_format must be 'comfy_quant' or 'scaled_fp8', got {fp8_format!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = tiny_gemma_weights(seed, hidden_size, num_layers)
    sd: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        key = "model." + name
        layer = key[: -len(".weight")]
        if fp4_mixed and _is_linear(name) and ".mlp." in name:
            out_f, in_f = w.shape
            sd[key] = torch.zeros(out_f, in_f // 2, dtype=torch.uint8)
            sd[layer + ".weight_scale"] = torch.ones(out_f, max(in_f // 16, 1)).to(torch.float8_e4m3fn)
            sd[layer + ".weight_scale_2"] = torch.ones((), dtype=torch.float32)
            sd[layer + ".comfy_quant"] = _json_tensor({"format": "nvfp4"})
        elif fp8 and _is_linear(name):
            fp8_max = torch.finfo(torch.float8_e4m3fn).max
            scale = (w.abs().max() / fp8_max).reshape(()).float()
            sd[key] = (w / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            if fp8_format == "comfy_quant":
                sd[layer + ".weight_scale"] = scale
                sd[layer + ".comfy_quant"] = _json_tensor({"format": "float8_e4m3fn"})
            else:
                sd[layer + ".scale_weight"] = scale
        else:
            sd[key] = w.to(torch.bfloat16)
    if fp8 and fp8_format == "scaled_fp8":
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    sd["spiece_model"] = torch.frombuffer(bytearray(tiny_spiece_model()), dtype=torch.uint8).clone()
    for k, v in sd.items():
        if v.is_floating_point():
            assert torch.isfinite(v.float()).all(), k
    save_file(sd, str(path), metadata={"format": "pt"})
    return path


def _json_tensor(obj: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)


def tiny_text_config(hidden_size: int = 64, num_layers: int = 2) -> dict:
    """The `text_config` dict (google/gemma-3-12b-it style fields) matching `write_tiny_gemma`'s shapes."""
    from ..models.gemma import GEMMA3_12B_CONSTANTS

    c = GEMMA3_12B_CONSTANTS
    return {
        "model_type": "gemma3_text", "hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": hidden_size // 2, "query_pre_attn_scalar": hidden_size // 2, "vocab_size": _vocab_size(),
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta_global"],
        "rope_local_base_freq": c["rope_theta_local"],
        "rope_scaling": {"rope_type": "linear", "factor": c["rope_linear_factor_global"]},
        "sliding_window": c["sliding_window"], "sliding_window_pattern": c["sliding_window_pattern"],
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    }


def write_tiny_gemma_hf_folder(dir: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, *,
                               key_style: str = "language_model.model.") -> Path:
    """Write the same weights as `write_tiny_gemma(seed, hidden_size, num_layers)` as a Hugging Face folder.

    Args:
        dir: destination folder (created).
        key_style: weight-key prefix: "language_model.model." (google/gemma-3-12b-it as published),
            "model.language_model." (Gemma3ForConditionalGeneration saved by transformers >= 4.52) or "model."
            (Gemma3ForCausalLM text-only, `model_type: "gemma3_text"` config).
    Returns: the folder path.
    """
    if key_style not in ("language_model.model.", "model.language_model.", "model."):
        raise ValueError(f"unknown key_style {key_style!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    weights = tiny_gemma_weights(seed, hidden_size, num_layers)
    sd = {key_style + k: v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(sd, str(dir / "model.safetensors"), metadata={"format": "pt"})
    text_config = tiny_text_config(hidden_size, num_layers)
    if key_style == "model.":
        config = dict(text_config, architectures=["Gemma3ForCausalLM"], torch_dtype="bfloat16")
    else:
        config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                  "text_config": text_config, "torch_dtype": "bfloat16", "image_token_index": 262144,
                  "boi_token_index": 255999, "eoi_token_index": 256000, "mm_tokens_per_image": 256}
    (dir / "config.json").write_text(json.dumps(config, indent=2))
    (dir / "tokenizer.model").write_bytes(tiny_spiece_model())
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    (dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (dir / "tokenizer_config.json").write_text(json.dumps(
        dict(special, tokenizer_class="GemmaTokenizer", add_bos_token=True, add_eos_token=False,
             padding_side="left"), indent=2))
    return dir
