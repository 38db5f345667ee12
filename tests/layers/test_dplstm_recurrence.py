"""DPLSTM's one-pass recurrence (manual back-propagation through time): per-sample gradients,
norms and clipped sums in every mode, against torch's ``nn.LSTM`` run on one sample at a time
(float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dptorch.grad_sample import wrap_model
from dptorch.layers import DPLSTM, dp_rnn

B, T, IN, H = 5, 6, 3, 4


class Probe(nn.Module):
    """``DPLSTM`` (or ``nn.LSTM``) with a per-sample loss that reads every output, ``h_n`` and
    ``c_n`` through fixed random weights ``w`` (so every gradient path is exercised)."""

    def __init__(self, lstm: nn.Module, w: dict, batch_first: bool, twice: bool = False):
        super().__init__()
        self.lstm, self.w, self.batch_first, self.twice = lstm, w, batch_first, twice

    def forward(self, x, hx=None):
        out, (h, c) = self.lstm(x, hx)
        if self.twice:  # a second call of the same layer in one forward pass
            out2, _ = self.lstm(x, (h, c))
            out = _unpack(out, self.batch_first) + 0.5 * _unpack(out2, self.batch_first)
        else:
            out = _unpack(out, self.batch_first)
        t = out.shape[1]
        per = (out * self.w["out"][: out.shape[0], :t]).flatten(1).sum(1)
        per = per + (h * self.w["h"][:, : h.shape[1]]).sum((0, 2))
        return per + (c * self.w["c"][:, : c.shape[1]]).sum((0, 2))


def _unpack(out, batch_first):
    if isinstance(out, torch.nn.utils.rnn.PackedSequence):
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
        return out
    return out if batch_first else out.transpose(0, 1)


def _case(seed, batch_first, bidirectional, num_layers, bias, packed, with_hx):
    torch.manual_seed(seed)
    kw = dict(input_size=IN, hidden_size=H, num_layers=num_layers, bias=bias,
              batch_first=batch_first, bidirectional=bidirectional)
    ref = nn.LSTM(**kw).double()
    dp = DPLSTM(**kw).double()
    dp.load_state_dict(ref.state_dict())
    n = num_layers * (2 if bidirectional else 1)
    lengths = torch.tensor([6, 2, 5, 1, 4]) if packed else torch.full((B,), T)
    xs = [torch.randn(int(k), IN, dtype=torch.float64) for k in lengths]
    hx = (torch.randn(n, B, H, dtype=torch.float64), torch.randn(n, B, H, dtype=torch.float64))
    w = {
        "out": torch.randn(B, T, (2 if bidirectional else 1) * H, dtype=torch.float64),
        "h": torch.randn(n, B, H, dtype=torch.float64),
        "c": torch.randn(n, B, H, dtype=torch.float64),
    }
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    if packed:
        x = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    else:
        x = padded if batch_first else padded.transpose(0, 1)
    return ref, dp, w, xs, x, (hx if with_hx else None)


def _reference(ref, w, xs, hx, batch_first, twice=False):
    """``{name: (B, *shape)}``: each sample's gradient, ``nn.LSTM`` on that sample alone."""
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    grads = {n: [] for n in params}
    for i, xi in enumerate(xs):
        x1 = xi.unsqueeze(0) if batch_first else xi.unsqueeze(1)
        h1 = None if hx is None else tuple(s[:, i : i + 1] for s in hx)
        wi = {k: (v[i : i + 1] if k == "out" else v[:, i : i + 1]) for k, v in w.items()}
        loss = Probe(ref, wi, batch_first, twice)(x1, h1).sum()
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
            grads[n].append(g)
    return {n: torch.stack(g) for n, g in grads.items()}


def _clipped(per_sample: dict, C: float):
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
    factor = (C / (norms + 1e-6)).clamp(max=1.0)
    return norms, {n: torch.einsum("b,b...->...", factor, g) for n, g in per_sample.items()}


