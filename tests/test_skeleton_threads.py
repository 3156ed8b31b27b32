"""Skeletons (lightning_ppo.distributed.sharded_loading: every ``PPOLightningModule`` builds its roles
so) built while another thread of the process builds modules of its own: a second module for a fit
on another thread, a user's reward model, a notebook's background job. The skeleton's hook, which
moves each parameter registered to the meta device, was torch's process-wide one, added and removed
around each skeleton: another thread's parameters went to meta too, and its registration, iterating
torch's hooks as they were added or removed, raised "OrderedDict mutated during iteration" (seen
once in tests/test_server_engine.py, two modules built on two threads). Each test forces the
interleaving with events; every wait is bounded."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from lightning_ppo.distributed.sharded_loading import _parameters_on_meta


class _Norm(nn.Module):
    """A parameter made from a real tensor (RMSNorm's ones), not with ``torch.empty``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))


def _on_a_thread(inside: threading.Event, leave: threading.Event) -> threading.Thread:
    """A thread that builds a skeleton: inside its meta context until ``leave`` is set."""

    def build() -> None:
        with _parameters_on_meta():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    assert inside.wait(30)
    return thread


def test_a_module_built_while_another_thread_builds_a_skeleton_is_real():
    """Built on this thread while another is inside a skeleton's build: its parameters went to the
    meta device (no memory, no values: its first forward failed far from the cause). Real now."""
    inside, leave = threading.Event(), threading.Event()
    thread = _on_a_thread(inside, leave)
    try:
        linear, norm = nn.Linear(2, 2), _Norm()
    finally:
        leave.set()
        thread.join(30)
    assert [p.device.type for p in (linear.weight, linear.bias, norm.weight)] == ["cpu"] * 3
    assert norm.weight.tolist() == [1.0, 1.0]


def _registering(when_called: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """A thread registering one parameter, with torch's hooks iterated over: ``when_called`` runs
    from a hook of this test's, in line after any the process holds, with one more after it."""
    here = threading.get_ident()
    raised: list[BaseException] = []

    def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if threading.get_ident() != here:
            when_called()

    def register() -> None:
        try:
            _Norm()
        except BaseException as err:  # noqa: BLE001 (asserted on the test's thread)
            raised.append(err)

    # a second hook after it, as a second skeleton's on another thread: the iteration goes on past
    # the first (the last one's return ends it unchecked)
    handles = [register_module_parameter_registration_hook(h) for h in (hook, lambda *_: None)]
    thread = threading.Thread(target=register, daemon=True)
    thread.start()
    thread.join(30)
    for handle in handles:
        handle.remove()
    return thread, raised


def test_a_skeleton_built_while_another_thread_registers_a_parameter_leaves_it_registering():
    """While another thread's registration iterates torch's hooks, a skeleton's build starts and
    ends on this thread: the other's iteration raised "OrderedDict mutated during iteration"."""
    built = threading.Event()

    def a_skeleton_meanwhile() -> None:
        inside, leave = threading.Event(), threading.Event()
        leave.set()  # in and out at once
        _on_a_thread(inside, leave).join(30)
        built.set()

    thread, raised = _registering(a_skeleton_meanwhile)
    assert not thread.is_alive() and built.is_set()
    assert raised == []


def test_skeletons_built_on_several_threads_at_once_are_all_skeletons():
    """Each thread's own build still puts its parameters on meta, whatever the others do."""
    threads = 4
    barrier, kinds, lock = threading.Barrier(threads), [], threading.Lock()

    def build() -> None:
        with _parameters_on_meta():
            barrier.wait(30)
            made = [nn.Linear(2, 2).weight.device.type, _Norm().weight.device.type]
            barrier.wait(30)
        with lock:
            kinds.extend(made)

    workers = [threading.Thread(target=build, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert kinds == ["meta"] * (2 * threads)
