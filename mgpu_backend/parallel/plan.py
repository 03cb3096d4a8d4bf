"""How one job is split over a fleet: the sequence-parallel group and the hand-over to the other ranks.

SP runs on the largest valid subset of the fleet (W must divide the video heads): on 6 GPUs with 32 heads, SP uses
ranks 0–3 as a sub-group and says so in the job report; ranks 4–5 skip the SP stages and receive the result by
broadcast from rank 0, so the stages that use every device (tiled stage 2, decode, Gemma) still can.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..validation import ValidationError
from .decode import decode_tiles
from .exchange import Exchange
from .sequence import SequenceParallelTransformer, check_token_cap, largest_sp_degree
from .tiled import TiledTransformer
from .tiling import TileCountConfig

DEFAULT_TOKEN_CAP = 65536  # video tokens per rank per forward (≈ 241 frames at 1920×1088 on 2 ranks)


@dataclass
class ParallelPlan:
    """The split of one fleet. Build it on every rank with `build_plan` (creating a sub-group is collective)."""

    rank: int
    world_size: int
    device: torch.device
    sp_degree: int
    sp_group: dist.ProcessGroup | None  # None = the default (world) group
    sp_forward: SequenceParallelTransformer | None  # None on ranks outside the SP group
    token_cap: int | None = DEFAULT_TOKEN_CAP
    active_group: dist.ProcessGroup | None = None  # the group of the stage now running (for the cancel check)

    @property
    def in_sp_group(self) -> bool:
        return self.rank < self.sp_degree

    def check(self, tokens: int) -> None:
        """Before any work: the per-rank token cap of the largest SP stage (raises ValidationError)."""
        try:
            check_token_cap(tokens, self.sp_degree, self.token_cap)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def share(self, video: torch.Tensor | None, audio: torch.Tensor | None, video_shape, audio_shape):
        """After an SP stage: ranks outside the SP group receive rank 0's latents (no-op when SP spans the fleet)."""
        if self.sp_degree == self.world_size:
            return video, audio
        out = []
        for x, shape in ((video, video_shape), (audio, audio_shape)):
            buf = (x if x is not None else torch.empty(shape, dtype=torch.float32)).to(self._comm_device())
            dist.broadcast(buf, src=0)
            out.append(buf.cpu())
        return out[0], out[1]

    def tiled(self, transformer, grid: tuple[int, int, int], tiling: TileCountConfig) -> TiledTransformer:
        """A TDP wrapper over every rank of the fleet (the default group)."""
        return TiledTransformer(transformer, grid, tiling, None, self.world_size, self.rank)

    def decode(self, vae, latent: torch.Tensor, tiling: TileCountConfig, temb=None):
        """Distributed decode over every rank; pixels on rank 0 (None elsewhere) and this rank's report."""
        return decode_tiles(vae, latent, tiling, temb, None, self.world_size, self.rank)

    def gather_reports(self, report: dict) -> list[dict] | None:
        """Every rank's report on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [report]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, out, dst=0)
        return out

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def describe(self) -> str:
        if self.world_size == 1:
            return "one rank"
        if self.sp_degree == self.world_size:
            return f"sequence parallel over all {self.world_size} ranks"
        return (f"sequence parallel on ranks 0-{self.sp_degree - 1} of {self.world_size} (the SP degree must divide "
                f"the attention heads; {self.world_size} does not); the other ranks wait for its result")


def build_plan(transformer, rank: int, world_size: int, device: torch.device,
               token_cap: int | None = DEFAULT_TOKEN_CAP) -> ParallelPlan:
    """Called by every rank of an initialized default process group."""
    heads = transformer.config.num_attention_heads
    degree = largest_sp_degree(heads, world_size)
    group = None
    if degree != world_size:
        group = dist.new_group(list(range(degree)))  # collective: every rank calls it
    forward = None
    if rank < degree:
        forward = SequenceParallelTransformer(transformer, Exchange(group, degree, rank), token_cap)
    return ParallelPlan(rank, world_size, device, degree, group, forward, token_cap)
