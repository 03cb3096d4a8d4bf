"""Fleet (MGPU): the controller's and the fleet's status, or shut the fleet down (its devices are freed; the next
MGPU job starts it again from the handle)."""
from __future__ import annotations

import time

from comfy_api.latest import io, ui

from ..mgpu_backend.protocol.errors import ControllerError
from ..mgpu_backend.protocol.fleet_config import FleetHandle
from ..mgpu_backend.protocol.job_results import ControllerStatus
from .common import CATEGORY, NodeError, check_handle, client, fleet_input

ACTIONS = ("status", "shut down")


def format_status(status: ControllerStatus, handle: FleetHandle | None = None) -> str:
    """The status as the node shows it, one fact a line: the controller, the fleet (`FleetDescription`: generation,
    devices, workers, checkpoint, int8 path, the links measured at start and the predicted step times; whether
    `handle` is of an older generation), its processes (`ProcessInfo`: role, pid, RSS in MiB), busy or idle, the
    last failure."""
    lines = [f"controller pid {status.pid} ({status.socket})"]
    fleet = status.fleet
    if fleet is None:
        lines.append("no fleet running (the next MGPU job starts one)")
    else:
        lines.append(f"fleet generation {fleet.generation}: {len(fleet.devices)} rank(s) on "
                     f"{', '.join(fleet.devices)}; workers {', '.join(map(str, fleet.worker_pids))}")
        lines.append(f"checkpoint {fleet.checkpoint} (loaded in {fleet.load_seconds:.1f} s)")
        if fleet.int8_compute:  # which path the int8 file's layers take (FleetIdentity.int8_compute)
            lines.append(f"int8 compute: {fleet.int8_compute}")
        link = getattr(fleet, "link", None)  # what it measured at start (none from an older controller)
        if link is not None:
            lines.append(link.describe())
        lines.extend(getattr(fleet, "predicted", ()) or ())
        if handle is not None and fleet.generation != handle.generation:
            lines.append(f"this handle is of generation {handle.generation} (the fleet was rebuilt since)")
    processes = status.processes
    if processes:  # every process the controller owns, with its resident memory
        lines.append("processes: " + "; ".join(
            f"{p.role} pid {p.pid} {p.rss_bytes / 2**20:.0f} MiB" if p.rss_bytes is not None
            else f"{p.role} pid {p.pid}" for p in processes))
    lines.append(f"busy with job {status.busy_job}" if status.busy_job else "idle")
    if status.last_failure:
        lines.append(f"last failure: {status.last_failure}")
    return "\n".join(lines)


class FleetMGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LTX2MGPU_Fleet",
            display_name="Fleet (MGPU)",
            category=CATEGORY,
            description="Shows the controller and worker fleet status, or shuts the fleet down to free its devices.",
            inputs=[
                fleet_input(),
                io.Combo.Input("action", options=list(ACTIONS), default="status",
                               tooltip="status: report the fleet. shut down: stop the worker processes and free "
                                       "their memory (the next MGPU job starts the fleet again)."),
            ],
            outputs=[io.String.Output(display_name="status")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return time.time()  # a status is never cached

    @classmethod
    def execute(cls, fleet, action) -> io.NodeOutput:
        handle = check_handle(fleet)
        try:
            c = client(start=False)
        except ControllerError:
            text = "no controller running (the next MGPU job starts it)"
            return io.NodeOutput(text, ui=ui.PreviewText(text))
        try:
            if action == "shut down":
                c.shutdown_fleet()
                text = "fleet shut down; its devices are free (the next MGPU job starts it again)\n"
                text += format_status(c.status(), handle)
            else:
                text = format_status(c.status(), handle)
        except ControllerError as exc:
            raise NodeError(f"Fleet (MGPU): {exc}") from None
        finally:
            c.close()
        return io.NodeOutput(text, ui=ui.PreviewText(text))
