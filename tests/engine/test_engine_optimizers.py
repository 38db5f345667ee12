"""DPOptimizer, DPPerLayerOptimizer and AdaClipDPOptimizer against hand computations and
statistical references."""

import math

import numpy as np
import pytest
import torch
from engine_helpers import (
    TinyNet,
    chi2_variance_bounds,
    reference_flat_clip,
    set_grad_samples,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch import nn

from dptorch import GradSampleModule
from dptorch.optimizers import (
    AdaClipDPOptimizer,
    DPOptimizer,
    DPPerLayerOptimizer,
    get_optimizer_class,
    register_optimizer_class,
)


def _params(shapes, dtype=torch.float64):
    return [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]


# ---------------------------------------------------------------------------- clipping
@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 7),
    scale=st.floats(1e-3, 1e3),
    c=st.floats(1e-2, 10.0),
    seed=st.integers(0, 10_000),
)
def test_clip_and_accumulate_matches_reference_and_bounds_each_sample(batch, scale, c, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 2), (4,), (2, 2, 2)]
    params = _params(shapes)
    gs = [torch.randn(batch, *s, generator=g, dtype=torch.float64) * scale for s in shapes]
    set_grad_samples(params, gs)
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=c,
        expected_batch_size=batch,
    )
    factors = opt.compute_clip_factors()[0].reshape(-1).numpy()
    ref_factors, ref_sums = reference_flat_clip([x.numpy() for x in gs], c)
    np.testing.assert_allclose(factors, ref_factors, rtol=1e-12)
    # every sample's clipped contribution has norm <= C
    flat = torch.cat([x.reshape(batch, -1) for x in gs], 1)
    contrib_norms = (flat * torch.from_numpy(factors)[:, None]).norm(dim=1)
    assert (contrib_norms <= c * (1 + 1e-9)).all()
    opt.clip_and_accumulate()
    for p, ref in zip(params, ref_sums):
        np.testing.assert_allclose(p.summed_grad.numpy(), ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- σ=0, C=∞
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_zero_noise_infinite_clip_equals_non_private(opt_name):
    torch.manual_seed(0)
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    }[opt_name]
    ref = TinyNet().double()
    dp_net = TinyNet().double()
    dp_net.load_state_dict(ref.state_dict())
    ref_opt = make(ref.parameters())
    gsm = GradSampleModule(dp_net)
    dp_opt = DPOptimizer(
        make(dp_net.parameters()), noise_multiplier=0.0, max_grad_norm=math.inf,
        expected_batch_size=16,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=g)
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(gsm(x), y).backward()
        dp_opt.step()
        dp_opt.zero_grad()
    for p, q in zip(ref.parameters(), dp_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- noise
def test_noise_std_matches_sigma_c_over_batch_size():
    sigma, c, b = 1.3, 0.7, 8
    params = _params([(50, 20)])
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=sigma, max_grad_norm=c,
        expected_batch_size=b, generator=torch.Generator().manual_seed(3),
    )
    g = torch.Generator().manual_seed(4)
    diffs = []
    for _ in range(20):
        gs = torch.randn(b, 50, 20, generator=g, dtype=torch.float64) * 1e-3  # never clipped
        set_grad_samples(params, [gs])
        opt.step()
        clean = gs.sum(0) / b
        diffs.append((params[0].grad - clean).flatten())
        opt.zero_grad()
    d = torch.cat(diffs)
    target = sigma * c / b
    lo, hi = chi2_variance_bounds(d.numel())
    ratio = (d.var() / target**2).item()
    assert lo < ratio < hi, (ratio, lo, hi)
    assert abs(d.mean().item()) < 4 * target / math.sqrt(d.numel())
    # consecutive steps draw independent noise
    r = np.corrcoef(diffs[0].numpy(), diffs[1].numpy())[0, 1]
    assert abs(r) < 4 / math.sqrt(1000)


def test_zero_noise_multiplier_adds_exactly_nothing():
    params = _params([(4, 3)])
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=1e6,
        expected_batch_size=5,
    )
    gs = torch.randn(5, 4, 3, dtype=torch.float64)
    set_grad_samples(params, [gs])
    opt.step()
    assert torch.equal(params[0].grad, params[0].summed_grad / 5)  # not a single noise bit
    torch.testing.assert_close(params[0].summed_grad, gs.sum(0), rtol=1e-12, atol=1e-12)


