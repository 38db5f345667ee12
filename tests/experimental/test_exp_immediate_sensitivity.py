"""Immediate-sensitivity engines against finite-difference references and statistical bounds."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from exp_helpers import accuracy, batches, mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.experimental import (
    ApproximateDPWarning,
    ApproximateEpsilon,
    GlobalImmediateSensitivityPrivacyEngine,
    ImmediateSensitivityPrivacyEngine,
    NonConstantSensitivityWarning,
    immediate_sensitivity,
)

F64 = torch.float64


def _quiet_engine(cls, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximateDPWarning)
        return cls(*args, **kwargs)


def _small_net(seed: int, d_in: int = 3, hidden: int = 4, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(F64)


def _grad_norm(model, x, y, ord, per_param, scaling):
    """First-order only: ‖∇θ L‖ (joint or per tensor) of the mean cross-entropy at batch x."""
    params = list(model.parameters())
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params)
    if per_param:
        return np.array([torch.linalg.vector_norm(g.flatten(), ord).item() for g in grads])
    scaling = scaling or [1.0] * len(grads)
    flat = torch.cat([(g / c).flatten() for g, c in zip(grads, scaling)])
    return np.array([torch.linalg.vector_norm(flat, ord).item()])


def _fd_sensitivity(model, x, y, ord=2, per_param=False, scaling=None, h=1e-6):
    """Per-example input-gradient norms of the gradient norm, by central finite differences,
    one example and one input coordinate at a time. Returns (n_norms, B)."""
    x = x.detach().clone()
    B, D = x.shape
    n_out = len(list(model.parameters())) if per_param else 1
    jac = np.zeros((n_out, B, D))
    for i in range(B):
        for j in range(D):
            xp, xm = x.clone(), x.clone()
            xp[i, j] += h
            xm[i, j] -= h
            jac[:, i, j] = (
                _grad_norm(model, xp, y, ord, per_param, scaling)
                - _grad_norm(model, xm, y, ord, per_param, scaling)
            ) / (2 * h)
    return np.linalg.norm(jac, ord=ord, axis=2)


def _is(model, x, y, **kw):
    x = x.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(model(x), y)
    return immediate_sensitivity(loss, list(model.parameters()), x, **kw)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 4), ord=st.sampled_from([1, 2]))
def test_is_matches_finite_differences(seed, batch, ord):
    model = _small_net(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, generator=g, dtype=F64)
    y = torch.randint(0, 3, (batch,), generator=g)
    grads, sens = _is(model, x, y, ord=ord)
    ref = _fd_sensitivity(model, x, y, ord=ord)[0]
    np.testing.assert_allclose(sens.numpy(), ref, rtol=1e-5, atol=1e-8)
    # the gradients are the ordinary gradients of the loss
    ref_grads = torch.autograd.grad(
        nn.functional.cross_entropy(model(x), y), list(model.parameters())
    )
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_is_scaling_vec_and_per_param_match_finite_differences():
    model = _small_net(3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=g, dtype=F64)
    y = torch.tensor([0, 1, 2, 1])
    scaling = [0.5, 2.0, 3.0, 0.25]
    _, sens = _is(model, x, y, scaling=scaling)
    np.testing.assert_allclose(sens.numpy(), _fd_sensitivity(model, x, y, scaling=scaling)[0], rtol=1e-5)
    _, sens_pp = _is(model, x, y, per_param=True)
    assert sens_pp.shape == (4, 4)
    np.testing.assert_allclose(sens_pp.numpy(), _fd_sensitivity(model, x, y, per_param=True), rtol=1e-5, atol=1e-9)


def test_engine_noise_std_is_sigma_times_sensitivity():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 5)).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sigma = 0.7
    engine = _quiet_engine(
        ImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=sigma, sample_rate=0.1,
        generator=torch.Generator().manual_seed(5),
    )
    x = torch.randn(8, 40, dtype=F64, requires_grad=True)
    y = torch.randint(0, 5, (8,))
    z = []
    for _ in range(3):
        engine.backward(nn.functional.cross_entropy(model(x), y), x)
        clean = [p.grad.clone() for p in model.parameters()]
        sens = engine.batch_sensitivity
        assert sens > 0
        opt.step()
        z += [((p.grad - c) / (sigma * sens)).flatten() for p, c in zip(model.parameters(), clean)]
        opt.zero_grad()
    z = torch.cat(z)
    n = z.numel()  # 3 * 2305 standardized noise draws
    assert abs(z.mean().item()) < 4 / math.sqrt(n)
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * n)
    assert engine.steps == 3


def test_per_param_noise_beta_and_zero_sensitivity_skip():
    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(30, 40, dtype=F64))
            self.b = nn.Parameter(torch.zeros(30, dtype=F64))

        def forward(self, x):
            return x @ self.w.t() + self.b

    model = Affine()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sigma, beta = 0.5, 0.3
    engine = _quiet_engine(
        ImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=sigma, sample_rate=0.1,
        per_param=True, beta=beta, generator=torch.Generator().manual_seed(2),
    )
    x = torch.randn(6, 40, dtype=F64, requires_grad=True)
    z = []
    for _ in range(4):
        engine.backward(model(x).sum(), x)  # d/db = 6 everywhere: no input dependence
        sens_w, sens_b = engine.batch_sensitivity
        # ‖∂L/∂w‖ = √30 ‖Σ x_i‖, whose gradient wrt each x_i has norm √30
        assert sens_w == pytest.approx(math.sqrt(30), rel=1e-10)
        assert sens_b == 0.0
        clean_w, clean_b = model.w.grad.clone(), model.b.grad.clone()
        engine.step()
        torch.testing.assert_close(model.b.grad, clean_b, rtol=0, atol=0)  # skipped: no noise
        z.append(((model.w.grad - clean_w) / (sigma * math.exp(beta) * sens_w)).flatten())
        engine.zero_grad()
    z = torch.cat(z)
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * z.numel())
    # accounted as one Gaussian mechanism of multiplier σ e^β / √P with P = 2 tensors
    assert engine._step_noise_multiplier == pytest.approx(sigma * math.exp(beta) / math.sqrt(2))


def test_warning_label_and_epsilon_are_approximate():
    model = _small_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(ApproximateDPWarning, match="APPROXIMATE.*local"):
        engine = ImmediateSensitivityPrivacyEngine(model, opt, noise_multiplier=1.0, sample_rate=0.05)
    assert engine.is_approximate is True
    assert "Approximate DP" in engine.describe_guarantee()
    assert engine.get_epsilon(1e-5) == 0.0
    x = torch.randn(5, 3, dtype=F64, requires_grad=True)
    for _ in range(10):
        engine.backward(nn.functional.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)), x)
        opt.step()
        opt.zero_grad()
    eps = engine.get_epsilon(1e-5)
    assert isinstance(eps, ApproximateEpsilon) and eps.is_approximate
    assert "approximate" in str(eps) and "Approximate" in repr(eps)
    from dptorch.accountants import RDPAccountant

    ref = RDPAccountant()
    for _ in range(10):
        ref.step(noise_multiplier=1.0, sample_rate=0.05)
    assert float(eps) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    assert 0 < float(eps) < 10
    assert engine.get_privacy_spent(1e-5)[1] == 1e-5


def test_engine_argument_errors():
    model = _small_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    make = ImmediateSensitivityPrivacyEngine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximateDPWarning)
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="noise_multiplier"):
                make(model, opt, noise_multiplier=bad, sample_rate=0.1)
        for bad in (0.0, 1.5, -0.1):
            with pytest.raises(ValueError, match="sample_rate"):
                make(model, opt, noise_multiplier=1.0, sample_rate=bad)
        with pytest.raises(ValueError, match="sample_rate=... or data_loader"):
            make(model, opt, noise_multiplier=1.0)
        with pytest.raises(ValueError, match="per_param"):
            make(model, opt, noise_multiplier=1.0, sample_rate=0.1, beta=1.0)
        with pytest.raises(ValueError, match="scaling_vec has 2"):
            make(model, opt, noise_multiplier=1.0, sample_rate=0.1, scaling_vec=[1.0, 2.0])
        with pytest.raises(ValueError, match="scaling_vec entry"):
            make(model, opt, noise_multiplier=1.0, sample_rate=0.1, scaling_vec=[1.0, 0.0, 1.0, 1.0])
        engine = make(model, opt, noise_multiplier=1.0, sample_rate=0.1)
    x = torch.randn(2, 3, dtype=F64)
    loss = nn.functional.cross_entropy(model(x), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="requires_grad_"):
        engine.backward(loss, x)
    with pytest.raises(RuntimeError, match="without a backward pass through the engine"):
        opt.step()
    with pytest.raises(ValueError, match="delta"):
        engine.get_epsilon(1.5)


def test_sample_rate_from_data_loader():
    model = _small_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Loader:  # a DPDataLoader-like object
        sample_rate = 0.02

    engine = _quiet_engine(ImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=1.0, data_loader=Loader())
    assert engine.sample_rate == 0.02
    engine.detach()
    plain = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(50, 3)), batch_size=5)
    engine = _quiet_engine(ImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=1.0, data_loader=plain)
    assert engine.sample_rate == pytest.approx(0.1)


# ------------------------------------------------------------------------------ global variants
def test_global_l2_constant_for_bias_free_linear_model_and_device():
    torch.manual_seed(0)
    model = nn.Linear(6, 4, bias=False).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = _quiet_engine(
        GlobalImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=0.8,
        sample_rate=0.1, input_shape=(6,), expected_batch_size=10,
        generator=torch.Generator().manual_seed(1),
    )
    # ‖∂(Σ Wx)/∂W‖ = √4 ‖x‖ and its x-gradient has norm √4 for every x ≠ 0
    values = engine.check_constant(trials=4)
    np.testing.assert_allclose(values, 2.0, rtol=1e-10)
    assert engine.sensitivity_at() == pytest.approx(2.0, rel=1e-12)
    assert engine._reference_tensor().dtype == F64
    assert engine._reference_tensor().device == model.weight.device
    x, y = torch.randn(10, 6, dtype=F64), torch.randint(0, 4, (10,))
    z = []
    for _ in range(20):
        engine.backward(nn.functional.cross_entropy(model(x), y))
        clean = model.weight.grad.clone()
        assert engine.noise_std() == pytest.approx(0.8 * 2.0 / 10)
        opt.step()
        z.append(((model.weight.grad - clean) / engine.noise_multiplier / 2.0 * 10).flatten())
        opt.zero_grad()
    z = torch.cat(z)
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * z.numel())


def test_global_l1_constant_with_bias():
    torch.manual_seed(0)
    model = nn.Linear(5, 3).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = _quiet_engine(
        GlobalImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=1.0,
        sample_rate=0.1, input_shape=(5,), norm="l1", loss_reduction="sum",
    )
    # ‖∂/∂W‖₁ = 3 ‖x‖₁ (+ const from the bias); its x-gradient is 3·sign(x): L1 norm 3·5 = 15
    np.testing.assert_allclose(engine.check_constant(trials=3), 15.0, rtol=1e-10)


def test_global_nonconstant_raises_or_warns():
    model = _small_net(1, d_in=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kw = dict(noise_multiplier=1.0, sample_rate=0.1, input_shape=(4,), loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximateDPWarning)
        with pytest.raises(ValueError, match="input-dependent"):
            GlobalImmediateSensitivityPrivacyEngine(model, opt, **kw)
        with pytest.warns(NonConstantSensitivityWarning, match="input-dependent"):
            engine = GlobalImmediateSensitivityPrivacyEngine(model, opt, on_nonconstant="warn", **kw)
    assert engine.is_approximate
    with pytest.raises(ValueError, match="norm must be"):
        GlobalImmediateSensitivityPrivacyEngine(model, opt, norm="linf", **kw)
    with pytest.raises(ValueError, match="expected_batch_size"):
        GlobalImmediateSensitivityPrivacyEngine(
            model, opt, noise_multiplier=1.0, sample_rate=0.1, input_shape=(4,)
        )


# ------------------------------------------------------------------------------ training
def test_is_engine_trains_digits(digits):
    """Approximate DP only (see engine.guarantee): σ = 1, ~100 steps, q = 64/1500."""
    x_tr, y_tr, x_te, y_te = digits
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _quiet_engine(
        ImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=1.0,
        sample_rate=64 / 1500, generator=torch.Generator().manual_seed(0),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for idx in batches(1500, 64, g):
            xb = x_tr[idx].clone().requires_grad_(True)
            engine.backward(nn.functional.cross_entropy(model(xb), y_tr[idx]), xb)
            opt.step()
            opt.zero_grad()
    acc = accuracy(model, x_te, y_te)
    eps = engine.get_epsilon(1e-5)
    assert isinstance(eps, ApproximateEpsilon)
    assert acc > 0.6, (acc, eps)


def test_global_is_engine_trains_digits(digits):
    """Approximate DP only: bias-free linear model, L2 IS at x_ref = √10 (checked constant)."""
    x_tr, y_tr, x_te, y_te = digits
    torch.manual_seed(0)
    model = nn.Linear(64, 10, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = _quiet_engine(
        GlobalImmediateSensitivityPrivacyEngine, model, opt, noise_multiplier=1.0,
        sample_rate=64 / 1500, input_shape=(64,), expected_batch_size=64,
        generator=torch.Generator().manual_seed(0),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for idx in batches(1500, 64, g):
            engine.backward(nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]))
            opt.step()
            opt.zero_grad()
    assert engine.sensitivity_at() == pytest.approx(math.sqrt(10), rel=1e-5)
    assert accuracy(model, x_te, y_te) > 0.6
