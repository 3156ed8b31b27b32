"""What a server's completion answer must hold before any of it reaches a rollout.

A server's answer is input from another process, maybe another version or a proxy: a token id
outside the vocabulary would be accepted here and fail later, far from its cause (an index error
in the embedding on CPU, a device-side assert on a GPU that poisons the whole CUDA context), and a
NaN log-prob would reach the loss. Each sample is checked as it arrives, and the first problem is
said in one line (the caller names the server and the route).
"""

from __future__ import annotations

import math
from typing import Any

Sample = tuple[list[int], list[float]]  # a sample's token ids and their log-probs


class BadAnswer(ValueError):
    """What is wrong with an answer, without the server's URL (the caller says it once)."""


def samples_of(answer: Any, n: int, vocab_size: int, max_new_tokens: int | None) -> list[Sample]:
    """The ``n`` samples of a completion answer (``choices`` in any order, each with its
    ``token_ids`` and ``logprobs.token_logprobs``), in order: every token an ``int`` id in
    ``[0, vocab_size)``, every log-prob a finite number ``<= 0`` (a sampled token's), as many of them as
    tokens, at most ``max_new_tokens`` of each. :class:`BadAnswer` says the first problem."""
    try:
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        raw = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]
    except (KeyError, IndexError, TypeError):
        raise BadAnswer(f"answered without token ids or log-probs: {str(answer)[:200]!r}") from None
    if len(raw) != n or any(
        not isinstance(t, list) or not isinstance(p, list) or len(t) != len(p) for t, p in raw
    ):
        raise BadAnswer(f"gave {len(raw)} samples (of {n}) or tokens without their log-probs")
    for tokens, logprobs in raw:
        _check(tokens, logprobs, vocab_size, max_new_tokens)
    return [(list(tokens), [float(x) for x in logprobs]) for tokens, logprobs in raw]


def _check(tokens: list[Any], logprobs: list[Any], vocab_size: int, max_new_tokens: int | None) -> None:
    if max_new_tokens is not None and len(tokens) > max_new_tokens:
        raise BadAnswer(f"answered {len(tokens)} tokens, more than max_new_tokens {max_new_tokens}")
    for token in tokens:
        # bool is an int to Python, and JSON's true is no token id
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise BadAnswer(
                f"answered token id {token!r}, not an id of the policy's vocabulary of {vocab_size} "
                f"(0 to {vocab_size - 1})"
            )
    for logprob in logprobs:
        number = isinstance(logprob, int | float) and not isinstance(logprob, bool)
        if not number or not math.isfinite(logprob) or logprob > 0:
            raise BadAnswer(
                f"answered the log-prob {logprob!r} for a sampled token, not a finite number <= 0"
            )
