"""User errors and silent inputs of the engine fail early or warn: the loader's sampler is
honoured (a SubsetRandomSampler's held-out records are never trained on, other samplers are
refused), unknown or mistyped make_private arguments raise, extreme settings warn, and
ExpandedWeights handles an empty Poisson batch."""

import math
import re
import warnings

import numpy as np
import pytest
import torch
from engine_helpers import TinyNet, make_data, make_loader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from dptorch import PrivacyEngine
from dptorch.data_loader import DistinctIndicesBatchSampler, DPDataLoader, poisson_sampling_indices
from dptorch.utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _index_dataset(n: int) -> TensorDataset:
    """Each item is its own index (and a feature vector, for training)."""
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.arange(n), torch.randn(n, 6, generator=g))


def _drawn(dp: DataLoader, epochs: int) -> list[torch.Tensor]:
    return [batch[0] for _ in range(epochs) for batch in dp]


def _model_untouched(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def _make_private(engine=None, model=None, dl=None, **kw):
    engine = engine or PrivacyEngine(accountant="rdp")
    model = model or TinyNet()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=dl if dl is not None else make_loader(make_data(64), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(kw)
    return (engine, *engine.make_private(**args))


def _with_epsilon(engine=None, model=None, dl=None, **kw):
    engine = engine or PrivacyEngine(accountant="rdp")
    model = model or TinyNet()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=dl if dl is not None else make_loader(make_data(64), batch_size=8),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
    )
    args.update(kw)
    return (engine, *engine.make_private_with_epsilon(**args))


# ---------------------------------------------------------------------------- 1. the sampler
@SETTINGS
@given(
    n=st.integers(4, 60),
    data=st.data(),
    batch_size=st.integers(1, 10),
    seed=st.integers(0, 2**31 - 1),
)
def test_subset_sampler_never_draws_a_held_out_record(n, data, batch_size, seed):
    train = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n), label="train")
    as_type = data.draw(st.sampled_from([list, np.array, torch.tensor]), label="indices type")
    ds = _index_dataset(n)
    dl = DataLoader(ds, sampler=SubsetRandomSampler(as_type(sorted(train))), batch_size=batch_size)
    dp = DPDataLoader.from_data_loader(dl, generator=torch.Generator().manual_seed(seed))
    assert len(dp) == len(dl) and dp.sample_rate == pytest.approx(1 / len(dl))
    assert dp.batch_sampler.num_samples == len(train)
    drawn = torch.cat(_drawn(dp, epochs=20)).tolist()
    assert set(drawn) <= train
    for batch in _drawn(dp, epochs=1):  # Poisson: a record at most once per batch
        assert len(set(batch.tolist())) == len(batch)


def test_subset_sampler_inclusion_frequency_is_q():
    n, batch_size, steps = 100, 10, 4000
    train = list(range(0, n, 2))  # every other record; the rest is held out
    dl = DataLoader(_index_dataset(n), sampler=SubsetRandomSampler(train), batch_size=batch_size)
    dp = DPDataLoader.from_data_loader(dl, generator=torch.Generator().manual_seed(0))
    q = dp.sample_rate
    assert q == pytest.approx(1 / 5)  # len(dl) = 50 / 10
    counts = torch.zeros(n)
    sizes = []
    for batch in _drawn(dp, epochs=steps // len(dp)):
        counts[batch] += 1
        sizes.append(len(batch))
    freq = counts / steps
    assert counts[1::2].sum() == 0  # held out: never drawn
    se = math.sqrt(q * (1 - q) / steps)
    assert (freq[0::2] - q).abs().max() < 5 * se
    # expected batch size is q * N with N = len(train), not q * len(dataset)
    se_mean = math.sqrt(len(train) * q * (1 - q) / steps)
    assert abs(np.mean(sizes) - q * len(train)) < 5 * se_mean


def test_make_private_trains_on_the_subset_and_accounts_with_its_size():
    n, train = 64, list(range(32, 64))
    ds = _index_dataset(n)
    dl = DataLoader(ds, sampler=SubsetRandomSampler(train), batch_size=8)  # len 4, q = 1/4
    model = nn.Linear(6, 3)
    engine, gsm, opt, dp = _make_private(model=model, dl=dl)
    assert dp.sample_rate == pytest.approx(1 / 4)
    assert opt.expected_batch_size == 8  # q * 32, not q * 64
    seen = set()
    for _ in range(10):
        for idx, x in dp:
            seen |= set(idx.tolist())
            nn.functional.cross_entropy(gsm(x), idx % 3).backward()
            opt.step()
            opt.zero_grad()
    assert seen <= set(train) and len(seen) > 16
    assert engine.accountant.history == [(1.0, 1 / 4, 40)]


@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda ds: SequentialSampler(ds),
        lambda ds: RandomSampler(ds),
        lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(0)),
        lambda ds: DistributedSampler(ds, num_replicas=1, rank=0),
        None,  # shuffle=True
    ],
    ids=["sequential", "random", "random-seeded", "distributed-1-replica", "shuffle"],
)
def test_whole_dataset_samplers_keep_sampling_everything(make_sampler):
    ds = _index_dataset(40)
    if make_sampler is None:
        dl = DataLoader(ds, batch_size=4, shuffle=True)
    else:
        dl = DataLoader(ds, batch_size=4, sampler=make_sampler(ds))
    assert poisson_sampling_indices(dl) is None
    dp = DPDataLoader.from_data_loader(dl, generator=torch.Generator().manual_seed(1))
    assert dp.batch_sampler.indices is None and dp.batch_sampler.num_samples == 40
    assert set(torch.cat(_drawn(dp, epochs=10)).tolist()) == set(range(40))


