"""An engine's completions (token ids and their log-probs, one list per prompt) as a rollout."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.sampling import truncate_at_stop


def completions_to_rollout(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    tokens: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    stop_token_id: int | None,
    pad_token_id: int,
) -> Rollout:
    """Right-pad the completions to the longest one, as HF generate does, and mask at the stop."""
    width = max(len(row) for row in tokens)
    ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    engine_logprobs = torch.zeros(len(tokens), width, dtype=torch.float32)  # not the default dtype
    for row, (row_tokens, row_logprobs) in enumerate(zip(tokens, logprobs, strict=True)):
        ids[row, : len(row_tokens)] = torch.tensor(list(row_tokens), dtype=torch.long)
        engine_logprobs[row, : len(row_tokens)] = torch.tensor(list(row_logprobs), dtype=torch.float32)
    ids, mask, ended = truncate_at_stop(ids, stop_token_id, pad_token_id)
    device = prompt_ids.device
    return Rollout(
        prompt_ids,
        prompt_mask.bool(),
        ids.to(device),
        mask.to(device),
        ended.to(device),
        engine_logprobs=engine_logprobs.masked_fill(~mask, 0.0).to(device),
    )


def prompt_groups(rows: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(first row, count)`` of each run of identical consecutive prompts: a group's copies
    (``ppo.num_generations``) after ``repeat_interleave``, sent as one request of ``n`` samples."""
    groups: list[tuple[int, int]] = []
    for index, row in enumerate(rows):
        if groups and rows[groups[-1][0]] == row:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((index, 1))
    return groups


def group_seeds(groups: Sequence[tuple[int, int]]) -> list[int]:
    """One seed per group from torch's generator (``seed_everything`` fixes the draws; ranks, whose
    generators are offset, draw differently); a group's ``i``-th row samples with seed + ``i``,
    as vLLM seeds the ``n`` samples of one seeded request. Without repeated prompts: one draw per
    row, as before groups were sent whole."""
    return torch.randint(0, 2**31 - 1, (len(groups),)).tolist()


def row_seeds(rows: Sequence[Sequence[int]]) -> list[int]:
    """Each row's seed, the same a server's grouped request gives it (:func:`group_seeds`)."""
    groups = prompt_groups(rows)
    seeds = group_seeds(groups)
    return [seed + i for (_, count), seed in zip(groups, seeds, strict=True) for i in range(count)]
