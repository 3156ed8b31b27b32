"""Guardrails: each one-time warning against hand-made iterations, a forced collapse end to end,
and the bounded adaptive KL controller."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.checkpoint import PPOCheckpoint
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.runs.warn import LightningPPOWarning
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from lightning_ppo.tasks.reveal import RevealDigits, RevealDigitsDataModule
from lightning_ppo.watch.guardrails import Guardrails, IterationView
from tests.helpers import fit_warnings, quiet_trainer

CALM = {"approx_kl": 0.02, "clipfrac": 0.1, "kl": 3.0, "kl_coef": 0.05, "kl_coef_pinned": False}


def _view(iteration=1, completions=("12", "34", "56", "78"), scores_std=0.3, **stats) -> IterationView:
    stats.setdefault("kl_coef_base", stats.get("kl_coef", CALM["kl_coef"]))
    return IterationView(iteration, list(completions), scores_std=scores_std, **{**CALM, **stats})


def test_a_step_far_outside_the_trust_region_names_the_learning_rate_once():
    rails = Guardrails(PPOConfig(), lr=1e-3)
    assert rails.observe(_view()) == []
    (message,) = rails.observe(_view(2, approx_kl=4.5, clipfrac=0.55))  # the user's warm-started run
    assert message.startswith("policy/approxkl_avg 4.5 and policy/clipfrac_avg 0.55 at iteration 2")
    assert "learning rate 0.001 is too large" in message and "model.optimizer.init_args.lr" in message
    assert rails.observe(_view(3, approx_kl=4.5)) == []  # once
    late = Guardrails(PPOConfig(), lr=1e-3)
    assert late.observe(_view(11, approx_kl=4.5)) == []  # only the first iterations judge the step size


def test_a_guardrail_warns_as_the_errors_read_one_line_without_a_source_path():
    """Printed before as ``/.../lightning_ppo/watch/guardrails.py:121: policy/approxkl_avg ...``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Guardrails(PPOConfig(), lr=1e-3).heed(_view(1, approx_kl=4.5, clipfrac=0.55))
    (warning,) = caught
    assert warning.category is LightningPPOWarning and issubclass(LightningPPOWarning, UserWarning)
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno)
    assert shown.startswith("lightning-ppo: warning: policy/approxkl_avg 4.5 and policy/clipfrac_avg 0.55")
    assert shown.count("\n") == 1 and ".py:" not in shown
    other = warnings.formatwarning("a plain warning", UserWarning, "/x/other.py", 7)
    assert other.startswith("/x/other.py:7: UserWarning: a plain warning")  # every other warning as before


def test_collapse_fires_after_three_identical_or_empty_batches_in_a_row():
    rails = Guardrails(PPOConfig(kl_target=4.0), lr=1e-3)
    empty = ("",) * 8
    assert rails.observe(_view(1, empty)) == []
    assert rails.observe(_view(2, empty)) == []
    assert rails.observe(_view(3)) == []  # a varied batch starts the count again
    assert rails.observe(_view(4, empty)) == [] and rails.observe(_view(5, empty)) == []
    (message,) = rails.observe(_view(6, empty))
    assert message.startswith("response collapse: all 8 responses of each of the last 3 iterations were")
    assert "were empty" in message
    assert "smaller learning rate (now 0.001" in message
    assert "kl_target" not in message.split("model.optimizer.init_args.lr")[1]  # it is set already
    same = Guardrails(PPOConfig(), lr=1e-3)
    messages = [same.observe(_view(i, ("admin.",) * 4)) for i in range(3)]
    assert messages[:2] == [[], []] and "the same text 'admin.'" in messages[2][0]


