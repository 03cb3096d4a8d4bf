"""LoRA files in the LTX / ComfyUI key naming, fused into the transformer the way ComfyUI applies them and exactly
restored — in one process or over a fleet of ranks, without ever reading the checkpoint again.

File layout (Lightricks' distilled LoRA, ComfyUI's LoRA loader): for a Linear at original path `P`
(`transformer_blocks.0.attn1.to_q`, …) the keys `diffusion_model.P.lora_A.weight` `[rank, in]`,
`diffusion_model.P.lora_B.weight` `[out, rank]` and optionally `diffusion_model.P.alpha` (scalar); the kohya spelling
`lora_down` / `lora_up` is read the same way. `read_lora` reads only the file's header and the alpha scalars (an
index of the pairs with their shapes); the A / B tensors are read from the memory-mapped file when a layer is fused,
so a rank reads only the pairs it fuses.

The fused weight is ComfyUI 0.33's (`comfy/model_patcher.py::patch_weight_to_device`; the facts and sources in
`models/requantize.py`): the weight in ComfyUI's LoRA patch dtype D (float32 on the CPU, float16 on recent GPUs; a
quantized weight dequantized into D), plus `((strength · alpha / rank) · B @ A).to(D)` for each LoRA in the order
given (B @ A in float32; alpha defaults to the rank), then put back in the layer's own format: a plain weight cast
to its dtype; an fp8 layer (`FP8Linear`) re-quantized with a recalculated per-tensor scale and ComfyUI's seeded
stochastic rounding; an int8 layer (`Int8Linear`, tensorwise, per row or ConvRot) re-quantized as comfy-kitchen does.
The seed is ComfyUI's `string_to_seed` of the layer's state-dict key in ComfyUI (`keymaps.comfyui_weight_key`). On
the CPU the bytes equal ComfyUI's (tests/test_lora_requant.py, goldens made by ComfyUI itself).

Memory: no full-precision copy of any layer is held while a LoRA is fused (one layer's patch-dtype copy exists
while that layer is computed). What is kept is the clean bytes of each touched layer — its weight as stored (bf16,
fp8 or int8) plus its scale — for an exact restore: the same bits come back, so stage 1 after a stage-2 LoRA equals
stage 1 with no LoRA. The new bytes are copied into the existing tensors (no tensor object changes: captured CUDA
graphs stay valid; `FP8Linear.scale_written` refreshes the scale copy their fp8 matmul reads).

On a fleet of W ranks (every rank holds a full working copy of the weights, docs/design/fleet.md#weights-and-loras)
each touched layer has one owner rank (largest layers first, each to the least-loaded rank):
- fuse: the owner alone reads the layer's LoRA pairs, keeps the layer's clean bytes, computes the fused weight and
  writes it in place; then every layer is broadcast from its owner into all ranks (`dist.broadcast` of the weight's
  bytes and of its scale: exact, gloo or NCCL). Reading and computing are split W ways and run on all ranks at once;
  every rank ends with bit-identical weights, equal to what one process computes.
- restore: the owner copies the clean bytes back and broadcasts them into the layer on every rank.
Clean bytes held per rank: ~1/W of the touched layers' stored bytes (`LoRAFuser.clean_bytes`), in pinned host
memory when the weights are on a GPU (`backup_device_for`, as ComfyUI keeps its backups on its offload device). The
checkpoint is not opened.

With sharded weights (`weights/sharding.py`: each rank holds rows of every block layer) each rank fuses every touched
layer itself: the layer is gathered whole (in model order on every rank), the fused weight computed and rounded
whole, as one process does (the same seed, the same random draws), and the rank's own rows written into its shard,
with those rows' clean bytes kept (~1/W of the touched bytes; in pinned host memory when the weights are on a GPU,
`backup_device_for`); a per-tensor or per-row scale is a whole buffer on every rank, written (and kept) whole.
Restore copies them back. No broadcast; the same bits as one process, row for row.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..models import keymaps
from ..models.fp8 import FP8Linear
from ..models.requantize import PATCH_DTYPES, PatchedWeight, lora_patched, string_to_seed
from .sharding import full_weight, is_dtensor, local_rows, local_shard
from ..protocol.stage_params import LORA_PAIR_SUFFIXES, lora_pair_keys, open_lora
from ..protocol.validation import ValidationError

_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "transformer.")
# (A suffix, B suffix): PEFT / LTX / ComfyUI spelling, kohya spelling
_OTHER_SUFFIXES = tuple(s for pair in LORA_PAIR_SUFFIXES for s in pair) + (".alpha",)


class LoRAError(ValidationError):
    """A LoRA that cannot be applied (no pairs, matches nothing, made for another model width): bad input, raised
    before any weight is touched (on every rank of a fleet alike, so the fleet stays usable)."""


@dataclass(frozen=True)
class LoRAPair:
    """Where one layer's pair lives in the file, and its shapes (from the header)."""

    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    alpha: float


