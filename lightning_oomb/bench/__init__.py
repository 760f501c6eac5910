"""Benchmarks (need a CUDA GPU)."""
