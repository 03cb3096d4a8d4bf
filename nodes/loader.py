"""Load Checkpoint (MGPU): resolve model files from ComfyUI's folders, start (or reuse) the worker fleet, show the plan."""
from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io, ui

from ..mgpu_backend.protocol.errors import ControllerError
from ..mgpu_backend.protocol.fleet_config import INT8_COMPUTE_MODES, WEIGHT_MODES, FleetConfig, FleetHandle
from ..mgpu_backend.protocol.fleet_rules import check_fleet
from ..mgpu_backend.protocol.job_results import FleetDescription
from .common import CATEGORY, Fleet, NodeError, client, guard, log
from .loader_plan import NONE, CheckpointOptions, checkpoint_config, describe_plan, diffusion_model_config
from .widgets import read_widgets

UPSCALER_FOLDER = "latent_upscale_models"
DTYPES = ("auto", "bfloat16", "float16", "float32")


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


def _configure(c, config: FleetConfig) -> tuple[FleetHandle, FleetDescription | None]:
    """The fleet for `config` and its status (what it measured at start)."""
    handle = c.configure(config)
    return handle, c.status().fleet


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
            config = checkpoint_config(
                devs, _resolve(checkpoint, "checkpoints", "diffusion_models"), _resolve_gemma(gemma),
                _optional(upscaler, UPSCALER_FOLDER), weight_dtype, o,
                video_vae=_optional(o.video_vae, "vae", "checkpoints"),
                audio_vae=_optional(o.audio_vae, "vae", "checkpoints"),
                text_projection=_optional(o.text_projection, "text_encoders", "checkpoints"))
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
            path = _resolve(unet_name, "diffusion_models", "checkpoints")
            # transformer only: no Gemma, no VAEs, no upscaler on the fleet (ComfyUI's own loaders provide those); a
            # Load Checkpoint (MGPU) fleet of the same file, devices and weights serves it (one fleet for both)
            config = diffusion_model_config(devs, path, weights, int8_compute, gpu_budget_gib)
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
