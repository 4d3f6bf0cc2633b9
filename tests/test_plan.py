"""``automodel.plan`` / ``automodel plan``: simulated ranks (torch's fake process group, the model on meta) report
exactly what a real gloo run holds and reads on every rank, refuse what the real run refuses with its message, and
scale to thousands of ranks in one process tree.

The real run is the loading pipeline of ``from_pretrained`` on CPU gloo ranks; each real rank's figures must equal
those of the simulated rank that stands for it (``stands_for``), byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from automodel.planning import plan
from tests.cases.plan import held_and_read, refusal
from tests.cases.sidecar_nemotron_h import save_checkpoint as save_nemotron_h
from tests.tiny_models import save_tiny_checkpoint
from tests.vlm_models import save_tiny_vlm

REPO = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "fsdp2": (4, {"strategy": "fsdp2"}),
    "hsdp_2x2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_tp2": (4, {"strategy": "fsdp2", "tp_size": 2}),
    "cp2": (2, {"strategy": "fsdp2", "cp_size": 2}),
    "ep2": (4, {"strategy": "fsdp2", "ep_size": 2}),
    "ep2_tp2": (4, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}),
    "pp2": (2, {"strategy": "fsdp2", "pp_size": 2}),
    "pp2_fsdp2": (4, {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 4}),
    "pp2_tp2": (4, {"strategy": "fsdp2", "pp_size": 2, "tp_size": 2}),
}
MODELS = ("llama_uneven", "qwen3_moe", "nemotron_h")
EP = {"ep2", "ep2_tp2"}
QUICK = {("llama_uneven", "fsdp2_tp2"), ("qwen3_moe", "ep2"), ("nemotron_h", "fsdp2"), ("llama_uneven", "pp2_fsdp2")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    extra = ("three_heads", "three_experts", "qwen3_vl", "llama_4_layers")
    folders = {name: tmp_path_factory.mktemp(name) for name in (*MODELS, *extra)}
    save_tiny_checkpoint("llama_uneven", folders["llama_uneven"])
    save_tiny_checkpoint("qwen3_moe", folders["qwen3_moe"])
    save_nemotron_h(str(folders["nemotron_h"]))
    save_tiny_checkpoint("llama", folders["three_heads"], num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    save_tiny_checkpoint("qwen3_moe", folders["three_experts"], num_experts=3)
    save_tiny_vlm("qwen3_vl", folders["qwen3_vl"])
    save_tiny_checkpoint("llama", folders["llama_4_layers"], num_hidden_layers=4)
    return {name: str(folder) for name, folder in folders.items()}


def _matrix():
    for model in MODELS:
        for name, (world, layout) in LAYOUTS.items():
            if (name in EP and model == "llama_uneven") or (model, name) == ("nemotron_h", "cp2"):
                continue  # no experts; Nemotron-H refuses CP (a refusal case below)
            marks = [pytest.mark.distributed] + ([] if (model, name) in QUICK else [pytest.mark.slow])
            yield pytest.param(model, world, layout, id=f"{model}-{name}", marks=marks)


@pytest.mark.parametrize(("model", "world", "layout"), _matrix())
def test_every_rank_holds_and_reads_what_its_plan_says(request, checkpoints, model, world, layout):
    real = request.getfixturevalue(f"ranks{world}").run(held_and_read, checkpoints[model], layout)
    planned = plan(checkpoints[model], world_size=world, layout=layout, dtype="fp32")
    assert planned.ok, planned.error
    covered = sorted(rank for result in planned.ranks for rank in result.stands_for)
    assert sorted(set(covered)) == list(range(world)), planned.ranks
    for rank, figures in enumerate(real):
        result = next(result for result in planned.ranks if rank in result.stands_for)
        assert result.param_bytes == figures["param_bytes"], (rank, result, figures)
        assert result.checkpoint_read_bytes == figures["read_bytes"], (rank, result, figures)
    assert planned.total_param_bytes >= max(result.param_bytes for result in planned.ranks)


REFUSALS = {
    "heads": ("three_heads", 2, {"strategy": "fsdp2", "tp_size": 2}),
    "kv_heads": ("llama_uneven", 4, {"strategy": "fsdp2", "tp_size": 4}),
    "experts": ("three_experts", 2, {"strategy": "fsdp2", "ep_size": 2}),
    "sidecar": ("nemotron_h", 2, {"strategy": "fsdp2", "cp_size": 2}),
    "cp_on_a_vlm": ("qwen3_vl", 2, {"strategy": "fsdp2", "cp_size": 2}),
    "world_size": ("llama_uneven", 4, {"strategy": "fsdp2", "tp_size": 3}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_layout_the_real_run_refuses_is_refused_with_its_message(request, checkpoints, case):
    model, world, layout = REFUSALS[case]
    messages = request.getfixturevalue(f"ranks{world}").run(refusal, checkpoints[model], layout)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    planned = plan(checkpoints[model], world_size=world, layout=layout, dtype="fp32")
    assert not planned.ok and planned.error == messages[0], (planned.error, messages[0])
    assert planned.ranks == []


def test_the_representative_ranks_stand_for_every_rank_once(checkpoints):
    """Without ``ranks``: rank 0, the last rank, and one rank per class of equal local shapes (97 rows over 4: three
    full chunks and a short one)."""
    planned = plan(checkpoints["llama_uneven"], world_size=4, layout={"strategy": "fsdp2"}, dtype="fp32")
    assert [(result.rank, result.stands_for) for result in planned.ranks] == [(0, [0, 1, 2]), (3, [3])]
    assert planned.ranks[0].param_bytes > planned.ranks[1].param_bytes
    assert planned.ranks[0].padded_param_bytes == planned.ranks[1].padded_param_bytes  # FSDP2 pads the short one
    assert any("FSDP2 units" in line for line in planned.log), planned.log

    many = plan(checkpoints["llama_uneven"], world_size=40, layout={"strategy": "ddp"}, dtype="fp32")
    assert all(result.stands_for == list(range(40)) for result in many.ranks), "a list past 16"
    crowds = [result.stands_for for result in many.ranks if len(result.stands_for) > 16]
    assert crowds and all(f"{len(ranks)} ranks: {ranks[0]}-" in many.table() for ranks in crowds), many.table()


def test_estimates_follow_the_batch_and_the_checkpointing(checkpoints):
    model = checkpoints["llama_uneven"]
    layout = {"strategy": "fsdp2"}
    small = plan(model, world_size=2, layout=layout, micro_batch_size=1, seq_len=64, ranks=[0]).ranks[0]
    large = plan(model, world_size=2, layout=layout, micro_batch_size=2, seq_len=64, ranks=[0]).ranks[0]
    full = plan(
        model,
        world_size=2,
        layout={**layout, "activation_checkpointing": "full"},
        micro_batch_size=2,
        seq_len=64,
        ranks=[0],
    ).ranks[0]
    assert large.activation_bytes_estimate == 2 * small.activation_bytes_estimate
    assert full.activation_bytes_estimate < large.activation_bytes_estimate
    assert small.optimizer_bytes == 2 * small.param_bytes  # two states per element, in the weights' bf16
    assert small.peak_bytes_estimate > small.param_bytes + small.activation_bytes_estimate


def _automodel(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "automodel.training.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_command_prints_json_with_the_documented_keys(checkpoints):
    done = _automodel(
        "plan",
        "--model",
        checkpoints["qwen3_moe"],
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "layout.ep_size=2",
        "--micro-batch-size",
        "1",
        "--seq-len",
        "32",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert {"world_size", "ok", "error", "total_param_bytes", "ranks", "log"} <= set(result)
    assert result["world_size"] == 4 and result["ok"] and result["error"] is None
    keys = {
        "rank",
        "stands_for",
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "checkpoint_read_bytes",
        "largest_gather_bytes",
        "activation_bytes_estimate",
        "peak_bytes_estimate",
    }
    assert all(keys <= set(rank) for rank in result["ranks"]), result["ranks"]


def test_the_command_exits_1_with_the_refusal_and_2_on_bad_keys(checkpoints):
    refused = _automodel("plan", "--model", checkpoints["llama_uneven"], "--world-size", "4", "layout.tp_size=3")
    assert refused.returncode == 1 and "does not divide the world size 4" in refused.stdout, refused
    bad = _automodel("plan", "--model", checkpoints["llama_uneven"], "--world-size", "4", "train.lr=1")
    assert bad.returncode == 2 and "only layout.KEY=VALUE" in bad.stderr, bad


def test_a_recipe_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    done = _automodel(
        "sft",
        "--config",
        str(REPO / "recipes" / "sft_tiny.yaml"),
        "--nproc-per-node",
        "2",
        "--dry-run",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    assert done.returncode == 0, done.stderr
    assert "plan: 2 ranks" in done.stdout and "stands for" in done.stdout, done.stdout
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("schedule", "virtual", "in_flight", "bubble"),
    [("1f1b", 1, [2.0, 1.0], 1 / 5), ("gpipe", 1, [4.0, 4.0], 1 / 5), ("interleaved_1f1b", 2, [2.5, 1.5], 1 / 9)],
)
def test_a_pipeline_plan_reports_stages_layers_in_flight_microbatches_and_the_bubble(
    checkpoints, schedule, virtual, in_flight, bubble
):
    layout = {"strategy": "fsdp2", "pp_size": 2, "pp_schedule": schedule, "pp_virtual_stages": virtual}
    planned = plan(
        checkpoints["llama_4_layers"],
        world_size=4,
        layout={**layout, "pp_microbatches": 4},
        dtype="fp32",
        micro_batch_size=1,
        seq_len=16,
    )
    assert planned.ok, planned.error
    stages = 2 * virtual
    assert planned.pipeline["stages"] == stages and planned.pipeline["bubble"] == pytest.approx(bubble)
    assert sum(planned.pipeline["layers_per_stage"]) == 4
    by_pipeline_rank = {result.rank // 2: result for result in planned.ranks}
    assert sorted(by_pipeline_rank) == [0, 1]
    assert [by_pipeline_rank[p].in_flight_microbatches for p in (0, 1)] == in_flight
    assert by_pipeline_rank[1].pipeline_stages == list(range(1, stages, 2))
    # The first stage's rank holds more microbatches in flight, over its layers; the last one the logits.
    assert all(result.activation_bytes_estimate > 0 for result in planned.ranks)
    table = planned.table()
    assert f"pipeline: {schedule}, {stages} stages over 2 pipeline ranks, 4 microbatches" in table, table
    assert f"ideal bubble {bubble:.1%}" in table and "in flight)" in table, table


def test_a_pipeline_layout_the_run_refuses_is_refused_by_the_plan_with_its_message(checkpoints):
    planned = plan(
        checkpoints["llama_uneven"],
        world_size=4,
        layout={"strategy": "fsdp2", "pp_size": 4, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"},
    )
    assert not planned.ok and "pipeline stages" in planned.error, planned.error


def test_an_uncached_hub_id_offline_is_refused_in_one_line_with_the_fix(tmp_path):
    """The README's own `automodel plan --model meta-llama/Llama-3.1-70B ...` without the model in the cache and
    without the hub: exit 2, one line naming the model and `hf download` (not a fork server's nested traceback)."""
    command = [sys.executable, "-m", "automodel.training.cli", "plan", "--model", "meta-llama/Llama-3.1-70B"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [*command, "--nnodes", "128", "--nproc-per-node", "8", "layout.tp_size=8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) <= 10 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("automodel plan: --model meta-llama/Llama-3.1-70B: Model 'meta-llama/Llama-3.1-70B'")
    assert "`hf download meta-llama/Llama-3.1-70B`" in lines[0], lines[0]


def test_a_simulated_rank_that_fails_says_so_once(tmp_path, checkpoints):
    """A config the model cannot be built from (a negative MLP width): the child's error comes back as one line with
    its type, message and the project's frame that raised it; exit 2."""
    config = json.loads((Path(checkpoints["llama_uneven"]) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": -1}))
    done = _automodel("plan", "--model", str(tmp_path), "--world-size", "8")
    assert done.returncode == 2 and done.stdout == "", done
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("automodel plan: simulating rank 0 of 8 failed: RuntimeError: Trying to create tensor"), line
    assert "(at automodel/" in line and "Traceback" not in line, line


def test_the_table_names_each_class_once_and_says_what_the_activations_are_for(checkpoints):
    """Rank 0 and the last rank in one class: the last row says `as rank 0`. The command estimates activations for
    the recipes' default batch and says so; a plan without a batch says that the peak leaves them out."""
    replicated = ("--world-size", "2", "layout.dp_replicate_size=2")  # every rank holds the same
    done = _automodel("plan", "--model", checkpoints["llama_4_layers"], *replicated)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()[-2:]
    assert rows[0].split()[0] == "0" and rows[0].endswith(" 0-1") and rows[1].endswith(" as rank 0"), rows
    assert "activations: estimated for micro batches of 1 x 512 tokens" in done.stdout, done.stdout
    assert all(row.split()[13] != "-" for row in rows), rows  # the activations column (a value and a unit per column)
    quiet = plan(checkpoints["llama_4_layers"], world_size=2, layout={"dp_replicate_size": 2}).table()
    assert "activations: not estimated (no micro batch size and sequence length given)" in quiet, quiet
    assert "compile=auto" not in quiet.splitlines()[0], "defaults are not the layout's choices"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--world-size", "8", "--micro-batch-size", "-1"], "argument --micro-batch-size: must be at least 1, got -1"),
        (["--world-size", "8", "--seq-len", "0"], "argument --seq-len: must be at least 1, got 0"),
        (["--world-size", "0"], "--world-size must be at least 1, got 0"),
        (["--world-size", "8", "--nnodes", "2", "--nproc-per-node", "8"], "--world-size 8 is not --nnodes 2 x"),
        (["--world-size", "8", "--rank", "9"], "--rank 9: the ranks of a 8-rank job are 0 to 7"),
    ],
)
def test_the_commands_usage_mistakes_exit_2_naming_the_option(checkpoints, capsys, arguments, message):
    from automodel.training import plan_command

    with pytest.raises(SystemExit) as status:
        plan_command.main(["--model", str(checkpoints["llama_uneven"]), *arguments])
    assert status.value.code == 2 and message in capsys.readouterr().err


def test_suggest_searches_the_micro_batch_at_its_own_sequence_length_unless_given(checkpoints, monkeypatch):
    """``--suggest`` without ``--seq-len`` plans for the search's 8,192 tokens (the plan's own default, 512, is the
    recipes' train.seq_len), and without ``--micro-batch-size`` searches the micro batch instead of pinning 1."""
    import automodel.suggestion
    from automodel.training import plan_command

    calls = []
    monkeypatch.setattr(automodel.suggestion, "suggest", lambda *args, **kwargs: calls.append(kwargs) or _NoTable())
    model = str(checkpoints["llama_uneven"])
    plan_command.main(["--model", model, "--world-size", "4", "--suggest"])
    plan_command.main(
        ["--model", model, "--world-size", "4", "--suggest", "--seq-len", "64", "--micro-batch-size", "2"]
    )
    assert "seq_len" not in calls[0] and "micro_batch_size" not in calls[0]["pins"], calls[0]
    assert calls[1]["seq_len"] == 64 and calls[1]["pins"]["micro_batch_size"] == 2, calls[1]


class _NoTable:
    ok = True

    def table(self) -> str:
        return ""


def test_the_api_names_a_layout_key_that_is_no_keyword_of_meshcontext_build(checkpoints):
    with pytest.raises(TypeError, match=r"'tp_sz' \(did you mean 'tp_size'"):
        plan(str(checkpoints["llama_uneven"]), world_size=4, layout={"tp_sz": 2})
