"""How a completion request keeps ``generation.suppress_tokens`` from being sampled.

vLLM's completions route takes two encodings. ``allowed_token_ids`` lists the ids that may be
sampled and masks every other logit to -inf: exactly the distribution the trainer's log-probs
assume (:func:`lightning_ppo.ppo.functional.logprobs_from_logits` with the suppressed ids). But it
lists the whole rest of the vocabulary: at 151,936 tokens with two suppressed, about 1 MB of JSON
in every request, which the server parses per request. ``logit_bias`` names the suppressed ids
alone, with -100 (vLLM clamps a bias to [-100, 100] and adds it before the temperature divides
the logits): a suppressed token keeps e^(-100 / temperature) of its odds, which is not a mask, but
is below float32's resolution next to the others unless the model puts that token's logit about
100 above theirs. Each request sends the smaller of the two in bytes; a wildcard pattern that
suppresses most of the vocabulary goes as ``allowed_token_ids``. Where ``logit_bias`` went and a
suppressed id came back anyway, the engine asks again with ``allowed_token_ids``
(:meth:`~lightning_ppo.rollout.engines.server.VLLMServerEngine._exact_again`), so the promise
that no suppressed token is ever sampled stays exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

# The lowest bias vLLM accepts: it clamps to [-100, 100] (sampling_params.py, vLLM 0.32).
BIAS = -100


@dataclass(frozen=True)
class Suppression:
    """The ids never to sample (``ids``, inside a vocabulary of ``vocab_size``) as request fields."""

    ids: frozenset[int]
    vocab_size: int

    @cached_property
    def allowed(self) -> list[int]:
        return [i for i in range(self.vocab_size) if i not in self.ids]

    @cached_property
    def bias(self) -> dict[str, int]:
        return {str(i): BIAS for i in sorted(self.ids)}

    @cached_property
    def biased(self) -> bool:
        """``logit_bias`` is the smaller encoding (measured once, as JSON: an entry of it is about
        twice an entry of the allowed list, so it wins while under a third of the ids are suppressed)."""
        return bool(self.ids) and len(json.dumps(self.bias)) < len(json.dumps(self.allowed))

    def fields(self, exact: bool = False) -> dict[str, Any]:
        """The request's fields: the smaller encoding, or ``allowed_token_ids`` where ``exact``."""
        if not self.ids:
            return {}
        if self.biased and not exact:
            return {"logit_bias": self.bias}
        return {"allowed_token_ids": self.allowed}

    def first_in(self, tokens: Iterable[int]) -> int | None:
        """The first suppressed id among ``tokens``, or None."""
        return next((token for token in tokens if token in self.ids), None)


@lru_cache(maxsize=8)
def _suppression(ids: tuple[int, ...], vocab_size: int) -> Suppression:
    return Suppression(frozenset(i for i in ids if 0 <= i < vocab_size), vocab_size)


def suppression(ids: Sequence[int] | None, vocab_size: int) -> Suppression:
    """``ids`` (an HF generation config's ``suppress_tokens``) as a :class:`Suppression`, built once
    per set of ids: the allowed list and the size comparison are not redone for every request. Ids
    outside the vocabulary are dropped: they cannot be sampled, and vLLM refuses them in a bias."""
    return _suppression(tuple(ids or ()), vocab_size)
