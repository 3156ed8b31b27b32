"""The generation-engine seam: the HF engine, the engine settings, and the truncated importance
weights that correct the policy loss for an engine's log-prob mismatch (hand-computed numbers)."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

from lightning_ppo.config import GenerationConfig
from lightning_ppo.models.loading import load_causal_lm
from lightning_ppo.models.roles import LoraSettings, apply_lora
from lightning_ppo.ppo import functional as F
from lightning_ppo.rollout.engines import Placement, compute_dtype, engine_metrics, make_engine
from lightning_ppo.rollout.engines.hf import HFEngine
from lightning_ppo.rollout.engines.weights import hf_weights
from lightning_ppo.rollout.sampling import generate, hf_generation_config
from lightning_ppo.runs.errors import UsageError

LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5]])  # the trainer's
ENGINE = torch.tensor([[-1.5, -1.0, -0.5]])  # the engine's: log-ratios 0.5, -1.0 (and padding)
MASK = torch.tensor([[True, True, False]])


def test_token_weights_are_exp_log_ratio_truncated_at_the_cap():
    weights = F.truncated_is_weights(LOGPROBS, ENGINE, MASK, "token", cap=1.5)
    # exp(0.5) = 1.6487 > 1.5 is truncated; exp(-1) = 0.3679 is kept; padding is 0
    assert torch.allclose(weights, torch.tensor([[1.5, math.exp(-1.0), 0.0]]))


def test_sequence_weights_use_the_sequence_log_ratio_on_every_token():
    weights = F.truncated_is_weights(LOGPROBS, ENGINE, MASK, "sequence", cap=2.0)
    expected = math.exp(0.5 - 1.0)  # 0.6065
    assert torch.allclose(weights, torch.tensor([[expected, expected, 0.0]]))
    truncated = F.truncated_is_weights(LOGPROBS, ENGINE, MASK, "sequence", cap=0.5)
    assert torch.allclose(truncated, torch.tensor([[0.5, 0.5, 0.0]]))


def test_weights_are_detached():
    logprobs = LOGPROBS.clone().requires_grad_()
    assert not F.truncated_is_weights(logprobs, ENGINE, MASK, "token", cap=2.0).requires_grad


def test_policy_loss_multiplies_each_token_by_its_weight():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logprobs = old.clone().requires_grad_()
    advantages = torch.ones(1, 3)
    weights = torch.tensor([[2.0, 0.5, 0.0]])
    out = F.policy_loss(logprobs, old, advantages, MASK, clip_range=0.2, is_weights=weights)
    # ratio 1: per-token losses -1 x 2 and -1 x 0.5, averaged over the two real tokens
    assert out.loss.item() == pytest.approx(-1.25)
    out.loss.backward()
    # d(-A w r)/d logp = -A w r / 2 tokens: the weights scale each token's gradient
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -0.25, 0.0]]))


def test_policy_loss_without_weights_is_unchanged_bit_for_bit():
    torch.manual_seed(0)
    logprobs, old, advantages = torch.randn(3, 4, 5).unbind(0)
    mask = torch.rand(4, 5) > 0.3
    plain = F.policy_loss(logprobs, old, advantages, mask, 0.2, 3.0)
    none = F.policy_loss(logprobs, old, advantages, mask, 0.2, 3.0, is_weights=None)
    assert torch.equal(plain.loss, none.loss) and torch.equal(plain.clipfrac, none.clipfrac)


def test_engine_metrics_by_hand():
    stats = engine_metrics(LOGPROBS, ENGINE, MASK, "token", cap=1.5)
    assert stats["engine/logp_abs_diff"].item() == pytest.approx(0.75)  # (0.5 + 1.0) / 2
    assert stats["engine/is_truncated_fraction"].item() == pytest.approx(0.5)  # exp(0.5) > 1.5 only
    # weights exp(0.5) and exp(-1.0): their spread is half their difference
    assert stats["engine/is_weight_std"].item() == pytest.approx((math.exp(0.5) - math.exp(-1.0)) / 2)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"engine": "sglang"}, "generation.engine"),
        ({"engine_is_correction": "token"}, "generation.engine_is_correction"),  # with engine hf
        ({"engine": "vllm", "engine_is_correction": "batch"}, "generation.engine_is_correction"),
        ({"engine": "vllm", "engine_is_cap": 0.0}, "generation.engine_is_cap"),
        ({"gpu_memory_utilization": 1.5}, "generation.gpu_memory_utilization"),
        ({"cache_implementation": "sliding_window"}, "generation.cache_implementation"),
        # the engine's log-probs are renormalised over the kept tokens, the trainer's are not
        ({"engine": "vllm", "engine_is_correction": "token", "top_p": 0.9}, "generation.top_p 0.9"),
        ({"engine": "vllm", "engine_is_correction": "sequence", "top_k": 5}, "generation.top_k 5"),
    ],
)
def test_bad_engine_settings_name_the_field(settings, field):
    with pytest.raises(UsageError, match=field):
        GenerationConfig(**settings)


def test_hf_engine_generates_as_hf_generate(tiny_gpt2):
    model = load_causal_lm(str(tiny_gpt2))
    gen = hf_generation_config(GenerationConfig(max_new_tokens=6, temperature=0.7), 1, 0)
    engine = make_engine(GenerationConfig(), gen, str(tiny_gpt2), Placement(), seed=0)
    assert isinstance(engine, HFEngine)
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = prompt_ids != 0
    engine.sync_weights(model)
    torch.manual_seed(0)
    rollout = engine.generate(prompt_ids, prompt_mask)
    torch.manual_seed(0)
    expected = generate(model, prompt_ids, prompt_mask, gen)
    assert torch.equal(rollout.response_ids, expected.response_ids)
    assert torch.equal(rollout.response_mask, expected.response_mask)
    assert rollout.engine_logprobs is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_says_how_to_install(tiny_gpt2):
    config = GenerationConfig(engine="vllm")
    gen = hf_generation_config(config, 1, 0)
    with pytest.raises(UsageError, match=r"generation.engine 'vllm' needs the vllm package.*pip install"):
        make_engine(config, gen, str(tiny_gpt2), Placement(), seed=0)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("bf16-mixed", torch.bfloat16),
        ("bf16-true", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("32-true", torch.float32),
    ],
)
def test_a_colocated_engine_samples_in_the_trainers_compute_dtype(precision, dtype):
    """Under bf16-mixed the trained weights are fp32, but the engine needs no fp32 copy of them."""
    assert compute_dtype(precision, torch.float32) == dtype


def test_lora_pushes_base_plus_delta_and_never_writes_the_base(tiny_gpt2):
    """Merge -> push -> unmerge drifted a bf16 base (the reference, too) with every push; the push
    now computes base + delta out of place. 200 pushes: the base bitwise unchanged, and each pushed
    weight equal to PEFT's own merge (done in fp32 on a copy)."""
    policy = apply_lora(load_causal_lm(str(tiny_gpt2), dtype=torch.bfloat16), LoraSettings(r=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))  # PEFT starts B at 0: make the adapter matter
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    for _ in range(200):
        pushed = dict(hf_weights(policy))
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if "lora_" not in n)
    expected = dict(copy.deepcopy(policy).float().merge_and_unload().named_parameters())
    assert pushed.keys() == expected.keys()
    initial = dict(load_causal_lm(str(tiny_gpt2), dtype=torch.bfloat16).named_parameters())
    for name, weight in pushed.items():
        torch.testing.assert_close(weight.float(), expected[name], rtol=0, atol=1e-5, msg=name)
    adapted = [n for n, w in pushed.items() if not torch.equal(w.float(), initial[n].float())]
    assert len(adapted) == policy.config.n_layer  # each block's c_attn carries its adapter
