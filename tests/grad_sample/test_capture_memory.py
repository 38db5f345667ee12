"""What the per-sample machinery keeps alive, and for how long.

* A hooked layer's output that no later op saves is freed during the forward pass, as without
  DP (the capture hook of a view kept the whole output until the end of the backward pass: a
  transformer step held every Linear output, 20 MB of a 74 MB step).
* bk drops each recorded call's input and output gradient once its clipped sum is formed.
* Convolutions take large batches in chunks of samples, exactly.

Liveness is probed with weak references to tensor storages: a storage held by anything, Python
or autograd's C++ graph, stays alive.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dptorch.grad_sample.conv as conv
from dptorch.grad_sample import wrap_model
from dptorch.grad_sample.grad_sample_module_bk import GradSampleModuleBookKeeping
from tests.privacy.invariants import MODES, assert_exact_or_refused

ALL_MODES = MODES + ["ew"]


class Residual(nn.Module):
    """``h + fc(h)`` on ``(B, T, d)``: ``fc``'s output is a view of a 2-d product, and the sum
    saves neither operand."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)

    def forward(self, h):
        return self.head(h + self.fc(h))


def _probe_output(layer: nn.Module, probes: list) -> None:
    layer.register_forward_hook(lambda m, i, out: probes.append(weakref.ref(out.untyped_storage())))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_unsaved_layer_output_freed_in_forward(mode):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    plain = Residual()
    wrapped = copy.deepcopy(plain)
    gsm = wrap_model(wrapped, mode, **({"max_grad_norm": 1.0} if mode in ("ghost", "bk") else {}))
    for model, fc in ((plain, plain.fc), (gsm, wrapped.fc)):
        probes: list = []
        _probe_output(fc, probes)
        loss = model(x).sum()  # the graph is alive; nothing in it needs fc's output
        assert probes
        assert all(p() is None for p in probes), f"{mode}: fc's output is kept alive"
        loss.backward()
    # and the per-sample machinery still ran on it
    assert wrapped.fc.weight.grad is not None


def test_probe_sees_a_saved_output():
    """The probe is not blind: an output that the next op saves (``pow`` saves its input)
    stays alive while the graph is, and is freed with it."""
    fc = nn.Linear(16, 16)
    probes: list = []
    _probe_output(fc, probes)
    loss = fc(torch.randn(4, 8, 16)).pow(2).sum()
    assert probes[0]() is not None
    del loss
    assert probes[0]() is None


class Scaled(nn.Module):
    """``fc`` on ``2 x + 1``: only ``fc``'s own node would save its input."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.fc(x * 2.0 + 1.0).tanh())


@pytest.mark.parametrize("mode", ["plain", "hooks", "functorch", "bk"])
def test_layer_input_freed_once_its_backward_ran(mode):
    """A hooked call's inputs are released when its per-sample work is done, as autograd
    frees a node's saved inputs once it ran, not at the end of the backward pass. (bk: a layer
    whose per-sample gradient is instantiated, T (d_in + d_out) >= d_in d_out; one on the
    ghost path keeps its inputs for the clipped sum at the end of the pass.)"""
    torch.manual_seed(0)
    model = Scaled()
    kw = {"max_grad_norm": 1.0} if mode == "bk" else {}
    run = model if mode == "plain" else wrap_model(model, mode, **kw)
    probes: list = []
    model.fc.register_forward_pre_hook(
        lambda m, args: probes.append(weakref.ref(args[0].untyped_storage()))
    )
    x = torch.randn(3, 8, 4, requires_grad=True)
    seen: list = []
    # x's gradient is formed after fc's backward (upstream of it), with the graph still alive
    x.register_hook(lambda g: seen.append(probes[0]() is None))
    loss = run(x).sum()
    assert probes[0]() is not None  # saved for the backward pass
    loss.backward()
    assert seen == [True], f"{mode}: fc's input is still alive after its backward ran"
    assert model.fc.weight.grad is not None


def test_bk_drops_each_call_after_its_clipped_sum(monkeypatch):
    """When bk forms a call's clipped sum, the output gradients of the calls before it are
    gone (each is held only by its record)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1))
    gsm = wrap_model(model, "bk", max_grad_norm=1.0)
    seen: list = []
    alive_before: list[int] = []
    original = GradSampleModuleBookKeeping._clipped_sum

    def probing(self, module, activations, backprops, *a, **k):
        alive_before.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(backprops.untyped_storage()))
        return original(self, module, activations, backprops, *a, **k)

    monkeypatch.setattr(GradSampleModuleBookKeeping, "_clipped_sum", probing)
    # batch of one position: every Linear takes the (A, G) path (ghost norm), none instantiated
    gsm(torch.randn(6, 8)).pow(2).sum().backward()
    assert len(seen) == 3
    assert alive_before == [0, 0, 0]
    assert all(r() is None for r in seen)


