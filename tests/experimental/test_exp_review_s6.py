"""Review s6: the trainable set changing after construction, and non-finite per-sample gradients.

* Sign vote and trimmed mean calibrate their noise to ``d``, the number of trainable
  coordinates. ``d`` must be the number released at the step, not the number at construction:
  a parameter unfrozen later would otherwise be released with noise calibrated to a smaller
  ``d`` (sign vote: L2 sensitivity ``√d_new`` against noise ``σ√d_old``; trimmed mean:
  ``ρ d_new / d_old`` spent per step instead of ``ρ``).
* A parameter frozen between the backward pass and the step still holds its raw gradient in
  ``p.grad``; the step must refuse rather than let the optimizer apply it.
* One example with a NaN / infinite per-sample gradient must not change the release by more
  than the sensitivity the noise is calibrated to (it made every trimmed-mean coordinate NaN).
"""

from __future__ import annotations

import importlib
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from dptorch.experimental import (
    GlobalImmediateSensitivityPrivacyEngine,
    ImmediateSensitivityPrivacyEngine,
    SignVotePrivacyEngine,
    TrimmedMeanPrivacyEngine,
    clamp_with_nonfinite,
    lln_calibration,
    sample_laplace_log_normal,
    sign_vote_counts,
    trimmed_mean,
    trimmed_mean_smooth_sensitivity,
)

F64 = torch.float64
# the module, not the function dptorch.experimental.trimmed_mean that shadows it
tm_module = importlib.import_module("dptorch.experimental.trimmed_mean")


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)


def _set_trainable(module: nn.Module, flag: bool) -> None:
    for p in module.parameters():
        p.requires_grad_(flag)


# ------------------------------------------------------------------ trainable set changes
def test_sign_vote_noise_follows_parameters_unfrozen_after_construction():
    model = _mlp(0)
    _set_trainable(model[0], False)  # backbone frozen at construction
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sigma = 0.7
    engine = SignVotePrivacyEngine(
        model, opt, noise_multiplier=sigma, sample_rate=0.1, output="mean",
        expected_batch_size=1, generator=torch.Generator().manual_seed(3),
    )
    d_old = 8 * 3 + 3
    assert engine.num_coordinates == d_old
    _set_trainable(model[0], True)  # unfrozen later; SGD already holds these parameters
    d_new = d_old + 5 * 8 + 8
    assert engine.num_coordinates == d_new
    assert engine.noise_std == pytest.approx(sigma * math.sqrt(d_new))

    x, y = _batch(1, 6)
    nn.functional.cross_entropy(engine.module(x), y).backward()
    params = engine.params
    assert len(params) == 4
    counts = [sign_vote_counts(p.grad_sample) for p in params]
    opt.step()
    # the noise of every released count is exactly the generator's N(0, σ² d_new) draw
    g = torch.Generator().manual_seed(3)
    for p, c in zip(params, counts):
        noise = torch.normal(0.0, sigma * math.sqrt(d_new), size=p.shape, dtype=F64, generator=g)
        torch.testing.assert_close(p.grad, c + noise, rtol=0, atol=1e-12)
    ((charged, q, steps),) = engine.accountant.history
    assert charged == pytest.approx(sigma) and q == 0.1 and steps == 1

    _set_trainable(model[2], False)  # frozen later: the noise shrinks with d
    assert engine.num_coordinates == 5 * 8 + 8
    assert engine.noise_std == pytest.approx(sigma * math.sqrt(5 * 8 + 8))


