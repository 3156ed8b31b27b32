r"""Math with verifiable answers (GSM8K, MATH): 1.0 when a completion's final answer is right, 0.0 if not.

The comparison is Hugging Face's ``math-verify`` (as TRL's math rewards use it): ``\boxed{1/2}``
equals ``0.5``, ``1,000`` equals ``1000``, ``$5.00`` equals ``5``. Nothing here parses numbers or
LaTeX by hand.

- The ground truth comes from a dataset column (``answer``). GSM8K's answers are a worked solution
  whose last line is ``#### 72``: the text after the last ``####`` is the answer; a column without
  ``####`` is the answer as it is (``72``, ``\frac{1}{2}``). One that parses as no number or
  expression stops the run with one line naming the row.
- The completion's final answer is its last ``\boxed{...}``; without one, math-verify's reading of
  the text: an answer after "the final answer is", else the last number. No answer scores 0.0.
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

import functools
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lightning_ppo.rewards import ACCURACY_COLUMN
from lightning_ppo.runs.errors import UsageError

# The instruction Qwen2.5's math models are trained with, and what the format term looks for.
BOXED_INSTRUCTION = r"Please reason step by step, and put your final answer within \boxed{}."
BOXED = r"\\boxed\{\s*[^\s}]"
# math-verify stops a parse or comparison after this many seconds (by SIGALRM: main thread only).
_TIMEOUT_S = 5


def gsm8k_answer(value: Any) -> str:
    """The answer in a ground-truth value: the text after the last ``####`` (GSM8K's solutions end
    with ``#### 72``), else the whole value; surrounding blanks and thousands separators removed."""
    text = str(value)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "")


def _verify_module() -> Any:
    """``math_verify``, imported on first use (sympy and its grammar take a second to load)."""
    import math_verify

    return math_verify


def _timeout() -> int | None:
    """math-verify's timeouts use ``signal.alarm``, which only the main thread may set."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def _parse_truth(answer: str) -> tuple[Any, ...]:
    """A ground truth as math-verify reads it (a plain number, an expression, LaTeX); cached:
    every epoch and every completion of a group asks again."""
    mv = _verify_module()
    config = [mv.ExprExtractionConfig(), mv.LatexExtractionConfig()]
    return tuple(mv.parse(answer, extraction_config=config, parsing_timeout=_timeout()))


def final_answer(text: str) -> list[Any]:
    """A completion's final answer as math-verify reads it (``[value, text]``): its last ``\\boxed{}``
    first, else an anchored answer ("the final answer is 7") or the last number; ``[]`` for none."""
    mv = _verify_module()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return mv.parse(text, extraction_config=config, parsing_timeout=_timeout())


def is_correct(completion: str, truth: Sequence[Any]) -> bool:
    """Whether ``completion``'s final answer equals the parsed ground truth ``truth``."""
    answer = final_answer(completion)
    if not answer:
        return False
    return bool(_verify_module().verify(list(truth), answer, timeout_seconds=_timeout()))


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
    """

    def __init__(
        self, answer_column: str = "answer", format_weight: float = 0.0, format_pattern: str = BOXED
    ):
        self.answer_column = answer_column
        self.format_weight = float(format_weight)
        try:
            self._format = re.compile(format_pattern)
        except re.error as err:
            raise UsageError(
                f"MathAnswerReward format_pattern {format_pattern!r} is not a regex: {err}"
            ) from err

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
        pairs = enumerate(zip(columns[self.answer_column], prompts, strict=True))
        truths = [self.truth(value, row, _text(prompt)) for row, (value, prompt) in pairs]
        texts = [_text(c) for c in completions]
        correct = [float(is_correct(text, truth)) for text, truth in zip(texts, truths, strict=True)]
        if log_extra is not None:
            log_extra(ACCURACY_COLUMN, correct)
        if log_metric is not None and correct:
            log_metric("accuracy", sum(correct) / len(correct))
        if not self.format_weight:
            return correct
        return [
            c + self.format_weight * bool(self._format.search(t)) for c, t in zip(correct, texts, strict=True)
        ]

    def truth(self, value: Any, row: int = 0, prompt: str = "") -> tuple[Any, ...]:
        """The parsed ground truth of one row; one that does not parse is a one-line error naming it,
        with its prompt's start (the batch's row number alone does not find it in the dataset)."""
        answer = gsm8k_answer(value)
        parsed = _parse_truth(answer) if answer else ()
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
