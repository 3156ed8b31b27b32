"""The optimizer's param groups: one over the policy and the critic, or one per role.

By default one optimizer trains every trained parameter as one group, at one learning rate, under
one gradient clip. PPO recipes often train the critic faster than the policy (verl's PPO baseline:
actor lr 1e-6, critic lr 1e-5, each clipped to 1.0 apart; OpenRLHF: 5e-7 and 9e-6), so
``model.critic_optimizer`` and ``model.ppo.critic_max_grad_norm`` give the critic a group of its own:
group 0 the policy, group 1 the critic, in the same one optimizer. One optimizer, not two: one step,
one grad scaler update per step under ``16-mixed`` (Lightning's scaler updates after every
optimizer's step, and a second optimizer's gradients would be unscaled by the updated scale), and
DeepSpeed's one optimizer.

The critic's parameters are those of the role that only the value loss trains: the separate value
model, or with ``value_model: shared`` the value head alone (the backbone under it is the policy's,
trained at the policy's rate by both losses).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_ppo.config import UsageError

ROLES = ("policy", "critic")  # the groups' order when the critic has its own


@dataclass(frozen=True)
class CriticSettings:
    """The optimizer class and hyper-parameters ``model.critic_optimizer`` names for the critic's group."""

    kind: type[Optimizer]
    defaults: dict[str, Any]

    @classmethod
    def of(cls, factory: Callable[[Iterable], Optimizer]) -> CriticSettings:
        """Read from an optimizer ``factory`` builds on a stand-in parameter: the same callable a
        user gives ``model.optimizer`` (a class_path with init_args, a ``partial``, a lambda)."""
        try:
            probe = factory([torch.nn.Parameter(torch.zeros(1))])
        except ValueError as err:  # torch checks lr, betas, eps, weight_decay... in the constructor
            raise UsageError(f"model.critic_optimizer: {err}") from err
        return cls(type(probe), dict(probe.defaults))

    @property
    def name(self) -> str:
        """The class's import path, as a config names it (what a checkpoint records)."""
        return f"{self.kind.__module__}.{self.kind.__qualname__}"


def role_groups(
    trained: list[torch.nn.Parameter], critic: Iterable[torch.nn.Parameter], settings: CriticSettings | None
) -> list[dict[str, Any]]:
    """The policy's group (every trained parameter but the critic's) and the critic's (with its
    own settings, else the optimizer's), each in the order of ``trained``."""
    ids = {id(p) for p in critic}
    policy = [p for p in trained if id(p) not in ids]
    own = [p for p in trained if id(p) in ids]
    return [{"params": policy}, {"params": own, **(settings.defaults if settings else {})}]


def check_role_groups(optimizer: Optimizer, settings: CriticSettings | None) -> None:
    """Error when the built optimizer cannot hold the critic's group as configured (one line)."""
    if len(optimizer.param_groups) != len(ROLES):
        raise UsageError(
            f"model.optimizer: {type(optimizer).__name__} made {len(optimizer.param_groups)} param "
            f"groups of the {len(ROLES)} it was given (the policy's and the critic's, for "
            "model.critic_optimizer or model.ppo.critic_max_grad_norm): build it on the groups as given"
        )
    if settings is not None and type(optimizer) is not settings.kind:
        raise UsageError(
            f"model.critic_optimizer: {settings.kind.__name__}, but model.optimizer is "
            f"{type(optimizer).__name__}: the critic trains as a param group of the one optimizer, "
            "so give both the same class (its init_args may differ: lr, weight_decay, betas...)"
        )
