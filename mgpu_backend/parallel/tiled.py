"""Tiled data parallelism (TDP) for the stage-2 upscale (DESIGN.md §5; seed `000_…`, Lightricks
`ltx_core/multigpu/transformer/tiled_data_parallel.py`).

Every rank runs the full transformer on its tiles (tile i -> rank i mod W; more tiles than ranks is fine, a rank
with none still joins the collective). Each rank adds its weighted tile outputs into a full-size buffer and one
`all_reduce(SUM)` per forward gives the blended result (the weights sum to one everywhere).

- Positions: with `normalize_positions` (default) a tile's positions are shifted so its generated tokens start at
  0 on every axis (interval widths kept) — keeps RoPE in the trained range.
- Conditioning tokens (after the F·H·W generated tokens): a tile keeps one whose [start, end) overlaps the tile on
  all three axes, or whose time start is negative (reference tokens, kept by every tile); a token kept by k tiles
  weighs 1/k.
- Audio is not tiled: every tile forward sees the full audio. The stage-2 audio is frozen (the clean stage-1 audio
  at timestep 0), so the audio output here is not blended: zeros are returned and the caller keeps its audio.

TDP is an approximation (each tile sees only local context): it is an upscaler, never a first stage.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..attention import LTX2AttnProcessor, use_processor
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
                         f"0.625, 0.4, 0) or raise the bound")


class TiledTransformer:
    """Wraps an `LTX2VideoTransformer3DModel` for one stage on a latent grid (F, H, W).

    Call with the transformer's keyword arguments (full, replicated inputs on every rank): `hidden_states
    [B, T, C]` with T ≥ F·H·W (tokens past F·H·W are conditioning tokens), per-token `timestep [B, T]`,
    `video_coords [B, 3, T, 2]`, optional per-token `video_keyframes_mask [B, T, 1]` (indexed with each tile).
    Returns `(video [B, T, C], zeros like audio)`, the same on every rank.

    `group=None` with `world_size=1` computes every tile here (the single-process reference of the same tiling).
    """

    def __init__(self, transformer, grid: tuple[int, int, int], tiling: TileCountConfig,
                 group: dist.ProcessGroup | None = None, world_size: int = 1, rank: int = 0,
                 normalize_positions: bool = True):
        self.transformer, self.grid, self.tiling = transformer, tuple(grid), tiling
        self.transformer_blocks = transformer.transformer_blocks  # for STG's processor swap
        self.group, self.world_size, self.rank = group, world_size, rank
        self.normalize_positions = normalize_positions
        self.tiles, self.normalized = make_tiles(self.grid, tiling)
        self.my_tiles = [t for t in self.tiles if t.index % world_size == rank]
        self.compute_seconds = 0.0
        self.forwards = 0
        self._local = LTX2AttnProcessor()

    def activate(self) -> None:
        """Install local attention processors (tiles run the whole model on this rank)."""
        use_processor(self.transformer, self._local)

    def describe(self) -> str:
        return (f"{len(self.tiles)} tiles ({'×'.join(str(a.num_tiles) for a in self.tiling.axes)}) over "
                f"{self.world_size} ranks; rank {self.rank}: tiles {[t.index for t in self.my_tiles]}")

    def _conditioning_selection(self, tile: Tile, coords: torch.Tensor, tile_coords: torch.Tensor,
                                n_generated: int) -> torch.Tensor:
        """Boolean [T_cond] of the conditioning tokens this tile keeps (overlap on all axes, or time start < 0)."""
        cond = coords[0, :, n_generated:]  # [3, Tc, 2]
        lo = tile_coords[0, :, :, 0].amin(dim=1)  # [3] tile extent (batch 0: positions are shared across the batch)
        hi = tile_coords[0, :, :, 1].amax(dim=1)
        overlaps = ((cond[..., 0] < hi[:, None]) & (cond[..., 1] > lo[:, None])).all(dim=0)
        return overlaps | (cond[0, :, 0] < 0)

    def __call__(self, *, hidden_states, timestep, video_coords, audio_hidden_states, **kwargs):
        blocks = self.transformer.transformer_blocks
        if blocks and blocks[0].video_to_audio_attn.processor is not self._local:
            self.activate()  # another stage used the shared transformer since (STG never swaps this one)
        b, t, c = hidden_states.shape
        n_gen = self.grid[0] * self.grid[1] * self.grid[2]
        if t < n_gen:
            raise ValueError(f"{t} video tokens for a {self.grid} latent grid ({n_gen} tokens)")
        if timestep.ndim != 2 or timestep.shape[1] != t:
            raise ValueError(f"tiled stages need per-token timesteps [B, {t}]; got {tuple(timestep.shape)}")
        n_cond = t - n_gen
        # how many tiles keep each conditioning token (every rank computes it for all tiles: cheap, no comm)
        keep = {}
        if n_cond:
            counts = torch.zeros(n_cond)
            for tile in self.tiles:
                idx = tile.token_index(self.grid).to(video_coords.device)
                keep[tile.index] = self._conditioning_selection(tile, video_coords, video_coords[:, :, idx], n_gen)
                counts += keep[tile.index].float().cpu()
        out = torch.zeros(b, t, c, dtype=torch.float32, device=hidden_states.device)
        start = time.perf_counter()
        for tile in self.my_tiles:
            idx = tile.token_index(self.grid).to(hidden_states.device)
            weights = tile.weight.reshape(-1).to(out.device, torch.float32)
            if n_cond:
                kept = keep[tile.index].nonzero().flatten().to(hidden_states.device)
                idx = torch.cat([idx, n_gen + kept])
                weights = torch.cat([weights, (1.0 / counts[kept.cpu()]).to(out.device)])
            coords = video_coords[:, :, idx]
            if self.normalize_positions:
                offset = video_coords[:, :, tile.token_index(self.grid).to(coords.device), 0].amin(dim=2)  # [B, 3]
                coords = coords - offset[:, :, None, None]
            per_token = {"video_keyframes_mask": kwargs["video_keyframes_mask"][:, idx]} \
                if kwargs.get("video_keyframes_mask") is not None else {}  # from the un-normalized positions
            video, _ = self.transformer(hidden_states=hidden_states[:, idx], timestep=timestep[:, idx],
                                        video_coords=coords, audio_hidden_states=audio_hidden_states,
                                        return_dict=False, **{**{k: v for k, v in kwargs.items() if k != "return_dict"},
                                                              **per_token})
            out[:, idx] += video.float() * weights[None, :, None]
            self.forwards += 1
        self.compute_seconds += time.perf_counter() - start
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(hidden_states.dtype), torch.zeros_like(audio_hidden_states)
