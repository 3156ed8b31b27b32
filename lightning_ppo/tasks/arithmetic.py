"""A tool task: arithmetic questions, a calculator the policy may call, and a reward for the answer.

Prompt ``"what is 12*7? "``. The policy can answer at once or call the calculator first
(``call calculator: 12*7`` in the ``text`` tool format; the observation is ``result: 84;``) and
then answer. :class:`AnswerReward` pays 1.0 when the episode's last reply is the right number.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

import datasets

from lightning_ppo.data import PromptDataModule
from lightning_ppo.rewards import ScoreInputs

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, +, -, * and / (no names, no calls).

    Args:
        expression: The expression, e.g. ``12*7``.
    """
    return _format(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def arithmetic_prompts(num: int, seed: int) -> dict[str, list[str]]:
    """``num`` two-number questions (``what is 12*7? ``) with their answers."""
    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "answer": []}
    for _ in range(num):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        rows["prompt"].append(f"what is {a}{op}{b}? ")
        rows["answer"].append(calculator(f"{a}{op}{b}"))
    return rows


class ArithmeticDataModule(PromptDataModule):
    """Generated arithmetic questions, with the answer in the ``answer`` column."""

    def __init__(self, num_prompts: int = 10000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_prompts = num_prompts

    def load_dataset(self) -> datasets.DatasetDict:
        data = arithmetic_prompts(self.num_prompts, self.seed)
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict(data)})


class AnswerReward:
    """1.0 when the episode's last reply (after the last tool result) is the ``answer`` column's number."""

    def __call__(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> list[float]:
        answers = batch.extras["answer"]
        return [float(_last_reply(c) == a) for c, a in zip(completions, answers, strict=True)]


def _last_reply(episode: str) -> str:
    return episode.rsplit(";", 1)[-1].strip()
