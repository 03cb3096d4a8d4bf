"""The MGPU MODEL's forward translation (nodes/native_forward.py) and its patch rules (nodes/native_patches.py), on
arguments built by hand the way ComfyUI 0.33 passes them to `LTXAVModel.forward` (docs/design/native-model.md), without
ComfyUI. The whole path inside a real ComfyUI (the proxy MODEL against ComfyUI's native one) is
tests/test_native_model_comfyui.py.
"""
from __future__ import annotations

import types
import uuid

import pytest
import torch

from mgpu_backend.protocol import native_forward as F
from nodes import native_forward as NF
from nodes import native_patches as NP
from nodes.native_types import UnsupportedInput

B, FR, H, W, T, L, C = 2, 3, 2, 3, 5, 16, 64


def _args(seed=0, per_token=False):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(B, 128, FR, H, W, generator=g)
    audio = torch.randn(B, 8, T, 16, generator=g)
    if per_token:
        ts = (torch.rand(B, FR * H * W, 1, generator=g), torch.rand(B, T, 1, generator=g))
    else:
        ts = (torch.full((B,), 0.7), torch.full((B,), 0.7))
    context = torch.randn(B, L, C, generator=g)
    options = {"uuids": [uuid.UUID(int=1), uuid.UUID(int=2)], "cond_or_uncond": [1, 0], "sigmas": torch.tensor([0.7]),
               "wrappers": {}, "callbacks": {}}
    return [video, audio], ts, context, options


def test_plain_call_becomes_a_request_with_keys_per_row():
    x, ts, ctx, options = _args()
    req = NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 25, options, None, {"a_timestep": ts[1]}))
    assert isinstance(req, F.ForwardRequest)
    assert req.video is not None and torch.equal(req.video, x[0]) and torch.equal(req.audio, x[1])
    assert torch.equal(req.video_timestep, ts[0]) and torch.equal(req.audio_timestep, ts[1])
    assert req.frame_rate == 25.0 and req.cond_or_uncond == (1, 0)  # row 0 is the negative
    assert len(req.context_keys) == 2 and req.context_keys[0] != req.context_keys[1]
    assert req.context_keys[0].startswith(str(uuid.UUID(int=1)) + "/0:")
    assert torch.equal(req.context, ctx)
    assert req.options.is_plain and req.lora is None and req.keyframe_idxs is None
    # the fleet holds both rows: the context stays behind; one row unknown: it travels again
    again = NF.build_request(NF.ComfyForwardCall(x, ts, ctx.clone(), None, 25, options, None),
                             known_contexts=set(req.context_keys))
    assert again.context is None and again.context_keys == req.context_keys
    partly = NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 25, options, None),
                              known_contexts={req.context_keys[0]})
    assert partly.context is not None


def test_context_key_follows_the_values():
    x, ts, ctx, options = _args()
    keys = NF.context_keys(ctx, options)
    changed = ctx.clone()
    changed[1, 0, 0] += 1.0  # element 0 is always in the digest sample
    keys2 = NF.context_keys(changed, options)
    assert keys2[0] == keys[0] and keys2[1] != keys[1]
    # a chunk of two rows under one uuid (latent batch 2): one key per row
    one = dict(options, uuids=[uuid.UUID(int=5)], cond_or_uncond=[0])
    k = NF.context_keys(ctx, one)
    assert k[0].split(":")[0] == f"{uuid.UUID(int=5)}/0" and k[1].split(":")[0] == f"{uuid.UUID(int=5)}/1"
    req = NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 25, one, None))
    assert req.cond_or_uncond == (0, 0)


