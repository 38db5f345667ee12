"""DDP + PrivacyEngine.make_private over 2 gloo processes: the distributed optimizer and sampler
are chosen, the loss decreases, every rank reports the epsilon of the single-process run, and a
checkpoint saved by rank 0 resumes on every rank."""

from __future__ import annotations

import math

import pytest
import torch
from ddp_workers import EPOCHS, N_TRAIN, TRAIN_BATCH, single_process_training


@pytest.fixture(scope="module")
def training(ddp_results) -> list[dict]:
    for r in ddp_results:
        if "training_error" in r:
            pytest.fail("distributed training failed:\n" + r["training_error"])
    return [r["training"] for r in ddp_results]


def test_make_private_picks_distributed_parts(training):
    for r in training:
        assert r["optimizer"] == "DistributedDPOptimizer"
        assert r["sampler"] == "DistributedUniformWithReplacementSampler"
        assert r["sample_rate"] == pytest.approx(TRAIN_BATCH / N_TRAIN)
        assert r["expected_batch_size"] == pytest.approx(TRAIN_BATCH / 2)  # per rank


def test_local_batches_are_poisson_shards(training):
    sizes = torch.tensor(training[0]["batch_sizes"] + training[1]["batch_sizes"], dtype=torch.float)
    # each rank: Binomial(300, 0.1), mean 30; 40 batches -> standard error ~0.8
    assert abs(sizes.mean().item() - TRAIN_BATCH / 2) < 4


def test_loss_decreases_and_ranks_stay_in_sync(training):
    losses = training[0]["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert training[0]["losses"] == training[1]["losses"]
    assert torch.equal(training[0]["params"], training[1]["params"])


def test_epsilon_matches_single_process(training):
    single = single_process_training()
    assert single["sample_rate"] == training[0]["sample_rate"]
    assert training[0]["history"] == training[1]["history"]
    assert training[0]["eps"] == training[1]["eps"]
    assert math.isfinite(single["eps"]) and single["eps"] > 0
    assert training[0]["eps"] == pytest.approx(single["eps"], rel=1e-12)
    steps = EPOCHS * round(N_TRAIN / TRAIN_BATCH)
    if training[0]["history"]:
        assert sum(h[-1] for h in training[0]["history"]) == steps


def test_checkpoint_resumes_on_every_rank(training):
    for r in training:
        assert r["eps_resumed"] == pytest.approx(r["eps"], rel=1e-12)
        assert torch.equal(r["params_resumed"], training[0]["params"])
