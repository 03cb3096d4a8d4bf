"""A few stage outputs of the engine, computed through entry points that every version of the code keeps:
`TwoStagePipeline.generate` (the CLI `generate` recipe, one process and a 2-rank fleet) and the node job
`jobs.stages.run_sample` (one process, 2 ranks sequence parallel, 2 ranks guidance passes, 2 ranks tiled).

    python tests/stage_snapshot.py OUT.pt [--tiny DIR]

Run by `tests/test_stage_contract.py` twice: on the tree of the commit before the stage contract (extracted with
`git archive` into a temporary folder, so the "before" tensors come from the old code, not from the code under test)
and on the current tree; the test asserts the two snapshots are bit-identical. The ranks are CPU gloo processes
spawned here (this file must not depend on test helpers that may change between the versions).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import old_layout  # noqa: E402  (copied beside this file in the old tree too)

old_layout.install(ROOT)

torch.set_num_threads(1)

SIZE = dict(width=128, height=128, frames=9, fps=24.0, steps=3)


def _image(path: Path) -> str:
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(5)
    Image.fromarray(g.integers(0, 255, (128, 128, 3), dtype=np.uint8)).save(path)
    return str(path)


def _requests(paths: dict, image: str) -> dict:
    from mgpu_backend.stages.pipelines import GenerateRequest

    lora = (str(paths["distilled_lora"]), 1.0)
    return {
        "generate_t2v": GenerateRequest(prompt="a fox in the snow", seed=3, distilled_lora=lora, **SIZE),
        "generate_i2v_ancestral": GenerateRequest(prompt="a boat", seed=4, distilled_lora=lora, image=image,
                                                  image_strength=0.7, sampler="euler_ancestral", **SIZE),
    }


def _payloads() -> dict:
    from mgpu_backend.engine.sampling import GuidanceParams

    g = torch.Generator().manual_seed(9)
    f, h, w, t = 2, 3, 3, 8
    video = torch.randn(1, 128, f, h, w, generator=g)
    mask = torch.ones(1, 1, f, 1, 1)
    mask[:, :, 0] = 0.3
    base = {"positive": torch.randn(1, 7, 64, generator=g), "negative": torch.randn(1, 5, 64, generator=g),
            "video": video, "audio": torch.zeros(1, 8, t, 16), "video_mask": mask,
            "noise_video": torch.randn(1, 128, f, h, w, generator=g), "noise_audio": torch.randn(1, 8, t, 16,
                                                                                                   generator=g),
            "sigmas": torch.tensor([1.0, 0.8, 0.5, 0.0]), "fps": 25.0,
            "video_guidance": GuidanceParams(3.0, 1.0, (0,), 0.7, 3.0),
            "audio_guidance": GuidanceParams(7.0, 1.0, (0,), 0.7, 3.0), "stg_blocks": "auto",
            "mode": "sequence_parallel", "sampler": "euler_ancestral", "seed": 11, "loras": [],
            "semantics": "reference"}  # the old code ignores the key (it only had these semantics)
    tiled = dict(base, video=torch.randn(1, 128, f, 4, 4, generator=g), video_mask=None, mode="tiled",
                 noise_video=torch.randn(1, 128, f, 4, 4, generator=g), sigmas=torch.tensor([0.6, 0.3, 0.0]),
                 sampler="euler", video_guidance=GuidanceParams(), audio_guidance=GuidanceParams(), negative=None,
                 tiles=None, tile_overlap=1)
    return {"sample_sp": base, "sample_euler": dict(base, sampler="euler"), "sample_tiled": tiled}


def _as_request(payload: dict):
    """The tree's form of a "sample" payload: a `SampleRequest` where the tree has one, else the dict the
    older jobs read (`semantics` given to the old code too: it only had "reference")."""
    try:
        from mgpu_backend.protocol.stage_requests import SampleRequest
    except ImportError:
        try:  # a tree from before protocol/ was split by concern
            from mgpu_backend.protocol import SampleRequest
        except ImportError:
            return dict(payload)
    return SampleRequest(**payload)


def _field(result, name: str):
    """A job result's field: a typed result (`protocol.job_results`) or the dict an older tree's job returns."""
    return result[name] if isinstance(result, dict) else getattr(result, name)


def _ctx(rank: int, world: int):
    from types import SimpleNamespace

    return SimpleNamespace(rank=rank, world_size=world, progress=lambda *a: None, step_boundary=lambda *a: False,
                           stage="setup")


def cpu_plan(transformer, rank: int, world: int, guidance_parallel: str):
    """`build_plan` on the CPU with every stage at the full degree and this guidance-parallel mode, on this tree's
    signature (a `FleetPolicy` since issue 34; the policy's fields as keywords before)."""
    import inspect

    from mgpu_backend.splits.plan import build_plan

    if "policy" in inspect.signature(build_plan).parameters:
        from mgpu_backend.protocol.fleet_config import FleetPolicy

        return build_plan(transformer, rank, world, torch.device("cpu"),
                          FleetPolicy(min_tokens_per_rank=0, guidance_parallel=guidance_parallel))
    return build_plan(transformer, rank, world, torch.device("cpu"), guidance_parallel=guidance_parallel)


def _run(rank: int, world: int, paths: dict, image: str, guidance_parallel: str) -> dict:
    """Everything on this rank (world 1: one process, no plan)."""
    from types import SimpleNamespace

    from mgpu_backend.serving.jobs.stages import run_sample
    from mgpu_backend.models.gemma import load_gemma
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    try:
        from mgpu_backend.models.loader import ComponentFiles
    except ImportError:  # a tree before issue 34 (the befdd65 snapshot): the component files as keywords
        components = load_components(paths["checkpoint"], upsampler=paths["upsampler"], dtype=torch.float32)
    else:
        components = load_components(paths["checkpoint"], ComponentFiles(upsampler=paths["upsampler"]),
                                     dtype=torch.float32)
    plan = None
    if world > 1:
        plan = cpu_plan(components.transformer, rank, world, guidance_parallel)
    pipe = TwoStagePipeline(components, load_gemma(paths["gemma"]), plan=plan)
    out = {}
    if guidance_parallel != "on":  # the recipe's stage 1 is guided: "on" gives it to the passes split
        for name, request in _requests(paths, image).items():
            result = pipe.generate(request)
            if rank == 0:
                out[name] = {"video": result.video_latent, "audio": result.audio_latent}
    state = SimpleNamespace(pipeline=pipe, components=components, plan=plan, dtype=torch.float32,
                            device=torch.device("cpu"))
    for name, payload in _payloads().items():
        if world == 1 and name == "sample_tiled":
            continue
        result = run_sample(state, _as_request(payload), _ctx(rank, world))
        if rank == 0:
            out[name] = {"video": _field(result, "video"), "audio": _field(result, "audio")}
    return out


def _rank_main(rank: int, world: int, rendezvous: str, paths: dict, image: str, mode: str, out_dir: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        result = _run(rank, world, paths, image, mode)
        dist.barrier()  # every rank finished its collectives before any tears the group down (gloo aborts else)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown, as tests/_dist.py does; the result is on disk


def _spawn(world: int, paths: dict, image: str, mode: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "rdv"), paths, image, mode, tmp), nprocs=world)
        return torch.load(os.path.join(tmp, "rank0.pt"))


def snapshot(tiny: Path) -> dict:
    from mgpu_backend.testing.tiny import make_tiny

    tiny.mkdir(parents=True, exist_ok=True)
    paths = {k: str(v) for k, v in make_tiny(tiny, "2.0", seed=0).items()}
    image = _image(tiny / "first.png")
    out = {}
    for key, value in _run(0, 1, paths, image, "off").items():
        out[f"w1.{key}"] = value
    for mode in ("off", "on"):
        for key, value in _spawn(2, paths, image, mode).items():
            out[f"w2.{mode}.{key}"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tiny", default=None, help="folder for the tiny models (default: a temporary one)")
    args = parser.parse_args()
    if args.tiny:
        torch.save(snapshot(Path(args.tiny)), args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(snapshot(Path(tmp)), args.out)


if __name__ == "__main__":
    main()