def test_entropy_collapsing_without_a_better_score_is_named_and_learning_is_not():
    rails = Guardrails(PPOConfig(), lr=1e-3)
    early = [rails.observe(_view(i, entropy=2.0, score=0.3)) for i in range(1, 6)]
    late = [rails.observe(_view(i, entropy=0.15, score=0.3)) for i in range(6, 10)]
    assert early + late == [[]] * 9  # the window of 5 late iterations is not full yet
    (message,) = rails.observe(_view(10, entropy=0.15, score=0.29))
    assert message.startswith(
        "objective/entropy fell to 0.15 nats per response token from 2 at the start while "
        "objective/scores did not rise (0.3 -> 0.298)"
    )
    assert "smaller learning rate (now 0.001" in message and "ppo.entropy_coef" in message
    learned = Guardrails(PPOConfig(), lr=1e-3)
    views = [_view(i, entropy=2.0, score=0.3) for i in range(1, 6)]
    views += [_view(i, entropy=0.1, score=0.9) for i in range(6, 20)]  # certain, and better: fine
    assert [m for view in views for m in learned.observe(view)] == []


def test_kl_coef_at_its_bound_or_grown_tenfold_is_reported_with_advice_that_fits():
    config = PPOConfig(kl_target=4.0, kl_coef=0.05, score_norm=True)
    (message,) = Guardrails(config, lr=1e-3).observe(_view(kl=25.0, kl_coef=0.6))
    assert message.startswith("kl_coef 0.6 is 12x its start (0.05 at the start; bounds ppo.kl_coef_min")
    assert "objective/kl is 25 against ppo.kl_target 4.0: the policy moves faster" in message
    (low,) = Guardrails(config, lr=1e-3).observe(_view(kl=0.5, kl_coef=0.001, kl_coef_pinned=True))
    assert "is at its bound" in low and "score_norm" not in low  # it is on already
    off = Guardrails(PPOConfig(kl_target=4.0), lr=1e-3).observe(_view(kl=0.5, kl_coef=0.004))
    assert "set ppo.score_norm: true" in off[0]
    assert Guardrails(PPOConfig(), lr=1e-3).observe(_view(kl_coef=5.0)) == []  # fixed kl_coef: not watched
    # the proportional part answering a KL 2.7x the target on its own is no runaway
    assert Guardrails(config, lr=1e-3).observe(_view(kl=11.0, kl_coef=0.6, kl_coef_base=0.22)) == []


def test_reward_scale_advice_never_names_a_setting_that_is_on():
    for config, advised in ((PPOConfig(), True), (PPOConfig(score_norm=True, kl_coef=2.0), False)):
        rails = Guardrails(config, lr=1e-3)
        views = [_view(i + 20, scores_std=0.006, kl_coef=config.kl_coef) for i in range(5)]
        messages = [m for view in views for m in rails.observe(view)]
        (message,) = messages
        assert "so the score will stay flat" in message
        assert ("score_norm" in message) == advised


class EmptyAnswerReward:
    """Pays only for the empty answer: a collapse the guardrails must name."""

    def __call__(self, prompts, completions, batch):
        return [1.0 if c == "" else 0.0 for c in completions]


def test_a_forced_collapse_is_named(tiny_digits, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=EmptyAnswerReward(),
        ppo=PPOConfig(ppo_epochs=4, num_minibatches=1, kl_coef=0.0),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-1),
    )
    data = DigitsDataModule(num_prompts=512, num_digits=3, batch_size=16, max_prompt_length=8)
    caught = fit_warnings(module, data, iterations=30)
    assert "collapse" in module.guardrails.fired, module.last_samples.completions
    assert any(message.startswith("response collapse: all 16 responses") for message in caught)


class UnscoredAtTheStart:
    """The digits reward, but not applicable (``None``) to the first row of the run's first batch."""

    def __call__(self, prompts, completions, batch):
        scores = DigitsReward()(prompts, completions, batch).tolist()
        return [None, *scores[1:]] if batch.trainer_state.global_step == 0 else scores


def _wild(policy) -> PPOLightningModule:
    """lr 0.1: a step far outside the trust region from the first iteration on."""
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=UnscoredAtTheStart(),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-1),
    )


