"""Attacks on DPLSTM's one-pass recurrence (``_run_lstm`` / ``RNNLinear.returning``): gradients
against torch's ``nn.LSTM`` in odd configurations, and one DP step (noise 0, clipping active) in
every mode against the float64 brute-force sum of clipped per-sample gradients.

Several found bugs, now fixed; their tests say what was wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.batch_memory_manager import BatchMemoryManager
from dptorch.grad_sample import wrap_model
from dptorch.layers import DPLSTM, dp_rnn

pytestmark = pytest.mark.filterwarnings("ignore")

MODES = ["hooks", "functorch", "ghost", "bk"]
DT = torch.float64
N, T, IN, H, K = 24, 4, 3, 4, 3
C = 0.05  # small: every sample is clipped


# ----------------------------------------------------------------------------- non-private
def _loss(out, h, c, use, batch_first):
    g = torch.Generator().manual_seed(0)
    if isinstance(out, PackedSequence):
        out = pad_packed_sequence(out, batch_first=True)[0]
    elif not batch_first:
        out = out.transpose(0, 1)
    loss = out.new_zeros(())
    if "out" in use:
        loss = loss + (out * torch.randn(out.shape, generator=g, dtype=DT)).sum()
    if "out0" in use:  # only the first time step's output
        loss = loss + 3 * out[:, 0].sum()
    if "h" in use:
        loss = loss + (h * torch.randn(h.shape, generator=g, dtype=DT)).sum()
    if "c" in use:
        loss = loss + (c * torch.randn(c.shape, generator=g, dtype=DT)).sum()
    return loss


ODD = [
    # kw, B, T, lengths, hx requiring grad ("h", "c", "hc" or None), outputs used, enforce_sorted
    (dict(hidden_size=1), 1, 1, None, None, ("out", "h", "c"), False),
    (dict(hidden_size=1, bias=False), 2, 3, None, "hc", ("out", "h", "c"), False),
    (dict(hidden_size=3, num_layers=3, bidirectional=True), 3, 4, None, "hc", ("out", "h", "c"), False),
    (dict(hidden_size=3, bidirectional=True), 3, 4, None, "c", ("out", "h", "c"), False),
    (dict(hidden_size=3, bidirectional=True), 3, 4, None, "h", ("h",), False),
    (dict(hidden_size=3, bidirectional=True), 3, 4, None, "hc", ("c",), False),
    (dict(hidden_size=3, bidirectional=True), 3, 4, None, None, ("out0",), False),
    (dict(hidden_size=3, bidirectional=True, batch_first=True), 4, 5, [5, 5, 5, 5], None,
     ("out", "h", "c"), False),
    (dict(hidden_size=3, bidirectional=True, batch_first=True), 4, 1, [1, 1, 1, 1], "hc",
     ("out", "h", "c"), False),
    (dict(hidden_size=3, bidirectional=True, num_layers=2, batch_first=True), 4, 5, [2, 5, 1, 3],
     "hc", ("out", "h", "c"), False),
    (dict(hidden_size=3, bidirectional=True, num_layers=2, batch_first=True), 4, 5, [5, 3, 2, 1],
     "hc", ("h", "c"), True),
    (dict(hidden_size=3, bidirectional=True, batch_first=True), 4, 5, [2, 5, 1, 3], None,
     ("out0",), False),
]


def _observed(dp: DPLSTM, path: str) -> DPLSTM:
    """``"decomposed"``: the layer's own recurrence (what a GradSampleModule sees);
    ``"native"``: torch's kernel."""
    dp.use_native_kernel = path == "native"
    assert (dp._native_kernel(torch.zeros(1, 1, 1)) is None) == (path == "decomposed")
    return dp


