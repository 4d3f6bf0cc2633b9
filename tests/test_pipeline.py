"""Pipeline parallelism on CPU ranks: any causal LM split into stages by its decoder layers, run by torch's schedules,
against plain single-process transformers on the whole batch (fp32: loss and every gradient within 1e-5)."""

from __future__ import annotations

import pytest

from tests.cases import pipeline

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
SCHEDULES = {
    "gpipe": {"pp_schedule": "gpipe"},
    "1f1b": {"pp_schedule": "1f1b"},
    "interleaved_1f1b": {"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
    "interleaved_zero_bubble": {"pp_schedule": "interleaved_zero_bubble", "pp_virtual_stages": 2},
    "zbv": {"pp_schedule": "zbv", "pp_virtual_stages": 2},
}
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv")
#: The zero-bubble schedules on the quick suite: the tied model (ZBV holds the first and the last stage on one rank)
#: and the MoE model; the other models under them are in the slow matrix.
QUICK_ZERO_BUBBLE = {"llama_tied", "mixtral"}
#: (model type, tie_word_embeddings): dense, QK-norm, sliding-window, tied and MoE models.
MODELS = [("llama", False), ("qwen3", None), ("gemma3_text", None), ("llama", True), ("mixtral", None)]


def _check(result):
    assert max(result["loss"], result["grad"], result["other_shape_loss"]) <= TOLERANCE, result
    assert not result["no_grad"], result
    assert not result["uncovered"], result
    assert result["same_loss_everywhere"], result


def _matrix():
    for model_type, tie in MODELS:
        name = f"{model_type}{'_tied' if tie else ''}"
        for schedule in SCHEDULES:
            slow = schedule in ZERO_BUBBLE and name not in QUICK_ZERO_BUBBLE
            yield pytest.param(model_type, tie, schedule, id=f"{name}-{schedule}", marks=[pytest.mark.slow] * slow)


@pytest.mark.parametrize(("model_type", "tie", "schedule"), _matrix())
def test_pp2_matches_plain_transformers(ranks2, model_type, tie, schedule):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, **SCHEDULES[schedule]}
    results = ranks2.run(pipeline.pipeline_parity, model_type, layout, tie)
    for result in results:
        _check(result)
    virtual = SCHEDULES[schedule].get("pp_virtual_stages", 1)
    expected = [[0, 3], [1, 2]] if schedule == "zbv" else [[rank + 2 * k for k in range(virtual)] for rank in (0, 1)]
    assert [result["stages"] for result in results] == expected


#: Models whose stages needed more than the Llama-likes: BioGPT and CTRL declare no `_no_split_modules` (a stage's
#: blocks are its own layers, not the stand-ins), CTRL scales its `inputs_embeds` in place (a later stage passes a
#: detached copy of the received activation), RemBERT's embeddings are narrower than its layers (zeros of the
#: embeddings' shape).
@pytest.mark.parametrize("model_type", ["biogpt", "ctrl", "rembert"])
def test_pp2_of_models_without_declared_blocks_or_with_narrow_embeddings(ranks2, model_type):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}
    for result in ranks2.run(pipeline.pipeline_parity, model_type, layout, None):
        _check(result)


