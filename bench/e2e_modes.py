"""The speed modes of `bench_e2e.py` (issue 27): what each mode switches on, the FLOP tally of the forwards a run
makes, the weight conversions, and the per-stage achieved FLOP/s against the GPU's dense peak.

Modes (`MODES`, in this order; `bench_e2e.py` runs each in a process of its own, or all in one with `--in-process`,
where the quantized ones come last because their weights are converted from the bf16 ones in place):
- eager: the bench's former behaviour — every forward through a timing wrapper (CUDA-synchronized per forward),
  so the guidance passes run one at a time and nothing is replayed from CUDA graphs (`cuda_graphs.set_mode("off")`).
- default: what the fleet runs — the denoiser's own forward (`model_forward.run`): guidance passes batched into one
  forward where `LTX2Denoiser.batch_choice` allows, forwards replayed from CUDA graphs (`cuda_graphs` "auto").
  Stages are timed whole (synchronize before and after the stage), forwards counted, not timed one by one.
- compiled: default + the blocks compiled (`mgpu_backend.engine.compile.compile_blocks`, as `--compile` does).
- fp8: default with every transformer-block Linear an `FP8Linear` (per-tensor e4m3 weights quantized from the
  bf16 ones) and fp8 compute forced on (`fp8.set_compute("on")` + `check_compute`: a layer that cannot run the
  fp8 matmul raises instead of dequantizing).
- int8: default with every block Linear an `Int8Linear` (ComfyUI's int8_tensorwise + ConvRot, per-row scales,
  quantized from the current weights; the FeedForward GELU folded in as ComfyUI does), computed W8A8 (`models.quant`).

FLOPs (`FlopTally`): each forward's model FLOPs from the shapes (`mgpu_backend.engine.flops.forward_flops`), per
batch row, with the row's own variant — the STG row without its blocks' self-attention, the isolated row without the
cross-modal attention — read from the attention processors installed at the call (`denoiser._SkipSelfAttention`,
`_PerItemSkip`, `_PerItemIsolation`). A batched forward executes a little more than that (each item's full
attention, the STG value path, the isolated item's cross-modal attention × 0: `tests/test_flops.py`); the tally
counts what the recipe needs, the same figure in every mode.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict

import torch
from torch import nn

from mgpu_backend.engine import compile as C
from mgpu_backend.engine import cuda_graphs as G
from mgpu_backend.engine import forward as model_forward
from mgpu_backend.engine.denoiser import _PerItemIsolation, _PerItemSkip, _SkipSelfAttention
from mgpu_backend.protocol.native_forward import ForwardOptions
from mgpu_backend.models import fp8 as F8
from mgpu_backend.models import quant as Q
from mgpu_backend.engine import flops as FL
from mgpu_backend.engine.tokens import TokenBatch

MODES = ("eager", "default", "compiled", "fp8", "int8")
MATMUL_DTYPE = {"fp8": "fp8", "int8": "int8"}  # the other modes: the compute dtype


class ModeRefused(Exception):
    """A mode that cannot run here, with the reason (printed by name; never replaced by another mode)."""


def parse_modes(text: str) -> list[str]:
    """"default,fp8" -> ["default", "fp8"] in `MODES` order. Raises ValueError naming an unknown mode."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise ValueError(f"--modes {text!r}: {', '.join(bad) or 'empty'}; choose from {', '.join(MODES)}")
    return [m for m in MODES if m in names]


def matmul_dtype(mode: str, dtype: torch.dtype) -> str:
    """The dtype of the block matmuls in `mode` ("bf16", "fp8", "int8", "fp32"): the peak the fraction is of."""
    return MATMUL_DTYPE.get(mode) or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


# ---- the FLOP tally ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StageShape:
    """The token counts of a stage's forwards (for the reference forward at the same shape) and one row's inputs."""

    video_tokens: int
    audio_tokens: int
    text_tokens: int
    row: dict


