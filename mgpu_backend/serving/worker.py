"""One worker process per device: joins the process group, loads the weights once, runs jobs until told to stop.

Every rank runs the same job code in lockstep (SPMD). Cancel is decided by rank 0 and applied by all ranks at the
same step boundary: before each denoising step rank 0 broadcasts its cancel flag, so no collective is ever left
half-entered. Rank 0 streams progress and returns the result: latents by value, frames through shared memory
(`protocol/frames.py`).
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..protocol.fleet_config import FleetIdentity, FleetPolicy
from ..protocol.fleet_rules import check_int8_mode, check_policy, place_weights
from ..protocol.job_requests import JOB_STAGES, FaultSpec, JobSpec
from ..protocol.transport import Pickled, send_inline
from ..protocol.worker_messages import JobDone, JobFailed, JobProgress, JobStopped, RunJob, StopWorker, WorkerInitError, WorkerReady
from ..protocol.validation import ValidationError

ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# the jobs a transformer-only fleet (FleetConfig.transformer_only) can run: the native MODEL's and the diagnostics
TRANSFORMER_JOBS = frozenset({"forward", "preprocess_text", "noop", "frames"})


def clean_allocator_env(env: dict[str, str]) -> dict[str, str]:
    """Drop `backend:cudaMallocAsync` from the allocator settings ComfyUI sets (docs/design/fleet.md#start: inherited by
    workers it led to OOM at step 2 elsewhere); other allocator options are kept."""
    env = dict(env)
    for name in ALLOC_ENV:
        if name in env:
            kept = [p for p in env[name].split(",") if p.strip() and "cudaMallocAsync" not in p]
            if kept:
                env[name] = ",".join(kept)
            else:
                del env[name]
    return env


@dataclass
class JobContext:
    """What a job function sees of the fleet: its rank, the device, progress and the synchronized cancel check."""

    rank: int
    world_size: int
    device: torch.device
    job_id: str
    conn: Any
    cancel_flag: Any  # multiprocessing.Value('i'): set by the controller, read by rank 0 only
    heartbeat: Any  # multiprocessing.Array('d', 2 * world_size): per rank (steps done, wall time)
    fault: FaultSpec | None = None
    plan: Any = None  # parallel.plan.ParallelPlan
    stage: str = "setup"
    step: int = 0
    steps_done: int = 0

    def progress(self, stage: str, done: int, total: int) -> None:
        self.stage, self.step = stage, done
        if self.rank == 0:
            self.conn.send(JobProgress(self.job_id, stage, done, total))

    def step_boundary(self, stage: str, step: int, group=None) -> bool:
        """Called before each step by every rank of `group` (the process group of ranks 0..d-1 running the stage,
        as its runner passes it; None: the whole fleet); returns True (on those ranks) when the job is cancelled."""
        self.stage, self.step = stage, step
        # a test fault fires before the heartbeat: a rank that hangs (or dies) on its way to the boundary has begun
        # fewer steps than the ranks waiting for it in the broadcast, which is how the fleet names it
        self._maybe_fault(stage, step)
        self.steps_done += 1
        self.heartbeat[2 * self.rank] = self.steps_done
        self.heartbeat[2 * self.rank + 1] = time.time()
        flag = torch.tensor([int(self.cancel_flag.value) if self.rank == 0 else 0], dtype=torch.int32,
                            device=self.device if self.device.type == "cuda" else "cpu")
        if self.world_size > 1:
            dist.broadcast(flag, src=0, group=group)
        return bool(flag.item())

    def _maybe_fault(self, stage: str, step: int) -> None:
        f = self.fault
        if f is None or not f.fires(self.rank, stage, step):
            return
        if f.kind in ("error", "error_all"):
            raise RuntimeError(f"injected fault on rank {self.rank} at {stage} step {step}")
        if f.kind == "crash":
            os._exit(17)
        if f.kind == "stall":
            time.sleep(3600)
        if f.kind == "reread":  # counts as one more checkpoint open (tests that status() reports OPEN_COUNT)
            from ..models import loader

            loader.OPEN_COUNT += 1


class WorkerState:
    """The resident models of one rank (loaded once per fleet from its `FleetIdentity`, kept between jobs), and the
    policy (`FleetPolicy`) applied to them, which each job may change (`apply_policy`) without reloading."""

    def __init__(self, identity: FleetIdentity, policy: FleetPolicy, rank: int, device: torch.device):
        from ..models import loader
        from ..stages.text_encoder import TextEncoderService
        from ..splits.plan import build_plan
        from ..stages.pipelines import TwoStagePipeline
        from ..weights.sharding import agree_budget, rank_budget, shard_transformer

        dtype = getattr(torch, identity.dtype)
        self.config, self.rank, self.device, self.dtype = identity, rank, device, dtype
        # the weights' placement, before any weight (the fleet's rules: protocol/fleet_rules.py): the fleet's per-GPU
        # budget — free memory at load or gpu_budget_gib, the smallest over the ranks (one all_reduce MIN: every
        # rank must shard the same units) —, the int8 path in it, then which units are sharded (`place_weights`:
        # refused, naming the budget and the need, when even fully sharded they would not fit)
        self.budget = agree_budget(rank_budget(device, identity.gpu_budget_gib), device)
        self.int8_compute, int8_reason = loader.int8_path_for(identity, dtype, device, budget_bytes=self.budget)
        sizes = loader.weight_bytes(loader.identity_files(identity), dtype, transformer_only=identity.transformer_only,
                                    int8_dequantized=self.int8_compute == "dequantize")
        source = (f"gpu_budget_gib={identity.gpu_budget_gib:g}" if identity.gpu_budget_gib is not None else
                  "the smallest free memory of the fleet's GPUs at load")
        try:
            self.placement = place_weights(sizes, identity.world_size, self.budget, identity.weights,
                                           budget_from=source)
        except ValidationError as exc:
            raise ValidationError(f"{device}: {exc}") from None
        check_int8_mode(self.placement, self.int8_compute)
        sharded = self.placement.any_sharded
        # sharded units: loaded as a memory map on the host, then each rank moves only its shards (and the whole
        # modules) to the device
        load_device = torch.device("cpu") if sharded else device
        if identity.transformer_only:
            self.components = loader.load_components(identity.checkpoint, dtype=dtype, device=load_device,
                                                     transformer_only=True, int8_compute=self.int8_compute,
                                                     int8_reason=int8_reason)
        else:
            files = loader.ComponentFiles(video_vae=identity.video_vae, audio_vae=identity.audio_vae,
                                          text_projection=identity.text_projection, upsampler=identity.upscaler,
                                          text_encoder=identity.gemma)
            self.components = loader.load_components(identity.checkpoint, files, dtype=dtype, device=load_device,
                                                     int8_compute=self.int8_compute, int8_reason=int8_reason)
        c = self.components
        self.sharding = shard_transformer(c.transformer, device, connectors=(c.video_connector, c.audio_connector),
                                          placement=self.placement)  # collective when a unit is sharded
        if sharded:
            for module in c.modules().values():
                if module not in (c.transformer, c.video_connector, c.audio_connector):
                    module.to(device)
        # Gemma as the fleet's text service (mode, memory plan, prompt cache, unload); checks Gemma vs projection
        self.text = TextEncoderService.for_fleet(identity, rank, device, self.components.text_projection,
                                                 family=self.components.family)
        # every group any policy may use is built here, once (build_plan), and kept (`groups`); each job gets a
        # frozen plan of them under its policy (`apply_policy`)
        plan = (build_plan(self.components.transformer, rank, identity.world_size, device, policy, sharded=sharded,
                           budget_bytes=self.budget)
                if identity.sequence_parallel else None)
        self.groups = plan.groups if plan is not None else None  # parallel.plan.PlanGroups, for the fleet's life
        self.plan = plan  # the frozen plan of the last job's policy (parallel.plan.ParallelPlan)
        self.pipeline = TwoStagePipeline(self.components, self.text, device=device, dtype=dtype, plan=self.plan)
        self.policy: FleetPolicy | None = None
        self.speed = None  # weights_cost.FleetFacts (rank 0 of a CUDA fleet), set at start by `_probe_links`
        self.apply_policy(policy)

    def apply_policy(self, policy: FleetPolicy) -> None:
        """Make `policy` this rank's (every rank gets the same one with the same job): a new frozen plan of the
        fleet's groups under it (`ParallelPlan.with_policy`: degree cap, token minimum, guidance-parallel mode, token
        cap; no collective), handed to the pipeline (`TwoStagePipeline.use_plan`), and the
        compiled or eager transformer blocks (`compile.compile_blocks` / `uncompile_blocks`). Raises ValidationError
        for a policy the fleet's rules refuse (`fleet_rules.check_policy` on the weights' placement: compile with a
        sharded unit, a degree the heads or the fleet do not allow, …), before anything changes."""
        if policy == self.policy:
            return
        check_policy(self.placement, self.config.world_size, policy,  # the fleet's rules (fleet_rules.py)
                     int(self.components.transformer.config.num_attention_heads), self.config.sequence_parallel)
        if self.plan is not None:
            self.plan = self.plan.with_policy(policy)  # raises before anything changes
            self.pipeline.use_plan(self.plan)
        if self.policy is None or policy.compile != self.policy.compile:
            from ..engine.compile import compile_blocks, uncompile_blocks

            if policy.compile:
                compile_blocks(self.components.transformer)
            elif self.policy is not None:
                uncompile_blocks(self.components.transformer)
        self.policy = policy

    @property
    def gemma(self):
        """This rank's loaded `GemmaTextEncoder` (None when unloaded, or off rank 0 in sharded mode)."""
        return self.text.encoder


