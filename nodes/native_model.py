"""The native ComfyUI MODEL whose transformer runs on the fleet (issue 19; docs/design/native-model.md).

`build_native_model(path, transport)` returns a `comfy.model_patcher.ModelPatcher` around ComfyUI's own LTX-AV model
wrapper (`model_base.LTXAV`: model sampling, latent format, conditioning handling are ComfyUI's) built without
weights: the configuration comes from the safetensors header alone (shape-only tensors into ComfyUI's own
`model_detection`), the DiT is not created (`disable_unet_model_creation`), and `diffusion_model` is a
`FleetTransformer` — a weightless proxy whose every call goes to the fleet:

- `forward(x, timestep, context, …)`: ComfyUI's DIFFUSION_MODEL wrappers run here, around the remote call (EasyCache
  keeps skipping steps); the arguments become a `ForwardRequest` (nodes/native_forward.py), the processed context is
  shipped once per conditioning per sampling, the sampling patcher's plain LoRAs once per `patches_uuid`;
- `preprocess_text_embeds(context, unprocessed)` (called by `LTXAV.extra_conds`; the caption projection and the
  connectors are transformer weights): a "preprocess_text" job;
- what else ComfyUI reads: `.dtype` (the inference dtype native would pick), `.patchifier` / `.a_patchifier`
  (weightless, ComfyUI's own classes), the config attributes (`cross_attention_dim`, …) and `state_dict()` with the
  real key names as meta tensors (no registered parameters: ComfyUI's memory management loads and counts nothing;
  LoRA key mapping and `add_patches` see every key).

The patcher is a plain `ModelPatcher(size=1)` and the model's memory estimate is tiny, so ComfyUI keeps cond and
uncond in one batched call (the pair the fleet can split over ranks).
"""
from __future__ import annotations

import json
import logging
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:  # inside ComfyUI the pack is one package (mangled name); tests import `nodes` and `mgpu_backend` top-level
    from ..mgpu_backend.protocol import native_forward as F
except ImportError:
    from mgpu_backend.protocol import native_forward as F
from . import native_forward as NF
from .native_patches import refuse_core_multigpu, refuse_patcher_features
from .native_types import UnsupportedInput

log = logging.getLogger("ltx2_mgpu.nodes")

# the memory estimate ComfyUI's sampler sees per input element (the inputs and outputs stay in ComfyUI's memory;
# the transformer's activations are on the fleet)
MEMORY_USAGE_FACTOR = 1e-4

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}

# LTXAVModel.__init__ defaults (ComfyUI 0.33) for the attributes ComfyUI's nodes read off `diffusion_model`
_CONFIG_DEFAULTS = {"in_channels": 128, "audio_in_channels": 128, "cross_attention_dim": 4096,
                    "audio_cross_attention_dim": 2048, "attention_head_dim": 128, "audio_attention_head_dim": 64,
                    "num_attention_heads": 32, "audio_num_attention_heads": 32, "caption_channels": 3840,
                    "num_layers": 48, "timestep_scale_multiplier": 1000.0, "av_ca_timestep_scale_multiplier": 1.0,
                    "vae_scale_factors": (8, 32, 32), "causal_temporal_positioning": False,
                    "use_middle_indices_grid": False, "caption_proj_before_connector": False,
                    "cross_attention_adaln": False, "apply_gated_attention": False}


def read_header(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The safetensors file's tensors as meta tensors (shape and dtype, no data) and its metadata — the header alone
    is read. Raises ValueError naming the file when it is not a safetensors file or holds an unknown dtype."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 200 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON)") from None
    metadata = header.pop("__metadata__", None) or {}
    sd = {}
    for key, info in header.items():
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {key} has dtype {info['dtype']}, which this loader does not know")
        sd[key] = torch.empty(info["shape"], dtype=dtype, device="meta")
    return sd, metadata


Transport = Callable[[str, Any], Any]  # (job kind, payload) -> the job's result


