"""What every node shares: the fleet socket type, running a job on the controller with ComfyUI's progress bar and
interrupt, and turning engine errors into node errors.

The engine is imported relatively (`..mgpu_backend`): ComfyUI imports the pack under a mangled module name.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from comfy_api.latest import io

from ..mgpu_backend.protocol.errors import ControllerError, ErrorKind, FleetBusy, JobCancelled
from ..mgpu_backend.protocol.fleet_config import FleetConfig, FleetHandle
from ..mgpu_backend.protocol.job_requests import JobSpec
from .native_types import UnsupportedInput

log = logging.getLogger("ltx2_mgpu.nodes")

CATEGORY = "LTX-2 Multi-GPU"
FLEET_TYPE = "LTX2_MGPU_FLEET"
Fleet = io.Custom(FLEET_TYPE)


class NodeError(Exception):
    """An error shown on the node: the engine's (or our validation's) message, without a deep traceback."""


NodeError.__module__ = "ltx2_multigpu"  # ComfyUI shows `module.Class`; the pack's real module name is a file path


def fleet_input(tooltip: str = "The fleet from Load Checkpoint (MGPU): which worker processes run this job.") -> Any:
    return Fleet.Input("fleet", tooltip=tooltip)


def check_handle(handle: Any) -> FleetHandle:
    if not isinstance(handle, FleetHandle) and type(handle).__name__ != "FleetHandle":
        raise NodeError(f"fleet input: expected a fleet from Load Checkpoint (MGPU), got {type(handle).__name__}")
    return handle


def client(start: bool = True):
    """A connection to the controller (started with ComfyUI's Python when none answers). The runtime directory is
    `protocol.transport.default_runtime_dir()` ($LTX2_MGPU_RUNTIME_DIR overrides)."""
    from ..mgpu_backend.serving.client import ControllerClient

    return ControllerClient(start=start)


def _interrupt() -> None:
    import comfy.model_management as mm

    mm.throw_exception_if_processing_interrupted()  # raises and clears the flag when it is set
    raise mm.InterruptProcessingException()


class _Progress:
    """Maps the job's progress events onto ComfyUI progress bars (one per stage) and remembers an interrupt raised
    by the progress hook, so that the job is cancelled (not abandoned mid-stream)."""

    def __init__(self, node_id: str | None):
        self.node_id = node_id
        self.bar = None
        self.key = None
        self.interrupted = False

    def __call__(self, event) -> None:  # a protocol.messages.Progress
        import comfy.model_management as mm
        import comfy.utils

        total, step = int(event.total or 0), int(event.step or 0)
        if total <= 0:
            return
        key = (event.stage, total)
        try:
            if self.bar is None or key != self.key:
                self.bar, self.key = comfy.utils.ProgressBar(total, node_id=self.node_id), key
            self.bar.update_absolute(step, total)
        except mm.InterruptProcessingException:  # ComfyUI's hook raises on interrupt (and clears the flag)
            self.interrupted = True

    def cancel_requested(self) -> bool:
        import comfy.model_management as mm

        return self.interrupted or mm.processing_interrupted()


# headroom a fleet job needs on each of its GPUs beyond what it already holds (activations, VAE decode tiles)
FLEET_JOB_HEADROOM_BYTES = 8 * 1024 ** 3


def make_room_on_fleet_devices(config: FleetConfig) -> None:
    """Unload ComfyUI's own models from the fleet's GPUs when one of them is short of free memory (the workers are
    other processes: ComfyUI cannot see what they need, so it must not keep its models there)."""
    import torch

    indices = sorted({int(d.split(":")[1]) for d in config.devices if d.startswith("cuda:")})
    if not indices or not torch.cuda.is_available():
        return
    short = [i for i in indices if torch.cuda.mem_get_info(i)[0] < FLEET_JOB_HEADROOM_BYTES]
    if short:
        import comfy.model_management as mm

        log.info("GPU(s) %s short of memory for the fleet job: unloading ComfyUI's models", short)
        mm.unload_all_models()
        mm.soft_empty_cache()


def run_job(handle: FleetHandle, kind: str, payload: Any, *, node_id: str | None = None,
            what: str = "job", progress: bool = True,
            on_handle: Callable[[FleetHandle], None] | None = None) -> Any:
    """Run one job on the fleet: progress into ComfyUI's bar, ComfyUI's interrupt cancels it (every rank stops at
    the next step boundary and the fleet stays), engine errors become NodeError with the engine's message.

    A stale handle (the fleet was rebuilt with another configuration since) or a controller that went away (the
    client's ControllerError of kind "controller_lost") is handled transparently once: the fleet is configured again
    from the handle's own configuration and the job re-submitted; a second loss is shown with the client's message
    (what was lost, when, what to do). A job that fails because a worker died is reported (the next run starts a fresh fleet).

    progress=False: the job's progress events are not shown (a model forward inside ComfyUI's own sampler, whose
    progress bar is ComfyUI's). on_handle: called with the new handle when the fleet was configured again."""
    import comfy.model_management as mm

    handle = check_handle(handle)
    make_room_on_fleet_devices(handle.config)
    show_progress = progress
    progress = _Progress(node_id)
    for attempt in (1, 2):
        if progress.cancel_requested():
            _interrupt()
        try:
            c = client()
        except ControllerError as exc:
            raise NodeError(f"{what}: the multi-GPU controller could not be reached: {exc}") from None
        try:
            return c.run(handle, JobSpec(kind, payload), on_event=progress if show_progress else None,
                         cancel_requested=progress.cancel_requested)
        except JobCancelled:
            log.info("%s: cancelled by an interrupt", what)
            if mm.processing_interrupted():
                _interrupt()
            raise mm.InterruptProcessingException() from None
        except FleetBusy as exc:
            raise NodeError(f"{what}: {exc} (another client — a CLI run or a second ComfyUI — is using the fleet; "
                            f"queue again when it is done)") from None
        except ControllerError as exc:
            if exc.kind == ErrorKind.CONTROLLER_LOST and attempt == 1:  # killed mid-job: a new one, the job again
                log.warning("%s: %s — starting the controller again and re-submitting once", what, exc)
                continue
            if exc.kind == ErrorKind.STALE_HANDLE and attempt == 1:
                log.info("%s: %s — configuring the fleet again from the handle", what, exc)
                try:
                    handle = c.configure(handle.config)
                except ControllerError as exc2:
                    raise NodeError(f"{what}: reloading the fleet failed: {exc2}") from None
                if on_handle is not None:
                    on_handle(handle)
                continue
            lost = " (the fleet was torn down; the next run starts a new one)" if exc.fleet_lost else ""
            raise NodeError(f"{what}: {exc}{lost}") from None
        except (EOFError, ConnectionError, OSError) as exc:  # the controller went away mid-request
            if attempt == 1:
                log.warning("%s: lost the controller (%s); starting it again and re-submitting once", what, exc)
                continue
            raise NodeError(f"{what}: lost the connection to the multi-GPU controller twice: {exc}") from None
        finally:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass
    raise NodeError(f"{what}: failed after reconfiguring the fleet")


@contextlib.contextmanager
def guard(what: str):
    """`with guard("SP Sampler (MGPU)"):` input errors (UnsupportedInput, ValueError) become NodeError prefixed with
    the node's name; NodeError and ComfyUI's interrupt pass through."""
    try:
        yield
    except NodeError:
        raise
    except (UnsupportedInput, ValueError) as exc:
        raise NodeError(f"{what}: {exc}") from None
