"""A model carries the per-sample hooks of at most one GradSampleModule, and a refused call
leaves it as it was.

* wrapping a model that is still wrapped (the same object, or a ``copy.deepcopy`` of a wrapped
  model, whose hooks are copies bound to a copy of the wrapper) is refused with a ``ValueError``
  naming the layer, the reason and the fix, by ``wrap_model`` and by ``make_private`` (before it
  modifies anything) — instead of running two sets of hooks whose per-sample gradients mix;
* ``to_standard_module()`` removes every hook and attribute: the model wraps again and gives
  the same per-sample gradients;
* a ``make_private`` refused for a model its mode cannot differentiate (``ew`` on an LSTM)
  leaves no hook and no attribute on the model or its parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptorch import PrivacyEngine
from dptorch.grad_sample import wrap_model
from dptorch.grad_sample.gsm_base import wrapper_hooks_in

MODES = ("hooks", "functorch", "ew", "ghost", "bk")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(1), nn.Linear(12, 3)).double()


def _wrap(model: nn.Module, mode: str):
    extra = {"max_grad_norm": 1.0} if mode in ("ghost", "bk") else {}
    return wrap_model(model, mode, batch_first=True, loss_reduction="sum", **extra)


def _norms(model: nn.Module, mode: str, x: torch.Tensor) -> torch.Tensor:
    """Per-sample gradient norms of ``sum(out²)`` computed through a fresh wrapper of ``model``
    (unwrapped afterwards)."""
    gsm = _wrap(model, mode)
    out = gsm(x).pow(2).sum()
    if mode == "ghost":
        gsm.norm_backward(out)
        norms = gsm.per_sample_gradient_norms.clone()
    elif mode == "bk":
        out.backward()
        norms = gsm.per_sample_gradient_norms.clone()
    else:
        out.backward()
        norms = torch.sqrt(sum(p.grad_sample.flatten(1).pow(2).sum(1)
                               for p in model.parameters()))
    gsm.to_standard_module()
    model.zero_grad(set_to_none=True)
    return norms


def _state(model: nn.Module) -> list:
    return [
        (n, dict(m._forward_hooks), dict(m._forward_pre_hooks), "forward" in m.__dict__)
        for n, m in model.named_modules()
    ] + [(n, sorted(vars(p)), dict(p._backward_hooks or {})) for n, p in model.named_parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_wrapping_a_wrapped_model_is_refused(mode):
    model = _model()
    gsm = _wrap(model, mode)
    assert wrapper_hooks_in(model) is not None
    for again in ("hooks", mode):
        with pytest.raises(ValueError, match=r"already carries the per-sample hooks.*"
                                             r"to_standard_module"):
            _wrap(model, again)
    with pytest.raises(ValueError, match="copy.deepcopy of a wrapped model"):
        _wrap(copy.deepcopy(model), mode)
    gsm.to_standard_module()
    assert wrapper_hooks_in(model) is None
    _wrap(model, mode).to_standard_module()  # unwrapped: wraps again


@pytest.mark.parametrize("mode", MODES)
def test_unwrapped_model_gives_the_same_per_sample_gradients(mode):
    model = _model()
    x = torch.randint(0, 10, (5, 3))
    first = _norms(model, mode, x)
    assert first.shape == (5,) and bool((first > 0).all())
    assert _state(model) == _state(_model())  # nothing left: no hook, no attribute
    torch.testing.assert_close(_norms(model, mode, x), first, rtol=1e-12, atol=0)


def test_make_private_refuses_a_wrapped_model_before_modifying_anything():
    model = _model()
    gsm = _wrap(model, "hooks")
    before = _state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randint(0, 10, (8, 3)), torch.randn(8, 3))
    with pytest.raises(ValueError, match="already carries"):
        PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, 4),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bk",
        )
    assert _state(model) == before
    # the wrapper itself is accepted: it is the model's one wrapper
    PrivacyEngine().make_private(
        module=gsm, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, 4),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks", loss_reduction="sum",
    )


def test_refused_ew_make_private_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4, batch_first=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _state(model)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2, 4))
    with pytest.raises(NotImplementedError, match=r"1 \(LSTM\).*ExpandedWeights"):
        PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, 4),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ew",
        )
    assert _state(model) == before  # no summed_grad, no hook: refused before the build
