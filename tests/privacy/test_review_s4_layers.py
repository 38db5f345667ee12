"""Review (session 4): DP layers (DPLSTM / DPGRU / DPRNN / DPMultiheadAttention), adaptive and
per-layer clipping, multi-pass (GAN) training.

Every step is checked against the brute force: each sample alone in float64, its gradient
clipped to C (per parameter for per-layer clipping), summed, divided by the expected batch size,
with ``noise_multiplier=0`` so the step is deterministic; or, where dptorch cannot be exact, it
must refuse with an error. The tests marked *finding* fail on the code they were written against.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
C = 0.05


# ----------------------------------------------------------------------------- helpers
def _private(model, x, y, mode, c=C, batch_size=8, **kw):
    """``(module, optimizer, criterion)`` of ``make_private`` with σ = 0 and plain SGD, lr = 1
    (the parameter update is the released gradient)."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=0.0, max_grad_norm=c, grad_sample_mode=mode, **kw)
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return out[0], out[1], crit


def _brute(model, per_sample_loss, n, c=C, denom=8, per_layer=None):
    """``{name: Σ_b clip(∇ loss_b) / denom}``; ``per_layer``: one bound per trainable parameter."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    tot = [torch.zeros_like(p) for p in params]
    for i in range(n):
        gs = torch.autograd.grad(per_sample_loss(model, i), params, allow_unused=True)
        gs = [torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)]
        if per_layer is None:
            norm = float(torch.sqrt(sum(g.pow(2).sum() for g in gs)))
            fs = [min(1.0, c / (norm + 1e-6))] * len(gs)
        else:
            fs = [min(1.0, ci / (float(g.norm()) + 1e-6)) for g, ci in zip(gs, per_layer)]
        for t, g, f in zip(tot, gs, fs):
            t += f * g
    return {k: t / denom for (k, _), t in zip(named, tot)}


def _update(model, run):
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    run()
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def _assert_close(upd, want):
    for k in want:
        torch.testing.assert_close(upd[k], want[k], rtol=1e-6, atol=1e-10, msg=k)


def _ce(model, xs, ys):
    return lambda m, i: F.cross_entropy(m(*(x[i : i + 1] for x in xs)), ys[i : i + 1])


# ============================================================================ findings
# ---------------------------------------------------------------- 1. ghost: a later forward
class _LaterFunctionalUse(nn.Module):
    """From the second forward on, ``l2.weight`` is also used outside ``l2``'s call (a
    data-dependent or flag-dependent branch: the use trace only runs on the first forward)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(3, 4)
        self.l2 = nn.Linear(4, 2)
        self.functional = False

    def forward(self, x):
        h = self.l1(x)
        out = self.l2(h)
        if self.functional:
            out = 0.001 * out + 100.0 * F.linear(h.detach(), self.l2.weight)
        return out


_DROPPED = pytest.mark.xfail(
    strict=True,
    reason="hooks/functorch drop the gradient of a use that first appears after the first "
    "(traced) forward pass: not released, but not exact either (README: Not caught). Tracing "
    "every pass would cost about 17% of a small model's step in the default mode.",
)


