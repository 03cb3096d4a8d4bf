"""Gemma text encoding on the fleet (docs/design/text-encoder.md): sharded, batch-parallel or replicated, with a prompt
cache.

Modes (`MODES`; every rank of the fleet calls `TextEncoderService.encode` with the same arguments, in lockstep):

* "replicated": every rank holds a Gemma replica on its device and encodes every prompt itself (no messages).
* "batch_parallel": every rank holds a replica; the prompts to encode are split over the ranks (longest-first onto
  the least-loaded rank, by token count) and the results are gathered back in the original order
  (`all_gather_object`). Refused for a request with fewer than two distinct prompts: there is nothing to split.
* "sharded": ONE copy spread over the fleet's devices (and any extra device named in `max_memory`, e.g. "cpu")
  with Accelerate: rank 0 (the driver) plans a device map from each device's free memory (`plan_device_map`),
  loads the layers straight onto their devices (`models.gemma.load_gemma(device_map=...)`, `dispatch_model`),
  encodes, and broadcasts the embeddings to every rank. Only rank 0 holds Gemma; its layers sit on the other
  ranks' GPUs, which wait on a CPU (gloo) group meanwhile, so no NCCL kernel spins on a GPU Gemma is using.

Every mode encodes each prompt on its own (a batch of one, no padding) and runs the checkpoint's feature extractor
(`text_projection`) where the hidden states are produced, so the result of a prompt does not depend on the mode, the
fleet size or the other prompts of the request: every mode equals a one-process `GemmaTextEncoder.encode([prompt])`
+ projection bit for bit (same device type and dtype), and a cached result is valid whatever asked for it.
Results are ComfyUI's unprocessed CONDITIONING embeddings `[1, T_i, C]` (valid tokens only, float32, CPU;
docs/design/comfyui-types.md); `conditioning()` wraps them as
`[[cond, {"pooled_output": None, "unprocessed_ltxav_embeds": True}]]`.

Cache: per prompt, keyed by (prompt, Gemma file/folder identity = resolved path + size + mtime of its files, text
projection source identity, dtype, min_length); LRU bounded by bytes. Every rank keeps the same cache (rank 0's
fingerprint is broadcast, every rank receives every result), so a hit is a hit on every rank and no collective
is entered by some ranks only. `unload=True` drops Gemma after encoding (its memory goes back to the transformer);
the next miss loads it again.

Memory planning (before anything is loaded): the weight bytes come from the safetensors headers
(`models.gemma.read_gemma_header`), the activations from `activation_bytes` for `plan_tokens` tokens, the budgets
from each device's free memory minus `reserve_bytes` (kept for the transformer's activations), capped by
`max_memory`. When it cannot fit, `GemmaMemoryError` (a ValidationError, raised on every rank) names the model
size and every device's budget, free memory and reserve.
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..protocol.job_results import TextEncodeReport, TextEncoderCounters
from ..protocol.resources import available_memory
from ..protocol.validation import ValidationError

MODES = ("replicated", "batch_parallel", "sharded")
#: modules placed with the first decoder layer's predecessor (before layer 0), in this order
HEAD_MODULES = ("embed_tokens", "rotary_emb")
#: Accelerate's no-split classes: the decoder layers of Gemma 3 and Gemma 4 (`models.gemma.TextEncoderArch`); each
#: decoder layer stays whole on one device
NO_SPLIT = ("Gemma3DecoderLayer", "Gemma4UnifiedTextDecoderLayer")
#: prompt length the activation estimate plans for (ComfyUI pads Gemma prompts to 1024 tokens)
PLAN_TOKENS = 1024
DEFAULT_CACHE_BYTES = 1 << 30
OFFLOAD_DEVICES = ("cpu", "disk")


class GemmaMemoryError(ValidationError):
    """Gemma cannot fit the devices' budgets; the message has the numbers (needed vs budget per device)."""


