"""Text encoding as a job: prompts -> ComfyUI CONDITIONING on the fleet (parallel/gemma.py, DESIGN.md §3, §7)."""
from __future__ import annotations

from . import register


def _payload(payload) -> dict:
    from ..parallel.gemma import check_mode
    from ..validation import ValidationError

    if not isinstance(payload, dict):
        raise ValidationError(f"encode_text payload must be a dict with 'prompts', got {type(payload).__name__}")
    unknown = set(payload) - {"prompts", "mode", "unload", "frame_rate"}
    if unknown:
        raise ValidationError(f"encode_text payload: unknown keys {sorted(unknown)} (known: prompts, mode, unload, "
                              f"frame_rate)")
    prompts = payload.get("prompts")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValidationError(f"encode_text: 'prompts' must be a non-empty list of strings, got {prompts!r:.120}")
    mode = payload.get("mode")
    if mode is not None:
        check_mode(mode)
    frame_rate = payload.get("frame_rate")
    if frame_rate is not None and not (isinstance(frame_rate, (int, float)) and frame_rate > 0):
        raise ValidationError(f"encode_text: frame_rate={frame_rate!r} must be a positive number")
    return {"prompts": list(prompts), "mode": mode, "unload": payload.get("unload"), "frame_rate": frame_rate}


@register("encode_text")
def run_encode_text(state, payload, ctx) -> dict:
    """`payload` = {"prompts": [...], "mode": "sharded" | "batch_parallel" | "replicated" | None (the fleet's
    gemma_mode), "unload": bool | None (the fleet's gemma_unload), "frame_rate": float | None}.

    Returns (rank 0): {"embeds": [[1, T_i, C] float32 per prompt, valid tokens only], "conditioning": [ComfyUI
    CONDITIONING `[[cond, {"pooled_output": None, "unprocessed_ltxav_embeds": True[, "frame_rate"]}]]` per prompt
    (cond is the same tensor as embeds[i])], "report": {mode, cache_hits, encoded, seconds, device_map, ...},
    "forwards_per_rank": [Gemma forwards each rank has run since the fleet started], "stats": rank 0's counters}.
    Raises ValidationError (bad payload, "batch_parallel" asked for with one prompt, GemmaMemoryError) on every
    rank; the fleet stays.
    """
    from ..sampling import SamplingCancelled

    request = _payload(payload)
    service = state.text
    if ctx.step_boundary("text", 0):
        raise SamplingCancelled("encode_text cancelled before it began")
    # batch_parallel with one prompt is refused when asked for; as the fleet's default it falls back to the replicas
    embeds = service.encode(request["prompts"], mode=request["mode"], unload=request["unload"],
                            strict=request["mode"] is not None)
    ctx.progress("text", 1, 1)
    forwards = [s["forwards"] for s in service.gather_stats()]
    if ctx.rank != 0:
        return {}
    conditioning = [service.conditioning(e, request["frame_rate"]) for e in embeds]
    return {"embeds": [c[0][0] for c in conditioning], "conditioning": conditioning,
            "report": dict(service.last_report), "forwards_per_rank": forwards, "stats": dict(service.stats)}
