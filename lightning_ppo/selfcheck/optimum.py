"""The exact optimum of the run as it was configured: its reference, sampling settings and beta.

Read from the fitted module, not from the selfcheck's own defaults, so an option the user passed
(``generation.temperature``, ``ppo.kl_coef`` through ``--beta``) is in the exact numbers too. One
turn: every response of every prompt (:class:`ListedTask`); two: every episode, both replies and
the hint between them (:class:`ListedEpisodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from lightning_ppo.selfcheck.exact import TiltedOptimum, kl_to_optimum, rated_optimum, tilted_optimum
from lightning_ppo.selfcheck.hint import HINTS, hint_probabilities, hint_reward
from lightning_ppo.selfcheck.induction import TwoTurns
from lightning_ppo.selfcheck.responses import ResponseSpace, float64_copy
from lightning_ppo.selfcheck.task import SelfcheckTask, prompt_char_score, prompt_ids, rater_score


@dataclass(frozen=True)
class ListedTask:
    """Every response of every prompt, with its reward and reference log-prob.

    Attributes:
        space: What sampling may draw.
        prompts: The prompts' token ids.
        rewards: (P, N) the reward of each response of each prompt (the raters' mean, with raters).
        ref_logprobs: (P, N) float64 log-prob under the reference.
        rater_rewards: (C, P, N) each rater's reward, with raters; else ``None``.
    """

    space: ResponseSpace
    prompts: tuple[tuple[int, ...], ...]
    rewards: Tensor
    ref_logprobs: Tensor
    rater_rewards: Tensor | None = None

    def optimum(self, beta: float) -> TiltedOptimum:
        if self.rater_rewards is not None:
            return rated_optimum(self.ref_logprobs, self.rater_rewards, beta)
        return tilted_optimum(self.ref_logprobs, self.rewards, beta)

    def distance(self, policy: nn.Module, beta: float) -> float:
        """The policy's exact ``E_x KL(pi || pi*)`` in nats."""
        exact = float64_copy(policy)
        logprobs = torch.stack([self.space.logprobs(exact, list(ids)) for ids in self.prompts])
        return float(kl_to_optimum(logprobs, self.ref_logprobs, self.rewards, beta).mean())


@dataclass(frozen=True)
class ListedEpisodes:
    """Every episode of the hint task: the contexts of each turn and the exact :class:`TwoTurns`.

    Attributes:
        space: What sampling may draw in each turn.
        prompts: The prompts' token ids.
        hints: The token ids each of :data:`~lightning_ppo.selfcheck.hint.HINTS` appends.
        episodes: The turns' reference log-probs, rewards and the hint's probabilities.
    """

    space: ResponseSpace
    prompts: tuple[tuple[int, ...], ...]
    hints: tuple[tuple[int, ...], ...]
    episodes: TwoTurns

    def optimum(self, beta: float) -> TiltedOptimum:
        return self.episodes.optimum(beta)

    def distance(self, policy: nn.Module, beta: float) -> float:
        """The policy's exact ``E_x KL(pi || pi*)`` over whole episodes, in nats."""
        logprobs = episode_logprobs(self.space, self.prompts, self.hints, float64_copy(policy))
        return self.episodes.distance(*logprobs, beta)


def episode_logprobs(
    space: ResponseSpace,
    prompts: tuple[tuple[int, ...], ...],
    hints: tuple[tuple[int, ...], ...],
    exact: nn.Module,
) -> tuple[Tensor, Tensor]:
    """``(P, N)`` first replies' and ``(P, N, O, N)`` second replies' log-probs under ``exact``: the
    second after the prompt, the first reply as sampled (its stop token included) and the hint."""
    replies = [r.token_ids for r in space.responses()]
    first = torch.stack([space.logprobs(exact, list(p)) for p in prompts])
    second = [
        torch.stack(
            [torch.stack([space.logprobs(exact, [*p, *reply, *hint]) for hint in hints]) for reply in replies]
        )
        for p in prompts
    ]
    return first, torch.stack(second)


def sampling_space(module: Any) -> ResponseSpace:
    """What the fitted ``module`` samples in a reply: its tokens, stop token, length and temperature."""
    excluded = {*module.suppressed_ids, module.stop_token_id}
    return ResponseSpace(
        tokens=tuple(i for i in range(len(module.tokenizer)) if i not in excluded),
        stop_token_id=module.stop_token_id,
        max_new_tokens=module.generation_config.max_new_tokens,
        temperature=module.generation_config.temperature,
    )


def list_task(module: Any, task: SelfcheckTask) -> ListedTask | ListedEpisodes:
    """Every response (one turn) or episode (two) the fitted ``module`` could sample, scored and
    weighed by its reference."""
    tokenizer, space = module.tokenizer, sampling_space(module)
    reference = AutoModelForCausalLM.from_pretrained(module.hparams["reference"] or module.hparams["policy"])
    exact = reference.double().eval()
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in space.responses()]
    prompts = tuple(tuple(prompt_ids(tokenizer, p)) for p in task.prompts)
    if task.turns == 1:
        ref = torch.stack([space.logprobs(exact, list(ids)) for ids in prompts])
        if task.raters:  # every prompt's rows are rated by each rater in turn
            length = task.max_new_tokens
            rated = [[rater_score(c, t, length, task.raters) for t in texts] for c in task.raters]
            by_rater = torch.tensor(rated, dtype=torch.float64)[:, None].expand(-1, len(prompts), -1)
            return ListedTask(space, prompts, by_rater.mean(dim=0), ref, by_rater)
        scores = [
            [prompt_char_score(p, t, task.max_new_tokens, task.offsets) for t in texts] for p in task.prompts
        ]
        return ListedTask(space, prompts, torch.tensor(scores, dtype=torch.float64), ref)
    hints = tuple(tuple(tokenizer(h, add_special_tokens=False)["input_ids"]) for h in HINTS)
    ref1, ref2 = episode_logprobs(space, prompts, hints, exact)
    second = [
        [[hint_reward(p, h, t, task.max_new_tokens) for t in texts] for h in HINTS] for p in task.prompts
    ]
    r2 = torch.tensor(second, dtype=torch.float64)[:, None].expand(-1, len(texts), -1, -1)
    transition = torch.tensor([hint_probabilities(t) for t in texts], dtype=torch.float64)
    episodes = TwoTurns(ref1, torch.zeros_like(ref1), transition.expand(len(prompts), -1, -1), ref2, r2)
    return ListedEpisodes(space, prompts, hints, episodes)