# ----------------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "20GiB", "512MB", "1.5 GiB" (Accelerate's spellings).
    Raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"memory size {value!r}: expected bytes or a string like '20GiB'")
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {value!r}: expected bytes or a string like '20GiB', '512MB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: int | float) -> str:
    """Human-readable bytes (binary units): 12.34 GiB, 120.6 KiB, 17 B."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def activation_bytes(text_config: Mapping, tokens: int, dtype: torch.dtype) -> int:
    """Bytes a device needs besides weights for a Gemma forward of `tokens` tokens (batch 1), conservatively:
    every hidden state (kept until the forward returns: `tokens·H·(L+1)`) + one layer's temporaries (MLP gate/up
    `2·tokens·I`, q/k/v with RoPE copies `2·tokens·(heads+2·kv)·head_dim`, residual/norm copies `4·tokens·H`,
    attention scores `heads·tokens²` for a math SDPA), all in `dtype`."""
    e = torch.empty((), dtype=dtype).element_size()
    h, layers = int(text_config["hidden_size"]), int(text_config["num_hidden_layers"])
    inter = int(text_config["intermediate_size"])
    heads, kv = int(text_config["num_attention_heads"]), int(text_config["num_key_value_heads"])
    # Gemma 4's full-attention layers are wider (global_head_dim 512 vs 256): plan for the widest layer
    head_dim = max(int(text_config.get("head_dim") or h // heads), int(text_config.get("global_head_dim") or 0))
    retained = tokens * h * (layers + 1)
    transient = tokens * (2 * inter + 2 * (heads + 2 * kv) * head_dim + 4 * h) + heads * tokens * tokens
    return (retained + transient) * e


# ----------------------------------------------------------------------------------------------------------------
# Device-map planner (pure)
# ----------------------------------------------------------------------------------------------------------------

def plan_device_map(layer_sizes: Sequence[int], fixed_sizes: Mapping[str, int],
                    budgets: Mapping[object, int | str], *, overhead: int | str | Mapping = 0,
                    spill: Sequence = (), head: Sequence[str] = HEAD_MODULES,
                    layer_prefix: str = "layers") -> dict[str, object]:
    """Place a decoder stack on devices: module name -> device key of `budgets` (an Accelerate `device_map`).

    Pure function (no torch, no devices). Each decoder layer `f"{layer_prefix}.{i}"` is one whole entry (Gemma's
    no-split module); `fixed_sizes` are the other modules: those named in `head` go before layer 0 (with it, on the
    first device), the rest after the last layer. Entries keep their order and devices keep the order of
    `budgets` (the driver's device first), so every device holds one contiguous run of layers.

    Placement: each device's capacity is `budget - overhead` (overhead: bytes per device, or per device in a
    mapping — activations). Proportional first: device d gets the entries whose midpoints fall in its share
    `total · cap_d / Σ cap` of the stack, so **|load_d − total · cap_d / Σ cap| ≤ the largest entry** (balanced
    within one entry). If that puts a device over its capacity (tight budgets), the contiguous placement that
    minimizes the largest load/capacity ratio is used instead (bisection over the ratio with a greedy fill; no
    device goes over its capacity). Devices may be left empty.

    `spill` names devices of `budgets` (e.g. "cpu", "disk" next to GPUs: offload) used only for what the others
    cannot hold: when everything fits the other devices it is placed there as above; otherwise the other devices
    are filled in order up to their capacity and the tail of the stack goes to the spill devices, in order.

    Raises: GemmaMemoryError with the numbers when the entries do not fit (in total, or as whole layers);
        ValueError for no budgets or a bad size.
    """
    if not budgets:
        raise ValueError("plan_device_map: no devices to place Gemma on")
    devices = list(budgets)
    per_dev = overhead if isinstance(overhead, Mapping) else {d: overhead for d in devices}
    caps = {d: max(0, parse_size(budgets[d]) - parse_size(per_dev.get(d, 0))) for d in devices}
    items = ([(n, int(fixed_sizes[n])) for n in head if n in fixed_sizes]
             + [(f"{layer_prefix}.{i}", int(s)) for i, s in enumerate(layer_sizes)]
             + [(n, int(s)) for n, s in fixed_sizes.items() if n not in head])
    total = sum(s for _, s in items)
    unknown = [d for d in spill if d not in budgets]
    if unknown:
        raise ValueError(f"plan_device_map: spill devices {unknown} have no budget")
    primary = [d for d in devices if d not in spill]
    ordered = primary + [d for d in devices if d in spill]
    if total > sum(caps.values()) or _greedy(items, ordered, caps) is None:
        raise GemmaMemoryError(_no_fit_message(items, layer_sizes, budgets, per_dev, caps, layer_prefix))
    if not primary or _greedy(items, primary, caps) is None:
        return _greedy(items, ordered, caps)  # fill the primary devices, spill the rest
    plan = _proportional(items, primary, caps)
    if plan is None:
        plan = _min_max_ratio(items, primary, caps)
    return plan


def plan_loads(plan: Mapping[str, object], layer_sizes: Sequence[int], fixed_sizes: Mapping[str, int],
               layer_prefix: str = "layers") -> dict[object, int]:
    """Bytes placed on each device by `plan` (devices without entries are absent)."""
    sizes = dict(fixed_sizes)
    sizes.update({f"{layer_prefix}.{i}": s for i, s in enumerate(layer_sizes)})
    loads: dict[object, int] = {}
    for name, dev in plan.items():
        loads[dev] = loads.get(dev, 0) + int(sizes.get(name, 0))
    return loads


def _proportional(items, devices, caps) -> dict | None:
    usable = [d for d in devices if caps[d] > 0]
    cap_sum = sum(caps[d] for d in usable)
    total = sum(s for _, s in items)
    bounds, acc = [], 0
    for d in usable:
        acc += caps[d]
        bounds.append(acc)  # device j's share ends at total · bounds[j] / cap_sum
    plan, loads, start, j = {}, {d: 0 for d in usable}, 0, 0
    for name, size in items:
        # midpoint (start + size/2) >= total · bounds[j] / cap_sum, in integers
        while j < len(usable) - 1 and (2 * start + size) * cap_sum >= 2 * total * bounds[j]:
            j += 1
        plan[name] = usable[j]
        loads[usable[j]] += size
        start += size
    if any(loads[d] > caps[d] for d in usable):
        return None
    return plan


def _greedy(items, devices, limits) -> dict | None:
    plan, loads, k = {}, {d: 0 for d in devices}, 0
    for name, size in items:
        while k < len(devices) and loads[devices[k]] + size > limits[devices[k]]:
            k += 1
        if k == len(devices):
            return None
        plan[name] = devices[k]
        loads[devices[k]] += size
    return plan


def _min_max_ratio(items, devices, caps) -> dict:
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _greedy(items, devices, {d: int(caps[d] * mid) for d in devices}) is None:
            lo = mid
        else:
            hi = mid
    plan = _greedy(items, devices, {d: int(caps[d] * hi) for d in devices})
    return plan if plan is not None else _greedy(items, devices, caps)


def _no_fit_message(items, layer_sizes, budgets, per_dev, caps, layer_prefix) -> str:
    total = sum(s for _, s in items)
    fixed = ", ".join(f"{n} {fmt_bytes(s)}" for n, s in items if not n.startswith(layer_prefix + ".") and s)
    largest = max(layer_sizes) if layer_sizes else 0
    per = ", ".join(f"{d} {fmt_bytes(parse_size(budgets[d]))}" + (
        f" − {fmt_bytes(parse_size(per_dev.get(d, 0)))} activations = {fmt_bytes(caps[d])} for weights"
        if parse_size(per_dev.get(d, 0)) else "") for d in budgets)
    why = ("in total" if total > sum(caps.values()) else
           f"as whole layers (no device has room for the next {fmt_bytes(largest)} decoder layer)")
    return (f"needs {fmt_bytes(total)} of weights ({len(layer_sizes)} whole decoder layers of up to "
            f"{fmt_bytes(largest)}{'; ' + fixed if fixed else ''}) but does not fit {why}: budgets {per}; "
            f"total {fmt_bytes(sum(caps.values()))}")


# ----------------------------------------------------------------------------------------------------------------
# Budgets from the devices, and Accelerate's own planner
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class DeviceBudget:
    """Memory Gemma may use on one device: `min(free - reserve, cap)`, never below 0."""

    device: str
    free: int
    reserve: int = 0
    cap: int | None = None

    @property
    def budget(self) -> int:
        b = self.free - self.reserve
        if self.cap is not None:
            b = min(b, self.cap)
        return max(0, b)

    def describe(self) -> str:
        parts = f"free {fmt_bytes(self.free)}" + (f" − reserve {fmt_bytes(self.reserve)}" if self.reserve else "")
        if self.cap is not None:
            parts += f", capped at {fmt_bytes(self.cap)} by gemma_max_memory"
        return f"{self.device} budget {fmt_bytes(self.budget)} ({parts})"


def device_key(device) -> str:
    """Normalized device name: 3 / "3" / "cuda:3" -> "cuda:3"; "cuda" -> "cuda:0"; "cpu", "disk" unchanged."""
    if isinstance(device, int) or (isinstance(device, str) and device.isdigit()):
        return f"cuda:{int(device)}"
    if isinstance(device, torch.device):
        device = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    device = str(device)
    return "cuda:0" if device == "cuda" else device


def free_bytes(device: str, offload_dir: str | None = None) -> int:
    """Free memory on `device` ("cuda:i": driver-free + this process's cached-but-unused blocks; "cpu":
    MemAvailable; "disk": free space of `offload_dir`'s file system)."""
    device = device_key(device)
    if device.startswith("cuda"):
        index = int(device.split(":")[1])
        free, _ = torch.cuda.mem_get_info(index)
        return int(free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))
    if device == "disk":
        return int(shutil.disk_usage(offload_dir or tempfile.gettempdir()).free)
    available = available_memory()
    return available if available is not None else int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_budgets(devices: Sequence, *, reserve_bytes: int = 0, max_memory: Mapping | None = None,
                   offload_dir: str | None = None) -> dict[str, DeviceBudget]:
    """Budgets for `devices` (deduplicated, in order; `reserve_bytes` kept free on each) followed by any extra
    device named in `max_memory` (e.g. "cpu" for CPU offload, no reserve there); `max_memory` caps each named
    device ({"cuda:0": "20GiB", "cpu": "64GiB"})."""
    caps = {device_key(k): parse_size(v) for k, v in (max_memory or {}).items()}
    out: dict[str, DeviceBudget] = {}
    for d in devices:
        d = device_key(d)
        if d not in out:
            out[d] = DeviceBudget(d, free_bytes(d, offload_dir), reserve_bytes, caps.get(d))
    for d, cap in caps.items():
        if d not in out:
            out[d] = DeviceBudget(d, free_bytes(d, offload_dir), 0, cap)
    return out


