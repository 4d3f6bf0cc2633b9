#!/usr/bin/env python
"""Architecture guardrail: keep ``ModelParallelizer`` the one parallelization contract.

Usage: ``python tools/lint_model_parallelizer_contract.py [paths...]`` (default: the repository this file lives in).
A path is a project root or a file / folder inside one. Prints ``path:line: message`` per finding and exits 1, or
one OK line and exits 0. Standard library only. Rules (see ``docs/architecture-guardrails.md``):

1. no second parallelization interface (``ParallelizeContext`` / ``parallel_scheme``) anywhere in the project;
2. a sidecar ``ModelParallelizer`` subclass defines no public method, ``parallelize`` included;
3. a sidecar imports from ``automodel.distributed`` only names the target module lists in its literal ``__all__``;
4. ``automodel/distributed/`` imports no model or sidecar and never branches on a model class name;
5. private torch / transformers symbols are imported only in the seam, ``automodel/_compat/``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SCANNED_DIRS = ("automodel", "model_sidecars", "recipes", "tools", "benchmarks")
SKIPPED_FILES = ("tools/lint_model_parallelizer_contract.py", "tests/test_contract_lint.py")
SKIPPED_DIRS = frozenset({"venv", "__pycache__", "build", "dist"})  # plus every hidden folder (.venv, .git, ...)
SECOND_INTERFACE_NAMES = frozenset({"ParallelizeContext", "parallel_scheme"})
DISTRIBUTED = "automodel.distributed"
BASE_FILE = Path("automodel/distributed/parallelizer.py")
DOCS = "docs/architecture-guardrails.md"
# A string that looks like a model class: an architecture suffix, a model building block, or a model family.
MODEL_CLASS_NAME = re.compile(
    r"ForCausalLM|ForConditionalGeneration|Model$|DecoderLayer|Attention|MLP|MoE|Expert|"
    r"llama|qwen|mistral|mixtral|gemma|deepseek|nemotron|phi|gpt|falcon|olmo|granite|glm|kimi",
    re.IGNORECASE,
)
# A model class re-exported by the top-level transformers package (PreTrainedModel, the generic base, is fine).
TRANSFORMERS_MODEL_CLASS = re.compile(r"(?!PreTrained)\w*(For[A-Z]\w*|Model|DecoderLayer)")
# A string naming a sidecar module ("model_sidecars", "model_sidecars.x", "model_sidecars:X") or a transformers model
# module; a path in a message ("model_sidecars/<model>/parallelization.py") is not a module name.
MODEL_MODULE_STRING = re.compile(r"\bmodel_sidecars(?:[.:]|$)|\btransformers\.models\b")

SEAM_DIR = ("automodel", "_compat")
SEAMED_LIBRARIES = ("torch", "transformers")
# transformers' public modules besides the top-level package: the model code (and its submodules), and the package
# that exports DistributedConfig (not its submodules).
TRANSFORMERS_MODEL_CODE = "transformers.models"
TRANSFORMERS_PUBLIC_PACKAGE = "transformers.distributed"

SECOND_INTERFACE = (
    "`{name}` introduces a second parallelization interface; ModelParallelizer.parallelize(model, mesh_context) is "
    "the only one: put runtime inputs on MeshContext and model policy in a protected hook of a ModelParallelizer "
    "subclass"
)
OVERRIDES_PUBLIC = (
    "{cls} overrides the public `{name}`; keep the shared dispatch and override a protected hook ({hooks})"
)
ADDS_PUBLIC = (
    "{cls} adds the public method `{name}`; sidecars only override protected hooks: make it a private helper "
    "(`_{name}`) or override a protected hook ({hooks})"
)
WHOLE_MODULE = "`import {module}` imports a whole module; import exported names: `from automodel.distributed import X`"
NOT_EXPORTED = (
    "`{name}` is not exported by {module} (not in its literal __all__); import only exported symbols, preferably "
    "`from automodel.distributed import ...`, or add the symbol to automodel.distributed.__all__ if sidecars need it"
)
SHARED_FIX = (
    "; shared code must not name a model: move the model-specific part into a protected hook of the model's sidecar "
    "(model_sidecars/<model>/parallelization.py) or ask a structural property (e.g. _no_split_modules, _tp_plan)"
)
MODEL_IMPORT = "shared infrastructure imports the model code `{module}`" + SHARED_FIX
NAME_CONDITIONAL = "model-name conditional on {literal!r}" + SHARED_FIX
MODEL_ISINSTANCE = "isinstance check against the model class `{name}`" + SHARED_FIX
MODEL_STRING = "string {literal!r} names model code" + SHARED_FIX

PRIVATE_SYMBOL = (
    "`{symbol}` is a private {library} symbol (an internal module or a `_` name); import it from the seam, "
    "automodel._compat.{library}, and add it there if it is new, with what it is for and the releases it is known in"
)

Hit = tuple[int, str]  # (line, message)


@dataclass(frozen=True)
class Finding:
    """One violation: where it is and what to do about it."""

    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        try:
            shown = self.path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: {self.message}"


@dataclass(frozen=True)
class BaseContract:
    """The public methods and protected hooks ``automodel/distributed/parallelizer.py`` gives ``ModelParallelizer``."""

    public_methods: frozenset[str]
    hooks: str

    @classmethod
    def parse(cls, root: Path) -> BaseContract:
        """Read the base class with ``ast``; an absent file or class declares nothing."""
        names = [
            item.name
            for node in module_body(root / BASE_FILE)
            if isinstance(node, ast.ClassDef) and node.name == "ModelParallelizer"
            for item in node.body
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        hooks = [name for name in names if name.startswith("_") and not name.startswith("__")]
        return cls(frozenset(name for name in names if not name.startswith("_")), ", ".join(hooks) or "see the docs")


def module_body(path: Path | None) -> list[ast.stmt]:
    """The top-level statements of a file; nothing for a missing or unparsable one (reported on its own)."""
    try:
        return ast.parse(path.read_text(encoding="utf-8")).body if path and path.is_file() else []
    except SyntaxError:
        return []


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name / Attribute chain, ``""`` for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        prefix = dotted(node.value)
        return f"{prefix}.{node.attr}" if prefix else ""
    return ""


def literal_all(path: Path | None) -> frozenset[str]:
    """The names in a module's literal ``__all__``; a missing or non-literal ``__all__`` exports nothing."""
    for node in module_body(path):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
                try:
                    value = ast.literal_eval(node.value)
                except (ValueError, TypeError):
                    return frozenset()
                literal = isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value)
                return frozenset(value) if literal else frozenset()
    return frozenset()


