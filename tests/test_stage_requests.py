"""The stage jobs' requests (`SampleRequest`, `UpscaleRequest`, `DecodeRequest`; issue 17 Build 2): frozen,
validated on construction with errors naming the field, the value and the rule; the jobs refuse any other payload by
name; and a request built under ComfyUI's mangled import of the pack reads back as this package's classes (the
controller's unpickler), its value types included."""
from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mgpu_backend.protocol.stage_requests import ComfyGuides, DecodeRequest, SampleRequest, UpscaleRequest
from mgpu_backend.protocol.transport import loads
from mgpu_backend.protocol.native_forward import GuideAttentionEntry
from mgpu_backend.protocol.stage_params import TileCountConfig
from mgpu_backend.protocol.validation import ValidationError

REPO = Path(__file__).resolve().parent.parent
VIDEO, AUDIO = (1, 128, 2, 3, 4), (1, 8, 5, 16)


def _sample(**overrides) -> SampleRequest:
    args = dict(positive=torch.zeros(1, 7, 64), video=torch.zeros(VIDEO), audio=torch.zeros(AUDIO),
                noise_video=torch.zeros(VIDEO), noise_audio=torch.zeros(AUDIO), sigmas=torch.tensor([1.0, 0.5, 0.0]),
                fps=24.0)
    args.update(overrides)
    return SampleRequest(**args)


