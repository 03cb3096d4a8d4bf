"""The pack's ComfyExtension: the node list ComfyUI registers."""
from __future__ import annotations

import os

from comfy_api.latest import ComfyExtension, io

from .decode import DistributedDecodeMGPU
from .fleet import FleetMGPU
from .loader import LoadCheckpointMGPU, LoadDiffusionModelMGPU
from .lora import LoRAMGPU
from .sampler import GuidanceMGPU, GuiderMGPU, SPSamplerGuidedMGPU, SPSamplerMGPU
from .text_encode import TextEncodeMGPU
from .upscale import TDPUpscaleMGPU

NODES: list[type[io.ComfyNode]] = [LoadCheckpointMGPU, TextEncodeMGPU, GuidanceMGPU, GuiderMGPU, SPSamplerGuidedMGPU,
                                   SPSamplerMGPU, TDPUpscaleMGPU,
                                   DistributedDecodeMGPU, FleetMGPU, LoRAMGPU,
                                   LoadDiffusionModelMGPU]
if os.environ.get("LTX2_MGPU_TEST_NODES") == "1":  # test-only nodes (nodes/testing.py), never in a user's graph
    from .testing import TEST_NODES

    NODES += TEST_NODES


class LTX2MultiGPUExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