def test_guides_masks_and_per_call_options_travel():
    x, ts, ctx, options = _args(per_token=True)
    kf = torch.zeros(B, 3, H * W, 2, dtype=torch.int64)
    mask = torch.ones(B, 1, FR, H, W)
    entries = [{"pre_filter_count": H * W, "strength": 0.7, "pixel_mask": None, "latent_shape": [1, H, W]}]
    opts = dict(options, stg_self_attn_blocks=frozenset({3, 1}), a2v_cross_attn=False, v2a_cross_attn=False)
    req = NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 24.0, opts, kf, {
        "denoise_mask": mask, "audio_denoise_mask": torch.ones(B, 8, T, 16), "guide_attention_entries": entries}))
    assert torch.equal(req.keyframe_idxs, kf) and req.denoise_mask is None  # no −1 cell: nothing to drop
    assert req.guide_attention_entries == (F.GuideAttentionEntry(H * W, 0.7, None, (1, H, W)),)
    assert req.options.stg_self_attn_blocks == (1, 3)
    assert not req.options.a2v_cross_attn and not req.options.v2a_cross_attn and req.options.run_vx
    assert req.video_timestep.shape == (B, FR * H * W, 1) and req.frame_rate == 24.0
    sparse = mask.clone()
    sparse[:, :, -1, 0, 0] = -1.0  # an IC-LoRA padding cell
    req = NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 24.0, opts, kf, {"denoise_mask": sparse}))
    assert torch.equal(req.denoise_mask, sparse)
    ref = torch.randn(1, 4, 128)
    req = NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 24.0, opts, None, {"ref_audio": {"tokens": ref}}))
    assert torch.equal(req.ref_audio_tokens, ref)


def test_what_needs_the_transformer_in_process_is_refused_by_name():
    x, ts, ctx, options = _args()
    cases = [
        (dict(options, patches_replace={"dit": {("double_block", 1): print}}), {}, "patches_replace"),
        (dict(options, patches={"attn1_patch": [print]}), {}, "attention / block patches"),
        (dict(options, optimized_attention_override=print), {}, "attention override"),
        (options, {"control": {"output": []}}, "ControlNet"),
        (options, {"mystery_input": torch.zeros(1)}, "mystery_input"),
    ]
    for opts, kwargs, needle in cases:
        with pytest.raises(UnsupportedInput, match=needle):
            NF.build_request(NF.ComfyForwardCall(x, ts, ctx, None, 25, opts, None, kwargs))
    with pytest.raises(UnsupportedInput, match="audio\\+video latent"):
        NF.build_request(NF.ComfyForwardCall(x[0], ts, ctx, None, 25, options, None))


def test_reply_back_in_comfyui_form():
    x, _, _, _ = _args()
    x = [x[0].to(torch.bfloat16), x[1].to(torch.bfloat16)]
    reply = F.ForwardReply(torch.randn(B, 128, FR, H, W), torch.randn(B, 8, T, 16))
    out = NF.reply_output(reply, x)
    assert isinstance(out, list) and out[0].dtype == out[1].dtype == torch.bfloat16
    assert torch.equal(out[1], reply.audio.to(torch.bfloat16))
    assert torch.is_tensor(NF.reply_output(F.ForwardReply(reply.video, None), x))


# ---- LoRA patches and patcher features -----------------------------------------------------------------------------


def _adapter(up, down, alpha=None, mid=None, dora=None):
    return types.SimpleNamespace(name="lora", weights=(up, down, alpha, mid, dora, None))


def _patcher(patches=None, **fields):
    base = {"patches": patches or {}, "patches_uuid": uuid.UUID(int=9), "object_patches": {},
            "weight_wrapper_patches": {}, "hook_patches": {}, "model_options": {"transformer_options": {}}}
    base.update(fields)
    return types.SimpleNamespace(**base)


