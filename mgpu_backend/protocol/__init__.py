"""What the client, the controller and the workers say to each other, one module per concern (import the module
you need; this package re-exports nothing):

- `transport`: the private socket directory and auth key, `send` / `recv` / `loads` (plain pickle, this package's
  classes found whatever name the sender imported it under), `Pickled` and `wire_job` (a payload pickled once);
- `shm_lane`: the client's shared-memory lane that carries those payloads' (and their replies') large tensors;
- `fleet_config`: `FleetIdentity` (the processes), `FleetPolicy` (per job), `FleetConfig` (the two, as asked for),
  `FleetPlan` and `FleetHandle` (the controller's answer);
- `job_requests`: `JobSpec` (a job: its kind, payload and test `FaultSpec`) and the small jobs' requests
  (`EncodeTextRequest`, `NoopRequest`, `FramesRequest`);
- `job_results`: what the jobs hand back (`GenerateJobResult`, `SampleResult`, `UpscaleResult`, `DecodeResult`,
  `EncodeTextResult`, `NoopResult`, `FramesResult`) and the controller's reports (`ControllerStatus` with its
  `FleetDescription` and `ProcessInfo`s; `FleetTeardown`: what a stop or a rebuild ended);
- `stage_requests`: the stage jobs' requests (`SampleRequest`, `UpscaleRequest`, `DecodeRequest`, `ComfyGuides`);
- `worker_messages`: the fleet <-> worker messages (`RunJob`, `WorkerReady`, `JobDone`, …);
- `errors`: `ErrorKind`, `ControllerError`, `FleetBusy`, `JobCancelled`;
- `messages`: the client <-> controller messages: requests (`Ping`, `Status`, `Configure`, `Submit`, `Cancel`,
  `ShutdownFleet`, `Stop`), their replies (`Pong`, `StatusReply`, `Configured`, `Done`, `Stopped`, `Refused`) and
  a job's events (`Accepted`, `Progress`, `JobResult`, `JobError`, `Busy`).

Every message that crosses a process is a frozen dataclass of these modules (or a job's request / result); the
classes' module paths are part of the wire format (both ends import this package, under whatever name:
`transport.loads`).
"""
