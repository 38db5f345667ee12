"""Parameters used by several calls (tied embeddings, a layer called twice) in ghost and bk.

Their squared per-sample norm is the calls' own norms plus the cross terms of the calls'
factored gradients (``LayerRule.factors``), without instantiating ``(B, *p.shape)``. Every case
is checked against the brute-force per-sample loop in float64 (update with every sample
clipped and with none clipped, and the per-sample norms), including the groups that must fall
back to instantiation (a layer without factors sharing a parameter, too many calls).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
)

from .invariants import assert_exact_or_refused, sample_loss, unique_trainable, variant_bounds


class TiedLM(nn.Module):
    """Embedding -> Linear -> LM head tied to the embedding (GPT-2's layout)."""

    def __init__(self, v=11, d=4, padding_idx=0, scale_grad_by_freq=False):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, v, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class EmbeddingTwice(nn.Module):
    def __init__(self, scale_grad_by_freq=False):
        super().__init__()
        self.emb = nn.Embedding(7, 3, padding_idx=1, scale_grad_by_freq=scale_grad_by_freq)
        self.out = nn.Linear(3, 2)

    def forward(self, ids):
        return self.out(self.emb(ids) * self.emb(ids.flip(1)))


class Repeated(nn.Module):
    """One layer applied ``k`` times."""

    def __init__(self, layer, k):
        super().__init__()
        self.layer, self.k = layer, k

    def forward(self, x):
        for _ in range(self.k):
            x = torch.tanh(self.layer(x))
        return x


class MixedGroup(nn.Module):
    """``l2.weight`` tied to ``l1.weight`` and ``ln.weight`` tied to ``l1.bias``: the group
    (l1, l2, ln) has a layer without factors, so every call of it must be instantiated."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4, bias=False)
        self.ln = nn.LayerNorm(4)
        self.l2.weight = self.l1.weight
        self.ln.weight = self.l1.bias

    def forward(self, x):
        return self.l2(torch.tanh(self.ln(torch.tanh(self.l1(x)))))


def _conv1d_twice():
    from transformers.pytorch_utils import Conv1D

    return Repeated(Conv1D(4, 4), 2), torch.randn(5, 3, 4)


CASES = {
    "tied_lm": lambda: (TiedLM(), torch.randint(0, 11, (5, 6))),
    "tied_lm_freq": lambda: (TiedLM(scale_grad_by_freq=True), torch.randint(0, 5, (5, 6))),
    "embedding_twice": lambda: (EmbeddingTwice(), torch.randint(0, 7, (5, 4))),
    "embedding_twice_freq": lambda: (EmbeddingTwice(True), torch.randint(0, 4, (5, 4))),
    "linear_twice": lambda: (Repeated(nn.Linear(4, 4), 2), torch.randn(5, 4)),
    "linear_twice_seq": lambda: (Repeated(nn.Linear(4, 4), 2), torch.randn(5, 3, 4)),
    "linear_thrice": lambda: (Repeated(nn.Linear(3, 3), 3), torch.randn(5, 2, 3)),
    "linear_many": lambda: (Repeated(nn.Linear(3, 3), 6), torch.randn(5, 3)),  # instantiated
    "conv1d_twice": _conv1d_twice,
    "mixed_group": lambda: (MixedGroup(), torch.randn(5, 2, 4)),  # instantiated
}


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _build(name):
    torch.manual_seed(0)
    model, x = CASES[name]()
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model, x


def _ghost_refuses(name, mode):
    """Ghost's second backward pass would let autograd apply scale_grad_by_freq with counts over
    the whole batch, not each sample's: ghost refuses those layers (bk forms its own sum)."""
    return mode == "ghost" and name.endswith("_freq")


#: the mixed group ties a LayerNorm weight to a Linear bias: bk refuses it (LayerNorm's autograd
#: gradient reaches a parameter whose Linear computes none), which is allowed
MAY_REFUSE = {("mixed_group", "bk")}


@pytest.mark.parametrize(
    "name,variant",
    [(n, v) for n in CASES for v in ("ghost", "bk", "bk-per_layer") if not _ghost_refuses(n, v)],
)
def test_shared_parameters_exact(name, variant):
    model, x = _build(name)
    y = torch.randn_like(model(x))
    must_work = (name, variant.split("-")[0]) not in MAY_REFUSE
    for c in (1e3, 0.05):
        assert_exact_or_refused(
            model, variant, x, y, variant_bounds(model, variant, c), must_work=must_work
        )


@pytest.mark.parametrize("mode", ["ghost", "bk"])
@pytest.mark.parametrize("name", list(CASES))
def test_shared_parameters_norms(name, mode):
    if (name, mode) in MAY_REFUSE or _ghost_refuses(name, mode):
        pytest.skip("refused in this mode (see MAY_REFUSE, test_ghost_refuses_batch_frequency)")
    model, x = _build(name)
    y = torch.randn_like(model(x))
    named = unique_trainable(model)
    ref = []
    for b in range(x.shape[0]):
        loss = sample_loss(model(x[b : b + 1]), y[b : b + 1])
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        ref.append(torch.sqrt(sum(g.pow(2).sum() for g in grads if g is not None)))
    gsm = wrap_model(copy.deepcopy(model), mode, loss_reduction="sum", max_grad_norm=1.0)
    loss = sample_loss(gsm(x), y)
    if mode == "ghost":
        gsm.norm_backward(loss)
    else:
        loss.backward()
    torch.testing.assert_close(gsm.per_sample_gradient_norms, torch.stack(ref), rtol=1e-9, atol=0)


@pytest.mark.parametrize("name", ["plain_freq", "tied_lm_freq", "embedding_twice_freq"])
def test_ghost_refuses_batch_frequency(name):
    """Embedding(scale_grad_by_freq=True) divides by frequencies over the whole batch in
    autograd's gradient, so ghost's second pass would not release Σ_b c_b grad_b: it refuses at
    the forward pass, naming the layer; with the weight frozen there is nothing to refuse."""
    if name == "plain_freq":
        model = nn.Sequential(nn.Embedding(6, 3, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 2))
        x = torch.randint(0, 3, (5, 4))
        emb, where = model[0], "'0'"
    else:
        model, x = _build(name)
        emb, where = model.emb, "'emb'"
    gsm = wrap_model(copy.deepcopy(model), "ghost", loss_reduction="sum", max_grad_norm=1.0)
    with pytest.raises(NotImplementedError, match=rf"Embedding {where}.*scale_grad_by_freq.*'bk'"):
        gsm(x)
    emb.weight.requires_grad_(False)
    if name == "plain_freq":
        wrap_model(model, "ghost", loss_reduction="sum", max_grad_norm=1.0)(x)


def test_tied_head_is_not_instantiated():
    """The tied LM head takes the factored path: no (B, V, d) per-sample gradient is built."""
    model, x = _build("tied_lm")
    gsm = wrap_model(model, "bk", loss_reduction="sum", max_grad_norm=1.0)
    built = []
    orig = GradSampleModuleFastGradientClipping._add_cross_terms

    def spy(self, *args, **kwargs):
        built.append(args[0])
        return orig(self, *args, **kwargs)

    GradSampleModuleFastGradientClipping._add_cross_terms = spy
    try:
        gsm(x).pow(2).sum().backward()
    finally:
        GradSampleModuleFastGradientClipping._add_cross_terms = orig
    assert {type(m) for m in built} == {nn.Embedding, nn.Linear}
    assert getattr(model.emb.weight, "_current_grad_sample", None) is None


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_embedding_bag_batch_frequency_refused(mode):
    """EmbeddingBag(scale_grad_by_freq=True) scales by frequencies over the batch: no mode that
    builds per-sample gradients or norms from the layer's rule may return a number for it."""
    model = nn.Sequential(nn.EmbeddingBag(6, 3, mode="sum", scale_grad_by_freq=True), nn.Linear(3, 2))
    x = torch.randint(0, 3, (5, 4))
    kw = {} if mode == "hooks" else {"max_grad_norm": 1.0}
    gsm = wrap_model(model, mode, loss_reduction="sum", **kw)
    with pytest.raises(NotImplementedError, match="EmbeddingBag.*scale_grad_by_freq"):
        gsm(x).sum().backward()