@dataclass(frozen=True)
class FleetForwardReport:
    """How the fleet ran one forward: report (`ForwardReply.report`, e.g. "sequence parallel over all 4 ranks"; ""
    before the first forward) and lora_reports (the fused LoRA set's coverage, one line per strength group)."""

    report: str = ""
    lora_reports: tuple[str, ...] = ()


class FleetTransformer(torch.nn.Module):
    """The weightless stand-in for ComfyUI's `LTXAVModel` (module docstring). No parameters, no buffers.

    transport(kind, payload): runs one fleet job ("forward" / "preprocess_text") and returns its result (ForwardReply
    or ForwardMiss; PreprocessTextReply); the node layer passes `common.run_job` bound to the fleet handle."""

    def __init__(self, unet_config: dict, dtype: torch.dtype, keys: dict[str, torch.Tensor], transport: Transport,
                 name: str = ""):
        super().__init__()
        from comfy.ldm.lightricks.symmetric_patchifier import AudioPatchifier, SymmetricPatchifier

        self.dtype = dtype
        for attr, default in _CONFIG_DEFAULTS.items():
            setattr(self, attr, unet_config.get(attr, default))
        self.inner_dim = self.num_attention_heads * self.attention_head_dim
        self.audio_inner_dim = self.audio_num_attention_heads * self.audio_attention_head_dim
        self.patchifier = SymmetricPatchifier(1, start_end=True)  # as LTXVModel / LTXAVModel build them
        self.a_patchifier = AudioPatchifier(1, start_end=True)
        self.name = name
        self._keys = keys  # state-dict key -> meta tensor
        self._transport = transport
        self._owner: Callable[[], Any] = lambda: None  # weakref to the BaseModel (its current_patcher)
        self._lock = threading.Lock()
        self.known_contexts: OrderedDict[str, None] = OrderedDict()  # context row keys the fleet holds
        self.known_loras: set[str] = set()
        self.logged_loras: set[tuple[str, str]] = set()  # (LoRA set key, part) whose coverage is in ComfyUI's log
        self.stats = {"forwards": 0, "context_sent": 0, "misses": 0, "preprocess": 0}
        # how the fleet ran the latest forward: ComfyUI's sampler keeps only the forward's tensors, so the reply's
        # report stays here for whoever shows it
        self.report = FleetForwardReport()

    # ---- what ComfyUI reads ----------------------------------------------------------------------------------------

    def attach(self, base_model) -> None:
        self._owner = weakref.ref(base_model)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):  # noqa: D401 - nn.Module's signature
        """The real key names as meta tensors (LoRA key mapping and `add_patches` use them; nothing is loaded)."""
        if destination is None:
            destination = OrderedDict()
        for key, t in self._keys.items():
            destination[prefix + key] = t
        return destination

    def load_state_dict(self, *args, **kwargs):
        raise UnsupportedInput("the MGPU model holds no weights in ComfyUI (its transformer is on the fleet); "
                               "loading weights into it (model merges, checkpoint tools) is not supported")

    def preprocess_text_embeds(self, context: torch.Tensor, unprocessed: bool = False) -> torch.Tensor:
        """`LTXAVModel.preprocess_text_embeds` on the fleet (caption projection + connectors), with the sampling
        patcher's LoRA patches of the connectors fused for the call, as ComfyUI runs them on its patched weights."""
        patcher = getattr(self._owner(), "current_patcher", None)
        with self._lock:
            request = F.PreprocessTextRequest(context.detach().cpu(), bool(unprocessed), lora=self._lora(patcher))
            for _ in range(3):
                reply = self._call(F.PREPROCESS_TEXT_JOB, request)
                if type(reply).__name__ != "ForwardMiss":  # by name: see _run_forward
                    break
                self.known_loras.discard(reply.lora_key)  # the fleet lost the set: ship its patches
                request = _replace(request, lora=self._lora(patcher))
            else:
                raise RuntimeError("the fleet kept answering ForwardMiss for the same preprocess_text request")
            if request.lora is not None and request.lora.patches is not None:
                self.known_loras.add(request.lora.key)
            if request.lora is not None:
                self._log_coverage(request.lora.key, "on the text connectors",
                                   tuple(getattr(reply, "lora_reports", ()) or ()))
            self.stats["preprocess"] += 1
        return reply.context.to(device=context.device, dtype=context.dtype)

    # ---- forward ---------------------------------------------------------------------------------------------------

    def forward(self, x, timestep, context, attention_mask=None, frame_rate=25, transformer_options={},
                keyframe_idxs=None, **kwargs):
        """ComfyUI's `LTXAVModel.forward` signature; the DIFFUSION_MODEL wrappers run here as in `LTXBaseModel`."""
        import comfy.patcher_extension as pe

        if isinstance(timestep, (tuple, list)) and len(timestep) == 2:
            kwargs["a_timestep"] = timestep[1]
            timestep = timestep[0]
        else:
            kwargs["a_timestep"] = timestep
        return pe.WrapperExecutor.new_class_executor(
            self._forward, self, pe.get_all_wrappers(pe.WrappersMP.DIFFUSION_MODEL, transformer_options),
        ).execute(x, timestep, context, attention_mask, frame_rate, transformer_options, keyframe_idxs, **kwargs)

    def _forward(self, x, timestep, context, attention_mask=None, frame_rate=25, transformer_options={},
                 keyframe_idxs=None, **kwargs):
        try:
            return self._remote_forward(x, timestep, context, attention_mask, frame_rate, transformer_options,
                                        keyframe_idxs, **kwargs)
        except (UnsupportedInput, F.ForwardContractError) as exc:
            from .common import NodeError

            raise NodeError(f"MGPU model: {exc}") from None

    def _remote_forward(self, x, timestep, context, attention_mask, frame_rate, transformer_options, keyframe_idxs,
                        **kwargs):
        owner = self._owner()
        patcher = getattr(owner, "current_patcher", None)
        refuse_patcher_features(patcher)
        a_timestep = kwargs.pop("a_timestep", timestep)
        with self._lock:
            lora = self._lora(patcher)
            call = NF.ComfyForwardCall(x, (timestep, a_timestep), context, attention_mask, frame_rate,
                                       transformer_options, keyframe_idxs, kwargs)
            request = NF.build_request(call, known_contexts=self.known_contexts, lora=lora)
            reply = self._run_forward(request, context, patcher)
            self.stats["forwards"] += 1
        return NF.reply_output(reply, x)

    def _lora(self, patcher) -> F.LoraSet | None:
        patches = getattr(patcher, "patches", None) or {}
        if not patches:
            return None  # the fleet restores its clean weights (a LoRA never leaks into a plain run)
        key = f"{patcher.patches_uuid}"
        return NF.lora_set(patches, key, key in self.known_loras)

    def _run_forward(self, request: F.ForwardRequest, context, patcher) -> F.ForwardReply:
        for _ in range(3):
            if request.context is not None:
                self.stats["context_sent"] += 1
            result = self._call(F.FORWARD_JOB, request)
            # by name: the reply's classes may come from another import of the engine package (the controller's
            # unpickler resolves them under whichever name imports first)
            kind = type(result).__name__
            if kind == "ForwardReply":
                self._remember(request, result)
                return result
            if kind != "ForwardMiss":
                raise RuntimeError(f"the fleet's forward job answered {type(result).__name__}, not a ForwardReply")
            self.stats["misses"] += 1
            for k in result.context_keys:
                self.known_contexts.pop(k, None)
            if result.context_keys:
                request = NF.with_context(request, context)
            if result.lora_key is not None:
                self.known_loras.discard(result.lora_key)
                request = _replace(request, lora=self._lora(patcher))
        raise RuntimeError("the fleet kept answering ForwardMiss for the same request")

    def _remember(self, request: F.ForwardRequest, reply) -> None:
        lora_reports = tuple(getattr(reply, "lora_reports", ()) or ())
        self.report = FleetForwardReport(reply.report, lora_reports)
        for line in getattr(reply, "slowdowns", ()) or ():  # new in this reply: forwards eager and why, with the cost
            log.warning("MGPU MODEL: %s", line)
        for k in request.context_keys:
            self.known_contexts[k] = None
            self.known_contexts.move_to_end(k)
        while len(self.known_contexts) > 64:  # what we believe the fleet holds; a wrong belief costs one ForwardMiss
            self.known_contexts.popitem(last=False)
        if request.lora is not None and request.lora.patches is not None:
            self.known_loras.add(request.lora.key)
        if request.lora is not None:
            self._log_coverage(request.lora.key, "in the transformer", lora_reports)
        partial = [r for r in lora_reports if "not in this model" in r]
        if partial:  # ComfyUI would patch those weights (e.g. the text connectors'): never dropped silently
            raise UnsupportedInput(f"the fleet could not apply every layer of the LoRA: {'; '.join(partial)}")

    def _log_coverage(self, key: str, part: str, reports: tuple[str, ...]) -> None:
        """Log (INFO, through ComfyUI's root logger: its console and log file) the coverage the fleet reported for a
        LoRA set, once per set and part — the first reply after the set is fused, whichever job shipped its patches
        (`preprocess_text` ships them before the first forward, then the forwards name the set by its key)."""
        if not reports or (key, part) in self.logged_loras:
            return
        self.logged_loras.add((key, part))
        log.info("MGPU model: LoRA fused on the fleet %s: %s", part, "; ".join(reports))

    def _call(self, kind: str, payload):
        return self._transport(kind, payload)

    def forget(self) -> None:
        """Forget what the fleet holds (a new fleet: everything is shipped again)."""
        self.known_contexts.clear()
        self.known_loras.clear()
        self.logged_loras.clear()


