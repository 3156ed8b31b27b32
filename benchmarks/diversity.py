"""What the converging-answers check costs on a collapsed batch: the shared part's search.

    .venv/bin/python -m benchmarks.diversity                    # 64 answers x 4,000 characters
    .venv/bin/python -m benchmarks.diversity --chars 1000 --no-before

Every iteration, every rank reads the batch's answers for a part that half the prompts' answers
share (``lightning_ppo/watch/diversity.py``, ``Diversity.shared``). A collapsed policy repeats
one text, which is when the check matters. The search before grew the part a character at a time
re-finding every occurrence of it in every answer: in 64 answers of 2,000 repeated characters
that was over 30 s per iteration. This times :func:`before` (that search, kept here as the
reference the tests compare with) against today's on the same batches, in the same run, and
prints one line per batch: its shape, the time each took (and today's whole ``Diversity.of``, for
scale) and whether they found the same part.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable

from benchmarks.flags import at_least_one
from lightning_ppo.watch.diversity import (
    MAX_SHARED_CHARS,
    MIN_SHARED_CHARS,
    SHARED_PROMPTS,
    SHARED_SEEDS,
    Diversity,
)
from lightning_ppo.watch.diversity import _shared_part as now

log = logging.getLogger("benchmarks.diversity")


def before(rows: list[tuple[str, str]]) -> tuple[str, float, float]:
    """``_shared_part`` as it was (issue 49), its sets made ordered (``dict.fromkeys``) so ties
    break the same way in every process: the reference the tests compare today's with."""
    by_prompt: dict[str, list[str]] = {}
    for prompt, text in rows:
        by_prompt.setdefault(prompt, []).append(text)
    answers = list(by_prompt.values())
    need = max(2, -(-int(SHARED_PROMPTS * 100) * len(answers) // 100))
    if len(answers) < need:
        return "", 0.0, 0.0
    k = MIN_SHARED_CHARS
    seeds: Counter[str] = Counter()
    for texts in answers:
        seeds.update(list(dict.fromkeys(t[i : i + k] for t in texts for i in range(len(t) - k + 1))))
    best = ""
    for seed, count in seeds.most_common(SHARED_SEEDS):
        if count < need or seed in best:
            continue
        grown = _grow_before(_grow_before(seed, answers, need, right=True), answers, need, right=False)
        if len(grown) > len(best):
            best = grown
    if not best:
        return "", 0.0, 0.0
    holding = [[t for t in texts if best in t] for texts in answers]
    covers = [len(best) / len(t) for texts in holding for t in texts]
    return best, sum(map(bool, holding)) / len(answers), sum(covers) / len(covers)


def _grow_before(part: str, answers: list[list[str]], need: int, right: bool) -> str:
    while len(part) < MAX_SHARED_CHARS:
        nexts: Counter[str] = Counter()
        for texts in answers:
            found: dict[str, None] = {}
            for t in texts:
                start = t.find(part)
                while start >= 0:
                    at = start + len(part) if right else start - 1
                    if 0 <= at < len(t):
                        found[t[at]] = None
                    start = t.find(part, start + 1)
            nexts.update(list(found))
        if not nexts:
            return part
        char, count = nexts.most_common(1)[0]
        if count < need:
            return part
        part = part + char if right else char + part
    return part


def batches(answers: int, chars: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """Collapsed batches (one character repeated, one sentence repeated, a repeated sentence after
    varied openings) and an ordinary one (varied words), ``answers`` of ``chars`` characters."""
    rng = random.Random(0)
    words = "the a of to and in is it that for on was with as be at by this have from".split()
    sentence = "So the final answer is 42. "
    varied = [
        " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(chars // 6))
        for _ in range(answers)
    ]
    cases = {
        "one character repeated": ["a" * chars] * answers,
        "one sentence repeated": [(sentence * chars)[:chars]] * answers,
        "varied openings, then a sentence repeated": [(v[:200] + sentence * chars)[:chars] for v in varied],
        "ordinary: varied words": [v[:chars] for v in varied],
    }
    return [(name, [(f"prompt {i}", text) for i, text in enumerate(texts)]) for name, texts in cases.items()]


def timed(search: Callable[[list[tuple[str, str]]], tuple[str, float, float]], rows: list[tuple[str, str]]):
    start = time.perf_counter()
    found = search(rows)
    return found, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=at_least_one, default=64)
    parser.add_argument("--chars", type=at_least_one, default=4000)
    parser.add_argument("--no-before", action="store_true", help="time today's search only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    log.info("the shared part's search, %d answers of %d characters", args.answers, args.chars)
    for name, rows in batches(args.answers, args.chars):
        found, seconds = timed(now, rows)
        start = time.perf_counter()
        Diversity.of([prompt for prompt, _ in rows], [text for _, text in rows])
        whole = time.perf_counter() - start
        line = f"{name:44s} today {1000 * seconds:7.1f} ms (all of Diversity.of {1000 * whole:6.1f} ms)"
        line += f"  part of {len(found[0])} chars"
        if not args.no_before:
            old, old_seconds = timed(before, rows)
            line += f"  before {old_seconds:9.2f} s  same part: {old == found}"
        log.info(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
