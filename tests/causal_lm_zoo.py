"""Tiny random models of every architecture in transformers' causal-LM mapping, and which of them plain transformers
can run on CPU (the sweep in ``tests/test_zoo_sweep.py`` compares the feasible ones under our parallelizer).

``tiny_config(model_type)`` shrinks each config class generically: every field of the default config is matched by
name (and by the canonical names its ``attribute_map`` gives it, e.g. ``n_embd`` is ``hidden_size``) against
``_RULES``; the overrides go to the constructor, so derived fields (``head_dim``, ``layer_types`` ...) are recomputed;
per-layer lists are cut down to two layers that differ where the default has several layer kinds (dense and MoE,
sliding and full attention ...), and sub-configs (``text_config`` ...) are shrunk the same way. ``_OVERRIDES`` holds
the few per-model values no name rule can know, each with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "BATCH_SIZE",
    "SEQ_LEN",
    "VOCAB",
    "ZOO_MODEL_TYPES",
    "build_tiny_model",
    "feasibility",
    "train_mode",
    "tiny_config",
    "zoo_batch",
]

#: Every model type of transformers' causal-LM auto mapping.
ZOO_MODEL_TYPES: list[str] = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

VOCAB = 128
#: Special token ids beyond the vocabulary (bos, eos, pad, image ...) move to the top ``_SPECIAL`` ids, which batches
#: never contain.
_SPECIAL = 16
#: 4 rows so FSDP2 over 4 ranks gets one row each; 16 tokens so sliding windows / chunks of 8 are exercised.
BATCH_SIZE, SEQ_LEN = 4, 16
MAX_PARAMS = 2_000_000
SEED = 0


def _cap(target: int) -> Callable[[int], int]:
    return lambda value: min(value, target)


def _set(target: int) -> Callable[[int], int]:
    return lambda value: target


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Fields whose name (or a canonical alias of it) fully matches one of ``names`` get ``value(default)``; a derived
    field (class default ``None``, computed from the others) only when ``derived``."""

    names: tuple[str, ...]
    value: Callable[[int], int]
    derived: bool = False

    def matches(self, candidates: list[str]) -> bool:
        return any(re.fullmatch("|".join(self.names), name) for name in candidates)


_TOKEN_ID = r"(.*_)?token_(id|ids|index)"

# First match wins.
_RULES: tuple[_Rule, ...] = (
    _Rule((_TOKEN_ID,), lambda value: value),  # left to _special_tokens
    _Rule(("vocab_size",), _set(VOCAB)),
    _Rule((".*vocab.*",), _cap(VOCAB)),
    _Rule(("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_head_kv", "num_query_groups"), _set(2), True),
    _Rule(("linear_num_key_heads",), _set(2)),
    _Rule(("num_attention_heads", "n_heads?", "num_heads", "(.*_)?attention_heads"), _set(4)),
    _Rule((".*_n_heads", ".*num_.*heads"), _set(4)),
    # Multi-head latent attention: the rope part is as wide as head_dim (several models tie the two).
    _Rule(("qk_(nope|rope)_head_dim",), _cap(16)),
    _Rule(("rotary_dim",), _cap(8)),
    _Rule(("head_dim",), _cap(16), True),
    # Mamba heads: heads x head width = expand (2) x hidden 64.
    _Rule(("mamba_(d_head|head_dim|headdim)",), _set(32)),
    _Rule((".*head_dim", "d_head", "dim_head", "attention_head_size", "kv_channels"), _cap(16)),
    _Rule(("moe_intermediate_size", ".*expert.*(intermediate|hidden)_size", "moe_.*intermediate.*"), _cap(64)),
    _Rule(("mamba_d_ssm", ".*intermediate_size.*", ".*ffn_dim", ".*ffn_hidden_size", "dff", "d_inner"), _cap(128)),
    _Rule(("dim_ff", "feed_forward_size", "n_inner", "mlp_dim"), _cap(128)),
    _Rule(
        ("hidden_size", "d_model", "n_embd", "emb_dim", "embedding_(size|dim)", "dim", "word_embed_proj_dim"), _cap(64)
    ),
    _Rule(("lru_width", ".*hidden_size.*", ".*_embed_dim", "adapter_(in|out)_dim", "adapter_input_size"), _cap(64)),
    _Rule((".*channels?",), _cap(64)),
    _Rule(("num_hidden_layers", "n_layers?", "num_layers", "(num_)?(encoder|decoder)_layers", "num_blocks"), _set(2)),
    _Rule(("first_k_dense_replace", "moe_layer_start_index", "n_recurrent_layers", "moe_layer_end_index"), _cap(1)),
    _Rule(("max_window_layers",), _cap(2)),
    _Rule(("num_kv_shared_layers",), _cap(0)),
    _Rule(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), _cap(4), True),
    _Rule(("num_experts_per_tok(en)?", "moe_top_?k", "top_k", "centroid_intermediate_top_k"), _cap(2), True),
    _Rule(("n_group", "num_expert_group", "topk_group"), _cap(1)),
    _Rule(("n_groups", "mamba_n_groups", "mamba_ngroups"), _cap(2)),
    _Rule(("n_shared_experts", "num_shared_experts", "zero_expert_num"), _cap(1), True),
    _Rule(("num_centroids", "index_topk"), _cap(4)),
    _Rule((".*lora_rank", ".*_rank", ".*lowrank"), _cap(16)),
    _Rule((".*state_size", ".*d_state"), _cap(16)),
    _Rule(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length"), _cap(64)),
    _Rule(("max_(source|target)_positions", "model_max_length", "original_max_position_embeddings"), _cap(64)),
    _Rule(("sliding_window(_size)?", "attention_window_size", "window_size", "local_attention(_window_len)?"), _cap(8)),
    _Rule(("attention_chunk_size", "keep_window_size", "rel_extent"), _cap(8)),
    _Rule(("(.*_)?chunk_size", "(.*_)?block_size", ".*chunk_length", "prompt_length", "prompt_mid_dim"), _cap(8)),
)

