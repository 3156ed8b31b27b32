"""The roles: separate or shared critic, full or LoRA policy, GPT-2 and Llama; export round trip."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.export import export_policy
from lightning_ppo.models.loading import ValueModel, load_causal_lm, response_logits
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.ppo.rollout_data import position_ids_from_mask
from lightning_ppo.runs.errors import UsageError
from tests.helpers import CountCharReward, prompt_data, quiet_trainer


def _module(path, **kwargs) -> PPOLightningModule:
    kwargs.setdefault("reward_fn", CountCharReward())
    return PPOLightningModule(
        policy=str(path),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.05),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        **kwargs,
    )


def _fit(module, root, iterations=2) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = quiet_trainer(root, iterations)
    trainer.fit(module, datamodule=prompt_data())
    return trainer


def _optimized(trainer) -> set[int]:
    return {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("value_model", ["separate", "shared"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_role_combinations_fit(arch, value_model, lora, tiny_gpt2, tiny_llama, tmp_path):
    path = tiny_gpt2 if arch == "gpt2" else tiny_llama
    module = _module(path, value_model=value_model, lora=LoraSettings(r=4) if lora else None)
    trainer = _fit(module, tmp_path)
    assert trainer.global_step == 2 * 2 * 2
    assert (module.ref_policy is None) == lora  # LoRA: no second copy of the weights
    assert (module.value_model is None) == (value_model == "shared")
    metrics = trainer.logged_metrics
    assert torch.isfinite(metrics["loss/value_avg"]) and torch.isfinite(metrics["val/explained_variance"])


def test_lora_with_a_bf16_base_and_a_shared_head_trains_in_fp32(tiny_gpt2, tmp_path):
    """The shared value head is fp32 and the LoRA base's hidden states bf16: under 32-true (no
    autocast to reconcile them) the head must take them in its own dtype."""
    module = _module(tiny_gpt2, value_model="shared", lora=LoraSettings(r=4), frozen_dtype="bf16")
    assert module.roles.value_head.weight.dtype == torch.float32
    trainer = _fit(module, tmp_path, iterations=1)
    assert trainer.global_step == 2 * 2
    assert torch.isfinite(trainer.logged_metrics["loss/value_avg"])


def test_shared_critic_trains_head_and_policy_with_one_optimizer(tiny_gpt2, tmp_path):
    module = _module(tiny_gpt2, value_model="shared")
    head_before = module.roles.value_head.weight.clone()
    trainer = _fit(module, tmp_path)
    expected = {id(p) for p in module.policy.parameters()} | {
        id(p) for p in module.roles.value_head.parameters()
    }
    assert _optimized(trainer) == expected
    assert not torch.equal(module.roles.value_head.weight, head_before)


def test_lora_keeps_the_base_and_disables_the_adapter_for_the_reference(tiny_gpt2, tmp_path):
    module = _module(tiny_gpt2, value_model="shared", lora=LoraSettings(r=4))
    base_before = {n: p.clone() for n, p in module.policy.named_parameters() if "lora_" not in n}
    trainer = _fit(module, tmp_path, iterations=3)
    # only adapters and the value head are optimised, and the base is bit-identical after training
    adapters = {id(p) for n, p in module.policy.named_parameters() if "lora_" in n}
    assert _optimized(trainer) == adapters | {id(p) for p in module.roles.value_head.parameters()}
    for name, param in module.policy.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), name
    lora_b = [p for n, p in module.policy.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # the adapters did train (B starts at zero)
    # the reference is the untouched initial policy
    initial = load_causal_lm(str(tiny_gpt2))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]).bool()
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        expected = response_logits(initial, ids, mask, pos, 3)
        trained = response_logits(module.policy, ids, mask, pos, 3)
    assert torch.equal(module.roles.reference_logits(ids, mask, pos, 3), expected)
    assert not torch.allclose(trained, expected)


def test_gradient_checkpointing_with_lora_trains(tiny_digits, tmp_path):
    module = _module(tiny_digits, value_model="separate", lora=LoraSettings(r=4), gradient_checkpointing=True)
    assert module.policy.base_model.model.is_gradient_checkpointing
    trainer = _fit(module, tmp_path, iterations=1)
    assert trainer.global_step == 4
    assert any(p.abs().sum() > 0 for n, p in module.policy.named_parameters() if "lora_B" in n)


def test_frozen_dtype_loads_the_reference_in_bf16(tiny_gpt2):
    module = _module(tiny_gpt2, frozen_dtype="bf16")
    assert next(module.ref_policy.parameters()).dtype == torch.bfloat16
    assert next(module.policy.parameters()).dtype == torch.float32


@pytest.mark.parametrize("frozen_dtype", [None, "bf16"])
def test_a_checkpoint_saved_in_bf16_trains_in_fp32(frozen_dtype, tiny_gpt2, tmp_path):
    """transformers 5 loads a checkpoint in its saved dtype (hub models: bf16); the trained weights
    must be fp32 all the same, or AdamW's steps of lr 1e-6 round away in bf16."""
    saved = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_gpt2).to(torch.bfloat16).save_pretrained(saved)
    AutoTokenizer.from_pretrained(tiny_gpt2).save_pretrained(saved)
    module = _module(saved, frozen_dtype=frozen_dtype, value_model="separate")
    bf16 = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16  # the checkpoint's own dtype
    for role in (module.policy, module.roles.value_model):
        assert {p.dtype for p in role.parameters()} == {torch.float32}
    frozen = torch.float32 if frozen_dtype is None else torch.bfloat16
    assert {p.dtype for p in module.ref_policy.parameters()} == {frozen}
    for key, value in bf16.state_dict().items():  # the saved values, exactly
        torch.testing.assert_close(module.policy.state_dict()[key], value.float(), rtol=0, atol=0)
    moved = {}
    for name, model in (("fp32", module.policy), ("bf16", bf16)):
        weight = model.transformer.h[0].mlp.c_fc.weight
        before = weight.detach().clone()
        weight.sum().backward()
        torch.optim.AdamW([weight], lr=1e-6).step()
        moved[name] = (weight.detach() != before).float().mean().item()
    # in bf16 a step of 1e-6 rounds away but for weights near 0 (measured: 2 % of them moved)
    assert moved["fp32"] == 1.0 and moved["bf16"] < 0.05


