"""Review of 26214c7 (ghost: unhooked-call guard and criterion parameter guard; ew: create_graph
refusal on every unit's output).

Every test here is a *finding*: it fails on the code it was written against. Invariant: with
``noise_multiplier=0``, SGD at lr 1 and ``loss_reduction="mean"``, the update is
``Σ_b clip_C(g_b) / B`` (the brute force: each sample alone, clipped, summed), whose norm is at
most ``C``; an update of norm ``≫ C`` is a contribution released unclipped. A clear refusal is
accepted wherever the tests say so; a refusal of code that cannot leak is a bug.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine

from .test_review_s4_changes import _MLP, DT, B, C, _data, _private, _released_norm

pytestmark = pytest.mark.filterwarnings("ignore")



def _ghost(criterion=None, model=None):
    return _private("ghost", criterion, model=model)


def _brute_norm(model) -> float:
    """Norm of Σ_b clip_C(g_b) / B, one sample at a time (float64)."""
    x, y = _data()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(B):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        g = [p.grad.clone() for p in model.parameters()]
        c = min(1.0, C / (float(torch.sqrt(sum((t ** 2).sum() for t in g))) + 1e-6))
        total = [a + c * t for a, t in zip(total, g)]
    return float(torch.sqrt(sum((t ** 2).sum() for t in total))) / B


# ------------------------------------------------------------ 1. ghost: a term built outside
def test_ghost_parameter_term_built_outside_model_and_criterion():
    """*Finding* (privacy leak, ghost). 26214c7 guards two routes by which a parameter reaches
    the DP loss without a per-sample hook: an unhooked call of a sampled layer (eval mode,
    hooks off) and a parameter used *inside* the criterion. The same term computed one line
    earlier, in the training loop, is guarded by neither: here
    ``crit(F.linear(z, model.b.weight, model.b.bias), y)`` (z independent of the model) is
    added to the DP loss; the norm pass ignores it, ghost's second backward pass releases its
    gradient: update norm ~17.5 for C = 0.05 (bk refuses such a gradient in
    ``_on_autograd_grad``). Suggested fix (DPTensorFastGradientClipping.backward): before the
    second pass, walk ``weighted.grad_fn``'s graph and refuse if the AccumulateGrad node of a
    trainable parameter is reachable without going through a hooked call's output node (the
    edges kept in ``_outputs``); this covers every route (eval calls, hooks off, a
    criterion, user code, a non-sampled module using a sampled parameter) with one check."""
    model, gm, opt, crit = _ghost()
    x, y = _data()
    z = torch.ones(B, 8, dtype=DT)

    def run():
        extra = crit(F.linear(z, model.b.weight, model.b.bias), y)
        (crit(gm(x), y) + 1000 * extra).backward()
        opt.step()

    try:
        norm = _released_norm(gm, run)
    except (ValueError, RuntimeError, NotImplementedError):
        return  # a clear refusal is fine
    assert norm <= C * (1 + 1e-6), f"released update norm {norm:.3g} > C = {C}"


# ------------------------------------------------------------ 2. ghost: criterion guard bypass
def test_ghost_criterion_parameter_inside_a_list_argument():
    """*Finding* (privacy leak, ghost). ``_NoParameterUse`` looks for parameters with
    ``tensors_in((args, kwargs), 2)``, i.e. only among a function's *direct* tensor
    arguments: a parameter inside a list argument (``torch.stack``, ``torch.cat``,
    ``torch.block_diag``, ``torch.linalg.multi_dot``, ...) passes unseen. Here the criterion
    adds ``1000 * <logits.detach(), torch.stack([head.bias] * B)>`` per sample: update norm
    ~4.7 for C = 0.05 (the exact leak test_review_s4_changes.py::
    test_ghost_criterion_using_a_covered_parameter refuses when written with ``*``).
    Suggested fix (fast_clipping_loss._NoParameterUse): search the arguments at full depth
    (``tensors_in(..., depth=4)`` or ``torch.utils._pytree.tree_leaves``), or better the
    graph check of the first test, which does not depend on how the term was written."""
    holder = {}

    class Crit(nn.Module):
        def __init__(self, reduction="mean"):
            super().__init__()
            self.reduction = reduction

        def forward(self, logits, y):
            bias = torch.stack([holder["head"].bias] * logits.shape[0])
            per = F.cross_entropy(logits, y, reduction="none") + 1000 * (
                logits.detach() * bias).sum(1)
            return {"mean": per.mean, "sum": per.sum}.get(self.reduction, lambda: per)()

    model, gm, opt, crit = _ghost(criterion=Crit())
    holder["head"] = model.b
    x, y = _data()

    def run():
        crit(gm(x), y).backward()
        opt.step()

    try:
        norm = _released_norm(gm, run)
    except (ValueError, RuntimeError, NotImplementedError):
        return
    assert norm <= C * (1 + 1e-6), f"released update norm {norm:.3g} > C = {C}"


# ------------------------------------------------------------ 3. ghost: false refusal
def test_ghost_criterion_reading_a_parameters_device_is_not_refused():
    """*Finding* (false refusal, ghost). ``_NoParameterUse`` refuses *any* torch function
    whose arguments hold a parameter, including attribute getters that produce no tensor and
    no gradient: a criterion that places its targets with ``next(model.parameters()).device``
    (the pattern of Hugging Face's ``model.device``) is refused with "The criterion uses the
    model's parameter _module.a.weight (__get__)", although nothing of the parameter enters
    the loss. The update must equal the brute force. Suggested fix: refuse only where the
    function's result is a tensor that requires grad (``torch.is_grad_enabled()`` and a
    parameter with ``requires_grad`` among the inputs), letting ``.device``, ``.dtype``,
    ``.shape``, ``.detach()`` and ``torch.no_grad()`` uses through."""
    torch.manual_seed(0)
    model = _MLP().to(DT)
    ref = _MLP().to(DT)
    ref.load_state_dict(model.state_dict())

    class DevCE(nn.Module):
        def __init__(self, m, reduction="mean"):
            super().__init__()
            self.reduction = reduction
            self.m = [m]  # not a submodule

        def forward(self, logits, y):
            dev = next(self.m[0].parameters()).device
            return F.cross_entropy(logits, y.to(dev), reduction=self.reduction)

    _, gm, opt, crit = _ghost(criterion=DevCE(model), model=model)
    x, y = _data()

    def run():
        crit(gm(x), y).backward()
        opt.step()

    norm = _released_norm(gm, run)
    assert abs(norm - _brute_norm(ref)) <= 1e-9


# ------------------------------------------------------------ 4. ew: tuple-output unit
def test_ew_create_graph_from_a_tuple_output_unit_is_refused():
    """*Finding* (silently inexact, ew). 26214c7 registers ``_refuse_create_graph`` on every
    trainable unit's output, but ``_on_unit_forward`` only does so when the output *is* a
    tensor (``out = output if isinstance(output, torch.Tensor) else None``). A custom layer
    with its own parameter that returns a tuple ``(h, aux)`` (accepted by ew) gets no hook: a
    gradient penalty ``autograd.grad((h**2).sum(), x, create_graph=True)`` is not refused and
    ``grad_sample[0]`` of its weight differs from the true one-sample gradient by 76 (norm
    172). Suggested fix (GradSampleModuleExpandedWeights._on_unit_forward): register the
    refusal on every tensor of the output that requires grad (``tensors_in(output)``), as
    ``forward`` does for the model's outputs."""

    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 4, dtype=DT) * 0.3)

        def forward(self, x):
            h = F.linear(x, self.weight)
            return h, h.detach().norm(dim=1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = Proj()
            self.b = nn.Linear(8, 3)

        def forward(self, x):
            self.h, _ = self.p(x)
            return self.b(torch.tanh(self.h))

    torch.manual_seed(0)
    model = M().to(DT)
    x, y = _data()
    x, y = x[:1] / 10, y[:1]
    gm = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=1), noise_multiplier=0.0,
        max_grad_norm=C, grad_sample_mode="ew", loss_reduction="sum")[0]
    xx = x.clone().requires_grad_()
    try:
        out = gm(xx)
        g, = torch.autograd.grad((model.h ** 2).sum(), xx, create_graph=True)
        (F.cross_entropy(out, y, reduction="sum") + (g ** 2).sum()).backward()
    except (ValueError, RuntimeError, NotImplementedError):
        return
    for name, p in model.named_parameters():
        err = float((p.grad_sample[0] - p.grad).norm())
        assert err <= 1e-9 * (1 + float(p.grad.norm())), (
            f"{name}: |grad_sample[0] - grad| = {err:.4g}, |grad| = {float(p.grad.norm()):.4g}")
