"""GradSampleModule behaviour: fallback layers, parametrizations, frozen/tied parameters,
recurrent use, empty batches, accumulation and error cases; the per-sample-gradient checker."""

from __future__ import annotations

import logging

import pytest
import torch
from gs_helpers import MODES, assert_grad_samples_match
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from dptorch.grad_sample import (
    GradSampleModule,
    GradSampleModuleExpandedWeights,
    register_grad_sampler,
)
from dptorch.grad_sample.norm_samplers import position_sum
from dptorch.grad_sample.registry import GRAD_SAMPLERS
from dptorch.utils.per_sample_gradients_utils import (
    check_per_sample_gradients_are_correct,
    compute_microbatch_grad_sample,
)

REDUCTIONS = pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
F64 = torch.float64


class ScaleShift(nn.Module):
    """A custom layer with its own parameters and a keyword argument: no grad sampler."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.shift = nn.Parameter(torch.linspace(-1, 1, d))

    def forward(self, x, power=1):
        return torch.tanh(x * self.scale) ** power + self.shift


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.custom = ScaleShift(5)
        self.out = nn.Linear(5, 3)
        self.temperature = nn.Parameter(torch.tensor(0.7))  # used directly by the root

    def forward(self, x):
        return self.out(self.custom(self.fc(x), power=2)) * self.temperature


class Symmetric(nn.Module):
    def forward(self, w):
        return (w + w.T) / 2


@REDUCTIONS
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_custom_layer_kwargs_and_root_parameter(mode, loss_reduction):
    torch.manual_seed(0)
    x = torch.randn(4, 4, dtype=F64)
    assert_grad_samples_match(Mixed().double(), (x,), mode, loss_reduction=loss_reduction)


def test_custom_layer_rejected_by_ew():
    with pytest.raises(NotImplementedError, match="ExpandedWeights"):
        assert_grad_samples_match(Mixed().double(), (torch.randn(2, 4, dtype=F64),), "ew")


@REDUCTIONS
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("kind", ["parametrize", "weight_norm"])
def test_parametrized_weights(mode, loss_reduction, kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    if kind == "parametrize":
        parametrize.register_parametrization(model[0], "weight", Symmetric())
    else:
        nn.utils.parametrizations.weight_norm(model[2])
    x = torch.randn(4, 3, dtype=F64)
    assert_grad_samples_match(model, (x,), mode, loss_reduction=loss_reduction)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_layer_gets_no_grad_sample(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    x = torch.randn(5, 3, dtype=F64)
    assert_grad_samples_match(model, (x,), mode, loss_reduction="mean")
    gsm = GradSampleModule(model) if mode != "ew" else GradSampleModuleExpandedWeights(model)
    gsm(x).sum().backward()
    assert not hasattr(model[0].weight, "grad_sample")
    assert not hasattr(model[2].bias, "grad_sample")
    assert model[2].weight.grad_sample.shape == (5, 2, 4)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 3, padding_idx=0)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


@REDUCTIONS
@pytest.mark.parametrize("mode", MODES)
def test_tied_parameters_sum_both_uses(mode, loss_reduction):
    torch.manual_seed(0)
    ids = torch.tensor([[0, 1, 2], [3, 0, 3], [5, 4, 1]])
    assert_grad_samples_match(Tied().double(), (ids,), mode, loss_reduction=loss_reduction)


class TwiceRecurrent(nn.Module):
    """The same Linear and Conv1d applied twice in one forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.cell = nn.Linear(6, 6)

    def forward(self, x):
        h = self.conv(torch.tanh(self.conv(x))).flatten(1)
        return self.cell(torch.tanh(self.cell(h)))


@REDUCTIONS
@pytest.mark.parametrize("mode", MODES)
def test_layer_called_twice(mode, loss_reduction):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=F64)
    assert_grad_samples_match(TwiceRecurrent().double(), (x,), mode, loss_reduction=loss_reduction)


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_linear_sequence_batch_second(mode, loss_reduction):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, 3, dtype=F64)  # (T, B, d)
    assert_grad_samples_match(model, (x,), mode, batch_first=False, loss_reduction=loss_reduction)


def test_empty_batch_gives_zero_size_grad_samples():
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2), nn.Flatten(), nn.Linear(16, 3), nn.LayerNorm(3)
    )
    emb = nn.Embedding(5, 2)
    gsm = GradSampleModule(nn.ModuleDict({"m": model, "e": emb}), loss_reduction="sum")
    out = gsm.m(torch.zeros(0, 1, 4, 6)).sum() + gsm.e(torch.zeros(0, 3, dtype=torch.long)).sum()
    out.backward()
    for p in gsm.parameters():
        assert p.grad_sample.shape == (0, *p.shape)
    # ExpandedWeights refuses batch_size=0; the "ew" module runs it plainly, same shapes
    ew = GradSampleModuleExpandedWeights(nn.Linear(2, 2), loss_reduction="sum")
    ew(torch.zeros(0, 2)).sum().backward()
    for p in ew.parameters():
        assert p.grad_sample.shape == (0, *p.shape)
        assert torch.equal(p.grad, torch.zeros_like(p))


