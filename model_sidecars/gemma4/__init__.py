"""Gemma 4 sidecar: with per-layer inputs, the tied embedding and head stay replicated under TP."""
