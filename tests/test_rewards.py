"""Reward models score the last real token, whatever the padding; reward functions by class_path."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from lightning_ppo.rewards import RewardModel
from lightning_ppo.rollout import Rollout

EOS = 1  # also the pad id below: HF's own pooling would look for the first pad and pick the wrong token


def test_reward_model_reads_the_last_real_token_with_pad_equal_eos(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=20, n_layer=2, n_embd=32, n_head=2, num_labels=1, pad_token_id=EOS, eos_token_id=EOS
    )
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    reward = RewardModel.from_pretrained(str(tmp_path))
    # Row 0: left-padded prompt, response "7 EOS" then padding (= EOS ids); row 1: no padding at all.
    rollout = Rollout(
        prompt_ids=torch.tensor([[EOS, 5, 6], [4, 5, 6]]),
        prompt_mask=torch.tensor([[False, True, True], [True, True, True]]),
        response_ids=torch.tensor([[7, EOS, EOS, EOS], [7, 8, 9, 10]]),
        response_mask=torch.tensor([[True, True, False, False], [True, True, True, True]]),
        ended=torch.tensor([True, False]),
    )
    scores = reward(rollout.input_ids, rollout.attention_mask, rollout.position_ids)
    # The same sequences scored alone, without any padding, by HF's own classifier.
    alone = [torch.tensor([[5, 6, 7, EOS]]), torch.tensor([[4, 5, 6, 7, 8, 9, 10]])]
    with torch.no_grad():
        expected = []
        for ids in alone:
            hidden = reward.model.transformer(input_ids=ids).last_hidden_state
            expected.append(reward.model.score(hidden[0, -1]).item())
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5)
    assert all(not p.requires_grad for p in reward.parameters())
