"""Tiled data parallelism (TDP) for the stage-2 upscale (docs/design/tiled-data-parallel.md; Lightricks'
`ltx_core/multigpu/transformer/tiled_data_parallel.py`).

Every rank runs the full transformer on its tiles (tile i -> rank i mod W; more tiles than ranks is fine, a rank
with none still joins the collective). Each rank adds its weighted tile outputs into a full-size buffer and one
`all_reduce(SUM)` per forward gives the blended result (the weights sum to one everywhere).

- Positions: with `normalize_positions` (default) a tile's positions are shifted so its generated tokens start at
  0 on every axis (interval widths kept) — keeps RoPE in the trained range.
- Conditioning tokens (after the F·H·W generated tokens): a tile keeps one whose [start, end) overlaps the tile on
  all three axes, or whose time start is negative (reference tokens, kept by every tile); a token kept by k tiles
  weighs 1/k.
- Audio is not tiled: every tile forward sees the full audio. By default the stage-2 audio is frozen (the clean
  stage-1 audio at timestep 0, the reference's final audio), so the audio output here is not blended: zeros are
  returned and the caller keeps its audio. With `denoise_audio` (what ComfyUI's LTX templates do in their stage 2:
  the audio is re-noised and denoised with the video) every tile's audio output is averaged over all tiles (the
  reference computes this average too, then throws it away).
- Tile drift (`drift`, one value per forward): how far overlapping tiles disagree before blending. Over the
  generated tokens covered by n ≥ 2 tiles, with m and s² the mean and (unbiased) variance of the tiles' outputs at
  a token: drift = sqrt(Σ 2·s²) / sqrt(Σ m²) — the RMS difference of two tiles' outputs relative to their mean
  (for two tiles: ‖v₁ − v₂‖ / ‖(v₁ + v₂)/2‖ over the overlap). Costs one extra sum over the overlap tokens in the
  same all_reduce. `normalized` says whether the trapezoid weights had to be normalized (three tiles overlapping).

TDP is an approximation (each tile sees only local context): it is an upscaler, never a first stage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.tokens import TokenBatch
from .forward_plan import TILES, ForwardPlan, select_tokens
from .tiling import Tile, TileCountConfig, make_tiles

DEFAULT_MAX_FIRST_SIGMA = 0.7  # TDP refused above this first sigma: tiles drift apart (seed: "Do not run TDP first")


def check_tdp_sigmas(sigmas, max_first_sigma: float = DEFAULT_MAX_FIRST_SIGMA) -> None:
    """Refuse TDP as a first stage or from too much noise (raises ValueError with the explanation)."""
    first = float(sigmas[0])
    if first >= 0.999:
        raise ValueError("tiled data parallelism cannot run as a first stage: from pure noise every tile denoises "
                         "on its own and the tiles never agree on one video; run stage 1 with sequence parallelism")
    if first > max_first_sigma:
        raise ValueError(f"tiled stage 2 starting at sigma {first:g} is above the bound {max_first_sigma:g}: the "
                         f"more noise is re-injected, the more the tiles drift apart; use smaller sigmas (reference: "
                         f"0.625, 0.4, 0) or raise the bound (max_first_sigma) and check the reported tile drift")


@dataclass(frozen=True, eq=False)
class _TilePart:
    """One tile's share of a batch: its token indices (generated tokens, then the conditioning tokens it keeps),
    their blend weights `[n]` float32 and the tile's (re-based) positions."""

    index: torch.Tensor
    weights: torch.Tensor
    coords: torch.Tensor


