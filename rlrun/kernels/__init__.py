"""Kernels the trainer and the embedded engine share (attention, RoPE, SwiGLU, norms); README.md states the bar."""
