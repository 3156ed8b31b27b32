"""The bare-PyTorch floor: the same PPO passes as lightning_ppo and TRL, with no framework around them.

One iteration: HF ``generate`` (KV cache) -> policy, reference, value and reward forwards ->
KL-penalised per-token rewards, GAE, whitened advantages -> ``ppo_epochs`` x ``num_minibatches``
of policy + value forward, backward and one AdamW step. No logging, no statistics, no NaN guard,
no host syncs beyond what ``generate`` does itself. It uses the same kernels lightning_ppo picks
(fused AdamW, and PyTorch's fused tanh GELU where a GPT-2 config asks for ``gelu_new``), so the
ratio to it measures the framework around the passes, not a choice of kernels. Mixed precision is
``torch.autocast(dtype=torch.bfloat16)`` around the forwards, as Lightning's ``bf16-mixed`` does.

    python -m benchmarks.floor SPEC.json RESULT.json
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
)

from benchmarks import common
from lightning_ppo.models.loading import load_config

TEMPERATURE = common.TEMPERATURE


class Critic(nn.Module):
    """A backbone with a zero-initialised scalar head: one value per position."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def token_logprobs(model: nn.Module, ids: Tensor, mask: Tensor, pos: Tensor, tokens: Tensor) -> Tensor:
    """(B, R) log-probs of the last R tokens; the LM head runs on those positions only."""
    length = tokens.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=length + 1).logits
    logits = logits[:, :-1].float()
    if TEMPERATURE != 1.0:
        logits = logits / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def gae(rewards: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """GAE over the response; positions past the stop token carry nothing."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + common.GAMMA * next_value - values[:, t]
        next_advantage = (delta + common.GAMMA * common.GAE_LAMBDA * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    returns = (advantages + values) * mask
    mean = masked_mean(advantages, mask)
    var = masked_mean((advantages - mean).square(), mask)
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def ppo_loss(
    logprobs: Tensor,
    values: Tensor,
    old_logprobs: Tensor,
    old_values: Tensor,
    advantages: Tensor,
    returns: Tensor,
    mask: Tensor,
) -> Tensor:
    """Clipped policy loss + vf_coef x clipped value loss, masked means over real response tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1 - common.CLIP_RANGE, 1 + common.CLIP_RANGE)
    policy_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    clip = common.VALUE_CLIP_RANGE
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    value_loss = torch.maximum((values - returns).square(), (clipped_values - returns).square())
    return masked_mean(policy_loss, mask) + common.VF_COEF * 0.5 * masked_mean(value_loss, mask)


def run(spec: common.RunSpec) -> common.RunResult:
    torch.manual_seed(spec.seed)
    device = torch.device(spec.device)
    tokenizer = AutoTokenizer.from_pretrained(spec.policy, padding_side="left")
    # lightning_ppo's loader config: dropout off (as in lightning_ppo and TRL: the first minibatch
    # must reproduce the rollout's log-probs) and the one-kernel GELU. Setup only, not timed.
    config, reward_config = load_config(spec.policy), load_config(spec.reward)
    policy = AutoModelForCausalLM.from_pretrained(spec.policy, config=config).to(device).train()
    reference = AutoModelForCausalLM.from_pretrained(spec.policy, config=config)
    reference = reference.to(device).eval().requires_grad_(False)
    critic = Critic(AutoModel.from_pretrained(spec.policy, config=config)).to(device).train()
    reward_config.num_labels = 1
    reward_model = AutoModelForSequenceClassification.from_pretrained(spec.reward, config=reward_config)
    reward_model = reward_model.to(device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        [*policy.parameters(), *critic.parameters()], lr=common.LEARNING_RATE, weight_decay=0.0, fused=True
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    generation = GenerationConfig(
        do_sample=True,
        max_new_tokens=spec.response_length,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if spec.precision == "bf16-mixed" else nullcontext()
    )
    if spec.workload == "variable":
        texts = common.variable_prompts(spec.batch_size * spec.iterations, spec.response_length, spec.seed)
    else:
        texts = common.prompts(spec.batch_size * spec.iterations, spec.seed, spec.prompt_length)
    timer = common.PhaseTimer(spec.device, spec.phases)
    clock = common.IterationClock(spec.device)
    result = common.RunResult(spec=vars(spec))
    clock.mark()
    for it in range(spec.iterations):
        batch_texts = texts[it * spec.batch_size : (it + 1) * spec.batch_size]
        encoded = tokenizer(batch_texts, return_tensors="pt", padding=True)
        prompt_ids = encoded["input_ids"].to(device)
        prompt_mask = encoded["attention_mask"].to(device).bool()

        with timer("generate"), torch.no_grad(), autocast:
            policy.eval()
            sequences = policy.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=generation
            )
            policy.train()
        responses = sequences[:, prompt_ids.shape[1] :]
        width = responses.shape[1]
        # Real response tokens: up to and including the first stop token.
        is_stop = responses == eos
        stop_at = torch.where(is_stop.any(1), is_stop.int().argmax(1), width - 1)
        response_mask = torch.arange(width, device=device)[None, :] <= stop_at[:, None]
        responses = responses.masked_fill(~response_mask, pad)
        if spec.workload == "variable":  # the lengths every variant cuts at (a cheap rewrite, timed)
            responses, response_mask = common.length_schedule(
                responses, batch_texts, spec.response_length, pad
            )
        ids = torch.cat([prompt_ids, responses], dim=1)
        mask = torch.cat([prompt_mask, response_mask], dim=1)
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)
        rmask = response_mask.float()

        with timer("rollout_forwards"), torch.no_grad(), autocast:
            old_logprobs = token_logprobs(policy, ids, mask, pos, responses)
            ref_logprobs = token_logprobs(reference, ids, mask, pos, responses)
            old_values = critic(ids, mask, pos)[:, -width - 1 : -1]
        with timer("reward"), torch.no_grad(), autocast:
            backbone = getattr(reward_model, reward_model.base_model_prefix)
            hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=pos)
            last = mask.shape[1] - 1 - mask.long().flip(1).argmax(1)
            rows = torch.arange(len(ids), device=device)
            scores = reward_model.score(hidden.last_hidden_state[rows, last]).squeeze(-1).float()

        with timer("experience"), torch.no_grad():
            rewards = -common.KL_COEF * (old_logprobs - ref_logprobs) * rmask
            rewards[rows, response_mask.sum(1) - 1] += scores
            old_values = old_values * rmask
            advantages, returns = gae(rewards, old_values, rmask)

        with timer("train"):
            for _ in range(spec.ppo_epochs):
                for idx in torch.randperm(len(ids), device=device).chunk(spec.num_minibatches):
                    with autocast:
                        logprobs = token_logprobs(policy, ids[idx], mask[idx], pos[idx], responses[idx])
                        values = critic(ids[idx], mask[idx], pos[idx])[:, -width - 1 : -1]
                    loss = ppo_loss(
                        logprobs,
                        values,
                        old_logprobs[idx],
                        old_values[idx],
                        advantages[idx],
                        returns[idx],
                        rmask[idx],
                    )
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        if spec.workload == "variable":  # the policy's forwards: rollout + one per epoch, padded
            result.tokens_computed += (1 + spec.ppo_epochs) * ids.numel()
            result.tokens_real += (1 + spec.ppo_epochs) * int(mask.sum())
        clock.mark()
        timer.end_iteration()
        result.response_width = width

    result.iteration_s, result.gc_s, result.phases = clock.intervals(), clock.gc_intervals(), timer.history
    return common.finish(result, spec.device)


if __name__ == "__main__":
    common.runner_main(run)
