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

import torch
import torch.distributed as dist

from ..engine import forward as model_forward
from ..engine.attention import LTX2AttnProcessor, use_processor
from ..protocol.native_forward import ForwardOptions
from ..engine.semantics import REFERENCE
from ..engine.tokens import TokenBatch
from .forward_plan import TILES, select_tokens
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


class TiledTransformer:
    """Wraps an `LTX2VideoTransformer3DModel` for one stage on a latent grid (F, H, W).

    Call with the transformer's keyword arguments (full, replicated inputs on every rank): `hidden_states
    [B, T, C]` with T ≥ F·H·W (tokens past F·H·W are conditioning tokens), per-token `timestep [B, T]`,
    `video_coords [B, 3, T, 2]`, optional per-token `video_keyframes_mask [B, T, 1]` (indexed with each tile).
    Returns `(video [B, T, C], zeros like audio)`, the same on every rank.

    `group=None` with `world_size=1` computes every tile here (the single-process reference of the same tiling).
    """

    plan = TILES  # the declarative plan it applies (splits/forward_plan.py)

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
        self.denoise_audio = False  # True: average the tiles' audio outputs (audio re-denoised in this stage)
        self.drift: list[float] = []  # per forward call; empty when no token is covered by two tiles
        self._local = LTX2AttnProcessor()
        n_gen = self.grid[0] * self.grid[1] * self.grid[2]
        cover = torch.zeros(n_gen, dtype=torch.int64)
        for tile in self.tiles:
            cover[tile.token_index(self.grid)] += 1
        overlap = (cover >= 2).nonzero().flatten()
        self._overlap_count = cover[overlap].float()  # [N_ov] tiles per overlap token
        self._overlap_slot = torch.full((n_gen,), -1, dtype=torch.int64)  # token -> row in the overlap buffers
        self._overlap_slot[overlap] = torch.arange(overlap.numel())

    def _tile_forwards(self, hidden_states, timestep, video_coords, audio_hidden_states, kwargs: dict):
        """`(token index, the tile's positions) -> (video, audio)`: the one forward (`model_forward.run_eager`,
        local) on the tile's share of ONE `TokenBatch` of the whole latent (the plan's `TILES` entry:
        `forward_plan.select_tokens`). A stand-in without the LTX-2 modules (tests) is called with the tile's
        keyword arguments instead."""
        rest = {k: v for k, v in kwargs.items() if k != "return_dict"}
        if not hasattr(self.transformer, "proj_in"):
            def stand_in(idx, coords):
                per_token = ({"video_keyframes_mask": rest["video_keyframes_mask"][:, idx]}
                             if rest.get("video_keyframes_mask") is not None else {})
                return self.transformer(hidden_states=hidden_states[:, idx], timestep=timestep[:, idx],
                                        video_coords=coords, audio_hidden_states=audio_hidden_states,
                                        return_dict=False, **{**rest, **per_token})
            return stand_in
        isolate = bool(rest.pop("isolate_modalities", False))
        batch = TokenBatch.from_diffusers(self.transformer.config, hidden_states=hidden_states, timestep=timestep,
                                          video_coords=video_coords, audio_hidden_states=audio_hidden_states, **rest)
        options = ForwardOptions(a2v_cross_attn=not isolate, v2a_cross_attn=not isolate)

        def tile(idx, coords):  # the keyframe marker comes from the clip's positions, not the tile's
            return model_forward.run_eager(self.transformer, select_tokens(self.plan, batch, idx, video_coords=coords),
                                           REFERENCE, None, options)
        return tile

    def activate(self) -> None:
        """Install local attention processors (tiles run the whole model on this rank)."""
        use_processor(self.transformer, self._local)

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
        n_ov = self._overlap_count.numel()
        sums = torch.zeros(2, b, n_ov, c, dtype=torch.float32, device=out.device)  # Σ v and Σ v² on overlaps
        audio_sum = None
        tile_forward = self._tile_forwards(hidden_states, timestep, video_coords, audio_hidden_states, kwargs)
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
            video, audio = tile_forward(idx, coords)
            out[:, idx] += video.float() * weights[None, :, None]
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
        self.compute_seconds += time.perf_counter() - start
        if self.denoise_audio and audio_sum is None:  # a rank without a tile joins with zeros
            audio_sum = torch.zeros(audio_hidden_states.shape[:2] + (self._audio_channels(audio_hidden_states),),
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
            audio_out = (audio_sum / len(self.tiles)).to(audio_hidden_states.dtype)
        else:
            audio_out = torch.zeros_like(audio_hidden_states)
        return out.to(hidden_states.dtype), audio_out

    def _audio_channels(self, audio_hidden_states: torch.Tensor) -> int:
        """Width of the transformer's audio output (its audio patch size: the input width for LTX-2)."""
        proj = getattr(self.transformer, "audio_proj_out", None)
        return int(proj.out_features) if proj is not None else int(audio_hidden_states.shape[-1])
