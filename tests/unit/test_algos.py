"""The pure maths against hand-computed values and plain-loop references."""

import math

import pytest
import torch

from agentrl.algos import (AdaptiveKLController, FixedKLController, gae, kl_penalty, masked_mean, ppo_policy_loss,
                           ppo_value_loss, whiten)
from agentrl.algos.kl import k3_kl


def loop_gae(rewards, values, gamma, lam):
    """Textbook GAE on a plain list (no mask)."""
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else 0.0
        last = rewards[t] + gamma * next_v - values[t] + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_hand_computed():
    # r = [0, 1], V = [0.5, 0.2], gamma = 1, lam = 0.5
    # delta_1 = 1 - 0.2 = 0.8; A_1 = 0.8; delta_0 = 0 + 0.2 - 0.5 = -0.3; A_0 = -0.3 + 0.5 * 0.8 = 0.1
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), torch.ones(1, 2), 1.0, 0.5)
    assert torch.allclose(adv, torch.tensor([[0.1, 0.8]]))
    assert torch.allclose(ret, torch.tensor([[0.6, 1.0]]))


def test_gae_skips_masked_gaps_like_removing_them():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 9), torch.randn(3, 9)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(3):
        keep = mask[b].bool()
        expected = loop_gae(rewards[b, keep].tolist(), values[b, keep].tolist(), 0.9, 0.8)
        assert torch.allclose(adv[b, keep], torch.tensor(expected), atol=1e-6)
        assert torch.all(adv[b, ~keep] == 0) and torch.all(ret[b, ~keep] == 0)
        assert torch.allclose(ret[b, keep], adv[b, keep] + values[b, keep])


def test_whiten_and_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    w = whiten(x, mask)
    # mean 2, unbiased var 1 -> (x - 2) / 1; the masked position is 0
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)
    w2 = whiten(x, mask, shift_mean=False)
    assert torch.allclose(w2, torch.tensor([[1.0, 2.0, 3.0, 0.0]]), atol=1e-6)


def test_policy_loss_hand_computed():
    # ratio e^{log 1.5} = 1.5 with A = +1 is clipped at 1.2 -> loss -1.2; ratio 0.5 with A = -1: max(0.5, 0.8) = 0.8
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = ppo_policy_loss(logp, old, adv, torch.ones(1, 2), cliprange=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clipfrac"].item() == pytest.approx(1.0)
    # A mask-0 position changes nothing
    loss_m, _ = ppo_policy_loss(torch.cat([logp, torch.tensor([[9.0]])], 1), torch.zeros(1, 3),
                                torch.tensor([[1.0, -1.0, 5.0]]), torch.tensor([[1, 1, 0]]), 0.2)
    assert loss_m.item() == pytest.approx(loss.item())


def test_value_loss_hand_computed():
    # v = 2, v_old = 1, R = 0, clip 0.5 -> v_clip = 1.5; max(4, 2.25) = 4 -> 0.5 * 4 = 2
    # v = 0.2, v_old = 0, R = 1, clip 0.5 -> v_clip = 0.2; max(0.64, 0.64) -> 0.32
    loss, stats = ppo_value_loss(torch.tensor([[2.0, 0.2]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]),
                                 torch.ones(1, 2), 0.5)
    assert loss.item() == pytest.approx(0.5 * (4.0 + 0.64) / 2)
    # v far below R with v_old close: clipped term (further from R) dominates
    loss2, stats2 = ppo_value_loss(torch.tensor([[0.9]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.5)
    assert loss2.item() == pytest.approx(0.5 * 0.25)
    assert stats2["clipfrac"].item() == 1.0


def test_kl_estimators():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(kl_penalty(logp, ref, "kl"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([[0.5, 1.0]]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([[0.125, 0.5]]))
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert torch.allclose(k3_kl(logp, ref), torch.tensor([expected]))
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "nope")
    # full: p = (0.5, 0.5), q = (0.25, 0.75): KL = 0.5 ln 2 + 0.5 ln(2/3)
    logits, ref_logits = torch.log(torch.tensor([[[0.5, 0.5]]])), torch.log(torch.tensor([[[0.25, 0.75]]]))
    full = kl_penalty(logp[:, :1], ref[:, :1], "full", logits, ref_logits)
    assert full.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 128)
    assert fixed.value == 0.1
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(12.0, 128)  # error clipped to 0.2 -> 0.2 * (1 + 0.2 * 128 / 10000)
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 128 / 10000))
    ctl2 = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl2.update(5.4, 100)  # error -0.1
    assert ctl2.value == pytest.approx(0.2 * (1 - 0.1 * 100 / 10000))


def test_kl_shaped_rewards_by_hand():
    from agentrl.algos import kl_shaped_rewards

    token_scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    rewards, non_score = kl_shaped_rewards(token_scores, kl, 0.5)
    assert torch.allclose(non_score, torch.tensor([[-0.05, -0.1, -0.15], [-0.25, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.25, -1.0, 0.0]]))
