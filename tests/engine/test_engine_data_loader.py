"""Poisson sampling: batch-size distribution, independence, reproducibility, empty batches."""

import itertools
import math

import numpy as np
import pytest
import torch
from engine_helpers import make_data, make_loader
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

from dptorch.data_loader import DPDataLoader, switch_generator
from dptorch.utils.uniform_sampler import UniformWithReplacementSampler


def _chi2_binomial_pvalue(sizes: np.ndarray, n: int, q: float) -> float:
    k = np.arange(n + 1)
    expected = stats.binom.pmf(k, n, q) * len(sizes)
    observed = np.bincount(sizes, minlength=n + 1).astype(float)
    # pool the tails so that every bin expects >= 5
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("secure_mode", [False, True])
def test_batch_sizes_are_binomial_and_steps_independent(secure_mode):
    n, q, steps = 60, 0.1, 3000
    gen = None if secure_mode else torch.Generator().manual_seed(0)
    sampler = UniformWithReplacementSampler(
        num_samples=n, sample_rate=q, generator=gen, steps=steps, secure_mode=secure_mode
    )
    batches = list(sampler)
    assert len(batches) == steps == len(sampler)
    sizes = np.array([len(b) for b in batches])
    assert _chi2_binomial_pvalue(sizes, n, q) > 1e-3
    # independence across steps: lag-1 correlation of sizes, and record-level co-inclusion
    r = np.corrcoef(sizes[:-1], sizes[1:])[0, 1]
    assert abs(r) < 4 / math.sqrt(steps)
    masks = np.zeros((steps, n), dtype=bool)
    for t, b in enumerate(batches):
        masks[t, b] = True
    both = (masks[:-1] & masks[1:]).mean()  # P(i in b_t and i in b_t+1) = q²
    se = math.sqrt(q**2 * (1 - q**2) / ((steps - 1) * n))
    assert abs(both - q**2) < 5 * se
    # each record joins with probability q
    per_record = masks.mean(0)
    assert abs(per_record.mean() - q) < 5 * math.sqrt(q * (1 - q) / (steps * n))


def test_generator_makes_sampling_reproducible():
    def draw(seed):
        s = UniformWithReplacementSampler(
            num_samples=50, sample_rate=0.2, generator=torch.Generator().manual_seed(seed), steps=20
        )
        return list(s)

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_sampler_rejects_bad_arguments():
    for q in (0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="sample_rate"):
            UniformWithReplacementSampler(num_samples=10, sample_rate=q)
    with pytest.raises(ValueError, match="num_samples"):
        UniformWithReplacementSampler(num_samples=0, sample_rate=0.1)
    with pytest.raises(ValueError, match="secure_mode"):
        UniformWithReplacementSampler(
            num_samples=10, sample_rate=0.1, generator=torch.Generator(), secure_mode=True
        )
    with pytest.raises(ValueError, match="sample_rate"):
        DPDataLoader(make_data(10), sample_rate=0.0)


def test_from_data_loader_keeps_settings_and_sets_rate():
    ds = make_data(100)

    def collate(batch):
        xs, ys = zip(*batch)
        return {"x": torch.stack(xs), "y": torch.stack(ys)}

    dl = DataLoader(ds, batch_size=7, collate_fn=collate, num_workers=0, pin_memory=False,
                    generator=torch.Generator().manual_seed(3))
    dp = DPDataLoader.from_data_loader(dl)
    assert dp.dataset is ds
    assert len(dp) == len(dl) == 15
    assert dp.sample_rate == pytest.approx(1 / 15)
    assert dp.batch_sampler.generator is dl.generator  # the loader's seed drives the sampling
    batch = next(iter(dp))
    assert set(batch) == {"x", "y"}
    # 1 / (1 / n) round-off must not lose a step
    assert len(DPDataLoader(ds, sample_rate=1 / 49)) == 49


def test_empty_batches_have_the_right_structure():
    ds = TensorDataset(torch.randn(10, 3, 4), torch.arange(10))
    dl = DPDataLoader(ds, sample_rate=1e-7, generator=torch.Generator().manual_seed(0))
    x, y = next(iter(dl))
    assert x.shape == (0, 3, 4) and x.dtype == torch.float32
    assert y.shape == (0,) and y.dtype == torch.int64

    def dict_collate(batch):
        return {"img": torch.stack([b[0] for b in batch]).double(), "n": [int(b[1]) for b in batch]}

    dl2 = DPDataLoader(ds, sample_rate=1e-7, collate_fn=dict_collate)
    out = next(iter(dl2))
    assert out["img"].shape == (0, 3, 4) and out["img"].dtype == torch.float64
    assert out["n"] == []


def test_switch_generator():
    ds = make_data(40)
    dp = DPDataLoader(ds, sample_rate=0.25)
    g1 = torch.Generator().manual_seed(5)
    switch_generator(data_loader=dp, generator=g1)
    a = [b[1].tolist() for b in dp]
    switch_generator(data_loader=dp, generator=torch.Generator().manual_seed(5))
    assert [b[1].tolist() for b in dp] == a
    shuffled = make_loader(ds, shuffle=True)
    switch_generator(data_loader=shuffled, generator=torch.Generator().manual_seed(1))
    assert shuffled.sampler.generator.initial_seed() == 1
    with pytest.raises(ValueError, match="Cannot switch"):
        switch_generator(data_loader=make_loader(ds), generator=g1)


def test_iteration_does_not_consume_global_rng():
    dp = DPDataLoader(make_data(30), sample_rate=0.2, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)
    list(itertools.islice(iter(dp), 3))
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(1))
