"""Qwen3.5 sidecar: GatedDeltaNet linear attention mixed with full attention, fp32 decay parameters."""
