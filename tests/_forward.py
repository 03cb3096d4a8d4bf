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



# the diffusers-keyword drivers live with the other test-only code of the package (bench/ uses them too)
from mgpu_backend.testing.diffusers_inputs import SequenceDriver, TiledDriver, diffusers_batch  # noqa: E402,F401
