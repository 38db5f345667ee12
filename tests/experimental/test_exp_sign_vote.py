"""Sign-vote engine: vote counts against an explicit per-example loop, noise std, accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from exp_helpers import accuracy, batches
from torch import nn

from dptorch.experimental import ApproximateEpsilon, SignVotePrivacyEngine, sign_vote_counts


def _per_sample_grads(model, x, y):
    out = []
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        out.append([g.numpy() for g in torch.autograd.grad(loss, list(model.parameters()))])
    return out


def test_counts_match_numpy_and_noise_std():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 30), nn.Tanh(), nn.Linear(30, 4)).double()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 4, (9,))
    ref = [sum(np.sign(g[j]) for g in _per_sample_grads(model, x, y)) for j in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sigma = 0.6
    engine = SignVotePrivacyEngine(
        model, opt, noise_multiplier=sigma, sample_rate=0.1, generator=torch.Generator().manual_seed(0)
    )
    d = 5 * 30 + 30 + 30 * 4 + 4
    assert engine.num_coordinates == d and engine.noise_std == pytest.approx(sigma * math.sqrt(d))
    nn.functional.cross_entropy(engine.module(x), y).backward()
    for p, r in zip(engine.params, ref):
        np.testing.assert_array_equal(sign_vote_counts(p.grad_sample).numpy(), r)
    z = []
    for _ in range(5):
        noisy = engine.noisy_counts()
        z += [((n - torch.from_numpy(r)) / engine.noise_std).flatten() for n, r in zip(noisy, ref)]
    z = torch.cat(z)
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * z.numel())
    assert abs(z.mean().item()) < 4 / math.sqrt(z.numel())
    opt.step()
    for p in engine.params:  # released direction is a sign vector; per-sample grads consumed
        assert set(p.grad.unique().tolist()) <= {-1.0, 0.0, 1.0}
        assert getattr(p, "grad_sample", None) is None


def test_tiny_noise_gives_majority_sign_and_mean_output():
    torch.manual_seed(1)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randint(0, 2, (7,))
    ref = [sum(np.sign(g[j]) for g in _per_sample_grads(model, x, y)) for j in range(2)]
    for output in ("sign", "mean"):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = SignVotePrivacyEngine(
            model, opt, noise_multiplier=1e-9, sample_rate=0.5, output=output, expected_batch_size=7
        )
        nn.functional.cross_entropy(engine.module(x), y).backward()
        engine.step()
        for p, r in zip(engine.params, ref):
            want = np.sign(r) if output == "sign" else r / 7
            np.testing.assert_allclose(p.grad.numpy(), want, atol=1e-6)
        engine.zero_grad()
        engine.detach()
        engine.module.to_standard_module()


def test_empty_batch_releases_noise_and_epsilon_is_formal():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = SignVotePrivacyEngine(model, opt, noise_multiplier=1.0, sample_rate=0.01)
    assert not engine.is_approximate and "DP under add/remove" in engine.describe_guarantee()
    engine.backward(None)  # empty Poisson batch
    opt.step()
    assert all(p.grad is not None for p in engine.params)
    for _ in range(9):
        engine.backward(None)
        opt.step()
    eps = engine.get_epsilon(1e-5)
    assert type(eps) is float and not isinstance(eps, ApproximateEpsilon)
    from dptorch.accountants import RDPAccountant

    ref = RDPAccountant()
    for _ in range(10):
        ref.step(noise_multiplier=1.0, sample_rate=0.01)
    assert eps == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)


def test_sign_vote_errors():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="noise_multiplier"):
            SignVotePrivacyEngine(model, opt, noise_multiplier=bad, sample_rate=0.1)
    with pytest.raises(ValueError, match="output"):
        SignVotePrivacyEngine(model, opt, noise_multiplier=1.0, sample_rate=0.1, output="median")
    with pytest.raises(ValueError, match="expected_batch_size"):
        SignVotePrivacyEngine(model, opt, noise_multiplier=1.0, sample_rate=0.1, output="mean")
    with pytest.raises(ValueError, match="secure_mode"):
        SignVotePrivacyEngine(
            model, opt, noise_multiplier=1.0, sample_rate=0.1, secure_mode=True,
            generator=torch.Generator(),
        )
    engine = SignVotePrivacyEngine(model, opt, noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    assert engine.steps == 0


@pytest.mark.parametrize("output,lr,threshold", [("sign", 0.05, 0.3), ("mean", 0.5, 0.6)])
def test_sign_vote_engine_trains_digits(digits, output, lr, threshold):
    """(ε, δ)-DP, add/remove, sampled Gaussian at σ = 1, q = 64/1500, 8 epochs (ε ~ 3-4 at 1e-5).

    Chance is 0.1. Pure majority signs are weak on a 10-class linear model (each class's rows
    are outvoted by the 90% of examples of other classes); noisy mean votes keep the margins."""
    x_tr, y_tr, x_te, y_te = digits
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = SignVotePrivacyEngine(
        model, opt, noise_multiplier=1.0, sample_rate=64 / 1500, output=output,
        expected_batch_size=64, generator=torch.Generator().manual_seed(0),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        for idx in batches(1500, 64, g):
            nn.functional.cross_entropy(engine.module(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
            opt.zero_grad()
    eps = engine.get_epsilon(1e-5)
    assert 0 < eps < 20
    assert accuracy(model, x_te, y_te) > threshold