def test_noise_is_added_in_place_to_the_clipped_sum_and_never_aliases_its_buffer():
    """The noisy gradient is the clipped sum's own storage (no parameter-sized copy per step),
    equal to clipped sum + N(0, (σC)²); a gradient kept from one step is not overwritten by
    the next step's draw (the flat noise buffer is reused, the gradients are not views of it)."""
    params = _params([(40, 25), (25,)])
    sigma, c = 0.5, 2.0
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=sigma, max_grad_norm=c,
        expected_batch_size=3, loss_reduction="sum",
        generator=torch.Generator().manual_seed(0),
    )
    kept = []
    for _ in range(2):
        gss = [1e-3 * torch.randn(3, *p.shape, dtype=torch.float64) for p in params]
        set_grad_samples(params, gss)
        opt.clip_and_accumulate()
        clean = [p.summed_grad.clone() for p in params]
        for cl, gs in zip(clean, gss):
            torch.testing.assert_close(cl, gs.sum(0))  # never clipped
        opt.add_noise()
        noise = torch.cat([(p.grad - cl).flatten() for p, cl in zip(params, clean)])
        assert all(p.grad.data_ptr() == p.summed_grad.data_ptr() for p in params)
        lo, hi = chi2_variance_bounds(noise.numel())
        assert lo < (noise.var() / (sigma * c) ** 2).item() < hi
        kept.append([(p.grad, p.grad.clone()) for p in params])
        opt.zero_grad(set_to_none=True)  # (False zeroes the held tensors, as torch does)
    for held, value in kept[0]:
        assert torch.equal(held, value)  # the second step's draw left them alone


def test_noise_generator_makes_steps_reproducible_and_secure_mode_rejects_it():
    outs = []
    for _ in range(2):
        params = _params([(10,)])
        opt = DPOptimizer(
            torch.optim.SGD(params, lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=1, generator=torch.Generator().manual_seed(7),
        )
        set_grad_samples(params, [torch.zeros(1, 10, dtype=torch.float64)])
        opt.step()
        outs.append(params[0].grad.clone())
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="secure_mode"):
        DPOptimizer(
            torch.optim.SGD(_params([(2,)]), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=1, generator=torch.Generator(), secure_mode=True,
        )


def test_secure_mode_noise_is_standard_normal():
    params = _params([(4000,)])
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=2.0, max_grad_norm=0.5,
        expected_batch_size=1, loss_reduction="sum", secure_mode=True,
    )
    set_grad_samples(params, [torch.zeros(1, 4000, dtype=torch.float64)])
    opt.step()
    z = params[0].grad.numpy() / 1.0  # σC = 1
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # and it is not reproducible: a second step gives other numbers
    first = params[0].grad.clone()
    opt.zero_grad()
    set_grad_samples(params, [torch.zeros(1, 4000, dtype=torch.float64)])
    opt.step()
    assert not torch.equal(first, params[0].grad)


# ---------------------------------------------------------------------------- wrapper behaviour
def test_behaves_like_wrapped_optimizer_and_lr_scheduler_works():
    net = TinyNet()
    base = torch.optim.Adam(net.parameters(), lr=0.1)
    opt = DPOptimizer(base, noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=4)
    assert opt.param_groups is base.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gsm = GradSampleModule(net)
    for _ in range(2):
        gsm(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    sd = opt.state_dict()
    assert sd["state"][0]["step"].item() == 2
    fresh = torch.optim.Adam(TinyNet().parameters(), lr=1.0)
    DPOptimizer(fresh, noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=4).load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.025)


def test_step_without_zero_grad_refuses_to_reuse_gradients():
    params = _params([(3,)])
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=2,
    )
    set_grad_samples(params, [torch.ones(2, 3, dtype=torch.float64)])
    opt.step()
    with pytest.raises(ValueError, match="zero_grad"):
        opt.step()


# ---------------------------------------------------------------------------- per-layer
def test_per_layer_clipping_matches_hand_computation():
    shapes = [(3, 2), (3,)]
    params = _params(shapes)
    cs = [0.5, 2.0]
    g = torch.Generator().manual_seed(0)
    gs = [torch.randn(6, *s, generator=g, dtype=torch.float64) * 3 for s in shapes]
    set_grad_samples(params, gs)
    opt = DPPerLayerOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=cs,
        expected_batch_size=6, loss_reduction="sum",
    )
    assert opt.max_grad_norm == pytest.approx(math.sqrt(0.25 + 4.0))
    opt.step()
    for p, x, c in zip(params, gs, cs):
        arr = x.numpy().reshape(6, -1)
        f = np.minimum(1.0, c / (np.linalg.norm(arr, axis=1) + 1e-6))
        np.testing.assert_allclose(p.grad.numpy(), np.tensordot(f, x.numpy(), axes=(0, 0)), rtol=1e-10)
        clipped = arr * f[:, None]
        assert (np.linalg.norm(clipped, axis=1) <= c * (1 + 1e-9)).all()


def test_per_layer_noise_is_calibrated_to_total_norm_and_rescales():
    params = _params([(2000,), (2000,)])
    opt = DPPerLayerOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=1.5, max_grad_norm=[3.0, 4.0],
        expected_batch_size=1, loss_reduction="sum", generator=torch.Generator().manual_seed(0),
    )
    assert opt.noise_std == pytest.approx(1.5 * 5.0)
    set_grad_samples(params, [torch.zeros(1, 2000, dtype=torch.float64)] * 2)
    opt.step()
    z = torch.cat([p.grad for p in params]).numpy() / 7.5
    assert stats.kstest(z, "norm").pvalue > 1e-3
    opt.max_grad_norm = 10.0  # e.g. a clip scheduler: every per-parameter norm scales
    assert opt.max_grad_norms == pytest.approx([6.0, 8.0])
    with pytest.raises(ValueError, match="one clipping norm per parameter"):
        DPPerLayerOptimizer(
            torch.optim.SGD(_params([(2,), (2,)]), lr=0.1), noise_multiplier=1.0,
            max_grad_norm=[1.0], expected_batch_size=1,
        )