def _stops_after(root, iterations: int, dirpath) -> pl.Trainer:
    """A quiet Trainer that saves every iteration and stops by max_steps (2 per iteration), as a killed
    run would: mid-epoch, so that a resume goes on in the same epoch."""
    return pl.Trainer(
        accelerator="cpu",
        max_steps=2 * iterations,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[PPOCheckpoint(every_n_iterations=1, dirpath=dirpath)],
    )


def test_the_guardrails_and_the_unscored_count_carry_on_through_a_resume(tiny_digits, tmp_path):
    """Before, a resumed run forgot which warnings it gave (the trust region's came again), started
    the entropy window at the resume, and stopped logging reward/unscored."""
    data = DigitsDataModule(num_prompts=512, num_digits=3, batch_size=8, max_prompt_length=8)
    first = _wild(tiny_digits)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _stops_after(tmp_path, 3, tmp_path / "ckpt").fit(first, datamodule=data)
    assert "trust_region" in first.guardrails.fired and len(first.guardrails.early) == 3
    second = _wild(tiny_digits)
    trainer = _stops_after(tmp_path, 5, tmp_path / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(second, datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert second.iteration == 5
    assert not [w for w in caught if str(w.message).startswith("policy/approxkl_avg")]  # given once
    assert second.guardrails.fired >= first.guardrails.fired
    assert second.guardrails.early[:3] == first.guardrails.early  # the run's start, not the resume's
    assert len(second.guardrails.early) == 5
    assert float(trainer.callback_metrics["reward/unscored"]) == 0.0  # still logged after the resume


class ScoresPerIteration(pl.Callback):
    """The population std of every iteration's scores as logged: the reward's plus the environment's."""

    def __init__(self) -> None:
        self.stds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stds.append(float(torch.tensor(pl_module.last_samples.scores).std(unbiased=False)))


@pytest.mark.parametrize("reward_weights", [None, [0.01]], ids=["environment only", "with a 0.01 reward"])
def test_the_reward_scale_is_judged_on_every_reward_the_update_uses(reward_weights, tiny_digits, tmp_path):
    """The reveal task (the environment pays 0 to 1 for the digits repeated), alone or with the digits
    reward at 0.01 beside it. Before, the spread judged left the environment's rewards out: 0 for
    the environment alone (the reward-scale and small-steps checks could never speak), and 0.004 with
    the small reward beside it, so 'the scores the update uses vary by 0.004 ... set ppo.score_norm:
    true' spoke while the score rose, advice that would blow the small reward up over the
    environment's."""
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=None if reward_weights is None else DigitsReward(),
        reward_weights=reward_weights,
        environment=RevealDigits(),
        episode=EpisodeConfig(max_turns=2, max_tokens=18),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.05),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = RevealDigitsDataModule(num_prompts=256, batch_size=16, max_prompt_length=8)
    spreads = ScoresPerIteration()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        quiet_trainer(tmp_path, iterations=6, callbacks=[spreads]).fit(module, datamodule=data)
    rails = module.guardrails
    assert rails.spread_count == 6 and rails.spread_sum == pytest.approx(sum(spreads.stds), rel=1e-5)
    assert min(spreads.stds) > 0.05 and "reward_drowned" not in rails.fired


def test_beside_an_environments_rewards_the_reward_scale_advice_names_no_score_norm():
    """ppo.score_norm normalises the reward's scores, not the environment's: advice to set it would
    scale one part of the rewards against the other."""
    rails = Guardrails(PPOConfig(), lr=1e-3)
    views = [_view(i + 20, scores_std=0.006, environment_rewards=True) for i in range(5)]
    (message,) = [m for view in views for m in rails.observe(view)]
    assert message.startswith(
        "the rewards the update uses (the reward's scores and the environment's) vary by"
    )
    assert "score_norm" not in message and "Scale the rewards up, lower ppo.kl_coef" in message
    (low,) = Guardrails(PPOConfig(kl_target=4.0), lr=1e-3).observe(
        _view(kl=0.5, kl_coef=0.004, environment_rewards=True)
    )
    assert "raise the rewards' scale" in low and "score_norm" not in low
