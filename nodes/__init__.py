"""The ComfyUI layer: the only package here that imports `comfy*`, `folder_paths` or `server`."""
from comfy_api.latest import ComfyExtension  # noqa: F401  (ImportError outside ComfyUI, caught by the pack root)


async def comfy_entrypoint():
    from .extension import LTX2MultiGPUExtension

    return LTX2MultiGPUExtension()
