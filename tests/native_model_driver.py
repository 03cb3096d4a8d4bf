"""Driver for tests/test_native_model_comfyui.py: runs INSIDE a real ComfyUI (its Python, cwd = the ComfyUI checkout)
and samples the same graphs twice — with ComfyUI's native LTX-AV MODEL (`comfy.sd.load_diffusion_model` on the tiny
checkpoint) and with the pack's MGPU MODEL (`nodes.native_model.build_native_model`: no weights in this process,
every transformer call through a transport) — then prints one JSON line `RESULT {case: {max_abs, max_ref, …}}`.

    cd $COMFYUI_DIR && $COMFYUI_PYTHON PACK/tests/native_model_driver.py CHECKPOINT OUT.json \
        --transport local|fleet [--world-size W] [--cases t2v,i2v07,…] [--runtime-dir DIR]

Transports:
- `local`: `LocalComfyTransport` below answers the ForwardRequest / PreprocessTextRequest with ComfyUI's OWN
  LTXAVModel (a second, weighted copy) called with the arguments rebuilt from the request: it checks that the
  request carries everything ComfyUI's forward needs (a lossless contract round trip; expected bit-identical).
- `fleet`: the pack's fleet (`--world-size` CPU ranks through the controller in `--runtime-dir`): the engine's
  forward job behind the same proxy (equal to float tolerance).

The graphs are ComfyUI's own nodes called in process (V3 `execute`): CFGGuider / LTXVDualCFGGuider,
SamplerCustomAdvanced, KSamplerSelect, RandomNoise, LTXVImgToVideoInplace, LTXVAddGuide + LTXVCropGuides,
LTXVConcatAVLatent / LTXVSeparateAVLatent, LTXVSpatioTemporalGuidance, LTXVModalityGuidance, LoraLoaderModelOnly
(through `comfy.sd.load_lora_for_models`). The conditioning is seeded random native CONDITIONING (ComfyUI's LTX-2
text encoder hard-codes Gemma-3-12B; see nodes/testing.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

PACK = Path(__file__).resolve().parent.parent

FPS = 25.0
# a 3×3 latent (96×96 px) × 3 latent frames (17 px frames) = 27 video tokens: not divisible by 2 or 4
WIDTH, HEIGHT, LENGTH = 96, 96, 17
SIGMAS = [1.0, 0.85, 0.6, 0.3, 0.0]
EASYCACHE_SIGMAS = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3, 0.15, 0.0]  # 12 steps: some skipped


def setup_comfy():
    sys.path.insert(0, os.getcwd())
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch

    torch.set_num_threads(1)


def import_pack():
    """The pack as ComfyUI imports it: one package (here named `ltx2_multigpu`) from the repository root."""
    spec = importlib.util.spec_from_file_location("ltx2_multigpu", PACK / "__init__.py",
                                                  submodule_search_locations=[str(PACK)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ltx2_multigpu"] = mod
    spec.loader.exec_module(mod)
    import ltx2_multigpu.nodes.native_model as nm

    return nm


class LocalComfyTransport:
    """Answers the proxy's requests with ComfyUI's own weighted LTXAVModel (see the module docstring)."""

    def __init__(self, path: str):
        import comfy.sd

        self.patcher = comfy.sd.load_diffusion_model(path, disable_dynamic=True)
        self.dm = self.patcher.model.diffusion_model
        self.contexts = {}
        self.loras = {}
        self.clean = {}
        self.active = None
        self.calls = []
        self.forget_at = None  # forget the cached contexts and LoRA sets before this call (a fleet restart)

    def __call__(self, kind, payload):
        import torch

        from ltx2_multigpu.mgpu_backend.protocol import native_forward as F

        with torch.no_grad():
            if kind == F.PREPROCESS_TEXT_JOB:  # the connectors on the patched weights, as the fleet fuses them
                lora = payload.lora
                if lora is not None and lora.patches is None and lora.key not in self.loras:
                    return F.ForwardMiss(lora_key=lora.key)
                self.apply_lora(lora)
                return F.PreprocessTextReply(self.dm.preprocess_text_embeds(payload.context,
                                                                            unprocessed=payload.unprocessed))
            assert kind == F.FORWARD_JOB, kind
            r = payload
            if self.forget_at is not None and len(self.calls) == self.forget_at:  # as a restarted fleet would
                self.contexts.clear()
                self.loras.clear()
                self.apply_lora(None)
            self.calls.append({"batch": r.batch, "context": r.context is not None,
                               "lora": None if r.lora is None else (r.lora.key, r.lora.patches is not None),
                               "options": repr(r.options), "tags": r.cond_or_uncond})
            missing = [k for k in r.context_keys if k not in self.contexts] if r.context is None else []
            if missing:
                return F.ForwardMiss(context_keys=tuple(missing))
            if r.lora is not None and r.lora.patches is None and r.lora.key not in self.loras:
                return F.ForwardMiss(lora_key=r.lora.key)
            if r.context is not None:
                for i, k in enumerate(r.context_keys):
                    self.contexts[k] = r.context[i:i + 1]
                context = r.context
            else:
                context = torch.cat([self.contexts[k] for k in r.context_keys])
            self.apply_lora(r.lora)
            to = {"stg_self_attn_blocks": frozenset(r.options.stg_self_attn_blocks),
                  "a2v_cross_attn": r.options.a2v_cross_attn, "v2a_cross_attn": r.options.v2a_cross_attn,
                  "run_vx": r.options.run_vx, "run_ax": r.options.run_ax}
            kwargs = {}
            if r.denoise_mask is not None:
                kwargs["denoise_mask"] = r.denoise_mask
            elif r.keyframe_idxs is not None:  # ComfyUI's forward patchifies the mask when guides are present
                kwargs["denoise_mask"] = torch.ones((r.batch, 1) + tuple(r.video.shape[2:]))
            if r.guide_attention_entries:
                kwargs["guide_attention_entries"] = [
                    {"pre_filter_count": e.pre_filter_count, "strength": e.strength, "pixel_mask": e.pixel_mask,
                     "latent_shape": list(e.latent_shape) if e.latent_shape else None}
                    for e in r.guide_attention_entries]
            if r.ref_audio_tokens is not None:
                kwargs["ref_audio"] = {"tokens": r.ref_audio_tokens}
            x = [r.video] + ([r.audio] if r.audio is not None else [])
            ts = (r.video_timestep, r.audio_timestep if r.audio_timestep is not None else r.video_timestep)
            out = self.dm(x, ts, context, attention_mask=r.attention_mask, frame_rate=r.frame_rate,
                          transformer_options=to, keyframe_idxs=r.keyframe_idxs, **kwargs)
            if isinstance(out, list):
                return F.ForwardReply(out[0], out[1] if len(out) > 1 else None, report="local")
            return F.ForwardReply(out, None, report="local")

    def apply_lora(self, lora):
        """ComfyUI's LoRA math on the reference copy: W = W0 + Σ strength · (alpha / rank) · up @ down (float32)."""
        import torch

        key = None if lora is None else lora.key
        if key == self.active:
            return
        params = dict(self.dm.named_parameters())
        for name, w in self.clean.items():
            params[name].data.copy_(w)
        self.active = None
        if lora is None:
            return
        if lora.patches is not None:
            self.loras[lora.key] = lora.patches
        for p in self.loras[lora.key]:
            name = p.module + ".weight"
            w = params[name]
            self.clean.setdefault(name, w.detach().clone())
            rank = p.down.shape[0]
            scale = p.strength * (1.0 if p.alpha is None else p.alpha / rank)
            w.data.copy_((w.data.float() + scale * (p.up.float() @ p.down.float())).to(w.dtype))
        self.active = lora.key


