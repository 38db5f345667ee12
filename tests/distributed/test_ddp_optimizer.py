"""DistributedDPOptimizer, DPDDP, torch DDP and the distributed sampler over 2 gloo processes:
the ranks' results (conftest.ddp_results) against a single-process DPOptimizer on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from ddp_workers import (
    NOISE_STEPS,
    SIGMA,
    B,
    C,
    make_data,
    make_dp_optimizer,
    make_model,
    per_layer_reference,
    reference,
)

from dptorch import GradSampleModule
from dptorch.optimizers import DistributedDPOptimizer


@pytest.fixture(scope="module")
def results(ddp_results) -> list[dict]:
    return [r["optimizer"] for r in ddp_results]


def _assert_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


def _assert_same_on_ranks(results: list[dict], key: str) -> None:
    for a, b in zip(results[0][key], results[1][key]):
        assert torch.equal(a, b), f"{key}: ranks disagree"


def test_dpddp_broadcasts_rank0_parameters(results):
    _assert_same_on_ranks(results, "params")
    _assert_close(results[0]["params"], list(make_model(seed=0).parameters()))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_two_ranks_equal_one_process(results, reduction):
    _assert_same_on_ranks(results, reduction)
    _assert_close(results[0][reduction], reference(reduction))


def test_noise_added_once_for_the_world(results):
    noisy0, noisy1 = results[0]["noisy"], results[1]["noisy"]
    assert torch.equal(noisy0, noisy1), "ranks must hold the same noised gradient"
    clean = torch.cat([g.flatten() for g in reference("mean")])
    noise = noisy0 - clean  # N(0, (sigma C / B)^2) per coordinate if noise is added once
    std = noise.std().item()
    expected = SIGMA * C / B
    # 40 steps x 39 coordinates: relative standard error ~2%; sqrt(2) or 0 would be far off
    assert abs(std / expected - 1) < 0.1, f"noise std {std:.4g}, expected {expected:.4g}"
    assert abs(noise.mean().item()) < 4 * expected / noise.numel() ** 0.5
    assert len({tuple(r.tolist()) for r in noise[:, :5]}) == NOISE_STEPS  # fresh noise each step


def test_empty_local_batch(results):
    _assert_same_on_ranks(results, "empty")
    x, y = make_data()
    ref = reference("mean", x[: B // 2], y[: B // 2])  # only rank 0's samples, divided by B
    _assert_close(results[0]["empty"], ref)


def test_skipped_physical_batches_on_one_rank(results):
    _assert_same_on_ranks(results, "skip")
    _assert_close(results[0]["skip"], reference("sum"))


def test_torch_ddp_without_grad_sync(results):
    assert results[0]["ddp_local_grad_kept"] and results[1]["ddp_local_grad_kept"]
    _assert_same_on_ranks(results, "ddp")
    _assert_close(results[0]["ddp"], reference("mean"))


def test_sampler_shards_under_torch_distributed(results):
    assert [r["world"] for r in results] == [(0, 2), (1, 2)]
    s0, s1 = results[0]["shard"], results[1]["shard"]
    assert not set(s0) & set(s1) and sorted(s0 + s1) == list(range(21))
    for b0, b1 in zip(results[0]["batches"], results[1]["batches"]):
        assert set(b0) <= set(s0) and set(b1) <= set(s1)
    # same global seed on both ranks, yet independent draws: the masks differ
    masks = [[[i in set(b) for i in r["shard"][:10]] for b in r["batches"]] for r in results]
    assert masks[0] != masks[1]


def test_optimizer_needs_process_group():
    model = GradSampleModule(make_model())
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_dp_optimizer(model, DistributedDPOptimizer)


def test_per_layer_two_ranks_equal_one_process(ddp_results):
    got0, got1 = ddp_results[0]["per_layer"], ddp_results[1]["per_layer"]
    for a, b in zip(got0, got1):
        assert torch.equal(a, b)
    _assert_close(got0, per_layer_reference())
