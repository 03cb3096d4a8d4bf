"""Jobs without model work: controller overhead, busy / cancel tests and the frame hand-back benchmark."""
from __future__ import annotations

import time

import torch

from . import register


@register("noop")
def run_noop(state, payload, ctx) -> dict:
    """`payload` = {"steps": n, "sleep_s": s}: n synchronized, cancellable steps of s seconds; a small tensor back."""
    from ..sampling import SamplingCancelled

    payload = payload or {}
    steps = int(payload.get("steps", 0))
    for i in range(steps):
        if ctx.step_boundary("noop", i):
            raise SamplingCancelled(f"noop cancelled before step {i + 1}/{steps}")
        time.sleep(float(payload.get("sleep_s", 0.0)))
        ctx.progress("noop", i + 1, steps)
    return {"tensor": torch.arange(4, dtype=torch.float32) + ctx.rank}


@register("frames")
def run_frames(state, payload, ctx) -> dict:
    """Hand back `payload["shape"]` float32 frames (frame i filled with i / F) from rank 0 through shared memory, as
    `generate` does; `sent_at` is the wall time just before the hand-back began."""
    from ..frames import send_frames

    if ctx.rank != 0:
        return {}
    shape = tuple(int(n) for n in payload["shape"])
    frames = torch.empty(shape, dtype=torch.float32)
    for i in range(shape[0]):
        frames[i].fill_(i / max(1, shape[0]))
    sent_at = time.time()
    return {"frames": send_frames(frames), "sent_at": sent_at}
