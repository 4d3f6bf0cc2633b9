"""The architecture guardrail: ``tools/lint_model_parallelizer_contract.py`` and the import-linter contracts.

Unit tests run the tool's functions on a tiny fake project, one snippet that must be flagged and one that must pass
per rule. Acceptance tests copy the real tree, plant each violation the product docs name, and check that the tool or
``lint-imports`` (run on the copy) fails, and that the unmodified copy passes both.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "lint_model_parallelizer_contract.py"


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lint_model_parallelizer_contract", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


lint = _load_tool()

FAKE_TREE = {
    "automodel/__init__.py": "",
    "automodel/distributed/__init__.py": """
        from .parallelizer import ModelParallelizer

        __all__ = ["ModelParallelizer"]
    """,
    "automodel/distributed/parallelizer.py": """
        __all__ = ["ModelParallelizer", "helper"]


        class ModelParallelizer:
            def parallelize(self, model, mesh_context):
                return self._apply(model)

            def _apply(self, model, **kwargs):
                return model

            def _fully_shard_module(self, module, **kwargs):
                return module


        def helper():
            pass


        def _private():
            pass
    """,
    "automodel/distributed/fsdp.py": """
        __all__ = ("fully_shard_default",)


        def fully_shard_default(module):
            return module


        def _hidden():
            pass
    """,
    "automodel/distributed/no_all.py": "def anything():\n    pass\n",
    "automodel/distributed/computed_all.py": "__all__ = [name for name in ('x',)]\nx = 1\n",
    "model_sidecars/__init__.py": "",
}

Lint = Callable[[str, str], list[str]]


def _write(root: Path, relative: str, source: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source).lstrip(), encoding="utf-8")
    return path


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    for relative, source in FAKE_TREE.items():
        _write(tmp_path, relative, source)
    return tmp_path


@pytest.fixture
def lint_snippet(fake_root: Path) -> Lint:
    """Write one file into the fake project and return the messages the tool reports for it."""

    def run(relative: str, source: str) -> list[str]:
        path = _write(fake_root, relative, source).resolve()
        findings, _ = lint.check_paths([fake_root])
        return [finding.message for finding in findings if finding.path == path]

    return run


SIDECAR = "model_sidecars/foo/parallelization.py"
SHARED = "automodel/distributed/extra.py"

# name: (file, source, a fragment of the expected message)
FLAGGED = {
    "class-definition": (
        "automodel/distributed/mesh.py",
        "class ParallelizeContext:\n    pass\n",
        "ParallelizeContext",
    ),
    "function-definition": (SIDECAR, "def parallel_scheme(model):\n    return model\n", "parallel_scheme"),
    "assignment": ("recipes/train.py", "parallel_scheme = {'tp': 2}\n", "second parallelization interface"),
    "argument": ("tools/run.py", "def run(model, parallel_scheme=None):\n    pass\n", "parallel_scheme"),
    "keyword": ("benchmarks/bench.py", "run(model, parallel_scheme='fsdp')\n", "parallel_scheme"),
    "attribute": ("automodel/auto_model.py", "self.parallel_scheme = 'fsdp'\n", "parallel_scheme"),
    "import": ("automodel/auto_model.py", "from automodel.distributed import ParallelizeContext\n", "MeshContext"),
    "import-alias": ("automodel/auto_model.py", "import x as parallel_scheme\n", "parallel_scheme"),
    "sidecar-public-method": (
        SIDECAR,
        """
        from automodel.distributed import ModelParallelizer


        class FooParallelizer(ModelParallelizer):
            def shard_experts(self, model):
                return model
        """,
        "adds the public method `shard_experts`",
    ),
    "sidecar-overrides-parallelize": (
        SIDECAR,
        """
        from automodel.distributed import ModelParallelizer


        class FooParallelizer(ModelParallelizer):
            def parallelize(self, model, mesh_context):
                return model
        """,
        "overrides the public `parallelize`",
    ),
    "sidecar-indirect-subclass": (
        SIDECAR,
        """
        from automodel.distributed import ModelParallelizer as Base


        class Middle(Base):
            pass


        class FooParallelizer(Middle):
            def setup(self, model):
                return model
        """,
        "FooParallelizer adds the public method `setup`",
    ),
    "sidecar-attribute-base": (
        SIDECAR,
        """
        import automodel.distributed as distributed


        class FooParallelizer(distributed.ModelParallelizer):
            def setup(self, model):
                return model
        """,
        "adds the public method `setup`",
    ),
    "sidecar-unexported-package-name": (SIDECAR, "from automodel.distributed import fsdp\n", "`fsdp` is not exported"),
    "sidecar-private-submodule-name": (
        SIDECAR,
        "from automodel.distributed.parallelizer import _private\n",
        "`_private` is not exported by automodel.distributed.parallelizer",
    ),
    "sidecar-unexported-submodule-name": (SIDECAR, "from automodel.distributed.fsdp import _hidden\n", "_hidden"),
    "sidecar-module-without-all": (SIDECAR, "from automodel.distributed.no_all import anything\n", "literal __all__"),
    "sidecar-computed-all": (SIDECAR, "from automodel.distributed.computed_all import x\n", "not exported"),
    "sidecar-missing-module": (SIDECAR, "from automodel.distributed.nowhere import x\n", "not exported"),
    "sidecar-whole-package": (SIDECAR, "import automodel.distributed\n", "imports a whole module"),
    "sidecar-whole-submodule": (SIDECAR, "import automodel.distributed.fsdp as fsdp\n", "imports a whole module"),
    "shared-imports-sidecar": (SHARED, "import model_sidecars\n", "imports the model code `model_sidecars`"),
    "shared-imports-sidecar-symbol": (SHARED, "from model_sidecars.llama import PARALLELIZER\n", "model_sidecars"),
    "shared-imports-model": (SHARED, "from transformers.models.llama import LlamaConfig\n", "transformers.models"),
    "shared-imports-model-module": (SHARED, "import transformers.models.llama.modeling_llama\n", "model code"),
    "shared-imports-models-package": (SHARED, "from transformers import models\n", "transformers.models"),
    "shared-imports-model-class": (SHARED, "from transformers import LlamaForCausalLM\n", "LlamaForCausalLM"),
    "shared-name-equality": (
        SHARED,
        "def f(model):\n    return type(model).__name__ == 'LlamaForCausalLM'\n",
        "model-name conditional on 'LlamaForCausalLM'",
    ),
    "shared-name-membership": (
        SHARED,
        "def f(model):\n    return model.__class__.__name__ in ('Qwen3MoeForCausalLM', 'Other')\n",
        "Qwen3MoeForCausalLM",
    ),
    "shared-name-suffix": (
        SHARED,
        "def f(layer):\n    return type(layer).__name__.endswith('DecoderLayer')\n",
        "model-name conditional",
    ),
    "shared-isinstance": (
        SHARED,
        """
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer


        def f(module):
            return isinstance(module, (Layer, int))
        """,
        "isinstance check against the model class `Layer`",
    ),
    "shared-isinstance-dotted": (
        SHARED,
        "import transformers\n\n\ndef f(m):\n    return isinstance(m, transformers.models.llama.LlamaModel)\n",
        "isinstance check",
    ),
    "shared-sidecar-string": (
        SHARED,
        "import importlib\n\nSIDECAR = importlib.import_module('model_sidecars.llama')\n",
        "names model code",
    ),
    "private-torch-module": (
        "automodel/loading/reader.py",
        "from torch.utils._pytree import tree_map_only\n",
        "`torch.utils._pytree.tree_map_only` is a private torch symbol",
    ),
    "private-torch-name": (SHARED, "from torch.distributed.tensor.placement_types import _StridedShard\n", "seam"),
    "private-torch-import-as": (SIDECAR, "import torch.distributed._functional_collectives as funcol\n", "private"),
    "private-torch-attribute": (
        SHARED,
        "import torch.distributed as dist\n\n\ndef group():\n    return dist.distributed_c10d._get_default_group()\n",
        "`torch.distributed.distributed_c10d._get_default_group` is a private torch symbol",
    ),
    "private-torch-attribute-of-class": (
        "recipes/x.py",
        "from torch.distributed.fsdp import FSDPModule\n\nstate = FSDPModule._get_fsdp_state\n",
        "automodel._compat.torch",
    ),
    "private-transformers-name": (
        SHARED,
        "from transformers.distributed.parallel_utils import _get_parameter_plan\n",
        "`transformers.distributed.parallel_utils._get_parameter_plan` is a private transformers symbol",
    ),
    "transformers-internal-module": (
        "automodel/auto_model.py",
        "from transformers.core_model_loading import build_glob_alternation\n",
        "automodel._compat.transformers",
    ),
    "transformers-distributed-submodule": (
        SHARED,
        "from transformers.distributed.tensor_parallel import ColwiseParallel\n",
        "`transformers.distributed.tensor_parallel.ColwiseParallel` is a private transformers symbol",
    ),
    "transformers-internal-module-from-top-level": (
        "tools/t.py",
        "from transformers import initialization as hf_init\n",
        "`transformers.initialization` is a private",
    ),
    "transformers-internal-attribute": (
        "benchmarks/b.py",
        "import transformers\n\nf = transformers.modeling_utils.remove_tied_weights_from_state_dict\n",
        "`transformers.modeling_utils.remove_tied_weights_from_state_dict` is a private",
    ),
    "transformers-private-method": (
        SIDECAR,
        "from transformers import PreTrainedModel\n\nbuild = PreTrainedModel._from_config\n",
        "`transformers.PreTrainedModel._from_config` is a private transformers symbol",
    ),
}

# name: (file, source) that must raise no finding
PASSING = {
    "mesh-context": ("automodel/auto_model.py", "def load(model, mesh_context):\n    scheme = 'fsdp'\n"),
    "docstring-mention": ("automodel/auto_model.py", '"""No ParallelizeContext or parallel_scheme here."""\n'),
    "outside-scanned-folders": ("tests/test_x.py", "class ParallelizeContext:\n    pass\n"),
    "lint-tool-itself": ("tools/lint_model_parallelizer_contract.py", "parallel_scheme = 1\n"),
    "virtualenv": ("automodel/.venv/lib/x.py", "class ParallelizeContext:\n    pass\n"),
    "sidecar-protected-hooks": (
        SIDECAR,
        """
        from automodel.distributed import ModelParallelizer
        from automodel.distributed.fsdp import fully_shard_default
        from automodel.distributed.parallelizer import helper


        class FooParallelizer(ModelParallelizer):
            _customizes_moe_fsdp = True

            def __init__(self):
                super().__init__()

            def _fully_shard_module(self, module, **kwargs):
                return fully_shard_default(module)

            def _group_units(self, model):
                return helper()


        class Plain:
            def public(self):
                pass


        PARALLELIZER = FooParallelizer()
        """,
    ),
    "non-sidecar-private-import": ("automodel/loading/reader.py", "from automodel.distributed.fsdp import _hidden\n"),
    "shared-transformers-distributed": (
        SHARED,
        """
        from transformers import PreTrainedModel
        from transformers.distributed import DistributedConfig


        def f(model, names):
            if __name__ == "__main__":
                pass
            if type(model).__name__ == "FSDP2Config":
                pass
            if type(model).__name__ in names:
                raise TypeError(f"{type(model).__name__}: put a plan in model_sidecars/<model>/parallelization.py")
        """,
    ),
    "model-name-outside-shared": ("automodel/auto_model.py", "ok = type(m).__name__ == 'LlamaForCausalLM'\n"),
    "seam-imports-private-symbols": (
        "automodel/_compat/torch.py",
        "import torch.distributed as dist\nfrom torch.utils._pytree import tree_map_only\n\ng = dist.distributed_c10d._get_default_group\n",
    ),
    "public-torch-and-transformers": (
        SHARED,
        """
        import torch
        import torch.distributed as dist
        import transformers
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import DTensor
        from transformers import AutoConfig, PreTrainedModel, set_seed
        from transformers.distributed import DistributedConfig

        VERSION = (torch.__version__, transformers.__version__)
        GROUP = dist.group.WORLD
        """,
    ),
    "transformers-model-code": (
        SIDECAR,
        "from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n",
    ),
    "seam-symbol-import": ("automodel/loading/reader.py", "from automodel._compat.torch import tree_map_only\n"),
    "private-attribute-of-a-variable": ("automodel/loading/reader.py", "def f(m):\n    return m._parameters\n"),
}


@pytest.mark.parametrize(("relative", "source", "fragment"), FLAGGED.values(), ids=list(FLAGGED))
def test_flags_violation(lint_snippet: Lint, relative: str, source: str, fragment: str) -> None:
    messages = lint_snippet(relative, source)
    assert any(fragment in message for message in messages), messages


@pytest.mark.parametrize(("relative", "source"), PASSING.values(), ids=list(PASSING))
def test_accepts_allowed_code(lint_snippet: Lint, relative: str, source: str) -> None:
    assert lint_snippet(relative, source) == []


def test_public_method_message_comes_from_the_parsed_base(lint_snippet: Lint) -> None:
    (message,) = lint_snippet(SIDECAR, FLAGGED["sidecar-public-method"][1])
    assert "(_apply, _fully_shard_module)" in message  # the fake base's hooks, not a hard-coded list
    assert "_shard_experts" in message


def test_syntax_error_is_reported(lint_snippet: Lint) -> None:
    assert lint_snippet("automodel/broken.py", "def f(:\n") == ["cannot parse (invalid syntax); fix the syntax error"]


def test_unparsable_distributed_module_exports_nothing(fake_root: Path, lint_snippet: Lint) -> None:
    _write(fake_root, "automodel/distributed/broken.py", "__all__ = ['x']\ndef f(:\n")
    (message,) = lint_snippet(SIDECAR, "from automodel.distributed.broken import x\n")
    assert "`x` is not exported" in message


def _run_tool(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(cwd / "tools" / "lint_model_parallelizer_contract.py"), *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_cli_reports_path_line_message_and_exit_status(fake_root: Path) -> None:
    (fake_root / "tools").mkdir()
    shutil.copy(TOOL, fake_root / "tools")
    clean = _run_tool(cwd=fake_root)
    assert clean.returncode == 0 and clean.stdout.startswith("model-parallelizer contract OK"), clean
    _write(fake_root, "automodel/distributed/mesh.py", "X = 1\n\n\nclass ParallelizeContext:\n    pass\n")
    broken = _run_tool(fake_root, cwd=fake_root)
    assert broken.returncode == 1
    assert broken.stdout.startswith("automodel/distributed/mesh.py:4: `ParallelizeContext` introduces"), broken
    assert "1 violation(s); see docs/architecture-guardrails.md" in broken.stderr
    assert _run_tool(fake_root / "nowhere", cwd=fake_root).returncode == 2


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance: the real tree, copied, with each violation planted.
# ---------------------------------------------------------------------------------------------------------------------

LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


@pytest.fixture
def real_copy(tmp_path: Path) -> Path:
    """automodel/, model_sidecars/, tools/ and pyproject.toml of this repository, copied."""
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("automodel", "model_sidecars", "tools"):
        shutil.copytree(REPO / folder, copy / folder, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    return copy


def _lint_imports(copy: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` analysing the copy: the copy first on the path, and its own pyproject.toml."""
    if LINT_IMPORTS is None:
        pytest.skip("import-linter is not installed (pip install -e .[dev])")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = subprocess.run(
        [sys.executable, "-c", "import automodel, model_sidecars; print(automodel.__file__, model_sidecars.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert all(Path(p).is_relative_to(copy) for p in where.stdout.split()), where.stdout
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=copy, env=env, capture_output=True, text=True, timeout=120)


def _append(copy: Path, relative: str, source: str) -> None:
    path = copy / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\n" + textwrap.dedent(source).lstrip())


def _tool_messages(copy: Path) -> list[str]:
    findings, _ = lint.check_paths([copy])
    return [str(finding.path.relative_to(copy)) + ": " + finding.message for finding in findings]


def test_unmodified_copy_passes_both_checks(real_copy: Path) -> None:
    tool = _run_tool(cwd=real_copy)  # no argument: the copied tool checks the tree it lives in
    assert tool.returncode == 0, tool.stdout + tool.stderr
    result = _lint_imports(real_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


TOOL_PLANTS = {
    "parallelize-context-class": (
        "automodel/distributed/mesh.py",
        "class ParallelizeContext:\n    pass\n",
        "automodel/distributed/mesh.py: `ParallelizeContext` introduces a second parallelization interface",
    ),
    "parallel-scheme-function": (
        "automodel/distributed/__init__.py",
        "def parallel_scheme(model):\n    return model\n",
        "automodel/distributed/__init__.py: `parallel_scheme` introduces",
    ),
    "sidecar-public-method": (
        "model_sidecars/demo/parallelization.py",
        """
        from automodel.distributed import ModelParallelizer

        __all__ = ["PARALLELIZER"]


        class DemoParallelizer(ModelParallelizer):
            def shard_everything(self, model):
                return model


        PARALLELIZER = DemoParallelizer()
        """,
        "model_sidecars/demo/parallelization.py: DemoParallelizer adds the public method `shard_everything`",
    ),
    "sidecar-unexported-import": (
        "model_sidecars/demo/parallelization.py",
        """
        from automodel.distributed import ModelParallelizer
        from automodel.distributed.parallelizer import _dense_apply_arguments
        """,
        "model_sidecars/demo/parallelization.py: `_dense_apply_arguments` is not exported",
    ),
    "distributed-imports-sidecars": (
        "automodel/distributed/__init__.py",
        "import model_sidecars\n",
        "automodel/distributed/__init__.py: shared infrastructure imports the model code `model_sidecars`",
    ),
    "private-torch-import-outside-the-seam": (
        "automodel/distributed/fsdp.py",
        "from torch.utils._pytree import tree_map_only\n",
        "automodel/distributed/fsdp.py: `torch.utils._pytree.tree_map_only` is a private torch symbol",
    ),
    "private-transformers-import-outside-the-seam": (
        "automodel/loading/key_mapping.py",
        "from transformers.core_model_loading import WeightConverter\n",
        "automodel/loading/key_mapping.py: `transformers.core_model_loading.WeightConverter` is a private",
    ),
}


@pytest.mark.parametrize(("relative", "source", "expected"), TOOL_PLANTS.values(), ids=list(TOOL_PLANTS))
def test_planted_violation_fails_the_tool(real_copy: Path, relative: str, source: str, expected: str) -> None:
    assert _tool_messages(real_copy) == []
    _append(real_copy, relative, source)
    messages = _tool_messages(real_copy)
    assert any(message.startswith(expected) for message in messages), messages
    assert len(messages) == 1, messages


def test_distributed_importing_sidecars_fails_lint_imports(real_copy: Path) -> None:
    _append(real_copy, "automodel/distributed/__init__.py", "import model_sidecars\n")
    result = _lint_imports(real_copy)
    assert result.returncode != 0
    assert "automodel.distributed is not allowed to import model_sidecars" in result.stdout, result.stdout


def test_distributed_importing_the_loader_fails_lint_imports(real_copy: Path) -> None:
    if not (real_copy / "automodel" / "loading").exists():
        _append(real_copy, "automodel/loading/__init__.py", '"""Stand-in loader."""\n\nsomething = None\n')
    _append(real_copy, "automodel/distributed/parallelizer.py", "from automodel.loading import something\n")
    result = _lint_imports(real_copy)
    assert result.returncode != 0
    assert "automodel.distributed is not allowed to import automodel.loading" in result.stdout, result.stdout
    assert "automodel layers point one way" in result.stdout and "BROKEN" in result.stdout


def test_compat_importing_automodel_fails_lint_imports(real_copy: Path) -> None:
    _append(real_copy, "automodel/_compat/torch.py", "from automodel.distributed import MeshContext\n")
    result = _lint_imports(real_copy)
    assert result.returncode != 0
    assert "automodel._compat is not allowed to import automodel.distributed" in result.stdout, result.stdout