class FlopTally:
    """Model FLOPs of the forwards, per stage (see the module docstring). `stage` names where calls go."""

    def __init__(self, shape: FL.TransformerShape):
        self.shape = shape
        self.stage: str | None = None
        self.flops: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)  # forwards (a batched forward is one)
        self.items: dict[str, int] = defaultdict(int)  # batch rows = unbatched forwards the recipe needs
        self.shapes: dict[str, StageShape] = {}

    def reset(self) -> None:
        self.flops.clear()
        self.calls.clear()
        self.items.clear()

    def count(self, transformer, batch: TokenBatch, options: ForwardOptions) -> int:
        rows, n, ta = batch.rows, batch.video_tokens, batch.audio.shape[1]
        vskip, askip = [0] * rows, [0] * rows
        isolated = [not (options.a2v_cross_attn or options.v2a_cross_attn)] * rows
        for blk in transformer.transformer_blocks:
            for name, acc in (("attn1", vskip), ("audio_attn1", askip)):
                p = getattr(blk, name).processor
                if isinstance(p, _SkipSelfAttention):
                    for i in range(rows):
                        acc[i] += 1
                elif isinstance(p, _PerItemSkip):
                    for i, on in enumerate(p.pattern):
                        acc[i] += bool(on)
            p = blk.audio_to_video_attn.processor
            if isinstance(p, _PerItemIsolation):
                isolated = [a or bool(b) for a, b in zip(isolated, p.pattern)]
        total = 0
        for i in range(rows):
            total += FL.forward_flops(
                self.shape, n, ta, batch.video_context.shape[1], audio_text_tokens=batch.audio_context.shape[1],
                variant=FL.ForwardVariant(timestep_per_token=batch.per_token("video_timestep"),
                                          cross_timestep_per_token=batch.per_token("video_cross_timestep"),
                                          cross_modal=not isolated[i], video_skip_blocks=vskip[i],
                                          audio_skip_blocks=askip[i])).total
        stage = self.stage or "?"
        self.flops[stage] += total
        self.calls[stage] += 1
        self.items[stage] += rows
        if stage not in self.shapes:
            row = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
            row = {k: (v[:1].clone() if isinstance(v, torch.Tensor) and k not in ("guide_log_w",) else v)
                   for k, v in row.items()}
            self.shapes[stage] = StageShape(n, ta, batch.video_context.shape[1], row)
        return total


@contextlib.contextmanager
def counting_run(tally: FlopTally):
    """Within the block, every `model_forward.run` (the denoiser's forward: graphs, batches) is counted first."""
    original = model_forward.run

    def run(transformer, batch, semantics=model_forward.REFERENCE, split=None, options=model_forward.PLAIN,
            what="forward"):
        tally.count(transformer, batch, options)
        return original(transformer, batch, semantics, split, options, what)

    model_forward.run = run
    try:
        yield
    finally:
        model_forward.run = original


# ---- weights -------------------------------------------------------------------------------------------------------

def _float_weight(m: nn.Module) -> torch.Tensor:
    if isinstance(m, Q.Int8Linear):
        return m.dequantized_weight().float()
    if isinstance(m, F8.FP8Linear):
        return m.weight.float() * m.weight_scale
    return m.weight.float()


def convert_blocks(transformer, kind: str, dtype: torch.dtype) -> int:
    """Every Linear of the transformer blocks converted in place, one layer at a time: "fp8" (`FP8Linear`, per-tensor
    e4m3) or "int8" (`Int8Linear`, ConvRot group 256 — or 16 when a width is not a multiple of 256, the tiny model —
    per-row scales; then `fold_gelu`). Returns the number of layers converted. Raises ValueError for another kind or
    a block with int8 layers already (the GELU fold is one-way: int8 is the last mode)."""
    if kind not in ("fp8", "int8"):
        raise ValueError(f"convert_blocks: kind {kind!r} is not 'fp8' or 'int8'")
    blocks = transformer.transformer_blocks
    found = [(name, m) for name, m in blocks.named_modules() if isinstance(m, (nn.Linear, F8.FP8Linear))]
    if any(isinstance(m, Q.Int8Linear) for _, m in found):
        raise ValueError("convert_blocks: the blocks already hold int8 layers (int8 runs last)")
    group = Q.DEFAULT_CONVROT_GROUP
    if any(m.in_features % group for _, m in found):
        from mgpu_backend.testing.tiny import TINY_CONVROT_GROUP

        group = TINY_CONVROT_GROUP
    names = [name for name, _ in found]
    del found  # no reference to the old layers outlives their replacement: one layer's two copies at a time
    device = next(transformer.parameters()).device
    for name in names:
        parent_path, _, child = name.rpartition(".")
        parent = blocks.get_submodule(parent_path)
        old = getattr(parent, child)
        w = _float_weight(old)
        bias = None if old.bias is None else old.bias.detach().to(dtype)
        with torch.device(device):
            if kind == "fp8":
                new = F8.FP8Linear(old.in_features, old.out_features, bias is not None, dtype)
                q, s = F8.quantize_fp8(w)
                new.weight.data = q
                new.weight_scale.copy_(s)
            else:
                new = Q.Int8Linear(old.in_features, old.out_features, bias is not None, dtype, convrot_group=group,
                                   per_row_scale=True)
                q, s = Q.quantize_int8(w, group)
                new.weight.data = q
                new.weight_scale.copy_(s)
        if bias is not None:
            new.bias.data = bias
        setattr(parent, child, new.requires_grad_(False))
        del old, w
    if kind == "int8":
        Q.fold_gelu(transformer.transformer_blocks)
    G.graphs_of(transformer).clear()
    return len(names)


