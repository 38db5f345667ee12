"""Privacy events: frozen data, their reduction to Gaussian phases, the accountants' event
history (with the Opacus ``history`` view on top), the optimizer's one event per step, and the
round trip of the events through a checkpoint."""

from __future__ import annotations

import dataclasses
import io
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.accountants import (
    ComposedEvent,
    FixedSizeBatchEvent,
    GaussianEvent,
    NonPrivateEvent,
    NoOpEvent,
    PLDAccountant,
    PoissonSampledEvent,
    PRVAccountant,
    RDPAccountant,
    SelfComposedEvent,
    create_accountant,
)
from dptorch.accountants.events import (
    UnsupportedEventError,
    event_from_dict,
    event_to_dict,
    gaussian_phases,
)
from dptorch.optimizers import DPOptimizer

Q = 256 / 60000


def sgm(sigma, q):
    return PoissonSampledEvent(q, GaussianEvent(sigma))


# ---------------------------------------------------------------------------- the data
def test_events_are_frozen_hashable_and_validated():
    e = sgm(1.0, 0.01)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.sampling_probability = 0.5
    assert e == sgm(1, 0.01) and hash(e) == hash(sgm(1.0, 0.01))
    assert isinstance(e.sampling_probability, float)
    for bad in (lambda: GaussianEvent(-1.0), lambda: GaussianEvent(1.0, sensitivity=0.0),
                lambda: PoissonSampledEvent(1.5, GaussianEvent(1.0)),
                lambda: PoissonSampledEvent(0.1, "gaussian"),
                lambda: SelfComposedEvent(e, -1), lambda: SelfComposedEvent(e, 1.5),
                lambda: FixedSizeBatchEvent(GaussianEvent(1.0), 0),
                lambda: GaussianEvent(float("nan"))):
        with pytest.raises(ValueError):
            bad()


def test_dict_round_trip():
    event = ComposedEvent((
        SelfComposedEvent(sgm(1.1, Q), 100),
        GaussianEvent(2.0, sensitivity=2.0),
        FixedSizeBatchEvent(GaussianEvent(3.0), steps_per_epoch=7, sample_rate=1 / 7),
        NoOpEvent(),
        NonPrivateEvent(),
    ))
    d = event_to_dict(event)
    import json
    assert event_from_dict(json.loads(json.dumps(d))) == event
    with pytest.raises(ValueError):
        event_from_dict({"type": "Laplace"})


def test_reduction_to_phases():
    # multi-pass split clipping: noise σk, sensitivity k -> effective σ
    assert gaussian_phases([PoissonSampledEvent(0.1, GaussianEvent(3.0, sensitivity=3.0))]) == [
        (1.0, 0.1, 1)]
    # composed Gaussians on one batch: 1/σ² add up
    two = PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), GaussianEvent(1.0))))
    assert gaussian_phases([two])[0][0] == pytest.approx(1 / math.sqrt(2))
    # equal consecutive steps merge, no-ops and q = 0 vanish, non-private is sigma 0
    events = [sgm(1.0, 0.1)] * 3 + [NoOpEvent(), sgm(1.0, 0.0), sgm(1.0, 0.1), NonPrivateEvent()]
    assert gaussian_phases(events) == [(1.0, 0.1, 4), (0.0, 1.0, 1)]
    # fixed-size batches: passes of m steps, each one Gaussian with the smallest sigma
    fixed = [FixedSizeBatchEvent(GaussianEvent(s), 4, 0.25) for s in [2.0] * 6 + [1.0] * 5]
    assert gaussian_phases(fixed, "replace_one") == [(2.0, 1.0, 1), (1.0, 1.0, 2)]
    # a no-op ends a pass (a new loader iterator after a checkpoint)
    assert gaussian_phases(fixed[:2] + [NoOpEvent()] + fixed[:2], "replace_one") == [
        (2.0, 1.0, 2)]
    # long merged runs: whole passes at once
    long = [SelfComposedEvent(FixedSizeBatchEvent(GaussianEvent(2.0), 100, 0.01), 10_050)]
    assert gaussian_phases(long, "replace_one") == [(2.0, 1.0, 101)]
    with pytest.raises(UnsupportedEventError, match="replace_one"):
        gaussian_phases(fixed, "add_remove")
    with pytest.raises(ValueError, match="neighboring_relation"):
        gaussian_phases(fixed, "substitute")


