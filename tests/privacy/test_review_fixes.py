"""Review of the fixes of 84896fa..HEAD (truncation charged by the accountants, LayoutQueue
passes, checkpoint sampling checks, BatchMemoryManager's dropped logical batches).

The "found by review, fixed" section: bugs the review found (DDP resume seeding every rank
alike, a loaded accountant state replacing the truncation, trade-off curve and μ without
truncation, a refused make_private changing the engine, a retry refused forever, an unsound ε
at the edge of truncation); the rest: behaviour checked and found right."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine, checkpoint
from dptorch.accountants import create_accountant
from dptorch.accountants.rdp import RDPAccountant
from dptorch.accountants.truncation import Truncation, epsilon_with_truncation
from dptorch.batch_memory_manager import BatchMemoryManager
from dptorch.sampling import choose_max_batch_size
from dptorch.utils.uniform_sampler import DistributedUniformWithReplacementSampler

N, D, K = 60, 5, 3
FIXED = dict(poisson_sampling="fixed_shape", max_batch_size=20)
USER = dict(privacy_unit="user", user_id=torch.arange(N) % 20, max_records_per_user=3)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _data(n=N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, K))


def _private(engine=None, model=None, num_workers=0, **kw):
    engine = engine or PrivacyEngine(accountant="rdp")
    model = model or _model()
    module, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=12, num_workers=num_workers),
        noise_multiplier=1.0, max_grad_norm=1.0, **kw)
    return engine, module, opt, dl


def _step(module, opt, x, y):
    nn.functional.cross_entropy(module(x), y).backward()
    opt.step()
    opt.zero_grad()


def _cycled(dl, n: int):
    """``n`` batches of ``dl`` as a step-based loop draws them: ``next`` on one iterator, a new
    pass whenever one ends."""
    it = iter(dl)
    for _ in range(n):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(dl)
            batch = next(it)
        yield batch


def _pair(mech, per_step=1e-10):
    """The same run twice: with fixed-shape truncation (M for ``per_step``) and without."""
    a, b = create_accountant(mech), create_accountant(mech)
    for acc in (a, b):
        acc.history = [(1.0, 0.01, 1000)]
    a.truncation = Truncation(10000, choose_max_batch_size(10000, 0.01, per_step))
    return a, b


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_full_backward_hooks", {})) for m in model.modules())


# ================================================ found by review, fixed
def test_ddp_resume_from_rank0_file_keeps_rank_streams_independent():
    def sampler(rank):
        return DistributedUniformWithReplacementSampler(
            total_size=200, sample_rate=0.2, num_replicas=2, rank=rank, steps=100,
            generator=torch.Generator().manual_seed(5))

    ds = TensorDataset(torch.randn(200, 1))
    s0 = sampler(0)
    it = iter(s0)
    [next(it) for _ in range(3)]
    buf = io.BytesIO()
    checkpoint.save_checkpoint(path=buf, module=nn.Linear(1, 1), accountant=create_accountant("rdp"),
                               data_loader=DataLoader(ds, batch_sampler=s0))
    resumed = []
    for rank in (0, 1):
        s = sampler(rank)
        buf.seek(0)
        checkpoint.load_checkpoint(path=buf, module=nn.Linear(1, 1),
                                   accountant=create_accountant("rdp"),
                                   data_loader=DataLoader(ds, batch_sampler=s))
        resumed.append([s.sample_mask() for _ in range(5)])
    assert not all(torch.equal(a, b) for a, b in zip(*resumed))


def test_accountant_load_state_dict_keeps_or_refuses_other_truncation():
    engine, *_ = _private(poisson_sampling="fixed_shape", max_batch_size=13)
    other = create_accountant("rdp")
    other.history = [(1.0, 1 / 5, 5)]
    other.truncation = Truncation(N, 40)
    try:
        engine.accountant.load_state_dict(other.state_dict())
    except ValueError:
        return
    assert engine.accountant.truncation == Truncation(N, 13)


@pytest.mark.parametrize("mech", ["rdp", "prv", "pld", "gdp"])
def test_tradeoff_curve_includes_truncation(mech):
    a, b = _pair(mech)
    tau = a.truncation_tau()
    alpha = np.array([1e-3, 0.1])
    bound = np.maximum(b.get_tradeoff_curve(alpha + tau) - tau, 0.0)
    assert np.all(a.get_tradeoff_curve(alpha) <= bound + 1e-12)


@pytest.mark.parametrize("mech", ["rdp", "prv", "gdp"])
def test_mu_includes_truncation(mech):
    a, b = _pair(mech)
    assert a.get_mu() > b.get_mu()


def test_refused_make_private_changes_nothing():
    engine, module, opt, dl = _private(**FIXED)
    x, y = next(iter(dl))
    for x, y in dl:
        _step(module, opt, x, y)
        break
    ctx = engine._sampling_context()
    model2 = _model()
    before = _hooks(model2)
    with pytest.raises(ValueError, match="truncation"):
        _private(engine, model2, poisson_sampling="fixed_shape", max_batch_size=30)
    assert engine._sampling_context() == ctx and _hooks(model2) == before


def test_retry_after_interrupt_with_kept_traceback():
    engine, module, opt, dl = _private(**FIXED)
    kept = None

    def train(interrupt):
        batches = _cycled(dl, 3)  # a local: a kept traceback keeps the pass alive
        for x, y in batches:
            _step(module, opt, x, y)
            if interrupt:
                raise KeyboardInterrupt

    ok = False
    for attempt in range(3):
        opt.zero_grad()
        try:
            train(attempt == 0)
            ok = True
            break
        except (KeyboardInterrupt, ValueError) as e:
            kept = e  # what IPython keeps as sys.last_value / last_traceback
    assert ok, kept


def test_epsilon_with_truncation_never_returns_an_unsound_epsilon():
    tau = 1e-7

    def eps_at(d):
        return 0.3 * math.sqrt(2 * math.log(1 / d)) + 0.2

    def converges(d):
        eps = 0.0
        for _ in range(20000):
            rest = d - (1 + math.exp(eps)) * tau
            if rest <= 0:
                return False
            nxt = eps_at(rest)
            if nxt <= eps:
                return True
            eps = nxt + 1e-9
        return False

    lo, hi = 1e-7, 1e-3
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if converges(mid) else (mid, hi)
    for d in (hi * (1 + 1e-4), hi * (1 + 1e-6)):
        try:
            eps = epsilon_with_truncation(eps_at, d, tau)
        except ValueError:
            continue
        rest = d - (1 + math.exp(eps)) * tau
        assert rest > 0 and eps_at(rest) <= eps


# ============================================================================ verified
@pytest.mark.parametrize("mech", ["rdp", "prv", "gdp"])
def test_truncated_epsilon_is_a_fixed_point_any_call_form(mech):
    a, b = _pair(mech)
    tau, delta = a.truncation_tau(), 1e-5
    assert tau > 1e-8
    eps = a.get_epsilon(delta)
    assert eps == a.get_epsilon(delta=delta)
    assert b.get_epsilon(delta - (1 + math.exp(eps)) * tau) <= eps + 1e-9
    assert eps > b.get_epsilon(delta)
    d = a.get_delta(epsilon=2.0)
    assert d == pytest.approx(b.get_delta(2.0) + (1 + math.exp(2.0)) * tau)
    assert not getattr(a, "_in_truncation", False)


def test_rdp_privacy_spent_and_subclass_super_pay_once():
    a, _ = _pair("rdp")

    class Mine(RDPAccountant):
        def get_epsilon(self, delta, *args, **kwargs):
            return super().get_epsilon(delta, *args, **kwargs)

    m = Mine()
    m.history, m.truncation = a.history, a.truncation
    eps = a.get_epsilon(1e-5)
    assert m.get_epsilon(1e-5) == eps
    assert a.get_privacy_spent(delta=1e-5)[0] == eps
    with pytest.raises(ValueError, match="Truncating"):
        a.get_epsilon(1e-9)  # truncation alone spends it
    assert not a._in_truncation and a.get_epsilon(1e-5) == eps


def test_make_private_with_epsilon_counts_truncation_once():
    model = _model()
    engine = PrivacyEngine(accountant="rdp")
    _, opt, dl = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(600), batch_size=20), target_epsilon=2.0,
        target_delta=1e-3, epochs=3, max_grad_norm=1.0, poisson_sampling="fixed_shape",
        max_batch_size=44)
    for _ in range(3 * len(dl)):
        engine.accountant.step(noise_multiplier=opt.noise_multiplier, sample_rate=1 / len(dl))
    eps = engine.get_epsilon(1e-3)
    assert engine.accountant.truncation_tau() > 1e-5
    assert 2.0 - 0.01 < eps <= 2.0
    assert eps == engine.accountant.get_epsilon(1e-3)


def test_states_without_truncation_keep_the_engines():
    engine, *_ = _private(**FIXED)
    src = create_accountant("rdp")
    src.history = [(1.0, 1 / 5, 5)]
    old = dict(src.state_dict())
    del old["truncation"]
    for state in (old, {"history": [(1.0, 1 / 5, 5)], "mechanism": "rdp"}):
        engine.accountant.load_state_dict(state)
        assert engine.accountant.truncation == Truncation(N, 20)
        assert engine.accountant.truncation_tau() > 0


@pytest.mark.parametrize("sampling", ["fixed", "user"])
@pytest.mark.parametrize("loop", ["epochs_break", "workers", "bmm_break", "peek", "step_based"])
def test_ordinary_layout_loops_are_not_refused(sampling, loop):
    kw = FIXED if sampling == "fixed" else USER
    engine, module, opt, dl = _private(num_workers=2 if loop == "workers" else 0, **kw)
    if loop in ("epochs_break", "workers"):
        for epoch in range(2):
            for i, (x, y) in enumerate(dl):
                _step(module, opt, x, y)
                if epoch == 0 and i == 1:
                    break
    elif loop == "bmm_break":
        for epoch in range(2):
            with BatchMemoryManager(data_loader=dl, max_physical_batch_size=6,
                                    optimizer=opt) as mdl:
                for i, (x, y) in enumerate(mdl):
                    _step(module, opt, x, y)
                    if epoch == 0 and i == 2:
                        break
        assert not opt.last_step_skipped
    elif loop == "peek":
        next(iter(dl))
        for x, y in dl:
            _step(module, opt, x, y)
    else:
        for x, y in _cycled(dl, 8):
            _step(module, opt, x, y)
    assert len(engine.accountant) > 0