class FleetTransport:
    """`transport` of a FleetTransformer: one fleet job per call through `common.run_job` (ComfyUI's interrupt
    cancels it; no progress bar of its own: the sampler shows ComfyUI's). Follows the fleet when it is configured
    again (the proxy then forgets what the old fleet held)."""

    def __init__(self, handle):
        self.handle = handle
        self.proxy: FleetTransformer | None = None

    def __call__(self, kind: str, payload):
        from .common import run_job

        return run_job(self.handle, kind, payload, what=f"MGPU model {kind}", progress=False,
                       on_handle=self._renewed)

    def _renewed(self, handle) -> None:
        self.handle = handle
        if self.proxy is not None:
            self.proxy.forget()


def _replace(request, **changes):
    import dataclasses

    return dataclasses.replace(request, **changes)


def build_native_model(path: str, transport: Transport, name: str = ""):
    """A native ComfyUI MODEL (ModelPatcher) for the LTX-AV file at `path` whose transformer runs through `transport`.

    Mirrors `comfy.sd.load_diffusion_model_state_dict` on the header: the unet prefix and configuration detection,
    the weight / inference dtype choice (`set_inference_dtype`), `model_config.get_model` — without creating the DiT
    or reading any weight. Raises ValueError naming the file when it is not an LTX-AV (LTX-2) transformer."""
    import comfy.model_detection as md
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.patcher_extension as pe
    import comfy.utils
    from comfy import model_base

    sd, metadata = read_header(path)
    prefix = md.unet_prefix_from_state_dict(sd)
    unet_sd = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True)
    if unet_sd:
        sd = unet_sd
    parameters = comfy.utils.calculate_parameters(sd)
    weight_dtype = comfy.utils.weight_dtype(sd)
    load_device = mm.get_torch_device()
    model_config = md.model_config_from_unet(sd, "", metadata=metadata)
    if model_config is None or model_config.unet_config.get("image_model") != "ltxav":
        found = "no known model" if model_config is None else model_config.unet_config.get("image_model")
        raise ValueError(f"{path}: not an LTX-2 audio-video transformer (ComfyUI detects {found})")
    supported = list(model_config.supported_inference_dtypes)
    if model_config.quant_config is not None:
        weight_dtype = None
    unet_dtype = mm.unet_dtype(model_params=parameters, supported_dtypes=supported, weight_dtype=weight_dtype)
    if model_config.quant_config is not None:
        manual_cast = mm.unet_manual_cast(None, load_device, model_config.supported_inference_dtypes)
    else:
        manual_cast = mm.unet_manual_cast(unet_dtype, load_device, model_config.supported_inference_dtypes)
    model_config.set_inference_dtype(unet_dtype, manual_cast, device=load_device)
    model_config.unet_config["disable_unet_model_creation"] = True
    model = model_config.get_model(sd, "")
    if not isinstance(model, model_base.LTXAV):
        raise ValueError(f"{path}: ComfyUI builds {type(model).__name__} for it, not LTXAV")
    proxy = FleetTransformer(model_config.unet_config, model_config.unet_config.get("dtype") or unet_dtype, sd,
                             transport, name=name)
    model.diffusion_model = proxy
    proxy.attach(model)
    model.memory_usage_factor = MEMORY_USAGE_FACTOR
    model.state_dict_for_saving = _refuse_saving
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=load_device,
                                               offload_device=mm.unet_offload_device(), size=1)
    # core's reload factory (ModelPatcher.deepclone_multigpu: Select Model Device onto another device, MultiGPU CFG
    # Split): another weightless proxy on the same transport; CFG Split is then refused by name when sampling
    patcher.cached_patcher_init = (build_native_model, (path, transport, name))
    patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "ltx2_mgpu", _refuse_before_sampling)
    return patcher