# Dropout probabilities are zeroed, so the models can be compared in train mode.
_DROPOUT = r".*dropout.*|.*pdrop|.*drop_prob|.*drop_path_rate|(.*_)?layerdrop"

# Per-model values no name rule can know (keep this small; each says why).
_OVERRIDES: dict[str, dict[str, Any]] = {
    # Mamba2 names its SSM head width plain `head_dim`: 4 heads x 32 = expand (2) x hidden 64.
    "mamba2": {"head_dim": 32},
    # Full-attention layers' head width is a constructor argument, not a field (default 512).
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # The looped layers [start, end) must lie in the model (start > 0) and span whole attention-residual blocks.
    "inkling2_loop_text": {"loop_layer_index_start": 1, "loop_layer_index_end": 2, "n_layers_per_attn_res_block": 1},
    # clip_qkv=None reaches torch.clamp(min=None, max=None) in the attention (the default config fails too).
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10_000.0, "clip_qkv": 8.0}},
    # The default config has no rope_parameters, which the rotary embedding indexes per layer type.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    # attention_types ([[kinds, repeats]]) must expand to num_layers layers.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # A single shared-attention ("hybrid") layer breaks the tied-weights pattern of the shared block: use two.
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},
    # LSH attention hashes with fresh random rotations unless seeded.
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 4], "hash_seed": 0},
    # X-MOD needs a language adapter chosen when no lang_ids are given.
    "xmod": {"default_language": "en_XX"},
    # The default config leaves the QSA indexer unset, which the indexed-attention layers need.
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # The default config has no layer_types, which the model indexes per layer (a conv and an attention layer).
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}

# Set where the config has them: no KV cache, no auxiliary router loss (it depends on the batch split, so a sharded
# batch would legitimately differ), and causal attention for the encoder families' causal-LM heads.
_RUNTIME = {"use_cache": False, "output_router_logits": False, "is_decoder": True}


def _field_name(config_class: type[PretrainedConfig], key: str, fields: set[str]) -> str | None:
    """The constructor argument that sets ``key`` (itself or an ``attribute_map`` alias), or ``None``."""
    return next((name for name in _canonical_names(config_class, key) if name in fields), None)


def _canonical_names(config_class: type[PretrainedConfig], name: str) -> list[str]:
    aliases = [alias for alias, real in getattr(config_class, "attribute_map", {}).items() if real == name]
    return [name, *aliases]


def _rule_for(config_class: type[PretrainedConfig], name: str) -> _Rule | None:
    names = _canonical_names(config_class, name)
    return next((rule for rule in _RULES if rule.matches(names)), None)


def _derived_fields(config_class: type[PretrainedConfig]) -> set[str]:
    return {f.name for f in dataclasses.fields(config_class) if f.default is None}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink_value(rule: _Rule, value: Any) -> Any:
    """The rule applied to an int, to each int of a list, and to a derived field's ``None`` (the rule's target)."""
    if value is None:
        return rule.value(10**9)
    if _is_int(value):
        return rule.value(value)
    if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value):
        return type(value)(rule.value(v) for v in value)
    return value


