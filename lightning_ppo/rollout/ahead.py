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
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_ppo.config import GenerationConfig
from lightning_ppo.models.loading import response_logits
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.engines.hf import HFEngine
from lightning_ppo.rollout.prompts import PromptBatch
from lightning_ppo.runs.errors import UsageError


@dataclass
class Sampled:
    """A batch and its rollout, sampled by the weights of iteration ``version`` (updates trained);
    ``extra`` is what the sampler gave beside the rollout (an episode runner's stats)."""

    batch: PromptBatch
    rollout: Rollout
    version: int
    extra: Any = None


@dataclass
class _Job:
    batch: PromptBatch
    version: int
    future: Future


Sampler = Callable[[PromptBatch], tuple[Rollout, Any]]  # the rollout, and anything to keep with it


class PolicySnapshots:
    """Frozen copies of the policy to generate from while the live one trains: one per job that can
    be in flight (``max_staleness``), taken in turn, so a copy is refreshed only after the job that
    sampled from it was handed back."""

    def __init__(self, policy: nn.Module, count: int) -> None:
        self.models = [copy.deepcopy(policy).eval().requires_grad_(False) for _ in range(count)]
        self.taken = 0

    @torch.no_grad()
    def take(self, policy: nn.Module) -> nn.Module:
        """The next copy, holding ``policy``'s weights now."""
        model = self.models[self.taken % len(self.models)]
        self.taken += 1
        for mine, theirs in zip(model.parameters(), policy.parameters(), strict=True):
            mine.copy_(theirs)
        return model


@torch.no_grad()
def with_behaviour_logprobs(
    rollout: Rollout, model: nn.Module, token_logprobs: Callable[[Tensor, Tensor], Tensor]
) -> Rollout:
    """``rollout`` with the log-probs of its tokens under ``model``, the weights that sampled it (the
    behaviour policy of the decoupled loss), under the trainer's sampling distribution."""
    width = rollout.response_ids.shape[1]
    logits = response_logits(model, rollout.input_ids, rollout.attention_mask, rollout.position_ids, width)
    logprobs = token_logprobs(logits, rollout.response_ids).float().masked_fill(~rollout.response_mask, 0.0)
    return replace(rollout, engine_logprobs=logprobs)


@dataclass
class BackgroundJobs:
    """How a batch's job starts on the main thread (:meth:`start`) and samples on the background
    thread, and what is put back when its rollout trains (:meth:`taken`).

    ``server`` is the ``vllm_server`` engine, synced as each job starts (every rank joins); without
    it (``hf``) a job samples from a snapshot of ``policy``, which also gives the behaviour
    log-probs. No collective runs on the background thread: each rank samples on its own.
    """

    policy: nn.Module
    iteration: Callable[[], int]
    server: Any  # a GenerationEngine (vllm_server), or None for hf
    hf_generation: Any  # transformers.GenerationConfig
    cache: str
    episode_runner: Any  # an EpisodeRunner, or None
    token_logprobs: Callable[[Tensor, Tensor], Tensor]
    rank: int
    check_prompts: Callable[[PromptBatch], None]
    max_staleness: int
    snapshots: PolicySnapshots | None = None

    def start(self, batch: PromptBatch) -> Sampler:
        self.check_prompts(batch)
        if self.server is not None:
            self.server.sync_weights(self.policy)
            return partial(self._sample, self.server, None, self.iteration())
        if self.snapshots is None:
            self.snapshots = PolicySnapshots(self.policy, self.max_staleness)
        snapshot = self.snapshots.take(self.policy)
        engine = HFEngine(self.hf_generation, self.cache)
        engine.sync_weights(snapshot)
        return partial(self._sample, engine, snapshot, self.iteration())

    def taken(self, sampled: Sampled) -> None:
        """The episode runner's stats and transcripts of the batch about to train (the runner's own
        are the latest job's)."""
        if self.episode_runner is not None:
            self.episode_runner.last_stats, self.episode_runner.transcripts = sampled.extra

    def _sample(
        self, engine: Any, snapshot: nn.Module | None, iteration: int, batch: PromptBatch
    ) -> tuple[Rollout, Any]:
        """On the background thread: the rollout, and an episode runner's stats (read here, where the
        next job cannot overwrite them)."""
        if self.episode_runner is None:
            rollout, extra = engine.generate(batch.prompt_ids, batch.prompt_mask), None
        else:
            rollout = self.episode_runner.run(engine, batch, iteration, self.rank, lambda flag: flag)
            extra = (self.episode_runner.last_stats, self.episode_runner.transcripts)
        if snapshot is not None:
            rollout = with_behaviour_logprobs(rollout, snapshot, self.token_logprobs)
        return rollout, extra


