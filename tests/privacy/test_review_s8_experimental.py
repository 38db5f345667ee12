"""Review S8, experimental engines (dptorch.experimental).

F5: an optimizer parameter outside the wrapped module (a learnable temperature) was updated with
    its raw gradient; every experimental engine now runs the main engine's
    ``check_optimizer_params``, at construction and at every step.
F6: engines documented as formal accepted loaders their analysis does not cover. The sign-vote
    engine (Poisson analysis) accounted a shuffled fixed-size DataLoader as Poisson at q = B/N
    (ε 5.88 reported; 28.4 replace-one / 11.5 add-remove without amplification); the
    trimmed-mean engine (one batch per example per epoch) took samplers with replacement and
    Poisson batch samplers. Covered loaders keep working with the ε of an independent
    computation; the approximate engines accept any loader and say so.
F7: docs/sampling.md said a user-level loader of batch_size=b has about b users per batch; it
    has about b·U/N (q = 1/len(record loader)).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import dptorch.data_loader as data_loader_module
import dptorch.experimental as experimental
from dptorch.data_loader import DPDataLoader, steps_per_pass
from dptorch.experimental import (
    ApproximateDPWarning,
    ApproximateEpsilon,
    ExperimentalPrivacyEngine,
    GlobalImmediateSensitivityPrivacyEngine,
    ImmediateSensitivityPrivacyEngine,
    SignVotePrivacyEngine,
    TrimmedMeanPrivacyEngine,
)
from dptorch.utils.uniform_sampler import UniformWithReplacementSampler

D_IN, D_OUT = 4, 2


def _dataset(n: int = 200, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, D_IN, generator=g), torch.randint(0, D_OUT, (n,), generator=g))


def _make(cls, model, opt, **loader_kw):
    """Each engine class with small valid settings; ``loader_kw`` is sample_rate/data_loader
    (steps_per_epoch/data_loader for the trimmed mean)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximateDPWarning)
        if cls is TrimmedMeanPrivacyEngine:
            return cls(model, opt, rho_per_epoch=1.0, **(loader_kw or {"steps_per_epoch": 10}))
        if cls is GlobalImmediateSensitivityPrivacyEngine:
            return cls(model, opt, noise_multiplier=1.0, input_shape=(D_IN,),
                       loss_reduction="sum", **(loader_kw or {"sample_rate": 0.1}))
        return cls(model, opt, noise_multiplier=1.0, **(loader_kw or {"sample_rate": 0.1}))


ENGINES = [
    ImmediateSensitivityPrivacyEngine,
    GlobalImmediateSensitivityPrivacyEngine,
    TrimmedMeanPrivacyEngine,
    SignVotePrivacyEngine,
]


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # bias-free: the global IS engine's constancy check holds for it
    return nn.Linear(D_IN, D_OUT, bias=False)


def _backward(engine, model_out_module, x, y, temperature=None):
    """One backward pass through ``engine`` (its own API for the IS engines)."""
    x = x.clone().requires_grad_(isinstance(engine, ImmediateSensitivityPrivacyEngine))
    out = model_out_module(x)
    if temperature is not None:
        out = out * temperature
    loss = nn.functional.cross_entropy(out, y, reduction="sum")
    if isinstance(engine, (ImmediateSensitivityPrivacyEngine, GlobalImmediateSensitivityPrivacyEngine)):
        engine.backward(loss, x)
    else:
        loss.backward()