def test_a_sample_request_is_frozen_and_normalises_what_it_holds():
    r = _sample(sigmas=[1.0, 0.5, 0.0], stg_blocks=[28, 29], loras=[("a.safetensors", 1)])
    assert r.sigmas.dtype == torch.float32 and r.sigmas.tolist() == [1.0, 0.5, 0.0]
    assert r.stg_blocks == (28, 29) and r.loras == (("a.safetensors", 1),)
    assert (r.mode, r.semantics, r.sampler, r.audio_frozen, r.guides) == ("sequence_parallel", "reference", "euler",
                                                                         None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fps = 25.0  # type: ignore[misc]
    assert _sample(stg_blocks="auto").stg_blocks == "auto"


@pytest.mark.parametrize("overrides,words", [
    ({"mode": "split"}, ["mode='split'", "sequence_parallel, tiled"]),
    ({"semantics": "diffusers"}, ["semantics='diffusers'", "reference, comfyui"]),
    ({"sampler": "dpmpp"}, ["sampler='dpmpp'", "euler, euler_ancestral"]),
    ({"stage": " "}, ["stage=' '", "'stage 1'"]),
    ({"video": torch.zeros(2, 128, 2, 3, 4)}, ["video latent", "batch size 2", "one clip per job"]),
    ({"video": torch.zeros(1, 64, 2, 3, 4)}, ["video latent", "(1, 64, 2, 3, 4)", "[1, 128, F, H, W]"]),
    ({"audio": torch.zeros(1, 8, 5)}, ["audio latent", "(1, 8, 5)", "[1, 8, T, 16]"]),
    ({"noise_video": torch.zeros(1, 128, 2, 3, 5)}, ["noise_video", "(1, 128, 2, 3, 5)", "(1, 128, 2, 3, 4)"]),
    ({"positive": [[0.0]]}, ["positive=list", "torch tensor"]),
    ({"negative": torch.zeros(7, 64)}, ["negative", "(7, 64)", "3 dimensions"]),
    ({"sigmas": [1.0, 0.5]}, ["sigmas", "end in 0"]),
    ({"fps": 0}, ["fps=0", "positive number"]),
    ({"video_guidance": {"cfg_scale": 3.0}}, ["video_guidance=dict", "GuidanceParams"]),
    ({"stg_blocks": "29"}, ["stg_blocks='29'", "'auto'"]),
    ({"stg_blocks": [-1]}, ["stg_blocks=[-1]", "non-negative"]),
    ({"seed": 1.5}, ["seed=1.5", "non-negative integer"]),
    ({"tiles": (1, 2)}, ["tiles=(1, 2)", "TileCountConfig"]),
    ({"tile_overlap": -1}, ["tile_overlap=-1", "non-negative integer"]),
    ({"audio_frozen": 1}, ["audio_frozen=1", "True, False or None"]),
    ({"max_first_sigma": 0.0}, ["max_first_sigma=0.0", "positive number"]),
    ({"loras": [("a.safetensors",)]}, ["loras entry", "(path, strength)"]),
    ({"loras": [("a.safetensors", "strong")]}, ["strength of LoRA 'a.safetensors'='strong'", "finite number"]),
    ({"guides": {"keyframe_idxs": None}}, ["guides=dict", "ComfyGuides"]),
])
def test_a_bad_sample_request_is_refused_on_construction_by_name(overrides, words):
    with pytest.raises(ValueError) as info:
        _sample(**overrides)
    message = str(info.value)
    assert message.startswith("sample: ") and all(w in message for w in words), message


def test_upscale_decode_and_guides_check_themselves():
    assert UpscaleRequest(torch.zeros(VIDEO)).video.shape == VIDEO
    with pytest.raises(ValueError, match=r"upscale: video latent of shape \(1, 128, 3, 4\): expected"):
        UpscaleRequest(torch.zeros(1, 128, 3, 4))
    d = DecodeRequest(torch.zeros(VIDEO), tiles=TileCountConfig.spatial(1, 2, 1))
    assert (d.audio, d.overlap, d.seed) == (None, 2, 0)
    for kwargs, words in (({"audio": torch.zeros(1, 2, 5, 16)}, "audio latent of shape (1, 2, 5, 16)"),
                          ({"overlap": -2}, "overlap=-2: must be a non-negative integer"),
                          ({"seed": "7"}, "seed='7'"), ({"tiles": "2x2"}, "tiles='2x2'")):
        with pytest.raises(ValueError) as info:
            DecodeRequest(torch.zeros(VIDEO), **kwargs)
        assert str(info.value).startswith("decode: ") and words in str(info.value), str(info.value)
    entry = GuideAttentionEntry(pre_filter_count=12, strength=0.7)
    assert ComfyGuides(guide_attention_entries=[entry]).guide_attention_entries == (entry,)
    assert ComfyGuides().empty and not ComfyGuides(keyframe_idxs=torch.zeros(1, 3, 4, 2)).empty
    with pytest.raises(ValueError, match="guides: guide_attention_entries holds \\['dict'\\]"):
        ComfyGuides(guide_attention_entries=({"pre_filter_count": 12},))


@pytest.mark.parametrize("kind,job", [("sample", "run_sample"), ("upscale", "run_upscale"), ("decode", "run_decode")])
def test_the_stage_jobs_refuse_any_other_payload_by_name(kind, job):
    from mgpu_backend.serving.jobs import stages

    ctx = SimpleNamespace(rank=0, world_size=1, progress=lambda *a: None, step_boundary=lambda *a: False)
    expected = {"sample": "SampleRequest", "upscale": "UpscaleRequest", "decode": "DecodeRequest"}[kind]
    with pytest.raises(ValidationError, match=f"^{kind} payload: expected a {expected}, got dict$"):
        getattr(stages, job)(SimpleNamespace(pipeline=None), {"video": torch.zeros(VIDEO)}, ctx)


MANGLED = textwrap.dedent("""
    import importlib, importlib.util, pickle, sys
    repo = sys.argv[1]
    name = "custom_nodes_ltx2_multigpu_0x5f3a"  # what ComfyUI does with a custom node folder
    spec = importlib.util.spec_from_file_location(name, repo + "/__init__.py", submodule_search_locations=[repo])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[name] = pack
    spec.loader.exec_module(pack)
    import torch
    R = importlib.import_module(name + ".mgpu_backend.protocol.stage_requests")
    J = importlib.import_module(name + ".mgpu_backend.protocol.job_requests")
    SP = importlib.import_module(name + ".mgpu_backend.protocol.stage_params")
    F = importlib.import_module(name + ".mgpu_backend.protocol.native_forward")
    g = SP.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(0,))
    guides = R.ComfyGuides(keyframe_idxs=torch.arange(24.0).reshape(1, 3, 4, 2),
                           guide_attention_entries=(F.GuideAttentionEntry(pre_filter_count=12, strength=0.7),))
    v, a = (1, 128, 2, 3, 4), (1, 8, 5, 16)
    sample = R.SampleRequest(positive=torch.ones(1, 7, 64), video=torch.full(v, 2.0), audio=torch.zeros(a),
                             noise_video=torch.zeros(v), noise_audio=torch.zeros(a), sigmas=[1.0, 0.5, 0.0], fps=24.0,
                             video_guidance=g, stg_blocks="auto", tiles=SP.TileCountConfig.spatial(1, 2, 1),
                             guides=guides, loras=[("x.safetensors", 0.5)], semantics="comfyui")
    jobs = [J.JobSpec("sample", sample), J.JobSpec("upscale", R.UpscaleRequest(torch.zeros(v))),
            J.JobSpec("decode", R.DecodeRequest(torch.zeros(v), audio=torch.zeros(a), overlap=1))]
    assert "mgpu_backend" not in sys.modules
    sys.stdout.buffer.write(pickle.dumps(jobs, protocol=pickle.HIGHEST_PROTOCOL))
""")


def test_requests_built_under_comfyuis_mangled_import_read_back_as_this_packages_classes(tmp_path):
    """The client inside ComfyUI pickles `<mangled>…protocol.stage_requests.SampleRequest` (and its GuidanceParams,
    TileCountConfig, ComfyGuides, GuideAttentionEntry); the controller's unpickler (`transport.loads`) must find this
    package's classes, so the job's `isinstance` check holds."""
    from mgpu_backend.protocol import native_forward as forward, stage_params

    proc = subprocess.run([sys.executable, "-c", MANGLED, str(REPO)], cwd=tmp_path, capture_output=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"custom_nodes_ltx2_multigpu_0x5f3a.mgpu_backend.protocol" in proc.stdout  # really the mangled names
    sample, upscale, decode = (job.payload for job in loads(proc.stdout))
    assert type(sample) is SampleRequest and type(upscale) is UpscaleRequest and type(decode) is DecodeRequest
    assert type(sample.video_guidance) is stage_params.GuidanceParams and sample.video_guidance.cfg_scale == 3.0
    assert type(sample.tiles) is stage_params.TileCountConfig and sample.tiles.width.num_tiles == 2
    assert type(sample.guides) is ComfyGuides
    assert type(sample.guides.guide_attention_entries[0]) is forward.GuideAttentionEntry
    assert torch.equal(sample.video, torch.full(VIDEO, 2.0)) and sample.sigmas.tolist() == [1.0, 0.5, 0.0]
    assert (sample.stg_blocks, sample.loras, sample.semantics) == ("auto", (("x.safetensors", 0.5),), "comfyui")
    assert decode.overlap == 1 and decode.audio.shape == AUDIO
    json.dumps([sample.mode, decode.seed])  # plain values, not mangled objects
    assert pickle.loads(pickle.dumps(upscale)).video.shape == VIDEO
