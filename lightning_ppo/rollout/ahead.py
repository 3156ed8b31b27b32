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

Under several ranks, every wait for a job ends in one agreement of all ranks (a gather of each
rank's failure, if any): a job that failed on one rank stops every rank with one line, and no
server loads the next weights before every rank's requests of the batch before have ended. A
batch is kept as handed in (before its ``num_generations`` copies), so a resume with another
``num_generations`` builds whole groups; its episodes are seeded by the iteration it trains at.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_ppo.config import GenerationConfig
from lightning_ppo.models.loading import response_logits
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.ppo.row_groups import forward_groups
from lightning_ppo.rollout.engines.hf import HFEngine
from lightning_ppo.rollout.prompts import PromptBatch
from lightning_ppo.runs.daemon_worker import DaemonWorker
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn


@dataclass
class Sampled:
    """A batch and its rollout, sampled by the weights of iteration ``version`` (updates trained);
    ``episodes`` is what an episode runner counted and wrote for this batch (its ``EpisodeStats``
    and transcripts), carried with the rollout so that the metrics and samples logged for it are its
    own, whatever a later job does to the runner meanwhile."""

    batch: PromptBatch
    rollout: Rollout
    version: int
    episodes: EpisodeRecord | None = None


@dataclass(frozen=True)
class EpisodeRecord:
    """An episode runner's stats, transcripts and the policy's own words in each episode (its
    replies, for the diversity checks) of one batch, read right after it ran the batch."""

    stats: Any  # rollout.episodes.EpisodeStats
    transcripts: list[str]
    words: list[str | None]  # None for an episode its environment dropped

    @staticmethod
    def of(runner: Any) -> EpisodeRecord | None:
        if runner is None:
            return None
        return EpisodeRecord(runner.last_stats, list(runner.transcripts), list(runner.own_words))


@dataclass
class _Job:
    batch: PromptBatch  # as handed in (before ``num_generations`` copies): what a checkpoint keeps
    future: Future


Sampler = Callable[[], Sampled]  # samples one batch on the background thread


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
    rollout: Rollout,
    model: nn.Module,
    token_logprobs: Callable[[Tensor, Tensor], Tensor],
    chunk_size: int = 0,
) -> Rollout:
    """``rollout`` with the log-probs of its tokens under ``model``, the weights that sampled it (the
    behaviour policy of the decoupled loss), under the trainer's sampling distribution. Row groups of
    similar length, as the trainer's own forwards (``generation.forward_chunk_size``), so the peak
    memory is theirs, not one fp32 batch x response x vocabulary tensor."""
    split = rollout.prompt_ids.shape[1]
    ids, mask, pos = rollout.input_ids, rollout.attention_mask, rollout.position_ids
    logprobs = torch.zeros(rollout.response_ids.shape, dtype=torch.float32, device=ids.device)
    for group in forward_groups(mask, split, chunk_size):
        rows, cols, width = group.rows.to(ids.device), group.columns(split), group.after
        logits = response_logits(model, ids[rows, cols], mask[rows, cols], pos[rows, cols], width)
        logprobs[rows, :width] = token_logprobs(logits, rollout.response_ids[rows, :width]).float()
    return replace(rollout, engine_logprobs=logprobs.masked_fill(~rollout.response_mask, 0.0))


