r"""Math with verifiable answers (GSM8K, MATH): 1.0 when a completion's final answer is right, 0.0 if not.

- The ground truth comes from a dataset column (``answer``). GSM8K's answers are a worked solution
  whose last line is ``#### 72``: the text after the last ``####`` is the answer; a column without
  ``####`` is the answer as it is (``72``, ``\frac{1}{2}``, ``(1, 2)``), read as LaTeX. One that
  reads as no number or expression stops the run with one line naming the row.
- The completion's final answer is its last ``\boxed{...}`` that holds something, else its last
  ``<answer>...</answer>``, else a number or math after "the answer is", else its last number or
  math. :mod:`lightning_ppo.tasks.math_reading` has the rules; Hugging Face's ``math-verify`` (as
  TRL's math rewards use it) reads the LaTeX and compares: ``\boxed{1/2}`` equals ``0.5``, ``1,000``
  equals ``1000``, ``$5.00`` equals ``5``, ``\boxed{\sqrt{12}}`` equals ``2\sqrt{3}``. No answer
  scores 0.0, and so does ``\boxed{73 = 72}`` against 72.
- Each batch is checked in ``workers`` processes within ``batch_timeout`` seconds, each answer
  within ``answer_timeout`` (:mod:`lightning_ppo.tasks.math_checkers`): an answer not checked in
  time (``\boxed{9^{9^{9^{9}}}}``) scores 0.0 and counts in ``reward/timed_out``.
- ``format_weight`` adds an optional format term: that weight for a completion that writes its
  answer as ``format_pattern`` asks (``\boxed{...}`` by default), so a score is at most
  ``1 + format_weight``.

Use it in YAML by class path (``lightning_ppo.tasks.math_answer.MathAnswerReward``) or import path
(``lightning_ppo.tasks.math_answer.math_answer_reward``); in Python both are also
``lightning_ppo.MathAnswerReward`` and ``lightning_ppo.math_answer_reward``. Hand
``math_answer_reward`` to TRL's trainers: both take TRL's keywords (``completions`` and the
dataset's columns). Each batch logs ``reward/accuracy`` and the sample tables' ``correct`` column;
validation logs it as ``eval/accuracy``.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lightning_ppo.rewards import ACCURACY_COLUMN
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn
from lightning_ppo.tasks.math_checkers import checkers
from lightning_ppo.tasks.math_reading import final_answer, gsm8k_answer, is_correct, read, truth_answer

__all__ = [
    "BOXED",
    "BOXED_INSTRUCTION",
    "MathAnswerReward",
    "final_answer",
    "gsm8k_answer",
    "is_correct",
    "math_answer_reward",
]

# The instruction Qwen2.5's math models are trained with, and what the format term looks for.
BOXED_INSTRUCTION = r"Please reason step by step, and put your final answer within \boxed{}."
BOXED = r"\\boxed\{\s*[^\s}]"
# math-verify stops a parse after this many seconds (by SIGALRM: main thread only).
_TIMEOUT_S = 5


def _timeout() -> int | None:
    """math-verify's timeouts use ``signal.alarm``, which only the main thread may set."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _check_bounds(workers: int, answer_timeout: float, batch_timeout: float) -> None:
    """One line naming a setting that cannot work (NaN included)."""
    if workers < 0:
        raise UsageError(f"MathAnswerReward workers must be 0 or more, got {workers}")
    if not answer_timeout > 0:
        raise UsageError(
            f"MathAnswerReward answer_timeout must be more than 0 seconds, got {answer_timeout!r}"
        )
    if not batch_timeout >= answer_timeout:
        raise UsageError(
            f"MathAnswerReward batch_timeout must be at least answer_timeout ({answer_timeout:g} s), "
            f"got {batch_timeout!r}"
        )


