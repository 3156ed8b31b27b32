"""The package's warnings, printed as its errors are: ``lightning-ppo: warning: MESSAGE``, one line.

Python prints a warning as ``/path/to/the/source.py:121: UserWarning: MESSAGE`` followed by the
source line; Lightning's own warnings keep the path and line number. A :class:`LightningPPOWarning`
is advice to the user about the run, not about a line of our code, so it drops both and reads like
the command's one-line errors (``lightning-ppo: error: ...``, :mod:`lightning_ppo.runs.errors`).
It stays a warning (a ``UserWarning``): filters, ``-W error``, ``warnings.catch_warnings`` and
``pytest.warns`` treat it as before. Every other warning is formatted as it was.
"""

from __future__ import annotations

import warnings

from lightning.pytorch.utilities import rank_zero_warn

from lightning_ppo.runs.errors import PROG


class LightningPPOWarning(UserWarning):
    """Advice about the run (a guardrail's), printed as ``lightning-ppo: warning: MESSAGE``."""


def one_line(message: str) -> str:
    """``message`` on one line: its lines joined by single spaces."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def warning_line(message: str) -> str:
    """How a :class:`LightningPPOWarning` prints (without the newline)."""
    return f"{PROG}: warning: {one_line(message)}"


def warn(message: str) -> None:
    """Warn the user, on rank 0, with ``message`` as one line (see :func:`warning_line`)."""
    rank_zero_warn(one_line(message), category=LightningPPOWarning)


_format_before = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    if isinstance(category, type) and issubclass(category, LightningPPOWarning):
        return warning_line(str(message)) + "\n"
    return _format_before(message, category, filename, lineno, line)


# Chained to the formatter in place (Lightning's, which lightning_ppo imports first): installed once.
if getattr(warnings.formatwarning, "__module__", None) != __name__:
    warnings.formatwarning = _format_warning
