"""A small LTX-2 transformer forward shared by the loader, fp8 and LoRA tests."""
from __future__ import annotations

import torch


def av_forward(transformer, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 transformer forward on a small random input: 2×2×3 video tokens, 5 audio tokens, 7 text tokens
    (the last 2 masked), distinct audio/video sigmas."""
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    frames, height, width, audio_frames, text = 2, 2, 3, 5, 7
    video = torch.randn(1, frames * height * width, cfg.in_channels, generator=g)
    audio = torch.randn(1, audio_frames, cfg.audio_in_channels, generator=g)
    video_ctx_dim = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.cross_attention_dim
    audio_ctx_dim = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.audio_cross_attention_dim
    ctx_v = torch.randn(1, text, video_ctx_dim, generator=g)
    ctx_a = torch.randn(1, text, audio_ctx_dim, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    sv, sa = 0.6, 0.3
    with torch.no_grad():
        out_v, out_a = transformer(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=ctx_v,
            audio_encoder_hidden_states=ctx_a, timestep=torch.full((1, video.shape[1]), sv * 1000),
            audio_timestep=torch.full((1, audio_frames), sa * 1000), sigma=torch.tensor([sv * 1000]),
            audio_sigma=torch.tensor([sa * 1000]), encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=frames, height=height, width=width, fps=24.0, audio_num_frames=audio_frames,
            use_cross_timestep=True, return_dict=False)
    return out_v, out_a


def diffusers_batch(config, *, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                    timestep, video_coords, audio_coords, **rest):
    """diffusers' `LTX2VideoTransformer3DModel.forward` keyword arguments -> (`TokenBatch`, `ForwardOptions`), by
    diffusers' own input rules (0.42.1), for tests that compare the engine's forward with diffusers' (the engine
    itself builds its batches directly: `denoiser.LTX2Denoiser.token_batch`). Optional keywords: audio_timestep,
    sigma, audio_sigma (default: the video's), encoder_attention_mask / audio_encoder_attention_mask (2-D: the bias
    `(1 − mask)·−10000`), use_cross_timestep, video_keyframes_mask, isolate_modalities. Raises TypeError for any
    other keyword."""
    from mgpu_backend.engine.tokens import TokenBatch
    from mgpu_backend.protocol.native_forward import ForwardOptions

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
        from mgpu_backend.splits.tiled import TiledSplit

        object.__setattr__(self, "transformer", transformer)
        object.__setattr__(self, "split", TiledSplit(transformer, grid, tiling, group, world_size, rank,
                                                     normalize_positions))

    def __getattr__(self, name):
        return getattr(self.split, name)

    def __setattr__(self, name, value):
        setattr(self.split, name, value)

    def __call__(self, return_dict=False, **kwargs):
        from types import SimpleNamespace

        from mgpu_backend.engine import forward as model_forward
        from mgpu_backend.engine.semantics import REFERENCE
        from mgpu_backend.splits.apply import apply_plan

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
