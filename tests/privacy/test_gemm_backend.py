"""dptorch's own matrix products on oneDNN (``dptorch.utils.gemm``): the same products as torch's,
taken only where they are plain float32 arithmetic, and the float32 DP steps that use them
(bk's clipped sums, the DP-LSTM recurrence) against the float64 per-sample brute force."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dptorch.layers import DPLSTM
from dptorch.utils import gemm

from .invariants import dp_update, reference_update

needs_onednn = pytest.mark.skipif(
    not gemm.onednn_gemm_enabled(), reason="torch without oneDNN's linear operator"
)


def _operand(rows: int, cols: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A ``(rows, cols)`` float32 matrix stored contiguous, transposed, or as a slice of wider
    rows (a leading dimension larger than ``cols``)."""
    if layout == "contiguous":
        return torch.randn(rows, cols, generator=gen)
    if layout == "transposed":
        return torch.randn(cols, rows, generator=gen).t()
    return torch.randn(rows, cols + 3, generator=gen)[:, 1 : cols + 1]


layouts = st.sampled_from(["contiguous", "transposed", "sliced"])


@needs_onednn
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 160), k=st.integers(1, 300), n=st.integers(1, 160),
       la=layouts, lb=layouts, seed=st.integers(0, 2**16))
def test_products_equal_torch(m, k, n, la, lb, seed):
    """``mm``, ``mm_tn``, ``bmm_nt`` and ``linear`` give torch's products (float32 round-off of the
    float64 product) for every shape, across the oneDNN threshold, and every layout."""
    gen = torch.Generator().manual_seed(seed)
    a, b = _operand(m, k, la, gen), _operand(k, n, lb, gen)
    tol = dict(rtol=1e-4, atol=1e-4 * k**0.5)
    torch.testing.assert_close(gemm.mm(a, b).double(), a.double() @ b.double(), **tol)
    g, x = _operand(k, m, la, gen), _operand(k, n, lb, gen)  # (N, o), (N, i)
    got = gemm.mm_tn(g, x)
    assert got.is_contiguous() and got.shape == (m, n)
    torch.testing.assert_close(got.double(), g.double().t() @ x.double(), **tol)
    x3 = torch.stack([_operand(m, k, la, gen) for _ in range(2)])
    y3 = torch.stack([_operand(n, k, lb, gen) for _ in range(2)])
    torch.testing.assert_close(
        gemm.bmm_nt(x3, y3).double(), x3.double() @ y3.double().transpose(1, 2), **tol
    )
    w, bias = _operand(n, k, lb, gen), torch.randn(n, generator=gen)
    torch.testing.assert_close(
        gemm.linear(a, w, bias).double(), a.double() @ w.double().t() + bias.double(), **tol
    )


