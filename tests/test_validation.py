"""Input validation: every rule refuses bad input before any work, with a message naming the value and the rule.

No numeric tolerances here: every assertion is on exact values or message text.
"""
from __future__ import annotations

import math

import pytest
import torch

from mgpu_backend.protocol import validation as V
from mgpu_backend.models.gemma import load_gemma
from mgpu_backend.models.loader import SafetensorsFile, load_text_projection
from mgpu_backend.models.text_projection import check_gemma_matches
from mgpu_backend.testing.tiny import TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS
from mgpu_backend.testing.tiny_gemma import write_tiny_gemma
from mgpu_backend.stages.pipelines import GenerateRequest


def _refused(match: str | None = None, **fields) -> str:
    request = GenerateRequest(prompt="a red car on a coastal road", **fields)
    with pytest.raises(V.ValidationError, match=match) as err:
        request.validate()
    return str(err.value)


def test_unreadable_image_is_refused_naming_the_file(tmp_path):
    image = tmp_path / "garbage.png"
    image.write_bytes(b"\x89PNG not really")
    with pytest.raises(V.ValidationError, match=r"image: .*garbage.png is not a readable image"):
        GenerateRequest(prompt="x", image=str(image)).validate()


def test_negative_tile_overlap_is_refused():
    with pytest.raises(V.ValidationError, match=r"tile_overlap=-3: must be a non-negative number of latent cells"):
        GenerateRequest(prompt="x", tile_overlap=-3).validate()


def test_default_request_is_valid(tmp_path):
    GenerateRequest(prompt="x").validate()  # 768x512, 121 frames, 24 fps
    image = tmp_path / "first.png"
    from PIL import Image

    Image.new("RGB", (8, 8), (10, 20, 30)).save(image)
    lora = tmp_path / "distilled.safetensors"
    lora.write_bytes(b"")
    GenerateRequest(prompt="x", width=1280, height=704, frames=9, fps=25.0, steps=3, image=str(image),
                    image_strength=0.0, distilled_lora=(str(lora), 0.6), stage2_sigmas=(0.625, 0.4, 0.0)).validate()
    assert issubclass(V.ValidationError, ValueError)


# ------------------------------------------------------------------------------------------------------- frames

@pytest.mark.parametrize("frames, below, above", [(120, 113, 121), (122, 121, 129), (10, 9, 17), (5, 1, 9),
                                                   (2, 1, 9), (240, 233, 241)])
def test_frames_not_8k_plus_1_names_nearest_valid_counts(frames, below, above):
    msg = _refused(frames=frames)
    assert f"frames={frames}" in msg and "8k+1" in msg
    assert f"{below} or {above}" in msg
    assert V.nearest_valid_frames(frames) == (below, above)
    assert (below - 1) % 8 == 0 and (above - 1) % 8 == 0 and below < frames < above


@pytest.mark.parametrize("frames", [0, -7, 121.0, "121"])
def test_frames_not_a_positive_int(frames):
    msg = _refused(frames=frames)
    assert f"frames={frames}" in msg and "8k+1" in msg and " or " not in msg


@pytest.mark.parametrize("frames", [1, 9, 17, 121, 241])
def test_valid_frame_counts_pass(frames):
    V.check_frames(frames)


# --------------------------------------------------------------------------------------------------------- size

@pytest.mark.parametrize("field, value, hint", [("width", 700, "640 or 704"), ("height", 352, "320 or 384"),
                                                ("width", 736, "704 or 768"), ("height", 32, "64 or 128"),
                                                ("width", 0, "64 or 128")])
def test_two_stage_size_must_be_multiple_of_64(field, value, hint):
    msg = _refused(**{field: value})
    assert f"{field}={value}" in msg and "multiple of 64" in msg and "two-stage" in msg
    assert hint in msg


def test_single_stage_size_is_multiple_of_32():
    V.check_size(640, 352, two_stage=False)  # 352 = 11 · 32 is fine for one stage ...
    with pytest.raises(V.ValidationError, match="height=352: must be a positive multiple of 64"):
        V.check_size(640, 352, two_stage=True)  # ... but not when stage 1 runs at half size
    with pytest.raises(V.ValidationError, match=r"width=650: must be a positive multiple of 32 .*try 640 or 672"):
        V.check_size(650, 352, two_stage=False)
    with pytest.raises(V.ValidationError, match="width=640.0"):
        V.check_size(640.0, 352, two_stage=False)


# ------------------------------------------------------------------------------------------- fps, steps, strength

@pytest.mark.parametrize("fps", [0, -24.0, math.nan, math.inf])
def test_fps_must_be_positive_and_finite(fps):
    msg = _refused(fps=fps)
    assert f"fps={fps}" in msg and "positive finite" in msg


@pytest.mark.parametrize("steps", [0, -3, 2.5])
def test_steps_must_be_a_positive_integer(steps):
    msg = _refused(steps=steps)
    assert f"steps={steps}" in msg and "positive integer" in msg


