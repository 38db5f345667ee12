"""Clipping in both multi-pass modes against an independent reference, and argument errors."""

from __future__ import annotations

import pytest
import torch
from mp_helpers import IN_DIM, make_disc, make_optimizer, reference_sum, run_passes

from dptorch import GradSampleModule
from dptorch.optimizers.multi_pass import validate_multi_pass_args


def _passes(sizes, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    signs = [1.0, -1.0, 0.7]
    return [
        (scale * torch.randn(b, IN_DIM, generator=gen, dtype=torch.float64), signs[i])
        for i, b in enumerate(sizes)
    ]


@pytest.mark.parametrize("accum", [True, False], ids=["accum", "split"])
@pytest.mark.parametrize("c", [0.05, 1.0, 100.0])
def test_summed_grad_matches_reference(accum, c):
    sizes = (5, 5, 5) if accum else (5, 3, 4)
    passes = _passes(sizes)
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    kw = {"accum_passes": True} if accum else {"accum_passes": False, "num_private_passes": 3}
    opt = make_optimizer(gsm, max_grad_norm=c, **kw)
    run_passes(gsm, passes)
    opt.clip_and_accumulate()
    ref = reference_sum(make_disc(), passes, c, accum)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.summed_grad, r, rtol=1e-9, atol=1e-12)
    total = torch.sqrt(sum(p.summed_grad.pow(2).sum() for p in model.parameters()))
    n_units = 5 if accum else sum(sizes)
    assert total <= n_units * c * (1 + 1e-9)


@pytest.mark.parametrize("accum", [True, False], ids=["accum", "split"])
def test_clipped_units_have_norm_at_most_c(accum):
    c = 0.3
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    kw = {"accum_passes": True} if accum else {"accum_passes": False, "num_private_passes": 2}
    opt = make_optimizer(gsm, max_grad_norm=c, auto_clip_and_accum_on_step=False, **kw)
    run_passes(gsm, _passes((6, 6), scale=5.0))
    opt.clip()
    gs = [p.grad_sample for p in model.parameters()]
    assert gs[0].shape[0] == (1 if accum else 2)
    norms = torch.sqrt(sum(g.flatten(2).pow(2).sum(2) for g in gs))
    assert norms.max() <= c * (1 + 1e-9)
    assert norms.min() > 0.99 * c  # large inputs: every unit was actually clipped


def test_accum_rejects_unequal_batch_sizes():
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    opt = make_optimizer(gsm, accum_passes=True)
    run_passes(gsm, _passes((5, 4)))
    with pytest.raises(ValueError, match="different batch sizes"):
        opt.step()


def test_multi_pass_grads_need_accum_passes_and_vice_versa():
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    run_passes(gsm, _passes((3, 3)))
    with pytest.raises(ValueError, match="accum_passes=None"):
        make_optimizer(gsm).step()
    model2 = make_disc()
    gsm2 = GradSampleModule(model2, loss_reduction="sum")
    run_passes(gsm2, _passes((3,)))
    with pytest.raises(ValueError, match="single-pass"):
        make_optimizer(gsm2, accum_passes=True).step()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"accum_passes": False}, "num_private_passes >= 1"),
        ({"accum_passes": False, "num_private_passes": 0}, "num_private_passes >= 1"),
        ({"accum_passes": True, "num_private_passes": 1}, "only meaningful"),
        ({"num_private_passes": 2}, "only meaningful"),
        ({"accum_passes": 1}, "True, False or None"),
        ({"accum_passes": False, "num_private_passes": 1.5}, "must be an int"),
    ],
)
def test_optimizer_rejects_inconsistent_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(GradSampleModule(make_disc()), **kw)


@pytest.mark.parametrize(
    "multi_pass, accum, k, ok",
    [
        (True, True, None, True),
        (True, False, 2, True),
        (False, None, None, True),
        (True, None, None, False),
        (False, True, None, False),
        (False, None, 1, False),
        (True, False, None, False),
        (True, True, 2, False),
    ],
)
def test_validate_multi_pass_args(multi_pass, accum, k, ok):
    if ok:
        validate_multi_pass_args(multi_pass, accum, k)
    else:
        with pytest.raises(ValueError):
            validate_multi_pass_args(multi_pass, accum, k)


def test_split_refuses_undeclared_extra_passes():
    """Two passes, noise calibrated to one: refused unless the other pass is declared public."""
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    opt = make_optimizer(gsm, accum_passes=False, num_private_passes=1)
    run_passes(gsm, _passes((3, 4)))
    with pytest.raises(ValueError, match="num_private_passes=1"):
        opt.step()


def test_split_counts_only_non_public_passes():
    real, fake = _passes((3, 4))
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    opt = make_optimizer(gsm, accum_passes=False, num_private_passes=1, max_grad_norm=0.5)
    run_passes(gsm, [real])
    with gsm.public_pass():
        run_passes(gsm, [fake])
    assert [r.public for r in gsm.record.passes] == [False, True]
    opt.clip_and_accumulate()  # accepted: one private pass
    ref = reference_sum(make_disc(), [real, fake], 0.5, False)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.summed_grad, r, rtol=1e-9, atol=1e-12)
    opt.zero_grad()
    # the declaration lasts one pass: a new step starts undeclared
    run_passes(gsm, [real, fake])
    with pytest.raises(ValueError, match="public_pass"):
        opt.clip_and_accumulate()


def test_public_pass_needs_multi_pass():
    gsm = GradSampleModule(make_disc())
    with pytest.raises(ValueError, match="multi_pass"):
        with gsm.public_pass():
            pass