class TiledSplit:
    """The `TILES` plan of one stage on a latent grid (F, H, W), as the one forward uses it (`engine.forward.Split`).

    A forward's batch has `video [B, T, C]` with T ≥ F·H·W (tokens past F·H·W are conditioning tokens), per-token
    `video_timestep [B, T]` and `video_coords [B, 3, T, 2]`; `shard` gives this rank's tiles (the plan's input
    entries indexed by each tile's tokens, positions re-based), `gather` blends them and returns `(video [B, T, C],
    audio)` — the same on every rank (audio: zeros like the input, or the tiles' average with `denoise_audio`).
    It synchronises with the host (`cuda_graph_safe` False: eager forwards). Its processors are local
    (`apply.apply_plan(transformer, TILES)`).

    `group=None` with `world_size=1` computes every tile here (the single-process reference of the same tiling).
    Statistics of the stage on this rank: `forwards` (tile forwards), `compute_seconds`, `drift` (per forward).
    """

    plan: ForwardPlan = TILES
    exchange = None  # the tiles' attention is local: nothing for apply_plan to install over
    cuda_graph_safe = False  # every forward's blend waits on an all_reduce and host-side index math

    def __init__(self, transformer, grid: tuple[int, int, int], tiling: TileCountConfig,
                 group: dist.ProcessGroup | None = None, world_size: int = 1, rank: int = 0,
                 normalize_positions: bool = True):
        self.transformer, self.grid, self.tiling = transformer, tuple(grid), tiling
        self.group, self.world_size, self.rank = group, world_size, rank
        self.normalize_positions = normalize_positions
        self.tiles, self.normalized = make_tiles(self.grid, tiling)
        self.my_tiles = [t for t in self.tiles if t.index % world_size == rank]
        self.compute_seconds = 0.0
        self.forwards = 0
        self.denoise_audio = False  # True: average the tiles' audio outputs (audio re-denoised in this stage)
        self.drift: list[float] = []  # per forward call; empty when no token is covered by two tiles
        self._started: float | None = None
        n_gen = self.grid[0] * self.grid[1] * self.grid[2]
        cover = torch.zeros(n_gen, dtype=torch.int64)
        for tile in self.tiles:
            cover[tile.token_index(self.grid)] += 1
        overlap = (cover >= 2).nonzero().flatten()
        self._overlap_count = cover[overlap].float()  # [N_ov] tiles per overlap token
        self._overlap_slot = torch.full((n_gen,), -1, dtype=torch.int64)  # token -> row in the overlap buffers
        self._overlap_slot[overlap] = torch.arange(overlap.numel())

    def describe(self) -> str:
        drift = (", ".join(f"{d:.3g}" for d in self.drift) if self.drift
                 else "n/a (no token is covered by two tiles)")
        return (f"{len(self.tiles)} tile{'s' if len(self.tiles) != 1 else ''} ({'×'.join(str(a.num_tiles) for a in self.tiling.axes)}) over "
                f"{self.world_size} ranks; rank {self.rank}: tiles {[t.index for t in self.my_tiles]}\n"
                f"tile drift per forward (RMS difference of overlapping tiles before blending / their mean): "
                f"{drift}\nblend weights normalized: "
                f"{'yes (three tiles overlap somewhere)' if self.normalized else 'no'}\n"
                f"audio: {'re-denoised (tiles averaged)' if self.denoise_audio else 'frozen stage-1 audio'}")

    @staticmethod
    def drift_of(sums: torch.Tensor, squares: torch.Tensor, count: torch.Tensor) -> float | None:
        """sqrt(Σ 2·s²) / sqrt(Σ m²) from per-token sums of the tiles' outputs and of their squares `[B, N, C]` and
        the tile count per token `[N]` (all ≥ 2); None when there is no overlap token."""
        if count.numel() == 0:
            return None
        n = count[None, :, None].to(sums.dtype)
        mean = sums / n
        var = ((squares - n * mean * mean) / (n - 1)).clamp(min=0)
        return float(torch.sqrt(2 * var.sum()) / torch.sqrt((mean * mean).sum()).clamp(min=1e-30))

    def _conditioning_selection(self, tile: Tile, coords: torch.Tensor, tile_coords: torch.Tensor,
                                n_generated: int) -> torch.Tensor:
        """Boolean [T_cond] of the conditioning tokens this tile keeps (overlap on all axes, or time start < 0)."""
        cond = coords[0, :, n_generated:]  # [3, Tc, 2]
        lo = tile_coords[0, :, :, 0].amin(dim=1)  # [3] tile extent (batch 0: positions are shared across the batch)
        hi = tile_coords[0, :, :, 1].amax(dim=1)
        overlaps = ((cond[..., 0] < hi[:, None]) & (cond[..., 1] > lo[:, None])).all(dim=0)
        return overlaps | (cond[0, :, 0] < 0)

    def _parts(self, batch: TokenBatch) -> list[_TilePart]:
        """This rank's tiles of `batch` (index math only, the same on every call with the same batch). Raises
        ValueError for fewer tokens than the grid, or timesteps that are not per token."""
        video_coords, t = batch.video_coords, batch.video_tokens
        n_gen = self.grid[0] * self.grid[1] * self.grid[2]
        if t < n_gen:
            raise ValueError(f"{t} video tokens for a {self.grid} latent grid ({n_gen} tokens)")
        timestep = batch.video_timestep
        if timestep.ndim != 2 or timestep.shape[1] != t:
            raise ValueError(f"tiled stages need per-token timesteps [B, {t}]; got {tuple(timestep.shape)}")
        n_cond = t - n_gen
        device = batch.video.device
        # how many tiles keep each conditioning token (every rank computes it for all tiles: cheap, no comm)
        keep = {}
        if n_cond:
            counts = torch.zeros(n_cond)
            for tile in self.tiles:
                idx = tile.token_index(self.grid).to(video_coords.device)
                keep[tile.index] = self._conditioning_selection(tile, video_coords, video_coords[:, :, idx], n_gen)
                counts += keep[tile.index].float().cpu()
        parts = []
        for tile in self.my_tiles:
            idx = tile.token_index(self.grid).to(device)
            weights = tile.weight.reshape(-1).to(device, torch.float32)
            if n_cond:
                kept = keep[tile.index].nonzero().flatten().to(device)
                idx = torch.cat([idx, n_gen + kept])
                weights = torch.cat([weights, (1.0 / counts[kept.cpu()]).to(device)])
            coords = video_coords[:, :, idx]
            if self.normalize_positions:
                offset = video_coords[:, :, tile.token_index(self.grid).to(coords.device), 0].amin(dim=2)  # [B, 3]
                coords = coords - offset[:, :, None, None]
            parts.append(_TilePart(idx, weights, coords))
        return parts

    def shard(self, batch: TokenBatch) -> list[TokenBatch]:
        """This rank's tiles of `batch`: every field the plan splits indexed by the tile's tokens, the tile's
        positions (the keyframe marker comes from the clip's positions, not the tile's)."""
        self._started = time.perf_counter()
        return [select_tokens(self.plan, batch, p.index, video_coords=p.coords) for p in self._parts(batch)]

    def key_mask(self, batch: TokenBatch, part: TokenBatch) -> None:
        """Tiles are never padded."""
        return None

    def gather(self, batch: TokenBatch, outputs: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tiles' outputs (in `shard`'s order) blended over all ranks with one all_reduce (see the module
        docstring); the drift of this forward appended."""
        b, t, c = batch.video.shape
        out = torch.zeros(b, t, c, dtype=torch.float32, device=batch.video.device)
        n_ov = self._overlap_count.numel()
        sums = torch.zeros(2, b, n_ov, c, dtype=torch.float32, device=out.device)  # Σ v and Σ v² on overlaps
        audio_sum = None
        for tile, part, (video, audio) in zip(self.my_tiles, self._parts(batch), outputs):
            out[:, part.index] += video.float() * part.weights[None, :, None]
            if n_ov:
                gen = tile.token_index(self.grid)
                slot = self._overlap_slot[gen]
                on = (slot >= 0).nonzero().flatten()
                v = video[:, on.to(video.device)].float()
                rows = slot[on].to(out.device)
                sums[0].index_add_(1, rows, v)
                sums[1].index_add_(1, rows, v * v)
            if self.denoise_audio:
                audio_sum = audio.float() if audio_sum is None else audio_sum + audio.float()
            self.forwards += 1
        if self._started is not None:
            self.compute_seconds += time.perf_counter() - self._started
            self._started = None
        if self.denoise_audio and audio_sum is None:  # a rank without a tile joins with zeros
            audio_sum = torch.zeros(batch.audio.shape[:2] + (self._audio_channels(batch.audio),),
                                    dtype=torch.float32, device=out.device)
        if self.world_size > 1:
            # one collective: the blended video, the overlap sums, and (re-denoised audio) the audio sum
            parts = [out, sums] + ([audio_sum] if self.denoise_audio else [])
            flat = torch.cat([x.reshape(-1) for x in parts])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for x in parts:
                x.copy_(flat[offset:offset + x.numel()].view_as(x))
                offset += x.numel()
        if n_ov:
            self.drift.append(self.drift_of(sums[0], sums[1], self._overlap_count.to(out.device)))
        if self.denoise_audio:
            audio_out = (audio_sum / len(self.tiles)).to(batch.audio.dtype)
        else:
            audio_out = torch.zeros_like(batch.audio)
        return out.to(batch.video.dtype), audio_out

    def _audio_channels(self, audio: torch.Tensor) -> int:
        """Width of the transformer's audio output (its audio patch size: the input width for LTX-2)."""
        proj = getattr(self.transformer, "audio_proj_out", None)
        return int(proj.out_features) if proj is not None else int(audio.shape[-1])


__all__ = ["DEFAULT_MAX_FIRST_SIGMA", "TiledSplit", "check_tdp_sigmas"]
