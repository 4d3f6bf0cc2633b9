"""A sidecar model class as ``model_sidecars/<model>/model.py`` defines one, for the registry lookup test."""

from __future__ import annotations

from transformers import LlamaForCausalLM

from automodel.distributed import ModelParallelizer, fully_shard_default


class CountingParallelizer(ModelParallelizer):
    """Counts the FSDP units it shards (a class attribute, so the test can read it back)."""

    units: list[str] = []

    def _fully_shard_module(self, module, **kwargs):
        CountingParallelizer.units.append(type(module).__name__)
        return fully_shard_default(module, **kwargs)


class SidecarLlamaForCausalLM(LlamaForCausalLM):
    pass


SidecarLlamaForCausalLM.parallelizer = CountingParallelizer()
