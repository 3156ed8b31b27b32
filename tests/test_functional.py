"""functional: hand-computed numbers, a slow scalar reference, and padding that must not leak."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ppo.ppo import functional as F
from tests.tolerances import reordered_tolerance


def test_masked_mean_ignores_garbage_in_padding():
    x = torch.tensor([[1.0, 3.0, float("nan")], [5.0, float("inf"), -7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert F.masked_mean(x, mask).item() == pytest.approx(3.0)
    assert F.masked_mean(x, mask, dim=1).tolist() == pytest.approx([2.0, 5.0])


@pytest.mark.parametrize("ones", [0, 1, 2, 17], ids=["empty", "one", "two", "many"])
def test_a_token_mask_gives_the_means_of_the_plain_mask_bit_for_bit(ones):
    """TokenMask shares one complement and count between means; every statistic must be unchanged."""
    gen = torch.Generator().manual_seed(ones)
    x = torch.randn(4, 6, generator=gen)
    mask = torch.zeros(24, dtype=torch.bool)
    mask[torch.randperm(24, generator=gen)[:ones]] = True
    mask = mask.reshape(4, 6)
    x[~mask] = float("nan")  # padding garbage stays out either way
    tokens = F.TokenMask.of(mask)

    def same(a, b):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), (a, b)

    same(tokens.mean(x), F.masked_mean(x, mask))
    same(F.masked_mean(x, tokens), F.masked_mean(x, mask))
    for unbiased in (True, False):
        same(F.masked_var(x, tokens, unbiased), F.masked_var(x, mask.clone(), unbiased))
    same(F.masked_whiten(x, tokens), F.masked_whiten(x, mask))
    same(F.explained_variance(x, x * 2, tokens), F.explained_variance(x, x * 2, mask))


def test_masked_var_unbiased_and_biased():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    assert F.masked_var(x, mask).item() == pytest.approx(1.0)
    assert F.masked_var(x, mask, unbiased=False).item() == pytest.approx(2.0 / 3.0)


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 50.0])
    mask = torch.tensor([True, True, True, False])
    w = F.masked_whiten(x, mask)
    assert w.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    kept = F.masked_whiten(x, mask, shift_mean=False)
    assert kept.tolist() == pytest.approx([1.0, 2.0, 3.0, 0.0], abs=1e-6)


def test_logprobs_match_log_softmax_gather_at_temperature():
    torch.manual_seed(0)
    logits = torch.randn(11, 5, 17)  # 11 rows: more than one internal chunk
    tokens = torch.randint(0, 17, (11, 5))
    for temperature in (1.0, 0.7):
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
        assert torch.allclose(F.logprobs_from_logits(logits, tokens, temperature), expected, atol=1e-5)


def test_logprobs_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [1/4, 3/4]
    assert F.logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))


def test_entropy_hand_computed():
    uniform = torch.zeros(2, 3, 4)
    assert torch.allclose(F.entropy_from_logits(uniform), torch.full((2, 3), math.log(4.0)))
    peaked = torch.tensor([[0.0, math.log(3.0)]])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert F.entropy_from_logits(peaked).item() == pytest.approx(h)


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    assert F.kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert F.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert F.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-d) - 1 + d)
    with pytest.raises(ValueError, match="kl_estimator"):
        F.kl_penalty(logp, ref, "k9")


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = F.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.5, 0.5])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])
    adv0, _ = F.gae(rewards, values, mask, gamma=1.0, lam=0.0)
    assert adv0.tolist()[0] == pytest.approx([0.0, 0.0, 0.5])


def test_gae_padding_does_not_leak():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 123.0, -9.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 77.0, float("nan")]])
    mask = torch.tensor([[True, True, True, False, False]])
    adv, ret = F.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.5, 0.5, 0.0, 0.0])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0])


def _slow_gae(rewards, values, gamma, lam):
    """Textbook GAE over one unpadded list."""
    n = len(rewards)
    advantages = []
    for t in range(n):
        total = 0.0
        for k in range(t, n):
            next_value = values[k + 1] if k + 1 < n else 0.0
            delta = rewards[k] + gamma * next_value - values[k]
            total += (gamma * lam) ** (k - t) * delta
        advantages.append(total)
    return advantages


def test_gae_matches_scalar_loop_on_ragged_batch():
    torch.manual_seed(1)
    rewards, values = torch.randn(4, 7), torch.randn(4, 7)
    lengths = [7, 3, 1, 5]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    garbage_r = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    adv, ret = F.gae(garbage_r, values, mask, gamma=0.9, lam=0.8)
    for row, n in enumerate(lengths):
        expected = _slow_gae(rewards[row, :n].tolist(), values[row, :n].tolist(), 0.9, 0.8)
        assert adv[row, :n].tolist() == pytest.approx(expected, abs=1e-5)
        assert (adv[row, n:] == 0).all() and (ret[row, n:] == 0).all()
        assert ret[row, :n].tolist() == pytest.approx((adv[row, :n] + values[row, :n]).tolist(), abs=1e-6)


def test_policy_loss_clipping_hand_computed():
    # ratio 1.5 on a positive advantage is clipped to 1.2; ratio 0.5 on a negative one is clipped to 0.8.
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, False]])
    out = F.policy_loss(new, old, adv, mask, clip_range=0.2)
    # token 0: max(-1.5, -1.2) = -1.2; token 1: max(0.5, 0.8) = 0.8; token 2 is padding.
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert out.clipfrac.item() == pytest.approx(1.0)
    assert out.ratio.item() == pytest.approx(1.0)
    expected_kl = 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2
    assert out.approx_kl.item() == pytest.approx(expected_kl)


def test_policy_loss_ratio_one_has_gradient_minus_advantage():
    logp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]])
    out = F.policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), 0.2)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, 0.5])
    assert out.clipfrac.item() == 0.0


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    out = F.value_loss(values, old, returns, mask, clip_range=0.5)
    # token 0: unclipped (1-1)^2 = 0, clipped (0.5-1)^2 = 0.25 -> 0.25; token 1: 4 both -> 4.
    assert out.loss.item() == pytest.approx(0.5 * (0.25 + 4.0) / 2)
    assert out.clipfrac.item() == pytest.approx(0.5)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert F.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    mean_only = torch.full_like(returns, 2.0)
    assert F.explained_variance(mean_only, returns, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_suppressed_tokens_leave_the_distribution_and_its_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, requires_grad=True)
    suppressed = [1, 4]
    allowed = [0, 2, 3, 5]
    every_token = torch.arange(6).expand(2, 3, 6).permute(2, 0, 1)  # (V, B, T): each token in turn
    logprobs = torch.stack([F.logprobs_from_logits(logits, t, 1.3, suppressed) for t in every_token], -1)
    assert torch.isinf(logprobs[..., suppressed]).all()
    assert torch.allclose(logprobs[..., allowed].exp().sum(-1), torch.ones(2, 3))  # sums to 1 over allowed
    renormalised = torch.log_softmax(logits[..., allowed] / 1.3, -1)
    assert torch.allclose(logprobs[..., allowed], renormalised, atol=1e-6)
    entropy = F.entropy_from_logits(logits, 1.3, suppressed)
    assert torch.allclose(entropy, -(renormalised.exp() * renormalised).sum(-1), atol=1e-6)
    entropy.sum().backward()  # 0 x -inf must not turn the gradient into NaN
    assert torch.isfinite(logits.grad).all() and (logits.grad[..., suppressed] == 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_a_minus_inf_log_prob_on_padding_leaves_the_kl_and_policy_gradients_finite(estimator):
    """A suppressed pad token's log-prob is -inf on padding: the KL term and the clipped surrogate
    are 0 there and their gradients are those of the real tokens alone (0 x inf was NaN)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 2, 0], [3, 0, 0]])  # 0: the suppressed pad token
    mask = tokens != 0
    logprobs = F.logprobs_from_logits(logits, tokens, 1.0, [0])
    assert torch.isinf(logprobs[~mask]).all()
    ref = torch.randn(2, 3).masked_fill(~mask, 0.0)
    old = logprobs.detach() + 0.1  # padding: -inf, as a log-prob read under the same mask
    advantages = torch.tensor([[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]])
    kl = F.kl_penalty(logprobs, ref, estimator, mask)
    assert (kl[~mask] == 0).all()
    pg = F.policy_loss(logprobs, old, advantages, mask, 0.2)
    (kl.sum() + pg.loss).backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[~mask] == 0).all()
    # the same numbers from the real tokens alone, one at a time
    expected = torch.zeros_like(logits)
    for row, col in mask.nonzero().tolist():
        one = logits[row, col].detach().clone().requires_grad_(True)
        lp = F.logprobs_from_logits(one[None], tokens[row, col][None], 1.0, [0])
        term = F.kl_penalty(lp, ref[row, col][None], estimator).sum()
        ratio = torch.exp(lp - old[row, col])
        a = advantages[row, col]
        surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)).sum() / mask.sum()
        (term + surrogate).backward()
        expected[row, col] = one.grad
    # the same terms summed in another order: float32 rounding steps at the gradient's size, or at
    # the advantages' (terms of size up to 4) where the sum cancels
    tolerance = reordered_tolerance(expected, float(advantages.abs().max()))
    assert torch.allclose(logits.grad, expected, atol=tolerance)
