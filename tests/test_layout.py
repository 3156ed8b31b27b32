"""The package's folders and the paths users write.

Folders import one way, down the layers below (a module may import its own layer and those under
it; ``ppo/`` only itself and ``config``), every old module path imports as the module it became,
and every ``class_path`` (and dotted ``lightning_ppo.`` value) in ``configs/``, the README and the
docs' YAML blocks names something that imports.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest
import yaml

from lightning_ppo import _moved

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_ppo"

# Lowest first. config.py sits with runs/: every folder reads the settings, and config needs only
# runs.errors for its messages.
LAYERS = [
    {"runs", "config", "_moved"},
    {"ppo"},
    {"distributed"},
    {"models"},
    {"rollout"},
    {"watch"},
]
FOLDERS = {"ppo", "rollout", "distributed", "models", "runs", "watch", "tasks"}


def _part(module: str) -> str:
    """The folder (``ppo``) or top-level module (``config``) a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    """The public face (the top-level modules and ``tasks/``) is above every folder."""
    return next((i for i, layer in enumerate(LAYERS) if part in layer), len(LAYERS))


def _imports(path: Path) -> set[str]:
    """Every ``lightning_ppo`` module a file imports, at any depth of the file (lazy imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_ppo"):
            if node.module == "lightning_ppo":
                found |= {f"lightning_ppo.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("lightning_ppo")}
    return found


def _modules() -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), path)
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def test_imports_run_down_the_layers():
    upward = []
    for module, path in _modules():
        here = _part(module)
        for imported in _imports(path):
            there = _part(imported)
            if there == here or imported == "lightning_ppo":
                continue
            if here == "ppo" and there != "config":
                upward.append(f"{module} -> {imported} (ppo/ imports only config)")
            elif _layer(there) > _layer(here):
                upward.append(f"{module} -> {imported}")
    assert not upward, "imports running up the layers:\n" + "\n".join(sorted(upward))


def test_every_folder_says_what_lives_there():
    for folder in sorted(FOLDERS):
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 100, f"lightning_ppo/{folder}/__init__.py needs its docstring"


def test_no_module_left_at_an_old_path():
    for old in _moved.MOVED:
        path = PACKAGE / f"{old.replace('.', '/')}.py"
        assert not path.exists(), f"{path} is both moved and present"


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_module_paths_import_as_the_new_module(old):
    new = importlib.import_module(f"lightning_ppo.{_moved.MOVED[old]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module(f"lightning_ppo.{old}") is new


def test_an_old_path_says_where_it_moved():
    import sys

    sys.modules.pop("lightning_ppo.kl", None)
    with pytest.warns(DeprecationWarning, match="lightning_ppo.kl moved to lightning_ppo.ppo.kl"):
        importlib.import_module("lightning_ppo.kl")


def test_old_names_of_the_modules_that_became_folders():
    from lightning_ppo.models import ValueModel, load_causal_lm
    from lightning_ppo.models.loading import ValueModel as value_model
    from lightning_ppo.rollout import Rollout, generate
    from lightning_ppo.rollout.sampling import generate as sampling_generate

    assert ValueModel is value_model and generate is sampling_generate
    assert Rollout is importlib.import_module("lightning_ppo").Rollout
    assert callable(load_causal_lm)
    with pytest.raises(AttributeError, match="lightning_ppo.rollout' has no attribute 'nothing'"):
        _ = importlib.import_module("lightning_ppo.rollout").nothing


def test_an_old_submodule_path_is_the_new_submodule():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("lightning_ppo.engines.weights")
    assert old is importlib.import_module("lightning_ppo.rollout.engines.weights")


def _yaml_texts() -> list[tuple[str, str]]:
    texts = [
        (str(path.relative_to(ROOT)), path.read_text()) for path in sorted((ROOT / "configs").rglob("*.yaml"))
    ]
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```ya?ml\n(.*?)```", doc.read_text(), flags=re.S)):
            texts.append((f"{doc.relative_to(ROOT)} block {i + 1}", block))
    return texts


def _dotted_values(node: object) -> list[str]:
    """``class_path`` values and any other string naming something under lightning_ppo."""
    if isinstance(node, dict):
        return [v for value in node.values() for v in _dotted_values(value)]
    if isinstance(node, list):
        return [v for value in node for v in _dotted_values(value)]
    if isinstance(node, str) and re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", node):
        return [node] if node.startswith(("lightning_ppo.", "lightning.")) else []
    return []


def test_the_yaml_files_and_blocks_are_all_checked():
    names = [name for name, _ in _yaml_texts()]
    assert sum(name.startswith("configs/") for name in names) >= 10
    assert any(name.startswith("README.md") for name in names)
    assert any(name.startswith("docs/agents.md") for name in names)


@pytest.mark.parametrize(("where", "text"), _yaml_texts(), ids=[name for name, _ in _yaml_texts()])
def test_every_class_path_in_configs_and_docs_imports(where, text):
    paths = _dotted_values(yaml.safe_load(text))
    assert paths or "lightning_ppo." not in text, f"{where}: its lightning_ppo paths were not found"
    for dotted in paths:
        module, _, name = dotted.rpartition(".")
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the docs use the new paths
            try:
                target = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as err:
                pytest.fail(f"{where}: {dotted} does not import: {err}")
        assert callable(target), f"{where}: {dotted} is not a class or function"
