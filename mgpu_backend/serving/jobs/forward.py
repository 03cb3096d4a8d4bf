"""The native MODEL's jobs (issue 19): one transformer forward, and the text connectors, on the fleet.

Payloads and replies are the typed contract of `mgpu_backend/protocol/native_forward.py`; the engine is `mgpu_backend/stages/native.py`
(one `NativeEngine` per rank, made at the first such job and kept with the fleet: its context cache lives as long
as the fleet's model).
"""
from __future__ import annotations

from ...protocol.native_forward import FORWARD_JOB, PREPROCESS_TEXT_JOB, ForwardContractError, ForwardMiss, ForwardReply, PreprocessTextRequest
from . import register


def engine(state):
    """This rank's `NativeEngine` (created once per fleet)."""
    eng = getattr(state, "native", None)
    if eng is None:
        pipeline = getattr(state, "pipeline", None)
        if pipeline is not None:  # the one the SP Sampler's stages use too (semantics "comfyui")
            eng = pipeline.native_engine()
        else:
            from ...stages.native import NativeEngine

            eng = NativeEngine(state.components, state.plan, state.dtype, state.device)
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
        return ForwardMiss(context_keys=missing, lora_key=lora_missing) if ctx.rank == 0 else None
    lora_reports = eng.apply_lora(request)
    result = eng.forward(request, context)
    if ctx.rank != 0:
        return None
    return ForwardReply(result.video, result.audio, report=result.report, seconds=result.seconds,
                        lora_reports=lora_reports, slowdowns=result.slowdowns)


@register(PREPROCESS_TEXT_JOB)
def run_preprocess_text(state, request, ctx):
    """`request`: a `PreprocessTextRequest` -> `PreprocessTextReply` on rank 0 (every rank runs the connectors, with
    the request's connector LoRA patches fused for the call, and caches the rows under the request's keys), or a
    `ForwardMiss` naming a LoRA key the fleet does not hold."""
    eng = engine(state)
    if not isinstance(request, PreprocessTextRequest):
        raise ForwardContractError(f"preprocess_text payload: expected a PreprocessTextRequest, got "
                                   f"{type(request).__name__}")
    missing = eng.lora_missing(request)
    if missing:
        return ForwardMiss(lora_key=missing) if ctx.rank == 0 else None
    reply = eng.preprocess_text(request)
    return reply if ctx.rank == 0 else None
