"""Gemma 4 (LTX-2.5's text encoder): the tiny file's layout, loading (bf16 and int8-convrot), the tokenizer, the
bundled projection, and ComfyUI 0.33's own encode.

References that are not our code:
* ComfyUI 0.33 golden tensors (`tests/golden/gemma4_golden.safetensors`, made by `tests/golden/make_gemma4_golden.py`
  with ComfyUI's `CLIPLoader(type="ltxv")` + `CLIPTextEncode` on the same tiny files): token ids, the stacked
  hidden states of one prompt and the CONDITIONING tensor of five prompts for the bf16 and the int8-convrot file.
* transformers' own `Gemma4UnifiedTextModel.from_pretrained` on a Hugging Face folder with the same weights.

Tolerances (float32 on the CPU). This tiny random 48-layer Gemma amplifies float32 rounding ~10⁴-fold (the error
grows layer by layer to ~1e-3 on values of O(4)), so two float32 runs of the same encode differ by the sum of their
own errors. Measured against a float64 run of our encode (the exact result, to ~1e-12 on any CPU): the golden
(ComfyUI's float32 on the CPU that made it) is 9.9e-4 (hidden states) / 3.2e-4 (CONDITIONING) from it; our float32
encode 1.7e-3 / 5.7e-4 at most on an AVX-512 EPYC under ATEN_CPU_CAPABILITY=avx512 / avx2 / default and
MKL_CBWR=COMPATIBLE (another GEMM reduction order), while a float32 encode on the golden's CPU matched the golden to
1.5e-5. Hence, on any x86-64 CPU:
* ids: equal. Hidden states / CONDITIONING vs ComfyUI at the RoPE positions of ComfyUI's left padding to 1024 tokens:
  HIDDEN_ATOL = 4e-3 / COND_ATOL = 1.5e-3 (2 × the largest float32 error, rounded up; measured on the EPYC: 7.6e-4 /
  2.6e-4); our default encode (no padding, positions from 0) adds RoPE angles of positions near 1000 in float32
  (<= 1.2e-4 measured): 5e-3 / 2e-3. A ±0.1 % change of one weight matrix fails them by far
  (`test_tolerances_catch_a_perturbed_weight`).
* int8-convrot vs ComfyUI's int8 encode: same bounds (both dequantize the same int8 values); vs the bf16 file:
  relative L2 error <= 5% (int8 per-row quantization after the Hadamard rotation).
* vs transformers `from_pretrained`: equal (`torch.equal`): same classes, same weights.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import require_golden_weights

from mgpu_backend.testing import tiny_gemma4 as T
from mgpu_backend.models.gemma import (BOS_ID, GEMMA4, dequantize_int8, infer_gemma4_text_config, load_gemma,
                                       read_gemma_header)
from mgpu_backend.models.text_projection import load_bundled_projection, make_conditioning, split_video_audio

torch.set_num_threads(1)

GOLDEN = Path(__file__).resolve().parent / "golden" / "gemma4_golden.safetensors"
HIDDEN_ATOL, COND_ATOL = 4e-3, 1.5e-3  # at ComfyUI's positions; 2 x the float32 error (module docstring)
HIDDEN_ATOL_POS0, COND_ATOL_POS0 = 5e-3, 2e-3  # positions from 0: + float32 RoPE angles near 1000


@pytest.fixture(scope="module")
def files(tmp_path_factory, golden) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gemma4") / "text_encoders"
    paths = {"bf16": T.write_tiny_gemma4(d / "gemma4-12b-with-proj-ltx-2.5-tiny-bf16.safetensors", seed=0),
            "int8": T.write_tiny_gemma4(d / "gemma4-12b-with-proj-ltx-2.5-tiny-comfy-int8-convrot.safetensors",
                                        seed=0, int8_convrot=True)}
    recorded = json.loads(golden[1]["files"])  # the golden was made from exactly these bytes
    require_golden_weights(all(hashlib.sha256(p.read_bytes()).hexdigest() == recorded[k]["sha256"]
                               for k, p in paths.items()),
                           "the tiny Gemma 4 writer changed: regenerate with tests/golden/make_gemma4_golden.py")
    return paths


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict]:
    with safe_open(str(GOLDEN), framework="pt") as f:
        meta = f.metadata()
    return load_file(str(GOLDEN)), meta


@pytest.fixture(scope="module")
def enc(files):
    return load_gemma(files["bf16"])


def _encode(enc, projection, prompt):
    hidden, mask = enc.encode([prompt])
    return hidden, projection(hidden, mask)


@torch.inference_mode()
def _encode_at_comfy_positions(enc, projection, prompt):
    """As ComfyUI runs it: the prompt left-padded to 1024 tokens, i.e. its tokens at RoPE positions 1024-n..1023
    (the masked padding itself changes nothing else), without computing the 1024-token forward."""
    ids, mask = enc.tokenize([prompt])
    n = ids.shape[1]
    out = enc.model(input_ids=ids, position_ids=torch.arange(1024 - n, 1024)[None], output_hidden_states=True)
    hidden = torch.stack([h.float() for h in out.hidden_states], dim=-1)
    return hidden, projection(hidden, mask)


# ------------------------------------------------------------------------------------------------ the tiny file

def test_tiny_file_is_comfy_layout_deterministic_and_the_golden_s(files, golden, tmp_path):
    _, meta = golden
    recorded = json.loads(meta["files"])
    for kind, path in files.items():  # the golden was made from exactly these bytes
        assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded[kind]["sha256"], kind
    again = T.write_tiny_gemma4(tmp_path / "again.safetensors", seed=0)
    assert again.read_bytes() == files["bf16"].read_bytes()
    sd = load_file(str(files["bf16"]))
    # ComfyUI's detect_te_model -> GEMMA_4_12B, and lt.sd_detect -> dual_linear
    assert "model.layers.0.post_feedforward_layernorm.weight" in sd and "model.layers.47.self_attn.q_norm.weight" in sd
    assert "model.layers.5.self_attn.v_proj.weight" not in sd
    assert {"text_embedding_projection.video_aggregate_embed.weight",
            "text_embedding_projection.audio_aggregate_embed.weight"} <= set(sd)
    for i in range(48):
        full = i % 6 == 5
        assert (f"model.layers.{i}.self_attn.v_proj.weight" in sd) != full
        assert sd[f"model.layers.{i}.self_attn.q_norm.weight"].shape == ((512,) if full else (256,))
        assert sd[f"model.layers.{i}.self_attn.k_proj.weight"].shape[0] == (512 if full else 2 * 256)
        assert sd[f"model.layers.{i}.layer_scalar"].shape == (1,)
    assert sd["tokenizer_json"].dtype == torch.uint8
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all() for k, v in sd.items()
               if k != "tokenizer_json")
    q = load_file(str(files["int8"]))
    conf = json.loads(bytes(q["model.layers.5.self_attn.k_proj.comfy_quant"].tolist()))
    assert conf == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}
    assert q["model.layers.5.self_attn.k_proj.weight"].dtype == torch.int8
    assert q["model.layers.5.self_attn.k_proj.weight_scale"].shape == (512, 1)
    assert q["model.embed_tokens.weight"].dtype == torch.bfloat16  # the embedding and the projection stay bf16
    assert q["text_embedding_projection.video_aggregate_embed.weight"].dtype == torch.bfloat16


def test_tokenizer_json_encodes_like_the_sentencepiece_model_it_came_from():
    import io

    import sentencepiece as spm
    from tokenizers import Tokenizer

    from mgpu_backend.testing.tiny_gemma import _CORPUS

    tok = Tokenizer.from_str(T.tiny_gemma4_tokenizer_json().decode())
    buf = io.BytesIO()  # the same training run as the tiny (deterministic): its SentencePiece model
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 8), model_writer=buf, vocab_size=512, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=T.SPECIAL_SYMBOLS, add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, normalization_rule_name="identity", minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    for text in lines + ["ünïcode 日本 \t tab  two spaces<|turn>user\nhi<turn|>", "", " lead"]:
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), text
    assert tok.encode("A cat", add_special_tokens=True).ids[0] == BOS_ID  # as Gemma's tokenizer.json


# ------------------------------------------------------------------------------------------------ config and header

def test_config_and_header(files, enc):
    h = read_gemma_header(files["int8"])
    assert h.architecture is GEMMA4 and enc.architecture is GEMMA4
    c = h.text_config
    assert (c["hidden_size"], c["num_hidden_layers"], c["head_dim"], c["global_head_dim"]) == (32, 48, 256, 512)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["num_global_key_value_heads"]) == (4, 2, 1)
    assert c["attention_k_eq_v"] and c["layer_types"][5] == "full_attention"
    assert c["layer_types"][4] == "sliding_attention"
    assert h.stored_dtypes["layers.0.mlp.up_proj.weight"] == "I8" and enc.num_hidden_states == 49
    assert h.projection_shapes["video_aggregate_embed.weight"] == (64, 32 * 49)
    layers, fixed = h.module_bytes(torch.float32)
    assert len(layers) == 48 and layers[5] > layers[4] and set(fixed) == {"embed_tokens", "norm"}
    assert sum(layers) + sum(fixed.values()) == 4 * sum(p.numel() for p in enc.model.parameters()) + 4 * 48


def test_config_inference_on_12b_shapes():
    shapes = {"embed_tokens.weight": (262144, 3840), "norm.weight": (3840,)}
    for i in range(48):
        full = i % 6 == 5
        hd, kv = (512, 1) if full else (256, 8)
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (16 * hd, 3840), p + "self_attn.k_proj.weight": (kv * hd, 3840),
                   p + "self_attn.q_norm.weight": (hd,), p + "mlp.gate_proj.weight": (15360, 3840)}
        if not full:
            shapes[p + "self_attn.v_proj.weight"] = (kv * hd, 3840)
    c = infer_gemma4_text_config(shapes, "12b")
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["num_global_key_value_heads"]) == (16, 8, 1)
    assert (c["head_dim"], c["global_head_dim"], c["intermediate_size"], c["vocab_size"]) == (256, 512, 15360, 262144)
    assert c["layer_types"].count("full_attention") == 8 and c["attention_k_eq_v"]
    from transformers import Gemma4UnifiedTextConfig

    config = Gemma4UnifiedTextConfig(**{k: v for k, v in c.items() if k != "model_type"})
    assert config.per_layer_config[5].head_dim == 512 and config.per_layer_config[5].num_key_value_heads == 1
    assert config.per_layer_config[0].head_dim == 256 and config.per_layer_config[0].num_key_value_heads == 8
    del shapes["layers.3.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"sliding layers \[3\] have no self_attn.v_proj"):
        infer_gemma4_text_config(shapes, "12b")


# ------------------------------------------------------------------------------------------------ vs references

def test_tokens_equal_comfyui(enc, golden):
    g, meta = golden
    for i, prompt in enumerate(json.loads(meta["prompts"])):
        assert enc.tokenizer.prompt_ids(prompt) == g[f"p{i}.ids"].tolist(), prompt


def test_hidden_states_equal_transformers_from_pretrained(files, enc, tmp_path):
    from transformers import Gemma4UnifiedTextConfig, Gemma4UnifiedTextModel

    cfg = {k: v for k, v in read_gemma_header(files["bf16"]).text_config.items() if k != "model_type"}
    Gemma4UnifiedTextConfig(**cfg).save_pretrained(tmp_path)
    sd = {k[len("model."):]: v.float() for k, v in load_file(str(files["bf16"])).items() if k.startswith("model.")}
    save_file(sd, str(tmp_path / "model.safetensors"))
    ref = Gemma4UnifiedTextModel.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids, _ = enc.tokenize(["A cinematic shot of a red car driving along a coastal road at sunset."])
    with torch.inference_mode():
        want = torch.stack(ref(input_ids=ids, output_hidden_states=True).hidden_states, dim=-1)
    got, _ = enc.encode(["A cinematic shot of a red car driving along a coastal road at sunset."])
    assert got.shape == want.shape == (1, ids.shape[1], 32, 49) and torch.equal(got, want)


def test_hidden_states_and_conditioning_equal_comfyui(files, enc, golden):
    g, meta = golden
    projection = load_bundled_projection(files["bf16"], dtype=torch.float32)
    assert projection.kind == "dual_linear" and (projection.in_features, projection.out_features) == (32 * 49, 96)
    for i, prompt in enumerate(json.loads(meta["prompts"])):
        hidden_p, cond_p = _encode_at_comfy_positions(enc, projection, prompt)
        hidden, cond = _encode(enc, projection, prompt)
        if f"p{i}.hidden" in g:
            assert (hidden_p - g[f"p{i}.hidden"]).abs().max() <= HIDDEN_ATOL
            assert (hidden - g[f"p{i}.hidden"]).abs().max() <= HIDDEN_ATOL_POS0
        assert cond.shape == g[f"p{i}.cond_bf16"].shape
        assert (cond_p - g[f"p{i}.cond_bf16"]).abs().max() <= COND_ATOL, i
        assert (cond - g[f"p{i}.cond_bf16"]).abs().max() <= COND_ATOL_POS0, i
        (tensor, extra), = make_conditioning(cond, torch.ones(cond.shape[:2], dtype=torch.long))
        assert sorted(extra) == json.loads(meta["extra_keys"])[f"p{i}.bf16"] + [] and torch.equal(tensor, cond)
    video, audio = split_video_audio(cond, projection.kind, projection.video_dim)
    assert video.shape[-1] == 64 and audio.shape[-1] == 32


def test_tolerances_catch_a_perturbed_weight(files, golden):
    """The bounds above hold any CPU's float32 and still see a bug: one layer's MLP down projection with each entry
    moved by ±0.1 % moves the CONDITIONING by 9.9e-3 (6 × COND_ATOL) and the hidden states by 3.3e-2. (Scaling a
    whole matrix is no test: the post-norms undo it.)"""
    g, meta = golden
    enc = load_gemma(files["bf16"])  # its own copy: the module's `enc` stays clean
    projection = load_bundled_projection(files["bf16"], dtype=torch.float32)
    weight = enc.model.layers[24].mlp.down_proj.weight
    signs = torch.randint(0, 2, weight.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        weight.mul_(1 + 1e-3 * signs)
    hidden_p, cond_p = _encode_at_comfy_positions(enc, projection, json.loads(meta["prompts"])[1])
    assert (cond_p - g["p1.cond_bf16"]).abs().max() > 3 * COND_ATOL
    assert (hidden_p - g["p1.hidden"]).abs().max() > 3 * HIDDEN_ATOL


def test_int8_convrot_loads_dequantized_and_equals_comfyui(files, enc, golden):
    g, meta = golden
    q = load_gemma(files["int8"])
    projection = load_bundled_projection(files["int8"], dtype=torch.float32)
    # resident dequantized weights: close to the bf16 file's
    w = q.model.layers[5].self_attn.k_proj.weight
    w_bf16 = enc.model.layers[5].self_attn.k_proj.weight
    assert w.dtype == torch.float32 and (w - w_bf16).norm() / w_bf16.norm() <= 0.05
    for i, prompt in enumerate(json.loads(meta["prompts"])):
        _, cond_p = _encode_at_comfy_positions(q, projection, prompt)
        _, cond = _encode(q, projection, prompt)
        assert (cond_p - g[f"p{i}.cond_int8"]).abs().max() <= COND_ATOL, i
        assert (cond - g[f"p{i}.cond_int8"]).abs().max() <= COND_ATOL_POS0, i


def test_dequantize_int8_inverts_the_convrot_quantizer():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    qw, scale = T.quantize_int8_convrot(w, 16)
    back = dequantize_int8(qw, scale, {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16})
    assert (back - w).abs().max() <= scale.max() * 4  # half a step per rotated entry, summed over a group of 16
    plain = dequantize_int8(qw, scale, {"format": "int8_tensorwise"})
    assert not torch.allclose(plain, w, atol=0.1)  # without the rotation it is another matrix
    with pytest.raises(ValueError, match="must be a power of 4"):
        dequantize_int8(qw, scale, {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 8})


# ------------------------------------------------------------------------------------------------ strictness

def test_refusals_name_the_file_and_the_rule(files, tmp_path):
    sd = load_file(str(files["bf16"]))
    no_tok = {k: v for k, v in sd.items() if k != "tokenizer_json"}
    save_file(no_tok, str(tmp_path / "no_tok.safetensors"))
    with pytest.raises(ValueError, match="no_tok.safetensors: Gemma 4 file without a tokenizer"):
        load_gemma(tmp_path / "no_tok.safetensors")
    extra = dict(sd, **{"text_embedding_projection.video_aggregate_embed.scale": torch.ones(1)})
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"extra.safetensors: .*unexpected keys \['text_embedding_projection.video"):
        load_bundled_projection(tmp_path / "extra.safetensors")
    lm_only = {k: v for k, v in sd.items() if not k.startswith("text_embedding_projection.")}
    save_file(lm_only, str(tmp_path / "lm_only.safetensors"))
    with pytest.raises(ValueError, match="no text projection bundled"):
        load_bundled_projection(tmp_path / "lm_only.safetensors")
    missing = {k: v for k, v in sd.items() if k != "model.layers.7.mlp.up_proj.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)missing.safetensors: weights do not match the gemma4 config.*"
                                         r"layers.7.mlp"):
        load_gemma(tmp_path / "missing.safetensors")


def test_multimodal_embedders_are_ignored(files, enc, tmp_path):
    sd = load_file(str(files["bf16"]))
    sd |= {"vision_model.patch_dense.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
           "vision_model.pos_embedding": torch.zeros(4, 2, 8, dtype=torch.bfloat16),
           "multi_modal_projector.embedding_projection.weight": torch.zeros(32, 8, dtype=torch.bfloat16),
           "audio_projector.embedding_projection.weight": torch.zeros(32, 8, dtype=torch.bfloat16)}
    save_file(sd, str(tmp_path / "with_mm.safetensors"))
    other = load_gemma(tmp_path / "with_mm.safetensors")
    assert torch.equal(other.encode(["Rain."])[0], enc.encode(["Rain."])[0])


def test_the_family_table_names_the_classes_gemma_py_runs():
    from mgpu_backend.models.families import get_family
    from mgpu_backend.models.gemma import ARCHITECTURES
    from mgpu_backend.stages.text_encoder import NO_SPLIT

    for name in ("2.0", "2.3", "2.5"):
        spec = get_family(name).text_encoder
        arch = ARCHITECTURES[spec.architecture]
        assert (spec.model_class, spec.config_class, spec.decoder_layer_class) == (
            arch.model_class, arch.config_class, arch.no_split_module)
        assert spec.decoder_layer_class in NO_SPLIT
        assert (spec.projection_location == "text_encoder") == (arch.projection_prefix is not None)
