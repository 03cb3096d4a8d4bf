"""int8-convrot layers (ComfyUI's `int8_tensorwise` + ConvRot, the LTX-2.5 templates' transformer file): time of the
pack's `Int8Linear` — W8A8 through comfy-kitchen's `int8_linear` (what ComfyUI computes; the fleet option
`int8_compute="w8a8"`), W8A16 (`LTX2_MGPU_INT8_COMPUTE=w8a16`: dequantize per call, then a bf16 / fp32 matmul), and
the layer dequantized at load (`int8_compute="dequantize"`: `quant.dequantize_int8_linears`, an `nn.Linear` holding
ComfyUI's dequantized weight in the compute dtype) — and of a plain bf16 Linear holding the bf16 weight before
quantization, at LTX-2.5 22B block shapes; ratios to bf16 side by side, each path's relative L2 error to the fp32
product of the dequantized weight, the dequantized-at-load output's difference from W8A8 (rel L2 / max |Δ|, what a
user switching from ComfyUI's path sees), and the seconds the dequantization takes per layer at load.

    PYTHONPATH=. python bench/bench_int8.py [--tokens 3520 14080] [--device cuda] [--repeat 20]
    PYTHONPATH=. python bench/bench_int8.py --device cpu --tokens 256 --shapes attn1.to_q --repeat 3
    PYTHONPATH=. python bench/bench_int8.py --tiny-model   # the tiny LTX-2.5 twin files: forward differences

On CUDA it uses comfy-kitchen's backend as ComfyUI does (its "cuda" backend with torch cu130+, else "eager" with
`torch._int_mm`); without comfy-kitchen, the pack's torch copy of the eager math. Results go in bench/results/ with
the date, device and command.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mgpu_backend.models import quant as Q

# (name, in_features, out_features): LTX-2.5 22B video / audio block Linears
SHAPES = (("attn1.to_q", 4096, 4096), ("ff.net.0.proj", 4096, 16384), ("ff.net.2", 16384, 4096),
          ("audio attn1.to_q", 2048, 2048))
GROUP = 256  # ConvRot group size of the released files


def _time(fn, repeat: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeat * 1e3


def tiny_model() -> None:
    """The tiny LTX-2.5 transformer (bf16 file and its int8-convrot twin, `testing/tiny.py`), float32 compute: the
    forward's relative L2 / max |Δ| between the bf16 file, W8A8 and dequantized-at-load (tests/_forward.py input)."""
    import os
    import sys
    import tempfile

    from mgpu_backend.models.loader import load_components
    from mgpu_backend.testing.tiny import write_tiny_transformer

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from _forward import av_forward

    with tempfile.TemporaryDirectory() as d:
        bf16 = write_tiny_transformer(os.path.join(d, "bf16.safetensors"), "2.5", 0)
        int8 = write_tiny_transformer(os.path.join(d, "int8.safetensors"), "2.5", 0, quantization="int8-convrot")
        out = {}
        for label, path, mode in (("bf16 file", bf16, "w8a8"), ("W8A8", int8, "w8a8"), ("dequantized", int8,
                                                                                         "dequantize")):
            c = load_components(path, dtype=torch.float32, transformer_only=True, int8_compute=mode)
            out[label] = av_forward(c.transformer)
    print("tiny LTX-2.5 transformer (testing/tiny.py, ConvRot group 16), float32, one forward (tests/_forward.py)")
    print("pair | video rel L2 | video max |Δ| | audio rel L2 | audio max |Δ|")
    for a, b in (("dequantized", "W8A8"), ("dequantized", "bf16 file"), ("W8A8", "bf16 file")):
        cells = []
        for i in range(2):
            x, y = out[a][i].float(), out[b][i].float()
            cells += [f"{float((x - y).norm() / y.norm()):.2e}", f"{float((x - y).abs().max()):.2e}"]
        print(f"{a} vs {b} | " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[3520, 14080])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--shapes", nargs="+", default=None, help=f"layer names among {[s[0] for s in SHAPES]}")
    ap.add_argument("--tiny-model", action="store_true", help="the tiny 2.5 model's forward differences instead")
    args = ap.parse_args()
    if args.tiny_model:
        tiny_model()
        return
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"compute {dtype}, comfy-kitchen {'yes' if Q.kitchen_op() is not None else 'no (torch copy)'}")
    print(f"layer | tokens | {str(dtype)[6:]} Linear ms | W8A8 ms (ratio) | W8A16 ms (ratio) | dequantized-at-load ms "
          "(ratio) | rel L2 W8A8 / W8A16 / dequantized (to the fp32 product of the dequantized weight) | dequantized "
          "vs W8A8 rel L2 / max |Δ| | dequantized vs bf16 weight rel L2 | dequantize at load ms")
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, k, n in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        w = torch.randn(n, k, generator=g) / k ** 0.5
        q, s = Q.quantize_int8(w, GROUP)
        layer = Q.Int8Linear(k, n, True, dtype, convrot_group=GROUP, per_row_scale=True)
        bias = torch.randn(n, generator=g) * 0.01
        layer.load_state_dict({"weight": q, "weight_scale": s, "bias": bias.to(dtype)})
        layer.to(device)
        w_deq = layer.dequantized_weight()
        w_orig = w.to(device, dtype)  # the weight before quantization (a bf16 file's)
        holder = torch.nn.Sequential(Q.Int8Linear(k, n, True, dtype, convrot_group=GROUP, per_row_scale=True))
        holder[0].load_state_dict(layer.state_dict())
        holder.to(device)
        _sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        _sync()
        t0 = time.perf_counter()
        Q.dequantize_int8_linears(holder)
        _sync()
        t_conv = (time.perf_counter() - t0) * 1e3
        deq = holder[0]
        for tokens in args.tokens:
            x = torch.randn(tokens, k, generator=g).to(device, dtype)
            exact = F.linear(x.float(), w_deq.float(), bias.to(device))
            with torch.no_grad():
                t_bf = _time(lambda: F.linear(x, w_orig, layer.bias), args.repeat, device)
                Q.INT8_COMPUTE = "w8a8"
                t_8 = _time(lambda: layer(x), args.repeat, device)
                y_8 = layer(x).float()
                e_8 = float((y_8 - exact).norm() / exact.norm())
                Q.INT8_COMPUTE = "w8a16"
                t_16 = _time(lambda: layer(x), args.repeat, device)
                e_16 = float((layer(x).float() - exact).norm() / exact.norm())
                Q.INT8_COMPUTE = "w8a8"
                t_d = _time(lambda: deq(x), args.repeat, device)
                y_d = deq(x).float()
                e_d = float((y_d - exact).norm() / exact.norm())
                y_bf = F.linear(x, w_orig, layer.bias).float()
                d_8 = float((y_d - y_8).norm() / y_8.norm())
                m_8 = float((y_d - y_8).abs().max())
                d_bf = float((y_d - y_bf).norm() / y_bf.norm())
            print(f"{name} | {tokens} | {t_bf:.3f} | {t_8:.3f} ({t_8 / t_bf:.2f}x) | {t_16:.3f} ({t_16 / t_bf:.2f}x) | "
                  f"{t_d:.3f} ({t_d / t_bf:.2f}x) | {e_8:.2e} / {e_16:.2e} / {e_d:.2e} | {d_8:.2e} / {m_8:.2e} | "
                  f"{d_bf:.2e} | {t_conv:.1f}", flush=True)


if __name__ == "__main__":
    main()