def _probe_links(state: WorkerState, config: FleetIdentity, device: torch.device):
    """`splits.link.probe_at_start` on every rank (a collective), after the weights are loaded: the `LinkReport`,
    and `state.speed` the `FleetFacts` of the step-time predictions (rank 0 of a CUDA fleet; None elsewhere)."""
    from ..splits.link import probe_at_start

    c = state.components
    link, state.speed = probe_at_start(c.transformer, device, config.devices,
                                       (getattr(c, "video_connector", None), getattr(c, "audio_connector", None)))
    return link


def worker_main(rank: int, config: FleetIdentity, policy: FleetPolicy, init_file: str, links) -> None:
    """A spawned worker's body (its entry point is `worker_start.start`, which binds it to its parent before this
    module is imported: it ends with its parent): rank `rank` of the fleet `config` under its first `policy`,
    joining the process group through `init_file` (`links`: a `worker_start.WorkerLinks`). Reports `WorkerReady` or
    `WorkerInitError`, then serves jobs: each `RunJob` runs under its policy (`WorkerState.apply_policy`) and ends
    with `JobDone`, `JobStopped` or `JobFailed`; a `StopWorker` ends the loop."""
    from ..protocol.resources import set_process_name

    conn, cancel_flag, heartbeat = links.conn, links.cancel_flag, links.heartbeat
    set_process_name(f"ltx2mgpu-rank{rank}")

    from .jobs import load_all
    from ..models import loader
    from ..engine.sampling import SamplingCancelled
    from ..protocol.validation import ValidationError

    jobs = load_all()

    device = torch.device(config.devices[rank])
    try:
        torch.set_num_threads(max(1, config.threads_per_worker))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        t0 = time.perf_counter()
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=config.world_size, timeout=timedelta(seconds=config.collective_timeout_s))
        state = WorkerState(config, policy, rank, device)
        dist.barrier()
        heads = int(state.components.transformer.config.num_attention_heads)
        link = _probe_links(state, config, device)  # the links measured once (issue 35): in the fleet's report
        conn.send(WorkerReady(rank, os.getpid(), loader.OPEN_COUNT, time.perf_counter() - t0, heads,
                              getattr(state.components.transformer, "int8_compute_note", None) or None,
                              link, state.speed.lines() if state.speed is not None else (),
                              placement=state.placement))
    except Exception as exc:  # reported to the controller, which tears the fleet down
        conn.send(WorkerInitError(rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return

    while True:
        message = conn.recv()
        if isinstance(message, StopWorker):
            break
        if not isinstance(message, RunJob):
            raise TypeError(f"worker rank {rank}: unknown message {type(message).__name__} from the fleet")
        spec: JobSpec = message.spec
        job_policy: FleetPolicy = message.policy
        ctx = JobContext(rank, config.world_size, device, spec.job_id, conn, cancel_flag, heartbeat, spec.fault,
                         plan=state.plan, stage=JOB_STAGES.get(spec.kind, spec.kind))
        # every job-end message ends with this rank's OPEN_COUNT (a re-read checkpoint would show in status())
        try:
            if spec.kind not in jobs:
                raise ValidationError(f"unknown job kind {spec.kind!r} (known: {', '.join(sorted(jobs))})")
            if config.transformer_only and spec.kind not in TRANSFORMER_JOBS:
                raise ValidationError(
                    f"job {spec.kind!r}: this fleet holds the transformer only (Load Diffusion Model (MGPU), "
                    f"FleetConfig.transformer_only), where ComfyUI's own loaders give the VAEs and the text encoder; "
                    f"it runs {', '.join(sorted(TRANSFORMER_JOBS))} — load the whole checkpoint (Load Checkpoint "
                    f"(MGPU)) for the stage jobs")
            state.apply_policy(job_policy)  # before any work (a refused policy leaves the last one in place)
            ctx.plan = state.plan
            pickled = isinstance(spec.payload, Pickled)  # the client's bytes, passed on by the controller
            result = jobs[spec.kind](state, spec.payload.load() if pickled else spec.payload, ctx)
            if pickled and rank == 0:
                result = spec.payload.reply(result)  # its large tensors in the payload's shared-memory lane, if any
            message = JobDone(spec.job_id, rank, result, loader.OPEN_COUNT)
            if pickled:  # by value, like the payload (transport.INLINE_JOBS); rank 0's reply is the only large one
                send_inline((conn,), message)
            else:
                conn.send(message)
        except SamplingCancelled:
            conn.send(JobStopped(spec.job_id, rank, ctx.stage, ctx.step, loader.OPEN_COUNT))
        except Exception as exc:
            conn.send(JobFailed(spec.job_id, rank, type(exc).__name__, str(exc), ctx.stage, ctx.step,
                                isinstance(exc, (ValidationError, FileNotFoundError)), traceback.format_exc(),
                                loader.OPEN_COUNT))
    try:
        dist.destroy_process_group()
    finally:
        conn.close()
