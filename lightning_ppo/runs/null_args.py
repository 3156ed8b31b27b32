"""``--model.init_args.ppo.kl_target null`` on the command line: an optional config field set to null.

jsonargparse (4.53) refuses ``null`` for an optional field of a dataclass section inside a class's
``init_args`` (``expected float, got None``), while the same section given as JSON merges a null
fine. So ``--model.init_args.ppo.field null`` (or ``--model.ppo.field null``) is passed on as
``--model.init_args.ppo {"field": null}``, for the fields of the module's config dataclasses
(``ppo``, ``generation``, ``episode``) whose type allows ``None`` only: every other null is passed on
as given, for jsonargparse to accept or to refuse naming the field.

Where it goes: jsonargparse also refuses a null field that a later ``--section.other`` re-validates,
so the nulls are held back and given before the next ``--config`` or whole-section argument (which
then override them as they would any value), or at the end; the same field given again later
replaces its null.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from functools import cache

NULLS = ("null", "None", "~")
CONFIG_FLAGS = ("--config", "-c")


@cache
def optional_fields(module: type) -> dict[str, frozenset[str]]:
    """The config sections of ``module``'s ``__init__`` (``ppo``, ...) and their fields that may be None."""
    sections = {}
    for name, hint in typing.get_type_hints(module.__init__).items():
        if dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            sections[name] = frozenset(f for f, h in hints.items() if type(None) in typing.get_args(h))
    return sections


def _canonical(key: str, module: type) -> tuple[str, str] | None:
    """(section, field) of ``--model.init_args.S.F`` or ``--model.S.F``, S one of the module's config
    sections and F a field of it that may be None; else None."""
    parts = key.removeprefix("--").split(".")
    if parts[:2] == ["model", "init_args"]:
        parts = ["model", *parts[2:]]
    if len(parts) != 3 or parts[0] != "model":
        return None
    section, field = parts[1], parts[2]
    return (section, field) if field in optional_fields(module).get(section, ()) else None


def _section_of(key: str, module: type) -> str | None:
    """S for a whole-section argument ``--model.init_args.S`` or ``--model.S``."""
    parts = key.removeprefix("--").split(".")
    parts = ["model", *parts[2:]] if parts[:2] == ["model", "init_args"] else parts
    whole = len(parts) == 2 and parts[0] == "model" and parts[1] in optional_fields(module)
    return parts[1] if whole else None


def nulls_as_sections(args: list[str], module: type) -> list[str]:
    """``args`` with each null of an optional field of ``module``'s config sections as its section in
    JSON (module docstring)."""
    out: list[str] = []
    held: dict[tuple[str, str], None] = {}  # (section, field), in the order given

    def give(sections: set[str] | None = None) -> None:
        for section, field in [k for k in held if sections is None or k[0] in sections]:
            out.extend([f"--model.init_args.{section}", json.dumps({field: None})])
            del held[(section, field)]

    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        target = _canonical(key, module) if key.startswith("--") else None
        if target is not None and value in NULLS:
            held.pop(target, None)
            held[target] = None
            i += 1 if eq else 2
            continue
        if target is not None:
            held.pop(target, None)  # given again: the later value wins
        elif key in CONFIG_FLAGS:
            give()
        elif key.startswith("--") and _section_of(key, module) is not None:
            give({_section_of(key, module)})
        out.append(args[i])
        i += 1
    give()
    return out