# ---------------------------------------------------------------------------- accountants
@pytest.mark.parametrize("name", ["rdp", "prv", "pld", "gdp"])
def test_history_view_and_events_agree(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = create_accountant(name), create_accountant(name)
    for _ in range(3):
        a.step(noise_multiplier=1.0, sample_rate=0.01)
    a.compose(sgm(2.0, 0.01), 2)
    b.compose(SelfComposedEvent(sgm(1.0, 0.01), 3)).compose(sgm(2.0, 0.01)).compose(sgm(2.0, 0.01))
    assert a.history == b.history == [(1.0, 0.01, 3), (2.0, 0.01, 2)]
    assert a.events == b.events == [SelfComposedEvent(sgm(1.0, 0.01), 3),
                                    SelfComposedEvent(sgm(2.0, 0.01), 2)]
    assert len(a) == len(b) == 5
    assert a.get_epsilon(1e-5) == b.get_epsilon(1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = create_accountant(name)
    c.history = a.history  # the Opacus setter builds the same events
    assert c.events == a.events


def test_get_epsilon_of_any_event_history():
    acc = PLDAccountant()
    acc.compose(SelfComposedEvent(sgm(1.0, 0.01), 500))
    acc.compose(ComposedEvent((GaussianEvent(20.0), SelfComposedEvent(sgm(2.0, 0.05), 100))))
    acc.compose(PoissonSampledEvent(0.01, GaussianEvent(2.0, sensitivity=2.0)), 10)  # multi-pass
    same = PLDAccountant()
    same.history = [(1.0, 0.01, 500), (20.0, 1.0, 1), (2.0, 0.05, 100), (1.0, 0.01, 10)]
    assert acc.get_epsilon(1e-6) == same.get_epsilon(1e-6)
    assert acc.get_epsilon(1e-6) > PLDAccountant().compose(sgm(1.0, 0.01), 510).get_epsilon(1e-6)
    assert math.isinf(PLDAccountant().compose(NonPrivateEvent()).get_epsilon(1e-5))
    assert PRVAccountant().compose(NoOpEvent(), 5).get_epsilon(1e-5) == 0.0


def test_state_dict_round_trip_with_events_and_relation():
    acc = PRVAccountant(neighboring_relation="replace_one")
    acc.compose(sgm(1.0, 0.02), 40).compose(FixedSizeBatchEvent(GaussianEvent(1.5), 10, 0.1), 25)
    state = acc.state_dict()
    # the fixed-size row in its plain form (built-in types, weights_only-loadable), not Poisson
    assert state["mechanism"] == "prv" and state["history"] == [
        (1.0, 0.02, 40), (1.5, 0.1, 25, {"fixed_size_batches": 10, "new_pass": True})]
    assert acc.history == [(1.0, 0.02, 40), (1.5, 0.1, 25)]  # the Opacus view unpacks as before
    other = PRVAccountant()
    other.load_state_dict(state)
    assert other.neighboring_relation == "replace_one" and other.events == acc.events
    assert other.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    # an Opacus-style state (history only) still loads
    legacy = PRVAccountant()
    legacy.load_state_dict({"history": [(1.0, 0.02, 40)], "mechanism": "prv"})
    assert legacy.events == [SelfComposedEvent(sgm(1.0, 0.02), 40)]


# ---------------------------------------------------------------------------- training
def _engine_run(accountant="prv", steps=6, poisson=True, quiet=True, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 3, (48,)))
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        model, opt, dl = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=8, **kw), noise_multiplier=1.3,
            max_grad_norm=1.0, poisson_sampling=poisson)
    done = 0
    while done < steps:
        for x, y in dl:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
    return engine, model, opt, dl


def test_optimizer_emits_one_event_per_step():
    engine, *_ = _engine_run(steps=5)
    assert engine.accountant.events == [SelfComposedEvent(sgm(1.3, 1 / 6), 5)]
    assert engine.accountant.history == [(1.3, 1 / 6, 5)]