@pytest.mark.parametrize(
    "mode",
    [pytest.param("hooks", marks=_DROPPED), pytest.param("functorch", marks=_DROPPED),
     "ghost", "bk", "ew"],
)
def test_functional_use_appearing_after_first_forward_is_exact_or_refused(mode):
    """*Finding* (ghost: privacy; hooks/functorch: silent inexactness). The use trace that
    refuses ``F.linear(h, layer.weight)`` runs on the first forward pass only. A use that first
    appears in a later forward is not seen: in ghost mode the clip factor comes from the hooked
    norms, which miss it, while the second (weighted) backward pass carries its full gradient,
    so one sample's contribution to the released sum reaches ~10⁴ C here (unbounded in
    general); hooks/functorch silently drop that gradient. bk refuses at backward (its
    autograd gradient check), ew is exact. Either exact or a ValueError is acceptable. Fixed
    for ghost: it traces every forward pass (``TRACE_EVERY_PASS``)."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, dtype=DT)
    y = torch.randint(0, 2, (16,))
    torch.manual_seed(1)
    model = _LaterFunctionalUse().to(DT)
    module, opt, crit = _private(model, x, y, mode, c=0.01)
    crit(module(x[:8]), y[:8]).backward()
    opt.step()
    opt.zero_grad()
    model.functional = True
    ref = copy.deepcopy(model)
    xb, yb = x[8:9], y[8:9]  # one sample: its clipped contribution must have norm <= C

    def run():
        crit(module(xb), yb).backward()
        opt.step()

    try:
        upd = _update(model, run)
    except ValueError:
        return
    released = float(torch.sqrt(sum(u.pow(2).sum() for u in upd.values()))) * 8
    assert released <= 0.01 * (1 + 1e-6), f"one sample moved the release by {released} > C"
    _assert_close(upd, _brute(ref, _ce(ref, (xb,), yb), 1, c=0.01))


# ---------------------------------------------------------------- 2. gradient penalty (GAN)
def _critic():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).to(DT)


def _wgan_gp_loss(d, x, gsm=None):
    """A critic loss with a WGAN-GP style gradient penalty (double backward). The inner
    ``autograd.grad`` runs with the backward hooks off, as docs/multi_pass.md advises."""
    x = x.clone().requires_grad_(True)
    out = d(x)
    if gsm is not None:
        gsm.disable_backward_hooks()
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    if gsm is not None:
        gsm.enable_backward_hooks()
    return (out.sum() + 3.0 * ((gx.norm(dim=1) - 1) ** 2).sum()) / len(x)


@pytest.mark.parametrize(
    ("mode", "kw"),
    [
        ("hooks", {}),
        ("functorch", {}),
        ("hooks", dict(multi_pass=True, accum_passes=True)),
        ("hooks", dict(multi_pass=True, accum_passes=False, num_private_passes=1)),
        ("ew", {}),
        ("bk", {}),
    ],
    ids=["hooks", "functorch", "mp_basic", "mp_split", "ew", "bk"],
)
def test_gradient_penalty_double_backward_is_exact_or_refused(mode, kw):
    """*Finding* (silent inexactness). A gradient penalty differentiates through the backward
    graph (``create_graph=True``): the weights also enter the loss through ``∂D/∂x = g·W``,
    a use no forward hook sees, and the hooks of the second backward see a partial
    ``backprops``. hooks/functorch (single and multi-pass) and ew release Σ clip(partial
    per-sample gradient) without a word; bk refuses ("received a gradient from a use outside
    its layer's call"). The released step must equal the brute force or raise."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, dtype=DT)
    y = torch.zeros(8, dtype=torch.long)
    model = _critic()
    ref = copy.deepcopy(model)
    module, opt, _ = _private(model, x, y, mode, **kw)
    toggles = module if hasattr(module, "disable_backward_hooks") else None

    def run():
        _wgan_gp_loss(module, x, toggles).backward()
        opt.step()

    try:
        upd = _update(model, run)
    except (ValueError, RuntimeError):
        return
    want = _brute(ref, lambda m, i: _wgan_gp_loss(m, x[i : i + 1]), 8)
    _assert_close(upd, want)


# ---------------------------------------------------------------- 3. DPMultiheadAttention
def test_mha_key_batch_mismatch_is_refused_like_torch():
    """*Finding* (silent wrong semantics). ``nn.MultiheadAttention`` refuses a key/value whose
    batch differs from the query's; DPMultiheadAttention views the (1, S, E) key as
    (B, S/B, ...) when B divides S, so sample b attends to key position b only. Under a
    GradSampleModule the hooks expand the projection's batch-1 output to the batch, so DP
    training computes another function (every sample attends to every position) than the same
    model in eval or unwrapped: the trained model is not the evaluated one."""
    torch.manual_seed(0)
    q = torch.randn(8, 3, 4)
    mem = torch.randn(1, 8, 4)
    with pytest.raises((RuntimeError, AssertionError)):
        nn.MultiheadAttention(4, 2, batch_first=True)(q, mem, mem)
    with pytest.raises((RuntimeError, ValueError)):
        DPMultiheadAttention(4, 2, batch_first=True)(q, mem, mem)


# ---------------------------------------------------------------- 4. AdaClip checkpoint
def test_adaclip_checkpoint_does_not_store_the_raw_batch_size(tmp_path):
    """*Finding* (minor release). AdaClip's ``sample_size`` is the exact number of records of
    the last logical batch (never noised, unused by the update, which divides by the public
    expected batch size) and ``save_checkpoint`` writes it among the "DP settings". A Poisson
    batch's size is private; a checkpoint must hold only released quantities."""
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = torch.randint(0, 2, (64,))
    model = nn.Linear(3, 2)
    pe = PrivacyEngine(accountant="rdp")
    m, opt, dl = pe.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.0,
        max_grad_norm=1.0, clipping="adaptive", target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.01,
        unclipped_num_std=4.0)
    xb, yb = next(iter(dl))
    F.cross_entropy(m(xb), yb).backward()
    opt.step()
    buf = io.BytesIO()
    pe.save_checkpoint(path=buf, module=m, optimizer=opt)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    settings = ckpt.get("dp_optimizer_state", {})
    assert settings.get("sample_size") != float(len(yb)), (
        "the checkpoint holds the exact size of the last Poisson batch")


