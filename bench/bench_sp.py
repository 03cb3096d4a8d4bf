"""Transformer forward time at W = 1: ours (eager and compiled) vs plain diffusers vs Lightricks' reference, and the
per-rank compute of a W-way sequence-parallel split simulated on one GPU (issue #9).

19B-shaped random bf16 weights are built directly in GPU memory (the real LTX-2.0 config, `--blocks` of the 48;
times are scaled to 48 blocks, the embeddings and output layers being negligible). On the same shapes, in one run:
- ours: our attention processor and fused norms through `SequenceParallelTransformer` at W = 1 (what a stage runs);
- plain diffusers 0.42.1: `LTX2VideoTransformer3DModel` with its default processor and norms (a fresh module with
  the same weights);
- reference: `ltx_core.model.transformer.LTXModel` (ltx-core 1.0.0, installed for the benchmark only) loaded with
  **the same weights** (our key map back to the original layout), so its output checks ours: relative L2 error of
  ours (eager and compiled) against it, bf16 tolerance 2e-2 (8 mantissa bits; different kernels and fusions);
- ours compiled: `mgpu_backend.engine.compile.compile_blocks` (regional, per block); the first call's time is the compile.
Ratios: `overhead_vs_reference` = ours eager / reference eager (target ≤ 1.03), `compiled_vs_reference` = ours
compiled / reference eager (target ≤ 0.90). The forwards compared are timed in turn (a, b, c, a, b, c, …; the
compiled one with the reference again), so a change in the host's load does not favour one column — at 640×352 the
forward is bound by the host's kernel launches, not the GPU.
Then the simulated split: each "rank" runs projections / feed-forwards on T/W tokens and attention over all T tokens
with H/W heads (the exchanges are local tensor copies of the right shapes), eager — the per-rank compute without
communication; and at W = 2, compiled, once with the exchanges as custom ops inside the block graph and once with a
graph break at every exchange (what a plain `dist.all_to_all_single` call would cost under `torch.compile`).

    python bench/bench_sp.py --blocks 8 [--sizes 640x352,1280x704,1920x1088] [--frames 121] [--world 2,4,8] \
        [--json out.json]
    python bench/bench_sp.py --tiny          # CPU smoke check
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mgpu_backend.engine import latents as L  # noqa: E402
from mgpu_backend.engine import compile as C  # noqa: E402
from mgpu_backend.engine import forward as model_forward  # noqa: E402
from mgpu_backend.models import configs  # noqa: E402
from mgpu_backend.splits.exchange import Exchange  # noqa: E402
from mgpu_backend.splits.sequence import SequenceParallelTransformer  # noqa: E402

LTX2_19B = {  # LTX-2.0 transformer metadata (docs/design/models.md#the-releases; diffusers' converter config)
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


@torch.library.custom_op("ltx2_mgpu_bench::fake_exchange", mutates_args=())
def fake_exchange(x: torch.Tensor) -> torch.Tensor:
    """Stands in for a collective (a copy), opaque to the compiler like the real `ltx2_mgpu::all_to_all`, and like it
    a graph-segment boundary while a CUDA graph is captured (`mgpu_backend.engine.cuda_graphs.collective`)."""
    from mgpu_backend.engine import cuda_graphs

    return cuda_graphs.collective(lambda out, inp: out.copy_(inp), x.contiguous(), torch.empty_like(x))


@fake_exchange.register_fake
def _(x):
    return torch.empty_like(x)


class SimulatedExchange(Exchange):
    """Shapes of a W-way exchange without communication: this rank's data stands in for the others'.
    `graph_break`: break a compiled graph at every exchange (as an untraceable collective call would)."""

    def __init__(self, world_size: int, graph_break: bool = False):
        super().__init__(None, world_size, 0)
        self.graph_break = graph_break

    def _exchange(self, x):
        if self.graph_break:
            torch._dynamo.graph_break()
        return fake_exchange(x)

    def seq_to_heads(self, x):
        b, t, h, d = x.shape
        return self._exchange(x[:, :, : h // self.world_size].repeat(1, self.world_size, 1, 1))

    def heads_to_seq(self, x):
        b, t, h, d = x.shape
        return self._exchange(x[:, : t // self.world_size].repeat(1, 1, self.world_size, 1))

    def all_gather_seq(self, x, dim=1):
        return self._exchange(torch.cat([x] * self.world_size, dim=dim))


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


def build_reference(meta: dict, device, dtype, weights_from=None):
    """ltx-core's `LTXModel` for `meta`; with `weights_from` (our diffusers transformer) it gets those weights
    through our key map back to the original layout (strict), else random ones."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from _ltx_core import import_ltx_core

    from mgpu_backend.models import keymaps

    lc = import_ltx_core()
    with torch.device(device):
        model = lc.LTXModelConfigurator.from_config({"transformer": meta})
    for module in model.modules():  # ltx-core builds some layers (the 2.0 caption projections) on the meta device
        if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False)
    model = model.to(device, dtype)
    with torch.no_grad():
        if weights_from is None:
            for p in model.parameters():
                p.normal_(0, 0.02)
        else:
            model.load_state_dict({keymaps.transformer_to_original(k): v
                                   for k, v in weights_from.state_dict().items()}, strict=True, assign=True)
    return lc, model.eval().requires_grad_(False)


