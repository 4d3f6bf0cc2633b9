"""DeepSeek-V4 sidecar: float32 FSDP units for the parameters the model keeps in float32."""