@pytest.mark.parametrize("path", ["decomposed", "native"])
@pytest.mark.parametrize("case", ODD)
def test_odd_configurations_match_torch(case, path):
    """Outputs and the gradients of x, every parameter, h_0 and c_0 are nn.LSTM's."""
    kw, b, t, lengths, hx_grad, use, enforce_sorted = case
    torch.manual_seed(0)
    kw = dict(input_size=IN, **kw)
    ref = nn.LSTM(**kw).to(DT)
    dp = _observed(DPLSTM(**kw).to(DT), path)
    dp.load_state_dict(ref.state_dict())
    n = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    x0 = torch.randn(b, t, IN, dtype=DT)
    h0, c0 = torch.randn(n, b, kw["hidden_size"], dtype=DT), torch.randn(n, b, kw["hidden_size"], dtype=DT)
    got = []
    for layer in (ref, dp):
        x = x0.clone().requires_grad_()
        hx = None
        if hx_grad is not None:
            hx = (h0.clone().requires_grad_("h" in hx_grad), c0.clone().requires_grad_("c" in hx_grad))
        if lengths is not None:
            inp = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True,
                                       enforce_sorted=enforce_sorted)
        else:
            inp = x if kw.get("batch_first") else x.transpose(0, 1)
        out, (h, c) = layer(inp, hx)
        wrt = [x, *layer.parameters()] + [s for s in (hx or ()) if s.requires_grad]
        grads = torch.autograd.grad(_loss(out, h, c, use, kw.get("batch_first")), wrt,
                                    allow_unused=True)
        got.append([h, c] + [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)])
    for a, r in zip(got[1], got[0]):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10)


def test_retain_graph_second_backward_packed():
    """Two backward passes through one packed, bidirectional, 2-layer graph (the first turns the
    saved values into coefficients in place) accumulate torch's gradients."""
    torch.manual_seed(0)
    kw = dict(input_size=IN, hidden_size=H, batch_first=True, bidirectional=True, num_layers=2)
    ref, dp = nn.LSTM(**kw).to(DT), _observed(DPLSTM(**kw).to(DT), "decomposed")
    dp.load_state_dict(ref.state_dict())
    x0, lengths = torch.randn(4, 5, IN, dtype=DT), torch.tensor([2, 5, 1, 3])
    got = []
    for layer in (ref, dp):
        x = x0.clone().requires_grad_()
        out, (h, c) = layer(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        pad_packed_sequence(out, batch_first=True)[0].pow(2).sum().backward(retain_graph=True)
        first = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        (h.sum() + c.pow(2).sum()).backward()
        got.append(first + [x.grad] + [p.grad for p in layer.parameters()])
    for a, r in zip(got[1], got[0]):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)


class _DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(IN, H, num_layers=3, bidirectional=True, dropout=0.4, batch_first=True)
        self.head = nn.Linear(2 * H, K)

    def forward(self, x, lengths=None):
        if lengths is not None:
            x = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, c) = self.lstm(x)
        return self.head(h[-2:].transpose(0, 1).flatten(1)) + c.sum(0).sum(-1, keepdim=True)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_dropout_three_layers_matches_general_recurrence(monkeypatch, mode, packed):
    """Train-mode dropout (seeded): per-sample gradients of the one-pass recurrence equal the
    general (autograd replay) recurrence's, and sum to the batch gradient."""
    x, y = torch.randn(5, T, IN, dtype=DT), torch.randint(0, K, (5,))
    lengths = torch.tensor([4, 1, 3, 4, 2]) if packed else None

    def run():
        torch.manual_seed(2)
        model = _DropoutNet().to(DT)
        gsm = wrap_model(model, "hooks", batch_first=True, loss_reduction="sum",
                         force_functorch=mode == "functorch")
        torch.manual_seed(7)
        nn.functional.cross_entropy(gsm(x, lengths), y, reduction="sum").backward()
        return {n: (p.grad_sample, p.grad) for n, p in model.named_parameters()}

    fast = run()
    monkeypatch.setattr(dp_rnn, "DPLSTMCell", type("Other", (dp_rnn.DPLSTMCell,), {}))
    general = run()
    for n, (gs, g) in fast.items():
        torch.testing.assert_close(gs, general[n][0], rtol=1e-9, atol=1e-12, msg=n)
        torch.testing.assert_close(gs.sum(0), g, rtol=1e-9, atol=1e-12, msg=n)


def test_returning_value_cleared_after_exception():
    torch.manual_seed(0)
    dp = DPLSTM(IN, H, batch_first=True).to(DT)
    hh = dp.l0.hh

    def boom(module, args):
        raise RuntimeError("boom")

    handle = hh.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        dp(torch.randn(2, 3, IN, dtype=DT))
    handle.remove()
    assert hh._given is None
    z = torch.randn(2, H, dtype=DT)
    torch.testing.assert_close(hh(z), nn.functional.linear(z, hh.weight, hh.bias))


