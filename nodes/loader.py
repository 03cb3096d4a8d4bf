"""Load Checkpoint (MGPU): resolve model files from ComfyUI's folders, start (or reuse) the worker fleet, show the plan."""
from __future__ import annotations

import os
from dataclasses import dataclass

import folder_paths
from comfy_api.latest import io, ui

from ..mgpu_backend.protocol.errors import ControllerError
from ..mgpu_backend.protocol.fleet_config import INT8_COMPUTE_MODES, WEIGHT_MODES, FleetConfig, FleetHandle
from ..mgpu_backend.protocol.fleet_rules import check_fleet
from ..mgpu_backend.protocol.job_results import FleetDescription
from ..mgpu_backend.protocol.resources import LINKS_GBPS, sharded_gather_seconds
from .common import CATEGORY, Fleet, NodeError, client, guard, log
from .widgets import read_widgets

NONE = "none"
UPSCALER_FOLDER = "latent_upscale_models"
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CheckpointOptions:
    """Load Checkpoint's optional widgets: the separate component files (video_vae, audio_vae, text_projection; NONE:
    from the checkpoint), sp_degree (0: the largest valid), compile, weights (`WEIGHT_MODES`), int8_compute
    (`INT8_COMPUTE_MODES`), gpu_budget_gib (GiB per GPU for the weights and one forward; 0: the free memory)."""

    video_vae: str = NONE
    audio_vae: str = NONE
    text_projection: str = NONE
    sp_degree: int = 0
    compile: bool = False
    weights: str = "auto"
    int8_compute: str = "auto"
    gpu_budget_gib: float = 0.0


def _ensure_upscaler_folder() -> None:
    """ComfyUI 0.20 knows `latent_upscale_models/`; register it on an older one."""
    if UPSCALER_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.folder_names_and_paths[UPSCALER_FOLDER] = (
            [os.path.join(folder_paths.models_dir, UPSCALER_FOLDER)], folder_paths.supported_pt_extensions)


def _files(*folders: str) -> list[str]:
    names: set[str] = set()
    for folder in folders:
        try:
            names.update(folder_paths.get_filename_list(folder))
        except KeyError:  # a folder this ComfyUI does not know
            pass
    return sorted(names)


def _gemma_choices() -> list[str]:
    """Files in `text_encoders/` and Hugging Face folders there (a sub-folder with config.json), shown as 'name/'."""
    folders = []
    for base in folder_paths.get_folder_paths("text_encoders"):
        if os.path.isdir(base):
            for entry in sorted(os.listdir(base)):
                if os.path.isfile(os.path.join(base, entry, "config.json")):
                    folders.append(entry + "/")
    files = [f for f in _files("text_encoders") if f.endswith((".safetensors", ".sft"))]
    return sorted(set(folders)) + files


def _resolve(name: str, *folders: str) -> str:
    for folder in folders:
        try:
            path = folder_paths.get_full_path(folder, name)
        except KeyError:
            path = None
        if path:
            return path
    raise NodeError(f"model file {name!r} not found in {', '.join(f'models/{f}/' for f in folders)}")


def _resolve_gemma(name: str) -> str:
    if name.endswith("/"):
        for base in folder_paths.get_folder_paths("text_encoders"):
            path = os.path.join(base, name.rstrip("/"))
            if os.path.isdir(path):
                return path
        raise NodeError(f"Gemma folder {name!r} not found in models/text_encoders/")
    return _resolve(name, "text_encoders")


def _optional(name: str, *folders: str) -> str | None:
    return None if name in (None, "", NONE) else _resolve(name, *folders)


def _free_memory(devices: tuple[str, ...]) -> str:
    import torch

    parts = []
    for dev in dict.fromkeys(devices):
        if dev.startswith("cuda"):
            free, total = torch.cuda.mem_get_info(torch.device(dev))
            parts.append(f"{dev} {free / 2**30:.1f}/{total / 2**30:.1f} GiB free")
        else:
            try:
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                parts.append(f"host RAM {avail / 2**30:.1f} GiB free")
            except (ValueError, OSError):
                pass
    return ", ".join(parts)


