"""The exact optimum of the run as it was configured: its reference, sampling settings and beta.

Read from the fitted module, not from the selfcheck's own defaults, so an option the user passed
(``generation.temperature``, ``ppo.kl_coef`` through ``--beta``) is in the exact numbers too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from lightning_ppo.selfcheck.exact import TiltedOptimum, kl_to_optimum, tilted_optimum
from lightning_ppo.selfcheck.responses import ResponseSpace
from lightning_ppo.selfcheck.task import SelfcheckTask, prompt_char_score, prompt_ids


@dataclass(frozen=True)
class ListedTask:
    """Every response of every prompt, with its reward and reference log-prob.

    Attributes:
        space: What sampling may draw.
        prompts: The prompts' text and token ids.
        texts: Each response's text as the reward sees it.
        rewards: (P, N) the reward of each response of each prompt.
        ref_logprobs: (P, N) float64 log-prob under the reference.
    """

    space: ResponseSpace
    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    texts: tuple[str, ...]
    rewards: Tensor
    ref_logprobs: Tensor

    def logprobs(self, model: nn.Module) -> Tensor:
        """(P, N) float64 log-prob of every response under ``model``."""
        return torch.stack([self.space.logprobs(model, list(ids)) for _, ids in self.prompts])


def list_task(module, task: SelfcheckTask) -> ListedTask:
    """Every response the fitted ``module`` could sample, scored and weighed by its reference."""
    tokenizer = module.tokenizer
    excluded = {*module.suppressed_ids, module.stop_token_id}
    space = ResponseSpace(
        tokens=tuple(i for i in range(len(tokenizer)) if i not in excluded),
        stop_token_id=module.stop_token_id,
        max_new_tokens=module.generation_config.max_new_tokens,
        temperature=module.generation_config.temperature,
    )
    texts = tuple(tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in space.responses())
    prompts = tuple((p, tuple(prompt_ids(tokenizer, p))) for p in task.prompts)
    rewards = torch.tensor(
        [[prompt_char_score(p, t, task.max_new_tokens, task.offsets) for t in texts] for p, _ in prompts],
        dtype=torch.float64,
    )
    reference = AutoModelForCausalLM.from_pretrained(module.hparams["reference"] or module.hparams["policy"])
    ref = torch.stack([space.logprobs(reference, list(ids)) for _, ids in prompts])
    return ListedTask(space, prompts, texts, rewards, ref)


def optimum_of(listed: ListedTask, beta: float) -> TiltedOptimum:
    return tilted_optimum(listed.ref_logprobs, listed.rewards, beta)


def distance_of_policy(listed: ListedTask, policy: nn.Module, beta: float) -> float | None:
    """The trained policy's exact ``E_x KL(pi(.|x) || pi*(.|x))`` in nats, where its whole weights are
    in this process (``None`` for sharded weights: FSDP2's DTensors)."""
    if any(type(p).__name__ == "DTensor" for p in policy.parameters()):
        return None
    return float(kl_to_optimum(listed.logprobs(policy), listed.ref_logprobs, listed.rewards, beta).mean())
