"""Resuming with a config that is not the checkpoint's: what differs, and whether it can work.

A checkpoint records the module's settings (its hyper-parameters). The config given to the resumed
run is the one that runs (LightningCLI would otherwise overwrite it with the checkpoint's, and only
for checkpoints passed by path), so a changed value is either a deliberate change, said once as a
warning, or one that cannot work with the saved weights: a different set of trained tensors
(LoRA on or off, another critic layout, an estimator with or without a critic, another model),
which is an error naming the settings that differ, before any optimizer state is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn


@dataclass(frozen=True)
class SettingChange:
    """One setting whose value in the checkpoint differs from the resumed run's config."""

    name: str  # dotted, as in the config: "model.ppo.num_minibatches"
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.name}: {self.saved!r} in the checkpoint, {self.now!r} now"


def setting_changes(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    prefix: str = "model",
    defaults: Mapping[str, Any] | None = None,
) -> list[SettingChange]:
    """Settings that differ between two hyper-parameter dicts, nested dicts compared field by field.

    A setting absent on one side (an older checkpoint, a new option) counts as ``None`` there,
    except that a new option the checkpoint predates, left at its default (``defaults``, nested
    like the hyper-parameters), is no change: the older code behaved as that default does. A
    section set on one side only (``lora``) is one change, not one per field.
    """
    changes, defaults = [], defaults or {}
    for key in sorted(set(saved) | set(now)):
        old, new, name = saved.get(key), now.get(key), f"{prefix}.{key}"
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            inner = defaults.get(key)
            changes += setting_changes(old, new, name, inner if isinstance(inner, Mapping) else None)
        elif key not in saved and key in defaults and new == defaults[key]:
            continue
        elif old != new:
            changes.append(SettingChange(name, old, new))
    return changes


