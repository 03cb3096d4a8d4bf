"""The LTX-2 transformer as a denoising function: text contexts, positions and guidance passes -> velocities.

`text_contexts` runs the checkpoint's text connectors on CONDITIONING embeddings (positive and negative batched
together), the way ComfyUI's `LTXAVModel.preprocess_text_embeds` and diffusers' `LTX2TextConnectors` do it.
`LTX2Denoiser` is the `model_fn` of `sampling.denoise_loop`: one transformer forward per guidance pass, with STG
implemented by swapping the self-attention processor of the chosen blocks (each modality in its own blocks, as the
reference's perturbations do) and modality guidance by `isolate_modalities`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor

from . import cuda_graphs
from .attention import LTX2AttnProcessor, use_processor
from .sampling import TIMESTEP_SCALE, GuidancePass, ModelInputs

# connectors replace padding with 128 learnable registers; the reference pads prompts to 1024 tokens
MIN_CONTEXT_TOKENS = 1024


@dataclass
class TextContext:
    """Transformer context for one or more prompts.

    video: `[B, L, Dv]`, audio: `[B, L, Da]`, mask: `[B, L]` (1 = attend) in the compute dtype; L is a multiple of
    the connector's register count, at least `MIN_CONTEXT_TOKENS`.
    """

    video: torch.Tensor
    audio: torch.Tensor
    mask: torch.Tensor

    def select(self, index: int) -> "TextContext":
        return TextContext(self.video[index:index + 1], self.audio[index:index + 1], self.mask[index:index + 1])


def split_embeds(embeds: torch.Tensor, variant: str, video_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CONDITIONING embeddings -> (video input, audio input) of the connectors.

    LTX-2.0: one `[B, T, 3840]` tensor feeds both connectors; LTX-2.3: `[B, T, 4096 + 2048]` is split.
    """
    if variant == "2.3":
        return embeds[..., :video_dim], embeds[..., video_dim:]
    return embeds, embeds


def text_contexts(components, embeds: list[torch.Tensor], dtype: torch.dtype | None = None) -> TextContext:
    """Run the text connectors on a list of CONDITIONING embeddings (each `[1, T_i, C]`, valid tokens only).

    The prompts are left-padded to a common length L = max(1024, ceil(max T_i / R)·R) (R = register count) and
    run as one batch; the connectors replace the padding by their learnable registers.

    Returns a `TextContext` with batch `len(embeds)`, in the order given.
    Raises ValueError when an embedding's width does not match the checkpoint's connectors.
    """
    video_connector, audio_connector = components.video_connector, components.audio_connector
    param = next(video_connector.parameters())
    dtype = dtype or param.dtype
    device = param.device
    width = video_connector.inner_dim + (audio_connector.inner_dim if components.variant == "2.3" else 0)
    for e in embeds:
        if e.ndim != 3 or e.shape[0] != 1 or e.shape[-1] != width:
            raise ValueError(f"conditioning embeddings of shape {tuple(e.shape)} do not fit this checkpoint's text "
                             f"connectors (expected [1, T, {width}] for LTX-{components.variant})")
    registers = video_connector.num_learnable_registers or 1
    longest = max(e.shape[1] for e in embeds)
    length = max(MIN_CONTEXT_TOKENS, math.ceil(longest / registers) * registers)
    batch = torch.zeros(len(embeds), length, width, dtype=dtype, device=device)
    mask = torch.zeros(len(embeds), length, dtype=torch.long, device=device)
    for i, e in enumerate(embeds):
        t = e.shape[1]
        batch[i, length - t:] = e[0].to(device=device, dtype=dtype)
        mask[i, length - t:] = 1
    video_in, audio_in = split_embeds(batch, components.variant, video_connector.inner_dim)
    additive = ((mask - 1).to(dtype) * torch.finfo(dtype).max).view(len(embeds), 1, 1, length)
    with torch.no_grad():
        video, video_mask = video_connector(video_in, additive)
        keep = (video_mask.reshape(len(embeds), -1) >= -9000.0).to(dtype)  # registers make every slot valid
        video = video * keep.unsqueeze(-1)
        audio, _ = audio_connector(audio_in, additive)
    return TextContext(video, audio, keep)


class _SkipSelfAttention:
    """STG perturbation: the attention output is replaced by its value projection (diffusers'
    `LTX2PerturbedAttnProcessor` with every item perturbed; reference: ltx-core `SkipSelfAttention` perturbation)."""

    def __init__(self):
        self._inner = LTX2PerturbedAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, **_):
        return self._inner(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                           key_rotary_emb, perturbation_mask=None, all_perturbed=True)


