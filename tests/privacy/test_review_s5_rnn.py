"""Review (session 5): DPRNN / DPGRU / DPLSTM run torch's fused kernel when nothing observes
their ``RNNLinear`` calls (commit 356c1e7), and Linear's ghost norm reuses the output-gradient
Gram of the previous call (``linear._output_gram``).

Every DP step is checked against the brute force (each sample alone in float64, its gradient
clipped to C, summed, divided by the expected batch size, ``noise_multiplier=0``), or must be
refused. Tests named ``test_finding_*`` fail on the code they were written against; the others
pin behaviour that holds.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import linear as linear_rule
from dptorch.layers import DPGRU, DPLSTM, DPRNN

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
MODES = ["hooks", "functorch", "ghost", "bk"]
N, T, IN, H, K = 24, 4, 3, 4, 3
C = 0.05  # every sample is clipped


# ----------------------------------------------------------------------------- helpers
class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True, **kw)
        self.head = nn.Linear(H * (2 if kw.get("bidirectional") else 1), K)

    def forward(self, x):
        out, (_, c) = self.lstm(x)
        return self.head(out[:, -1]) + c[-1].sum(-1, keepdim=True)


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, T, IN, generator=g, dtype=DT),
                         torch.randint(0, K, (n,), generator=g))


def _private(mode, model, ds, wrap=True):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode=mode, wrap_model=wrap)
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return out[0], out[1], crit


def _brute(model, x, y, denom=8):
    params = [p for p in model.parameters() if p.requires_grad]
    tot = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        gs = [torch.zeros_like(p) if g is None else g
              for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]
        f = min(1.0, C / (float(torch.sqrt(sum(g.pow(2).sum() for g in gs))) + 1e-6))
        for t, g in zip(tot, gs):
            t += f * g
    it = iter(tot)
    return [next(it) / denom if p.requires_grad else torch.zeros_like(p)
            for p in model.parameters()]


def _step(module, opt, crit, x, y, model):
    before = [p.detach().clone() for p in model.parameters()]
    crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def _exact_or_refused(step, ref_update):
    """``step()`` must raise ValueError/RuntimeError/NotImplementedError, or return the brute
    force's update."""
    try:
        upd = step()
    except (ValueError, RuntimeError, NotImplementedError):
        return
    for a, b in zip(upd, ref_update()):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def _tied_copy(src: DPLSTM) -> DPLSTM:
    """A new DPLSTM whose parameters are ``src``'s (the same Parameter objects)."""
    new = DPLSTM(src.input_size, src.hidden_size, batch_first=True).to(DT)
    for a, b in zip(src.cells, new.cells):
        b.ih.weight, b.hh.weight, b.ih.bias, b.hh.bias = a.ih.weight, a.hh.weight, a.ih.bias, a.hh.bias
    new.set_rename_map(new.old_to_new)
    return new


# ----------------------------------------------------------------------------- findings
@pytest.mark.parametrize("cls,ref_cls", [(DPLSTM, nn.LSTM), (DPGRU, nn.GRU), (DPRNN, nn.RNN)])
def test_finding_decomposed_path_mixed_second_derivative(cls, ref_cls):
    """*Finding* (wrong numbers, silent). The decomposed recurrence (the path taken on every
    non-CPU device, under any hook, and with ``use_native_kernel=False``) computes the hidden
    states without autograd, so ``d/dx ||dL/dθ||²`` (a gradient penalty, the immediate
    sensitivity engine's ``‖∂‖g‖/∂x_i‖``) misses every term through the recorded states. torch's
    kernel (the native path) is exact. Must match nn.*, or raise on create_graph."""
    torch.manual_seed(0)
    ref = ref_cls(3, 5, batch_first=True).to(DT)
    dp = cls(3, 5, batch_first=True).to(DT)
    dp.load_state_dict(ref.state_dict())
    dp.use_native_kernel = False
    x0 = torch.randn(2, 4, 3, dtype=DT)

    def penalty_grad(m):
        x = x0.clone().requires_grad_()
        gs = torch.autograd.grad(m(x)[0].pow(2).sum(), list(m.parameters()), create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in gs), x)[0]

    want = penalty_grad(ref)
    try:
        got = penalty_grad(dp)
    except RuntimeError:
        return
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_finding_fast_modes_release_a_hooks_off_gradient_left_before_the_dp_pass(mode):
    """*Finding* (silent privacy failure; not specific to the RNN change: a Linear-only model
    shows it too). A backward pass with the hooks off (a GAN's generator update through the
    private discriminator) leaves autograd's unclipped gradient in ``p.grad``; without
    ``zero_grad`` the next DP pass adds its clipped sum on top and the step releases both.
    ``test_fast_modes_refuse_p_grad_written_outside_clipping`` covers a write *after* the
    clipped pass only."""
    torch.manual_seed(1)
    model = Net(bidirectional=True).to(DT)
    ref = copy.deepcopy(model)
    ds = _data()
    module, opt, crit = _private(mode, model, ds)
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]

    def step():
        module.disable_hooks()
        F.cross_entropy(module(ds.tensors[0][16:24]), ds.tensors[1][16:24]).backward()
        module.enable_hooks()
        return _step(module, opt, crit, x, y, model)

    _exact_or_refused(step, lambda: _brute(ref, x, y))