def test_returned_value_only_for_its_own_input():
    """A call of ``hh`` made while ``hh`` is being called (a forward pre-hook evaluating the
    layer on a probe) computes ``probe Wᵀ + b``: the recurrence's value is tied to its input
    (it once went to whichever call came first)."""
    torch.manual_seed(0)
    dp = DPLSTM(IN, H, batch_first=True).to(DT)
    hh, probe, seen, busy = dp.l0.hh, torch.randn(1, H, dtype=DT), [], []

    def monitor(module, args):
        if not busy:
            busy.append(1)
            seen.append(module(probe))
            busy.pop()

    hh.register_forward_pre_hook(monitor)
    dp(torch.randn(2, 5, IN, dtype=DT))
    want = nn.functional.linear(probe, hh.weight, hh.bias)
    assert seen[0].shape == want.shape, f"probe call returned shape {tuple(seen[0].shape)}"
    torch.testing.assert_close(seen[0], want)


def test_autocast_bfloat16_like_torch():
    """Under CPU bf16 autocast DPLSTM runs like nn.LSTM (it once failed for T > 1 with a dtype
    mismatch in its recurrence): same output dtype, values and gradients within bf16
    round-off."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, IN)
    ref = nn.LSTM(IN, H, batch_first=True)
    dp = DPLSTM(IN, H, batch_first=True)
    dp.load_state_dict(ref.state_dict())
    outs = []
    for layer in (ref, dp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = layer(x)
        out.float().pow(2).sum().backward()
        outs.append(out)
    assert outs[1].dtype == outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=0)
    for p, q in zip(ref.parameters(), dp.parameters()):
        assert q.grad.dtype == torch.float32
        assert (q.grad - p.grad).norm() <= 0.05 * p.grad.norm()


# ----------------------------------------------------------------------------- DP steps
class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True, **kw)
        self.head = nn.Linear(H * (2 if kw.get("bidirectional") else 1), K)

    def forward(self, x):
        out, (_, c) = self.lstm(x)
        return self.head(out[:, -1]) + c[-1].sum(-1, keepdim=True)


class Twice(nn.Module):
    """The same DPLSTM called twice, the second from the first's final state."""

    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True)
        self.head = nn.Linear(H, K)

    def forward(self, x):
        out, hc = self.lstm(x)
        out2, _ = self.lstm(out[:, :, :IN] * 0.5 + x, hc)
        return self.head(out2[:, -1] + out[:, 0])


