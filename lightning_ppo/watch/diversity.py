"""How varied a batch's answers are: what a rising score alone does not show.

A policy that finds one phrase the reward likes can answer every prompt with it while its score
rises (reward hacking). These are read from the decoded responses, on the host, once per iteration:

- ``diversity/top_share``: of the batch's distinct prompts, the share that got the most common
  answer (answers compared after :func:`normalise`: case, spacing and the punctuation that ends a
  sentence or quotes a word ignored, so near-copies count as one; signs, operators and decimal
  marks kept, so ``-12`` and ``12``, ``x+y`` and ``x-y``, ``3.5`` and ``3,5`` stay different).
  Groups of one prompt (GRPO) count once per prompt.
- ``diversity/distinct_1``, ``diversity/distinct_2``: distinct words and word pairs over all the
  batch's responses, as a share of all (1.0: no word repeats anywhere).
- ``diversity/overlap``: the mean word overlap (Jaccard) between responses to different prompts.

Not logged, for the converging-answers guardrail: near-copies that are not the same answer (a
shared ending after different first words, a phrase the reward pays inside varied text). The
:attr:`Diversity.shared` part is the longest stretch of text (spacing collapsed, at least
:data:`MIN_SHARED_CHARS` characters) found in the answers of at least half of the distinct prompts,
with how many prompts' answers hold it and how much of those answers it makes up. Characters, not
words: text without spaces (Chinese, digits) has near-copies too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain, combinations
from typing import Any

import torch
from torch import Tensor

# Responses the overlap compares at most (130k set comparisons per iteration for a batch of 512
# otherwise), taken a prompt at a time: the first response of every prompt, then the second...
# The first 64 rows of a batch with num_generations >= 64 are all one prompt's: no pair at all.
MAX_OVERLAP_RESPONSES = 64
# What a word may end with (or be wrapped in) that does not change the answer: a sentence's end, a
# quote, a bracket. Only at a word's edges: inside one (3.5, x+y) and in front of a number (-12) it
# is the answer. A word made only of these (a lone "!") goes.
_TRAILING = ".,;:!?\u2026"
_WRAPPING = "\"'`()[]{}<>\u201c\u201d\u2018\u2019\u00ab\u00bb"
# The shared part: at least this many characters, in the answers of at least this share of the
# distinct prompts; grown a character at a time from the most common seeds, to at most
# MAX_SHARED_CHARS (a longer one is as telling, and the search stays linear in the batch's text).
MIN_SHARED_CHARS = 5
SHARED_PROMPTS = 0.5
SHARED_SEEDS = 4
MAX_SHARED_CHARS = 400
# Occurrences of the part read in each answer, the first ones: an answer that repeats one text
# thousands of times (a collapsed policy) holds nothing more to grow from than its first few.
MAX_OCCURRENCES = 64


def normalise(text: str) -> str:
    """An answer as the near-duplicate check compares it: lower case, single spaces, each word without
    the sentence punctuation after it and the quotes or brackets around it (``"Yes!"`` is ``yes``)."""
    words = (word.strip(_WRAPPING).rstrip(_TRAILING).strip(_WRAPPING) for word in text.lower().split())
    return " ".join(word for word in words if word)


@dataclass(frozen=True)
class Diversity:
    """One batch's diversity, and its most common answer (for the guardrail's message)."""

    top_share: float
    distinct_1: float
    distinct_2: float
    overlap: float
    prompts: int  # distinct prompts in the batch
    top_answer: str  # an example of the most common answer, as the policy wrote it
    shared: str = ""  # the longest text in the answers of half the prompts or more ("" if none)
    shared_share: float = 0.0  # the share of the distinct prompts whose answers hold it
    shared_cover: float = 0.0  # how much of those answers it is (mean share of their characters)

    @classmethod
    def of(cls, prompts: list[str], completions: list[str]) -> Diversity:
        words = [normalise(c).split() for c in completions]
        top_share, top_answer = _top_answer(prompts, completions)
        spaced = [" ".join(c.split()) for c in completions]
        shared, shared_share, shared_cover = _shared_part(
            _prompt_by_prompt(list(zip(prompts, spaced, strict=True)))
        )
        return cls(
            top_share=top_share,
            top_answer=top_answer,
            shared=shared,
            shared_share=shared_share,
            shared_cover=shared_cover,
            distinct_1=_distinct([tuple(w[i : i + 1]) for w in words for i in range(len(w))]),
            distinct_2=_distinct([tuple(w[i : i + 2]) for w in words for i in range(len(w) - 1)]),
            overlap=_overlap(prompts, words),
            prompts=len(set(prompts)),
        )

    def metrics(self) -> dict[str, float]:
        return {
            "diversity/top_share": self.top_share,
            "diversity/distinct_1": self.distinct_1,
            "diversity/distinct_2": self.distinct_2,
            "diversity/overlap": self.overlap,
        }

    def on(self, device: torch.device) -> dict[str, Tensor]:
        """:meth:`metrics` as scalars on ``device``, in one non-blocking copy: a blocking copy of a
        host value to a GPU waits for every kernel queued before it, as a host read does."""
        metrics = self.metrics()
        values = torch.tensor(list(metrics.values()), dtype=torch.float32)
        return dict(zip(metrics, values.to(device, non_blocking=True).unbind(), strict=True))


def _top_answer(prompts: list[str], completions: list[str]) -> tuple[float, str]:
    """The share of distinct prompts given the most common (normalised) answer, and that answer."""
    given: dict[str, set[str]] = {}
    example: dict[str, str] = {}
    for prompt, completion in zip(prompts, completions, strict=True):
        key = normalise(completion)
        given.setdefault(key, set()).add(prompt)
        example.setdefault(key, completion)
    if not given:
        return 0.0, ""
    key = max(given, key=lambda k: len(given[k]))
    return len(given[key]) / len(set(prompts)), example[key]


def _distinct(grams: list[tuple[str, ...]]) -> float:
    return len(set(grams)) / len(grams) if grams else 1.0


def _overlap(prompts: list[str], words: list[list[str]]) -> float:
    """Mean Jaccard overlap of the word sets of responses to different prompts (0 without a pair)."""
    shown = _prompt_by_prompt(list(zip(prompts, (set(w) for w in words), strict=True)))
    pairs = [(a, b) for (pa, a), (pb, b) in combinations(shown, 2) if pa != pb]
    if not pairs:
        return 0.0
    return sum(len(a & b) / len(a | b) if a | b else 1.0 for a, b in pairs) / len(pairs)


def _shared_part(rows: list[tuple[str, str]]) -> tuple[str, float, float]:
    """The longest text found in the answers of at least :data:`SHARED_PROMPTS` of the rows' distinct
    prompts (two at least), the share of prompts whose answers hold it, and the mean share of those
    answers' characters it makes up; ``("", 0.0, 0.0)`` where no :data:`MIN_SHARED_CHARS` characters
    are shared so widely. Seeds are the most widely shared runs of MIN_SHARED_CHARS characters (ties:
    the one seen first), each grown to the right and then to the left by the character most often
    next to it, while it stays as widely shared; the longest wins."""
    by_prompt: dict[str, list[str]] = {}
    for prompt, text in rows:
        by_prompt.setdefault(prompt, []).append(text)
    answers = list(by_prompt.values())
    need = max(2, -(-int(SHARED_PROMPTS * 100) * len(answers) // 100))  # ceil without float error
    if len(answers) < need:
        return "", 0.0, 0.0
    k = MIN_SHARED_CHARS
    # each prompt's runs once, in the order first seen (dict, not set: ties do not depend on hashing)
    runs = (dict.fromkeys(t[i : i + k] for t in texts for i in range(len(t) - k + 1)) for texts in answers)
    seeds = Counter(chain.from_iterable(runs))
    best = ""
    for seed, count in seeds.most_common(SHARED_SEEDS):
        if count < need or seed in best:
            continue
        grown = _grow(_grow(seed, answers, need, right=True), answers, need, right=False)
        if len(grown) > len(best):
            best = grown
    if not best:
        return "", 0.0, 0.0
    holding = [[t for t in texts if best in t] for texts in answers]
    covers = [len(best) / len(t) for texts in holding for t in texts]
    return best, sum(map(bool, holding)) / len(answers), sum(covers) / len(covers)


def _grow(part: str, answers: list[list[str]], need: int, right: bool) -> str:
    """``part`` extended a character at a time on one side, by the character most prompts' answers
    have next to it, while the answers of ``need`` prompts still hold it (up to
    :data:`MAX_SHARED_CHARS`)."""
    room = MAX_SHARED_CHARS - len(part)
    if room <= 0:
        return part
    grown = _extend([_contexts(part, texts, room, right) for texts in answers], need)
    return part + grown if right else grown[::-1] + part


def _contexts(part: str, texts: list[str], room: int, right: bool) -> list[str]:
    """What follows (``right``) or precedes (read backwards) the first :data:`MAX_OCCURRENCES` of
    ``part`` in each of one prompt's answers, ``room`` characters at most: all that growing it can
    read. Each only once, in the order found: a collapsed answer repeating one text gives one."""
    found: dict[str, None] = {}
    for t in texts:
        start = t.find(part)
        for _ in range(MAX_OCCURRENCES):
            if start < 0:
                break
            end = start + len(part)
            found[t[end : end + room] if right else t[max(0, start - room) : start][::-1]] = None
            start = t.find(part, start + 1)
    return list(found)


def _extend(contexts: list[list[str]], need: int) -> str:
    """The text grown from each prompt's ``contexts``: one character at a time, the one the most
    prompts' contexts continue with (ties: the first found), while ``need`` prompts continue it.
    Up to where two contexts first differ, each depth has one character to choose: that stretch is
    taken at once, to where fewer than ``need`` prompts' contexts go on if that comes first (a
    collapsed batch costs a step or two, not one per character)."""
    grown = ""
    while True:
        at = len(grown)
        contexts = [kept for cs in contexts if (kept := [c for c in cs if len(c) > at])]
        if len(contexts) < need:
            return grown
        every = [c for cs in contexts for c in cs]
        last = max(every)  # every context that is no start of it differs from it somewhere
        apart = min((len(_common_start(c, last)) for c in every if not last.startswith(c)), default=len(last))
        going_on = sorted((max(map(len, cs)) for cs in contexts), reverse=True)[need - 1]
        if apart > at:  # no choice before `apart`; `need` prompts hold the text up to `going_on`
            grown = last[: min(apart, going_on)]
            continue
        counts = Counter(chain.from_iterable(dict.fromkeys(c[at] for c in cs) for cs in contexts))
        char, count = counts.most_common(1)[0]
        if count < need:
            return grown
        grown += char
        contexts = [[c for c in cs if c[at] == char] for cs in contexts]


def _common_start(a: str, b: str) -> str:
    """The longest common start of ``a`` and ``b``, by halving (slice comparisons, not a loop per
    character)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return a[:low]


def _prompt_by_prompt(rows: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """At most :data:`MAX_OVERLAP_RESPONSES` rows, the k-th response of every prompt before any
    prompt's (k+1)-th: as many different prompts as the budget allows, whatever the group size."""
    seen: dict[str, int] = {}
    rank = []
    for prompt, _ in rows:
        rank.append(seen.get(prompt, 0))
        seen[prompt] = rank[-1] + 1
    order = sorted(range(len(rows)), key=lambda i: (rank[i], i))
    return [rows[i] for i in order[:MAX_OVERLAP_RESPONSES]]
