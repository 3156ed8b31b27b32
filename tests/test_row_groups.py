"""Rows grouped by length without shared padding: the plan, and forwards and updates equal to padded ones."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

import lightning_ppo.module
from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.data import PromptDataModule
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.ppo.microbatches import MicroBatch, Share
from lightning_ppo.ppo.row_groups import equal_groups, forward_groups, plan_row_groups, row_extents
from lightning_ppo.rewards import RewardModel, at_last_real_token
from tests.helpers import CountCharReward, quiet_trainer
from tests.test_trimming import PROMPTS
from tests.tolerances import reordered_tolerance


def _rows(groups) -> list[list[int]]:
    return [g.rows.tolist() for g in groups]


def test_the_plan_splits_where_padding_costs_more_than_a_forward():
    # padded: 4 rows x (2 + 10) = 48 tokens; overhead 48 / 64 = 0.75 per group. One group costs
    # 48.75; rows {1, 3} and {0, 2} cost 2 x 3 = 6 and 2 x 12 = 24, + 1.5: 31.5; four: 30 + 3.
    groups = plan_row_groups([2, 2, 2, 2], [10, 1, 10, 1])
    assert _rows(groups) == [[1, 3], [0, 2]]
    assert [(g.before, g.after, g.area) for g in groups] == [(2, 1, 6), (2, 10, 24)]
    # equal lengths: one group, the padded batch's own cost
    assert _rows(plan_row_groups([3, 3, 3], [5, 5, 5])) == [[0, 1, 2]]
    # a budget of 12 tokens: the long rows alone (each 12), the short ones together (6)
    assert _rows(plan_row_groups([2, 2, 2, 2], [10, 1, 10, 1], budget=12)) == [[1, 3], [0], [2]]
    # a row longer than the budget still runs, alone
    assert _rows(plan_row_groups([2, 2], [10, 1], budget=4)) == [[1], [0]]
    # equal counts, sorted by length (what FSDP2 ranks and gradient_accumulation_steps use)
    assert _rows(equal_groups([1, 9, 1, 9], [1, 1, 2, 2], 2)) == [[0, 2], [1, 3]]


def test_extents_count_the_real_columns_on_each_side_of_the_split():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    assert row_extents(mask, 3).tolist() == [[2, 3, 1], [1, 2, 3]]
    # split 0: minus the first real column, and the last real column + 1: any layout. Alone, the
    # rows cost 3 + 4 + 5 tokens + 3 x 18 / 64 overhead, less than the padded 18 + 18 / 64.
    groups = forward_groups(mask, 0)
    assert [(g.columns(0).start, g.columns(0).stop) for g in groups] == [(1, 4), (2, 6), (0, 5)]


def _spread_rollout(module: PPOLightningModule):
    data = PromptDataModule(prompts=PROMPTS, batch_size=16, max_prompt_length=12, shuffle=False)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    return module.generate(next(iter(data.train_dataloader())))


@pytest.mark.parametrize("layout", ["separate", "shared", "lora"])
def test_grouped_rollout_forwards_equal_the_padded_rectangle(layout, tiny_gpt2):
    torch.manual_seed(0)
    roles = {"lora": LoraSettings(r=4)} if layout == "lora" else {"value_model": layout}
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
        **roles,
    )
    rollout = _spread_rollout(module)
    ids, mask, pos = rollout.input_ids, rollout.attention_mask, rollout.position_ids
    groups = forward_groups(mask, rollout.prompt_ids.shape[1])
    assert len(groups) > 1 and sum(g.area for g in groups) < ids.numel()  # padding was left out
    grouped = module.rollout_forwards(rollout)
    with torch.no_grad():
        width = rollout.response_ids.shape[1]
        logits, values = module.roles.policy_forward(ids, mask, pos, width)
        ref_logits = module.roles.reference_logits(ids, mask, pos, width)
    real = rollout.response_mask
    padded = [
        module.token_logprobs(logits, rollout.response_ids),
        module.token_logprobs(ref_logits, rollout.response_ids),
        values,
        module.token_entropy(logits),
    ]
    ours = [grouped.logprobs, grouped.ref_logprobs, grouped.values, grouped.entropy]
    for name, mine, theirs in zip(
        ["logprobs", "ref_logprobs", "values", "entropy"], ours, padded, strict=True
    ):
        tolerance = reordered_tolerance(theirs[real])
        torch.testing.assert_close(mine[real], theirs[real], rtol=0, atol=tolerance, msg=name)
        assert not mine[~real].any(), name


def test_a_reward_model_scores_groups_as_it_scores_the_whole_batch(tiny_reward):
    model = RewardModel.from_pretrained(str(tiny_reward))
    texts = ["1=", "12345678901234=", "7=", "99999999=", "3=", "123="]
    batch = model.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    mask = batch["attention_mask"].bool()
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    assert len(forward_groups(mask, 0)) > 1
    grouped = model(batch["input_ids"], mask, pos)
    with torch.no_grad():
        backbone = getattr(model.model, model.model.base_model_prefix)
        hidden = backbone(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=pos
        ).last_hidden_state
        whole = model.model.score(at_last_real_token(hidden, mask)).squeeze(-1)
    torch.testing.assert_close(grouped, whole, rtol=0, atol=reordered_tolerance(whole))


def _one_update(policy, budget: int | None, **kwargs) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    pl.seed_everything(0, verbose=False)
    module = PPOLightningModule(
        policy=str(policy),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(num_minibatches=2, micro_batch_tokens=budget, **kwargs.pop("ppo", {})),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
        **kwargs,
    )
    data = PromptDataModule(prompts=PROMPTS, batch_size=16, max_prompt_length=12, shuffle=False)
    trainer = quiet_trainer("unused", iterations=1)
    trainer.fit(module, datamodule=data)
    metrics = {
        k: float(v)
        for k, v in trainer.callback_metrics.items()
        if k.startswith(("loss/", "policy/", "val/", "objective/"))
    }
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, metrics


def _initial(policy) -> dict[str, torch.Tensor]:
    weights = AutoModelForCausalLM.from_pretrained(str(policy)).state_dict()
    return {f"roles.policy.{name}": weight for name, weight in weights.items()}


@pytest.mark.parametrize(
    "kwargs",
    [{"value_model": "separate"}, {"value_model": "shared"}, {"ppo": {"advantage_estimator": "grpo"}}],
    ids=["gae-separate", "gae-shared", "grpo"],
)
def test_grouped_micro_batches_give_the_padded_update(kwargs, tiny_gpt2, monkeypatch):
    if "ppo" in kwargs:
        kwargs = {"ppo": {**kwargs["ppo"], "num_generations": 2}}
    grouped = _one_update(tiny_gpt2, None, **dict(kwargs))  # runs that leave padding out
    budget = _one_update(tiny_gpt2, 48, **dict(kwargs))  # and within 48 tokens each
    # the padded path: each minibatch one micro-batch, its whole rectangle
    monkeypatch.setattr(
        lightning_ppo.module,
        "plan_minibatch",
        lambda facts, rows, *a: [MicroBatch(rows, [0, facts.length - 1], Share())],
    )
    padded, padded_metrics = _one_update(tiny_gpt2, None, **dict(kwargs))
    moved = max((padded[k] - initial).abs().max() for k, initial in _initial(tiny_gpt2).items())
    assert moved > 5e-5
    for weights, metrics in (grouped, budget):
        assert padded_metrics and padded_metrics.keys() == metrics.keys()
        for key, value in padded_metrics.items():
            assert metrics[key] == pytest.approx(value, abs=reordered_tolerance(value, terms=1.0)), key
        # 8 AdamW steps of lr 1e-5 moved weights by up to 8e-5 (asserted above); gradients summed
        # in another order moved them by 7e-8 at most (measured): 1e-6 is far below one step.
        for name, weight in padded.items():
            torch.testing.assert_close(weights[name], weight, rtol=0, atol=1e-6, msg=name)
