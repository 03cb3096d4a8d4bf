"""Regional `torch.compile` of the LTX-2 transformer: each transformer block is compiled, the rest stays eager.

Why per block: the 48 blocks share one structure, so with `inline_inbuilt_nn_modules` (PyTorch ≥ 2.5 default) their
parameters are graph inputs and one compiled graph serves every block — the compile cost is that of one block, paid
once per input shape and attention configuration by the persistent fleet (the first job at a size pays it; later
jobs reuse it). The embeddings, RoPE tables and output layers are cheap and stay eager (diffusers-style regional
compilation, https://huggingface.co/docs/diffusers/optimization/fp16#regional-compilation).

What recompiles (each once): a new token count (stage 1, stage-2 tile, a new size), a different attention processor
set (local, sequence parallel, tiled, the STG pass's skipped self-attention), a different dtype. The sequence
parallel exchanges are custom ops (`splits/exchange.py`), so they stay inside the block's graph.
"""
from __future__ import annotations

import torch

# recompiles per block code object: sizes × processor sets × guidance passes of a long-lived fleet
RECOMPILE_LIMIT = 64


def compile_blocks(transformer, mode: str | None = None) -> int:
    """Compile every transformer block of `transformer` in place (`nn.Module.compile`, static shapes).

    Returns the number of blocks compiled; a no-op (0) when the blocks are already compiled. The first forward at a
    new shape is slow (it compiles); `graph_breaks()` tells whether a block split.
    """
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT)
    compiled = 0
    for block in transformer.transformer_blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(dynamic=False, mode=mode)
            compiled += 1
    return compiled


def graph_breaks() -> int:
    """Graph breaks dynamo has recorded in this process (0 = every compiled block is one graph)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def uncompile_blocks(transformer) -> None:
    """Back to eager blocks (the compiled code stays cached by dynamo for a later `compile_blocks`)."""
    for block in transformer.transformer_blocks:
        block._compiled_call_impl = None
