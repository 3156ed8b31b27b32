"""Multi-turn episodes under ``hf`` that keep their KV cache from one turn to the next.

Without it each turn's ``generate`` reads the whole episode so far again (42 % of a 4-turn
rollout's generate time in ``benchmarks/episodes.py --prefill``). With ``episode.keep_cache``,
:class:`KeptCache` keeps what the last turn's ``generate`` left: its sequences, their attention
mask and HF's ``DynamicCache``. The next turn appends only each episode's new tokens (the
observation; the reply is in the cache already) and ``generate`` reads just those.

The rows keep the layout of the first turn: a reply that stopped early leaves padding after its
stop token, and observations of different lengths are left padded within their segment. Those
gaps are masked out of attention and skipped by the positions (HF computes them from the mask),
so every real token sees what it saw in the re-read path, at the same position. A row whose turn
adds no token moves its last real token to the end (:func:`_move_last_token`): ``generate`` samples
from the last column. Episodes that end drop their rows (``DynamicCache.batch_select_indices``).

That holds for models whose every layer attends to the whole context. A sliding window (Mistral,
Qwen2 with ``use_sliding_window``, Gemma 2/3, Cohere2) or chunked attention (Llama 4) counts cache
columns, gaps included, so a real token would see fewer real tokens than in the re-read path and
the training forward (measured on a tiny Mistral with a window of 8: log-probs off by 0.05-0.37,
other greedy replies). :func:`check_full_attention` refuses such models before training.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import Tensor, nn

from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.sampling import generate
from lightning_ppo.runs.errors import UsageError


def local_attention(config: Any) -> str | None:
    """How ``config``'s model attends other than to the whole context (``"a sliding window of 8
    tokens"``), ``None`` when every layer sees everything."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = sorted(set(getattr(text, "layer_types", None) or ()) - {"full_attention"})
    window = getattr(text, "sliding_window", None)
    if getattr(text, "layer_types", None):  # transformers names each layer's attention
        if not kinds:
            return None
    elif window is None or getattr(text, "use_sliding_window", True) is False:
        return None
    chunk = getattr(text, "attention_chunk_size", None)
    if kinds == ["chunked_attention"] and chunk:
        return f"chunks of {chunk} tokens"
    return f"a sliding window of {window} tokens" if window else f"{', '.join(kinds)} layers"


def check_full_attention(config: Any) -> None:
    """``episode.keep_cache`` serves models whose layers all attend to the whole context; one line
    otherwise."""
    local = local_attention(config)
    if local is not None:
        raise UsageError(
            f"model.episode.keep_cache: the policy ({getattr(config, 'model_type', 'this model')}) "
            f"attends within {local}, and the kept cache's padding columns count against it, so "
            "replies would differ from the training forward; set episode.keep_cache: false for it"
        )


class KeptCache:
    """The batch's episodes as one growing ``generate`` with a cache kept between turns."""

    def __init__(self, policy: nn.Module, generation_config: transformers.GenerationConfig) -> None:
        self.policy, self.config = policy, generation_config
        self.sequences: Tensor | None = None
        self.mask: Tensor | None = None
        self.cache: transformers.DynamicCache | None = None

    def first(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Rollout:
        """The first turn: every episode's prompt, with a new cache."""
        self.cache = transformers.DynamicCache()
        return self._generate(prompt_ids, prompt_mask.long())

    def next(self, rows: list[int], segments: list[list[int]]) -> Rollout:
        """A later turn: ``rows`` of the last call's batch go on, each after its ``segment`` of new
        tokens (the observation since its reply)."""
        if self.sequences is None or self.cache is None or self.mask is None:
            raise RuntimeError("KeptCache.next before first")
        if rows != list(range(len(self.sequences))):
            self.cache.batch_select_indices(torch.tensor(rows, device=self.sequences.device))
        sequences, mask = self.sequences[rows], self.mask[rows]  # copies (indexed by a list)
        segments = [s or _move_last_token(sequences[row], mask[row]) for row, s in enumerate(segments)]
        width = max(len(s) for s in segments)
        new = torch.full((len(rows), width), self.config.pad_token_id, dtype=torch.long)
        new_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, segment in enumerate(segments):
            new[row, width - len(segment) :] = torch.tensor(segment, dtype=torch.long)
            new_mask[row, width - len(segment) :] = 1
        device = sequences.device
        ids = torch.cat([sequences, new.to(device)], dim=1)
        return self._generate(ids, torch.cat([mask, new_mask.to(device)], dim=1))

    def _generate(self, ids: Tensor, mask: Tensor) -> Rollout:
        """``generate`` on the kept cache (grown in place); what the next turn continues: the
        sequences, with the padding after a stop token masked out from now on."""
        rollout = generate(self.policy, ids, mask, self.config, self.cache)
        self.sequences = torch.cat([ids, rollout.response_ids], dim=1)
        self.mask = torch.cat([mask, rollout.response_mask.long()], dim=1)
        return rollout


def _move_last_token(sequence: Tensor, mask: Tensor) -> list[int]:
    """The segment of a row that adds nothing this turn (no observation, or one of no tokens): its
    last real token again, its first column masked out (``mask`` is changed in place).

    ``generate`` samples from the batch's last column; left as padding, the reply would be sampled
    from a masked pad's position (pad ids sampled and trained as actions). The moved copy sits at
    the position the original had (positions count the mask) and sees the same tokens, so it
    computes what the original did, and the row goes on exactly as the re-read path's.
    """
    last = int(mask.nonzero()[-1])
    mask[last] = 0
    return [int(sequence[last])]
