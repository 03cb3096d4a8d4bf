"""Text encoding as a job: prompts -> ComfyUI CONDITIONING on the fleet (stages/text_encoder.py,
docs/design/comfyui-types.md, docs/design/text-encoder.md)."""
from __future__ import annotations

from ...protocol.job_requests import EncodeTextRequest
from ...protocol.job_results import EncodeTextResult
from . import register


@register("encode_text")
def run_encode_text(state, request, ctx) -> EncodeTextResult | None:
    """`request`: a `EncodeTextRequest` (prompts, Gemma mode or None for the fleet's, unload or None for the
    fleet's, frame_rate or None).

    Returns on rank 0 an `EncodeTextResult` (per prompt its embeddings `[1, T_i, C]` float32 and ComfyUI
    CONDITIONING, whose cond is the same tensor; the encode's report, Gemma forwards per rank, rank 0's counters),
    None elsewhere.
    Raises ValidationError (not an EncodeTextRequest, "batch_parallel" asked for with one prompt, GemmaMemoryError)
    on every rank; the fleet stays.
    """
    from ...stages.text_encoder import check_mode
    from ...engine.sampling import SamplingCancelled
    from ...protocol.validation import ValidationError

    if not isinstance(request, EncodeTextRequest):
        raise ValidationError(f"encode_text payload: expected an EncodeTextRequest, got {type(request).__name__}")
    if request.mode is not None:
        check_mode(request.mode)
    service = state.text
    if ctx.step_boundary("text", 0):
        raise SamplingCancelled("encode_text cancelled before it began")
    # batch_parallel with one prompt is refused when asked for; as the fleet's default it falls back to the replicas
    encoding = service.encode(list(request.prompts), mode=request.mode, unload=request.unload,
                              strict=request.mode is not None)
    ctx.progress("text", 1, 1)
    forwards = [s.forwards for s in service.gather_stats()]
    if ctx.rank != 0:
        return None
    conditioning = tuple(service.conditioning(e, request.frame_rate) for e in encoding.embeds)
    return EncodeTextResult(tuple(c[0][0] for c in conditioning), conditioning, encoding.report,
                            tuple(forwards), service.counters())