@pytest.mark.parametrize("inner", [{"dp_replicate_size": 1}, {"tp_size": 2}], ids=["pp2_fsdp2", "pp2_tp2"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_pp2_composes_with_fsdp2_and_tp_on_4_ranks(ranks4, model_type, inner):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b", **inner}
    for result in ranks4.run(pipeline.pipeline_parity, model_type, layout, None):
        _check(result)


#: PP2 x TP2 for models TP supports alone (besides the untied Llama and Qwen3 above): tied embeddings (the embedding
#: group's gradient sum under a vocab-sharded embedding and a colwise head; GPT-2 and OPT are tied too), plans derived
#: from the module tree (GPT-2, OPT and StableLM declare none), and sequence parallelism inside the stages.
PP_TP_CASES = [
    pytest.param("gemma3_text", None, {}, id="gemma3"),
    pytest.param("llama", True, {}, id="llama_tied"),
    pytest.param("gpt2", None, {}, id="gpt2_derived_plan"),
    pytest.param("opt", None, {}, id="opt_derived_plan"),
    pytest.param("stablelm", None, {}, id="stablelm_derived_plan"),
    pytest.param("llama", None, {"sequence_parallel": True}, id="llama_sp"),
]


@pytest.mark.parametrize(("model_type", "tie", "extra"), PP_TP_CASES)
def test_pp2_x_tp2_for_models_tp_supports_alone(ranks4, model_type, tie, extra):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b", "tp_size": 2, **extra}
    for result in ranks4.run(pipeline.pipeline_parity, model_type, layout, tie):
        _check(result)
        assert result["tp_sharded"], result  # a plan applied on every stage, not everything replicated


@pytest.mark.parametrize("inner", [{"ep_size": 2}, {"ep_size": 2, "tp_size": 2}], ids=["pp2_ep2", "pp2_ep2_tp2"])
def test_mixtral_under_pp2_x_ep2_on_4_ranks(ranks4, inner):
    """Expert parallelism within each stage group: the experts of a stage's layers split over its 2 ranks."""
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b", **inner}
    for result in ranks4.run(pipeline.pipeline_parity, "mixtral", layout, None):
        _check(result)
        assert "ep" in result["expert_axes"], result["expert_axes"]


def test_nemotron_h_with_its_sidecar_under_pp2_x_fsdp2(ranks4):
    """The hybrid (Mamba-2, attention, MLP, MoE blocks) through its sidecar's parallelizer, per stage."""
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}
    for result in ranks4.run(pipeline.pipeline_parity, "nemotron_h", layout, None):
        _check(result)


def test_tied_embeddings_stay_equal_after_optimizer_steps(ranks2):
    """The first stage's embedding and the last stage's head (the same tied weight, a copy on each stage) get their
    gradients summed, take the same AdamW steps, and equal the plain model's after 3 steps."""
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}
    for load in ("first", "again"):
        result = ranks2.run(pipeline.tied_after_steps, layout)[0]
        assert result["copies"] == 2, (load, result)
        assert result["between_copies"] == 0.0, (load, result)
        assert result["from_plain"] <= 1e-5, (load, result)
    # The second load reuses the first one's groups (the tied-embedding group too): a process that loads models
    # one after another does not pile up groups, each with its connections and transport threads.
    assert result["groups_added"] == 0, result


def test_gradient_norm_spans_the_stages(ranks2):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "gpipe"}
    results = ranks2.run(pipeline.clipped_norm, layout)
    assert len({result["norm"] for result in results}) == 1, results
    assert abs(results[0]["norm"] - results[0]["plain"]) <= 1e-4 * results[0]["plain"], results


def test_from_config_under_pp_gives_the_weights_of_the_same_call_without_a_mesh(ranks2):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "1f1b"}
    for result in ranks2.run(pipeline.from_config_weights, layout):
        assert result["tensors"] and not result["differing"], result