class _EvenRecords(Sampler[int]):
    """A user sampler: which records it draws is its own business."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return self.n // 2


REFUSED = {
    "weighted": (
        lambda ds: dict(sampler=WeightedRandomSampler([1.0] * 40, 40)),
        "WeightedRandomSampler",
    ),
    "with-replacement": (
        lambda ds: dict(sampler=RandomSampler(ds, replacement=True)),
        r"RandomSampler.*replacement",
    ),
    "num-samples": (
        lambda ds: dict(sampler=RandomSampler(ds, num_samples=20)),
        r"RandomSampler.*20 records",
    ),
    "user-sampler": (lambda ds: dict(sampler=_EvenRecords(40)), "_EvenRecords"),
    "distributed-shard": (
        lambda ds: dict(sampler=DistributedSampler(ds, num_replicas=2, rank=0)),
        r"DistributedSampler.*rank 0 out of 2",
    ),
    "custom-batch-sampler": (
        lambda ds: dict(batch_sampler=[[0, 1], [2, 3]]),
        "batch_sampler list",
    ),
    "batch-sampler-subclass": (
        lambda ds: dict(
            batch_sampler=type("MyBatches", (BatchSampler,), {})(SequentialSampler(ds), 4, False)
        ),
        "MyBatches",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_samplers_are_refused_with_the_fix(case):
    ds = _index_dataset(40)
    make_kw, pattern = REFUSED[case]
    kw = make_kw(ds)
    if "batch_sampler" not in kw:
        kw["batch_size"] = 4
    dl = DataLoader(ds, **kw)
    with pytest.raises(ValueError, match=pattern) as e:
        DPDataLoader.from_data_loader(dl)
    msg = str(e.value)
    assert "Poisson" in msg and "torch.utils.data.Subset" in msg and "poisson_sampling=False" in msg
    # make_private refuses it before touching the model ...
    model = TinyNet()
    with pytest.raises(ValueError, match=pattern):
        _make_private(model=model, dl=DataLoader(ds, **kw))
    assert _model_untouched(model)
    # ... as does make_private_with_epsilon, before computing the noise
    with pytest.raises(ValueError, match=pattern):
        _with_epsilon(dl=DataLoader(ds, **kw))
    # poisson_sampling=False: samplers with replacement are refused (a batch could hold a
    # record twice, charged once); a loader known to use each record once per pass is kept as
    # it is; any other one comes back with every batch checked for a repeated record
    if case in ("weighted", "with-replacement"):
        with pytest.raises(ValueError, match=r"replacement=True.*poisson_sampling=True"):
            _make_private(dl=dl, poisson_sampling=False)
        return
    with pytest.warns(UserWarning, match="poisson_sampling=False"):
        _, _, _, got = _make_private(dl=dl, poisson_sampling=False)
    if case in ("num-samples", "distributed-shard"):
        assert got is dl
        return
    assert isinstance(got.batch_sampler, DistinctIndicesBatchSampler)
    assert got.batch_sampler.batch_sampler is dl.batch_sampler and got.dataset is dl.dataset
    assert [list(b) for b in got.batch_sampler] == [list(b) for b in dl.batch_sampler]


def test_bad_subset_indices_are_refused():
    ds = _index_dataset(10)
    for indices, pattern in (
        ([1, 2, 2, 3], r"more than once \(e\.g\. \[2\]\)"),
        ([1, 10], r"must be in \[0, 10\).*\[10\]"),
        ([-1, 3], r"must be in \[0, 10\).*\[-1\]"),
        ([0.5, 1.0], "must be integers"),
    ):
        dl = DataLoader(ds, sampler=SubsetRandomSampler(indices), batch_size=1)
        with pytest.raises(ValueError, match=pattern):
            DPDataLoader.from_data_loader(dl)
    with pytest.raises(ValueError, match="indices"):
        DPDataLoader(ds, sample_rate=0.5, indices=[3, 3])


@SETTINGS
@given(
    n=st.integers(2, 50),
    world=st.integers(1, 4),
    data=st.data(),
    shuffle=st.booleans(),
)
def test_distributed_sampler_over_a_subset_shards_exactly_the_subset(n, world, data, shuffle):
    train = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    samplers = [
        DistributedUniformWithReplacementSampler(
            total_size=len(train),
            sample_rate=0.5,
            shuffle=shuffle,
            num_replicas=world,
            rank=r,
            generator=torch.Generator().manual_seed(r),
            indices=train,
            steps=5,
        )
        for r in range(world)
    ]
    shards = [s.shard().tolist() for s in samplers]
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == train  # disjoint shards covering the subset exactly
    for s, shard in zip(samplers, shards):
        for batch in s:
            assert set(batch) <= set(shard)


def test_uniform_sampler_indices_must_match_num_samples():
    with pytest.raises(ValueError, match="len\\(indices\\)"):
        UniformWithReplacementSampler(num_samples=5, sample_rate=0.5, indices=[0, 1])
    s = UniformWithReplacementSampler(num_samples=3, sample_rate=1.0, indices=[7, 3, 9], steps=2)
    assert list(s) == [[7, 3, 9], [7, 3, 9]]


# ---------------------------------------------------------------------------- 2. arguments
TYPOS = {
    "max_grad_nrom": "max_grad_norm",
    "poison_sampling": "poisson_sampling",
    "noise_generater": "noise_generator",
    "grad_sample_mod": "grad_sample_mode",
    "accum_pases": "accum_passes",
    "auto_clip_and_acum_on_step": "auto_clip_and_accum_on_step",
}


@pytest.mark.parametrize("typo", sorted(TYPOS))
def test_unknown_keyword_is_refused_with_the_closest_name(typo):
    model = TinyNet()
    with pytest.raises(ValueError) as e:
        _make_private(model=model, **{typo: 3})
    msg = str(e.value)
    assert f"unknown keyword argument {typo!r}" in msg
    assert f"did you mean {TYPOS[typo]!r}" in msg
    assert _model_untouched(model)


def test_adaptive_clipping_arguments_are_known_only_to_adaptive_clipping():
    ada = dict(
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.01,
        unclipped_num_std=2.0,
    )
    _make_private(clipping="adaptive", noise_multiplier=0.5, **ada)  # accepted
    typo = {**ada, "target_unclipped_quantle": ada.pop("target_unclipped_quantile")}
    with pytest.raises(ValueError, match="did you mean 'target_unclipped_quantile'"):
        _make_private(clipping="adaptive", noise_multiplier=0.5, **typo)
    # silently ignored before: AdaClip settings with flat clipping
    with pytest.raises(ValueError, match=r"AdaClipDPOptimizer \(clipping='adaptive'\)"):
        _make_private(target_unclipped_quantile=0.5)


def test_arguments_make_private_sets_itself_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="noise_generator="):
        _make_private(generator=torch.Generator())
    with pytest.raises(ValueError, match=r"PrivacyEngine\(secure_mode=True\)"):
        _make_private(secure_mode=True)
    with pytest.raises(ValueError, match="q \\* N"):
        _make_private(expected_batch_size=8)
    with pytest.raises(ValueError, match="computes it from target_epsilon"):
        _with_epsilon(noise_multiplier=1.0)


def test_make_private_with_epsilon_knows_its_own_arguments():
    with pytest.raises(ValueError, match="did you mean 'epsilon_tolerance'"):
        _with_epsilon(epsilon_tolerence=0.1)
    with pytest.raises(ValueError, match="did you mean 'target_delta'"):
        _with_epsilon(target_deltaa=1e-5)
    with pytest.raises(ValueError, match="epsilon_tolerance must be a finite number"):
        _with_epsilon(epsilon_tolerance="0.1")
    # epsilon_tolerance and make_private's own multi_pass go through
    _, _, opt, _ = _with_epsilon(epsilon_tolerance=0.05)
    _, _, opt, _ = _with_epsilon(multi_pass=True, accum_passes=True)
    assert opt.accum_passes is True


_VALID = {
    "max_batch_size",
    "privacy_unit",
    "user_id",
    "max_records_per_user",
    "accum_passes",
    "num_private_passes",
    "auto_clip_and_accum_on_step",
    "criterion",
    "clipping",
    "noise_generator",
    "grad_sample_mode",
    "wrap_model",
    "multi_pass",
    "batch_first",
    "loss_reduction",
    "poisson_sampling",
    "module",
    "optimizer",
    "data_loader",
    "noise_multiplier",
    "max_grad_norm",
    "generator",
    "secure_mode",
    "expected_batch_size",
}


@SETTINGS
@given(name=st.from_regex(r"[a-z][a-z_]{0,24}", fullmatch=True).filter(lambda s: s not in _VALID))
def test_any_unknown_keyword_is_named(name):
    with pytest.raises(ValueError, match=f"unknown keyword argument '{re.escape(name)}'"):
        _make_private(**{name: 1})


TYPE_CASES = {
    "poisson_sampling": ("shuffle", "True, False or 'fixed_shape'"),
    "batch_first": (1, "True or False"),
    "wrap_model": ("yes", "True or False"),
    "multi_pass": (None, "True or False"),
    "grad_sample_mode": (1, "a string"),
    "clipping": (None, "a string"),
    "loss_reduction": (b"mean", "a string"),
    "noise_multiplier": (True, "finite number"),
    "max_grad_norm": (True, "real number"),
    "accum_passes": (1, "True or False"),
    "auto_clip_and_accum_on_step": ("no", "True or False"),
}


@pytest.mark.parametrize("name", sorted(TYPE_CASES))
def test_mistyped_arguments_name_the_argument_value_and_expectation(name):
    value, expected = TYPE_CASES[name]
    model = TinyNet()
    with pytest.raises(ValueError) as e:
        _make_private(model=model, **{name: value})
    msg = str(e.value)
    assert name in msg and repr(value) in msg and expected in msg, msg
    assert _model_untouched(model)


def test_mistyped_numbers_of_the_optimizer_and_of_make_private_with_epsilon():
    ada = dict(
        clipping="adaptive",
        noise_multiplier=0.5,
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.01,
        unclipped_num_std=2.0,
    )
    for name, value in (
        ("max_clipbound", True),
        ("unclipped_num_std", "2"),
        ("min_clipbound", None),
    ):
        with pytest.raises(
            ValueError, match=rf"{name} must be a real number.*{re.escape(repr(value))}"
        ):
            _make_private(**{**ada, name: value})
    with pytest.raises(ValueError, match="num_private_passes must be an integer"):
        _make_private(multi_pass=True, accum_passes=False, num_private_passes=2.0)
    for name, value in (("target_epsilon", True), ("target_delta", "1e-5"), ("epochs", 2.0)):
        with pytest.raises(ValueError, match=name):
            _with_epsilon(**{name: value})
    with pytest.raises(
        ValueError, match="poisson_sampling must be True, False or 'fixed_shape', got 1"
    ):
        _with_epsilon(poisson_sampling=1)


# ---------------------------------------------------------------------------- 3. warnings
def test_extreme_noise_multiplier_warns_with_the_numbers():
    with pytest.warns(UserWarning, match="target_epsilon=0.01 needs noise_multiplier=") as rec:
        _, _, opt, _ = _with_epsilon(engine=PrivacyEngine(), target_epsilon=0.01)
    assert opt.noise_multiplier > 50
    assert any(f"{opt.noise_multiplier:.4g}" in str(w.message) for w in rec)


def test_reasonable_settings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine, model, opt, dl = _with_epsilon(target_epsilon=2.0, target_delta=1e-5)
        x, y = make_data(8)[:]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        engine.get_epsilon(1e-5)
    assert opt.noise_multiplier < 50


def test_delta_of_one_over_n_or_more_warns_with_n_of_the_loader():
    # the loader yields 16 of 64 records: N = 16, 1/N = 0.0625
    dl = DataLoader(_index_dataset(64), sampler=SubsetRandomSampler(range(16)), batch_size=4)
    with pytest.warns(UserWarning, match=r"target_delta=0.1 is >= 1/N = 0.0625 \(N = 16"):
        _with_epsilon(model=nn.Linear(6, 3), dl=dl, target_delta=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _with_epsilon(model=nn.Linear(6, 3), dl=dl, target_delta=0.02)  # >= 1/64 but < 1/16
    # get_epsilon remembers N from make_private
    engine, _, opt, _ = _make_private(model=nn.Linear(6, 3), dl=dl)
    engine.accountant.history = [(1.0, 0.25, 4)]
    with pytest.warns(UserWarning, match=r"delta=0.07 is >= 1/N = 0.0625 \(N = 16"):
        engine.get_epsilon(0.07)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.get_epsilon(0.02)
    # a whole-dataset loader: N = 64
    engine, *_ = _make_private()
    engine.accountant.history = [(1.0, 0.125, 8)]
    with pytest.warns(UserWarning, match=r"1/N = 0.015625 \(N = 64"):
        engine.get_epsilon(0.02)


# ---------------------------------------------------------------------------- 4. empty batch, "ew"
def test_ew_empty_batch_step_adds_noise_and_is_accounted_like_hooks():
    updates = {}
    for mode in ("hooks", "ew"):
        torch.manual_seed(0)
        model = TinyNet()
        engine, gsm, opt, _ = _make_private(
            model=model,
            grad_sample_mode=mode,
            noise_multiplier=2.0,
            noise_generator=torch.Generator().manual_seed(1),
        )
        before = [p.detach().clone() for p in gsm.parameters()]
        x, y = torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)
        nn.functional.cross_entropy(gsm(x), y).backward()  # mean of nothing: nan loss
        for p in gsm.parameters():
            assert p.grad_sample.shape == (0, *p.shape)
        opt.step()
        grads = torch.cat([p.grad.flatten() for p in gsm.parameters()])
        assert torch.isfinite(grads).all()
        assert 0.15 < grads.std().item() < 0.35  # pure noise, std σC / (qN) = 2 / 8
        updates[mode] = [p.detach() - b for p, b in zip(gsm.parameters(), before)]
        opt.zero_grad()
        assert engine.accountant.history == [(2.0, 1 / 8, 1)]
        # the next, non-empty batch trains normally
        xb, yb = make_data(8)[:]
        nn.functional.cross_entropy(gsm(xb), yb).backward()
        assert all(p.grad_sample.shape == (8, *p.shape) for p in gsm.parameters())
        opt.step()
        opt.zero_grad()
    for a, b in zip(updates["hooks"], updates["ew"]):
        assert torch.equal(a, b)  # same noise, nothing else


def test_ew_trains_through_empty_poisson_batches():
    engine, gsm, opt, dl = _make_private(grad_sample_mode="ew", noise_multiplier=0.0)
    dl.batch_sampler.sample_rate = 1e-9  # every batch is empty
    before = [p.detach().clone() for p in gsm.parameters()]
    for x, y in dl:
        assert len(x) == 0
        nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
    assert sum(n for *_, n in engine.accountant.history) == len(dl)
    assert all(torch.equal(b, p) for b, p in zip(before, gsm.parameters()))  # σ = 0, no data
    # accumulation after an empty pass is still forbidden (Poisson sampling)
    x, y = make_data(8)[:]
    nn.functional.cross_entropy(gsm(x[:0]), y[:0], reduction="sum").backward()
    with pytest.raises(ValueError, match="accumulation"):
        gsm(x)
