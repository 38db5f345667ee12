"""Review (session 4, commits d0003f1..HEAD): ghost's per-pass trace, the create_graph refusal,
bk's KEEP_RATIO, position_sum, DPTrainer's packing check.

Every test here is a *finding*: it fails on the code it was written against. The invariant is
the brute force (each sample alone, clipped to C, summed; ``noise_multiplier=0``) or, where
dptorch cannot be exact, a clear error. With ``noise_multiplier=0``, SGD at lr 1 and
``loss_reduction="mean"``, the parameter update is ``Σ_b clip_C(g_b) / B``, whose norm is at
most ``C`` whatever the data: an update of norm ``≫ C`` is a contribution released unclipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
C = 0.05
B = 8


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        self.h = torch.tanh(self.a(x))  # kept for the ew test (an intermediate tensor)
        return self.b(self.h)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, 4, generator=g, dtype=DT) * 10, torch.randint(0, 3, (B,), generator=g)


def _private(mode, criterion=None, model=None, **kw):
    torch.manual_seed(0)
    model = model if model is not None else _MLP().to(DT)
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    extra = {} if criterion is None else {"criterion": criterion}
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode=mode, **extra, **kw)
    crit = out[2] if len(out) == 4 else None
    return model, out[0], out[1], crit


def _released_norm(module, run) -> float:
    before = [p.detach().clone() for p in module.parameters()]
    run()
    return float(torch.sqrt(sum((b - p.detach()).pow(2).sum()
                                for b, p in zip(before, module.parameters()))))


# ---------------------------------------------------------------- 1. ghost: untraced forward pass
@pytest.mark.parametrize("how", ["eval", "disable_hooks"])
def test_ghost_untraced_forward_pass_feeding_the_dp_loss(how):
    """*Finding* (privacy leak, ghost). ``TRACE_EVERY_PASS`` traces every *training* forward
    pass, but a forward pass run with gradients on while the model is in eval mode, or with
    ``disable_hooks()``, is neither traced nor hooked. Its output can still go through the DP
    criterion and be added to the training pass's DP loss (consistency regularisation, a
    dropout-free second view, ...). The first (norm) backward pass sees only the hooked
    training pass, so the clip factors ignore the second pass; ghost's second backward pass
    then takes autograd's gradient of *every* use, so the untraced pass's gradient is released
    scaled by factors computed without it: update norm ~19 (eval and disable_hooks) for
    C = 0.05. bk refuses it (``_on_autograd_grad``); hooks/functorch/ew drop it (private).
    Fix (GradSampleModuleFastGradientClipping.forward / DPLossFastGradientClipping): when a
    forward pass runs with gradients enabled but is not hooked (eval mode, hooks disabled),
    mark its outputs (e.g. a tensor hook that raises while a DP loss's backward passes run),
    or refuse a DP loss built from them."""
    _, gm, opt, crit = _private("ghost")
    x, y = _data()

    def run():
        loss = crit(gm(x), y)
        if how == "eval":
            gm.eval()
            extra = crit(gm(x), y)
            gm.train()
        else:
            gm.disable_hooks()
            extra = crit(gm(x), y)
            gm.enable_hooks()
        (loss + 1000 * extra).backward()
        opt.step()

    try:
        norm = _released_norm(gm, run)
    except (ValueError, RuntimeError, NotImplementedError):
        return  # a clear refusal is fine
    assert norm <= C * (1 + 1e-6), f"released update norm {norm:.3g} > C = {C}"


# ---------------------------------------------------------------- 2. ghost: criterion uses a param
def test_ghost_criterion_using_a_covered_parameter():
    """*Finding* (privacy leak, ghost). The per-sample criterion is called outside the
    wrapped forward, so the use trace never sees it. A parameter that it uses *and* that a
    hooked layer call also uses passes ghost's coverage check (only parameters used by no
    hooked call are refused); its criterion-side gradient is not in the per-sample norms, yet
    the second backward pass releases it: here ``b.bias`` enters the loss as
    ``1000 * <h.detach(), b.bias>`` and the update has norm ~4.7 for C = 0.05 (hooks drops the
    term, bk refuses it). Fix (DPLossFastGradientClipping / the ghost second pass): trace the
    criterion call as the forward is traced (a parameter of the module used there is refused),
    or check in the second pass, as bk's ``_on_autograd_grad`` does, that no parameter gets a
    gradient outside its hooked calls."""
    holder = {}

    class Crit(nn.Module):
        def __init__(self, reduction="mean"):
            super().__init__()
            self.reduction = reduction

        def forward(self, logits, y):
            head = holder["head"]
            per = F.cross_entropy(logits, y, reduction="none") + 1000 * (
                logits.detach() * head.bias).sum(1)
            return {"mean": per.mean, "sum": per.sum}.get(self.reduction, lambda: per)()

    model, gm, opt, crit = _private("ghost", criterion=Crit())
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


# ---------------------------------------------------------------- 3. ew: create_graph not refused
def test_ew_create_graph_from_an_intermediate_tensor_is_refused():
    """*Finding* (silently inexact, ew). Commit 875b51a refuses a ``create_graph=True``
    backward through hooked layers "in every mode"; for ``ew`` the refusal is a hook on the
    *model's outputs* only. A gradient penalty taken from an intermediate tensor (here the
    hidden activation, ``autograd.grad((h**2).sum(), x, create_graph=True)``; in practice
    ``output_hidden_states`` of an HF model, or a forward hook) never reaches the output, so
    nothing refuses it, and ExpandedWeights' per-sample gradients then miss part of the
    penalty's gradient: with one sample, ``grad_sample[0]`` of ``a.weight`` has norm 8.7 where
    the true gradient (``p.grad``) has 16.7. The rows stay per-sample (no cross-sample leak),
    but training is silently wrong. hooks/functorch/ghost/bk refuse it. Fix
    (GradSampleModuleExpandedWeights.forward): register ``_refuse_create_graph`` on the output
    of every layer that samples parameters (a forward hook per such submodule), not only on
    the model's outputs."""
    torch.manual_seed(0)
    model = _MLP().to(DT)
    x, y = _data()
    x, y = x[:1] / 10, y[:1]
    gm, opt, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=1), noise_multiplier=0.0,
        max_grad_norm=C, grad_sample_mode="ew", loss_reduction="sum")[:3]
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
            f"{name}: |grad_sample[0]| = {float(p.grad_sample[0].norm()):.4g}, true "
            f"|grad| = {float(p.grad.norm()):.4g}")
