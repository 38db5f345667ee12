"""DistributedUniformWithReplacementSampler in-process (explicit ranks) and DPDataLoader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from dptorch.data_loader import DPDataLoader
from dptorch.utils.uniform_sampler import DistributedUniformWithReplacementSampler

N, Q, WORLD, STEPS = 101, 0.2, 2, 2000


def _samplers(**kw) -> list[DistributedUniformWithReplacementSampler]:
    return [
        DistributedUniformWithReplacementSampler(
            total_size=N, sample_rate=Q, steps=STEPS, num_replicas=WORLD, rank=r, **kw
        )
        for r in range(WORLD)
    ]


def test_shards_are_disjoint_and_cover_every_epoch():
    samplers = _samplers(shuffle_seed=3)
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        shards = [s.shard().tolist() for s in samplers]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(N))
        assert [len(x) for x in shards] == [s.num_samples for s in samplers] == [51, 50]
    unshuffled = _samplers(shuffle=False)[1].shard().tolist()
    assert unshuffled == list(range(1, N, 2))


def test_each_record_sampled_with_probability_q_per_step():
    # the same seed on both ranks: each rank must still draw its own, independent masks
    samplers = _samplers(generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(N)
    joint = 0  # steps where record a (rank 0) and record b (rank 1) are both sampled
    a, b = samplers[0].shard()[0].item(), samplers[1].shard()[0].item()
    for b0, b1 in zip(*samplers):
        assert not set(b0) & set(b1)  # a record is in at most one local batch
        for i in b0 + b1:
            counts[i] += 1
        joint += (a in b0) and (b in b1)
    freq = counts / STEPS
    # per record: std sqrt(q(1-q)/STEPS) ~ 0.009; 5 sigma
    assert (freq - Q).abs().max() < 5 * (Q * (1 - Q) / STEPS) ** 0.5
    assert abs(freq.mean() - Q) < 0.005
    # independence across ranks: P(a and b) = q^2 = 0.04 (identical masks would give q = 0.2)
    assert abs(joint / STEPS - Q * Q) < 0.02


def test_empty_batches_are_yielded_and_lengths():
    s = DistributedUniformWithReplacementSampler(
        total_size=4, sample_rate=0.01, num_replicas=2, rank=0, generator=torch.Generator()
    )
    assert len(s) == 100
    batches = list(s)
    assert len(batches) == 100 and [] in batches  # empty local batches are not dropped


def test_secure_mode_and_argument_errors():
    s = DistributedUniformWithReplacementSampler(
        total_size=10, sample_rate=0.5, num_replicas=2, rank=1, secure_mode=True, steps=3
    )
    assert len(list(s)) == 3
    with pytest.raises(ValueError, match="secure_mode"):
        DistributedUniformWithReplacementSampler(
            total_size=10, sample_rate=0.5, num_replicas=2, rank=0, secure_mode=True,
            generator=torch.Generator(),
        )
    with pytest.raises(ValueError, match="rank"):
        DistributedUniformWithReplacementSampler(
            total_size=10, sample_rate=0.5, num_replicas=2, rank=2
        )
    with pytest.raises(ValueError, match="sample_rate"):
        DistributedUniformWithReplacementSampler(
            total_size=10, sample_rate=0.0, num_replicas=2, rank=0
        )
    with pytest.raises(RuntimeError, match="initialised"):
        DistributedUniformWithReplacementSampler(total_size=10, sample_rate=0.5)


def test_dp_data_loader_distributed_needs_process_group():
    ds = TensorDataset(torch.randn(10, 2))
    with pytest.raises(RuntimeError, match="initialised"):
        DPDataLoader(ds, sample_rate=0.5, distributed=True)