def _device_inputs() -> list:
    """The `devices` and `world_size` inputs both loader nodes share."""
    return [io.String.Input("devices", default="all",
                            tooltip="Devices of the fleet: 'all', a count ('4'), a CUDA index list ('0,1,3'; one "
                                    "index: '1,'), or 'cpu:N' for N CPU ranks. Without CUDA, 'all' means CPU ranks "
                                    "(see world_size)."),
            io.Int.Input("world_size", default=0, min=0, max=64,
                         tooltip="Number of ranks: 0 = every device of 'devices' (one CPU rank when 'all' has no "
                                 "GPU); otherwise caps or sets the count.")]


WEIGHT_MODES_TOOLTIP = ("The transformer's weights over the GPUs: auto = replicated when every GPU holds the model, "
                        "else placed; replicated = every GPU holds the whole transformer (fastest; refused when it "
                        "does not fit); placed = as many blocks whole as each GPU's budget allows, the rest sharded "
                        "over the GPUs (gathered as they run, behind the whole blocks' compute); sharded = each GPU "
                        "holds 1/N of every block (least memory: LTX-2.3 / 2.5 22B on 2-4 GPUs of 24-32 GB). "
                        "Whenever a block is sharded every forward runs sequence parallel over all GPUs, whose count "
                        "must divide the 32 heads (2, 4 or 8). The node's text says what was placed. Changing it "
                        "restarts the fleet.")
GPU_BUDGET_TOOLTIP = ("GiB per GPU the fleet may use for the transformer's weights and one forward (a hard cap on "
                      "each GPU); the weights are placed in the smallest GPU's budget. 0 = each GPU's free memory "
                      "at load. Changing it restarts the fleet.")


def _weights_input():
    return io.Combo.Input("weights", options=list(WEIGHT_MODES), default="auto", optional=True,
                          tooltip=WEIGHT_MODES_TOOLTIP)


def _budget_input():
    return io.Float.Input("gpu_budget_gib", default=0.0, min=0.0, max=1024.0, step=0.5, optional=True,
                          tooltip=GPU_BUDGET_TOOLTIP)


INT8_COMPUTE_TOOLTIP = ("How an int8(-convrot) transformer file computes (ComfyUI's LTX-2.5 templates load one): "
                        "w8a8 = int8 weights resident, activations quantized per token (ComfyUI's own result); "
                        "dequantize = weights dequantized to bf16 at load as ComfyUI dequantizes them (bf16 speed - "
                        "W8A8 measured slower on an H200 - and twice their memory; refused when they would not fit "
                        "the GPU, or with sharded weights); auto = dequantize on GPUs when it fits, else w8a8 (CPU: "
                        "w8a8). The fleet status and each job report say which path ran. Changing it restarts the "
                        "fleet.")


def _int8_input():
    return io.Combo.Input("int8_compute", options=list(INT8_COMPUTE_MODES), default="auto", optional=True,
                          tooltip=INT8_COMPUTE_TOOLTIP)


def describe_plan(handle: FleetHandle, fleet: FleetDescription | None = None) -> str:
    """The node's text: the fleet and the split it computed for this handle's policy (`handle.plan`, a
    `protocol.fleet_config.FleetPlan`: nothing is re-derived here), the weights and the free memory; with the
    running fleet's status (`fleet`), the links it measured at start and its predicted step times against one card
    with weight streaming."""
    cfg = handle.config
    w = cfg.world_size
    backend = "nccl" if any(d.startswith("cuda") for d in cfg.devices) else "gloo"
    per_job = ("each stage's split - tokens over ranks, guidance passes over ranks, or one GPU - is chosen per job "
               "and shown by the SP Sampler")
    plan = getattr(handle, "plan", None)
    if plan is None:
        sp = "parallel plan: not reported by the running controller (stop it to start the current one)"
    elif not plan.sequence_parallel:
        sp = "no parallel plan (sequence_parallel off): every rank computes every stage whole"
    elif plan.sp_degree == w:
        sp = f"sequence parallel up to degree {plan.sp_degree} ({per_job})"
    elif plan.set_by_policy:
        sp = (f"sequence parallel up to degree {plan.sp_degree} on ranks 0-{plan.sp_degree - 1}, set by sp_degree "
              f"({per_job}; changing it keeps the fleet)")
    else:
        sp = (f"sequence parallel degree {plan.sp_degree} on ranks 0-{plan.sp_degree - 1}: {w} does not divide the "
              f"{plan.heads} attention heads (valid: {', '.join(map(str, plan.valid_degrees))})")
    size = sum(os.path.getsize(p) for p in (cfg.checkpoint, cfg.upscaler, cfg.video_vae, cfg.audio_vae,
                                            cfg.text_projection) if p and os.path.isfile(p))
    lines = [
        f"fleet generation {handle.generation}: {w} rank(s) on {', '.join(cfg.devices)} ({backend}), "
        f"{cfg.dtype}{', compiled blocks' if cfg.compile else ''}",
        sp,
        f"tiled stage 2 / decode: all {w} ranks",
        _weights_line(cfg, getattr(plan, "placement", None), size),
        f"memory: {_free_memory(cfg.devices)}",
        f"worker pids: {', '.join(map(str, handle.worker_pids))}",
    ]
    return "\n".join(lines + _measured(fleet))


