"""The job memory plan's figures, read off this process, and its decisions applied (issue 37).

`protocol/job_memory.py` decides from byte counts; this module counts them — the components' bytes on the GPU, the
GPU's budget (free + what this process holds), the host's room for an offloaded text encoder, each stage's forward
activations (`protocol/memory_plan.activation_bytes` at the stage's shape, the transformer's block Linear path, the
engine's feed-forward chunking) — and applies the plan at its moments (`TwoStagePipeline.generate`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..engine import cuda_graphs as G
from ..engine.denoiser import BATCH_TOKENS
from ..protocol import job_memory as J
from ..protocol import memory_plan as M

HOST_MARGIN_BYTES = 4 * J.GiB  # left to the host when an encoder is offloaded to it


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: a tensor's device is "cuda:0", never "cuda", and the two compare unequal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def module_bytes(module, device: torch.device) -> int:
    """Bytes of `module`'s parameters and buffers on `device` (0 for None); a shared tensor counts once."""
    if module is None:
        return 0
    device = _indexed(device)
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device == device and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def linear_path(transformer) -> str:
    """How the block Linears compute, for the activation model: "int8" (W8A8), "fp8" (fp8 tensor cores), "bf16"."""
    from ..models import fp8 as F8
    from ..models import quant as Q

    kinds = {type(m) for m in transformer.transformer_blocks.modules()}
    if Q.Int8Linear in kinds:
        return "int8"
    if F8.FP8Linear in kinds and F8.compute_mode() != "off":
        return "fp8"
    return "bf16"


def stage_need(name: str, transformer, tokens: int, passes: int, dtype: torch.dtype,
               device: torch.device) -> J.StageNeed:
    """A stage of `tokens` video tokens and `passes` guidance passes per step on this process's transformer."""
    shape = M.ActivationShape.of(transformer.config, act_bytes=torch.empty((), dtype=dtype).element_size(),
                                 linear=linear_path(transformer), timesteps="token")

    def act(rows: int) -> int:
        return M.activation_bytes(tokens, tokens, shape, batch=rows, ff_chunk=M.auto_ff_chunk(tokens, shape, rows))

    batchable = device.type == "cuda" and passes > 1 and tokens <= BATCH_TOKENS
    return J.StageNeed(name, tokens, passes, batchable, act(1), act(passes) if batchable else act(1))


def offloaded_bytes(service) -> int:
    """Bytes of a text service's encoder that an earlier job's plan moved to host memory (`offloaded`), else 0."""
    encoder = getattr(service, "encoder", None)
    if encoder is None or not getattr(service, "offloaded", False):
        return 0
    return module_bytes(encoder.model, torch.device("cpu"))


def encoder_figures(service, device: torch.device) -> tuple[int, int]:
    """(bytes, one forward's activation bytes) of a text service's encoder held whole on `device` (a replica), or
    moved to host memory by an earlier job's plan (`offloaded`: the next prompt the cache misses brings it back to
    `device`, so it counts as there); (0, 0) when it is sharded, elsewhere, or not loaded."""
    from .text_encoder import activation_bytes

    encoder = getattr(service, "encoder", None)
    if encoder is None or getattr(service, "layout", "replica") != "replica" or getattr(encoder, "device_map", None):
        return 0, 0
    held = offloaded_bytes(service) or module_bytes(encoder.model, device)
    if not held:
        return 0, 0
    config = encoder.text_config.to_dict() if hasattr(encoder.text_config, "to_dict") else dict(encoder.text_config)
    tokens = getattr(service, "plan_tokens", 1024)
    return held, activation_bytes(config, tokens, encoder.dtype)


def gpu_budget(device: torch.device) -> int:
    """What this process may hold on `device`: the driver's free memory + what its allocator holds now."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def host_room(service=None) -> int:
    """Host memory an offloaded encoder may take: MemAvailable (or the cgroup's room) less `HOST_MARGIN_BYTES`, plus
    the bytes of `service`'s encoder when an earlier job already moved it there (its room is taken by itself)."""
    from .text_encoder import free_bytes

    return max(0, free_bytes("cpu") - HOST_MARGIN_BYTES) + offloaded_bytes(service)


@contextmanager
def stage_memory(plan: J.JobMemoryPlan | None, name: str, transformer, device: torch.device):
    """Run a stage under `plan`'s decision for it: the allocator's cache emptied first (the stage's eager memory is
    its own), graphs paused where the plan takes them away. Yields the stage's batch mode ("auto" or "off")."""
    stage = plan.stage(name) if plan is not None else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if stage is None:
        yield "auto"
        return
    batch = "auto" if stage.batched else "off"
    if stage.graphs:
        yield batch
        return
    with G.paused(transformer, f"{name}: forwards eager (the job's memory plan)"):
        yield batch


__all__ = ["encoder_figures", "gpu_budget", "host_room", "linear_path", "module_bytes", "offloaded_bytes",
           "stage_memory", "stage_need"]