# ---- entering / leaving a mode -------------------------------------------------------------------------------------

def enter_mode(mode: str, transformer, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Switch the process and `transformer` to `mode`; returns notes for the output. Raises `ModeRefused` (before
    changing anything) where the mode cannot run on `device`."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    notes: list[str] = []
    cpu = device.type != "cuda"
    if mode == "compiled" and cpu:
        raise ModeRefused("compiled: refused on CPU — the mode is torch.compile + CUDA graphs, a CUDA speed mode "
                          "(CUDA graphs do not exist on CPU); run it on a GPU")
    if mode == "fp8" and not F8.scaled_mm_capable(device):
        raise ModeRefused(f"fp8: refused on {device.type} — fp8 compute needs a CUDA GPU of compute capability ≥ 8.9 "
                          "(torch._scaled_mm); here FP8Linear would dequantize to the compute dtype, which is not "
                          "the fp8 compute this mode measures")
    G.graphs_of(transformer).clear()
    if mode == "eager":
        G.set_mode("off")
        notes.append("eager: every forward run eagerly and timed alone (synchronized before and after): guidance "
                     "passes one at a time, no CUDA graphs — the bench's former measurement, not what users run")
        return notes
    G.set_mode("auto")
    if cpu:
        notes.append(f"{mode} on CPU: the fleet's own forward path ran; on CPU it has no CUDA graphs and runs one "
                     "forward per guidance pass (`LTX2Denoiser.batch_choice` batches on CUDA only)")
    if mode == "compiled":
        n = C.compile_blocks(transformer)
        notes.append(f"compiled: {n} blocks compiled (torch.compile, static shapes) + CUDA graphs; the warm-up "
                     "generation pays the compile")
    elif mode == "fp8":
        n = convert_blocks(transformer, "fp8", dtype)
        F8.set_compute("on")
        try:
            F8.check_compute(transformer, device, dtype)
        except ValueError as exc:
            F8.set_compute("auto")
            raise ModeRefused(f"fp8: refused — {exc}") from None
        notes.append(f"fp8: {n} block Linears quantized to per-tensor e4m3 from the current weights; fp8 compute "
                     "forced on (torch._scaled_mm, dynamic per-row activation scales); attention stays "
                     f"{str(dtype)[6:]}")
    elif mode == "int8":
        n = convert_blocks(transformer, "int8", dtype)
        path = "comfy-kitchen int8_linear" if Q.kitchen_op() is not None else \
            "the torch copy of comfy-kitchen's int8_linear (comfy-kitchen not installed)"
        notes.append(f"int8: {n} block Linears as int8_tensorwise + ConvRot (W8A8 through {path}); attention stays "
                     f"{str(dtype)[6:]}")
    return notes


def leave_mode(mode: str, transformer) -> None:
    """Undo the process-wide switches of `mode` (the converted weights stay: later modes convert again)."""
    if mode == "compiled":
        C.uncompile_blocks(transformer)
    if mode == "fp8":
        F8.set_compute("auto")
    G.graphs_of(transformer).clear()
    G.set_mode("auto")


# ---- report --------------------------------------------------------------------------------------------------------

def rate_cells(flops: int, seconds: float, peak: FL.Peak) -> tuple[str, str]:
    """("123", "45.6 %" | "unknown"): TFLOP/s (3 significant digits) of `flops` done in `seconds`, and the fraction
    of `peak`."""
    if not seconds or not flops:
        return "", ""
    rate = flops / seconds
    frac = peak.fraction(rate)
    return f"{rate / 1e12:.3g}", ("unknown" if frac is None else f"{100 * frac:.1f} %")


__all__ = ["MODES", "FlopTally", "ModeRefused", "convert_blocks", "counting_run", "enter_mode", "leave_mode",
           "matmul_dtype", "parse_modes", "rate_cells"]
