"""int8-convrot layers (ComfyUI's `int8_tensorwise` + ConvRot, the LTX-2.5 templates' transformer file): time of the
pack's `Int8Linear` — W8A8 through comfy-kitchen's `int8_linear` (what ComfyUI computes; the default), W8A16
(`LTX2_MGPU_INT8_COMPUTE=w8a16`: dequantize per call, then a bf16 / fp32 matmul) — and of a plain bf16 Linear, at
LTX-2.5 22B block shapes; ratios to bf16 side by side, and each path's relative L2 error to the fp32 product of the
dequantized weight.

    PYTHONPATH=. python bench/bench_int8.py [--tokens 3520 14080] [--device cuda] [--repeat 20]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[3520, 14080])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"compute {dtype}, comfy-kitchen {'yes' if Q.kitchen_op() is not None else 'no (torch copy)'}")
    print(f"layer | tokens | {str(dtype)[6:]} Linear ms | W8A8 ms (ratio) | W8A16 ms (ratio) | rel L2 W8A8 / W8A16 "
          "(to the fp32 product of the dequantized weight)")
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, k, n in SHAPES:
        w = torch.randn(n, k, generator=g) / k ** 0.5
        q, s = Q.quantize_int8(w, GROUP)
        layer = Q.Int8Linear(k, n, True, dtype, convrot_group=GROUP, per_row_scale=True)
        bias = torch.randn(n, generator=g) * 0.01
        layer.load_state_dict({"weight": q, "weight_scale": s, "bias": bias.to(dtype)})
        layer.to(device)
        w_deq = layer.dequantized_weight()
        for tokens in args.tokens:
            x = torch.randn(tokens, k, generator=g).to(device, dtype)
            exact = F.linear(x.float(), w_deq.float(), bias.to(device))
            with torch.no_grad():
                t_bf = _time(lambda: F.linear(x, w_deq, layer.bias), args.repeat, device)
                Q.INT8_COMPUTE = "w8a8"
                t_8 = _time(lambda: layer(x), args.repeat, device)
                e_8 = float((layer(x).float() - exact).norm() / exact.norm())
                Q.INT8_COMPUTE = "w8a16"
                t_16 = _time(lambda: layer(x), args.repeat, device)
                e_16 = float((layer(x).float() - exact).norm() / exact.norm())
                Q.INT8_COMPUTE = "w8a8"
            print(f"{name} | {tokens} | {t_bf:.3f} | {t_8:.3f} ({t_8 / t_bf:.2f}x) | {t_16:.3f} ({t_16 / t_bf:.2f}x) | "
                  f"{e_8:.2e} / {e_16:.2e}")


if __name__ == "__main__":
    main()