def weight_mismatch(saved: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> list[str]:
    """Why the saved trained tensors cannot load into a model that trains ``expected``: a few lines."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    reshaped = sorted(
        f"{name} {tuple(saved[name].shape)} -> {tuple(expected[name].shape)}"
        for name in set(saved) & set(expected)
        if saved[name].shape != expected[name].shape
    )
    lines = []
    for label, names in (("not in the checkpoint", missing), ("not in this model", unexpected)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            lines.append(f"{len(names)} trained tensors {label}: {', '.join(names[:3])}{more}")
    if reshaped:
        lines.append(f"{len(reshaped)} with another shape: {', '.join(reshaped[:3])}")
    return lines


def check_resumable(
    checkpoint: Mapping[str, Any],
    hparams: Mapping[str, Any],
    trained: Mapping[str, Tensor],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Error if the saved trained weights cannot load into a model that trains ``trained``; warn
    about other setting changes (an option newer than the checkpoint, at its ``defaults``, is none).

    Runs before Lightning loads weights and optimizer state (whose own errors name no setting;
    frozen roles are left out of checkpoints, so the weights load non-strictly).
    """
    check_param_groups(checkpoint.get("hyper_parameters", {}), hparams)
    changes = setting_changes(checkpoint.get("hyper_parameters", {}), hparams, defaults=defaults)
    # A sharded checkpoint's weights are not in ``checkpoint``: the strategy loaded them already
    # (its distributed load fails on any missing or reshaped tensor).
    mismatch = weight_mismatch(checkpoint["state_dict"], trained) if "state_dict" in checkpoint else []
    if mismatch:
        raise UsageError(
            "the checkpoint's trained weights do not fit this model"
            + (f" ({'; '.join(map(str, changes))})" if changes else "")
            + ": "
            + "; ".join(mismatch)
            + ". Resume with the checkpoint's settings, or start a new run from its exported policy."
        )
    if changes:
        warn(
            "resuming with settings that differ from the checkpoint's; the run goes on with the "
            "config's values: " + "; ".join(map(str, changes))
        )


def per_role_groups(hparams: Mapping[str, Any]) -> bool:
    """Whether a run with these settings gives the critic a param group of its own
    (lightning_ppo.ppo.param_groups); a checkpoint written before that option had one group."""
    ppo = hparams.get("ppo") or {}
    return hparams.get("critic_optimizer") is not None or ppo.get("critic_max_grad_norm") is not None


def check_param_groups(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Error (one line) when the checkpoint's optimizer state has other param groups than this run's
    optimizer: torch's own error names no setting, and the state of one group cannot be split."""
    if per_role_groups(saved) == per_role_groups(now):
        return
    one, apart = "one param group for the policy and the critic together", "one for each of them"
    raise UsageError(
        f"the checkpoint's optimizer has {apart if per_role_groups(saved) else one}, this run's "
        f"{apart if per_role_groups(now) else one} (model.critic_optimizer or "
        "model.ppo.critic_max_grad_norm set gives the critic its own): resume with the checkpoint's "
        "settings of these two, or start a new run from its exported policy"
    )


@dataclass(frozen=True)
class BuiltRate:
    """A param group's base rate as this run's ``configure_optimizers`` built it, before a resume
    restores the checkpoint's: the optimizer's ``lr``, or the one its scheduler set from its own
    arguments (``by_scheduler``: OneCycleLR's ``max_lr / div_factor``, CyclicLR's ``base_lr``)."""

    rate: float
    by_scheduler: bool


def base_rates(groups: list[dict[str, Any]], scheduler: Any = None) -> list[float]:
    """The rate each param group is scheduled from. A torch scheduler keeps it as ``base_lrs``, part
    of its state (restored on a resume, set by a callback that changes the rate) and what it scales
    (LambdaLR, StepLR, CyclicLR...): the group's ``initial_lr`` is only where ``base_lrs`` started.
    Without ``base_lrs`` (no scheduler, SequentialLR, ChainedScheduler): ``initial_lr``, else ``lr``."""
    kept = getattr(scheduler, "base_lrs", None)
    if kept is not None and len(kept) == len(groups):
        return [float(rate) for rate in kept]
    return [float(group.get("initial_lr", group["lr"])) for group in groups]


def built_rates(
    groups: list[dict[str, Any]], configured: list[float], scheduler: Any = None
) -> list[BuiltRate]:
    """Each group's :class:`BuiltRate`, from the groups and ``scheduler`` (if any) once it is built,
    and ``configured``, each group's ``lr`` as the optimizer was built."""
    rates = base_rates(groups, scheduler)
    return [BuiltRate(rate, rate != lr) for rate, lr in zip(rates, configured, strict=True)]


def say_restored_rates(
    built: list[BuiltRate], groups: list[dict[str, Any]], fields: list[str], scheduler: Any = None
) -> None:
    """Warn, in one line, of each learning rate the config sets that the resumed optimizer does not
    train at: Lightning restores the optimizer state, param groups' ``lr`` included (a scheduler's
    base rate, ``initial_lr``, too), over what ``configure_optimizers`` built. That is kept, as a
    Lightning user expects; what is said is that the config's new rate is not the one used.

    ``built``: each group's base rate as this run built it; ``groups`` and ``scheduler``: the param
    groups and the scheduler as restored (and as a callback's ``on_train_start`` may have set them
    since); ``fields``: the config field of
    the first groups' rates (an optimizer factory's own further groups are named by their index, a
    rate the scheduler sets by the scheduler).
    """
    changed: dict[str, str] = {}
    for index, (now, saved) in enumerate(zip(built, base_rates(groups, scheduler), strict=True)):
        field = fields[index] if index < len(fields) else f"param group {index}'s lr"
        if now.by_scheduler:  # the config's lr is not the one the scheduler starts from
            field = "model.lr_scheduler's base rate" + (f" of param group {index}" if index else "")
        if saved != now.rate:
            changed.setdefault(field, f"{field}: {now.rate:g} in the config, {saved:g} in the checkpoint")
    if changed:
        warn(
            "resuming restores the checkpoint's optimizer state, its learning rate included, as "
            f"Lightning does: {'; '.join(changed.values())}; the run goes on at the checkpoint's rate "
            "(to train at another, start a new run from the exported policy, or set the param groups' "
            "lr in a callback's on_train_start)"
        )
