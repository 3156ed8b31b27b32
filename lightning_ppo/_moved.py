"""Module paths from before the package had folders keep importing, as the module they became.

Until version 0.1 every module sat directly in ``lightning_ppo/``; configs, notebooks and user code
name them (``lightning_ppo.episodes.Environment``, ``lightning_ppo.sharding.shard_model``), and
checkpoints written then pickle a few objects under those names. :class:`OldPaths`, installed on
``sys.meta_path`` when ``lightning_ppo`` is imported, answers an old name with the new module
itself (not a copy: classes stay identical, ``isinstance`` and pickling hold) and a
``DeprecationWarning`` naming the new path; the new module keeps its own ``__spec__``.
``tests/test_layout.py`` imports every old path.

A file pickled before the move names its classes by their old paths, and ``torch.load(weights_only=
True)`` matches those names as strings: allow-listed by their new paths alone they are refused. Pass
:func:`with_old_paths` of the list to ``torch.serialization.safe_globals`` to allow both names
(public as ``lightning_ppo.checkpoint.with_old_paths``). The package's own readers of checkpoints
read within :func:`old_paths_allowed`, so there what a user allowed by its new path loads by its old.

Two old modules are folders now, ``rollout`` and ``models``: their packages forward the old names
with :func:`forwarding`, importing each one on first use so the folders stay cheap to import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch.serialization

# old module (under lightning_ppo.) -> new module (under lightning_ppo.)
MOVED = {
    "functional": "ppo.functional",
    "kl": "ppo.kl",
    "experience": "ppo.experience",
    "microbatches": "ppo.microbatches",
    "row_groups": "ppo.row_groups",
    "optim": "ppo.optim",
    "engines": "rollout.engines",
    "episodes": "rollout.episodes",
    "tools": "rollout.tools",
    "chat": "rollout.chat",
    "vocab": "rollout.vocab",
    "environment": "rollout.environment",
    "sharding": "distributed.sharding",
    "sharded_loading": "distributed.sharded_loading",
    "sharded_checkpoint": "distributed.sharded_checkpoint",
    "roles": "models.roles",
    "placement": "models.placement",
    "checkpoint_io": "runs.checkpoint_io",
    "resume": "runs.resume",
    "run_lock": "runs.run_lock",
    "log_continuity": "runs.log_continuity",
    "writable": "runs.writable",
    "file_modes": "runs.file_modes",
    "ctrl_c": "runs.ctrl_c",
    "quiet": "runs.quiet",
    "run_length": "runs.run_length",
    "preflight": "runs.preflight",
    "errors": "runs.errors",
    "typos": "runs.typos",
    "processes": "runs.processes",
    "data_files": "runs.data_files",
    "metrics": "watch.metrics",
    "guardrails": "watch.guardrails",
    "plot": "watch.plot",
    "samples": "watch.samples",
    "wandb_offline": "watch.wandb_offline",
    # the server engine's parts, in a folder of their own since 0.2
    "rollout.engines.server_batch": "rollout.engines.server.batch",
    "rollout.engines.server_client": "rollout.engines.server.client",
    "rollout.engines.server_connections": "rollout.engines.server.connections",
    "rollout.engines.server_guard": "rollout.engines.server.key_guard",
    "rollout.engines.server_memory": "rollout.engines.server.memory_sync",
    "rollout.engines.server_requests": "rollout.engines.server.concurrent_calls",
    "rollout.engines.server_session": "rollout.engines.server.session",
    "rollout.engines.server_suppress": "rollout.engines.server.suppress",
    "rollout.engines.server_sync": "rollout.engines.server.weight_sync",
    "rollout.engines.server_worker": "rollout.engines.server.worker_extension",
    "rollout.engines.weight_group": "rollout.engines.server.weight_group",
    "rollout.engines.local_server": "rollout.engines.server.local_server",
}
PACKAGE = "lightning_ppo"

# Classes that left a module which stayed (or became a folder), where MOVED does not name them:
# their dotted name (under lightning_ppo.) then -> now. Before the folders, and the moves since.
MOVED_CLASSES = {
    "data.PromptBatch": "rollout.prompts.PromptBatch",
    "module.Samples": "watch.samples.Samples",
    "rollout.Rollout": "ppo.rollout_data.Rollout",
    "models.ValueModel": "models.loading.ValueModel",
    "episodes.EnvironmentFailure": "rollout.answers.EnvironmentFailure",
    "rollout.episodes.EnvironmentFailure": "rollout.answers.EnvironmentFailure",
    "rollout.OneDtypeStaticCache": "rollout.static_cache.OneDtypeStaticCache",
    "rollout.sampling.OneDtypeStaticCache": "rollout.static_cache.OneDtypeStaticCache",
}


def _longest(name: str, prefixes: Iterable[str]) -> str | None:
    """The longest of ``prefixes`` that is ``name`` or a dotted parent of it."""
    matches = [prefix for prefix in prefixes if name == prefix or name.startswith(prefix + ".")]
    return max(matches, key=len, default=None)


def new_name(fullname: str) -> str | None:
    """``lightning_ppo.engines.vllm`` -> ``lightning_ppo.rollout.engines.vllm``; None if not moved."""
    if not fullname.startswith(PACKAGE + "."):
        return None
    name = fullname.removeprefix(PACKAGE + ".")
    old = _longest(name, MOVED)
    return None if old is None else f"{PACKAGE}.{MOVED[old]}{name.removeprefix(old)}"


def old_name(module: str) -> str | None:
    """``lightning_ppo.rollout.engines.vllm`` -> ``lightning_ppo.engines.vllm``; None if not moved.
    The deepest move names it (``rollout.engines.server.client`` was ``rollout.engines.server_client``)."""
    homes = {f"{PACKAGE}.{new}": old for old, new in MOVED.items()}
    home = _longest(module, homes)
    return None if home is None else f"{PACKAGE}.{homes[home]}" + module.removeprefix(home)


def old_path_aliases(safe_globals: Iterable[Any]) -> list[tuple[Any, str]]:
    """``(each, a dotted name it had before it moved)`` for those of ``safe_globals`` that moved: its
    module's old name (MOVED), or the module it left (MOVED_CLASSES). ``(global, name)`` entries,
    a caller's own renames, are left as they are."""
    aliases = []
    for obj in safe_globals:
        module, qualname = getattr(obj, "__module__", None) or "", getattr(obj, "__qualname__", None)
        if isinstance(obj, tuple) or qualname is None:
            continue
        old_module, now = old_name(module), f"{module}.{qualname}"
        names = [f"{old_module}.{qualname}"] if old_module else []
        names += [f"{PACKAGE}.{old}" for old, new in MOVED_CLASSES.items() if f"{PACKAGE}.{new}" == now]
        aliases += [(obj, name) for name in names]
    return aliases


