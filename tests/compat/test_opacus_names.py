"""Behaviour of the Opacus names dptorch provides on top of its own mechanisms."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data._utils.collate import default_collate

from dptorch.data_loader import CollateFnWithEmpty, dtype_safe, shape_safe, wrap_collate_with_empty
from dptorch.grad_sample import GradSampleModule, prepare_module, wrap_model
from dptorch.grad_sample.conv import compute_conv_grad_sample
from dptorch.grad_sample.dp_rnn import compute_rnn_linear_grad_sample
from dptorch.grad_sample.embedding import (
    compute_embedding_grad_sample,
    compute_embedding_norm_sample,
    compute_embeddingbag_grad_sample,
    compute_embeddingbag_gradsampler,
)
from dptorch.grad_sample.embedding_norm_sample import (
    compute_embedding_norm_sample as compute_embedding_norm_sample_2,
)
from dptorch.grad_sample.functorch import make_functional, prepare_layer
from dptorch.grad_sample.grad_sample_module import (
    create_or_accumulate_grad_sample,
    promote_current_grad_sample,
)
from dptorch.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS
from dptorch.grad_sample.linear import compute_linear_grad_sample, compute_linear_norm_sample
from dptorch.grad_sample.registry import GRAD_SAMPLERS
from dptorch.layers.dp_rnn import RNNLinear
from dptorch.optimizers import DPOptimizer
from dptorch.optimizers.utils import params
from dptorch.utils.tensor_utils import unfold2d, unfold3d


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 2)))


def _has_any_attr(p):
    return [a for a in OPACUS_PARAM_MONKEYPATCH_ATTRS if hasattr(p, a)]


# ------------------------------------------------------------------------------- zero_grad
def test_zero_grad_defaults_zero_the_grads_and_drop_grad_samples():
    gsm = GradSampleModule(_model())
    gsm(torch.randn(5, 4)).sum().backward()
    gsm.zero_grad()
    for p in gsm.parameters():
        assert p.grad is not None and not p.grad.any()
        assert p.grad_sample is None  # Opacus: None, not a deleted attribute
    gsm.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in gsm.parameters())


@pytest.mark.parametrize("set_to_none", [False, True])
def test_dp_steps_with_zeroed_grads_and_an_unreached_parameter(set_to_none):
    """A parameter reached by the first step but not by the second keeps zeros (not None)
    after ``zero_grad()``: it is not a gradient without per-sample gradients."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x, use_b=True):
            return self.a(x) + (self.b(x) if use_b else 0)

    torch.manual_seed(0)
    gsm = GradSampleModule(Two())
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=3,
    )
    for use_b in (True, False):
        gsm(torch.randn(3, 4), use_b=use_b).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none) if set_to_none else opt.zero_grad()
    b_grad = gsm.b.weight.grad
    assert (b_grad is None) if set_to_none else not b_grad.any()


