"""Generation ahead of training: rollouts sampled while the update before them runs
(``ppo.max_staleness`` > 0).

With a bound of ``s``, the rollout trained at iteration ``i`` was sampled by the weights of an
iteration ``>= i - s``. Each training step hands its prompt batch in and gets back the oldest
batch handed in, sampled; its own batch is sampled in the background while that one trains:

    step k:  wait for batch k-s's rollout  ->  start batch k's  ->  train batch k-s

so generation (on a background thread here, or on generation servers) overlaps the update, and
training starts ``s`` steps after the first batch (those steps train nothing). Batches handed in
and not yet trained are :meth:`RolloutsAhead.pending`: a checkpoint keeps them, and a resumed run
samples them again before anything else, so every prompt reached is trained exactly once. A rollout
older than the bound is never trained on: it is sampled again first (admission, not dropping).

Where the engine generates with the live module (``hf``), a job samples from a copy of the
policy taken when it starts (a snapshot: the update cannot change the weights under it), and the
same copy gives the behaviour log-probs the decoupled loss needs (``rollout.engine_logprobs``).
A server engine is synced on the main thread, where every rank takes part, before its job starts.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.prompts import PromptBatch


@dataclass
class Sampled:
    """A batch and its rollout, sampled by the weights of iteration ``version`` (updates trained)."""

    batch: PromptBatch
    rollout: Rollout
    version: int


@dataclass
class _Job:
    batch: PromptBatch
    version: int
    future: Future


Sampler = Callable[[PromptBatch], Rollout]


class PolicySnapshot:
    """A frozen copy of the policy to generate from while the live one trains."""

    def __init__(self, policy: nn.Module) -> None:
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)

    @torch.no_grad()
    def take(self, policy: nn.Module) -> nn.Module:
        """The copy, holding ``policy``'s weights now (called between jobs, never during one)."""
        for mine, theirs in zip(self.model.parameters(), policy.parameters(), strict=True):
            mine.copy_(theirs)
        return self.model


class RolloutsAhead:
    """Sampling ``max_staleness`` batches ahead of training, on one background thread.

    ``prepare(batch)`` runs on the main thread when a batch's job starts (sync a server, take a
    snapshot) and returns the function the background thread samples with.
    """

    def __init__(self, max_staleness: int, prepare: Callable[[PromptBatch], Sampler]) -> None:
        self.max_staleness = max_staleness
        self.prepare = prepare
        self.jobs: deque[_Job] = deque()
        self.unsampled: deque[PromptBatch] = deque()  # restored from a checkpoint: sampled again first
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-ppo-rollouts")
        self.resampled = 0

    def next(self, batch: PromptBatch, version: int) -> Sampled | None:
        """Hand ``batch`` in; the oldest batch's rollout once ``max_staleness`` are ahead, else None."""
        self.unsampled.append(batch)
        while len(self.jobs) + len(self.unsampled) > self.max_staleness:
            if not self.jobs:
                self._start(self.unsampled.popleft(), version)
            oldest = self.jobs.popleft()
            rollout = oldest.future.result()  # a failure in the background is raised here
            self._start_waiting(version)
            if version - oldest.version > self.max_staleness:  # only where iterations were skipped
                self.resampled += 1
                self.unsampled.appendleft(oldest.batch)
                continue
            return Sampled(oldest.batch, rollout, oldest.version)
        self._start_waiting(version)
        return None

    def pending(self) -> list[PromptBatch]:
        """Every batch handed in and not yet trained, oldest first (what a checkpoint keeps)."""
        return [job.batch for job in self.jobs] + list(self.unsampled)

    def restore(self, batches: list[PromptBatch]) -> None:
        """Batches a checkpoint kept: they are sampled again, before the next one handed in."""
        self.unsampled.extendleft(reversed(batches))

    def close(self) -> None:
        """Let the running job finish (its rollout is not trained: its batch stays pending)."""
        self.worker.shutdown(wait=True, cancel_futures=True)

    def _start_waiting(self, version: int) -> None:
        """Start the batches waiting, up to ``max_staleness`` jobs ahead of the one training."""
        while self.unsampled and len(self.jobs) < self.max_staleness:
            self._start(self.unsampled.popleft(), version)

    def _start(self, batch: PromptBatch, version: int) -> None:
        sample = self.prepare(batch)
        self.jobs.append(_Job(batch, version, self.worker.submit(sample, batch)))
