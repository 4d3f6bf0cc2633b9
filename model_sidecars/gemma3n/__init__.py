"""Gemma 3n sidecar: the MLPs with activation sparsity are not sharded on their intermediate dimension."""