def _text(completion: Any) -> str:
    """A completion's text; TRL hands conversational completions as ``[{"role", "content"}]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


class MathAnswerReward:
    """1.0 for a right final answer, 0.0 otherwise, plus ``format_weight`` for the asked-for format.

    Args:
        answer_column: The dataset column holding the ground truth (GSM8K: ``answer``).
        format_weight: Added when the completion matches ``format_pattern``; 0 (default) for none.
        format_pattern: A regular expression (``re.search``) of the format the prompt asks for;
            default: a non-empty ``\\boxed{...}``.
        workers: Processes that check answers (started on first use, shared by the rewards of this
            process); default: 4, or the CPUs if fewer. 0: in this process, one answer after
            another, and nothing bounds the batch (math-verify's timeouts, on the main thread only).
        answer_timeout: Seconds one answer may take to check (math-verify's own default: 5).
        batch_timeout: Seconds a batch's answers may take all together; those not checked by then
            score 0.0 and count in ``reward/timed_out`` (the share of the batch).
    """

    def __init__(
        self,
        answer_column: str = "answer",
        format_weight: float = 0.0,
        format_pattern: str = BOXED,
        workers: int | None = None,
        answer_timeout: float = 5.0,
        batch_timeout: float = 10.0,
    ):
        self.answer_column = answer_column
        self.format_weight = float(format_weight)
        try:
            self._format = re.compile(format_pattern)
        except re.error as err:
            raise UsageError(
                f"MathAnswerReward format_pattern {format_pattern!r} is not a regex: {err}"
            ) from err
        self.workers = min(4, os.cpu_count() or 1) if workers is None else int(workers)
        self.answer_timeout = float(answer_timeout)
        self.batch_timeout = float(batch_timeout)
        _check_bounds(self.workers, self.answer_timeout, self.batch_timeout)
        self._warned = False

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        log_extra: Callable[[str, list], None] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **columns: Any,
    ) -> list[float]:
        if self.answer_column not in columns:
            shown = sorted(k for k in columns if k not in ("completion_ids", "trainer_state"))
            raise UsageError(
                f"MathAnswerReward needs the ground truth in the dataset column {self.answer_column!r} "
                f"(answer_column); the batch has the columns {shown}"
            )
        values = [str(value) for value in columns[self.answer_column]]
        for row, (value, prompt) in enumerate(zip(values, prompts, strict=True)):
            self.truth(value, row, _text(prompt))
        texts = [_text(c) for c in completions]
        pairs = list(zip(values, texts, strict=True))
        checked = checkers(self.workers).check(pairs, self.answer_timeout, self.batch_timeout)
        correct = [float(bool(right)) for right in checked]
        late = [text for text, right in zip(texts, checked, strict=True) if right is None]
        self._warn_late(late, len(texts))
        if log_extra is not None:
            log_extra(ACCURACY_COLUMN, correct)
        if log_metric is not None and correct:
            log_metric("accuracy", sum(correct) / len(correct))
            log_metric("timed_out", len(late) / len(correct))
        if not self.format_weight:
            return correct
        return [
            c + self.format_weight * bool(self._format.search(t)) for c, t in zip(correct, texts, strict=True)
        ]

    def _warn_late(self, late: list[str], total: int) -> None:
        """Once per reward: answers that took too long to check are scored 0.0, not waited for."""
        if late and not self._warned:
            self._warned = True
            warn(
                f"MathAnswerReward: {len(late)} of {total} answers were not checked within answer_timeout "
                f"{self.answer_timeout:g} s or batch_timeout {self.batch_timeout:g} s and score 0.0 "
                f"(reward/timed_out), such as {final_answer(late[0])!r:.80}"
            )

    def truth(self, value: Any, row: int = 0, prompt: str = "") -> tuple[Any, ...]:
        """The ground truth of one row as read (a sympy value); one that reads as nothing is a one-line
        error naming it, with its prompt's start (the batch's row number alone does not find it)."""
        answer = truth_answer(value)
        parsed = read(answer, _timeout()) if answer is not None else ()
        if not parsed:
            asked = f", prompt {' '.join(prompt.split())[:60]!r}" if prompt else ""
            raise UsageError(
                f"MathAnswerReward: the ground truth of row {row} of this batch{asked} (column "
                f"{self.answer_column!r}: {str(value)[-80:]!r}) is no number or expression math-verify can "
                "read; GSM8K's answers end with a line '#### <number>', a plain answer column holds the "
                "answer alone (72, 0.5, \\frac{1}{2})"
            )
        return parsed


_DEFAULT = MathAnswerReward()


def math_answer_reward(
    prompts: list[Any], completions: list[Any], answer: list[Any], **kwargs: Any
) -> list[float]:
    """TRL's way: 1.0 where a completion's final answer equals the ``answer`` column's, else 0.0."""
    return _DEFAULT(prompts, completions, answer=answer, **kwargs)
