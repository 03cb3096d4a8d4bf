"""What the two loader nodes ask the fleet for and how they report the fleet that runs (no ComfyUI import).

Load Checkpoint (MGPU) and Load Diffusion Model (MGPU) resolve their files in ComfyUI's folders (`nodes/loader.py`);
from the resolved paths on, their `FleetConfig`s are built here (`checkpoint_config`, `diffusion_model_config`) and
their text is written here (`describe_plan`), so both are tested without ComfyUI. Two loaders of one prompt on the
same file, devices and weights share one fleet: the controller keeps a whole-checkpoint fleet for a
transformer-only configuration it serves (`FleetIdentity.serves`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

try:  # inside ComfyUI the pack is one package (mangled name); tests import `nodes` and `mgpu_backend` top-level
    from ..mgpu_backend.protocol.fleet_config import FleetConfig, FleetHandle
    from ..mgpu_backend.protocol.job_results import FleetDescription
    from ..mgpu_backend.protocol.resources import LINKS_GBPS, sharded_gather_seconds
except ImportError:
    from mgpu_backend.protocol.fleet_config import FleetConfig, FleetHandle
    from mgpu_backend.protocol.job_results import FleetDescription
    from mgpu_backend.protocol.resources import LINKS_GBPS, sharded_gather_seconds

NONE = "none"


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


def compute_dtype(devices: tuple[str, ...], weight_dtype: str = "auto") -> str:
    """The fleet's dtype for a loader's `weight_dtype` widget: "auto" = bfloat16 when a rank is a GPU, else float32
    (both loaders apply the same rule, so their fleets can be one)."""
    if weight_dtype != "auto":
        return weight_dtype
    return "bfloat16" if any(d.startswith("cuda") for d in devices) else "float32"


def checkpoint_config(devices: tuple[str, ...], checkpoint: str, gemma: str, upscaler: str | None,
                      weight_dtype: str, options: CheckpointOptions, video_vae: str | None = None,
                      audio_vae: str | None = None, text_projection: str | None = None) -> FleetConfig:
    """Load Checkpoint (MGPU)'s fleet: the whole checkpoint (transformer, Gemma, VAEs, upscaler) on `devices`, from
    paths already resolved in ComfyUI's folders. Raises ValueError naming a field whose value breaks its rule."""
    o = options
    return FleetConfig(
        devices=devices, checkpoint=checkpoint, gemma=gemma, upscaler=upscaler, video_vae=video_vae,
        audio_vae=audio_vae, text_projection=text_projection, dtype=compute_dtype(devices, weight_dtype),
        sp_degree=o.sp_degree or None, compile=bool(o.compile), weights=o.weights, int8_compute=o.int8_compute,
        gpu_budget_gib=o.gpu_budget_gib or None)


def diffusion_model_config(devices: tuple[str, ...], path: str, weights: str = "auto", int8_compute: str = "auto",
                           gpu_budget_gib: float = 0.0) -> FleetConfig:
    """Load Diffusion Model (MGPU)'s fleet: the transformer of `path` only (no Gemma, no VAEs, no upscaler: ComfyUI's
    own loaders give those), with the dtype rule of Load Checkpoint (MGPU) (`compute_dtype`), so a whole-checkpoint
    fleet of the same file, devices and weights serves it. Raises ValueError naming a field that breaks its rule."""
    return FleetConfig(devices=devices, checkpoint=path, gemma=None, dtype=compute_dtype(devices), gemma_unload=True,
                       transformer_only=True, weights=weights, int8_compute=int8_compute,
                       gpu_budget_gib=gpu_budget_gib or None)


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


def describe_plan(handle: FleetHandle, fleet: FleetDescription | None = None) -> str:
    """The node's text: the fleet and the split it computed for this handle's policy (`handle.plan`, a
    `protocol.fleet_config.FleetPlan`: nothing is re-derived here), the weights and the free memory; with the
    running fleet's status (`fleet`), the links it measured at start and its predicted step times against one card
    with weight streaming. A transformer-only handle (Load Diffusion Model (MGPU)) is described as such: no Gemma,
    no tiled stage 2 or decode (its fleet has neither); when a whole-checkpoint fleet serves it, the text says so."""
    cfg = handle.config
    w = cfg.world_size
    backend = "nccl" if any(d.startswith("cuda") for d in cfg.devices) else "gloo"
    per_job = ("each forward's split - tokens over ranks, or guidance passes / batch rows over ranks - is chosen per "
               "request" if cfg.transformer_only else
               "each stage's split - tokens over ranks, guidance passes over ranks, or one GPU - is chosen per job "
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
    files = (cfg.checkpoint,) if cfg.transformer_only else (cfg.checkpoint, cfg.upscaler, cfg.video_vae,
                                                             cfg.audio_vae, cfg.text_projection)
    size = sum(os.path.getsize(p) for p in files if p and os.path.isfile(p))
    if cfg.transformer_only:
        what = ("the transformer only (ComfyUI's own loaders give the text encoder and the VAEs)"
                if fleet is None or getattr(fleet, "transformer_only", True) else
                "the transformer, on the fleet of Load Checkpoint (MGPU) of the same file, which also holds the text "
                "encoder and the VAEs (one fleet for both loaders)")
        role = f"runs: {what}"
    else:
        role = f"tiled stage 2 / decode: all {w} ranks"
    lines = [
        f"fleet generation {handle.generation}: {w} rank(s) on {', '.join(cfg.devices)} ({backend}), "
        f"{cfg.dtype}{', compiled blocks' if cfg.compile else ''}",
        sp,
        role,
        _weights_line(cfg, getattr(plan, "placement", None), size),
        f"memory: {_free_memory(cfg.devices)}",
        f"worker pids: {', '.join(map(str, handle.worker_pids))}",
    ]
    return "\n".join(lines + _measured(fleet))


def _measured(fleet: FleetDescription | None) -> list[str]:
    """The link line and the predicted step times of a `FleetDescription` (none from an older controller)."""
    link = getattr(fleet, "link", None)
    return ([link.describe()] if link is not None else []) + list(getattr(fleet, "predicted", ()) or ())


def _weights_line(cfg, placement, size: int) -> str:
    """The weights' line of the node's text: the placement the workers reported (`FleetPlan.placement`), with the
    predicted weight gathers per forward over the configured links (`resources.LINKS_GBPS`); the mode asked for
    when the controller did not report one. Gemma's mode only for a fleet that loads Gemma."""
    w = cfg.world_size
    gemma = "" if cfg.transformer_only else f"; Gemma mode {cfg.gemma_mode}"
    if placement is not None:
        line = f"weights: {placement.describe()}{gemma}"
        if placement.any_sharded:
            line += (f"; every forward runs sequence parallel over all {w} ranks; predicted weight gathers per forward "
                     f"(on top of the compute, unless hidden behind the whole blocks'): "
                     + ", ".join(f"{placement.gather_seconds(gbps):.2f} s over {link}"
                                 for link, gbps in LINKS_GBPS.items()))
        return line
    if cfg.weights == "sharded":
        return (f"weights: the transformer's layers sharded over the {w} ranks (~1/{w} each of ~{size / 2**30:.2f} "
                f"GiB of files, gathered layer by layer as they run{gemma}): every forward runs sequence parallel "
                f"over all {w} ranks; predicted weight gathers per forward (on top of the compute): "
                + ", ".join(f"{sharded_gather_seconds(size, w, gbps):.2f} s over {link}"
                            for link, gbps in LINKS_GBPS.items()))
    return (f"weights: {cfg.weights} (~{size / 2**30:.2f} GiB of files; the running controller did not report the "
            f"placement{gemma})")
