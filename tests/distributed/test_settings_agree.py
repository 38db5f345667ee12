"""Ranks must agree on their DP settings (dptorch.distributed_settings), over 2 gloo processes.

One spawned run (:func:`settings_checks`) tries every case on both ranks and records, per case,
``("ok", ...)`` or ``("refused", type, message)``; the tests assert that both ranks refuse with the
same message naming the setting and each rank's value, that a rank whose own checks fail makes the
other one refuse too (instead of waiting on it), and that agreeing ranks still train.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_launch import run_distributed
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dptorch import PrivacyEngine
from dptorch.distributed import DPDDP
from dptorch.distributed_settings import check_settings_agree, settings_must_agree
from dptorch.optimizers import DistributedDPOptimizer


def _engine_case(rank: int, *, batch=(4, 4), clip=(1.0, 1.0), sigma=(1.0, 1.0), epsilon=None,
                 secure=(False, False), clipping="flat", extra=({}, {})) -> tuple:
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    loader = DataLoader(ds, batch_size=batch[rank], sampler=DistributedSampler(ds))
    args = dict(module=DPDDP(net), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                data_loader=loader, max_grad_norm=clip[rank], clipping=clipping, **extra[rank])
    engine = PrivacyEngine(secure_mode=secure[rank])
    try:
        if epsilon is None:
            _, opt, dl = engine.make_private(noise_multiplier=sigma[rank], **args)
        else:
            _, opt, dl = engine.make_private_with_epsilon(
                target_epsilon=epsilon[rank], target_delta=1e-3, epochs=1, **args)
    except (ValueError, TypeError) as e:
        return ("refused", type(e).__name__, str(e))
    return ("ok", dl.batch_sampler.sample_rate, opt.noise_multiplier)


def _optimizer_case(rank: int, *, clip=(1.0, 1.0), ebs=(4, 4), reduction=("mean", "mean")):
    net = nn.Linear(4, 2)
    try:
        DistributedDPOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), noise_multiplier=1.0,
                               max_grad_norm=clip[rank], expected_batch_size=ebs[rank],
                               loss_reduction=reduction[rank])
    except ValueError as e:
        return ("refused", type(e).__name__, str(e))
    return ("ok",)


def settings_checks(rank: int, world_size: int) -> dict:
    warnings.simplefilter("ignore")
    out = {
        "agree": _engine_case(rank),
        "batch": _engine_case(rank, batch=(4, 16)),
        "clip": _engine_case(rank, clip=(1.0, 5.0)),
        "sigma": _engine_case(rank, sigma=(1.0, 0.5)),
        "secure": _engine_case(rank, secure=(False, True)),
        "per_layer": _engine_case(rank, clipping="per_layer", clip=([1.0, 1.0, 1.0, 1.0],
                                                                    [1.0, 1.0, 1.0, 2.0])),
        "epsilon_agree": _engine_case(rank, epsilon=(2.0, 2.0)),
        "epsilon": _engine_case(rank, epsilon=(2.0, 4.0)),
        "reduction": _engine_case(rank, extra=({}, {"loss_reduction": "sum"})),
        # rank 1's own checks fail (unknown keyword): rank 0 must refuse rather than wait
        "local_failure": _engine_case(rank, extra=({}, {"not_an_argument": 1})),
        "opt_agree": _optimizer_case(rank),
        "opt_clip": _optimizer_case(rank, clip=(1.0, 5.0)),
        "opt_ebs": _optimizer_case(rank, ebs=(4, 8)),
        "opt_local_failure": _optimizer_case(rank, reduction=("mean", "avg")),
    }
    # the bare function; a body that fails before agree() on rank 0 only
    try:
        check_settings_agree({"x": rank % 2 == 0}, where="custom")
        out["bare"] = ("ok",)
    except ValueError as e:
        out["bare"] = ("refused", "ValueError", str(e))
    try:
        with settings_must_agree(True, where="custom") as agree:
            if rank == 0:
                raise KeyError("boom")
            agree({"x": 1})
        out["cm"] = ("ok",)
    except (KeyError, ValueError) as e:
        out["cm"] = ("refused", type(e).__name__, str(e))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out_dir = tmp_path_factory.mktemp("settings")
    return run_distributed(settings_checks, out_dir)


def _both_refuse(results, case: str) -> str:
    outcomes = [r[case] for r in results]
    assert all(o[0] == "refused" and o[1] == "ValueError" for o in outcomes), outcomes
    assert outcomes[0][2] == outcomes[1][2], "the ranks must raise the same error"
    return outcomes[0][2]


@pytest.mark.parametrize(
    "case, setting, values",
    [
        ("batch", "sample_rate", ("rank 0: 0.125", "rank 1: 0.5")),
        ("clip", "max_grad_norm", ("rank 0: 1.0", "rank 1: 5.0")),
        ("sigma", "noise_multiplier", ("rank 0: 1.0", "rank 1: 0.5")),
        ("secure", "secure_mode", ("rank 0: False", "rank 1: True")),
        ("per_layer", "max_grad_norm", ("rank 0: (1.0, 1.0, 1.0, 1.0)",
                                        "rank 1: (1.0, 1.0, 1.0, 2.0)")),
        ("epsilon", "target_epsilon", ("rank 0: 2.0", "rank 1: 4.0")),
        ("reduction", "loss_reduction", ("rank 0: 'mean'", "rank 1: 'sum'")),
        ("opt_clip", "max_grad_norm", ("rank 0: 1.0", "rank 1: 5.0")),
        ("opt_ebs", "expected_batch_size", ("rank 0: 4", "rank 1: 8")),
        ("bare", "x", ("rank 0: True", "rank 1: False")),
    ],
)
def test_disagreeing_ranks_all_refuse(results, case, setting, values):
    message = _both_refuse(results, case)
    line = next((ln for ln in message.splitlines() if ln.strip().startswith(setting)), "")
    assert all(v in line for v in values), message


def test_batch_size_mismatch_names_sample_rate_and_expected_batch(results):
    message = _both_refuse(results, "batch")
    assert "expected_batch_size" in message and "batch_size" in message


def test_epsilon_mismatch_also_names_the_computed_sigma(results):
    assert "noise_multiplier" in _both_refuse(results, "epsilon")


def test_agreeing_ranks_train(results):
    for case in ("agree", "epsilon_agree", "opt_agree"):
        assert [r[case][0] for r in results] == ["ok", "ok"], [r[case] for r in results]
    assert results[0]["agree"] == results[1]["agree"] == ("ok", 0.125, 1.0)
    assert results[0]["epsilon_agree"] == results[1]["epsilon_agree"]


@pytest.mark.parametrize("case", ["local_failure", "opt_local_failure", "cm"])
def test_a_rank_failing_its_own_checks_makes_the_others_refuse(results, case):
    r0, r1 = results[0][case], results[1][case]
    failing, other = (r0, r1) if case == "cm" else (r1, r0)
    assert failing[0] == "refused" and other[0] == "refused", (r0, r1)
    assert other[1] == "ValueError"
    failed_rank = 0 if case == "cm" else 1
    assert f"failed on rank(s) {failed_rank}" in other[2], other[2]
    if case == "cm":
        assert failing[1] == "KeyError"  # the failing rank's own exception propagates