def plain_diffusers(model, meta: dict):
    """A second `LTX2VideoTransformer3DModel` sharing `model`'s parameters, with diffusers' own processor and norms
    (ours swaps both in place)."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        plain = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta))
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    device = next(model.parameters()).device
    for name in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        setattr(plain, name, getattr(model, name))  # the RoPE modules hold computed buffers
    return plain.eval().requires_grad_(False).to(device)


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


def timeit(fn, iters, warmup=2):
    """Median seconds per call of `fn` over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def interleaved(fns: dict, iters: int, warmup: int = 2) -> dict:
    """Median seconds per call of each function, the calls taken in turn (a, b, c, a, b, c, …) so that a change
    in the host's load (small sizes are launch-bound) falls on every column alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_call(fn) -> float:
    """Seconds of one call (the compile, for a compiled module at a new shape)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


PARITY_TOL = 2e-2  # bf16: 8 mantissa bits, other kernels / fusion order (module docstring)


def reference_call(lc, ref, kw):
    vm = lc.Modality(latent=kw["hidden_states"], sigma=kw["sigma"] / 1000, timesteps=kw["timestep"] / 1000,
                     positions=kw["video_coords"], context=kw["encoder_hidden_states"], context_mask=None)
    am = lc.Modality(latent=kw["audio_hidden_states"], sigma=kw["audio_sigma"] / 1000,
                     timesteps=kw["audio_timestep"] / 1000, positions=kw["audio_coords"],
                     context=kw["audio_encoder_hidden_states"], context_mask=None)
    return lambda: ref(vm, am, lc.BatchedPerturbationConfig.empty(1))


