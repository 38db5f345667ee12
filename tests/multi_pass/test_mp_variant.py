"""How multi-pass plugs into the core: a multi-pass option gives the class's multi-pass variant
(``MultiPassDPOptimizerMixin`` first in its bases); without one the core has no multi-pass code
and refuses multi-pass per-sample gradients."""

from __future__ import annotations

import inspect

import pytest
import torch
from mp_helpers import IN_DIM, make_disc, make_optimizer, run_passes

from dptorch import GradSampleModule
from dptorch.optimizers import AdaClipDPOptimizer, DPOptimizer, DPPerLayerOptimizer
from dptorch.optimizers.multi_pass import MultiPassDPOptimizerMixin, multi_pass_variant
from dptorch.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"accum_passes": True},
        {"accum_passes": False, "num_private_passes": 2},
        {"auto_clip_and_accum_on_step": False},
    ],
    ids=["basic", "split", "manual"],
)
def test_a_multi_pass_option_builds_the_multi_pass_variant(kw):
    opt = make_optimizer(GradSampleModule(make_disc(), multi_pass=True), **kw)
    assert isinstance(opt, DPOptimizer) and isinstance(opt, MultiPassDPOptimizerMixin)
    assert type(opt) is multi_pass_variant(DPOptimizer)
    assert type(opt).__name__ == "MultiPassDPOptimizer"
    assert type(opt).__mro__[1:3] == (MultiPassDPOptimizerMixin, DPOptimizer)


def test_without_options_the_core_has_no_multi_pass_stages():
    opt = make_optimizer(GradSampleModule(make_disc()))
    assert type(opt) is DPOptimizer
    assert not hasattr(opt, "accum_passes") and not hasattr(opt, "clip")
    assert opt.noise_scale_factor == 1


def test_core_refuses_multi_pass_grad_samples():
    """Clipping (n_passes, B) units with noise sigma*C would under-noise split passes."""
    gsm = GradSampleModule(make_disc(), multi_pass=True, loss_reduction="sum")
    opt = make_optimizer(gsm)
    x = torch.randn(3, IN_DIM, dtype=torch.float64)
    run_passes(gsm, [(x, 1.0), (x, -1.0)])
    with pytest.raises(ValueError, match="pass axis"):
        opt.step()


def test_variant_of_a_subclass_keeps_its_stages():
    model = make_disc()
    n = len(list(model.parameters()))
    opt = DPPerLayerOptimizer(
        _sgd(model),
        noise_multiplier=1.0,
        max_grad_norm=[1.0] * n,
        expected_batch_size=4,
        accum_passes=False,
        num_private_passes=3,
    )
    assert isinstance(opt, DPPerLayerOptimizer) and isinstance(opt, MultiPassDPOptimizerMixin)
    assert opt.noise_scale_factor == 3
    assert opt.noise_std == pytest.approx(1.0 * (n**0.5) * 3)
    assert multi_pass_variant(DPPerLayerOptimizer) is type(opt)
    assert multi_pass_variant(type(opt)) is type(opt)


def test_adaclip_variant_keeps_its_noise_split():
    model = make_disc()
    opt = AdaClipDPOptimizer(
        _sgd(model),
        noise_multiplier=1.0,
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.1,
        unclipped_num_std=5.0,
        max_grad_norm=2.0,
        expected_batch_size=4,
        accum_passes=True,
    )
    assert isinstance(opt, AdaClipDPOptimizer) and isinstance(opt, MultiPassDPOptimizerMixin)
    assert opt.noise_std == pytest.approx(opt.gradient_noise_multiplier * 2.0)


def test_signature_still_lists_every_argument():
    names = set(inspect.signature(DPOptimizer).parameters)
    assert {"optimizer", "noise_multiplier", "max_grad_norm", "accum_passes",
            "num_private_passes", "auto_clip_and_accum_on_step"} <= names


def test_options_passed_past_the_constructor_are_refused():
    class Sub(DPOptimizer):
        def __init__(self, optimizer, **kw):
            super().__init__(optimizer, accum_passes=True, **kw)

    with pytest.raises(ValueError, match="multi-pass option"):
        Sub(_sgd(make_disc()), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)


def test_fast_clipping_refuses_the_options_itself():
    with pytest.raises(ValueError, match="fast-clipping"):
        DPOptimizerFastGradientClipping(
            _sgd(make_disc()),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=4,
            accum_passes=True,
        )



def test_adaclip_refuses_split_clipping():
    """With split clipping one record moves the unclipped count of every private pass: AdaClip's
    count noise does not cover that, so it is refused at construction."""
    m = torch.nn.Linear(2, 2)
    for extra in ({"accum_passes": False, "num_private_passes": 2},):
        with pytest.raises(ValueError, match="does not support split multi-pass"):
            AdaClipDPOptimizer(
                torch.optim.SGD(m.parameters(), lr=1.0), noise_multiplier=1.0,
                target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                min_clipbound=0.1, unclipped_num_std=5.0, max_grad_norm=1.0,
                expected_batch_size=4, **extra,
            )
