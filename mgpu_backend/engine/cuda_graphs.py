"""The transformer forward replayed from CUDA graphs: a forward without host overhead (issue 16).

Why: a small forward is bound by the host, not the GPU. Eager, one 48-block LTX-2 forward launches thousands of
kernels from Python, which sets a floor under a rank's forward however few tokens it holds
(docs/design/baselines.md#what-the-pack-had-to-close; the figures: bench/results/docstring_figures.md,
bench/results/native_graphs_h200.txt). Captured once into CUDA graphs and replayed, the launches cost microseconds.

How (`call`): the first forward at a key runs eagerly (warm-up: compilation, autotuning, cuBLAS handles, Triton
kernels); the second captures it and replays the capture; later ones only copy their tensor arguments into the
captured ("static") inputs and replay. The key is everything the captured kernels depend on: the tensors' shapes,
dtypes and devices, the other arguments' values, the attention processors installed in every block (so the STG
pass's skipped self-attention, sequence-parallel processors or a tiled stage each get their own graphs), whether the
blocks are compiled, the fp8 weight generation (a LoRA fused into an fp8 layer is a new tensor) and compute mode,
and grad mode. The
cache lives on the transformer module, so the resident fleet keeps its graphs from job to job; all graphs of one
transformer share one memory pool (each replay is atomic and its outputs are copied out before the next, so a
later capture reusing an earlier one's intermediate memory is safe), and the least recently used graph is dropped
beyond `CAPACITY`.

Collectives (sequence parallel): the exchanges (`splits/exchange.py`) call `collective` — during a capture it
ends the current graph segment, runs the collective eagerly between segments (its input and output buffers are
recorded, stable addresses) and starts the next segment; a replay then is segment, collective, segment, … (the
piecewise scheme of serving engines). Every rank captures and replays the same sequence, so the collectives stay
matched. NCCL collectives captured inside one graph would remove the remaining launches (not done).

Falls back to eager, with the reason kept for the job report (`report`), wherever a capture fails (a host
synchronisation or a CPU tensor inside the forward, an unsupported kernel); CPU forwards never touch this module's
machinery. `set_mode("off")` (or LTX2_MGPU_CUDA_GRAPHS=off) disables it.
"""
from __future__ import annotations

import gc
import logging
import os
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..weights.sharding import is_sharded

log = logging.getLogger("ltx2_mgpu.cuda_graphs")

MODES = ("auto", "off")
CAPACITY = 16  # graphs kept per transformer (sizes × pass sets × stages of a long-lived fleet)
MAX_HELD_FRACTION = 0.25  # a graph whose capture reserves more than this share of the GPU's memory is dropped
_MODE = os.environ.get("LTX2_MGPU_CUDA_GRAPHS", "auto")
ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


def set_mode(mode: str) -> None:
    """"auto": CUDA forwards replayed from graphs wherever capture works; "off": always eager.
    Raises ValueError for another mode."""
    global _MODE
    if mode not in MODES:
        raise ValueError(f"CUDA graphs mode {mode!r}: choose one of {', '.join(MODES)}")
    _MODE = mode


def mode() -> str:
    return _MODE


# ---- segments and collectives --------------------------------------------------------------------------------------

class _Borrow:
    """CUDA array interface of a tensor's memory, for a view that does not own it."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


def _borrow(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory that does not keep it allocated. The collectives' buffers are allocated inside the
    segment captures, in the graphs' private pool, whose memory stays reserved for the graphs while they live; holding
    only borrowed views lets the capture reuse a buffer once the forward has released it (as the eager forward
    would), so the graphs hold about one forward's activations, not one buffer pair per collective."""
    if t.numel() == 0:
        return t
    return torch.as_tensor(_Borrow(t), device=t.device).view(t.dtype).view(t.shape)


