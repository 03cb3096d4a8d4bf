"""ComfyUI entry point of the LTX-2 Multi-GPU node pack.

ComfyUI imports this package under a mangled module name; importing it without ComfyUI installed must not fail,
so the node layer is imported lazily and only when ComfyUI's API is present.
"""
try:  # ComfyUI present: expose the V3 entry point
    from .nodes import comfy_entrypoint  # noqa: F401
except ImportError as exc:  # plain Python (CLI, tests): the engine is `mgpu_backend`, nodes are optional
    _NODES_IMPORT_ERROR = exc

WEB_DIRECTORY = None