def module_file(root: Path, module: str) -> Path | None:
    """The file of the project module ``module`` (a package ``__init__.py`` or a ``.py`` file), or ``None``."""
    base = root.joinpath(*module.split("."))
    return next((c for c in (base / "__init__.py", base.with_suffix(".py")) if c.is_file()), None)


def check_second_interface(tree: ast.AST) -> Iterator[Hit]:
    """Rule 1: a definition, binding, argument, keyword, attribute or import named like a second interface."""
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.arg, ast.keyword)):
            names = [node.arg or ""]
        elif isinstance(node, ast.alias):
            names = [*node.name.split("."), node.asname or ""]
        for name in sorted(SECOND_INTERFACE_NAMES.intersection(names)):
            yield node.lineno, SECOND_INTERFACE.format(name=name)


def parallelizer_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """Classes of this file that subclass ``ModelParallelizer``, directly or through another class of the file."""
    known = {"ModelParallelizer"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            known |= {alias.asname for alias in node.names if alias.name == "ModelParallelizer" and alias.asname}
    pending = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    found: list[ast.ClassDef] = []
    while subclasses := [c for c in pending if any(dotted(b).rpartition(".")[2] in known for b in c.bases)]:
        found += subclasses
        known |= {c.name for c in subclasses}
        pending = [c for c in pending if c not in subclasses]
    return found


def check_sidecar_methods(tree: ast.Module, base: BaseContract) -> Iterator[Hit]:
    """Rule 2: a sidecar parallelizer defines no public method, not even an override of ``parallelize``."""
    for cls in parallelizer_classes(tree):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                template = OVERRIDES_PUBLIC if item.name in base.public_methods else ADDS_PUBLIC
                yield item.lineno, template.format(cls=cls.name, name=item.name, hooks=base.hooks)


def check_sidecar_imports(tree: ast.Module, root: Path) -> Iterator[Hit]:
    """Rule 3: a sidecar imports only names that an ``automodel.distributed`` module lists in its ``__all__``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == DISTRIBUTED or alias.name.startswith(DISTRIBUTED + "."):
                    yield node.lineno, WHOLE_MODULE.format(module=alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == DISTRIBUTED or node.module.startswith(DISTRIBUTED + "."):
                exported = literal_all(module_file(root, node.module))
                for alias in node.names:
                    if alias.name not in exported:
                        yield node.lineno, NOT_EXPORTED.format(name=alias.name, module=node.module)


def _is_model_module(module: str) -> bool:
    """Whether an imported module is a sidecar or a transformers model implementation."""
    return module.split(".")[0] == "model_sidecars" or module.startswith("transformers.models")


def _model_imports(tree: ast.Module) -> Iterator[tuple[int, str, str | None]]:
    """``(line, module, bound name)`` for each import of a sidecar or a model class / module of transformers."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, None) for a in node.names if _is_model_module(a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                model_class = node.module == "transformers" and TRANSFORMERS_MODEL_CLASS.fullmatch(alias.name)
                if _is_model_module(f"{node.module}.{alias.name}") or model_class:
                    yield node.lineno, f"{node.module}.{alias.name}", alias.asname or alias.name


def _name_lookup(node: ast.AST) -> bool:
    """``x.__name__``, ``x.__class__.__name__``, ``type(x).__name__`` (or ``__qualname__``)."""
    return isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__")


def _model_like(nodes: Iterable[ast.AST]) -> list[str]:
    """The string literals among ``nodes`` (constants or tuples / lists / sets of them) that look like model classes."""
    items = [item for n in nodes for item in (n.elts if isinstance(n, (ast.Tuple, ast.List, ast.Set)) else [n])]
    strings = [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    return [string for string in strings if MODEL_CLASS_NAME.search(string)]


def check_distributed(tree: ast.Module) -> Iterator[Hit]:
    """Rule 4: shared infrastructure imports no model or sidecar and has no model-name conditionals."""
    model_names: set[str | None] = set()
    for line, module, bound in _model_imports(tree):
        model_names.add(bound)
        yield line, MODEL_IMPORT.format(module=module)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(map(_name_lookup, [node.left, *node.comparators])):
            for literal in _model_like([node.left, *node.comparators]):
                yield node.lineno, NAME_CONDITIONAL.format(literal=literal)
        elif isinstance(node, ast.Call) and dotted(node.func) in ("isinstance", "issubclass") and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for name in map(dotted, classes):
                if name in model_names or name.startswith("transformers.models."):
                    yield node.lineno, MODEL_ISINSTANCE.format(name=name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("startswith", "endswith") and _name_lookup(node.func.value):
                for literal in _model_like(node.args[:1]):
                    yield node.lineno, NAME_CONDITIONAL.format(literal=literal)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if MODEL_MODULE_STRING.search(node.value):
                yield node.lineno, MODEL_STRING.format(literal=node.value)


def _underscored(parts: Iterable[str]) -> bool:
    """Whether a dotted path has a ``_`` part (dunders such as ``__version__`` are public)."""
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__")) for part in parts)


@functools.cache
def _package_dir(library: str) -> Path | None:
    """Where an installed top-level package lives (located, not imported), or ``None``."""
    spec = importlib.util.find_spec(library)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _is_submodule(dotted: str) -> bool:
    """Whether ``dotted`` (``transformers.x.y``) names a module of the installed package rather than an object."""
    library, *parts = dotted.split(".")
    folder = _package_dir(library)
    if folder is None or not parts:
        return False
    path = folder.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_symbol(dotted: str) -> bool:
    """Whether the dotted path of an import or attribute reaches torch / transformers internals: any ``_`` part (the
    rule torch's public-API definition uses), or a transformers module other than the top-level package, the model
    code (``transformers.models``) and ``transformers.distributed``."""
    parts = dotted.split(".")
    if parts[0] not in SEAMED_LIBRARIES:
        return False
    if _underscored(parts):
        return True
    if parts[0] != "transformers" or len(parts) < 2 or not _is_submodule(".".join(parts[:2])):
        return False
    module = ".".join(parts[:3]) if _is_submodule(".".join(parts[:3])) else ".".join(parts[:2])
    model_code = module == TRANSFORMERS_MODEL_CODE or module.startswith(TRANSFORMERS_MODEL_CODE + ".")
    return not (model_code or module == TRANSFORMERS_PUBLIC_PACKAGE)


def check_private_imports(tree: ast.Module) -> Iterator[Hit]:
    """Rule 5: no private torch / transformers import, nor attribute of an imported torch / transformers name,
    outside the seam."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in SEAMED_LIBRARIES:
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
                    if private_symbol(alias.name):
                        yield node.lineno, PRIVATE_SYMBOL.format(symbol=alias.name, library=alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            library = node.module.split(".")[0]
            for alias in node.names if library in SEAMED_LIBRARIES else []:
                symbol = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = symbol
                if private_symbol(symbol):
                    yield node.lineno, PRIVATE_SYMBOL.format(symbol=symbol, library=library)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        chain = dotted(node) if isinstance(node, ast.Attribute) and id(node) not in inner else ""
        head, _, rest = chain.partition(".")
        if head in bound and rest:
            symbol = f"{bound[head]}.{rest}"
            if private_symbol(symbol) and not private_symbol(bound[head]):
                yield node.lineno, PRIVATE_SYMBOL.format(symbol=symbol, library=symbol.split(".")[0])


def check_file(path: Path, root: Path, base: BaseContract) -> list[Finding]:
    """Every finding for one Python file of the project rooted at ``root``."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as error:
        return [Finding(path, error.lineno or 1, f"cannot parse ({error.msg}); fix the syntax error")]
    folders = path.relative_to(root).parts[:-1]
    hits = list(check_second_interface(tree))
    if folders[:1] == ("model_sidecars",):
        hits += [*check_sidecar_methods(tree, base), *check_sidecar_imports(tree, root)]
    if folders[:2] == ("automodel", "distributed"):
        hits += check_distributed(tree)
    if folders[:2] != SEAM_DIR:
        hits += check_private_imports(tree)
    return [Finding(path, line, message) for line, message in sorted(hits)]


def find_root(path: Path) -> Path:
    """The project root holding ``path`` (resolved): the nearest folder with ``automodel/`` or ``model_sidecars/``."""
    for candidate in (path, *path.parents):
        if (candidate / "automodel").is_dir() or (candidate / "model_sidecars").is_dir():
            return candidate
    return path if path.is_dir() else path.parent


def _kept(folder: str) -> bool:
    """Whether a folder holds project source (not a virtualenv, cache, build output or hidden folder)."""
    return folder not in SKIPPED_DIRS and not folder.startswith(".")


def _python_files(start: Path) -> Iterator[Path]:
    """The ``.py`` files under ``start`` in a stable order, without descending into skipped folders."""
    for folder, subfolders, names in os.walk(start):
        subfolders[:] = sorted(name for name in subfolders if _kept(name))
        yield from (Path(folder) / name for name in sorted(names) if name.endswith(".py"))


def project_files(path: Path, root: Path) -> Iterator[Path]:
    """The project Python files at or under ``path`` (resolved, inside ``root``) that the rules apply to."""
    if path.is_file():
        candidates: Iterable[Path] = [path]
    elif path == root:
        candidates = (file for name in SCANNED_DIRS for file in _python_files(root / name))
    else:
        candidates = _python_files(path)
    for candidate in candidates:
        relative = candidate.relative_to(root)
        folders = relative.parts[:-1]
        if folders and folders[0] in SCANNED_DIRS and all(map(_kept, folders)):
            if relative.as_posix() not in SKIPPED_FILES:
                yield candidate


def check_paths(paths: Iterable[Path]) -> tuple[list[Finding], int]:
    """All findings under ``paths`` and the number of files checked."""
    findings: list[Finding] = []
    checked: set[Path] = set()
    for path in (p.resolve() for p in paths):
        root = find_root(path)
        base = BaseContract.parse(root)
        for file in project_files(path, root):
            if file not in checked:
                checked.add(file)
                findings += check_file(file, root, base)
    return findings, len(checked)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 clean, 1 findings, 2 bad arguments)."""
    paths = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)] or [Path(__file__).resolve().parents[1]]
    missing = [str(path) for path in paths if not path.exists()]
    if missing:
        print(f"error: no such path: {', '.join(missing)}", file=sys.stderr)
        return 2
    findings, count = check_paths(paths)
    for finding in findings:
        print(finding)
    if findings:
        print(f"model-parallelizer contract: {len(findings)} violation(s); see {DOCS}", file=sys.stderr)
        return 1
    print(f"model-parallelizer contract OK ({count} files checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