def simulated_rank(model, kw, tokens, w, exchange):
    """The forward of one rank of a W-way split (T/W tokens held, `exchange` standing in for the collectives)."""
    sim = SequenceParallelTransformer(model, exchange)
    sim.activate()
    per = tokens // w
    sim_kw = dict(kw, hidden_states=kw["hidden_states"][:, :per], timestep=kw["timestep"][:, :per],
                  video_coords=kw["video_coords"][:, :, :per])
    # the simulated rank already holds its T/W tokens: the engine's one forward on them (model_forward)
    return lambda: model_forward.call_diffusers(model, **sim_kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--sizes", default="640x352,1280x704,1920x1088")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--world", default="2,4,8")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    ap.add_argument("--graph-break-size", default="1280x704",
                    help="size at which W=2 compiled is measured with and without graph breaks ('' = skip)")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check with a tiny config")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = dict(LTX2_19B, num_layers=args.blocks)
    if args.tiny:
        from mgpu_backend.testing.tiny import tiny_transformer_metadata

        meta = tiny_transformer_metadata("2.0")
        args.sizes, args.frames, args.graph_break_size = "128x64", 9, "128x64"
    scale = 48 / meta["num_layers"]
    model = build_transformer(meta, device, dtype)
    plain = plain_diffusers(model, meta)
    ref = None
    if not args.no_reference:
        try:
            lc, ref = build_reference(meta, device, dtype, weights_from=model)
        except Exception as exc:  # reported, not fatal: the other columns still mean something
            print(f"reference unavailable: {type(exc).__name__}: {exc}")
    worlds = [int(w) for w in args.world.split(",") if w]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{time.strftime('%Y-%m-%d')} device {name}, torch {torch.__version__}, {meta['num_layers']} blocks "
          f"measured, times scaled ×{scale:g} to 48 blocks, {dtype}, median of {args.iters}")
    header = (f"{'size':>10} {'tokens':>7} {'ours ms':>8} {'diffusers':>9} {'reference':>9} {'ours/ref':>8} "
              f"{'diff/ref':>8} {'compiled':>8} {'comp/ref':>8} {'compile s':>9} {'err eager':>9} {'err comp':>9}")
    print(header)
    results = {"device": name, "date": time.strftime("%Y-%m-%d"), "blocks": meta["num_layers"], "sizes": {}}
    sims = []
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        kw, tokens = inputs(model, args.frames, height, width, 24.0, device, dtype)
        ours_kw = {k: v for k, v in kw.items() if k != "return_dict"}
        row = {"tokens": tokens}
        with torch.no_grad():
            sp = SequenceParallelTransformer(model, Exchange(None, 1, 0))
            sp.activate()
            out_ours = sp(**ours_kw)
            fns = {"ours": lambda: sp(**ours_kw), "diffusers": lambda: plain(**kw)}
            t_ref, err_eager, err_comp = float("nan"), float("nan"), float("nan")
            if ref is not None:
                fns["ref"] = call_ref = reference_call(lc, ref, kw)
                out_ref = call_ref()
                err_eager = max(rel_l2(out_ours[0], out_ref[0]), rel_l2(out_ours[1], out_ref[1]))
            eager = {k: v * scale for k, v in interleaved(fns, args.iters).items()}
            t_ours, t_diff, t_ref = eager["ours"], eager["diffusers"], eager.get("ref", float("nan"))
            t_comp, t_compile, t_ref_comp = float("nan"), float("nan"), t_ref
            if not args.no_compile:
                C.compile_blocks(model, mode=args.mode)
                t_compile = first_call(lambda: sp(**ours_kw))
                fns = {"compiled": lambda: sp(**ours_kw)}
                if ref is not None:
                    fns["ref"] = call_ref  # timed again, in turn with the compiled forward
                    out_comp = sp(**ours_kw)
                    err_comp = max(rel_l2(out_comp[0], out_ref[0]), rel_l2(out_comp[1], out_ref[1]))
                timed = {k: v * scale for k, v in interleaved(fns, args.iters).items()}
                t_comp, t_ref_comp = timed["compiled"], timed.get("ref", float("nan"))
                C.uncompile_blocks(model)
            for w in worlds:
                t_w = timeit(simulated_rank(model, ours_kw, tokens, w, SimulatedExchange(w)), args.iters) * scale
                sims.append((size, tokens, w, t_w, t_ours))
            if not args.no_compile and size == args.graph_break_size:
                C.compile_blocks(model)
                for gb in (False, True):
                    fn = simulated_rank(model, ours_kw, tokens, 2, SimulatedExchange(2, graph_break=gb))
                    row["compile_w2_graph_break" if gb else "compile_w2_custom_op"] = {
                        "compile_s": first_call(fn), "ms": timeit(fn, args.iters) * scale * 1000}
                row["graph_breaks"] = C.graph_breaks()
                C.uncompile_blocks(model)
        row.update(ours_ms=t_ours * 1000, diffusers_ms=t_diff * 1000, reference_ms=t_ref * 1000,
                   compiled_ms=t_comp * 1000, compile_s=t_compile, overhead_vs_reference=t_ours / t_ref,
                   reference_ms_with_compiled=t_ref_comp * 1000, compiled_vs_reference=t_comp / t_ref_comp,
                   diffusers_vs_reference=t_diff / t_ref,
                   rel_l2_eager_vs_reference=err_eager, rel_l2_compiled_vs_reference=err_comp)
        results["sizes"][size] = row
        print(f"{size:>10} {tokens:7d} {t_ours * 1000:8.1f} {t_diff * 1000:9.1f} {t_ref * 1000:9.1f} "
              f"{t_ours / t_ref:8.3f} {t_diff / t_ref:8.3f} {t_comp * 1000:8.1f} {t_comp / t_ref_comp:8.3f} "
              f"{t_compile:9.1f} {err_eager:9.2e} {err_comp:9.2e}", flush=True)
        del kw, ours_kw
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"parity: relative L2 of ours vs reference (same weights) ≤ {PARITY_TOL}: "
          + ("ok" if all(r["rel_l2_eager_vs_reference"] <= PARITY_TOL and not r["rel_l2_compiled_vs_reference"]
                         > PARITY_TOL for r in results["sizes"].values()) else "FAILED"))
    print("\nsimulated W-way split, per-rank compute without communication (eager):")
    print(f"{'size':>10} {'tokens':>7} {'W':>2} {'rank ms':>8} {'eff':>5}")
    for size, tokens, w, t_w, t_1 in sims:
        print(f"{size:>10} {tokens:7d} {w:2d} {t_w * 1000:8.1f} {t_1 / (w * t_w):5.2f}")
        results["sizes"][size].setdefault("simulated", {})[w] = {"rank_ms": t_w * 1000, "eff": t_1 / (w * t_w)}
    for size, row in results["sizes"].items():
        if "compile_w2_custom_op" in row:
            a, b = row["compile_w2_custom_op"], row["compile_w2_graph_break"]
            print(f"\ncompiled W=2 rank at {size}: exchanges as custom ops {a['ms']:.1f} ms "
                  f"(compile {a['compile_s']:.1f} s), graph break at each exchange {b['ms']:.1f} ms "
                  f"(compile {b['compile_s']:.1f} s); graph breaks recorded: {row['graph_breaks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
