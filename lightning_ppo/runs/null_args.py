"""``--model.init_args.ppo.kl_target null`` on the command line: setting a nested config field to null.

jsonargparse (4.53) refuses ``null`` for an optional field of a dataclass section inside a class's
``init_args`` (``expected float, got None``), while the same section given as JSON merges a null
fine. So ``--a.b.field null`` is passed on as ``--a.b {"field": null}``: the section's other fields
keep their values, set before or after. Only fields of a nested section are rewritten (their parent
key has a dot and is not ``init_args``): ``--trainer.max_steps null`` and ``--model.init_args.value
null`` parse as they are.
"""

from __future__ import annotations

import json

NULLS = ("null", "None", "~")


def nulls_as_sections(args: list[str]) -> list[str]:
    """``args`` with each ``--section.field null`` (or ``=null``) of a nested section moved to the end as
    ``--section {"field": null}``: jsonargparse also refuses a null section field that another
    ``--section.other`` given after it re-validates. A null set again later is dropped (the last wins)."""
    kept: list[str] = []
    nulls: dict[str, tuple[str, str]] = {}  # key -> (section, field), in the order given
    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        step = 1 if eq else 2
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        section, _, field = key.removeprefix("--").rpartition(".")
        nested = key.startswith("--") and "." in section and not section.endswith("init_args")
        if nested and field.isidentifier() and value in NULLS:
            nulls.pop(key, None)
            nulls[key] = (section, field)
            i += step
            continue
        nulls.pop(key, None)  # set again after the null: the later value wins
        kept.append(args[i])
        i += 1
    for section, field in nulls.values():
        kept += [f"--{section}", json.dumps({field: None})]
    return kept
