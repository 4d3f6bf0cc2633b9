"""Plan, then apply: the frozen plan's ``describe()`` is what ``parallelize`` logs (the reference recorded from the code
before the split, ``tests/golden``), every refusal is the planner's and leaves the model untouched, and the plan
is what the applied model records. One process simulates rank 0 of 4 under torch's fake process group (the models on
meta); the parity of the applied models is the rest of the suite's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from automodel.distributed import MegatronFSDPConfig, MeshContext, ModelParallelizer
from automodel.distributed.parallelizer import parallelizer_for
from automodel.distributed.planner import plan_parallelization
from automodel.distributed.tensor_parallel import set_user_tp_plan
from tests.cases.hooks import RefusingParallelizer, UnitsAndPrimitiveParallelizer
from tests.cases.plan_lines import GOLDEN, LAYOUTS, meta_model, parallelize_lines, simulated_rank_zero
from tests.tiny_models import tiny_config

RECORDED = json.loads(GOLDEN.read_text())
CASES = RECORDED["cases"]
#: The reference lines hold for the versions they were recorded with (the TP plans, and so some lines, are
#: transformers'); at another end of the tested range the plan is compared with what parallelize logs there.
SAME_VERSIONS = (transformers.__version__, torch.__version__.split("+")[0]) == (
    RECORDED["transformers"],
    RECORDED["torch"],
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_describe_is_what_parallelize_logs_today(case):
    """The plan's lines equal what ``parallelize`` logs, byte for byte (a refusal: the same message); with the
    versions the reference was recorded with, both equal the lines of the code before plan / apply."""
    architecture, layout = case.split("/")
    logged = parallelize_lines(architecture, layout)
    if SAME_VERSIONS:
        assert logged == CASES[case]
    with simulated_rank_zero():
        model = meta_model(architecture)
        try:
            plan = plan_parallelization(parallelizer_for(model), model, MeshContext.build(**LAYOUTS[layout]))
        except (ValueError, NotImplementedError) as refusal:
            assert logged == {"refused": f"{type(refusal).__name__}: {refusal}"}
        else:
            assert {"lines": plan.describe()} == logged
            assert json.loads(json.dumps(plan.to_dict()))["model"] == type(model).__name__


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """What a refusal must leave as it was: the parameter objects, every module's class, hooks and ``forward``, and
    the recorded TP plan."""
    return {
        "parameters": {name: id(param) for name, param in model.named_parameters(remove_duplicate=False)},
        "classes": {name: type(module) for name, module in model.named_modules()},
        "hooks": {
            name: sum(
                len(hooks) for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
            )
            for name, module in model.named_modules()
        },
        "forwards": sorted(name for name, module in model.named_modules() if "forward" in module.__dict__),
        "tp_plan": model.__dict__.get("_tp_plan", "absent"),
    }


def _model(architecture: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tiny_config(architecture, **config), dtype=torch.float32)

    return build


def _vlm() -> nn.Module:
    from transformers import AutoModelForImageTextToText

    from tests.vlm_models import tiny_vlm_config

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(tiny_vlm_config("llava"))


def _with_user_plan(build: Callable[[], nn.Module], plan: dict[str, str]) -> Callable[[], nn.Module]:
    def with_plan() -> nn.Module:
        model = build()
        set_user_tp_plan(model, plan)
        return model

    return with_plan


def _megatron(context: MeshContext) -> MeshContext:
    """Megatron-FSDP, built field by field (``MeshContext.build`` needs CUDA for it)."""
    return MeshContext(device_mesh=context.device_mesh, strategy=MegatronFSDPConfig())


# (model, layout, parallelizer, context transform, part of the refusal): one case per kind of refusal.
REFUSALS = {
    "hook on Megatron-FSDP": (_model("llama"), {}, UnitsAndPrimitiveParallelizer, _megatron, "cannot apply that"),
    "hooks on the MoE path": (_model("qwen3_moe"), {"ep_size": 2}, UnitsAndPrimitiveParallelizer, None, "customizes"),
    "encoder tower under CP": (_vlm, {"cp_size": 2}, ModelParallelizer, None, "encoder tower"),
    "EP without experts": (_model("llama"), {"ep_size": 2}, ModelParallelizer, None, "no routed experts"),
    "experts against EP": (_model("qwen3_moe", num_experts=6), {"ep_size": 4}, ModelParallelizer, None, "6 experts"),
    "compile with EP": (_model("qwen3_moe"), {"ep_size": 2, "compile": True}, ModelParallelizer, None, "compile=True"),
    "a user rule matching nothing": (
        _with_user_plan(_model("llama"), {"model.nothing": "colwise"}),
        {"tp_size": 2},
        ModelParallelizer,
        None,
        "match no parameter",
    ),
    "heads against TP": (_model("llama"), {"tp_size": 4}, ModelParallelizer, None, "not divisible by tp_size=4"),
    "the sidecar's _validate_tp_mesh": (_model("llama"), {"tp_size": 2}, RefusingParallelizer, None, "cannot use TP"),
    "sequence parallelism": (
        _model("phi3"),
        {"tp_size": 2, "sequence_parallel": True},
        ModelParallelizer,
        None,
        "Sequence parallelism cannot follow",
    ),
    "tied placements": (
        _with_user_plan(_model("llama_tied"), {"lm_head": "colwise"}),
        {"tp_size": 2},
        ModelParallelizer,
        None,
        "Tied parameters",
    ),
    "CP and a sliding window": (_model("mistral"), {"cp_size": 2}, ModelParallelizer, None, "sliding window"),
    "CP without self_attn": (_model("gpt_neox"), {"cp_size": 2}, ModelParallelizer, None, "no `self_attn`"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_every_refusal_is_the_planners_and_leaves_the_model_untouched(case):
    build, layout, parallelizer_class, transform, message = REFUSALS[case]
    with simulated_rank_zero():
        model = build()
        before = _snapshot(model)
        context = MeshContext.build(**layout)
        context = transform(context) if transform else context
        parallelizer = parallelizer_class()
        with pytest.raises((ValueError, RuntimeError, ImportError), match=None) as planned:
            plan_parallelization(parallelizer, model, context)
        assert message in str(planned.value), str(planned.value)
        assert _snapshot(model) == before
        with pytest.raises(type(planned.value)) as applied:
            parallelizer.parallelize(model, context)
        assert str(applied.value) == str(planned.value)
        assert _snapshot(model) == before


def test_the_applied_model_records_its_plan_and_its_tp_plan():
    with simulated_rank_zero():
        model = meta_model("llama")
        context = MeshContext.build(tp_size=2, activation_checkpointing=True)
        before = dict(model._tp_plan)  # transformers' own record of the model's plan
        plan = plan_parallelization(parallelizer_for(model), model, context)
        assert model._tp_plan == before, "planning leaves the model as it was"
        parallelized = parallelizer_for(model).parallelize(model, context)
        assert parallelized.parallel_plan == plan
        assert parallelized._tp_plan == plan.tp.rules
        assert plan.ac.targets == tuple(f"model.layers.{i}.{part}" for i in range(2) for part in ("self_attn", "mlp"))
        assert plan.sharding.mesh == {"dp_shard_cp": 2} and plan.decoder_blocks == ("model.layers.0", "model.layers.1")