def test_trimmed_mean_budget_follows_parameters_unfrozen_after_construction():
    model = _mlp(0)
    _set_trainable(model[0], False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rho, t, m, lo, hi = 2.0, 0.05, 2, -0.4, 0.4
    engine = TrimmedMeanPrivacyEngine(
        model, opt, rho_per_epoch=rho, steps_per_epoch=3, m_trim=m, min_val=lo, max_val=hi,
        smooth_sensitivity_t=t, generator=torch.Generator().manual_seed(4),
    )
    d_old = 8 * 3 + 3
    assert engine.epsilon_per_coordinate == pytest.approx(math.sqrt(2 * rho / d_old))
    _set_trainable(model[0], True)
    d_new = d_old + 5 * 8 + 8
    eps_c = math.sqrt(2 * rho / d_new)  # ρ split over the d_new coordinates now released
    sigma_l, s = lln_calibration(eps_c, t)
    assert engine.num_coordinates == d_new
    assert engine.epsilon_per_coordinate == pytest.approx(eps_c)
    assert (engine.lln_sigma, engine.lln_s) == pytest.approx((sigma_l, s))

    x, y = _batch(2, 12)
    nn.functional.cross_entropy(engine.module(x), y).backward()
    params = engine.params
    assert len(params) == 4
    rows = [p.grad_sample.reshape(12, -1).t().clamp(lo, hi) for p in params]
    opt.step()
    g = torch.Generator().manual_seed(4)
    for p, r in zip(params, rows):
        z = sample_laplace_log_normal((r.shape[0],), sigma_l, generator=g, dtype=F64)
        sens = trimmed_mean_smooth_sensitivity(r, m, t, lo, hi)
        expected = trimmed_mean(r, m, dim=1) + sens / s * z
        torch.testing.assert_close(p.grad.flatten(), expected, rtol=1e-10, atol=1e-12)
    assert engine.rho == rho  # one epoch started, charged ρ whatever d is


@pytest.mark.parametrize("engine_cls", [SignVotePrivacyEngine, TrimmedMeanPrivacyEngine])
def test_freezing_between_backward_and_step_is_refused(engine_cls):
    """The frozen parameter's p.grad is its raw batch gradient: the optimizer would apply it."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kw = (
        dict(noise_multiplier=1.0, sample_rate=0.1)
        if engine_cls is SignVotePrivacyEngine
        else dict(rho_per_epoch=1.0, steps_per_epoch=10, m_trim=1)
    )
    engine = engine_cls(model, opt, **kw)
    x, y = _batch(3, 8)
    nn.functional.cross_entropy(engine.module(x), y).backward()
    model[2].weight.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"2\.weight became frozen.*raw, non-private"):
        opt.step()
    for p, b in zip(model.parameters(), before):  # nothing was applied
        assert torch.equal(p, b)
    assert engine.steps == 0


def _is_engine(cls, model, opt, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ApproximateDPWarning
        return cls(model, opt, noise_multiplier=1.0, sample_rate=0.1, **kw)


def test_immediate_sensitivity_per_param_accounts_tensors_unfrozen_after_construction():
    """Per-parameter mode accounts sigma*e^beta/sqrt(P): P is the number of tensors released."""
    model = _mlp(0)
    _set_trainable(model[0], False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = _is_engine(ImmediateSensitivityPrivacyEngine, model, opt, per_param=True)
    _set_trainable(model[0], True)  # P: 2 -> 4 tensors
    x, y = _batch(4, 8)
    x.requires_grad_(True)
    engine.backward(nn.functional.cross_entropy(model(x), y), x)
    opt.step()
    ((charged, _, _),) = engine.accountant.history
    assert charged == pytest.approx(1.0 / math.sqrt(4))


@pytest.mark.parametrize(
    "engine_cls", [ImmediateSensitivityPrivacyEngine, GlobalImmediateSensitivityPrivacyEngine]
)
def test_immediate_sensitivity_freezing_between_backward_and_step_is_refused(engine_cls):
    model = nn.Linear(5, 3, bias=False).double()
    head = nn.Linear(3, 3, bias=False).double()
    seq = nn.Sequential(model, head)
    opt = torch.optim.SGD(seq.parameters(), lr=0.5)
    kw = (
        dict(input_shape=(5,), loss_reduction="sum", check_constant_trials=0)
        if engine_cls is GlobalImmediateSensitivityPrivacyEngine
        else {}
    )
    engine = _is_engine(engine_cls, seq, opt, **kw)
    x, y = _batch(5, 8)
    x.requires_grad_(True)
    engine.backward(nn.functional.cross_entropy(seq(x), y), x)
    head.weight.requires_grad_(False)
    before = [p.detach().clone() for p in seq.parameters()]
    with pytest.raises(ValueError, match=r"frozen: 1\.weight; unfrozen: none"):
        opt.step()
    for p, b in zip(seq.parameters(), before):
        assert torch.equal(p, b)
    assert engine.steps == 0


# ------------------------------------------------------------------ non-finite per-sample values
def test_clamp_with_nonfinite_maps_into_the_range():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.3, -2.0, 5.0], dtype=F64)
    assert clamp_with_nonfinite(x, -1.0, 1.0).tolist() == [0.0, 1.0, -1.0, 0.3, -1.0, 1.0]
    assert clamp_with_nonfinite(x, 0.5, 2.0).tolist() == [0.5, 2.0, 0.5, 0.5, 0.5, 2.0]


def _zero_lln(shape, sigma, *, generator=None, dtype=torch.float32, device=None):
    return torch.zeros(shape, dtype=dtype, device=device)


def _release(engine, opt, grad_samples, seed):
    """The engine's release for the given per-sample gradients, with the noise seeded."""
    engine.generator.manual_seed(seed)
    for p, gs in zip(engine.params, grad_samples):
        p.grad_sample = gs.clone()
    opt.step()
    return [p.grad.clone() for p in engine.params]


@pytest.mark.parametrize("noise", ["zero", "seeded"])
def test_trimmed_mean_nonfinite_sample_is_an_in_range_sample(noise, monkeypatch):
    if noise == "zero":
        monkeypatch.setattr(tm_module, "sample_laplace_log_normal", _zero_lln)
    n, m, t, lo, hi = 10, 2, 0.05, -0.3, 0.3
    model = nn.Linear(4, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = TrimmedMeanPrivacyEngine(
        model, opt, rho_per_epoch=1.0, steps_per_epoch=5, m_trim=m, min_val=lo, max_val=hi,
        smooth_sensitivity_t=t, generator=torch.Generator().manual_seed(0),
    )
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(5), dtype=F64)
    y = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(6))
    x_bad = x.clone()
    x_bad[3] = float("inf")  # this example's per-sample gradient is non-finite
    nn.functional.cross_entropy(engine.module(x), y).backward()
    good = [p.grad_sample.clone() for p in engine.params]
    engine.zero_grad()
    nn.functional.cross_entropy(engine.module(x_bad), y).backward()
    bad = [p.grad_sample.clone() for p in engine.params]
    assert not all(torch.isfinite(gs[3]).all() for gs in bad)
    engine.zero_grad()
    # also every kind of non-finite entry, injected into example 7
    mixed = []
    for gs in good:
        gs = gs.clone()
        row = gs[7].reshape(-1)
        row[0::3], row[1::3], row[2::3] = float("nan"), float("inf"), -float("inf")
        mixed.append(gs)

    for poisoned, i in ((bad, 3), (mixed, 7)):
        out_bad = _release(engine, opt, poisoned, seed=11)
        assert all(torch.isfinite(g).all() for g in out_bad)
        # the same release as for the in-range example NaN -> 0, +inf -> hi, -inf -> lo
        mapped = [gs.clone() for gs in poisoned]
        for gs in mapped:
            gs[i] = clamp_with_nonfinite(gs[i], lo, hi)
        for a, b in zip(out_bad, _release(engine, opt, mapped, seed=11)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if noise == "zero":
            # replace-one neighbour of the clean batch: the trimmed mean moves by at most its
            # local sensitivity, which the smooth sensitivity S bounds, and S itself moves by at
            # most a factor e^t (so the noise scale S / s stays calibrated)
            out_good = _release(engine, opt, good, seed=11)
            for a, b, gs_good, gs_bad in zip(out_bad, out_good, good, poisoned):
                rows_good = gs_good.reshape(n, -1).t().clamp(lo, hi)
                rows_bad = clamp_with_nonfinite(gs_bad.reshape(n, -1).t(), lo, hi)
                s_good = trimmed_mean_smooth_sensitivity(rows_good, m, t, lo, hi)
                s_bad = trimmed_mean_smooth_sensitivity(rows_bad, m, t, lo, hi)
                diff = (a - b).flatten().abs()
                assert (diff <= s_good + 1e-12).all()
                assert (diff <= (hi - lo) / (n - 2 * m) + 1e-12).all()
                assert (s_bad <= math.exp(t) * s_good + 1e-12).all()


def test_sign_vote_nonfinite_sample_casts_an_ordinary_vote():
    """Regression guard: NaN votes 0 and ±inf votes ±1 on every backend (torch.sign(NaN) is NaN
    in general; on CPU it happens to be 0, so this test also passes without the explicit rule)."""
    gs = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, 2.0, -3.0]], dtype=F64)
    assert sign_vote_counts(gs).tolist() == [0.0, 1.0, -1.0, 0.0, 1.0, -1.0]

    model = nn.Linear(4, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sigma = 0.5
    engine = SignVotePrivacyEngine(
        model, opt, noise_multiplier=sigma, sample_rate=0.1, output="mean",
        expected_batch_size=1, generator=torch.Generator().manual_seed(0),
    )
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    x[5] = float("inf")
    nn.functional.cross_entropy(engine.module(x), y).backward()
    with_bad = [p.grad_sample.clone() for p in engine.params]
    assert not all(torch.isfinite(gs[5]).all() for gs in with_bad)
    engine.zero_grad()
    out_bad = _release(engine, opt, with_bad, seed=9)
    assert all(torch.isfinite(g).all() for g in out_bad)
    # add/remove neighbour (same noise): the counts move by one vote vector, L2 norm <= sqrt(d)
    without = [gs[torch.arange(8) != 5] for gs in with_bad]
    out_without = _release(engine, opt, without, seed=9)
    diff = torch.cat([(a - b).flatten() for a, b in zip(out_bad, out_without)])
    assert float(diff.norm()) <= math.sqrt(engine.num_coordinates) + 1e-9
    assert np.isin(diff.numpy().round(9), [-1.0, 0.0, 1.0]).all()
