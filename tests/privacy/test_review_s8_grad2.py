"""Review round 8, second pass (per-sample gradients).

* A second output that a layer derives from its *first* output (``(y, y.softmax(-1))``, a Linear
  subclass returning ``(y, tanh(y))``, a router's scores computed from its logits) sends every
  gradient through the first output, whose capture hook sees it: exact in every mode (it was
  refused as an escape). A second output computed from the parameters beside the first output,
  or from another view of the same base, stays refused.
* A layer without a grad sampler whose forward depends on state the recompute guard does not
  see (a counter in a dict, a numpy scalar, a plain Python schedule object, a tensor its parent
  reassigns after the call, its previous output cached on itself) was recomputed by torch.func
  with another state: ghost released up to 6x the clipping bound. The recompute is now compared
  with the forward's output and the step refused.

Every case is checked in every mode against the brute force (float64, one sample at a time).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from .invariants import MODES, assert_exact_or_refused, dp_update, reference_update

DT = torch.float64
C = 0.05


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _data(b=6, d_in=4, d_out=3, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d_in, generator=g, dtype=DT) * scale
    y = torch.randn(b, d_out, generator=g, dtype=DT)
    return x, y


# ---------------------------------------------------------------- second output from the first
class Head(nn.Module):  # no grad sampler: torch.func
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, dtype=DT))

    def forward(self, x):
        y = x @ self.w
        return y, y.softmax(-1)


class LinTanh(nn.Linear):  # a Linear subclass: Linear's grad sampler
    def forward(self, x):
        y = super().forward(x)
        return y, torch.tanh(y)


class Router(nn.Module):  # Mixtral's router: scores from the logits, normalised in place
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4, dtype=DT))

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        probs = logits.float().softmax(-1).to(DT)
        top, idx = probs.topk(2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        scores = torch.zeros_like(probs).scatter(-1, idx, top)
        return logits, scores


class UsesSecond(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        first, second = self.head(x)
        return second * 3 + first


def _uses_second(kind):
    torch.manual_seed(0)
    head = {"head": Head, "router": Router}.get(kind)
    return UsesSecond(head() if head else LinTanh(4, 3).to(DT))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["head", "linear_subclass", "router"])
def test_second_output_derived_from_the_first_is_exact(mode, kind):
    x, y = _data()
    assert assert_exact_or_refused(_uses_second(kind), mode, x, y, C, must_work=True) == "exact"


class BesideFirst(nn.Module):  # the second output uses the parameter beside the first output
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, dtype=DT))

    def forward(self, x):
        y = x @ self.w
        return y, (x @ self.w).tanh()


class OtherHalf(nn.Module):  # two chunks of one product: the hook sees the first chunk only
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6, dtype=DT))

    def forward(self, x):
        a, b = (x @ self.w).chunk(2, dim=-1)
        return a, b


class FirstModifiedAfter(nn.Module):  # derived from the first output's old value
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, dtype=DT))

    def forward(self, x):
        y = x @ self.w
        s = y.sigmoid()
        y.mul_(2.0)
        return y, s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [BesideFirst, OtherHalf, FirstModifiedAfter])
def test_second_output_not_through_the_first_stays_refused(mode, cls):
    torch.manual_seed(0)
    model = UsesSecond(cls())
    x, y = _data()
    with pytest.raises(ValueError, match="other than through its first output"):
        dp_update(model, mode, x, y, C)


# ---------------------------------------------------------------- stateful forwards (recompute)
class DictCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=DT))
        self.state = {"t": 0}

    def forward(self, x):
        self.state["t"] += 1
        return x * self.w / self.state["t"]


class NpCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=DT))
        self.t = np.int64(0)

    def forward(self, x):
        self.t += 1
        return x * self.w / float(self.t)


class _Schedule:
    def __init__(self):
        self.t = 0

    def step(self):
        self.t += 1
        return self.t


class ObjCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=DT))
        self.sched = _Schedule()

    def forward(self, x):
        return x * self.w / self.sched.step()


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=DT))
        self.temp = torch.ones((), dtype=DT)

    def forward(self, x):
        return x * self.w / self.temp


class ParentAnneals(nn.Module):  # the parent advances the child's tensor after the call
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(DT)
        self.gate = Gate()

    def forward(self, x):
        out = self.gate(self.lin(x))
        self.gate.temp = self.gate.temp + 1.0
        return out


class Cell(nn.Module):  # its previous output cached on itself, read by the next call
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=DT))
        self.prev = None

    def forward(self, x):
        gate = 1.0 if self.prev is None else 1.0 + self.prev.tanh()
        h = x * self.w * gate
        self.prev = h
        return h


class TwiceCell(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(DT)
        self.cell = Cell()

    def forward(self, x):
        self.cell.prev = None
        return self.cell(self.lin(x)) + self.cell(self.lin(x) * -2)


def _stateful(cls):
    torch.manual_seed(1)
    if cls in (ParentAnneals, TwiceCell):
        model = cls()
        model.lin.requires_grad_(False)
        return model
    model = nn.Sequential(nn.Linear(4, 3).to(DT), cls())
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [DictCounter, NpCounter, ObjCounter, ParentAnneals, TwiceCell])
@pytest.mark.parametrize("b", [1, 6])
def test_forward_state_the_recompute_does_not_reproduce_is_refused(mode, cls, b):
    x, y = _data(b, scale=3.0)
    y = y * 10
    with pytest.raises(ValueError, match="forward|read the batch"):
        dp_update(_stateful(cls), mode, x, y, C)


class Stateless(nn.Module):  # a torch.func layer with constant attributes: still exact
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=DT))
        self.config = {"scale": 2.0}
        self.table = torch.arange(3, dtype=DT)

    def forward(self, x):
        return (x * self.w * self.config["scale"] + self.table).tanh()


@pytest.mark.parametrize("mode", MODES)
def test_stateless_torch_func_layer_stays_exact(mode):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3).to(DT), Stateless(), nn.Linear(3, 3).to(DT))
    x, y = _data()
    assert assert_exact_or_refused(model, mode, x, y, C, must_work=True) == "exact"


@pytest.mark.parametrize("mode", MODES)
def test_ghost_never_releases_more_than_the_bound_with_a_stateful_layer(mode):
    """The released norm of one sample is at most C, or the step is refused."""
    x, y = _data(1)
    for cls in (DictCounter, ObjCounter, TwiceCell):
        try:
            got = dp_update(_stateful(cls), mode, x, y * 10, C)
        except ValueError:
            continue
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in got.values())))
        assert norm <= C * (1 + 1e-6)
        ref = reference_update(_stateful(cls), x, y * 10, C)
        for n, r in ref.items():
            torch.testing.assert_close(got[n], r)
