"""One transformer forward and one parallel plan (issue 25): `model_forward.run` on a `TokenBatch` under a
`Semantics` record serves the native MODEL, the stage runners, the CLI, sequence parallel and tiles.

`test_outputs_bit_identical_to_main_before_the_one_forward` runs `tests/forward_snapshot.py` (the stage snapshot's 12
cases, the native MODEL on every ComfyUI golden request in one process / sequence parallel / batch rows over 2 gloo
ranks, the comfyui "sample" job, the LTX-2.5 keyframe forward in one process / SP / tiles: 58 cases) on the tree of
`BEFORE` — main before the one forward, extracted with `git archive` — and on this tree, and asserts every tensor is
bit-identical. It skips where the git history is not at hand (a shallow CI checkout).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from mgpu_backend.engine import forward as model_forward
from mgpu_backend.engine.attention import use_processor
from mgpu_backend.testing.tiny import build_tiny_modules
from mgpu_backend.splits.forward_plan import SEQUENCE, TILES, select_tokens, shard_batch
from mgpu_backend.engine.semantics import COMFYUI, REFERENCE, Semantics, semantics_named
from mgpu_backend.engine.tokens import TOKEN_FIELDS, TokenBatch
from mgpu_backend.protocol.validation import ValidationError

from _forward import diffusers_batch

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "befdd65f7d534d84aa93b5b1264b8c74e2e65040"  # main before issue 34 (the layer packages, the executable plan)


@pytest.fixture(scope="module")
def transformer23():
    tr = build_tiny_modules("2.3", 0)["transformer"].eval()
    use_processor(tr)
    return tr


def _kwargs(tr, n=7, ta=5, b=1, seed=0, **over):
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    dv = cfg.num_attention_heads * cfg.attention_head_dim if not cfg.use_prompt_embeddings else cfg.caption_channels
    da = (cfg.audio_num_attention_heads * cfg.audio_attention_head_dim if not cfg.use_prompt_embeddings
          else cfg.caption_channels)
    coords = torch.rand(b, 3, n, 1, generator=g).cumsum(2)
    kw = dict(hidden_states=torch.randn(b, n, cfg.in_channels, generator=g),
              audio_hidden_states=torch.randn(b, ta, cfg.audio_in_channels, generator=g),
              encoder_hidden_states=torch.randn(b, 6, dv, generator=g),
              audio_encoder_hidden_states=torch.randn(b, 6, da, generator=g),
              timestep=torch.rand(b, n, generator=g) * 1000, audio_timestep=torch.rand(b, ta, generator=g) * 1000,
              sigma=torch.rand(b, generator=g) * 1000, audio_sigma=torch.rand(b, generator=g) * 1000,
              encoder_attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * b),
              audio_encoder_attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * b),
              video_coords=torch.cat([coords, coords + 1], dim=-1),
              audio_coords=torch.stack([torch.arange(ta), torch.arange(ta) + 1], -1).float().view(1, 1, ta, 2)
              .expand(b, -1, -1, -1), use_cross_timestep=True)
    kw.update(over)
    return kw


def _batch(tr, kw):
    return diffusers_batch(tr.config, **kw)


@pytest.mark.parametrize("over", [{}, {"use_cross_timestep": False}, {"isolate_modalities": True},
                                  {"audio_sigma": None}, {"timestep": torch.full((1, 1), 500.0)}])
def test_reference_semantics_is_diffusers_forward_bitwise(transformer23, over):
    """The one forward (REFERENCE) on diffusers' inputs (`_forward.diffusers_batch`) = diffusers 0.42.1's own
    forward."""
    kw = _kwargs(transformer23, **over)
    with torch.no_grad():
        want = transformer23(return_dict=False, **kw)
        batch, options = _batch(transformer23, kw)
        got = model_forward.run_eager(transformer23, batch, REFERENCE, None, options)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_engine_never_calls_diffusers_forward(transformer23, monkeypatch):
    """Every path goes through `model_forward`: the plain forward, the sequence split, the tiles (each under its
    applied plan)."""
    from mgpu_backend.splits.apply import apply_plan, remove_plan
    from mgpu_backend.splits.exchange import Exchange
    from mgpu_backend.splits.sequence import UlyssesSplit
    from mgpu_backend.splits.tiled import TiledSplit
    from mgpu_backend.splits.tiling import TileCountConfig

    def refuse(*args, **kwargs):
        raise AssertionError("diffusers' LTX2VideoTransformer3DModel.forward was called")

    batch, options = _batch(transformer23, _kwargs(transformer23, n=6))
    sp = UlyssesSplit(Exchange(None, 1, 0))
    tiles = TiledSplit(transformer23, (1, 2, 3), TileCountConfig.spatial(1, 1, overlap=0), normalize_positions=False)
    with torch.no_grad():
        want = model_forward.run_eager(transformer23, batch, REFERENCE, None, options)
        monkeypatch.setattr(type(transformer23), "forward", refuse)
        try:
            apply_plan(transformer23, sp.plan, sp.exchange)
            got_sp = model_forward.run(transformer23, batch, REFERENCE, sp, options)
            apply_plan(transformer23, tiles.plan)
            got_tiles = model_forward.run(transformer23, batch, REFERENCE, tiles, options)
        finally:
            remove_plan(transformer23)
    assert torch.equal(got_sp[0], want[0]) and torch.equal(got_tiles[0], want[0].float().to(got_tiles[0].dtype))


def test_apply_plan_installs_exactly_the_plans_processors(transformer23):
    """`apply_plan` puts the processor of each attention entry's kind on that attention of every block (the others
    local), refuses a plan it cannot execute, and `remove_plan` makes every attention local again."""
    from mgpu_backend.engine.attention import ATTENTIONS, LTX2AttnProcessor
    from mgpu_backend.splits.apply import applied_plan, apply_plan, remove_plan
    from mgpu_backend.splits.exchange import Exchange
    from mgpu_backend.splits.forward_plan import ForwardPlan
    from mgpu_backend.splits.sequence import GatheredKeysCrossAttention, UlyssesSelfAttention

    try:
        apply_plan(transformer23, SEQUENCE, Exchange(None, 1, 0))
        assert applied_plan(transformer23) is SEQUENCE
        for block in transformer23.transformer_blocks:
            kinds = {name: type(getattr(block, name).processor) for name in ATTENTIONS}
            assert kinds.pop("attn1") is UlyssesSelfAttention
            assert kinds.pop("video_to_audio_attn") is GatheredKeysCrossAttention
            assert set(kinds.values()) == {LTX2AttnProcessor}
        with pytest.raises(ValueError, match="needs an exchange"):
            apply_plan(transformer23, SEQUENCE)
        with pytest.raises(ValueError, match=r"kind\(s\) \['ring'\] have no processor"):
            apply_plan(transformer23, ForwardPlan("ring", attention=MappingProxyType({"attn1": "ring"})))
        with pytest.raises(ValueError, match="does not divide"):
            apply_plan(transformer23, SEQUENCE, Exchange(None, 3, 0))
    finally:
        remove_plan(transformer23)
    assert applied_plan(transformer23) is None
    assert {type(getattr(b, n).processor) for b in transformer23.transformer_blocks for n in ATTENTIONS} == \
        {LTX2AttnProcessor}


def test_apply_plan_again_is_a_no_op_while_its_processors_stay(transformer23):
    """The native MODEL applies its plan on every request: the same plan over the same exchange installs nothing
    while its processors are in place, and installs again once anything else was installed (a stage's plan, the
    local processors, another exchange)."""
    from mgpu_backend.engine.attention import LTX2AttnProcessor, use_processor
    from mgpu_backend.splits.apply import applied_plan, apply_plan, remove_plan
    from mgpu_backend.splits.exchange import Exchange

    def installed():
        return [getattr(b, n).processor for b in transformer23.transformer_blocks for n in ("attn1", "attn2")]

    exchange = Exchange(None, 1, 0)
    try:
        apply_plan(transformer23, SEQUENCE, exchange)
        first = installed()
        apply_plan(transformer23, SEQUENCE, exchange)
        assert all(a is b for a, b in zip(installed(), first, strict=True))  # nothing reinstalled
        apply_plan(transformer23, SEQUENCE, Exchange(None, 1, 0))  # another exchange: installed anew
        second = installed()
        assert second[0] is not first[0] and applied_plan(transformer23) is SEQUENCE
        use_processor(transformer23, LTX2AttnProcessor())  # someone made the attentions local behind its back
        apply_plan(transformer23, SEQUENCE, exchange)
        assert type(installed()[0]).__name__ == "UlyssesSelfAttention" and installed()[0] is not second[0]
    finally:
        remove_plan(transformer23)
    assert applied_plan(transformer23) is None


def test_token_batch_is_frozen_and_selects_rows(transformer23):
    batch, _ = _batch(transformer23, _kwargs(transformer23, b=2))
    with pytest.raises(AttributeError):
        batch.video = batch.audio  # type: ignore[misc]
    one = batch.select_rows([1])
    assert one.rows == 1 and torch.equal(one.video[0], batch.video[1])
    assert batch.per_token("video_timestep") and not batch.per_token("video_cross_timestep")  # [B]: per row


def test_sequence_plan_pads_and_slices_only_the_per_token_fields(transformer23):
    batch, _ = _batch(transformer23, _kwargs(transformer23, n=7))
    parts = [shard_batch(SEQUENCE, batch, r, 2) for r in range(2)]
    assert {padded for _, padded in parts} == {8}
    assert torch.equal(torch.cat([p.video for p, _ in parts], 1)[:, :7], batch.video)
    assert torch.equal(parts[1][0].video[:, -1], torch.zeros_like(batch.video[:, 0]))  # the padding token
    for p, _ in parts:
        assert p.video_coords.shape[2] == 4 and torch.equal(p.audio, batch.audio)
        assert torch.equal(p.video_cross_timestep, batch.video_cross_timestep)  # per row: replicated
    picked = select_tokens(TILES, batch, torch.tensor([0, 3, 5]))
    assert picked.video_tokens == 3 and torch.equal(picked.video_timestep, batch.video_timestep[:, [0, 3, 5]])


def test_plans_are_declarative_and_weights_have_their_entry():
    assert set(SEQUENCE.inputs) == set(TOKEN_FIELDS) and SEQUENCE.inputs["video_coords"].dim == 2
    assert SEQUENCE.attention == {"attn1": "ulysses", "video_to_audio_attn": "gathered keys"}
    assert SEQUENCE.outputs["video"].dim == 1 and not TILES.attention
    with pytest.raises(TypeError):
        SEQUENCE.inputs["video"] = None  # type: ignore[index]


def test_semantics_is_a_record():
    assert semantics_named("reference") is REFERENCE and semantics_named(COMFYUI) is COMFYUI
    assert (REFERENCE.block_order, COMFYUI.block_order) == ("diffusers", "comfyui")
    assert (REFERENCE.qk_eps, COMFYUI.qk_eps) == (None, 1e-5)
    with pytest.raises(ValidationError, match="semantics='diffusers'.*reference, comfyui"):
        semantics_named("diffusers")
    with pytest.raises(ValidationError, match="block_order='upside'"):
        Semantics(**{**REFERENCE.__dict__, "block_order": "upside"})


def test_stage_code_reads_the_record_not_the_name():
    """No string switch on the semantics' name is left in the stage layer (issue 25)."""
    for path in ("stages/stage.py", "stages/comfy_stage.py", "serving/jobs/stages.py", "stages/pipelines.py", "stages/native.py"):
        text = (ROOT / "mgpu_backend" / path).read_text()
        for needle in ('semantics == "', "semantics != \"", '== "comfyui"', '== "reference"'):
            assert needle not in text.replace('noise_layout == "comfyui"', ""), (path, needle)


@pytest.mark.slow
def test_outputs_bit_identical_to_main_before_the_one_forward(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"commit {BEFORE} is not in this checkout's history (shallow clone?)")
    old = tmp_path / "before"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "mgpu_backend", "nodes", "kernels",
                              "tests/golden"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    for name in ("stage_snapshot.py", "forward_snapshot.py", "old_layout.py"):
        shutil.copy(ROOT / "tests" / name, old / "tests" / name)
    tiny = tmp_path / "tiny"
    outputs = {}
    for name, tree in (("before", old), ("after", ROOT)):
        out = tmp_path / f"{name}.pt"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run([sys.executable, str(tree / "tests" / "forward_snapshot.py"), str(out), "--tiny",
                               str(tiny)], cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        outputs[name] = torch.load(out)
    before, after = outputs["before"], outputs["after"]
    assert before.keys() == after.keys() and len(before) == 58
    for case in before:
        for modality in ("video", "audio"):
            assert torch.equal(before[case][modality], after[case][modality]), (
                f"{case} {modality}: max |after - before| = "
                f"{float((after[case][modality] - before[case][modality]).abs().max()):.3e}")
