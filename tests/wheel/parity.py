"""Run by tests/test_packaging.py under torchrun (2 ranks), from the wheel installed in a fresh virtualenv: load a
checkpoint with ``from_pretrained`` under TP=2 and compare the logits with plain transformers in the same process."""

import sys

import torch
from transformers import AutoModelForCausalLM

import automodel
from automodel import MeshContext, NeMoAutoModelForCausalLM

checkpoint = sys.argv[1]
context = MeshContext.build("fsdp2", tp_size=2)
model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context).eval()
reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
batch = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits = model(input_ids=batch).logits
    expected = reference(input_ids=batch).logits
logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
difference = (logits - expected).abs().max().item()
assert difference < 1e-4, f"logits differ from plain transformers by {difference}"
if torch.distributed.get_rank() == 0:
    print(f"parity ok: max |logits difference| {difference:.2e}; automodel from {automodel.__file__}", flush=True)
torch.distributed.destroy_process_group()
