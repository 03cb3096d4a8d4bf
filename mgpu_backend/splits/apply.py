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
from dataclasses import dataclass

from ..engine.attention import ATTENTIONS, LTX2AttnProcessor, use_processor
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

_APPLIED = "_ltx2_applied_plan"  # what apply_plan installed on a transformer (`_Applied`)


@dataclass(frozen=True, eq=False)
class _Applied:
    """What `apply_plan` installed on a transformer: the plan, its exchange, and the processor objects it put on the
    first block (attention name -> processor), by which a later call sees whether they are still in place."""

    plan: ForwardPlan
    exchange: Exchange | None
    probes: tuple[tuple[str, LTX2AttnProcessor], ...]

    def in_place(self, transformer) -> bool:
        block = transformer.transformer_blocks[0]
        for name, processor in self.probes:
            installed = getattr(block, name).processor
            while hasattr(installed, "inner"):  # a per-item wrapper of a batch of guidance passes (engine/denoiser.py)
                installed = installed.inner
            if installed is not processor:
                return False
        return True


def apply_plan(transformer, plan: ForwardPlan, exchange: Exchange | None = None) -> None:
    """Install `plan`'s attention processors on every block of `transformer` (the kinds of `PROCESSORS`, made with
    `exchange`; the attentions the plan does not name get the local processor, with the direct processor call and
    the fused norms of `attention.use_processor`). Nothing is done when this plan over this exchange is applied and
    its processors are still in place (the native MODEL applies its plan on every request: a reinstall per forward
    would cost milliseconds on a 48-block model). Raises ValueError for an attention kind without a processor, a
    plan that exchanges without an `exchange`, or a degree that does not divide the heads — before anything is
    installed."""
    current = getattr(transformer, _APPLIED, None)
    if current is not None and current.plan is plan and current.exchange is exchange and current.in_place(transformer):
        return
    unknown = sorted(set(plan.attention.values()) - set(PROCESSORS))
    if unknown:
        raise ValueError(f"plan {plan.name!r}: attention kind(s) {unknown} have no processor (known: "
                         f"{', '.join(PROCESSORS)})")
    exchanging = [kind for kind in plan.attention.values() if kind != LOCAL]
    if exchanging and exchange is None:
        raise ValueError(f"plan {plan.name!r} exchanges between ranks ({', '.join(exchanging)}): it needs an exchange")
    if ULYSSES in exchanging:
        check_sp_degree(transformer.config.num_attention_heads, exchange.world_size)
    local = LTX2AttnProcessor()
    use_processor(transformer, local)
    probes = {name: local for name in ATTENTIONS}
    for name, kind in plan.attention.items():
        processor = PROCESSORS[kind](exchange)
        for block in transformer.transformer_blocks:
            getattr(block, name).set_processor(processor)
        probes[name] = processor
    object.__setattr__(transformer, _APPLIED, _Applied(plan, exchange, tuple(probes.items())))  # not a submodule


def remove_plan(transformer) -> None:
    """Make every attention of `transformer` local again (`attention.use_processor`): the attentions the applied
    plan named get the local processor back, the others keep their local one. Nothing applied: the same."""
    use_processor(transformer, LTX2AttnProcessor())
    if hasattr(transformer, _APPLIED):
        object.__delattr__(transformer, _APPLIED)


def applied_plan(transformer) -> ForwardPlan | None:
    """The plan last applied to `transformer` (None: none, or removed)."""
    applied = getattr(transformer, _APPLIED, None)
    return None if applied is None else applied.plan


__all__ = ["PROCESSORS", "apply_plan", "applied_plan", "remove_plan"]
