import math
import warnings

import pytest

from dptorch.accountants import (
    FixedSizeBatchEvent,
    GaussianAccountant,
    GaussianEvent,
    IAccountant,
    PLDAccountant,
    RDPAccountant,
    create_accountant,
    get_noise_multiplier,
    register_accountant,
)
from dptorch.cli import main


def test_history_compression_len_and_state_round_trip():
    acc = RDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.0, sample_rate=0.01)
    acc.step(noise_multiplier=2.0, sample_rate=0.01)
    acc.step(noise_multiplier=1.0, sample_rate=0.01)
    assert acc.history == [(1.0, 0.01, 3), (2.0, 0.01, 1), (1.0, 0.01, 1)]
    assert len(acc) == 5
    state = acc.state_dict()
    other = RDPAccountant()
    other.load_state_dict(state)
    assert other.history == acc.history and other.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="mechanism"):
        PLDAccountant().load_state_dict(state)


def test_hook_uses_accumulated_iterations():
    """An optimizer-like object without ``privacy_event``: one Poisson batch per release is a
    step at q; two accumulated Poisson batches are refused (their sum is not a Poisson step at
    2q: a record's multiplicity is Binomial(2, q)), nothing composed; fixed-size batches
    accumulated by 2 make passes of half as many releases."""
    class Optim:
        noise_multiplier = 1.5
        accumulated_iterations = 1
    acc = create_accountant("pld")
    hook = acc.get_optimizer_hook_fn(sample_rate=0.01)
    hook(Optim())
    hook(Optim())
    assert acc.history == [(1.5, 0.01, 2)]
    Optim.accumulated_iterations = 2
    with pytest.raises(ValueError, match="2 Poisson batches.*BatchMemoryManager"):
        hook(Optim())
    assert acc.history == [(1.5, 0.01, 2)]
    fixed = create_accountant("pld", neighboring_relation="replace_one")
    fixed.get_optimizer_hook_fn(sample_rate=0.1, steps_per_epoch=10)(Optim())
    assert fixed.events[-1] == FixedSizeBatchEvent(GaussianEvent(1.5), 5, 0.2)


def test_heterogeneous_rdp_equals_sum_of_phases():
    acc = RDPAccountant()
    for s in [1.0] * 10 + [2.0] * 20:
        acc.step(noise_multiplier=s, sample_rate=0.1)
    a, b = RDPAccountant(), RDPAccountant()
    a.history, b.history = [(1.0, 0.1, 10)], [(2.0, 0.1, 20)]
    from dptorch.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=0.1, noise_multiplier=1.0, steps=10, orders=orders) + compute_rdp(
        q=0.1, noise_multiplier=2.0, steps=20, orders=orders)
    assert acc.get_epsilon(1e-5) == pytest.approx(get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)[0])


def test_gdp_warns_and_matches_closed_form():
    with pytest.warns(UserWarning, match="under-estimate"):
        acc = GaussianAccountant()
    acc.history = [(1.0, 1.0, 4)]  # q = 1: mu = sqrt(4 (e - 1))
    from scipy.stats import norm
    eps = acc.get_epsilon(1e-5)
    mu = math.sqrt(4 * math.expm1(1.0))
    assert norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) == pytest.approx(1e-5, rel=1e-6)


def test_registry():
    class Dummy(RDPAccountant):
        @classmethod
        def mechanism(cls):
            return "dummy"
    register_accountant("dummy", Dummy)
    assert isinstance(create_accountant("dummy"), Dummy)
    with pytest.raises(ValueError, match="already registered"):
        register_accountant("dummy", Dummy)
    with pytest.raises(ValueError, match="unknown"):
        create_accountant("nope")
    assert issubclass(Dummy, IAccountant)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_get_noise_multiplier_round_trip(accountant):
    kw = dict(target_delta=1e-5, sample_rate=0.01)
    sigma = get_noise_multiplier(target_epsilon=2.0, epochs=5, accountant=accountant, **kw)
    steps = int(5 / 0.01)
    acc = create_accountant(accountant)
    acc.history = [(sigma, 0.01, steps)]
    assert acc.get_epsilon(1e-5) <= 2.0
    acc.history = [(sigma - 0.01, 0.01, steps)]
    assert acc.get_epsilon(1e-5) > 2.0


def test_get_noise_multiplier_errors():
    kw = dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, accountant="rdp")
    with pytest.raises(ValueError, match="exactly one"):
        get_noise_multiplier(**kw)
    with pytest.raises(ValueError, match="exactly one"):
        get_noise_multiplier(epochs=1, steps=10, **kw)
    with pytest.raises(ValueError, match="sample_rate"):
        get_noise_multiplier(**{**kw, "sample_rate": 0.0}, steps=10)
    with pytest.raises(ValueError, match="target_delta"):
        get_noise_multiplier(**{**kw, "target_delta": 1.0}, steps=10)
    with pytest.raises(ValueError, match="target_epsilon"):
        get_noise_multiplier(**{**kw, "target_epsilon": 0.0}, steps=10)
    with pytest.raises(ValueError, match="unreachable"):  # delta < q-ish: budget too small
        get_noise_multiplier(**{**kw, "target_epsilon": 1e-9, "sample_rate": 1.0}, steps=10**6)


def test_step_validation():
    with pytest.raises(ValueError, match="sample_rate"):
        RDPAccountant().step(noise_multiplier=1.0, sample_rate=1.5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        RDPAccountant().step(noise_multiplier=-1.0, sample_rate=0.5)


def test_cli_privacy_and_calibrate(capsys):
    assert main(["privacy", "--noise-multiplier", "1.1", "--sample-rate", str(256 / 60000),
                 "--steps", "14062", "--delta", "1e-5", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    assert "rdp: epsilon = 2.59" in out
    assert main(["calibrate", "--target-epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.01",
                 "--epochs", "5", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sigma = get_noise_multiplier(target_epsilon=2, target_delta=1e-5, sample_rate=0.01,
                                     epochs=5, accountant="rdp")
    assert f"noise_multiplier = {sigma:.4f}" in out


@pytest.mark.parametrize("argv", [
    ["privacy", "--noise-multiplier", "1", "--sample-rate", "2", "--steps", "5", "--delta", "1e-5"],
    ["privacy", "--noise-multiplier", "-1", "--sample-rate", "0.1", "--steps", "5", "--delta", "1e-5"],
    ["privacy", "--noise-multiplier", "1", "--sample-rate", "0.1", "--delta", "1e-5"],
    ["calibrate", "--target-epsilon", "0", "--delta", "1e-5", "--sample-rate", "0.1", "--steps", "5"],
    ["calibrate", "--target-epsilon", "1", "--delta", "2", "--sample-rate", "0.1", "--steps", "5"],
])
def test_cli_bad_input_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
