"""Follow ``mesh_context`` from ``from_pretrained`` to the loaded model: which files of ``automodel/`` it passes
through, in call order, and how often it comes back to a file it had left.

    torchrun --standalone --nproc-per-node 2 tools/trace_mesh_context.py [tp_size]

Rank 0 traces its ``from_pretrained`` of a tiny Llama (saved here) under ``MeshContext.build(tp_size=...)``: a stop is
a call of a function of the package holding the context object as an argument; consecutive stops in one file count
once; a return is a stop in a file the trip had already left. Prints the stops, the returns per file and their total.
"""

from __future__ import annotations

import collections
import inspect
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

PACKAGE = Path(__file__).resolve().parents[1] / "automodel"


def main() -> None:
    from automodel import NeMoAutoModelForCausalLM
    from automodel.distributed import MeshContext

    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    context = MeshContext.build(tp_size=tp)
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    if dist.get_rank() == 0:
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=96)  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(directory[0])
    dist.barrier()
    stops: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(str(PACKAGE)):
            return
        arguments = inspect.getargvalues(frame)
        if any(arguments.locals.get(name) is context for name in arguments.args):
            name = str(Path(frame.f_code.co_filename).relative_to(PACKAGE.parent))
            if not stops or stops[-1] != name:
                stops.append(name)

    sys.setprofile(profile if dist.get_rank() == 0 else None)
    NeMoAutoModelForCausalLM.from_pretrained(directory[0], mesh_context=context, dtype=torch.float32)
    sys.setprofile(None)
    if dist.get_rank() == 0:
        seen, returns = set(), collections.Counter()
        for stop in stops:
            if stop in seen:
                returns[stop] += 1
            seen.add(stop)
        print("stops:", " -> ".join(stops))
        print(f"{len(stops)} stops in {len(seen)} files; returns to a file already left: {sum(returns.values())}")
        for name, count in returns.most_common():
            print(f"  {name}: {count}")
    dist.barrier()


if __name__ == "__main__":
    main()
