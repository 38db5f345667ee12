"""Manual stages (auto_clip_and_accum_on_step=False): order, equivalence, errors."""

from __future__ import annotations

import pytest
import torch
from mp_helpers import IN_DIM, make_disc, make_optimizer, run_passes

from dptorch import GradSampleModule


def _passes(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (3 * torch.randn(b, IN_DIM, generator=gen, dtype=torch.float64), (-1.0) ** i)
        for i, b in enumerate(sizes)
    ]


def _setup(manual: bool, accum: bool, **gsm_kw):
    model = make_disc()
    gsm = GradSampleModule(model, loss_reduction="sum", **gsm_kw)
    kw = {}
    if gsm_kw.get("multi_pass"):
        kw = {"accum_passes": True} if accum else {"accum_passes": False, "num_private_passes": 2}
    opt = make_optimizer(
        gsm,
        max_grad_norm=0.5,
        noise_multiplier=1.3,
        generator=torch.Generator().manual_seed(7),
        auto_clip_and_accum_on_step=not manual,
        **kw,
    )
    return model, gsm, opt


@pytest.mark.parametrize("accum", [True, False], ids=["accum", "split"])
@pytest.mark.parametrize("fold", [False, True])
def test_manual_stages_equal_auto_step(accum, fold):
    grads = []
    for manual in (False, True):
        model, gsm, opt = _setup(manual, accum, multi_pass=True)
        run_passes(gsm, _passes((4, 4)))
        if manual:
            opt.clip()
            if fold:
                opt.accum_grads_across_passes()
                assert model[0].weight.grad_sample.shape[0] == 1
            opt.accumulate_batch()
        opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_manual_path_keeps_accumulated_list_layout():
    """Two backward passes in single-pass mode (accumulation allowed) make a list; the manual
    path must keep it, so accumulated_iterations (and the "mean" scaling) stay right."""
    grads = []
    for manual in (False, True):
        model, gsm, opt = _setup(manual, accum=False)
        run_passes(gsm, _passes((3, 2)))
        assert isinstance(model[0].weight.grad_sample, list)
        if manual:
            opt.clip()
            assert isinstance(model[0].weight.grad_sample, list)
            assert [g.shape[0] for g in model[0].weight.grad_sample] == [3, 2]
            opt.accumulate_batch()
        assert opt.accumulated_iterations == 2
        opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_term_added_between_stages_reaches_the_gradient():
    model, gsm, opt = _setup(True, True, multi_pass=True)
    opt.noise_multiplier = 0.0
    run_passes(gsm, _passes((3, 3)))
    opt.clip()
    clipped = [p.grad_sample.sum((0, 1)).clone() for p in model.parameters()]
    w = model[0].weight
    w.grad_sample = w.grad_sample * 0.5  # stays within the bound
    opt.accumulate_batch()
    extra = torch.full_like(w, 0.25)
    w.summed_grad = w.summed_grad + extra  # a data-independent term
    opt.step()
    torch.testing.assert_close(w.grad, 0.5 * clipped[0] + extra)
    torch.testing.assert_close(model[2].weight.grad, clipped[2])


def test_edit_exceeding_the_bound_is_refused():
    model, gsm, opt = _setup(True, False, multi_pass=True)
    run_passes(gsm, _passes((3, 3)))
    opt.clip()
    model[0].weight.grad_sample = model[0].weight.grad_sample * 10
    with pytest.raises(ValueError, match="changed after clip"):
        opt.accumulate_batch()


def test_out_of_order_calls_raise():
    model, gsm, opt = _setup(True, True, multi_pass=True)
    run_passes(gsm, _passes((3, 3)))
    with pytest.raises(RuntimeError, match="must follow clip"):
        opt.accumulate_batch()
    with pytest.raises(RuntimeError, match="after clip"):
        opt.accum_grads_across_passes()
    with pytest.raises(RuntimeError, match="auto_clip_and_accum_on_step=False"):
        opt.step()
    opt.clip()
    with pytest.raises(RuntimeError, match="already called"):
        opt.clip()
    with pytest.raises(RuntimeError, match="auto_clip_and_accum_on_step=False"):
        opt.step()
    opt.accumulate_batch()
    with pytest.raises(RuntimeError, match="already called"):
        opt.accumulate_batch()
    with pytest.raises(RuntimeError, match="once, after clip"):
        opt.accum_grads_across_passes()
    opt.step()
    opt.zero_grad()
    run_passes(gsm, _passes((2,)))
    opt.clip()  # a new step starts over
    opt.accumulate_batch()
    opt.step()


def test_manual_stage_refused_in_auto_mode():
    model, gsm, opt = _setup(False, True, multi_pass=True)
    run_passes(gsm, _passes((3,)))
    with pytest.raises(RuntimeError, match="manual stage"):
        opt.clip()


def test_backward_between_clip_and_step_is_refused():
    model, gsm, opt = _setup(True, False, multi_pass=True)
    run_passes(gsm, _passes((3, 3)))
    opt.clip()
    with pytest.raises(RuntimeError, match="after optimizer.clip"):
        run_passes(gsm, _passes((3,), seed=1))
    # an auxiliary pass with the backward hooks off is fine and records nothing
    opt.zero_grad()
    run_passes(gsm, _passes((3, 3)))
    opt.clip()
    gsm.disable_backward_hooks()
    run_passes(gsm, _passes((3,), seed=1))
    gsm.enable_backward_hooks()
    assert model[0].weight.grad_sample.shape[0] == 2
    opt.accumulate_batch()
    opt.step()


def test_step_without_zero_grad_then_new_pass_is_refused():
    model, gsm, opt = _setup(False, True, multi_pass=True)
    run_passes(gsm, _passes((3,)))
    opt.step()
    run_passes(gsm, _passes((3,), seed=1))  # forgot zero_grad: old pass would be reused
    with pytest.raises(ValueError, match="haven't been cleared"):
        opt.step()