# ============================================================================ coverage
# (attacks handled correctly, not covered elsewhere)
B, T, IN, H, K = 8, 4, 3, 4, 3


def _seq_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, IN, generator=g, dtype=DT)
    return x, torch.randint(0, K, (B,), generator=g)


class _RecurrentLearnedH0(nn.Module):
    """Bidirectional two-layer DPGRU / DPRNN, time-major, with a learned h_0 expanded to the
    batch."""

    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(IN, H, num_layers=2, bidirectional=True)
        self.h0 = nn.Parameter(torch.randn(4, 1, H))
        self.head = nn.Linear(2 * H, K)

    def forward(self, x):
        h0 = self.h0.expand(4, x.shape[0], H).contiguous()
        out, _ = self.rnn(x.transpose(0, 1), h0)
        return self.head(out[-1])


@pytest.mark.parametrize("mode", ["functorch", "ghost", "bk"])
@pytest.mark.parametrize("cls", [DPGRU, DPRNN])
def test_gru_rnn_learned_h0_dp_step(cls, mode):
    """The general (autograd replay) recurrence with a trainable h_0, time-major layer."""
    x, y = _seq_data()
    torch.manual_seed(1)
    model = _RecurrentLearnedH0(cls).to(DT)
    ref = copy.deepcopy(model)
    module, opt, crit = _private(model, x, y, mode)
    upd = _update(model, lambda: (crit(module(x), y).backward(), opt.step()))
    _assert_close(upd, _brute(ref, _ce(ref, (x,), y), B))