class _TwoLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(IN, H, batch_first=True)
        self.head = nn.Linear(H, K)
        self.use2 = False

    def forward(self, x):
        out, _ = self.lstm(x)
        if self.use2:
            out = out + self.lstm2(x)[0]
        return self.head(out[:, -1])


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])  # ew: no DPLSTM
def test_tied_layer_added_after_make_private_is_hooked(mode):
    """A DPLSTM added after make_private that reuses the model's trainable parameters (a tied
    copy) is hooked at the next forward pass: its contribution is in the clipped sum, exactly
    (the trainable signature is made of (module, parameter) pairs, not parameter ids alone).
    ghost and bk may refuse instead."""
    torch.manual_seed(1)
    model = _TwoLSTM().to(DT)
    ds = _data()
    module, opt, crit = _private(mode, model, ds)
    _step(module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8], model)
    model.lstm2 = _tied_copy(model.lstm)
    model.use2 = True
    ref = _TwoLSTM().to(DT)
    ref.load_state_dict(model.state_dict(), strict=False)
    ref.lstm2 = _tied_copy(ref.lstm)
    ref.use2 = True
    x, y = ds.tensors[0][8:16], ds.tensors[1][8:16]
    _exact_or_refused(lambda: _step(module, opt, crit, x, y, model), lambda: _brute(ref, x, y))


def test_finding_parametrization_of_a_torch_named_weight_is_ignored():
    """*Finding* (wrong numbers, silent; both paths). ``weight_norm(lstm, "weight_hh_l0")``,
    the nn.LSTM idiom, parametrizes the alias only: the cells keep using ``l0.hh.weight``, the
    new ``original0/1`` never get a gradient. Must behave as nn.LSTM, or raise."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    ref = nn.LSTM(3, 4, batch_first=True).to(DT)
    dp = DPLSTM(3, 4, batch_first=True).to(DT)
    dp.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 3, dtype=DT)
    try:
        for m in (ref, dp):
            parametrizations.weight_norm(m, "weight_hh_l0")
            with torch.no_grad():
                m.parametrizations.weight_hh_l0.original0.mul_(3)
        got = dp(x)[0]
    except (RuntimeError, ValueError, NotImplementedError):
        return
    torch.testing.assert_close(got, ref(x)[0])


def test_finding_linear_norms_under_inference_mode():
    """*Finding* (false refusal, regression of the Gram cache). ``compute_linear_norm_sample``
    (Opacus API) on inference tensors: ``backprops._version`` raises 'Inference tensors do not
    track version counter'."""
    lin = nn.Linear(64, 64)
    with torch.inference_mode():
        a, g = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
        got = linear_rule.compute_linear_norm_sample(lin, [a], g)[lin.weight]
    gs = torch.einsum("bto,bti->boi", g, a)
    torch.testing.assert_close(got, gs.flatten(1).norm(dim=1))


# ----------------------------------------------------------------------------- pinned
@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_dp_wrapped_layer_never_takes_the_native_path(mode, wrap):
    model = Net(bidirectional=True).to(DT)
    x = torch.zeros(1, 1, IN, dtype=DT)
    assert model.lstm._native_kernel(x) is not None
    module, opt, crit = _private(mode, model, _data())
    assert model.lstm._native_kernel(x) is None
    module.disable_hooks()
    assert model.lstm._native_kernel(x) is None  # still observed: decomposed, refused by the checks


