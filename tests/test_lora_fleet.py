"""LoRAs on the fleet (issue 8): per-stage LoRA sets fused into every rank's working weights, restored exactly between
stages and jobs from clean weights sharded over the ranks, without reading the checkpoint again.

The fleet runs on W = 1, 2 gloo ranks (`_dist.run_ranks`, CPU, one thread per rank) with the tiny LTX-2.0 checkpoint
in bf16 and its fp8 twin (bf16 compute), the tiny distilled LoRA and a "user" LoRA written here in the real key
layout (`diffusion_model.<module>.lora_A/lora_B.weight` + `.alpha`; a subset of the layers, rank 2). Each rank runs
the stage-level `sample` job (`serving/jobs/stages.py`) with a job sequence that switches LoRA sets: stage 1 (sequence
parallel) without LoRA, stage 2 (tiled) with the distilled LoRA, stage 1 again, stage 1 with the user LoRA, stage 2
with user + distilled, and LoRAs that do not fit the model.

What is asserted (exact = bit for bit, `torch.equal` on the bytes):
- the fused weights on every rank equal the weights one process fuses with `LoRAFuser` (exact), for bf16 layers
  and for fp8 layers (their re-quantized fp8 bytes and scales: `models/requantize.py`);
- every job's output on the fleet equals the output of the same fleet when each rank fuses the whole set itself the
  one-process way (exact); at W = 1 it equals the one-process job (exact); at W = 2 the sequence-parallel stage
  differs from one process by its reduction order only (bounded, far below the LoRA's effect);
- stage 1 after a stage-2 LoRA equals stage 1 with no LoRA (exact), and after all jobs every weight equals the
  loaded one (exact);
- clean bytes held per rank (bf16, or fp8 with their scales), W = 2: each rank keeps 1/2 ± 5 % of the touched
  layers' bytes, together exactly once; no full-precision copy anywhere; each LoRA pair is read by one rank only;
- the checkpoint is never opened again after loading: `loader.OPEN_COUNT` is unchanged and a spy on
  `safetensors.safe_open` (the loader's, the LoRA reader's and the module's) sees only the LoRA files;
- coverage reports (matched / total, the missing layers), and the mismatch errors (a LoRA of another width, one
  that matches nothing) raised on every rank before any weight is touched, after which the same fleet goes on.
The controller tests repeat the switch and the errors on a real W = 2 worker fleet (the error keeps the fleet, the
workers' OPEN_COUNT stays put) and run the two-stage `generate` job with a user LoRA on both stages.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from _dist import run_ranks
from _procs import process_alive as _alive
from mgpu_backend.engine import sampling as S
from mgpu_backend.weights.lora import LoRAError, LoRAFuser, LoRAReport, assign_owners, read_lora, read_loras
from mgpu_backend.models import loader
from mgpu_backend.models.fp8 import FP8Linear
from mgpu_backend.testing.tiny import write_tiny_lora
from mgpu_backend.protocol.stage_requests import SampleRequest

torch.set_num_threads(1)

VARIANT = "2.0"
SP_VIDEO = (1, 128, 2, 2, 3)  # stage-1-like latent: 12 video tokens
TILED_VIDEO = (1, 128, 2, 4, 4)  # stage-2-like latent: 2 tiles by default
AUDIO = (1, 8, 5, 16)
USER_STRENGTH = 0.8
# W = 2 sequence parallel vs one process, bf16 compute: the reduction order moves outputs by a few bf16 ulps
SP_BOUND = 0.1
USER_LAYERS = ("attn1.", "ff.")  # the user LoRA: video self-attention and video feed-forward only


# ---- files ---------------------------------------------------------------------------------------------------------

def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny 2.0 files plus LoRAs written here in the real key layout: `user` (a subset of the layers, rank 2,
    other values), `wide` (one layer made for a wider model), `foreign` (no layer of this model), `deeper` (the
    user LoRA plus one layer of a block this model does not have)."""
    base = tiny_dir[VARIANT]
    out = tmp_path_factory.mktemp("lora_fleet")
    full = _tensors(write_tiny_lora(out / "full.safetensors", VARIANT, seed=7, rank=2, scale=0.08))
    user = {k: v for k, v in full.items() if any(f".{layer}" in k for layer in USER_LAYERS)}
    save_file(user, str(out / "user-style.safetensors"))
    wide = dict(user)
    wide["diffusion_model.transformer_blocks.1.attn1.to_k.lora_A.weight"] = torch.zeros(2, 96, dtype=torch.bfloat16)
    wide["diffusion_model.transformer_blocks.1.attn1.to_k.lora_B.weight"] = torch.zeros(96, 2, dtype=torch.bfloat16)
    save_file(wide, str(out / "wide.safetensors"))
    save_file({"diffusion_model.input_blocks.1.1.proj_in.lora_A.weight": torch.zeros(4, 64),
               "diffusion_model.input_blocks.1.1.proj_in.lora_B.weight": torch.zeros(64, 4)},
              str(out / "foreign.safetensors"))
    deeper = dict(user)
    deeper["diffusion_model.transformer_blocks.7.attn1.to_q.lora_A.weight"] = torch.zeros(2, 64)
    deeper["diffusion_model.transformer_blocks.7.attn1.to_q.lora_B.weight"] = torch.zeros(64, 2)
    save_file(deeper, str(out / "deeper.safetensors"))
    return {"checkpoint": str(base["checkpoint"]), "checkpoint_fp8": str(base["checkpoint_fp8"]),
            "gemma": str(base["gemma"]), "upscaler": str(base["upsampler"]), "distilled": str(base["distilled_lora"]),
            "user": str(out / "user-style.safetensors"), "wide": str(out / "wide.safetensors"),
            "foreign": str(out / "foreign.safetensors"), "deeper": str(out / "deeper.safetensors"),
            "dir": str(out)}


