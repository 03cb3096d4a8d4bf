"""The engine: one transformer forward on a TokenBatch, its semantics, attention, CUDA graphs and the sampling loop."""
