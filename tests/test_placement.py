"""Roles made where they run: skeletons in ``__init__``, each weight read once onto the root device in
its final dtype by ``configure_model``; without a Trainer, read onto the CPU on first use."""

from __future__ import annotations

import weakref

import lightning.pytorch as pl
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForSequenceClassification

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.models.loading import ValueModel, load_causal_lm
from tests.helpers import CountCharReward, prompt_data, quiet_trainer

aten = torch.ops.aten
# In-place initialisers: a weight initialised at random (or filled) and then overwritten by the
# checkpoint is the "materialised twice" this file guards against.
INITIALISERS = {
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.random_.default,
    aten.exponential_.default, aten.fill_.Scalar, aten.zero_.default,
}  # fmt: skip
MIN_WEIGHT_NUMEL = 1024  # the value heads (hidden_size) and rotary buffers are smaller than any weight


class RealFloatMemory(TorchDispatchMode):
    """The peak bytes held at once by real (not meta) floating-point storages that ops inside create,
    and the initialisers run on real tensors of weight size. Storages are followed to their release
    (torch keeps one Python object per storage), so the peak is exact and deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.followed: set[int] = set()
        self.initialised: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in INITIALISERS and not args[0].is_meta and args[0].numel() >= MIN_WEIGHT_NUMEL:
            self.initialised.append(f"{func} on {tuple(args[0].shape)}")
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.is_floating_point():
                self._follow(tensor.untyped_storage())
        return out

    def _follow(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.followed:
            return
        self.followed.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self.followed.discard(key)
        self.live -= nbytes


def _module(policy, reward, **kwargs) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=CountCharReward(),
        reward_model=str(reward),
        frozen_dtype="bf16",
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=4),
        **kwargs,
    )


def _weight_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """Bytes of every distinct parameter and floating buffer of ``module``, and of the largest in fp32."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()}
    total = sum(t.nbytes for t in tensors.values())
    return total, max(t.numel() * 4 for t in tensors.values())


def _as_built(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters, found without ``module.named_parameters()``: without a Trainer that reads them."""
    modules = torch.nn.Module.named_modules(module)
    return [(f"{m}.{n}", p) for m, sub in modules for n, p in sub._parameters.items() if p is not None]


def test_roles_are_read_once_onto_the_root_device_in_their_final_dtype(tiny_llama, tiny_reward, tmp_path):
    memory = RealFloatMemory()
    with memory:
        module = _module(tiny_llama, tiny_reward)
    real = [
        n for n, p in _as_built(module) if not p.is_meta and not n.endswith(("v_head.weight", "v_head.bias"))
    ]
    assert real == []  # nothing read yet: policy, reference, critic backbone and reward model are skeletons
    built_peak = memory.peak
    with memory:
        quiet_trainer(tmp_path, iterations=0).fit(module, datamodule=prompt_data())  # configure_model reads
    assert memory.initialised == []
    total, largest = _weight_bytes(module)
    # Building allocates no weight even for a moment: only value heads and buffers computed from the config.
    assert built_peak < largest, (built_peak, largest)
    # Every weight held once, plus one host buffer at a time for a tensor read in another dtype
    # (the bf16 frozen roles from fp32 files); a second copy of any role would add its whole size.
    assert memory.peak <= total + 2 * largest, (memory.peak, total, largest)
    root = module.trainer.strategy.root_device
    frozen = [module.ref_policy, module.reward_model]
    assert {p.dtype for role in frozen for p in role.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in [*module.policy.parameters(), *module.value_model.parameters()]} == {
        torch.float32
    }
    assert {t.device for t in [*module.parameters(), *module.buffers()]} == {root}


def test_without_a_trainer_the_weights_are_read_on_first_use(tiny_llama, tiny_reward):
    """As built whole: every role real on the CPU, the weights ``from_pretrained`` gives."""
    module = _module(tiny_llama, tiny_reward)
    policy = module.policy  # the first model reached reads every role
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    expected = {
        "policy": load_causal_lm(str(tiny_llama)),
        "ref_policy": load_causal_lm(str(tiny_llama), dtype=torch.bfloat16),
        "value_model": ValueModel.from_pretrained(str(tiny_llama)),
        "reward_model": AutoModelForSequenceClassification.from_pretrained(
            str(tiny_reward), dtype=torch.bfloat16
        ),
    }
    got = {"policy": policy, "ref_policy": module.ref_policy, "value_model": module.value_model}
    got["reward_model"] = module.reward_model.model
    for name, model in expected.items():
        for key, value in model.state_dict().items():
            assert torch.equal(got[name].state_dict()[key], value), f"{name}.{key}"


def test_load_state_dict_reaches_real_weights_without_a_trainer(tiny_llama, tiny_reward):
    """A checkpoint's weights loaded into an unread module must stay: copying into a meta tensor
    does nothing, and the later read would put the initial weights back."""
    source = _module(tiny_llama, tiny_reward)
    with torch.no_grad():
        for param in source.policy.parameters():
            param.add_(1.0)
    trained = {k: v for k, v in source.state_dict().items() if k.startswith("roles.policy.")}
    target = _module(tiny_llama, tiny_reward)
    target.load_state_dict(trained, strict=False)
    for key, value in trained.items():
        assert torch.equal(target.state_dict()[key], value), key


class _FailsInSetup(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        raise RuntimeError("a callback's setup failed")


def test_a_fit_that_failed_in_setup_leaves_the_weights_to_be_read_on_first_use(
    tiny_llama, tiny_reward, tmp_path
):
    """The Trainer stays attached after its fit raised, before ``configure_model`` read anything: the
    module is then one without a Trainer, not a module whose roles stay on the meta device."""
    module = _module(tiny_llama, tiny_reward)
    with pytest.raises(RuntimeError, match="setup failed"):
        quiet_trainer(tmp_path, iterations=1, callbacks=[_FailsInSetup()]).fit(
            module, datamodule=prompt_data()
        )
    assert all(p.is_meta for n, p in _as_built(module) if "v_head" not in n)  # the teardown read nothing
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = module.policy(input_ids=ids).logits  # the first use reads every role
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    assert torch.equal(logits, load_causal_lm(str(tiny_llama))(input_ids=ids).logits)
