"""`sampling.denoise_loop` over a grid of configurations, through whichever call form the tree under test has: the
keyword form of `main` before issue 25's typed loop inputs (`video_mask=`, `audio_frozen=`, `progress_callback=`, …)
or `ModalityStream` / `LoopHooks`.

    python tests/loop_snapshot.py OUT.pt

Run by `tests/test_loop_contract.py` on the tree of the commit before the typed inputs (extracted with `git
archive`, so the expected tensors come from the old code) and on the current tree; the test asserts the two
snapshots are bit-identical (latents, progress calls, cancel calls, frozen audio returned as the same object). The
grid: video / audio present or absent, batch 1 or 2, denoise masks ([B, T] or [B, T, 1], fractional), clean
latents, full guidance with a skip step, the reference Euler step or Euler ancestral (eta 1 / 0.5), frozen audio,
both mask rules; plus the refusals' types and messages.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import old_layout  # noqa: E402  (copied beside this file in the old tree too)

old_layout.install(ROOT)

torch.set_num_threads(1)

from mgpu_backend.engine import sampling as S

TYPED = hasattr(S, "ModalityStream")
GRID = {"video": [True, False], "audio": [True, False], "vmask": [0, 0.3], "mask3": [False, True],
        "amask": [False, True], "clean": [False, True], "guided": [False, True], "eta": [0, 1.0, 0.5],
        "frozen": [False, True], "rule": ["reference", "comfyui"]}


def _model(seed: int):
    """A velocity model that reads every input it is given (latents, per-token timesteps, per-item sigmas, pass)."""
    g = torch.Generator().manual_seed(seed)
    weights = {k: torch.randn(8, 8, generator=g) * 0.3 for k in S.PASS_KINDS}

    def model(inp):
        w = weights[inp.guidance.kind]
        v = (None if inp.video is None else
             (inp.video @ w) * (1 + inp.video_timesteps[..., None]) + inp.video_sigma[:, None, None])
        a = (None if inp.audio is None else
             (inp.audio @ w.T) * (1 + inp.audio_timesteps[..., None]) - inp.audio_sigma[:, None, None])
        return v, a

    return model


def _inputs(case: dict) -> dict:
    g = torch.Generator().manual_seed(case["seed"])
    b = case["batch"]
    video = torch.randn(b, 6, 8, generator=g) if case["video"] else None
    audio = torch.randn(b, 4, 8, generator=g) if case["audio"] else None
    vmask = amask = None
    if case["vmask"] and video is not None:
        vmask = torch.ones(b, 6)
        vmask[:, :2] = case["vmask"]
        vmask = vmask[..., None] if case["mask3"] else vmask
    if case["amask"] and audio is not None:
        amask = torch.ones(b, 4)
        amask[:, 1] = 0.0
    vclean = torch.randn(b, 6, 8, generator=g) if case["clean"] and video is not None else None
    aclean = torch.randn(b, 4, 8, generator=g) if case["clean"] and audio is not None else None
    vg = ag = S.NO_GUIDANCE
    if case["guided"]:
        vg = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(0,), rescale=0.7, modality_scale=3.0)
        ag = S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(0,), rescale=0.7, modality_scale=3.0,
                              skip_step=case["skip"])
    sampler = None
    if case["eta"]:
        ng = torch.Generator().manual_seed(11)
        sampler = S.AncestralSampler(lambda: (None if video is None else torch.randn(video.shape, generator=ng),
                                              None if audio is None else torch.randn(audio.shape, generator=ng)),
                                     eta=case["eta"])
    return {"video": video, "audio": audio, "vmask": vmask, "amask": amask, "vclean": vclean, "aclean": aclean,
            "vg": vg, "ag": ag, "sampler": sampler}


def _loop(model, sigmas, x: dict, frozen: bool, rule: str, progress, cancel):
    if TYPED:
        video = None if x["video"] is None else S.ModalityStream(x["video"], x["vmask"], x["vclean"], x["vg"])
        audio = (None if x["audio"] is None else
                 S.ModalityStream(x["audio"], x["amask"], x["aclean"], x["ag"], frozen=frozen))
        return S.denoise_loop(model, sigmas, video, audio, sampler=x["sampler"], mask_rule=rule,
                              hooks=S.LoopHooks(progress=progress, cancel=cancel))
    return S.denoise_loop(model, x["video"], x["audio"], sigmas, video_mask=x["vmask"], video_clean=x["vclean"],
                          audio_mask=x["amask"], audio_clean=x["aclean"], audio_frozen=frozen,
                          video_guidance=x["vg"], audio_guidance=x["ag"], sampler=x["sampler"], mask_rule=rule,
                          progress_callback=progress, cancel_check=cancel)


def run(case: dict) -> dict:
    x = _inputs(case)
    progress, cancels = [], []
    out = _loop(_model(case["seed"]), S.ltx2_sigmas(4), x, case["frozen"], case["rule"],
                lambda i, n: progress.append((i, n)), lambda: bool(cancels.append(1)))
    return {"video": out[0], "audio": out[1], "progress": progress, "cancels": len(cancels),
            "audio_is_input": out[1] is x["audio"] and out[1] is not None}


def refusals() -> dict:
    """What each refusal raises (type and message), before any forward."""
    def never(inp):
        raise AssertionError("a refused loop ran a forward")

    x = torch.zeros(1, 3, 8)
    nan = x.clone()
    nan[0, 1, 2] = float("nan")
    cases = {"bad rule": {"rule": "inpaint"}, "comfyui frozen": {"rule": "comfyui", "frozen": True},
             "no modality": {"video": None, "audio": None}, "unpacked": {"video": torch.zeros(1, 3, 8, 1)},
             "batches": {"audio": torch.zeros(2, 3, 8)}, "nan input": {"video": nan},
             "bad mask": {"vmask": torch.ones(1, 4)}}
    out = {}
    for name, over in cases.items():
        inp = {"video": x, "audio": x, "vmask": None, "amask": None, "vclean": None, "aclean": None,
               "vg": S.NO_GUIDANCE, "ag": S.NO_GUIDANCE, "sampler": None}
        inp.update({k: v for k, v in over.items() if k in inp})
        try:
            _loop(never, [0.9, 0.0], inp, over.get("frozen", False), over.get("rule", "reference"), None, None)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 (the snapshot records what was raised)
            out[name] = (type(exc).__name__, str(exc))
    return out


def main(path: str) -> None:
    results = {}
    for n, values in enumerate(itertools.product(*GRID.values())):
        case = dict(zip(GRID, values), seed=n % 7, batch=1 + n % 2, skip=(1 + n % 3) if n % 5 == 0 else 0)
        if (not case["video"] and not case["audio"]) or (case["mask3"] and not case["vmask"]):
            continue
        if case["frozen"] and (case["rule"] == "comfyui" or not case["audio"]):
            continue
        results[repr(sorted(case.items()))] = run(case)
    results["refusals"] = refusals()
    torch.save(results, path)


if __name__ == "__main__":
    main(sys.argv[1])
