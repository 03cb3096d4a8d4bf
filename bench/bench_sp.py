"""Transformer forward time at W = 1: ours vs plain diffusers vs Lightricks' reference, and the per-rank compute of a
W-way sequence-parallel split simulated on one GPU.

19B-shaped random bf16 weights are built directly in GPU memory (the real LTX-2.0 config, `--blocks` of the 48;
times are scaled to 48 blocks, the embeddings and output layers being negligible). Three forwards on the same
shapes, in one run:
- ours: `LTX2Denoiser` with our attention processor through `SequenceParallelTransformer` at W = 1;
- plain diffusers 0.42.1: `LTX2VideoTransformer3DModel` with its default processor (same module, same weights);
- reference: `ltx_core.model.transformer.LTXModel` (ltx-core 1.0.0, installed for the benchmark only), own weights.
Then the simulated split: each "rank" runs projections / feed-forwards on T/W tokens and attention over all T tokens
with H/W heads (the exchanges are replaced by local tensor copies of the right shapes), so the number is the per-rank
compute without communication.

    python bench/bench_sp.py --blocks 8 [--sizes 640x352,1280x704,1920x1088] [--frames 121] [--world 2,4,8]
    python bench/bench_sp.py --tiny          # CPU smoke check
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend import latents as L  # noqa: E402
from mgpu_backend.attention import LTX2AttnProcessor, use_processor  # noqa: E402
from mgpu_backend.models import configs  # noqa: E402
from mgpu_backend.parallel.exchange import Exchange  # noqa: E402
from mgpu_backend.parallel.sequence import SequenceParallelTransformer  # noqa: E402

LTX2_19B = {  # LTX-2.0 transformer metadata (DESIGN.md §2; diffusers' converter config)
    "num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
    "caption_channels": 3840, "num_layers": 48, "rope_type": "split", "frequencies_precision": "float64",
    "av_ca_timestep_scale_multiplier": 1000, "use_middle_indices_grid": True,
    # fields ltx-core's configurator checks (the released files carry them)
    "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None, "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000, "use_linear_projection": False, "only_cross_attention": False,
    "cross_attention_norm": True, "double_self_attention": False, "upcast_attention": False,
    "standardization_norm": "rms_norm", "norm_elementwise_affine": False, "qk_norm": "rms_norm",
    "positional_embedding_type": "rope", "use_audio_video_cross_attention": True, "share_ff": False,
    "av_cross_ada_norm": True,
}


class SimulatedExchange(Exchange):
    """Shapes of a W-way exchange without communication: this rank's data stands in for the others'."""

    def __init__(self, world_size: int):
        super().__init__(None, world_size, 0)

    def seq_to_heads(self, x):
        b, t, h, d = x.shape
        return x[:, :, : h // self.world_size].repeat(1, self.world_size, 1, 1)

    def heads_to_seq(self, x):
        b, t, h, d = x.shape
        return x[:, : t // self.world_size].repeat(1, 1, self.world_size, 1)

    def all_gather_seq(self, x, dim=1):
        return torch.cat([x] * self.world_size, dim=dim)


def build_transformer(meta: dict, device, dtype):
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta))
    model = model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    # the RoPE modules hold computed buffers: rebuild them on the device
    for name in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        getattr(model, name).to(device)
    return model.to(dtype).eval().requires_grad_(False)


def build_reference(meta: dict, device, dtype):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from _ltx_core import import_ltx_core

    lc = import_ltx_core()
    with torch.device(device):
        model = lc.LTXModelConfigurator.from_config({"transformer": meta})
    for module in model.modules():  # ltx-core builds some layers (the 2.0 caption projections) on the meta device
        if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return lc, model.to(device, dtype).eval().requires_grad_(False)


def inputs(model, frames, height, width, fps, device, dtype, audio_tokens=126):
    f, h, w = L.latent_frames(frames), height // 32, width // 32
    t = f * h * w
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, t, 128, generator=g).to(device, dtype)
    a = torch.randn(1, audio_tokens, 128, generator=g).to(device, dtype)
    ctx_v = torch.randn(1, 1024, model.config.caption_channels, generator=g).to(device, dtype)
    return dict(hidden_states=x, audio_hidden_states=a, encoder_hidden_states=ctx_v, audio_encoder_hidden_states=ctx_v,
                timestep=torch.full((1, t), 700.0, device=device), audio_timestep=torch.full((1, audio_tokens), 700.0,
                                                                                               device=device),
                sigma=torch.tensor([700.0], device=device), audio_sigma=torch.tensor([700.0], device=device),
                encoder_attention_mask=torch.ones(1, 1024, device=device),
                audio_encoder_attention_mask=torch.ones(1, 1024, device=device),
                video_coords=L.video_coords(model, 1, f, h, w, fps, device=device),
                audio_coords=L.audio_coords(model, 1, audio_tokens, device=device),
                use_cross_timestep=True, return_dict=False), t


def timeit(fn, iters, warmup=1):
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--sizes", default="640x352,1280x704,1920x1088")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--world", default="2,4,8")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check with a tiny config")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = dict(LTX2_19B, num_layers=args.blocks)
    if args.tiny:
        from mgpu_backend.models.tiny import tiny_transformer_metadata

        meta = tiny_transformer_metadata("2.0")
        args.sizes, args.frames = "128x64", 9
    scale = 48 / meta["num_layers"]
    model = build_transformer(meta, device, dtype)
    ref = None
    if not args.no_reference:
        try:
            lc, ref = build_reference(meta, device, dtype)
        except Exception as exc:  # reported, not fatal: the other columns still mean something
            print(f"reference unavailable: {type(exc).__name__}: {exc}")
    worlds = [int(w) for w in args.world.split(",") if w]
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {meta['num_layers']} blocks "
          f"measured, times scaled ×{scale:g} to 48 blocks, {dtype}")
    header = f"{'size':>10} {'tokens':>7} {'ours ms':>9} {'diffusers':>10} {'reference':>10} {'ours/ref':>9} " \
             f"{'diff/ref':>9} " + " ".join(f"{'W=' + str(w) + ' ms':>9} {'eff':>5}" for w in worlds)
    print(header)
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        kw, tokens = inputs(model, args.frames, height, width, 24.0, device, dtype)
        with torch.no_grad():
            use_processor(model, LTX2AttnProcessor())
            sp = SequenceParallelTransformer(model, Exchange(None, 1, 0))
            sp.activate()
            ours_kw = {k: v for k, v in kw.items() if k != "return_dict"}
            t_ours = timeit(lambda: sp(**ours_kw), args.iters) * scale
            from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

            use_processor(model, LTX2AudioVideoAttnProcessor())
            t_diff = timeit(lambda: model(**kw), args.iters) * scale
            t_ref = float("nan")
            if ref is not None:
                vm = lc.Modality(latent=kw["hidden_states"], sigma=kw["sigma"] / 1000,
                                 timesteps=kw["timestep"] / 1000, positions=kw["video_coords"],
                                 context=kw["encoder_hidden_states"], context_mask=None)
                am = lc.Modality(latent=kw["audio_hidden_states"], sigma=kw["audio_sigma"] / 1000,
                                 timesteps=kw["audio_timestep"] / 1000, positions=kw["audio_coords"],
                                 context=kw["audio_encoder_hidden_states"], context_mask=None)
                t_ref = timeit(lambda: ref(vm, am, lc.BatchedPerturbationConfig.empty(1)), args.iters) * scale
            cols = []
            for w in worlds:
                sim = SequenceParallelTransformer(model, SimulatedExchange(w))
                sim.activate()
                per = tokens // w
                sim_kw = dict(ours_kw, hidden_states=kw["hidden_states"][:, :per], timestep=kw["timestep"][:, :per],
                              video_coords=kw["video_coords"][:, :, :per])
                # the simulated rank already holds its T/W tokens: run the wrapped transformer on them directly
                t_w = timeit(lambda: model(return_dict=False, **sim_kw), args.iters) * scale
                cols.append(f"{t_w * 1000:9.1f} {t_ours / (w * t_w):5.2f}")
        print(f"{size:>10} {tokens:7d} {t_ours * 1000:9.1f} {t_diff * 1000:10.1f} {t_ref * 1000:10.1f} "
              f"{t_ours / t_ref:9.3f} {t_diff / t_ref:9.3f} " + " ".join(cols))
        del kw
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