@pytest.mark.parametrize(
    ("layout", "layers", "call", "expected"),
    [
        ({"strategy": "ddp", "pp_size": 2}, 4, "load", "pp_size=2 with strategy='ddp' is not supported"),
        ({"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 1}, 4, "load", "pp_microbatches=1 is fewer than"),
        ({"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "interleaved_1f1b"}, 4, "load", "pp_virtual_stages >= 2"),
        ({"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "zero"}, 4, "load", "pp_schedule='zero' is not a schedule"),
        ({"strategy": "fsdp2", "pp_size": 2, "pp_virtual_stages": 2}, 4, "load", "runs one stage per rank"),
        ({"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "zbv", "pp_virtual_stages": 3}, 6, "load", "exactly two stages per rank"),
        (
            {"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
            3,
            "load",
            "The model has 3 decoder layers and the pipeline 4 stages",
        ),
        ({"strategy": "fsdp2", "pp_size": 2}, 4, "forward", "use model.train_step(input_ids=..., labels=...)"),
        ({"strategy": "fsdp2", "pp_size": 2}, 4, "generate", "generate() is not available on a pipeline-parallel"),
        ({"strategy": "fsdp2", "pp_size": 2, "tp_size": 2}, 4, "tied_layouts", "(last stage) are laid out differently"),
        ({"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4}, 4, "batch", "A batch of 6 rows cannot be split"),
        (
            {"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2,
             "pp_microbatches": 5},
            4,
            "load",
            "needs their number to be a multiple of the number of rounds (5 // 2 = 2). Use a multiple of 2, or one of "
            "2, 3, 4, 6, 8.",
        ),
    ],
    ids=["ddp", "few_microbatches", "interleaved_without_virtual", "unknown", "virtual_without_interleaved", "zbv_three",
         "fewer_layers_than_stages", "plain_call", "generate", "tied_layouts_differ", "uneven_batch",
         "interleaved_rounds"],
)  # fmt: skip
def test_impossible_pipelines_are_refused_on_every_rank(ranks2, ranks4, layout, layers, call, expected):
    pool = ranks4 if layout.get("tp_size", 1) > 1 else ranks2
    messages = pool.run(pipeline.pipeline_error, layout, call, layers)
    assert len(set(messages)) == 1, messages
    assert expected in messages[0], messages[0]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_padding_masks_and_positions_reach_every_stage(ranks2, packed):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}
    for result in ranks2.run(pipeline.masked_batch_parity, layout, packed):
        assert max(result["loss"], result["grad"]) <= TOLERANCE, result


TRAINING_STEPS = {
    "left_padded_1f1b": ({"pp_schedule": "1f1b"}, None, True),
    # Zero-bubble schedules run a loss's backward twice (for the inputs, then for the weights).
    "fused_zbv": ({"pp_schedule": "zbv", "pp_virtual_stages": 2}, "fused", False),
    "fused_interleaved_zero_bubble": (
        {"pp_schedule": "interleaved_zero_bubble", "pp_virtual_stages": 2},
        "fused",
        True,
    ),
}


@pytest.mark.parametrize(("schedule", "loss", "left_padded"), TRAINING_STEPS.values(), ids=TRAINING_STEPS.keys())
def test_the_training_step_keeps_the_padding_and_runs_the_fused_loss_on_every_schedule(
    ranks2, schedule, loss, left_padded
):
    from automodel._compat.torch import ZERO_BUBBLE_RERUNS_CUSTOM_FUNCTIONS

    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, **schedule}
    zero_bubble = schedule["pp_schedule"] in ("zbv", "interleaved_zero_bubble")
    refused = loss == "fused" and zero_bubble and not ZERO_BUBBLE_RERUNS_CUSTOM_FUNCTIONS  # torch before 2.13
    for result in ranks2.run(pipeline.training_step_parity, layout, loss, left_padded):
        if refused:
            assert (
                "train.loss=fused: layout.pp_schedule=" in result["refused"] and "torch 2.13 can" in result["refused"]
            )
        else:
            assert max(result["loss"], result["grad"]) <= TOLERANCE, result


@pytest.mark.parametrize("inner", [{}, {"tp_size": 2}], ids=["pp2_fsdp2", "pp2_tp2"])
def test_lora_under_pp2_on_4_ranks(ranks4, inner):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b", **inner}
    for result in ranks4.run(pipeline.lora_parity, layout):
        assert max(result["loss"], result["grad"]) <= TOLERANCE, result
        assert result["adapters"] and not result["frozen_grads"], result


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_pretrained_writes_the_files_of_the_unpipelined_export(ranks2, tie):
    """Every stage's tensors reach rank 0 and are written in the same files, byte for byte, as the one-process
    export of the same weights; after a training and an optimizer step plain transformers loads the trained ones."""
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}
    result = ranks2.run(pipeline.export_matches, layout, tie)[0]
    assert result["pipelined"] == result["plain"] and "model.safetensors" in result["plain"], result
    assert not result["reloaded_differs"], result


def test_the_fused_loss_is_left_out_of_zero_bubble_schedules_on_a_torch_that_cannot_rerun_it(monkeypatch):
    """torch before 2.13 cannot run a custom autograd function's backward a second time (zero-bubble's weight pass):
    ``auto`` takes the model's loss there, saying why."""
    from types import SimpleNamespace

    from automodel.training import loss

    monkeypatch.setattr(loss, "ZERO_BUBBLE_RERUNS_CUSTOM_FUNCTIONS", False)
    chosen, line = loss.choose_loss("auto", 4096, SimpleNamespace(layout=SimpleNamespace(schedule="zbv")))
    assert isinstance(chosen, loss.ModelLoss) and "layout.pp_schedule=zbv runs the loss's backward twice" in line
    assert loss.fused_schedule_refusal(SimpleNamespace(layout=SimpleNamespace(schedule="1f1b"))) is None
