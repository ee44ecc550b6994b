"""DPO and KTO losses against their formulas written out independently here."""

import math

import torch

from treadle.cookbook.preference import dpo_loss, kto_loss


def test_dpo_matches_formula_and_gradient():
    pc = torch.tensor([-3.0, -5.0], requires_grad=True)
    pr = torch.tensor([-4.0, -4.5], requires_grad=True)
    rc, rr, beta = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -4.0]), 0.5
    loss, _ = dpo_loss(pc, pr, rc, rr, beta)
    expected = []
    for i in range(2):
        z = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
        expected.append(-math.log(1 / (1 + math.exp(-z))))
    assert math.isclose(loss.item(), sum(expected) / 2, rel_tol=1e-6)
    loss.backward()
    # d/dpc_i of -log σ(z_i) / 2 = -(1 - σ(z_i)) * beta / 2
    for i in range(2):
        z = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
        sig = 1 / (1 + math.exp(-z))
        assert math.isclose(pc.grad[i].item(), -(1 - sig) * beta / 2, rel_tol=1e-5)
        assert math.isclose(pr.grad[i].item(), (1 - sig) * beta / 2, rel_tol=1e-5)


def test_kto_matches_formula():
    policy = torch.tensor([-2.0, -6.0, -3.0])
    ref = torch.tensor([-3.0, -5.0, -3.5])
    desirable = torch.tensor([True, False, True])
    beta, wd, wu = 0.3, 1.0, 1.5
    loss, _ = kto_loss(policy, ref, desirable, beta, wd, wu)
    ratios = [1.0, -1.0, 0.5]
    z0 = max(0.0, sum(ratios) / 3)

    def sig(x):
        return 1 / (1 + math.exp(-x))

    terms = [
        wd * (1 - sig(beta * (ratios[0] - z0))),
        wu * (1 - sig(beta * (z0 - ratios[1]))),
        wd * (1 - sig(beta * (ratios[2] - z0))),
    ]
    assert math.isclose(loss.item(), sum(terms) / 3, rel_tol=1e-6)


def test_kto_reference_point_is_not_differentiated():
    policy = torch.tensor([-2.0, -6.0], requires_grad=True)
    loss, _ = kto_loss(policy, torch.tensor([-3.0, -5.0]), torch.tensor([True, False]), 1.0)
    loss.backward()
    z0 = 0.0  # mean ratio (1 - 1)/2 = 0
    s0 = 1 / (1 + math.exp(-(1.0 - z0)))
    # d/dp0 of (1 - σ(r0 - z0))/2 with z0 held fixed
    assert math.isclose(policy.grad[0].item(), -s0 * (1 - s0) / 2, rel_tol=1e-5)