def _refuse_before_sampling(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper (runs in `CFGGuider.sample` before ComfyUI loads models or builds the sampler's state):
    what the fleet cannot honour fails here, naming it, instead of at the first forward."""
    guider = executor.class_obj
    patcher = guider.model_patcher
    try:
        refuse_patcher_features(patcher)
        refuse_core_multigpu(patcher, guider.model_options, _model_links_into_running_node())
    except UnsupportedInput as exc:
        from .common import NodeError

        raise NodeError(f"MGPU model: {exc}") from None
    return executor(*args, **kwargs)


def _model_links_into_running_node() -> set[str]:
    """Class types of the nodes on the running prompt's `model` / `guider` links into the node executing now (the
    sampler), from the server's queue; empty outside a server (a script driving ComfyUI's nodes)."""
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer
    except ImportError:
        return set()
    context = get_executing_context()
    queue = getattr(getattr(PromptServer, "instance", None), "prompt_queue", None)
    if context is None or queue is None:
        return set()
    running, _ = (getattr(queue, "get_current_queue_volatile", None) or queue.get_current_queue)()
    prompt = next((item[2] for item in running if item[1] == context.prompt_id), None) or {}
    classes, todo, seen = set(), [str(context.node_id)], set()
    while todo:
        node = prompt.get(todo.pop(), {})
        for name in ("model", "guider"):
            link = node.get("inputs", {}).get(name)
            if isinstance(link, list) and len(link) == 2 and str(link[0]) in prompt and str(link[0]) not in seen:
                seen.add(str(link[0]))
                classes.add(prompt[str(link[0])].get("class_type"))
                todo.append(str(link[0]))
    return classes


def fleet_model(path: str, handle, name: str = ""):
    """`build_native_model` whose transformer runs on the fleet of `handle`."""
    transport = FleetTransport(handle)
    patcher = build_native_model(path, transport, name=name)
    transport.proxy = proxy_of(patcher)
    return patcher


def _refuse_saving(*args, **kwargs):
    from .common import NodeError

    raise NodeError("MGPU model: saving a checkpoint (CheckpointSave / ModelSave) needs the weights in ComfyUI, but "
                    "the MGPU model's transformer lives on the fleet; save from ComfyUI's own loader's MODEL")


def proxy_of(model_patcher) -> FleetTransformer | None:
    """The FleetTransformer of a MODEL, or None for any other model."""
    dm = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    return dm if isinstance(dm, FleetTransformer) else None