def test_plain_loras_become_patches_in_comfyui_order():
    g = torch.Generator().manual_seed(1)
    up, down = torch.randn(64, 4, generator=g), torch.randn(4, 32, generator=g)
    up2, down2 = torch.randn(64, 2, generator=g), torch.randn(2, 32, generator=g)
    key = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    patches = {key: [(0.7, _adapter(up, down, torch.tensor(8.0)), 1.0, None, None),
                     (-0.4, _adapter(up2, down2), 1.0, None, None)]}
    lora = NF.lora_set(patches, "u1", known=False)
    assert lora.key == "u1" and len(lora.patches) == 2
    p0, p1 = lora.patches
    assert p0.module == "transformer_blocks.0.attn1.to_q" and p0.alpha == 8.0 and p0.strength == 0.7
    assert torch.equal(p0.up, up) and torch.equal(p0.down, down) and p1.alpha is None and p1.strength == -0.4
    terms = NP.lora_terms(patches)
    assert terms[0].scale == pytest.approx(0.7 * 8.0 / 4) and terms[1].scale == pytest.approx(-0.4)
    assert NF.lora_set(patches, "u1", known=True) == F.LoraSet("u1", None)
    assert NF.lora_set({}, "u1", known=False) is None  # no patches: the fleet runs (restores) clean weights


def test_other_weight_patches_are_refused_by_name():
    up, down = torch.randn(64, 4), torch.randn(4, 32)
    key = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    cases = [
        ({key: [(1.0, _adapter(up, down, dora=torch.ones(64)), 1.0, None, None)]}, "DoRA"),
        ({key: [(1.0, _adapter(up, down, mid=torch.ones(4, 4, 1, 1)), 1.0, None, None)]}, "LoCon"),
        ({key: [(1.0, types.SimpleNamespace(name="loha", weights=()), 1.0, None, None)]}, "'loha'"),
        ({key: [(0.5, [(torch.zeros(64, 32), None)], 0.5, None, None)]}, "model merge"),
        ({key: [(1.0, _adapter(up, down), 0.8, None, None)]}, "strength_model=0.8"),
        ({(key, (0, 0, 8)): [(1.0, _adapter(up, down), 1.0, None, None)]}, "offset"),
        ({"model_sampling.sigmas": [(1.0, _adapter(up, down), 1.0, None, None)]}, "outside the diffusion model"),
    ]
    for patches, needle in cases:
        with pytest.raises(UnsupportedInput, match=needle):
            NP.lora_terms(patches)


def test_patcher_features_that_need_the_transformer_in_process_are_refused():
    NP.refuse_patcher_features(None)
    NP.refuse_patcher_features(_patcher(object_patches={"model_sampling": object()}))  # ModelSamplingLTXV: fine
    with pytest.raises(UnsupportedInput, match="diffusion_model.transformer_blocks.0"):
        NP.refuse_patcher_features(_patcher(object_patches={"diffusion_model.transformer_blocks.0": object()}))
    with pytest.raises(UnsupportedInput, match="hook-scheduled"):
        NP.refuse_patcher_features(_patcher(hook_patches={"ref": {}}))
    with pytest.raises(UnsupportedInput, match="weight wrappers"):
        NP.refuse_patcher_features(_patcher(weight_wrapper_patches={"diffusion_model.x.weight": [print]}))
    with pytest.raises(UnsupportedInput, match="patches_replace"):
        NP.refuse_patcher_features(_patcher(model_options={"transformer_options": {"patches_replace": {"dit": {1: 2}},
                                                                                   "patches": {}}}))
    NP.refuse_transformer_options({"patches_replace": {"dit": {}}, "patches": {"attn1_patch": []}})  # nothing set


