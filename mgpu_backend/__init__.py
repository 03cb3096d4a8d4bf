"""The ltx2-multigpu engine: model loading, sampling, parallelism, controller and fleet. Never imports ComfyUI."""

__version__ = "0.1.0"
