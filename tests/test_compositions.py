"""The composition sweep: every pair of 2-way mesh axes on 4 CPU ranks (FSDP2, HSDP, TP, CP, EP, PP), alone and with
each modifier that applies (sequence parallelism, activation checkpointing, LoRA, gradient accumulation, compiled
blocks), over a dense untied, a dense tied, a sliding-window, an MoE and a hybrid (Nemotron-H) tiny model; and every
triple of the 2-way axes on 8 ranks (the modifiers on HSDP x TP x PP).

Each cell has one answer: parity with plain transformers (the loss of two training steps and every trainable
gradient within ``TOLERANCE``, fp32) or a refusal raised while the context is built or the model loaded, with the same
message on every rank. A crash, a hang (``CELL_TIMEOUT_S``) or a silent difference fails the sweep; every cell runs
before it fails, and the failures are listed together.

The cells' answers are the support matrix users read, kept in ``docs/parallelisms.md`` between the markers below:
the test fails when the page differs from what it found, and ``AUTOMODEL_UPDATE_SUPPORT_MATRIX=1`` rewrites it.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import pytest

from tests.cases import compositions
from tests.conftest import REPO
from tests.harness import RankFailure, RankPool

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOLERANCE = 1e-5
CELL_TIMEOUT_S = 120.0
COMPILE_TIMEOUT_S = 600.0
PAGE = REPO / "docs" / "parallelisms.md"
BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
NAMES = {"fsdp2": "FSDP2", "hsdp": "HSDP", "tp": "TP", "cp": "CP", "ep": "EP", "pp": "PP"}
MODIFIERS = {
    "base": "-",
    "sp": "SP",
    "ac": "AC",
    "lora": "LoRA",
    "accum": "grad. accumulation",
    "compile": "compile",
}
#: Compiled blocks (inductor generates C++ on the CPU: tens of seconds per layout) for the dense model only.
COMPILE_MODELS = ("dense",)


def cells() -> list[tuple[tuple[str, str], str, str]]:
    """(axes, modifier, model) of every cell, in the table's order."""
    found = []
    for axes in itertools.combinations(compositions.AXES, 2):
        for modifier in MODIFIERS:
            if modifier == "sp" and "tp" not in axes:
                continue
            models = COMPILE_MODELS if modifier == "compile" else compositions.MODELS
            found += [(axes, modifier, model) for model in models]
    return found


def _answer(results: list[dict[str, Any]]) -> tuple[str, str | None]:
    """("parity" | "refused: <message>" | "FAILED: <why>", a detail for a failure)."""
    refusals = {result.get("refused") for result in results}
    if refusals != {None}:
        if None in refusals or len(refusals) > 1:
            return "FAILED", f"not the same refusal on every rank: {sorted(map(str, refusals))}"
        return f"refused: {refusals.pop()}", None
    loss = max(result["loss"] for result in results)
    worst = max(results, key=lambda result: result["grad"])
    missing = sorted({name for result in results for name in result["no_grad"]})
    if loss > TOLERANCE or worst["grad"] > TOLERANCE or missing:
        return (
            "FAILED",
            f"loss {loss:.2e}, gradient {worst['grad']:.2e} ({worst['worst_grad']}), no gradient: {missing}",
        )
    eager = sorted({reason for result in results for reason in result["eager_blocks"]})
    return ("parity, blocks eager: " + "; ".join(eager)) if eager else "parity", None


def _table(answers: dict[tuple[tuple[str, str], str, str], str]) -> str:
    """The markdown support matrix: one row per pair and modifier, one column per model; refusals as numbered
    notes below it."""
    models = list(compositions.MODELS)
    notes: dict[str, int] = {}
    lines = [
        "| Axes (2 x 2 ranks) | Modifier | " + " | ".join(models) + " |",
        "| --- | --- | " + " | ".join("---" for _ in models) + " |",
    ]
    rows: dict[tuple[tuple[str, str], str], dict[str, str]] = {}
    for (axes, modifier, model), answer in answers.items():
        rows.setdefault((axes, modifier), {})[model] = answer
    for (axes, modifier), by_model in rows.items():
        shown = []
        for model in models:
            answer = by_model.get(model)
            if answer is None:
                shown.append("")
            elif answer.startswith("refused: "):
                note = notes.setdefault(answer.removeprefix("refused: "), len(notes) + 1)
                shown.append(f"refused [{note}]")
            else:
                shown.append(answer)
        pair = " x ".join(NAMES[axis] for axis in axes)
        lines.append(f"| {pair} | {MODIFIERS[modifier]} | " + " | ".join(shown) + " |")
    lines.append("")
    lines += [f"{number}. {message}" for message, number in notes.items()]
    return "\n".join(lines)


