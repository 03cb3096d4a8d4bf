"""Optional fast paths (e.g. a CUDA-IPC all_to_all). Each has a pure-PyTorch fallback in `mgpu_backend.parallel`.

Never imports `mgpu_backend`.
"""
