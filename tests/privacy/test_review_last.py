"""Review of 4e49289 (rank-generator re-seed on resume, truncation in the trade-off curve and
mu, LayoutQueue overlap only for an untrained live batch)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine, checkpoint
from dptorch.accountants import create_accountant
from dptorch.accountants.truncation import Truncation
from dptorch.sampling import (
    DistributedFixedShapePoissonSampler,
    FixedShapePoissonSampler,
    choose_max_batch_size,
)
from dptorch.utils.batch_layout import LayoutQueue

N, D, K = 60, 5, 3


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _private(num_workers=0, **kw):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, K))
    engine = PrivacyEngine(accountant="rdp")
    module, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=12, num_workers=num_workers),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling="fixed_shape",
        max_batch_size=20, **kw)
    return engine, module, opt, dl


def _step(module, opt, x, y):
    nn.functional.cross_entropy(module(x), y).backward()
    opt.step()
    opt.zero_grad()


# ================================================ found by review, fixed
def test_stale_pass_draw_does_not_shift_live_pass_layouts():
    """A stale pass's draw pushes its layout among the live pass's before its token is
    refused: the live pass's training reads are refused from then on (not clipped with the
    stray layout)."""
    engine, module, opt, dl = _private()
    a = iter(dl)
    x, y = next(a)
    _step(module, opt, x, y)            # pass A's batch trained
    b = iter(dl)
    x, y = next(b)                      # pass B begins while A is live: allowed
    _step(module, opt, x, y)
    with pytest.raises(ValueError):
        next(a)                         # stale: refused, after its layout was pushed
    x, y = next(b)
    with pytest.raises(ValueError, match="Two passes"):
        _step(module, opt, x, y)


def test_queue_level_stale_push_is_refused():
    q = LayoutQueue()
    for name in ("LA1", "LB1"):
        token = q.begin()
        q.push(name)
        q.activate(token)
        q.training_layout()
    a, b = token - 1, token
    q.push("LA2")                       # stale pass A draws ...
    with pytest.raises(ValueError):
        q.activate(a)                   # ... and is refused after the push
    q.push("LB2")
    q.activate(b)
    with pytest.raises(ValueError, match="Two passes"):
        q.training_layout()             # B's 2nd batch would get A's layout


# ================================================ verified behaviour
def test_reseed_distributed_fixed_shape_ranks_differ_and_secure_mode_skips():
    def s(rank, secure=False):
        return DistributedFixedShapePoissonSampler(
            max_batch_size=30, layouts=LayoutQueue(), total_size=200, sample_rate=0.2,
            num_replicas=2, rank=rank, steps=50, secure_mode=secure,
            generator=None if secure else torch.Generator().manual_seed(5))
    ds = TensorDataset(torch.randn(200, 1))
    s0 = s(0)
    buf = io.BytesIO()
    checkpoint.save_checkpoint(path=buf, module=nn.Linear(1, 1),
                               accountant=create_accountant("rdp"),
                               data_loader=DataLoader(ds, batch_sampler=s0))
    masks = []
    for rank in (0, 1):
        smp = s(rank)
        before = smp.rank_generator
        buf.seek(0)
        checkpoint.load_checkpoint(path=buf, module=nn.Linear(1, 1),
                                   accountant=create_accountant("rdp"),
                                   data_loader=DataLoader(ds, batch_sampler=smp))
        assert smp.rank_generator is not before
        masks.append([smp.sample_mask() for _ in range(5)])
    assert not all(torch.equal(a, b) for a, b in zip(*masks))
    sec = s(0, secure=True)
    buf.seek(0)
    checkpoint.load_checkpoint(path=buf, module=nn.Linear(1, 1),
                               accountant=create_accountant("rdp"),
                               data_loader=DataLoader(ds, batch_sampler=sec))
    assert sec.rank_generator is None


def test_reseed_leaves_non_distributed_sampler_resume_exact():
    ds = TensorDataset(torch.randn(100, 1))

    def s():
        return FixedShapePoissonSampler(num_samples=100, sample_rate=0.1, max_batch_size=20,
                                        layouts=LayoutQueue(),
                                        generator=torch.Generator().manual_seed(3), steps=20)
    s0 = s()
    it = iter(s0)
    [next(it) for _ in range(3)]
    buf = io.BytesIO()
    checkpoint.save_checkpoint(path=buf, module=nn.Linear(1, 1),
                               accountant=create_accountant("rdp"),
                               data_loader=DataLoader(ds, batch_sampler=s0))
    want = [next(iter(s0)) for _ in range(1)]
    s1 = s()
    buf.seek(0)
    checkpoint.load_checkpoint(path=buf, module=nn.Linear(1, 1),
                               accountant=create_accountant("rdp"),
                               data_loader=DataLoader(ds, batch_sampler=s1))
    assert [next(iter(s1))] == want


@pytest.mark.parametrize("mech", ["rdp", "prv", "pld", "gdp"])
def test_truncated_curve_and_mu_call_forms(mech):
    a = create_accountant(mech)
    a.history = [(1.0, 0.01, 1000)]
    a.truncation = Truncation(10000, choose_max_batch_size(10000, 0.01, 1e-10))
    assert a.truncation_tau() > 0
    s = a.get_tradeoff_curve(0.1)
    v = a.get_tradeoff_curve(np.array([0.1, 0.2]))
    kw = a.get_tradeoff_curve(alpha=np.array([0.1, 0.2]))
    assert np.ndim(s) == 0 and np.allclose(v, kw) and abs(float(s) - v[0]) < 1e-9
    extra = {"poisson": True} if mech == "gdp" else ({"eps_error": 0.05}
                                                       if mech in ("prv", "pld") else {})
    assert np.isfinite(a.get_mu(**extra))
    assert np.all(np.isfinite(a.get_tradeoff_curve([0.1], **extra)))


def test_gdp_get_mu_positional_argument_reaches_the_curve_under_truncation():
    a = create_accountant("gdp")
    a.history = [(1.0, 0.01, 1000)]
    a.truncation = Truncation(10000, choose_max_batch_size(10000, 0.01, 1e-10))
    assert a.get_mu(False) == a.get_mu(poisson=False) != a.get_mu()
