"""What a fleet is and how it runs its jobs: `FleetIdentity` (the processes and what they load), `FleetPolicy` (how
jobs are split, per job), `FleetConfig` (the two as the CLI and the nodes ask for them), and what the controller
answers with: `FleetPlan` (the split the fleet computed for a policy) and `FleetHandle` (a client's reference).
Standard library only: the nodes build these without importing torch. The rules between fields and across the two
parts (sharded × compile, sharded × the split, degrees and heads) are `fleet_rules.py`'s (`check_fleet`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from .fleet_rules import INT8_COMPUTE_MODES, WEIGHT_MODES, WeightPlacement, check_int8_mode  # noqa: F401 - nodes

DTYPES = ("float32", "bfloat16", "float16")
GUIDANCE_PARALLEL_MODES = ("auto", "on", "off")  # = splits/passes.py MODES (not imported: no torch here)
GEMMA_MODES = ("replicated", "batch_parallel", "sharded")  # = stages/text_encoder.py MODES


def _positive(what: str, value, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ValueError(f"{what}={value!r}: must be a positive {'integer' if integer else 'number'}"
                         f"{' or None' if allow_none else ''}")


@dataclass(frozen=True)
class FleetIdentity:
    """What a fleet's processes are: a different identity needs new workers (and a fresh load of the weights).

    The controller decides "same fleet" from this alone (`FleetConfig.identity`); everything else is `FleetPolicy`,
    applied to the running fleet per job.

    devices: one entry per rank, e.g. ("cuda:0", "cuda:1") or ("cpu", "cpu").
    checkpoint / gemma / upscaler / video_vae / audio_vae / text_projection: the model files the workers load.
    dtype: compute dtype name (`DTYPES`).
    threads_per_worker: torch intra-op threads per CPU worker (1 for tests, so reductions match).
    collective_timeout_s: bounded collective waits; it is given to `init_process_group` and every group at fleet start
        (PyTorch's defaults are 10 min for NCCL and 30 min for gloo), so it cannot change on running processes.
    sequence_parallel: False: every rank computes every stage whole, no parallel plan (debugging).
    transformer_only: the workers load the transformer and its text connectors only (a transformer-only
        `diffusion_models/` file is enough): the fleet of the native MODEL (Load Diffusion Model (MGPU)), where
        ComfyUI's own loaders provide the VAEs and the text encoder. Only the transformer's jobs run on it
        (`worker.TRANSFORMER_JOBS`); the stage jobs are refused by name.
    gemma_mode: Gemma text encoder layout (`GEMMA_MODES`, stages/text_encoder.py): "replicated" (a replica per rank, each
        encodes everything), "batch_parallel" (a replica per rank, prompts split over ranks) or "sharded" (one copy
        over every device, run from rank 0, embeddings broadcast); it decides what is loaded at start (jobs may ask
        for another mode: Gemma is then reloaded).
    gemma_unload: free Gemma after each encode (reloaded on the next cache miss), not loaded at start.
    gemma_reserve_gib: kept free on every fleet device when planning Gemma's memory (for the transformer).
    gemma_max_memory: per-device caps for Gemma, Accelerate max_memory style: (("cuda:0", "20GiB"), ("cpu", "64GiB"));
        a device named here that is not a fleet device ("cpu", "disk") takes the sharded layers the GPUs cannot hold.
    weights: the transformer's weights over the ranks (`WEIGHT_MODES`, placed by `fleet_rules.place_weights` at
        load): "auto" (the default: "replicated" when a replica and one forward fit every GPU's budget, else
        "placed"), "replicated" (every rank holds the whole transformer: the latency mode; refused at load when it
        does not fit), "placed" (as many blocks whole as the budget allows, the rest sharded: see "sharded") or
        "sharded" (each rank holds 1/W of every block, FSDP2, gathered block by block as it runs: the memory mode).
        Whenever some block is sharded every forward runs sequence parallel over all ranks, and the world size must
        divide the attention heads (fleet_rules.py); for "auto" / "placed" that is known once the workers have
        placed the weights.
    gpu_budget_gib: the memory (GiB) the pack may use on each GPU for the transformer's weights and one forward
        (`fleet_rules.place_weights`); None = each GPU's free memory at load. On CUDA it is also made a hard cap
        (`torch.cuda.set_per_process_memory_fraction`), so one 80 GB card can stand for a 24 GB one; the cap covers
        all the worker allocates on that GPU (a Gemma resident there too: see `gemma_reserve_gib`). The ranks
        place the weights in the smallest budget of the fleet (mixed cards: the larger card's extra memory holds no
        weights). On CPU ranks: None = unbounded (every block whole).
    int8_compute: how an int8(-convrot) transformer file computes (`INT8_COMPUTE_MODES`, fleet_rules.py
        `resolve_int8_compute`): "w8a8" (int8 weights resident, activations quantized per token: ComfyUI's result),
        "dequantize" (the weights dequantized to `dtype` at load, as ComfyUI dequantizes them: bf16 speed, 2× those
        weights' memory; refused at start, naming the sizes, when they would not fit the GPU, and here with sharded
        weights) or "auto" (CUDA: "dequantize" when a dequantized replica fits, else "w8a8"; CPU and sharded
        weights: "w8a8"). Files without int8 layers ignore it.

    Raises ValueError (naming the field, the value and the rule) on construction.
    """

    devices: tuple[str, ...]
    checkpoint: str
    gemma: str | None
    upscaler: str | None = None
    video_vae: str | None = None
    audio_vae: str | None = None
    text_projection: str | None = None
    dtype: str = "float32"
    threads_per_worker: int = 1
    collective_timeout_s: float = 300.0
    sequence_parallel: bool = True
    transformer_only: bool = False
    gemma_mode: str = "replicated"
    gemma_unload: bool = False
    gemma_reserve_gib: float = 0.0
    gemma_max_memory: tuple[tuple[str, str], ...] | None = None
    weights: str = "auto"
    int8_compute: str = "auto"
    gpu_budget_gib: float | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights={self.weights!r}: choose one of {', '.join(WEIGHT_MODES)}")
        check_int8_mode(self.weights, self.int8_compute)  # the fleet's rule (fleet_rules.py)
        if (not isinstance(self.devices, tuple) or not self.devices
                or not all(isinstance(d, str) and d for d in self.devices)):
            raise ValueError(f"devices={self.devices!r}: must be a non-empty tuple of device names, one per rank "
                             f"(e.g. ('cuda:0', 'cuda:1') or ('cpu', 'cpu'))")
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(f"checkpoint={self.checkpoint!r}: must be the path of a .safetensors file")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        _positive("threads_per_worker", self.threads_per_worker, integer=True)
        _positive("collective_timeout_s", self.collective_timeout_s)
        if self.gemma_mode not in GEMMA_MODES:
            raise ValueError(f"gemma_mode={self.gemma_mode!r}: choose one of {', '.join(GEMMA_MODES)}")
        if isinstance(self.gemma_reserve_gib, bool) or not isinstance(self.gemma_reserve_gib, (int, float)) \
                or self.gemma_reserve_gib < 0:
            raise ValueError(f"gemma_reserve_gib={self.gemma_reserve_gib!r}: must be 0 or a positive number of GiB")
        if self.gpu_budget_gib is not None and (
                isinstance(self.gpu_budget_gib, bool) or not isinstance(self.gpu_budget_gib, (int, float))
                or not math.isfinite(self.gpu_budget_gib) or self.gpu_budget_gib <= 0):
            raise ValueError(f"gpu_budget_gib={self.gpu_budget_gib!r}: must be a positive, finite number of GiB per "
                             f"GPU, or None (each GPU's free memory at load)")

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def serves(self, other: FleetIdentity) -> bool:
        """True when a running fleet of this identity runs `other`'s jobs without new workers: the same identity, or
        `other` is transformer-only (Load Diffusion Model (MGPU): the native MODEL's forward jobs) and this fleet,
        loading the whole checkpoint, loads that transformer the same way — every field of `TRANSFORMER_FIELDS`
        equal (the same file, devices, dtype, weights mode, int8 path, budget …). Two loaders of one prompt on one
        file then share one fleet instead of rebuilding it for each other's jobs (issue 36). A transformer-only
        fleet never serves a whole-checkpoint identity: it holds no Gemma, VAEs or upscaler."""
        if self == other:
            return True
        return (other.transformer_only and not self.transformer_only
                and all(getattr(self, name) == getattr(other, name) for name in TRANSFORMER_FIELDS))


# the fields that decide how a fleet loads and runs its transformer (`FleetIdentity.serves`); the others (Gemma, the
# VAEs, the upscaler, the text projection, transformer_only) decide only what else it loads
TRANSFORMER_FIELDS = ("devices", "checkpoint", "dtype", "threads_per_worker", "collective_timeout_s",
                      "sequence_parallel", "weights", "int8_compute", "gpu_budget_gib")


@dataclass(frozen=True)
class FleetPolicy:
    """How a running fleet splits and watches its jobs: changed per job, never restarting a worker or re-reading a
    file (the groups of every degree are built at fleet start: `splits/plan.py build_plan`).

    sp_degree: the largest sequence-parallel degree a stage may use; None = the largest that divides the heads and
        fits the ranks (checked against the checkpoint's heads by the controller, `check_config`).
    min_tokens_per_rank: None = on CUDA the cost model (splits/cost.py) picks each SP stage's degree, on CPU the
        full degree; an int = SP on fewer ranks when a stage has fewer video tokens per rank than this (0: always the
        full degree).
    guidance_parallel: guided stages (splits/passes.py, `GUIDANCE_PARALLEL_MODES`): "auto" (CUDA: the guidance
        passes of each step on different ranks when the cost model predicts it faster than the stage's sequence
        parallelism; CPU: sequence parallel), "on" (whenever a stage has more than one pass per step and the fleet
        more than one rank) or "off".
    token_cap: video tokens per rank per SP forward; larger jobs are refused before work, the refusal naming the
        longest clip that fits. "auto" (the default): on CUDA the memory plan's cap for each SP degree
        (`protocol/memory_plan.py`, from the memory the rank has left after its weights), elsewhere 65,536; an int:
        that cap; None: no cap.
    init_timeout_s: how long a fleet start may take (used when the controller starts a fleet for this policy).
    stall_timeout_s: a job with no step progress for this long is declared hung and the fleet torn down.
    compile: regional torch.compile of the transformer blocks (mgpu_backend/engine/compile.py): the first job at each size
        pays the compile, later jobs run faster (docs/cli.md, "compile"). Switching it off restores the eager blocks
        (`compile.uncompile_blocks`; dynamo keeps its cache for a later switch on).

    Raises ValueError (naming the field, the value and the rule) on construction.
    """

    sp_degree: int | None = None
    min_tokens_per_rank: int | None = None
    guidance_parallel: str = "auto"
    token_cap: int | str | None = "auto"
    init_timeout_s: float = 120.0
    stall_timeout_s: float = 300.0
    compile: bool = False

    def __post_init__(self) -> None:
        _positive("sp_degree", self.sp_degree, integer=True, allow_none=True)
        if self.min_tokens_per_rank is not None and (isinstance(self.min_tokens_per_rank, bool) or not isinstance(
                self.min_tokens_per_rank, int) or self.min_tokens_per_rank < 0):
            raise ValueError(f"min_tokens_per_rank={self.min_tokens_per_rank!r}: must be 0 (always every rank), a "
                             f"positive video-token count, or None (the cost model on CUDA)")
        if self.guidance_parallel not in GUIDANCE_PARALLEL_MODES:
            raise ValueError(f"guidance_parallel={self.guidance_parallel!r}: choose one of "
                             f"{', '.join(GUIDANCE_PARALLEL_MODES)}")
        if self.token_cap != "auto":
            _positive("token_cap", self.token_cap, integer=True, allow_none=True)
        _positive("init_timeout_s", self.init_timeout_s)
        _positive("stall_timeout_s", self.stall_timeout_s)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r}: must be True or False")


_IDENTITY_FIELDS = frozenset(f.name for f in fields(FleetIdentity))
_POLICY_FIELDS = frozenset(f.name for f in fields(FleetPolicy))


@dataclass(frozen=True, init=False)
class FleetConfig:
    """What the CLI and the nodes ask for: a fleet identity (`FleetIdentity`: the processes and what they load) and a
    policy (`FleetPolicy`: how jobs are split). The controller reuses a running fleet whenever `identity` is unchanged
    and applies `policy` to each job; the two classes declare and check the fields.

    Built from its parts, `FleetConfig(identity, policy)` (policy: `FleetPolicy()` when left out), or from their
    fields as keywords, `FleetConfig(devices=…, checkpoint=…, gemma=…, sp_degree=2)`: each keyword goes to the part
    that declares it (with a part given, it replaces that part's field; `dataclasses.replace` works so). A field
    reads from its part: `config.devices` is `config.identity.devices`, `config.sp_degree` `config.policy.sp_degree`.

    Raises TypeError for a keyword neither part declares or a part of another type; ValueError (naming the field, the
    value and the rule) from the part whose rule a value breaks.
    """

    identity: FleetIdentity
    policy: FleetPolicy

    def __init__(self, identity: FleetIdentity | None = None, policy: FleetPolicy | None = None, **fields) -> None:
        unknown = sorted(set(fields) - _IDENTITY_FIELDS - _POLICY_FIELDS)
        if unknown:
            raise TypeError(f"FleetConfig: unknown field(s) {', '.join(unknown)}: neither FleetIdentity nor "
                            f"FleetPolicy has them")
        for name, part, cls in (("identity", identity, FleetIdentity), ("policy", policy, FleetPolicy)):
            if part is not None and not isinstance(part, cls):
                raise TypeError(f"FleetConfig: {name}={type(part).__name__}: must be a {cls.__name__}")
        own = {k: v for k, v in fields.items() if k in _IDENTITY_FIELDS}
        identity = FleetIdentity(**own) if identity is None else replace(identity, **own) if own else identity
        own = {k: v for k, v in fields.items() if k in _POLICY_FIELDS}
        policy = FleetPolicy(**own) if policy is None else replace(policy, **own) if own else policy
        object.__setattr__(self, "identity", identity)
        object.__setattr__(self, "policy", policy)

    def __getattr__(self, name: str):
        """A field of the identity or the policy (only called for names the config itself does not have)."""
        part = "identity" if name in _IDENTITY_FIELDS else "policy" if name in _POLICY_FIELDS else None
        if part is None or part not in self.__dict__:  # (unpickling looks names up before the parts are set)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__[part], name)

    @property
    def world_size(self) -> int:
        return self.identity.world_size


@dataclass(frozen=True)
class FleetPlan:
    """How a fleet splits its stages under one policy, as the fleet computed it (`Fleet.plan_for`, from the heads of
    the transformer its workers loaded and the degree rule of `fleet_rules.py`): shown by Load Checkpoint (MGPU).

    world_size: ranks in the fleet. heads: the transformer's video attention heads.
    sp_degree: the largest sequence-parallel degree a stage may use (ranks 0..sp_degree-1); 1 when the fleet runs
        without a parallel plan (`FleetIdentity.sequence_parallel` False). Each stage's own split (fewer ranks,
        guidance passes over ranks, one GPU) is chosen per job and reported with the job.
    valid_degrees: the degrees the heads allow on this fleet (`FleetPolicy.sp_degree` must be one of them).
    set_by_policy: `sp_degree` is the policy's explicit `FleetPolicy.sp_degree`, not the largest valid one.
    placement: where the workers placed the transformer's weights (`FleetIdentity.weights` resolved at load:
        `fleet_rules.WeightPlacement`, its `describe()` the load report's line); None: not reported. A report
        beside the split: not compared (two plans are equal when they split the same way).
    """

    world_size: int
    heads: int
    sp_degree: int
    valid_degrees: tuple[int, ...]
    set_by_policy: bool = False
    sequence_parallel: bool = True
    placement: WeightPlacement | None = field(default=None, compare=False)


@dataclass(frozen=True)
class FleetHandle:
    """A client's reference to a fleet; `generation` detects a handle from an older fleet. `config` is the client's
    own: its `identity` names the fleet, its `policy` is applied to each job the handle submits. `plan`: the split
    the fleet computed for that policy (None from a controller that predates it)."""

    generation: int
    config: FleetConfig
    worker_pids: tuple[int, ...] = ()
    plan: FleetPlan | None = None
