"""Execute a `ForwardPlan` on the resident transformer, in the style of diffusers' `apply_context_parallel` /
`remove_context_parallel`: `apply_plan` installs exactly the attention processors the plan's `attention` entries
name (every other attention gets the local `LTX2AttnProcessor`), `remove_plan` puts the local processors back.

The transformer is resident and shared by every stage and native request of a fleet, so whoever runs forwards under
a split applies its plan first: the reference denoiser and the ComfyUI denoiser when a stage starts
(`engine/denoiser.py`, `stages/comfy_stage.py`), the native engine per request (`stages/native.py`). The forward
itself (`engine.forward.run`) installs nothing and reads no wrapper state: the split passes its per-forward values
(key mask, guide kernel) down the blocks (`engine.attention.VideoKeys`).
"""
from __future__ import annotations

from collections.abc import Callable

from ..engine.attention import LTX2AttnProcessor, use_processor
from ..protocol.fleet_rules import check_sp_degree
from .exchange import Exchange
from .forward_plan import GATHERED_KEYS, LOCAL, ULYSSES, ForwardPlan
from .sequence import GatheredKeysCrossAttention, UlyssesSelfAttention

PROCESSORS: dict[str, Callable[[Exchange | None], LTX2AttnProcessor]] = {
    LOCAL: lambda exchange: LTX2AttnProcessor(),
    ULYSSES: UlyssesSelfAttention,
    GATHERED_KEYS: GatheredKeysCrossAttention,
}
"""A plan's attention kind -> the processor that implements it, made with the split's exchange."""

_APPLIED = "_ltx2_applied_plan"  # the plan applied to a transformer (read by `applied_plan`, `remove_plan`)


def apply_plan(transformer, plan: ForwardPlan, exchange: Exchange | None = None) -> None:
    """Install `plan`'s attention processors on every block of `transformer` (the kinds of `PROCESSORS`, made with
    `exchange`; the attentions the plan does not name get the local processor, with the direct processor call and
    the fused norms of `attention.use_processor`). Raises ValueError for an attention kind without a processor, a
    plan that exchanges without an `exchange`, or a degree that does not divide the heads — before anything is
    installed."""
    unknown = sorted(set(plan.attention.values()) - set(PROCESSORS))
    if unknown:
        raise ValueError(f"plan {plan.name!r}: attention kind(s) {unknown} have no processor (known: "
                         f"{', '.join(PROCESSORS)})")
    exchanging = [kind for kind in plan.attention.values() if kind != LOCAL]
    if exchanging and exchange is None:
        raise ValueError(f"plan {plan.name!r} exchanges between ranks ({', '.join(exchanging)}): it needs an exchange")
    if ULYSSES in exchanging:
        check_sp_degree(transformer.config.num_attention_heads, exchange.world_size)
    use_processor(transformer, LTX2AttnProcessor())
    for name, kind in plan.attention.items():
        processor = PROCESSORS[kind](exchange)
        for block in transformer.transformer_blocks:
            getattr(block, name).set_processor(processor)
    object.__setattr__(transformer, _APPLIED, plan)  # not a submodule


def remove_plan(transformer) -> None:
    """Make every attention of `transformer` local again (`attention.use_processor`): the attentions the applied
    plan named get the local processor back, the others keep their local one. Nothing applied: the same."""
    use_processor(transformer, LTX2AttnProcessor())
    if hasattr(transformer, _APPLIED):
        object.__delattr__(transformer, _APPLIED)


def applied_plan(transformer) -> ForwardPlan | None:
    """The plan last applied to `transformer` (None: none, or removed)."""
    return getattr(transformer, _APPLIED, None)


__all__ = ["PROCESSORS", "apply_plan", "applied_plan", "remove_plan"]
