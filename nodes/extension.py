"""The pack's ComfyExtension: the node list ComfyUI registers."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .decode import DistributedDecodeMGPU
from .fleet import FleetMGPU
from .loader import LoadCheckpointMGPU
from .lora import LoRAMGPU
from .sampler import SPSamplerMGPU
from .text_encode import TextEncodeMGPU
from .upscale import TDPUpscaleMGPU

NODES: list[type[io.ComfyNode]] = [LoadCheckpointMGPU, TextEncodeMGPU, SPSamplerMGPU, TDPUpscaleMGPU,
                                   DistributedDecodeMGPU, FleetMGPU, LoRAMGPU]
NODES += __import__(f"{__package__}.testing", fromlist=["TEST_NODES"]).TEST_NODES if __import__("os").environ.get("LTX2_MGPU_TEST_NODES") == "1" else []  # noqa: E501 - TEST-ONLY nodes (nodes/testing.py)


class LTX2MultiGPUExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
