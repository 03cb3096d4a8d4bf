"""TEST-ONLY nodes, registered only when the environment has LTX2_MGPU_TEST_NODES=1 (`test_nodes()`).

ComfyUI's own LTX-2 text encoder hard-codes Gemma-3-12B, so a test on the tiny models cannot make native CONDITIONING
with it. These nodes stand in for it and for an upstream ComfyUI fix, so that tests can drive ComfyUI's native
samplers and ours on the same inputs:

- **Test Conditioning (MGPU)** (`LTX2MGPU_TestConditioning`): positive and negative CONDITIONING in the native
  unprocessed LTX-2 form (`[[embeds [1, T, C], {"pooled_output": None, "unprocessed_ltxav_embeds": True,
  "frame_rate": fps}]]`, what ComfyUI's LTX-2 text encoder + LTXVConditioning make), either
  - `random`: `torch.randn` from one CPU generator seeded with `seed`, positive `[1, positive_tokens, width]` drawn
    first, then negative `[1, negative_tokens, width]` (`random_embeddings()`; tests regenerate them without
    ComfyUI), or
  - `tiny gemma`: the prompts through a (tiny) Gemma file and the checkpoint's text projection, in this process,
    with the engine's Gemma loader and feature extractor (valid tokens only, as Text Encode (MGPU) returns them).
- **Test Tiny Gemma 4 CLIP (MGPU)** (`LTX2MGPU_TestTinyCLIP`): ComfyUI's CLIPLoader (ltxv) for a tiny Gemma 4 file,
  the tiny widths given as ComfyUI's own `_model_config` override: a native CLIP for CLIPTextEncode and core's
  Select CLIP Device.
- **Test LTXAV Reference Fix (MGPU)** (`LTX2MGPU_TestLTXAVFix`): a MODEL patch for golden runs. ComfyUI 0.20.x feeds
  the unscaled sigma to the four audio-video cross-attention AdaLNs (fixed upstream by Comfy-Org/ComfyUI#14097) and
  builds the attention q/k RMS norms with eps 1e-5 (the reference: 1e-6). The patch (a `model_function_wrapper`,
  active only during this model's forwards) scales those AdaLN inputs by `timestep_scale_multiplier` as the fix
  does, and optionally sets the q/k norm eps; on a ComfyUI that already has the fix the scaling is skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from comfy_api.latest import io

from .widgets import read_widgets

CATEGORY = "LTX-2 Multi-GPU/testing"
ENV = "LTX2_MGPU_TEST_NODES"
SOURCES = ("random", "tiny gemma")
AV_CA_ADALNS = ("av_ca_video_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single",
                "av_ca_audio_scale_shift_adaln_single", "av_ca_v2a_gate_adaln_single")


def random_embeddings(seed: int, positive_tokens: int, negative_tokens: int, width: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `random` source: (positive `[1, Tp, C]`, negative `[1, Tn, C]`) float32, one CPU generator, positive
    first."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    positive = torch.randn(1, int(positive_tokens), int(width), generator=g, dtype=torch.float32)
    negative = torch.randn(1, int(negative_tokens), int(width), generator=g, dtype=torch.float32)
    return positive, negative


def native_conditioning(embeds: torch.Tensor, frame_rate: float) -> list:
    return [[embeds.contiguous(), {"pooled_output": None, "unprocessed_ltxav_embeds": True,
                                   "frame_rate": float(frame_rate)}]]


def _gemma_embeddings(gemma_path: str, checkpoint_path: str, prompts: list[str]) -> list[torch.Tensor]:
    from ..mgpu_backend.models.gemma import load_gemma
    from ..mgpu_backend.models.loader import SafetensorsFile, load_text_projection

    encoder = load_gemma(gemma_path, dtype=torch.float32)
    projection = load_text_projection(SafetensorsFile(checkpoint_path), torch.float32)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden, mask = encoder.encode([prompt])
            embeds = projection(hidden, mask)
            valid = int(mask[0].sum())
            out.append(embeds[:, embeds.shape[1] - valid:].float().cpu().contiguous())
    return out


@dataclass(frozen=True)
class ConditioningWidgets:
    """Test Conditioning's widgets: source (`SOURCES`), seed / positive_tokens / negative_tokens / width of the random
    embeddings, frame_rate, the prompts and the gemma / checkpoint file names of the tiny gemma source."""

    source: str
    seed: int
    positive_tokens: int
    negative_tokens: int
    width: int
    frame_rate: float
    prompt: str
    negative_prompt: str
    gemma: str
    checkpoint: str


class TestConditioningMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        def files(folder):
            try:
                return ["none"] + sorted(folder_paths.get_filename_list(folder))
            except KeyError:
                return ["none"]

        return io.Schema(
            node_id="LTX2MGPU_TestConditioning",
            display_name="Test Conditioning (MGPU)",
            category=CATEGORY,
            description="TEST ONLY (LTX2_MGPU_TEST_NODES=1): native LTX-2 CONDITIONING from seeded random embeddings "
                        "or a tiny Gemma, for tests on tiny models where ComfyUI's Gemma-3-12B encoder cannot run.",
            is_dev_only=True,
            inputs=[
                io.Combo.Input("source", options=list(SOURCES), default="random",
                               tooltip="random: seeded torch.randn embeddings (positive first, then negative). "
                                       "tiny gemma: the prompts through the Gemma file and the checkpoint's text "
                                       "projection."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, tooltip="Seed of the random embeddings."),
                io.Int.Input("positive_tokens", default=16, min=1, max=1024,
                             tooltip="Tokens of the random positive embeddings."),
                io.Int.Input("negative_tokens", default=11, min=1, max=1024,
                             tooltip="Tokens of the random negative embeddings."),
                io.Int.Input("width", default=64, min=1, max=16384,
                             tooltip="Embedding width of the random source: the checkpoint's caption_channels "
                                     "(LTX-2.0) or video + audio connector width (LTX-2.3)."),
                io.Float.Input("frame_rate", default=25.0, min=1.0, max=240.0, step=0.01,
                               tooltip="frame_rate written into the conditioning (as LTXVConditioning does)."),
                io.String.Input("prompt", default="a tiny test clip", multiline=True,
                                tooltip="Positive prompt (tiny gemma source)."),
                io.String.Input("negative_prompt", default="", multiline=True,
                                tooltip="Negative prompt (tiny gemma source)."),
                io.Combo.Input("gemma", options=files("text_encoders"), default="none",
                               tooltip="Gemma file (tiny gemma source)."),
                io.Combo.Input("checkpoint", options=files("checkpoints"), default="none",
                               tooltip="Checkpoint whose text projection maps Gemma's hidden states (tiny gemma "
                                       "source)."),
            ],
            outputs=[io.Conditioning.Output(display_name="positive"),
                     io.Conditioning.Output(display_name="negative")],
        )

    @classmethod
    def execute(cls, **widgets) -> io.NodeOutput:
        # ComfyUI passes every widget by name: read into one record at once
        w = read_widgets(ConditioningWidgets, widgets, "Test Conditioning (MGPU)")
        if w.source == "random":
            positive, negative = random_embeddings(w.seed, w.positive_tokens, w.negative_tokens, w.width)
        elif w.source == "tiny gemma":
            import folder_paths

            if "none" in (w.gemma, w.checkpoint):
                raise ValueError("Test Conditioning (MGPU): the tiny gemma source needs a gemma file and a checkpoint")
            positive, negative = _gemma_embeddings(folder_paths.get_full_path_or_raise("text_encoders", w.gemma),
                                                   folder_paths.get_full_path_or_raise("checkpoints", w.checkpoint),
                                                   [w.prompt, w.negative_prompt])
        else:
            raise ValueError(f"Test Conditioning (MGPU): source={w.source!r}: choose one of {', '.join(SOURCES)}")
        return io.NodeOutput(native_conditioning(positive, w.frame_rate), native_conditioning(negative, w.frame_rate))


def comfy_has_av_ca_fix(diffusion_model) -> bool:
    """False on ComfyUI 0.20.x, whose `_prepare_timestep` feeds the unscaled sigma to the cross-attention AdaLNs."""
    import inspect

    try:
        source = inspect.getsource(type(diffusion_model)._prepare_timestep)
    except (AttributeError, OSError, TypeError):
        return True
    return "timestep.max().expand_as(a_timestep_flat) * av_ca_factor" not in source


class TestLTXAVFixMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_TestLTXAVFix",
            display_name="Test LTXAV Reference Fix (MGPU)",
            category=CATEGORY,
            description="TEST ONLY (LTX2_MGPU_TEST_NODES=1): patches ComfyUI's LTXAV model towards the reference for "
                        "golden runs: the audio-video cross-attention AdaLN timestep scaling of Comfy-Org/ComfyUI#14097 "
                        "and the q/k RMS-norm eps.",
            is_dev_only=True,
            inputs=[
                io.Model.Input("model", tooltip="An LTXAV model (CheckpointLoaderSimple)."),
                io.Boolean.Input("fix_av_cross_attention_timesteps", default=True,
                                 tooltip="Scale the four av_ca_* AdaLN inputs by timestep_scale_multiplier (as "
                                         "ComfyUI#14097); skipped on a ComfyUI that already does."),
                io.Float.Input("qk_norm_eps", default=0.0, min=0.0, max=1e-3, step=1e-7,
                               tooltip="eps of the attention q/k RMS norms during the forward (0 = ComfyUI's own, "
                                       "1e-5; the reference uses 1e-6)."),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, fix_av_cross_attention_timesteps, qk_norm_eps) -> io.NodeOutput:
        fix, eps = bool(fix_av_cross_attention_timesteps), float(qk_norm_eps)
        previous = model.model_options.get("model_function_wrapper")

        def wrapper(apply_model, args):
            dm = apply_model.__self__.diffusion_model
            handles, saved = [], []
            try:
                if fix and not comfy_has_av_ca_fix(dm):
                    scale = float(dm.timestep_scale_multiplier)
                    for name in AV_CA_ADALNS:
                        handles.append(getattr(dm, name).register_forward_pre_hook(
                            lambda module, a, s=scale: (a[0] * s, *a[1:])))
                if eps > 0:
                    for name, module in dm.named_modules():
                        if name.endswith(("q_norm", "k_norm")) and hasattr(module, "eps"):
                            saved.append((module, module.eps))
                            module.eps = eps
                if previous is not None:
                    return previous(apply_model, args)
                return apply_model(args["input"], args["timestep"], **args["c"])
            finally:
                for h in handles:
                    h.remove()
                for module, value in saved:
                    module.eps = value

        patched = model.clone()
        patched.set_model_unet_function_wrapper(wrapper)
        return io.NodeOutput(patched)


class TestTinyCLIPMGPU(io.ComfyNode):
    """ComfyUI's CLIPLoader (`type="ltxv"`) for a tiny Gemma 4 file: what `nodes.CLIPLoader.load_clip` does —
    `comfy.sd.load_clip(ckpt_paths=[file], embedding_directory=…, clip_type=LTXV, model_options=…)` — with ComfyUI's
    own per-model config override `model_options["_model_config"]` (read by `sd1_clip.SDClipModel`) carrying the tiny
    widths: ComfyUI builds the 12B from its hard-coded `Gemma4_12B_Config` otherwise. Everything else (the file's
    detection, the LTXAV text encoder, its tokenizer, the bundled projection) is ComfyUI's, so ComfyUI's CLIP nodes
    (CLIPTextEncode, Select CLIP Device) can run in front of the pack on the tiny models."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id="LTX2MGPU_TestTinyCLIP",
            display_name="Test Tiny Gemma 4 CLIP (MGPU)",
            category=CATEGORY,
            description="TEST ONLY (LTX2_MGPU_TEST_NODES=1): ComfyUI's CLIPLoader (ltxv) for a tiny Gemma 4 file, "
                        "the tiny widths given as ComfyUI's _model_config override.",
            is_dev_only=True,
            inputs=[io.Combo.Input("clip_name", options=sorted(folder_paths.get_filename_list("text_encoders")),
                                   tooltip="The tiny Gemma 4 file (with its text projection) in text_encoders/."),
                    io.String.Input("model_config", default="{}", multiline=True,
                                    tooltip="JSON: the Gemma 4 config ComfyUI builds instead of the 12B's "
                                            "(mgpu_backend.testing.tiny_gemma4.tiny_comfy_config()).")],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, clip_name, model_config) -> io.NodeOutput:
        import json

        import comfy.sd
        import folder_paths

        path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        clip = comfy.sd.load_clip(ckpt_paths=[path], embedding_directory=folder_paths.get_folder_paths("embeddings"),
                                  clip_type=comfy.sd.CLIPType.LTXV,
                                  model_options={"_model_config": json.loads(model_config)})
        return io.NodeOutput(clip)


TEST_NODES: list[type[io.ComfyNode]] = [TestConditioningMGPU, TestLTXAVFixMGPU, TestTinyCLIPMGPU]


def test_nodes() -> list[type[io.ComfyNode]]:
    """The test-only nodes when LTX2_MGPU_TEST_NODES=1, else none."""
    return list(TEST_NODES) if os.environ.get(ENV) == "1" else []
