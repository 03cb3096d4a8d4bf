"""The whole two-stage / distilled generation as one job (CLI `generate --devices`)."""
from __future__ import annotations

from . import register


@register("generate")
def run_generate(state, request, ctx) -> dict:
    """`pipelines.TwoStagePipeline.generate` on this rank, split by the fleet's parallel plan."""
    from ..frames import send_frames

    result = state.pipeline.generate(request, progress=ctx.progress, cancel_check=ctx.step_boundary)
    if ctx.rank != 0:
        return {}
    return {"frames": send_frames(result.frames), "audio": result.audio, "sample_rate": result.sample_rate,
            "video_latent": result.video_latent, "audio_latent": result.audio_latent, "timings": result.timings,
            "lora_reports": [str(r) for r in result.lora_reports], "parallel": result.parallel_report,
            "rank_reports": result.rank_reports}
