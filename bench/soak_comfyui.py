"""Soak a live ComfyUI 0.33 with this pack: two API clients and the CLI beside them, configurations changing between
prompts, random interrupts, SIGKILLed workers, a SIGKILLed controller and a ComfyUI restart mid-job (issue 24, item 7).

    nice -n 10 python bench/soak_comfyui.py --prompts 600 --max-minutes 50 \\
        --out bench/results/soak_comfyui_cpu            # writes .txt, .json and .png (the process count over time)
    python bench/soak_comfyui.py --prompts 20           # a short check

The script starts ComfyUI itself (`$COMFYUI_PYTHON main.py --cpu` in `$COMFYUI_DIR`, whose custom_nodes/ holds this
pack: docs/testing.md#a-live-comfyui) on `--port`, with its own controller directory
(LTX2_MGPU_RUNTIME_DIR) and a mark in the environment that every controller and worker it starts inherits; it
links the tiny LTX-2.0 models (`make_tiny`, seeds 0 and 1: two checkpoint files) into the server's models folders.

- Two client threads queue prompts over HTTP (`POST /prompt`, poll `/history/<id>`), each prompt a tiny graph
  (64 x 64 px, 9 frames, 1-2 steps): Load Checkpoint (MGPU) -> Text Encode -> SP Sampler -> Preview as Text, every
  `--full-every`-th one the whole two-stage graph (+ TDP Upscale, Distributed Decode, Save Video). A share
  `--interrupt-prob` samples 100 steps and is interrupted (`POST /interrupt` with its prompt id) once it runs; a share
  `--bad-prob` asks for devices "512" (refused with the rule, issue 24's runaway fleet).
- The configuration (devices cpu:1 / cpu:2 / "cpu" + world size 2, checkpoint seed 0 / seed 1) changes every
  `--config-every` prompts.
- A CLI thread runs `python -m mgpu_backend generate` (the same tiny files, one CPU rank, 1 step) every
  `--cli-every` prompts on the same controller (it replaces the fleet; a prompt or a CLI run that meets the other's
  job fails with the controller's `busy` message); every other run in a quiet window (the clients pause until it
  ends, after ComfyUI's queue drained), so that some meet an idle fleet.
- Chaos: a random worker SIGKILLed every `--kill-worker-every` prompts, the controller SIGKILLed once (at 40 % of the
  prompts), ComfyUI SIGKILLed mid-job and started again once (at 70 %); prompts queued at that moment vanish with
  the server's in-memory queue and are counted `dropped by the restart`.
- A sampler thread reads /proc every `--sample-s`: the pack's processes (controller + workers, by the mark), the
  controller's RSS + swap, and whether ComfyUI is alive.

Recorded: every prompt's outcome (completed / interrupted / failed with its message, grouped by kind with the
numbers taken out / dropped by the restart / hung: no end within `--prompt-timeout-s`), the CLI runs likewise, the
process count over time (max, and the samples above the largest configured world size + 1), the controller's RSS
(start after `--warmup` prompts of its life, end), ComfyUI exits other than the deliberate one, and after the stop:
processes and /dev/shm blocks left. PASS needs: no hung prompt, no failure without a message, no leak, process count
never above the bound, controller RSS growth under 10 %, ComfyUI never died unasked.

Run with the repository root on PYTHONPATH, under a Python with torch (it writes the tiny models). Not part of the
test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.soak_common import leaked_blocks, rss_kib, shm_blocks  # noqa: E402
from mgpu_backend.protocol.resources import pack_processes  # noqa: E402

BASE_WORKFLOW = ROOT / "workflows" / "api" / "ltx2-mgpu-two-stage-t2v.json"
MARK = "LTX2_MGPU_SOAK"
GEMMA, UPSCALER, LORA = ("gemma-3-tiny.safetensors", "ltx-20-tiny-spatial-upscaler-x2.safetensors",
                         "ltx-2.0-tiny-distilled-lora.safetensors")
CHECKPOINTS = ("ltx-2.0-tiny.safetensors", "ltx-2.0-tiny-seed1.safetensors")
# (devices, world_size, checkpoint index): what Load Checkpoint (MGPU) is given; ranks = the fleet's size
CONFIGS = (("cpu:2", 0, 0), ("cpu:1", 0, 0), ("cpu", 2, 1), ("cpu:2", 0, 1), ("cpu:1", 0, 1))
MAX_RANKS = 2
BAD_DEVICES = "512"  # issue 24: a width typed into the devices field


# ---- models --------------------------------------------------------------------------------------------------------


def link_models(models: Path) -> dict[str, str]:
    """Write the tiny LTX-2.0 sets (seeds 0 and 1) in the cache folder and link them into the server's models
    folders: checkpoint (both seeds), Gemma, upscaler, distilled LoRA (seed 0). Returns name -> file."""
    from mgpu_backend.testing.tiny import make_tiny

    cache = Path(os.environ.get("LTX2_MGPU_CACHE") or Path.home() / ".cache" / "ltx2-multigpu")
    seed0 = make_tiny(cache / "soak-tiny-2.0-seed0", "2.0", seed=0)
    seed1 = make_tiny(cache / "soak-tiny-2.0-seed1", "2.0", seed=1)
    links = {("checkpoints", CHECKPOINTS[0]): seed0["checkpoint"], ("checkpoints", CHECKPOINTS[1]): seed1["checkpoint"],
             ("text_encoders", GEMMA): seed0["gemma"], ("latent_upscale_models", UPSCALER): seed0["upsampler"],
             ("loras", LORA): seed0["distilled_lora"]}
    for (folder, name), target in links.items():
        (models / folder).mkdir(parents=True, exist_ok=True)
        link = models / folder / name
        tmp = link.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(target).resolve())
        os.replace(tmp, link)
    return {name: str(target) for (_, name), target in links.items()}


# ---- the server ----------------------------------------------------------------------------------------------------


class Server:
    """ComfyUI started (and restarted) by this script; `generation` counts the starts."""

    def __init__(self, comfy_dir: Path, python: str, port: int, env: dict, log: Path):
        self.comfy_dir, self.python, self.port, self.env, self.log = comfy_dir, python, port, env, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.generation = 0
        self.restarting = threading.Event()
        self.unasked_exits: list[str] = []

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port",
                                          str(self.port), "--disable-auto-launch"], cwd=self.comfy_dir,
                                         env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} at start; see {self.log}")
            try:
                get(self.url, "/object_info/LTX2MGPU_LoadCheckpoint", timeout=5)
                self.generation += 1
                return
            except (OSError, ValueError):
                time.sleep(1)
        raise RuntimeError(f"ComfyUI did not answer within 300 s; see {self.log}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_and_restart(self) -> float:
        """SIGKILL ComfyUI (mid-job) and start it again; returns the seconds it was away."""
        self.restarting.set()
        t = time.monotonic()
        try:
            self.proc.kill()
            self.proc.wait()
            self.start()
        finally:
            self.restarting.clear()
        return time.monotonic() - t

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get(url: str, path: str, timeout: float = 30):
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        return json.load(r)


def post(url: str, path: str, body: dict, timeout: float = 30):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read()
        return json.loads(text) if text.strip() else {}


# ---- the prompts ---------------------------------------------------------------------------------------------------


def graph(kind: str, config: tuple, seed: int, steps: int) -> dict:
    """The tiny prompt: the shipped two-stage graph at 64 x 64 px, 9 frames; `sample` and `interrupt` end at the SP
    Sampler (Preview as Text makes it an output), `full` keeps stage 2, the decode and Save Video."""
    wf = json.loads(BASE_WORKFLOW.read_text())
    devices, world_size, ckpt = config
    by = {v["class_type"]: k for k, v in wf.items()}
    loader = wf[by["LTX2MGPU_LoadCheckpoint"]]["inputs"]
    loader.update(checkpoint=CHECKPOINTS[ckpt], gemma=GEMMA, upscaler=UPSCALER,
                  devices=BAD_DEVICES if kind == "bad" else devices, world_size=world_size)
    wf[by["LTX2MGPU_TextEncode"]]["inputs"]["negative_prompt"] = "blurry"
    wf[by["EmptyLTXVLatentVideo"]]["inputs"].update(width=64, height=64, length=9)
    wf[by["LTXVEmptyLatentAudio"]]["inputs"]["frames_number"] = 9
    wf[by["LTXVAudioVAELoader"]]["inputs"]["ckpt_name"] = CHECKPOINTS[ckpt]
    wf[by["RandomNoise"]]["inputs"]["noise_seed"] = seed
    sampler = by["LTX2MGPU_SPSampler"]
    wf[sampler]["inputs"]["steps"] = steps
    if kind == "full":
        wf[by["LTX2MGPU_LoRA"]]["inputs"]["lora_name"] = LORA
        wf[by["SaveVideo"]]["inputs"]["filename_prefix"] = "ltx2-mgpu/soak"
        return wf
    for cls in ("LTX2MGPU_TDPUpscale", "LTX2MGPU_DistributedDecode", "CreateVideo", "SaveVideo", "LTX2MGPU_LoRA"):
        del wf[by[cls]]
    wf["900"] = {"class_type": "PreviewAny", "inputs": {"source": [sampler, 0]}}
    return wf


def message_kind(message: str) -> str:
    """A failure message with its numbers, ids and paths taken out: failures of one kind group together."""
    text = re.sub(r"/[\w./-]+", "<path>", message)
    text = re.sub(r"\b[0-9a-f]{12,}\b", "<id>", text)
    text = re.sub(r"(?<![A-Za-z])\d+(\.\d+)?", "N", text)
    return text[:300]


class Soak:
    def __init__(self, args, server: Server, runtime: Path, env: dict, files: dict):
        self.args, self.server, self.runtime, self.env, self.files = args, server, runtime, env, files
        self.lock = threading.Lock()
        self.taken = 0
        self.finished = 0
        self.stop_at = time.monotonic() + args.max_minutes * 60
        self.t0 = time.monotonic()
        self.outcomes = Counter()
        self.kinds = Counter()
        self.by_kind = Counter()  # "kind outcome" -> count
        self.failures: Counter = Counter()  # message kind -> count
        self.examples: dict[str, str] = {}
        self.cli = Counter()
        self.cli_failures: Counter = Counter()
        self.events: list[tuple[float, str]] = []
        self.samples: list[tuple[float, int, int | None, int]] = []  # t, pack processes, controller pid, RSS KiB
        self.over: list[str] = []
        self.config_index = 0
        self.done = threading.Event()
        self.kill_milestones: set[int] = set()
        self.quiet = threading.Event()  # set: the clients queue nothing (the CLI's quiet window)
        self.chaos_due = {"controller": int(args.prompts * 0.4), "restart": int(args.prompts * 0.7)}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def event(self, what: str) -> None:
        with self.lock:
            self.events.append((self.now(), what))
        print(f"  [{self.now():7.1f} s] {what}", flush=True)

    def take(self) -> int | None:
        while self.quiet.is_set() and time.monotonic() < self.stop_at:  # a CLI run in a quiet window
            time.sleep(0.2)
        with self.lock:
            if self.taken >= self.args.prompts or time.monotonic() > self.stop_at:
                return None
            self.taken += 1
            if self.taken % self.args.config_every == 0:
                self.config_index = (self.config_index + 1 + random.randrange(len(CONFIGS) - 1)) % len(CONFIGS)
            return self.taken

    def record(self, outcome: str, kind: str, message: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.by_kind[f"{kind} {outcome}"] += 1
            self.finished += 1
            if message is not None:
                key = f"{outcome}: {message_kind(message)}"
                self.failures[key] += 1
                self.examples.setdefault(key, message[:600])
            n = self.finished
        if n % 25 == 0:
            print(f"  {n} prompts ended ({dict(self.outcomes)}), {self.now():.0f} s", flush=True)

    # ---- a client ----------------------------------------------------------------------------------------------

    def client_loop(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        client_id = uuid.uuid4().hex
        while (n := self.take()) is not None:
            r = rng.random()
            if r < self.args.bad_prob:
                kind = "bad"
            elif r < self.args.bad_prob + self.args.interrupt_prob:
                kind = "interrupt"
            elif n % self.args.full_every == 0:
                kind = "full"
            else:
                kind = "sample"
            with self.lock:
                self.kinds[kind] += 1
                config = CONFIGS[self.config_index]
            wf = graph(kind, config, rng.randrange(1 << 31), 100 if kind == "interrupt" else rng.choice((1, 2)))
            try:
                self.run_prompt(wf, kind, client_id, rng)
            except Exception as exc:  # noqa: BLE001 - the soak goes on; counted as a failure of the harness
                self.record("failed", kind, f"soak client: {type(exc).__name__}: {exc}")
            self.chaos(rng)

    def wait_server(self) -> None:
        end = time.monotonic() + 600
        while (self.server.restarting.is_set() or not self.server.alive()) and time.monotonic() < end:
            time.sleep(0.5)

    def run_prompt(self, wf: dict, kind: str, client_id: str, rng: random.Random) -> None:
        self.wait_server()
        generation = self.server.generation
        url = self.server.url
        try:
            prompt_id = post(url, "/prompt", {"prompt": wf, "client_id": client_id})["prompt_id"]
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                info = json.loads(body)
                errs = [e.get("message", "") + ": " + e.get("details", "") for v in info.get("node_errors", {}).values()
                        for e in v.get("errors", [])] or [info.get("error", {}).get("message", body)]
                msg = f"rejected at queue time (HTTP {exc.code}): {'; '.join(errs)}"
            except ValueError:
                msg = f"rejected at queue time (HTTP {exc.code}): {body[:300]}"
            self.record("failed", kind, msg)
            return
        except OSError as exc:
            if self.server.generation != generation or self.server.restarting.is_set():
                self.record("dropped_by_restart", kind)
            else:
                self.record("failed", kind, f"POST /prompt: {type(exc).__name__}: {exc}")
            return
        interrupted = False
        deadline = time.monotonic() + self.args.prompt_timeout_s
        while time.monotonic() < deadline:
            if self.server.restarting.is_set():
                time.sleep(0.5)
                continue
            if self.server.generation != generation:
                # ComfyUI was restarted: its queue and history were in memory; the prompt is gone
                self.record("dropped_by_restart", kind)
                return
            try:
                h = get(url, f"/history/{prompt_id}")
            except OSError:
                time.sleep(0.5)
                continue
            entry = h.get(prompt_id)
            status = (entry or {}).get("status") or {}
            if status.get("status_str") in ("success", "error"):
                self.classify(entry, kind)
                return
            if kind == "interrupt" and not interrupted:
                try:
                    running = [item[1] for item in get(url, "/queue").get("queue_running", [])]
                except OSError:
                    running = []
                if prompt_id in running:
                    time.sleep(rng.uniform(0.2, 2.0))
                    try:
                        post(url, "/interrupt", {"prompt_id": prompt_id})
                        interrupted = True
                    except OSError:
                        pass
            time.sleep(0.2)
        self.record("hung", kind, f"prompt {prompt_id} ({kind}) did not end within {self.args.prompt_timeout_s:g} s")

    def classify(self, entry: dict, kind: str) -> None:
        status = entry["status"]
        if status["status_str"] == "success":
            self.record("completed", kind)
            return
        names = [m[0] for m in status.get("messages", [])]
        if "execution_interrupted" in names:
            self.record("interrupted", kind)
            return
        errors = [m[1] for m in status.get("messages", []) if m[0] == "execution_error"]
        if not errors or not (errors[0].get("exception_message") or "").strip():
            self.record("failed", kind, f"no message: {json.dumps(status)[:400]}")
            return
        err = errors[0]
        self.record("failed", kind, f"{err.get('node_type')}: {err.get('exception_type')}: "
                                    f"{err['exception_message'].strip()}")

    # ---- chaos -------------------------------------------------------------------------------------------------

    def chaos(self, rng: random.Random) -> None:
        with self.lock:
            n = self.finished
            kill_worker = (self.args.kill_worker_every and n % self.args.kill_worker_every == 0 and n > 0
                           and n not in self.kill_milestones)
            if kill_worker:
                self.kill_milestones.add(n)
            kill_controller = n >= self.chaos_due["controller"] > 0
            restart = n >= self.chaos_due["restart"] > 0
            if kill_controller:
                self.chaos_due["controller"] = 0
            if restart:
                self.chaos_due["restart"] = 0
        procs = pack_processes(f"{MARK}={self.env[MARK]}")
        if kill_worker:
            workers = [p for p, what in procs.items() if what.startswith("ltx2mgpu-rank")]
            if workers:
                victim = rng.choice(workers)
                os.kill(victim, signal.SIGKILL)
                self.event(f"SIGKILL worker {victim}")
        if kill_controller:
            ctl = [p for p, what in procs.items() if what.startswith("ltx2mgpu-ctl")]
            for p in ctl:
                os.kill(p, signal.SIGKILL)
                self.event(f"SIGKILL controller {p}")
        if restart:
            threading.Thread(target=self.restart_mid_job, daemon=True).start()

    def restart_mid_job(self) -> None:
        """Wait (up to 60 s) until a prompt runs, then SIGKILL ComfyUI and start it again."""
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if get(self.server.url, "/queue").get("queue_running"):
                    break
            except OSError:
                pass
            time.sleep(0.1)
        time.sleep(random.uniform(0.1, 1.0))
        self.event(f"SIGKILL ComfyUI {self.server.proc.pid} (deliberate restart)")
        away = self.server.kill_and_restart()
        self.event(f"ComfyUI up again as {self.server.proc.pid} after {away:.1f} s")

    def cli_loop(self) -> None:
        """A CLI generate every `--cli-every` finished prompts, on the same controller."""
        next_at = self.args.cli_every
        k = 0
        while not self.done.is_set():
            with self.lock:
                due = self.finished >= next_at
            if not due:
                time.sleep(0.5)
                continue
            next_at += self.args.cli_every
            k += 1
            out = self.runtime / f"cli-{k}.mp4"
            cmd = [self.args.cli_python, "-m", "mgpu_backend", "generate", "--prompt", "a red fox in snow",
                   "--checkpoint", self.files[CHECKPOINTS[k % 2]], "--gemma", self.files[GEMMA],
                   "--upscaler", self.files[UPSCALER], "--devices", "cpu:1", "--width", "64", "--height", "64",
                   "--frames", "9", "--steps", "1", "--seed", str(k), "--output", str(out)]
            quiet = k % 2 == 0  # every other run in a quiet window: the clients pause, ComfyUI's queue drains
            if quiet:
                self.quiet.set()
                self.wait_queue_empty()
            self.event(f"CLI run {k} starts" + (" (quiet window)" if quiet else ""))
            try:
                p = subprocess.run(cmd, env={**self.env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                                   timeout=self.args.prompt_timeout_s)
            except subprocess.TimeoutExpired:
                p = None
            finally:
                self.quiet.clear()
            if p is None:
                self.cli["hung"] += 1
                self.event(f"CLI run {k} hung")
                continue
            if p.returncode == 0 and out.is_file():
                self.cli["completed"] += 1
                out.unlink()
                self.event(f"CLI run {k} completed")
            else:
                lines = [line for line in p.stderr.splitlines() if line.strip() and "%|" not in line]
                msg = lines[-1].strip() if lines else ""
                self.cli["failed" if msg else "failed_without_message"] += 1
                key = f"rc {p.returncode}: {message_kind(msg)}"
                self.cli_failures[key] += 1
                self.examples.setdefault(f"cli {key}", msg[:600])
                self.event(f"CLI run {k} failed: {msg[:200]}")

    def wait_queue_empty(self, timeout_s: float = 300.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                q = get(self.server.url, "/queue")
                if not q.get("queue_running") and not q.get("queue_pending"):
                    return
            except OSError:
                pass
            time.sleep(0.2)

    # ---- sampling ----------------------------------------------------------------------------------------------

    def sample_loop(self) -> None:
        mark = f"{MARK}={self.env[MARK]}"
        while not self.done.is_set():
            procs = pack_processes(mark)
            ctl = [p for p, what in procs.items() if what.startswith("ltx2mgpu-ctl")]
            rss = rss_kib(ctl[0]) if ctl else 0
            t = self.now()
            with self.lock:
                self.samples.append((t, len(procs), ctl[0] if ctl else None, rss, self.finished))
                if len(procs) > MAX_RANKS + 1:
                    self.over.append(f"{t:.1f} s: {len(procs)} processes: " + "; ".join(procs.values()))
            if not self.server.alive() and not self.server.restarting.is_set() and not self.done.is_set():
                code = self.server.proc.returncode
                self.unasked(f"{t:.1f} s: ComfyUI exited with {code}")
            time.sleep(self.args.sample_s)

    def unasked(self, what: str) -> None:
        self.server.unasked_exits.append(what)
        self.event(what + "; starting it again")
        self.server.restarting.set()
        try:
            self.server.start()
        finally:
            self.server.restarting.clear()


# ---- results -------------------------------------------------------------------------------------------------------


def controller_lives(samples: list, warmup: int) -> list[dict]:
    """Per controller pid: its first sample, its RSS once `warmup` prompts ended in its life, and its last sample."""
    lives: dict[int, dict] = {}
    for t, _, pid, rss, finished in samples:
        if pid is None or rss == 0:
            continue
        life = lives.setdefault(pid, {"pid": pid, "from_s": t, "first_finished": finished, "rss_first_mib": rss / 1024})
        life.update(to_s=t, rss_end_mib=rss / 1024, last_finished=finished)
        if "rss_start_mib" not in life and finished - life["first_finished"] >= warmup:
            life["rss_start_mib"] = rss / 1024
    out = []
    for life in lives.values():
        life["prompts"] = life["last_finished"] - life["first_finished"]
        start = life.get("rss_start_mib")
        life["growth_percent"] = round((life["rss_end_mib"] - start) / start * 100, 2) if start else None
        out.append({k: round(v, 1) if isinstance(v, float) else v for k, v in life.items()})
    return out


def plot(samples: list, events: list, bound: int, title: str, path: Path) -> None:
    """PNG of the pack's process count over time (a step line), the bound (dashed) and the chaos events (vertical
    lines: worker SIGKILL red, controller SIGKILL purple, ComfyUI restart orange, CLI run green)."""
    from PIL import Image, ImageDraw

    w, h, left, right, top, bottom = 1200, 420, 60, 20, 40, 70
    t_max = max((s[0] for s in samples), default=1.0) or 1.0
    y_max = bound + 1
    x = lambda t: left + (w - left - right) * t / t_max  # noqa: E731
    y = lambda c: top + (h - top - bottom) * (1 - c / y_max)  # noqa: E731
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 12), title, fill="black")
    for c in range(y_max + 1):
        d.line([(left, y(c)), (w - right, y(c))], fill="#e6e6e6")
        d.text((left - 20, y(c) - 6), str(c), fill="black")
    step = max(60, round(t_max / 12 / 60) * 60)
    for t in range(0, int(t_max) + 1, step):
        d.text((x(t) - 12, h - bottom + 6), f"{t // 60} min", fill="black")
    colors = {"worker": "#d62728", "controller": "#9467bd", "ComfyUI": "#ff7f0e", "CLI": "#2ca02c"}
    for t, what in events:
        who = next((k for k in colors if k in what), None)
        if who and (who != "CLI" or "starts" in what) and "up" not in what.split()[1:2]:
            d.line([(x(t), top), (x(t), h - bottom)], fill=colors[who], width=1)
    for x0 in range(left, w - right, 12):  # the bound, dashed
        d.line([(x0, y(bound)), (min(x0 + 6, w - right), y(bound))], fill="black", width=1)
    d.text((w - right - 150, y(bound) - 14), f"bound: {bound - 1} ranks + 1", fill="black")
    pts, prev = [], None
    for t, count, *_ in samples:
        if prev is not None:
            pts.append((x(t), y(prev)))
        pts.append((x(t), y(count)))
        prev = count
    if len(pts) > 1:
        d.line(pts, fill="#1f77b4", width=2)
    legend = [("processes (controller + workers)", "#1f77b4"), ("worker SIGKILL", colors["worker"]),
              ("controller SIGKILL", colors["controller"]), ("ComfyUI restart", colors["ComfyUI"]),
              ("CLI run", colors["CLI"])]
    lx = left
    for label, color in legend:
        d.line([(lx, h - 22), (lx + 18, h - 22)], fill=color, width=3)
        d.text((lx + 24, h - 28), label, fill="black")
        lx += 60 + 7 * len(label)
    d.text((8, top - 20), "processes", fill="black")
    img.save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=600)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=50.0, help="stop queuing after this long")
    parser.add_argument("--config-every", type=int, default=20, help="a new configuration every N prompts")
    parser.add_argument("--full-every", type=int, default=10, help="every Nth prompt the whole two-stage graph")
    parser.add_argument("--interrupt-prob", type=float, default=0.05)
    parser.add_argument("--bad-prob", type=float, default=0.02, help="share of prompts with devices '512'")
    parser.add_argument("--kill-worker-every", type=int, default=50)
    parser.add_argument("--cli-every", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=30, help="prompts of a controller's life before its start RSS")
    parser.add_argument("--prompt-timeout-s", type=float, default=300.0)
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8190")))
    parser.add_argument("--comfy-dir", default=os.environ.get("COMFYUI_DIR", "/tmp/comfyui-soak"))
    parser.add_argument("--comfy-python", default=os.environ.get("COMFYUI_PYTHON", "/tmp/comfyvenv/bin/python"))
    parser.add_argument("--cli-python", default=None, help="the CLI's Python (default: --comfy-python)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write OUT.txt, OUT.json and OUT.png")
    args = parser.parse_args(argv)
    args.cli_python = args.cli_python or args.comfy_python
    random.seed(args.seed)
    comfy_dir = Path(args.comfy_dir)
    files = link_models(comfy_dir / "models")
    runtime = Path(tempfile.mkdtemp(prefix="ltx2-soak-comfy-"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"LTX2_MGPU_RUNTIME_DIR": str(runtime), MARK: f"{os.getpid()}-{time.time_ns()}"})
    shm_before = shm_blocks()
    server = Server(comfy_dir, args.comfy_python, args.port, env, runtime / "comfyui.log")
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    t0 = time.monotonic()
    server.start()
    soak = Soak(args, server, runtime, env, files)
    soak.event(f"ComfyUI up as {server.proc.pid} after {time.monotonic() - t0:.1f} s")
    say(f"soak: {args.prompts} prompts, {args.clients} clients + the CLI every {args.cli_every}, ComfyUI on port "
        f"{args.port} (runtime {runtime})")
    helpers = [threading.Thread(target=soak.sample_loop, daemon=True), threading.Thread(target=soak.cli_loop,
                                                                                        daemon=True)]
    clients = [threading.Thread(target=soak.client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    for t in helpers + clients:
        t.start()
    for t in clients:
        t.join()
    soak.done.set()
    for t in helpers:
        t.join(timeout=args.prompt_timeout_s)
    seconds = time.monotonic() - soak.t0
    server_alive_at_end = server.alive()

    # stop everything; then count what is left
    server.stop()
    from mgpu_backend.serving.client import ControllerClient
    from mgpu_backend.protocol.errors import ControllerError
    try:
        c = ControllerClient(runtime, start=False)
        c.stop()
        c.close()
    except (ControllerError, OSError):
        pass
    mark = f"{MARK}={env[MARK]}"
    end = time.monotonic() + 30
    while pack_processes(mark) and time.monotonic() < end:
        time.sleep(0.2)
    left = pack_processes(mark)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    leaked_shm = leaked_blocks(shm_before)

    o = soak.outcomes
    ended = sum(o.values())
    counts = [s[1] for s in soak.samples]
    lives = controller_lives(soak.samples, args.warmup)
    main_life = max(lives, key=lambda life: life["prompts"]) if lives else {}
    growth = main_life.get("growth_percent")
    unclear = sum(n for k, n in soak.failures.items() if "no message" in k) + soak.cli["failed_without_message"]
    figures = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "command": "python bench/soak_comfyui.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "comfyui": str(comfy_dir), "prompts_asked": args.prompts, "prompts_queued": soak.taken, "prompts_ended": ended,
        "seconds": round(seconds, 1), "prompt_kinds": dict(soak.kinds), "outcomes": dict(o),
        "outcomes_by_kind": dict(sorted(soak.by_kind.items())),
        "failures_by_kind": dict(soak.failures.most_common()), "cli": dict(soak.cli),
        "cli_failures_by_kind": dict(soak.cli_failures.most_common()), "examples": soak.examples,
        "events": soak.events, "max_processes": max(counts, default=0), "process_bound": MAX_RANKS + 1,
        "samples_over_bound": soak.over[:20], "n_samples": len(counts),
        "controller_lives": lives, "controller_rss_growth_percent": growth,
        "comfyui_unasked_exits": server.unasked_exits, "comfyui_alive_at_end": server_alive_at_end,
        "leaked_processes": left, "leaked_shm_files": leaked_shm,
        "samples_columns": ["seconds", "pack processes", "prompts ended", "controller pid", "controller RSS+swap KiB"],
        "samples": [[t, n, f, pid, rss] for t, n, pid, rss, f in soak.samples],
    }
    say(f"prompts queued {soak.taken} of {args.prompts} in {seconds / 60:.1f} min; ended {ended}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(o.items())) + f"  (kinds {dict(soak.kinds)})")
    say("  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(soak.by_kind.items())))
    say("failures by kind (numbers, ids, paths taken out):")
    for k, n in soak.failures.most_common():
        say(f"  {n:4d}  {k}")
    say(f"CLI runs: {dict(soak.cli)}")
    for k, n in soak.cli_failures.most_common():
        say(f"  {n:4d}  {k}")
    say(f"process count (controller + workers): max {max(counts, default=0)} over {len(counts)} samples every "
        f"{args.sample_s:g} s; bound {MAX_RANKS + 1} (ranks + 1); samples above it: {len(soak.over)}")
    for line in soak.over[:5]:
        say(f"  over: {line}")
    for life in lives:
        say(f"controller pid {life['pid']}: {life['from_s']:.0f}-{life['to_s']:.0f} s, {life['prompts']} prompts; "
            f"RSS+swap first {life['rss_first_mib']} MiB, after {args.warmup} prompts {life.get('rss_start_mib')} MiB, end "
            f"{life['rss_end_mib']} MiB ({life['growth_percent']} %)")
    say(f"ComfyUI exits not asked for: {len(server.unasked_exits)} {server.unasked_exits}; alive at the end: "
        f"{server_alive_at_end}")
    say(f"left after the stop: {len(left)} process(es) {list(left.values())[:5]}, {len(leaked_shm)} /dev/shm "
        f"block(s) {leaked_shm[:5]}")
    say("chaos events: " + ", ".join(f"{t:.0f} s {what}" for t, what in soak.events
                                      if "CLI" not in what))
    ok = (o["hung"] == 0 and soak.cli["hung"] == 0 and unclear == 0 and not left and not leaked_shm and not soak.over
          and not server.unasked_exits and server_alive_at_end and (growth is None or growth < 10.0))
    say("PASS" if ok else "FAIL")
    if args.out:
        out = Path(args.out)
        out.with_suffix(".txt").write_text(f"{figures['date']}  {figures['machine']}\n{figures['command']}\n\n"
                                           + "\n".join(lines) + "\n")
        out.with_suffix(".json").write_text(json.dumps(figures, indent=1) + "\n")
        plot(soak.samples, soak.events, MAX_RANKS + 1,
             f"ltx2-multigpu soak through ComfyUI 0.33 on {os.cpu_count()} CPU cores: the pack's processes over time "
             f"({ended} prompts, {figures['date']})", out.with_suffix(".png"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
