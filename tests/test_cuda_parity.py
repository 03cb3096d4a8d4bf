"""The parity tests of sequence parallelism, tiled stage 2, distributed decode, distributed Gemma and LoRA, on a CUDA
device, in float32 and bfloat16 (issue #9, item 1). Marker `gpu`; skipped without CUDA.

`pytest -m gpu tests/test_cuda_parity.py` on a machine with one GPU. `LTX2_MGPU_PARITY_DEVICE` picks the device
(default "cuda", i.e. `cuda:0`); `LTX2_MGPU_PARITY_DEVICE=cpu` runs the very same tests on the CPU (gloo, CPU tensors),
so the test logic can be checked on a machine without a GPU.

How the ranks run. W = 2 and 4 ranks share the one GPU: every rank puts its models and tensors on `cuda:0`, and the
process group is gloo (NCCL refuses two ranks on one device). gloo runs the engine's collectives on CUDA tensors
itself — `all_to_all_single` (Ulysses), `all_gather` (SP K/V and outputs), `all_reduce` (TDP), `reduce` (decode),
`broadcast` (LoRA bytes, SP hand-over) — copying them through host memory; nothing in the engine is changed for it.
The object collectives (Gemma service, reports) are CPU pickles on any gloo group. One test runs W = 1 on a real
NCCL group of size 1 (gloo when the device is the CPU): the SP wrapper and the whole two-stage pipeline with a
`ParallelPlan` built on that group, plus one round of each collective the engine issues, with the engine's tensor
kinds (bf16 / fp32 Ulysses send buffer, uint8 LoRA bytes, int32 cancel flag) — at W = 1 the engine itself
short-circuits its exchanges, so the NCCL kernels are reached only through those explicit calls.

Each (W, dtype) is one spawn (`_dist.run_ranks`) whose ranks run every check: SP (one forward of four token layouts,
among them T % W != 0, video and audio outputs; a guided image-to-video stage 1), TDP (three tilings of a 2×4×6
grid with conditioning tokens), decode (five tilings), Gemma (replicated, batch-parallel, sharded, and sharded over
the GPU plus CPU offload), LoRA (two LoRAs fused over the ranks, a forward, exact restore; the fp8 checkpoint too)
and the two-stage image-to-video pipeline with a user LoRA on both stages (W = 4: SP on ranks 0-1, ranks 2-3 get
the stage-1 result by broadcast). Every result is compared with the one-process computation on the same device and
dtype (module fixture, computed once per dtype). Inputs are made once on the CPU in float32 and cast, so the ranks
and the reference see the same tensors. TF32 is off in every rank and in this process (`allow_tf32 = False` for
matmul and cuDNN: fp32 on a GPU is IEEE fp32), and cuDNN picks its algorithms deterministically.

Tolerances: relative error ‖got − ref‖ / ‖ref‖ (whole tensor, float64 arithmetic) below the bound of its kind:
- fp32 (`TOL["fp32"]`): SP changes no formula, only the blocking of reductions (T/W rows per Linear, per-head-slice
  attention, padded keys that add exact zeros): a few units of fp32 roundoff per op. Forwards, stage 1, LoRA
  forwards, pipeline latents and Gemma below 1e-5 (measured on the CPU ≤ 1.6e-6). Decoded frames / waveforms below
  1e-3: the LTX-2.3 vocoder amplifies the latent difference ~60× (measured on the CPU: audio latent 7.3e-7 ->
  waveform 4.3e-5), so 100 × the latent bound; `test_pipeline_parity` also re-decodes rank 0's latents here and
  finds rank 0's frames and waveform within 1e-4 (the decoders add nothing; measured 0).
- bf16 (`TOL["bf16"]`, `BF16_FLOOR_FACTOR`): 8 significant bits, unit roundoff 2⁻⁹ ≈ 2e-3. Once one rounding
  differs (another matmul blocking for T/W rows, another attention kernel for the masked padded keys) every later
  op rounds differently, so two bf16 runs of the same math differ by about as much as either differs from the
  exact result. The bound is max(fixed bound, 3 × bf16 floor), the floor being ‖bf16 − fp32‖ / ‖fp32‖ of the same
  quantity computed in one process on the same device (3: 2 from the triangle inequality, plus a margin). Fixed: one
  forward 2e-2, a guided stage (12 forwards: CFG / STG / modality guidance amplify the difference between passes)
  and pipeline latents 5e-2, decoded media 5e-2, Gemma 2e-2. Measured on the CPU: forward floor 6e-3 to 9e-3
  (errors ≤ 6e-3), stage-1 floor 1.3e-2 to 3.4e-2 (errors ≤ 3.9e-2), pipeline audio latent 2.3e-2; the decoded
  waveform's floor is 0.34 (the vocoder amplifies latent differences), so in bf16 the direct waveform comparison
  is weak and the re-decode check of `test_pipeline_parity` carries it.
- TDP and decode blend in float32 whatever the model dtype: a token / pixel covered by at most two tiles is a sum
  of at most two non-zero terms, so it must be bit-identical to the one-process blend; with 3-4 tiles the fp32 sum
  may reassociate: |Δ| ≤ 1e-6·(1 + |ref|) (test_tdp.py, test_decode.py). The TDP output is cast back to the model
  dtype, so in bf16 such a token may round to the neighbouring bf16 value: |Δ| ≤ 2⁻⁷·|ref| (one bf16 ulp).
- exact (`torch.equal`): what is a copy or the same computation on the same tensors — the ranks' outputs after a
  gather / all_reduce / broadcast agree with each other; LoRA fused weights (computed by the owner rank with the
  same function, broadcast as bytes) and the restored weights; W = 1 SP wrapper vs the plain forward in one
  process. `test_gemma_bit_identical` checks the engine's stronger claim that every Gemma mode equals the
  one-process encode bit for bit on the same device type and dtype (separate from the tolerance check, so a GPU
  that breaks only bit-identity shows as that).
- fp32 negative control: the SP forward with the video→audio (or self-attention) key mask dropped differs from the
  reference by more than 100× the fp32 bound, so the parity tests can fail.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

import test_decode as DEC
import test_gemma_parallel as GP
import test_sequence_parallel as SP
import test_tdp as TDP
from _dist import run_ranks
from mgpu_backend.engine.attention import LTX2AttnProcessor, use_processor
from mgpu_backend.weights.lora import LoRAFuser, read_lora
from mgpu_backend.models.fp8 import FP8Linear
from mgpu_backend.models.gemma import load_gemma, read_gemma_header
from mgpu_backend.models.loader import ComponentFiles, SafetensorsFile, load_components, load_transformer
from mgpu_backend.testing.tiny import write_tiny_lora
from mgpu_backend.stages import text_encoder as G
from mgpu_backend.splits.decode import decode_tiles
from mgpu_backend.splits.exchange import Exchange
from mgpu_backend.splits.plan import build_plan
from mgpu_backend.protocol.fleet_config import FleetPolicy
from mgpu_backend.protocol.fleet_config import FleetPolicy
from mgpu_backend.splits.sequence import GatheredKeysCrossAttention, UlyssesSelfAttention
from mgpu_backend.splits.tiled import TiledSplit
from mgpu_backend.testing.diffusers_inputs import SequenceDriver
from mgpu_backend.splits.tiling import TileCountConfig
from mgpu_backend.stages.pipelines import GenerateRequest, TwoStagePipeline

DEVICE = os.environ.get("LTX2_MGPU_PARITY_DEVICE", "").strip() or "cuda"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WORLDS = (2, 4)
VARIANTS = SP.VARIANTS
TOL = {  # relative L2 bounds (module docstring)
    "fp32": {"forward": 1e-5, "stage": 1e-5, "latent": 1e-5, "decoded": 1e-3, "text": 1e-5},
    "bf16": {"forward": 2e-2, "stage": 5e-2, "latent": 5e-2, "decoded": 5e-2, "text": 2e-2},
}
RANK_RTOL = 1e-6  # TDP / decode tokens of 3-4 tiles, fp32 blend
BF16_ULP = 2.0 ** -7  # one bf16 ulp relative to the value (upper bound)
NEGATIVE_FACTOR = 100  # fp32 negative control: error above this × the fp32 bound
BF16_FLOOR_FACTOR = 3  # bf16: the bound is at least this × the bf16 floor (module docstring)
REDECODE_TOL = 1e-4  # rank 0's frames / waveform vs this process decoding rank 0's latents (any dtype)
LORA_STRENGTHS = (1.0, 0.8)  # distilled LoRA, user LoRA
LORA_FORWARD_CASE = "odd"  # 9 tokens: padded at W = 2 and 4
GEMMA_PLAN_TOKENS = 64
PIPELINE_VARIANT = "2.3"
PIPELINE_TILES = TileCountConfig.spatial(2, 2, overlap=1)  # stage 2: 4 tiles (W = 2: two per rank)
PIPELINE_DECODE_TILES = TileCountConfig.spatial(1, 2, overlap=1)  # W = 4: ranks 2, 3 decode nothing


def _device(name: str = DEVICE) -> torch.device:
    """The device every rank uses: "cuda" means `cuda:0` (all ranks on the one GPU)."""
    device = torch.device(name)
    return torch.device("cuda", device.index or 0) if device.type == "cuda" else device


ON_CUDA = _device().type == "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (LTX2_MGPU_PARITY_DEVICE=cpu runs these tests on the CPU)")]
CASES = [(w, d) for w in WORLDS for d in DTYPES]
CASE_IDS = [f"W{w}-{d}" for w, d in CASES]


_NUMERICS = {(torch.backends.cuda.matmul, "allow_tf32"): False, (torch.backends.cudnn, "allow_tf32"): False,
             (torch.backends.cudnn, "deterministic"): True, (torch.backends.cudnn, "benchmark"): False}


def _exact_numerics() -> None:
    """IEEE fp32 on the GPU (no TF32 in matmuls or cuDNN convolutions) and deterministic cuDNN algorithm choice (the
    same convolution kernels in every process, so a tile decoded on a rank is the tile decoded here)."""
    for (module, name), value in _NUMERICS.items():
        setattr(module, name, value)


def _rank_setup(device: torch.device) -> None:
    _exact_numerics()
    if device.type == "cuda":
        torch.cuda.set_device(device)


# ---- inputs on the device ------------------------------------------------------------------------------------------

_COMPUTE_DTYPE_ARGS = frozenset({"hidden_states", "audio_hidden_states", "encoder_hidden_states",
                                 "audio_encoder_hidden_states", "encoder_attention_mask",
                                 "audio_encoder_attention_mask"})


def _cast(kwargs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Transformer keyword arguments on `device`: latents, contexts and their masks in the compute dtype; timesteps,
    sigmas and positions stay float32 (what `LTX2Denoiser` passes)."""
    return {k: (v.to(device, dtype) if k in _COMPUTE_DTYPE_ARGS else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


class _OnDevice:
    """The transformer (or its SP wrapper) called with CPU float32 arguments: moves them to the device and the
    compute dtype first. The test helpers of test_sequence_parallel.py (`_forward`, `_stage1`: the sampling state
    stays on the CPU in float32, as in the pipeline) then run unchanged on the device."""

    def __init__(self, inner, device: torch.device, dtype: torch.dtype):
        self.inner, self.device, self.dtype = inner, device, dtype

    def activate(self) -> None:
        if hasattr(self.inner, "activate"):
            self.inner.activate()
        else:
            use_processor(self.inner, LTX2AttnProcessor())  # what a one-process stage installs

    @property
    def split(self):
        """The SP driver's split (None: the plain transformer)."""
        return getattr(self.inner, "split", None)

    def __call__(self, **kwargs):
        return self.inner(**_cast(kwargs, self.device, self.dtype))


def _models(files: dict, device: torch.device, dtype: torch.dtype) -> dict:
    return {v: load_components(files[v]["checkpoint"], ComponentFiles(upsampler=files[v]["upsampler"]), dtype=dtype,
                               device=device)
            for v in VARIANTS}


# ---- the checks' computations: the same code in the ranks (`ranks` = (W, rank)) and in one process (None) ----------

def _sp(models: dict, inputs: dict, device, dtype, ranks=None) -> dict:
    out = {}
    for variant in VARIANTS:
        components = models[variant]
        sp = SequenceDriver(components.transformer, Exchange(None, *ranks)) if ranks else None
        run = _OnDevice(sp or components.transformer, device, dtype)
        run.activate()
        res = {"forward": {case: _cpu(SP._forward(run, kw)) for case, kw in inputs[variant]["forward"].items()},
               "stage1": {case: SP._stage1(components, case, inputs[variant]["contexts"], forward=run)
                          for case in SP.STAGE1_CASES}}
        if sp is not None:  # negative controls: the same forward with one key mask removed
            kwargs = _cast(inputs[variant]["forward"][SP.NEGATIVE_CONTROL_CASE], device, dtype)
            res["no_v2a_mask"] = _cpu(SP._without_mask(sp, GatheredKeysCrossAttention, kwargs))
            res["no_self_mask"] = _cpu(SP._without_mask(sp, UlyssesSelfAttention, kwargs))
        out[variant] = res
    return out


def _tdp(models: dict, inputs: dict, device, dtype, ranks=None) -> dict:
    world, rank = ranks or (1, 0)
    out = {}
    for variant in VARIANTS:
        tf = models[variant].transformer
        kwargs = _cast(inputs[variant]["tdp"], device, dtype)
        for name, tiling in TDP.TILINGS.items():
            video, audio = TDP._tiled_forward(tf, TDP.GRID, tiling, kwargs, world, rank)
            mine = [t.index for t in TiledSplit(tf, TDP.GRID, tiling, None, world, rank).my_tiles]
            out[variant, name] = (video.cpu(), audio.cpu(), mine)
    return out


def _decode(models: dict, device, dtype, ranks=None) -> dict:
    world, rank = ranks or (1, 0)
    out = {}
    for variant in VARIANTS:
        vae = models[variant].video_vae
        for name, (grid, tiling) in DEC.DECODE_CASES.items():
            pixels, report = decode_tiles(vae, DEC._latent(grid), tiling, None, None, world, rank)
            out[variant, name] = (_cpu(pixels), report.tiles)
    return out


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer on the CPU, fp8 tensors as their bytes (for torch.equal)."""
    return {k: (v.view(torch.uint8) if v.element_size() == 1 and v.is_floating_point() else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def _states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _lora(models: dict, files: dict, user_loras: dict, inputs: dict, device, dtype, ranks=None) -> dict:
    """Fuse the distilled and a user LoRA (over the ranks: each layer computed by its owner, broadcast as bytes),
    one forward (SP on the ranks), restore; the same for the fp8 checkpoint of LTX-2.0 (fused into the fp8 weights
    and scales, re-quantized as ComfyUI does: `models/requantize.py`)."""
    world, rank = ranks or (1, 0)
    out = {}
    for variant in VARIANTS:
        tf = models[variant].transformer
        loras = [read_lora(files[variant]["distilled_lora"], LORA_STRENGTHS[0]),
                 read_lora(user_loras[variant], LORA_STRENGTHS[1])]
        before = _state(tf)
        fuser = LoRAFuser(tf, rank, world)
        reports = fuser.fuse(loras)
        fused = {name: tf.get_submodule(name).weight.detach().cpu().clone() for name in fuser.fused_names}
        run = _OnDevice(SequenceDriver(tf, Exchange(None, *ranks)) if ranks else tf, device, dtype)
        run.activate()
        forward = _cpu(SP._forward(run, inputs[variant]["forward"][LORA_FORWARD_CASE]))
        owned = len(fuser.owned())
        fuser.restore()
        out[variant] = dict(reports=[str(r) for r in reports], fused=fused, forward=forward, owned=owned,
                            restored=_states_equal(_state(tf), before))
    fp8 = load_transformer(SafetensorsFile(files["2.0"]["checkpoint_fp8"]), dtype)[0].to(device)
    before = _state(fp8)
    fuser = LoRAFuser(fp8, rank, world)
    fuser.fuse([read_lora(files["2.0"]["distilled_lora"], LORA_STRENGTHS[0])])
    fused = {}
    for name in fuser.fused_names:
        m = fp8.get_submodule(name)
        if isinstance(m, FP8Linear):
            fused[name] = m.weight.detach().view(torch.uint8).cpu().clone()
            fused[name + ".weight_scale"] = m.weight_scale.detach().cpu().clone()
    fp8_kept = all(fp8.get_submodule(n).weight.dtype == torch.float8_e4m3fn for n in fuser.fused_names)
    held = (fuser.fuse_stats.fused_bytes, fuser.clean_bytes)
    fuser.restore()
    cleared = not any(m.lora_fused for m in fp8.modules() if isinstance(m, FP8Linear))
    out["fp8"] = dict(fused=fused, fp8_kept=fp8_kept, held=held,
                      restored=cleared and _states_equal(_state(fp8), before))
    return out


def _split_budgets(path: str, device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """max_memory for a two-device sharded Gemma: the main device (the GPU; the CPU on a CPU run) holds embed_tokens
    and layer 0 besides its activations and one streamed layer; the rest is offloaded (to "cpu" next to a GPU, to
    "disk" next to the CPU)."""
    header = read_gemma_header(path)
    layers, fixed = header.module_bytes(dtype)
    act = G.activation_bytes(header.text_config, GEMMA_PLAN_TOKENS, dtype)
    main, spill = (G.device_key(device), "cpu") if device.type == "cuda" else ("cpu", "disk")
    return {main: act + max(layers) + fixed["embed_tokens"] + layers[0] + 1024, spill: 2 ** 30}


def _gemma(models: dict, files: dict, device, dtype, ranks=None) -> dict:
    """One process: each prompt encoded on its own (`load_gemma(...).encode([p])` + the checkpoint's projection).
    Ranks: the fleet's text service in every mode, on the device."""
    out = {}
    for variant in VARIANTS:
        projection, path = models[variant].text_projection, str(files[variant]["gemma"])
        if ranks is None:
            enc, weight = load_gemma(path, device=device, dtype=dtype), next(projection.parameters())
            refs = []
            for p in GP.PROMPTS:
                hidden, mask = enc.encode([p])
                embeds = projection(hidden.to(weight.device), mask.to(weight.device))
                refs.append(embeds[:, embeds.shape[1] - int(mask.sum()):].float().cpu())
            out[variant] = refs
            continue
        world, rank = ranks
        placement = G.EncoderPlacement(device=device, dtype=dtype, rank=rank, world_size=world,
                                       devices=(str(device),) * world)
        svc = G.TextEncoderService(path, projection, projection_source=path, placement=placement,
                                   settings=G.EncoderSettings(plan_tokens=GEMMA_PLAN_TOKENS))
        res = {}
        for mode in ("replicated", "batch_parallel", "sharded"):
            svc.clear_cache()
            encoding = svc.encode(GP.PROMPTS, mode=mode)
            res[mode], res[mode + " forwards"] = encoding.embeds, encoding.report.forwards_here
        svc.unload()
        split = G.TextEncoderService(path, projection, projection_source=path, placement=placement,
                                     settings=G.EncoderSettings(mode="sharded", plan_tokens=GEMMA_PLAN_TOKENS,
                                                                max_memory=_split_budgets(path, device, dtype)))
        res["split"] = split.encode(GP.PROMPTS).embeds
        res["split map"] = dict(split.device_map)
        split.unload()
        out[variant] = res
    return out


def _request(files: dict, user_loras: dict, image: str) -> GenerateRequest:
    """Image-to-video two-stage (guided stage 1: 27 tokens, padded at W = 2 and 4), the user LoRA on both stages and
    the distilled LoRA on stage 2, explicit stage-2 and decode tilings (so one process tiles the same way)."""
    v = PIPELINE_VARIANT
    return GenerateRequest(prompt="a fox in the snow", steps=2, seed=3, image=image,
                           distilled_lora=(str(files[v]["distilled_lora"]), LORA_STRENGTHS[0]),
                           loras=((str(user_loras[v]), LORA_STRENGTHS[1]),), tiles=PIPELINE_TILES,
                           decode_tiles=PIPELINE_DECODE_TILES, **SP.PIPELINE_SIZE)


def _pipeline(models: dict, files: dict, user_loras: dict, image: str, device, dtype, ranks=None,
              sp_degree: int | None = None, guidance_parallel: str = "off") -> dict:
    """`guidance_parallel`: "off" = stage 1 sequence parallel over the SP degree; "on" = its guidance passes over the
    ranks (splits/passes.py)."""
    components = models[PIPELINE_VARIANT]
    plan = None
    if ranks:
        world, rank = ranks
        plan = build_plan(components.transformer, rank, world, device,
                          FleetPolicy(sp_degree=sp_degree, min_tokens_per_rank=0, guidance_parallel=guidance_parallel))
    gemma = load_gemma(files[PIPELINE_VARIANT]["gemma"], device=device, dtype=dtype)
    result = TwoStagePipeline(components, gemma, device=device, dtype=dtype, plan=plan).generate(
        _request(files, user_loras, image))
    return dict(SP._pipeline_result(result), loras=[str(r) for r in result.lora_reports])


def _everything(models, files, inputs, user_loras, image, device, dtype, ranks=None) -> dict:
    return dict(sp=_sp(models, inputs, device, dtype, ranks), tdp=_tdp(models, inputs, device, dtype, ranks),
                decode=_decode(models, device, dtype, ranks),
                lora=_lora(models, files, user_loras, inputs, device, dtype, ranks),
                gemma=_gemma(models, files, device, dtype, ranks),
                pipeline=_pipeline(models, files, user_loras, image, device, dtype, ranks,
                                   sp_degree=2 if ranks and ranks[0] == 4 else None),
                pipeline_passes=_pipeline(models, files, user_loras, image, device, dtype, ranks,
                                          guidance_parallel="on") if ranks else None)


# ---- rank functions ------------------------------------------------------------------------------------------------

def _parity_rank(rank: int, world: int, device_name: str, dtype_name: str, files: dict, inputs: dict,
                 user_loras: dict, image: str) -> dict:
    device = _device(device_name)
    _rank_setup(device)
    dtype = DTYPES[dtype_name]
    return _everything(_models(files, device, dtype), files, inputs, user_loras, image, device, dtype, (world, rank))


def _collective_round_trips(models: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """One call of each collective the engine issues, on the default group (size 1: each is the identity), with the
    engine's tensor kinds; the LoRA broadcast through `LoRAFuser._broadcast` itself."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, 8, 16, generator=g).to(device, dtype)  # [B, T, H, D] after QK-norm and RoPE
    send = x.reshape(2, 9, 1, 8, 16).permute(2, 0, 1, 3, 4).contiguous()  # Exchange's send buffer [W, B, T/W, H/W, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    kv = torch.randn(2, 5, 8, 16, generator=g).to(device, dtype)
    parts = [torch.empty_like(kv)]
    dist.all_gather(parts, kv)  # SP K/V and outputs
    blend = torch.randn(1, 50, 128, generator=g).to(device)
    summed, reduced = blend.clone(), blend.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # TDP (float32)
    dist.reduce(reduced, dst=0, op=dist.ReduceOp.SUM)  # decode (float32)
    layer = models["2.0"].transformer.transformer_blocks[0].attn1.to_q
    weight = layer.weight.detach().clone()
    LoRAFuser(models["2.0"].transformer)._broadcast(layer.weight, 0)  # the LoRA bytes (uint8 view)
    flag = torch.tensor([1], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)  # the cancel flag / SP stage status
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"all_to_all_single": torch.equal(recv, send), "all_gather": torch.equal(parts[0], kv),
            "all_reduce": torch.equal(summed, blend), "reduce": torch.equal(reduced, blend),
            "broadcast uint8": torch.equal(layer.weight.detach(), weight), "broadcast int32": int(flag.item()) == 1}


def _w1_rank(rank: int, world: int, device_name: str, files: dict, inputs: dict, user_loras: dict,
             image: str) -> dict:
    """W = 1 on the real backend of the device (NCCL on a GPU): the SP wrapper vs the plain forward, the pipeline
    with a plan on this group, one round of each collective; both dtypes."""
    device = _device(device_name)
    _rank_setup(device)
    out = {"backend": str(dist.get_backend())}
    for dtype_name, dtype in DTYPES.items():
        models = _models(files, device, dtype)
        res = {}
        for variant in VARIANTS:
            tf = models[variant].transformer
            plain = _OnDevice(tf, device, dtype)
            plain.activate()
            res[variant, "plain"] = {c: _cpu(SP._forward(plain, kw)) for c, kw in inputs[variant]["forward"].items()}
            sp = _OnDevice(SequenceDriver(tf, Exchange(None, 1, 0)), device, dtype)
            res[variant, "sp"] = {c: _cpu(SP._forward(sp, kw)) for c, kw in inputs[variant]["forward"].items()}
        res["collectives"] = _collective_round_trips(models, device, dtype)
        res["pipeline"] = _pipeline(models, files, user_loras, image, device, dtype, ranks=(1, 0))
        out[dtype_name] = res
    return out


# ---- fixtures -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _numerics():
    saved = {key: getattr(*key) for key in _NUMERICS}
    _exact_numerics()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    yield
    for (module, name), value in saved.items():
        setattr(module, name, value)


@pytest.fixture(scope="module")
def files(tiny_dir) -> dict:
    """The tiny checkpoints of both variants (paths as strings, for the ranks)."""
    return {v: {k: str(p) for k, p in tiny_dir[v].items()} for v in VARIANTS}


@pytest.fixture(scope="module")
def user_loras(tmp_path_factory) -> dict[str, str]:
    """A "user" LoRA per variant (rank 2, other values than the distilled one) in the real key layout."""
    root = tmp_path_factory.mktemp("cuda_parity_loras")
    return {v: str(write_tiny_lora(root / f"user-{v}.safetensors", v, seed=7, rank=2, scale=0.08)) for v in VARIANTS}


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cuda_parity_image") / "first_frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (192, 192, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def inputs(files) -> dict:
    """Per variant, made once on the CPU in float32 with the test modules' own builders: the text contexts (two
    prompts through the real connectors), the forward arguments of every SP case, the TDP forward arguments."""
    out = {}
    for variant in VARIANTS:
        components = load_components(files[variant]["checkpoint"], dtype=torch.float32)
        contexts = SP._contexts(components)
        out[variant] = dict(contexts=contexts, tdp=TDP._model_kwargs(components, TDP.GRID),
                            forward={c: SP._forward_kwargs(components, c, contexts) for c in SP.FORWARD_CASES})
    return out


@pytest.fixture(scope="module")
def reference(files, inputs, user_loras, image):
    """`reference(dtype)`: everything computed in this process on the device (once per dtype), and the models."""
    cache: dict = {}

    def get(dtype_name: str) -> dict:
        if dtype_name not in cache:
            device, dtype = _device(), DTYPES[dtype_name]
            models = _models(files, device, dtype)
            cache[dtype_name] = dict(_everything(models, files, inputs, user_loras, image, device, dtype),
                                     models=models)
        return cache[dtype_name]

    return get


@pytest.fixture(scope="module")
def ranks(files, inputs, user_loras, image):
    """`ranks(W, dtype)`: the per-rank results of `_parity_rank` (one spawn per (W, dtype))."""
    cache: dict = {}

    def get(world: int, dtype_name: str) -> list[dict]:
        if (world, dtype_name) not in cache:
            cache[world, dtype_name] = run_ranks(_parity_rank, world, DEVICE, dtype_name, files, inputs, user_loras,
                                                 image, timeout_s=300.0)
        return cache[world, dtype_name]

    return get


# ---- checks ----------------------------------------------------------------------------------------------------------

def _close(got: torch.Tensor, ref: torch.Tensor, what: str, dtype_name: str, kind: str,
           fp32_ref: torch.Tensor | None) -> None:
    """`got` within the bound of `kind` for the dtype; in bf16 at least `BF16_FLOOR_FACTOR` × the bf16 floor (the
    one-process bf16 result's distance from the one-process fp32 result, `fp32_ref`)."""
    tol = TOL[dtype_name][kind]
    if dtype_name == "bf16":
        floor = SP._rel(ref, fp32_ref)
        tol = max(tol, BF16_FLOOR_FACTOR * floor)
        print(f"{what}: bf16 floor (one process, bf16 vs fp32) {floor:.3e} -> bound {tol:.3e}")
    SP._assert_close(got.double(), ref.double(), f"{what} [{dtype_name}]", tol)


def _same_on_every_rank(results: list, get, what: str) -> None:
    first = get(results[0])
    for rank, r in enumerate(results[1:], 1):
        assert torch.equal(get(r), first), f"{what}: rank {rank} differs from rank 0"


# ---- W = 1 on the device's own backend (NCCL on a GPU) ---------------------------------------------------------------

def test_w1_real_backend(files, inputs, user_loras, image, reference):
    """One rank in a process group of the device's backend (a real NCCL group of size 1 on a GPU): the SP wrapper
    gives the plain forward bit for bit; each collective the engine issues is the identity; the two-stage pipeline
    with a plan on this group equals the one-process pipeline."""
    backend = "nccl" if ON_CUDA else "gloo"
    (result,) = run_ranks(_w1_rank, 1, DEVICE, files, inputs, user_loras, image, timeout_s=300.0, backend=backend)
    assert result["backend"] == backend
    fp32 = reference("fp32")
    for dtype_name in DTYPES:
        res, ref = result[dtype_name], reference(dtype_name)
        assert all(res["collectives"].values()), f"{backend} {dtype_name}: {res['collectives']}"
        for variant in VARIANTS:
            for case in SP.FORWARD_CASES:
                for i, modality in enumerate(("video", "audio")):
                    plain, sp = res[variant, "plain"][case][i], res[variant, "sp"][case][i]
                    assert torch.equal(sp, plain), f"{dtype_name} {variant} {case} {modality}: SP W=1 != plain"
                    _close(plain, ref["sp"][variant]["forward"][case][i], f"W=1 {backend} {variant} {case} "
                           f"{modality}", dtype_name, "forward", fp32["sp"][variant]["forward"][case][i])
        got, want = res["pipeline"], ref["pipeline"]
        assert got["report"] == "one rank" and got["loras"] == want["loras"]
        for name, kind in [(n, "latent") for n in SP.LATENTS] + [(n, "decoded") for n in SP.DECODED]:
            _close(got[name], want[name], f"W=1 {backend} pipeline {name}", dtype_name, kind, fp32["pipeline"][name])


# ---- sequence parallel ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_sp_forward_and_stage1(reference, ranks, world, dtype_name):
    """One forward of every SP case (among them 9 tokens: T % W != 0, padded keys masked in self-attention and
    video→audio) and a guided image-to-video stage 1 (batch 1 and 2): video and audio equal one process within the
    dtype's bound; every rank holds the same outputs."""
    results = ranks(world, dtype_name)
    ref, fp32 = reference(dtype_name)["sp"], reference("fp32")["sp"]
    for variant in VARIANTS:
        for case in SP.FORWARD_CASES:
            t = np.prod(SP.FORWARD_CASES[case]["grid"])
            for i, modality in enumerate(("video", "audio")):
                _close(results[0]["sp"][variant]["forward"][case][i], ref[variant]["forward"][case][i],
                       f"forward {variant} W={world} {case} (T={t}, T%W={t % world}) {modality}", dtype_name,
                       "forward", fp32[variant]["forward"][case][i])
                _same_on_every_rank(results, lambda r: r["sp"][variant]["forward"][case][i], f"{case} {modality}")
        for case in SP.STAGE1_CASES:
            got, want = results[0]["sp"][variant]["stage1"][case], ref[variant]["stage1"][case]
            assert got["forwards"] == want["forwards"] == 4 * SP.STAGE1_STEPS
            assert got["first_frame_kept"] and want["first_frame_kept"]
            for modality in ("video", "audio"):
                _close(got[modality], want[modality], f"stage 1 {variant} W={world} {case} {modality}", dtype_name,
                       "stage", fp32[variant]["stage1"][case][modality])
                _same_on_every_rank(results, lambda r: r["sp"][variant]["stage1"][case][modality],
                                    f"stage 1 {case} {modality}")


@pytest.mark.parametrize("world", WORLDS)
def test_sp_negative_control_fp32(reference, ranks, world):
    """Dropping the key mask of the video→audio attention (or of the video self-attention) moves the audio (video)
    far above the fp32 bound: the parity test above can fail on this device."""
    results, ref = ranks(world, "fp32"), reference("fp32")["sp"]
    bound = NEGATIVE_FACTOR * TOL["fp32"]["forward"]
    for variant in VARIANTS:
        ref_video, ref_audio = ref[variant]["forward"][SP.NEGATIVE_CONTROL_CASE]
        err_audio = SP._rel(results[0]["sp"][variant]["no_v2a_mask"][1], ref_audio)
        err_video = SP._rel(results[0]["sp"][variant]["no_self_mask"][0], ref_video)
        print(f"negative controls {variant} W={world}: audio {err_audio:.3e}, video {err_video:.3e}")
        assert err_audio > bound and err_video > bound, (err_audio, err_video)


# ---- tiled stage 2 and distributed decode ----------------------------------------------------------------------------

def _check_blend(got: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, what: str, bf16_output: bool) -> float:
    """≤ 2 tiles: bit-identical; else within the reassociation bound (one bf16 ulp for a bf16 output)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    assert torch.equal(got[low], ref[low]), f"{what}: values of ≤ 2 tiles differ (must be bit-identical)"
    diff, mag = (got.double() - ref.double()).abs(), ref.double().abs()
    bound = BF16_ULP * mag + RANK_RTOL if bf16_output else RANK_RTOL * (1 + mag)
    assert (diff <= bound).all(), f"{what}: max |Δ| {float(diff.max()):.2e} above the bound"
    return float((diff / (1 + mag)).max())


@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_tdp_parity(reference, ranks, inputs, world, dtype_name):
    """TDP on W ranks (tiles round-robin, one all_reduce of CUDA tensors) equals the same tiling in one process."""
    results, ref = ranks(world, dtype_name), reference(dtype_name)["tdp"]
    worst = 0.0
    for variant in VARIANTS:
        for name, tiling in TDP.TILINGS.items():
            coverage = TDP._coverage(TDP.GRID, tiling, inputs[variant]["tdp"])
            assert [r["tdp"][variant, name][2] for r in results] == \
                [list(range(r, tiling.num_tiles, world)) for r in range(world)]  # round-robin
            _same_on_every_rank(results, lambda r: r["tdp"][variant, name][0], f"TDP {variant} {name}")
            video, audio, _ = results[0]["tdp"][variant, name]
            assert torch.equal(audio, torch.zeros_like(audio))  # the stage-2 audio is frozen: no blend
            worst = max(worst, _check_blend(video, ref[variant, name][0], (coverage <= 2)[None],
                                            f"TDP {variant} {name} W={world} [{dtype_name}]", dtype_name == "bf16"))
    print(f"TDP W={world} {dtype_name}: max |Δ|/(1+|ref|) {worst:.2e}")


@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_decode_parity(reference, ranks, world, dtype_name):
    """Distributed VAE decode (tiles round-robin, one reduce of CUDA tensors to rank 0) equals the one-process tiled
    decode."""
    results, ref = ranks(world, dtype_name), reference(dtype_name)["decode"]
    worst = 0.0
    for variant in VARIANTS:
        for name, (grid, tiling) in DEC.DECODE_CASES.items():
            assert [r["decode"][variant, name][1] for r in results] == \
                [tuple(range(r, tiling.num_tiles, world)) for r in range(world)]
            assert all(r["decode"][variant, name][0] is None for r in results[1:]), "frames only on rank 0"
            want = ref[variant, name][0]
            low = (DEC._pixel_coverage(grid, tiling) <= 2).expand_as(want)
            worst = max(worst, _check_blend(results[0]["decode"][variant, name][0], want, low,
                                            f"decode {variant} {name} W={world} [{dtype_name}]", False))
    print(f"decode W={world} {dtype_name}: max |Δ|/(1+|ref|) {worst:.2e}")


# ---- Gemma -----------------------------------------------------------------------------------------------------------

GEMMA_MODES = ("replicated", "batch_parallel", "sharded", "split")


@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_gemma_parity(reference, ranks, world, dtype_name):
    """Every mode of the fleet's text service on W ranks of the one device (replicated, batch-parallel, sharded on the
    device, sharded over the device plus an offload device) gives every rank the one-process encode of each prompt."""
    results, ref, fp32 = ranks(world, dtype_name), reference(dtype_name)["gemma"], reference("fp32")["gemma"]
    main, spill = (G.device_key(_device()), "cpu") if ON_CUDA else ("cpu", "disk")
    for variant in VARIANTS:
        for rank, r in enumerate(results):
            res = r["gemma"][variant]
            for mode in GEMMA_MODES:
                assert len(res[mode]) == len(GP.PROMPTS)
                for i, (got, want) in enumerate(zip(res[mode], ref[variant])):
                    _close(got, want, f"Gemma {variant} W={world} rank {rank} {mode} prompt {i}", dtype_name, "text",
                           fp32[variant][i])
                    assert torch.equal(got, results[0]["gemma"][variant][mode][i])  # every rank: the same tensors
            assert res["sharded forwards"] == (3 if rank == 0 else 0)  # only the driver encodes (3 distinct prompts)
            assert set(res["split map"].values()) == {main, spill}, res["split map"]
        split = [r["gemma"][variant]["batch_parallel forwards"] for r in results]
        assert sum(split) == 3 and max(split) < 3, f"the prompts were not split over the ranks: {split}"


@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_gemma_bit_identical(reference, ranks, world, dtype_name):
    """The engine's claim (stages/text_encoder.py): every mode equals the one-process encode bit for bit on the same device
    type and dtype (each prompt is encoded alone, with the same kernels)."""
    results, ref = ranks(world, dtype_name), reference(dtype_name)["gemma"]
    for variant in VARIANTS:
        for mode in GEMMA_MODES:
            got = results[0]["gemma"][variant][mode]
            assert all(torch.equal(a, b) for a, b in zip(got, ref[variant])), f"{variant} {mode}: not bit-identical"


# ---- LoRA ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_lora_parity(reference, ranks, world, dtype_name):
    """Two LoRAs fused over W ranks (each layer by its owner, broadcast as bytes between CUDA tensors) give every rank
    the weights one process fuses, bit for bit; an SP forward with them equals the one-process forward; restore
    gives back the loaded weights exactly. The fp8 checkpoint: the re-quantized fp8 bytes and scales equal too (the
    stochastic rounding's random draws come from each owner's CUDA generator with ComfyUI's seed), no full-precision
    copy is held, and restore is exact."""
    results, ref = ranks(world, dtype_name), reference(dtype_name)
    for variant in VARIANTS:
        want = ref["lora"][variant]
        assert want["owned"] == len(want["fused"]) > 0  # one process owns every fused layer
        for rank, r in enumerate(results):
            got = r["lora"][variant]
            assert got["reports"] == want["reports"]
            assert got["fused"].keys() == want["fused"].keys()
            bad = [n for n in want["fused"] if not torch.equal(got["fused"][n], want["fused"][n])]
            assert not bad, f"{variant} rank {rank}: fused weights differ from one process: {bad[:5]}"
            assert got["restored"], f"{variant} rank {rank}: restore did not give back the loaded weights"
        owned = [r["lora"][variant]["owned"] for r in results]
        assert sum(owned) == len(want["fused"]) and min(owned) >= 1, owned  # the work is split over the ranks
        for i, modality in enumerate(("video", "audio")):
            _close(results[0]["lora"][variant]["forward"][i], want["forward"][i],
                   f"LoRA forward {variant} W={world} {modality}", dtype_name, "forward",
                   reference("fp32")["lora"][variant]["forward"][i])
            _same_on_every_rank(results, lambda r: r["lora"][variant]["forward"][i], f"LoRA forward {modality}")
            base = ref["sp"][variant]["forward"][LORA_FORWARD_CASE][i]
            assert SP._rel(want["forward"][i], base) > 1e-3, "the LoRAs do not change the output"
    want = ref["lora"]["fp8"]
    assert len(want["fused"]) == 2 * 56 and want["fp8_kept"] and want["restored"] and want["held"][0] == 0
    for rank, r in enumerate(results):
        got = r["lora"]["fp8"]
        assert got["fp8_kept"] and got["restored"] and got["held"][0] == 0, f"fp8 rank {rank}"
        assert got["fused"].keys() == want["fused"].keys()
        assert all(torch.equal(got["fused"][n], want["fused"][n]) for n in want["fused"]), f"fp8 rank {rank}"


# ---- the two-stage pipeline ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_guidance_parallel_pipeline_parity(reference, ranks, world, dtype_name):
    """The same pipeline with stage 1's guidance passes spread over the ranks (4 passes: 2 per rank at W = 2, 1 at
    W = 4) equals the one-process pipeline within the same bounds (on one device and dtype it is the same forwards)."""
    results = [r["pipeline_passes"] for r in ranks(world, dtype_name)]
    want, fp32 = reference(dtype_name)["pipeline"], reference("fp32")["pipeline"]
    assert f"guidance passes in parallel on {world} ranks" in results[0]["report"], results[0]["report"]
    for name in SP.LATENTS:
        _close(results[0][name], want[name], f"passes W={world} {name}", dtype_name, "latent", fp32[name])
        _same_on_every_rank(results, lambda r: r[name], f"passes {name}")
    for name in SP.DECODED:
        _close(results[0][name], want[name], f"passes W={world} {name}", dtype_name, "decoded", fp32[name])


@pytest.mark.parametrize("world,dtype_name", CASES, ids=CASE_IDS)
def test_pipeline_parity(reference, ranks, files, user_loras, image, world, dtype_name):
    """The two-stage image-to-video pipeline on W ranks of the one device (SP stage 1 — on ranks 0-1 at W = 4, handed
    to ranks 2-3 by broadcast —, the LoRA switch between stages, TDP stage 2, distributed decode) equals the
    one-process pipeline; latents identical on every rank, frames and audio on rank 0, and exactly what this process
    decodes from rank 0's latents (to 1e-4: what differs from one process is the latents, not the decoders)."""
    results = [r["pipeline"] for r in ranks(world, dtype_name)]
    want, fp32 = reference(dtype_name)["pipeline"], reference("fp32")["pipeline"]
    expected = "sequence parallel over all 2 ranks" if world == 2 else "sequence parallel on ranks 0-1 of 4"
    assert results[0]["report"].startswith(expected), results[0]["report"]
    assert results[0]["loras"] == want["loras"]
    for name in SP.LATENTS:
        _close(results[0][name], want[name], f"pipeline W={world} {name}", dtype_name, "latent", fp32[name])
        _same_on_every_rank(results, lambda r: r[name], f"pipeline {name}")
    for name in SP.DECODED:
        _close(results[0][name], want[name], f"pipeline W={world} {name}", dtype_name, "decoded", fp32[name])
        assert all(r[name] is None for r in results[1:]), f"{name} only on rank 0"
    pipeline = TwoStagePipeline(reference(dtype_name)["models"][PIPELINE_VARIANT], None, device=_device(),
                                dtype=DTYPES[dtype_name])
    request = _request(files, user_loras, image)
    frames, _ = pipeline.decode_video(results[0]["video_latent"], request.seed, request.decode_tiles)
    waveform, _ = pipeline.decode_audio(results[0]["audio_latent"])
    redecode = REDECODE_TOL
    SP._assert_close(frames, results[0]["frames"], f"W={world} frames re-decoded here [{dtype_name}]", redecode)
    SP._assert_close(waveform, results[0]["audio"], f"W={world} waveform re-decoded here [{dtype_name}]", redecode)
