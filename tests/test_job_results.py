"""Typed job results and status (`protocol/job_results.py`) and the typed test fault (`job_requests.FaultSpec`): what
crosses the process boundary comes back equal through every transport path (plain pickle, `transport.Pickled` of
the inline jobs, frames through shared memory), and a dict from a controller of an older pack version is refused
with a message naming the process to stop."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle

import pytest
import torch

from mgpu_backend.protocol import frames as F
from mgpu_backend.serving.client import ControllerClient
from mgpu_backend.protocol import transport
from mgpu_backend.protocol.errors import ControllerError, ErrorDetails, ErrorKind
from mgpu_backend.protocol.fleet_config import FleetConfig, FleetHandle, FleetPlan, FleetPolicy
from mgpu_backend.protocol.fleet_rules import WeightBytes, placement_of
from mgpu_backend.protocol.job_requests import FAULT_KINDS, FaultSpec, JobSpec, NoopRequest
from mgpu_backend.protocol.job_results import (ControllerStatus, DecodeReport, EncodeTextResult, FleetDescription,
                                               FleetTeardown, FramesResult, GenerateJobResult, GenerateTimings,
                                               NoopResult, ProcessInfo, RankReport, SampleResult, TextEncodeReport,
                                               TextEncoderCounters, UpscaleResult)
from mgpu_backend.protocol.messages import Accepted, Configured, JobResult, Pong, StatusReply, Stopped
from mgpu_backend.protocol.link import LinkReport
from mgpu_backend.protocol.transport import Pickled


def _results() -> list:
    v, a = torch.randn(1, 128, 2, 3, 4), torch.randn(1, 8, 5, 16)
    return [SampleResult(v, a, "sequence parallel over all 2 ranks", ("lora x: 1/1 layers applied",)),
            SampleResult(v, a, "tiles", (), tile_drift=(0.1, 0.2), weights_normalized=False, audio_frozen=True),
            UpscaleResult(v), NoopResult(torch.arange(4, dtype=torch.float32)),
            EncodeTextResult((v[0, :1, 0, 0],), ([[v[0, :1, 0, 0], {"pooled_output": None}]],),
                             TextEncodeReport("sharded", "sharded", 2, 2, 0, 2, 2, False, 0.5, {"cpu": "layers.0-1"}),
                             (3, 0), TextEncoderCounters(forwards=2, loads=1)),
            GenerateJobResult(torch.rand(2, 4, 4, 3), torch.randn(2, 10), 24000, v, a, GenerateTimings(total=1.0),
                              ("r",), "one rank", (RankReport(0, "local", "local", DecodeReport((0, 1), 0.25),
                                                              GenerateTimings(total=1.0), ("fp8 compute: …",)),))]


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if dataclasses.is_dataclass(x):
        return type(x) is type(y) and all(_equal(getattr(x, f.name), getattr(y, f.name))
                                          for f in dataclasses.fields(x))
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return x == y


@pytest.mark.parametrize("result", _results(), ids=lambda r: type(r).__name__)
def test_results_are_frozen_and_cross_every_transport_path(result):
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.video = None  # type: ignore[misc]
    plain = transport.loads(pickle.dumps(JobResult("j", result), protocol=pickle.HIGHEST_PROTOCOL)).result
    inline = transport.loads(pickle.dumps(JobResult("j", Pickled.of(result)))).result.load()
    for back in (plain, inline):
        assert _equal(back, result)


def test_frames_travel_through_shared_memory_in_a_typed_result():
    frames = torch.rand(3, 8, 12, 3)
    sent = FramesResult(F.send_frames(frames), 12.5)
    on_wire = transport.loads(pickle.dumps(JobResult("j", sent))).result
    assert F.frames_ref(on_wire) == sent.frames
    back = F.receive_frames(on_wire)
    assert isinstance(back, FramesResult) and back.sent_at == 12.5 and torch.equal(back.frames, frames)
    assert not os.path.exists(os.path.join(F.SHM_DIR, sent.frames.name))  # the block was freed
    assert F.frames_ref({"frames": sent.frames}) is None  # a dict is no typed result


class _Wire:
    """A client connection without a controller: what the client sends is kept, the replies are queued bytes."""

    def __init__(self, *replies):
        self.sent, self.replies = [], [pickle.dumps(r) for r in replies]

    def send_bytes(self, data):
        self.sent.append(transport.loads(data))

    def recv_bytes(self):
        return self.replies.pop(0)

    def poll(self, timeout=None):
        return True


def _client(tmp_path, *replies) -> ControllerClient:
    client = object.__new__(ControllerClient)
    client.runtime_dir, client.socket_path, client._conn = tmp_path, tmp_path / "ctl.sock", _Wire(*replies)
    client.shm_lane = False  # the job's tensors by value, in the queued reply
    return client


def test_an_older_controllers_dicts_are_refused_naming_the_process(tmp_path):
    config = FleetConfig(devices=("cpu",), checkpoint="c.safetensors", gemma=None)
    handle = FleetHandle(1, config, (11,), FleetPlan(1, 8, 1, (1,)))
    old_result = _client(tmp_path, Accepted("j1", 1, (11,)), JobResult("j1", {"tensor": torch.zeros(4)}))
    with pytest.raises(ControllerError) as info:
        old_result.run(handle, JobSpec("noop", NoopRequest(), job_id="j1"))
    assert info.value.kind == ErrorKind.PROTOCOL
    assert "older version of the pack" in str(info.value) and "job j1 (noop)" in str(info.value)
    assert f"python -m mgpu_backend.serving.controller --runtime-dir {tmp_path}" in str(info.value)
    old_status = _client(tmp_path, StatusReply({"pid": 4242, "fleet": None}))
    with pytest.raises(ControllerError, match=r"for the status .*stop that process \(pid 4242: `python -m "):
        old_status.status()
    status = ControllerStatus(4242, "s", clients=("pid 1 (python)",))
    assert _client(tmp_path, StatusReply(status)).status() == status
    # the previous version's controller: typed at the top, its fleet, processes and teardowns still dicts
    for half_typed in (ControllerStatus(4242, "s", fleet={"generation": 1}),
                       ControllerStatus(4242, "s", processes=({"pid": 4242, "role": "controller"},))):
        with pytest.raises(ControllerError, match=r"for the status's fleet and processes .*stop that process "
                                                  r"\(pid 4242: `python -m mgpu_backend.serving.controller"):
            _client(tmp_path, StatusReply(half_typed)).status()
    with pytest.raises(ControllerError, match=r"for what the configure replaced .*\(pid 4243: `python -m "):
        _client(tmp_path, Configured(handle, {"generation": 1, "clients": []}), Pong(4243)).configure(config)
    with pytest.raises(ControllerError, match=r"for what the shutdown_fleet stopped .*\(pid 4243: `python -m "):
        _client(tmp_path, Stopped({"fleet": None, "clients": [], "job": None}), Pong(4243)).shutdown_fleet()
    with pytest.raises(ControllerError, match="answered the stop with a dict .* older version of the pack; it has "
                                              "stopped") as info:
        _client(tmp_path, Stopped({"fleet": None, "clients": [], "job": None})).stop()
    assert info.value.kind == ErrorKind.PROTOCOL
    good = _client(tmp_path, Accepted("j2", 1, (11,)), JobResult("j2", Pickled.of(NoopResult(torch.ones(4)))))
    assert torch.equal(good.run(handle, JobSpec("noop", NoopRequest(), job_id="j2")).tensor, torch.ones(4))


def test_fault_spec_rules():
    f = FaultSpec(stage="stage 1", step=2, kind="error", rank=1)
    assert f.fires(1, "stage 1", 2) and not f.fires(0, "stage 1", 2) and not f.fires(1, "stage 1", 1)
    everyone = FaultSpec(stage="noop", step=0, kind="error_all")
    assert everyone.fires(0, "noop", 0) and everyone.fires(3, "noop", 0)
    assert set(FAULT_KINDS) == {"crash", "stall", "error", "error_all", "reread"}
    with pytest.raises(ValueError, match="kind='boom': choose one of crash, stall, error, error_all, reread"):
        FaultSpec(stage="s", step=0, kind="boom", rank=0)
    with pytest.raises(ValueError, match="kind='crash' needs the rank"):
        FaultSpec(stage="s", step=0, kind="crash")
    with pytest.raises(ValueError, match="step=-1 must be a non-negative integer"):
        FaultSpec(stage="s", step=-1, kind="crash", rank=0)
    with pytest.raises(TypeError, match="JobSpec.fault: expected a FaultSpec or None, got dict"):
        JobSpec("noop", NoopRequest(), fault={"rank": 0, "stage": "noop", "step": 0, "kind": "crash"})
    job = JobSpec("noop", NoopRequest(), fault=f)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.fault = None  # type: ignore[misc]
    assert dataclasses.replace(job, fault=None).fault is None and job.fault is f
    assert transport.loads(pickle.dumps(job)) == job


def _described(generation=3, pids=(11, 12)) -> FleetDescription:
    return FleetDescription(generation, ("cpu",) * len(pids), pids, "/m/c.safetensors", "replicated", 1.5, None,
                            FleetPolicy(sp_degree=2), FleetPlan(len(pids), 8, 2, (1, 2), set_by_policy=True),
                            (2,) * len(pids))


def test_the_controllers_reports_print_as_the_json_users_read():
    """`python -m mgpu_backend status` prints `dataclasses.asdict(status)` as JSON: the keys (and values) of the
    dicts these reports were before they were typed, so users' scripts keep working."""
    status = ControllerStatus(4242, "/run/ctl.sock", "j1", "noop", None, ("pid 1 (python)",), _described(),
                              (ProcessInfo(4242, "controller", 300 << 20), ProcessInfo(11, "worker rank 0", 400 << 20),
                               ProcessInfo(12, "worker rank 1", None)))
    printed = json.loads(json.dumps(dataclasses.asdict(status), default=str))
    assert list(printed) == ["pid", "socket", "busy_job", "busy_kind", "last_failure", "clients", "fleet",
                             "processes"]
    fleet = printed["fleet"]
    assert list(fleet) == ["generation", "devices", "worker_pids", "checkpoint", "weights", "load_seconds",
                           "int8_compute", "policy", "plan", "open_counts", "link", "predicted", "transformer_only"]
    assert fleet["link"] is None and fleet["predicted"] == []  # (issue 35: keys added at the end)
    assert fleet["transformer_only"] is False  # (issue 36: a key added at the end)
    assert (fleet["generation"], fleet["devices"], fleet["worker_pids"], fleet["open_counts"]) == \
        (3, ["cpu", "cpu"], [11, 12], [2, 2])
    assert fleet["policy"]["sp_degree"] == 2 and fleet["policy"]["guidance_parallel"] == "auto"
    assert fleet["plan"] == {"world_size": 2, "heads": 8, "sp_degree": 2, "valid_degrees": [1, 2],
                             "set_by_policy": True, "sequence_parallel": True, "placement": None}
    # where the workers placed the weights (issue 35): the placement's fields, under the plan
    sizes = WeightBytes(blocks=6, rest=1, block_units=(2, 2), connector_units=(1, 1))
    plan = dataclasses.replace(_described().plan, placement=placement_of(sizes, 2, (1, 3), 9, 0, "auto"))
    assert json.loads(json.dumps(dataclasses.asdict(plan)))["placement"] == {
        "requested": "auto", "world_size": 2, "units": 4, "block_units": 2, "sharded": [1, 3], "budget_bytes": 9,
        "reserve_bytes": 0, "resident_bytes": 1 + (2 + 1) + (1 + 1), "gathered_bytes": 1, "transient_bytes": 4}
    assert printed["processes"] == [{"pid": 4242, "role": "controller", "rss_bytes": 300 * 2**20},
                                    {"pid": 11, "role": "worker rank 0", "rss_bytes": 400 * 2**20},
                                    {"pid": 12, "role": "worker rank 1", "rss_bytes": None}]
    ended = FleetTeardown(_described(), ("pid 1 (python)",), "a noop job (j1)")
    for message in (StatusReply(status), Stopped(ended), Configured(FleetHandle(4, FleetConfig(
            devices=("cpu",), checkpoint="c.safetensors", gemma=None)), FleetTeardown(_described()))):
        assert transport.loads(pickle.dumps(message)) == message
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.fleet.generation = 4  # type: ignore[misc]
    # the link measured at start and the predicted step times (issue 35), as the status prints them
    link = LinkReport("gloo", 2, ("cpu", "cpu"), 2**18, 0.002, 0.131, None, None, 0.05, 3, 1, 0.01)
    measured = dataclasses.replace(_described(), link=link, predicted=("predicted step time at stage 1 …",))
    printed = json.loads(json.dumps(dataclasses.asdict(measured), default=str))
    assert printed["link"]["all_gather_GBps"] == 0.131 and printed["link"]["message_bytes"] == 2**18
    assert printed["predicted"] == ["predicted step time at stage 1 …"]
    reply = StatusReply(dataclasses.replace(status, fleet=measured))
    assert transport.loads(pickle.dumps(reply)).status.fleet == measured


