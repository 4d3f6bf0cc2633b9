"""The layout search behind ``automodel plan --suggest``: the fastest layouts that fit, from exact per-rank memory
(the real planner) and a stated cost model (``docs/plan.md``).

- :mod:`.model_facts`: the model's sizes, read once off the meta model;
- :mod:`.candidates`: the layouts and the pure size rules;
- :mod:`.memory`: the memory bound that prunes and the exact per-rank figures;
- :mod:`.cost_model`: the step time that ranks;
- :mod:`.search`: the three passes; :mod:`.report`: the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hardware import GPUS, Hardware, parse_bytes
    from .report import Suggestion, Suggestions
    from .search import suggest

__all__ = ["GPUS", "Hardware", "Suggestion", "Suggestions", "parse_bytes", "suggest"]

_HOMES = {
    "GPUS": "hardware",
    "Hardware": "hardware",
    "parse_bytes": "hardware",
    "Suggestion": "report",
    "Suggestions": "report",
    "suggest": "search",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
