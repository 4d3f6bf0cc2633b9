"""Rebuilding a failing rank's exception on the other ranks: the same class, the combined message."""

from __future__ import annotations

import json

from automodel.loading.agreement import rebuild_exception
from automodel.loading.checkpoint_files import MissingCheckpointFileError


def test_builtin_and_library_classes_are_rebuilt_as_themselves():
    for cls in (FileNotFoundError, ValueError, MissingCheckpointFileError):
        error = rebuild_exception(cls.__module__, cls.__qualname__, "rank 1: gone")
        assert type(error) is cls and str(error) == "rank 1: gone"


def test_a_class_whose_constructor_needs_more_gets_a_stand_in_that_still_matches():
    error = rebuild_exception("json", "JSONDecodeError", "rank 0: bad")
    assert isinstance(error, json.JSONDecodeError) and isinstance(error, ValueError)
    assert str(error) == "rank 0: bad" and type(error).__name__ == "JSONDecodeError"


def test_an_unknown_class_becomes_a_runtime_error():
    error = rebuild_exception("no_such_module_here", "Gone", "rank 3: lost")
    assert type(error) is RuntimeError and str(error) == "rank 3: lost"
