"""Triton kernels: chunk attention over the paged KV store (forward, and a deterministic backward)."""
