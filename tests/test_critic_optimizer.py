"""The critic's own learning rate and gradient clip (model.critic_optimizer, ppo.critic_max_grad_norm).

One optimizer with a param group per role (lightning_ppo.ppo.param_groups): each role moves at its own
rate and is clipped to its own norm, and without either setting the update is today's, bit for bit.
"""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quiet_trainer

LAYOUTS = ("separate", "shared")


def _module(policy, value_model="separate", optimizer=None, critic_optimizer=None, **ppo):
    pl.seed_everything(0)
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=DigitsReward(),
        value_model=value_model,
        ppo=PPOConfig(**{"ppo_epochs": 1, "num_minibatches": 2, **ppo}),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=optimizer or partial(torch.optim.AdamW, lr=1e-3),
        critic_optimizer=critic_optimizer,
    )


def _fit(module, root, iterations=1, precision="32-true") -> pl.Trainer:
    data = DigitsDataModule(num_prompts=16, num_digits=3, batch_size=8, max_prompt_length=8)
    if precision == "16-mixed":  # the grad scaler's path on CPU too (as tests/test_faults.py)
        trainer = quiet_trainer(root, iterations, plugins=[MixedPrecision("16-mixed", "cpu")], precision=None)
    else:
        trainer = quiet_trainer(root, iterations)
    trainer.fit(module, datamodule=data)
    return trainer


def _roles(module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The trained weights of the policy and of the critic (the value model, or the shared head)."""
    critic_ids = {id(p) for p in module.roles.critic_parameters()}
    policy, critic = {}, {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            (critic if id(p) in critic_ids else policy)[name] = p.detach().clone()
    return policy, critic


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> torch.Tensor:
    """The norm of the whole update of one role, in float64."""
    return torch.cat([(after[n].double() - before[n].double()).flatten() for n in before]).norm()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("still", ["policy", "critic"])
def test_each_role_moves_at_its_own_rate(tiny_digits, tmp_path, layout, still):
    """With one role's lr 0 that role is bitwise unchanged while the other moves (AdamW's decay is
    lr x weight_decay: 0 too)."""
    rates = {"policy": 1e-2, "critic": 1e-2, still: 0.0}
    module = _module(
        tiny_digits,
        layout,
        optimizer=partial(torch.optim.AdamW, lr=rates["policy"]),
        critic_optimizer=partial(torch.optim.AdamW, lr=rates["critic"]),
    )
    start = _roles(module)
    trainer = _fit(module, tmp_path)
    end = _roles(module)
    assert len(start[1]) == (2 if layout == "shared" else len(list(module.value_model.parameters())))
    for role, before, after in zip(("policy", "critic"), start, end, strict=True):
        if role == still:
            assert all(torch.equal(before[n], after[n]) for n in before), role
        else:
            assert _moved(before, after) > 1e-3, role  # 2 AdamW steps of lr 1e-2
    groups = module.optimizers().optimizer.param_groups
    assert [g["lr"] for g in groups] == [rates["policy"], rates["critic"]]
    assert trainer.callback_metrics["lr"] == rates["policy"]
    assert trainer.callback_metrics["lr_critic"] == rates["critic"]


def test_without_critic_settings_the_optimizer_gets_one_group_as_before(tiny_digits, tmp_path):
    """Nothing set: the optimizer is built on the flat list of trained parameters in module order, as
    before these settings existed (one group, one clip: the same update, bit for bit). The critic in a
    group of its own with the same settings and the one clip trains to the same bits as well."""
    received = []
    default = _module(tiny_digits, optimizer=lambda p: received.append(p) or torch.optim.AdamW(p, lr=1e-3))
    trainer = _fit(default, tmp_path / "default")
    assert len(received) == 1 and all(isinstance(p, torch.nn.Parameter) for p in received[0])
    assert [id(p) for p in received[0]] == [id(p) for p in default.parameters() if p.requires_grad]
    assert "train/grad_norm" in trainer.callback_metrics and "lr_critic" not in trainer.callback_metrics
    same = partial(torch.optim.AdamW, lr=1e-3)
    grouped = _module(tiny_digits, optimizer=same, critic_optimizer=same)
    _fit(grouped, tmp_path / "grouped")
    assert len(grouped.optimizers().optimizer.param_groups) == 2
    for (name, a), b in zip(default.state_dict().items(), grouped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_the_gradient_clip_is_per_role(tiny_digits, tmp_path, precision):
    """One SGD step of lr 1 moves each role by its clipped gradient: the policy by max_grad_norm, the
    critic by critic_max_grad_norm, each apart; the logged norms are each role's before clipping."""
    sgd = partial(torch.optim.SGD, lr=1.0)
    one_step = {"num_minibatches": 1, "optimizer": sgd}
    free = _module(tiny_digits, max_grad_norm=1e9, critic_max_grad_norm=1e9, **one_step)
    start = _roles(free)
    metrics = _fit(free, tmp_path / "free", precision=precision).callback_metrics
    raw = [_moved(b, a) for b, a in zip(start, _roles(free), strict=True)]  # the whole gradients
    # The weights are float32: each element of an update is off by at most half an ulp of the weight
    # (2^-24 relative), so a role's update norm by at most 2^-24 x its weights' norm.
    slack = [2.0**-24 * torch.cat([w.double().flatten() for w in role.values()]).norm() for role in start]
    logged = [float(metrics["policy/grad_norm"]), float(metrics["val/grad_norm"])]
    for norm, moved, err in zip(logged, raw, slack, strict=True):
        assert abs(norm - moved) <= err
    limits = (float(raw[0]) / 2, float(raw[1]) / 4)  # each role's own cut
    clipped = _module(tiny_digits, max_grad_norm=limits[0], critic_max_grad_norm=limits[1], **one_step)
    metrics = _fit(clipped, tmp_path / "clipped", precision=precision).callback_metrics
    assert [float(metrics["policy/grad_norm"]), float(metrics["val/grad_norm"])] == logged  # same gradients
    updates = [_moved(b, a) for b, a in zip(start, _roles(clipped), strict=True)]
    for limit, update, norm, err in zip(limits, updates, raw, slack, strict=True):
        # torch's clip multiplies by limit / (norm + 1e-6), a float32: short of the limit by
        # limit x 1e-6 / norm, and off by one rounding of the factor (2^-24 relative)
        assert abs(float(update) - limit) <= err + limit * (1e-6 / float(norm) + 2.0**-24)


def test_critic_settings_without_a_critic_or_of_another_class_are_one_line(tiny_digits, tmp_path):
    with pytest.raises(UsageError, match="^model.critic_optimizer must be null with ppo.advantage_estim"):
        _module(
            tiny_digits, advantage_estimator="grpo", num_generations=2, critic_optimizer=torch.optim.AdamW
        )
    with pytest.raises(UsageError, match="^ppo.critic_max_grad_norm must be null with advantage_estimator"):
        PPOConfig(advantage_estimator="rloo", num_generations=2, critic_max_grad_norm=1.0)
    with pytest.raises(UsageError, match=r"^ppo.critic_max_grad_norm must be > 0 or null, got 0.0$"):
        PPOConfig(critic_max_grad_norm=0.0)
    with pytest.raises(UsageError, match="^model.critic_optimizer: Invalid learning rate: -1.0$"):
        _module(tiny_digits, critic_optimizer=partial(torch.optim.AdamW, lr=-1.0))
    module = _module(tiny_digits, critic_optimizer=partial(torch.optim.SGD, lr=1e-2))
    with pytest.raises(UsageError, match="^model.critic_optimizer: SGD, but model.optimizer is AdamW: the"):
        _fit(module, tmp_path)
