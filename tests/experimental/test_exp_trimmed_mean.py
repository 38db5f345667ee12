"""Trimmed-mean engine: definitions against numpy/scipy and brute force, noise law, accounting."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from exp_helpers import accuracy, batches
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch import nn

from dptorch.experimental import (
    TrimmedMeanPrivacyEngine,
    lln_calibration,
    sample_laplace_log_normal,
    trimmed_mean,
    trimmed_mean_smooth_sensitivity,
    zcdp_to_epsilon,
)


@settings(max_examples=15, deadline=None)
@given(
    values=st.lists(st.floats(-5, 5, allow_nan=False), min_size=3, max_size=20),
    frac=st.floats(0.0, 0.45),
)
def test_trimmed_mean_matches_scipy(values, frac):
    x = np.array(values)
    m = int(frac * len(x))
    if 2 * m >= len(x):
        return
    ref = stats.trim_mean(x, m / len(x) + 1e-12) if m else x.mean()
    got = trimmed_mean(torch.tensor(x)[None], m, dim=1).item()
    assert got == pytest.approx(ref, rel=1e-12, abs=1e-12)


def _tm(y, m):
    s = np.sort(y)
    return s[m : len(s) - m].mean()


def _brute_smooth_sensitivity(x, m, t, a, b):
    """max_k e^{-tk} max_{d(x,y)<=k} LS(y), enumerating every y that replaces points of x by
    a or b; LS(y) by replacing one point by a or b (the trimmed mean is monotone in each point)."""
    n = len(x)
    best_at = np.zeros(n + 1)
    for choice in itertools.product((None, a, b), repeat=n):
        y = np.array([xi if c is None else c for xi, c in zip(x, choice)])
        k = sum(c is not None for c in choice)
        base = _tm(y, m)
        ls = 0.0
        for i, v in itertools.product(range(n), (a, b)):
            z = y.copy()
            z[i] = v
            ls = max(ls, abs(_tm(z, m) - base))
        best_at[k] = max(best_at[k], ls)
    a_k = np.maximum.accumulate(best_at)
    return max(math.exp(-t * k) * a_k[k] for k in range(n + 1))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), n=st.integers(3, 6), t=st.floats(0.01, 1.5))
def test_smooth_sensitivity_matches_brute_force(seed, n, t):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(0, (n - 1) // 2 + 1))
    x = rng.uniform(-1, 1, size=n)
    got = trimmed_mean_smooth_sensitivity(torch.tensor(x)[None], m, t, -1.0, 1.0).item()
    assert got == pytest.approx(_brute_smooth_sensitivity(x, m, t, -1.0, 1.0), rel=1e-10)


def test_lln_noise_law_and_calibration():
    sigma = 0.3
    z = sample_laplace_log_normal((400_000,), sigma, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # Var = E[X^2] E[e^{2σY}] = 2 e^{2σ²}; relative s.e. of the variance estimate ~ 0.5%
    assert z.var().item() == pytest.approx(2 * math.exp(2 * sigma**2), rel=0.03)
    # symmetric; |Z| has median e^{0}·... checked through P(Z > 0) = 1/2
    assert (z > 0).double().mean().item() == pytest.approx(0.5, abs=0.005)
    eps, t = 0.3, 0.02
    sig, s = lln_calibration(eps, t)
    assert t / sig + math.exp(1.5 * sig**2) * s == pytest.approx(eps, rel=1e-10)

    def std_of_noise(sg):  # std of Z/s when s is chosen to meet ε exactly
        return math.sqrt(2) * math.exp(sg**2) / ((eps - t / sg) * math.exp(-1.5 * sg**2))

    grid = np.linspace(t / eps * 1.001, 3.0, 20_000)
    assert std_of_noise(sig) <= min(std_of_noise(g) for g in grid) * (1 + 1e-6)
    assert zcdp_to_epsilon(0.5, 1e-5) == pytest.approx(0.5 + 2 * math.sqrt(0.5 * math.log(1e5)))


def _per_sample_grads(model, x, y):
    """Explicit per-example loop (independent of GradSampleModule)."""
    rows = []
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))]))
    return torch.stack(rows)  # (B, d)


def test_engine_releases_noisy_trimmed_mean_and_accounts_epochs():
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 3, (12,))
    ps = _per_sample_grads(model, x, y).clamp(-0.4, 0.4).numpy()  # before the hooks exist
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = TrimmedMeanPrivacyEngine(
        model, opt, rho_per_epoch=2.0, steps_per_epoch=3, m_trim=2, min_val=-0.4, max_val=0.4,
        smooth_sensitivity_t=0.05, generator=torch.Generator().manual_seed(0),
    )
    assert not engine.is_approximate and "zCDP" in engine.describe_guarantee()
    tm_ref = np.array([_tm(ps[:, j], 2) for j in range(ps.shape[1])])
    sens_ref = trimmed_mean_smooth_sensitivity(torch.tensor(ps.T), 2, 0.05, -0.4, 0.4).numpy()
    zs = []
    for _ in range(4):
        nn.functional.cross_entropy(engine.module(x), y).backward()
        opt.step()
        released = torch.cat([p.grad.flatten() for p in model.parameters()]).numpy()
        zs.append((released - tm_ref) / (sens_ref / engine.lln_s))
        opt.zero_grad()
    z = np.concatenate(zs)  # 4 * 21 standardized LLN draws
    assert np.isfinite(z).all() and z.std() > 0
    assert abs(z.mean()) < 5 * math.sqrt(2 * math.exp(2 * engine.lln_sigma**2) / len(z))
    # ρ split over d = 21 coordinates: ε_c = sqrt(2ρ/d)
    assert engine.epsilon_per_coordinate == pytest.approx(math.sqrt(2 * 2.0 / 21))
    assert engine.epochs == 2 and engine.rho == 4.0  # 4 steps at 3 steps per epoch
    assert engine.get_epsilon(1e-6) == pytest.approx(4.0 + 2 * math.sqrt(4.0 * math.log(1e6)))


def test_trimmed_mean_errors():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(rho_per_epoch=1.0, steps_per_epoch=10)
    for bad in (0.5, -0.1, 0.7):
        with pytest.raises(ValueError, match="trim_fraction"):
            TrimmedMeanPrivacyEngine(model, opt, trim_fraction=bad, **kw)
    with pytest.raises(ValueError, match="m_trim"):
        TrimmedMeanPrivacyEngine(model, opt, m_trim=-1, **kw)
    with pytest.raises(ValueError, match="not both"):
        TrimmedMeanPrivacyEngine(model, opt, m_trim=1, trim_fraction=0.1, **kw)
    with pytest.raises(ValueError, match="min_val < max_val"):
        TrimmedMeanPrivacyEngine(model, opt, min_val=1.0, max_val=1.0, **kw)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="rho_per_epoch"):
            TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=bad, steps_per_epoch=10)
        with pytest.raises(ValueError, match="smooth_sensitivity_t"):
            TrimmedMeanPrivacyEngine(model, opt, smooth_sensitivity_t=bad, **kw)

    class PoissonLoader:
        sample_rate = 0.1

        def __len__(self):
            return 10

    with pytest.raises(ValueError, match="Poisson"):
        TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0, data_loader=PoissonLoader())
    with pytest.raises(ValueError, match="steps_per_epoch"):
        TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0)
    engine = TrimmedMeanPrivacyEngine(model, opt, m_trim=2, **kw)
    nn.functional.cross_entropy(engine.module(torch.randn(4, 4)), torch.zeros(4, dtype=torch.long)).backward()
    with pytest.raises(ValueError, match="cannot have m=2"):
        opt.step()
    with pytest.raises(ValueError, match="2m < n"):
        trimmed_mean(torch.zeros(4), 2)


def test_trimmed_mean_engine_trains_digits(digits):
    """rho_per_epoch = 100 zCDP (replace-one), 5 epochs -> eps ~ 650 at delta = 1e-5: a formal
    but very weak guarantee, because the budget is split over all 650 coordinates."""
    x_tr, y_tr, x_te, y_te = digits
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = TrimmedMeanPrivacyEngine(
        model, opt, rho_per_epoch=100.0, steps_per_epoch=15, trim_fraction=0.2, min_val=-0.3,
        max_val=0.3, smooth_sensitivity_t=0.05, generator=torch.Generator().manual_seed(0),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for idx in batches(1500, 100, g):
            nn.functional.cross_entropy(engine.module(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
            opt.zero_grad()
    assert engine.epochs == 5
    assert engine.get_epsilon(1e-5) == pytest.approx(zcdp_to_epsilon(500.0, 1e-5))
    assert accuracy(model, x_te, y_te) > 0.5