def test_multi_pass_event_has_the_split_sensitivity():
    p = nn.Parameter(torch.zeros(3))
    opt = DPOptimizer(torch.optim.SGD([p], lr=0.1), noise_multiplier=0.7, max_grad_norm=1.0,
                      expected_batch_size=4, accum_passes=False, num_private_passes=3)
    assert opt.privacy_event(0.1) == PoissonSampledEvent(0.1, GaussianEvent(0.7 * 3, 3.0))
    assert gaussian_phases([opt.privacy_event(0.1)])[0][:2] == pytest.approx((0.7, 0.1))
    assert opt.privacy_event(0.1, steps_per_epoch=10) == FixedSizeBatchEvent(
        GaussianEvent(0.7 * 3, 3.0), 10, 0.1)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_checkpoint_round_trip_keeps_events_and_epsilon(accountant):
    engine, model, opt, dl = _engine_run(accountant, steps=7)
    eps = engine.get_epsilon(1e-5)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=model, optimizer=opt)
    buf.seek(0)
    fresh, model2, opt2, _ = _engine_run(accountant, steps=0)
    fresh.load_checkpoint(path=buf, module=model2, optimizer=opt2)
    assert fresh.accountant.events == engine.accountant.events
    assert fresh.get_epsilon(1e-5) == eps


def test_fixed_size_batches_get_a_sound_number_and_its_assumptions():
    with pytest.warns(UserWarning, match="poisson_sampling=False"):  # the make_private warning
        engine, *_ = _engine_run(steps=12, poisson=False, quiet=False, shuffle=True)
    events = engine.accountant.events
    assert events[0] == NoOpEvent()  # the hook's first step starts a pass
    assert events[1] == SelfComposedEvent(
        FixedSizeBatchEvent(GaussianEvent(1.3), steps_per_epoch=6, sample_rate=1 / 6), 12)
    assert engine.accountant.history == [(1.3, 1 / 6, 12)]  # the Opacus view is unchanged
    with pytest.warns(UserWarning, match="replace-one.*no amplification") as rec:
        eps = engine.get_epsilon(1e-5)
    msg = str(rec[0].message)
    assert "at most one optimizer step of each pass" in msg and "(6 steps)" in msg
    assert "not a guarantee" in msg
    # two passes = two Gaussian mechanisms of sensitivity 2 (replace-one): mu = 2*sqrt(2)/sigma
    from acc_helpers import exact_gaussian_eps
    exact = exact_gaussian_eps(1.3 / 2, 2, 1e-5)
    assert exact <= eps <= exact * 1.003
    # the add/remove accountant refuses to call it an add/remove guarantee
    with pytest.raises(ValueError, match="replace_one"):
        engine.accountant.get_epsilon(1e-5)


def test_unknown_sampler_charges_every_step():
    # (a WeightedRandomSampler with replacement, used here before, is now refused by
    # make_private: one batch could hold a record several times)
    from torch.utils.data import Sampler

    class Shuffled(Sampler[int]):  # a user sampler: dptorch cannot tell what it draws
        def __iter__(self):
            return iter(torch.randperm(48).tolist())

        def __len__(self):
            return 48

    with pytest.warns(UserWarning, match="poisson_sampling=False"):
        engine, *_ = _engine_run(steps=3, poisson=False, quiet=False, sampler=Shuffled())
    assert engine.accountant.events[1].event.steps_per_epoch == 1
    with pytest.warns(UserWarning, match="not known to use each record at most once"):
        eps = engine.get_epsilon(1e-5)
    acc = PLDAccountant(neighboring_relation="replace_one").compose(GaussianEvent(1.3), 3)
    assert eps == acc.get_epsilon(1e-5)


def test_rdp_replace_one_events():
    acc = RDPAccountant(neighboring_relation="replace_one")
    acc.compose(FixedSizeBatchEvent(GaussianEvent(2.0), 5, 0.2), 10)  # two passes
    # q = 1 replace-one: RDP 2α/σ² per pass
    ref = RDPAccountant()
    from dptorch.accountants.analysis.rdp import get_privacy_spent
    orders = RDPAccountant.DEFAULT_ALPHAS
    eps = get_privacy_spent(orders=orders, rdp=[2 * 2 * a / 4.0 for a in orders], delta=1e-5)[0]
    assert acc.get_epsilon(1e-5) == pytest.approx(eps, rel=1e-12)
    assert len(ref) == 0