def to_accelerate_max_memory(budgets: Mapping) -> dict:
    """Accelerate's `max_memory` from budgets keyed "cuda:i" / "cpu" / "disk" (values in bytes or "20GiB")."""
    out = {}
    for d, v in budgets.items():
        key = device_key(d)
        out[int(key.split(":")[1]) if key.startswith("cuda") else key] = parse_size(
            v.budget if isinstance(v, DeviceBudget) else v)
    return out


def accelerate_device_map(model: torch.nn.Module, budgets: Mapping, dtype: torch.dtype | None = None) -> dict:
    """Accelerate's own greedy plan (`infer_auto_device_map`, Gemma decoder layers unsplit) for the same budgets —
    fills devices in order; `plan_device_map` balances instead. Works on a meta-device model."""
    from accelerate import infer_auto_device_map

    return infer_auto_device_map(model, max_memory=to_accelerate_max_memory(budgets),
                                 no_split_module_classes=list(NO_SPLIT), dtype=dtype)


def plan_gemma(header, dtype: torch.dtype, budgets: Mapping[str, DeviceBudget], *,
               tokens: int = PLAN_TOKENS) -> dict[str, str]:
    """The sharded device map for a Gemma described by `header` (`models.gemma.read_gemma_header`) on `budgets`
    (the driver's device first). Activations (`activation_bytes`) are set aside on the devices that compute (every
    accelerator; the CPU on a CPU fleet). "cpu"/"disk" next to the compute devices are offload (spill) devices:
    used only for what the others cannot hold, streamed to the main device (the first accelerator, or the CPU),
    which then also keeps room for the largest layer. Raises GemmaMemoryError with the numbers."""
    layer_sizes, fixed = header.module_bytes(dtype)
    fixed = {"rotary_emb": 0, **fixed}
    act = activation_bytes(header.text_config, tokens, dtype)
    accel = [d for d in budgets if d not in OFFLOAD_DEVICES]
    main = accel[0] if accel else "cpu"  # where offloaded ("cpu"/"disk") entries execute
    overhead = {d: act for d in accel}
    spill = [d for d in budgets if d in OFFLOAD_DEVICES and d != main]
    overhead[main] = act + (max(layer_sizes, default=0) if spill else 0)  # a streamed layer
    try:
        return plan_device_map(layer_sizes, fixed, {d: b.budget for d, b in budgets.items()}, overhead=overhead,
                               spill=spill)
    except GemmaMemoryError as exc:
        raise GemmaMemoryError(
            f"Gemma text encoder {header.source} ({str(dtype).replace('torch.', '')}, sharded over "
            f"{', '.join(budgets)}; {fmt_bytes(act)} of activations per device for {tokens} tokens) {exc}. "
            f"Devices: {'; '.join(b.describe() for b in budgets.values())}. Free memory on these devices, lower "
            f"gemma_reserve_gib, add a device, or offload with 'cpu' in gemma_max_memory (fp8 files are "
            f"dequantized to the compute dtype, so they do not shrink this)") from None


