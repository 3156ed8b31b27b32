r"""A batch of 256 degenerate math answers, checked as before and as now, in one run.

    .venv/bin/python -m benchmarks.math_answer_timeouts               # before: 8 answers, times 32
    .venv/bin/python -m benchmarks.math_answer_timeouts --before-all  # before: all 256 (~21 minutes)

Degenerate answers are power towers and huge factorials (``\boxed{9^{9^{9^{9}}}}``), which sympy
cannot compare to 72 in time. Before (lightning_ppo at c3e3be1, rewritten here): math-verify's
``parse`` and ``verify`` one answer after another on the main thread, each within its 5 s alarm.
Now: :class:`lightning_ppo.tasks.math_answer.MathAnswerReward` with its defaults (worker processes,
``answer_timeout`` 5 s, ``batch_timeout`` 10 s). Then a mixed batch, 192 right answers among 64
degenerate ones: how long it takes, and how many of the right ones still score 1.0. Nothing is
asserted: the figures are printed.
"""

from __future__ import annotations

import argparse
import logging
import time

import math_verify as mv

from lightning_ppo.tasks.math_answer import MathAnswerReward

DEGENERATE = (r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{100})!}", r"\boxed{10^{10^{10}}}", r"\boxed{7^{7^{9}}}")
BATCH = 256


def before(truth: str, completion: str) -> bool:
    """The reward's check before issue 49: serial, math-verify's 5 s timeouts (main thread)."""
    gold = mv.parse(truth, [mv.ExprExtractionConfig(), mv.LatexExtractionConfig()], parsing_timeout=5)
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    answer = mv.parse(completion, config, parsing_timeout=5)
    return bool(answer) and mv.verify(gold, answer, timeout_seconds=5)


def timed(call) -> tuple[float, object]:  # noqa: ANN001
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-all", action="store_true", help="time all 256 the old way (~21 minutes)")
    args = parser.parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # a timeout warning per answer
    answers = [DEGENERATE[i % len(DEGENERATE)] for i in range(BATCH)]

    sample = answers if args.before_all else answers[:8]
    seconds, _ = timed(lambda: [before("72", answer) for answer in sample])
    scaled = seconds * BATCH / len(sample)
    how = (
        "measured"
        if args.before_all
        else f"{len(sample)} measured ({seconds:.1f} s), times {BATCH // len(sample)}"
    )
    print(f"before: {BATCH} degenerate answers, serially: {scaled:.0f} s ({scaled / 60:.1f} min; {how})")

    reward = MathAnswerReward()
    start, _ = timed(lambda: reward(["q"], [r"\boxed{72}"], answer=["72"]))
    print(f"now: {reward.workers} workers, started in {start:.1f} s (the first batch only)")
    metrics: dict[str, float] = {}
    seconds, scores = timed(
        lambda: reward(["q"] * BATCH, answers, answer=["72"] * BATCH, log_metric=metrics.__setitem__)
    )
    print(
        f"now: {BATCH} degenerate answers: {seconds:.1f} s, all scored {set(scores)}, "
        f"reward/timed_out {metrics['timed_out']:.2f}"
    )

    mixed = [answers[i] if i % 4 == 0 else rf"\boxed{{{i}}}" for i in range(BATCH)]
    truths = [str(i) for i in range(BATCH)]
    seconds, scores = timed(
        lambda: reward(["q"] * BATCH, mixed, answer=truths, log_metric=metrics.__setitem__)
    )
    right = sum(score == 1.0 for i, score in enumerate(scores) if i % 4)
    print(
        f"now: {BATCH - BATCH // 4} right answers among {BATCH // 4} degenerate: {seconds:.1f} s, "
        f"{right} of the right ones scored 1.0, reward/timed_out {metrics['timed_out']:.2f}"
    )


if __name__ == "__main__":
    main()
