"""Compute kernels in plain PyTorch, with optional fast paths (e.g. comfy-kitchen's), shared by the model layer
(`models/`) and the parallel layer (`parallel/`): `neighborhood` (3-D neighborhood attention, LTX-2.5's diffusion
video decoder). A module here imports neither `models/` nor `parallel/` nor anything above them (tests/test_layering.py).
"""
