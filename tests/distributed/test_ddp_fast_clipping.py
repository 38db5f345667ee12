"""The fast-clipping optimizers over 2 gloo processes (``grad_sample_mode="bk"`` / ``"ghost"``,
results from the shared run of conftest.ddp_results): 2 ranks x B/2 give the single-process
update of the same mode and of hooks mode, noise is drawn once for the world, make_private on
DDP / DPDDP picks the distributed fast-clipping optimizer and trains with the single-process
epsilon, and per-layer clipping works with bk."""

from __future__ import annotations

import math

import pytest
import torch
from ddp_fast_workers import (
    FAST_C,
    FAST_NOISE_STEPS,
    FAST_NORMS,
    FAST_SIGMA,
    B,
    fast_data,
    fast_reference,
)
from ddp_workers import EPOCHS, N_TRAIN, TRAIN_BATCH, single_process_training

from dptorch.grad_sample import wrap_model
from dptorch.optimizers import get_optimizer_class


def _results(ddp_results, key: str) -> list[dict]:
    for r in ddp_results:
        if f"{key}_error" in r:
            pytest.fail(f"distributed {key} checks failed:\n" + r[f"{key}_error"])
    return [r[key] for r in ddp_results]


@pytest.fixture(scope="module")
def fast(ddp_results) -> list[dict]:
    return _results(ddp_results, "fast")


@pytest.fixture(scope="module")
def fast_training(ddp_results) -> list[dict]:
    return _results(ddp_results, "fast_training")


def _close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


def _same_on_ranks(fast: list[dict], key: str) -> list[torch.Tensor]:
    (name0, g0), (name1, g1) = fast[0][key], fast[1][key]
    assert name0 == name1
    for a, b in zip(g0, g1):
        assert torch.equal(a, b), f"{key}: ranks disagree"
    return g0


EXPECTED_CLASS = {
    "flat": "DistributedDPOptimizerFastGradientClipping",
    "per_layer": "DistributedDPPerLayerOptimizerFastGradientClipping",
}


@pytest.mark.parametrize(
    "case",
    [
        "bk/dpddp",
        "bk/ddp",
        "bk/ddp_by_hand",
        "ghost/dpddp",
        "ghost/ddp",
        "ghost/ddp_by_hand",
        "bk_per_layer/dpddp",
        "bk_per_layer/ddp",
    ],
)
def test_two_ranks_equal_one_process(fast, case):
    """2 ranks x B/2 == 1 process x B in the same mode == hooks mode (materialised per-sample
    gradients), sigma = 0; ``*/ddp`` went through make_private on torch DDP, ``*/ddp_by_hand``
    wrapped torch DDP by hand (its gradient sync left on)."""
    mode, _ = case.split("/")
    clipping = "per_layer" if mode.endswith("per_layer") else "flat"
    mode = mode.removesuffix("_per_layer")
    assert fast[0][case][0] == EXPECTED_CLASS[clipping]
    got = _same_on_ranks(fast, case)
    same_mode = fast_reference(mode, clipping)
    hooks = fast_reference("hooks", clipping)
    _close(same_mode, hooks)  # the single-process reference itself
    _close(got, same_mode)
    _close(got, hooks)
    assert all(g.abs().sum() > 0 for g in got)  # every parameter is reached
    if case.endswith("by_hand"):  # wrapping switched DDP's backward all-reduce off
        assert fast[0][f"{case}_sync"] is False and fast[1][f"{case}_sync"] is False


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_empty_local_batch(fast, mode):
    got = _same_on_ranks(fast, f"{mode}/empty")
    x, y = fast_data()
    _close(got, fast_reference("hooks", x=x[: B // 2], y=y[: B // 2]))  # rank 0's samples / B


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_skipped_physical_batch_on_one_rank(fast, mode):
    got = _same_on_ranks(fast, f"{mode}/skip")
    _close(got, fast_reference("hooks", reduction="sum"))


@pytest.mark.parametrize("case", ["bk", "ghost", "bk_per_layer"])
def test_noise_added_once_for_the_world(fast, case):
    noisy0, noisy1 = fast[0][f"noisy/{case}"], fast[1][f"noisy/{case}"]
    assert torch.equal(noisy0, noisy1), "ranks must hold the same noised gradient"
    clipping = "per_layer" if case == "bk_per_layer" else "flat"
    clean = torch.cat([g.flatten() for g in fast_reference("hooks", clipping)])
    noise = noisy0 - clean
    total_c = math.sqrt(sum(c * c for c in FAST_NORMS)) if clipping == "per_layer" else FAST_C
    expected = FAST_SIGMA * total_c / B
    std = noise.std().item()
    # 40 steps x 127 coordinates: relative standard error ~1%; sqrt(2) or 0 would be far off
    assert abs(std / expected - 1) < 0.08, f"noise std {std:.4g}, expected {expected:.4g}"
    assert abs(noise.mean().item()) < 4 * expected / noise.numel() ** 0.5
    assert len({tuple(r.tolist()) for r in noise[:, :5]}) == FAST_NOISE_STEPS


@pytest.mark.parametrize("case", ["bk/ddp", "bk/dpddp", "ghost/ddp"])
def test_make_private_trains(fast_training, case):
    r0, r1 = fast_training[0][case], fast_training[1][case]
    assert r0["optimizer"] == "DistributedDPOptimizerFastGradientClipping"
    assert r0["gsm"] == (
        "GradSampleModuleBookKeeping" if case.startswith("bk") else "GradSampleModuleFastGradientClipping"
    )
    assert r0["expected_batch_size"] == pytest.approx(TRAIN_BATCH / 2)  # per rank
    losses = r0["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert r0["losses"] == r1["losses"]
    assert torch.equal(r0["params"], r1["params"])
    assert r0["history"] == r1["history"] and r0["eps"] == r1["eps"]
    if r0["history"]:
        assert sum(h[-1] for h in r0["history"]) == EPOCHS * round(N_TRAIN / TRAIN_BATCH)


@pytest.fixture(scope="module")
def single_process():
    return single_process_training()


@pytest.mark.parametrize("case", ["bk/ddp", "bk/dpddp", "ghost/ddp"])
def test_make_private_epsilon_matches_single_process(fast_training, single_process, case):
    eps = fast_training[0][case]["eps"]
    assert math.isfinite(eps) and eps > 0
    assert eps == pytest.approx(single_process["eps"], rel=1e-12)


def test_per_layer_ghost_is_refused():
    """Per-layer clipping needs bk: ghost's second backward pass weights whole sample losses."""
    for distributed in (False, True):
        with pytest.raises(ValueError, match="Unsupported combination"):
            get_optimizer_class("per_layer", distributed, "ghost")
    with pytest.raises(ValueError, match="grad_sample_mode='bk'"):
        wrap_model(torch.nn.Linear(2, 2), "ghost", max_grad_norm=[1.0, 1.0])
