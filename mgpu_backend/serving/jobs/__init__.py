"""Job kinds a worker can run. Each module registers its functions with `@register("kind")`.

A job function is `fn(state: worker.WorkerState, payload, ctx: worker.JobContext) -> result`; it runs on every rank
in lockstep and returns its typed result on rank 0 (a frozen dataclass of `protocol/job_results.py`, or the native
MODEL's replies of `protocol/native_forward.py`) and None on the other ranks (their return values are dropped).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

REGISTRY: dict[str, Callable] = {}
_MODULES = ("generate", "diagnostics", "text", "stages", "forward")


def register(kind: str):
    def wrap(fn: Callable) -> Callable:
        if kind in REGISTRY:
            raise ValueError(f"job kind {kind!r} registered twice")
        REGISTRY[kind] = fn
        return fn

    return wrap


def load_all() -> dict[str, Callable]:
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")
    return REGISTRY
