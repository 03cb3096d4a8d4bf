"""Sampling recipe: LTX-2 sigma schedule, noise, Euler steps, guidance combination, the denoising loop (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from mgpu_backend.engine import sampling as S

# --- schedule ------------------------------------------------------------------------------------------------------------


def _formula_f64(steps: int, tokens: int, max_shift=2.05, base_shift=0.95, stretch=True, terminal=0.1) -> list[float]:
    """Independent float64 evaluation of the LTX-2 scheduler formula (see mgpu_backend.engine.sampling.ltx2_sigmas)."""
    m = (max_shift - base_shift) / (4096 - 1024)
    shift = tokens * m + (base_shift - 1024 * m)
    raw = [1.0 - i / steps for i in range(steps + 1)]
    out = [math.exp(shift) / (math.exp(shift) + (1.0 / s - 1.0)) if s != 0 else 0.0 for s in raw]
    if stretch:
        k = (1.0 - out[-2]) / (1.0 - terminal)
        out = [1.0 - (1.0 - s) / k if s != 0 else 0.0 for s in out]
    return out


@pytest.mark.parametrize("steps,tokens", [(30, 3520), (20, 14080), (40, 4096), (8, 1024)])
def test_sigmas_match_formula(steps, tokens):
    s = S.ltx2_sigmas(steps, tokens)
    assert s.dtype == torch.float32 and s.shape == (steps + 1,)
    torch.testing.assert_close(s.double(), torch.tensor(_formula_f64(steps, tokens), dtype=torch.float64),
                               rtol=0, atol=2e-6)


def test_sigmas_no_stretch_matches_formula():
    s = S.ltx2_sigmas(12, 2000, stretch=False)
    torch.testing.assert_close(s.double(), torch.tensor(_formula_f64(12, 2000, stretch=False), dtype=torch.float64),
                               rtol=0, atol=2e-6)


# Values produced by the reference itself: LTX2Scheduler.execute from Lightricks/LTX-2 @ 400fd31
# (packages/ltx-core/src/ltx_core/components/schedulers.py), run on CPU torch 2.13 with
#   execute(steps=8, latent=torch.zeros(1, 128, 16, 11, 20))        -> 3520 tokens (121 frames @ 640x352)
#   execute(steps=30)  (no latent -> 4096 tokens, as ti2vid_two_stages stage 1 calls it)
#   execute(steps=4, latent=torch.zeros(1, 128, 4, 16, 16), stretch=False/True)  -> 1024 tokens
#   execute(steps=1)
# ComfyUI's LTXVScheduler (comfy_extras/nodes_lt.py) evaluates the same expression.
REF_8_3520 = [1.0, 0.9621454477310181, 0.914201021194458, 0.851513147354126, 0.7660449743270874,
              0.6426222324371338, 0.44874656200408936, 0.09999996423721313, 0.0]
REF_30_DEFAULT_HEAD = [0.9999999403953552, 0.9949570298194885, 0.9896030426025391]
REF_30_DEFAULT_TAIL = [0.3875408172607422, 0.26612043380737305, 0.10000002384185791, 0.0]
REF_4_1024_NOSTRETCH = [1.0, 0.8858072757720947, 0.7211151719093323, 0.4629151523113251, 0.0]
REF_4_1024 = [1.0, 0.8086457848548889, 0.5326690673828125, 0.10000002384185791, 0.0]


def test_sigmas_match_reference_numbers():
    def close(a, b):
        torch.testing.assert_close(a, torch.tensor(b, dtype=torch.float32), rtol=0, atol=1e-7)

    close(S.ltx2_sigmas(8, 16 * 11 * 20), REF_8_3520)
    full = S.ltx2_sigmas(30)  # num_tokens=None -> 4096
    close(full[:3], REF_30_DEFAULT_HEAD)
    close(full[-4:], REF_30_DEFAULT_TAIL)
    close(S.ltx2_sigmas(4, 1024, stretch=False), REF_4_1024_NOSTRETCH)
    close(S.ltx2_sigmas(4, 1024), REF_4_1024)
    # reference quirk kept: a 1-step stretched schedule starts at the terminal value
    close(S.ltx2_sigmas(1), [0.10000002384185791, 0.0])
    assert S.schedule_tokens((1, 128, 16, 11, 20)) == 3520


@pytest.mark.parametrize("steps,tokens", [(30, 3520), (40, None), (3, 32640)])
def test_sigmas_shape_properties(steps, tokens):
    s = S.ltx2_sigmas(steps, tokens)
    assert float(s[-1]) == 0.0
    assert torch.all(s[1:] < s[:-1])  # strictly decreasing
    assert abs(float(s[-2]) - 0.1) < 1e-6  # stretched to the terminal
    assert float(s[0]) <= 1.0


def test_sigmas_more_tokens_shift_up():
    assert torch.all(S.ltx2_sigmas(10, 14080)[1:-2] > S.ltx2_sigmas(10, 3520)[1:-2])  # [-2] is the terminal in both


def test_sigma_constants_and_validation():
    assert S.DISTILLED_STAGE2_SIGMAS == (0.909375, 0.725, 0.421875, 0.0)
    assert S.DISTILLED_SIGMAS[-4:] == S.DISTILLED_STAGE2_SIGMAS
    assert S.as_sigmas(S.DISTILLED_STAGE2_SIGMAS).dtype == torch.float32
    with pytest.raises(ValueError, match="end in 0"):
        S.as_sigmas([1.0, 0.5])
    with pytest.raises(ValueError, match="non-increasing"):
        S.as_sigmas([0.5, 0.7, 0.0])
    with pytest.raises(ValueError, match="steps"):
        S.ltx2_sigmas(0)


# --- noise -----------------------------------------------------------------------------------------------------------------


def test_make_noise_deterministic():
    a = S.make_noise((2, 5, 128), seed=42)
    b = S.make_noise((2, 5, 128), seed=42)
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert not torch.equal(a, S.make_noise((2, 5, 128), seed=43))
    assert S.make_noise((3,), 1, dtype=torch.bfloat16).dtype == torch.bfloat16
    # identical to a plain CPU generator draw (documented contract)
    assert torch.equal(a, torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(42)))


def test_make_av_noise_order():
    v, a = S.make_av_noise((1, 6, 128), (1, 4, 128), seed=7)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(v, torch.randn(1, 6, 128, generator=g))
    assert torch.equal(a, torch.randn(1, 4, 128, generator=g))  # audio continues the same stream


def test_noise_latent():
    clean = torch.full((1, 3, 2), 2.0)
    noise = torch.full((1, 3, 2), -1.0)
    mask = torch.tensor([[1.0, 0.0, 0.5]])
    x = S.noise_latent(clean, noise, 0.5, mask)
    # token 0: (1-.5)*2 + .5*(-1) = 0.5 ; token 1: clean 2 ; token 2: lerp(2, 0.5, .5) = 1.25
    torch.testing.assert_close(x[0, :, 0], torch.tensor([0.5, 2.0, 1.25]))


# --- Euler -----------------------------------------------------------------------------------------------------------------


def test_euler_step_linear_toy():
    # Straight-line flow: x(s) = (1-s) x0 + s n, exact velocity n - x0 -> Euler lands on the path exactly.
    x0 = torch.tensor([[[1.0, -2.0, 0.5]]])
    n = torch.tensor([[[0.3, 0.7, -1.1]]])
    s, s2 = 0.8, 0.35
    x = (1 - s) * x0 + s * n
    out = S.euler_step(x, n - x0, s, s2)
    torch.testing.assert_close(out, (1 - s2) * x0 + s2 * n)
    torch.testing.assert_close(S.euler_step(x, n - x0, s, 0.0), x0)
    # x0-parameterized step is the same thing
    torch.testing.assert_close(S.masked_euler_step(x, x0, s, s2), (1 - s2) * x0 + s2 * n)


def test_masked_step_keeps_conditioned_tokens():
    clean = torch.randn(1, 4, 3)
    x = clean.clone()
    x[:, 2:] = torch.randn(1, 2, 3)  # tokens 0, 1 conditioned (mask 0) start clean, as noise_latent leaves them
    x0_pred = torch.randn(1, 4, 3)
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    out = S.masked_euler_step(x, x0_pred, 0.9, 0.5, mask, clean)
    assert torch.equal(out[:, :2], clean[:, :2])
    torch.testing.assert_close(out[:, 2:], x[:, 2:] + (0.5 - 0.9) * (x[:, 2:] - x0_pred[:, 2:]) / 0.9)
    # partial mask blends in x0 space (reference post_process_latent)
    m = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    out2 = S.masked_euler_step(x, x0_pred, 0.9, 0.5, m, clean)
    x0b = 0.25 * x0_pred + 0.75 * clean
    torch.testing.assert_close(out2, x + (0.5 - 0.9) * (x - x0b) / 0.9)


# --- guidance ----------------------------------------------------------------------------------------------------------------


def test_default_guidance_values():
    v, a = S.default_guidance("2.0")
    assert (v.cfg_scale, v.stg_scale, v.stg_blocks, v.rescale, v.modality_scale) == (3.0, 1.0, (29,), 0.7, 3.0)
    assert (a.cfg_scale, a.stg_scale, a.stg_blocks, a.rescale, a.modality_scale) == (7.0, 1.0, (29,), 0.7, 3.0)
    v3, a3 = S.default_guidance("2.3")
    assert v3.stg_blocks == a3.stg_blocks == (28,)
    with pytest.raises(ValueError, match="stg_blocks"):
        S.GuidanceParams(stg_scale=1.0)


def test_combine_by_hand():
    p = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(1,), modality_scale=2.0)
    c, u, pt, iso = (torch.full((1, 2, 2), v) for v in (1.0, 0.5, 0.75, 0.25))
    # 1 + 2*(1-.5) + 1*(1-.75) + 1*(1-.25) = 1 + 1 + .25 + .75 = 3.0
    torch.testing.assert_close(S.combine_guidance(p, c, u, pt, iso), torch.full((1, 2, 2), 3.0))
    # a disabled term may be absent
    torch.testing.assert_close(S.combine_guidance(S.GuidanceParams(cfg_scale=2.0), c, u), torch.full((1, 2, 2), 1.5))
    with pytest.raises(ValueError, match="uncond"):
        S.combine_guidance(S.GuidanceParams(cfg_scale=2.0), c)


def test_rescale_formula():
    p = S.GuidanceParams(cfg_scale=3.0, rescale=0.7)
    cond = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    uncond = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]])
    pred = cond + 2.0 * (cond - uncond)  # [1, 4, 7, 10]
    # hand: std(cond) = std([1,2,3,4]) ; std(pred) = std([1,4,7,10]) = 3 * std(cond) -> ratio 1/3
    factor = 0.7 * (1.0 / 3.0) + 0.3
    torch.testing.assert_close(S.combine_guidance(p, cond, uncond), pred * factor)
    torch.testing.assert_close(S.combine_guidance(p, cond, uncond), pred * (0.7 * cond.std() / pred.std() + 0.3))
    # rescale = 1 -> std of the result equals std of cond
    r1 = S.combine_guidance(S.GuidanceParams(cfg_scale=3.0, rescale=1.0), cond, uncond)
    torch.testing.assert_close(r1.std(), cond.std())


def test_rescale_uses_global_std_over_batch():
    # reference MultiModalGuider.calculate: cond.std() / pred.std() over the whole tensor, not per sample
    p = S.GuidanceParams(cfg_scale=2.0, rescale=1.0)
    cond = torch.tensor([[[1.0, 2.0]], [[5.0, 9.0]]])
    uncond = torch.zeros_like(cond)
    pred = 2 * cond
    torch.testing.assert_close(S.combine_guidance(p, cond, uncond), pred * (cond.std() / pred.std()))


class _CountingDenoiser:
    """Toy denoise_fn: each pass kind returns fixed x0 values; records the passes."""

    VALUES = {"cond": (1.0, 10.0), "uncond": (0.5, 8.0), "perturbed": (0.75, 9.0), "isolated": (0.25, 7.0)}

    def __init__(self):
        self.calls: list[S.GuidancePass] = []

    def __call__(self, p: S.GuidancePass):
        self.calls.append(p)
        v, a = self.VALUES[p.kind]
        return torch.full((1, 3, 2), v), torch.full((1, 2, 2), a)


def test_guided_prediction_by_hand():
    vp = S.GuidanceParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=(29,), modality_scale=3.0)
    ap = S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(29,), modality_scale=3.0)
    fn = _CountingDenoiser()
    v, a = S.guided_prediction(fn, vp, ap)
    assert [c.kind for c in fn.calls] == ["cond", "uncond", "perturbed", "isolated"]
    # video: 1 + 2*.5 + 1*.25 + 2*.75 = 3.75 ; audio: 10 + 6*2 + 1*1 + 2*3 = 29
    torch.testing.assert_close(v, torch.full((1, 3, 2), 3.75))
    torch.testing.assert_close(a, torch.full((1, 2, 2), 29.0))


def test_unused_passes_are_skipped():
    fn = _CountingDenoiser()
    S.guided_prediction(fn, S.NO_GUIDANCE, S.GuidanceParams(cfg_scale=1.0, stg_scale=0.0, modality_scale=1.0))
    assert len(fn.calls) == 1 and fn.calls[0].kind == "cond"

    fn = _CountingDenoiser()
    v, a = S.guided_prediction(fn, S.GuidanceParams(cfg_scale=3.0), S.NO_GUIDANCE)
    assert [c.kind for c in fn.calls] == ["cond", "uncond"]
    torch.testing.assert_close(a, torch.full((1, 2, 2), 10.0))  # audio unguided: cond only

    fn = _CountingDenoiser()
    S.guided_prediction(fn, S.NO_GUIDANCE, S.GuidanceParams(stg_scale=1.0, stg_blocks=(5, 6)))
    assert [c.kind for c in fn.calls] == ["cond", "perturbed"]
    assert fn.calls[1].video_stg_blocks == () and fn.calls[1].audio_stg_blocks == (5, 6)


def test_guided_prediction_batched_and_skip_step():
    p = S.GuidanceParams(cfg_scale=3.0, skip_step=1)
    seen = []

    def batched(passes):
        seen.append([q.kind for q in passes])
        return [_CountingDenoiser()(q) for q in passes]

    v0, a0 = S.guided_prediction(batched, p, p, step=0, batched=True)
    assert seen == [["cond", "uncond"]]
    last = (v0 * 0 + 123, a0)
    v1, a1 = S.guided_prediction(batched, p, p, step=1, last=last, batched=True)  # odd step: reuse, no forward
    assert len(seen) == 1 and v1 is last[0]


# --- denoising loop ----------------------------------------------------------------------------------------------------------


def _exact_flow_model(x0_v, n_v, x0_a, n_a, log):
    """Model fn that returns the exact straight-line velocity (n - x0) for both modalities."""

    def fn(inp: S.ModelInputs):
        log.append(inp)
        return n_v - x0_v, (n_a - x0_a) if inp.audio is not None else None

    return fn


def test_denoise_loop_recovers_clean_on_exact_flow():
    g = torch.Generator().manual_seed(0)
    x0_v, n_v = torch.randn(1, 6, 4, generator=g), torch.randn(1, 6, 4, generator=g)
    x0_a, n_a = torch.randn(1, 3, 4, generator=g), torch.randn(1, 3, 4, generator=g)
    sig = S.ltx2_sigmas(5, 6)
    s0 = float(sig[0])
    log, progress = [], []
    v, a = S.denoise_loop(
        _exact_flow_model(x0_v, n_v, x0_a, n_a, log),
        sig,
        S.ModalityStream((1 - s0) * x0_v + s0 * n_v),
        S.ModalityStream((1 - s0) * x0_a + s0 * n_a),
        hooks=S.LoopHooks(progress=lambda i, n: progress.append((i, n))),
    )
    torch.testing.assert_close(v, x0_v, atol=1e-5, rtol=0)
    torch.testing.assert_close(a, x0_a, atol=1e-5, rtol=0)
    assert progress == [(i, 5) for i in range(1, 6)]
    assert len(log) == 5  # no guidance: one forward per step
    torch.testing.assert_close(log[1].video_timesteps, torch.full((1, 6), float(sig[1])))
    torch.testing.assert_close(log[1].audio_sigma, torch.tensor([float(sig[1])]))


def test_denoise_loop_frozen_audio_and_mask():
    g = torch.Generator().manual_seed(1)
    x0_v, n_v = torch.randn(1, 6, 4, generator=g), torch.randn(1, 6, 4, generator=g)
    audio = torch.randn(1, 3, 4, generator=g)
    clean_v = x0_v.clone()
    clean_v[:, :2] = 5.0  # conditioned tokens 0, 1
    mask = torch.tensor([[0.0, 0.0, 1, 1, 1, 1]])
    sig = torch.tensor(S.DISTILLED_STAGE2_SIGMAS)
    start = S.noise_latent(clean_v, n_v, float(sig[0]), mask)
    log = []

    def fn(inp: S.ModelInputs):
        log.append(inp)
        return n_v - x0_v, torch.full_like(audio, 99.0)  # audio velocity must be ignored

    v, a = S.denoise_loop(fn, sig, S.ModalityStream(start, mask, clean_v, S.GuidanceParams(cfg_scale=2.0)),
                          S.ModalityStream(audio, frozen=True))
    assert a is audio  # frozen: returned untouched
    assert torch.equal(v[:, :2], clean_v[:, :2])  # conditioned tokens stay clean
    torch.testing.assert_close(v[:, 2:], x0_v[:, 2:], atol=1e-5, rtol=0)
    assert len(log) == 3 * 2  # cond + uncond per step
    for inp in log:
        assert torch.all(inp.audio_timesteps == 0) and torch.all(inp.audio_sigma == 0)
        assert torch.all(inp.video_timesteps[:, :2] == 0)
    assert {inp.guidance.kind for inp in log} == {"cond", "uncond"}


def test_denoise_loop_cancel_and_nonfinite():
    x = torch.zeros(1, 2, 4)
    calls = []
    with pytest.raises(S.SamplingCancelled):
        S.denoise_loop(lambda inp: (calls.append(1) or torch.zeros_like(x), None), [0.9, 0.5, 0.0],
                       S.ModalityStream(x), None, hooks=S.LoopHooks(cancel=lambda: len(calls) >= 1))
    assert len(calls) == 1
    with pytest.raises(S.NonFiniteLatentError, match="audio"):
        S.denoise_loop(lambda inp: (torch.zeros_like(x), torch.full_like(x, float("nan"))), [0.9, 0.0],
                       S.ModalityStream(x), S.ModalityStream(x.clone()))


def test_one_step_schedule_is_finite():
    # The reference returns [nan, 0.0] here (0/0 in the stretch); we skip the degenerate stretch instead.
    s = S.ltx2_sigmas(1, 3520)
    assert torch.isfinite(s).all() and s.tolist() == [1.0, 0.0]
