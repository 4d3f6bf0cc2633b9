"""Rank-side cases for pipeline parallelism (run inside ``tests.harness.RankPool`` workers): a tiny model of the
zoo saved with ``save_pretrained`` and loaded with ``pp_size > 1``, against plain transformers on the whole batch."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from automodel import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.runtime import full_tensor
from tests.causal_lm_zoo import tiny_config
from tests.tiny_models import token_batch

#: Layers of the pipelined tiny models: two per rank on two ranks, one per stage with two virtual stages per rank.
LAYERS = 4


def plain_model(model_type: str, tie: bool | None = None, seed: int = 0) -> torch.nn.Module:
    """The plain transformers model (fp32, train mode) of a 4-layer tiny config of ``model_type``."""
    overrides: dict[str, Any] = {"num_hidden_layers": LAYERS}
    if tie is not None:
        overrides["tie_word_embeddings"] = tie
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def _saved(reference: torch.nn.Module) -> str:
    """``reference`` saved with ``save_pretrained`` in a directory every rank reads (rank 0 writes it)."""
    paths = [tempfile.mkdtemp(prefix="pp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    if dist.get_rank() == 0:
        reference.save_pretrained(paths[0])
    dist.barrier()
    return paths[0]


def nemotron_h_model(tie: bool | None = None) -> torch.nn.Module:
    """The tiny 4-block hybrid Nemotron-H of its sidecar's tests (Mamba-2, attention, MLP, MoE), fp32, train mode."""
    from tests.cases.sidecar_nemotron_h import tiny_config as nemotron_h_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(nemotron_h_config(), dtype=torch.float32).train()


def pipeline_parity(
    model_type: str, layout: dict[str, Any], tie: bool | None = None, *, train: bool = True, refusal: bool = False
) -> dict[str, Any]:
    """One ``train_step`` of ``model_type`` under ``layout`` (``MeshContext.build`` keywords with ``pp_size``) against
    plain transformers' ``model(input_ids, labels).loss.backward()`` on the whole batch: the loss difference, the
    largest gradient difference (and its parameter), the parameters without a gradient, and whether every
    parameter of the plain model is on some rank; then the loss of a batch of another sequence length, by
    ``train_step`` and ``eval_step``. ``train=False`` runs both models in eval mode (a model whose training forward
    is random); with ``refusal``, a refusal while loading is returned as ``{"refused": message}``."""
    reference = nemotron_h_model() if model_type == "nemotron_h" else plain_model(model_type, tie)
    reference.train(train)
    directory = _saved(reference)
    context = MeshContext.build(**layout)
    try:
        model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context).train(train)
    except (ValueError, NotImplementedError, TypeError) as error:
        if not refusal:
            raise
        return {"refused": f"{type(error).__name__}: {error}"}
    batch = token_batch(8, 16)  # longer than the tiny configs' sliding windows (8)
    loss = model.train_step(input_ids=batch, labels=batch)
    expected = reference(input_ids=batch, labels=batch)
    expected.loss.backward()
    plain = dict(reference.named_parameters(remove_duplicate=False))
    worst, worst_name, without = 0.0, None, []
    for name, param in model.named_parameters():
        if param.grad is None:
            if plain[name].grad is not None:  # some parameters get none by construction (a routing bias)
                without.append(name)
            continue
        difference = (full_tensor(param.grad) - plain[name].grad).abs().max().item()
        if difference >= worst:
            worst, worst_name = difference, name
    # Another sequence length (new stage buffers), train and eval.
    other = token_batch(8, 12, seed=5)
    with torch.no_grad():
        plain_other = reference(input_ids=other, labels=other).loss.item()
    shapes = max(
        abs(model.train_step(input_ids=other, labels=other).item() - plain_other),
        abs(model.eval_step(input_ids=other, labels=other).item() - plain_other),
    )
    held = [[name for name, _ in model.named_parameters(remove_duplicate=False)]]
    everyone: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, held[0])
    covered = {name for names in everyone for name in names}
    return {
        "loss": abs(loss.item() - expected.loss.item()),
        "other_shape_loss": shapes,
        "grad": worst,
        "worst_grad": worst_name,
        "no_grad": without,
        "uncovered": sorted(set(plain) - covered),
        "stages": list(model.stage_indices),
        "same_loss_everywhere": _same_everywhere(loss),
        # How many of this rank's parameters TP shards (a plan applied, not everything replicated).
        "tp_sharded": sum(
            1
            for _, param in model.named_parameters()
            if isinstance(param, DTensor)
            for dim, placement in enumerate(param.placements)
            if placement.is_shard() and param.device_mesh.mesh_dim_names[dim] == "tp"
        ),
        # The mesh axes each routed-expert weight is sharded over (EP: "ep").
        "expert_axes": sorted(
            {
                param.device_mesh.mesh_dim_names[dim]
                for name, param in model.named_parameters()
                if ".experts." in name and isinstance(param, DTensor)
                for dim, placement in enumerate(param.placements)
                if placement.is_shard()
            }
        ),
    }