# ---- the job sequence (the same on every rank and in one process) --------------------------------------------------

def _payload(mode: str, loras, seed: int = 11) -> SampleRequest:
    g = torch.Generator().manual_seed(seed)
    video_shape = SP_VIDEO if mode == "sequence_parallel" else TILED_VIDEO
    video = torch.randn(video_shape, generator=g)
    audio = torch.randn(AUDIO, generator=g)
    payload = {"positive": torch.randn(1, 7, 64, generator=g), "negative": None, "video": video, "audio": audio,
               "noise_video": torch.randn(video_shape, generator=g), "noise_audio": torch.randn(AUDIO, generator=g),
               "fps": 24.0, "mode": mode, "loras": list(loras)}
    if mode == "tiled":
        payload.update(sigmas=torch.tensor([0.6, 0.3, 0.0]), audio_frozen=True)
    else:
        payload.update(sigmas=torch.tensor([1.0, 0.7, 0.4, 0.0]))
    return SampleRequest(**payload)


def _jobs(f: dict) -> list[tuple[str, str, list]]:
    d, u = (f["distilled"], 1.0), (f["user"], USER_STRENGTH)
    sp, tiled = "sequence_parallel", "tiled"
    return [("stage1", sp, []), ("stage2 none", tiled, []), ("stage2", tiled, [d]), ("stage1 after stage2", sp, []),
            ("stage1 user", sp, [u]), ("stage2 user+distilled", tiled, [u, d]),
            ("stage2 user+distilled again", tiled, [u, d]), ("stage1 after user", sp, []),
            ("wide", sp, [(f["wide"], 1.0)]), ("foreign", sp, [u, (f["foreign"], 1.0)]),
            ("stage1 after errors", sp, []), ("stage1 deeper", sp, [(f["deeper"], USER_STRENGTH)])]


class _Ctx:
    def __init__(self, rank: int):
        self.rank, self.progress, self.step_boundary = rank, None, None


def _run_jobs(pipe, rank: int, f: dict) -> dict:
    from mgpu_backend.serving.jobs import stages

    out = {}
    for name, mode, loras in _jobs(f):
        try:
            result = stages.run_sample(type("State", (), {"pipeline": pipe})(), _payload(mode, loras), _Ctx(rank))
            out[name] = {"video": getattr(result, "video", None), "audio": getattr(result, "audio", None),
                         "lora_reports": None if result is None else list(result.lora_reports),
                         "fuse": pipe.lora.fuse_stats,
                         "active_after": pipe.lora.active}
        except LoRAError as exc:
            out[name] = {"error": str(exc), "active_after": pipe.lora.active}
    return out


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fused_weights(model, fuser: LoRAFuser) -> dict[str, torch.Tensor]:
    """The working weight of every fused layer, and the scale of an fp8 layer (`<name>.weight_scale`)."""
    out = {}
    for name, m in model.named_modules():
        if name in set(fuser.fused_names):
            out[name] = m.weight.detach().clone()
            if isinstance(m, FP8Linear):
                out[name + ".weight_scale"] = m.weight_scale.detach().clone()
    return out


def _touched_bytes(model, names) -> int:
    """Stored bytes of the touched layers: weight, and scale for an fp8 layer."""
    return sum(t.numel() * t.element_size() for n, m in model.named_modules() if n in set(names)
               for t in (m.weight, getattr(m, "weight_scale", None)) if t is not None)


class _ReadSpy:
    """Records the path of every `safetensors.safe_open` (the module's, the loader's and the LoRA reader's)."""

    def __init__(self):
        import safetensors

        import mgpu_backend.weights.lora as lora_module

        self.paths: list[str] = []
        original = safetensors.safe_open

        def spy(path, *args, **kwargs):
            self.paths.append(os.path.realpath(str(path)))
            return original(path, *args, **kwargs)

        for module in (safetensors, loader, lora_module):
            module.safe_open = spy


# ---- rank function ---------------------------------------------------------------------------------------------------

def _fleet_rank(rank: int, world: int, f: dict, weights: str) -> dict:
    from mgpu_backend.splits.plan import build_plan
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    spy = _ReadSpy()
    components = loader.load_components(f[weights], dtype=torch.bfloat16)
    opens_after_load, reads_at_load = loader.OPEN_COUNT, list(spy.paths)
    spy.paths.clear()
    model = components.transformer
    loaded = _state(model)
    plan = build_plan(model, rank, world, torch.device("cpu"))
    pipe = TwoStagePipeline(components, None, dtype=torch.bfloat16, plan=plan)
    assert pipe.lora.world_size == world and pipe.lora.rank == rank

    # the fused weights of a two-LoRA set, and what each rank keeps while it is fused
    both = read_loras([(f["user"], USER_STRENGTH), (f["distilled"], 1.0)])
    reports = pipe.lora.apply(both, "stage 2")
    fused = _fused_weights(model, pipe.lora)
    held = {"clean_bytes": pipe.lora.clean_bytes, "fused_bytes": pipe.lora.fuse_stats.fused_bytes,
            "owned": pipe.lora.owned(), "pairs_read": pipe.lora.fuse_stats.pairs_read,
            "touched_bytes": _touched_bytes(model, pipe.lora.fused_names)}
    fuse_before = pipe.lora.fuse_stats
    again = pipe.lora.apply(both, "stage 2")  # the same set again: nothing to do
    same_set_noop = (pipe.lora.fuse_stats is fuse_before and [str(r) for r in again] == [str(r) for r in reports]
                     and all(_bytes_equal(v, fused[k]) for k, v in _fused_weights(model, pipe.lora).items()))
    pipe.lora.restore()
    restored_after_apply = all(_bytes_equal(loaded[k], v) for k, v in model.state_dict().items())

    sharded = _run_jobs(pipe, rank, f)
    restored_after_jobs = all(_bytes_equal(loaded[k], v) for k, v in model.state_dict().items())
    pipe.lora = LoRAFuser(model)  # every rank fuses the whole set itself, the one-process way
    local = _run_jobs(pipe, rank, f)
    return {"fused": fused, "reports": [(r.matched, r.total, r.stage, str(r)) for r in reports], "held": held,
            "same_set_noop": same_set_noop, "restored_after_apply": restored_after_apply,
            "restored_after_jobs": restored_after_jobs,
            "restored_at_end": all(_bytes_equal(loaded[k], v) for k, v in model.state_dict().items()),
            "sharded": sharded, "local": local, "opens": (opens_after_load, loader.OPEN_COUNT),
            "reads_at_load": reads_at_load, "reads_after_load": spy.paths}


