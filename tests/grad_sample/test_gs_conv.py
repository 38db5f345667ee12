"""Conv1d/2d/3d per-sample gradients against brute force, in every mode, hypothesis-drawn."""

from __future__ import annotations

import pytest
import torch
from gs_helpers import MODES, assert_grad_samples_match
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.utils.tensor_utils import unfold_nd

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


@st.composite
def conv_cases(draw, n: int):
    groups = draw(st.sampled_from([1, 2]))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    k = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dil = tuple(draw(st.integers(1, 2)) for _ in range(n))
    padding = draw(st.sampled_from(["same", "valid", 0, 1, 2]))
    stride = 1 if padding == "same" else tuple(draw(st.integers(1, 2)) for _ in range(n))
    padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    bias = draw(st.booleans())
    extra = draw(st.integers(0, 2 if n == 3 else 3))
    sizes = tuple(max(3, d * (kk - 1) + 1) + extra for kk, d in zip(k, dil))
    batch = draw(st.integers(1, 3))
    layer = CONVS[n](c_in, c_out, k, stride=stride, padding=padding, dilation=dil,
                     groups=groups, bias=bias, padding_mode=padding_mode)
    return layer, (batch, c_in, *sizes)


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 2, 3])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_conv_matches_brute_force(n, mode, loss_reduction, data):
    layer, shape = data.draw(conv_cases(n))
    torch.manual_seed(0)
    layer = layer.double()
    x = torch.randn(shape, dtype=torch.float64)
    if mode == "ew" and n == 3 and layer.dilation != (1, 1, 1):
        with pytest.raises(NotImplementedError, match="Conv3d with dilation"):
            assert_grad_samples_match(layer, (x,), mode, loss_reduction=loss_reduction)
        return
    assert_grad_samples_match(layer, (x,), mode, loss_reduction=loss_reduction)


def test_conv_in_a_network_with_frozen_first_layer():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2, stride=2),
        nn.Flatten(), nn.Linear(16, 3),
    ).double()
    model[0].requires_grad_(False)
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    for mode in MODES:
        assert_grad_samples_match(model, (x,), mode, loss_reduction="mean")


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 3), k=st.integers(1, 3), s=st.integers(1, 3), d=st.integers(1, 2),
    p=st.integers(0, 2), size=st.integers(5, 7), c=st.integers(1, 2),
)
def test_unfold_nd_matches_conv(n, k, s, d, p, size, c):
    """conv(x, w) == w_flat @ unfold(x): an independent check of the im2col layout."""
    torch.manual_seed(0)
    x = torch.randn(2, c, *([size] * n), dtype=torch.float64)
    w = torch.randn(3, c, *([k] * n), dtype=torch.float64)
    conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d,
            3: torch.nn.functional.conv3d}[n]
    ref = conv(x, w, stride=s, padding=p, dilation=d)
    cols = unfold_nd(x, k, padding=p, stride=s, dilation=d)
    got = (w.reshape(3, -1) @ cols).reshape(ref.shape)
    torch.testing.assert_close(got, ref)


@settings(max_examples=15, deadline=None)
@given(
    stride=st.integers(1, 2), dilation=st.integers(1, 2), groups=st.sampled_from([1, 2]),
    padding=st.sampled_from([0, 1, "same"]), mode=st.sampled_from(["zeros", "reflect"]),
    bias=st.booleans(), b=st.integers(1, 4),
)
def test_convolution2d_backward_as_a_convolution_matches_brute_force(
    stride, dilation, groups, padding, mode, bias, b
):
    """Opacus's alternative Conv2d sampler (batch folded into groups) against one-sample-at-a-
    time autograd in float64."""
    from dptorch.grad_sample.conv import convolution2d_backward_as_a_convolution

    assume(padding != "same" or stride == 1)  # torch refuses padding="same" with stride > 1
    torch.manual_seed(0)
    layer = nn.Conv2d(4, 6, 3, stride=stride, dilation=dilation, groups=groups, padding=padding,
                      padding_mode=mode, bias=bias).double()
    x = torch.randn(b, 4, 9, 8, dtype=torch.float64)
    g = torch.randn_like(layer(x))
    got = convolution2d_backward_as_a_convolution(layer, [x], g)
    params = [p for p in layer.parameters()]
    assert set(got) == set(params)
    for i in range(b):
        want = torch.autograd.grad((layer(x[i : i + 1]) * g[i : i + 1]).sum(), params)
        for p, w in zip(params, want):
            torch.testing.assert_close(got[p][i], w)


@settings(max_examples=10, deadline=None)
@given(
    stride=st.integers(1, 2), groups=st.sampled_from([1, 2]), padding=st.sampled_from([0, 1]),
    mode=st.sampled_from(["zeros", "circular"]), bias=st.booleans(), b=st.integers(0, 3),
)
def test_folded_path_is_exact(stride, groups, padding, mode, bias, b):
    """A Conv2d with few output channels and large receptive fields per group takes the
    batch-folded grouped convolution (faster there) for its per-sample gradients and norms;
    both equal one-sample-at-a-time autograd in float64."""
    from dptorch.grad_sample import conv as conv_rule

    torch.manual_seed(1)
    c_in = 16 * groups  # receptive field 16 * 9 = 144 values per group
    layer = nn.Conv2d(c_in, 6, 3, stride=stride, groups=groups, padding=padding,
                      padding_mode=mode, bias=bias).double()
    x = torch.randn(b, c_in, 9, 10, dtype=torch.float64)
    g = torch.randn(b, *layer(x[:1].new_zeros(1, *x.shape[1:])).shape[1:], dtype=torch.float64)
    assert conv_rule._folding_is_faster(layer)
    assert not conv_rule._folding_is_faster(nn.Conv2d(c_in, 128 * groups, 3, groups=groups))
    assert not conv_rule._folding_is_faster(nn.Conv2d(3, 6, 3))
    got = conv_rule.compute_conv_grad_sample(layer, [x], g)
    norms = conv_rule.compute_conv_norm_sq_sample(layer, [x], g)
    params = [p for p in layer.parameters()]
    for i in range(b):
        want = torch.autograd.grad((layer(x[i : i + 1]) * g[i : i + 1]).sum(), params)
        for p, w in zip(params, want):
            torch.testing.assert_close(got[p][i], w)
            torch.testing.assert_close(norms[p][i], w.pow(2).sum())
    assert all(got[p].shape == (b, *p.shape) for p in params)
