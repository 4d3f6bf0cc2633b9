"""The error of a data file the recipe cannot train on (raised by ``data_check`` and ``data_tables``)."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data file the recipe cannot train on, at one position (``file:line`` or ``file: row N``)."""