# ---- one process -----------------------------------------------------------------------------------------------------

_ONE: dict[str, dict] = {}


def _one_process(f: dict, weights: str) -> dict:
    if weights not in _ONE:
        from mgpu_backend.stages.pipelines import TwoStagePipeline

        components = loader.load_components(f[weights], dtype=torch.bfloat16)
        model = components.transformer
        fuser = LoRAFuser(model)
        fuser.fuse(read_loras([(f["user"], USER_STRENGTH), (f["distilled"], 1.0)]))
        fused = _fused_weights(model, fuser)
        fuser.restore()
        pipe = TwoStagePipeline(components, None, dtype=torch.bfloat16)
        _ONE[weights] = {"fused": fused, "jobs": _run_jobs(pipe, 0, f)}
    return _ONE[weights]


_FLEET: dict[tuple, list] = {}


def _fleet(f: dict, world: int, weights: str) -> list[dict]:
    if (world, weights) not in _FLEET:
        _FLEET[(world, weights)] = run_ranks(_fleet_rank, world, f, weights, timeout_s=180.0)
    return _FLEET[(world, weights)]


# ---- tests: units ----------------------------------------------------------------------------------------------------

def test_assign_owners_balances_bytes_and_is_deterministic():
    sizes = [4096] * 48 + [16384] * 8 + [100]
    for world in (1, 2, 3, 4, 8):
        owners = assign_owners(sizes, world)
        assert owners == assign_owners(list(sizes), world)
        load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
        assert sum(load) == sum(sizes) and set(owners) <= set(range(world))
        assert max(load) - min(load) <= max(sizes), load  # LPT: within one item of each other


def test_read_lora_indexes_without_reading_pairs(files, monkeypatch):
    """`read_lora` reads the header and alphas only; tensors are read per layer when fused."""
    lora = read_lora(files["user"], 0.5)
    n = len(lora.index)
    assert n == 2 * (4 + 2)  # 2 blocks × (attn1: q, k, v, out; ff: 2 Linears)
    reads = []
    original = lora.reader

    def counting_reader():
        ctx = original()

        class Wrapped:
            def __enter__(self_inner):
                get = ctx.__enter__()

                def counted(name):
                    reads.append(name)
                    return get(name)
                return counted

            def __exit__(self_inner, *exc):
                return ctx.__exit__(*exc)
        return Wrapped()

    monkeypatch.setattr(lora, "reader", counting_reader)
    assert set(lora.pairs) == set(lora.index) and reads == []  # listing the pairs reads nothing
    a, b, alpha = lora.pairs["transformer_blocks.0.attn1.to_q"]
    assert a.shape == (2, 64) and b.shape == (64, 2) and alpha == 2.0 and len(reads) == n  # first access: all once
    assert lora.key[1] == 0.5 and lora.key[0][1] == os.path.getsize(files["user"])


def test_kohya_naming_is_read_like_peft(files, tmp_path):
    tensors = _tensors(files["user"])
    kohya = {k.replace(".lora_A.weight", ".lora_down.weight").replace(".lora_B.weight", ".lora_up.weight"): v
             for k, v in tensors.items()}
    path = tmp_path / "kohya.safetensors"
    save_file(kohya, str(path))
    a, b = read_lora(files["user"]), read_lora(path)
    assert a.index.keys() == b.index.keys()
    for name in a.index:
        assert all(torch.equal(x, y) for x, y in zip(a.pairs[name][:2], b.pairs[name][:2]))
        assert a.pairs[name][2] == b.pairs[name][2]


def test_read_loras_rejects_malformed_entries(files):
    with pytest.raises(LoRAError, match="expected \\(path, strength\\)"):
        read_loras([("only-a-path",)])
    with pytest.raises(LoRAError, match="finite"):
        read_loras([(files["user"], float("nan"))])
    assert [lo.strength for lo in read_loras([{"path": files["user"], "strength": 0.3}])] == [0.3]


