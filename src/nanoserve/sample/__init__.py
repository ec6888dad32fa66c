"""Batched sampling: per-batch metadata and one chain of tensor operations for every row."""
