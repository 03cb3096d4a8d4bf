"""The whole two-stage / distilled generation as one job (CLI `generate --devices`)."""
from __future__ import annotations

from ...protocol.job_results import GenerateJobResult
from . import register


@register("generate")
def run_generate(state, request, ctx) -> GenerateJobResult | None:
    """`pipelines.TwoStagePipeline.generate` on this rank, split by the fleet's parallel plan -> on rank 0 a
    `GenerateJobResult` (frames through shared memory), None elsewhere."""
    from ...protocol.frames import send_frames

    result = state.pipeline.generate(request, progress=ctx.progress, cancel_check=ctx.step_boundary)
    if ctx.rank != 0:
        return None
    return GenerateJobResult(send_frames(result.frames), result.audio, result.sample_rate, result.video_latent,
                             result.audio_latent, result.timings, tuple(str(r) for r in result.lora_reports),
                             result.parallel_report,
                             None if result.rank_reports is None else tuple(result.rank_reports))
