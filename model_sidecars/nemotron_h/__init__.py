"""Nemotron-H sidecar: hybrid Mamba-2 / attention / MLP / MoE blocks."""
