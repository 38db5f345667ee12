"""Per-layer ghost norms equal the norms of materialised per-sample gradients (float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.grad_sample import GRAD_SAMPLERS, NORM_SAMPLERS
from dptorch.grad_sample import conv as conv_rule
from dptorch.grad_sample import linear as linear_rule
from dptorch.grad_sample.norm_samplers import generic_clipped_sum, ghost_is_cheaper
from dptorch.grad_sample.registry import LAYER_RULES, rule_for

SETTINGS = settings(max_examples=12, deadline=None)


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _check(layer: nn.Module, activations, out_shape, force_ghost: bool | None = None, mp=None):
    """Norm sampler vs materialised norms, and clipped-sum function vs Σ_b c_b grad_b."""
    g = torch.randn(out_shape)
    if force_ghost is not None and mp is not None:
        for mod in (linear_rule, conv_rule):
            mp.setattr(mod, "ghost_is_cheaper", lambda *a: force_ghost)
    want = {p: gs.pow(2).sum(tuple(range(1, gs.dim()))) for p, gs in GRAD_SAMPLERS[type(layer)](layer, activations, g).items()}
    got = NORM_SAMPLERS[type(layer)](layer, activations, g)
    assert set(want) == set(got)
    for p in want:
        torch.testing.assert_close(got[p], want[p], rtol=1e-6, atol=1e-9)
    c = torch.rand(g.shape[0])
    scaled = g * c.view(-1, *[1] * (g.dim() - 1))
    gs = GRAD_SAMPLERS[type(layer)](layer, activations, g)
    fn = LAYER_RULES[type(layer)].clipped_sum
    sums = fn(layer, activations, scaled) if fn else generic_clipped_sum(layer, activations, scaled)
    for p in gs:
        torch.testing.assert_close(sums[p], torch.tensordot(c, gs[p], dims=1), rtol=1e-6, atol=1e-9)


@SETTINGS
@given(b=st.integers(0, 4), t=st.sampled_from([(), (1,), (3,), (2, 3)]), din=st.integers(1, 6),
       dout=st.integers(1, 6), bias=st.booleans(), ghost=st.sampled_from([None, True, False]))
def test_linear(b, t, din, dout, bias, ghost):
    layer = nn.Linear(din, dout, bias=bias)
    with pytest.MonkeyPatch.context() as mp:
        _check(layer, [torch.randn(b, *t, din)], (b, *t, dout), ghost, mp)


@SETTINGS
@given(n=st.sampled_from([1, 2, 3]), b=st.integers(0, 3), groups=st.sampled_from([1, 2]),
       k=st.integers(1, 3), stride=st.integers(1, 2), dilation=st.integers(1, 2),
       padding=st.sampled_from([0, 1, "same"]), mode=st.sampled_from(["zeros", "reflect", "circular"]),
       ghost=st.sampled_from([None, True, False]))
def test_conv(n, b, groups, k, stride, dilation, padding, mode, ghost):
    if padding == "same":
        stride = 1
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[n - 1]
    layer = cls(2 * groups, 2 * groups, k, stride=stride, padding=padding, dilation=dilation,
                groups=groups, padding_mode=mode)
    size = 6 if n < 3 else 5
    x = torch.randn(b, 2 * groups, *[size] * n)
    with torch.no_grad():
        out_shape = layer(torch.randn(1, *x.shape[1:])).shape[1:]
    with pytest.MonkeyPatch.context() as mp:
        _check(layer, [x], (b, *out_shape), ghost, mp)


@SETTINGS
@given(b=st.integers(0, 4), s=st.sampled_from([(1,), (4,), (2, 3)]), vocab=st.integers(2, 6),
       pad=st.sampled_from([None, 0]), freq=st.booleans())
def test_embedding(b, s, vocab, pad, freq):
    layer = nn.Embedding(vocab, 3, padding_idx=pad, scale_grad_by_freq=freq)
    ids = torch.randint(0, vocab, (b, *s))  # small vocab: many repeated indices
    _check(layer, [ids], (b, *s, 3))


@SETTINGS
@given(b=st.integers(1, 4), mode=st.sampled_from(["sum", "mean"]), pad=st.sampled_from([None, 1]),
       weighted=st.booleans())
def test_embedding_bag(b, mode, pad, weighted):
    layer = nn.EmbeddingBag(5, 3, mode=mode, padding_idx=pad)
    ids = torch.randint(0, 5, (b, 4))
    w = torch.rand(b, 4) if (weighted and mode == "sum") else None
    g = torch.randn(b, 3)
    want = GRAD_SAMPLERS[nn.EmbeddingBag](layer, [ids, None, w], g)[layer.weight].pow(2).sum((1, 2))
    got = NORM_SAMPLERS[nn.EmbeddingBag](layer, [ids, None, w], g)[layer.weight]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "layer,shape",
    [
        (lambda: nn.LayerNorm(4), (3, 5, 4)),
        (lambda: nn.LayerNorm((2, 4)), (3, 2, 4)),
        (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
        (lambda: nn.RMSNorm(4), (3, 2, 4)),
        (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 4)),
    ],
)
def test_norm_layers(layer, shape):
    layer = layer()
    with torch.no_grad():  # non-trivial affine parameters
        for p in layer.parameters():
            p.normal_()
    _check(layer, [torch.randn(shape)], shape)


def test_sequence_bias():
    from dptorch.layers import SequenceBias

    layer = SequenceBias(4, batch_first=True)
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        out = layer(x)
    _check(layer, [x], out.shape)


def test_cost_model():
    assert ghost_is_cheaper(1, 10, 10)
    assert ghost_is_cheaper(4, 512, 512)
    assert not ghost_is_cheaper(196, 64, 16)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["linear", "conv1d"]),
    b=st.integers(0, 4),
    t=st.integers(1, 6),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_weighted_clipped_sum_equals_per_sample_sum(kind, b, t, d_in, d_out, bias, seed):
    """A rule's ``weighted_clipped_sum`` (clip factors applied to the smaller of input and
    output gradient) is ``Σ_b c_b grad_b`` of the materialised per-sample gradients, for every
    parameter, the bias included."""
    torch.manual_seed(seed)
    if kind == "linear":
        layer = nn.Linear(d_in, d_out, bias=bias)
    else:
        from transformers.pytorch_utils import Conv1D

        layer = Conv1D(d_out, d_in)
        if not bias:
            layer.bias = None
    rule = rule_for(layer)
    a = torch.randn(b, t, d_in)
    g = torch.randn(b, t, d_out)
    c = torch.rand(b)
    got = rule.weighted_clipped_sum(layer, [a], g, c)
    per_sample = rule.grad_sample(layer, [a], g)
    assert set(got) == set(per_sample) == {p for p in layer.parameters()}
    for p, gs in per_sample.items():
        torch.testing.assert_close(got[p], torch.einsum("b,b...->...", c, gs))


def test_derived_fields_follow_their_partner():
    """An optional fast form (``weighted_clipped_sum``, ``factors``) is used only with the rule
    field it was written for: a rule derived from Linear's with its own ``clipped_sum`` or
    ``norm_sq`` does not inherit Linear's, while a rule keeping them (DP recurrent layers'
    ``RNNLinear``) does."""
    from dataclasses import replace

    from dptorch.grad_sample.dp_rnn import RNN_LINEAR_RULE
    from dptorch.grad_sample.registry import derived

    def mine(layer, activations, backprops):
        return {}

    rule = linear_rule.LINEAR_RULE
    assert derived(rule, "weighted_clipped_sum") is rule.weighted_clipped_sum is not None
    assert derived(rule, "factors") is rule.factors is not None
    assert derived(replace(rule, clipped_sum=mine), "weighted_clipped_sum") is None
    assert derived(replace(rule, clipped_sum=mine), "factors") is rule.factors
    assert derived(replace(rule, norm_sq=mine), "factors") is None
    assert derived(RNN_LINEAR_RULE, "weighted_clipped_sum") is rule.weighted_clipped_sum
    assert derived(None, "factors") is None