@contextlib.contextmanager
def skip_self_attention(transformer, video_blocks: tuple[int, ...], audio_blocks: tuple[int, ...]):
    """Within the block, video self-attention of `video_blocks` and audio self-attention of `audio_blocks` are
    replaced by their value projections. Raises ValueError for a block index the model does not have."""
    blocks = transformer.transformer_blocks
    for b in (*video_blocks, *audio_blocks):
        if not 0 <= b < len(blocks):
            raise ValueError(f"STG block {b} does not exist: this transformer has blocks 0..{len(blocks) - 1}")
    swapped = [(blocks[b].attn1, blocks[b].attn1.processor) for b in video_blocks]
    swapped += [(blocks[b].audio_attn1, blocks[b].audio_attn1.processor) for b in audio_blocks]
    try:
        for attn, _ in swapped:
            attn.processor = _SkipSelfAttention()
        yield
    finally:
        for attn, processor in swapped:
            attn.processor = processor


class LTX2Denoiser:
    """`model_fn` for `sampling.denoise_loop`: one transformer forward per guidance pass.

    Args:
        transformer: `LTX2VideoTransformer3DModel` (diffusers).
        positive / negative: `TextContext` of batch 1 each (negative may be None when no pass needs it).
        video_coords: `[1, 3, Tv, 2]`, audio_coords: `[1, 1, Ta, 2]` (see `latents.video_coords/audio_coords`).
        dtype: compute dtype of the forward.
        forward: what runs the forward (default the transformer itself; a `SequenceParallelTransformer` for SP).
    Returns velocities in float32 (diffusers convention: v = noise - x0).
    """

    def __init__(self, transformer, positive: TextContext, negative: TextContext | None,
                 video_coords: torch.Tensor, audio_coords: torch.Tensor, dtype: torch.dtype, forward=None):
        self.transformer = transformer
        self.forward = forward or transformer  # e.g. a SequenceParallelTransformer around `transformer`
        # the resident transformer is shared by every stage: install this stage's attention processors
        if hasattr(self.forward, "activate"):
            self.forward.activate()
        else:
            use_processor(transformer, LTX2AttnProcessor())
        self.positive, self.negative = positive, negative
        self.video_coords, self.audio_coords = video_coords, audio_coords
        self.dtype = dtype
        self.forwards = 0

    def run_forward(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of `self.forward` (keyword arguments of the diffusers transformer, without `return_dict`):
        replayed from CUDA graphs when the forward allows it (`cuda_graphs.call`: the plain transformer and the
        sequence-parallel wrapper; a tiled wrapper synchronises with the host and stays eager), else eager."""
        forward = self.forward
        if forward is self.transformer:
            return cuda_graphs.call(self.transformer, lambda **kw: forward(return_dict=False, **kw), kwargs,
                                    extra="transformer")
        if getattr(forward, "cuda_graph_safe", False):
            forward.ensure_active()
            return cuda_graphs.call(self.transformer, forward, kwargs, extra=type(forward).__name__)
        if cuda_graphs.eligible(kwargs) is None:
            cuda_graphs.graphs_of(self.transformer).note_eager(
                f"{type(forward).__name__} forwards eager (the wrapper synchronises with the host)")
        return forward(return_dict=False, **kwargs)

    def __call__(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        p: GuidancePass = inputs.guidance
        if p.kind == "uncond":
            if self.negative is None:
                raise ValueError("CFG needs a negative prompt context")
            context = self.negative
        else:
            context = self.positive
        perturb = skip_self_attention(self.transformer, p.video_stg_blocks, p.audio_stg_blocks) \
            if p.kind == "perturbed" else contextlib.nullcontext()
        # the sampling state stays where the loop keeps it (small); each forward runs on the model's device
        device = self.video_coords.device
        with perturb, torch.no_grad():
            video, audio = self.run_forward(
                hidden_states=inputs.video.to(device, self.dtype),
                audio_hidden_states=inputs.audio.to(device, self.dtype),
                encoder_hidden_states=context.video,
                audio_encoder_hidden_states=context.audio,
                timestep=inputs.video_timesteps.to(device) * TIMESTEP_SCALE,
                audio_timestep=inputs.audio_timesteps.to(device) * TIMESTEP_SCALE,
                sigma=inputs.video_sigma.to(device) * TIMESTEP_SCALE,
                audio_sigma=inputs.audio_sigma.to(device) * TIMESTEP_SCALE,
                encoder_attention_mask=context.mask,
                audio_encoder_attention_mask=context.mask,
                video_coords=self.video_coords,
                audio_coords=self.audio_coords,
                isolate_modalities=p.kind == "isolated",
                use_cross_timestep=True,
            )
        self.forwards += 1
        return video.float().to(inputs.video.device), audio.float().to(inputs.audio.device)
