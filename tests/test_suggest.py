"""``automodel plan --suggest`` (``automodel.suggestion``): the fastest layouts that fit.

- memory is exact where it can be checked: every suggested layout of the tiny Llama and Qwen3-MoE on 4 gloo ranks
  holds, on every rank, the parameter bytes a real load holds; the activation estimate is within 25% of the
  measured growth of a training step under FSDP2, TP=2 and PP=2;
- never a layout that does not fit or cannot run: at Llama-3-8B on 8, Llama-3-70B on 64 and Qwen3-235B-A22B on 256
  ranks of 80 GiB every suggestion is accepted by ``automodel.plan`` and its peak is within the GPU; where nothing
  fits (70B on 8 x 24 GiB) the answer says so, with the smallest world size that fits;
- sensible at the points peers publish (docs/plan.md compares them);
- a layout the size rules drop costs no plan; the command prints JSON, the recipes refuse a layout that does not fit.

The large models are config-only folders: the plan builds them on the meta device, nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from automodel.planning import plan
from automodel.suggestion import suggest
from automodel.suggestion.memory import MemoryModel
from automodel.suggestion.search import load_facts, training_setup
from tests.cases.plan import held_and_read
from tests.cases.suggest import step_growth
from tests.tiny_models import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

#: Config-only shapes of the published models (their config.json values).
SHAPES = {
    "llama3_8b": (
        "LlamaConfig",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256),
    ),
    "llama3_70b": (
        "LlamaConfig",
        dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
             num_key_value_heads=8, vocab_size=128256),
    ),
    "qwen3_235b": (
        "Qwen3MoeConfig",
        dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
             moe_intermediate_size=1536, intermediate_size=12288, num_experts=128, num_experts_per_tok=8,
             vocab_size=151936),
    ),
}  # fmt: skip
#: (model, world size): the known points, each searched once per session.
POINTS = {"8b@8": ("llama3_8b", 8), "70b@64": ("llama3_70b", 64), "qwen3_235b@256": ("qwen3_235b", 256)}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    folders = {}
    for name, (class_name, values) in SHAPES.items():
        folder = tmp_path_factory.mktemp(name)
        getattr(transformers, class_name)(**values, architectures=None, dtype="bfloat16").save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def searched(configs):
    """The search at a known point, on 80 GiB GPUs, nodes of 8 (once per point)."""

    @functools.cache
    def run(point: str):
        model, world = POINTS[point]
        return suggest(configs[model], world_size=world, gpu_memory=80 * GIB, nproc_per_node=8)

    return run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    folders = {name: tmp_path_factory.mktemp(name) for name in ("llama_uneven", "qwen3_moe")}
    for name, folder in folders.items():
        save_tiny_checkpoint(name, folder)
    return {name: str(folder) for name, folder in folders.items()}


# ----------------------------------------------------------------------------------------------------------------
# Memory is exact where it can be checked.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["llama_uneven", "qwen3_moe"])
def test_every_suggested_layout_holds_what_a_real_run_holds_on_every_rank(ranks4, tiny, model):
    found = suggest(tiny[model], world_size=4, gpu_memory=GIB, nproc_per_node=4, seq_len=32, dtype="fp32", top=5)
    assert found.ok and len(found.suggestions) >= 3, found.table()
    for suggestion in found.suggestions:
        layout = {"strategy": "fsdp2", **suggestion.candidate.layout()}
        real = ranks4.run(held_and_read, tiny[model], layout)
        planned = plan(tiny[model], world_size=4, layout=layout, dtype="fp32")
        assert planned.ok, (layout, planned.error)
        for rank, figures in enumerate(real):
            result = next(result for result in planned.ranks if rank in result.stands_for)
            assert result.param_bytes == figures["param_bytes"], (layout, rank, result, figures)
        worst = next(result for result in planned.ranks if suggestion.memory.rank in result.stands_for)
        assert suggestion.memory.params == worst.padded_param_bytes, (layout, suggestion.memory, worst)
        assert suggestion.memory.exact and suggestion.memory.grads == worst.grad_bytes


#: A Llama whose activations dwarf its parameters, so that a step's growth is mostly what it keeps for backward.
ACTIVATION_MODEL = dict(
    model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip
MEASURED_LAYOUTS = {
    "fsdp2": (4, {"strategy": "fsdp2"}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "pp2": (2, {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 2}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MEASURED_LAYOUTS))
def test_the_activation_estimate_is_within_a_quarter_of_a_measured_step(request, tmp_path, name):
    world, layout = MEASURED_LAYOUTS[name]
    values = dict(ACTIVATION_MODEL)
    transformers.AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path)
    batch, seq_len = 4, 512
    growth = request.getfixturevalue(f"ranks{world}").run(step_growth, ACTIVATION_MODEL, layout, batch, seq_len)
    planned = plan(tmp_path, world_size=world, layout=layout, dtype="fp32", micro_batch_size=batch, seq_len=seq_len)
    for rank, measured in enumerate(growth):
        estimate = next(r for r in planned.ranks if rank in r.stands_for).activation_bytes_estimate
        assert abs(estimate - measured) <= 0.25 * measured, (name, rank, estimate, measured)


def test_the_memory_bound_never_exceeds_the_exact_figure(searched, configs):
    found = searched("70b@64")
    facts = load_facts(configs["llama3_70b"], False, "bf16")
    memory = MemoryModel(facts, training_setup({}), found.job.seq_len)
    for suggestion in found.suggestions:
        bound = memory.bound(suggestion.candidate)
        assert bound.peak <= suggestion.memory.peak, (suggestion.candidate.describe(), bound, suggestion.memory)
        assert bound.activations == suggestion.memory.activations and bound.held == suggestion.memory.held


# ----------------------------------------------------------------------------------------------------------------
# Never a layout that does not fit or cannot run; sensible at known points.
# ----------------------------------------------------------------------------------------------------------------


def _point(point: str):
    marks = [pytest.mark.slow] if point == "qwen3_235b@256" else []
    return pytest.param(point, marks=marks, id=point)


@pytest.mark.parametrize("point", [_point(point) for point in POINTS])
def test_every_suggestion_is_accepted_by_the_plan_and_fits(searched, configs, point):
    found = searched(point)
    model, world = POINTS[point]
    assert found.ok and len(found.suggestions) == 5, found.table()
    for suggestion in found.suggestions:
        candidate = suggestion.candidate
        assert suggestion.peak_bytes <= found.usable_bytes < 80 * GIB, suggestion.to_dict()
        planned = plan(
            configs[model],
            world_size=world,
            layout=candidate.layout(),
            ranks=[0],
            micro_batch_size=candidate.micro_batch_size,
            seq_len=found.job.seq_len,
        )
        assert planned.ok, (candidate.describe(), planned.error)
        # The plan's own peak of rank 0 is within the suggestion's (which adds what a step holds unsharded and
        # takes the worst pipeline rank).
        assert planned.ranks[0].peak_bytes_estimate <= suggestion.peak_bytes, (candidate.describe(), planned.ranks)
    times = [suggestion.step_seconds for suggestion in found.suggestions]
    assert times == sorted(times)


@pytest.mark.parametrize(
    ("point", "sensible"),
    [
        # torchtitan's Llama 3 8B config: FSDP over the 8 GPUs, nothing else.
        ("8b@8", lambda c: (c.tp_size, c.pp_size, c.cp_size, c.ep_size, c.dp_replicate_size) == (1, 1, 1, 1, 1)),
        # torchtitan's Llama 3 70B config: TP 8 within the node, FSDP across.
        ("70b@64", lambda c: 1 < c.tp_size <= 8),
        # Megatron-Bridge's Qwen3-235B-A22B presets: EP 8 to 32, experts never tensor-parallel.
        pytest.param("qwen3_235b@256", lambda c: c.ep_size >= 8, marks=pytest.mark.slow),
    ],
    ids=["8b@8", "70b@64", "qwen3_235b@256"],
)
def test_the_first_suggestion_is_what_peers_run_at_known_points(searched, point, sensible):
    first = searched(point).suggestions[0].candidate
    assert sensible(first), first.describe()


def test_when_nothing_fits_it_says_so_and_names_the_smallest_world_size(configs):
    found = suggest(configs["llama3_70b"], world_size=8, gpu_memory=24 * GIB, nproc_per_node=8)
    assert not found.ok and found.suggestions == []
    assert "no layout of LlamaForCausalLM fits 8 ranks of 24.00 GiB" in found.error, found.error
    smallest = found.smallest_world_size
    # Parameters, gradients and AdamW states alone (12 bytes per parameter) need this many 24 GiB GPUs.
    floor = found.facts.total * 12 / found.usable_bytes
    assert smallest is not None and smallest > floor and smallest % 8 == 0, (smallest, floor)
    assert f"smallest world size where one fits is {smallest} ranks" in found.error
    assert suggest(configs["llama3_70b"], world_size=smallest, gpu_memory=24 * GIB, nproc_per_node=8, top=1).ok


def test_a_layout_the_size_rules_drop_costs_no_plan(configs):
    found = suggest(configs["llama3_70b"], world_size=64, gpu_memory=80 * GIB, pins={"tp_size": 3})
    assert not found.ok and found.counts.get("planned", 0) == 0, found.counts
    assert found.counts.get("layouts", 0) == 0
    assert any("tp_size=3" in reason for reason in found.rejections), found.rejections
    assert "passes the size rules" in found.error and "tp_size=3" in found.error, found.error


def test_pinned_keys_are_kept(configs):
    found = suggest(configs["llama3_8b"], world_size=8, gpu_memory=80 * GIB, pins={"tp_size": 2}, top=2)
    assert found.ok and all(s.candidate.tp_size == 2 for s in found.suggestions), found.table()


# ----------------------------------------------------------------------------------------------------------------
# The commands.
# ----------------------------------------------------------------------------------------------------------------


def _automodel(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "automodel.training.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_the_command_prints_one_json_object_and_exits_1_when_nothing_fits(tiny):
    done = _automodel(
        "plan", "--model", tiny["llama_uneven"], "--world-size", "4", "--nproc-per-node", "4", "--suggest",
        "--gpu-memory", "1GiB", "--seq-len", "32", "--top", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] and result["error"] is None and len(result["suggestions"]) == 2
    first = result["suggestions"][0]
    assert {"layout", "micro_batch_size", "peak_bytes", "step_seconds", "recipe_overrides", "why"} <= set(first)
    assert {"tp_size", "pp_size", "cp_size", "ep_size", "dp_replicate_size"} <= set(first["layout"])
    assert first["peak_bytes"] + first["margin_bytes"] == result["usable_bytes"]
    full = _automodel(
        "plan", "--model", tiny["llama_uneven"], "--world-size", "4", "--suggest", "--gpu-memory", "1KiB", "--json"
    )
    assert full.returncode == 1, full.stderr
    assert json.loads(full.stdout)["ok"] is False and "no layout" in json.loads(full.stdout)["error"]


@pytest.fixture
def launch(tmp_path, recorded_torchrun, capsys, tiny):
    """``automodel sft`` in this process on the tiny Llama, torchrun replaced by a recorder: (status, stdout, stderr,
    whether torchrun was started)."""
    from automodel.training import cli
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint

    model = save_tiny_chat_checkpoint(tmp_path / "model")

    def run(*options: str):
        config = tmp_path / "sft.yaml"
        config.write_text(f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: {CHAT_DATA}}}\n")
        recorded_torchrun.clear()
        status = cli.main(["sft", "--config", str(config), "--nproc-per-node", "2", *options])
        captured = capsys.readouterr()
        return status, captured.out, captured.err, bool(recorded_torchrun)

    return run


def test_a_recipe_suggests_its_layouts_and_refuses_one_that_does_not_fit(launch):
    status, out, err, started = launch("--suggest-layout", "--gpu-memory", "1GiB")
    assert (status, started) == (0, False), err
    assert "suggest: LlamaForCausalLM" in out and "train.micro_batch_size=" in out, out
    status, out, err, started = launch("--gpu-memory", "1MiB")
    assert (status, started) == (2, False), err
    assert "over the" in err and "usable of a 1.0 MiB GPU" in err, err
    assert "The fastest layout that fits" in err or "No layout fits" in err, err
    status, out, err, started = launch("--gpu-memory", "1GiB")
    assert (status, started) == (0, True), err


def test_memory_sizes_need_a_unit_unless_they_are_plainly_bytes():
    from automodel.suggestion import parse_bytes

    assert (
        parse_bytes("80GiB") == 80 * GIB and parse_bytes("141GB") == 141 * 10**9 and parse_bytes("24 gib") == 24 * GIB
    )
    assert parse_bytes(str(80 * GIB)) == 80 * GIB
    with pytest.raises(ValueError, match="'80' has no unit and would be 80 bytes: write e.g. 80GiB or 80GB"):
        parse_bytes("80")
    with pytest.raises(ValueError, match="is not a memory size"):
        parse_bytes("80 gigs")


def test_the_nodes_a_world_size_takes_are_counted_whole():
    from automodel.suggestion.report import describe_nodes

    assert describe_nodes(64, 8) == "8 nodes of 8" and describe_nodes(8, 8) == "1 node of 8"
    assert describe_nodes(13, 8) == "2 nodes of 8, the last with 5"
