"""The closest valid key to a misspelt one in a config or on the command line: ``did you mean kl_coef?``.

jsonargparse names an unknown key in four ways, depending on where it sits and where it was given:

- ``Group 'ppo' does not accept option 'kl_coeff'`` (a dataclass group of a class, from YAML),
- ``unrecognized arguments: --ppo.kl_coeff=0.1`` (the same on the command line),
- ``Option 'batch_sise' is not accepted`` (an argument of a class selected by ``class_path``),
- ``Subcommand 'fit' does not accept option 'trainer.max_step'`` or ``unrecognized arguments:
  --trainer.max_stepz 3`` (a key of the command itself: ``trainer``, ``ckpt_path``, ...).

The valid keys are those of the class named by the nearest ``class_path`` in the report (read from
its signature by jsonargparse, as the parser does), or of the subcommand's own parser.
"""

from __future__ import annotations

import difflib
import re
from importlib import import_module
from typing import Any

from jsonargparse import ArgumentParser

_CLASS_PATH = re.compile(r"class_path[ =]'([\w.]+)'")
_GROUP = re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'")
_OPTION = re.compile(r"Option '([\w.]+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: --([\w.]+)")
_SUBCOMMAND = re.compile(r"Subcommand '(\w+)' does not accept option '([\w.]+)'")


def closest(word: str, keys: list[str]) -> str | None:
    """The key of ``keys`` closest to ``word`` (dotted keys: within the longest group both share)."""
    parts = word.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:depth])
        start = f"{prefix}." if prefix else ""
        siblings = [key[len(start) :] for key in keys if key.startswith(start)]
        if siblings:
            match = difflib.get_close_matches(".".join(parts[depth:]), siblings, n=1, cutoff=0.6)
            return start + match[0] if match else None
    return None


def class_keys(class_path: str) -> list[str]:
    """Every key the parser accepts under ``init_args`` of ``class_path`` (``ppo.kl_coef``, ...)."""
    module_name, _, name = class_path.rpartition(".")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(getattr(import_module(module_name), name))
    return list(parser.get_defaults().keys())


def parser_keys(parser: Any, subcommand: str | None) -> list[str]:
    """Every key of ``subcommand``'s parser (``trainer.max_steps``, ``ckpt_path``, ...)."""
    action = getattr(parser, "_subcommands_action", None)
    if action is not None and subcommand in action._name_parser_map:
        parser = action._name_parser_map[subcommand]
    return list(parser.get_defaults().keys())


def suggestion(message: str, parser: Any, argv: list[str] | None = None) -> str | None:
    """``did you mean KEY?`` for the unknown key a jsonargparse error ``message`` reports, else None.

    ``argv``: the command line parsed (its first word names the subcommand).
    """
    words = [a for a in argv or () if isinstance(a, str) and not a.startswith("-")]
    subcommand = words[0] if words else None
    class_path = None
    for line in message.splitlines():
        found = _CLASS_PATH.search(line)
        class_path = found[1] if found else class_path
        group, option = _GROUP.search(line), _OPTION.search(line)
        unrecognized, top = _UNRECOGNIZED.search(line), _SUBCOMMAND.search(line)
        if not (group or option or unrecognized or top):
            continue
        try:
            if top or (unrecognized and class_path is None):
                word = top[2] if top else unrecognized[1]
                key = closest(word, parser_keys(parser, top[1] if top else subcommand))
            elif class_path is not None:
                word = f"{group[1]}.{group[2]}" if group else option[1] if option else unrecognized[1]
                key = closest(word, class_keys(class_path))
                key = key.removeprefix(f"{group[1]}.") if group and key else key
            else:
                return None
        except Exception:  # a suggestion is a courtesy: never let it hide the error it explains
            return None
        return f"did you mean {key}?" if key else None
    return None