@needs_onednn
def test_onednn_taken_only_for_plain_float32(monkeypatch):
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    assert gemm.onednn_applies(a, a)
    assert not gemm.onednn_applies(a.double(), a.double())
    w = torch.randn(256, 256, requires_grad=True)
    assert not gemm.onednn_applies(a, w)  # autograd would not see the product
    with torch.no_grad():
        assert gemm.onednn_applies(a, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.onednn_applies(a, a)
    seen = []
    torch.func.vmap(lambda r: seen.append(gemm.onednn_applies(r, r)) or r)(a)
    assert seen == [False]
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert not gemm.onednn_applies(a, a)  # a lowered precision is left to torch
    finally:
        torch.set_float32_matmul_precision(prev)
    with torch.autograd.forward_ad.dual_level():  # oneDNN's op would drop the tangent
        dual = torch.autograd.forward_ad.make_dual(a, torch.ones_like(a))
        assert not gemm.onednn_applies(dual, a)
        tangent = torch.autograd.forward_ad.unpack_dual(gemm.mm(dual, a)).tangent
        torch.testing.assert_close(tangent, torch.ones_like(a) @ a, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("DPTORCH_CPU_GEMM", "torch")
    assert not gemm.onednn_applies(a, a)
    # an autograd product still works and differentiates (torch's product)
    monkeypatch.delenv("DPTORCH_CPU_GEMM")
    gemm.mm(a, w).sum().backward()
    torch.testing.assert_close(w.grad, a.sum(0).unsqueeze(1).expand(256, 256),
                               rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- DP steps
class _Head(nn.Module):
    def __init__(self, body: nn.Module, d: int):
        super().__init__()
        self.body, self.out = body, nn.Linear(d, 3)

    def forward(self, x):
        h = self.body(x)
        if isinstance(h, tuple):
            h = h[0]
        return self.out(h.mean(1) if h.dim() == 3 else h)


class _Packed(nn.Module):
    """A DP-LSTM on right-padded sequences (the masked recurrence)."""

    def __init__(self):
        super().__init__()
        self.lstm, self.out = DPLSTM(24, 128, batch_first=True), nn.Linear(128, 3)

    def forward(self, x):
        lengths = (x.abs().sum(-1) > 0).sum(1)  # the input is zero after each sample's end
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.out(h[-1])


def _conv1d_body(width: int = 64):
    transformers = pytest.importorskip("transformers")
    conv1d = transformers.pytorch_utils.Conv1D
    return nn.Sequential(conv1d(256, width), nn.GELU(), conv1d(width, 256))


def _wide_head():
    """A wide output on a sequence, whose ghost norm takes the output gradient's ``T × T``
    Gram over 1200 features; the head is frozen, so the norms are this layer's."""
    model = _Head(nn.Linear(64, 1200), 1200)
    model.out.requires_grad_(False)
    return model


MODELS = {
    "mlp": (lambda: _Head(nn.Sequential(nn.Linear(200, 256), nn.Tanh(), nn.Linear(256, 256)),
                          256), (32, 200)),
    "lstm": (lambda: _Head(DPLSTM(24, 128, batch_first=True), 128), (24, 16, 24)),
    "bilstm-2layers": (lambda: _Head(DPLSTM(24, 128, batch_first=True, bidirectional=True,
                                            num_layers=2), 256), (24, 16, 24)),
    "lstm-packed": (_Packed, (24, 16, 24)),
    "sequence-wide-head": (_wide_head, (8, 32, 64)),
    # 128 output channels: per-sample weight gradients by unfold and a batched product
    "conv2d": (lambda: _Head(nn.Sequential(nn.Conv2d(16, 128, 3), nn.Flatten(2)), 400),
               (6, 16, 22, 22)),
    "gpt2-conv1d": (lambda: _Head(_conv1d_body(), 64), (8, 24, 64)),
    # T (d_in + d_out) = d_in d_out: per-sample gradients instantiated by one product per sample
    "sequence-instantiated": (lambda: _Head(nn.Sequential(nn.Linear(256, 256), nn.Tanh()), 256),
                              (4, 128, 256)),
    "gpt2-conv1d-instantiated": (lambda: _Head(_conv1d_body(256), 256), (4, 128, 256)),
}


@needs_onednn
@pytest.mark.parametrize("name", list(MODELS))
def test_float32_bk_step_matches_float64_brute_force(name, monkeypatch):
    """bk in float32, with oneDNN's products, releases the float64 brute-force clipped sum up
    to float32 round-off, as it does with torch's products (``DPTORCH_CPU_GEMM=torch``)."""
    _check_float32_step(name, "bk", monkeypatch)


@needs_onednn
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("name", ["sequence-instantiated", "gpt2-conv1d-instantiated"])
def test_float32_instantiated_products_match_float64_brute_force(name, mode, monkeypatch):
    """The per-sample products of a Linear or Conv1D on a sequence (hooks: their per-sample
    gradients; ghost: their instantiated norms) on oneDNN."""
    _check_float32_step(name, mode, monkeypatch)


def _check_float32_step(name: str, mode: str, monkeypatch) -> None:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(*shape)
    if name == "lstm-packed":
        x[torch.arange(shape[1]) >= (torch.arange(shape[0]) % 5 + 11)[:, None]] = 0.0
    y = torch.randn(shape[0], 3)
    c = 0.01  # every sample clipped: the released sum depends on every per-sample norm
    ref = reference_update(copy.deepcopy(model).double(), x.double(), y.double(), c)
    taken = []
    eligible = gemm._eligible
    monkeypatch.setattr(gemm, "_eligible", lambda *t: taken.append(eligible(*t)) or taken[-1])
    got = dp_update(model, mode, x, y, c)
    assert any(taken), "the step must have used oneDNN's products"
    monkeypatch.setenv("DPTORCH_CPU_GEMM", "torch")
    plain = dp_update(model, mode, x, y, c)
    for n, r in ref.items():
        scale = float(r.abs().max()) + 1e-3
        for label, upd in (("oneDNN", got), ("torch", plain)):
            torch.testing.assert_close(
                upd[n].double(), r, rtol=1e-3, atol=2e-4 * scale,
                msg=lambda m, n=n, label=label: f"{label} {n}: {m}",
            )


def _manual_lstm(cell, x: torch.Tensor, xi_map) -> torch.Tensor:
    """The LSTM recurrence of ``cell`` on ``x`` ``(B, T, I)`` in plain torch ops, with
    ``xi_map`` applied to the input projection: outputs ``(B, T, H)``."""
    b, t_len, _ = x.shape
    h_size = cell.hh.weight.shape[1]
    h, c = x.new_zeros(b, h_size), x.new_zeros(b, h_size)
    xi = xi_map(x @ cell.ih.weight.t() + cell.ih.bias)
    outs = []
    for t in range(t_len):
        i, f, g, o = (xi[:, t] + h @ cell.hh.weight.t() + cell.hh.bias).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs, 1)


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_lstm_input_projection_changed_by_a_hook_is_followed(mode):
    """A forward hook that changes the input projection's output (torch's fused kernel, which
    computes its own projection, must not give the recurrence's values): the forward is the
    hooked recurrence, and the step equals the brute force of the hooked model (float64)."""
    torch.manual_seed(0)
    model = _Head(DPLSTM(6, 8, batch_first=True), 8).double()
    def xi_map(out):
        return out * 1.5 + 0.25

    model.body.l0.ih.register_forward_hook(lambda mod, args, out: xi_map(out))
    x, y = torch.randn(5, 7, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(
        model.body(x)[0], _manual_lstm(model.body.l0, x, xi_map), rtol=1e-10, atol=1e-12
    )
    got = dp_update(model, mode, x, y, 0.5)
    ref = reference_update(copy.deepcopy(model), x, y, 0.5)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-7, atol=1e-9)
