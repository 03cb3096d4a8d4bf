"""SP Sampler (MGPU)'s typed inputs (`nodes/sampler_inputs.py`), without ComfyUI: the guidance records, the request
they make, and the old node's eleven widgets — a workflow saved with them gives the request the old node sent."""
from __future__ import annotations

import pytest
import torch

from mgpu_backend.engine import sampling
from mgpu_backend.protocol import stage_params as S
from mgpu_backend.protocol.stage_requests import SampleRequest
from mgpu_backend.stages.stage import StageLimits
from nodes import native_types as NT
from nodes import sampler_inputs as SI
from test_nodes_native import FakeNested, concat, conditioning, empty_audio, empty_video, i2v

# SP Sampler's widgets_values as the shipped workflows saved them before the guidance became an input (befdd65)
SAVED_UI = [30, "euler", 3, 1, 0.7, 3, 7, 1, 0.7, 3, "auto"]
SAVED_BLOCKS = [8, "euler_ancestral", 4.5, 0.5, 0.0, 1.0, 1.0, 0.0, 0.7, 2.0, "28, 29"]


class Noise:  # RandomNoise: a seed and generate_noise(latent)
    seed = 42

    def generate_noise(self, latent):
        s = latent["samples"]
        g = torch.Generator().manual_seed(self.seed)
        if getattr(s, "is_nested", False):
            return FakeNested([torch.randn(t.shape, generator=g) for t in s.unbind()])
        return torch.randn(s.shape, generator=g)


def _old_request(latent, noise, positive, negative, w: list) -> SampleRequest:
    """What SP Sampler (MGPU).execute sent at befdd65 for widget values `w` (its code, the ComfyUI calls aside):
    guidance with the placeholder stg_blocks=(0,), the widget's stg_blocks put in both on the fleet."""
    steps, sampler, vc, vs, vr, vm, ac, as_, ar, am, blocks = w
    parts = NT.split_latent(latent)
    pos = NT.split_conditioning(positive, "positive", allow=NT.GUIDE_CONDITIONING_KEYS)
    neg = NT.split_conditioning(negative, "negative", allow=NT.GUIDE_CONDITIONING_KEYS)
    fps = NT.frame_rate_of(pos, neg)
    video, audio = parts.video, parts.audio
    noise_video, noise_audio = SI.make_noise(noise, latent, video, audio, parts.nested)

    def g(cfg, stg, rescale, modality):
        return S.GuidanceParams(cfg_scale=float(cfg), stg_scale=float(stg), stg_blocks=(0,), rescale=float(rescale),
                                modality_scale=float(modality))

    return SampleRequest(
        positive=pos.embeds, negative=neg.embeds, video=video, audio=audio, video_mask=parts.video_mask,
        audio_mask=parts.audio_mask, semantics="comfyui", guides=NT.guides_payload(pos, neg, parts.video_mask),
        noise_video=noise_video, noise_audio=noise_audio,
        sigmas=S.ltx2_sigmas(int(steps), S.schedule_tokens(video.shape)), fps=fps,
        video_guidance=g(vc, vs, vr, vm), audio_guidance=g(ac, as_, ar, am), stg_blocks=SI.parse_stg_blocks(blocks),
        mode="sequence_parallel", sampler=sampler, seed=42, noise_device="cpu", loras=())


def _inputs():
    torch.manual_seed(0)
    latent = concat(i2v(empty_video()), empty_audio())
    return latent, conditioning(frame_rate=25.0), conditioning(frame_rate=25.0)


@pytest.mark.parametrize("saved", [SAVED_UI, SAVED_BLOCKS], ids=["defaults", "explicit_blocks"])
def test_saved_old_widgets_give_the_old_request(saved):
    """A workflow saved with the old SP Sampler's widgets: its values, mapped by position, make the request the old
    node sent — every field equal, and the guidance the fleet resolves (`StageLimits.guidance`, LTX-2.3 and LTX-2.0
    blocks) equal too."""
    latent, pos, neg = _inputs()
    old = SI.LegacyWidgets.from_saved(saved)
    assert old == SI.LegacyWidgets.from_values(dict(zip(SI.LEGACY_WIDGETS, saved)))
    new = SI.sample_request(old.guider(pos, neg), latent, Noise(), old.settings())
    want = _old_request(latent, Noise(), pos, neg, saved)
    for name in SampleRequest.__dataclass_fields__:
        a, b = getattr(new, name), getattr(want, name)
        if name in ("video_guidance", "audio_guidance"):
            continue
        if name == "guides":
            assert (a is None) == (b is None)
            continue
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name
    assert isinstance(new.video_guidance, S.GuidanceScales)  # no placeholder blocks
    for family in ("2.3", "2.0"):
        limits = StageLimits(family=family, n_blocks=48)
        assert limits.guidance(new.video_guidance, new.audio_guidance, new.stg_blocks) == \
            limits.guidance(want.video_guidance, want.audio_guidance, want.stg_blocks)
    blocks = StageLimits(family="2.3", n_blocks=48).guidance(new.video_guidance, new.audio_guidance,
                                                              new.stg_blocks)[0].stg_blocks
    assert blocks == ((28,) if saved is SAVED_UI else (28, 29))


