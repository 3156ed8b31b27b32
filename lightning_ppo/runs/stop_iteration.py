"""A ``StopIteration`` out of user code inside a step is the user's error, not the end of the data.

Lightning's loops take any ``StopIteration`` a step raises for the end of its dataloader (the
training epoch loop's ``except StopIteration: break``, the evaluation loop's too). So a ``next()``
over no match in a user's ``score`` override, or in a callback hook that runs inside
``training_step`` (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``),
ended the epoch in silence: a shorter run that looked finished. As Python does for a generator
(PEP 479), it becomes a ``RuntimeError`` here, whose one line names the hook; its traceback, a bug's,
is kept (``raise ... from``). Rewards have their own (``scoring._called``).

The hooks Lightning's loops call outside a step (a callback's or the module's ``on_train_batch_start``
and ``_end``, ``on_train_epoch_start`` and ``_end``, ``on_validation_batch_start`` and ``_end``) are
in the same place: a ``next()`` bug there ended the epoch, the fit or the validation as if done (on
2 gloo ranks the one that stopped exited 0, the other failed in its next all-reduce naming no hook).
A Lightning user ends an epoch by returning -1 from ``on_train_batch_start`` and a fit by
``trainer.should_stop``, never by raising StopIteration, so :func:`loops_name_hook_stops` makes it
the same error; and the same for the hooks a loop calls as it starts or ends (``on_train_start``,
``on_validation_start``, ``on_train_end``...), whose StopIteration came out of ``fit`` bare. The loops' own
StopIterations (the data running out, the -1 return) pass through no hook and still end the loop.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

# Where Lightning calls a hook (``_call_callback_hooks``, ``_call_lightning_module_hook``): the frame
# under its last one is the hook that raised.
_LIGHTNING_CALLS = os.path.join("lightning", "pytorch", "trainer", "call.py")

Step = TypeVar("Step", bound=Callable[..., Any])


class StopIterationIsAnError:
    """Turn a ``StopIteration`` raised inside into ``RuntimeError("<hook> raised StopIteration: ...")``,
    naming the Lightning hook it came out of, else ``where``.

    A class, not ``@contextmanager``: contextlib takes a RuntimeError caused by a StopIteration for
    PEP 479's and raises the StopIteration again.
    """

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if isinstance(err, StopIteration):
            raise RuntimeError(f"{hook_that_raised(err) or self.where} raised StopIteration: {err}") from err


def no_silent_stop(step: Step) -> Step:
    """A module's step method under :class:`StopIterationIsAnError`, named as ``Class.step``."""

    @functools.wraps(step)
    def guarded(module: Any, *args: Any, **kwargs: Any) -> Any:
        with StopIterationIsAnError(f"{type(module).__name__}.{step.__name__}"):
            return step(module, *args, **kwargs)

    return guarded  # type: ignore[return-value]


# The loop methods that call hooks (Lightning 2.x): each loop's attribute path from the trainer, and
# its methods. Those inside a ``try: ... except StopIteration: break`` ended the loop in silence;
# ``on_run_start`` and ``on_run_end`` (``on_train_start``, ``on_validation_start``, their ``_end``s,
# the evaluation epoch's) are outside it: the StopIteration came out of ``fit`` or ``validate`` bare.
# A name a Lightning version lacks is left as it is: its loop then behaves as Lightning's does.
_EDGES = ("on_run_start", "on_run_end")
_GUARDED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fit_loop", ("on_advance_start", "on_advance_end", *_EDGES)),
    ("fit_loop.epoch_loop", ("advance", "on_advance_end")),
    ("fit_loop.epoch_loop.val_loop", ("_evaluation_step", *_EDGES)),
    ("validate_loop", ("_evaluation_step", *_EDGES)),
)


# The hooks that may consume a ``dataloader_iter`` (the strategy's, which call the module's), whose
# StopIteration is the data's end in the loops of ``_GUARDED``.
_DATA_STEPS = frozenset({"training_step", "validation_step"})


def loops_name_hook_stops(trainer: Any) -> None:
    """Make a ``StopIteration`` out of a hook that ``trainer``'s loops call outside a step a
    ``RuntimeError`` naming the hook; once per trainer (its loops' methods are wrapped in place)."""
    for path, names in _GUARDED:
        loop = functools.reduce(getattr, path.split("."), trainer)
        for name in names:
            method = getattr(loop, name, None)
            if method is not None and not getattr(method, "_names_hook_stops", False):
                setattr(loop, name, _naming_hook_stops(method))


def _naming_hook_stops(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except StopIteration as err:
            hook = hook_that_raised(err)
            # none: the loop's own (the data's end, a -1 return); a step's: the end of the
            # ``dataloader_iter`` a step consumes (the package's own steps name theirs already).
            # Only a step: ``optimizer_step``, ``on_before_optimizer_step``, ``lr_scheduler_step``
            # consume no data, and automatic optimization calls them from the loop.
            if hook is None or hook.rpartition(".")[2] in _DATA_STEPS:
                raise
            raise RuntimeError(f"{hook} raised StopIteration: {err}") from err

    guarded._names_hook_stops = True  # type: ignore[attr-defined]
    return guarded


def hook_that_raised(err: BaseException) -> str | None:
    """``Class.hook`` of the last hook Lightning called on the way to ``err``; ``None`` if none."""
    hook = None
    under_a_call = False
    frame = err.__traceback__
    while frame is not None:
        if under_a_call:
            hook = _method_name(frame.tb_frame)
        under_a_call = frame.tb_frame.f_code.co_filename.endswith(_LIGHTNING_CALLS)
        frame = frame.tb_next
    return hook


def _method_name(frame: FrameType) -> str:
    owner = frame.f_locals.get("self")
    name = frame.f_code.co_name
    return name if owner is None else f"{type(owner).__name__}.{name}"