# ----------------------------------------------------------------------------- conv chunks
def _brute(layer: nn.Conv2d, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Per-sample weight/bias gradients of ``Σ out·g``, one sample at a time (float64)."""
    ws, bs = [], []
    for b in range(x.shape[0]):
        out = layer(x[b : b + 1])
        gw, gb = torch.autograd.grad((out * g[b : b + 1]).sum(), [layer.weight, layer.bias])
        ws.append(gw)
        bs.append(gb)
    return {p: torch.stack(r) if r else p.new_zeros((0, *p.shape))
            for p, r in ((layer.weight, ws), (layer.bias, bs))}


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(0, 7),
    c_in=st.sampled_from([1, 2, 4]),
    c_out=st.sampled_from([2, 4]),
    groups=st.sampled_from([1, 2]),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same"]),
    hw=st.integers(4, 7),
    cap=st.sampled_from([1, 40, 200]),
)
def test_conv_chunks_equal_brute_force(b, c_in, c_out, groups, k, stride, padding, hw, cap):
    if c_in % groups or c_out % groups or (padding == "same" and stride != 1):
        return
    torch.manual_seed(b * 100 + hw)
    layer = nn.Conv2d(c_in, c_out, k, stride, padding=padding, groups=groups).double()
    x = torch.randn(b, c_in, hw, hw, dtype=torch.float64)
    g = torch.randn_like(layer(x))
    ref = _brute(layer, x, g)
    saved = conv.CHUNK_ELEMENTS
    conv.CHUNK_ELEMENTS = cap
    try:
        step = conv.samples_per_chunk(layer, x, g, conv._weight_path(layer, g, True))
        gs = conv.compute_conv_grad_sample(layer, [x], g)
        norms = conv.compute_conv_norm_sq_sample(layer, [x], g)
    finally:
        conv.CHUNK_ELEMENTS = saved
    if cap == 1:
        assert step == 1  # chunked, one sample each (a batch of one or none: one call)
    for p in (layer.weight, layer.bias):
        assert gs[p].shape == ref[p].shape
        torch.testing.assert_close(gs[p], ref[p], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(norms[p], ref[p].flatten(1).pow(2).sum(1), rtol=1e-10,
                                   atol=1e-12)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, stride=2, groups=2)
        self.head = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.c2(torch.tanh(self.c1(x)))).flatten(1))


@pytest.mark.parametrize("mode", MODES)
def test_chunked_conv_dp_step_exact(mode, monkeypatch):
    """A DP step whose convolutions are taken one sample at a time equals the brute force."""
    monkeypatch.setattr(conv, "CHUNK_ELEMENTS", 1)
    torch.manual_seed(0)
    model = ConvNet().double()
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    g1 = torch.zeros(5, 8, 8, 8)
    assert conv.samples_per_chunk(model.c1, x, g1, conv._weight_path(model.c1, g1, True)) == 1
    assert assert_exact_or_refused(model, mode, x, y, 0.05, must_work=True) == "exact"
