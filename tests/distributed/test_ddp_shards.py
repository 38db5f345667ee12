"""DDP with ``poisson_sampling=False`` (2 gloo processes): the accounting charges a record once
per pass, which holds only if the ranks' DistributedSamplers cut one permutation into disjoint
shards. A per-rank seed (``seed=rank``) or a hard-coded ``rank`` puts a record into both ranks'
batches of one release (ε 10.0 reported against 24.4 in the review); both are refused on every
rank, and consistent samplers are accepted."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shards(ddp_results) -> list[dict]:
    for r in ddp_results:
        if "shards_error" in r:
            pytest.fail("distributed shard run failed:\n" + r["shards_error"])
    return [r["shards"] for r in ddp_results]


def test_per_rank_seeds_are_refused_on_every_rank(shards):
    for r in shards:
        assert r["seed_rank"] is not None and "disagree" in r["seed_rank"]


def test_a_hard_coded_rank_is_refused_on_every_rank(shards):
    for r in shards:
        assert r["rank_0"] is not None and "another rank" in r["rank_0"]


def test_consistent_samplers_are_accepted(shards):
    assert all(r["good"] is None for r in shards)