def test_a_fleet_description_gives_one_entry_per_rank():
    with pytest.raises(ValueError, match=r"devices \('cpu', 'cpu'\), worker_pids \(11,\) and open_counts \(2, 2\) "
                                         r"must give one entry per rank each"):
        FleetDescription(1, ("cpu", "cpu"), (11,), "c", "replicated", 0.0, None, FleetPolicy(),
                         FleetPlan(2, 8, 2, (1, 2)), (2, 2))


def test_what_a_stop_or_a_rebuild_ended_in_words():
    from mgpu_backend.serving.cli import describe_stopped

    ended = FleetTeardown(_described(), ("pid 1 (python)",), "a noop job (j1)")
    assert describe_stopped(ended, "stopped") == (
        "stopped fleet generation 3: 2 rank(s) on cpu,cpu (pids 11, 12) that held /m/c.safetensors; 1 other client(s) "
        "were connected to this controller (pid 1 (python)) — ComfyUI and the CLI share it; their next job starts a "
        "fleet of their own configuration; a noop job (j1) was running and was stopped")
    assert describe_stopped(FleetTeardown(None), "stopped") == "no fleet was loaded"


def test_the_replace_note_names_this_runs_checkpoint_and_the_one_it_replaced():
    """Issue 36 item 10: the CLI's note after a `generate` replaced another fleet read "replaced fleet generation 3:
    … with /m/c.safetensors" — the previous fleet's checkpoint, as if it were this run's. It names this run's fleet
    and checkpoint first, then the replaced fleet and the checkpoint it held."""
    from mgpu_backend.serving.cli import replaced_note

    handle = FleetHandle(4, FleetConfig(devices=("cpu",), checkpoint="/m/new.safetensors", gemma=None), (21,))
    assert replaced_note(handle, FleetTeardown(_described())) == (
        "this run's fleet (generation 4, /m/new.safetensors) replaced fleet generation 3: 2 rank(s) on cpu,cpu "
        "(pids 11, 12) that held /m/c.safetensors")