def _same_everywhere(value: torch.Tensor) -> bool:
    values: list[float] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(values, value.item())
    return len(set(values)) == 1


def tied_after_steps(layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """A tiny Llama with tied embeddings, ``steps`` AdamW steps under ``layout`` and in one plain process: the
    largest difference between the pipelined embedding (first stage) and head (last stage) weights, and between
    each and the plain model's tied weight; and how many process groups the load created."""
    reference = plain_model("llama", tie=True)
    directory = _saved(reference)
    groups_before = len(dist.distributed_c10d._world.pg_map)
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context).train()
    groups_added = len(dist.distributed_c10d._world.pg_map) - groups_before
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    batch = token_batch(8, 8)
    for _ in range(steps):
        model.train_step(input_ids=batch, labels=batch)
        optimizer.step()
        optimizer.zero_grad()
        reference(input_ids=batch, labels=batch).loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    parameters = dict(model.named_parameters())
    mine = parameters.get("model.embed_tokens.weight", parameters.get("lm_head.weight"))
    mine = full_tensor(mine.detach()) if mine is not None else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    held = [tensor for tensor in gathered if tensor is not None]
    plain = reference.get_input_embeddings().weight.detach()
    return {
        "copies": len(held),
        "between_copies": max((held[0] - tensor).abs().max().item() for tensor in held),
        "from_plain": max((plain - tensor).abs().max().item() for tensor in held),
        "groups_added": groups_added,
    }


def clipped_norm(layout: dict[str, Any]) -> dict[str, float]:
    """``automodel.clip_grad_norm_`` over a pipelined model's parameters after one step, and the plain model's
    ``torch.nn.utils.clip_grad_norm_`` on the same batch (tied embeddings: the shared gradient counts once)."""
    from automodel.distributed.grad_clipping import clip_grad_norm_

    reference = plain_model("llama", tie=True)
    directory = _saved(reference)
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context).train()
    batch = token_batch(8, 8)
    model.train_step(input_ids=batch, labels=batch)
    reference(input_ids=batch, labels=batch).loss.backward()
    return {
        "norm": clip_grad_norm_(model.parameters(), 1e9).item(),
        "plain": torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item(),
    }


def pipeline_error(layout: dict[str, Any], call: str = "load", layers: int = LAYERS) -> str:
    """The error a pipelined load (or ``call``: ``forward`` / ``generate`` / ``batch`` on the loaded model) raises,
    on this rank. ``tied_layouts``: a tied Llama loaded with a plan that shards its embedding over the hidden size
    and its head over the vocabulary."""
    tied_layouts = call == "tied_layouts"
    config = tiny_config("llama", num_hidden_layers=layers, tie_word_embeddings=tied_layouts)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    directory = _saved(reference)
    plan = {"model.embed_tokens": "embedding_colwise", "lm_head": "colwise_gather_output"} if tied_layouts else None
    try:
        context = MeshContext.build(**layout)
        model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, tp_plan=plan)
        batch = token_batch(8, 8)
        if call == "forward":
            model(input_ids=batch)
        elif call == "generate":
            model.generate(batch)
        elif call == "batch":
            model.train_step(input_ids=batch[:6], labels=batch[:6])
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def from_config_weights(layout: dict[str, Any]) -> dict[str, Any]:
    """``from_config`` under PP (the default per-module init) gives each rank's stage tensors exactly the values the
    same call without a mesh gives."""
    config = tiny_config("llama", num_hidden_layers=LAYERS)
    whole = dict(NeMoAutoModelForCausalLM.from_config(config).state_dict())
    model = NeMoAutoModelForCausalLM.from_config(config, mesh_context=MeshContext.build(**layout))
    differing = [
        name
        for name, tensor in model.state_dict().items()
        if not torch.equal(full_tensor(tensor.detach()), whole[name])
    ]
    return {"tensors": len(model.state_dict()), "differing": differing}