def test_coverage_report_and_errors_before_any_weight_is_touched(files):
    components = loader.load_components(files["checkpoint"], dtype=torch.bfloat16)
    model = components.transformer
    loaded = _state(model)
    fuser = LoRAFuser(model)
    deeper = read_lora(files["deeper"], 0.5)
    assert fuser.check([deeper]) == [LoRAReport(files["deeper"], 0.5, 12, 13)]
    reports = fuser.fuse([read_lora(files["distilled"]), deeper], "stage 2")
    assert [(r.matched, r.total) for r in reports] == [(56, 56), (12, 13)]
    assert reports[1].missing == ("transformer_blocks.7.attn1.to_q",)
    assert str(reports[1]) == "stage 2: deeper.safetensors @ 0.5: 12/13 layers applied"
    assert reports[1].detail() == str(reports[1]) + " (not in this model: transformer_blocks.7.attn1.to_q)"
    assert reports[0].detail() == "stage 2: ltx-2.0-tiny-distilled-lora.safetensors @ 1: 56/56 layers applied"
    fused = _state(model)
    for bad, needles in (("wide", ["transformer_blocks.1.attn1.to_k", "(2, 96)", "(96, 2)", "64 -> 64"]),
                         ("foreign", ["none of its 1 LoRA layers"])):
        with pytest.raises(LoRAError) as err:  # a ValidationError: the fleet stays usable
            fuser.apply([read_lora(files["user"]), read_lora(files[bad])])
        assert files[bad] in str(err.value) and all(n in str(err.value) for n in needles), str(err.value)
        # refused while planning: the previous set is restored (apply restores first) and nothing else is touched
        assert not fuser.active
        assert all(_bytes_equal(loaded[k], v) for k, v in model.state_dict().items())
        fuser.fuse([read_lora(files["distilled"]), deeper])
        assert all(_bytes_equal(fused[k], v) for k, v in model.state_dict().items())
    fuser.restore()
    assert all(_bytes_equal(loaded[k], v) for k, v in model.state_dict().items())


# ---- tests: the fleet ------------------------------------------------------------------------------------------------

WEIGHTS = ("checkpoint", "checkpoint_fp8")


