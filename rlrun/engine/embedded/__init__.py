"""The embedded engine: an in-process inference engine on rlrun's own kernels (decode loop, CUDA graphs, static
KV cache, slots, fused ops), driven by the engine worker like any other backend (``backend.py``)."""