# ------------------------------------------------------------------------------------------ F5
def test_every_experimental_engine_is_tested():
    """The parametrized tests below cover every engine class the package exports."""
    exported = {
        getattr(experimental, name) for name in experimental.__all__
        if isinstance(getattr(experimental, name), type)
        and issubclass(getattr(experimental, name), ExperimentalPrivacyEngine)
        and getattr(experimental, name) is not ExperimentalPrivacyEngine
    }
    assert exported == set(ENGINES)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_parameter_outside_the_module_is_refused(cls):
    model = _linear()
    temperature = nn.Parameter(torch.ones(()))  # a learnable temperature, not in the model
    opt = torch.optim.SGD(list(model.parameters()) + [temperature], lr=1.0)
    with pytest.raises(ValueError, match="not the model's") as e:
        _make(cls, model, opt)
    assert cls.__name__ in str(e.value) and "raw, non-private gradient" in str(e.value)
    assert not model._forward_hooks and not model._forward_pre_hooks  # left as it was
    assert not opt._optimizer_step_pre_hooks  # no engine hook left on the optimizer


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_parameter_added_to_the_optimizer_later_is_refused_at_step(cls):
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = _make(cls, model, opt)
    temperature = nn.Parameter(torch.ones(()))
    opt.add_param_group({"params": [temperature]})
    ds = _dataset(16)
    x, y = ds.tensors
    _backward(engine, engine.module, x, y, temperature)
    if temperature.grad is None:  # the IS engines differentiate the module's parameters only
        temperature.grad = torch.ones(())
    before = temperature.detach().clone()
    with pytest.raises(ValueError, match="not the model's"):
        opt.step()
    assert torch.equal(temperature.detach(), before)  # the raw gradient was not applied
    assert engine.steps == 0


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_module_parameter_missing_from_the_optimizer_is_refused(cls):
    """The other half of the main engine's check: a trainable model parameter the optimizer
    does not update."""
    model = nn.Sequential(nn.Linear(D_IN, 3, bias=False), nn.Linear(3, D_OUT, bias=False))
    opt = torch.optim.SGD(model[0].parameters(), lr=1.0)
    with pytest.raises(ValueError, match="not in the optimizer"):
        _make(cls, model, opt)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_module_parameters_only_still_train(cls):
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _make(cls, model, opt)
    x, y = _dataset(16).tensors
    before = model.weight.detach().clone()
    _backward(engine, engine.module, x, y)
    opt.step()
    assert engine.steps == 1 and not torch.equal(model.weight.detach(), before)


# ------------------------------------------------------------------------------------------ F6
def _weighted(ds):
    return DataLoader(ds, batch_size=20, sampler=WeightedRandomSampler(torch.ones(len(ds)), len(ds)))


class _Stream(IterableDataset):
    def __iter__(self):
        for _ in range(100):
            yield torch.zeros(D_IN), 0


def _fixed_shape_loader(ds):
    """The fixed-shape Poisson loader of make_private (a DPDataLoader subclass with padding)."""
    from dptorch import PrivacyEngine

    model = _linear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        *_, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=20), noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling="fixed_shape", max_batch_size=40,
        )
    return loader


def _user_level_loader(ds):
    from dptorch import PrivacyEngine

    model = _linear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        *_, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=20), noise_multiplier=1.0, max_grad_norm=1.0,
            privacy_unit="user", user_id=torch.arange(len(ds)) // 4,
        )
    return loader


class _ClaimsPoisson:
    """Not a loader dptorch can check, but it carries a sample_rate."""

    sample_rate = 0.1
    batch_size = 20
    dataset = _dataset()

    def __len__(self):
        return 10


NOT_POISSON = {
    "shuffled": lambda ds: DataLoader(ds, batch_size=20, shuffle=True),
    "sequential": lambda ds: DataLoader(ds, batch_size=20),
    "with_replacement": lambda ds: DataLoader(ds, batch_size=20, sampler=RandomSampler(ds, replacement=True)),
    "weighted": _weighted,
    "fixed_shape": _fixed_shape_loader,
    "user_level": _user_level_loader,
    "claims_sample_rate": lambda ds: _ClaimsPoisson(),
}


