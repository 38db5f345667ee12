"""Attacks on the mean-loss ``scale`` (the ``1/B`` undone on backprops in hooks mode, on norms,
cross terms and clip factors in ghost / bk), bk's ``weighted_clipped_sum`` (nn.Linear, GPT-2
Conv1D), the batch-folded Conv2d weight gradient, the optimizer's foreach noise / mean scaling,
0-dim parameters and a root that owns parameters with ``wrap_model=False``.

Every test runs one or two DP steps (noise 0 unless said otherwise) through
``PrivacyEngine.make_private`` and compares the released update with the float64 brute force:
per-sample gradients one sample at a time with plain autograd, clipped with
``min(1, C / (||g|| + 1e-6))`` over all trainable parameters, summed, divided by the expected
batch size for a mean loss. C is chosen between the samples' norms (some clipped, some not), so
that a wrong scale shows both as a wrong direction and as a wrong magnitude."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.batch_memory_manager import BatchMemoryManager
from dptorch.grad_sample import conv as conv_module
from dptorch.layers import DPGRU, DPLSTM, DPRNN

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
EXPECTED = 8  # the loaders' batch size: expected batch size of every step
N = 24
MODES = ["hooks", "functorch", "ghost", "bk"]
MODE_WRAP = [("hooks", True), ("hooks", False), ("functorch", True), ("ghost", True),
             ("bk", True), ("bk", False)]


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)


# ----------------------------------------------------------------------------- harness
def _ce(red):
    """Cross-entropy over samples (or tokens: (B, T, V) logits); the ghost loss wrapper when
    ``crit`` is given."""

    def loss(m, x, y, crit=None):
        out = m(x)
        if out.dim() == 3:
            flat, t = out.reshape(-1, out.shape[-1]), y.reshape(-1)
            return crit(flat, t, shape=out.shape) if crit is not None else F.cross_entropy(
                flat, t, reduction=red)
        return crit(out, y) if crit is not None else F.cross_entropy(out, y, reduction=red)

    return loss


def _private(model, mode, ds, c, *, wrap=True, red="mean", sigma=0.0, gen=None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(reduction=red),
        loss_reduction=red, noise_multiplier=sigma, max_grad_norm=c, grad_sample_mode=mode,
        wrap_model=wrap, noise_generator=gen,
        data_loader=DataLoader(ds, batch_size=EXPECTED, generator=torch.Generator().manual_seed(3)),
        **kw)
    return out[0], out[1], (out[2] if len(out) == 4 else None), out[-1]


def _per_sample(model, x, y, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(len(x)):
        grads = torch.autograd.grad(loss(model, x[i:i + 1], y[i:i + 1]), params, allow_unused=True)
        yield [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _mid_bound(model, x, y, loss) -> float:
    """A C between the samples' norms: about half of them are clipped."""
    norms = sorted(math.sqrt(sum(float(g.pow(2).sum()) for g in gs))
                   for gs in _per_sample(model, x, y, loss))
    if not norms:
        return 1.0
    if len(norms) == 1:
        return norms[0] / 2
    return (norms[len(norms) // 2 - 1] + norms[len(norms) // 2]) / 2


def _brute(model, x, y, c, denom, loss, per_layer=False):
    """Σ_b clip_C(∇ loss_b) / denom, one entry per parameter (zeros for frozen ones)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for gs in _per_sample(model, x, y, loss):
        if per_layer:
            fs = [min(1.0, ci / (float(g.norm()) + 1e-6)) for g, ci in zip(gs, c)]
        else:
            f = min(1.0, c / (math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) + 1e-6))
            fs = [f] * len(gs)
        for t, g, f in zip(total, gs, fs):
            t += f * g
    it = iter(total)
    return [next(it) / denom if p.requires_grad else torch.zeros_like(p)
            for p in model.parameters()]


def _update(module, opt, crit, x, y, model, loss):
    before = [p.detach().clone() for p in model.parameters()]
    loss(module, x, y, crit).backward()
    opt.step()
    opt.zero_grad()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def _assert_close(model, got, want, rtol=1e-7, atol=1e-10):
    for (n, _), a, b in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda s, n=n: f"{n}: {s}")


def _check_step(make, mode, x, y, *, wrap=True, red="mean", loss=None, c=None, rtol=1e-7,
                atol=1e-10, per_layer=False, **kw):
    """One DP step on the batch ``(x, y)`` (any size; the loader only sets q and the expected
    batch size) against the brute force."""
    loss = loss or _ce(red)
    torch.manual_seed(1)
    model = make().to(DT)
    ref = copy.deepcopy(model)
    if c is None:
        c = _mid_bound(ref, x, y, loss)
    ds = TensorDataset(torch.zeros(N, *x.shape[1:], dtype=x.dtype),
                       torch.zeros(N, *y.shape[1:], dtype=y.dtype))
    if per_layer:
        kw["clipping"] = "per_layer"
    module, opt, crit, _ = _private(model, mode, ds, c, wrap=wrap, red=red, **kw)
    got = _update(module, opt, crit, x, y, model, loss)
    want = _brute(ref, x, y, c, EXPECTED if red == "mean" else 1, loss, per_layer=per_layer)
    _assert_close(model, got, want, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- models
class MLP(nn.Module):
    """Linear 6 -> 3 (in > out: the clip factors go on G), 3 -> 10 (in < out: on A), 10 -> 4."""

    def __init__(self, bias=True):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 3, bias=bias), nn.Linear(3, 10, bias=bias), \
            nn.Linear(10, 4, bias=bias)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Seq(nn.Module):
    """(B, T, d) inputs, token-level loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Twice(nn.Module):
    """One Linear called twice in a forward (cross terms, each with its call's scale)."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.out(self.lin(torch.tanh(self.lin(x))))


class Tied(nn.Module):
    """Embedding tied to the output Linear."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj, self.out = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.proj(self.emb(ids))).mean(1))


class TiedSeq(Tied):
    def forward(self, ids):
        return self.out(torch.tanh(self.proj(self.emb(ids))))


def _frozen_bias():
    m = MLP()
    m.b.bias.requires_grad_(False)
    return m


def _frozen_weights():
    m = MLP()
    m.a.weight.requires_grad_(False)
    m.b.weight.requires_grad_(False)
    return m


def _data(shape, k, seed=0, ints=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, ints, shape, generator=g) if ints else torch.randn(shape, generator=g)
    return x, torch.randint(0, k, (shape[0],) if k != "seq" else shape[:2], generator=g)


LINEAR_MODELS = {
    "mlp": (MLP, lambda: _data((8, 6), 4)),
    "mlp_nobias": (lambda: MLP(bias=False), lambda: _data((8, 6), 4)),
    "frozen_bias": (_frozen_bias, lambda: _data((8, 6), 4)),
    "frozen_weights": (_frozen_weights, lambda: _data((8, 6), 4)),
    "seq_tokens": (Seq, lambda: (torch.randn(8, 5, 6), torch.randint(0, 4, (8, 5)))),
    "twice": (Twice, lambda: _data((8, 6), 4)),
    "tied": (Tied, lambda: _data((8, 3), 6, ints=6)),
    "tied_tokens": (TiedSeq, lambda: (torch.randint(0, 6, (8, 3)), torch.randint(0, 6, (8, 3)))),
}


@pytest.mark.parametrize("b", [8, 3, 1])
@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize(("mode", "wrap"), MODE_WRAP)
@pytest.mark.parametrize("name", list(LINEAR_MODELS))
def test_linear_family(name, mode, wrap, red, b):
    """Poisson-like batch sizes 8 (= expected), 3 and 1 with a mean or sum loss: the scale is
    the batch's size, the released sum is divided by the expected size."""
    make, data = LINEAR_MODELS[name]
    x, y = data()
    _check_step(make, mode, x[:b], y[:b], wrap=wrap, red=red)


@pytest.mark.parametrize(("mode", "wrap"), MODE_WRAP)
def test_sequence_model_batch_second(mode, wrap):
    """batch_first=False: (T, B, d) inputs, the batch moved first before the scale is read."""

    class TB(Seq):
        def forward(self, x):  # x (T, B, d) -> logits (B, T, V)
            return super().forward(x).transpose(0, 1)

    x, y = torch.randn(5, 3, 6), torch.randint(0, 4, (3, 5))

    def loss(m, x, y, crit=None):
        out = m(x)
        flat, t = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        return crit(flat, t, shape=out.shape) if crit is not None else F.cross_entropy(flat, t)

    torch.manual_seed(1)
    model = TB().to(DT)
    ref = copy.deepcopy(model)
    samples = [(x[:, i:i + 1], y[i:i + 1]) for i in range(3)]
    norms = sorted(math.sqrt(sum(float(g.pow(2).sum()) for g in torch.autograd.grad(
        loss(ref, xi, yi), list(ref.parameters())))) for xi, yi in samples)
    c = (norms[0] + norms[1]) / 2
    ds = TensorDataset(torch.zeros(N, 5, 6), torch.zeros(N, 5, dtype=torch.long))
    module, opt, crit, _ = _private(model, mode, ds, c, wrap=wrap, batch_first=False)
    got = _update(module, opt, crit, x, y, model, loss)
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for xi, yi in samples:
        gs = torch.autograd.grad(loss(ref, xi, yi), list(ref.parameters()))
        f = min(1.0, c / (math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) + 1e-6))
        for t, g in zip(total, gs):
            t += f * g / EXPECTED
    _assert_close(model, got, total)


@pytest.mark.parametrize(("mode", "wrap"), MODE_WRAP)
def test_empty_batch_releases_zero(mode, wrap):
    make, data = LINEAR_MODELS["twice"]
    x, y = data()
    torch.manual_seed(1)
    model = make().to(DT)
    ds = TensorDataset(torch.zeros(N, 6), torch.zeros(N, dtype=torch.long))
    module, opt, crit, _ = _private(model, mode, ds, 0.5, wrap=wrap)
    got = _update(module, opt, crit, x[:0], y[:0], model, _ce("mean"))
    assert all(torch.equal(u, torch.zeros_like(u)) for u in got)


# ----------------------------------------------------------------------------- Conv2d folding
class ConvNet(nn.Module):
    def __init__(self, cin=16, cout=8, channels_last=False, frozen=None, **kw):
        super().__init__()
        kw.setdefault("kernel_size", 3)
        self.conv, self.fc, self.cl = nn.Conv2d(cin, cout, **kw), nn.Linear(cout, 3), channels_last
        if frozen:
            getattr(self.conv, frozen).requires_grad_(False)

    def forward(self, x):
        if self.cl:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.fc(torch.tanh(self.conv(x)).mean((2, 3)))


CONVS = {
    "pad1": dict(padding=1),
    "groups2": dict(cin=32, groups=2, padding=1),
    "groups4_wide": dict(cin=64, cout=16, groups=4, padding=1),
    "stride2": dict(padding=1, stride=2),
    "reflect": dict(padding=1, padding_mode="reflect"),
    "dilation2": dict(padding=2, dilation=2),
    "same_dilated": dict(padding="same", dilation=2),
    "same_even_kernel": dict(kernel_size=4, padding="same"),
    "circular_stride3": dict(padding=2, padding_mode="circular", stride=3),
    "asymmetric": dict(kernel_size=(3, 5), padding=(1, 2), stride=(2, 1), dilation=(1, 2)),
    "replicate_same": dict(kernel_size=(3, 5), padding="same", padding_mode="replicate"),
    "valid_nobias": dict(padding="valid", bias=False),
    "channels_last": dict(padding=1, channels_last=True),
    "frozen_weight": dict(padding=1, frozen="weight"),
    "frozen_bias": dict(padding=1, frozen="bias"),
    "out64": dict(cout=64, padding=1),
}


@pytest.mark.parametrize("b", [6, 1, 0])
@pytest.mark.parametrize(("mode", "wrap"), [("hooks", True), ("hooks", False), ("ghost", True),
                                            ("bk", True), ("bk", False)])
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_folded(name, mode, wrap, b):
    kw = CONVS[name]
    assert conv_module._folding_is_faster(ConvNet(**kw).conv)  # the folded path is taken
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, kw.get("cin", 16), 9, 11, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    _check_step(lambda: ConvNet(**kw), mode, x[:b], y[:b], wrap=wrap)


# ----------------------------------------------------------------------------- 0-dim / root
class Scalar(nn.Module):
    """A custom layer (no rule) with a 0-dim parameter."""

    def __init__(self):
        super().__init__()
        self.s, self.w = nn.Parameter(torch.tensor(1.3)), nn.Parameter(torch.randn(6, 4))

    def forward(self, x):
        return (x * self.s) @ self.w


class WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.sc, self.lin = Scalar(), nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.sc(x)))


