"""A hand-written training loop on a parallelized model:
``torchrun --standalone --nproc-per-node 2 docs/examples/train_by_hand.py [--model ID_OR_DIR] [--output DIR]``.

``from_pretrained`` loads the model (a hub id or a local checkpoint; by default a tiny random Llama written to a
temporary folder) with FSDP2 x TP over the ranks; a few AdamW steps with torch's own gradient clipping follow, and
``save_pretrained`` (on every rank) writes a checkpoint plain transformers loads. Runs on CPU (gloo) or GPU (NCCL).
"""

import argparse
import tempfile
from pathlib import Path

import torch

from automodel import MeshContext, NeMoAutoModelForCausalLM
from automodel.training.tiny_model import write_tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="hub id or local checkpoint (default: a tiny random Llama)")
parser.add_argument("--output", default="out/trained-by-hand", help="where save_pretrained writes")
args = parser.parse_args()
ctx = MeshContext.build("fsdp2", tp_size=2)  # dp_shard = world_size / 2
if args.model:
    path = args.model
else:  # the same folder on every rank; rank 0 writes the tiny model
    path = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(path)
    path = path[0]
    if torch.distributed.get_rank() == 0:
        write_tiny_model(path, Path(__file__).resolve().parents[2] / "recipes" / "data" / "smol_chat.jsonl")
    torch.distributed.barrier()
output = args.output

# --- the loop the README shows ---
model = NeMoAutoModelForCausalLM.from_pretrained(path, mesh_context=ctx).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
generator = torch.Generator().manual_seed(ctx.mesh("dp").get_local_rank())  # each data-parallel rank its own rows
for step in range(3):
    batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator).to(ctx.device_type)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # automodel.clip_grad_norm_ on every layout (EP)
    optimizer.step()
    optimizer.zero_grad()
    if torch.distributed.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.full_tensor().item():.3f}")
model.save_pretrained(output)  # on every rank: one consolidated checkpoint, written by rank 0
# ---
if torch.distributed.get_rank() == 0:
    print(f"saved to {output} ({type(model).__name__}, {ctx.world_size} ranks: dp={ctx.dp_size}, tp={ctx.tp_size})")
torch.distributed.destroy_process_group()
