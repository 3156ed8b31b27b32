"""The callback that collects, during the selfcheck's run, what :mod:`.sampling` tests: the exact
distribution of every version of the policy and the responses each trained batch holds.

At each training step's start, before its update, the policy's exact log-probs of every response to
every prompt are the distribution of the version the step samples with (``ppo.max_staleness`` 0),
or that batches sampled ahead at this step record (``Sampled.version``: updates trained). After the
step, its trained batch's responses are scored against the version the run claims sampled them and
the one before it. Each rank scores its own rows; at the fit's end the sums are all-reduced, so
every rank holds every rank's. One turn only: an episode's likelihood needs the environment's turns
listed too.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn

from lightning_ppo.distributed.sharding import is_sharded
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.selfcheck.optimum import sampling_space
from lightning_ppo.selfcheck.responses import ResponseSpace, float64_copy
from lightning_ppo.selfcheck.sampling import TERMS, SamplingCheck, ratio_terms
from lightning_ppo.selfcheck.task import prompt_ids


class SamplingRecorder(Callback):
    """Scores each trained batch's responses for :class:`~lightning_ppo.selfcheck.sampling.SamplingCheck`.

    Args:
        prompts: The task's prompts (text), every one a batch may hold.
    """

    def __init__(self, prompts: list[str]) -> None:
        self.prompts = list(prompts)
        self.versions: dict[int, Tensor] = {}  # updates trained -> (P, N) exact log-probs
        self.terms: Tensor | None = None  # (batches, len(TERMS)) per training step; all ranks' after fit
        self._space: ResponseSpace | None = None
        self._prompt_index: dict[tuple[int, ...], int] = {}
        self._response_index: dict[tuple[int, ...], int] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a fit before in this process (a notebook's) ran another policy, or the same one from
        # elsewhere: its versions numbered as this fit's would be scored against in their place
        self.versions = {}
        self._space = sampling_space(pl_module)
        listed = (tuple(prompt_ids(pl_module.tokenizer, p)) for p in self.prompts)
        self._prompt_index = {ids: row for row, ids in enumerate(listed)}
        self._response_index = {r.token_ids: n for n, r in enumerate(self._space.responses())}
        self.terms = torch.zeros(trainer.num_training_batches, len(TERMS), dtype=torch.float64)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        version = pl_module.iteration
        if version not in self.versions:  # steps that train nothing (sampling ahead starts) keep it
            self.versions[version] = self.exact_logprobs(pl_module.policy)
        # a trained batch was sampled at most max_staleness updates ago; its claim's one before it
        oldest = version - pl_module.ppo.max_staleness - 1
        for old in [v for v in self.versions if v < oldest]:
            del self.versions[old]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sampled = pl_module.last_rollout
        if sampled is None or sampled.version - 1 not in self.versions:  # the first: nothing older
            return
        prompts, responses = self.rows(sampled.rollout)
        claimed, other = self.versions[sampled.version], self.versions[sampled.version - 1]
        self.terms[batch_idx] = ratio_terms(claimed, other, prompts, responses)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        reduce = pl_module.sum_over_ranks  # every rank reaches here: one all-reduce of the sums
        if reduce is not None:
            self.terms = reduce(self.terms.to(pl_module.device)).double().cpu()

    def check(self) -> SamplingCheck | None:
        """The run's check; ``None`` before any step trained."""
        return None if self.terms is None else SamplingCheck.of(self.terms)

    def exact_logprobs(self, policy: nn.Module) -> Tensor:
        """(P, N) float64 log-probs of every response to every prompt under ``policy`` as it is now:
        one forward over the longest responses per prompt, on a float64 copy (sharded weights: on the
        policy itself, every rank together, its logits read in float64)."""
        exact = policy if is_sharded(policy) else float64_copy(policy)
        return torch.stack([self._space.logprobs(exact, list(ids)) for ids in self._prompt_index])

    def rows(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(B,) each row's prompt and response as indices into the listed ones, -1 where not listed."""
        return _indices(rollout.prompt_ids, rollout.prompt_mask, self._prompt_index), _indices(
            rollout.response_ids, rollout.response_mask, self._response_index
        )


def _indices(ids: Tensor, mask: Tensor, index: dict[tuple[int, ...], int]) -> Tensor:
    """(B,) each row's masked token ids looked up in ``index``, -1 where absent."""
    rows = zip(ids.cpu().tolist(), mask.cpu().tolist(), strict=True)
    return torch.tensor([index.get(tuple(t for t, m in zip(*row, strict=True) if m), -1) for row in rows])


def recorded(trainer: Trainer) -> SamplingCheck | None:
    """The :class:`SamplingRecorder` among ``trainer``'s callbacks, its check; ``None`` without one."""
    for callback in trainer.callbacks:
        if isinstance(callback, SamplingRecorder):
            return callback.check()
    return None