class _Attn(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.bf = batch_first
        self.attn = DPMultiheadAttention(4, 2, batch_first=batch_first, add_bias_kv=True,
                                         add_zero_attn=True, kdim=5, vdim=5)
        self.head = nn.Linear(4, K)

    def forward(self, q, kv, kpm):
        am = torch.zeros(q.shape[1], kv.shape[1], dtype=torch.bool)
        am[0, -1] = True
        if not self.bf:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        out, w = self.attn(q, kv, kv, key_padding_mask=kpm, attn_mask=am)
        if not self.bf:
            out = out.transpose(0, 1)
        return self.head(out.sum(1) + w.sum((1, 2)).unsqueeze(-1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_mha_masks_bias_kv_zero_attn_kdim_dp_step(mode, batch_first):
    """key_padding_mask + attn_mask + add_bias_kv + add_zero_attn + kdim/vdim + need_weights,
    in the fast-clipping modes."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 3, 4, generator=g, dtype=DT)
    kv = torch.randn(B, 4, 5, generator=g, dtype=DT)
    kpm = torch.rand(B, 4, generator=g) < 0.4
    kpm[:, 0] = False
    y = torch.randint(0, K, (B,), generator=g)
    torch.manual_seed(1)
    model = _Attn(batch_first).to(DT)
    ref = copy.deepcopy(model)
    module, opt, crit = _private(model, q, y, mode)
    upd = _update(model, lambda: (crit(module(q, kv, kpm), y).backward(), opt.step()))
    _assert_close(upd, _brute(ref, _ce(ref, (q, kv, kpm), y), B))


class _Disc(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(IN, H, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * H, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1]).squeeze(-1)


@pytest.mark.parametrize("accum", [True, False], ids=["basic", "split"])
@pytest.mark.parametrize("cls", [DPLSTM, DPGRU])
def test_multi_pass_recurrent_discriminator(cls, accum):
    """A recurrent GAN discriminator, a real and a fake pass of equal size: basic clipping
    clips Σ_passes per sample, split clipping each pass (noise × num_private_passes)."""
    g = torch.Generator().manual_seed(0)
    real = torch.randn(6, T, IN, generator=g, dtype=DT)
    fake = torch.randn(6, T, IN, generator=g, dtype=DT)
    torch.manual_seed(1)
    model = _Disc(cls).to(DT)
    ref = copy.deepcopy(model)
    kw = dict(accum_passes=True) if accum else dict(accum_passes=False, num_private_passes=2)
    module, opt, _ = _private(model, real, torch.zeros(6, dtype=torch.long), "hooks",
                              batch_size=6, multi_pass=True, **kw)
    assert opt.noise_scale_factor == (1 if accum else 2)

    def run():
        module(real).mean().backward()
        (-module(fake)).mean().backward()
        opt.step()

    upd = _update(model, run)
    ps = [p for p in ref.parameters()]
    tot = [torch.zeros_like(p) for p in ps]
    for j in range(6):
        r, f = real[j : j + 1], fake[j : j + 1]
        losses = [ref(r).mean() - ref(f).mean()] if accum else [ref(r).mean(), -ref(f).mean()]
        for loss in losses:
            gs = torch.autograd.grad(loss, ps)
            fac = min(1.0, C / (float(torch.sqrt(sum(g_.pow(2).sum() for g_ in gs))) + 1e-6))
            for t_, g_ in zip(tot, gs):
                t_ += fac * g_ / 6
    _assert_close(upd, {k: t_ for (k, _), t_ in zip(ref.named_parameters(), tot)})


class _TiedGRU(nn.Module):
    """Both directions share W_ih and W_hh (shared parameters, one bound each)."""

    def __init__(self):
        super().__init__()
        self.rnn = DPGRU(IN, H, batch_first=True, bidirectional=True)
        self.rnn.l0_reverse.hh.weight = self.rnn.l0.hh.weight
        self.rnn.l0_reverse.ih.weight = self.rnn.l0.ih.weight
        self.head = nn.Linear(2 * H, K)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_per_layer_tied_recurrent_weights(mode):
    """Per-layer clipping of weights shared by two RNNLinear calls: each parameter's whole
    per-sample gradient is clipped to its bound; the noise is calibrated to sqrt(Σ C_i²)."""
    x, y = _seq_data()
    torch.manual_seed(1)
    model = _TiedGRU().to(DT)
    ref = copy.deepcopy(model)
    n = sum(1 for _ in model.parameters())
    cs = [0.01 * (1 + i % 3) for i in range(n)]
    module, opt, crit = _private(model, x, y, mode, c=cs, clipping="per_layer")
    assert opt.max_grad_norm == pytest.approx(sum(c * c for c in cs) ** 0.5)
    upd = _update(model, lambda: (crit(module(x), y).backward(), opt.step()))
    _assert_close(upd, _brute(ref, _ce(ref, (x,), y), B, per_layer=cs))
