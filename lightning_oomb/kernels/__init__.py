"""Triton kernels: chunk attention over the paged KV store (dense and sparse, forward and backward) and the
fused RMSNorm, RoPE, SwiGLU and cross-entropy ops."""