def to_saved(batch: PromptBatch) -> dict[str, Any]:
    """The batch as a checkpoint keeps it: plain values and CPU tensors, which ``torch.load``'s
    ``weights_only`` reads (a ``PromptBatch`` it would refuse)."""
    return {
        "prompt_ids": batch.prompt_ids.cpu(),
        "prompt_mask": batch.prompt_mask.cpu(),
        "prompts": list(batch.prompts),
        "extras": dict(batch.extras),
        "messages": batch.messages,
    }


def from_saved(saved: dict[str, Any], device: torch.device) -> PromptBatch:
    return PromptBatch(
        saved["prompt_ids"].to(device),
        saved["prompt_mask"].to(device),
        saved["prompts"],
        saved["extras"],
        saved["messages"],
    )


class RolloutsAhead:
    """Sampling ``max_staleness`` batches ahead of training, on one background thread.

    ``prepare(batch)`` runs on the main thread when a batch's job starts (sync a server, take a
    snapshot) and returns the function the background thread samples with; ``taken(sampled)`` runs
    when a rollout is handed to training (:class:`BackgroundJobs` gives both).
    """

    def __init__(
        self,
        max_staleness: int,
        prepare: Callable[[PromptBatch], Sampler],
        taken: Callable[[Sampled], None] = lambda sampled: None,
    ) -> None:
        self.max_staleness = max_staleness
        self.prepare = prepare
        self.taken = taken
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
            try:
                rollout, extra = oldest.future.result()  # a failure in the background is raised here
            except BaseException:
                self.unsampled.appendleft(oldest.batch)  # still pending: a checkpoint saved now keeps it
                raise
            self._start_waiting(version)
            if version - oldest.version > self.max_staleness:  # only where iterations were skipped
                self.resampled += 1
                self.unsampled.appendleft(oldest.batch)
                continue
            sampled = Sampled(oldest.batch, rollout, oldest.version, extra)
            self.taken(sampled)
            return sampled
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


def check_ahead(max_staleness: int, generation: GenerationConfig, model_parallel: bool) -> None:
    """Refuse, in one line, what sampling ahead cannot do (before any model is built)."""
    if max_staleness == 0:
        return
    if generation.engine == "vllm":
        raise UsageError(
            "ppo.max_staleness > 0 needs generation.engine 'hf' or 'vllm_server': the colocated "
            "'vllm' engine shares the trainer's device and would only wait for it"
        )
    if generation.engine == "hf" and model_parallel:
        raise UsageError(
            "ppo.max_staleness > 0 with generation.engine 'hf' cannot run under FSDP2 (a background "
            "snapshot of a sharded policy would need collectives of its own): use 'vllm_server' or DDP"
        )
    if generation.engine == "vllm_server" and max_staleness > 1:
        raise UsageError(
            f"ppo.max_staleness {max_staleness} with generation.engine 'vllm_server': at most 1 (a "
            "second batch in flight would see its weights change under it at the next sync)"
        )
    if generation.engine == "vllm_server" and (generation.top_k or generation.top_p < 1.0):
        raise UsageError(
            "ppo.max_staleness > 0 with vllm_server needs generation.top_k 0 and top_p 1.0: the decoupled "
            "loss weighs by the server's log-probs, renormalised over the tokens top-k/top-p keep"
        )


PENDING_KEY = "lightning_ppo_pending"  # the checkpoint's entry: each rank's batches not trained yet


def gather_objects(trainer: Any, mine: list[Any]) -> list[list[Any]]:
    """Every rank's list, by rank; every rank must call this (a collective under several ranks)."""
    if trainer is None or trainer.world_size == 1:
        return [mine]
    everyone: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def pending_of_rank(
    saved: list[list[dict[str, Any]]] | None, trainer: Any, max_staleness: int
) -> list[dict[str, Any]]:
    """This rank's saved batches (:func:`to_saved`) a checkpoint kept; refused if the ranks differ
    in number (each rank's pipeline must hold as many batches as the others', or they would train
    different steps)."""
    if not saved or not any(saved):
        return []
    world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
    if len(saved) != world:
        raise UsageError(
            f"the checkpoint holds batches sampled ahead by {len(saved)} ranks, not yet trained; resume "
            f"with {len(saved)} ranks (this run has {world}) so that each is trained exactly once"
        )
    if max_staleness == 0:
        rank_zero_warn(
            f"the checkpoint holds {len(saved[rank])} batch(es) per rank sampled ahead and not yet trained; "
            "with ppo.max_staleness 0 they are not trained (resume with ppo.max_staleness >= 1 to train them)"
        )
        return []
    return list(saved[rank])


def say_untrained(count: int, max_staleness: int) -> None:
    """At the end of a run: the batches handed in and not trained (a limit counts batches, the first
    steps only start sampling), and where they are."""
    if count:
        rank_zero_info(
            f"ppo.max_staleness {max_staleness}: {count} batch(es) handed in were not trained by the end "
            "of the run; the last checkpoint keeps them, and a resumed run (--ckpt_path last) trains "
            "them first"
        )
