"""Ghost and bk compute per-sample norms from factors (``‖a‖·‖g‖``, Gram matrices) whose
intermediates can overflow while the per-sample gradient itself is finite: a float32 input
feature of 1e25 (``‖a‖² = inf``), or a float16 model fed raw 0..255 pixels (``‖a‖² > 65504``).
With the output gradient of that sample 0 (a saturated tanh), ``inf · 0`` made the clip factor
NaN and the whole released gradient NaN (revealing the sample); with it non-zero the factor was
0 and the sample silently dropped. Where the norm's factors are finite in float32 the released
clipped sum must equal hooks mode and the brute-force per-sample computation; where a factor's
norm overflows even there (1e25) the record is dropped (clip factor 0), never NaN; each
sample's contribution stays within C."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptorch.clipping import ClippingContract
from dptorch.grad_sample import wrap_model
from dptorch.optimizers import get_optimizer_class
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

C = 1.0
FAST = ["ghost", "bk"]


def _step(model: nn.Module, mode: str, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """One DP-SGD step (SGD lr=1, noise 0, loss sum, flat C) of a copy of ``model`` in ``mode``;
    the released update ``before - after`` per parameter, in float64."""
    model = copy.deepcopy(model)
    fast = mode in FAST
    opt = get_optimizer_class("flat", False, mode)(
        torch.optim.SGD(list(model.parameters()), lr=1.0), noise_multiplier=0.0,
        max_grad_norm=C, expected_batch_size=x.shape[0], loss_reduction="sum",
    )
    gsm = wrap_model(model, mode, batch_first=True, loss_reduction="sum",
                     **({"clipping": opt.clipping} if fast else {}))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    out = gsm(x)
    if mode == "ghost":
        DPLossFastGradientClipping(gsm, opt, nn.MSELoss(reduction="sum"), "sum")(out, y).backward()
    else:
        (out - y).pow(2).sum().backward()
    opt.step()
    return [(b - p.detach()).double() for b, p in zip(before, model.parameters())]


def _brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """``Σ_b clip(∇ loss_b)``, one sample at a time in the model's dtype, the norms and the sum
    in float64."""
    params = list(model.parameters())
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for b in range(x.shape[0]):
        loss = (model(x[b : b + 1]) - y[b : b + 1]).pow(2).sum()
        grads = [g.double() for g in torch.autograd.grad(loss, params)]
        assert all(torch.isfinite(g).all() for g in grads), "the per-sample gradient is finite"
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        f = min(1.0, C / (norm + 1e-6))
        for t, g in zip(total, grads):
            t += f * g
    return total


def _norm(ts: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(t.pow(2).sum() for t in ts)))


def _assert_released(model, x, y, mode, rtol, atol, against_hooks=True):
    got = _step(model, mode, x, y)
    assert all(torch.isfinite(g).all() for g in got), f"{mode}: the released gradient is not finite"
    for g, w in zip(got, _brute_force(model, x, y)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    if against_hooks:
        for g, h in zip(got, _step(model, "hooks", x, y)):
            torch.testing.assert_close(g, h, rtol=rtol, atol=atol)
    for b in range(x.shape[0]):  # each sample's clipped contribution alone
        n = _norm(_step(model, mode, x[b : b + 1], y[b : b + 1]))
        assert n <= C * (1 + rtol), f"{mode}: sample {b}'s contribution has norm {n} > C"


def _float32_case():
    """A float32 tanh MLP; sample 3 has a feature of 1e25: its first-layer pre-activations are
    ~1e24, tanh saturates to ±1 exactly and the first layer's output gradient is exactly 0
    (``‖a‖² = 1e50`` overflows float32), while its second-layer gradient is finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    x[3, 2] = 1e25
    return model, x, y


@pytest.mark.parametrize("mode", FAST)
def test_float32_huge_feature_with_saturated_unit(mode):
    model, x, y = _float32_case()
    # the premise: the first layer's output gradient of sample 3 is exactly 0
    h = model[0](x[3:4]).requires_grad_()
    (g,) = torch.autograd.grad((model[2](torch.tanh(h)) - y[3:4]).pow(2).sum(), h)
    assert torch.all(g == 0)
    assert torch.isinf(torch.linalg.vector_norm(x[3]))
    # its first-layer norm is inf · 0: clip factor 0, the record is dropped (never NaN, never
    # unclipped); the release is the clipped sum of the others
    got = _step(model, mode, x, y)
    keep = torch.arange(x.shape[0]) != 3
    for g_, w in zip(got, _brute_force(model, x[keep], y[keep])):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)
    assert _norm(_step(model, mode, x[3:4], y[3:4])) <= C


def _pixels(seed: int, n: int = 8, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g) * 2
    x[5] = torch.rand(d, generator=g) * 255  # one raw-pixel sample: ‖a‖² ≈ 1.4e6 > 65504
    return x


@pytest.mark.parametrize("mode", FAST)
@pytest.mark.parametrize("first_scale", [1.0, 1e-3], ids=["saturated", "unsaturated"])
def test_float16_pixels(mode, first_scale):
    """``model.half()``, one sample of raw 0..255 pixels: with the default initialisation its
    tanh units saturate (output gradient 0: was NaN), with a small first layer they do not
    (output gradient non-zero: the sample was dropped). Hooks mode is compared only in the
    first case: its optimizer squares the float16 per-sample norms in float16 (``‖G_b‖ > 256``
    is inf) and drops the unsaturated sample itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    with torch.no_grad():
        model[0].weight.mul_(first_scale)
    model = model.half()
    x = _pixels(1).half()
    y = torch.randn(8, 10, generator=torch.Generator().manual_seed(2)).half()
    _assert_released(model, x, y, mode, rtol=1e-2, atol=2e-3, against_hooks=first_scale == 1.0)


@pytest.mark.parametrize("mode", FAST)
def test_float16_sequence_gram(mode):
    """A Linear on ``(B, T, d)`` takes the Gram path (``a_t·a_s`` > 65504 for pixels)."""
    torch.manual_seed(0)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(64, 64), nn.Linear(64, 4)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x) * 1e-3)).sum(1)

    model = Seq().half()
    x = (_pixels(3, n=6 * 3).reshape(6, 3, 64)).half()
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(4)).half()
    _assert_released(model, x, y, mode, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("mode", FAST)
def test_float16_conv_pixels(mode):
    """A convolution on raw 0..255 pixels: its im2col Gram overflows float16 (not compared
    with hooks mode, which drops this sample itself, see :func:`test_float16_pixels`)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    )
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
    model = model.half()
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(4, 3, 6, 6, generator=g) * 255).half()
    y = torch.randn(4, 3, generator=g).half()
    _assert_released(model, x, y, mode, rtol=1e-2, atol=2e-3, against_hooks=False)


def test_non_finite_norm_gives_factor_zero():
    norms = torch.tensor([0.5, 4.0, float("inf"), float("nan")])
    f = ClippingContract.factors(norms, 2.0)
    assert torch.isfinite(f).all()
    torch.testing.assert_close(f, torch.tensor([1.0, 2.0 / (4.0 + 1e-6), 0.0, 0.0]))
