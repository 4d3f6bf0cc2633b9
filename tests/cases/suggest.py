"""Rank-side cases for the layout search: the measured memory growth of one training step (run inside
``tests.harness.RankPool`` workers), against which the plan's activation estimate is held."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from automodel import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.pipelined_model import PipelinedModel


def peak_growth(step) -> int:
    """The most bytes torch's CPU allocator held during ``step()`` above what it held when the step began, read off
    the profiler's allocation events (each carries the allocator's running total: ``torch.cuda.max_memory_allocated``
    for the CPU)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step()
    events = []

    def walk(event) -> None:
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated))
        for child in event.children:
            walk(child)

    for root in recorded.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not events:
        return 0
    events.sort()
    start = events[0][2] - events[0][1]  # the total before the step's first allocation
    return max(total for _, _, total in events) - start


def step_growth(config: dict[str, Any], layout: dict[str, Any], batch: int, seq_len: int) -> int:
    """Build a random model of ``config`` (a ``model_type`` and its sizes) with ``layout`` (``MeshContext.build``
    keywords), run one training step (its gradients then exist), and return the peak growth of a second one on this
    rank: what the activations, the all-gather buffers and the backward's temporaries add to the parameters,
    gradients and optimizer states already held."""
    values = dict(config)
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_config(hf_config, mesh_context=context, dtype=torch.float32).train()
    generator = torch.Generator().manual_seed(context.mesh("dp").get_local_rank())  # one batch per replica
    rows = batch * (context.pipeline.microbatches if context.pipeline is not None else 1)
    ids = torch.randint(0, hf_config.vocab_size, (rows, seq_len), generator=generator)

    def step() -> None:
        if isinstance(model, PipelinedModel):
            model.train_step(input_ids=ids, labels=ids)
        else:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    step()
    growth = peak_growth(step)
    dist.barrier()
    return growth