@pytest.mark.parametrize("weights", WEIGHTS, ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", [1, 2])
def test_fused_weights_equal_one_process_and_restore_exactly(files, world, weights):
    ranks = _fleet(files, world, weights)
    one = _one_process(files, weights)
    for r, out in enumerate(ranks):
        n_fp8 = sum(k.endswith(".weight_scale") for k in one["fused"])
        assert out["fused"].keys() == one["fused"].keys() and len(one["fused"]) == 56 + n_fp8
        assert n_fp8 == (56 if weights == "checkpoint_fp8" else 0)
        bad = [k for k in one["fused"] if not _bytes_equal(out["fused"][k], one["fused"][k])]
        assert not bad, f"rank {r}: fused weights differ from one process in {bad[:5]}"
        assert [rep[:3] for rep in out["reports"]] == [(12, 12, "stage 2"), (56, 56, "stage 2")]
        assert out["same_set_noop"]
        assert out["restored_after_apply"] and out["restored_after_jobs"] and out["restored_at_end"]


@pytest.mark.parametrize("weights", WEIGHTS, ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", [1, 2])
def test_job_outputs_with_loras(files, world, weights, capsys):
    ranks = _fleet(files, world, weights)
    one = _one_process(files, weights)["jobs"]
    head = ranks[0]["sharded"]
    for r, out in enumerate(ranks):
        for name, job in out["sharded"].items():
            local = out["local"][name]
            if "error" in job:
                assert job["error"] == local["error"] == one[name]["error"]
            elif r == 0:  # the fleet's sharded fuse = each rank fusing the whole set itself
                assert torch.equal(job["video"], local["video"]), f"rank {r} {name}"
                assert torch.equal(job["audio"], local["audio"]), f"rank {r} {name}"
            assert not job["active_after"], f"rank {r} {name}: LoRAs left fused after the job"
    # stage 1 after a stage-2 LoRA (and after the errors) equals stage 1 with no LoRA
    for name in ("stage1 after stage2", "stage1 after user", "stage1 after errors"):
        assert torch.equal(head[name]["video"], head["stage1"]["video"]), name
        assert torch.equal(head[name]["audio"], head["stage1"]["audio"]), name
    assert torch.equal(head["stage2 user+distilled again"]["video"], head["stage2 user+distilled"]["video"])
    # the LoRAs do change what they touch
    effect = float((head["stage2"]["video"] - head["stage2 none"]["video"]).abs().max())
    assert effect > 1e-2
    assert not torch.equal(head["stage1 user"]["video"], head["stage1"]["video"])
    # against one process: exact at W = 1; at W = 2 the SP stage's reduction order differs (tiled stages are exact)
    diffs = {}
    for name, job in head.items():
        if "error" in job:
            continue
        for key in ("video", "audio"):
            diffs[f"{name}/{key}"] = float((job[key] - one[name][key]).abs().max())
    if world == 1:
        assert all(v == 0.0 for v in diffs.values()), diffs
    else:
        with capsys.disabled():
            print(f"\n[lora fleet] W=2 {weights}: max |fleet - one process| = {max(diffs.values()):.3g} "
                  f"(LoRA effect on stage 2 {effect:.3g})")
        assert max(diffs.values()) < SP_BOUND, diffs
        assert all(diffs[f"{n}/video"] == 0.0 for n in head if "stage2" in n and "error" not in head[n]), diffs
    # reports per job
    assert head["stage2 user+distilled"]["lora_reports"] == [
        "user-style.safetensors @ 0.8: 12/12 layers applied",
        "ltx-2.0-tiny-distilled-lora.safetensors @ 1: 56/56 layers applied"]
    assert head["stage1 deeper"]["lora_reports"] == [
        "deeper.safetensors @ 0.8: 12/13 layers applied (not in this model: transformer_blocks.7.attn1.to_q)"]
    assert head["stage1"]["lora_reports"] == []
    assert "(2, 96)" in head["wide"]["error"] and "none of its 1 LoRA layers" in head["foreign"]["error"]


@pytest.mark.parametrize("weights", WEIGHTS, ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", [1, 2])
def test_clean_weights_are_sharded_and_pairs_read_once(files, world, weights, capsys):
    ranks = _fleet(files, world, weights)
    held = [out["held"] for out in ranks]
    touched = held[0]["touched_bytes"]
    owned = [set(h["owned"]) for h in held]
    layers = {k for k in ranks[0]["fused"] if not k.endswith(".weight_scale")}
    assert set().union(*owned) == layers and sum(map(len, owned)) == 56  # each layer: one owner
    assert sum(h["pairs_read"] for h in held) == 56 + 12  # every pair of the two LoRAs read by one rank
    with capsys.disabled():
        print(f"\n[lora fleet] W={world} {weights}: clean bytes per rank "
              f"{[h['clean_bytes'] for h in held]} of {touched} touched; pairs read {[h['pairs_read'] for h in held]}"
              f"; full-precision copies per rank {[h['fused_bytes'] for h in held]}")
    # fp8 as bf16: the clean bytes as stored (fp8 weights with their scales), no full-precision copy anywhere
    assert sum(h["clean_bytes"] for h in held) == touched  # together exactly one clean copy
    for h in held:
        assert abs(h["clean_bytes"] - touched / world) <= 0.05 * touched, (h["clean_bytes"], touched)
        assert h["fused_bytes"] == 0


@pytest.mark.parametrize("weights", WEIGHTS, ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", [1, 2])
def test_switching_lora_sets_never_rereads_the_checkpoint(files, world, weights):
    ranks = _fleet(files, world, weights)
    checkpoint = os.path.realpath(files[weights])
    lora_files = {os.path.realpath(files[k]) for k in ("distilled", "user", "wide", "foreign", "deeper")}
    for out in ranks:
        assert checkpoint in out["reads_at_load"]  # the spy sees the loader's opens
        before, after = out["opens"]
        assert after == before, "the checkpoint was opened again"
        assert checkpoint not in out["reads_after_load"]
        assert set(out["reads_after_load"]) <= lora_files and out["reads_after_load"]


# ---- quantized layers over the ranks: replicated and sharded --------------------------------------------------------

#: the quantized tiny files of the requantization fleet test: name -> how `quantized_files` writes it
QUANT_KINDS = ("fp8_lightricks", "fp8_comfy", "int8", "int8_convrot")


@pytest.fixture(scope="module")
def quantized_files(tiny_dir, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (transformer file, LoRA file): the LTX-2.0 tiny fp8 single file (Lightricks' scaled fp8, no markers)
    with its distilled LoRA, and the LTX-2.3 tiny transformer in ComfyUI's `.comfy_quant` layouts — fp8 (with
    `input_scale`), int8 per tensor, int8 ConvRot (per-row scales) — with the tiny 2.3 distilled LoRA."""
    from mgpu_backend.testing.tiny import write_tiny_transformer

    out = tmp_path_factory.mktemp("lora_requant_fleet")
    lora23 = str(tiny_dir["2.3"]["distilled_lora"])
    files = {"fp8_lightricks": (str(tiny_dir[VARIANT]["checkpoint_fp8"]), str(tiny_dir[VARIANT]["distilled_lora"]))}
    for kind, quantization in (("fp8_comfy", "fp8"), ("int8", "int8"), ("int8_convrot", "int8-convrot")):
        files[kind] = (str(write_tiny_transformer(out / f"ltx-2.3-tiny-{kind}.safetensors", "2.3", 0,
                                                  quantization=quantization)), lora23)
    return files


def _whole(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's whole weight (gathered when sharded: a collective, every rank calls it) as bytes, and its scale."""
    from mgpu_backend.weights.sharding import full_weight

    w = full_weight(layer.weight).detach().contiguous().reshape(-1).view(torch.uint8).clone()
    scale = getattr(layer, "weight_scale", None)
    return w, None if scale is None else scale.detach().clone()


def _fuse_and_restore(transformer, lora_path: str, rank: int = 0, world: int = 1) -> dict:
    """Fuse the LoRA at 0.75 into `transformer` (on this rank of `world`), read every fused layer whole, restore, and
    report what was held and whether the clean bytes came back."""
    from mgpu_backend.weights.sharding import local_shard

    model_bytes = sum(local_shard(t).numel() * t.element_size() for t in (*transformer.parameters(),
                                                                            *transformer.buffers()))
    fuser = LoRAFuser(transformer, rank=rank, world_size=world)
    names = list(read_lora(lora_path).index)
    layers = {n: m for n, m in transformer.named_modules() if n in set(names)}
    objects = {n: (m.weight, getattr(m, "weight_scale", None)) for n, m in layers.items()}
    clean = {n: _whole(m) for n, m in layers.items()}
    fuser.fuse([read_lora(lora_path, 0.75)])
    fused = {n: _whole(layers[n]) for n in fuser.fused_names}
    out = {"fused": fused, "clean_bytes": fuser.clean_bytes, "fused_bytes": fuser.fuse_stats.fused_bytes,
           "owned": len(fuser.owned()), "sharded": fuser.sharded,
           "same_tensors": all(m.weight is objects[n][0] and getattr(m, "weight_scale", None) is objects[n][1]
                               for n, m in layers.items()),
           "flagged": all(getattr(layers[n], "lora_fused", True) for n in fuser.fused_names),
           "model_bytes_unchanged": model_bytes == sum(local_shard(t).numel() * t.element_size() for t in (
               *transformer.parameters(), *transformer.buffers())),
           "touched": sum(local_shard(m.weight).numel() * m.weight.element_size() for m in layers.values()),
           "scale_bytes": sum(m.weight_scale.numel() * 4 for m in layers.values() if hasattr(m, "weight_scale")),
           "rows": sum(m.in_features * m.weight.element_size() for m in layers.values()),
           "largest": max(m.weight.numel() * m.weight.element_size() + (m.weight_scale.numel() * 4 if hasattr(
               m, "weight_scale") else 0) for m in layers.values())}
    fuser.restore()
    after = {n: _whole(m) for n, m in layers.items()}
    out["restored"] = all(torch.equal(after[n][0], clean[n][0]) and (clean[n][1] is None or torch.equal(
        after[n][1], clean[n][1])) for n in layers)
    out["unflagged"] = not any(getattr(m, "lora_fused", False) for m in layers.values())
    return out


def _requant_rank(rank: int, world: int, files: dict, kinds: tuple[str, ...]) -> dict:
    from mgpu_backend.weights.sharding import shard_transformer

    out = {}
    for kind in kinds:
        path, lora = files[kind]
        for mode in ("replicated", "sharded"):
            transformer = loader.load_transformer(loader.SafetensorsFile(path), torch.bfloat16)[0]
            if mode == "sharded":
                shard_transformer(transformer, torch.device("cpu"))
            out[(kind, mode)] = _fuse_and_restore(transformer, lora, rank, world)
    return out


_REQUANT: dict = {}


def _requant_one_process(files: dict, kind: str) -> dict:
    if kind not in _REQUANT:
        path, lora = files[kind]
        _REQUANT[kind] = _fuse_and_restore(loader.load_transformer(loader.SafetensorsFile(path), torch.bfloat16)[0],
                                           lora)
    return _REQUANT[kind]


@pytest.mark.parametrize("world,kinds", [(2, QUANT_KINDS), (3, ("fp8_comfy", "int8_convrot"))],
                         ids=["W2", "W3"])
def test_quantized_layers_fused_over_the_ranks_equal_one_process(quantized_files, world, kinds, capsys):
    """fp8 (Lightricks' file and ComfyUI's marked one), int8 per tensor and int8 ConvRot: fused on W gloo ranks,
    replicated (each layer by its owner, bytes and scale broadcast) and sharded (each layer gathered and rounded whole
    on every rank, its rows written into each shard), every layer's whole bytes and scale equal one process's (the
    stochastic rounding's seed and random draws are the layer's own, whichever rank computes); restore gives the clean
    bytes back; the same tensors throughout, no full-precision copy held, the model's bytes unchanged; clean bytes
    per rank ≈ 1/W of the touched bytes (replicated: together exactly once, within one layer of each other; sharded:
    each rank its rows, within W − 1 rows per layer, plus the whole scales)."""
    ranks = run_ranks(_requant_rank, world, quantized_files, kinds, timeout_s=300.0)
    for kind in kinds:
        one = _requant_one_process(quantized_files, kind)
        assert one["restored"] and one["same_tensors"] and one["fused_bytes"] == 0 and len(one["fused"]) > 0
        for mode in ("replicated", "sharded"):
            held = [r[(kind, mode)] for r in ranks]
            for r, got in enumerate(held):
                where = f"{kind} {mode} W={world} rank {r}"
                assert got["sharded"] == (mode == "sharded"), where
                assert got["fused"].keys() == one["fused"].keys(), where
                bad = [n for n in one["fused"] if not (torch.equal(got["fused"][n][0], one["fused"][n][0]) and
                                                       torch.equal(got["fused"][n][1], one["fused"][n][1]))]
                assert not bad, f"{where}: fused bytes differ from one process: {bad[:4]}"
                assert got["restored"] and got["unflagged"] and got["flagged"], where
                assert got["same_tensors"] and got["model_bytes_unchanged"] and got["fused_bytes"] == 0, where
            clean = [h["clean_bytes"] for h in held]
            touched, scales = one["touched"], one["scale_bytes"]
            with capsys.disabled():
                print(f"\n[lora requant] {kind} {mode} W={world}: clean bytes per rank {clean} "
                      f"(touched {touched} + scales {scales})")
            if mode == "replicated":
                assert sum(clean) == touched + scales  # together exactly one clean copy
                assert sum(h["owned"] for h in held) == len(one["fused"])
                assert max(clean) - min(clean) <= one["largest"], clean  # LPT: within one layer of each other
            else:  # each rank: its rows of every layer and every scale whole; FSDP splits rows as torch.chunk does
                # (ceil(R / W) each, the last ranks the rest): within W − 1 rows of R / W per layer
                assert sum(c - scales for c in clean) == touched
                for c in clean:
                    assert abs(c - scales - touched / world) <= (world - 1) * one["rows"], (c, touched, world)


# ---- the controller's worker fleet -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctl():
    from mgpu_backend.serving.client import ControllerClient
    from mgpu_backend.protocol.errors import ControllerError

    runtime = Path(tempfile.mkdtemp(prefix="ltx2-lora-"))
    client = ControllerClient(runtime_dir=runtime)
    pid = client.ping().pid
    yield client
    workers = []
    try:
        other = ControllerClient(runtime, start=False)
        fleet = other.status().fleet
        workers = fleet.worker_pids if fleet else []
        other.stop()
    except (ControllerError, OSError):
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in (pid, *workers)):
        time.sleep(0.1)
    for p in (pid, *workers):
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    shutil.rmtree(runtime, ignore_errors=True)


def _config(files, world: int, dtype: str = "bfloat16"):
    from mgpu_backend.protocol.fleet_config import FleetConfig

    return FleetConfig(devices=("cpu",) * world, checkpoint=files["checkpoint"], gemma=files["gemma"],
                       upscaler=files["upscaler"], dtype=dtype, threads_per_worker=1, init_timeout_s=120.0,
                       collective_timeout_s=120.0, stall_timeout_s=60.0)


def test_worker_fleet_switches_lora_sets_without_reloading(ctl, files):
    from mgpu_backend.protocol.errors import ControllerError
    from mgpu_backend.protocol.job_requests import JobSpec

    handle = ctl.configure(_config(files, 2))
    before = ctl.status().fleet
    outs = {}
    for name, mode, loras in _jobs(files):
        try:
            outs[name] = ctl.run(handle, JobSpec("sample", _payload(mode, loras)))
        except ControllerError as exc:
            outs[name] = exc
    for name in ("wide", "foreign"):  # refused on every rank before any work: a validation error, fleet kept
        exc = outs[name]
        assert isinstance(exc, ControllerError) and exc.kind == "validation" and not exc.fleet_lost, exc
        assert files[name] in str(exc)
    for name in ("stage1 after stage2", "stage1 after user", "stage1 after errors"):
        assert torch.equal(outs[name].video, outs["stage1"].video), name
        assert torch.equal(outs[name].audio, outs["stage1"].audio), name
    assert not torch.equal(outs["stage2"].video, outs["stage2 user+distilled"].video)
    assert outs["stage2"].lora_reports == ("ltx-2.0-tiny-distilled-lora.safetensors @ 1: 56/56 layers applied",)
    # the same fleet, the same processes, and no checkpoint opened since the fleet started
    after = ctl.status().fleet
    assert after.worker_pids == before.worker_pids and after.generation == before.generation
    assert after.open_counts == before.open_counts, (before.open_counts, after.open_counts)


def test_generate_with_user_lora_on_both_stages(ctl, files, capsys):
    """The two-stage recipe on the W = 2 fleet (float32) with a user LoRA on both stages and the distilled LoRA on
    stage 2, against one process running the same tiled recipe: within the SP tolerance of test_fleet (1e-4). The
    user LoRA changes stage 1 (its audio latent) where the distilled LoRA alone does not."""
    from mgpu_backend.models.gemma import load_gemma
    from mgpu_backend.splits.tiling import default_tiling
    from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline
    from mgpu_backend.protocol.job_requests import JobSpec

    grid = (2, 4, 4)
    base = dict(prompt="a red fox in fresh snow", width=128, height=128, frames=9, fps=24.0, steps=2, seed=5,
                video_guidance=S.NO_GUIDANCE, audio_guidance=S.NO_GUIDANCE, stage2_sigmas=S.TDP_STAGE2_SIGMAS,
                tiles=default_tiling(2, grid, 5), decode_tiles=default_tiling(2, grid, 2),
                distilled_lora=(files["distilled"], 1.0))
    with_user = GenerateRequest(**base, loras=((files["user"], USER_STRENGTH),))
    without = GenerateRequest(**base)
    handle = ctl.configure(_config(files, 2, "float32"))
    before = ctl.status().fleet.open_counts
    fleet = ctl.run(handle, JobSpec("generate", with_user))
    fleet_without = ctl.run(handle, JobSpec("generate", without))
    assert ctl.status().fleet.open_counts == before
    components = loader.load_components(files["checkpoint"], loader.ComponentFiles(upsampler=files["upscaler"]),
                                        dtype=torch.float32)
    pipe = TwoStagePipeline(components, load_gemma(files["gemma"]), dtype=torch.float32)
    one = pipe.generate(with_user)
    assert [str(r) for r in one.lora_reports] == list(fleet.lora_reports) == [
        "stage 1: user-style.safetensors @ 0.8: 12/12 layers applied",
        "stage 2: user-style.safetensors @ 0.8: 12/12 layers applied",
        "stage 2: ltx-2.0-tiny-distilled-lora.safetensors @ 1: 56/56 layers applied"]
    diffs = {k: float((getattr(fleet, k) - getattr(one, k)).abs().max())
             for k in ("video_latent", "audio_latent", "frames")}
    with capsys.disabled():
        print(f"\n[lora fleet] generate W=2 with a user LoRA: max |fleet - one process| {diffs}")
    assert all(v < 1e-4 for v in diffs.values()), diffs
    assert float((fleet.audio_latent - fleet_without.audio_latent).abs().max()) > 1e-3  # stage 1 saw it
    assert not pipe.lora.active


# ---- the node, in a real ComfyUI (its own interpreter; skipped without one) ------------------------------------------

_NODE_DRIVER = r'''
import importlib.util, json, os, sys
comfy_dir, pack, loras = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, comfy_dir)
os.chdir(comfy_dir)
sys.argv = ["x", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import folder_paths
folder_paths.add_model_folder_path("loras", loras, is_default=True)
spec = importlib.util.spec_from_file_location("ltx2_pack", os.path.join(pack, "__init__.py"),
                                              submodule_search_locations=[pack])
module = importlib.util.module_from_spec(spec)
sys.modules["ltx2_pack"] = module
spec.loader.exec_module(module)
from ltx2_pack.nodes.common import NodeError
from ltx2_pack.nodes.extension import NODES
from ltx2_pack.nodes.lora import LoRAMGPU
from ltx2_pack.nodes.sampler import SPSamplerGuidedMGPU, SPSamplerMGPU
from ltx2_pack.nodes.sampler_inputs import LEGACY_WIDGETS
from ltx2_pack.nodes.upscale import TDPUpscaleMGPU
out = {"registered": [n.define_schema().node_id for n in NODES]}
s = LoRAMGPU.define_schema()
out["schema"] = [s.node_id, s.display_name, s.category, [i.id for i in s.inputs], [o.io_type for o in s.outputs]]
out["options"] = s.inputs[0].options
for node in (SPSamplerMGPU, SPSamplerGuidedMGPU, TDPUpscaleMGPU):
    inp = [i for i in node.define_schema().inputs if i.id == "loras"][0]
    out[node.__name__] = [inp.io_type, inp.optional]
old = SPSamplerMGPU.define_schema()  # the deprecated node: its widgets in the order saved workflows list them
out["legacy"] = [[i.id for i in old.inputs if i.io_type in ("INT", "FLOAT", "COMBO", "STRING")],
                 list(LEGACY_WIDGETS), bool(old.is_deprecated)]
name = "ltx-2.0-tiny-distilled-lora.safetensors"
first = LoRAMGPU.execute(lora_name=name, strength=1.0).args[0]
out["chain"] = LoRAMGPU.execute(lora_name="user-style.safetensors", strength=0.5, loras=first).args[0]
out["zero"] = LoRAMGPU.execute(lora_name="user-style.safetensors", strength=0.0, loras=first).args[0]
for bad in ("absent.safetensors", "not-a-lora.safetensors"):
    try:
        LoRAMGPU.execute(lora_name=bad, strength=1.0)
        out[bad] = None
    except NodeError as exc:
        out[bad] = str(exc)
print("RESULT " + json.dumps(out))
'''


def test_lora_node_in_comfyui(files, tmp_path):
    """LoRA (MGPU) in a real ComfyUI (`COMFYUI_DIR`, `COMFYUI_PYTHON` as in test_comfyui_load): registered, its
    schema (lora_name from models/loras, strength, optional chain in; LTX2_MGPU_LORAS out), the optional `loras`
    input of SP Sampler / TDP Upscale, chaining in order, strength 0 leaving the LoRA out, node errors for a missing
    file and a file without LoRA pairs."""
    import subprocess
    import sys

    directory = os.environ.get("COMFYUI_DIR")
    if not directory or not (Path(directory) / "comfy" / "sd.py").is_file():
        pytest.skip("no ComfyUI: set COMFYUI_DIR (and COMFYUI_PYTHON) to a ComfyUI checkout")
    root = Path(directory)
    python = os.environ.get("COMFYUI_PYTHON") or next(
        (str(c) for c in (root / "venv" / "bin" / "python", root / ".venv" / "bin" / "python") if c.exists()),
        sys.executable)
    loras = tmp_path / "loras"
    loras.mkdir()
    for key, name in (("distilled", "ltx-2.0-tiny-distilled-lora.safetensors"), ("user", "user-style.safetensors")):
        (loras / name).symlink_to(files[key])
    save_file({"some.weight": torch.zeros(3)}, str(loras / "not-a-lora.safetensors"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([python, "-c", _NODE_DRIVER, str(root), str(Path(__file__).resolve().parent.parent),
                          str(loras)], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    import json

    out = json.loads(lines[-1][len("RESULT "):])
    assert "LTX2MGPU_LoRA" in out["registered"]
    assert out["schema"] == ["LTX2MGPU_LoRA", "LoRA (MGPU)", "LTX-2 Multi-GPU", ["lora_name", "strength", "loras"],
                             ["LTX2_MGPU_LORAS"]]
    assert {"ltx-2.0-tiny-distilled-lora.safetensors", "user-style.safetensors"} <= set(out["options"])
    assert out["SPSamplerMGPU"] == out["SPSamplerGuidedMGPU"] == out["TDPUpscaleMGPU"] == ["LTX2_MGPU_LORAS", True]
    assert out["legacy"][0] == out["legacy"][1] and out["legacy"][2]  # saved widgets_values still map by position
    assert {"LTX2MGPU_SPSampler", "LTX2MGPU_SPSamplerGuided", "LTX2MGPU_Guider",
            "LTX2MGPU_Guidance"} <= set(out["registered"])
    distilled, user = str(loras / "ltx-2.0-tiny-distilled-lora.safetensors"), str(loras / "user-style.safetensors")
    assert out["chain"] == [[distilled, 1.0], [user, 0.5]]
    assert out["zero"] == [[distilled, 1.0]]
    assert "absent.safetensors" in out["absent.safetensors"] and out["absent.safetensors"].startswith("LoRA (MGPU)")
    assert "no LoRA pairs" in out["not-a-lora.safetensors"]


# ---- command line ----------------------------------------------------------------------------------------------------

def test_cli_lora_flags(files, tmp_path, capsys):
    """`--lora PATH:STRENGTH` (repeatable) on both stages, `--distilled-lora` on stage 2: the coverage of each is
    printed per stage; a bad strength and a LoRA of another width are refused with exit code 2."""
    from mgpu_backend.serving import cli

    common = ["generate", "--checkpoint", files["checkpoint"], "--gemma", files["gemma"], "--upscaler",
              files["upscaler"], "--prompt", "a fox", "--frames", "9", "--width", "128", "--height", "128",
              "--steps", "1", "--device", "cpu", "--output", str(tmp_path / "out.mp4")]
    args = cli.build_parser().parse_args(common + ["--lora", f"{files['user']}:0.8", "--lora", files["deeper"],
                                                   "--distilled-lora", files["distilled"]])
    request, _ = cli._request_and_files(args, None)
    assert request.loras == ((files["user"], 0.8), (files["deeper"], 1.0))
    assert request.distilled_lora == (files["distilled"], 1.0)

    assert cli.main(common + ["--lora", f"{files['user']}:0.8", "--distilled-lora", files["distilled"]]) == 0
    printed = capsys.readouterr().out
    for line in ("LoRA stage 1: user-style.safetensors @ 0.8: 12/12 layers applied",
                 "LoRA stage 2: user-style.safetensors @ 0.8: 12/12 layers applied",
                 "LoRA stage 2: ltx-2.0-tiny-distilled-lora.safetensors @ 1: 56/56 layers applied"):
        assert line in printed, printed
    assert cli.main(common + ["--lora", f"{files['user']}:strong"]) == 2
    assert "'strong'" in capsys.readouterr().err
    assert cli.main(common + ["--lora", files["wide"]]) == 2
    err = capsys.readouterr().err
    assert files["wide"] in err and "(2, 96)" in err
