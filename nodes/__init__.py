"""The ComfyUI layer: the only package here that imports `comfy*`, `folder_paths` or `server`.

ComfyUI calls `comfy_entrypoint()` (V3). Nothing here imports ComfyUI at module level, so `nodes.native_types`
(pure tensor conversions) imports and is tested without ComfyUI. This package must not define
NODE_CLASS_MAPPINGS (ComfyUI would then load it as a V1 pack and ignore the entry point).
"""


async def comfy_entrypoint():
    from .extension import LTX2MultiGPUExtension

    return LTX2MultiGPUExtension()