@pytest.mark.parametrize("name", list(NOT_POISSON))
def test_sign_vote_refuses_loaders_that_are_not_poisson(name):
    """The repro: a shuffled loader was accepted (a logged warning), is_approximate stayed False
    and ε was the Poisson figure at q = B/N."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = NOT_POISSON[name](_dataset())
    with pytest.raises(ValueError, match="Poisson sampling") as e:
        SignVotePrivacyEngine(model, opt, noise_multiplier=1.0, data_loader=loader)
    msg = str(e.value)
    assert "SignVotePrivacyEngine" in msg and "DPDataLoader.from_data_loader" in msg
    assert "sample_rate=q" in msg
    assert not model._forward_hooks  # refused before wrapping


def _train_sign_vote(engine, loader, epochs):
    for _ in range(epochs):
        for x, y in loader:
            if len(x) == 0:
                engine.backward(None)
            else:
                nn.functional.cross_entropy(engine.module(x), y).backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()


@pytest.mark.parametrize("kind", ["dp_data_loader", "batch_sampler"])
def test_sign_vote_poisson_loaders_keep_working_with_independent_epsilon(kind):
    """The repro's setting (N = 1000, B = 100, σ = 1, 5 epochs) on Poisson batches at q = 0.1:
    ε is dp-accounting's RDP figure, and not below its exact PLD figure."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import rdp
    from dp_accounting.pld import pld_privacy_accountant

    n, b, sigma, epochs, delta = 1000, 100, 1.0, 5, 1e-5
    ds = _dataset(n)
    gen = torch.Generator().manual_seed(0)
    if kind == "dp_data_loader":
        loader = DPDataLoader.from_data_loader(DataLoader(ds, batch_size=b, shuffle=True), generator=gen)
    else:
        loader = DataLoader(ds, batch_sampler=UniformWithReplacementSampler(
            num_samples=n, sample_rate=b / n, generator=gen))
    model = nn.Linear(D_IN, D_OUT)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = SignVotePrivacyEngine(model, opt, noise_multiplier=sigma, data_loader=loader)
    assert engine.sample_rate == pytest.approx(0.1) and not engine.is_approximate
    _train_sign_vote(engine, loader, epochs)
    assert engine.steps == 50
    eps = engine.get_epsilon(delta)
    assert type(eps) is float

    event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(sigma))
    ref = rdp.RdpAccountant(list(range(2, 64)) + [2.5, 3.5, 4.5])
    ref.compose(event, 50)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(event, 50)
    assert eps == pytest.approx(ref.get_epsilon(delta), rel=2e-2)
    assert eps >= pld.get_epsilon(delta)


def test_sign_vote_explicit_sample_rate_still_accepted():
    model = _linear()
    engine = SignVotePrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   noise_multiplier=1.0, sample_rate=0.05)
    assert engine.sample_rate == 0.05


@pytest.mark.parametrize("cls", [ImmediateSensitivityPrivacyEngine, GlobalImmediateSensitivityPrivacyEngine],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", ["shuffled", "with_replacement", "claims_sample_rate"])
def test_approximate_engines_accept_any_loader_and_say_so(cls, name):
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = NOT_POISSON[name](_dataset())
    with pytest.warns(ApproximateDPWarning) as record:
        kw = dict(input_shape=(D_IN,), loss_reduction="sum") if cls is GlobalImmediateSensitivityPrivacyEngine else {}
        engine = cls(model, opt, noise_multiplier=1.0, data_loader=loader, **kw)
    loader_warnings = [str(w.message) for w in record if "does not draw Poisson batches" in str(w.message)]
    assert len(loader_warnings) == 1 and cls.__name__ in loader_warnings[0]
    assert engine.sample_rate == pytest.approx(0.1)
    assert engine.is_approximate
    x, y = _dataset(16).tensors
    _backward(engine, engine.module, x, y)
    opt.step()
    assert isinstance(engine.get_epsilon(1e-5), ApproximateEpsilon)


def test_approximate_engine_with_a_poisson_loader_has_no_loader_warning():
    model = _linear()
    loader = DPDataLoader(_dataset(), sample_rate=0.1)
    with pytest.warns(ApproximateDPWarning) as record:
        engine = ImmediateSensitivityPrivacyEngine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, data_loader=loader)
    assert not [w for w in record if "does not draw Poisson batches" in str(w.message)]
    assert engine.sample_rate == 0.1


