"""`TokenBatch`: everything one transformer forward reads, per token and per row, in one frozen object (issue 25).

Every forward of the engine takes one (`engine.forward.run`): the native MODEL builds it from a ComfyUI
`ForwardRequest` (`native.NativeEngine.prepare`), the reference stages from their sampling state by the diffusers
transformer's input rules (`denoiser.LTX2Denoiser.token_batch`). The parallel plan
(`splits/forward_plan.py`) says which of its fields carry the video token axis, so a split (sequence parallel,
tiles) slices them all by name; a new per-token field is one line here and one entry in the plan.

Shapes (B rows, N video tokens, Ta audio tokens, L text tokens; Cv / Ca the latent widths, Dv / Da the context
widths); every tensor on the compute device, contiguous (a CUDA graph's static copy has the same layout):
- video `[B, N, Cv]`, audio `[B, Ta, Ca]`: packed latents (plus appended guide / reference-audio tokens) in the
  compute dtype.
- video_timestep `[B, N]` (per token) or `[B, 1]` (per row), audio_timestep `[B, Ta]` or `[B, 1]`: the AdaLN
  timesteps, float32, already × `timestep_scale_multiplier` (sigma × 1000).
- video_prompt_timestep / audio_prompt_timestep `[B]` float32 scaled: the prompt AdaLN's (LTX-2.3 / 2.5); None when
  the model has none.
- video_cross_timestep `[B, N]` | `[B, 1]` | `[B]`, audio_cross_timestep `[B, Ta]` | `[B, 1]` | `[B]`: the inputs
  of each stream's audio↔video cross-attention scale / shift AdaLN, float32 scaled.
- a2v_gate_timestep `[B]` (or `[B, N]`), v2a_gate_timestep `[B]` (or `[B, Ta]`): the inputs of the a2v / v2a gate
  AdaLN, float32, already × the cross-attention gate factor.
- video_coords `[B, 3, N, 2]`, audio_coords `[B, 1, Ta, 2]`: RoPE positions, [start, end) per token (seconds on the
  time axis, pixels on height and width), float32.
- video_context `[B, L, Dv]`, audio_context `[B, L, Da]`: the text contexts (before the LTX-2.0 caption projection).
- video_text_bias / audio_text_bias: additive `[B, 1, 1, L]` text-attention biases (0 = attend), compute dtype, or
  None.
- keyframe_marker `[B, N]` bool: the tokens LTX-2.5's `keyframes_abs_pos_embedding` is added to; None otherwise.
- guide_log_w `[G]` compute dtype and guide_start (int): ComfyUI's guide-attention bias (queries before guide_start
  add log w on the G tracked guide keys from guide_start on, and the reverse); None / None without one.
- audio_prefix (int): leading audio tokens (reference audio) cut from the audio output.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

TOKEN_FIELDS = ("video", "video_timestep", "video_cross_timestep", "a2v_gate_timestep", "video_coords",
                "keyframe_marker")
"""The fields that carry the video token axis (dim 1; `video_coords` dim 2) when they are per token."""
STATIC_FIELDS = ("guide_start", "audio_prefix")


@dataclass(frozen=True, eq=False)
class TokenBatch:
    """One forward's inputs (see the module docstring for every field's shape, dtype and unit)."""

    video: torch.Tensor
    audio: torch.Tensor
    video_timestep: torch.Tensor
    audio_timestep: torch.Tensor
    video_cross_timestep: torch.Tensor
    audio_cross_timestep: torch.Tensor
    a2v_gate_timestep: torch.Tensor
    v2a_gate_timestep: torch.Tensor
    video_coords: torch.Tensor
    audio_coords: torch.Tensor
    video_context: torch.Tensor
    audio_context: torch.Tensor
    video_prompt_timestep: torch.Tensor | None = None
    audio_prompt_timestep: torch.Tensor | None = None
    video_text_bias: torch.Tensor | None = None
    audio_text_bias: torch.Tensor | None = None
    keyframe_marker: torch.Tensor | None = None
    guide_log_w: torch.Tensor | None = None
    guide_start: int | None = None
    audio_prefix: int = 0

    def __post_init__(self):
        b, n = self.video.shape[:2]
        if self.video.ndim != 3 or self.audio.ndim != 3 or self.audio.shape[0] != b:
            raise ValueError(f"TokenBatch: video {tuple(self.video.shape)} and audio {tuple(self.audio.shape)} must be "
                             f"[B, T, C] with one B")
        if self.video_coords.shape[0] != b or self.video_coords.shape[2] != n:
            raise ValueError(f"TokenBatch: video_coords {tuple(self.video_coords.shape)} do not match {n} tokens")
        if (self.guide_log_w is None) != (self.guide_start is None):
            raise ValueError("TokenBatch: guide_log_w and guide_start come together")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and not value.is_contiguous():
                object.__setattr__(self, f.name, value.contiguous())

    @property
    def rows(self) -> int:
        return self.video.shape[0]

    @property
    def video_tokens(self) -> int:
        return self.video.shape[1]

    def per_token(self, name: str) -> bool:
        """Whether field `name` carries the video token axis in this batch (a per-row timestep does not)."""
        value = getattr(self, name)
        if value is None or name not in TOKEN_FIELDS:
            return False
        dim = 2 if name == "video_coords" else 1
        return value.ndim > dim and value.shape[dim] == self.video_tokens

    def select_rows(self, rows: list[int]) -> "TokenBatch":
        """The batch of `rows` (every per-row field indexed; the guide bias and statics are shared)."""
        if rows == list(range(self.rows)):
            return self
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name != "guide_log_w":
                changes[f.name] = value[rows]
        return dataclasses.replace(self, **changes)

    def graph_inputs(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensor fields, the other fields): what `cuda_graphs.call` copies into a capture, and what keys it."""
        tensors, static = {}, {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            (tensors if isinstance(value, torch.Tensor) else static)[f.name] = value
        return tensors, static


__all__ = ["STATIC_FIELDS", "TOKEN_FIELDS", "TokenBatch"]