def test_saved_widgets_of_another_length_or_name_are_refused():
    with pytest.raises(ValueError, match="10 values, expected 11"):
        SI.LegacyWidgets.from_saved(SAVED_UI[:-1])
    values = dict(zip(SI.LEGACY_WIDGETS, SAVED_UI))
    values["video_cgf"] = values.pop("video_cfg")
    with pytest.raises(ValueError, match=r"SP Sampler widgets: missing \[.video_cfg.\], unknown \[.video_cgf.\]"):
        SI.LegacyWidgets.from_values(values)


def test_guidance_widgets_auto_and_named_blocks():
    """'auto' leaves the block to the fleet (GuidanceScales, resolved to the family's); named blocks are kept."""
    auto = SI.ModalityGuidanceWidgets(3.0, 1.0, 0.7, 3.0, "auto").guidance()
    assert auto == S.GuidanceScales(cfg_scale=3.0, stg_scale=1.0, rescale=0.7, modality_scale=3.0)
    named = SI.ModalityGuidanceWidgets(7.0, 1.0, 0.7, 3.0, "27, 28").guidance()
    assert named == S.GuidanceParams(cfg_scale=7.0, stg_scale=1.0, stg_blocks=(27, 28), rescale=0.7,
                                     modality_scale=3.0)
    video, audio = StageLimits(family="2.0", n_blocks=48).guidance(auto, named)
    assert video == sampling.VIDEO_GUIDANCE_LTX2 and audio.stg_blocks == (27, 28)
    # a shallow model: the default block is its last (as the old node's "auto")
    assert StageLimits(family="2.3", n_blocks=2).guidance(auto, auto)[0].stg_blocks == (1,)
    with pytest.raises(ValueError, match="stg_blocks='-1'"):
        SI.ModalityGuidanceWidgets(3.0, 1.0, 0.7, 3.0, "-1").guidance()
    with pytest.raises(ValueError, match="GuidanceScales.cfg_scale must be finite; got nan"):
        SI.ModalityGuidanceWidgets(float("nan"), 1.0, 0.7, 3.0).guidance()


def test_guider_defaults_and_refusals():
    """An unconnected guidance is the reference's stage-1 guidance (the old widgets' defaults); CFG without a
    negative is refused by name; the request carries the guider's guidance and no global stg_blocks."""
    latent, pos, neg = _inputs()
    guider = SI.SamplerGuider(pos, neg)
    limits = StageLimits(family="2.3", n_blocks=48)
    assert limits.guidance(guider.video, guider.audio) == sampling.default_guidance("2.3")
    with pytest.raises(ValueError, match=r"CFG scale is not 1 \(video 3.0, audio 7.0\) but no negative"):
        SI.SamplerGuider(pos)
    off = S.GuidanceScales()
    request = SI.sample_request(SI.SamplerGuider(pos, None, off, off), latent, Noise(), SI.SamplerSettings(steps=4))
    assert request.negative is None and request.stg_blocks is None and request.video_guidance == off
    assert request.sigmas.shape == (5,) and float(request.sigmas[-1]) == 0.0
    with pytest.raises(ValueError, match="video guidance: expected LTX-2 Guidance"):
        SI.SamplerGuider(pos, neg, video={"cfg": 3.0})
    with pytest.raises(ValueError, match=r"sampler='dpmpp': one of \['euler', 'euler_ancestral'\]"):
        SI.SamplerSettings(sampler="dpmpp")


def test_sample_request_refuses_scales_of_the_wrong_type():
    latent, pos, neg = _inputs()
    request = SI.sample_request(SI.SamplerGuider(pos, neg), latent, Noise(), SI.SamplerSettings(steps=2))
    fields = {k: getattr(request, k) for k in SampleRequest.__dataclass_fields__}
    with pytest.raises(ValueError, match="video_guidance=dict: must be a stage_params.GuidanceParams, a "
                                         "stage_params.GuidanceScales or None"):
        SampleRequest(**{**fields, "video_guidance": {"cfg_scale": 3.0}})


def test_legacy_widget_order_is_the_records():
    """`LEGACY_WIDGETS` (the saved order) is the record's field order, which the deprecated node's schema lists."""
    import dataclasses

    assert tuple(f.name for f in dataclasses.fields(SI.LegacyWidgets)) == SI.LEGACY_WIDGETS
    assert SI.LEGACY_WIDGETS[:2] == ("steps", "sampler") and SI.LEGACY_WIDGETS[-1] == "stg_blocks"


def test_read_widgets_fills_defaults_and_names_what_is_wrong():
    import dataclasses

    from nodes.widgets import read_widgets

    @dataclasses.dataclass(frozen=True)
    class W:
        steps: int
        sampler: str = "euler"

    assert read_widgets(W, {"steps": 3}, "N") == W(3, "euler")
    with pytest.raises(ValueError, match=r"N widgets: missing \['steps'\], unknown \['stpes'\] \(expected "
                                         r"\['steps', 'sampler'\]\)"):
        read_widgets(W, {"stpes": 3}, "N")
