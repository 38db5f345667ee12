"""Every layer rule is complete, and every registered layer type is exact in every mode.

Adding a layer rule without an entry in ``EXAMPLES`` fails :func:`test_every_rule_has_an_example`;
an entry then runs the layer through hooks, functorch, ghost and bk (and per-layer bk) against
the brute-force reference, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import LAYER_RULES, LayerRule
from dptorch.grad_sample.registry import (
    GRAD_SAMPLERS,
    RULE_FIELDS,
    qualified_name,
    register_layer_rule,
)
from dptorch.layers.dp_multihead_attention import SequenceBias
from dptorch.layers.dp_rnn import RNNLinear

from .invariants import assert_exact_or_refused, variant_bounds

BUILTIN = dict(LAYER_RULES)


class Pair(nn.Module):
    """Feeds the two halves of the last dimension of ``x`` to a two-input layer."""

    def __init__(self, layer: nn.Bilinear):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        d1 = self.layer.in1_features
        return self.layer(x[..., :d1], x[..., d1:])


def _hf_conv1d(nf, nx):
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)


def _name(t) -> str:
    return t if isinstance(t, str) else t.__name__


def _ids(*shape, high=7):
    return torch.randint(0, high, shape)


# layer type -> [(model, x, output shape)], built in float64 inside the test
EXAMPLES = {
    nn.Linear: [
        lambda: (nn.Linear(4, 3), torch.randn(5, 4)),
        lambda: (nn.Linear(3, 2), torch.randn(5, 6, 3)),  # T > d: instantiated
    ],
    RNNLinear: [lambda: (RNNLinear(4, 3), torch.randn(5, 2, 4))],
    nn.Bilinear: [
        lambda: (Pair(nn.Bilinear(3, 2, 4)), torch.randn(5, 5)),
        lambda: (Pair(nn.Bilinear(2, 2, 2)), torch.randn(5, 9, 4)),  # T·Σd > Πd: instantiated
        lambda: (Pair(nn.Bilinear(3, 4, 2, bias=False)), torch.randn(5, 2, 3, 7)),
        # a layer before it: bk's input-gradient-only forward must pass exact input gradients
        lambda: (nn.Sequential(nn.Linear(4, 5), Pair(nn.Bilinear(2, 3, 2))), torch.randn(5, 2, 4)),
    ],
    nn.Conv1d: [lambda: (nn.Conv1d(2, 3, 3, padding=1), torch.randn(4, 2, 6))],
    nn.Conv2d: [lambda: (nn.Conv2d(2, 4, 2, groups=2, stride=2), torch.randn(4, 2, 5, 5))],
    nn.Conv3d: [lambda: (nn.Conv3d(1, 2, 2), torch.randn(3, 1, 3, 3, 3))],
    nn.Embedding: [lambda: (nn.Embedding(7, 3, padding_idx=0), _ids(5, 4))],
    nn.EmbeddingBag: [lambda: (nn.EmbeddingBag(7, 3, mode="mean"), _ids(5, 4))],
    nn.LayerNorm: [lambda: (nn.LayerNorm(4), torch.randn(5, 3, 4))],
    nn.GroupNorm: [lambda: (nn.GroupNorm(2, 4), torch.randn(5, 4, 3))],
    nn.RMSNorm: [lambda: (nn.RMSNorm(4), torch.randn(5, 3, 4))],
    nn.InstanceNorm1d: [lambda: (nn.InstanceNorm1d(3, affine=True), torch.randn(5, 3, 4))],
    nn.InstanceNorm2d: [lambda: (nn.InstanceNorm2d(2, affine=True), torch.randn(5, 2, 3, 3))],
    nn.InstanceNorm3d: [lambda: (nn.InstanceNorm3d(2, affine=True), torch.randn(4, 2, 2, 2, 3))],
    SequenceBias: [lambda: (SequenceBias(3, batch_first=True), torch.randn(5, 2, 3))],
    "transformers.pytorch_utils.Conv1D": [
        lambda: (_hf_conv1d(3, 4), torch.randn(5, 4)),
        lambda: (nn.Sequential(nn.Linear(3, 2), _hf_conv1d(2, 2)), torch.randn(5, 6, 3)),
    ],
}


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("layer_type", list(BUILTIN), ids=_name)
def test_rule_is_complete(layer_type):
    rule = BUILTIN[layer_type]
    assert rule.grad_sample is not None, "a rule needs at least the per-sample gradient"
    assert rule.missing() == [], f"{_name(layer_type)}: set or declare generic {rule.missing()}"
    for name, why in rule.generic.items():
        assert getattr(rule, name) is None, f"{name} is both set and declared generic"
        assert isinstance(why, str) and why.strip()


def test_missing_lists_unset_fields():
    def fn(layer, activations, backprops):
        return {}

    rule = LayerRule(grad_sample=fn, generic={"prefer_ghost": "never"})
    assert rule.missing() == ["norm_sq", "clipped_sum", "input_grad_only"]
    with pytest.raises(ValueError, match="unknown fields"):
        register_layer_rule(Pair, LayerRule(grad_sample=fn, generic={"norms": "typo"}))
    assert Pair not in LAYER_RULES


def test_every_rule_has_an_example():
    assert set(BUILTIN) == set(EXAMPLES), (
        "add an example for each new layer rule (and remove those of removed rules): "
        f"missing {set(BUILTIN) - set(EXAMPLES)}, stale {set(EXAMPLES) - set(BUILTIN)}"
    )


def test_opacus_tables_are_views_of_the_rules():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    def gs(layer, activations, backprops):
        return {layer.w: (activations[0] * backprops).flatten(1, -2).sum(1)}

    GRAD_SAMPLERS[Scale] = gs
    try:
        assert LAYER_RULES[Scale].grad_sample is gs and Scale in GRAD_SAMPLERS
        assert set(LAYER_RULES[Scale].missing()) == set(RULE_FIELDS) - {"grad_sample"}
    finally:
        del GRAD_SAMPLERS[Scale]
    assert Scale not in LAYER_RULES


CASES = [(t, i) for t, fs in EXAMPLES.items() for i in range(len(fs))]


@pytest.mark.parametrize("variant", ["hooks", "functorch", "ghost", "bk", "bk-per_layer"])
@pytest.mark.parametrize(
    "layer_type,i", CASES, ids=[f"{_name(t).rsplit('.', 1)[-1]}{i}" for t, i in CASES]
)
def test_rule_exact_in_every_mode(layer_type, i, variant):
    torch.manual_seed(i)
    layer, x = EXAMPLES[layer_type][i]()
    model = layer.double() if isinstance(layer, nn.Module) else layer
    with torch.no_grad():
        for p in model.parameters():  # non-trivial affine parameters
            p.add_(0.3 * torch.randn_like(p))
    y = torch.randn_like(model(x))
    assert any(layer_type in (type(m), qualified_name(type(m))) for m in model.modules())
    for c in (1e3, 0.05):  # unclipped, and every sample clipped
        assert_exact_or_refused(
            model, variant, x, y, variant_bounds(model, variant, c), must_work=True
        )