def _measured(fleet: FleetDescription | None) -> list[str]:
    """The link line and the predicted step times of a `FleetDescription` (none from an older controller)."""
    link = getattr(fleet, "link", None)
    return ([link.describe()] if link is not None else []) + list(getattr(fleet, "predicted", ()) or ())


def _configure(c, config: FleetConfig) -> tuple[FleetHandle, FleetDescription | None]:
    """The fleet for `config` and its status (what it measured at start)."""
    handle = c.configure(config)
    return handle, c.status().fleet


def _weights_line(cfg, placement, size: int) -> str:
    """The weights' line of the node's text: the placement the workers reported (`FleetPlan.placement`), with the
    predicted weight gathers per forward over the configured links (`resources.LINKS_GBPS`); the mode asked for
    when the controller did not report one."""
    w = cfg.world_size
    if placement is not None:
        line = f"weights: {placement.describe()}; Gemma mode {cfg.gemma_mode}"
        if placement.any_sharded:
            line += (f"; every forward runs sequence parallel over all {w} ranks; predicted weight gathers per forward "
                     f"(on top of the compute, unless hidden behind the whole blocks'): "
                     + ", ".join(f"{placement.gather_seconds(gbps):.2f} s over {link}"
                                 for link, gbps in LINKS_GBPS.items()))
        return line
    if cfg.weights == "sharded":
        return (f"weights: the transformer's layers sharded over the {w} ranks (~1/{w} each of ~{size / 2**30:.2f} "
                f"GiB of files, gathered layer by layer as they run; Gemma mode {cfg.gemma_mode}): every forward "
                f"runs sequence parallel over all {w} ranks; predicted weight gathers per forward (on top of the "
                f"compute): " + ", ".join(f"{sharded_gather_seconds(size, w, gbps):.2f} s over {link}"
                                          for link, gbps in LINKS_GBPS.items()))
    return (f"weights: {cfg.weights} (~{size / 2**30:.2f} GiB of files; the running controller did not report the "
            f"placement; Gemma mode {cfg.gemma_mode})")


class LoadCheckpointMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        _ensure_upscaler_folder()
        return io.Schema(
            node_id="LTX2MGPU_LoadCheckpoint",
            display_name="Load Checkpoint (MGPU)",
            category=CATEGORY,
            description="Starts (or reuses) the background worker fleet: one process per device, each holding a full "
                        "copy of the LTX-2 weights. The handle it returns feeds every other MGPU node.",
            inputs=[
                io.Combo.Input("checkpoint", options=_files("checkpoints", "diffusion_models"),
                               tooltip="LTX-2 / LTX-2.3 single-file checkpoint (models/checkpoints/) or a "
                                       "transformer file (models/diffusion_models/: LTX-2.5 bf16, fp8 or "
                                       "int8-convrot, or a 2.0 / 2.3 transformer-only file; then pick the video "
                                       "VAE and audio VAE files below)."),
                io.Combo.Input("gemma", options=_gemma_choices(),
                               tooltip="Text encoder in models/text_encoders/: Gemma 3 for LTX-2.0 / 2.3 (ComfyUI's "
                                       "single file or a Hugging Face folder, shown with a trailing '/'); for "
                                       "LTX-2.5 the Gemma 4 file with the bundled text projection."),
                io.Combo.Input("upscaler", options=[NONE] + _files(UPSCALER_FOLDER), default=NONE,
                               tooltip="2x spatial latent upscaler (models/latent_upscale_models/), needed by "
                                       "TDP Upscale (MGPU) when it upscales."),
                *_device_inputs(),
                io.Combo.Input("weight_dtype", options=list(DTYPES), default="auto",
                               tooltip="Compute / weight dtype on the workers: auto = bfloat16 on GPUs, float32 on "
                                       "CPU ranks."),
                io.Combo.Input("video_vae", options=[NONE] + _files("vae", "checkpoints"), default=NONE,
                               optional=True,
                               tooltip="Separate video VAE file, for a transformer-only checkpoint (none = from "
                                       "the checkpoint)."),
                io.Combo.Input("audio_vae", options=[NONE] + _files("vae", "checkpoints"), default=NONE,
                               optional=True,
                               tooltip="Separate audio VAE + vocoder file, for a transformer-only checkpoint (none = "
                                       "from the checkpoint)."),
                io.Combo.Input("text_projection", options=[NONE] + _files("text_encoders", "checkpoints"),
                               default=NONE, optional=True,
                               tooltip="Separate text projection file (text_embedding_projection.*), for a "
                                       "2.0 / 2.3 transformer-only checkpoint (none = from the checkpoint; LTX-2.5: "
                                       "from the Gemma 4 text-encoder file)."),
                io.Int.Input("sp_degree", default=0, min=0, max=64, optional=True,
                             tooltip="Largest sequence-parallel degree a stage may use: 0 = the largest that "
                                     "divides the model's attention heads (32 for LTX-2: 1, 2, 4, 8, …) and fits the "
                                     "ranks; another value is refused when the heads do not allow it. Changing it "
                                     "keeps the running fleet (no reload)."),
                io.Boolean.Input("compile", default=False, optional=True,
                                 tooltip="torch.compile the transformer blocks on the workers: the first generation "
                                         "at each size pays the compile (tens of seconds); later ones run ~10 % "
                                         "faster on GPUs. Changing it keeps the fleet (turning it off restores the "
                                         "eager blocks)."),
                _weights_input(),
                _int8_input(),
                _budget_input(),
            ],
            outputs=[Fleet.Output(display_name="fleet", tooltip="Handle of the worker fleet (its configuration and "
                                                                "generation)."),
                     io.Model.Output(display_name="model", tooltip=MODEL_TOOLTIP)],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, checkpoint, gemma, upscaler, devices, world_size, weight_dtype, **options) -> io.NodeOutput:
        from ..mgpu_backend.serving.client import parse_devices

        with guard("Load Checkpoint (MGPU)"):
            # ComfyUI passes every optional widget by name: read into one record at once
            o = read_widgets(CheckpointOptions, options, "Load Checkpoint (MGPU)")
            devs = parse_devices(devices, world_size or None)
            dtype = weight_dtype if weight_dtype != "auto" else (
                "bfloat16" if any(d.startswith("cuda") for d in devs) else "float32")
            config = FleetConfig(
                devices=devs, checkpoint=_resolve(checkpoint, "checkpoints", "diffusion_models"),
                gemma=_resolve_gemma(gemma), upscaler=_optional(upscaler, UPSCALER_FOLDER),
                video_vae=_optional(o.video_vae, "vae", "checkpoints"),
                audio_vae=_optional(o.audio_vae, "vae", "checkpoints"),
                text_projection=_optional(o.text_projection, "text_encoders", "checkpoints"), dtype=dtype,
                sp_degree=o.sp_degree or None, compile=bool(o.compile), weights=o.weights,
                int8_compute=o.int8_compute, gpu_budget_gib=o.gpu_budget_gib or None)
            # the fleet's rules the values decide (compile × sharded, …): refused before the running fleet is asked
            check_fleet(config.identity, config.policy)
            try:
                c = client()
                try:
                    handle, fleet = _configure(c, config)
                finally:
                    c.close()
            except ControllerError as exc:
                raise NodeError(f"Load Checkpoint (MGPU): {exc}") from None
            plan = describe_plan(handle, fleet)
            try:
                model = _native_model(handle, "Load Checkpoint (MGPU)")
            except NodeError as exc:  # the fleet and the stage nodes work without it; a graph that uses it fails
                log.warning("%s: no native MODEL output", exc)
                plan += f"\nno native MODEL output: {exc}"
                model = None
        return io.NodeOutput(handle, model, ui=ui.PreviewText(plan))


