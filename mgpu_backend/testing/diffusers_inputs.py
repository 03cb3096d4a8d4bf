"""Drivers for tests and benchmarks that speak diffusers' `LTX2VideoTransformer3DModel.forward` keyword arguments:
the engine itself takes none (it builds its `TokenBatch` directly), but comparing with diffusers' own forward, and
the older benchmarks' inputs, need the translation. Imported by tests/ and bench/ only (the testing fence).

- `diffusers_batch`: the keyword arguments -> (`TokenBatch`, `ForwardOptions`) by diffusers' input rules;
- `SequenceDriver`: the sequence split (`UlyssesSplit`) over an exchange, its plan applied, called with them;
- `TiledDriver`: a `TiledSplit` called with them (a stand-in transformer runs through the split's shard / gather);
- `call_diffusers`: the one forward, local, called with them.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from ..engine import forward as model_forward
from ..engine.semantics import REFERENCE
from ..engine.tokens import TokenBatch
from ..protocol.native_forward import ForwardOptions
from ..splits.apply import apply_plan
from ..splits.sequence import UlyssesSplit
from ..splits.tiled import TiledSplit


def diffusers_batch(config, *, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                    timestep, video_coords, audio_coords, **rest):
    """diffusers' `LTX2VideoTransformer3DModel.forward` keyword arguments -> (`TokenBatch`, `ForwardOptions`), by
    diffusers' own input rules (0.42.1), for tests that compare the engine's forward with diffusers' (the engine
    itself builds its batches directly: `denoiser.LTX2Denoiser.token_batch`). Optional keywords: audio_timestep,
    sigma, audio_sigma (default: the video's), encoder_attention_mask / audio_encoder_attention_mask (2-D: the bias
    `(1 − mask)·−10000`), use_cross_timestep, video_keyframes_mask, isolate_modalities. Raises TypeError for any
    other keyword."""
    known = {"audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask", "audio_encoder_attention_mask",
             "use_cross_timestep", "video_keyframes_mask", "isolate_modalities"}
    if set(rest) - known:
        raise TypeError(f"diffusers_batch: unexpected {sorted(set(rest) - known)}")
    audio_timestep = rest.get("audio_timestep")
    audio_timestep = audio_timestep if audio_timestep is not None else timestep
    sigma = rest.get("sigma")
    audio_sigma = rest.get("audio_sigma")
    audio_sigma = audio_sigma if audio_sigma is not None else sigma
    b = hidden_states.shape[0]
    factor = config.cross_attn_timestep_scale_multiplier / config.timestep_scale_multiplier

    def bias(mask, dtype):
        if mask is None or mask.ndim != 2:
            return None if mask is None else (mask[:, None] if mask.ndim == 3 else mask)
        return ((1 - mask.to(dtype)) * -10000.0).view(b, 1, 1, -1)

    cross = rest.get("use_cross_timestep", False)
    video_cross = audio_sigma.flatten() if cross else timestep
    audio_cross = sigma.flatten() if cross else audio_timestep
    marker = None
    keyframes = rest.get("video_keyframes_mask")
    if config.use_keyframes_abs_pos_embedding and keyframes is not None:
        marker = (keyframes > 0).reshape(b, -1)
    prompt = getattr(config, "use_prompt_adaln_single", False) and sigma is not None
    batch = TokenBatch(
        video=hidden_states, audio=audio_hidden_states, video_timestep=timestep, audio_timestep=audio_timestep,
        video_cross_timestep=video_cross, audio_cross_timestep=audio_cross,
        a2v_gate_timestep=video_cross * factor, v2a_gate_timestep=audio_cross * factor,
        video_coords=video_coords, audio_coords=audio_coords, video_context=encoder_hidden_states,
        audio_context=audio_encoder_hidden_states,
        video_prompt_timestep=sigma.flatten() if prompt else None,
        audio_prompt_timestep=audio_sigma.flatten() if prompt else None,
        video_text_bias=bias(rest.get("encoder_attention_mask"), hidden_states.dtype),
        audio_text_bias=bias(rest.get("audio_encoder_attention_mask"), audio_hidden_states.dtype),
        keyframe_marker=marker)
    isolate = bool(rest.get("isolate_modalities", False))
    return batch, ForwardOptions(a2v_cross_attn=not isolate, v2a_cross_attn=not isolate)


class TiledDriver:
    """Test driver of a `splits.tiled.TiledSplit` on diffusers' keyword arguments (the split's attributes read and
    written through): the split's own `shard` and `gather` around each tile's forward — the one forward
    (`engine.forward.run_eager` under the split, the `TILES` plan applied) on a real transformer, or a stand-in's
    `__call__(hidden_states=, timestep=, video_coords=, audio_hidden_states=, return_dict=False)` with the tile's
    fields (a stand-in is anything without `proj_in`)."""

    _OWN = ("split", "transformer")

    def __init__(self, transformer, grid, tiling, group=None, world_size=1, rank=0, normalize_positions=True):
        object.__setattr__(self, "transformer", transformer)
        object.__setattr__(self, "split", TiledSplit(transformer, grid, tiling, group, world_size, rank,
                                                     normalize_positions))

    def __getattr__(self, name):
        return getattr(self.split, name)

    def __setattr__(self, name, value):
        setattr(self.split, name, value)

    def __call__(self, return_dict=False, **kwargs):
        hidden, audio = kwargs["hidden_states"], kwargs["audio_hidden_states"]
        b = hidden.shape[0]
        kwargs.setdefault("encoder_hidden_states", hidden.new_zeros(b, 1, 1))
        kwargs.setdefault("audio_encoder_hidden_states", kwargs["encoder_hidden_states"])
        kwargs.setdefault("audio_coords", audio.new_zeros(b, 1, audio.shape[1], 2))
        config = getattr(self.transformer, "config", None) or SimpleNamespace(
            cross_attn_timestep_scale_multiplier=1000, timestep_scale_multiplier=1000,
            use_keyframes_abs_pos_embedding=False, use_prompt_adaln_single=False)
        batch, options = diffusers_batch(config, **kwargs)
        if hasattr(self.transformer, "proj_in"):
            apply_plan(self.transformer, self.split.plan)
            return model_forward.run_eager(self.transformer, batch, REFERENCE, self.split, options)
        outputs = [self.transformer(hidden_states=p.video, timestep=p.video_timestep, video_coords=p.video_coords,
                                    audio_hidden_states=p.audio, return_dict=False)
                   for p in self.split.shard(batch)]
        return self.split.gather(batch, outputs)


class SequenceDriver:
    """The sequence split over `exchange` (`UlyssesSplit`) called with diffusers' keyword arguments: its plan is
    applied to `transformer` when the driver is made and by `activate()` (another split may have been applied
    since); `token_cap` comes with the call (the job's, `StageRun.forward` in the engine). Returns `(video, audio)`
    as the one forward does."""

    def __init__(self, transformer, exchange):
        self.transformer, self.split = transformer, UlyssesSplit(exchange)
        self.transformer_blocks = transformer.transformer_blocks
        self.activate()

    @property
    def exchange(self):
        return self.split.exchange

    def activate(self) -> None:
        apply_plan(self.transformer, self.split.plan, self.split.exchange)

    def __call__(self, token_cap=None, return_dict=False, **kwargs):
        batch, options = diffusers_batch(self.transformer.config, **kwargs)
        split = dataclasses.replace(self.split, token_cap=token_cap)
        return model_forward.run_eager(self.transformer, batch, REFERENCE, split, options)




def call_diffusers(transformer, **kwargs):
    """The one forward (eagerly, REFERENCE semantics, no split: the installed processors) on diffusers' keyword
    arguments (`diffusers_batch`) -> `(video, audio)`."""
    kwargs.pop("return_dict", None)
    batch, options = diffusers_batch(transformer.config, **kwargs)
    return model_forward.run_eager(transformer, batch, REFERENCE, None, options)


__all__ = ["SequenceDriver", "TiledDriver", "call_diffusers", "diffusers_batch"]
