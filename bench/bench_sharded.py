"""Sharded weights (issue 26) on one GPU: what one rank of a W-rank sharded fleet holds and peaks at, its forward
time against a replica's, and the step times predicted for consumer links.

One rank of W is simulated: a fake process group (`torch.testing._internal.distributed.fake_pg`, rank 0 of W: the
collectives return at once, moving no data) under the real loader and `weights/sharding.py`, so the memory is that
rank's real memory: its shards, the replicated rest, one gathered layer at a time. The sequence-parallel exchange is
`bench_memory.MemoryExchange` (the real exchange's buffers, on one GPU). Steps:

1. `--write PATH`: a real-size random-weight transformer-only file in the released layout, LTX-2.3-shaped (48
   blocks, video 32 × 128, audio 32 × 64, gated attention, prompt AdaLN; text connectors of `--connector-layers`
   blocks), its block Linears float8_e4m3fn in ComfyUI's `.comfy_quant` layout (`--quantization fp8`) or bf16.
2. For each W: a fresh process loads the file with the real loader (a memory map on the host), shards it
   (`shard_transformer`, only this rank's shards reach the GPU) under a per-process memory fraction (`--budget-gib`,
   a 24 GB card by default), and reports: resident weights (`torch.cuda.memory_allocated`) against the replica's
   bytes and the 1/W target; then one no-grad forward per size (warm-up + measured) through the sequence-parallel
   wrapper with the W-way exchange: the rank's peak (`max_memory_allocated`) and forward time.
3. The replica's forward (W = 1, no budget) at the same sizes, for the time ratio.
4. Predicted step times: compute (measured) + the all-gathers FSDP adds per forward (the units' bytes × (W−1)/W,
   not overlapped: no prefetch) + the Ulysses all_to_alls, over a link of `--links` GB/s each (PCIe 4.0 x16 without
   P2P through host memory ≈ 10 GB/s bus bandwidth, with P2P ≈ 22, NVLink on H100/H200 ≈ 350); and the bytes tensor
   parallelism would move instead (2 all-reduces per attention and feed-forward, ∝ tokens).

    python bench/bench_sharded.py --write /tmp/ltx23-fp8.safetensors && \\
        python bench/bench_sharded.py --file /tmp/ltx23-fp8.safetensors --out bench/results/sharded_h200.txt
    python bench/bench_sharded.py --tiny          # CPU smoke check of every code path (tiny shapes)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"

# `config.transformer` of an LTX-2.3-shaped 22B transformer (docs/design/models.md#the-releases: 48 blocks,
# video 32 × 128, audio 32 × 64)
LTX23_SHAPE = {
    "num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
    "caption_channels": 3840, "num_layers": 48, "connector_num_attention_heads": 32,
    "connector_attention_head_dim": 128, "audio_connector_num_attention_heads": 32,
    "audio_connector_attention_head_dim": 64,
}
# (frames, width, height, batch): the two-stage template's stage 1 (half size, CFG: 2 passes batched) and stage 2
SIZES = ((121, 640, 352, 2), (121, 1280, 704, 1))


def shape_meta(tiny: bool, connector_layers: int, variant: str = "2.3") -> dict:
    """`config.transformer` of the file: the tiny model's, or the 22B shape (2.3 and 2.5 share it; 2.5's flags differ:
    no video feed-forward bias, the keyframe embedding)."""
    from mgpu_backend.testing.tiny import tiny_transformer_metadata

    meta = tiny_transformer_metadata(variant)
    if not tiny:
        meta.update(LTX23_SHAPE, connector_num_layers=connector_layers)
    return meta


def write_file(path: str, tiny: bool, connector_layers: int, quantization: str | None, device,
               variant: str = "2.3") -> dict:
    """Build the transformer + connectors on `device` with random weights and write them in the released layout."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d

    from bench_memory import fill_random_, quiet_diffusers
    from mgpu_backend.models import configs
    from mgpu_backend.models.quant import DEFAULT_CONVROT_GROUP
    from mgpu_backend.testing.tiny import write_transformer_file

    quiet_diffusers()
    meta = shape_meta(tiny, connector_layers, variant)
    t0 = time.perf_counter()
    with torch.device("meta"):
        modules = {"transformer": LTX2VideoTransformer3DModel(**configs.transformer_kwargs(meta)),
                   "video_connector": LTX2ConnectorTransformer1d(**configs.connector_kwargs(meta, audio=False)),
                   "audio_connector": LTX2ConnectorTransformer1d(**configs.connector_kwargs(meta, audio=True))}
    for i, (name, m) in enumerate(modules.items()):
        # filled on the device (fast), held on the host while written (an 80 GB card cannot hold the bf16 modules
        # and their converted copies at once)
        modules[name] = fill_random_(m.to(torch.bfloat16).to_empty(device=device), seed=i).to("cpu")
    params = sum(p.numel() for m in modules.values() for p in m.parameters())
    write_transformer_file(Path(path), modules, meta, quantization=quantization,
                           model_version=f"ltx-{variant}-shape-random", to_cpu=True,
                           convrot_group=16 if tiny else DEFAULT_CONVROT_GROUP)
    return {"params": params, "bytes": os.path.getsize(path), "seconds": time.perf_counter() - t0}