TRIMMED_REFUSED = {
    "with_replacement": lambda ds: DataLoader(ds, batch_size=20, sampler=RandomSampler(ds, replacement=True)),
    "poisson_batch_sampler": lambda ds: DataLoader(ds, batch_sampler=UniformWithReplacementSampler(
        num_samples=len(ds), sample_rate=0.1)),
    "dp_data_loader": lambda ds: DPDataLoader(ds, sample_rate=0.1),
    "weighted": _weighted,
    "subset_with_duplicates": lambda ds: DataLoader(ds, batch_size=20, sampler=SubsetRandomSampler([0, 0, 1, 2] * 10)),
    "random_more_than_n": lambda ds: DataLoader(ds, batch_size=20, sampler=RandomSampler(ds, num_samples=2 * len(ds))),
    "custom_batch_sampler": lambda ds: DataLoader(ds, batch_sampler=[[0, 0, 1], [2, 3, 3]]),
    "iterable": lambda ds: DataLoader(_Stream(), batch_size=10),
    "single_batch_with_replacement": lambda ds: DataLoader(
        ds, batch_size=len(ds), sampler=RandomSampler(ds, replacement=True)),
    "not_a_loader": lambda ds: _ClaimsPoisson(),
}


@pytest.mark.parametrize("name", list(TRIMMED_REFUSED))
def test_trimmed_mean_refuses_loaders_outside_its_analysis(name):
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = TRIMMED_REFUSED[name](_dataset())
    with pytest.raises(ValueError, match="at most one") as e:
        TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0, data_loader=loader)
    assert "steps_per_epoch" in str(e.value)
    assert not model._forward_hooks


class _RepeatingSampler(RandomSampler):
    """A RandomSampler subclass yielding each record twice per pass (repeated augmentation)."""

    def __iter__(self):
        for i in super().__iter__():
            yield i
            yield i

    def __len__(self):
        return 2 * super().__len__()


CONSISTENCY = {
    "single_batch_shuffled": lambda ds: DataLoader(ds, batch_size=len(ds), shuffle=True),
    "shuffled": lambda ds: DataLoader(ds, batch_size=20, shuffle=True, drop_last=True),
    "sequential": lambda ds: DataLoader(ds, batch_size=20, sampler=SequentialSampler(ds)),
    "subset": lambda ds: DataLoader(ds, batch_size=20, sampler=SubsetRandomSampler(list(range(0, 200, 2)))),
    "random_subset_per_epoch": lambda ds: DataLoader(ds, batch_size=20, sampler=RandomSampler(ds, num_samples=100)),
    "batch_sampler_object": lambda ds: DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 20, True)),
    "repeating_subclass": lambda ds: DataLoader(ds, batch_size=20, sampler=_RepeatingSampler(ds)),
    "with_replacement": TRIMMED_REFUSED["with_replacement"],
    "weighted": _weighted,
    "subset_with_duplicates": TRIMMED_REFUSED["subset_with_duplicates"],
    "random_more_than_n": TRIMMED_REFUSED["random_more_than_n"],
}


def _main_engine_trusts(loader) -> bool:
    """Whether dptorch.data_loader trusts ``loader`` to use each record at most once per pass:
    its predicate when it has one, else steps_per_pass answering len(loader) (>= 2 batches)."""
    once = getattr(data_loader_module, "uses_each_record_once", None)
    if once is not None:
        return once(loader)
    try:
        return steps_per_pass(loader, poisson_sampling=False) == len(loader) >= 2
    except ValueError:
        return False


@pytest.mark.parametrize("name", list(CONSISTENCY))
def test_trimmed_mean_accepts_exactly_what_steps_per_pass_trusts(name):
    """The trimmed-mean engine reuses dptorch.data_loader's check behind steps_per_pass: a
    DataLoader is accepted iff the main library trusts it to use each record at most once per
    pass; anything else is refused."""
    loader = CONSISTENCY[name](_dataset())
    trusted = _main_engine_trusts(loader)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if trusted:
        engine = TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0, data_loader=loader)
        assert engine.steps_per_epoch == len(loader)
    else:  # a single batch without the predicate: "at most once" (and steps_per_epoch=1)
        with pytest.raises(ValueError, match="at most one|at most once"):
            TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0, data_loader=loader)


def test_trimmed_mean_repro_loaders_are_refused():
    """Exactly the two loaders of the reviewer's repro."""
    ds = _dataset()
    for loader in (
        DataLoader(ds, batch_size=20, sampler=RandomSampler(ds, replacement=True)),
        DataLoader(ds, batch_sampler=UniformWithReplacementSampler(num_samples=200, sample_rate=0.1)),
    ):
        model = _linear()
        with pytest.raises(ValueError, match="at most one"):
            TrimmedMeanPrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     rho_per_epoch=1.0, data_loader=loader)