def _two_layers(values: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Cut the per-layer lists (length ``n_layers``) and layer-index lists to two layers: the first, and the first
    layer that differs from it in any per-layer setting (so a model mixing layer kinds keeps two kinds)."""
    per_layer = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == n_layers and n_layers > 2}
    index_lists = {
        k: v
        for k, v in per_layer.items()
        if all(_is_int(i) for i in v) and v == sorted(set(v)) and (not v or v[-1] < n_layers) and len(set(v)) > 2
    }
    signature = [
        tuple(v[i] for k, v in per_layer.items() if k not in index_lists) + tuple(i in v for v in index_lists.values())
        for i in range(n_layers)
    ]
    second = next((i for i in range(1, n_layers) if signature[i] != signature[0]), 1)
    out: dict[str, Any] = {}
    for key, value in per_layer.items():
        if key in index_lists:
            out[key] = [new for new, old in enumerate((0, second)) if old in value]
        else:
            out[key] = [value[0], value[second]]
    for key, value in values.items():
        # Index lists shorter than the layer count (full_attn_idxs, hybrid_layer_ids ...): keep indices 0 and 1.
        if key not in per_layer and isinstance(value, list) and value and all(_is_int(i) for i in value):
            if value == sorted(set(value)) and value[-1] < n_layers and re.search(r"(idx|ids|layers)$", key):
                out[key] = [new for new, old in enumerate((0, second)) if old in value]
    return out


def _special_tokens(values: dict[str, Any]) -> dict[str, Any]:
    """Move every special token id beyond the vocabulary to the top ``_SPECIAL`` ids (distinct where possible)."""
    out: dict[str, Any] = {}
    free = iter(range(VOCAB - 1, VOCAB - _SPECIAL - 1, -1))
    assigned: dict[int, int] = {}

    def remap(token: int) -> int:
        if token not in assigned:
            assigned[token] = next(free, VOCAB - 1)
        return assigned[token]

    for key, value in values.items():
        if not re.fullmatch(_TOKEN_ID, key):
            continue
        if _is_int(value) and value >= VOCAB:
            out[key] = remap(value)
        elif isinstance(value, list) and any(_is_int(v) and v >= VOCAB for v in value):
            out[key] = [remap(v) if v >= VOCAB else v for v in value]
    return out


def _overrides_for(config_class: type[PretrainedConfig], default: PretrainedConfig) -> dict[str, Any]:
    values = default.to_dict()
    derived = _derived_fields(config_class)
    fields = {f.name for f in dataclasses.fields(config_class)}
    out: dict[str, Any] = {}
    for key, value in values.items():
        sub = _sub_config(default, key)
        if sub is not None:
            nested = _overrides_for(type(sub), sub)
            out[key] = {"model_type": sub.model_type, **nested} if getattr(sub, "model_type", "") else nested
            continue
        field = _field_name(config_class, key, fields)
        if field is None:
            continue
        if re.fullmatch(_DROPOUT, key) and isinstance(value, float) and value > 0:
            out[field] = 0.0
            continue
        rule = _rule_for(config_class, key)
        if rule is None or (field in derived and not rule.derived):
            continue
        new = _shrink_value(rule, value)
        if new != value:
            out[field] = new
    n_layers = values.get(_real_name(config_class, "num_hidden_layers"))
    if _is_int(n_layers):
        for key, value in _two_layers(values, n_layers).items():
            if (field := _field_name(config_class, key, fields)) is not None:
                rule = _rule_for(config_class, key)
                out[field] = _shrink_value(rule, value) if rule else value
    if "kv_lora_rank" in values and "num_key_value_heads" in fields:
        # Multi-head latent attention expands K and V to every query head: no grouped-query attention.
        out["num_key_value_heads"] = out.get(_real_name(config_class, "num_attention_heads"), 4)
    out.update(_special_tokens(values))
    for key, value in _RUNTIME.items():
        if key in values:
            out[key] = value
    out.update(_OVERRIDES.get(default.model_type, {}))
    return out


def _sub_config(config: PretrainedConfig, key: str) -> PretrainedConfig | None:
    try:
        value = getattr(config, key, None)
    except RuntimeError:  # heterogeneous (per-layer) configs refuse global reads of per-layer fields
        return None
    return value if isinstance(value, PretrainedConfig) else None


def _real_name(config_class: type[PretrainedConfig], canonical: str) -> str:
    return getattr(config_class, "attribute_map", {}).get(canonical, canonical)


def _model_class(config_class: type[PretrainedConfig]) -> type | None:
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    except (KeyError, ImportError, AttributeError):
        return None


@functools.cache
def _tiny_kwargs(model_type: str) -> dict[str, Any]:
    config_class = CONFIG_MAPPING[model_type]
    return _overrides_for(config_class, config_class())


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A tiny config of ``model_type`` (hidden 64, 2 layers, 4 heads / 2 KV heads, vocabulary 128, 4 experts top-2,
    64 positions), with ``sdpa`` attention where the model class supports it, else ``eager``; ``overrides`` are
    config arguments (``num_hidden_layers=4``), given to the constructor so that derived fields follow."""
    config_class = CONFIG_MAPPING[model_type]
    model_class = _model_class(config_class)
    attn = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    kwargs = {**_tiny_kwargs(model_type), **overrides}
    depth = _tiny_kwargs(model_type).get("num_hidden_layers")
    if "num_hidden_layers" in overrides and depth:
        for key, value in list(kwargs.items()):
            # Per-layer lists (`layer_types`, `mlp_layer_types` ...) repeated over the new depth.
            if key not in overrides and isinstance(value, list) and len(value) == depth and "layer" in key:
                kwargs[key] = [value[index % depth] for index in range(overrides["num_hidden_layers"])]
    config = config_class(**kwargs)
    config._attn_implementation = attn
    return config


def build_tiny_model(model_type: str, seed: int = SEED, *, train: bool | None = None) -> torch.nn.Module:
    """The plain transformers model of ``tiny_config(model_type)``, fp32, weights drawn after ``manual_seed(seed)``.

    In train mode (the config's dropout probabilities are zero), unless its training forward draws random numbers
    (e.g. sampled expert routing), which no two layouts can reproduce: then in eval mode. ``train`` overrides the
    mode (``None``: run the feasibility check to choose, see ``train_mode``).
    """
    model = _build(model_type, seed)
    return model.train(train_mode(model_type) if train is None else train)


def train_mode(model_type: str) -> bool:
    """Whether the sweep compares ``model_type`` in train mode (False: its training forward is random)."""
    return _check(model_type).train


def _build(model_type: str, seed: int = SEED) -> torch.nn.Module:
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def zoo_batch(batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    """Random token ids below the ids special tokens were moved to, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - _SPECIAL, (batch_size, seq_len), generator=generator)


def _short(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {' | '.join(lines[:2])[:200]}"


def feasibility(model_type: str) -> str | None:
    """``None`` when plain transformers builds the tiny model on CPU in fp32 and runs a forward with labels and a
    backward with a finite loss, whose output does not depend on the random number generator (in train mode, else
    in eval mode); otherwise a short reason to skip it."""
    return _check(model_type).reason


@dataclasses.dataclass(frozen=True)
class _Feasibility:
    reason: str | None
    seconds: float
    train: bool = True


@functools.cache
def _check(model_type: str) -> _Feasibility:
    start = time.perf_counter()

    def skip(reason: str) -> _Feasibility:
        return _Feasibility(reason, time.perf_counter() - start)

    try:
        tiny_config(model_type)
    except Exception as error:
        return skip(f"config: {_short(error)}")
    try:
        model = _build(model_type)
    except Exception as error:
        return skip("needs CUDA" if "cuda" in str(error).lower() else f"build: {_short(error)}")
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > MAX_PARAMS:
        return skip(f"too large: {n_params} params")
    batch = zoo_batch()
    try:
        for train in (True, False):
            model.train(train)
            torch.manual_seed(1)
            out = model(input_ids=batch, labels=batch)
            if out.loss is None or not torch.isfinite(out.loss):
                return skip(f"forward: the loss is {out.loss}")
            out.loss.backward()
            torch.manual_seed(2)
            again = model(input_ids=batch, labels=batch)  # with autograd too: CPU SDPA picks other kernels without
            if torch.equal(out.logits.detach(), again.logits.detach()):
                return _Feasibility(None, time.perf_counter() - start, train)
    except Exception as error:
        return skip("needs CUDA" if "cuda" in str(error).lower() else f"forward: {_short(error)}")
    return skip("nondeterministic: the output depends on the random number generator, even in eval mode")


def _main() -> None:
    start = time.perf_counter()
    ok = 0
    for model_type in ZOO_MODEL_TYPES:
        result = _check(model_type)
        ok += result.reason is None
        mode = "" if result.reason or result.train else " (eval mode: random training forward)"
        print(f"{model_type:28s} {result.seconds:6.2f}s  {result.reason or 'ok'}{mode}", flush=True)
    print(f"{ok}/{len(ZOO_MODEL_TYPES)} feasible in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    _main()