class _LazyPairs(Mapping):
    """`module -> (A [r,in], B [out,r], alpha)`, read from the file on first access (all pairs at once)."""

    def __init__(self, lora: "LoRAFile"):
        self._lora, self._data = lora, None

    def _load(self) -> dict:
        if self._data is None:
            with self._lora.reader() as get:
                self._data = {name: get(name) for name in self._lora.index}
        return self._data

    def __getitem__(self, name):
        return self._load()[name]

    def __iter__(self):
        return iter(self._lora.index)  # no tensor read to list the names

    def __len__(self):
        return len(self._lora.index)

    def __contains__(self, name):
        return name in self._lora.index


@dataclass(eq=False)
class LoRAFile:
    """The low-rank pairs of one LoRA file, keyed by the transformer's (diffusers) module path.

    `index` holds each pair's keys, shapes and alpha (from the header); `reader()` reads tensors; `pairs` is the
    whole file as `module -> (A, B, alpha)` (read on first use)."""

    path: Path
    strength: float
    index: dict[str, LoRAPair]
    unmatched_keys: list[str] = field(default_factory=list)  # file keys that are not LoRA pairs we understand
    identity: tuple = ()  # (resolved path, size, mtime_ns): a changed file is a different LoRA

    def __post_init__(self):
        self.pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]] = _LazyPairs(self)

    @contextlib.contextmanager
    def reader(self) -> Iterator:
        """`with lora.reader() as get: a, b, alpha = get(module)` — one open (memory map) of the file."""
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            def get(name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
                pair = self.index[name]
                return f.get_tensor(pair.a_key), f.get_tensor(pair.b_key), pair.alpha
            yield get

    @property
    def key(self) -> tuple:
        return (self.identity or (str(self.path),), self.strength)


@dataclass
class LoRAReport:
    """Coverage of one fused LoRA: how many of its layers found a Linear in the model."""

    path: str
    strength: float
    matched: int
    total: int
    missing: tuple[str, ...] = field(default=(), compare=False)  # its layers this model does not have
    stage: str = field(default="", compare=False)

    def __str__(self) -> str:
        where = f"{self.stage}: " if self.stage else ""
        return f"{where}{Path(self.path).name} @ {self.strength:g}: {self.matched}/{self.total} layers applied"

    def detail(self, limit: int = 5) -> str:
        """`str(self)` plus the first `limit` layers that found no Linear in the model."""
        if not self.missing:
            return str(self)
        more = f" and {len(self.missing) - limit} more" if len(self.missing) > limit else ""
        return f"{self} (not in this model: {', '.join(self.missing[:limit])}{more})"


def parse_lora_arg(arg: str) -> tuple[str, float]:
    """`PATH[:STRENGTH]` -> (path, strength); strength defaults to 1.0. Raises ValueError for a bad strength."""
    path, sep, strength = arg.rpartition(":")
    if not sep or "/" in strength or "\\" in strength or not strength:  # no strength; ':' of a Windows drive
        return arg, 1.0
    try:
        value = float(strength)
    except ValueError:
        raise ValueError(f"LoRA argument {arg!r}: strength {strength!r} is not a number (use PATH:STRENGTH)") from None
    if not math.isfinite(value):  # nan / inf would fuse non-finite weights
        raise ValueError(f"LoRA argument {arg!r}: strength {strength!r} must be a finite number")
    return path, value


def _module_name(base: str) -> str:
    for prefix in _PREFIXES:
        if base.startswith(prefix):
            base = base[len(prefix):]
            break
    return keymaps.transformer_to_diffusers(base)


def read_lora(path: str | Path, strength: float = 1.0) -> LoRAFile:
    """Index a LoRA file: its pairs per transformer module path, with shapes and alpha (no A / B tensor is read).

    Raises FileNotFoundError for a missing file and LoRAError (a ValueError) naming the file when it holds no LoRA
    pairs, a pair lacks its B half, or the strength is not a finite number.
    """
    path = Path(path)
    try:
        handle = open_lora(path, strength)
    except ValueError as exc:
        raise LoRAError(str(exc)) from None
    with handle as f:
        keys = list(f.keys())
        try:
            pairs = lora_pair_keys(path, keys)
        except ValueError as exc:
            raise LoRAError(str(exc)) from None
        key_set = set(keys)
        index = {}
        for base, key, b_key in pairs:
            a_shape = tuple(f.get_slice(key).get_shape())
            b_shape = tuple(f.get_slice(b_key).get_shape())
            if len(a_shape) != 2 or len(b_shape) != 2:
                raise LoRAError(f"{path}: {key} / {b_key} are not matrices ({a_shape}, {b_shape})")
            alpha = float(f.get_tensor(base + ".alpha")) if base + ".alpha" in key_set else float(a_shape[0])
            index[_module_name(base)] = LoRAPair(key, b_key, a_shape, b_shape, alpha)
    unmatched = [key for key in keys if not key.endswith(_OTHER_SUFFIXES)]
    st = path.stat()
    return LoRAFile(path, float(strength), index, unmatched, (str(path.resolve()), st.st_size, st.st_mtime_ns))


def read_loras(specs) -> list[LoRAFile]:
    """`[(path, strength), …]` (or `{"path", "strength"}` dicts, or LoRAFiles, passed through) -> indexed
    LoRAFiles, in order. Raises LoRAError for an entry of another form, FileNotFoundError for a missing file."""
    out = []
    for spec in specs or ():
        if isinstance(spec, LoRAFile):
            out.append(spec)
            continue
        try:
            path, strength = (spec["path"], spec.get("strength", 1.0)) if isinstance(spec, dict) else spec
            strength = float(strength)
        except (TypeError, ValueError, KeyError):
            raise LoRAError(f"LoRA entry {spec!r}: expected (path, strength)") from None
        out.append(read_lora(path, strength))
    return out


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each item: largest first, each to the rank with the fewest bytes so far (ties: lower rank,
    then earlier item). Deterministic, so every rank computes the same map."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


@dataclass
class _Fused:
    name: str
    layer: nn.Module
    owner: int


@dataclass(frozen=True)
class _Clean:
    """The clean bytes of one fused layer that this rank keeps: its shard of the weight as stored (the whole weight
    when it is not sharded) and, for an fp8 / int8 layer, its scale (a whole buffer)."""

    weight: torch.Tensor
    scale: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale) if t is not None)


