"""Parallelize a transformers model by hand: ``torchrun --nproc-per-node 2 docs/examples/parallelize_by_hand.py``.

Builds a small random Llama on every rank (same seed), shards it with FSDP2 x TP over the ranks, and runs one
training step. Runs on CPU (gloo) or GPU (NCCL) alike.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel import MeshContext, ModelParallelizer

ctx = MeshContext.build("fsdp2", tp_size=2, activation_checkpointing=True)  # dp_shard = world_size / 2
config = AutoConfig.for_model(
    "llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
torch.manual_seed(0)
model = ModelParallelizer().parallelize(AutoModelForCausalLM.from_config(config), ctx)
batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(ctx.mesh("dp").get_local_rank()))
loss = model(input_ids=batch.to(ctx.device_type), labels=batch.to(ctx.device_type)).loss
loss.backward()
torch.optim.AdamW(model.parameters(), lr=1e-3).step()
if torch.distributed.get_rank() == 0:
    print(
        f"{type(model).__name__}: loss {loss.item():.4f} on {ctx.world_size} ranks (dp={ctx.dp_size}, tp={ctx.tp_size})"
    )
torch.distributed.destroy_process_group()