CASES = [
    # seed, batch_first, bidirectional, num_layers, bias, packed, with_hx
    (0, True, False, 1, True, False, False),
    (1, False, True, 2, True, False, True),
    (2, True, True, 1, False, True, True),
    (3, False, False, 2, True, True, False),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_every_mode_matches_per_sample_reference(case, mode):
    ref, dp, w, xs, x, hx = _case(*case)
    batch_first = case[1]
    want = _reference(ref, w, xs, hx, batch_first)
    C = 0.5 * float(torch.stack([g.flatten(1).norm(dim=1) for g in want.values()]).norm(dim=0).median())
    norms, clipped = _clipped(want, C)
    model = Probe(dp, w, batch_first)
    if mode in ("hooks", "functorch"):
        gsm = wrap_model(model, "hooks", batch_first=batch_first, loss_reduction="sum",
                         force_functorch=mode == "functorch")
        gsm(x, hx).sum().backward()
        for n, p in dp.named_parameters():
            torch.testing.assert_close(p.grad_sample, want[n], rtol=1e-6, atol=1e-9, msg=n)
        return
    gsm = wrap_model(model, mode, batch_first=batch_first, loss_reduction="sum", max_grad_norm=C)
    loss = gsm(x, hx).sum()
    if mode == "ghost":
        gsm.norm_backward(loss)
    else:
        loss.backward()
        for n, p in dp.named_parameters():
            torch.testing.assert_close(p.grad, clipped[n], rtol=1e-6, atol=1e-9, msg=n)
    torch.testing.assert_close(gsm.per_sample_gradient_norms, norms, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_layer_called_twice_per_forward(mode):
    """Both calls' contributions are in each sample's gradient (the ``RNNLinear`` layers are
    called twice per forward, the second recurrence starting from the first's final state)."""
    ref, dp, w, xs, x, hx = _case(4, True, True, 1, True, False, True)
    want = _reference(ref, w, xs, hx, True, twice=True)
    C = 1e-3  # every sample clipped
    norms, clipped = _clipped(want, C)
    gsm = wrap_model(Probe(dp, w, True, twice=True), mode, batch_first=True, loss_reduction="sum",
                     **({"max_grad_norm": C} if mode == "bk" else {}))
    gsm(x, hx).sum().backward()
    for n, p in dp.named_parameters():
        if mode == "hooks":
            torch.testing.assert_close(p.grad_sample, want[n], rtol=1e-6, atol=1e-9, msg=n)
        else:
            torch.testing.assert_close(p.grad, clipped[n], rtol=1e-6, atol=1e-12, msg=n)


def test_frozen_hidden_weights_after_wrapping():
    """``weight_hh`` frozen after wrapping: the others' clipped sums and norms are exact and
    the frozen weight gets no gradient."""
    ref, dp, w, xs, x, hx = _case(5, True, False, 1, True, False, False)
    gsm = wrap_model(Probe(dp, w, True), "bk", batch_first=True, loss_reduction="sum", max_grad_norm=0.1)
    dp.weight_hh_l0.requires_grad_(False)
    ref.weight_hh_l0.requires_grad_(False)
    want = _reference(ref, w, xs, hx, True)
    norms, clipped = _clipped(want, 0.1)
    gsm(x, hx).sum().backward()
    assert dp.weight_hh_l0.grad is None
    torch.testing.assert_close(gsm.per_sample_gradient_norms, norms, rtol=1e-6, atol=1e-9)
    for n, p in dp.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, clipped[n], rtol=1e-6, atol=1e-12, msg=n)


def test_learned_initial_state_under_functorch():
    """A model with a learned ``h_0`` is a custom layer: its per-sample gradients come from
    ``torch.func`` over its whole forward, DPLSTM included (the general recurrence runs under
    vmap). bk's clipped sums equal the per-sample loop's."""
    torch.manual_seed(6)

    class LearnedInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = DPLSTM(IN, H, batch_first=True)
            self.h0 = nn.Parameter(torch.randn(1, 1, H))

        def forward(self, x):
            h0 = self.h0.expand(1, x.shape[0], H).contiguous()
            out, _ = self.lstm(x, (h0, torch.zeros_like(h0)))
            return out.sum((1, 2))

    model = LearnedInit().double()
    x = torch.randn(B, T, IN, dtype=torch.float64)
    per = {n: [] for n, _ in model.named_parameters()}
    for i in range(B):
        gs = torch.autograd.grad(model(x[i : i + 1]).sum(), list(model.parameters()))
        for n, g in zip(per, gs):
            per[n].append(g)
    norms, clipped = _clipped({n: torch.stack(g) for n, g in per.items()}, 0.05)
    gsm = wrap_model(model, "bk", batch_first=True, loss_reduction="sum", max_grad_norm=0.05)
    gsm(x).sum().backward()
    torch.testing.assert_close(gsm.per_sample_gradient_norms, norms, rtol=1e-6, atol=1e-9)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, clipped[n], rtol=1e-6, atol=1e-12, msg=n)


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 5),
    hidden=st.integers(1, 5),
    bidirectional=st.booleans(),
    seed=st.integers(0, 2**16),
    native=st.booleans(),
)
def test_nonprivate_gradients_and_double_backward_match_torch(
    b, t, hidden, bidirectional, seed, native
):
    """Outside DP training, DPLSTM's outputs and parameter and input gradients are torch's,
    also when the graph is retained and back-propagated twice (both with torch's kernel and
    with the layer's own recurrence)."""
    torch.manual_seed(seed)
    ref = nn.LSTM(IN, hidden, bidirectional=bidirectional, batch_first=True).double()
    dp = DPLSTM(IN, hidden, bidirectional=bidirectional, batch_first=True).double()
    dp.use_native_kernel = native
    dp.load_state_dict(ref.state_dict())
    x = torch.randn(b, t, IN, dtype=torch.float64)
    w = torch.randn(b, t, (2 if bidirectional else 1) * hidden, dtype=torch.float64)
    grads = []
    for layer in (ref, dp):
        xx = x.clone().requires_grad_()
        out, (h, c) = layer(xx)
        loss = (out * w).sum() + h.pow(2).sum() + c.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([xx.grad] + [p.grad for p in layer.parameters()] + [out])
    for g_ref, g_dp in zip(*grads):
        torch.testing.assert_close(g_dp, g_ref, rtol=1e-9, atol=1e-12)


