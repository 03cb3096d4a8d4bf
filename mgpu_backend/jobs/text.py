"""Text encoding as a job: prompts -> ComfyUI CONDITIONING on the fleet (parallel/gemma.py, DESIGN.md §3, §7)."""
from __future__ import annotations

from ..protocol.job_requests import EncodeTextRequest
from . import register


@register("encode_text")
def run_encode_text(state, request, ctx) -> dict:
    """`request`: a `EncodeTextRequest` (prompts, Gemma mode or None for the fleet's, unload or None for the
    fleet's, frame_rate or None).

    Returns (rank 0): {"embeds": [[1, T_i, C] float32 per prompt, valid tokens only], "conditioning": [ComfyUI
    CONDITIONING `[[cond, {"pooled_output": None, "unprocessed_ltxav_embeds": True[, "frame_rate"]}]]` per prompt
    (cond is the same tensor as embeds[i])], "report": {mode, cache_hits, encoded, seconds, device_map, ...},
    "forwards_per_rank": [Gemma forwards each rank has run since the fleet started], "stats": rank 0's counters}.
    Raises ValidationError (not an EncodeTextRequest, "batch_parallel" asked for with one prompt, GemmaMemoryError)
    on every rank; the fleet stays.
    """
    from ..parallel.gemma import check_mode
    from ..sampling import SamplingCancelled
    from ..validation import ValidationError

    if not isinstance(request, EncodeTextRequest):
        raise ValidationError(f"encode_text payload: expected an EncodeTextRequest, got {type(request).__name__}")
    if request.mode is not None:
        check_mode(request.mode)
    service = state.text
    if ctx.step_boundary("text", 0):
        raise SamplingCancelled("encode_text cancelled before it began")
    # batch_parallel with one prompt is refused when asked for; as the fleet's default it falls back to the replicas
    embeds = service.encode(list(request.prompts), mode=request.mode, unload=request.unload,
                            strict=request.mode is not None)
    ctx.progress("text", 1, 1)
    forwards = [s["forwards"] for s in service.gather_stats()]
    if ctx.rank != 0:
        return {}
    conditioning = [service.conditioning(e, request.frame_rate) for e in embeds]
    return {"embeds": [c[0][0] for c in conditioning], "conditioning": conditioning,
            "report": dict(service.last_report), "forwards_per_rank": forwards, "stats": dict(service.stats)}
