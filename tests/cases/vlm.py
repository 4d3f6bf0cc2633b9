"""Rank-side cases for the vision-language and sequence-classification auto classes (run inside
``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from transformers import AutoModelForImageTextToText, AutoModelForSequenceClassification

from automodel.auto_model import NeMoAutoModelForImageTextToText, NeMoAutoModelForSequenceClassification
from automodel.distributed import MeshContext, ModelParallelizer
from automodel.distributed.model_structure import encoder_tower_blocks
from tests.parity import compare_with_reference
from tests.vlm_models import collate, vlm_examples


def _local_examples(context: MeshContext, examples: list[dict]) -> list[dict]:
    rows = len(examples) // context.dp_size
    start = context.mesh("dp").get_local_rank() * rows
    return examples[start : start + rows]


def vlm_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load ``checkpoint`` parallelized for ``layout``; compare logits, loss and every gradient on image + text
    examples with plain transformers in one process. Also report how the vision tower was parallelized."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForImageTextToText.from_pretrained(checkpoint, mesh_context=context).train()
    reference = AutoModelForImageTextToText.from_pretrained(checkpoint).train()
    examples = vlm_examples(reference.config)
    local = collate(_local_examples(context, examples))
    facts = {**_tower_facts(model, context), **_loading_facts(model, reference)}
    norm_lengths = _record_decoder_norm_lengths(model)
    compared = compare_with_reference(reference, model, context, collate(examples), local_batch=local)
    return {**facts, **compared, "norm_lengths": norm_lengths, "seq": local["input_ids"].shape[1]}


def _record_decoder_norm_lengths(model: torch.nn.Module) -> list[int]:
    """The sequence length each language decoder layer's first norm sees (filled by the next forward): a sequence
    shard under sequence parallelism."""
    from automodel.distributed.model_structure import decoder_layers

    encoder = {id(block) for block in encoder_tower_blocks(model)}
    lengths: list[int] = []
    for layer in decoder_layers(model):
        if id(layer) in encoder:
            continue
        norm = next(c for c in layer.children() if _holds_only_vectors(c))
        norm.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    return lengths


def _holds_only_vectors(module: torch.nn.Module) -> bool:
    """A norm: parameters, all of them 1-D."""
    params = list(module.parameters())
    return bool(params) and all(param.ndim == 1 for param in params)


def _tower_facts(model: torch.nn.Module, context: MeshContext) -> dict[str, Any]:
    """Whether the vision blocks are FSDP units, are checkpointed, and are replicated over ``tp``."""
    blocks = encoder_tower_blocks(model)
    vision_params = [param for block in blocks for param in block.parameters()]
    return {
        "vision_blocks": len(blocks),
        "vision_units": sum(isinstance(block, FSDPModule) for block in blocks),
        "vision_checkpointed": sum(
            any(getattr(module, "_automodel_checkpointed", False) for module in block.modules()) for block in blocks
        ),
        "vision_replicated_over_tp": all(
            isinstance(param, DTensor) and _placement_on_tp(param) == Replicate() for param in vision_params
        ),
    }


def _placement_on_tp(param: DTensor) -> Any:
    """The placement of ``param`` on the ``tp`` axis of its mesh (``None`` when its mesh has none)."""
    names = param.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    return param.placements[names.index("tp")]


def _loading_facts(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, Any]:
    references = dict(reference.named_buffers())
    return {
        "on_meta": [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta],
        "buffers": max(
            ((b.float() - references[n].float()).abs().max().item() for n, b in model.named_buffers()), default=0.0
        ),
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
        "training": model.training,
    }


def vlm_bytes_read_per_rank(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """How much of the checkpoint each rank reads (the loader's own accounting) against the total stored bytes and
    what the rank stores."""
    from transformers import AutoConfig

    from automodel.loading import load_checkpoint, materialize, plan_checkpoint
    from automodel.loading.checkpoint_files import open_checkpoint

    context = MeshContext.build(**layout)
    config = AutoConfig.from_pretrained(checkpoint)
    model = NeMoAutoModelForImageTextToText._build_on_meta(config, torch.float32, None, False)
    plan = plan_checkpoint(model, checkpoint)
    model = ModelParallelizer().parallelize(model, context)
    materialize(model, "cpu")
    report = load_checkpoint(model, plan, progress=False)
    files = open_checkpoint(checkpoint)
    total = sum(files.read_slice(key, tuple(slice(0, n) for n in files.shape(key))).nbytes for key in files.keys())
    local = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in model.parameters())
    return {"read": report.bytes_read, "total": total, "local": local}


def vlm_refusal(config_kwargs: dict[str, Any], architecture: str, layout: dict[str, Any]) -> str:
    """The error parallelizing a tiny ``architecture`` for ``layout`` raises (on every rank), or ``""``."""
    from tests.vlm_models import build_vlm, tiny_vlm_config

    model = build_vlm(tiny_vlm_config(architecture, **config_kwargs))
    try:
        ModelParallelizer().parallelize(model, MeshContext.build(**layout))
    except ValueError as error:
        return str(error)
    return ""


def sequence_classification_parity(
    checkpoint: str, layout: dict[str, Any], tp_plan: dict[str, str] | None = None
) -> dict[str, Any]:
    """``NeMoAutoModelForSequenceClassification`` against plain transformers: logits, loss, every gradient (with
    ``tp_plan``, a plan that also shards the ``score`` head)."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForSequenceClassification.from_pretrained(checkpoint, mesh_context=context, tp_plan=tp_plan)
    model.train()
    reference = AutoModelForSequenceClassification.from_pretrained(checkpoint).train()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 90, (4, 8), generator=generator)
    ids[1, 6:] = reference.config.pad_token_id  # right padding: the score is read at the last real token
    batch = {"input_ids": ids, "labels": torch.tensor([0, 2, 1, 2])}
    score = model.score.weight
    facts = {
        **_loading_facts(model, reference),
        "score_is_dtensor": isinstance(score, DTensor),
        "score_placements": [str(placement) for placement in getattr(score, "placements", ())],
    }
    return {**facts, **compare_with_reference(reference, model, context, batch)}


