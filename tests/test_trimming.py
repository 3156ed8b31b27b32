"""Micro-batches trimmed to their own longest sequence give the padded path's losses and gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.data import PromptDataModule
from lightning_ppo.ppo.experience import make_experience
from tests.helpers import CountCharReward
from tests.tolerances import reordered_tolerance

# prompts of 2 to 9 characters: every batch has left padding, short prompts more of it
PROMPTS = [("1234567" * 2)[: 1 + i % 8] + "=" for i in range(16)]


def _experience(module: PPOLightningModule):
    data = PromptDataModule(prompts=PROMPTS, batch_size=16, max_prompt_length=12, shuffle=False)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rollout = module.generate(batch)
    forwards = module.rollout_forwards(rollout)
    scores = torch.tensor(CountCharReward()(batch.prompts, module.decode_responses(rollout), None))
    return make_experience(
        rollout, forwards.logprobs, forwards.ref_logprobs, forwards.values, scores, 0.05, module.ppo
    )


@pytest.mark.parametrize(
    ("layout", "ppo"),
    [("separate", {}), ("shared", {}), ("separate", {"advantage_estimator": "grpo", "num_generations": 2})],
)
def test_a_trimmed_micro_batch_gives_the_padded_loss_and_gradients(layout, ppo, tiny_gpt2):
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        value_model=layout,
        ppo=PPOConfig(**ppo),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
    )
    exp = _experience(module)
    lengths = exp.response_mask.sum(1)
    short = torch.argsort(lengths)[:4]  # the four shortest responses, as one micro-batch
    micro = exp.select(short)
    trimmed = micro.trimmed()
    assert trimmed.input_ids.shape[1] < micro.input_ids.shape[1]  # columns were removed on both sides
    assert trimmed.response_ids.shape[1] == int(lengths[short].max())
    results = []
    for mb in (micro, trimmed):
        module.zero_grad(set_to_none=True)
        loss, stats = module.ppo_loss(mb)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
        results.append((loss.detach(), stats, grads))
    (loss, stats, grads), (loss_t, stats_t, grads_t) = results
    # float32 summation in other matrix shapes (measured: 3e-8 on the loss, 2e-8 on the gradients)
    torch.testing.assert_close(loss_t, loss, rtol=0, atol=reordered_tolerance(loss, terms=1.0))
    torch.testing.assert_close(grads_t, grads, rtol=0, atol=reordered_tolerance(grads))
    for key in stats:
        tolerance = reordered_tolerance(stats[key], terms=1.0)
        torch.testing.assert_close(stats_t[key], stats[key], rtol=0, atol=tolerance)


def test_a_micro_batch_without_shared_padding_is_left_as_it_is(tiny_gpt2):
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_gpt2), reward_fn=CountCharReward(), generation=GenerationConfig(max_new_tokens=12)
    )
    exp = _experience(module)
    longest_prompt = exp.attention_mask[:, 0].nonzero()[0]
    longest_response = exp.response_mask.sum(1).argmax()
    both = exp.select(torch.stack([longest_prompt[0], longest_response]))
    if both.attention_mask[:, 0].any() and both.response_mask[:, -1].any():
        assert both.trimmed() is both