def fleet_transport(nm, path: str, world_size: int, gemma: str | None):
    from ltx2_multigpu.mgpu_backend.protocol.fleet_config import FleetConfig
    from ltx2_multigpu.mgpu_backend.serving.client import ControllerClient

    config = FleetConfig(devices=("cpu",) * world_size, checkpoint=path, gemma=gemma, gemma_unload=True,
                         dtype="float32")
    c = ControllerClient()
    try:
        handle = c.configure(config)
    finally:
        c.close()
    return nm.FleetTransport(handle)


# ---- inputs ------------------------------------------------------------------------------------------------------


def conditioning(width: int, seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed)
    pos = torch.randn(1, 12, width, generator=g)
    neg = torch.randn(1, 9, width, generator=g)
    meta = {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": FPS}
    return [[pos, dict(meta)]], [[neg, dict(meta)]]


def image(seed: int = 3):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, HEIGHT, WIDTH, 3, generator=g)


def video_latent(length=LENGTH):
    from comfy_extras.nodes_lt import EmptyLTXVLatentVideo

    return EmptyLTXVLatentVideo.execute(WIDTH, HEIGHT, length, 1).result[0]


def audio_latent(length=LENGTH, fps=FPS):
    import math

    import torch

    return {"samples": torch.zeros(1, 8, math.ceil(length / fps * 25), 16), "type": "audio"}