# ---------------------------------------------------------------------------- AdaClip
def test_adaclip_update_matches_hand_computation():
    params = _params([(2,)])
    seed = 11
    opt = AdaClipDPOptimizer(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.01,
        unclipped_num_std=1.0, max_grad_norm=1.0, expected_batch_size=4,
        generator=torch.Generator().manual_seed(seed),
    )
    # norms 0.5, 0.9, 2, 3 -> 2 unclipped
    gs = torch.tensor([[0.5, 0.0], [0.0, 0.9], [2.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    set_grad_samples(params, [gs])
    opt.step()
    count_noise = torch.normal(
        0.0, 1.0, size=(), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    ).item()
    frac = (2 + count_noise) / 4
    expected_c = min(10.0, max(0.01, 1.0 * math.exp(-0.2 * (frac - 0.5))))
    assert opt.max_grad_norm == pytest.approx(expected_c, rel=1e-12)
    # the gradient was clipped with the old C = 1
    f = np.minimum(1.0, 1.0 / (np.array([0.5, 0.9, 2.0, 3.0]) + 1e-6))
    np.testing.assert_allclose(params[0].grad.numpy(), (f[:, None] * gs.numpy()).sum(0) / 4)
    opt.zero_grad()
    assert opt.unclipped_num == 0 and opt.sample_size == 0


def test_adaclip_gradient_noise_multiplier_and_its_limits():
    kw = dict(
        target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
        min_clipbound=0.01, max_grad_norm=2.0, expected_batch_size=4,
    )
    opt = AdaClipDPOptimizer(
        torch.optim.SGD(_params([(2,)]), lr=0.1), noise_multiplier=1.0, unclipped_num_std=2.0, **kw
    )
    sigma_grad = (1.0 - 1 / 16) ** -0.5
    assert opt.gradient_noise_multiplier == pytest.approx(sigma_grad)
    assert opt.noise_std == pytest.approx(sigma_grad * 2.0)
    # total privacy: 1/σ² = 1/σ_grad² + 1/(2 σ_count)²
    assert 1 / sigma_grad**2 + 1 / 16 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unclipped_num_std"):
        AdaClipDPOptimizer(
            torch.optim.SGD(_params([(2,)]), lr=0.1), noise_multiplier=1.0,
            unclipped_num_std=0.5, **kw,
        )
    with pytest.raises(ValueError, match="min_clipbound"):
        AdaClipDPOptimizer(
            torch.optim.SGD(_params([(2,)]), lr=0.1), noise_multiplier=1.0,
            unclipped_num_std=2.0, **{**kw, "min_clipbound": 20.0},
        )


# ---------------------------------------------------------------------------- chooser
def test_get_optimizer_class_registry():
    assert get_optimizer_class("flat", False) is DPOptimizer
    assert get_optimizer_class("flat", False, "hooks") is DPOptimizer
    assert get_optimizer_class("per_layer", False, "functorch") is DPPerLayerOptimizer
    assert get_optimizer_class("adaptive", False, "ew") is AdaClipDPOptimizer
    with pytest.raises(ValueError, match="Unsupported combination"):
        get_optimizer_class("bogus", False)
    # a norm-only mode must not silently get the generic optimizer
    with pytest.raises(ValueError):
        get_optimizer_class("flat", False, "some_norm_only_mode")

    class Custom(DPOptimizer):
        pass

    register_optimizer_class(Custom, clipping="flat", distributed=False, grad_sample_mode="custom_x")
    assert get_optimizer_class("flat", False, "custom_x") is Custom


def test_adaclip_count_sensitivity_is_one_half():
    """The released count moves by exactly 1/2 when a record is added (clipped or not), which is
    what the factor 2 in sigma_grad = (sigma^-2 - (2 unclipped_num_std)^-2)^-1/2 assumes."""
    kw = dict(
        noise_multiplier=0.0, target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
        max_clipbound=10.0, min_clipbound=0.01, unclipped_num_std=1.0, max_grad_norm=1.0,
        expected_batch_size=4,
    )
    base = torch.tensor([[0.5, 0.0], [0.0, 0.9], [2.0, 0.0]], dtype=torch.float64)
    stats = []
    for extra in (None, [[0.1, 0.1]], [[5.0, 5.0]]):  # removed / added unclipped / added clipped
        params = _params([(2,)])
        opt = AdaClipDPOptimizer(torch.optim.SGD(params, lr=0.0), **kw)
        gs = base if extra is None else torch.cat([base, torch.tensor(extra, dtype=torch.float64)])
        set_grad_samples(params, [gs])
        opt.clip_and_accumulate()
        stats.append(opt.unclipped_num)
    assert abs(stats[1] - stats[0]) == pytest.approx(0.5)
    assert abs(stats[2] - stats[0]) == pytest.approx(0.5)