# ---- the native MODEL (issue 19): ComfyUI's own LTX-AV model whose transformer runs on the fleet ----------------

MODEL_TOOLTIP = ("A native ComfyUI MODEL (ComfyUI's own LTX-AV model) whose transformer runs on the fleet: any "
                 "ComfyUI sampler, guider, LTXV conditioning node and LoraLoaderModelOnly drives it; each forward "
                 "runs sequence-parallel on the fleet's ranks. No weights are loaded in ComfyUI.")


def _native_model(handle: FleetHandle, what: str):
    from .native_model import fleet_model

    try:
        return fleet_model(handle.config.checkpoint, handle, name=os.path.basename(handle.config.checkpoint))
    except ValueError as exc:
        raise NodeError(f"{what}: {exc}") from None


class LoadDiffusionModelMGPU(io.ComfyNode):
    """Load Diffusion Model (MGPU): the MODEL of ComfyUI's Load Diffusion Model, its transformer on the fleet."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_LoadDiffusionModel",
            display_name="Load Diffusion Model (MGPU)",
            category=CATEGORY,
            description="ComfyUI's Load Diffusion Model for LTX-2, with the transformer on the worker fleet: the "
                        "MODEL is ComfyUI's own LTX-AV model (sampling, latent format and conditioning are "
                        "ComfyUI's) whose every forward runs sequence-parallel on the fleet. Swap it for "
                        "UNETLoader / the MODEL of CheckpointLoaderSimple; keep the rest of the graph. Plain LoRAs "
                        "(LoraLoaderModelOnly) apply on the fleet; attention / block patches, object patches, "
                        "model merges, ControlNet and hook-scheduled LoRAs are refused by name.",
            inputs=[
                io.Combo.Input("unet_name", options=_files("diffusion_models", "checkpoints"),
                               tooltip="The transformer: an LTX-2.5 file (models/diffusion_models/: bf16, fp8 or "
                                       "ComfyUI's int8-convrot), a 2.0 / 2.3 transformer-only file, or a single-file "
                                       "checkpoint (only its transformer is loaded on the fleet)."),
                *_device_inputs(),
                _weights_input(),
                _int8_input(),
                _budget_input(),
            ],
            outputs=[io.Model.Output(display_name="model", tooltip=MODEL_TOOLTIP),
                     Fleet.Output(display_name="fleet", tooltip="Handle of the worker fleet, for the other MGPU "
                                                                "nodes (e.g. Fleet (MGPU)).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, unet_name, devices, world_size, weights="auto", int8_compute="auto",
                gpu_budget_gib=0.0) -> io.NodeOutput:
        from ..mgpu_backend.serving.client import parse_devices

        what = "Load Diffusion Model (MGPU)"
        with guard(what):
            devs = parse_devices(devices, world_size or None)
            dtype = "bfloat16" if any(d.startswith("cuda") for d in devs) else "float32"
            path = _resolve(unet_name, "diffusion_models", "checkpoints")
            # transformer only: no Gemma, no VAEs, no upscaler on the fleet (ComfyUI's own loaders provide those)
            config = FleetConfig(devices=devs, checkpoint=path, gemma=None, dtype=dtype, gemma_unload=True,
                                 transformer_only=True, weights=weights, int8_compute=int8_compute,
                                 gpu_budget_gib=gpu_budget_gib or None)
            check_fleet(config.identity, config.policy)  # the fleet's rules the values decide
            try:
                c = client()
                try:
                    handle, fleet = _configure(c, config)
                finally:
                    c.close()
            except ControllerError as exc:
                raise NodeError(f"{what}: {exc}") from None
            model = _native_model(handle, what)
            plan = describe_plan(handle, fleet)
        return io.NodeOutput(model, handle, ui=ui.PreviewText(plan))