def test_core_multigpu_cfg_split_is_refused_through_what_core_sets():
    """ComfyUI core's MultiGPU CFG Split, by each mark core 0.33 leaves (comfy/multigpu.py), and by its class in the
    prompt's model links where it leaves none (a host with one device)."""
    plain = _patcher(additional_models={}, is_multigpu_base_clone=False)
    plain.get_additional_models_with_key = lambda key: list(plain.additional_models.get(key, []))
    NP.refuse_patcher_features(plain)
    NP.refuse_core_multigpu(plain, upstream_classes={"CFGGuider", "LoraLoaderModelOnly"})
    clones = _patcher(additional_models={"multigpu": [object()]})
    clones.get_additional_models_with_key = lambda key: list(clones.additional_models.get(key, []))
    marked = [clones, _patcher(is_multigpu_base_clone=True),
              _patcher(model_options={"transformer_options": {}, "multigpu_options": {"cuda:1": {}}}),
              _patcher(model_options={"transformer_options": {}, "multigpu_clones": {"cuda:0": 1}})]
    for patcher in marked:
        with pytest.raises(UnsupportedInput, match=r"MultiGPU CFG Split \(MultiGPU_WorkUnits\).*fleet"):
            NP.refuse_patcher_features(patcher)
    with pytest.raises(UnsupportedInput, match="give the MGPU loader more devices"):
        NP.refuse_core_multigpu(plain, upstream_classes={"CFGGuider", "MultiGPU_WorkUnits"})


def test_a_fleet_without_gemma_has_no_text_service_check():
    """Load Diffusion Model (MGPU) configures a fleet without Gemma (`FleetConfig.gemma=None`, unloaded): the
    worker's text service then holds no encoder and checks no projection against a Gemma it does not have."""
    from mgpu_backend.stages.text_encoder import TextEncoderService
    from mgpu_backend.protocol.fleet_config import FleetConfig

    config = FleetConfig(devices=("cpu",), checkpoint="ltx.safetensors", gemma=None, gemma_unload=True)
    svc = TextEncoderService.for_fleet(config, 0, torch.device("cpu"), projection=object())
    assert svc.encoder is None and svc.header is None and svc.projection is None


# ---- the LoRA coverage line in ComfyUI's log (issue 36 item 4) -------------------------------------------------------

class _FakeFleet:
    """The fleet's side of the native MODEL's jobs, as `serving/jobs/forward.py` answers them: a LoRA set shipped
    once (with its patches, by whichever job comes first) is held under its key and named by the key afterwards;
    every reply carries the coverage of the set fused for it (`NativeEngine.apply_lora`: one line per strength
    group, on every forward)."""

    def __init__(self):
        self.held: dict[str, F.LoraSet] = {}
        self.calls: list[tuple[str, bool | None]] = []  # (job kind, whether the request shipped patches)

    def _coverage(self, lora, what):
        if lora is None:
            return ()
        held = self.held[lora.key]  # a key the fleet does not hold would be a ForwardMiss (not exercised here)
        return tuple(f"{what} {lora.key}#0 @ {p.strength:g}: 1/1 layers applied" for p in held.patches[:1])

    def __call__(self, kind, payload):
        lora = payload.lora
        self.calls.append((kind, None if lora is None else lora.patches is not None))
        if lora is not None and lora.patches is not None:
            self.held[lora.key] = lora
        if kind == F.PREPROCESS_TEXT_JOB:  # this LoRA has no connector pairs: nothing fused for the call
            return F.PreprocessTextReply(payload.context.clone(), ())
        return F.ForwardReply(torch.zeros_like(payload.video), torch.zeros_like(payload.audio), "one rank", 0.1,
                              self._coverage(lora, "lora"))


class _Owner:  # the BaseModel the proxy reads its sampling patcher from (weakly referenced)
    current_patcher = None