def write_lora(path: str, tiny: bool, rank: int, variant: str = "2.3", scale: float = 0.01) -> dict:
    """A distilled-LoRA-shaped file for the file `--write` makes: a rank-`rank` pair (bf16, alpha = rank) on every
    attention and feed-forward Linear of the blocks (the layers Lightricks' distilled LoRA touches; as
    `testing.tiny.write_tiny_lora`), random values of `scale`."""
    from diffusers import LTX2VideoTransformer3DModel
    from safetensors.torch import save_file
    from torch import nn

    from mgpu_backend.models import configs, keymaps

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**configs.transformer_kwargs(shape_meta(tiny, 1, variant)))
    g = torch.Generator().manual_seed(7)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("transformer_blocks.") and "gate_logits" not in name:
            key = "diffusion_model." + keymaps.transformer_to_original(name)
            state[key + ".lora_A.weight"] = (torch.randn(rank, module.in_features, generator=g) * scale).bfloat16()
            state[key + ".lora_B.weight"] = (torch.randn(module.out_features, rank, generator=g) * scale).bfloat16()
            state[key + ".alpha"] = torch.tensor(float(rank))
    save_file(state, path, metadata={"format": "ltx-lora", "rank": str(rank)})
    return {"pairs": len(state) // 3, "bytes": os.path.getsize(path)}


def _inputs(model, frames: int, width: int, height: int, batch: int, device, dtype) -> tuple[dict, int]:
    """Forward inputs of the 2.3 transformer at one size (processed text contexts: video 4096 / audio 2048 wide)."""
    from mgpu_backend.engine import latents as L

    f, h, w = L.latent_frames(frames), height // 32, width // 32
    t, ta = f * h * w, L.audio_latent_frames(frames, 24.0)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    dv = cfg.num_attention_heads * cfg.attention_head_dim
    da = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    kw = dict(hidden_states=randn(batch, t, cfg.in_channels),
              audio_hidden_states=randn(batch, ta, cfg.audio_in_channels),
              encoder_hidden_states=randn(batch, 1024, dv), audio_encoder_hidden_states=randn(batch, 1024, da),
              timestep=torch.full((batch, t), 700.0, device=device),
              audio_timestep=torch.full((batch, ta), 700.0, device=device),
              sigma=torch.full((batch,), 700.0, device=device), audio_sigma=torch.full((batch,), 700.0, device=device),
              encoder_attention_mask=torch.ones(batch, 1024, device=device),
              audio_encoder_attention_mask=torch.ones(batch, 1024, device=device),
              video_coords=L.video_coords(model, batch, f, h, w, 24.0, device=device),
              audio_coords=L.audio_coords(model, batch, ta, device=device), use_cross_timestep=True)
    return kw, t


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rank(path: str, world: int, sizes, budget_gib: float | None, device, repeat: int,
                 profile: bool = False, lora: str | None = None, weights: str = "sharded") -> dict:
    """Rank 0 of a `world`-rank sharded fleet (world 1: the replica, not sharded), in this process; `lora`
    (`PATH[:STRENGTH]`): fused after loading (`weights.lora.LoRAFuser`, as a job fuses it), its memory reported.
    `weights`: "sharded" (every unit) or "placed" / "auto" (the worker's `place_weights` under the budget)."""
    import torch.distributed as dist

    from bench_memory import MemoryExchange, quiet_diffusers
    from mgpu_backend.models.loader import load_components
    from mgpu_backend.testing.diffusers_inputs import SequenceDriver
    from mgpu_backend.weights.sharding import shard_transformer

    quiet_diffusers()
    out: dict = {"world": world, "rows": []}
    if device.type == "cuda":
        torch.zeros(1, device=device)  # initialize CUDA before the memory statistics are read
    if device.type == "cuda" and budget_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * GiB / total), device)
        out["budget_gib"] = budget_gib
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    c = load_components(path, dtype=dtype, device=torch.device("cpu"), transformer_only=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        placement = None
        if weights != "sharded":  # as the worker places them (serving/worker.py): the header's sizes, the budget
            from mgpu_backend.models.loader import weight_bytes
            from mgpu_backend.protocol.fleet_rules import place_weights

            header_sizes = weight_bytes([path], dtype, transformer_only=True)
            placement = place_weights(header_sizes, world, int(budget_gib * GiB) if budget_gib else None, weights)
            out["placement"] = placement.describe()
        report = shard_transformer(c.transformer, device, connectors=(c.video_connector, c.audio_connector),
                                   placement=placement)
        out["report"] = {k: v for k, v in report.__dict__.items() if k != "placement"} | {"resident_bytes": report.resident_bytes,
                                           "replica_bytes": report.replica_bytes}
    else:
        for m in (c.transformer, c.video_connector, c.audio_connector):
            m.to(device)
    _sync(device)
    out["load_seconds"] = time.perf_counter() - t0
    if device.type == "cuda":
        out["resident"] = torch.cuda.memory_allocated(device)
        out["load_peak"] = torch.cuda.max_memory_allocated(device)
    model = c.transformer
    if lora:
        from mgpu_backend.weights.lora import LoRAFuser, parse_lora_arg, read_lora

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fuser = LoRAFuser(model, rank=0, world_size=world)
        reports = fuser.fuse([read_lora(*parse_lora_arg(lora))])
        _sync(device)
        out["lora"] = {"report": str(reports[0]), "stats": fuser.fuse_stats.__dict__}
        if device.type == "cuda":
            out["lora"] |= {"resident": torch.cuda.memory_allocated(device),
                            "fuse_peak": torch.cuda.max_memory_allocated(device)}
    if world > 1:  # every block gathered once, as the native forward's loop does (`gathered`): the gathers alone
        from mgpu_backend.weights.sharding import gathered

        for _ in range(2):
            start = time.perf_counter()
            for _block in gathered(model.transformer_blocks):
                pass
            _sync(device)
        out["gather_sweep_ms"] = (time.perf_counter() - start) * 1000
    for frames, width, height, batch in sizes:
        row = {"size": f"{width}x{height}x{frames}", "batch": batch}
        try:
            kw, tokens = _inputs(model, frames, width, height, batch, device, dtype)
            row["tokens"] = tokens
            wrapper = SequenceDriver(model, MemoryExchange(world))
            wrapper.activate()
            with torch.no_grad():
                wrapper(**kw)  # warm-up
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                for _ in range(repeat):
                    wrapper(**kw)
                _sync(device)
            row["ms"] = (time.perf_counter() - start) / repeat * 1000
            if profile:
                from torch.profiler import ProfilerActivity, profile as torch_profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with torch.no_grad(), torch_profile(activities=activities) as prof:
                    wrapper(**kw)
                    _sync(device)
                sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
                print(f"PROFILE W={world} {row['size']} B={batch}\n"
                      + prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                                max_name_column_width=60))
                profile = False  # the first size only
            if device.type == "cuda":
                row["peak"] = torch.cuda.max_memory_allocated(device)
                row["peak_reserved"] = torch.cuda.max_memory_reserved(device)
            del kw
        except torch.OutOfMemoryError as exc:
            row["error"] = f"OOM: {str(exc).splitlines()[0][:160]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["rows"].append(row)
    return out


