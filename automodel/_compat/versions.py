"""The tested version ranges and the lookup every private symbol goes through."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

__all__ = ["TESTED_RANGES", "MissingSymbolError", "VersionRange", "private_symbol"]


@dataclass(frozen=True)
class VersionRange:
    """The releases of one library that automodel is tested against: ``oldest`` and ``newest`` are the two ends
    ``make test-compat`` runs; ``specifier`` is what ``pyproject.toml`` declares."""

    library: str
    oldest: str
    newest: str
    specifier: str

    @property
    def requirement(self) -> str:
        """``"torch>=2.11.0,<2.15"``: what to install for a tested release."""
        return f"{self.library}{self.specifier}"


# pyproject.toml and the Makefile's OLDEST / NEWEST combinations say the same (tests/test_compat.py checks it).
TESTED_RANGES: dict[str, VersionRange] = {
    "torch": VersionRange("torch", oldest="2.11.0", newest="2.14.1", specifier=">=2.11.0,<2.15"),
    "transformers": VersionRange("transformers", oldest="5.23.0", newest="5.24.0", specifier=">=5.23.0,<5.25"),
}


class MissingSymbolError(ImportError):
    """A private symbol automodel needs is not in the installed release of its library."""

    def __init__(self, library: str, symbol: str, purpose: str) -> None:
        tested = TESTED_RANGES[library]
        super().__init__(
            f"automodel needs {symbol} ({purpose}), which {library} {installed_version(library)} does not have. "
            f"automodel is tested with {library} {tested.oldest} to {tested.newest}: "
            f"pip install '{tested.requirement}'. If this is a newer {library} release, please report it (README.md, "
            "'Supported versions'); the private symbols automodel uses are listed in "
            f"automodel/_compat/{library}.py."
        )
        self.library = library
        self.symbol = symbol


def installed_version(library: str) -> str:
    """The installed distribution's version, or ``"(not installed)"``."""
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def private_symbol(library: str, *paths: str, purpose: str) -> Any:
    """The object at the first of ``paths`` (``"package.module.name"``) that exists, or a :class:`MissingSymbolError`
    naming ``paths[0]`` and ``purpose``. More than one path: a symbol that moved or was renamed within the tested
    range (the newest location first).

    Only an absent module or attribute counts as missing; any other error while importing a module propagates.
    """
    for path in paths:
        module_name, _, name = path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise MissingSymbolError(library, paths[0], purpose)
