"""Turn-level GAE (algos.turn_gae) against hand-computed values and a plain loop over turns."""

import random

import torch

from agentrl.algos import gae, turn_gae


def loop_turn_gae(rewards, values, mask, ends, gamma, lam):
    """One row as plain lists: split the mask-1 positions into turns at `ends`, GAE over the turns, spread back."""
    turns, current = [], []
    for t, m in enumerate(mask):
        if m:
            current.append(t)
            if ends[t]:
                turns.append(current)
                current = []
    if current:
        turns.append(current)
    r = [sum(rewards[t] for t in turn) for turn in turns]
    v = [values[turn[0]] for turn in turns]
    adv_turn, last = [0.0] * len(turns), 0.0
    for k in reversed(range(len(turns))):
        next_v = v[k + 1] if k + 1 < len(turns) else 0.0
        last = r[k] + gamma * next_v - v[k] + gamma * lam * last
        adv_turn[k] = last
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    for k, turn in enumerate(turns):
        for t in turn:
            adv[t], ret[t] = adv_turn[k], adv_turn[k] + v[k]
    return adv, ret


def test_turn_gae_hand_computed():
    # prompt | 2 action tokens | observation | 3 action tokens | padding
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0]], dtype=torch.float)
    rewards = torch.tensor([[0.0, -0.1, 0.5, 0.0, 0.0, -0.2, 1.0, 0.0]])  # r_0 = 0.4, r_1 = 0.8 (KL terms summed)
    values = torch.tensor([[9.0, 0.3, 7.0, 9.0, 0.6, 5.0, 5.0, 9.0]])  # V_0 = 0.3, V_1 = 0.6: each turn's first
    # gamma 1, lam 0.5: delta_1 = 0.8 - 0.6 = 0.2 = A_1; delta_0 = 0.4 + 0.6 - 0.3 = 0.7, A_0 = 0.7 + 0.5 * 0.2 = 0.8
    adv, ret = turn_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0, 0.8, 0.8, 0, 0.2, 0.2, 0.2, 0]]))
    assert torch.allclose(ret, torch.tensor([[0, 1.1, 1.1, 0, 0.8, 0.8, 0.8, 0]]))
    # gamma 0.9: delta_0 = 0.4 + 0.9 * 0.6 - 0.3 = 0.64, A_0 = 0.64 + 0.45 * 0.2 = 0.73; A_1 unchanged
    adv, _ = turn_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0, 0.73, 0.73, 0, 0.2, 0.2, 0.2, 0]]))


def test_turn_ends_split_turns_with_no_observation_between():
    # Two turns back to back (an empty observation): the mask alone reads one turn, turn_ends two.
    mask, rewards = torch.ones(1, 4), torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.0, 1.5, 0.0]])
    one, _ = turn_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(one, torch.full((1, 4), 3.0 - 0.5))
    two, _ = turn_gae(rewards, values, mask, torch.tensor([[0, 1, 0, 1]]), gamma=1.0, lam=1.0)
    # A_1 = 2 - 1.5 = 0.5; A_0 = 1 + 1.5 - 0.5 + 0.5 = 2.5
    assert torch.allclose(two, torch.tensor([[2.5, 2.5, 0.5, 0.5]]))


def test_turn_gae_matches_plain_loop():
    rng = random.Random(0)
    B, T = 6, 30
    mask = torch.tensor([[float(rng.random() < 0.7) for _ in range(T)] for _ in range(B)])
    mask[5] = 0.0  # a row with no sampled token (a masked infrastructure failure)
    ends = torch.tensor([[float(rng.random() < 0.25) for _ in range(T)] for _ in range(B)])
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    for turn_ends in (ends, None):
        adv, ret = turn_gae(rewards, values, mask, turn_ends, gamma=0.95, lam=0.9)
        for b in range(B):
            m = mask[b].tolist()
            e = (ends[b].tolist() if turn_ends is not None else
                 [float(m[t] and (t + 1 == T or not m[t + 1])) for t in range(T)])
            want_adv, want_ret = loop_turn_gae(rewards[b].tolist(), values[b].tolist(), m, e, 0.95, 0.9)
            assert torch.allclose(adv[b], torch.tensor(want_adv), atol=1e-5)
            assert torch.allclose(ret[b], torch.tensor(want_ret), atol=1e-5)


def test_one_token_per_turn_is_token_gae():
    torch.manual_seed(0)
    mask = (torch.rand(4, 12) < 0.6).float()
    rewards, values = torch.randn(4, 12), torch.randn(4, 12)
    want = gae(rewards, values, mask, 0.9, 0.8)
    got = turn_gae(rewards, values, mask, turn_ends=mask, gamma=0.9, lam=0.8)
    for w, g in zip(want, got):
        assert torch.allclose(w, g, atol=1e-6)


def test_single_turn_is_token_gae_lambda_one_at_its_first_token():
    # One turn: A = (sum of the turn's rewards) - V(first position) for every token, whatever gamma and lam:
    # token-level GAE with gamma = lam = 1 at the turn's first token.
    torch.manual_seed(1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0]], dtype=torch.float)
    rewards, values = torch.randn(1, 7), torch.randn(1, 7)
    token_adv, token_ret = gae(rewards, values, mask, 1.0, 1.0)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5)):
        adv, ret = turn_gae(rewards, values, mask, gamma=gamma, lam=lam)
        assert torch.allclose(adv, token_adv[0, 2] * mask, atol=1e-6)
        assert torch.allclose(ret, token_ret[0, 2] * mask, atol=1e-6)