class RootOwns(nn.Module):
    """The root owns a 0-dim and a 1-dim parameter (wrap_model=False: the root's functorch
    replay must not re-enter the root hooks)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.t, self.v = nn.Parameter(torch.tensor(0.7)), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x) * self.t + self.v


@pytest.mark.parametrize("b", [8, 1])
@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [WithScalar, RootOwns], ids=["scalar", "root_owns"])
def test_scalar_parameter_and_root_parameters(make, mode, wrap, red, b):
    x, y = _data((8, 6), 4)
    _check_step(make, mode, x[:b], y[:b], wrap=wrap, red=red)


# ----------------------------------------------------------------------------- per-layer
@pytest.mark.parametrize("b", [8, 3])
@pytest.mark.parametrize(("mode", "wrap"), [("hooks", True), ("hooks", False),
                                            ("functorch", True), ("bk", True), ("bk", False)])
@pytest.mark.parametrize("make", [MLP, Twice, WithScalar], ids=["mlp", "twice", "scalar"])
def test_per_layer_clipping_mean(make, mode, wrap, b):
    """Per-parameter bounds: a Linear's weight and bias have different clip factors (bk forms
    one weighted sum per factor tensor)."""
    x, y = _data((8, 6), 4)
    n = len(list(make().parameters()))
    _check_step(make, mode, x[:b], y[:b], wrap=wrap, c=[0.02 * (i + 1) for i in range(n)],
                per_layer=True)


def test_per_layer_clipping_refused_in_ghost():
    ds = TensorDataset(torch.zeros(N, 6), torch.zeros(N, dtype=torch.long))
    with pytest.raises(ValueError, match="per_layer"):
        _private(MLP(), "ghost", ds, [1.0] * 6, clipping="per_layer")


# ----------------------------------------------------------------------------- recurrent
class RNNNet(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(3, 4, batch_first=True, bidirectional=True, num_layers=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        lengths = (x.abs().sum(-1) > 0).sum(1).clamp(min=1).cpu()
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        return self.head(pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
                         .sum(1))


def _packed_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 3, generator=g)
    for i, k in enumerate([5, 2, 1, 4, 3, 5, 1, 2]):
        x[i, k:] = 0
    return x, torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("b", [8, 3, 1])
@pytest.mark.parametrize(("mode", "wrap"), MODE_WRAP)
@pytest.mark.parametrize("cls", [DPGRU, DPRNN, DPLSTM])
def test_recurrent_packed_mean(cls, mode, wrap, b):
    x, y = _packed_data()
    _check_step(lambda: RNNNet(cls), mode, x[:b], y[:b], wrap=wrap)


@pytest.mark.parametrize("mode", MODES)
def test_recurrent_declared_max_batch_len(mode):
    """The Opacus-compatible ``set_max_batch_length``: declared = B is exact (scale =
    max_batch_len); a stale, larger declaration is refused, not used as the scale."""
    x, y = _packed_data()

    def declared(k):
        def make():
            m = RNNNet(DPLSTM)
            for cell in (m.rnn.l0, m.rnn.l1, m.rnn.l0_reverse, m.rnn.l1_reverse):
                cell.set_max_batch_length(k)
            return m
        return make

    _check_step(declared(8), mode, x, y)
    with pytest.raises(ValueError, match="rows"):
        _check_step(declared(16), mode, x, y)


# ----------------------------------------------------------------------------- GPT-2
def _gpt2():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    cfg = tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager")
    return tf.GPT2LMHeadModel(cfg)


def _lm_labels(m, x, y, crit=None):  # the default forward's loss (HF computes it in float32)
    return m(input_ids=x, labels=x).loss


def _lm_logits(m, x, y, crit=None):
    logits = m(input_ids=x).logits[:, :-1]
    flat, t = logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
    return crit(flat, t, shape=logits.shape) if crit is not None else F.cross_entropy(flat, t)


@pytest.mark.parametrize("b", [6, 1])
@pytest.mark.parametrize(("mode", "wrap", "loss"), [
    ("bk", True, "labels"), ("bk", False, "labels"), ("bk", True, "logits"),
    ("ghost", True, "logits"), ("hooks", True, "labels"),
])
def test_gpt2_from_config(mode, wrap, loss, b):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (6, 7), generator=g)
    fn = _lm_labels if loss == "labels" else _lm_logits
    _check_step(_gpt2, mode, ids[:b], torch.zeros(b, dtype=torch.long), wrap=wrap, loss=fn,
                rtol=1e-5 if loss == "labels" else 1e-7, atol=1e-8 if loss == "labels" else 1e-10)


# ----------------------------------------------------------------------------- real loaders
def _loader_run(make, mode, ds, *, red="mean", bmm=None, steps=2, tweak=None, **kw):
    """``steps`` logical steps from the loader make_private returns (optionally through
    BatchMemoryManager), each against the brute force over the valid rows, a user's rows
    summed before clipping."""
    loss = _ce(red)
    torch.manual_seed(1)
    model = make().to(DT)
    ref = copy.deepcopy(model)
    c = _mid_bound(ref, ds.tensors[0][:EXPECTED], ds.tensors[1][:EXPECTED], loss)
    module, opt, crit, dl = _private(model, mode, ds, c, red=red, **kw)
    if tweak is not None:
        c = tweak(model, opt)
        for p, q in zip(ref.parameters(), model.parameters()):
            p.requires_grad_(q.requires_grad)
    ctx = BatchMemoryManager(data_loader=dl, max_physical_batch_size=bmm, optimizer=opt) \
        if bmm else None
    loader = ctx.__enter__() if ctx else dl
    xs, ys, units, done, phys = [], [], [], 0, 0
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in loader:
        layout = getattr(getattr(dl, "layouts", None), "current", None)
        groups = layout.groups if layout is not None else torch.arange(len(x))
        xs.append(x)
        ys.append(y)
        units.append(torch.where(groups >= 0, groups + 10_000 * phys, -1))
        phys += 1
        loss(module, x, y, crit).backward()
        opt.step()
        opt.zero_grad()
        if bmm and opt._is_last_step_skipped:
            continue
        X, Y, U = torch.cat(xs), torch.cat(ys), torch.cat(units)
        xs, ys, units = [], [], []
        got = [b - p.detach() for b, p in zip(before, model.parameters())]
        params = [p for p in ref.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        for u in U[U >= 0].unique().tolist():
            rows = (U == u).nonzero().reshape(-1).tolist()
            s = [torch.zeros_like(p) for p in params]
            for gs in _per_sample(ref, X[rows], Y[rows], loss):
                for a, g in zip(s, gs):
                    a += g
            f = min(1.0, c / (math.sqrt(sum(float(g.pow(2).sum()) for g in s)) + 1e-6))
            for t, g in zip(total, s):
                t += f * g / (opt.expected_batch_size if red == "mean" else 1)
        it = iter(total)
        _assert_close(model, got, [next(it) if p.requires_grad else torch.zeros_like(p)
                                   for p in ref.parameters()])
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(q)
        before = [p.detach().clone() for p in model.parameters()]
        done += 1
        if done == steps:
            break
    if ctx:
        ctx.__exit__(None, None, None)
    assert done == steps


def _dataset(name):
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        return MLP, TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 4, (N,), generator=g))
    if name == "seq_tokens":
        return Seq, TensorDataset(torch.randn(N, 5, 6, generator=g),
                                  torch.randint(0, 4, (N, 5), generator=g))
    if name == "tied":
        return Tied, TensorDataset(torch.randint(0, 6, (N, 3), generator=g),
                                   torch.randint(0, 6, (N,), generator=g))
    return ConvNet, TensorDataset(torch.randn(N, 16, 8, 8, generator=g),
                                  torch.randint(0, 3, (N,), generator=g))


SETTINGS = {
    "poisson": {},
    "fixed_shape": dict(poisson_sampling="fixed_shape", max_batch_size=12),
    "user": dict(privacy_unit="user", user_id=(torch.arange(N) // 3).tolist(),
                 max_records_per_user=2),
}


@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize("bmm", [None, 3], ids=["whole", "bmm3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mlp", "seq_tokens", "tied", "conv"])
def test_loader_steps(name, mode, setting, bmm, red):
    """Poisson / fixed-shape (padding rows) / user-level batches from make_private's loader,
    whole or split into physical batches of 3 by BatchMemoryManager (each with its own mean)."""
    make, ds = _dataset(name)
    _loader_run(make, mode, ds, red=red, bmm=bmm, **SETTINGS[setting])


@pytest.mark.parametrize("setting", ["poisson", "fixed_shape"])
@pytest.mark.parametrize("mode", MODES)
def test_bound_changed_and_layer_unfrozen_after_make_private(mode, setting):
    def make():
        m = Twice()
        m.out.weight.requires_grad_(False)
        return m

    def tweak(model, opt):
        model.out.weight.requires_grad_(True)
        opt.max_grad_norm = 0.37
        return 0.37

    _, ds = _dataset("mlp")
    _loader_run(make, mode, ds, tweak=tweak, **SETTINGS[setting])


# ----------------------------------------------------------------------------- noise (foreach)
@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize(("mode", "wrap"), [("hooks", True), ("ghost", True), ("bk", False)])
def test_foreach_noise_and_mean_scaling(mode, wrap, red):
    """σ > 0: the released gradient is (clipped sum + one flat N(0, (σC)²) draw of the
    generator, split over the parameters in order) / expected batch size."""
    sigma, seed = 0.7, 5
    x, y = _data((5, 6), 4)
    loss = _ce(red)
    torch.manual_seed(1)
    model = Twice().to(DT)
    ref = copy.deepcopy(model)
    c = _mid_bound(ref, x, y, loss)
    ds = TensorDataset(torch.zeros(N, 6), torch.zeros(N, dtype=torch.long))
    module, opt, crit, _ = _private(model, mode, ds, c, wrap=wrap, red=red, sigma=sigma,
                                    gen=torch.Generator().manual_seed(seed))
    got = _update(module, opt, crit, x, y, model, loss)
    denom = EXPECTED if red == "mean" else 1
    clipped = _brute(ref, x, y, c, 1, loss)
    n = sum(p.numel() for p in ref.parameters())
    noise = torch.empty(n).normal_(0.0, sigma * c, generator=torch.Generator().manual_seed(seed))
    want = [(s + z.view_as(s)) / denom
            for s, z in zip(clipped, noise.split([p.numel() for p in ref.parameters()]))]
    _assert_close(model, got, want)


# ----------------------------------------------------------------------------- rule fields
class TenthLinear(nn.Linear):
    """A Linear subclass whose forward scales its input by 0.1 (a user's layer)."""

    def forward(self, x):
        return F.linear(x * 0.1, self.weight, self.bias)


@pytest.fixture
def _tenth_rule():
    """A user's rule written against the documented fields (RULE_FIELDS): Linear's, with every
    field that sees the activations replaced. It says nothing about ``weighted_clipped_sum``,
    which LayerRule documents as optional ("without it bk calls clipped_sum")."""
    from dataclasses import replace

    from dptorch.grad_sample.linear import LINEAR_RULE
    from dptorch.grad_sample.registry import LAYER_RULES, register_layer_rule

    def tenth(acts):
        return [acts[0] * 0.1, *acts[1:]]

    register_layer_rule(TenthLinear, replace(
        LINEAR_RULE,
        grad_sample=lambda layer, a, g: LINEAR_RULE.grad_sample(layer, tenth(a), g),
        norm_sq=lambda layer, a, g: LINEAR_RULE.norm_sq(layer, tenth(a), g),
        clipped_sum=lambda layer, a, g: LINEAR_RULE.clipped_sum(layer, tenth(a), g),
        input_grad_only=lambda layer, x: LINEAR_RULE.input_grad_only(layer, x * 0.1),
        prefer_ghost=None, factors=None))
    yield
    del LAYER_RULES[TenthLinear]


@pytest.mark.usefixtures("_tenth_rule")
@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_rule_derived_from_linear_with_own_clipped_sum(mode):
    """A rule derived from Linear's with its own clipped_sum: bk must not use the inherited
    weighted_clipped_sum (paired with Linear's clipped_sum). It once did, releasing each sample's
    weight contribution at 10x its clipped value (up to 10 C), silently."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = TenthLinear(6, 4)

        def forward(self, x):
            return self.lin(x)

    x, y = _data((8, 6), 4)
    _check_step(M, mode, 30 * x, y)