def test_the_fleets_lora_coverage_reaches_comfyuis_log_once_per_lora(monkeypatch, caplog):
    """LoraLoaderModelOnly on the MGPU MODEL at 0.5, then at 1.0: ComfyUI runs `preprocess_text_embeds` first, which
    ships the LoRA set to the fleet; every forward after it names the set by its key. The coverage the fleet reports
    for the transformer reaches ComfyUI's log (logger `ltx2_mgpu.nodes`, INFO, which ComfyUI's root logger prints)
    once per LoRA set — one line at 0.5, one at 1.0, none for the second forward of a set, none without a LoRA.
    Before issue 36 the line was logged only by a forward that shipped the patches itself, which after
    `preprocess_text` never happens: the line the docs promise never appeared."""
    import logging
    import sys

    stub = types.ModuleType("comfy.ldm.lightricks.symmetric_patchifier")
    stub.SymmetricPatchifier = stub.AudioPatchifier = lambda *a, **k: None
    for name in ("comfy", "comfy.ldm", "comfy.ldm.lightricks"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "comfy.ldm.lightricks.symmetric_patchifier", stub)
    from nodes.native_model import FleetTransformer

    fleet = _FakeFleet()
    proxy = FleetTransformer({}, torch.float32, {}, fleet, name="tiny")
    owner = _Owner()
    proxy.attach(owner)
    g = torch.Generator().manual_seed(3)
    key = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    adapter = _adapter(torch.randn(64, 4, generator=g), torch.randn(4, 32, generator=g))

    def sample(patcher, forwards=2):
        owner.current_patcher = patcher
        x, ts, ctx, options = _args()
        proxy.preprocess_text_embeds(ctx, unprocessed=True)
        for _ in range(forwards):
            proxy._remote_forward(x, ts[0], ctx, None, 25, options, None, a_timestep=ts[1])

    caplog.set_level(logging.INFO, logger="ltx2_mgpu.nodes")
    for strength, uid in ((0.5, uuid.UUID(int=5)), (1.0, uuid.UUID(int=10))):
        sample(_patcher({key: [(strength, adapter, 1.0, None, None)]}, patches_uuid=uid))
    sample(_patcher())  # no LoRA: the fleet restores its clean weights, nothing to log
    assert fleet.calls[:3] == [(F.PREPROCESS_TEXT_JOB, True), (F.FORWARD_JOB, False), (F.FORWARD_JOB, False)]
    lines = [r.getMessage() for r in caplog.records if r.name == "ltx2_mgpu.nodes" and r.levelno == logging.INFO]
    assert lines == [f"MGPU model: LoRA fused on the fleet in the transformer: lora {uuid.UUID(int=5)}#0 @ 0.5: "
                     f"1/1 layers applied",
                     f"MGPU model: LoRA fused on the fleet in the transformer: lora {uuid.UUID(int=10)}#0 @ 1: "
                     f"1/1 layers applied"]


def test_a_forward_that_ran_eagerly_is_a_warning_in_comfyuis_log(monkeypatch, caplog):
    """A fleet reply naming a slowdown (`ForwardReply.slowdowns`: forwards eager, why, the cost) reaches ComfyUI's
    console as one WARNING per reply that names it — the fleet names each reason once, in the forward it first
    happened — not only the controller's log."""
    import logging
    import sys

    stub = types.ModuleType("comfy.ldm.lightricks.symmetric_patchifier")
    stub.SymmetricPatchifier = stub.AudioPatchifier = lambda *a, **k: None
    for name in ("comfy", "comfy.ldm", "comfy.ldm.lightricks"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "comfy.ldm.lightricks.symmetric_patchifier", stub)
    from nodes.native_model import FleetTransformer

    line = ("native forward not capturable (OutOfMemoryError: x): forwards eager, ~3 % slower at 3,520 video tokens "
            "per rank")
    replies = iter([(line,), (), ()])

    def fleet(kind, payload):
        return F.ForwardReply(torch.zeros_like(payload.video), torch.zeros_like(payload.audio), "one rank", 0.1,
                              slowdowns=next(replies))

    proxy = FleetTransformer({}, torch.float32, {}, fleet, name="tiny")
    owner = _Owner()
    owner.current_patcher = _patcher()
    proxy.attach(owner)
    caplog.set_level(logging.INFO, logger="ltx2_mgpu.nodes")
    x, ts, ctx, options = _args()
    for _ in range(3):
        proxy._remote_forward(x, ts[0], ctx, None, 25, options, None, a_timestep=ts[1])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"MGPU MODEL: {line}"]
