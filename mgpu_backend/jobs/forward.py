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

        pipeline = getattr(state, "pipeline", None)
        eng = NativeEngine(state.components, state.plan, state.dtype, state.device,
                           lora=pipeline.lora if pipeline is not None else None)
        state.native = eng
    return eng


@register(FORWARD_JOB)
def run_forward(state, request, ctx):
    """`request`: a `ForwardRequest`. Returns on rank 0 a `ForwardReply`, or a `ForwardMiss` naming the cached
    pieces the fleet lacks (nothing ran; resend with them). Raises ValidationError / NotSupported on every rank
    before any work (bad request, model mismatch, unsupported option)."""
    eng = engine(state)
    eng.check(request)
    lora_missing = eng.lora_missing(request)
    context, missing = eng.resolve_context(request)
    if missing or lora_missing:
        return ForwardMiss(context_keys=missing, lora_key=lora_missing) if ctx.rank == 0 else {}
    eng.apply_lora(request)
    video, audio = eng.forward(request, context)
    if ctx.rank != 0:
        return {}
    return ForwardReply(video, audio, report=eng.last_report, seconds=eng.last_seconds,
                        lora_reports=tuple(eng.last_lora_reports))


@register(PREPROCESS_TEXT_JOB)
def run_preprocess_text(state, request, ctx):
    """`request`: a `PreprocessTextRequest` -> `PreprocessTextReply` on rank 0 (every rank runs the connectors and
    caches the rows under the request's keys)."""
    out = engine(state).preprocess_text(request)
    return PreprocessTextReply(out) if ctx.rank == 0 else {}
