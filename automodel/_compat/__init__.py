"""The one seam for private transformers and torch symbols: :mod:`automodel._compat.transformers` and
:mod:`automodel._compat.torch`.

Everything else in ``automodel`` and ``model_sidecars`` imports those libraries' public API only (the contract lint,
``tools/lint_model_parallelizer_contract.py``, rejects a private import anywhere else). Each seam module imports every
private symbol once, says what it is for and the releases it is known in, and bridges the releases of the tested range
that differ with a small shim. A release without a symbol fails at import with a :class:`MissingSymbolError` naming
the symbol, the tested range and what to install. ``_compat`` is a leaf: it imports nothing from automodel.
"""

from .versions import TESTED_RANGES, MissingSymbolError, VersionRange, private_symbol

__all__ = ["TESTED_RANGES", "MissingSymbolError", "VersionRange", "private_symbol"]