def test_separate_critic_starts_from_the_reward_models_head(tiny_digits, tmp_path):
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path / "rm", TinyModelSpec(), alphabet="0123456789=", kind="reward", seed=3
    )
    critic = ValueModel.from_pretrained(str(path))
    reward = AutoModelForSequenceClassification.from_pretrained(path)
    assert torch.equal(critic.v_head.weight, reward.score.weight)
    module = _module(tiny_digits, reward_fn=None, reward_model=str(path))
    assert torch.equal(module.value_model.v_head.weight, reward.score.weight)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-merged"])
def test_export_round_trip_gives_the_trained_policys_logits(lora, tiny_gpt2, tmp_path):
    module = _module(tiny_gpt2, value_model="shared", lora=LoraSettings(r=4) if lora else None)
    trainer = _fit(module, tmp_path)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    result = export_policy(tmp_path / "run.ckpt", tmp_path / "exported")
    out = result.out
    assert result.value_head and "value_head.pt" in result.describe()
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        expected = module.policy(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    # The user's config comes back, not the one training ran with (dropout off, fused GELU).
    original = AutoConfig.from_pretrained(tiny_gpt2).to_dict()
    written = exported.config.to_dict()
    for key in ("activation_function", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        assert written[key] == original[key], key
    assert "roles.value_head.weight" in torch.load(out / "value_head.pt", weights_only=True)
    assert (out / "tokenizer.json").exists()


def test_export_of_a_critic_free_run_writes_and_reports_no_value_head(tiny_gpt2, tmp_path):
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(advantage_estimator="grpo", num_generations=2, ppo_epochs=1, num_minibatches=2),
        generation=GenerationConfig(max_new_tokens=4),
    )
    trainer = _fit(module, tmp_path, iterations=1)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    result = export_policy(tmp_path / "run.ckpt", tmp_path / "exported")
    assert not result.value_head and not (result.out / "value_head.pt").exists()
    assert "value" not in result.describe() and "critic" not in result.describe()


def test_export_writes_the_runs_suppressed_tokens_into_the_generation_config(tiny_gpt2, tmp_path):
    """Merged or kept as an adapter, the folder samples as training did: never a suppressed token."""
    from transformers import GenerationConfig as HFGenerationConfig

    # "<b*>" a pattern (<bos>), "?" a token of the vocabulary despite its wildcard, 9 an id
    generation = GenerationConfig(max_new_tokens=6, suppress_tokens=["<b*>", "?", 9])
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        value_model="shared",
        lora=LoraSettings(r=4),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=2),
        generation=generation,
    )
    tokenizer = module.tokenizer
    expected = sorted([tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("?"), 9])
    assert module.suppressed_ids == expected
    trainer = _fit(module, tmp_path, iterations=1)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    for keep_adapter in (False, True):
        out = tmp_path / f"exported-{keep_adapter}"
        result = export_policy(tmp_path / "run.ckpt", out, keep_adapter=keep_adapter)
        assert "3 suppressed tokens" in result.describe()
        saved = HFGenerationConfig.from_pretrained(out)
        assert saved.suppress_tokens == expected
        # the rest is the policy's own generation config
        assert saved.eos_token_id == AutoConfig.from_pretrained(tiny_gpt2).eos_token_id
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported-False")
    prompts = torch.tensor([[5, 6, 7]] * 32)
    torch.manual_seed(0)
    sampled = exported.generate(prompts, do_sample=True, max_new_tokens=16, min_new_tokens=16)[:, 3:]
    assert not torch.isin(sampled, torch.tensor(expected)).any()
    torch.manual_seed(0)  # the same model without the mask does sample them
    unmasked = exported.generate(
        prompts, do_sample=True, max_new_tokens=16, min_new_tokens=16, suppress_tokens=None
    )
    assert torch.isin(unmasked[:, 3:], torch.tensor(expected)).any()