def masked_batch_parity(layout: dict[str, Any], packed: bool = False) -> dict[str, float]:
    """A padded batch (``attention_mask`` zeros and ``-100`` labels at the end of some rows) with explicit
    ``position_ids``, or (``packed``) packed rows: no mask, positions restarting at each packed document.
    ``train_step`` against plain transformers with the same inputs (the loss and every gradient)."""
    reference = plain_model("llama")
    directory = _saved(reference)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=MeshContext.build(**layout)).train()
    input_ids = token_batch(8, 16, seed=7)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate([16, 12, 9, 16, 5, 16, 14, 11]):
        attention_mask[row, length:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if packed:  # two documents per row, the second starting where the mask above ended
        starts = attention_mask.sum(-1, keepdim=True)
        columns = torch.arange(16).expand(8, 16)
        position_ids = torch.where(columns < starts, columns, columns - starts)
        labels = input_ids.clone()
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
    loss = model.train_step(labels=labels, **inputs)
    expected = reference(labels=labels, **inputs).loss
    expected.backward()
    plain = dict(reference.named_parameters(remove_duplicate=False))
    grad = max((full_tensor(p.grad) - plain[n].grad).abs().max().item() for n, p in model.named_parameters())
    return {"loss": abs(loss.item() - expected.item()), "grad": grad}


def lora_parity(layout: dict[str, Any]) -> dict[str, Any]:
    """LoRA (``peft_config``) under PP against peft's ``get_peft_model`` on plain transformers with the same adapter
    values: the loss, every adapter gradient, and no gradient on a frozen weight."""
    from peft import LoraConfig, get_peft_model

    from automodel.loading.placements import local_indices
    from automodel.loading.sources import select

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    base = plain_model("llama")
    directory = _saved(base)
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, peft_config=config).train()
    reference = get_peft_model(plain_model("llama"), config).train()
    plain = {name.removeprefix("base_model.model."): param for name, param in reference.named_parameters()}
    held: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # non-zero lora_B (peft starts it at zero), the same values on both sides, by name
        for name, param in model.named_parameters():
            if "lora_B" in name:
                generator = torch.Generator().manual_seed(sum(map(ord, name)))
                full = torch.randn(param.shape, generator=generator) * 0.1
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(select(full, local_indices(param)))
                held[name] = full
            elif "lora_A" in name:
                held[name] = full_tensor(param.detach())
        everyone: list[dict[str, torch.Tensor]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, held)  # the plain model takes every stage's adapter values
        for values in everyone:
            for name, full in values.items():
                plain[name].copy_(full)
    batch = token_batch(8, 16)
    loss = model.train_step(input_ids=batch, labels=batch)
    expected = reference(input_ids=batch, labels=batch).loss
    expected.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": max((full_tensor(p.grad) - plain[n].grad).abs().max().item() for n, p in trainable),
        "adapters": len(trainable),
        "frozen_grads": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
    }


def export_matches(layout: dict[str, Any], tie: bool) -> dict[str, Any]:
    """``save_pretrained`` of a pipelined model against ``save_hf_checkpoint`` of the same weights in one process:
    the files, byte for byte (rank 0); after a training and an optimizer step, plain transformers loads the export
    with the plain model's trained weights."""
    import hashlib
    from pathlib import Path

    from automodel.loading.export import save_hf_checkpoint

    reference = plain_model("llama", tie=tie)
    directory = _saved(reference)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=MeshContext.build(**layout)).train()
    out = [tempfile.mkdtemp(prefix="pp-export-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out, src=0)
    model.save_pretrained(f"{out[0]}/pipelined")
    save_hf_checkpoint(reference, f"{out[0]}/plain")  # collective too (every rank agrees), rank 0 writes
    # After a training and an optimizer step (values within fp32 rounding of the plain model's, so not bytes).
    batch = token_batch(8, 16)
    model.train_step(input_ids=batch, labels=batch)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    reference(input_ids=batch, labels=batch).loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    model.save_pretrained(f"{out[0]}/trained")
    if dist.get_rank() != 0:
        return {}

    def digests(folder: str) -> dict[str, str]:
        return {
            path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(Path(folder).iterdir())
            if path.suffix in (".safetensors", ".json")
        }

    reloaded = AutoModelForCausalLM.from_pretrained(f"{out[0]}/trained")
    plain_state = reference.state_dict()
    return {
        "pipelined": digests(f"{out[0]}/pipelined"),
        "plain": digests(f"{out[0]}/plain"),
        "reloaded_differs": [
            n for n, t in reloaded.state_dict().items() if not torch.allclose(t, plain_state[n], atol=1e-6)
        ],
    }


def training_step_parity(
    layout: dict[str, Any], loss: str | None = None, left_padded: bool = False
) -> dict[str, float]:
    """``automodel.training.step.train_step`` (what the recipes run: micro batches joined for the schedule) with
    ``loss`` (``make_loss``; None: the model's own), on a batch ``left_padded`` by 0-3 tokens per row (its
    ``attention_mask`` and ``-100`` labels), against plain transformers on the whole batch: the loss and every
    gradient."""
    from automodel.training.loss import make_loss
    from automodel.training.step import train_step

    reference = plain_model("llama")
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(_saved(reference), mesh_context=context).train()
    input_ids = token_batch(8, 16, seed=7)
    attention_mask = torch.ones_like(input_ids)
    for row in range(8):
        attention_mask[row, : row % 4 if left_padded else 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    padding = {"attention_mask": attention_mask} if left_padded else {}
    micro_batches = [
        {"input_ids": input_ids[rows], "labels": labels[rows], **{k: v[rows] for k, v in padding.items()}}
        for rows in (slice(0, 4), slice(4, 8))
    ]
    try:
        result = train_step(model, micro_batches, context, make_loss(loss) if loss else None)
    except ValueError as refusal:  # the fused loss under zero-bubble schedules on torch before 2.13
        return {"refused": str(refusal)}
    expected = reference(input_ids=input_ids, labels=labels, **padding).loss
    expected.backward()
    plain = dict(reference.named_parameters(remove_duplicate=False))
    grad = max((full_tensor(p.grad) - plain[n].grad).abs().max().item() for n, p in model.named_parameters())
    return {"loss": abs(result.item() - expected.item()), "grad": grad}