def _check_page(table: str) -> None:
    text = PAGE.read_text()
    before, rest = text.split(BEGIN, 1)
    current, after = rest.split(END, 1)
    if os.environ.get("AUTOMODEL_UPDATE_SUPPORT_MATRIX"):
        PAGE.write_text(f"{before}{BEGIN}\n{table}\n{END}{after}")
        return
    assert current.strip() == table.strip(), (
        f"{PAGE} does not hold the support matrix this sweep found; rerun with AUTOMODEL_UPDATE_SUPPORT_MATRIX=1 to "
        f"rewrite it. Found:\n{table}"
    )


def _sweep(pool: RankPool, cells: list[tuple[tuple[str, ...], str, str]]) -> dict[tuple, str]:
    """Each cell's answer on ``pool``; fails, after every cell ran, listing the crashes, hangs and differences."""
    started = time.monotonic()
    answers: dict[tuple, str] = {}
    failures: list[str] = []
    for axes, modifier, model in cells:
        timeout = COMPILE_TIMEOUT_S if modifier == "compile" else CELL_TIMEOUT_S
        cell_started = time.monotonic()
        try:
            results = pool.run(compositions.composition_cell, model, axes, modifier, timeout=timeout)
            answer, detail = _answer(results)
        except RankFailure as error:  # a crash or a hang: the pool starts again for the next cell
            answer, detail = "FAILED", error.brief()
        answers[(axes, modifier, model)] = answer
        name = f"{' x '.join(axes)} / {modifier} / {model}"
        print(f"{name}: {answer.partition(':')[0]} ({time.monotonic() - cell_started:.1f} s)")
        if detail is not None:
            failures.append(f"{name}: {detail}")
    refused = sum(answer.startswith("refused") for answer in answers.values())
    print(
        f"composition sweep on {pool.world_size} ranks: {len(answers)} cells, "
        f"{len(answers) - refused - len(failures)} parity, {refused} refused, {len(failures)} failed, "
        f"in {time.monotonic() - started:.0f} s"
    )
    assert not failures, "\n\n".join(failures)
    return answers


def test_every_composition_is_parity_or_a_refusal_on_every_rank(ranks4):
    _check_page(_table(_sweep(ranks4, cells())))


#: Three 2-way axes on 8 ranks: every triple of HSDP, TP, CP, EP and PP (FSDP2 takes the 1 or 2 ranks left), over the
#: five models; the modifiers on HSDP x TP x PP, where a pipeline stage runs TP inside an HSDP replica.
THREE_WAY_MODIFIED = ("hsdp", "tp", "pp")


def three_way_cells() -> list[tuple[tuple[str, ...], str, str]]:
    axes = [axis for axis in compositions.AXES if axis != "fsdp2"]
    found = [(triple, "base", model) for triple in itertools.combinations(axes, 3) for model in compositions.MODELS]
    modifiers = [modifier for modifier in MODIFIERS if modifier not in ("base", "compile")]
    return found + [(THREE_WAY_MODIFIED, modifier, model) for modifier in modifiers for model in compositions.MODELS]


@pytest.fixture(scope="module")
def ranks8():
    pool = RankPool(8)
    yield pool
    pool.close()


def test_every_three_way_composition_on_8_ranks_is_parity_or_a_refusal(ranks8):
    answers = _sweep(ranks8, three_way_cells())
    # Every axis of a triple is in some parity cell: the sweep is not only refusals.
    assert {axis for (axes, _, _), answer in answers.items() if answer.startswith("parity") for axis in axes} == {
        "hsdp",
        "tp",
        "cp",
        "ep",
        "pp",
    }
