"""Record which protected hooks of a sidecar's parallelizer run, and on which mesh, without changing what they do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from automodel.distributed import ModelParallelizer


@contextlib.contextmanager
def recording_hooks(parallelizer: ModelParallelizer, *hooks: str) -> Iterator[list[str]]:
    """Shadow each of ``hooks`` (which the parallelizer's class must override) on the instance with a wrapper that
    appends ``"<hook>"`` (``"<hook>@<mesh axes>"`` when it gets a ``mesh``) to the yielded list; undone on exit."""
    calls: list[str] = []
    for hook in hooks:
        method = getattr(type(parallelizer), hook)
        assert method is not getattr(ModelParallelizer, hook), f"{type(parallelizer).__name__} does not override {hook}"

        def recorder(*args: Any, _hook: str = hook, _method: Any = method, **kwargs: Any) -> Any:
            mesh = kwargs.get("mesh")
            calls.append(f"{_hook}@{','.join(mesh.mesh_dim_names)}" if mesh is not None else _hook)
            return _method(parallelizer, *args, **kwargs)

        setattr(parallelizer, hook, recorder)
    try:
        yield calls
    finally:
        for hook in hooks:
            delattr(parallelizer, hook)
