"""Review of the tenth session: silent failures found by the adversarial review.

* Reentrant activation checkpointing around the model's *last* hooked layers: the first
  per-sample hook of the backward pass ran inside the checkpoint's own (nested) backward, so the
  pass ended with it and the layers before the checkpoint were clipped as a second pass: one
  sample released up to √2·C (hooks, functorch, bk). Now a layer call outside a forward pass of
  the model during a backward pass (a recompute, or a nested checkpoint's forward under
  no_grad inside one) opens the pass on the enclosing backward. A forward pass of the model run
  inside another backward (user code in a hook) is a pass of its own, as before (the review of
  the first fix found that it merged two such passes: 2·C).
* ``grad_sample_mode="ew"`` under non-reentrant checkpointing released wrong per-sample
  gradients (the recompute runs outside ExpandedWeights): refused.
* bk: a layer called with its input as a keyword (``layer(input=x)``) crashed with an
  ``IndexError``; it is exact now.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from tests.privacy.invariants import (
    MODES,
    dp_backward,
    dp_update,
    private_pair,
    reference_update,
    sample_loss,
)


class Siblings(nn.Module):
    """``ckpt(ckpt(a)) -> tanh -> ckpt(ckpt(o))``, every checkpoint reentrant: the outer
    recomputes run the inner checkpoints under no_grad (nothing is captured in the outermost
    backward unless the no_grad call opens the pass)."""

    def __init__(self):
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 2)
        self.checkpointed = True

    def _twice(self, f, x):
        if not self.checkpointed:
            return f(x)
        return cp.checkpoint(lambda z: cp.checkpoint(f, z, use_reentrant=True), x,
                             use_reentrant=True)

    def forward(self, x):
        return self._twice(self.o, torch.tanh(self._twice(self.a, x)))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_sibling_nested_reentrant_checkpoints_are_one_pass(mode):
    x, y = _data()
    x.requires_grad_(True)  # as with a frozen embedding: the first segment gets a backward
    torch.manual_seed(1)
    assert _outcome(Siblings().double(), mode, x, y, 0.3) == "exact"


class Tail(nn.Module):
    """``o(a(x))`` with ``o`` (or nothing but ``o``) inside a checkpoint: ``nested`` puts a
    reentrant checkpoint inside another."""

    def __init__(self, *, reentrant: bool, nested: bool = False):
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 2)
        self.reentrant, self.nested, self.checkpointed = reentrant, nested, True

    def forward(self, x):
        h = self.a(x)
        if not self.checkpointed:
            return self.o(h)
        if self.nested:
            return cp.checkpoint(
                lambda z: cp.checkpoint(self.o, z, use_reentrant=self.reentrant), h,
                use_reentrant=self.reentrant,
            )
        return cp.checkpoint(self.o, h, use_reentrant=self.reentrant)


def _outcome(model: nn.Module, mode: str, x, y, c: float) -> str:
    """"exact" (against the brute force on the model without checkpoints), or "refused"."""
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    ref = reference_update(plain, x, y, c)
    try:
        got = dp_update(model, mode, x, y, c)
    except ValueError as e:
        assert str(e)
        return "refused"
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-7, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")
    return "exact"


def _data():
    torch.manual_seed(0)
    return 3 * torch.randn(5, 4, dtype=torch.float64), 30 * torch.randn(5, 2, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_reentrant_checkpoint_around_the_last_layer_is_one_pass(mode):
    x, y = _data()
    torch.manual_seed(1)
    model = Tail(reentrant=True).double()
    assert _outcome(model, mode, x, y, 0.3) == "exact"


def test_reentrant_tail_one_sample_stays_within_c():
    """The attacker's view: one sample's released update is at most C."""
    torch.manual_seed(2)
    model = Tail(reentrant=True).double()
    x, y = 3 * torch.randn(1, 4, dtype=torch.float64), torch.full((1, 2), 30.0, dtype=torch.float64)
    for mode in ("hooks", "functorch", "bk"):
        upd = dp_update(model, mode, x, y, 0.3)
        norm = float(torch.sqrt(sum(u.pow(2).sum() for u in upd.values())))
        assert norm <= 0.3 * (1 + 1e-9), f"{mode}: one sample released {norm} > C = 0.3"


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("mode", MODES + ["ew"])
def test_checkpointed_tail_exact_or_refused(mode, nested, reentrant):
    x, y = _data()
    torch.manual_seed(1)
    outcome = _outcome(Tail(reentrant=reentrant, nested=nested).double(), mode, x, y, 0.3)
    if mode == "ew":
        assert outcome == "refused"  # ExpandedWeights cannot follow a recompute
    elif not (mode == "ghost" and reentrant):  # ghost refuses reentrant checkpointing
        assert outcome == "exact"


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _assert_released(model: nn.Module, before: dict, ref: dict) -> None:
    """The step's update of ``model`` from ``before`` is the brute-force ``ref``."""
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=1e-7, atol=1e-9,
                                   msg=lambda m, n=n: f"{n}: {m}")


