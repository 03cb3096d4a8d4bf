"""`bench/bench_e2e.py --tiny` runs on CPU in every mode that can (issue 27): the modes that cannot are refused by name
(never replaced by another mode), and the FLOP column holds the counts of `engine/flops.py` for the stage's real
token counts — recomputed here from the tiny model's config and the latent sizes, independently of the bench."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_backend.engine import latents as L
from mgpu_backend.models import configs
from mgpu_backend.testing.tiny import tiny_transformer_metadata
from mgpu_backend.engine import flops as F

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tiny", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _shape(variant: str) -> F.TransformerShape:
    return F.TransformerShape.of(configs.transformer_kwargs(tiny_transformer_metadata(variant)))


STAGE2 = re.compile(r"^stage 2 .*?(\d+) video \+ (\d+) audio tokens, (\d+) text, 3 forwards .*?, ([0-9.e+]+) FLOP "
                    r"\((\d+) blocks\)", re.M)


@pytest.mark.slow
def test_two_stage_modes_on_cpu():
    out = _run("--modes", "eager,default,compiled,fp8", "--no-warmup", "--stage1-steps", "2")
    # refused by name, with the reason; nothing else ran in their place
    assert "[compiled] compiled: refused on CPU" in out
    assert "[fp8] fp8: refused on cpu" in out and "compute capability ≥ 8.9" in out
    assert "[compiled] two-stage" not in out and "[fp8] two-stage" not in out
    n, ta = L.video_token_count(9, 128, 128), L.audio_latent_frames(9, 24.0)
    found = STAGE2.findall(out)
    assert len(found) == 2, out  # eager and default
    for video, audio, text, flop, blocks in found:
        assert (int(video), int(audio), int(blocks)) == (n, ta, 2)
        expected = 3 * F.forward_flops(_shape("2.0"), n, ta, int(text)).total
        assert float(flop) == pytest.approx(expected, rel=1e-5)
    assert "peak unknown ('cpu' is not in the dense-peak table)" in out
    assert re.search(r"^stage 1 .* 8 passes = 2 steps × 4 in 8 forwards", out, re.M)
    # the side-by-side table names every mode asked for
    table = out[out.index("modes side by side"):]
    assert all(m in table for m in ("eager", "default", "compiled", "fp8")) and table.count("refused") >= 2


@pytest.mark.slow
def test_ltx25_distilled_preset_on_cpu():
    out = _run("--preset", "ltx25-distilled", "--modes", "default,int8")
    shape = _shape("2.5")
    ta = L.audio_latent_frames(9, 24.0)
    for mode in ("default", "int8"):
        section = out[out.index(f"[{mode}] LTX-2.5 distilled transformer stages"):]
        for stage, (w, h), steps in (("stage 1", (64, 64), 8), ("stage 2", (128, 128), 3)):
            n = L.video_token_count(9, h, w)
            m = re.search(rf"^{stage} .*?(\d+) video \+ (\d+) audio tokens, {steps} forwards, ([0-9.e+]+) FLOP",
                          section, re.M)
            assert m, section
            assert (int(m[1]), int(m[2])) == (n, ta)
            assert float(m[3]) == pytest.approx(steps * F.forward_flops(shape, n, ta, 16).total, rel=1e-5)
    assert "W8A8" in out


def test_profile_categories_put_kernels_where_they_belong():
    """`bench/profile_forward.category` on kernel names as the CUDA profiler prints them: an elementwise multiply's
    name contains "nocast" and is elementwise, not a cast (the first H100 profile put 37 ms of them under copies)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from profile_forward import category

    mul = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor"
           "<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > > >")
    copy = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}> >")
    assert category(mul) == "other elementwise"
    assert category(copy) == "copy / cast"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert category("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_bias_TNT") == "gemm"
    assert category("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>") == "norm"