class TiedHead(nn.Module):
    """W_hh (4H x H) is also the weight of a later Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(IN, H)
        self.lstm = DPLSTM(H, H, batch_first=True)
        self.head = nn.Linear(H, 4 * H)
        self.head.weight = self.lstm.l0.hh.weight
        self.out = nn.Linear(4 * H, K)

    def forward(self, x):
        out, _ = self.lstm(torch.tanh(self.emb(x)))
        return self.out(self.head(out[:, -1]))


class TiedDirections(nn.Module):
    """Both directions share W_ih and W_hh."""

    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True, bidirectional=True)
        self.lstm.l0_reverse.hh.weight = self.lstm.l0.hh.weight
        self.lstm.l0_reverse.ih.weight = self.lstm.l0.ih.weight
        self.head = nn.Linear(2 * H, K)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class PackedInit(nn.Module):
    """Packed variable lengths (from the sample's zero padding), a state computed by a hooked
    Linear from the input (its gradient comes from the recurrence's ``dh``/``dc``)."""

    def __init__(self):
        super().__init__()
        self.init = nn.Linear(IN, 2 * H)
        self.lstm = DPLSTM(IN, H, batch_first=True, bidirectional=True, num_layers=2)
        self.head = nn.Linear(2 * H, K)

    def forward(self, x):
        lengths = (x.abs().sum(-1) > 0).sum(1).cpu()
        hc = torch.tanh(self.init(x[:, 0]))
        h0 = hc[:, :H].unsqueeze(0).expand(4, -1, -1).contiguous()
        c0 = hc[:, H:].unsqueeze(0).repeat(4, 1, 1)
        p = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(p, (h0, c0))
        out = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
        return self.head(out.sum(1)) + h.sum(0).sum(-1, keepdim=True) + c[1].sum(-1, keepdim=True)


def _data(n=N, seed=0, pad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, IN, generator=g, dtype=DT)
    if pad:
        for i, k in enumerate(torch.randint(1, T + 1, (n,), generator=g).tolist()):
            x[i, k:] = 0
    return TensorDataset(x, torch.randint(0, K, (n,), generator=g))


def _private(mode, model, ds, c=C, batch_size=8, wrap=True, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # frozen ones too: unfrozen later
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt,
        data_loader=DataLoader(ds, batch_size=batch_size, generator=torch.Generator().manual_seed(3)),
        noise_multiplier=0.0, max_grad_norm=c, grad_sample_mode=mode, wrap_model=wrap, **kw)
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return out[0], out[1], crit, out[-1]


def _brute(model, x, y, c, denom):
    """Σ_b clip_c(∇ loss_b) / denom over the trainable parameters, one sample at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    tot = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        gs = [torch.zeros_like(p) if g is None else g
              for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]
        f = min(1.0, c / (float(torch.sqrt(sum(g.pow(2).sum() for g in gs))) + 1e-6))
        for t, g in zip(tot, gs):
            t += f * g
    out, it = [], iter(tot)
    for p in model.parameters():
        out.append(next(it) / denom if p.requires_grad else torch.zeros_like(p))
    return out


def _step(module, opt, crit, x, y, model):
    before = [p.detach().clone() for p in model.parameters()]
    crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def _assert_step(model, ref, module, opt, crit, x, y, c=C, denom=8):
    upd = _step(module, opt, crit, x, y, model)
    want = _brute(ref, x, y, c, denom)
    for (n, _), a, b in zip(model.named_parameters(), upd, want):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=n)


def _setup(mode, make, wrap=True, pad=False, **kw):
    torch.manual_seed(1)
    model = make().to(DT)
    ref = copy.deepcopy(model)
    ds = _data(pad=pad)
    module, opt, crit, dl = _private(mode, model, ds, wrap=wrap, **kw)
    return model, ref, ds, module, opt, crit, dl


MODELS = {
    "plain": Net,
    "bidir2": lambda: Net(bidirectional=True, num_layers=2),
    "nobias": lambda: Net(bias=False),
    "twice": Twice,
    "tied_head": TiedHead,
    "tied_directions": TiedDirections,
}


@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", MODES)
def test_dp_step_matches_brute_force(mode, name, wrap):
    model, ref, ds, module, opt, crit, _ = _setup(mode, MODELS[name], wrap=wrap)
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    _assert_step(model, ref, module, opt, crit, x, y)


@pytest.mark.parametrize("mode", MODES)
def test_dp_packed_with_input_dependent_state(mode):
    model, ref, ds, module, opt, crit, _ = _setup(mode, PackedInit, pad=True)
    for k in range(2):
        x, y = ds.tensors[0][8 * k : 8 * k + 8], ds.tensors[1][8 * k : 8 * k + 8]
        _assert_step(model, ref, module, opt, crit, x, y)
        ref.load_state_dict(model.state_dict())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", ["freeze", "unfreeze", "unfreeze_lstm", "max_grad_norm"])
def test_dp_changes_after_make_private(mode, change):
    """``unfreeze_lstm``: the whole DPLSTM frozen at make_private has no hook, so unobserved it
    would run torch's kernel; unfrozen, its calls must be hooked again before it runs."""
    hh = ("weight_hh_l0", "bias_hh_l0")
    if change == "unfreeze_lstm":
        hh += ("weight_ih_l0", "bias_ih_l0")

    def set_hh(models, flag):
        for m in models:
            for n in hh:
                getattr(m.lstm, n).requires_grad_(flag)

    torch.manual_seed(1)
    model = Net().to(DT)
    ref = copy.deepcopy(model)
    if change.startswith("unfreeze"):
        set_hh([model, ref], False)
    ds = _data()
    module, opt, crit, _ = _private(mode, model, ds, c=10.0 if change == "max_grad_norm" else C)
    if change == "unfreeze_lstm":
        assert model.lstm._native_kernel(torch.zeros(1, 1, IN)) is not None
    if change == "freeze":
        set_hh([model, ref], False)
    elif change.startswith("unfreeze"):
        set_hh([model, ref], True)
    else:
        opt.max_grad_norm = C
    _assert_step(model, ref, module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8])


@pytest.mark.parametrize("mode", MODES)
def test_dp_empty_batch(mode):
    model, ref, ds, module, opt, crit, _ = _setup(mode, lambda: Net(bidirectional=True))
    upd = _step(module, opt, crit, ds.tensors[0][:0], ds.tensors[1][:0], model)
    assert all(torch.all(u == 0) for u in upd)


@pytest.mark.parametrize("mode", MODES)
def test_dp_batch_memory_manager(mode):
    model, ref, ds, module, opt, crit, dl = _setup(mode, lambda: Net(bidirectional=True))
    xs, ys = [], []
    before = [p.detach().clone() for p in model.parameters()]
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=3, optimizer=opt) as mdl:
        for x, y in mdl:
            xs.append(x)
            ys.append(y)
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            if not opt._is_last_step_skipped:
                break
    assert len(xs) > 1
    upd = [b - p.detach() for b, p in zip(before, model.parameters())]
    for (n, _), a, b in zip(model.named_parameters(), upd,
                            _brute(ref, torch.cat(xs), torch.cat(ys), C, 8)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=n)