@dataclass(frozen=True)
class FuseStats:
    """What one `LoRAFuser.fuse` did on this rank: layers fused, of them owned by this rank (it keeps their clean
    bytes), LoRA pairs read, clean_bytes (the clean weight bytes and scales this rank keeps), fused_bytes
    (full-precision copies of layers held while fused: 0 — fused layers are re-quantized into their own format), and
    its wall time in seconds."""

    layers: int
    owned: int
    pairs_read: int
    clean_bytes: int
    fused_bytes: int
    seconds: float


@dataclass(frozen=True)
class RestoreStats:
    """What one `LoRAFuser.restore` did: layers restored and its wall time in seconds."""

    layers: int
    seconds: float


def backup_device_for(weight_device: torch.device, sharded: bool,
                      configured: torch.device | None = None) -> torch.device:
    """Where a rank keeps the clean bytes of a fused layer: `configured` when given; for a GPU weight pinned host
    memory — as ComfyUI keeps its patch backups on its offload device — so that a fused LoRA costs the GPU nothing
    beyond the model (a LoRA on every block of the 22B fp8 model touches 17 GiB: on the GPU that would be 17 GiB in
    one process, ~17/W GiB per owner rank of a replicated fleet; measured in bench/results/sharded_lora_h100.txt);
    restore copies the clean bytes back over PCIe. CPU weights: their own device. `sharded` (the layer is sharded
    over the ranks) does not change the rule; it is kept for the callers' clarity."""
    if configured is not None:
        return configured
    if weight_device.type == "cuda":
        return torch.device("cpu")
    return weight_device


