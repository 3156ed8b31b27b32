"""PPOLightningModule through the real Trainer: ratio 1, step counts, frozen roles, checkpoints."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.data import PromptBatch
from lightning_ppo.module import RolloutForwards
from lightning_ppo.ppo.experience import make_experience
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rewards import ScoreInputs, check_scores
from tests.helpers import CountCharReward, prompt_data, quiet_trainer


def _module(path, **ppo) -> PPOLightningModule:
    config = PPOConfig(**{"ppo_epochs": 2, "num_minibatches": 2, "kl_coef": 0.05, **ppo})
    return PPOLightningModule(
        policy=str(path),
        reward_fn=CountCharReward(),
        ppo=config,
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )


def _first_rollout(module: PPOLightningModule) -> tuple[PromptBatch, Rollout, RolloutForwards]:
    """The first training batch, its rollout and the rollout's forwards, outside any Trainer."""
    data = prompt_data()
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rollout = module.generate(batch)
    return batch, rollout, module.rollout_forwards(rollout)


def test_first_minibatch_of_first_epoch_has_ratio_exactly_one(tiny_gpt2):
    torch.manual_seed(0)
    module = _module(tiny_gpt2)
    batch, rollout, forwards = _first_rollout(module)
    scores = check_scores(
        module.score(batch.prompts, module.decode_responses(rollout), ScoreInputs(batch.extras, rollout)),
        len(batch),
        "r",
    )
    exp = make_experience(
        rollout, forwards.logprobs, forwards.ref_logprobs, forwards.values, scores, 0.05, module.ppo
    )
    _, stats = module.ppo_loss(next(exp.minibatches(2, torch.Generator().manual_seed(0))))
    assert stats["val/ratio"].item() == 1.0
    assert stats["policy/approxkl_avg"].item() == 0.0
    assert stats["policy/clipfrac_avg"].item() == 0.0
    # policy and reference start from the same weights: the KL of every token is exactly 0
    assert exp.kl.abs().max().item() == 0.0


def test_fit_counts_optimizer_steps_keeps_frozen_roles_and_trains_the_rest(tiny_gpt2, tmp_path):
    torch.manual_seed(0)
    module = _module(tiny_gpt2, ppo_epochs=3, num_minibatches=2, gradient_accumulation_steps=2)
    ref_before = {k: v.clone() for k, v in module.ref_policy.state_dict().items()}
    policy_before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    head_before = module.value_model.v_head.weight.clone()
    trainer = quiet_trainer(tmp_path, iterations=2)
    trainer.fit(module, datamodule=prompt_data())
    assert trainer.global_step == 2 * 3 * 2  # iterations x ppo_epochs x num_minibatches
    assert module.iteration == 2 and module.episodes == 16
    for key, value in module.ref_policy.state_dict().items():
        assert torch.equal(value, ref_before[key]), key
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, policy_before[k])]
    assert len(changed) > 0.5 * len(policy_before)
    assert not torch.equal(module.value_model.v_head.weight, head_before)
    assert all(not p.requires_grad for p in module.ref_policy.parameters())


def test_logged_metrics_are_finite_and_consistent(tiny_gpt2, tmp_path):
    torch.manual_seed(0)
    module = _module(tiny_gpt2)
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=prompt_data())
    m = {k: float(v) for k, v in trainer.logged_metrics.items()}
    for key in (
        "objective/kl",
        "objective/scores",
        "policy/approxkl_avg",
        "loss/value_avg",
        "val/ratio",
        "returns/mean",
        "response/length_mean",
        "response/eos_fraction",
        "kl_coef",
        "lr",
        "episode",
    ):
        assert key in m and torch.isfinite(torch.tensor(m[key])), key
    assert m["objective/rlhf_reward"] == pytest.approx(
        m["objective/scores"] + m["objective/non_score_reward"], abs=1e-5
    )
    assert 1.0 <= m["response/length_mean"] <= 6.0
    assert m["episode"] == 8.0
    assert m["lr"] == pytest.approx(1e-3)


def test_score_norm_keeps_the_raw_score_in_objective_scores(tiny_gpt2, tmp_path):
    torch.manual_seed(0)
    module = _module(tiny_gpt2, score_norm=True)
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=prompt_data())
    m = {k: float(v) for k, v in trainer.logged_metrics.items()}
    raw = torch.tensor(module.last_samples.scores)  # CountCharReward's own fractions, in [0, 1]
    assert m["objective/scores"] == pytest.approx(raw.mean().item(), abs=1e-6)
    assert m["objective/scores_std"] == pytest.approx(raw.std(correction=0).item(), abs=1e-6)
    # normalised by the moments of this very batch: mean 0
    assert m["objective/scores_normalized"] == pytest.approx(0.0, abs=1e-5)
    assert "objective/non_score_reward" in m


def test_checkpoint_leaves_frozen_roles_out_and_restores_state(tiny_gpt2, tmp_path):
    torch.manual_seed(0)
    module = _module(tiny_gpt2, kl_target=1.0)
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=prompt_data())
    path = tmp_path / "ppo.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert not any(k.startswith(("roles.ref_policy.", "reward_model.")) for k in ckpt["state_dict"])
    assert any(k.startswith("roles.policy.") for k in ckpt["state_dict"])
    restored = _module(tiny_gpt2, kl_target=1.0)
    restored.on_load_checkpoint(ckpt)
    assert restored.iteration == 1 and restored.kl_ctl.value == pytest.approx(module.kl_ctl.value)
    assert restored.kl_ctl.value != 0.05  # the adaptive controller moved and the move was saved


def test_no_reward_is_a_clear_error(tiny_gpt2):
    with pytest.raises(ValueError, match="no reward"):
        PPOLightningModule(policy=str(tiny_gpt2))


def test_unknown_stop_token_is_a_clear_error(tiny_gpt2):
    with pytest.raises(ValueError, match="generation.stop_token"):
        PPOLightningModule(
            policy=str(tiny_gpt2),
            reward_fn=CountCharReward(),
            generation=GenerationConfig(stop_token="<nope>"),
        )


def test_bad_reward_output_names_the_reward():
    with pytest.raises(ValueError, match="CountCharReward.*shape \\(4,\\)"):
        check_scores([1.0, 2.0], 4, "CountCharReward")
    with pytest.raises(ValueError, match="NaN or inf at positions \\[1\\]"):
        check_scores([1.0, float("nan")], 2, "r")
    with pytest.raises(TypeError, match="must return numbers"):
        check_scores(["a", "b"], 2, "r")


def test_entropy_bonus_enters_the_loss_only_when_configured(tiny_gpt2):
    torch.manual_seed(0)
    plain, bonus = _module(tiny_gpt2), _module(tiny_gpt2, entropy_coef=0.1)
    _, rollout, forwards = _first_rollout(plain)
    exp = make_experience(
        rollout, forwards.logprobs, forwards.ref_logprobs, forwards.values, torch.ones(8), 0.05, plain.ppo
    )
    loss, stats = plain.ppo_loss(exp)
    bonus_loss, bonus_stats = bonus.ppo_loss(exp)
    assert "policy/entropy_avg" not in stats  # no vocabulary-wide softmax when it is unused
    # the same rollout policy: its entropy over the response tokens, as the rollout measured it
    expected = (forwards.entropy * rollout.response_mask).sum() / rollout.response_mask.sum()
    assert bonus_stats["policy/entropy_avg"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert (loss - bonus_loss).item() == pytest.approx(0.1 * expected.item(), rel=1e-4)
    assert bonus_loss.requires_grad
