"""Gemma 3 / Gemma 4 text encoder on one GPU vs sharded over {GPU, CPU} or {GPU, GPU} (stages/text_encoder.py, issues 6, 18).

A 12B-shaped Gemma 3 (hidden 3840, 48 layers, 16 heads / 8 KV heads of 256, MLP 15360, vocab 262208) with random
bf16 weights is written once as a ComfyUI single file (`--file`, ~23.4 GB; reused when it exists), with the test
tokenizer embedded. Then, through the real code path (`load_gemma`, `TextEncoderService`, a random LTX-2.0-shaped
text projection 188160 -> 3840):
1. one device: load on `--device`, encode a ~`--tokens`-token prompt: forward time (median of `--repeats`), the
   time of the whole encode (tokenize + forward + 49 hidden states to the CPU + projection), peak GPU memory;
2. sharded: `mode="sharded"` with `max_memory = {device: --gpu-cap GiB, "cpu": ...}` — the planner puts what fits the
   cap on the GPU and the rest in CPU memory (Accelerate offload: streamed to the GPU and run there); the same
   timings and peak memory;
3. equality: all 49 hidden states and the CONDITIONING embeddings of (2) vs (1), `torch.equal` and max |diff|.

    python bench/bench_gemma.py --file /tmp/gemma12b.safetensors --out bench/results/gemma_h200.json
    python bench/bench_gemma.py --small --device cpu            # CPU smoke check (offload to "disk")

`--arch gemma4`: a Gemma 4 12B-shaped model instead (LTX-2.5's text encoder: 48 layers, sliding 16 heads / 8 KV
heads of 256, full-attention layers every 6th with one KV head of 512 and no v_proj, MLP 15360, vocab 262144, ~23.8 GB
bf16), written in ComfyUI's layout with the tiny tokenizer.json and a random LTX-2.5 projection (188160 -> 4096 + 2048)
bundled, which the service loads from the file. `--shard-over cuda:1` shards over two GPUs instead of GPU + CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend.models.gemma import read_gemma_header  # noqa: E402
from mgpu_backend.models.text_projection import TextProjection  # noqa: E402
from mgpu_backend.stages import text_encoder as G  # noqa: E402

GEMMA3_12B = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=256, vocab_size=262208)
GEMMA4_12B = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
                  attention_k_eq_v=True, vocab_size=262144)
GEMMA4_SMALL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
                    attention_k_eq_v=True, vocab_size=4096)
SMALL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=4096)
SENTENCE = ("A cinematic shot of a red car driving along a coastal road at sunset while waves crash against the "
            "rocks and seagulls fly overhead in the evening wind. ")


def write_random_gemma(path: Path, shape: dict, device: str, seed: int = 0) -> None:
    """Random bf16 weights in ComfyUI's single-file layout (`model.` prefix + `spiece_model`)."""
    from safetensors.torch import save_file
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from mgpu_backend.testing.tiny_gemma import tiny_spiece_model

    with torch.device("meta"):
        meta = Gemma3TextModel(Gemma3TextConfig(**shape))
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for name, t in meta.state_dict().items():
        if name == "embed_tokens.weight":
            std = 0.05
        elif t.ndim == 1:
            std = 0.1
        else:
            std = 0.5 / t.shape[1] ** 0.5
        sd["model." + name] = (torch.randn(t.shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()
    sd["spiece_model"] = torch.frombuffer(bytearray(tiny_spiece_model()), dtype=torch.uint8).clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": "pt"})


def write_random_gemma4(path: Path, shape: dict, device: str, seed: int = 0) -> None:
    """Random bf16 Gemma 4 weights in ComfyUI's LTX-2.5 single-file layout (`model.` + the bundled
    `text_embedding_projection.{video,audio}_aggregate_embed` + `tokenizer_json`), scaled as
    `models.tiny_gemma4.tiny_gemma4_weights` (norms ~1, q/k norms d^-1/4, layer scalars in [0.5, 1])."""
    from safetensors.torch import save_file
    from transformers import Gemma4UnifiedTextConfig, Gemma4UnifiedTextModel

    from mgpu_backend.testing.tiny_gemma4 import tiny_gemma4_tokenizer_json

    with torch.device("meta"):
        meta = Gemma4UnifiedTextModel(Gemma4UnifiedTextConfig(**shape))
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for name, t in meta.state_dict().items():
        r = torch.randn(t.shape, generator=gen, device=device)
        if name == "embed_tokens.weight":
            w = r * 0.05
        elif name.endswith("layer_scalar"):
            w = 0.5 + 0.5 * torch.rand(t.shape, generator=gen, device=device)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            w = t.shape[0] ** -0.25 * (1 + 0.1 * r)
        elif t.ndim == 1:
            w = 1 + 0.1 * r
        else:
            w = r * (0.5 / t.shape[1] ** 0.5)
        sd["model." + name] = w.to(torch.bfloat16).cpu()
    in_features = shape["hidden_size"] * (shape["num_hidden_layers"] + 1)
    for part, width in (("video_aggregate_embed", 4096), ("audio_aggregate_embed", 2048)):
        w = torch.randn(width, in_features, generator=gen, device=device) * in_features ** -0.5
        sd[f"text_embedding_projection.{part}.weight"] = w.to(torch.bfloat16).cpu()
        sd[f"text_embedding_projection.{part}.bias"] = torch.zeros(width, dtype=torch.bfloat16)
    sd["tokenizer_json"] = torch.frombuffer(bytearray(tiny_gemma4_tokenizer_json()), dtype=torch.uint8).clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": "pt"})


def prompt_of(tokens: int, tokenizer) -> str:
    """A prompt of about `tokens` Gemma ids (BOS included) from repeated sentences, cut at a word boundary."""
    words = (SENTENCE * (tokens // 8 + 8)).split()
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.prompt_ids(" ".join(words[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(svc: G.TextEncoderService, prompt: str, repeats: int, device: torch.device) -> dict:
    enc = svc.encoder
    ids, mask = enc.tokenize([prompt])
    with torch.inference_mode():
        enc.model(input_ids=ids.to(enc.device), attention_mask=mask.to(enc.device), output_hidden_states=True,
                  use_cache=False)  # warm-up
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    weights_resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    forward = []
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.inference_mode():
            enc.model(input_ids=ids.to(enc.device), attention_mask=mask.to(enc.device), output_hidden_states=True,
                      use_cache=False)
        sync(device)
        forward.append(time.perf_counter() - t)
    hidden, _ = enc.encode([prompt])
    whole = []
    for _ in range(repeats):
        svc.clear_cache()
        t = time.perf_counter()
        embeds = svc.encode([prompt])[0]
        sync(device)
        whole.append(time.perf_counter() - t)
    out = {"tokens": int(mask.sum()), "forward_s": statistics.median(forward), "encode_s": statistics.median(whole),
           "gpu_resident_gib": weights_resident / 2**30}
    if device.type == "cuda":
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out, hidden, embeds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default="/tmp/gemma3-12b-random.safetensors")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpu-cap", type=float, default=None,
                    help="GiB of the device for the sharded run (default: about half the weights)")
    ap.add_argument("--small", action="store_true", help="a small model of the architecture (smoke check)")
    ap.add_argument("--arch", choices=("gemma3", "gemma4"), default="gemma3")
    ap.add_argument("--shard-over", default=None,
                    help="second device of the sharded run (default: cpu offload; e.g. cuda:1 for two GPUs)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    gemma4 = args.arch == "gemma4"
    shape = (GEMMA4_SMALL if gemma4 else SMALL) if args.small else (GEMMA4_12B if gemma4 else GEMMA3_12B)
    path = Path(args.file if args.file != ap.get_default("file") else
                f"/tmp/{args.arch}-{'small' if args.small else '12b'}-random.safetensors")
    result: dict = {"arch": args.arch, "shape": shape, "device": str(device), "dtype": "bfloat16"}
    t = time.perf_counter()
    if not path.exists():
        (write_random_gemma4 if gemma4 else write_random_gemma)(path, shape,
                                                               args.device if device.type == "cuda" else "cpu")
        result["write_s"] = time.perf_counter() - t
    header = read_gemma_header(path)
    layers, fixed = header.module_bytes(torch.bfloat16)
    weights = sum(layers) + sum(fixed.values())
    result["weights_gib"] = weights / 2**30
    in_features = header.hidden_size * header.num_hidden_states
    if gemma4:
        projection = None  # the service loads the one bundled in the file
    else:
        projection = TextProjection("single_linear", in_features, header.hidden_size, dtype=torch.bfloat16,
                                    device=device)
        torch.nn.init.normal_(projection.aggregate_embed.weight, std=in_features ** -0.5)

    # 1. one device
    t = time.perf_counter()
    placement = G.EncoderPlacement(device=device, dtype=torch.bfloat16)
    one = G.TextEncoderService(path, projection, projection_source="random", placement=placement)
    one.ensure_loaded("replicated")
    result["one_device_load_s"] = time.perf_counter() - t
    prompt = prompt_of(args.tokens, one.encoder.tokenizer)
    result["one_device"], hidden1, embeds1 = measure(one, prompt, args.repeats, device)
    one.unload()
    del one

    # 2. sharded over {device, cpu} (a CPU run offloads to "disk" instead)
    offload = args.shard_over or ("cpu" if device.type == "cuda" else "disk")
    cap = args.gpu_cap * 2**30 if args.gpu_cap else weights / 2 + G.activation_bytes(
        header.text_config, G.PLAN_TOKENS, torch.bfloat16) + max(layers)
    # a second accelerator gets the same cap (an even two-GPU split); cpu / disk take the rest (offload)
    max_memory = {G.device_key(device): int(cap),
                  offload: int(cap) if offload.startswith("cuda") else "1TiB"}
    t = time.perf_counter()
    sharded = G.TextEncoderService(path, projection, projection_source="random", placement=placement,
                                   settings=G.EncoderSettings(mode="sharded", max_memory=max_memory))
    sharded.ensure_loaded("sharded")
    result["sharded_load_s"] = time.perf_counter() - t
    result["sharded_map"] = G._summarize_map(sharded.device_map)
    result["sharded_max_memory"] = {k: (v if isinstance(v, str) else f"{v / 2**30:.2f} GiB")
                                    for k, v in max_memory.items()}
    result["sharded"], hidden2, embeds2 = measure(sharded, prompt, args.repeats, device)
    sharded.unload()

    # 3. equality
    result["hidden_states_equal"] = bool(torch.equal(hidden1, hidden2))
    result["hidden_states_max_abs_diff"] = float((hidden1 - hidden2).abs().max())
    result["embeds_equal"] = bool(torch.equal(embeds1, embeds2))
    result["embeds_max_abs_diff"] = float((embeds1 - embeds2).abs().max())
    print(json.dumps(result, indent=2))
    o, s = result["one_device"], result["sharded"]
    label = f"{'small' if args.small else '12B-shaped'} {'Gemma 4' if gemma4 else 'Gemma 3'}"
    print(f"\n| {label}, bf16, {o['tokens']} tokens | forward | encode (+{header.num_hidden_states} states to CPU, projection) "
          f"| GPU resident | GPU peak |\n|---|---|---|---|---|")
    for name, r in ((f"one device ({device})", o), (f"sharded {{{device}, {offload}}}", s)):
        print(f"| {name} | {r['forward_s'] * 1e3:.1f} ms | {r['encode_s'] * 1e3:.1f} ms | "
              f"{r['gpu_resident_gib']:.2f} GiB | {r.get('gpu_peak_gib', float('nan')):.2f} GiB |")
    print(f"sharded == one device: hidden states {result['hidden_states_equal']} "
          f"(max |diff| {result['hidden_states_max_abs_diff']:.3g}), embeddings {result['embeds_equal']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