@pytest.mark.parametrize("mode", MODES)
def test_unfrozen_inside_forward_is_refused(mode):
    """The DPLSTM frozen at wrapping (no hooks: native path) unfrozen inside the forward pass,
    after ``_begin_forward``'s refresh: its native-kernel gradient must not be released."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(IN, IN)
            self.lstm = DPLSTM(IN, H, batch_first=True)
            self.head = nn.Linear(H, K)
            self.flip = False

        def forward(self, x):
            if self.flip:
                for p in self.lstm.parameters():
                    p.requires_grad_(True)
            return self.head(self.lstm(self.emb(x))[0][:, -1])

    torch.manual_seed(1)
    model = M().to(DT)
    model.lstm.requires_grad_(False)
    ds = _data()
    module, opt, crit = _private(mode, model, ds)
    _step(module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8], model)
    model.flip = True
    ref = copy.deepcopy(model)
    ref.lstm.requires_grad_(True)
    x, y = ds.tensors[0][8:16], ds.tensors[1][8:16]
    _exact_or_refused(lambda: _step(module, opt, crit, x, y, model), lambda: _brute(ref, x, y))


@pytest.mark.parametrize("mode", MODES)
def test_swapped_in_layer_with_the_same_parameters_is_exact_or_refused(mode):
    """``model.lstm = DPLSTM(...)`` holding the old layer's Parameter objects: the trainable
    signature is unchanged, the new RNNLinears are unhooked and run torch's kernel."""
    torch.manual_seed(1)
    model = Net().to(DT)
    ds = _data()
    module, opt, crit = _private(mode, model, ds)
    _step(module, opt, crit, ds.tensors[0][:8], ds.tensors[1][:8], model)
    model.lstm = _tied_copy(model.lstm)
    ref = Net().to(DT)
    ref.load_state_dict(model.state_dict())
    x, y = ds.tensors[0][8:16], ds.tensors[1][8:16]
    _exact_or_refused(lambda: _step(module, opt, crit, x, y, model), lambda: _brute(ref, x, y))


class _Wide(nn.Module):
    """Dimensions where Linear's ghost norm takes the Gram route for ``ih`` and ``hh``."""

    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(24, 24, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, K)

    def forward(self, x):
        out = self.lstm(x)[0]
        return self.head(out[:, -1] + out.mean(1))


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_shared_output_gram_is_exact(mode, monkeypatch):
    hits = []
    orig = linear_rule._output_gram

    def counting(bp, g):
        last = linear_rule._last_gram
        out = orig(bp, g)
        hits.append(last is not None and out is last[2])  # the cached Gram was returned
        return out

    monkeypatch.setattr(linear_rule, "_output_gram", counting)
    torch.manual_seed(0)
    model = _Wide().to(DT)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(24, 3, 24, generator=g, dtype=DT),
                       torch.randint(0, K, (24,), generator=g))
    module, opt, crit = _private(mode, model, ds)
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    upd = _step(module, opt, crit, x, y, model)
    assert any(hits) and not all(hits)
    for a, b in zip(upd, _brute(ref, x, y)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_output_gram_not_reused_after_in_place_change():
    l1, l2 = nn.Linear(64, 64), nn.Linear(64, 64)
    a, g = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    linear_rule.compute_linear_norm_sq_sample(l1, [a], g)
    g.mul_(2)
    got = linear_rule.compute_linear_norm_sq_sample(l2, [a], g)[l2.weight]
    want = linear_rule.compute_linear_norm_sq_sample(l2, [a], g.clone())[l2.weight]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("proj", [0, 2])
def test_native_path_packed_unsorted_with_state_matches_torch(proj):
    torch.manual_seed(0)
    kw = dict(input_size=3, hidden_size=4, num_layers=2, bidirectional=True, batch_first=True,
              proj_size=proj)
    ref, dp = nn.LSTM(**kw).to(DT), DPLSTM(**kw).to(DT)
    dp.load_state_dict(ref.state_dict())
    assert dp._native_kernel(torch.zeros(1, 1, 3, dtype=DT)) is not None
    x0, lengths = torch.randn(4, 5, 3, dtype=DT), torch.tensor([2, 5, 1, 3])
    h0 = torch.randn(4, 4, proj or 4, dtype=DT)
    c0 = torch.randn(4, 4, 4, dtype=DT)
    res = []
    for m in (ref, dp):
        x, h, c = (t.clone().requires_grad_() for t in (x0, h0, c0))
        out, (hn, cn) = m(pack_padded_sequence(x, lengths, batch_first=True,
                                               enforce_sorted=False), (h, c))
        out = pad_packed_sequence(out, batch_first=True)[0]
        (out.pow(2).sum() + hn.sin().sum() + cn.cos().sum()).backward()
        res.append([out, hn, cn, x.grad, h.grad, c.grad, *[p.grad for p in m.parameters()]])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b)
