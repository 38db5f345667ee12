"""The per-step lookups that are cached or computed by a faster path give what the plain
computation gives, and are recomputed when what they depend on changes (re-wrapping, freezing,
a new layer rule, a module added after wrapping)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from dptorch import GradSampleModule
from dptorch.grad_sample.grad_sample_module_bk import GradSampleModuleBookKeeping
from dptorch.grad_sample.registry import LAYER_RULES, LayerRule, register_layer_rule, rule_for
from dptorch.grad_sample.unit_params import module_parameters, own_parameters
from dptorch.optimizers import DPOptimizer


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w


class _HidesParams(nn.Module):
    """Overrides the traversal: ``parameters()`` must be used as is."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def named_parameters(self, *args, **kwargs):
        yield from self.a.named_parameters(*args, **kwargs)


def _models() -> list[nn.Module]:
    shared = nn.Linear(3, 3)
    tied_a, tied_b = nn.Linear(3, 3), nn.Linear(3, 3)
    tied_b.weight = tied_a.weight
    bias_twice = nn.Linear(3, 3)
    bias_twice.register_parameter("bias_alias", bias_twice.bias)
    deep = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.LayerNorm(2))), nn.GRU(2, 2))
    return [
        nn.Linear(2, 2),
        nn.Sequential(shared, nn.ReLU(), shared, nn.Sequential(shared)),
        nn.Sequential(tied_a, tied_b),
        bias_twice,
        deep,
        nn.Sequential(parametrizations.weight_norm(nn.Linear(3, 3))),
        nn.MultiheadAttention(4, 2),
        nn.Sequential(_HidesParams(), nn.Linear(2, 2)),
        _HidesParams(),
    ]


@pytest.mark.parametrize("model", _models(), ids=lambda m: type(m).__name__)
def test_module_parameters_is_parameters(model):
    assert [id(p) for p in module_parameters(model)] == [id(p) for p in model.parameters()]
    for m in model.modules():
        assert [id(p) for p in own_parameters(m)] == [id(p) for p in m.parameters(recurse=False)]


def test_module_parameters_sees_modules_added_and_replaced():
    model = nn.Sequential(nn.Linear(2, 2))
    before = module_parameters(model)
    model.append(nn.Linear(2, 2))
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    after = module_parameters(model)
    assert [id(p) for p in after] == [id(p) for p in model.parameters()]
    assert len(after) == len(before) + 2 and after[0] is not before[0]


def _optimizer(params) -> DPOptimizer:
    return DPOptimizer(
        torch.optim.SGD(params, lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
        expected_batch_size=4,
    )


def test_optimizer_records_follow_wrapping():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = _optimizer(model.parameters())
    assert opt.records == []
    gsm = GradSampleModule(model)
    assert len(opt.records) == 1 and opt.records[0] is gsm.record
    gsm.to_standard_module()
    assert opt.records == []
    gsm2 = GradSampleModule(model)
    assert len(opt.records) == 1 and opt.records[0] is gsm2.record
    opt.records.clear()  # a copy: the cache is not changed by the caller
    assert opt.records[0] is gsm2.record


def test_optimizer_records_follow_frozen_and_new_params():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    gsm = GradSampleModule(model)
    opt = _optimizer(model.parameters())
    assert opt.records == [gsm.record]
    for p in model.parameters():
        p.requires_grad_(False)
    assert opt.records == []
    model[0].weight.requires_grad_(True)
    assert opt.records == [gsm.record]
    extra = nn.Linear(3, 3)
    opt.add_param_group({"params": extra.parameters()})
    assert opt.records == [gsm.record]  # the new parameters are not wrapped
    other = GradSampleModule(extra)
    assert {id(r) for r in opt.records} == {id(gsm.record), id(other.record)}


def test_rule_for_sees_rule_changes():
    class Fresh(nn.Module):
        pass

    layer = Fresh()
    assert rule_for(layer) is None
    rule = register_layer_rule(Fresh, LayerRule(grad_sample=lambda *a: {}))
    try:
        assert rule_for(layer) is rule
        replacement = LayerRule(norm_sq=lambda *a: {})
        LAYER_RULES[Fresh] = replacement
        assert rule_for(layer) is replacement
        rule_by_name = LayerRule(clipped_sum=lambda *a: {})
        del LAYER_RULES[Fresh]
        assert rule_for(layer) is None
        LAYER_RULES.update({f"{Fresh.__module__}.{Fresh.__qualname__}": rule_by_name})
        assert rule_for(layer) is rule_by_name
    finally:
        LAYER_RULES.pop(Fresh, None)
        LAYER_RULES.pop(f"{Fresh.__module__}.{Fresh.__qualname__}", None)
    assert rule_for(layer) is None


def test_sampled_params_follow_unfreezing():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    gsm = GradSampleModuleBookKeeping(model, max_grad_norm=1.0)
    assert gsm.sampled_params(model[0]) == (model[0].bias,)
    model[0].weight.requires_grad_(True)
    gsm(torch.randn(4, 3)).sum().backward()
    assert gsm.sampled_params(model[0]) == (model[0].weight, model[0].bias)
    assert gsm.sampled_ids(model[0]) == {id(model[0].weight), id(model[0].bias)}
    assert model[0].weight.grad is not None


def test_scale_rule_via_table_is_seen_after_wrapping():
    """A grad sampler registered after the model was wrapped is used at the next pass."""
    from dptorch.grad_sample import GRAD_SAMPLERS

    model = nn.Sequential(_Scale())
    gsm = GradSampleModule(model, strict=False)
    x = torch.randn(4, 3)
    gsm(x).sum().backward()
    functorch_gs = model[0].w.grad_sample.clone()
    gsm.zero_grad()
    calls = []

    def sampler(layer, activations, backprops):
        calls.append(1)
        return {layer.w: activations[0] * backprops}

    GRAD_SAMPLERS[_Scale] = sampler
    try:
        gsm(x).sum().backward()
        assert calls and torch.allclose(model[0].w.grad_sample, functorch_gs)
    finally:
        del GRAD_SAMPLERS[_Scale]