def test_bk_mode_same_update_with_zeroed_or_none_grads():
    from dptorch.optimizers import get_optimizer_class

    torch.manual_seed(0)
    model = _model()
    data = [(torch.randn(4, 4), torch.randn(4, 2)) for _ in range(3)]
    results = []
    for set_to_none in (False, True):
        gsm = wrap_model(copy.deepcopy(model), "bk", max_grad_norm=0.5, loss_reduction="sum")
        opt = get_optimizer_class("flat", False, "bk")(
            torch.optim.SGD(gsm.parameters(), lr=0.1),
            noise_multiplier=0.0,
            max_grad_norm=0.5,
            expected_batch_size=4,
            loss_reduction="sum",
        )
        for x, y in data:
            ((gsm(x) - y) ** 2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none)
        results.append([p.detach().clone() for p in gsm.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------- GradSampleModule names
def test_cleanup_removes_hooks_and_attributes():
    model = _model()
    gsm = GradSampleModule(model)
    gsm(torch.randn(5, 4)).sum().backward()
    assert all(_has_any_attr(p) for p in model.parameters())
    gsm.cleanup()
    assert not any(_has_any_attr(p) for p in model.parameters())
    model(torch.randn(5, 4)).sum().backward()  # no hooks left
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


@pytest.mark.parametrize("mode", ["ew", "no_op"])
def test_cleanup_of_other_modes(mode):
    model = _model()
    gsm = wrap_model(model, mode)
    x = torch.randn(5, 4)
    gsm(x).sum().backward()
    # ew computes per-sample gradients; no_op leaves them to the user
    assert all(
        (getattr(p, "grad_sample", None) is not None) == (mode == "ew")
        for p in model.parameters()
    )
    gsm.cleanup()
    gsm.remove_hooks()  # idempotent
    model(torch.randn(5, 4)).sum().backward()
    assert not any(_has_any_attr(p) for p in model.parameters())


def test_set_grad_sample_to_none():
    gsm = GradSampleModule(_model())
    gsm(torch.randn(5, 4)).sum().backward()
    gsm.set_grad_sample_to_none()
    assert all(p.grad_sample is None for p in gsm.parameters())
    gsm(torch.randn(2, 4)).sum().backward()  # a fresh pass publishes a fresh tensor
    assert all(p.grad_sample.shape[0] == 2 for p in gsm.parameters())


def test_iterate_submodules_yields_trainable_owners():
    model = _model()
    model[0].bias.requires_grad_(False)
    model[2][0].requires_grad_(False)
    gsm = GradSampleModule(model)
    assert list(gsm.iterate_submodules(model)) == [model[0]]
    assert len(gsm.autograd_grad_sample_hooks) == 1


def test_create_or_accumulate_and_promote():
    p = nn.Parameter(torch.zeros(3))
    create_or_accumulate_grad_sample(param=p, grad_sample=torch.ones(2, 3), max_batch_len=4)
    assert p._current_grad_sample.shape == (4, 3)
    create_or_accumulate_grad_sample(param=p, grad_sample=torch.ones(4, 3), max_batch_len=4)
    torch.testing.assert_close(p._current_grad_sample[:, 0], torch.tensor([2.0, 2.0, 1.0, 1.0]))
    promote_current_grad_sample(p)
    assert not hasattr(p, "_current_grad_sample") and p.grad_sample.shape == (4, 3)
    create_or_accumulate_grad_sample(param=p, grad_sample=torch.ones(4, 3), max_batch_len=4)
    promote_current_grad_sample(p)
    assert isinstance(p.grad_sample, list) and len(p.grad_sample) == 2
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    create_or_accumulate_grad_sample(param=frozen, grad_sample=torch.ones(2, 3), max_batch_len=2)
    assert not hasattr(frozen, "_current_grad_sample")


def test_prepare_module_and_wrap_model_positional_flag():
    assert isinstance(prepare_module(_model(), "hooks", True), GradSampleModule)
    gsm = wrap_model(_model(), "functorch", True, batch_first=True)
    assert gsm.force_functorch
    net = _model()
    hooks = prepare_module(net, "hooks", False)  # in place: net is what the loop calls
    net(torch.randn(5, 4)).sum().backward()
    assert hooks._module is net and all(p.grad_sample.shape[0] == 5 for p in net.parameters())


# ------------------------------------------------------------------- samplers by Opacus name
def _norms_of(grad_samples):
    return {p: gs.flatten(1).norm(dim=1) for p, gs in grad_samples.items()}


def test_linear_norm_sample_is_the_norm_of_the_grad_sample():
    layer = nn.Linear(4, 3)
    a, g = torch.randn(5, 7, 4), torch.randn(5, 7, 3)
    expected = _norms_of(compute_linear_grad_sample(layer, [a], g))
    got = compute_linear_norm_sample(layer, [a], g)
    for p in expected:
        torch.testing.assert_close(got[p], expected[p])


def test_embedding_names():
    layer = nn.Embedding(10, 3, padding_idx=0)
    ids, g = torch.randint(0, 10, (4, 6)), torch.randn(4, 6, 3)
    expected = _norms_of(compute_embedding_grad_sample(layer, [ids], g))
    for fn in (compute_embedding_norm_sample, compute_embedding_norm_sample_2):
        torch.testing.assert_close(fn(layer, [ids], g)[layer.weight], expected[layer.weight])
    bag = nn.EmbeddingBag(10, 3, mode="mean")
    bg = torch.randn(4, 3)
    torch.testing.assert_close(
        compute_embeddingbag_gradsampler(bag, [ids], bg)[bag.weight],
        compute_embeddingbag_grad_sample(bag, [ids], bg)[bag.weight],
    )


def test_rnn_linear_sampler_is_registered_by_its_opacus_name():
    assert GRAD_SAMPLERS[RNNLinear] is compute_rnn_linear_grad_sample
    layer = RNNLinear(4, 3)
    a, g = torch.randn(5, 4), torch.randn(5, 3)
    got = compute_rnn_linear_grad_sample(layer, [a], g)
    torch.testing.assert_close(got[layer.weight], torch.einsum("bo,bi->boi", g, a))


def test_conv_grad_sample_name():
    layer = nn.Conv2d(2, 3, 3)
    x = torch.randn(4, 2, 6, 6, requires_grad=True)
    g = torch.randn(4, 3, 4, 4)
    gs = compute_conv_grad_sample(layer, [x.detach()], g)
    (layer(x) * g).sum().backward()
    torch.testing.assert_close(gs[layer.weight].sum(0), layer.weight.grad)


def test_make_functional():
    layer = nn.Linear(4, 3)
    fmodel, ps = make_functional(layer)
    assert all(q is p for q, p in zip(ps, layer.parameters()))
    x = torch.randn(2, 4)
    zeros = tuple(torch.zeros_like(p) for p in ps)
    torch.testing.assert_close(fmodel(zeros, x), torch.zeros(2, 3))
    torch.testing.assert_close(fmodel(ps, x), layer(x))
    _, detached = make_functional(layer, disable_autograd_tracking=True)
    assert not any(p.requires_grad for p in detached)


@pytest.mark.parametrize("batch_first", [True, False])
def test_prepare_layer_matches_the_grad_sampler(batch_first):
    layer = nn.Linear(4, 3)
    prepare_layer(layer, batch_first=batch_first)
    a, g = torch.randn(5, 7, 4), torch.randn(5, 7, 3)  # batch first, as the samplers get them
    w, b = layer.ft_compute_sample_grad(list(layer.parameters()), a, g)
    expected = compute_linear_grad_sample(layer, [a], g)
    torch.testing.assert_close(w, expected[layer.weight])
    torch.testing.assert_close(b, expected[layer.bias])


def test_unfold_parameter_names():
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(
        unfold2d(input=x, kernel_size=(2, 2)), torch.nn.functional.unfold(x, (2, 2))
    )
    assert unfold3d(tensor=torch.randn(2, 1, 3, 3, 3), kernel_size=2).shape == (2, 8, 8)


# ----------------------------------------------------------------------- optimizers.utils
def test_params_lists_trainable_parameters_of_every_group():
    a, b, c = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1)), torch.zeros(1)
    opt = torch.optim.SGD([{"params": [a, c]}, {"params": [b]}], lr=0.1)
    assert params(opt) == [a, b]
    dp = DPOptimizer(opt, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=1)
    assert dp.params == [a, b]