def _in_another_backward(fn) -> None:
    """Runs ``fn()`` in a tensor hook of an unrelated backward pass (user code)."""
    t = torch.ones(3, requires_grad=True)
    u = t * 2

    def hook(g):
        with torch.enable_grad():
            fn()
        return g

    u.register_hook(hook)
    u.sum().backward()


@pytest.mark.parametrize("mode", MODES)
def test_dp_step_inside_another_backward_exact(mode):
    model = _mlp(0)
    x, y = _data()
    ref = reference_update(copy.deepcopy(model), x, y, 0.3)
    box: dict = {}
    _in_another_backward(lambda: box.setdefault("got", dp_update(model, mode, x, y, 0.3)))
    for n, r in ref.items():
        torch.testing.assert_close(box["got"][n], r, rtol=1e-7, atol=1e-9,
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_two_micro_batches_inside_another_backward_are_two_passes(mode):
    """Two forward and backward passes of the model (5 samples each) made inside one hook of
    another backward: the release is the 10 samples clipped one by one, not row b of each
    micro-batch summed as one sample."""
    model = _mlp(1)
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(10, 4, generator=g, dtype=torch.float64)
    y = 30 * torch.randn(10, 2, generator=g, dtype=torch.float64)
    ref = reference_update(copy.deepcopy(model), x, y, 0.3)
    opt, gsm = private_pair(model, mode, 0.3, 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()

    def two_passes():
        for part in (slice(0, 5), slice(5, 10)):
            sample_loss(gsm(x[part]), y[part]).backward()

    _in_another_backward(two_passes)
    opt.step()
    _assert_released(model, before, ref)


def test_ew_refuses_non_reentrant_checkpoint_by_name():
    x, y = _data()
    with pytest.raises(ValueError, match=r"o \(Linear\).*saved-tensor hooks"):
        dp_update(Tail(reentrant=False).double(), "ew", x, y, 0.3)


class KeywordCalls(nn.Module):
    def __init__(self, layer: nn.Module, head_in: int):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(head_in, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.layer(input=x)).flatten(1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["linear", "conv2d", "embedding"])
def test_layer_called_with_keyword_input_exact(name, mode):
    torch.manual_seed(0)
    layer, x, head_in = {
        "linear": (nn.Linear(4, 3), torch.randn(5, 4), 3),
        "conv2d": (nn.Conv2d(2, 2, 3), torch.randn(5, 2, 4, 4), 8),
        "embedding": (nn.Embedding(10, 3), torch.randint(0, 10, (5, 2)), 6),
    }[name]
    model = KeywordCalls(layer, head_in).double()
    x = x.double() if x.is_floating_point() else x
    y = torch.randn(5, 2, dtype=torch.float64)
    ref = reference_update(copy.deepcopy(model), x, y, 0.05)
    got = dp_update(model, mode, x, y, 0.05)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-7, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")


class _Views(nn.Module):
    """The reference for a model called on two views of each sample in one loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return torch.cat([self.model(x), self.model(0.5 * x)], 1)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_wrapped_model_checkpointed_whole_is_refused(mode):
    """``checkpoint(gsm, x)`` twice in one loss (two views of each sample): each recompute
    opened and closed a pass of its own, 2·C per sample (review round 4). Such a recompute runs
    the wrapped model's forward inside an autograd Function's backward, as user code training
    the model inside a custom Function's backward does (a pass of its own, review round 5):
    the two cannot be told apart, and the forward is refused."""
    model = _mlp(1)
    x, y = _data()
    opt, gsm = private_pair(model, mode, 0.3, 5)
    opt.zero_grad()
    x.requires_grad_(True)  # a reentrant checkpoint's output needs an input that does
    out = torch.cat([cp.checkpoint(gsm, x, use_reentrant=True),
                     cp.checkpoint(gsm, 0.5 * x, use_reentrant=True)], 1)
    with pytest.raises(ValueError, match="inside an autograd Function's backward"):
        sample_loss(out, torch.cat([y, y], 1)).backward()


@pytest.mark.parametrize("context", ["save_on_cpu", "saved_tensors_hooks"])
def test_whole_model_checkpoint_refused_under_saved_tensor_hooks(context):
    """The refusal above held only without saved-tensor hooks: under ``save_on_cpu`` (or any
    user's hooks) around forward and backward, each recompute opened a pass of its own again
    (review round 6: one sample 0.59 against C = 0.3). Only torch's non-reentrant recompute is
    exempt."""
    model = _mlp(1)
    x, y = _data()
    opt, gsm = private_pair(model, "hooks", 0.3, 5)
    opt.zero_grad()
    x.requires_grad_(True)
    hooks = (torch.autograd.graph.save_on_cpu() if context == "save_on_cpu"
             else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    with hooks:
        out = torch.cat([cp.checkpoint(gsm, x, use_reentrant=True),
                         cp.checkpoint(gsm, 0.5 * x, use_reentrant=True)], 1)
        with pytest.raises(ValueError, match="inside an autograd Function's backward"):
            sample_loss(out, torch.cat([y, y], 1)).backward()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_whole_model_non_reentrant_checkpoint_exact(mode):
    """torch's non-reentrant recompute is not refused: it only refills the original graph's
    saved tensors (here inside a Python Function's backward: bk's and the tanh below)."""
    model = _mlp(1)
    x, y = _data()
    ref = reference_update(copy.deepcopy(model), x, y, 0.3)
    opt, gsm = private_pair(model, mode, 0.3, 5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    dp_backward(gsm, opt, mode, cp.checkpoint(gsm, x, use_reentrant=False), y)
    opt.step()
    _assert_released(model, before, ref)


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward runs ``fn()`` (user code training a model there)."""

    @staticmethod
    def forward(ctx, t, fn):
        ctx.fn = fn
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        with torch.enable_grad():
            ctx.fn()
        return g, None


@pytest.mark.parametrize("mode", MODES)
def test_model_trained_inside_a_function_backward_is_refused(mode):
    """Two micro-batches trained inside a custom Function's backward were merged into one
    pass by review round 4's rule (row b of each clipped as one sample, 2·C)."""
    model = _mlp(0)
    x, y = _data()
    opt, gsm = private_pair(model, mode, 0.3, 5)
    opt.zero_grad()

    def two_passes():
        for part in (slice(0, 3), slice(3, 5)):
            sample_loss(gsm(x[part]), y[part]).backward()

    t = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="inside an autograd Function's backward"):
        _RunInBackward.apply(t, two_passes).sum().backward()


class _Recompute(torch.autograd.Function):
    """A third-party-style reentrant checkpoint: forward under no_grad, backward recomputes
    under enable_grad and calls ``torch.autograd.backward``."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, g)
        return None, x.grad


class _CustomCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.checkpointed = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = _Recompute.apply(self._mid, h) if self.checkpointed else self._mid(h)
        return _Recompute.apply(self.o, h) if self.checkpointed else self.o(h)

    def _mid(self, z):
        return torch.tanh(self.b(z))


@pytest.mark.parametrize("mode", MODES)
def test_third_party_reentrant_checkpoint_exact_or_refused(mode):
    """hooks, functorch, bk: exact. ghost: its norm pass ran the checkpoint's nested backward,
    which wrote raw gradients to p.grad, released with the clipped sum (review round 5: 112
    against C = 0.3 for one sample); now refused."""
    x, y = _data()
    torch.manual_seed(1)
    outcome = _outcome(_CustomCheckpointed().double(), mode, x, y, 0.3)
    assert outcome == ("refused" if mode == "ghost" else "exact")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("where", ["before the step", "after a step in the same hook"])
@pytest.mark.parametrize("mode", MODES)
def test_layer_called_in_another_backward_opens_no_pass(mode, where, grad):
    """A training-mode call of a submodule by user code in a hook of an unrelated backward (a
    monitoring call) changes nothing: the DP step is exact (review round 4: it opened an empty
    pass, which refused the next ghost step, or a pass in the enclosing backward of a step
    made in the same hook)."""
    model = _mlp(0)
    x, y = _data()
    ref = reference_update(copy.deepcopy(model), x, y, 0.3)
    opt, gsm = private_pair(model, mode, 0.3, 5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step():
        dp_backward(gsm, opt, mode, gsm(x), y)

    def peek():
        with torch.set_grad_enabled(grad):
            model[0](x)

    opt.zero_grad()
    if where == "before the step":
        _in_another_backward(peek)
        step()
    else:
        _in_another_backward(lambda: (step(), peek()))
    opt.step()
    _assert_released(model, before, ref)