# ---- what the links would add ----------------------------------------------------------------------------------------

def comm_seconds(unit_bytes: int, tokens: int, batch: int, world: int, gbps: float, blocks: int = 48,
                 width: int = 4096) -> dict:
    """Bytes and seconds one rank's forward moves, per scheme, over a link of `gbps` GB/s (bus bandwidth; ring
    collectives move (W−1)/W of their data per rank):
    - FSDP all-gathers: every unit's weights once per forward: unit_bytes × (W−1)/W (∝ model size);
    - Ulysses all_to_all: q, k, v there and the output back per block: 4 × B·T·width·2 B × (W−1)/W / W;
    - tensor parallel instead (for comparison): 2 all-reduces of B·T·width·2 B per attention and feed-forward of
      the video stream (4 per block: self, text, a2v, ff; the audio stream's are ~1/40 of it) × 2(W−1)/W."""
    from mgpu_backend.protocol.resources import sharded_gather_seconds

    ring = (world - 1) / world
    fsdp = unit_bytes * ring
    ulysses = blocks * 4 * batch * tokens * width * 2 * ring / world
    tp = blocks * 4 * 2 * batch * tokens * width * 2 * ring
    return {"fsdp_bytes": fsdp, "ulysses_bytes": ulysses, "tp_bytes": tp,
            "fsdp_s": sharded_gather_seconds(unit_bytes, world, gbps), "ulysses_s": ulysses / (gbps * 1e9), "tp_s": tp / (gbps * 1e9)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", help="write the random-weight file to this path and exit")
    p.add_argument("--file", help="the transformer file to measure (from --write)")
    p.add_argument("--quantization", choices=("fp8", "int8-convrot", "none"), default="fp8",
                   help="block Linears of --write: fp8 (LTX-2.3 fp8 files), int8-convrot (LTX-2.5's template file)")
    p.add_argument("--variant", choices=("2.3", "2.5"), default="2.3", help="the family whose flags --write uses")
    p.add_argument("--sizes", default=None,
                   help="FRAMESxWIDTHxHEIGHTxBATCH,… (default: the LTX-2.3 two-stage template's stage 1 at CFG "
                        "(B=2) and stage 2; LTX-2.5's templates run CFG 1: 121x640x352x1,121x1280x704x1)")
    p.add_argument("--connector-layers", type=int, default=8)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--budget-gib", type=float, default=24.0, help="per-process GPU memory of a sharded rank")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--links", default="pcie4-host:10,pcie4-p2p:22,nvlink:350")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the code paths)")
    p.add_argument("--one", type=int, default=None, help="measure one W in this process (prints JSON)")
    p.add_argument("--profile", action="store_true", help="with --one: torch.profiler tables of the first size")
    p.add_argument("--write-lora", help="write a distilled-LoRA-shaped file (--lora-rank) to this path and exit")
    p.add_argument("--lora-rank", type=int, default=111, help="rank of --write-lora (LTX-2.3's distilled LoRA: 111)")
    p.add_argument("--lora", default=None, help="PATH[:STRENGTH]: fuse this LoRA on every rank before the forwards")
    p.add_argument("--weights", choices=("sharded", "placed", "auto"), default="sharded",
                   help="W > 1: every unit sharded, or placed under --budget-gib as the worker places them")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    if args.sizes:
        sizes = tuple(tuple(int(v) for v in s.split("x")) for s in args.sizes.split(","))
        if any(len(s) != 4 for s in sizes):
            p.error(f"--sizes {args.sizes!r}: each size is FRAMESxWIDTHxHEIGHTxBATCH")
    else:
        sizes = ((9, 64, 64, 2), (9, 128, 64, 1)) if args.tiny else SIZES
    quantization = None if args.quantization == "none" else args.quantization
    if args.tiny and not args.file:
        args.file = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
        write_file(args.file, True, 1, quantization, device, args.variant)
    if args.write_lora:
        print(json.dumps(write_lora(args.write_lora, args.tiny, args.lora_rank, args.variant)))
        return
    if args.write:
        info = write_file(args.write, args.tiny, args.connector_layers, quantization, device, args.variant)
        print(json.dumps(info))
        return
    if args.one is not None:
        res = measure_rank(args.file, args.one, sizes, args.budget_gib if args.one > 1 else None, device,
                           args.repeat, args.profile, args.lora, args.weights)
        print("RESULT " + json.dumps(res, default=str))
        return
    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"# bench_sharded.py — {datetime.date.today()} — {name} — torch {torch.__version__}")
    log(f"# command: python bench/bench_sharded.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    log(f"# file: {args.file} ({os.path.getsize(args.file) / GiB:.2f} GiB)")
    results = {}
    for world in [1] + [int(w) for w in args.worlds.split(",")]:
        cmd = [sys.executable, __file__, "--file", args.file, "--one", str(world), "--budget-gib",
               str(args.budget_gib), "--repeat", str(args.repeat)] + (["--tiny"] if args.tiny else []) \
            + (["--sizes", args.sizes] if args.sizes else []) + (["--lora", args.lora] if args.lora else []) \
            + ["--weights", args.weights]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            log(f"W={world}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            continue
        results[world] = json.loads(found[0][len("RESULT "):])
    replica = results.get(1, {})
    for world, res in results.items():
        if world == 1:
            log(f"\nreplica (W=1, whole transformer on the GPU, no budget): load {res['load_seconds']:.1f} s, "
                f"resident {res.get('resident', 0) / GiB:.2f} GiB")
        else:
            r = res["report"]
            ratio = res.get("resident", r["resident_bytes"]) / r["replica_bytes"]
            how = res.get("placement", "sharded")
            log(f"\nW={world} rank 0 ({how}, {res.get('budget_gib', '-')} GiB budget): load+shard "
                f"{res['load_seconds']:.1f} s; {r['units']} units; resident {res.get('resident', 0) / GiB:.2f} GiB "
                f"(shards {r['sharded_bytes'] / GiB:.2f} + replicated {r['replicated_bytes'] / GiB:.2f}) of a "
                f"{r['replica_bytes'] / GiB:.2f} GiB replica = {ratio:.3f} (target ≤ 1/{world} + 5 % = "
                f"{1 / world + 0.05:.3f}: {'met' if ratio <= 1 / world + 0.05 else 'NOT met'}); peak while sharding "
                f"{res.get('load_peak', 0) / GiB:.2f} GiB; every block gathered once (no compute, collectives "
                f"simulated): {res.get('gather_sweep_ms', float('nan')):.0f} ms")
        if "lora" in res:
            lo = res["lora"]
            st = lo["stats"]
            log(f"  LoRA {lo['report']}: {st['layers']} layers fused in {st['seconds']:.1f} s; clean copies kept "
                f"{st['clean_bytes'] / GiB:.2f} GiB, full-precision copies {st['fused_bytes'] / GiB:.2f} GiB"
                + (f"; resident after {lo['resident'] / GiB:.2f} GiB, peak while fusing {lo['fuse_peak'] / GiB:.2f}"
                   " GiB" if "resident" in lo else ""))
        for row in res["rows"]:
            if "error" in row:
                log(f"  {row['size']} B={row['batch']}: {row['error']}")
                continue
            base = next((x for x in replica.get("rows", []) if x["size"] == row["size"] and "ms" in x), None)
            vs = f", {row['ms'] / base['ms']:.3f}× the replica's {base['ms']:.0f} ms" if base and world > 1 else ""
            peak = f", peak {row['peak'] / GiB:.2f} GiB (reserved {row['peak_reserved'] / GiB:.2f})" \
                if "peak" in row else ""
            log(f"  {row['size']} B={row['batch']}: {row['tokens']} video tokens, {-(-row['tokens'] // world)} "
                f"per rank{peak}, forward {row['ms']:.1f} ms{vs}")
            if world > 1:
                for link in args.links.split(","):
                    label, gbps = link.split(":")
                    c = comm_seconds(res["report"]["unit_bytes"], row["tokens"], row["batch"], world, float(gbps))
                    step = row["ms"] / 1000 + c["fsdp_s"] + c["ulysses_s"]
                    log(f"    predicted over {label} ({gbps} GB/s): {step:.2f} s per forward = compute "
                        f"{row['ms'] / 1000:.2f} + FSDP all-gathers {c['fsdp_bytes'] / 1e9:.1f} GB "
                        f"{c['fsdp_s']:.2f} s + Ulysses {c['ulysses_bytes'] / 1e9:.2f} GB {c['ulysses_s']:.2f} s "
                        f"(tensor parallel would move {c['tp_bytes'] / 1e9:.1f} GB: {c['tp_s']:.2f} s)")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