# ----------------------------------------------------------------------------- data loader
def test_collate_with_empty_learns_from_the_first_batch():
    collate = CollateFnWithEmpty(default_collate)
    assert collate([]) == []  # nothing known yet
    out = collate([{"x": torch.ones(2, 3), "y": 1}])
    empty = collate([])
    assert empty["x"].shape == (0, 2, 3) and empty["y"].shape == (0,)
    assert empty["y"].dtype == out["y"].dtype


def test_collate_with_empty_from_shapes_and_from_dataset():
    ds = TensorDataset(torch.randn(5, 3), torch.arange(5))
    shapes = [(0, *shape_safe(x)) for x in ds[0]]
    dtypes = [dtype_safe(x) for x in ds[0]]
    assert shapes == [(0, 3), (0,)] and dtypes == [torch.float32, torch.int64]
    assert shape_safe(3) == () and dtype_safe(3) is int
    empty = wrap_collate_with_empty(
        collate_fn=default_collate, sample_empty_shapes=shapes, dtypes=dtypes
    )([])
    assert [t.shape for t in empty] == [(0, 3), (0,)]
    empty = wrap_collate_with_empty(collate_fn=default_collate, dataset=ds, batch_first=False)([])
    assert [t.shape for t in empty] == [(1, 0), (0,)]
    assert CollateFnWithEmpty(None)([1, 2]) == [1, 2]  # None passes the samples through