@dataclass
class BackgroundJobs:
    """How a batch's job starts on the main thread (:meth:`start`) and samples on the background
    thread.

    ``server`` is the ``vllm_server`` engine, synced as each job starts (every rank joins, after every
    rank's previous job ended: :meth:`RolloutsAhead.next`); without it (``hf``) a job samples from a
    snapshot of ``policy``, which also gives the behaviour log-probs. No collective runs on the
    background thread: each rank samples on its own.
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
    num_generations: int = 1
    chunk_size: int = 0  # generation.forward_chunk_size
    snapshots: PolicySnapshots | None = None

    def start(self, batch: PromptBatch, position: int) -> Sampler:
        """The job of ``batch``, to be trained at iteration ``position`` (its episodes' seeds: unique
        per batch, and the same when a resumed run samples it again)."""
        batch = batch.repeat_interleave(self.num_generations)
        self.check_prompts(batch)
        if self.server is not None:
            self.server.sync_weights(self.policy)
            return partial(self._sample, self.server, None, self.iteration(), position, batch)
        if self.snapshots is None:
            self.snapshots = PolicySnapshots(self.policy, self.max_staleness)
        snapshot = self.snapshots.take(self.policy)
        engine = HFEngine(self.hf_generation, self.cache)
        engine.sync_weights(snapshot)
        return partial(self._sample, engine, snapshot, self.iteration(), position, batch)

    def _sample(
        self, engine: Any, snapshot: nn.Module | None, version: int, position: int, batch: PromptBatch
    ) -> Sampled:
        """On the background thread: the rollout, and an episode runner's record of it (read here,
        where the next job cannot overwrite it)."""
        if self.episode_runner is None:
            rollout = engine.generate(batch.prompt_ids, batch.prompt_mask)
        else:
            rollout = self.episode_runner.run(engine, batch, position, self.rank, lambda flag: flag)
        if snapshot is not None:
            rollout = with_behaviour_logprobs(rollout, snapshot, self.token_logprobs, self.chunk_size)
        return Sampled(batch, rollout, version, EpisodeRecord.of(self.episode_runner))


def to_saved(batch: PromptBatch) -> dict[str, Any]:
    """The batch as a checkpoint keeps it: plain values and CPU tensors, which ``torch.load``'s
    ``weights_only`` reads (a ``PromptBatch`` it would refuse)."""
    return {
        "prompt_ids": batch.prompt_ids.cpu(),
        "prompt_mask": batch.prompt_mask.cpu(),
        "prompts": list(batch.prompts),
        "extras": dict(batch.extras),
        "messages": batch.messages,
        "handed_in": True,  # before its num_generations copies (checkpoints older than this: after)
    }


def as_handed_in(saved: dict[str, Any], copies: int) -> dict[str, Any]:
    """A saved batch as handed in: one written before batches were kept so (no ``handed_in``) holds
    each prompt ``copies`` times in a row (the ``num_generations`` of the run that saved it)."""
    if saved.get("handed_in") or copies <= 1:
        return saved
    one = slice(None, None, copies)
    return {
        "prompt_ids": saved["prompt_ids"][one],
        "prompt_mask": saved["prompt_mask"][one],
        "prompts": saved["prompts"][one],
        "extras": {key: values[one] for key, values in saved["extras"].items()},
        "messages": None if saved["messages"] is None else saved["messages"][one],
        "handed_in": True,
    }


def from_saved(saved: dict[str, Any], device: torch.device) -> PromptBatch:
    return PromptBatch(
        saved["prompt_ids"].to(device),
        saved["prompt_mask"].to(device),
        saved["prompts"],
        saved["extras"],
        saved["messages"],
    )


class EndSamplingOnFailure(Callback):
    """Ends a module's sampling ahead when its ``fit`` raises (Lightning calls no module hook then):
    its pending batches are kept as a checkpoint would keep them, and its background job is left to
    end on its own (bounded by its timeouts), so a second ``fit`` in the process starts clean."""

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        pl_module.end_sampling_ahead(wait=False)


class SamplingStopped(UsageError, RuntimeError):
    """Another rank's background sampling failed: this rank stops with it (one line), rather than
    wait for that rank in the next collective until the process group times out."""


Agree = Callable[[str | None], list[str | None]]  # every rank's failure (or None), by rank


class RolloutsAhead:
    """Sampling ``max_staleness`` batches ahead of training, on one background thread.

    ``prepare(batch, position)`` runs on the main thread when a batch's job starts (sync a server,
    take a snapshot) and returns what the background thread samples with (:class:`BackgroundJobs`).
    ``agree`` gathers one value from every rank (a collective): after each wait for a job, the ranks
    learn whether any rank's job failed, and all stop together; it is also the point every rank has
    passed before the next job starts, so no server loads new weights while any rank's requests
    for the batch before are still decoding.
    """

    def __init__(
        self,
        max_staleness: int,
        prepare: Callable[[PromptBatch, int], Sampler],
        agree: Agree = lambda failure: [failure],
    ) -> None:
        self.max_staleness = max_staleness
        self.prepare = prepare
        self.agree = agree
        self.jobs: deque[_Job] = deque()
        self.unsampled: deque[PromptBatch] = deque()  # restored from a checkpoint: sampled again first
        self.worker = DaemonWorker("lightning-ppo-rollouts")
        self.resampled = 0

    def next(self, batch: PromptBatch, version: int) -> Sampled | None:
        """Hand ``batch`` in; the oldest batch's rollout once ``max_staleness`` are ahead, else None."""
        self.unsampled.append(batch)
        while len(self.jobs) + len(self.unsampled) > self.max_staleness:
            if not self.jobs:
                self._start(version, training=False)
            oldest = self.jobs.popleft()
            try:
                sampled = self._wait(oldest)
                self._start_waiting(version, training=True)
            except BaseException:
                self.unsampled.appendleft(oldest.batch)  # still pending: a checkpoint saved now keeps it
                raise
            if version - sampled.version > self.max_staleness:  # only where iterations were skipped
                self.resampled += 1
                self.unsampled.appendleft(oldest.batch)
                continue
            return sampled
        self._start_waiting(version, training=False)
        return None

    def pending(self) -> list[PromptBatch]:
        """Every batch handed in and not yet trained, oldest first (what a checkpoint keeps)."""
        return [job.batch for job in self.jobs] + list(self.unsampled)

    def restore(self, batches: list[PromptBatch]) -> None:
        """Batches a checkpoint kept: they are sampled again, before the next one handed in."""
        self.unsampled.extendleft(reversed(batches))

    def close(self, wait: bool = True) -> None:
        """No more jobs (the running one's rollout is not trained: its batch stays pending); ``wait``
        for the running one to end, or leave it (a run that failed: it may wait on a hung server)."""
        self.worker.close(wait)

    def _wait(self, job: _Job) -> Sampled:
        """The job's rollout, once every rank's job of this step has ended, and none failed."""
        return self._agreed(job.future.result)

    def _agreed(self, step: Callable[[], Any]) -> Any:
        """``step()``'s result once every rank has done its own and none failed; a failure anywhere
        is raised on every rank (this rank's own error, or :class:`SamplingStopped`)."""
        try:
            result, failure = step(), None
        except BaseException as err:  # noqa: BLE001  (every rank must hear of it before raising)
            result, failure, raised = None, f"{type(err).__name__}: {err}", err
        failures = self.agree(failure)
        if failure is not None:
            raise raised
        for rank, other in enumerate(failures):
            if other is not None:
                raise SamplingStopped(f"rank {rank}'s background sampling failed ({other}); every rank stops")
        return result

    def _start_waiting(self, version: int, training: bool) -> None:
        """Start the batches waiting, up to ``max_staleness`` jobs ahead of the one training."""
        while self.unsampled and len(self.jobs) < self.max_staleness:
            self._start(version, training)

    def _start(self, version: int, training: bool) -> None:
        """Start the oldest unsampled batch; it leaves ``unsampled`` only once its job is submitted.
        Its position: the iteration it will train at (``training``: one batch trains at ``version``)."""
        position = version + len(self.jobs) + int(training)
        sample = self._agreed(partial(self.prepare, self.unsampled[0], position))
        batch = self.unsampled.popleft()
        self.jobs.append(_Job(batch, self.worker.submit(sample)))