def run_case(case: str, model, vae, width: int, lora_path: str | None):
    """One sampling of `case` with `model`; returns (video latent, audio latent) after separation (and cropping)."""
    import comfy.sd
    import torch
    from comfy_extras import nodes_custom_sampler as cs
    from comfy_extras import nodes_lt as lt

    pos, neg = conditioning(width)
    length, fps = LENGTH, FPS
    if case == "long126":
        length, fps = 126, 25.0
    v = video_latent(length)
    sampler_name = "euler_ancestral" if case == "euler_a" else "euler"
    if case.startswith("i2v") or case == "ksampler":
        v = lt.LTXVImgToVideoInplace.execute(vae, image(), v, 1.0 if case == "i2v10" else 0.7).result[0]
    if case.startswith("guides"):
        strength = 0.7 if case == "guides07" else 1.0
        pos, neg, v = lt.LTXVAddGuide.execute(pos, neg, vae, v, image(3), 0, strength).result
        pos, neg, v = lt.LTXVAddGuide.execute(pos, neg, vae, v, image(4), -1, strength).result
    if case == "restart_mid_sampling" and model is not REFERENCE.get("native") and \
            hasattr(TRANSPORT.get("t"), "forget_at"):
        TRANSPORT["t"].forget_at = len(TRANSPORT["t"].calls) + 2  # before the 3rd forward of this sampling
    if case.startswith("lora") or case == "restart_mid_sampling":
        model, _ = comfy.sd.load_lora_for_models(model, None, comfy.utils.load_torch_file(lora_path), 0.7, 0)
        if case == "lora_stack":
            model, _ = comfy.sd.load_lora_for_models(model, None, comfy.utils.load_torch_file(lora_path), -0.4, 0)
    if case == "model_sampling":  # an object patch of the wrapper (model_sampling): applies in ComfyUI as usual
        model = lt.ModelSamplingLTXV.execute(model, 2.05, 0.95, None).result[0]
    if case == "easycache":
        from comfy_extras.nodes_easycache import EasyCacheNode as EasyCache

        model = EasyCache.execute(model, 0.5, 0.0, 1.0, False).result[0]
    if case == "refuse_slg":
        from comfy_extras.nodes_slg import SkipLayerGuidanceDiT

        model = SkipLayerGuidanceDiT.execute(model, 3.0, 0.0, 1.0, "1", "", 0.0).result[0]
    if case == "refuse_attn_patch":
        model = model.clone()
        model.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    if case == "refuse_cfg_split":  # core's MultiGPU CFG Split on a host of two devices (the second one: `meta`)
        import comfy.model_management as mm
        import comfy.multigpu

        real = mm.get_all_torch_devices
        mm.get_all_torch_devices = lambda exclude_current=False: [torch.device("cpu"), torch.device("meta")]
        try:  # core reloads the model through the patcher's cached_patcher_init and marks the clone
            model = comfy.multigpu.create_multigpu_deepclones(model, 2, reuse_loaded=True)
        finally:
            mm.get_all_torch_devices = real
        assert [m.load_device.type for m in model.get_additional_models_with_key("multigpu")] == ["meta"]
    if case == "refuse_save":
        import comfy.sd

        comfy.sd.save_checkpoint("/nonexistent/never-written.safetensors", model=model)
    if case == "connector_lora":  # a LoRA pair on the text connectors too: ComfyUI patches them, and so does the fleet
        import comfy.utils

        sd = comfy.utils.load_torch_file(lora_path)
        name = "video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q"
        out_f, in_f = REFERENCE["native"].model.diffusion_model.state_dict()[name + ".weight"].shape
        sd[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(4, in_f) * 0.05
        sd[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(out_f, 4) * 0.05
        model, _ = comfy.sd.load_lora_for_models(model, None, sd, 1.0, 0)
    if case == "refuse_merge":
        from comfy_extras.nodes_model_merging import ModelMergeSimple

        model = ModelMergeSimple().merge(model, REFERENCE["native"], 0.5)[0]
    if case == "stg_modality":
        model = lt.LTXVSpatioTemporalGuidance.execute(model, 1.0, "1", 0.0, 1.0).result[0]
        model = lt.LTXVModalityGuidance.execute(model, 3.0, 0.0, 1.0).result[0]
    av = lt.LTXVConcatAVLatent.execute(v, audio_latent(length, fps)).result[0]
    if case == "ksampler":  # KSampler's path (comfy.sample.sample, scheduler "simple"), image-to-video 0.7
        import nodes as comfy_nodes  # ComfyUI's nodes.py (the pack is imported as ltx2_multigpu)

        out = comfy_nodes.common_ksampler(model, 42, 4, 3.0, "euler", "simple", pos, neg, av)[0]
        video, audio = lt.LTXVSeparateAVLatent.execute(out).result
        return video["samples"].float(), audio["samples"].float()
    if case == "dual_cfg":
        guider = lt.LTXVDualCFGGuider.execute(model, pos, neg, 3.0, 7.0).result[0]
    else:
        guider = cs.CFGGuider.execute(model, pos, neg, 3.0).result[0]
    noise = cs.RandomNoise.execute(42).result[0]
    sampler = cs.KSamplerSelect.execute(sampler_name).result[0]
    sigmas = torch.tensor(SIGMAS if case != "easycache" else EASYCACHE_SIGMAS)
    out = cs.SamplerCustomAdvanced.execute(noise, guider, sampler, sigmas, av).result[0]
    video, audio = lt.LTXVSeparateAVLatent.execute(out).result
    if case.startswith("guides"):
        _, _, video = lt.LTXVCropGuides.execute(pos, neg, video).result
    return video["samples"].float(), audio["samples"].float()


REFERENCE = {}  # "native": the native MODEL (the second model of a merge)
TRANSPORT = {}  # "t": the MGPU model's transport (the local one can play a fleet restart)
REFUSALS = {"refuse_slg": "patches_replace", "refuse_attn_patch": "attention / block patches",
            "refuse_merge": "model merge", "refuse_save": "saving a checkpoint",
            "refuse_cfg_split": "MultiGPU CFG Split (MultiGPU_WorkUnits)"}

CASES = ("t2v", "i2v07", "i2v10", "guides07", "guides10", "stg_modality", "dual_cfg", "euler_a", "lora", "lora_stack",
         "connector_lora", "t2v_after_lora", "long126", "model_sampling", "easycache", "restart_mid_sampling",
         "ksampler") + tuple(REFUSALS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--transport", choices=("local", "fleet"), default="local")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--lora", default=None)
    ap.add_argument("--gemma", default=None, help="Gemma file for the fleet (None: a transformer-only fleet)")
    args = ap.parse_args()
    setup_comfy()
    nm = import_pack()
    import comfy.sd
    import torch

    native, _, vae, _ = comfy.sd.load_checkpoint_guess_config(args.checkpoint, output_vae=True, output_clip=False)
    width = native.model.diffusion_model.video_embeddings_connector.inner_dim
    if native.model.diffusion_model.caption_proj_before_connector:
        width += native.model.diffusion_model.audio_embeddings_connector.inner_dim
    local = None
    if args.transport == "local":
        local = transport = LocalComfyTransport(args.checkpoint)
    else:
        transport = fleet_transport(nm, args.checkpoint, args.world_size, args.gemma)
    mgpu = nm.build_native_model(args.checkpoint, transport, name="tiny")
    TRANSPORT["t"] = transport
    if args.transport == "fleet":
        transport.proxy = nm.proxy_of(mgpu)
    proxy = nm.proxy_of(mgpu)
    info = {"native_dtype": str(native.model.get_dtype_inference()),
            "mgpu_dtype": str(mgpu.model.get_dtype_inference()),
            "manual_cast": [str(native.model.manual_cast_dtype), str(mgpu.model.manual_cast_dtype)],
            "params": len(list(mgpu.model.parameters())), "state_keys": len(mgpu.model.state_dict()),
            "native_state_keys": len(native.model.state_dict())}
    results = {}
    REFERENCE["native"] = native
    with torch.no_grad():
        for case in args.cases.split(","):
            if case in REFUSALS:
                try:
                    run_case(case, mgpu, vae, width, args.lora)
                    results[case] = {"refused": None}
                except Exception as exc:  # noqa: BLE001 - the refusal is what this case checks
                    results[case] = {"refused": f"{type(exc).__name__}: {exc}"}
                print(f"{case}: {results[case]}", file=sys.stderr, flush=True)
                continue
            t0 = time.perf_counter()
            name = "t2v" if case == "t2v_after_lora" else case
            ref_v, ref_a = run_case(name, native, vae, width, args.lora)
            t1 = time.perf_counter()
            before = dict(proxy.stats)
            got_v, got_a = run_case(name, mgpu, vae, width, args.lora)
            t2 = time.perf_counter()
            results[case] = {
                "max_abs": max(float((got_v - ref_v).abs().max()), float((got_a - ref_a).abs().max())),
                "max_ref": max(float(ref_v.abs().max()), float(ref_a.abs().max())),
                "shape": [list(ref_v.shape), list(ref_a.shape)],
                "native_s": t1 - t0, "mgpu_s": t2 - t1,
                "report": "; ".join((proxy.report.report,) + proxy.report.lora_reports),
                "stats": {k: proxy.stats[k] - before.get(k, 0) for k in proxy.stats}}
            print(f"{case}: {results[case]}", file=sys.stderr, flush=True)
    if local is not None:
        info["calls"] = local.calls[-3:]
    Path(args.out).write_text(json.dumps({"info": info, "results": results}))
    print("RESULT " + json.dumps({"info": info, "results": results}))


if __name__ == "__main__":
    main()