class _Capture:
    """One forward's capture: graph segments separated by eagerly run collectives."""

    def __init__(self, pool):
        self.pool = pool
        self.steps: list[tuple] = []  # ("graph", CUDAGraph) | ("call", fn, inp, out)
        self.current: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        graph, self.current = self.current, None
        graph.capture_end()
        self.steps.append(("graph", graph))

    def abort(self) -> None:
        """End a capture left open by an exception (its graph is discarded)."""
        if self.current is not None:
            graph, self.current = self.current, None
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 — an invalidated capture raises here; it is dropped either way
                pass

    def boundary(self, fn: Callable[[torch.Tensor, torch.Tensor], Any], inp: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        self.end()
        fn(out, inp)
        self.steps.append(("call", fn, _borrow(inp), _borrow(out)))
        self.begin()
        return out

    @property
    def segments(self) -> int:
        return sum(step[0] == "graph" for step in self.steps)

    def replay(self) -> None:
        for step in self.steps:
            if step[0] == "graph":
                step[1].replay()
            else:
                step[1](step[3], step[2])


_ACTIVE: list[_Capture] = []  # the capture in progress (at most one)


def capturing() -> bool:
    """True while a forward is being captured (the exchanges then call `collective`)."""
    return bool(_ACTIVE)


@torch.compiler.disable
def collective(fn: Callable[[torch.Tensor, torch.Tensor], Any], inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Run `fn(out, inp)` (a collective writing `out` from `inp`) and return `out`. During a capture it is a segment
    boundary: the graph so far is closed, `fn` runs eagerly now and at every replay between the segments, on the
    same buffers. `inp` and `out` must be contiguous and allocated inside the closing segment (the exchanges' custom
    ops do both). Never traced by the compiler (it would guard on whether a capture is under way)."""
    if _ACTIVE:
        return _ACTIVE[-1].boundary(fn, inp, out)
    fn(out, inp)
    return out


# ---- the cache -----------------------------------------------------------------------------------------------------

@dataclass
class _Entry:
    capture: _Capture
    static: dict[str, torch.Tensor]
    outputs: Any
    bytes: int
    what: str
    replays: int = 0


@dataclass
class ForwardGraphs:
    """The graphs of one transformer (attribute `_ltx2_forward_graphs` of the module), with what happened to them."""

    entries: "OrderedDict[tuple, _Entry]" = field(default_factory=OrderedDict)
    seen: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)  # key -> reason
    pool: Any = None
    captures: int = 0
    evicted: int = 0
    events: list[str] = field(default_factory=list)  # fallbacks, in order (for the job report)
    paused: str | None = None  # why forwards run eagerly for now (`paused`), None: graphs as usual

    @property
    def held_bytes(self) -> int:
        """GPU memory reserved while capturing the graphs now kept (their pool's growth; shared, so an upper
        bound of what dropping all of them would free)."""
        return sum(e.bytes for e in self.entries.values())

    def note_eager(self, reason: str) -> None:
        """Record a forward that was not offered for capture, and why (shown once in the report)."""
        self.failed[("eager", reason)] = reason

    def clear(self) -> None:
        self.entries.clear()
        self.seen.clear()
        self.failed.clear()
        self.pool = None

    def report(self) -> str | None:
        """One line for the job report (None when no CUDA forward went through here)."""
        if not (self.entries or self.failed or self.seen):
            return None
        replays = sum(e.replays for e in self.entries.values())
        segments = sorted({e.capture.segments for e in self.entries.values()})
        seg = "" if segments in ([], [1]) else (f", {'/'.join(map(str, segments))} segments between the "
                                                 f"collectives")
        text = (f"CUDA graphs: {len(self.entries)} forward graph{'s' if len(self.entries) != 1 else ''} kept "
                f"({self.captures} captured{seg}; {replays} replays), {self.held_bytes / 2**30:.2f} GiB held")
        if self.failed:
            text += "; eager: " + "; ".join(sorted(set(self.failed.values())))
        return text


def graphs_of(transformer) -> ForwardGraphs:
    cache = getattr(transformer, "_ltx2_forward_graphs", None)
    if cache is None:
        cache = ForwardGraphs()
        object.__setattr__(transformer, "_ltx2_forward_graphs", cache)  # not a submodule / buffer
    return cache


@contextmanager
def paused(transformer, reason: str):
    """Within the block `transformer`'s forwards run eagerly (neither captured nor replayed; its graphs are kept);
    `reason` is shown once in the report. Used where a job's memory plan has no room for a stage's graphs."""
    cache = graphs_of(transformer)
    before, cache.paused = cache.paused, reason
    try:
        yield
    finally:
        cache.paused = before


def report(transformer) -> str | None:
    cache = getattr(transformer, "_ltx2_forward_graphs", None)
    return None if cache is None else cache.report()


def _processor_signature(transformer) -> tuple:
    """What of the installed attention processors the captured kernels depend on: their classes, and for the
    sequence-parallel ones the exchange's group, size and rank."""
    sig = []
    for block in transformer.transformer_blocks:
        for name in ATTENTIONS:
            p = getattr(block, name).processor
            ex = getattr(p, "exchange", None)
            kind = getattr(p, "graph_key", None) or type(p)  # a per-item wrapper names its inner class and mask
            sig.append(kind if ex is None else (kind, id(ex.group), ex.world_size, ex.rank))
    return tuple(sig)


def _meta(value) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_meta(v) for v in value)
    return value


def forward_key(transformer, kwargs: dict, extra: Any = None) -> tuple:
    from ..models import fp8

    blocks = transformer.transformer_blocks
    compiled = getattr(blocks[0], "_compiled_call_impl", None) is not None if len(blocks) else False
    return (extra, tuple((k, _meta(v)) for k, v in sorted(kwargs.items())), _processor_signature(transformer),
            compiled, fp8.WEIGHT_GENERATION[0], fp8.compute_mode(), torch.is_grad_enabled())


def eligible(kwargs: dict) -> str | None:
    """None when a forward with these arguments may be graphed, else why not."""
    if _MODE == "off":
        return "CUDA graphs set off"
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return "not a CUDA forward"
    return None


def _copy_out(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_copy_out(o) for o in outputs)
    return outputs


def call(transformer, forward: Callable[..., Any], kwargs: dict, extra: Any = None, what: str = "forward"):
    """`forward(**kwargs)`, replayed from CUDA graphs where possible (see the module docstring).

    Args:
        transformer: the module whose blocks the forward runs (the cache lives on it; its processors key it).
        forward: the callable (the one forward of `engine.forward.run`, …); must be a pure function
            of its tensor arguments' values and of what the key holds.
        kwargs: keyword arguments (tensors are copied into the captured inputs; others are part of the key).
        extra: more key (e.g. the kind of wrapper).
        what: how the report names this forward in a fallback reason.
    Returns the forward's outputs (fresh tensors: never the captured buffers).
    """
    if eligible(kwargs) is not None:
        return forward(**kwargs)
    cache = graphs_of(transformer)
    if cache.paused is not None:
        cache.note_eager(cache.paused)
        return forward(**kwargs)
    if is_sharded(transformer):  # each block is gathered over the ranks as it runs (FSDP): not captured
        reason = f"{what} runs eagerly: sharded weights (each block is gathered over the ranks as it runs)"
        if reason not in cache.events:
            cache.events.append(reason)
        return forward(**kwargs)
    key = forward_key(transformer, kwargs, extra)
    entry = cache.entries.get(key)
    if entry is None:
        if key in cache.failed:
            return forward(**kwargs)
        if key not in cache.seen:  # warm-up: compilation, autotuning, lazy initialisation happen eagerly
            cache.seen.add(key)
            return forward(**kwargs)
        entry = _capture(cache, key, forward, kwargs, what)
        if entry is None:
            return forward(**kwargs)
    cache.entries.move_to_end(key)
    for name, static in entry.static.items():
        static.copy_(kwargs[name])
    entry.capture.replay()
    entry.replays += 1
    return _copy_out(entry.outputs)


def _capture(cache: ForwardGraphs, key: tuple, forward, kwargs: dict, what: str) -> _Entry | None:
    """Capture `forward` on the static copies of `kwargs`' tensors (the graph reads its inputs there).

    Before the capture the forward runs once eagerly on the capture stream with those copies: whatever the first
    call on a new stream or new buffers does lazily (a compiled block's guard check or recompile, Triton's autotuning
    and module loads, a cuBLAS workspace for the stream) happens there, where it may synchronise, not inside the
    capture, where it would invalidate it ("operation not permitted when stream is capturing")."""
    if _ACTIVE:
        cache.failed[key] = "nested capture"
        return None
    static = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    call_kwargs = {**kwargs, **static}
    if cache.pool is None:
        cache.pool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_reserved()
    capture = _Capture(cache.pool)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    outputs = None
    try:
        with torch.cuda.stream(stream):
            forward(**call_kwargs)  # the warm-up on the capture stream (see above)
            stream.synchronize()
            _ACTIVE.append(capture)
            try:
                capture.begin()
                outputs = forward(**call_kwargs)
                capture.end()
            finally:
                _ACTIVE.pop()
                capture.abort()
    except Exception as exc:  # noqa: BLE001 — any capture failure means: this forward stays eager
        reason = f"{what} not capturable ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        log.debug("%s", reason, exc_info=True)
        cache.failed[key] = reason
        cache.events.append(reason)
        del outputs, capture
        _recover(cache, stream)
        return None
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    entry = _Entry(capture, static, outputs, max(0, torch.cuda.memory_reserved() - before), what)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if entry.bytes > MAX_HELD_FRACTION * total:
        reason = (f"{what} graph dropped: its capture reserved {entry.bytes / 2**30:.1f} GiB "
                  f"(> {MAX_HELD_FRACTION:.0%} of the GPU's memory)")
        cache.failed[key] = reason
        cache.events.append(reason)
        del entry, capture, outputs
        return None
    cache.entries[key] = entry
    cache.captures += 1
    while len(cache.entries) > CAPACITY:
        cache.entries.popitem(last=False)
        cache.evicted += 1
    return entry


def _recover(cache: ForwardGraphs, stream: torch.cuda.Stream) -> None:
    """Leave the process as it was before a capture that failed, so the fleet goes on (eagerly for that forward).

    A capture that fails inside `capture_end` (an invalidated capture) stops before PyTorch's own clean-up: the
    caching allocator keeps routing the stream's allocations to the graphs' pool ("beginAllocateToPool: already
    recording to mempool_id" at the next capture) and the default CUDA generator stays in capture mode (the next
    random op outside a capture raises "Offset increment outside graph capture encountered unexpectedly" — the
    sampler's noise, or the compiler's autotuning inputs). So: end the pool's allocation routing (a no-op when it
    ended), give the pool up (the kept graphs hold their own reference to it; later captures get a fresh one), and run
    one empty capture, whose clean begin and end put the generator back in its normal state."""
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, cache.pool)
    except Exception:  # noqa: BLE001 — the capture's own clean-up ended it already
        pass
    cache.pool = None
    torch.cuda.synchronize()
    try:
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            empty.capture_begin(capture_error_mode="thread_local")
            empty.capture_end()
        del empty
    except Exception:  # noqa: BLE001 — nothing more can be reset from Python; the reason is already reported
        log.debug("reset capture after a failed capture failed", exc_info=True)
    torch.cuda.synchronize()
