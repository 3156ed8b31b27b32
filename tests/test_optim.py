"""Speed choices that must not change the math: fused Adam, device-side skips, the fused GELU."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_ppo.models.loading import load_causal_lm, load_config
from lightning_ppo.ppo.optim import grad_norm, is_finite, prefer_fused, skips_on_device, step_unless_nonfinite


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in [(8, 4), (4,), (3, 3, 2)]]


def _set_grads(params, seed: int) -> None:
    torch.manual_seed(seed)
    for p in params:
        p.grad = torch.randn_like(p)


def test_default_adamw_runs_fused_and_matches_the_loop():
    loop_params, fused_params = _params(), _params()
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, foreach=False)
    fused = torch.optim.AdamW(fused_params, lr=1e-2, weight_decay=0.1)
    assert not prefer_fused(loop)  # an explicit choice is kept
    assert prefer_fused(fused) and skips_on_device(fused)
    for step in range(5):
        for params, opt in ((loop_params, loop), (fused_params, fused)):
            _set_grads(params, step)
            opt.step()
    for a, b, start in zip(loop_params, fused_params, _params(), strict=True):
        assert (a - start).abs().max() > 1e-3  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_other_optimizers_and_explicit_choices_are_left_alone():
    assert not prefer_fused(torch.optim.SGD(_params(), lr=0.1))
    assert not prefer_fused(torch.optim.Adam(_params(), fused=False))
    assert not prefer_fused(torch.optim.Adam(_params(), foreach=True))
    mixed = [torch.nn.Parameter(torch.ones(2, dtype=torch.float64)), *_params()]
    assert prefer_fused(torch.optim.Adam(mixed))  # float64 is fine for the fused kernel


def test_a_non_finite_flag_leaves_weights_moments_and_step_untouched():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    prefer_fused(opt)
    _set_grads(params, 0)
    step_unless_nonfinite(opt, opt.step, torch.tensor(True))
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    finite = torch.isfinite(grad_norm(params, None))
    assert not finite
    step_unless_nonfinite(opt, opt.step, finite)
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    after = opt.state_dict()["state"]
    for key in state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key][name], after[key][name]), name
    assert not hasattr(opt, "found_inf")  # the flag does not outlive its step


def test_grad_norm_measures_without_a_limit_and_clips_with_one():
    params = _params()
    _set_grads(params, 3)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    torch.testing.assert_close(grad_norm(params, None), expected)
    grads = [p.grad.clone() for p in params]
    torch.testing.assert_close(grad_norm(params, 1.0), expected)  # returns the norm before clipping
    scale = 1.0 / float(expected)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * scale, rtol=1e-5, atol=1e-6)


def test_gpt2_runs_the_fused_gelu_with_the_same_outputs(tiny_gpt2):
    assert AutoModelForCausalLM.from_pretrained(tiny_gpt2).config.activation_function == "gelu_new"
    assert load_config(str(tiny_gpt2)).activation_function == "gelu_pytorch_tanh"
    stock = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    ours = load_causal_lm(str(tiny_gpt2)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_is_finite_agrees_with_torch_isfinite(dtype):
    values = [0.0, -0.0, 1e-45, 1e-8, 3e38, -3e38, 65504.0, float("inf"), float("-inf"), float("nan")]
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert torch.equal(is_finite(x), torch.isfinite(x))