def train_vlm(config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Run the SFT recipe on a vision-language checkpoint on every rank: the step losses, and (with an export) how
    far the exported checkpoint, loaded by plain transformers, is from the trained model on an image + text chat."""
    import torch.distributed as dist
    from transformers import AutoProcessor

    from automodel.training.config import load_config
    from automodel.training.loop import run

    config = load_config(config_path, overrides)
    result = run(config)
    facts: dict[str, Any] = {"losses": result.losses, "resumed_from": result.resumed_from}
    if result.export_dir is None:
        return facts
    processor = AutoProcessor.from_pretrained(result.export_dir)
    image = sorted((Path(config.data.path).parent / "images").glob("*.png"))[0]
    chat = [{"role": "user", "content": [{"type": "image", "path": str(image)}, {"type": "text", "text": "what"}]}]
    inputs = processor.apply_chat_template(chat, tokenize=True, return_dict=True, return_tensors="pt")
    inputs.pop("attention_mask")
    model = result.model.eval()
    with torch.no_grad():
        logits = model(**inputs).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    facts["processor"] = type(processor).__name__
    if dist.get_rank() == 0:
        plain = AutoModelForImageTextToText.from_pretrained(result.export_dir).eval()
        with torch.no_grad():
            facts["export_logits"] = (plain(**inputs).logits - logits).abs().max().item()
    return facts


def vlm_from_config_matches_seed(architecture: str, layout: dict[str, Any], seed: int) -> dict[str, Any]:
    """``NeMoAutoModelForImageTextToText.from_config(config, seed=s, init="exact")`` holds plain transformers' weights
    after ``torch.manual_seed(s)``, on both towers."""
    from tests.vlm_models import tiny_vlm_config

    config = tiny_vlm_config(architecture)
    model = NeMoAutoModelForImageTextToText.from_config(
        config, mesh_context=MeshContext.build(**layout), seed=seed, init="exact"
    )
    torch.manual_seed(seed)
    reference = dict(AutoModelForImageTextToText.from_config(config).named_parameters())
    diffs = [
        ((p.full_tensor() if isinstance(p, DTensor) else p) - reference[name]).abs().max().item()
        for name, p in model.named_parameters()
    ]
    return {"weights": max(diffs), "count": len(diffs), "reference": len(reference)}


def vlm_lora_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """LoRA adapters on both towers (``q_proj`` / ``v_proj`` of the vision encoder and the decoder, ``down_proj`` of
    the decoder) through ``from_pretrained(peft_config=...)`` against peft on plain transformers, with the same
    non-zero adapter values: logits, loss and every adapter gradient on image + text examples."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from automodel.distributed.runtime import full_tensor
    from automodel.loading.placements import local_indices
    from automodel.loading.sources import select

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForImageTextToText.from_pretrained(checkpoint, mesh_context=context, peft_config=lora)
    reference = get_peft_model(AutoModelForImageTextToText.from_pretrained(checkpoint), lora)
    model.train(), reference.train()
    ref_params = {name.removeprefix("base_model.model."): p for name, p in reference.named_parameters()}
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = full_tensor(param)
            if "lora_B" in name:  # peft starts lora_B at zero: give both the same non-zero values
                full = torch.randn(full.shape, generator=generator) * 0.1
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(select(full, local_indices(param)))
            ref_params[name].copy_(full)
    examples = vlm_examples(reference.config)
    mine = _local_examples(context, examples)
    out, ref = model(**collate(mine)), reference(**collate(examples))
    out.loss.backward()
    ref.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=context.mesh("dp").get_group())
    start = context.mesh("dp").get_local_rank() * len(mine)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return {
        "logits": (full_tensor(out.logits) - ref.logits[start : start + len(mine)]).abs().max().item(),
        "loss": (loss / context.dp_size - ref.loss).abs().item(),
        "grad": max(
            (full_tensor(model.get_parameter(n).grad) - ref_params[n].grad).abs().max().item() for n in trainable
        ),
        "trainable": len(trainable),
        "ref_trainable": sum(p.requires_grad for p in reference.parameters()),
        "vision_adapters": sum("lora_A" in n and n.startswith(("model.vision", "model.visual")) for n in trainable),
    }


def vlm_generate(checkpoint: str, layout: dict[str, Any]) -> bool:
    """Greedy ``generate`` with an image, parallelized for ``layout``, gives plain transformers' tokens (its encoders
    run before the first forward, outside the root unit's forward)."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForImageTextToText.from_pretrained(checkpoint, mesh_context=context).eval()
    reference = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    one = {key: value for key, value in collate(vlm_examples(reference.config)[:1]).items() if key != "labels"}
    with torch.no_grad():
        ours = model.generate(**one, max_new_tokens=5, do_sample=False, pad_token_id=0)
        theirs = reference.generate(**one, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return ours.tolist() == theirs.tolist()
