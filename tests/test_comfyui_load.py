"""A real ComfyUI loads our tiny single-file checkpoints the way `CheckpointLoaderSimple` does, and computes what we
compute with the same weights.

Runs only where a ComfyUI checkout (0.20.x or later, with native LTX-2) is at hand:

    COMFYUI_DIR=/path/to/ComfyUI [COMFYUI_PYTHON=/path/to/its/python] pytest -m comfyui tests/test_comfyui_load.py

ComfyUI runs in a subprocess with its own interpreter (`COMFYUI_PYTHON`; default `$COMFYUI_DIR/venv/bin/python`,
`$COMFYUI_DIR/.venv/bin/python`, then this interpreter), `--cpu`, so our test environment does not need ComfyUI's
packages. Without `COMFYUI_DIR` the module uses a `comfy` package importable here, and otherwise skips.
(The harness install: COMFYUI_DIR=/tmp/comfyui COMFYUI_PYTHON=/tmp/comfyvenv/bin/python.)

The subprocess (`_DRIVER` below) calls `comfy.sd.load_checkpoint_guess_config` on the float32 tiny file, records
ComfyUI's log, the built model's configuration and key coverage, then runs what the sampler runs for one step:
`model.extra_conds(cross_attn=<CONDITIONING tensor>, unprocessed_ltxav_embeds=True, frame_rate=25,
denoise_mask=<packed>, latent_shapes=...)` and `model.apply_model(packed video+audio latent, sigma, **conds)`,
capturing the diffusion model's raw output (velocities) with a forward hook; then `VAE.decode` of a small latent and
the audio VAE + vocoder exactly as `LTXVAudioVAELoader` / `LTXVAudioVAEDecode` do.

Known ComfyUI differences from the reference (ltx-core 1.0.0, which our components match bit for bit, see
`test_reference_ltx_core.py`), and how the comparison handles them:
- ComfyUI 0.20.x feeds the UNscaled sigma (0.7 instead of 700) to the four audio-video cross-attention AdaLNs
  (`av_ca_*_adaln_single`); fixed upstream by Comfy-Org/ComfyUI#14097 ("pass correct timesteps to cross-attention
  AdaLN modulation"). The driver detects the old code and, for the "scaled" runs, multiplies those four AdaLN inputs
  by `timestep_scale_multiplier` (a forward pre-hook), which is what the fix does for a shared video/audio sigma.
  The unpatched ("as_is") output is checked too: for LTX-2.0 it equals our transformer called with the unscaled
  sigma for the cross-attention timesteps, i.e. that is the only difference.
- ComfyUI builds the attention q/k RMS norms with eps 1e-5, the reference with 1e-6: on these tiny weights that moves
  velocities by ~1.5e-5. The "scaled_eps" run sets the eps to 1e-6 and is compared tightly.
- ComfyUI 0.33 (which has that fix) normalizes the video stream for a block's video→audio cross-attention after the
  block's audio→video update, the reference before it: its forward is compared with the pack's reproduction of
  ComfyUI's forward (`native.NativeEngine`, what the MGPU MODEL and SP Sampler run): measured ≤ 1.9e-6 on velocities
  and x0 at either eps (tolerance ALIGNED_ATOL); the reference denoiser differs from it at O(1e-2) (checked).
Measured on ComfyUI 0.20.1 (YellowRoseCx/ComfyUI @ aa9d2fc7), torch 2.14 CPU vs ours on torch 2.13 CPU, max |x| of
the outputs ~4: context 6.7e-5 / 4.0e-6 (as shipped / eps aligned), velocities 1.4e-5 / 1.9e-6, denoised x0
9e-6 / 1.2e-6, video decode 0.0, mel 1.1e-6, vocoder on the same mel 0.0, 2.0 waveform 2e-7. Tolerances: 2e-4 as
shipped, 2e-5 eps-aligned, 1e-5 for the decoders (5e-3 for the tiny 2.3 audio chain, see its test). The remaining
~1e-6 comes from ComfyUI's CPU attention (sub-quadratic, chunked softmax) and thread-dependent convolution sums.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_backend.engine import latents as L
from mgpu_backend.engine.denoiser import LTX2Denoiser, text_contexts
from mgpu_backend.models.loader import load_components
from mgpu_backend.testing.tiny import build_tiny_modules, tiny_transformer_metadata, write_tiny_checkpoint
from mgpu_backend.engine.sampling import TIMESTEP_SCALE, GuidancePass, ModelInputs

pytestmark = pytest.mark.comfyui

VARIANTS = ("2.0", "2.3")
SHIPPED_ATOL = 2e-4   # ComfyUI as shipped (+ the av-cross-attention timestep fix): q/k-norm eps 1e-5 vs 1e-6
ALIGNED_ATOL = 2e-5   # with the reference's eps: attention algorithm / summation order only
DECODE_ATOL = 1e-5    # measured 0.0: the VAE / vocoder convolutions are the same ops in the same order
UNUSED_VAE_STATS = {"per_channel_statistics.mean-of-stds", "per_channel_statistics.channel",
                    "per_channel_statistics.mean-of-stds_over_std-of-means"}  # stored in the released files too

FRAMES, HEIGHT, WIDTH, AUDIO_FRAMES, PROMPT_TOKENS, FPS, SIGMA = 2, 2, 3, 5, 23, 25.0, 0.7
# the smallest decodes of issue 36 (width × height × frames -> latent (F, H, W)); 96×64×9 is `decode_latent`
SMALL_DECODES = {"64x64x9": (2, 2, 2), "64x96x9": (2, 3, 2), "32x64x9": (2, 2, 1)}

_DRIVER = r'''
import inspect, json, logging, os, sys
sys.path.insert(0, os.getcwd())
ckpt, inputs_path, out_path = sys.argv[1:4]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
records = []
class _Capture(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger().setLevel(logging.DEBUG)
logging.getLogger().addHandler(_Capture(level=logging.DEBUG))
import torch
import comfy.sd, comfy.utils

inputs = torch.load(inputs_path)
# CheckpointLoaderSimple (nodes.py) calls exactly this
model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(ckpt, output_vae=True, output_clip=True,
                                                             embedding_directory=None)
base = model.model
dm = base.diffusion_model
info = {"model_class": type(base).__name__, "diffusion_class": type(dm).__name__, "clip": clip is not None,
        "vae_class": type(vae.first_stage_model).__name__, "dtype": str(base.get_dtype_inference()),
        "vae_dtype": str(vae.vae_dtype), "rope": str(getattr(dm, "split_positional_embedding", None))}
for name in ("num_attention_heads", "attention_head_dim", "audio_num_attention_heads", "audio_attention_head_dim",
             "inner_dim", "audio_inner_dim", "num_layers", "cross_attention_dim", "audio_cross_attention_dim",
             "caption_channels", "cross_attention_adaln", "caption_proj_before_connector", "apply_gated_attention",
             "use_middle_indices_grid", "causal_temporal_positioning", "timestep_scale_multiplier",
             "av_ca_timestep_scale_multiplier"):
    value = getattr(dm, name, None)
    info[name] = value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
info["connectors"] = {}
for c in ("video_embeddings_connector", "audio_embeddings_connector"):
    conn = getattr(dm, c)
    info["connectors"][c] = [conn.num_attention_heads, conn.inner_dim // conn.num_attention_heads,
                             len(conn.transformer_1d_blocks)]
file_keys = set(comfy.utils.load_torch_file(ckpt).keys())
unet_file = {k[len("model.diffusion_model."):] for k in file_keys if k.startswith("model.diffusion_model.")}
unet_model = set(dm.state_dict().keys())
info["unet_missing"], info["unet_unexpected"] = sorted(unet_model - unet_file), sorted(unet_file - unet_model)
vae_file = {k[len("vae."):] for k in file_keys if k.startswith("vae.")}
vae_model = set(vae.first_stage_model.state_dict().keys())
info["vae_missing"], info["vae_unexpected"] = sorted(vae_model - vae_file), sorted(vae_file - vae_model)
source = inspect.getsource(type(dm)._prepare_timestep)
info["av_ca_unscaled"] = "timestep.max().expand_as(a_timestep_flat) * av_ca_factor" in source

def run_forward():
    video, audio, sigma = inputs["video"], inputs["audio"], inputs["sigma"]
    x, shapes = comfy.utils.pack_latents([video, audio])
    mask, _ = comfy.utils.pack_latents([inputs["video_mask"].expand_as(video), inputs["audio_mask"].expand_as(audio)])
    conds = base.extra_conds(cross_attn=inputs["cond"], unprocessed_ltxav_embeds=True, frame_rate=inputs["fps"],
                             device=torch.device("cpu"), denoise_mask=mask, latent_shapes=shapes)
    kwargs = {k: v.cond for k, v in conds.items()}
    raw = {}
    hook = dm.register_forward_hook(lambda module, args, output: raw.setdefault("out", output))
    try:
        denoised = base.apply_model(x, sigma, **kwargs)
    finally:
        hook.remove()
    video_x0, audio_x0 = comfy.utils.unpack_latents(denoised, shapes)
    return {"context": kwargs["c_crossattn"].float(), "velocity_video": raw["out"][0].float(),
            "velocity_audio": raw["out"][1].float(), "x0_video": video_x0.float(), "x0_audio": audio_x0.float()}

def scale_av_ca_inputs():
    return [getattr(dm, name).register_forward_pre_hook(
                lambda module, args: (args[0] * dm.timestep_scale_multiplier, *args[1:]))
            for name in ("av_ca_video_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single",
                         "av_ca_audio_scale_shift_adaln_single", "av_ca_v2a_gate_adaln_single")]

out = {}
with torch.no_grad():
    out["as_is"] = run_forward()
    handles = scale_av_ca_inputs() if info["av_ca_unscaled"] else []
    out["scaled"] = run_forward()
    norms = [m for n, m in dm.named_modules() if n.endswith(("q_norm", "k_norm"))]
    info["qk_norm_eps"] = sorted({float(m.eps) for m in norms})
    for m in norms:
        m.eps = 1e-6
    out["scaled_eps"] = run_forward()
    for h in handles:
        h.remove()
    out["decoded"] = vae.decode(inputs["decode_latent"]).float()
    # VAEDecode (VAE.decode) at the smallest sizes: what it decodes, and the error where it cannot
    info["small_decode_errors"] = {}
    for name, latent in inputs["small_decode_latents"].items():
        try:
            out["small_decoded/" + name] = vae.decode(latent).float()
        except Exception as exc:
            info["small_decode_errors"][name] = f"{type(exc).__name__}: {exc}"
    # LTXVAudioVAELoader (comfy_extras/nodes_lt_audio.py) re-reads the checkpoint: audio_vae.* -> autoencoder.*
    sd, metadata = comfy.utils.load_torch_file(ckpt, return_metadata=True)
    sd = comfy.utils.state_dict_prefix_replace(sd, {"audio_vae.": "autoencoder.", "vocoder.": "vocoder."},
                                               filter_keys=True)
    audio_vae = comfy.sd.VAE(sd=sd, metadata=metadata)
    audio_vae.throw_exception_if_invalid()
    info["audio_vae_class"] = type(audio_vae.first_stage_model).__name__
    info["audio_sample_rate"] = int(audio_vae.first_stage_model.output_sample_rate)
    audio_model = set(audio_vae.first_stage_model.state_dict().keys())
    info["audio_vae_missing"] = sorted(audio_model - set(sd))
    info["audio_vae_unexpected"] = sorted(set(sd) - audio_model)
    # LTXVAudioVAEDecode: waveform [B, C, S]; the mel spectrogram on the way is captured too
    mels = []
    run_vocoder = audio_vae.first_stage_model.run_vocoder
    audio_vae.first_stage_model.run_vocoder = lambda mel: (mels.append(mel), run_vocoder(mel))[1]
    out["waveform"] = audio_vae.decode(inputs["decode_audio_latent"]).movedim(-1, 1).float()
    out["mel"] = mels[0].float()
    # the vocoder alone on a given mel [B, 2, T, 64]
    out["vocoder"] = run_vocoder(inputs["mel"]).float()
torch.save(out, out_path)
info["log"] = records
print("RESULT " + json.dumps(info))
'''


def _find_comfyui() -> tuple[Path, str] | None:
    """(ComfyUI checkout, python to run it with), or None."""
    directory = os.environ.get("COMFYUI_DIR")
    if directory:
        root = Path(directory)
        python = os.environ.get("COMFYUI_PYTHON")
        if not python:
            candidates = [root / "venv" / "bin" / "python", root / ".venv" / "bin" / "python"]
            python = next((str(c) for c in candidates if c.exists()), sys.executable)
        return root, python
    spec = importlib.util.find_spec("comfy")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).parent, sys.executable
    return None


def _subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.fixture(scope="module")
def comfyui() -> tuple[Path, str]:
    found = _find_comfyui()
    if found is None:
        pytest.skip("no ComfyUI: set COMFYUI_DIR (and COMFYUI_PYTHON) to a ComfyUI checkout with native LTX-2")
    root, python = found
    if not (root / "comfy" / "sd.py").is_file():
        pytest.skip(f"COMFYUI_DIR={root} is not a ComfyUI checkout (no comfy/sd.py)")
    probe = subprocess.run([python, "-c", "import sys, os; sys.path.insert(0, os.getcwd()); sys.argv = ['x', '--cpu']; "
                            "import comfy.options; comfy.options.enable_args_parsing(); "
                            "import comfy.ldm.lightricks.av_model"], cwd=root, env=_subprocess_env(),
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"ComfyUI at {root} cannot import its LTX-2 model with {python}: {probe.stderr.strip()[-300:]}")
    return root, python


def _inputs(variant: str, width: int) -> dict:
    g = torch.Generator().manual_seed(11)
    video_mask = torch.ones(1, 1, FRAMES, 1, 1)
    video_mask[:, :, 0] = 0.0  # image-to-video style: the first latent frame is clean (per-token timestep 0)
    return {
        "video": torch.randn(1, 128, FRAMES, HEIGHT, WIDTH, generator=g),
        "audio": torch.randn(1, 8, AUDIO_FRAMES, 16, generator=g),
        "sigma": torch.tensor([SIGMA]),
        "video_mask": video_mask,
        "audio_mask": torch.ones(1, 1, AUDIO_FRAMES, 1),
        "cond": torch.randn(1, PROMPT_TOKENS, width, generator=g),  # CONDITIONING tensor (before the connectors)
        "fps": FPS,
        "decode_latent": torch.randn(1, 128, 2, 2, 3, generator=g),
        "decode_audio_latent": torch.randn(1, 8, 6, 16, generator=g),
        "mel": torch.randn(1, 2, 13, 64, generator=g),
        # width × height × frames -> a model-space latent (its own generator: the inputs above stay as they were)
        "small_decode_latents": {name: torch.randn(1, 128, *grid, generator=torch.Generator().manual_seed(21))
                                 for name, grid in SMALL_DECODES.items()},
    }


@pytest.fixture(scope="module")
def runs(comfyui, tmp_path_factory) -> dict[str, dict]:
    """variant -> {"info", "out" (ComfyUI's tensors), "inputs", "ours" (our components), "path"}."""
    root, python = comfyui
    work = tmp_path_factory.mktemp("comfyui_load")
    driver = work / "driver.py"
    driver.write_text(_DRIVER)
    result = {}
    for variant in VARIANTS:
        path = write_tiny_checkpoint(work / f"ltx-{variant}-tiny.safetensors", variant, seed=3, dtype=torch.float32,
                                     modules=build_tiny_modules(variant, 3))
        ours = load_components(path, dtype=torch.float32)
        width = ours.video_connector.inner_dim + (ours.audio_connector.inner_dim if variant == "2.3" else 0)
        inputs = _inputs(variant, width)
        torch.save(inputs, work / f"in-{variant}.pt")
        proc = subprocess.run([python, str(driver), str(path), str(work / f"in-{variant}.pt"),
                               str(work / f"out-{variant}.pt")], cwd=root, env=_subprocess_env(),
                              capture_output=True, text=True, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"ComfyUI driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        result[variant] = {"info": json.loads(lines[-1][len("RESULT "):]), "inputs": inputs, "ours": ours,
                           "out": torch.load(work / f"out-{variant}.pt"), "path": path}
    return result


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.float() - b.float()).abs().max().item()


def _our_forward(run: dict, cross_sigma_scale: float = TIMESTEP_SCALE):
    """Our denoiser forward on the driver's inputs -> (video velocity [1,128,F,H,W], audio [1,8,T,16], context).

    `cross_sigma_scale` != 1000 emulates ComfyUI 0.20.x's unscaled cross-attention AdaLN input (2.0 only: for 2.3 the
    same sigma also drives the prompt AdaLN)."""
    comps, inputs = run["ours"], run["inputs"]
    tr = comps.transformer
    ctx = text_contexts(comps, [inputs["cond"]], dtype=torch.float32)
    sigma = inputs["sigma"]
    v_steps = L.video_token_mask(inputs["video_mask"], 1, FRAMES, HEIGHT, WIDTH) * sigma
    a_steps = L.audio_token_mask(inputs["audio_mask"], 1, AUDIO_FRAMES) * sigma
    denoiser = LTX2Denoiser(tr, ctx, None, L.video_coords(tr, 1, FRAMES, HEIGHT, WIDTH, FPS),
                            L.audio_coords(tr, 1, AUDIO_FRAMES), torch.float32)
    cross_sigma = sigma * cross_sigma_scale / TIMESTEP_SCALE
    v, a = denoiser(ModelInputs(L.pack_video(inputs["video"]), L.pack_audio(inputs["audio"]), v_steps, a_steps,
                                cross_sigma, cross_sigma, GuidancePass("cond"), 0))
    return L.unpack_video(v, FRAMES, HEIGHT, WIDTH), L.unpack_audio(a), ctx


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_loader_builds_ltxav_without_key_complaints(variant, runs):
    info = runs[variant]["info"]
    meta = tiny_transformer_metadata(variant)
    log = [message for _, message in info["log"]]
    assert info["model_class"] == "LTXAV" and info["diffusion_class"] == "LTXAVModel"
    assert info["unet_missing"] == [] and info["unet_unexpected"] == []
    assert not [m for m in log if m.startswith(("unet missing", "unet unexpected"))], log
    assert info["vae_class"] == "VideoVAE" and info["vae_missing"] == []
    assert set(info["vae_unexpected"]) <= UNUSED_VAE_STATS  # ComfyUI logs these at DEBUG, as for the released files
    assert not [m for m in log if "Missing VAE keys" in m], log
    assert not [(lvl, m) for lvl, m in info["log"] if lvl in ("WARNING", "ERROR") and "VAE" in m]
    assert not info["clip"]  # no text encoder in an LTX-2 checkpoint; ComfyUI loads Gemma from text_encoders/
    assert info["dtype"] == info["vae_dtype"] == "torch.float32"
    # the architecture ComfyUI built from the metadata = ours
    for key in ("num_attention_heads", "attention_head_dim", "audio_num_attention_heads", "audio_attention_head_dim",
                "num_layers", "cross_attention_dim", "audio_cross_attention_dim", "caption_channels"):
        assert info[key] == meta[key], key
    assert info["inner_dim"] == 64 and info["audio_inner_dim"] == 32
    assert info["rope"].endswith("SPLIT") and info["use_middle_indices_grid"] is True
    assert info["causal_temporal_positioning"] is True
    assert info["timestep_scale_multiplier"] == info["av_ca_timestep_scale_multiplier"] == 1000
    v23 = variant == "2.3"
    assert info["cross_attention_adaln"] is v23 and info["caption_proj_before_connector"] is v23
    assert info["apply_gated_attention"] is v23
    assert info["connectors"]["video_embeddings_connector"] == [8, 8, 1]
    assert info["connectors"]["audio_embeddings_connector"] == ([8, 4, 1] if v23 else [8, 8, 1])
    # the audio VAE + vocoder loader (LTXVAudioVAELoader) on the same file
    assert info["audio_vae_class"] == "AudioVAE"
    assert info["audio_vae_missing"] == [] and info["audio_vae_unexpected"] == []
    assert info["audio_sample_rate"] == runs[variant]["ours"].vocoder.config.output_sampling_rate


@pytest.mark.parametrize("variant", VARIANTS)
def test_connector_context_matches(variant, runs):
    """ComfyUI's `preprocess_text_embeds` (connectors on the unprocessed CONDITIONING: valid tokens first, learnable
    registers appended up to 1024) = our `text_contexts` (left padding replaced by the same registers)."""
    run = runs[variant]
    _, _, ctx = _our_forward(run)
    ours = torch.cat([ctx.video, ctx.audio], dim=-1)
    assert _max_diff(run["out"]["as_is"]["context"], ours) <= SHIPPED_ATOL  # measured 6.7e-5
    assert _max_diff(run["out"]["scaled_eps"]["context"], ours) <= ALIGNED_ATOL  # measured 4.0e-6


def _our_comfy_forward(run: dict, eps: float | None = None):
    """ComfyUI's LTX-AV forward as the pack runs it (`native.NativeEngine`: the MGPU MODEL's forward and the SP
    Sampler's, semantics "comfyui") on the driver's inputs -> (video velocity [1,128,F,H,W], audio [1,8,T,16]).
    `eps` None: ComfyUI's q/k eps (1e-5) as the engine runs it; else that eps in the connectors and the transformer
    (the driver's "scaled_eps" run)."""
    from mgpu_backend.protocol.native_forward import ForwardRequest, PreprocessTextRequest
    from mgpu_backend.splits.apply import apply_plan
    from mgpu_backend.stages.native import NativeEngine, comfy_qk_eps, qk_norms

    comps, inputs = run["ours"], run["inputs"]
    engine = NativeEngine(comps, None, torch.float32, "cpu")
    sigma = inputs["sigma"]
    v_ts = (inputs["video_mask"].expand(1, 1, FRAMES, HEIGHT, WIDTH) * sigma).reshape(1, -1, 1)
    a_ts = (inputs["audio_mask"].expand(1, 1, AUDIO_FRAMES, 1) * sigma).reshape(1, -1, 1)

    def request(context):
        return ForwardRequest(video=inputs["video"], audio=inputs["audio"], video_timestep=v_ts, audio_timestep=a_ts,
                              context=context, frame_rate=FPS)

    if eps is None:
        context = engine.preprocess_text(PreprocessTextRequest(context=inputs["cond"], unprocessed=True)).context
        result = engine.forward(request(context), context)
        return result.video, result.audio
    norms = qk_norms(comps.transformer, comps.video_connector, comps.audio_connector)
    with torch.no_grad(), comfy_qk_eps(norms, eps):
        tc = text_contexts(comps, [inputs["cond"]], dtype=torch.float32)
        req = request(torch.cat([tc.video, tc.audio], dim=-1))
        prepared = engine.prepare(req, req.context)
        apply_plan(engine.transformer, engine.local_split.plan, engine.local_split.exchange)
        video, audio = engine.run_rows(prepared, [0], engine.local_split, req.options)
        return engine.unpack(prepared, video, audio, torch.float32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformer_forward_matches(variant, runs):
    """One sampler step's model call in ComfyUI (packed latent, per-token denoise mask, CONDITIONING through
    `extra_conds`) = ComfyUI's forward as the pack runs it (`native.NativeEngine`: MGPU MODEL and SP Sampler),
    velocities and ComfyUI's denoised x0 = x - sigma·v. ComfyUI 0.33's block normalizes the video stream for the
    video→audio cross-attention after the audio→video update; the reference (ltx-core, diffusers, our CLI) before
    it, so the reference denoiser differs from ComfyUI 0.33 at O(1e-2) on these weights (checked too)."""
    run = runs[variant]
    if run["info"]["av_ca_unscaled"]:
        pytest.skip("ComfyUI 0.20.x (before Comfy-Org/ComfyUI#14097): the pack follows ComfyUI 0.33")
    for mode, eps in (("scaled", None), ("scaled_eps", 1e-6)):
        video_v, audio_v = _our_comfy_forward(run, eps)
        out = run["out"][mode]
        diffs = [_max_diff(out["velocity_video"], video_v), _max_diff(out["velocity_audio"], audio_v),
                 _max_diff(out["x0_video"], run["inputs"]["video"] - SIGMA * video_v),
                 _max_diff(out["x0_audio"], run["inputs"]["audio"] - SIGMA * audio_v)]
        print(f"{variant} {mode}: max |ComfyUI - ours| velocity video / audio, x0 video / audio = "
              + ", ".join(f"{d:.1e}" for d in diffs))
        assert max(diffs) <= ALIGNED_ATOL, (mode, diffs)
    reference_v, _, _ = _our_forward(run)  # the reference's block order (the CLI's semantics)
    assert _max_diff(run["out"]["scaled"]["velocity_video"], reference_v) > 10 * ALIGNED_ATOL


def test_comfyui_020_cross_attention_timestep_is_the_only_difference(runs):
    """Unpatched ComfyUI 0.20.x (before Comfy-Org/ComfyUI#14097) = our LTX-2.0 transformer fed the unscaled sigma
    for the audio-video cross-attention AdaLNs; with the reference's scaling the outputs differ by O(1)."""
    run = runs["2.0"]
    if not run["info"]["av_ca_unscaled"]:
        pytest.skip("this ComfyUI already scales the cross-attention AdaLN timesteps (Comfy-Org/ComfyUI#14097)")
    video_v, audio_v, _ = _our_forward(run, cross_sigma_scale=1.0)
    out = run["out"]["as_is"]
    assert _max_diff(out["velocity_video"], video_v) <= SHIPPED_ATOL  # measured 1.4e-5
    assert _max_diff(out["velocity_audio"], audio_v) <= SHIPPED_ATOL
    reference_v, _, _ = _our_forward(run)
    assert _max_diff(out["velocity_video"], reference_v) > 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_vae_decode_matches(variant, runs):
    """ComfyUI `VAE.decode` (model-space latent; un-normalizes with the file's statistics, [0, 1] frames) = ours."""
    run = runs[variant]
    vae = run["ours"].video_vae
    latent = run["inputs"]["decode_latent"]
    with torch.no_grad():
        pixels = vae.decode(L.denormalize_latents(latent, vae.latents_mean, vae.latents_std), return_dict=False)[0]
    frames = ((pixels.clamp(-1, 1) + 1) / 2)[0].permute(1, 2, 3, 0)  # [F, H, W, 3]
    got = run["out"]["decoded"]
    assert got.shape[-4:] == frames.shape == (9, 64, 96, 3)
    assert _max_diff(got.reshape(frames.shape), frames) <= DECODE_ATOL  # measured 0.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_audio_decode_matches(variant, runs):
    """ComfyUI `LTXVAudioVAEDecode` (audio VAE + vocoder; 2.3: bandwidth extension to 48 kHz) = our audio VAE decode
    of the de-normalized latent followed by our vocoder; and the vocoder alone on the same mel.

    The whole chain for 2.3 gets a looser bound: the tiny random BigVGAN generators have a gain of ~50 per stage, so
    the ~1e-6 float noise of the audio decoder (it changes with the CPU thread count: 8e-7 between 1 and 2 threads)
    reaches the waveform as ~5e-4. On the same mel the vocoders agree exactly."""
    run = runs[variant]
    audio_vae, vocoder = run["ours"].audio_vae, run["ours"].vocoder
    latent = run["inputs"]["decode_audio_latent"]
    with torch.no_grad():
        mel = audio_vae.decode(L.denormalize_audio_latents(latent, audio_vae.latents_mean, audio_vae.latents_std),
                               return_dict=False)[0]
        waveform = vocoder(mel)
        alone = vocoder(run["inputs"]["mel"])
    assert _max_diff(run["out"]["mel"], mel) <= DECODE_ATOL  # measured <= 1.1e-6
    assert _max_diff(run["out"]["vocoder"], alone) <= DECODE_ATOL  # measured 0.0
    chain_atol = 5e-3 if variant == "2.3" else DECODE_ATOL  # measured 0.0-5.7e-4 (2.3), 0.0 (2.0)
    assert _max_diff(run["out"]["waveform"], waveform) <= chain_atol


@pytest.mark.parametrize("variant", VARIANTS)
def test_default_distributed_decode_is_vaedecode_at_the_smallest_sizes(variant, runs):
    """Distributed Decode's default tiles for 2 ranks (what the decode job resolves) at 64×64×9, 96×64×9 and
    64×96×9: one tile — a tile under 256 px would be mostly seam — so the decode is ComfyUI 0.33's VAEDecode
    (`VAE.decode`) to DECODE_ATOL (the 2-rank run equals this one-process run bit for bit: `test_decode.py`).
    At 32×64×9 (1 latent cell wide) VAEDecode fails inside its first convolution, and ours refuses before decoding
    saying so: the refusal's "ComfyUI's VAEDecode fails the same" is true. (Before issue 36: 64×64 was refused with
    that claim although VAEDecode decodes it, and 96×64 came out in two 2-cell tiles, far from VAEDecode.)"""
    from mgpu_backend.splits.decode import decode_tiles
    from mgpu_backend.stages.pipelines import TwoStagePipeline

    run = runs[variant]
    vae = run["ours"].video_vae
    cases = {"96x64x9": run["inputs"]["decode_latent"], **run["inputs"]["small_decode_latents"]}
    for name, latent in cases.items():
        tiling = TwoStagePipeline.resolve_tiling(None, 2, tuple(latent.shape[2:]), 2, "decode tiles")
        x = L.denormalize_latents(latent, vae.latents_mean, vae.latents_std)
        if name == "32x64x9":
            assert "Padding size should be less than" in run["info"]["small_decode_errors"][name], run["info"]
            with pytest.raises(ValueError, match=r"the latent is 1 latent cell \(32 px\) in width; .*\(ComfyUI's "
                                                 r"VAEDecode fails the same\)"):
                decode_tiles(vae, x, tiling)
            continue
        assert tiling.num_tiles == 1 and name not in run["info"]["small_decode_errors"], (name, tiling)
        pixels, _ = decode_tiles(vae, x, tiling)
        frames = ((pixels.clamp(-1, 1) + 1) / 2)[0].permute(1, 2, 3, 0)  # [F, H, W, 3]
        got = run["out"]["decoded"] if name == "96x64x9" else run["out"]["small_decoded/" + name]
        assert _max_diff(got.reshape(frames.shape), frames) <= DECODE_ATOL, name