def test_fast_recurrence_is_the_path_taken(monkeypatch):
    """The tests above exercise the one-pass recurrence (not the general replay path)."""
    calls = []
    real = dp_rnn._LSTMRecurrence.apply
    monkeypatch.setattr(dp_rnn._LSTMRecurrence, "apply", lambda *a: calls.append(1) or real(*a))
    ref, dp, w, xs, x, hx = _case(7, True, True, 2, True, True, True)
    dp.use_native_kernel = False
    copy.deepcopy(Probe(dp, w, True))(x, hx).sum().backward()
    assert len(calls) == 4  # two layers, two directions


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["lstm", "lstm-proj", "gru", "rnn"]),
    bidirectional=st.booleans(),
    num_layers=st.integers(1, 2),
    seed=st.integers(0, 2**16),
    native=st.booleans(),
)
def test_initial_state_gradient_matches_torch(kind, bidirectional, num_layers, seed, native):
    """The gradient reaching a given initial state ``h_0`` (e.g. a learned one, or the state of
    an earlier call) is torch's, on both recurrences (it was once counted twice)."""
    from dptorch.layers import DPGRU, DPRNN

    torch.manual_seed(seed)
    kw = dict(input_size=IN, hidden_size=H, num_layers=num_layers, bidirectional=bidirectional,
              batch_first=True)
    if kind == "lstm-proj":
        kw["proj_size"] = 2
    t_cls, dp_cls = {"lstm": (nn.LSTM, DPLSTM), "lstm-proj": (nn.LSTM, DPLSTM),
                     "gru": (nn.GRU, DPGRU), "rnn": (nn.RNN, DPRNN)}[kind]
    ref, dp = t_cls(**kw).double(), dp_cls(**kw).double()
    dp.load_state_dict(ref.state_dict())
    dp.use_native_kernel = native
    n = num_layers * (2 if bidirectional else 1)
    x = torch.randn(3, 4, IN, dtype=torch.float64)
    h0 = torch.randn(n, 3, kw.get("proj_size", H), dtype=torch.float64)
    c0 = torch.randn(n, 3, H, dtype=torch.float64)
    grads = []
    for layer in (ref, dp):
        hx = (h0.clone().requires_grad_(), c0.clone().requires_grad_())
        out, _ = layer(x, hx if kind.startswith("lstm") else hx[0])
        out.pow(2).sum().backward()
        grads.append([hx[0].grad] + ([hx[1].grad] if kind.startswith("lstm") else []))
    for g_ref, g_dp in zip(*grads):
        torch.testing.assert_close(g_dp, g_ref, rtol=1e-9, atol=1e-12)
