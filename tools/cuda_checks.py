"""CUDA checks the CPU test suite cannot run: the NCCL / CUDA loading path, Megatron-FSDP, bf16 timings.

    torchrun --standalone --nproc-per-node 1 tools/cuda_checks.py [--out results.json]

Each check builds its own tiny checkpoint, compares against plain transformers on the same GPU in fp32 (TF32 off),
and reports numbers; a failing check records its error and the others still run. One GPU is enough: every check
uses all ranks torchrun starts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from automodel.distributed.runtime import full_tensor


def _tiny_llama(directory: Path, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **overrides,
    )
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    dist.barrier()
    return directory


def fsdp2_load_parity(directory: Path) -> dict:
    """from_pretrained on CUDA (NCCL mesh) against plain transformers on the same GPU: logits, loss, gradients."""
    from transformers import AutoModelForCausalLM

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    checkpoint = _tiny_llama(directory / "llama")
    context = MeshContext.build("fsdp2")
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context).train()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).cuda().train()
    batch = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
    # use_cache=False: the blocks run compiled (compile="auto" on CUDA; a KV cache would run them eagerly).
    out = model(input_ids=batch, labels=batch, use_cache=False)
    ref = reference(input_ids=batch, labels=batch, use_cache=False)
    out.loss.backward()
    ref.loss.backward()
    ref_params = dict(reference.named_parameters())
    grads = max((full_tensor(p.grad) - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters())
    return {
        "compile": str(context.compile),
        "compiled_blocks": sum(hasattr(layer.forward, "compiled") for layer in model.model.layers),
        "backend": str(dist.get_backend()),
        "device": str(next(model.parameters()).device),
        "logits": (full_tensor(out.logits) - ref.logits).abs().max().item(),
        "loss": (out.loss - ref.loss).abs().item(),
        "grad": grads,
    }


def megatron_fsdp_parity(directory: Path) -> dict:
    """The Megatron-FSDP strategy end to end: parallelize, load, forward, backward."""
    from transformers import AutoModelForCausalLM

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    checkpoint = _tiny_llama(directory / "llama_mfsdp")
    context = MeshContext.build("megatron_fsdp")
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).cuda()
    batch = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
    out, ref = model(input_ids=batch, labels=batch), reference(input_ids=batch, labels=batch)
    out.loss.backward()
    ref.loss.backward()
    weight = model.module.model.layers[0].mlp.up_proj.weight
    return {
        "param_type": f"{type(weight).__name__} {type(getattr(weight, 'data', weight)).__name__}",
        "fsdp_param": bool(getattr(weight, "__fsdp_param__", False)),
        "wrapper": type(model).__name__,
        "logits": (full_tensor(out.logits) - ref.logits).abs().max().item(),
        "loss": (out.loss - ref.loss).abs().item(),
    }


def bf16_load_and_step(directory: Path) -> dict:
    """A ~0.5 B-parameter bf16 Llama: load seconds (ours vs transformers vs a plain safetensors read to the GPU) and
    training-step tokens/s."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    checkpoint = directory / "llama_bf16"
    config = AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(checkpoint)
    dist.barrier()
    files = sorted(checkpoint.glob("*.safetensors"))
    for path in files:  # warm the page cache for every contender
        path.read_bytes()
    timings = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        timings[name] = round(time.perf_counter() - start, 3)
        return result

    timed("floor_safetensors_to_gpu", lambda: [load_file(path, device="cuda") for path in files])
    timed(
        "transformers",
        lambda: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda"),
    )
    context = MeshContext.build("fsdp2")
    model = timed("automodel", lambda: NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batch = torch.randint(0, 32000, (8, 1024), device="cuda")
    steps = []
    for step in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 2:
            steps.append(time.perf_counter() - start)
    step_s = sorted(steps)[len(steps) // 2]
    return {
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "load_s": timings,
        "dtype": str(next(model.parameters()).dtype),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(batch.numel() / step_s),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def sft_recipe(directory: Path) -> dict:
    """The SFT recipe on CUDA (bf16 mixed precision, then LoRA): loss falls, the export matches the trained model."""
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint, train

    checkpoint = save_tiny_chat_checkpoint(directory / "chat") if dist.get_rank() == 0 else directory / "chat"
    dist.barrier()
    config = directory / "sft.yaml"
    if dist.get_rank() == 0:
        config.write_text(
            f"model: {{path: {checkpoint}}}\ndata: {{path: {CHAT_DATA}}}\n"
            "train: {max_steps: 20, global_batch_size: 8, micro_batch_size: 2, seq_len: 48, lr: 3.0e-3}\n"
        )
    dist.barrier()
    results = {}
    for name, overrides in {
        "bf16": ["model.dtype=bfloat16", f"export.dir={directory / 'export_bf16'}"],
        "lora": ["lora.rank=8", "train.lr=3e-2", f"export.dir={directory / 'export_lora'}"],
    }.items():
        facts = train(str(config), overrides)
        losses = facts["losses"]
        results[name] = {"first": losses[0], "last": losses[-1], "export_logits": facts.get("export_logits")}
    return results


CHECKS = [fsdp2_load_parity, megatron_fsdp_parity, bf16_load_and_step, sft_recipe]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default="", help="comma-separated check names")
    options = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from automodel import MeshContext

    MeshContext.build("fsdp2")  # starts NCCL from the torchrun environment
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        dist.broadcast_object_list(holder := [str(directory)])
        directory = Path(holder[0])
        for check in CHECKS:
            if options.only and check.__name__ not in options.only.split(","):
                continue
            try:
                results[check.__name__] = check(directory)
            except Exception as error:  # a failing check is a result; the others still run
                results[check.__name__] = {
                    "error": f"{type(error).__name__}: {error}",
                    "trace": traceback.format_exc()[-3000:],
                }
            print(json.dumps({check.__name__: results[check.__name__]}), flush=True)
    if dist.get_rank() == 0 and options.out is not None:
        options.out.write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