def test_export_writes_the_trained_weights_dtype_not_the_bf16_bases(tiny_gpt2, tmp_path):
    """A base saved in bf16 (as hub models are) trains in fp32: the export keeps the updates fp32 holds,
    or rounds them to bf16 when asked, and says which."""
    import shutil

    base = tmp_path / "bf16-base"
    shutil.copytree(tiny_gpt2, base)
    AutoModelForCausalLM.from_pretrained(tiny_gpt2).to(torch.bfloat16).save_pretrained(base)
    module = _module(base, value_model="shared")
    trainer = _fit(module, tmp_path, iterations=1)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    trained = {k: v.detach() for k, v in module.policy.state_dict().items()}

    result = export_policy(tmp_path / "run.ckpt", tmp_path / "fp32")
    assert result.dtype == torch.float32 and "in float32" in result.describe()
    exported = AutoModelForCausalLM.from_pretrained(result.out).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in trained.items())
    assert any(not torch.equal(v, v.bfloat16().float()) for v in trained.values())  # bf16 would round

    rounded = export_policy(tmp_path / "run.ckpt", tmp_path / "bf16", dtype="bf16")
    assert rounded.dtype == torch.bfloat16 and "in bfloat16" in rounded.describe()
    exported = AutoModelForCausalLM.from_pretrained(rounded.out).state_dict()
    assert all(torch.equal(exported[k], v.bfloat16()) for k, v in trained.items())
    with pytest.raises(UsageError, match="export --dtype must be one of"):
        export_policy(tmp_path / "run.ckpt", tmp_path / "int8", dtype="int8")


