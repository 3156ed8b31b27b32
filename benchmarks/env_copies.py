"""What the per-episode copy of an environment costs: ``copy.deepcopy`` once per episode per batch.

    .venv/bin/python -m benchmarks.env_copies               # batch 256, 3 rounds (a few minutes)
    .venv/bin/python -m benchmarks.env_copies --batch 64 --rounds 1

The runner (``lightning_ppo/rollout/episodes.py``) copies the configured environment for every
episode of a batch, so ``self`` can hold the episode's state. This times those copies at a batch of
``--batch`` for environments whose instance holds state of growing size (a lookup table as a dict,
a Python list, a NumPy array), and for the same large table named in the class's ``shared`` (one
object for every episode, never copied). It prints one line per case: the state's
size, the median seconds for the batch's copies, and the memory the batch's copies hold at once.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import numpy as np

from benchmarks.flags import at_least_one
from lightning_ppo.rollout.episodes import Environment, StepResult, Turn, copy_for_an_episode

log = logging.getLogger("benchmarks.env_copies")


class Holds(Environment):
    """An environment whose instance holds ``state`` (copied with every episode)."""

    def __init__(self, state: object) -> None:
        self.state = state

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


class SharesState(Holds):
    """The same state named in ``shared``: every episode's copy holds the configured instance's."""

    shared = ("state",)


def _cases() -> list[tuple[str, Environment, int]]:
    """(name, environment, bytes of state it holds, roughly)."""
    table = {f"key{i}": list(range(8)) for i in range(100_000)}
    return [
        ("a few fields", Holds({"target": "12345", "turns": 0}), 200),
        (
            "dict, 10k entries of 8 ints",
            Holds({f"key{i}": list(range(8)) for i in range(10_000)}),
            10_000 * 190,
        ),
        ("dict, 100k entries of 8 ints", Holds(table), 100_000 * 190),
        ("list of 1M ints", Holds(list(range(1_000_000))), 8_000_000),
        ("numpy array, 4 MB", Holds(np.zeros(1_000_000, dtype=np.float32)), 4_000_000),
        ("numpy array, 64 MB", Holds(np.zeros(16_000_000, dtype=np.float32)), 64_000_000),
        ("dict, 100k entries, in `shared`", SharesState(table), 0),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=at_least_one, default=256)
    parser.add_argument("--rounds", type=at_least_one, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    log.info(
        "the runner's copies (copy_for_an_episode), %d episodes a batch, median of %d rounds",
        args.batch,
        args.rounds,
    )
    for name, environment, size in _cases():
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.batch):
                copy_for_an_episode(environment)  # what the runner does; dropped at once (time only)
            times.append(time.perf_counter() - start)
        held = size * args.batch / 2**20
        log.info(
            "%-32s %10.3f s per batch  %8.1f ms per copy  ~%.0f MiB held by the batch's copies",
            name,
            statistics.median(times),
            1000 * statistics.median(times) / args.batch,
            held,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