def pipeline_for(module: Any) -> RolloutsAhead:
    """A ``PPOLightningModule``'s pipeline: its engine (a server's) or snapshots of its policy, its
    episodes, every rank's agreement; the batches its checkpoint kept are sampled first."""
    server = module.engine if module.generation_config.engine == "vllm_server" else None
    jobs = BackgroundJobs(
        module.policy,
        lambda: module.iteration,
        server,
        module.hf_generation,
        module.generation_config.cache_implementation,
        module.episode_runner,
        module.token_logprobs,
        module.global_rank,
        module.prompt_end.check,
        module.ppo.max_staleness,
        module.ppo.num_generations,
        module.generation_config.forward_chunk_size,
    )
    agree = partial(gather_objects, module._trainer)  # every rank's failure, if any
    ahead = RolloutsAhead(module.ppo.max_staleness, jobs.start, agree)
    ahead.restore([from_saved(saved, module.device) for saved in module._restored_pending])
    return ahead


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
    saved: list[list[dict[str, Any]]] | None, trainer: Any, max_staleness: int, copies: int = 1
) -> list[dict[str, Any]]:
    """This rank's saved batches (:func:`to_saved`) a checkpoint kept; refused if the ranks differ
    in number (each rank's pipeline must hold as many batches as the others', or they would train
    different steps)."""
    if not saved or not any(saved) or trainer is None:  # outside a Trainer nothing is trained: a
        return []  # fit(ckpt_path=...) reads them again, with its ranks
    world, rank = trainer.world_size, trainer.global_rank
    if len(saved) != world:
        raise UsageError(
            f"the checkpoint holds batches sampled ahead by {len(saved)} ranks, not yet trained; resume "
            f"with {len(saved)} ranks (this run has {world}) so that each is trained exactly once"
        )
    if max_staleness == 0:
        warn(
            f"the checkpoint holds {len(saved[rank])} batch(es) per rank sampled ahead and not yet trained; "
            "with ppo.max_staleness 0 they are not trained (resume with ppo.max_staleness >= 1 to train them)"
        )
        return []
    return [as_handed_in(batch, copies) for batch in saved[rank]]


def say_untrained(count: int, max_staleness: int) -> None:
    """At the end of a run: the batches handed in and not trained (a limit counts batches, the first
    steps only start sampling), and where they are."""
    if count:
        rank_zero_info(
            f"ppo.max_staleness {max_staleness}: {count} batch(es) handed in were not trained by the end "
            "of the run; the last checkpoint keeps them, and a resumed run (--ckpt_path last) trains "
            "them first"
        )