def test_accumulation_makes_a_list_or_raises():
    torch.manual_seed(0)
    for cls in (GradSampleModule, GradSampleModuleExpandedWeights):
        layer = nn.Linear(2, 2).double()
        gsm = cls(layer, loss_reduction="sum")
        x1, x2 = torch.randn(3, 2, dtype=F64), torch.randn(4, 2, dtype=F64)
        gsm(x1).sum().backward()
        gsm(x2).sum().backward()
        gs = layer.weight.grad_sample
        assert isinstance(gs, list) and [g.shape[0] for g in gs] == [3, 4]
        ones = torch.ones(2, 1, dtype=F64)
        torch.testing.assert_close(gs[1], (ones * x2[:, None, :]).expand(4, 2, 2))
        gsm.zero_grad()
        gsm.forbid_grad_accumulation()
        gsm(x1).sum().backward()
        with pytest.raises(ValueError, match="accumulation is forbidden"):
            gsm(x2).sum().backward()


def test_construction_errors_name_the_problem():
    with pytest.raises(ValueError, match="loss_reduction"):
        GradSampleModule(nn.Linear(2, 2), loss_reduction="avg")
    with pytest.raises(ValueError):
        GradSampleModule("not a module")
    bn = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.BatchNorm1d(2)))
    with pytest.raises(NotImplementedError, match=r"1\.0 \(BatchNorm1d\)"):
        GradSampleModule(bn, strict=True)
    with pytest.raises(NotImplementedError, match=r"rnn \(LSTM\)"):
        GradSampleModule(nn.ModuleDict({"rnn": nn.LSTM(2, 2)}), strict=True)
    with pytest.raises(NotImplementedError, match="batch_first"):
        GradSampleModuleExpandedWeights(nn.Linear(2, 2), batch_first=False)
    with pytest.raises(NotImplementedError, match=r"0 \(LSTM\)"):
        GradSampleModuleExpandedWeights(nn.Sequential(nn.LSTM(2, 2)))


# ---------------------------------------------------------------- the per-sample-gradient checker
class Quadratic(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.3, -0.7, 1.1]))

    def forward(self, x):
        return (x * self.w) ** 2


def test_microbatch_reference_matches_brute_force():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)).double()
    x = torch.randn(4, 2, 3, dtype=F64)
    params = dict(model.named_parameters())
    for red, reduce in (("mean", torch.mean), ("sum", torch.sum)):
        got = compute_microbatch_grad_sample(x, model, loss_reduction=red)
        # Opacus's testing loss: L1 distance of the sample's outputs to 0, reduced over them
        for b in range(4):
            grads = torch.autograd.grad(reduce(model(x[b : b + 1]).abs()), list(params.values()))
            for n, g in zip(params, grads):
                torch.testing.assert_close(got[n][b], g)


def test_checker_accepts_correct_and_rejects_wrong_samplers(caplog):
    torch.manual_seed(0)
    x = torch.randn(3, 3, dtype=F64)
    model = nn.Sequential(nn.Linear(3, 3), Quadratic()).double()
    for mode in ("hooks", "functorch", "ghost", "bk"):  # ghost, bk: by per-sample norms
        for red in ("sum", "mean"):
            assert check_per_sample_gradients_are_correct(
                x, model, atol=1e-9, rtol=1e-7, loss_reduction=red, grad_sample_mode=mode
            )
    # d/dw (x w)^2 = 2 x^2 w; a sampler that forgets the factor 2 must be caught
    register_grad_sampler(Quadratic)(
        lambda layer, a, g: {layer.w: g * a[0] ** 2 * layer.w}
    )
    try:
        with caplog.at_level(logging.WARNING):
            assert not check_per_sample_gradients_are_correct(x, model, atol=1e-9, rtol=1e-7)
            assert not check_per_sample_gradients_are_correct(
                x, model, atol=1e-9, rtol=1e-7, grad_sample_mode="bk"
            )
        assert "w" in caplog.text and "per-sample norms" in caplog.text
    finally:
        del GRAD_SAMPLERS[Quadratic]


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 4), t=st.integers(1, 4), d=st.integers(1, 5))
def test_position_sum_is_the_sum_over_positions_and_a_view_for_one(b, t, d):
    """The bias norms and clipped sums of a Linear on 2-d inputs (T = 1) read the output
    gradient itself: no reduction kernel, no copy."""
    x = torch.randn(b, t, d, dtype=torch.float64)
    out = position_sum(x)
    assert out.shape == (b, d)
    torch.testing.assert_close(out, x.sum(1), rtol=1e-12, atol=1e-12)
    assert (out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == (t == 1)