def _quantized(layer: nn.Module) -> bool:
    return isinstance(layer, FP8Linear)  # fp8, and int8 (`Int8Linear` is a subclass)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 view of the same memory (any dtype, 0-d included): copies and broadcasts through
    it are exact and land in `t`. Raises RuntimeError for a tensor whose memory is not one contiguous run (a copy
    would silently write elsewhere)."""
    return t.detach().view(-1).view(torch.uint8)


class LoRAFuser:
    """Fuses LoRAs into a transformer's Linear weights as ComfyUI applies them and restores the originals exactly.

    Usage: `fuser = LoRAFuser(transformer); reports = fuser.fuse([lora, ...]); ...; fuser.restore()`;
    `fuser.apply(set)` fuses a set unless that very set is already fused (and restores for an empty set).

    Args:
        model: the transformer (every rank's own full copy on a fleet), or a module holding the text connectors as
            `video_connector` / `audio_connector`.
        rank, world_size, group: this rank in the process group whose ranks fuse together (`world_size` 1: one
            process, no communication). `rank` is the rank within `group` (None = the default group).
        backup_device: where the clean bytes are kept (None: `backup_device_for`'s choice — pinned host memory for
            CUDA weights, else the weight's device).
        patch_dtype: the dtype the LoRA is patched in (None: ComfyUI's rule for the weight's device,
            `models.requantize.lora_compute_dtype`).
        use_kitchen: None = comfy-kitchen's quantizers when installed, False = the torch steps (the same bits on CPU).
        seed_key: module path -> the ComfyUI state-dict key whose `string_to_seed` seeds the stochastic rounding
            (default `keymaps.comfyui_weight_key`).
    Every rank of the group must call `fuse` / `apply` / `restore` with the same LoRA sets, in the same order.
    Raises ValueError for a `patch_dtype` other than float32, float16 or bfloat16.
    """

    def __init__(self, model: nn.Module, rank: int = 0, world_size: int = 1, group=None,
                 backup_device: torch.device | str | None = None, patch_dtype: torch.dtype | None = None,
                 use_kitchen: bool | None = None, seed_key: Callable[[str], str] = keymaps.comfyui_weight_key):
        if patch_dtype is not None and patch_dtype not in PATCH_DTYPES:
            raise ValueError(f"LoRA patch_dtype {patch_dtype}: choose one of "
                             f"{', '.join(str(d).replace('torch.', '') for d in PATCH_DTYPES)} (or None: ComfyUI's "
                             f"choice for the device)")
        self.model = model
        self.rank, self.world_size, self.group = rank, world_size, group
        self.backup_device = None if backup_device is None else torch.device(backup_device)
        self.patch_dtype, self.use_kitchen, self.seed_key = patch_dtype, use_kitchen, seed_key
        self._backup: dict[str, _Clean] = {}  # module path -> the clean bytes this rank keeps (owned layers)
        self._fused: list[_Fused] = []
        self._key: tuple | None = None
        self._reports: list[LoRAReport] = []
        self._modules: dict[str, nn.Module] | None = None
        self._sharded = False  # the fused set's layers are sharded over the ranks (set by `fuse`)
        # what the latest fuse and restore did (diagnostics for the bench and the tests; None before the first)
        self.fuse_stats: FuseStats | None = None
        self.restore_stats: RestoreStats | None = None

    # ---- state -----------------------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._fused)

    @property
    def sharded(self) -> bool:
        """The fused layers are sharded over the ranks (`weights/sharding.py`): each rank fuses every layer itself
        — its own rows of a sharded layer (gathered whole first, in model order on every rank), the whole of a
        replicated one — and keeps the clean bytes of what it holds; nothing is broadcast."""
        return self._sharded

    @property
    def clean_bytes(self) -> int:
        """Bytes of clean weights (as stored: bf16, fp8 or int8, with their scales) this rank keeps for the fused
        set: ~1/W of the touched layers' bytes on a fleet of W ranks."""
        return sum(c.nbytes for c in self._backup.values())

    @property
    def fused_names(self) -> list[str]:
        return [f.name for f in self._fused]

    def owned(self) -> list[str]:
        """Names of the fused layers this rank owns."""
        return [f.name for f in self._fused if f.owner == self.rank]

    def _named_modules(self) -> dict[str, nn.Module]:
        if self._modules is None:
            self._modules = dict(self.model.named_modules())
        return self._modules

    # ---- planning (no weight touched, identical on every rank) -----------------------------------------------------

    def check(self, loras: list[LoRAFile], stage: str = "") -> list[LoRAReport]:
        """Coverage reports of a set, raising LoRAError for a LoRA that matches no layer or whose shapes do not fit
        the model (another model width), naming the file, the key and both shapes. Touches nothing."""
        return self._plan(loras, stage)[0]

    def _plan(self, loras: list[LoRAFile], stage: str = ""):
        modules = self._named_modules()
        reports = []
        terms: dict[str, list[tuple[int, str, float]]] = {}  # module -> [(lora index, module, scale)]
        for i, lora in enumerate(loras):
            matched, missing = 0, []
            for name, pair in lora.index.items():
                layer = modules.get(name)
                if not isinstance(layer, (nn.Linear, FP8Linear)):
                    missing.append(name)
                    continue
                a, b = pair.a_shape, pair.b_shape
                if a[1] != layer.in_features or b[0] != layer.out_features or b[1] != a[0]:
                    raise LoRAError(
                        f"{lora.path}: LoRA for {name} has A {a}, B {b} but the layer is "
                        f"{layer.in_features} -> {layer.out_features}; was it made for another model?")
                # ComfyUI's factor: strength · (alpha / rank), alpha / rank taken first
                terms.setdefault(name, []).append((i, name, lora.strength * (pair.alpha / a[0])))
                matched += 1
            if matched == 0:
                raise LoRAError(f"{lora.path}: none of its {len(lora.index)} LoRA layers matches a Linear of this "
                                f"transformer (e.g. {next(iter(lora.index))})")
            reports.append(LoRAReport(str(lora.path), lora.strength, matched, len(lora.index), tuple(missing),
                                      stage))
        order = [n for n in modules if n in terms]  # model order: the same on every rank, whatever the files
        return reports, [(n, modules[n], terms[n]) for n in order]

    def _check_host_room(self, plan) -> None:
        """The clean bytes a fuse keeps in host memory must fit it: with the backup on the host (`backup_device_for`:
        pinned host memory for GPU weights, the weights' own memory for CPU ranks), every rank of the fleet — one
        host — keeps its share, so the fleet's whole copy of the touched layers (stored bytes, scales included:
        `host_clean_bytes`) is checked against the host's room (`protocol.resources.available_memory`: MemAvailable
        or the room under the cgroup's memory limit, the smaller; the smallest any rank read, one all_reduce MIN, so
        every rank refuses together). Raises LoRAError with the numbers, before any weight is touched; nothing is
        checked where the backup is not on the host or the system reports no memory."""
        from ..protocol.resources import GIB, memory_room

        if not plan:
            return
        weight = local_shard(plan[0][1].weight)
        if backup_device_for(weight.device, False, self.backup_device).type != "cpu":
            return
        need = host_clean_bytes(plan, self.world_size)
        room = memory_room()
        available = room.available_bytes
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            least = torch.tensor([-1 if available is None else available], dtype=torch.int64,
                                 device=weight.device if weight.device.type == "cuda" else "cpu")
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.group)
            available = None if int(least.item()) < 0 else int(least.item())
        if available is None or need <= available:
            return
        where = "pinned host memory" if weight.device.type == "cuda" else "host memory"
        raise LoRAError(f"LoRA: fusing it keeps the clean bytes of the {len(plan)} layers it touches in {where}: "
                        f"{need / GIB:.1f} GiB over the fleet's {self.world_size} rank(s), more than the "
                        f"{available / GIB:.1f} GiB available ({room.source}); use a LoRA on fewer layers, fewer "
                        f"ranks, or raise the memory limit")

    # ---- fuse / restore --------------------------------------------------------------------------------------------

    def apply(self, loras: list[LoRAFile], stage: str = "") -> list[LoRAReport]:
        """Make `loras` the fused set: nothing to do when exactly this set (same files, same strengths, same order)
        is fused; restore for an empty set; otherwise restore and fuse."""
        key = tuple(lora.key for lora in loras)
        if not loras:
            self.restore()
            return []
        if self.active and key == self._key:
            return [LoRAReport(r.path, r.strength, r.matched, r.total, r.missing, stage) for r in self._reports]
        return self.fuse(loras, stage)

    def fuse(self, loras: list[LoRAFile], stage: str = "") -> list[LoRAReport]:
        """Add every LoRA's delta to the matching Linears, as ComfyUI does (module docstring). Restores first if
        something is fused.

        Raises LoRAError (before touching any weight) for a LoRA that matches no layer, or whose shapes do not fit
        the model (a LoRA for another model width), naming the file, the key and both shapes.
        """
        self.restore()
        reports, plan = self._plan(loras, stage)
        self._check_host_room(plan)
        t0 = time.perf_counter()
        owners = assign_owners([layer.weight.numel() for _, layer, _ in plan], self.world_size)
        self._sharded = any(is_dtensor(layer.weight) for _, layer, _ in plan)
        if self.sharded:  # every rank fuses every layer into what it holds: no owner, no broadcast
            owners = [self.rank] * len(plan)
        fused = [_Fused(name, layer, owner) for (name, layer, _), owner in zip(plan, owners)]
        pairs_read = 0
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                getters = {}
                # 1. each rank computes the layers it owns (all ranks at once), keeping their clean bytes
                for (name, layer, terms), item in zip(plan, fused):
                    if item.owner != self.rank:
                        continue
                    values = []
                    for i, module, scale in terms:
                        if i not in getters:
                            getters[i] = stack.enter_context(loras[i].reader())
                        a, b, _ = getters[i](module)
                        values.append((a, b, scale))
                        pairs_read += 1
                    weight = full_weight(layer.weight)  # gathered whole when sharded (a collective, model order)
                    patched = lora_patched(layer, weight, values, string_to_seed(self.seed_key(name)),
                                           self.patch_dtype, self.use_kitchen)
                    del weight, values
                    self._fused.append(item)  # from here on, restore() undoes it
                    self._write(name, layer, patched)
                    del patched
            # 2. every fused layer from its owner into every rank (the same order on all ranks)
            self._fused = fused  # model order; restore() and the rollback walk this list
            if self.world_size > 1 and not self.sharded:
                with torch.no_grad():
                    for item in fused:
                        self._broadcast_layer(item.layer, item.owner)
                        if _quantized(item.layer):
                            item.layer.lora_fused = True
        except BaseException:
            self._rollback_local()
            raise
        self._key = tuple(lora.key for lora in loras)
        self._reports = reports
        self.fuse_stats = FuseStats(layers=len(fused), owned=sum(f.owner == self.rank for f in fused),
                                    pairs_read=pairs_read, clean_bytes=self.clean_bytes, fused_bytes=0,
                                    seconds=_seconds_since(t0, self._device()))
        return reports

    def restore(self) -> None:
        """Put back the exact original bytes of every fused layer (on a fleet: from their owners)."""
        if not self.active:
            return
        t0 = time.perf_counter()
        layers, device = len(self._fused), self._device()
        with torch.no_grad():
            for item in self._fused:
                if item.owner == self.rank:
                    self._put_back(item.name, item.layer)
                if self.world_size > 1 and not self.sharded:
                    self._broadcast_layer(item.layer, item.owner)
                if _quantized(item.layer):
                    item.layer.lora_fused = False
        self._clear()
        self.restore_stats = RestoreStats(layers=layers, seconds=_seconds_since(t0, device))

    def after_error(self) -> None:
        """After a failed or cancelled job: one process restores now. A fleet keeps its (rank-consistent) fused set
        until the next `apply` / `restore`, which every rank calls at the start of its next job: a collective
        restore here could meet ranks that are elsewhere (an SP sub-group cancelled while the other ranks wait for
        its result; an asymmetric failure, after which the fleet is torn down anyway)."""
        if self.world_size == 1:
            self.restore()

    # ---- helpers ---------------------------------------------------------------------------------------------------

    def _write(self, name: str, layer: nn.Module, patched: PatchedWeight) -> None:
        """Keep the clean bytes this rank holds of `layer`, then write the patched weight's rows this rank holds (and
        the new scale, whole) into the layer's own tensors, in place."""
        shard = local_shard(layer.weight)
        scale = getattr(layer, "weight_scale", None) if _quantized(layer) else None
        self._backup[name] = _Clean(self._keep(shard.detach()), None if scale is None else self._keep(scale))
        _byte_view(shard).copy_(_byte_view(local_rows(layer.weight, patched.weight).contiguous()))
        if scale is not None:
            _byte_view(scale).copy_(_byte_view(patched.scale.contiguous()))
            layer.scale_written()
            layer.lora_fused = True

    def _put_back(self, name: str, layer: nn.Module) -> None:
        clean = self._backup.pop(name)
        _byte_view(local_shard(layer.weight)).copy_(_byte_view(clean.weight))
        if clean.scale is not None:
            _byte_view(layer.weight_scale).copy_(_byte_view(clean.scale))
            layer.scale_written()

    def _broadcast_layer(self, layer: nn.Module, owner: int) -> None:
        """The layer's weight (and scale) bytes from group rank `owner` into every rank."""
        self._broadcast(layer.weight, owner)
        if _quantized(layer):
            self._broadcast(layer.weight_scale, owner)
            layer.scale_written()

    def _clear(self) -> None:
        self._backup.clear()
        self._fused = []
        self._key, self._reports = None, []

    def _rollback_local(self) -> None:
        """After a failure inside `fuse`: put back what this rank changed, without communication (on a fleet a
        failure here is not symmetric: the fleet is torn down, this only leaves the process consistent)."""
        with torch.no_grad():
            for item in self._fused:
                if item.name in self._backup:
                    self._put_back(item.name, item.layer)
                if _quantized(item.layer):
                    item.layer.lora_fused = False
        self._clear()

    def _keep(self, clean: torch.Tensor) -> torch.Tensor:
        """A copy of clean bytes on the backup device (pinned host memory for a GPU tensor kept on the host)."""
        device = backup_device_for(clean.device, self.sharded, self.backup_device)
        if device.type == "cpu" and clean.device.type == "cuda":
            return torch.empty(clean.shape, dtype=clean.dtype, pin_memory=True).copy_(clean)
        return clean.to(device, copy=True)

    def _broadcast(self, tensor: torch.Tensor, owner: int) -> None:
        """Broadcast the bytes of `tensor` from group rank `owner` (uint8 view: exact for every dtype and backend)."""
        src = owner if self.group is None else dist.get_global_rank(self.group, owner)
        dist.broadcast(_byte_view(tensor), src=src, group=self.group)

    def _device(self) -> torch.device | None:
        return next((f.layer.weight.device for f in self._fused), None)


def host_clean_bytes(plan, world_size: int) -> int:
    """Bytes of clean weights a fleet of `world_size` ranks keeps in all for a fuse `plan` ((name, layer, terms) per
    touched layer): each layer's stored weight bytes once (one owner, or 1/W on each rank when sharded), and its
    scale on each rank that keeps one (every rank of a sharded layer)."""
    total = 0
    for _, layer, _ in plan:
        weight = layer.weight
        total += weight.numel() * weight.element_size()
        scale = getattr(layer, "weight_scale", None) if _quantized(layer) else None
        if scale is not None:
            total += scale.numel() * scale.element_size() * (world_size if is_dtensor(weight) else 1)
    return total


def _seconds_since(t0: float, device: torch.device | None) -> float:
    """Wall time since `t0`, after the device's queued work (the broadcasts, the copies) has finished."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
