import math

import pytest
import torch

from agentrl.algos import bradley_terry_loss, dpo_loss

# policy (c, r) = (-1, -3), reference (c, r) = (-2, -2): h = (-1 + 3) - 0 = 2
PC, PR, RC, RR = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.0))


def logsig(x):
    return -math.log1p(math.exp(-x))


def test_sigmoid_and_label_smoothing():
    losses, cr, rr = dpo_loss(PC, PR, RC, RR, beta=0.5)
    assert losses.item() == pytest.approx(-logsig(1.0))  # beta h = 1
    assert cr.item() == pytest.approx(0.5) and rr.item() == pytest.approx(-0.5)
    smooth, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    assert smooth.item() == pytest.approx(-0.9 * logsig(1.0) - 0.1 * logsig(-1.0))


def test_ipo_and_hinge():
    ipo, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo")
    assert ipo.item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)  # (2 - 1)^2 = 1
    hinge, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.25, loss_type="hinge")
    assert hinge.item() == pytest.approx(0.5)  # relu(1 - 0.25 * 2)
    hinge0, _, _ = dpo_loss(PC, PR, RC, RR, beta=1.0, loss_type="hinge")
    assert hinge0.item() == 0.0
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(PC, PR, RC, RR, loss_type="kto")


def test_per_example_and_bradley_terry():
    losses, _, _ = dpo_loss(torch.tensor([-1.0, -3.0]), torch.tensor([-3.0, -1.0]), torch.zeros(2), torch.zeros(2), 1.0)
    assert losses.shape == (2,) and losses[0] < math.log(2) < losses[1]
    assert bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0])).item() == pytest.approx(-logsig(1.0))