# ----------------------------------------------------------------------------------------------------------------
# The service
# ----------------------------------------------------------------------------------------------------------------

def _fingerprint_source(source) -> tuple:
    if source is None:
        return ("none",)
    if isinstance(source, (str, Path)):
        p = Path(source)
        if p.exists():
            st = p.stat()
            return (str(p.resolve()), st.st_size, st.st_mtime_ns)
        return (str(source),)
    return ("object", id(source))


@dataclass(frozen=True, eq=False)
class TextEncoding:
    """What `TextEncoderService.encode` returns: embeds, per prompt in order `[1, T_i, C]` float32 (CPU, valid tokens
    only); report, how the encode ran (`TextEncodeReport`)."""

    embeds: tuple[torch.Tensor, ...]
    report: TextEncodeReport


@dataclass(frozen=True, eq=False)
class EncoderPlacement:
    """Where a `TextEncoderService` runs.

    device, dtype: this rank's device and the compute dtype. rank, world_size, group: this rank in the fleet; `group`
    is the process group for the service's messages (`make_group`: gloo; None = the default group). world_size 1
    needs no process group. devices: every rank's device in rank order (the sharded budgets); () = `(device,)`.
    """

    device: Any = "cpu"
    dtype: torch.dtype = torch.float32
    rank: int = 0
    world_size: int = 1
    group: Any = None
    devices: tuple = ()


@dataclass(frozen=True)
class EncoderSettings:
    """How a `TextEncoderService` encodes and plans its memory.

    mode: default mode (`MODES`); unload: default "unload after encoding". reserve_bytes: kept free on every fleet
    device when planning (the transformer's activations). max_memory: per-device caps {"cuda:0": "20GiB",
    "cpu": "64GiB", "disk": "100GiB"}; a device named here that is not a fleet device is added to the sharded map
    (offload); None = no caps. plan_tokens: prompt length the memory plan assumes; min_length: left-pad every prompt
    to this length (None: no padding). cache_bytes: LRU cache budget (0 disables the cache).
    """

    mode: str = "replicated"
    unload: bool = False
    reserve_bytes: int = 0
    max_memory: Mapping | None = None
    plan_tokens: int = PLAN_TOKENS
    min_length: int | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES


