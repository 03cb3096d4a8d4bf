"""The native MODEL's jobs (issue 19): one transformer forward, and the text connectors, on the fleet.

Payloads and replies are the typed contract of `mgpu_backend/forward.py`; the engine is `mgpu_backend/native.py`
(one `NativeEngine` per rank, made at the first such job and kept with the fleet: its context cache lives as long
as the fleet's model).
"""
from __future__ import annotations

from ..forward import FORWARD_JOB, PREPROCESS_TEXT_JOB, ForwardMiss, ForwardReply, PreprocessTextReply
from . import register


def engine(state):
    """This rank's `NativeEngine` (created once per fleet)."""
    eng = getattr(state, "native", None)
    if eng is None:
        from ..native import NativeEngine

        eng = NativeEngine(state.components, state.plan, state.dtype, state.device)
        state.native = eng
    return eng


@register(FORWARD_JOB)
def run_forward(state, request, ctx):
    """`request`: a `ForwardRequest`. Returns on rank 0 a `ForwardReply`, or a `ForwardMiss` naming the cached
    pieces the fleet lacks (nothing ran; resend with them). Raises ValidationError / NotSupported on every rank
    before any work (bad request, model mismatch, unsupported option)."""
    import dataclasses

    from ..native_lora import apply_request_lora

    eng = engine(state)
    eng.check(dataclasses.replace(request, lora=None))  # the LoRA set is applied here (native_lora.py)
    context, missing = eng.resolve_context(request)
    if missing:
        return ForwardMiss(context_keys=missing) if ctx.rank == 0 else {}
    lora_miss = apply_request_lora(state, request)  # fuse / restore on every rank alike
    if lora_miss is not None:
        return lora_miss if ctx.rank == 0 else {}
    video, audio = eng.forward(request, context)
    if ctx.rank != 0:
        return {}
    lora = state.native_loras.report()
    return ForwardReply(video, audio, report=eng.last_report + (f"; {lora}" if lora else ""),
                        seconds=eng.last_seconds)


@register(PREPROCESS_TEXT_JOB)
def run_preprocess_text(state, request, ctx):
    """`request`: a `PreprocessTextRequest` -> `PreprocessTextReply` on rank 0 (every rank runs the connectors and
    caches the rows under the request's keys)."""
    out = engine(state).preprocess_text(request)
    return PreprocessTextReply(out) if ctx.rank == 0 else {}
