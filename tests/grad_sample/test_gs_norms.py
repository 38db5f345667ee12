"""LayerNorm / GroupNorm / InstanceNorm / RMSNorm per-sample gradients against brute force."""

from __future__ import annotations

import pytest
import torch
from gs_helpers import MODES, assert_grad_samples_match
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

SETTINGS = settings(max_examples=5, deadline=None)
REDUCTIONS = pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
MODE = pytest.mark.parametrize("mode", MODES)
BATCH_FIRST = pytest.mark.parametrize("batch_first", [True, False])


def _sequence_input(batch, middle, normalized, batch_first, seed):
    torch.manual_seed(seed)
    shape = (batch, middle, *normalized) if batch_first else (middle, batch, *normalized)
    return torch.randn(shape, dtype=torch.float64)


def _with_linear_before(norm, last):
    """Parameter-free norms still get tested through the Linear feeding them."""
    return nn.Sequential(nn.Linear(last, last), norm)


@BATCH_FIRST
@REDUCTIONS
@MODE
@SETTINGS
@given(batch=st.integers(1, 3), middle=st.integers(1, 3),
       normalized=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       affine=st.booleans(), bias=st.booleans(), seed=st.integers(0, 99))
def test_layer_norm(mode, loss_reduction, batch_first, batch, middle, normalized, affine, bias,
                    seed):
    if mode == "ew" and not batch_first:
        pytest.skip("ExpandedWeights supports only batch_first=True")
    x = _sequence_input(batch, middle, normalized, batch_first, seed)
    norm = nn.LayerNorm(normalized, elementwise_affine=affine, bias=bias)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    model = norm if affine else _with_linear_before(norm, normalized[-1])
    assert_grad_samples_match(model.double(), (x,), mode, batch_first, loss_reduction)


@BATCH_FIRST
@REDUCTIONS
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@SETTINGS
@given(batch=st.integers(1, 3), middle=st.integers(1, 3),
       normalized=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       affine=st.booleans(), eps=st.sampled_from([None, 1e-5]), seed=st.integers(0, 99))
def test_rms_norm(mode, loss_reduction, batch_first, batch, middle, normalized, affine, eps, seed):
    x = _sequence_input(batch, middle, normalized, batch_first, seed)
    norm = nn.RMSNorm(normalized, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
    model = norm if affine else _with_linear_before(norm, normalized[-1])
    assert_grad_samples_match(model.double(), (x,), mode, batch_first, loss_reduction)


def test_rms_norm_ew_raises_naming_the_layer():
    with pytest.raises(NotImplementedError, match=r"1 \(RMSNorm\)"):
        assert_grad_samples_match(
            _with_linear_before(nn.RMSNorm(3), 3).double(),
            (torch.randn(2, 3, dtype=torch.float64),), "ew",
        )


@BATCH_FIRST
@REDUCTIONS
@MODE
@SETTINGS
@given(batch=st.integers(1, 3), groups=st.integers(1, 3), per_group=st.integers(1, 2),
       spatial=st.lists(st.integers(1, 4), min_size=0, max_size=2), seed=st.integers(0, 99))
def test_group_norm(mode, loss_reduction, batch_first, batch, groups, per_group, spatial, seed):
    if not batch_first:
        pytest.skip("GroupNorm requires its batch at dim 0; batch_first=False cannot describe it")
    if per_group * torch.Size(spatial).numel() == 1:
        spatial = [2]  # torch refuses groups holding a single value
    torch.manual_seed(seed)
    norm = nn.GroupNorm(groups, groups * per_group)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(batch, groups * per_group, *spatial, dtype=torch.float64)
    assert_grad_samples_match(norm.double(), (x,), mode, batch_first, loss_reduction)


@BATCH_FIRST
@REDUCTIONS
@MODE
@pytest.mark.parametrize("n", [1, 2, 3])
@settings(max_examples=3, deadline=None)
@given(batch=st.integers(1, 3), channels=st.integers(1, 3), size=st.integers(2, 3),
       track=st.booleans(), seed=st.integers(0, 99))
def test_instance_norm(n, mode, loss_reduction, batch_first, batch, channels, size, track, seed):
    if not batch_first:
        pytest.skip("InstanceNorm requires its batch at dim 0; batch_first=False cannot describe it")
    if mode == "functorch":
        track = False  # vmap cannot update running stats in place (torch limitation)
    torch.manual_seed(seed)
    cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[n]
    norm = cls(channels, affine=True, track_running_stats=track)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(batch, channels, *([size] * n), dtype=torch.float64)
    assert_grad_samples_match(norm.double(), (x,), mode, batch_first, loss_reduction)