class TextEncoderService:
    """Prompts -> CONDITIONING embeddings on one rank of a fleet (or in one process); see the module docstring.

    Args:
        gemma_path: Gemma file or folder (`models.gemma.load_gemma`).
        projection: the checkpoint's `TextProjection` on this rank (feature extractor). None with a Gemma 4 file
            that bundles the LTX-2.5 projection: that one is loaded (`text_projection.load_bundled_projection`,
            in the placement's dtype on its device); a projection passed with such a file must have the bundled one's
            shapes.
        projection_source: the file the projection came from (cache key); default: the module's identity (the
            Gemma file for a bundled projection).
        placement: `EncoderPlacement` (device, dtype, rank, world size, group, every rank's device).
        settings: `EncoderSettings` (mode, unload, memory reserve and caps, plan tokens, padding, cache budget).
        encoder: an already loaded `GemmaTextEncoder` to adopt (one process; held as a replica).
        family: the checkpoint's `models.families.ModelFamily`, when known: the Gemma file must be its text encoder
            (`check_text_encoder_family`).
    Raises: ValueError (from the header, or `check_gemma_matches`) when Gemma and the projection do not match.
    """

    def __init__(self, gemma_path, projection, *, projection_source=None,
                 placement: EncoderPlacement = EncoderPlacement(), settings: EncoderSettings = EncoderSettings(),
                 encoder=None, family=None):
        from ..models.gemma import read_gemma_header
        from ..models.text_projection import check_gemma_matches

        device, dtype = placement.device, placement.dtype
        rank, world_size, group, devices = placement.rank, placement.world_size, placement.group, placement.devices
        mode, unload, reserve_bytes = settings.mode, settings.unload, settings.reserve_bytes
        max_memory, plan_tokens = settings.max_memory, settings.plan_tokens
        min_length, cache_bytes = settings.min_length, settings.cache_bytes
        check_mode(mode)
        self.gemma_path = str(gemma_path) if gemma_path is not None else None
        self.projection = projection
        self.projection_source = projection_source if projection_source is not None else projection
        self.device, self.dtype = torch.device(device), dtype
        self.rank, self.world_size, self.group = rank, world_size, group
        self.devices = [device_key(d) for d in (devices or [self.device])]
        self.mode, self.unload_after = mode, bool(unload)
        self.reserve_bytes, self.max_memory = int(reserve_bytes), dict(max_memory or {})
        self.plan_tokens, self.min_length, self.cache_bytes = plan_tokens, min_length, int(cache_bytes)
        self.header = read_gemma_header(gemma_path) if gemma_path is not None else None
        if family is not None and self.header is not None:
            check_text_encoder_family(self.header, family)
        bundled = self.header.projection_shapes if self.header is not None else {}
        if bundled and projection is None:
            from ..models.text_projection import load_bundled_projection

            projection = load_bundled_projection(gemma_path, dtype=dtype, device=self.device)
            self.projection = projection
            self.projection_source = projection_source if projection_source is not None else str(gemma_path)
        elif bundled:
            _check_bundled_shapes(projection, bundled, gemma_path)
        if projection is not None:
            check_gemma_matches(projection, self.header or encoder, gemma_path)
        self.encoder = encoder
        self.layout: str | None = "replica" if encoder is not None else None  # "replica" | "sharded" | None
        self.loaded_fingerprint = None  # rank 0's gemma_fingerprint of the loaded file
        self._offload_dir: str | None = None
        self.offloaded = False  # the replica sits in host memory (`offload`) until the next encode needs it
        self.cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._cache_used = 0
        self.stats = {"forwards": 0, "hits": 0, "misses": 0, "loads": 0, "unloads": 0}  # `counters()`
        self.device_map: dict | None = None

    # ---- construction ------------------------------------------------------------------------------------------

    @classmethod
    def wrap(cls, encoder, projection, settings: EncoderSettings = EncoderSettings()) -> TextEncoderService:
        """A one-process service around an already loaded `GemmaTextEncoder` (replicated, world size 1, on the
        encoder's device and dtype)."""
        path = encoder.source if Path(str(encoder.source)).exists() else None
        svc = cls(path, projection, placement=EncoderPlacement(device=encoder.device, dtype=encoder.dtype),
                  settings=settings, encoder=encoder)
        if path is not None:
            from ..models.gemma import gemma_fingerprint
            svc.loaded_fingerprint = gemma_fingerprint(path)
        return svc

    @classmethod
    def for_fleet(cls, config, rank: int, device, projection, family=None) -> TextEncoderService:
        """The service of one worker from its `FleetConfig` (collective: every rank calls it; creates the
        gloo group on GPU fleets). Gemma is loaded here in the configured mode unless `gemma_unload` is set.
        `projection` None with a Gemma 4 file: the projection bundled in it (LTX-2.5); `family`: the checkpoint's
        model family, checked against the Gemma file. No Gemma (a transformer-only fleet: the native MODEL of Load
        Diffusion Model (MGPU)): a service with nothing to encode."""
        projection = projection if config.gemma is not None else None
        if projection is None:
            projection_source = config.text_projection
        else:
            projection_source = config.text_projection or config.checkpoint
        placement = EncoderPlacement(device=device, dtype=getattr(torch, config.dtype), rank=rank,
                                     world_size=config.world_size,
                                     group=make_group(config.world_size, config.collective_timeout_s),
                                     devices=tuple(config.devices))
        settings = EncoderSettings(mode=getattr(config, "gemma_mode", "replicated"),
                                   unload=getattr(config, "gemma_unload", False),
                                   reserve_bytes=int(getattr(config, "gemma_reserve_gib", 0.0) * 2**30),
                                   max_memory=dict(getattr(config, "gemma_max_memory", None) or ()))
        svc = cls(config.gemma, projection, projection_source=projection_source, placement=placement,
                  settings=settings, family=family)
        if not svc.unload_after and config.gemma is not None:  # no Gemma file: nothing to load at start
            svc.ensure_loaded(svc.mode, svc.fingerprint())
        return svc

    # ---- compatibility with code that asks the encoder for its sizes -------------------------------------------

    @property
    def hidden_size(self) -> int:
        return self.header.hidden_size if self.header else self.encoder.hidden_size

    @property
    def num_hidden_states(self) -> int:
        return self.header.num_hidden_states if self.header else self.encoder.num_hidden_states

    # ---- collectives (the service's group) ---------------------------------------------------------------------

    def _broadcast(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_gather(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _guarded(self, fn):
        try:
            return ("ok", fn())
        except Exception as exc:  # noqa: BLE001 — re-raised on every rank by _raise_any
            return ("error", type(exc).__name__, str(exc), self.rank)

    @staticmethod
    def _raise_any(outcomes: list) -> None:
        for o in outcomes:
            if o[0] == "error":
                _, name, message, rank = o
                cls = {"GemmaMemoryError": GemmaMemoryError, "ValidationError": ValidationError,
                       "FileNotFoundError": FileNotFoundError, "ValueError": ValueError}.get(name, RuntimeError)
                raise cls(message if cls is not RuntimeError else f"{name} on rank {rank}: {message}")

    # ---- loading ----------------------------------------------------------------------------------------------------

    def fingerprint(self) -> tuple:
        """(Gemma identity, projection identity, dtype, min_length): rank 0's, on every rank."""
        from ..models.gemma import gemma_fingerprint

        def compute():
            gemma = gemma_fingerprint(self.gemma_path) if self.gemma_path else ("encoder", id(self.encoder))
            return (gemma, _fingerprint_source(self.projection_source), str(self.dtype), self.min_length)

        outcome = self._broadcast(self._guarded(compute) if self.rank == 0 else None)
        self._raise_any([outcome])
        return outcome[1]

    def ensure_loaded(self, mode: str, fingerprint: tuple | None = None) -> None:
        """Hold Gemma in the layout `mode` needs (collective: every rank calls it with rank 0's `fingerprint`,
        fetched here when not given). Reloads when the layout or the Gemma file changed; refuses with
        GemmaMemoryError (every rank) before loading when it cannot fit."""
        check_mode(mode)
        self._bring_back()
        if self.gemma_path is None:  # an adopted encoder without a file: it is what there is
            if self.encoder is None:
                raise ValueError("the text encoder was unloaded and this service has no Gemma path to reload it")
            return
        fingerprint = self.fingerprint() if fingerprint is None else fingerprint
        layout = "sharded" if mode == "sharded" else "replica"
        if self.layout == layout and self.loaded_fingerprint == fingerprint[0]:
            return
        self.unload()
        if self.loaded_fingerprint is not None and self.loaded_fingerprint != fingerprint[0]:
            from ..models.gemma import read_gemma_header
            from ..models.text_projection import check_gemma_matches

            self.header = read_gemma_header(self.gemma_path)  # the file changed since it was last loaded
            if self.projection is not None:
                check_gemma_matches(self.projection, self.header, self.gemma_path)
        if layout == "sharded":
            self._load_sharded()
        else:
            self._load_replicas()
        self.layout = layout
        self.loaded_fingerprint = fingerprint[0]
        self.stats["loads"] += 1

    def _load_replicas(self) -> None:
        from ..models.gemma import load_gemma

        def check():
            layer_sizes, fixed = self.header.module_bytes(self.dtype)
            weights = sum(layer_sizes) + sum(fixed.values())
            act = activation_bytes(self.header.text_config, self.plan_tokens, self.dtype)
            budget = device_budgets([self.device], reserve_bytes=self.reserve_bytes,
                                    max_memory={k: v for k, v in self.max_memory.items()
                                                if device_key(k) == device_key(self.device)})[device_key(self.device)]
            return weights, act, budget

        infos = self._all_gather(self._guarded(check))
        self._raise_any(infos)
        need: dict[str, int] = {}
        budgets: dict[str, DeviceBudget] = {}
        for _, (weights, act, budget) in infos:
            need[budget.device] = need.get(budget.device, 0) + weights + act
            budgets[budget.device] = budget
        short = [d for d in need if need[d] > budgets[d].budget]
        if short:
            weights, act, _ = infos[0][1]
            raise GemmaMemoryError(
                f"Gemma text encoder {self.header.source} ({str(self.dtype).replace('torch.', '')}, one replica per "
                f"rank) does not fit: each replica needs {fmt_bytes(weights + act)} = {fmt_bytes(weights)} of "
                f"weights + {fmt_bytes(act)} of activations for {self.plan_tokens} tokens; "
                + "; ".join(f"{d} needs {fmt_bytes(need[d])} for {need[d] // (weights + act)} replica(s), "
                            f"{budgets[d].describe()}" for d in need)
                + f". Short on {', '.join(short)}: use mode 'sharded' (one copy over all devices), free memory, "
                  f"lower gemma_reserve_gib, or unload Gemma after encoding")
        outcome = self._guarded(lambda: load_gemma(self.gemma_path, device=self.device, dtype=self.dtype))
        self._raise_any(self._all_gather(outcome[:1] + (None,) if outcome[0] == "ok" else outcome))
        self.encoder = outcome[1]
        self.device_map = None

    def _load_sharded(self) -> None:
        from ..models.gemma import load_gemma

        if self.world_size > 1:
            dist.barrier(group=self.group)  # every rank has its transformer loaded before rank 0 reads free memory

        def plan_and_load():
            needs_disk = any(device_key(k) == "disk" for k in self.max_memory)
            if needs_disk:
                self._offload_dir = tempfile.mkdtemp(prefix="ltx2-gemma-offload-")
            budgets = device_budgets(self.devices, reserve_bytes=self.reserve_bytes, max_memory=self.max_memory,
                                     offload_dir=self._offload_dir)
            device_map = plan_gemma(self.header, self.dtype, budgets, tokens=self.plan_tokens)
            enc = load_gemma(self.gemma_path, device=self.device, dtype=self.dtype, device_map=device_map,
                             offload_dir=self._offload_dir)
            return enc, device_map

        outcome = self._guarded(plan_and_load) if self.rank == 0 else ("ok", None)
        shared = self._broadcast(outcome[:1] + (outcome[1][1],) if outcome[0] == "ok" and self.rank == 0
                                 else outcome)
        if self.rank == 0 and outcome[0] != "ok":
            self._drop_offload_dir()
        self._raise_any([shared])
        self.device_map = shared[1]
        self.encoder = outcome[1][0] if self.rank == 0 else None

    def offload(self) -> bool:
        """Move a replica held on a GPU to host memory (the job memory plan: the stages need its room); the next
        encode that needs Gemma brings it back (`ensure_loaded`). Local to this rank. False where there is nothing to
        move (sharded, on the CPU, not loaded)."""
        enc = self.encoder
        if enc is None or self.layout != "replica" or self.device.type != "cuda" or getattr(enc, "device_map", None):
            return False
        enc.model.to("cpu")
        self.offloaded = True
        torch.cuda.empty_cache()
        return True

    def _bring_back(self) -> None:
        if self.offloaded and self.encoder is not None:
            self.encoder.model.to(self.device)
        self.offloaded = False

    def unload(self) -> None:
        """Drop Gemma from this rank (local; every rank calls it where the layout changes or after an encode with
        unload): Accelerate hooks removed, the model released, cached CUDA blocks returned to the driver."""
        enc, self.encoder = self.encoder, None
        self.offloaded = False
        had = enc is not None or self.layout is not None
        self.layout, self.device_map = None, None
        if enc is not None:
            if getattr(enc, "device_map", None):
                from accelerate.hooks import remove_hook_from_submodules
                remove_hook_from_submodules(enc.model)
            model = weakref.ref(enc.model)
            del enc
            if model() is not None:  # held by a reference cycle: collect it now, not at some later gc pass
                gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        self._drop_offload_dir()
        if had:
            self.stats["unloads"] += 1

    def _drop_offload_dir(self) -> None:
        if self._offload_dir is not None:
            shutil.rmtree(self._offload_dir, ignore_errors=True)
            self._offload_dir = None

    # ---- encoding ------------------------------------------------------------------------------------------------

    def _encode_one(self, prompt: str) -> torch.Tensor:
        hidden, mask = self.encoder.encode([prompt], min_length=self.min_length)
        self.stats["forwards"] += 1
        weight = next(self.projection.parameters())
        # the projection normalizes in float32 and casts to its weights' dtype itself
        embeds = self.projection(hidden.to(weight.device), mask.to(weight.device))
        valid = int(mask[0].sum())
        return embeds[:, embeds.shape[1] - valid:].float().cpu().contiguous()

    def _cache_put(self, key: tuple, value: torch.Tensor) -> None:
        if self.cache_bytes <= 0:
            return
        size = value.numel() * value.element_size()
        if key in self.cache:
            old = self.cache.pop(key)
            self._cache_used -= old.numel() * old.element_size()
        self.cache[key] = value
        self._cache_used += size
        while self._cache_used > self.cache_bytes and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self._cache_used -= old.numel() * old.element_size()

    def clear_cache(self) -> None:
        self.cache.clear()
        self._cache_used = 0

    def encode(self, prompts: Sequence[str], mode: str | None = None, unload: bool | None = None,
               strict: bool = True) -> TextEncoding:
        """A `TextEncoding`: embeddings `[1, T_i, C]` (float32, CPU, valid tokens only) for each prompt, in order, and
        how the encode ran (`TextEncodeReport`). Collective: every rank calls it with the same arguments and gets the
        same tensors.

        Args:
            prompts: a non-empty list of strings (duplicates are encoded once).
            mode: one of `MODES` (default: the service's).
            unload: drop Gemma afterwards (default: the service's setting).
            strict: refuse "batch_parallel" for fewer than two distinct prompts (False: encode them replicated,
                which the replica layout allows — what the pipeline does for a prompt without negative).
        Raises: ValidationError (bad prompts or mode, batch_parallel with one prompt), GemmaMemoryError; the same
            error on every rank.
        """
        t0 = time.perf_counter()
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts or not all(
                isinstance(p, str) for p in prompts):
            raise ValidationError(f"prompts must be a non-empty list of strings, got {prompts!r:.120}")
        mode = self.mode if mode is None else mode
        check_mode(mode)
        unload = self.unload_after if unload is None else bool(unload)
        distinct = list(dict.fromkeys(prompts))
        requested = mode
        if mode == "batch_parallel" and len(distinct) < 2:
            if strict:
                raise ValidationError(
                    f"mode 'batch_parallel' splits prompts over the ranks, but this request has "
                    f"{len(distinct)} distinct prompt: there is nothing to split. Use 'sharded' (one Gemma copy over "
                    f"all devices) or 'replicated'")
            mode = "replicated"
        fp = self.fingerprint()
        keys = {p: (p, fp) for p in distinct}
        misses = [p for p in distinct if keys[p] not in self.cache]
        hits = len(distinct) - len(misses)
        self.stats["hits"] += hits
        self.stats["misses"] += len(misses)
        forwards0 = self.stats["forwards"]
        if misses:
            self.ensure_loaded(mode, fp)
            if mode == "sharded":
                results = self._encode_sharded(misses)
            elif mode == "batch_parallel":
                results = self._encode_split(misses)
            else:
                outcome = self._guarded(lambda: [self._encode_one(p) for p in misses])
                self._raise_any(self._all_gather(outcome[:1] + (None,) if outcome[0] == "ok" else outcome))
                results = outcome[1]
            for p, e in zip(misses, results):
                self._cache_put(keys[p], e)
        else:
            results = []
        fresh = dict(zip(misses, results))
        out = [(fresh[p] if p in fresh else self.cache[keys[p]]).clone() for p in prompts]
        for p in distinct:  # refresh LRU order
            if keys[p] in self.cache:
                self.cache.move_to_end(keys[p])
        if unload:
            self.unload()
        report = TextEncodeReport(mode=mode, requested_mode=requested, prompts=len(prompts), distinct=len(distinct),
                                  cache_hits=hits, encoded=len(misses),
                                  forwards_here=self.stats["forwards"] - forwards0, unloaded=unload,
                                  seconds=time.perf_counter() - t0,
                                  device_map=_summarize_map(self.device_map) if mode == "sharded" else None)
        return TextEncoding(tuple(out), report)

    def encode_embeds(self, prompts: Sequence[str], strict: bool = True) -> list[torch.Tensor]:
        """`encode(prompts, strict=strict).embeds` as a list: what pipelines.TwoStagePipeline.encode_prompts calls."""
        return list(self.encode(prompts, strict=strict).embeds)

    def counters(self) -> TextEncoderCounters:
        """This rank's counters (`TextEncoderCounters`)."""
        return TextEncoderCounters(**self.stats)

    def _encode_sharded(self, prompts: list[str]) -> list[torch.Tensor]:
        outcome = self._guarded(lambda: [self._encode_one(p) for p in prompts]) if self.rank == 0 else None
        outcome = self._broadcast(outcome)
        self._raise_any([outcome])
        return outcome[1]

    def _encode_split(self, prompts: list[str]) -> list[torch.Tensor]:
        mine = split_prompts([len(self.encoder.tokenizer.prompt_ids(p)) for p in prompts], self.world_size)
        outcome = self._guarded(lambda: {i: self._encode_one(prompts[i]) for i in mine[self.rank]})
        gathered = self._all_gather(outcome)
        self._raise_any(gathered)
        merged: dict[int, torch.Tensor] = {}
        for o in gathered:
            merged.update(o[1])
        return [merged[i] for i in range(len(prompts))]

    def gather_stats(self) -> list[TextEncoderCounters]:
        """Every rank's counters (`TextEncoderCounters`), rank order. Collective."""
        return self._all_gather(self.counters())

    @staticmethod
    def conditioning(embeds: torch.Tensor, frame_rate: float | None = None) -> list:
        """ComfyUI's CONDITIONING `[[cond, {...}]]` for one prompt's embeddings `[1, T, C]`."""
        from ..models.text_projection import make_conditioning

        return make_conditioning(embeds, torch.ones(embeds.shape[:2], dtype=torch.long), frame_rate)


def check_text_encoder_family(header, family) -> None:
    """Raise ValueError naming the file and both names when the Gemma file (`models.gemma.GemmaHeader`) is not the
    text encoder `family` (`models.families.ModelFamily`) was trained with: LTX-2.0 / 2.3 use Gemma 3 12B
    (`gemma_3_12B_it*`), LTX-2.5 Gemma 4 12B with its projection (`gemma4-12b-with-proj-ltx-2.5-*`); the widths
    alone (3840 x 49 for both) cannot tell them apart."""
    want = family.text_encoder.architecture
    if header.architecture.name != want:
        files = ", ".join(family.text_encoder.released_files) or want
        raise ValueError(f"Gemma text encoder {header.source} is {header.architecture.name}, but {family.display} "
                         f"uses {want} ({files}); pick the text encoder of the checkpoint's model family")


def _check_bundled_shapes(projection, bundled: Mapping[str, tuple], gemma_path) -> None:
    """A projection passed next to a Gemma file that bundles its own must have the bundled one's kind and shapes."""
    want = {"kind": "dual_linear", "in": bundled.get("video_aggregate_embed.weight", (0, 0))[1],
            "video": bundled.get("video_aggregate_embed.weight", (0, 0))[0],
            "audio": bundled.get("audio_aggregate_embed.weight", (0, 0))[0]}
    have = {"kind": projection.kind, "in": projection.in_features, "video": projection.video_dim,
            "audio": projection.out_features - projection.video_dim}
    if want != have:
        raise ValueError(f"the text projection passed ({projection.kind}: {have}) is not the one bundled in "
                         f"the Gemma file {gemma_path} ({want}); rule: a Gemma 4 file brings its own LTX-2.5 "
                         f"projection, pass none or that one")


def split_prompts(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Prompt indices per rank: longest first onto the rank with the fewest tokens so far (ties: lower index, lower
    rank); each rank's list is in prompt order. Deterministic, so every rank computes the same split."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += token_counts[i]
    return [sorted(x) for x in out]


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValidationError(f"text encoder mode {mode!r}: choose one of {', '.join(MODES)}")


def make_group(world_size: int, timeout_s: float | None = None):
    """The group the text service talks on: the default group when it is gloo (CPU fleets), else a new gloo group
    over every rank, so ranks waiting for rank 0 wait on the CPU, not in an NCCL kernel on a GPU Gemma uses.
    Collective (every rank calls it, in the same order as other `new_group` calls). None for world size 1."""
    if world_size <= 1 or not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return None
    from datetime import timedelta

    kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    return dist.new_group(backend="gloo", **kw)


def _summarize_map(device_map: dict | None) -> dict | None:
    """{device: "embed_tokens, rotary_emb, layers.0-11"} for reports."""
    if not device_map:
        return None
    out: dict[str, list[str]] = {}
    for name, dev in device_map.items():
        out.setdefault(str(dev), []).append(name)
    summary = {}
    for dev, names in out.items():
        layers = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
        other = [n for n in names if not n.startswith("layers.")]
        parts = other + ([f"layers.{min(layers)}-{max(layers)}"] if layers else [])
        summary[dev] = ", ".join(parts)
    return summary