def test_rand_on_empty_is_refused():
    with pytest.raises(ValueError, match="rand_on_empty"):
        wrap_collate_with_empty(collate_fn=default_collate, rand_on_empty=True)
    with pytest.raises(ValueError, match="rand_on_empty"):
        CollateFnWithEmpty(default_collate, True, True)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost", "bk"])
def test_optimizer_zero_grad_leaves_grad_sample_none(mode):
    """Opacus sets ``p.grad_sample = None`` in ``zero_grad``: code that reads it after a step
    gets None, not AttributeError."""
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine

    torch.manual_seed(0)
    net = _model()
    data = TensorDataset(torch.randn(30, 4), torch.randint(0, 2, (30,)))
    out = PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10), noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode=mode,
    )
    model, opt = out[0], out[1]
    x, y = next(iter(out[-1]))
    if mode == "ghost":  # (model, optimizer, criterion, loader)
        out[2](model(x), y).backward()
    else:
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad_sample is None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad_sample is None for p in model.parameters())


def _make_private(net, optimizer):
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine

    data = TensorDataset(torch.randn(30, 4), torch.randint(0, 2, (30,)))
    return PrivacyEngine().make_private(
        module=net, optimizer=optimizer, data_loader=DataLoader(data, batch_size=10),
        noise_multiplier=1.0, max_grad_norm=1.0,
    )


def test_opacus_message_for_foreign_optimizer_parameters():
    net, other = _model(), _model()
    with pytest.raises(ValueError, match="Module parameters are different than optimizer Parameters"):
        _make_private(net, torch.optim.SGD(other.parameters(), lr=0.1))


def test_opacus_message_for_eval_mode():
    from dptorch.validators import ModuleValidator
    from dptorch.validators.errors import IllegalModuleConfigurationError, UnsupportedModuleError

    net = _model().eval()
    errors = ModuleValidator.validate(net)
    assert [type(e) for e in errors] == [IllegalModuleConfigurationError]
    assert "Model needs to be in training mode" in str(errors[0])
    with pytest.raises(UnsupportedModuleError, match="Model needs to be in training mode"):
        _make_private(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert ModuleValidator.validate(net.train()) == []


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("sorted_", [True, False])
def test_gen_packed_data(batch_first, sorted_):
    """Opacus's test helper: random sequences of lengths in [1, max], packed; unpacking gives
    them back longest first, each of its own length."""
    from dptorch.utils.packed_sequences import _gen_packed_data
    from dptorch.utils.per_sample_gradients_utils import unpack_packedsequences

    torch.manual_seed(0)
    packed = _gen_packed_data(6, 5, 3, batch_first, sorted_)
    seqs = unpack_packedsequences(packed)
    lengths = [s.shape[0] for s in seqs]
    assert len(seqs) == 6 and all(1 <= n <= 5 for n in lengths)
    assert lengths == sorted(lengths, reverse=True) and all(s.shape[1] == 3 for s in seqs)
    assert (packed.sorted_indices is None) == sorted_
    assert packed.data.shape == (sum(lengths), 3) and bool((packed.data != 0).all())
