"""Episodes their environment dropped (``episode.on_error: drop``, or a NaN/inf turn reward under
``ppo.on_bad_reward: drop``): which rows they are, and what never reads them.

A dropped episode is never shown to the rewards (nor, through ``PPOLightningModule.shape_scores``,
to the score moments), and gives the diversity checks and the guardrails no answer. What is left
of a batch is otherwise trained as any batch is (``PPOLightningModule.training_step``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_ppo.distributed.sharding import is_sharded
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rewards import ScoreInputs
from lightning_ppo.rollout.ahead import EpisodeRecord, Sampled
from lightning_ppo.rollout.prompts import PromptBatch
from lightning_ppo.watch.every_rank import BatchAnswers


def dropped_episodes(sampled: Sampled, device: torch.device) -> Tensor:
    """(B,) the episodes their environment dropped; all False without an environment."""
    if sampled.episodes is None:
        return torch.zeros(len(sampled.batch), dtype=torch.bool, device=device)
    return sampled.episodes.stats.failed.to(device)


def score_kept(
    module: Any, batch: PromptBatch, rollout: Rollout, completions: list[str], failed: Tensor
) -> Any:
    """``module.call_score`` of the rows not ``failed``, in order (a user's override included); the
    sample tables' columns (``module.scorer.columns``) put back in the batch's rows."""
    if not failed.any():
        return module.call_score(
            batch.prompts, completions, ScoreInputs(batch.extras, rollout, batch.messages)
        )
    rows = (~failed).nonzero().squeeze(1).tolist()
    if not rows and not is_sharded(module):  # nothing of this rank's to score (another rank's is kept)
        module.scorer.columns = {}
        return []
    # Under FSDP2 a sharded reward model's forwards are every rank's: a rank none of whose
    # episodes was kept scores its first one, and the score is ignored.
    shown = rows or [0]
    inputs = ScoreInputs(
        {name: [values[i] for i in shown] for name, values in batch.extras.items()},
        rollout.rows(torch.tensor(shown, dtype=torch.long, device=failed.device)),
        None if batch.messages is None else [batch.messages[i] for i in shown],
    )
    scores = module.call_score([batch.prompts[i] for i in shown], [completions[i] for i in shown], inputs)
    # the sample tables' columns, in the batch's rows (None for a dropped episode)
    columns = module.scorer.columns.items() if rows else ()
    module.scorer.columns = {name: _in_rows(values, rows, len(failed)) for name, values in columns}
    return scores if rows else scores[:0]


def policy_answers(
    trainer: Any, prompts: list[str], completions: list[str], episodes: EpisodeRecord | None
) -> BatchAnswers:
    """Every rank's answers as the diversity checks and the guardrails read them: the policy's own
    words (an episode's replies: ``EpisodeRunner.own_words``), none from a dropped episode. Every rank
    must call it (one all-gather under several ranks)."""
    if episodes is not None:
        kept = [
            (prompt, words)
            for prompt, words in zip(prompts, episodes.words, strict=True)
            if words is not None
        ]
        prompts, completions = [prompt for prompt, _ in kept], [words for _, words in kept]
    return BatchAnswers.gathered(trainer, prompts, completions)


def _in_rows(values: list[Any], rows: list[int], size: int) -> list[Any]:
    """``values`` of ``rows`` placed in a list of ``size`` (``None`` elsewhere)."""
    placed: list[Any] = [None] * size
    for row, value in zip(rows, values, strict=True):
        placed[row] = value
    return placed
