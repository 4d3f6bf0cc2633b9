"""DiffusionGemma sidecar: routed experts as FSDP units of their own, before the (tied) layers that hold them."""