@pytest.mark.parametrize("strength", [-0.1, 1.5, math.nan])
def test_image_strength_in_unit_interval(strength):
    msg = _refused(image_strength=strength)
    assert f"image_strength={strength}" in msg and "[0, 1]" in msg


# ---------------------------------------------------------------------------------------------------------- files

def test_missing_image_file_is_named(tmp_path):
    missing = tmp_path / "nope.png"
    msg = _refused(image=str(missing))
    assert msg == f"image: file not found: {missing}"


def test_missing_lora_file_is_named(tmp_path):
    missing = tmp_path / "loras" / "distilled.safetensors"
    msg = _refused(distilled_lora=(str(missing), 1.0))
    assert msg == f"distilled LoRA: file not found: {missing}"


def test_check_file(tmp_path):
    with pytest.raises(V.ValidationError, match="checkpoint: no file given"):
        V.check_file("checkpoint", None)
    assert V.check_file("upscaler", None, required=False) is None
    present = tmp_path / "x.safetensors"
    present.write_bytes(b"")
    assert V.check_file("checkpoint", str(present)) == present
    assert V.check_file("gemma", tmp_path, folder_ok=True) == tmp_path  # a Hugging Face folder
    with pytest.raises(V.ValidationError, match=f"checkpoint: {tmp_path} is a directory, not a file"):
        V.check_file("checkpoint", tmp_path)


def test_check_seed_refuses_negative_and_too_large_seeds():
    V.check_seed(0)
    V.check_seed(2 ** 64 - 1)
    for bad in (-1, 2 ** 64, 1.5):
        with pytest.raises(V.ValidationError, match=f"seed={bad}: must be an integer from 0"):
            V.check_seed(bad)


