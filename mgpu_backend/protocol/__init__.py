"""What the client, the controller and the workers say to each other, one module per concern (import the module
you need; this package re-exports nothing):

- `transport`: the private socket directory and auth key, `send` / `recv` / `loads` (plain pickle, this package's
  classes found whatever name the sender imported it under), `Pickled` and `wire_job` (a payload pickled once);
- `fleet_config`: `FleetIdentity` (the processes), `FleetPolicy` (per job), `FleetConfig` (the two, as asked for),
  `FleetPlan` and `FleetHandle` (the controller's answer);
- `job_requests`: `JobSpec` (a job: its kind and payload) and the small jobs' requests (`EncodeTextRequest`,
  `NoopRequest`, `FramesRequest`);
- `stage_requests`: the stage jobs' requests (`SampleRequest`, `UpscaleRequest`, `DecodeRequest`, `ComfyGuides`);
- `worker_messages`: the fleet <-> worker messages (`RunJob`, `WorkerReady`, `JobDone`, …);
- `errors`: `ErrorKind`, `ControllerError`, `FleetBusy`, `JobCancelled`.

Client -> controller requests are dicts with an `op`:
- `{"op": "ping"}` -> `{"ok": True, "pid": …}`
- `{"op": "status"}` -> controller and fleet status (generation, devices, worker PIDs, busy job)
- `{"op": "configure", "config": FleetConfig}` -> `{"ok": True, "handle": FleetHandle}` (same `identity`: the
  running fleet is reused, whatever the policy; the handle carries the new policy, applied to each of its jobs, and
  the `FleetPlan` the fleet computed for it)
- `{"op": "submit", "handle": FleetHandle, "job": JobSpec}` -> a stream of events on the same connection, ending
  with one `result` or `error` event (or a single `busy` event). A job's payload is its kind's frozen request:
  `EncodeTextRequest`, `NoopRequest`, `FramesRequest`, `SampleRequest`, `UpscaleRequest`, `DecodeRequest` here,
  `pipelines.GenerateRequest`, `forward.ForwardRequest` / `PreprocessTextRequest`; frames in a result come back as a
  `frames.FramesRef` (shared memory)
- `{"op": "cancel", "job_id": str}`, `{"op": "shutdown_fleet"}`, `{"op": "stop"}`

`configure` answers `replaced` (what a rebuild replaced: `describe_fleet` of the old fleet, or None) and `stop` /
`shutdown_fleet` answer `stopped` (the fleet, the other clients connected, the job that was running), so the CLI
and the nodes can say what they stopped. A request the controller cannot read (not a pickled dict with a known
`op`, a `submit` without a handle and a job) is answered `{"ok": False, "event": "error", "kind": "protocol", …}`
and the connection stays; one longer than `MAX_MESSAGE_BYTES` is answered so and the connection is closed (its
bytes were never read). The authentication handshake has `HANDSHAKE_TIMEOUT_S` and runs beside other clients.
"""
