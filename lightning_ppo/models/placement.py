"""The roles' weights are read where they run: on the Trainer's root device, in their final dtype.

``PPOLightningModule.__init__`` builds every role whose checkpoint is plain safetensors holding all of
its parameters as a skeleton (``lightning_ppo.distributed.sharded_loading``: parameters on the meta
device, each mapped to its tensor in the files) in the dtype it keeps: trained roles fp32, frozen roles
``frozen_dtype``. No weight is read or initialised then. ``configure_model``, which Lightning calls
under every strategy (single device, DDP, FSDP2) once the root device is known, reads them straight
into memory on that device (under FSDP2 into each rank's shards), one tensor at a time through a
host buffer of that tensor's size: no role is whole on the host first, nor initialised at random and
then overwritten. What cannot be a skeleton (``.bin`` checkpoints, renamed keys, a LoRA base, a
reward model passed in loaded) is loaded whole on the CPU as before and moved by the strategy.

A module used without a Trainer (in Python, in tests) reads its weights onto the CPU the first time
one of its models is reached (an attribute such as ``module.policy``, ``parameters()``,
``state_dict``, ``load_state_dict``, ``.to()``), so it behaves as one built whole. So does a module
whose Trainer's run raised before ``configure_model`` (a failed ``setup``): the Trainer stays attached,
but runs nothing more.

The end of every stage is the converse: Lightning's ``Strategy.teardown`` (single device, DDP;
FSDP2's moves nothing) moves the module and the optimizers' state to the host at the end of ``fit``,
``validate`` and ``test``, a host copy of every role and AdamW moment on every rank (15.9 GB at 0.5B
on one GPU, against 2.1 GB while training). :func:`keep_through_teardown` sets the roles and that
state aside around it: they stay where they ran, and what may follow (``trainer.save_checkpoint``,
``validate``, another ``fit``) finds them as training left them. The device memory stays held after
``fit``, as in a plain PyTorch loop: the Trainer holds the module and its optimizers (with AdamW's
moments), so it is freed once both the module and the Trainer are dropped (``module.cpu()`` moves the
roles but not the optimizer state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_ppo.distributed.sharded_loading import deferred_loading, load_deferred
from lightning_ppo.distributed.sharding import role_models
from lightning_ppo.ppo.optim import restore_states, set_aside_states


class LoadsWhereItRuns(nn.Module):
    """Mixin for a LightningModule whose role models are built inside :meth:`building_roles`."""

    @contextmanager
    def building_roles(self) -> Iterator[None]:
        """Models loaded inside are skeletons, read later by :meth:`load_weights`."""
        with deferred_loading():
            yield
        # Set only now: models reached while the roles are being built must not trigger the read.
        self.__dict__["_weights_pending"] = True

    def load_weights(self, device: torch.device | str | None = None) -> None:
        """Read every skeleton role's weights onto ``device`` (default: the CPU); a no-op once read."""
        self.__dict__["_weights_pending"] = False
        load_deferred(self, role_models(self), torch.device(device or "cpu"))

    def _loads_lazily(self) -> bool:
        # Read through __dict__: this runs inside __getattr__, where a missing name would recurse.
        return self.__dict__.get("_weights_pending", False) and not self._in_a_trainer_run()

    def _in_a_trainer_run(self) -> bool:
        """Whether a Trainer is running a stage with this module (its ``configure_model`` reads the
        weights where they run). Not merely attached: a Trainer whose fit raised stays attached, its
        stage reset to None once its teardown is done, and the module is then used without it."""
        trainer = self.__dict__.get("_trainer")
        return trainer is not None and trainer.state.stage is not None

    def __getattr__(self, name: str) -> Any:
        # Submodules (roles, reward_model, ...) live in ``_modules`` and are reached through here.
        value = super().__getattr__(name)
        if self._loads_lazily() and name in self.__dict__.get("_modules", {}):
            self.load_weights()
        return value

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        # Behind parameters(), named_parameters(), buffers() and modules(): what they yield is real.
        if self._loads_lazily():
            self.load_weights()
        return super().named_modules(*args, **kwargs)

    def _apply(self, fn: Callable, recurse: bool = True) -> LoadsWhereItRuns:
        if self._loads_lazily():  # .to()/.cuda()/.double() on meta parameters would fail or do nothing
            self.load_weights()
        elif self.__dict__.get("_weights_pending", False):
            # Under a Trainer, before configure_model (a teardown after setup failed): nothing is read
            # yet to move, and reading it only to move it would waste the time it takes.
            return super()._apply(lambda t: t if t.is_meta else fn(t), recurse)
        return super()._apply(fn, recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._loads_lazily():
            self.load_weights()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        # Copying into a meta parameter does nothing: the weights must be real first, or a checkpoint's
        # trained weights would be silently replaced by the initial ones when read later.
        if self._loads_lazily():
            self.load_weights()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def keep_through_teardown(strategy: Any) -> None:
    """Run ``strategy``'s teardown with the module's children (its roles) and the optimizers' state
    set aside, and put them back after it, on the device they ran on (see the module's docstring).

    The instance's ``teardown`` becomes a ``partial`` of :func:`_teardown_keeping` over the class's
    own (a subclass's override included): installing it again changes nothing, and it pickles.
    """
    strategy.teardown = partial(_teardown_keeping, strategy)


def _teardown_keeping(strategy: Any) -> None:
    module = strategy.lightning_module
    modules = module.__dict__["_modules"] if module is not None else {}
    children, device = dict(modules), getattr(module, "_device", None)
    aside: list[tuple[torch.optim.Optimizer, Any]] = []
    try:  # set aside inside the try: a Ctrl-C between the two steps still puts everything back
        set_aside_states(strategy.optimizers, aside)  # AdamW: 8 bytes per trained parameter
        modules.clear()  # what module.cpu() then moves: the module's own tensors, none in PPOLightningModule
        type(strategy).teardown(strategy)
    finally:
        modules.update(children)
        restore_states(aside)
        if device is not None:  # module.device names where its roles are, not the host it was told
            module._device = device