def test_check_output_refuses_unwritable_destinations_before_any_work(tmp_path):
    assert V.check_output(tmp_path / "new" / "clip.mp4") == tmp_path / "new" / "clip.mp4"
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # nothing left behind
    with pytest.raises(V.ValidationError, match="is a directory; give a file name"):
        V.check_output(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(V.ValidationError, match=f"cannot write {blocker / 'clip.mp4'}: {blocker} is a file"):
        V.check_output(blocker / "clip.mp4")
    with pytest.raises(V.ValidationError, match="cannot write /sys/clip.mp4: no file can be created in /sys"):
        V.check_output("/sys/clip.mp4")  # read-only for root too (permission bits would say writable)


# ------------------------------------------------------------------------------------------------ stage-2 sigmas

@pytest.mark.parametrize("sigmas, rule", [
    ((0.9, 0.95, 0.0), "non-increasing"),
    ((0.9, 0.4), "must end in 0"),
    ((0.5,), "at least 2 values"),
    ((1.5, 0.5, 0.0), "within \\[0, 1\\]"),
    ((0.9, math.nan, 0.0), "non-finite"),
])
def test_bad_stage2_sigmas(sigmas, rule):
    msg = _refused(match=rule, stage2_sigmas=sigmas)
    assert msg.startswith(f"stage2_sigmas={list(sigmas)}: ")


# ---------------------------------------------------------------------------------------------- Gemma vs checkpoint

@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_gemma_width_mismatch_names_both_widths_and_file(tiny_dir, tmp_path, variant):
    projection = load_text_projection(SafetensorsFile(tiny_dir[variant]["checkpoint"]), torch.float32)
    expected_in = TINY_GEMMA_HIDDEN * (TINY_GEMMA_LAYERS + 1)  # 64 × 3 hidden states = 192
    assert projection.in_features == expected_in
    check_gemma_matches(projection, load_gemma(tiny_dir[variant]["gemma"]), tiny_dir[variant]["gemma"])  # fits

    narrow = write_tiny_gemma(tmp_path / "gemma-3-narrow.safetensors", seed=0, hidden_size=32,
                              num_layers=TINY_GEMMA_LAYERS)
    encoder = load_gemma(narrow)
    assert (encoder.hidden_size, encoder.num_hidden_states) == (32, 3)
    with pytest.raises(ValueError) as err:
        check_gemma_matches(projection, encoder, narrow)
    msg = str(err.value)
    assert str(narrow) in msg
    assert "hidden_size 32 x 3" in msg and "= 96 features" in msg  # what the Gemma file gives
    assert f"in_features={expected_in}" in msg and f"LTX-{variant}" in msg  # what the checkpoint expects


# ----------------------------------------------------------------------------------------------- non-finite latents

def test_check_finite_names_stage_and_modality():
    V.check_finite(torch.zeros(1, 8, 128), "stage 1", "video")
    V.check_finite(None, "stage 1", "audio")
    latent = torch.zeros(1, 5, 128)
    latent[0, 1, 3] = math.nan
    latent[0, 2, 7] = math.inf
    latent[0, 4, 0] = -math.inf
    with pytest.raises(FloatingPointError) as err:
        V.check_finite(latent, "stage 2", "audio")
    assert str(err.value).startswith("stage 2: the audio latent has 3 non-finite values")
    latent = torch.ones(1, 4, 128, dtype=torch.bfloat16)
    latent[0, 0, 0] = math.nan
    with pytest.raises(FloatingPointError, match="^stage 1: the video latent has 1 non-finite values"):
        V.check_finite(latent, "stage 1", "video")


@pytest.mark.parametrize("fleet_args, message", [
    ([], "interrupted\n"),
    (["--devices", "cpu:2"], "interrupted (the fleet job is cancelled at its next step; the workers stay loaded)\n"),
])
def test_ctrl_c_says_what_was_interrupted(monkeypatch, capsys, fleet_args, message):
    """Ctrl-C exits with 130; only a fleet run says a fleet job was cancelled (an in-process run has no fleet)."""
    from mgpu_backend.serving import cli

    def interrupted(args, paths=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_generate", interrupted)
    argv = ["generate", "--checkpoint", "c", "--gemma", "g", "--upscaler", "u", "--prompt", "p", *fleet_args]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == message


# ------------------------------------------------------------------------------------- fresh-user findings (h27)

def test_sigma_messages_print_the_values_given_not_float32_noise():
    """`--stage2-sigmas 0.5,0.3` said "ends in 0.30000001192092896" (the float32 value's repr)."""
    from mgpu_backend.engine import sampling as S

    with pytest.raises(ValueError, match=r"must end in 0; ends in 0\.3$"):
        S.as_sigmas([0.5, 0.3])
    with pytest.raises(ValueError, match=r"non-increasing within \[0, 1\]; got \[0\.3, 0\.7, 0\]$"):
        S.as_sigmas([0.3, 0.7, 0.0])


def test_plan_report_gives_the_real_reason_for_a_sub_group():
    """An SP group smaller than the fleet because the user asked for it (`--sp-degree 1` on 2 ranks of 8 heads) was
    reported as "the SP degree must divide the attention heads; 2 does not" — 2 divides 8."""
    from mgpu_backend.splits.plan import ParallelPlan, PlanPolicy

    cpu = torch.device("cpu")
    asked = ParallelPlan.hand_built(0, 2, cpu, PlanPolicy(1, requested_sp_degree=1), heads=8)
    assert asked.describe() == ("sequence parallel on ranks 0-0 of 2 (sp_degree 1 requested); the other ranks wait "
                                "for its result")
    heads = ParallelPlan.hand_built(0, 3, cpu, PlanPolicy(2), heads=8)
    assert heads.describe() == ("sequence parallel on ranks 0-1 of 3 (the SP degree must divide the 8 attention "
                                "heads; 3 does not); the other ranks wait for its result")


def test_in_process_run_refuses_a_size_over_the_token_cap_before_any_work(tiny_dir):
    """In process, a huge size ran into the allocator (an OOM traceback mid-stage); a one-rank fleet refused it by
    its token cap. Now both refuse it the same way, before text encoding (no Gemma needed to reach the check)."""
    from mgpu_backend.models.loader import ComponentFiles, load_components
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    components = load_components(tiny_dir["2.0"]["checkpoint"], ComponentFiles(upsampler=tiny_dir["2.0"]["upsampler"]),
                                 dtype=torch.float32)
    request = GenerateRequest(prompt="p", width=16384, height=16384, frames=121)
    # stage 1 (half size) is the split stage: 16 latent frames of 256 × 256 tokens; one frame fits the cap, and
    # 1,048,576 / 65,536 = 16 ranks would hold it, but the tiny model's 8 heads allow no degree above 8
    with pytest.raises(V.ValidationError, match=r"^1048576 video tokens over 1 rank is 1048576 tokens per rank, "
                                                r"above the cap of 65536; at 16384×16384 the longest clip that fits "
                                                r"1 rank is 1 frame: no sequence-parallel degree up to 8 holds it"):
        TwoStagePipeline(components, gemma=None).generate(request)


def test_a_transformer_only_file_without_its_vae_says_which_file_to_give(tiny_dir, tmp_path):
    """`generate --checkpoint <a diffusion_models/ transformer>` without --video-vae said only "no video VAE weights
    (looked for vae.per_channel_statistics.mean-of-means)"; it now says the file holds a transformer only and names
    the option."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mgpu_backend.models.loader import CheckpointError, load_audio_vae_and_vocoder, load_video_vae

    prefix = "model.diffusion_model."
    with safe_open(str(tiny_dir["2.0"]["checkpoint"]), "pt") as f:
        state = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    path = tmp_path / "transformer-only.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"no video VAE weights \(looked for .*\); it holds a transformer only: "
                                              r"give the video VAE file of its own \(generate's --video-vae"):
        load_video_vae(SafetensorsFile(path), torch.float32)
    with pytest.raises(CheckpointError, match=r"give the audio VAE file of its own \(generate's --audio-vae"):
        load_audio_vae_and_vocoder(SafetensorsFile(path), torch.float32)
    # a file that is no transformer gets no such hint
    with pytest.raises(CheckpointError) as err:
        load_video_vae(SafetensorsFile(tiny_dir["2.0"]["gemma"]), torch.float32)
    assert "transformer only" not in str(err.value)
