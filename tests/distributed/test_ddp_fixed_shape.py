"""DDP with fixed-shape Poisson batches (2 gloo processes): every rank's batch has the same
constant shape, and the released gradient equals the float64 brute force over both ranks'
drawn records (padding rows contribute nothing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ddp_workers import FIXED_M, N_TRAIN, TRAIN_BATCH, TRAIN_C, train_model


@pytest.fixture(scope="module", params=["hooks", "bk"])
def fixed(ddp_results, request) -> list[dict]:
    key = f"fixed_shape_{request.param}"
    for r in ddp_results:
        if f"{key}_error" in r:
            pytest.fail("distributed fixed-shape run failed:\n" + r[f"{key}_error"])
    return [r[key] for r in ddp_results]


def test_every_rank_has_the_same_constant_shape(fixed):
    for r in fixed:
        assert r["sampler"] == "DistributedFixedShapePoissonSampler"
        assert {s["rows"] for s in r["steps"]} == {FIXED_M // 2}
    # the regime of the test: padding rows in some local batches
    assert any(len(s["x"]) < s["rows"] for r in fixed for s in r["steps"])


def test_released_gradient_is_the_clipped_sum_of_both_ranks_real_rows(fixed):
    model = train_model().double()
    params = list(model.parameters())
    q = TRAIN_BATCH / N_TRAIN
    for step in range(len(fixed[0]["steps"])):
        x = torch.cat([r["steps"][step]["x"] for r in fixed])
        y = torch.cat([r["steps"][step]["y"] for r in fixed])
        total = [torch.zeros_like(p) for p in params]
        for i in range(len(x)):
            grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
            norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            f = min(1.0, TRAIN_C / (float(norm) + 1e-6))
            for t, g in zip(total, grads):
                t += f * g
        expected = [t / (q * N_TRAIN) for t in total]
        for r in fixed:
            for got, exp in zip(r["steps"][step]["grads"], expected):
                torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-12)
