"""Jobs without model work: controller overhead, busy / cancel tests and the frame hand-back benchmark."""
from __future__ import annotations

import time

import torch

from ...protocol.frames import send_frames
from ...protocol.job_requests import FramesRequest, NoopRequest
from ...protocol.job_results import FramesResult, NoopResult
from . import register


@register("noop")
def run_noop(state, request, ctx) -> NoopResult:
    """`request`: a `NoopRequest` — n synchronized, cancellable steps of s seconds; a small tensor back (every
    rank: rank 0's is the job's answer)."""
    from ...engine.sampling import SamplingCancelled

    request = _check(request, NoopRequest, "noop")
    steps = request.steps
    for i in range(steps):
        if ctx.step_boundary("noop", i):
            raise SamplingCancelled(f"noop cancelled before step {i + 1}/{steps}")
        time.sleep(float(request.sleep_s))
        ctx.progress("noop", i + 1, steps)
    return NoopResult(torch.arange(4, dtype=torch.float32) + ctx.rank)


@register("frames")
def run_frames(state, request, ctx) -> FramesResult | None:
    """`request`: a `FramesRequest` — hand back `request.shape` float32 frames (frame i filled with i / F) from rank
    0 through shared memory, as `generate` does; `sent_at` is the wall time just before the hand-back began."""
    request = _check(request, FramesRequest, "frames")
    if ctx.rank != 0:
        return None
    shape = request.shape
    frames = torch.empty(shape, dtype=torch.float32)
    for i in range(shape[0]):
        frames[i].fill_(i / max(1, shape[0]))
    sent_at = time.time()
    return FramesResult(send_frames(frames), sent_at)


def _check(request, cls, kind: str):
    from ...protocol.validation import ValidationError

    if not isinstance(request, cls):
        raise ValidationError(f"{kind} payload: expected a {cls.__name__}, got {type(request).__name__}")
    return request
