"""`transport.Pickled`: a forward's payload and reply pickled once by their producer, passed through the controller as
bytes (issue 19: the native MODEL's per-forward overhead). CPU tensors travel as their raw bytes: every dtype, shape
and layout comes back equal (a fresh, writable tensor); what the raw path does not cover falls back to torch's own
pickling."""
from __future__ import annotations

import pytest
import torch

from mgpu_backend.protocol.native_forward import ForwardReply
from mgpu_backend.protocol import transport
from mgpu_backend.protocol.job_requests import FramesRequest, JobSpec, NoopRequest
from mgpu_backend.protocol.transport import Pickled, wire_job


@pytest.mark.parametrize("tensor", [
    torch.randn(2, 128, 3, 2, 4).bfloat16(), torch.randn(5, 7), torch.arange(12, dtype=torch.int64).reshape(3, 4),
    torch.tensor(2.5), torch.zeros(0, 3), torch.ones(2, 3, dtype=torch.bool), torch.randn(4, 6).t(),
    torch.arange(10.0)[::3], torch.randn(3).to(torch.float8_e4m3fn), torch.randn(2, 2, dtype=torch.complex64),
    torch.randn(3, 2).expand(4, 3, 2)])
def test_tensors_round_trip_exactly(tensor):
    back = Pickled.of({"t": tensor}).load()["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else back,
                       tensor.contiguous().view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor)
    if back.numel():
        back.view(-1)[0] = 0  # writable, and not the sender's memory
        assert back.data_ptr() != tensor.data_ptr()


def test_raw_bytes_path_and_fallbacks():
    video = torch.randn(2, 128, 16, 11, 20).bfloat16()
    reply = ForwardReply(video, torch.randn(2, 8, 126, 16).bfloat16(), report="one rank", seconds=0.01)
    data = Pickled.of(reply).data
    assert len(data) < (video.numel() + reply.audio.numel()) * 2 + 4096  # the raw bytes, no torch.save archive around them
    back = Pickled(data).load()
    assert isinstance(back, ForwardReply) and torch.equal(back.video, video) and back.report == "one rank"
    grad = torch.randn(3, requires_grad=True)  # not a plain tensor for the raw path: torch's pickling
    assert torch.equal(Pickled.of(grad).load(), grad)
    assert Pickled.of({"x": [1, "a"]}).load() == {"x": [1, "a"]}


def test_only_small_inline_payloads_travel_pickled(monkeypatch):
    """`wire_job`: a forward / noop payload is pickled once when small; above `INLINE_MAX_BYTES` (and for any other
    job) it stays as it is, for the controller's shared-memory path."""
    small = JobSpec("noop", NoopRequest(carry=torch.zeros(16)))
    wired = wire_job(small)
    assert isinstance(wired.payload, Pickled) and torch.equal(wired.payload.load().carry, torch.zeros(16))
    assert wire_job(wired) is wired
    monkeypatch.setattr(transport, "INLINE_MAX_BYTES", 1024)
    big = JobSpec("noop", NoopRequest(carry=torch.zeros(4096)))
    assert wire_job(big) is big
    stage = JobSpec("frames", FramesRequest((1, 2, 2, 3)))
    assert wire_job(stage) is stage