def test_generate_timings_keep_the_printed_phase_names():
    """`GenerateTimings` from and to the phase names the CLI prints, in the order the phases run; an unknown phase
    is refused by name."""
    phases = {"text": 0.1, "stage 1": 2.0, "upscale": 0.3, "stage 2": 1.5, "decode video": 0.7, "decode audio": 0.2,
              "total": 4.8}
    t = GenerateTimings.from_phases(phases)
    assert t.stage_1 == 2.0 and t.decode_video == 0.7 and list(t.as_dict().items()) == list(phases.items())
    with pytest.raises(ValueError, match=r"unknown phase\(s\) \['write mp4'\]"):
        GenerateTimings.from_phases({"write mp4": 0.1})


def test_decode_report_prints_its_tiles_as_before():
    """The CLI prints a rank's tiles as the list it printed when the report was a dict, or "untiled"."""
    assert DecodeReport((0, 2), 1.0).tiles_text == "[0, 2]" and DecodeReport((), 0.0).tiles_text == "[]"
    assert DecodeReport("untiled", 1.0).tiles_text == "untiled"


def test_error_details_are_typed_and_read_from_an_older_dict():
    assert ErrorDetails.of(None) == ErrorDetails() and ErrorDetails.of(ErrorDetails(step=2)).step == 2
    assert ErrorDetails.of({"traceback": "tb", "unknown": 1}) == ErrorDetails(traceback="tb")
    assert ControllerError("x", kind="job_error", details={"rank": 1}).details.rank == 1