def with_old_paths(safe_globals: list[Any]) -> list[Any]:
    """``safe_globals`` plus ``(each, its dotted name before the move)`` for those that moved: the
    form ``torch.serialization.safe_globals`` takes for a renamed global, so that a file pickled under
    the old path loads with what the caller allows, and nothing else."""
    return [*safe_globals, *old_path_aliases(safe_globals)]


# The aliases old_paths_allowed added to torch's (process-wide) allow-list, each with how many
# readers inside it need it, and the allowing that removes it once the last one leaves.
_HELD: dict[tuple[Any, str], list[Any]] = {}
_HELD_LOCK = threading.Lock()


@contextmanager
def old_paths_allowed() -> Iterator[None]:
    """Within it, ``torch.load(weights_only=True)`` allows every global allowed now (by
    ``torch.serialization.add_safe_globals`` or ``safe_globals``) under its names before the move
    too: how the package's readers open a checkpoint (preflight, log continuity, export, resume),
    so that a user who allowed a class by its new path reads an old file, and nothing else is
    allowed. Aliases already allowed are left out, so leaving does not remove the user's own. The
    list is the process's, not the thread's: an alias stays while any reader needs it (one that
    left while another thread's was still reading took the alias from under it)."""
    with _HELD_LOCK:
        allowed = torch.serialization.get_safe_globals()
        present = set(allowed)
        ours = [alias for alias in old_path_aliases(allowed) if alias not in present or alias in _HELD]
        for alias in ours:
            if alias not in _HELD:
                allowing = torch.serialization.safe_globals([alias])
                allowing.__enter__()
                _HELD[alias] = [0, allowing]
            _HELD[alias][0] += 1
    try:
        yield
    finally:
        with _HELD_LOCK:
            for alias in ours:
                _HELD[alias][0] -= 1
                if not _HELD[alias][0]:
                    _HELD.pop(alias)[1].__exit__(None, None, None)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module itself, whose ``__spec__`` stays its own."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.target}; the old path keeps working for now",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The target module ran when it was imported. Between the two calls importlib set its
        ``__spec__`` to the old name's (the one attribute it sets on a module that has it): put its own
        back, or ``find_spec`` of the new name answers the alias and ``importlib.reload`` of the new
        module reloads the alias, renaming the module to its old name and running nothing."""
        module.__spec__ = self.own_spec


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds ``lightning_ppo.<old module>[.<submodule>]`` as its new module."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        moved_to = new_name(fullname)
        return None if moved_to is None else importlib.util.spec_from_loader(fullname, _Alias(moved_to))


def install() -> None:
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())


def forwarding(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from ``homes[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