@pytest.mark.parametrize("loader_kind", ["shuffled", "sequential", "subset"])
def test_trimmed_mean_partition_loaders_keep_working_with_independent_epsilon(loader_kind):
    """A covered loader: steps_per_epoch = len(loader), and after E epochs ε is
    Eρ + 2√(Eρ log 1/δ) (Bun & Steinke 2016, Prop. 1.3), computed here by hand."""
    ds = _dataset(200)
    loader = CONSISTENCY[loader_kind](ds)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rho, epochs, delta = 0.5, 3, 1e-5
    engine = TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=rho, data_loader=loader,
                                      generator=torch.Generator().manual_seed(0))
    assert engine.steps_per_epoch == len(loader) == (10 if loader_kind != "subset" else 5)
    for _ in range(epochs):
        for x, y in loader:
            nn.functional.cross_entropy(engine.module(x), y).backward()
            opt.step()
            opt.zero_grad()
    total = rho * epochs
    assert engine.steps == epochs * len(loader)
    assert engine.get_epsilon(delta) == pytest.approx(total + 2 * math.sqrt(total * math.log(1 / delta)),
                                                      rel=1e-12)


def test_trimmed_mean_explicit_steps_per_epoch_still_accepted():
    model = _linear()
    engine = TrimmedMeanPrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      rho_per_epoch=1.0, steps_per_epoch=1)
    assert engine.steps_per_epoch == 1


@pytest.mark.skipif(not hasattr(data_loader_module, "uses_each_record_once"),
                    reason="dptorch.data_loader without exact-type sampler checks")
def test_trimmed_mean_refuses_a_sampler_subclass_that_repeats_records():
    """A RandomSampler subclass (repeated augmentation) uses each record twice per pass: the
    main library's exact-type check does not trust it, and neither does the trimmed mean."""
    ds = _dataset()
    loader = DataLoader(ds, batch_size=20, sampler=_RepeatingSampler(ds))
    model = _linear()
    with pytest.raises(ValueError, match="at most one"):
        TrimmedMeanPrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 rho_per_epoch=1.0, data_loader=loader)


def test_trimmed_mean_full_batch_loader():
    """One shuffled batch per epoch: accepted when the main library can tell that its sampler
    uses each record once, else refused with the steps_per_epoch=1 fix; never accepted with
    replacement (TRIMMED_REFUSED)."""
    ds = _dataset()
    loader = DataLoader(ds, batch_size=len(ds), shuffle=True)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if hasattr(data_loader_module, "uses_each_record_once"):
        engine = TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0, data_loader=loader)
        assert engine.steps_per_epoch == 1
    else:
        with pytest.raises(ValueError, match="steps_per_epoch=1"):
            TrimmedMeanPrivacyEngine(model, opt, rho_per_epoch=1.0, data_loader=loader)


# ------------------------------------------------------------------------------------------ F7
def test_user_level_batches_hold_b_times_u_over_n_users_as_documented():
    """q = 1/len(record loader) = b/N is the probability that a *user* is drawn: a batch holds
    about b·U/N users (b records), not b users, as docs/sampling.md and the example now say."""
    from pathlib import Path

    from dptorch import PrivacyEngine

    n, per_user, b = 2000, 10, 50
    users = n // per_user
    ds = _dataset(n)
    model = _linear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, opt, loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=b), noise_multiplier=1.0, max_grad_norm=1.0,
            privacy_unit="user", user_id=torch.arange(n) // per_user)
    assert loader.sample_rate == pytest.approx(b / n)
    assert opt.expected_batch_size == pytest.approx(b * users / n)  # 5 users, not 50

    root = Path(__file__).resolve().parents[2]
    doc = " ".join((root / "docs" / "sampling.md").read_text().split())
    assert "about b users per batch" not in doc
    assert "about q·U = b·U/N users" in doc
    example = (root / "examples" / "user_level_digits.py").read_text()
    assert "the loader's batch size counts users" not in example
    assert "b·U/N users" in example
