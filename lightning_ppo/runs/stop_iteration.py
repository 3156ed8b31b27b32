"""A ``StopIteration`` out of user code inside a step is the user's error, not the end of the data.

Lightning's loops take any ``StopIteration`` a step raises for the end of its dataloader (the
training epoch loop's ``except StopIteration: break``, the evaluation loop's too). So a ``next()``
over no match in a user's ``score`` override, or in a callback hook that runs inside
``training_step`` (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``),
ended the epoch in silence: a shorter run that looked finished. As Python does for a generator
(PEP 479), it becomes a ``RuntimeError`` here, whose one line names the hook; its traceback, a bug's,
is kept (``raise ... from``). Rewards have their own (``scoring._called``).
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
