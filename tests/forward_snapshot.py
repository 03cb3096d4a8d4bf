"""Transformer-forward outputs of the engine through entry points every version keeps, for the one-forward check
(issue 25): the stage snapshot of `stage_snapshot.py` (CLI `generate`, node "sample" jobs: one process, sequence
parallel, guidance passes, tiled) plus
- the native MODEL's forward (`native.NativeEngine.forward`) on every ComfyUI golden request of
  `tests/golden/ltx23_forward_golden.safetensors` (tiny LTX-2.3): one process, sequence parallel on 2 ranks, the
  batch rows over 2 ranks;
- the node "sample" job with semantics "comfyui" (SP Sampler: ComfyUI's forward and sampler): one process and
  sequence parallel on 2 ranks;
- one reference denoiser forward of the tiny LTX-2.5 transformer (its keyframe marker): one process, sequence
  parallel on 2 ranks (padded), two tiles.

    python tests/forward_snapshot.py OUT.pt [--tiny DIR]

Run by `tests/test_one_forward.py` on the tree of `BEFORE` (extracted with `git archive`) and on the current tree;
the test asserts every tensor is bit-identical. Ranks are CPU gloo processes spawned here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for p in (ROOT, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import old_layout  # noqa: E402  (copied beside this file in the old tree too)

old_layout.install(ROOT)

import stage_snapshot  # noqa: E402  (copied beside this file in the old tree too)

torch.set_num_threads(1)
GOLDEN = HERE / "golden" / "ltx23_forward_golden.safetensors"


def _native_requests() -> dict:
    """The golden cases as ForwardRequests (as tests/test_native_forward.py builds them, restated here so this file
    does not depend on a test module that may change)."""
    from safetensors import safe_open

    from mgpu_backend.protocol.native_forward import ForwardOptions, ForwardRequest, GuideAttentionEntry

    with safe_open(str(GOLDEN), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, spec in json.loads(meta["cases"]).items():
        def g(key, name=name):
            return tensors.get(f"{name}.in.{key}")

        entries = tuple(GuideAttentionEntry(e["pre_filter_count"], e["strength"],
                                            g(e["pixel_mask"]) if e["pixel_mask"] else None, tuple(e["latent_shape"]))
                        for e in spec.get("guide_entries", []))
        modality = spec.get("modality", False)
        options = ForwardOptions(stg_self_attn_blocks=tuple(spec.get("stg", ())), a2v_cross_attn=not modality,
                                 v2a_cross_attn=not modality, run_vx=spec.get("run_vx", True),
                                 run_ax=spec.get("run_ax", True))
        out[name] = ForwardRequest(
            video=g("video"), audio=g("audio"), video_timestep=g("video_timestep"), audio_timestep=g("audio_timestep"),
            context=tensors["text.processed"][spec["rows"]], context_keys=(),
            frame_rate=float(meta["fps"]), attention_mask=g("attention_mask"), keyframe_idxs=g("keyframe_idxs"),
            denoise_mask=g("denoise_mask"), guide_attention_entries=entries, ref_audio_tokens=g("ref_audio_tokens"),
            options=options, cond_or_uncond=tuple(spec.get("cond_or_uncond", ())))
    return out


def _native(rank: int, world: int, paths23: dict, guidance_parallel: str) -> dict:
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.stages.native import NativeEngine

    components = load_components(paths23["checkpoint"], dtype=torch.float32)
    plan = None
    if world > 1:
        plan = stage_snapshot.cpu_plan(components.transformer, rank, world, guidance_parallel)
    engine = NativeEngine(components, plan, torch.float32, torch.device("cpu"))
    out = {}
    for name, request in _native_requests().items():
        engine.check(request)
        result = engine.forward(request, request.context.float())
        # a NativeForwardResult since issue 34; the old tree's engine returned (video, audio)
        video, audio = (result.video, result.audio) if hasattr(result, "video") else result
        if rank == 0:
            out[f"native.{name}"] = {"video": video, "audio": audio}
    return out


def _comfy_samples(rank: int, world: int, paths20: dict) -> dict:
    from types import SimpleNamespace

    from mgpu_backend.serving.jobs.stages import run_sample
    from mgpu_backend.models.gemma import load_gemma
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    components = load_components(paths20["checkpoint"], dtype=torch.float32)
    plan = None
    if world > 1:
        plan = stage_snapshot.cpu_plan(components.transformer, rank, world, "off")
    pipe = TwoStagePipeline(components, load_gemma(paths20["gemma"]), plan=plan)
    state = SimpleNamespace(pipeline=pipe, components=components, plan=plan, dtype=torch.float32,
                            device=torch.device("cpu"))
    out = {}
    payloads = stage_snapshot._payloads()  # noqa: SLF001
    for name in ("sample_sp", "sample_euler"):
        payload = dict(payloads[name], semantics="comfyui")
        result = run_sample(state, stage_snapshot._as_request(payload), stage_snapshot._ctx(rank, world))  # noqa
        if rank == 0:
            out[f"comfy.{name}"] = {"video": stage_snapshot._field(result, "video"),
                                    "audio": stage_snapshot._field(result, "audio")}
    return out


def _ltx25(rank: int, world: int) -> dict:
    """One reference denoiser forward of the tiny LTX-2.5 transformer (keyframe marker), 9 video tokens."""
    from mgpu_backend.engine import latents as L
    from mgpu_backend.engine.denoiser import LTX2Denoiser, TextContext
    from mgpu_backend.testing.tiny import build_tiny_modules
    from mgpu_backend.engine.sampling import GuidancePass, ModelInputs

    tr = build_tiny_modules("2.5", 0)["transformer"].eval()
    f, h, w, a = 3, 1, 3, 5
    g = torch.Generator().manual_seed(5)
    cfg = tr.config
    dv, da = (cfg.num_attention_heads * cfg.attention_head_dim, cfg.audio_num_attention_heads *
              cfg.audio_attention_head_dim)
    ctx = TextContext(torch.randn(1, 6, dv, generator=g), torch.randn(1, 6, da, generator=g),
                      torch.tensor([[0.0, 1, 1, 1, 1, 1]]))
    video = torch.randn(1, f * h * w, 128, generator=g)
    audio = torch.randn(1, a, 128, generator=g)
    sigma = torch.tensor([0.6])
    inputs = ModelInputs(video, audio, torch.full((1, f * h * w), 0.6), torch.full((1, a), 0.6), sigma, sigma,
                         GuidancePass("cond"), 0)
    out = {}
    try:  # this tree executes plans (issue 34): the split's plan is applied, the denoiser takes the split
        from mgpu_backend.splits.apply import apply_plan, remove_plan
    except ImportError:  # an older tree: the wrapper installs its own processors
        apply_plan = remove_plan = None

    def run(key, split):
        vc, ac = L.video_coords(tr, 1, f, h, w, 25.0), L.audio_coords(tr, 1, a)
        if apply_plan is None:
            d = LTX2Denoiser(tr, ctx, None, vc, ac, torch.float32, forward=split)
        else:
            if split is not None:
                apply_plan(tr, split.plan, getattr(split, "exchange", None))
            d = LTX2Denoiser(tr, ctx, None, vc, ac, torch.float32, split=split)
        v, au = d(inputs)
        if split is not None and remove_plan is not None:
            remove_plan(tr)
        if rank == 0:
            out[key] = {"video": v, "audio": au}

    if world == 1:
        from mgpu_backend.splits.tiling import DimensionTilingConfig, TileCountConfig

        tiling = TileCountConfig(frames=DimensionTilingConfig(2, 1))
        run("ltx25.one", None)
        if apply_plan is None:
            from mgpu_backend.splits.tiled import TiledTransformer

            run("ltx25.tiled", TiledTransformer(tr, (f, h, w), tiling))
        else:
            from mgpu_backend.splits.tiled import TiledSplit

            run("ltx25.tiled", TiledSplit(tr, (f, h, w), tiling))
    else:
        import torch.distributed as dist

        from mgpu_backend.splits.exchange import Exchange

        exchange = Exchange(dist.group.WORLD, world, rank)
        if apply_plan is None:
            from mgpu_backend.splits.sequence import SequenceParallelTransformer

            run("ltx25.sp", SequenceParallelTransformer(tr, exchange))
        else:
            from mgpu_backend.splits.sequence import UlyssesSplit

            run("ltx25.sp", UlyssesSplit(exchange))
    return out


def _run(rank: int, world: int, paths: dict, mode: str) -> dict:
    out = _native(rank, world, paths["2.3"], mode)
    if mode == "off":
        out.update(_comfy_samples(rank, world, paths["2.0"]))
        out.update(_ltx25(rank, world))
    return out


def _rank_main(rank: int, world: int, rendezvous: str, paths: dict, mode: str, out_dir: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        result = _run(rank, world, paths, mode)
        dist.barrier()  # every rank finished its collectives before any tears the group down (gloo aborts else)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown, as tests/_dist.py does; the result is on disk


def _spawn(world: int, paths: dict, mode: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "rdv"), paths, mode, tmp), nprocs=world)
        return torch.load(os.path.join(tmp, "rank0.pt"))


def snapshot(tiny: Path, stages: bool = True) -> dict:
    from mgpu_backend.testing.tiny import make_tiny

    out = stage_snapshot.snapshot(tiny) if stages else {}  # writes the 2.0 files into `tiny`
    paths = {"2.0": {k: str(v) for k, v in make_tiny(tiny, "2.0", seed=0).items()}}
    (tiny / "ltx-2.3").mkdir(parents=True, exist_ok=True)
    paths["2.3"] = {k: str(v) for k, v in make_tiny(tiny / "ltx-2.3", "2.3", seed=0).items()}
    for key, value in _run(0, 1, paths, "off").items():
        out[f"w1.{key}"] = value
    for mode in ("off", "on"):
        for key, value in _spawn(2, paths, mode).items():
            out[f"w2.{mode}.{key}"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tiny", default=None, help="folder for the tiny models (default: a temporary one)")
    parser.add_argument("--no-stages", action="store_true", help="leave out stage_snapshot's cases (quicker)")
    args = parser.parse_args()
    if args.tiny:
        torch.save(snapshot(Path(args.tiny), not args.no_stages), args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(snapshot(Path(tmp), not args.no_stages), args.out)


if __name__ == "__main__":
    main()