@pytest.mark.parametrize("mode", MODES)
def test_dp_fixed_shape_padding_rows(mode):
    model, ref, ds, module, opt, crit, dl = _setup(
        mode, lambda: Net(bidirectional=True), poisson_sampling="fixed_shape", max_batch_size=14)
    it = iter(dl)
    for _ in range(2):
        x, y = next(it)
        valid = dl.layouts.current.valid
        assert x.shape[0] == 14 and 0 < int(valid.sum()) < 14
        upd = _step(module, opt, crit, x, y, model)
        for (n, _), a, b in zip(model.named_parameters(), upd,
                                _brute(ref, x[valid], y[valid], C, 8)):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=n)
        ref.load_state_dict(model.state_dict())


@pytest.mark.parametrize("mode", MODES)
def test_dp_layer_switched_to_eval_after_first_step_is_refused(mode):
    """A later step with the DPLSTM in eval mode (grad enabled, no capture) raises."""
    model, ref, ds, module, opt, crit, _ = _setup(mode, Net)
    _step(module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8], model)
    model.lstm.eval()
    with pytest.raises(ValueError):
        _step(module, opt, crit, ds.tensors[0][8:16], ds.tensors[1][8:16], model)


# ----------------------------------------------------------------------------- pre-existing
class _Scaled(nn.Module):
    """A custom layer (own parameter, no rule) whose forward calls a DPLSTM."""

    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True)
        self.scale = nn.Parameter(torch.tensor(1.3))  # 0-dim: the failing case

    def forward(self, x):
        return self.lstm(x * self.scale)[0][:, -1, :K] * self.scale


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Scaled()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("mode", MODES)
def test_custom_layer_with_scalar_parameter_around_dplstm(mode):
    """A 0-dim parameter of a custom layer (not DPLSTM-specific: nn.Linear in its place showed
    it too): the step is the brute force's. It once raised IndexError in hooks / functorch
    (``gs.flatten(2)``) and over-estimated ghost / bk norms (a sum over no dimensions sums
    everything)."""
    model, ref, ds, module, opt, crit, _ = _setup(mode, _Outer)
    _assert_step(model, ref, module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8])


class _LearnedInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True, bidirectional=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, H))
        self.c0 = nn.Parameter(torch.randn(2, 1, H))
        self.head = nn.Linear(2 * H, K)

    def forward(self, x):
        b = x.shape[0]
        hx = (self.h0.expand(2, b, H).contiguous(), self.c0.expand(2, b, H).contiguous())
        return self.head(self.lstm(x, hx)[0][:, -1])


@pytest.mark.parametrize("wrap", [True, pytest.param(False, id="wrap_model=False")])
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_learned_initial_state(mode, wrap):
    """A learned initial state; with wrap_model=False the root module owns parameters, and the
    functorch replay of the root in the backward pass must not re-enter the root pre-hook (it
    once raised 'Parameters were frozen or unfrozen during a backward pass')."""
    model, ref, ds, module, opt, crit, _ = _setup(mode, _LearnedInit, wrap=wrap)
    _assert_step(model, ref, module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8])