def _reward_adapter(base, out):
    """A sequence-classification LoRA adapter on ``base``, with non-zero weights, saved with PEFT."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    classifier = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    peft_model = get_peft_model(classifier, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["c_attn"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def test_reward_adapter_scores_on_the_policys_own_base(tiny_digits, tmp_path):
    reference = _reward_adapter(tiny_digits, tmp_path / "reward_adapter")
    module = _module(
        tiny_digits,
        reward_fn=None,
        reward_adapter=str(tmp_path / "reward_adapter"),
        lora=LoraSettings(r=4),
        value_model="shared",
    )
    # no second copy of the base: every base weight is the policy's
    assert module.reward_model is None and module.ref_policy is None
    assert sum(p.numel() for p in module.reward_adapter.parameters()) == 64  # only its score head
    ids = torch.tensor([[5, 6, 7, 8, 1, 1], [9, 10, 11, 12, 13, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]).bool()
    pos = position_ids_from_mask(mask)
    scores = module.reward_adapter(ids, mask, pos)
    with torch.no_grad():
        expected = [reference(input_ids=ids[i : i + 1, : int(mask[i].sum())]).logits.item() for i in range(2)]
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5)
    # the policy's own adapter is still the one trained, and training leaves the reward adapter alone
    reward_before = {n: p.clone() for n, p in module.policy.named_parameters() if ".reward." in n}
    trainer = _fit(module, tmp_path)
    assert trainer.global_step == 8
    after = dict(module.policy.named_parameters())
    assert reward_before and all(torch.equal(after[n], p) for n, p in reward_before.items())


def test_reward_adapter_needs_lora(tiny_digits, tmp_path):
    _reward_adapter(tiny_digits, tmp_path / "ra")
    with pytest.raises(ValueError, match="model.reward_adapter needs model.lora"):
        _module(tiny_digits, reward_fn=None, reward_adapter=str(tmp_path / "ra"))


@pytest.fixture
def remote_code_policy(tmp_path, monkeypatch) -> Path:
    """A tiny Llama whose ``config.json`` names its own code (``auto_map``), as hub models that need
    ``trust_remote_code`` do: transformers loads it only with the flag. Its code is imported into a
    modules cache of the test's own."""
    import json

    import transformers.dynamic_module_utils

    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    path = make_tiny_checkpoint(tmp_path / "remote_policy", TinyModelSpec(arch="llama", n_layer=2, n_embd=64))
    (path / "configuration_tiny_remote.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyRemoteConfig(LlamaConfig):\n"
        "    model_type = 'tiny_remote'\n"
    )
    (path / "modeling_tiny_remote.py").write_text(
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_tiny_remote import TinyRemoteConfig\n\n\n"
        "class TinyRemoteForCausalLM(LlamaForCausalLM):\n    config_class = TinyRemoteConfig\n"
    )
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "tiny_remote"
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_export_of_a_policy_that_runs_its_own_code(remote_code_policy, tmp_path, capsys):
    """A run that trusted its policy's code kept no record of it and export could not load that
    policy at all; now the run records it, and export runs the code when told to, as
    ``from_pretrained(..., trust_remote_code=True)`` does, never because a checkpoint file says so."""
    from lightning_ppo.cli import main

    module = _module(remote_code_policy, value_model="shared", trust_remote_code=True)
    trainer = _fit(module, tmp_path, iterations=1)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert (
        torch.load(tmp_path / "run.ckpt", weights_only=True)["hyper_parameters"]["trust_remote_code"] is True
    )
    with pytest.raises(
        UsageError,
        match=r"^export: the policy '.*remote_policy' runs code of its own \(an auto_map in its config "
        r"files\), which its run trusted \(trust_remote_code: true\): pass --trust-remote-code to run it",
    ):
        export_policy(tmp_path / "run.ckpt", tmp_path / "refused")
    main(["export", str(tmp_path / "run.ckpt"), "--out", str(tmp_path / "exported"), "--trust-remote-code"])
    assert capsys.readouterr().out.startswith("wrote the trained policy in float32")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", trust_remote_code=True)
    assert type(exported).__name__ == "TinyRemoteForCausalLM"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, module.policy(input_ids=ids).logits)
