"""Ctrl-C that the training loop does not handle: one line and exit status 130, never a traceback.

Once training runs, :class:`~lightning_ppo.checkpoint.PPOCheckpoint` turns the first Ctrl-C into
"finish the iteration, save, stop" (exit status 130); a second one aborts at once. Before that, a
run is importing torch, loading models, tokenizing prompts or setting up the Trainer: Python raised
``KeyboardInterrupt`` with a traceback into whatever library was running, and inside ``fit``
Lightning answered it with "attempting graceful shutdown" and exit status 1. Here every one of those
ends in one line saying what was saved, and status 130 (128 + SIGINT, as a shell reports it).

Only the standard library is imported: the console script enters :func:`ctrl_c_exits` before the
first heavy import.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from lightning_ppo.runs.quiet import DropMessages

INTERRUPTED_EXIT_CODE = 130
# Lightning's own line for a KeyboardInterrupt inside fit; ours replaces it.
_LIGHTNING_SHUTDOWN = ("lightning.pytorch.utilities.rank_zero", "\nDetected KeyboardInterrupt")

_training_started = False


def training_started() -> None:
    """Called when the first PPO iteration is about to run: from then on checkpoints may exist."""
    global _training_started
    _training_started = True


@contextmanager
def ctrl_c_exits(prog: str = "lightning-ppo") -> Iterator[None]:
    """Turn a ``KeyboardInterrupt`` raised inside, or Lightning's ``sys.exit(1)`` after one, into
    ``PROG: MESSAGE`` on stderr (rank 0 only) and exit status 130."""
    global _training_started
    _training_started = False
    name, prefix = _LIGHTNING_SHUTDOWN
    shutdown_line = DropMessages(prefix)
    logging.getLogger(name).addFilter(shutdown_line)
    try:
        yield
    except KeyboardInterrupt as err:
        _exit(prog, err)
    except SystemExit as err:
        # Lightning's exit(1) while handling one (not this module's exit, seen by an outer use of it)
        if isinstance(err.__context__, KeyboardInterrupt) and not isinstance(err, _Reported):
            _exit(prog, err.__context__)
        raise
    finally:
        logging.getLogger(name).removeFilter(shutdown_line)


def _exit(prog: str, err: KeyboardInterrupt) -> NoReturn:
    if str(err):  # the reason given where it was raised (a second Ctrl-C during training)
        what = str(err)
    elif _training_started:
        what = "interrupted (Ctrl-C) during training; the checkpoints it had written are kept"
    else:
        what = "interrupted (Ctrl-C) before training started; nothing was trained or saved"
    if _is_rank_zero():
        sys.stderr.write(f"{prog}: {what}\n")
    raise _Reported(INTERRUPTED_EXIT_CODE)


class _Reported(SystemExit):
    """The exit after the line is written."""


def _is_rank_zero() -> bool:
    """From the launchers' environment (Lightning's, torchrun, SLURM), as Lightning reads it; but a
    ``LOCAL_RANK`` (or no rank yet) is the rank on its node: Lightning's multi-node launcher numbers the
    nodes by ``NODE_RANK`` and gives each node's first process ``LOCAL_RANK`` 0, so every node's first
    process would take itself for rank 0."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            break
    else:
        key = "LOCAL_RANK"
    if key == "LOCAL_RANK":
        return os.environ.get(key, "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
    return os.environ[key] == "0"
