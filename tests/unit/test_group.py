"""GRPO / RLOO advantages and the GRPO loss against hand-computed values."""

import pytest
import torch

from agentrl.algos import group_advantages, grpo_loss, rloo_advantages, zero_variance_fraction


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0])  # groups of 2: (1, 0), (0.5, 0.5), (2, 2)
    adv = group_advantages(scores, 2, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.7071 = +-0.7071
    assert torch.allclose(adv[:2], torch.tensor([0.70710678, -0.70710678]))
    assert torch.all(adv[2:] == 0)  # all-equal groups carry no signal
    dr = group_advantages(scores, 2, normalize_std=False)
    assert torch.allclose(dr, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))
    three = group_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, eps=0.0)
    assert torch.allclose(three, torch.tensor([2.0, -1.0, -1.0]) / 3 ** 0.5)  # std = sqrt(3)
    assert torch.all(group_advantages(torch.tensor([4.0, -2.0]), 1) == 0)  # groups of one


def test_rloo_hand_computed():
    # (3, 0, 0): 3 - 0 = 3; 0 - 1.5 = -1.5 twice
    assert torch.allclose(rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3), torch.tensor([3.0, -1.5, -1.5]))
    assert torch.all(rloo_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 2) == 0)
    assert torch.all(rloo_advantages(torch.tensor([5.0, 1.0]), 1) == 0)


def test_zero_variance_fraction_and_bad_shapes():
    assert zero_variance_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2) == 0.5
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2)


def test_grpo_loss_hand_computed():
    logp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]]))  # ratios with old = 0
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logp, old, adv, mask, epsilon=0.2)
    # seq 0: -min(1.5, 1.2) = -1.2 ; -min(1, 1) = -1 ; seq 1: -min(-0.5, -0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 3)
    seq_loss, _ = grpo_loss(logp, old, adv, mask, epsilon=0.2, aggregation="sequence_mean")
    assert seq_loss.item() == pytest.approx(((-1.2 - 1.0) / 2 + 0.8) / 2)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    ref = logp.clone()
    with_kl, st = grpo_loss(logp, old, adv, mask, beta=0.5, ref_logprobs=ref)
    assert with_kl.item() == pytest.approx(loss.item()) and st["kl"].item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, adv, mask, beta=0.1)


def test_left_out_episodes_are_no_ones_baseline():
    """valid=False (an episode that failed outside the policy): advantage 0, and out of its group's mean and std."""
    scores = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0, 0.0, 9.0])  # two groups of 4
    valid = torch.tensor([True, True, True, False, True, False, False, True])
    # Group 1 without the 5.0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    mean, std = 1 / 3, (1 / 3) ** 0.5
    want = [(1 - mean) / (std + 1e-4), (0 - mean) / (std + 1e-4), (0 - mean) / (std + 1e-4), 0.0]
    # Group 2 keeps 2.0 and 9.0: mean 5.5, std sqrt(2 * 3.5^2 / 1) = 4.9497...
    std2 = (2 * 3.5 ** 2) ** 0.5
    want += [-3.5 / (std2 + 1e-4), 0.0, 0.0, 3.5 / (std2 + 1e-4)]
    assert torch.allclose(group_advantages(scores, 4, valid=valid), torch.tensor(want), atol=1e-6)
    assert torch.allclose(group_advantages(scores, 4, normalize_std=False, valid=valid),
                          torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, -3.5, 0.0, 0.0, 3.5]), atol=1e-6)
    # RLOO: baselines from the other valid episodes only.
    assert torch.allclose(rloo_advantages(scores, 4, valid=valid),
                          torch.tensor([1.0, -0.5, -0.5, 0.0, -7.0, 0.0, 0.0, 7.0]), atol=1e-6)
    # A group left with one valid episode teaches nothing; all valid = the plain formulas.
    one = torch.tensor([True, False, False, False] * 2)
    assert group_advantages(scores, 4, valid=one).abs().sum() == 0 and rloo_advantages(scores, 4, valid=one).abs().sum() == 0
    every = torch.ones(8, dtype=torch.bool)
    assert torch.allclose(group_advantages(scores, 4, valid=every), group_advantages(scores, 4), atol=1e-6)
    assert torch.allclose(rloo_advantages(scores, 4, valid=every), rloo_advantages(scores, 4))


def test_turn_returns_by_hand():
    from agentrl.algos import turn_returns

    assert turn_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert turn_returns([1.0, -1.0], 1.0) == [0.0, -1.0]
    assert turn_returns([], 0.9) == []


def test_anchor_state_advantages_by_hand():
    """GiGPO step groups: same group and same state. Group 0: three episodes; after turn 0, two of them reach
    state "s1" (returns 1.0 and 0.0) and one "s2" (alone: 0). Group 1 reuses the key "s1" but is its own group."""
    from agentrl.algos import anchor_state_advantages

    groups = [0, 0, 0, 1, 1]
    keys = [["reset", "s1"], ["reset", "s1"], ["reset", "s2"], ["reset", "s1"], ["reset"]]
    returns = [[0.5, 1.0], [0.0, 0.0], [2.0, 2.0], [1.0, 1.0], [1.0]]
    got = anchor_state_advantages(groups, keys, returns, eps=0.0)
    # reset of group 0: returns 0.5, 0.0, 2.0: mean 5/6, unbiased std sqrt(((1/3)^2 + (5/6)^2 + (7/6)^2) / 2)
    mean, std = 5 / 6, (((1 / 3) ** 2 + (5 / 6) ** 2 + (7 / 6) ** 2) / 2) ** 0.5
    s1 = 0.5 / (0.5 ** 0.5)  # returns 1.0 and 0.0: mean 0.5, std sqrt(0.5)
    want = [[(0.5 - mean) / std, s1], [(0.0 - mean) / std, -s1], [(2.0 - mean) / std, 0.0], [0.0, 0.0], [0.0]]
    assert all(a == pytest.approx(b) for ra, rb in zip(got, want) for a, b in zip(ra, rb))
    dr = anchor_state_advantages(groups, keys, returns, normalize_std=False)
    assert dr[0][1] == pytest.approx(0.5) and dr[1][1] == pytest.approx(-0.5) and dr[2][1] == 0.0


def test_single_turn_step_advantages_are_the_group_advantages():
    """With one turn per episode every episode of a group starts from the same state: GiGPO's step groups are
    GRPO's groups (gamma irrelevant), so the two advantages coincide."""
    from agentrl.algos import anchor_state_advantages

    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0])
    step = anchor_state_advantages([0, 0, 0, 1, 1, 1], [["reset"]] * 6, [[float(s)] for s in scores])
    assert torch.allclose(torch.tensor([r[0] for r in step]), group_advantages(scores, 3), atol=1e-6)
