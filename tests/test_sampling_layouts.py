"""Fixed-shape Poisson batches and user-level privacy (dptorch.sampling), in every mode:
padding rows change nothing, a user's summed gradient is clipped to C (float64 brute force),
the samplers draw at the documented rates, and truncation's δ is accounted."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binom
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.batch_memory_manager import BatchMemoryManager
from dptorch.sampling import (
    FixedShapePoissonSampler,
    UserPoissonSampler,
    choose_max_batch_size,
    truncation_probability,
)
from dptorch.utils.batch_layout import BatchLayout, LayoutQueue

MODES = ["hooks", "functorch", "ghost", "bk"]
N, D, K = 60, 5, 3


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, D, generator=g, dtype=torch.float64),
                         torch.randint(0, K, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, K)).double()


def _private(mode: str, model: nn.Module, ds, *, batch_size: int = 12, c: float = 0.5,
             seed: int = 3, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(
        module=model, optimizer=opt,
        data_loader=DataLoader(ds, batch_size=batch_size, generator=torch.Generator().manual_seed(seed)),
        noise_multiplier=0.0, max_grad_norm=c, grad_sample_mode=mode, **kw)
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return engine, out[0], out[1], crit, out[-1]


def _step(module, opt, crit, x, y) -> list[torch.Tensor]:
    before = [p.detach().clone() for p in module.parameters()]
    crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    return [b - p.detach() for b, p in zip(before, module.parameters())]


def _brute_force(model: nn.Module, x, y, groups: torch.Tensor, c: float, denom: float):
    """Σ over units of clip_C(Σ of the unit's per-record gradients) / denom, one record at a
    time in float64 (padding rows: group -1, skipped)."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for u in groups[groups >= 0].unique().tolist():
        gsum = [torch.zeros_like(p) for p in params]
        for i in (groups == u).nonzero().reshape(-1).tolist():
            loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
            for s, g in zip(gsum, torch.autograd.grad(loss, params)):
                s += g
        norm = torch.sqrt(sum(g.pow(2).sum() for g in gsum))
        f = min(1.0, c / (float(norm) + 1e-6))
        for t, g in zip(total, gsum):
            t += f * g
    return [t / denom for t in total]


# ----------------------------------------------------------------------------- fixed shape
@pytest.mark.parametrize("mode", MODES)
def test_fixed_shape_padding_changes_nothing(mode):
    """Same real records with and without padding rows: the same update (noise 0, float64),
    every batch has max_batch_size rows, and the padding rows' norms are 0."""
    ds, m = _data(), 20
    model = _model()
    ref_model = copy.deepcopy(model)
    _, module, opt, crit, dl = _private(mode, model, ds, poisson_sampling="fixed_shape",
                                        max_batch_size=m)
    _, ref_module, ref_opt, ref_crit, _ = _private(mode, ref_model, ds)
    shapes = set()
    for step, (x, y) in enumerate(dl):
        shapes.add(tuple(x.shape))
        valid = dl.layouts.current.valid
        assert 0 < int(valid.sum()) < m  # some padding in this test's regime
        upd = _step(module, opt, crit, x, y)
        ref = _step(ref_module, ref_opt, ref_crit, x[valid], y[valid])
        for a, b in zip(upd, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
        if step == 2:
            break
    assert shapes == {(m, D)}


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_fixed_shape_padding_norms_are_zero(mode):
    ds = _data()
    _, module, opt, crit, dl = _private(mode, _model(), ds, poisson_sampling="fixed_shape",
                                        max_batch_size=20)
    it = iter(dl)  # the layout is current while the loader's iteration is alive
    x, y = next(it)
    crit(module(x), y).backward()
    valid = dl.layouts.current.valid
    if mode == "hooks":
        norms = opt.per_sample_norms()[0]
        factors = opt.compute_clip_factors()[0][0]
    else:
        norms = module.per_sample_gradient_norms
        factors = module.get_clipping_coef()
    assert torch.all(norms[~valid] == 0) and torch.all(norms[valid] > 0)
    assert torch.all(factors[~valid] == 0)


def test_truncation_rate_matches_binomial_tail():
    n, q, m, steps = 60, 0.25, 17, 4000
    sampler = FixedShapePoissonSampler(num_samples=n, sample_rate=q, max_batch_size=m,
                                       layouts=LayoutQueue(), steps=steps,
                                       generator=torch.Generator().manual_seed(0))
    sizes = [len(b) for b in sampler]
    assert set(sizes) == {m}
    p = binom.sf(m, n, q)  # the sampler's own data set of n records
    sd = math.sqrt(steps * p * (1 - p))
    assert abs(sampler.truncations - steps * p) < 5 * sd
    # the accounted probability is that of the larger neighbour (n + 1 records): an upper bound
    assert truncation_probability(n, q, m) == pytest.approx(binom.sf(m, n + 1, q), rel=1e-12)
    assert truncation_probability(n, q, m) > p


def test_truncated_batches_are_uniform_subsets():
    """When truncated, every drawn record is equally likely to be kept."""
    n, q, m = 12, 0.9, 4
    sampler = FixedShapePoissonSampler(num_samples=n, sample_rate=q, max_batch_size=m,
                                       layouts=(lay := LayoutQueue()), steps=3000,
                                       generator=torch.Generator().manual_seed(1))
    counts = torch.zeros(n)
    for b in sampler:
        k = lay.pop_pending().num_groups
        assert k <= m
        counts += torch.bincount(torch.tensor(b[:k]), minlength=n)
    expected = counts.sum() / n
    assert (counts - expected).abs().max() < 6 * math.sqrt(expected)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(10, 100_000), q=st.floats(1e-4, 0.5), target=st.sampled_from([1e-4, 1e-8, 1e-12]))
def test_choose_max_batch_size_is_the_smallest(n, q, target):
    m = choose_max_batch_size(n, q, target)
    assert truncation_probability(n, q, m) <= target
    if m > 1:
        assert truncation_probability(n, q, m - 1) > target


def _fixed_shape_run(accountant: str, m: int):
    engine = PrivacyEngine(accountant=accountant)
    model = _model()
    module, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=6), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling="fixed_shape", max_batch_size=m)
    steps = 0
    for x, y in dl:
        _step(module, opt, nn.CrossEntropyLoss(), x, y)
        steps += 1
    return engine, steps


def test_epsilon_includes_truncation_delta():
    """get_epsilon(δ) is the smallest ε with δ_P(ε) + (1 + e^ε)·T·p ≤ δ, p = P(Bin(N+1, q) > M)
    (the coupling bound), computed here from the accountant and scipy's binomial tail."""
    engine, steps = _fixed_shape_run("rdp", 16)
    tau = steps * binom.sf(16, N + 1, 1 / 10)
    delta = 1e-2
    eps = engine.get_epsilon(delta)
    assert engine.accountant.get_epsilon(delta) == eps  # the accountant charges it itself
    assert engine.accountant.truncation_tau() == pytest.approx(tau, rel=1e-12)
    acc = copy.deepcopy(engine.accountant)
    acc.truncation = None  # the Poisson run's accountant
    assert acc.get_epsilon(delta - (1 + math.exp(eps)) * tau) <= eps + 1e-12
    below = eps - 1e-6
    assert acc.get_epsilon(delta - (1 + math.exp(below)) * tau) > below
    assert eps > acc.get_epsilon(delta)  # truncation costs something here
    with pytest.raises(ValueError, match="Truncating the fixed-shape batches costs"):
        engine.get_epsilon(2 * tau)


def test_truncation_bound_is_above_dp_accounting_truncated_pld():
    """dp-accounting 0.6 analyses truncated Poisson DP-SGD exactly
    (TruncatedSubsampledGaussianDpEvent, arXiv:2508.15089): dptorch's bound must not be below
    it (it is an upper bound) and not far above it."""
    dp_accounting = pytest.importorskip("dp_accounting")
    m = 19
    engine, steps = _fixed_shape_run("pld", m)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=N, sampling_probability=1 / 10, truncated_batch_size=m,
            noise_multiplier=1.0), steps)
    ref = dp_accounting.pld.PLDAccountant().compose(event)
    for delta in (1e-2, 1e-3):
        exact = ref.get_epsilon(delta)
        ours = engine.get_epsilon(delta)
        assert exact * (1 - 2e-3) <= ours <= exact * 1.5 + 0.05


def test_make_private_chooses_max_batch_size():
    ds = _data()
    _, _, _, _, dl = _private("bk", _model(), ds, poisson_sampling="fixed_shape")
    m = len(next(iter(dl))[0])
    assert m == choose_max_batch_size(N, 1 / 5, 1e-10)


def test_make_private_with_epsilon_keeps_truncation_under_a_tenth_of_delta():
    ds, delta, epochs = _data(), 1e-3, 2
    engine = PrivacyEngine(accountant="rdp")
    model = _model()
    module, opt, dl = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=12), target_epsilon=3.0, target_delta=delta,
        epochs=epochs, max_grad_norm=1.0, poisson_sampling="fixed_shape")
    m = len(next(iter(dl))[0])
    steps = epochs * len(dl)
    assert (1 + math.exp(3.0)) * steps * truncation_probability(N, 1 / 5, m) <= delta / 10
    for _ in range(epochs):
        for x, y in dl:
            _step(module, opt, nn.CrossEntropyLoss(), x, y)
    assert engine.get_epsilon(delta) <= 3.0 * 1.01


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_fixed_shape_with_batch_memory_manager(mode):
    """Fixed chunks of the fixed shape: the same update as the whole batch."""
    ds = _data()
    model = _model()
    twin = copy.deepcopy(model)
    _, module, opt, crit, dl = _private(mode, model, ds, poisson_sampling="fixed_shape",
                                        max_batch_size=20)
    _, module2, opt2, crit2, dl2 = _private(mode, twin, ds, poisson_sampling="fixed_shape",
                                            max_batch_size=20)
    it = iter(dl)
    x, y = next(it)
    whole = _step(module, opt, crit, x, y)
    before = [p.detach().clone() for p in module2.parameters()]
    chunks = []
    with BatchMemoryManager(data_loader=dl2, max_physical_batch_size=8, optimizer=opt2) as phys:
        for xb, yb in phys:
            chunks.append(tuple(xb.shape))
            crit2(module2(xb), yb).backward()
            opt2.step()
            opt2.zero_grad()
            if len(chunks) == 3:
                break
    assert chunks == [(8, D), (8, D), (4, D)]
    for w, b, p in zip(whole, before, module2.parameters()):
        torch.testing.assert_close(b - p.detach(), w, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- user level
@pytest.mark.parametrize("mode", MODES)
def test_one_record_per_user_is_record_level(mode):
    ds = _data()
    model = _model()
    twin = copy.deepcopy(model)
    e1, m1, o1, c1, dl1 = _private(mode, model, ds, privacy_unit="user", user_id=list(range(N)))
    e2, m2, o2, c2, dl2 = _private(mode, twin, ds)
    for (x1, y1), (x2, y2), _ in zip(dl1, dl2, range(3)):
        assert torch.equal(x1, x2)
        for a, b in zip(_step(m1, o1, c1, x1, y1), _step(m2, o2, c2, x2, y2)):
            assert torch.equal(a, b)
    assert e1.get_epsilon(1e-5) == e2.get_epsilon(1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_user_contribution_is_clipped_as_a_sum(mode):
    """k records per user: the update is Σ_users clip_C(Σ records' gradients) / (q·U), equal to
    a float64 brute force, and one user's share has norm ≤ C."""
    ds, c, per_user = _data(), 0.5, 4
    users = torch.arange(N) // per_user  # 15 users of 4 records
    model = _model()
    ref = copy.deepcopy(model)
    _, module, opt, crit, dl = _private(mode, model, ds, batch_size=20, c=c,
                                        privacy_unit="user", user_id=users,
                                        max_records_per_user=3)
    n_users = N // per_user
    denom = n_users / 3  # q = 1/3, expected users per batch
    for step, (x, y) in enumerate(dl):
        layout = dl.layouts.current
        assert torch.bincount(layout.groups).max() <= 3
        upd = _step(module, opt, crit, x, y)
        exp = _brute_force(ref, x, y, layout.groups, c, denom)
        for a, b in zip(upd, exp):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            for p, d in zip(ref.parameters(), exp):
                p -= d
        if step == 1:
            break
    # one user alone: its released share has norm ≤ C
    x, y = ds.tensors[0][:3], ds.tensors[1][:3]
    dl.layouts.current = BatchLayout(torch.zeros(3, dtype=torch.long), 1)
    share = _step(module, opt, crit, x, y)
    norm = math.sqrt(sum(float(s.pow(2).sum()) for s in share)) * denom
    assert norm <= c * (1 + 1e-9)
    dl.layouts.current = None


def test_user_sampler_inclusion_rate():
    users = torch.arange(400) % 50  # 50 users of 8 records
    q, steps, m = 0.2, 1500, 3
    sampler = UserPoissonSampler(user_of=users, sample_rate=q, max_records_per_user=m,
                                 layouts=(lay := LayoutQueue()), steps=steps,
                                 generator=torch.Generator().manual_seed(2))
    included = torch.zeros(50)
    for b in sampler:
        layout = lay.pop_pending()
        idx = torch.tensor(b, dtype=torch.long)
        u = users[idx] if idx.numel() else idx
        assert torch.all(torch.bincount(u, minlength=50) <= m)
        # rows are grouped by user, one group per drawn user
        assert layout.num_groups == int(u.unique().numel())
        included += torch.bincount(u.unique(), minlength=50).float() if u.numel() else 0
    rate = included / steps
    sd = math.sqrt(q * (1 - q) / steps)
    assert (rate - q).abs().max() < 5 * sd


def test_user_level_batch_memory_manager_splits_between_users():
    ds = _data()
    users = torch.arange(N) // 4
    _, module, opt, crit, dl = _private("bk", _model(), ds, batch_size=20, privacy_unit="user",
                                        user_id=users)
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=9, optimizer=opt) as phys:
        for i, (x, y) in enumerate(phys):
            layout = phys.layouts.current
            assert layout.num_rows == len(x) <= 9
            counts = torch.bincount(layout.groups) if len(x) else torch.zeros(0)
            assert torch.all(counts == 4)  # every user whole in one chunk
            _step(module, opt, crit, x, y)
            if i == 5:
                break


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_batch_size=10), "max_batch_size is the fixed shape"),
        (dict(poisson_sampling="fixed"), "poisson_sampling must be"),
        (dict(privacy_unit="person"), "privacy_unit must be"),
        (dict(user_id=[0] * N), "need privacy_unit='user'"),
        (dict(privacy_unit="user"), "needs user_id"),
        (dict(privacy_unit="user", user_id=[0] * 3), "user_id has 3 entries"),
        (dict(privacy_unit="user", user_id=[0] * N, max_records_per_user=0), "positive integer"),
        (dict(privacy_unit="user", user_id=[0] * N, poisson_sampling="fixed_shape"), "fixed-shape user"),
        (dict(poisson_sampling="fixed_shape", clipping="adaptive", target_unclipped_quantile=0.5,
              clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1,
              unclipped_num_std=1.0), "clipping='adaptive'"),
        (dict(poisson_sampling="fixed_shape", grad_sample_mode="ew"), "grad_sample_mode='ew'"),
        (dict(privacy_unit="user", user_id=[0] * N, clipping="per_layer",
              max_grad_norm=[1.0] * 4), "clipping='per_layer'"),
    ],
)
def test_bad_settings_raise_before_training(kw, match):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    kw = dict(kw)
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(_data(), batch_size=10), noise_multiplier=1.0,
                max_grad_norm=kw.pop("max_grad_norm", 1.0))
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(**args, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_layout_mismatch_raises():
    """A batch that is not the loader's (other row count) cannot be clipped with its layout."""
    ds = _data()
    _, module, opt, crit, dl = _private("hooks", _model(), ds, poisson_sampling="fixed_shape",
                                        max_batch_size=20)
    it = iter(dl)
    x, y = next(it)
    crit(module(x[:5]), y[:5]).backward()
    with pytest.raises(ValueError, match="the batch has 5 rows"):
        opt.step()


# ----------------------------------------------------------------------------- attacks
class _Tied(nn.Module):
    """Embedding tied to the LM-style head, and a position embedding called on ``[1, T]``
    positions (broadcast over the batch, as Hugging Face's default forward does)."""

    def __init__(self, v: int = 11, t: int = 5):
        super().__init__()
        self.emb, self.pos = nn.Embedding(v, 6), nn.Embedding(t, 6)
        self.lin, self.head, self.out = nn.Linear(6, 6), nn.Linear(6, v), nn.Linear(v, K)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1])[None])
        return self.out(self.head(torch.tanh(self.lin(h))).mean(1))


class _Functional(_Tied):
    """A layer's weight used through ``F.linear`` instead of its module."""

    def forward(self, x):
        return F.linear(self.emb(x).mean(1), self.out.weight[:, :6]) + self.out.bias


SETTINGS = {
    "fixed_shape": dict(poisson_sampling="fixed_shape", max_batch_size=12),
    "user": dict(privacy_unit="user", user_id=(torch.arange(24) // 3).tolist(),
                 max_records_per_user=2),
}


def _token_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 11, (24, 5), generator=g),
                         torch.randint(0, K, (24,), generator=g))


def _attack_run(mode: str, setting: str, model: nn.Module, *, tweak=None, loss=None):
    """Two steps of ``model`` under ``setting``, each against the float64 brute force
    (padding skipped, users' records summed, clipped with the C in force). ``tweak(model,
    optimizer)`` runs after make_private and returns the C to expect."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, noise_multiplier=0.0, max_grad_norm=0.3,
        data_loader=DataLoader(_token_data(), batch_size=8,
                               generator=torch.Generator().manual_seed(1)),
        grad_sample_mode=mode, **SETTINGS[setting])
    module, dp_opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    c = tweak(model, dp_opt) if tweak else 0.3
    if tweak:
        for p, q in zip(ref.parameters(), model.parameters()):
            p.requires_grad_(q.requires_grad)
    per_sample = loss or (lambda m, x, y, crit=None: F.cross_entropy(m(x), y))
    for step, (x, y) in enumerate(dl):
        groups = dl.layouts.current.groups
        params = [p for p in model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        (crit(module(x), y) if loss is None else loss(module, x, y, crit)).backward()
        dp_opt.step()
        dp_opt.zero_grad()
        rparams = [p for p in ref.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in rparams]
        for u in groups[groups >= 0].unique().tolist():
            gsum = [torch.zeros_like(p) for p in rparams]
            for i in (groups == u).nonzero().reshape(-1).tolist():
                grads = torch.autograd.grad(per_sample(ref, x[i:i + 1], y[i:i + 1]), rparams)
                for s, g in zip(gsum, grads):
                    s += g
            f = min(1.0, c / (math.sqrt(sum(float(g.pow(2).sum()) for g in gsum)) + 1e-6))
            for t, g in zip(total, gsum):
                t += f * g / dp_opt.expected_batch_size
        for b, p, e in zip(before, params, total):
            torch.testing.assert_close(b - p.detach(), e, rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            for p, e in zip(rparams, total):
                p -= e
        if step == 1:
            break


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_tied_and_broadcast_parameters_are_exact(mode, setting):
    torch.manual_seed(0)
    _attack_run(mode, setting, _Tied().double())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_changed_bound_and_unfrozen_layer_are_exact(mode, setting):
    """C changed and a layer unfrozen after make_private: both take part, exactly."""
    torch.manual_seed(0)
    model = _Tied().double()
    model.lin.weight.requires_grad_(False)

    def tweak(m, opt):
        m.lin.weight.requires_grad_(True)
        opt.max_grad_norm = 0.7
        return 0.7

    _attack_run(mode, setting, model, tweak=tweak)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_functional_use_of_a_parameter_is_refused(mode, setting):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="per-sample|clipped per sample|no hooked layer"):
        _attack_run(mode, setting, _Functional().double())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_hugging_face_default_forward_is_exact(mode, setting):
    """A tiny GPT-2 from a config, called with its default forward (position ids ``[1, T]``,
    LM head tied to the token embedding), causal-LM loss."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=11, n_positions=5, n_embd=8, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager")
    model = tf.GPT2LMHeadModel(cfg).double()

    def lm_loss(m, x, y, crit=None):  # next-token loss from the default forward's logits
        logits = m(input_ids=x).logits[:, :-1]  # float64 (HF's own .loss upcasts to float32)
        flat, target = logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
        if mode == "ghost" and crit is not None:  # the DP loss wrapper, per sequence
            return crit(flat, target, shape=logits.shape)
        return F.cross_entropy(flat, target)

    _attack_run(mode, setting, model, loss=lm_loss)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(20, 5000), world=st.integers(1, 8), m=st.integers(1, 400),
       q=st.floats(1e-3, 0.5))
def test_truncation_over_ranks_is_the_sum_of_the_shards_tails(n, world, m, q):
    """Under DDP each rank pads to ceil(M / W) rows and Poisson-samples its shard of the
    records; a step truncates somewhere with probability at most Σ_r P(Bin(N_r + 1, q) > M_r)."""
    from dptorch.sampling import rank_rows, step_truncation_probability

    rows = -(-m // world)
    assert rank_rows(m, world) == rows and rows * world >= m
    shards = [len(range(r, n, world)) for r in range(world)]
    assert sum(shards) == n
    expected = sum(binom.sf(rows, s + 1, q) for s in shards)
    assert step_truncation_probability(n, q, m, world) == pytest.approx(expected, rel=1e-12, abs=1e-300)


# ----------------------------------------------------------------------------- prefetching
def _prefetched(loader):
    """A wrapper that pulls each batch one ahead of training (a CUDA prefetcher's pattern)."""
    it = iter(loader)
    ahead = next(it, None)
    for batch in it:
        current, ahead = ahead, batch
        yield current
    if ahead is not None:
        yield ahead


@pytest.mark.parametrize("sampling", ["fixed_shape", "user"])
@pytest.mark.parametrize("mode", MODES)
def test_prefetching_wrapper_is_refused(mode, sampling):
    """Batch t would be clipped with the layout of batch t + 1 (its padding rows, copies of a
    real record, counted as records): refused at the first training read, in every mode."""
    kw = (dict(poisson_sampling="fixed_shape", max_batch_size=20) if sampling == "fixed_shape"
          else dict(privacy_unit="user", user_id=torch.arange(N) % 20, max_records_per_user=3))
    _, module, opt, crit, dl = _private(mode, _model(), _data(), **kw)
    with pytest.raises(ValueError, match="not trained on before it yielded the next"):
        for x, y in _prefetched(dl):
            _step(module, opt, crit, x, y)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_reading_batches_without_training_then_training_is_fine(mode):
    """Only training on a batch other than the last yielded is refused: a pass that only looks
    at the batches, then a pass that trains, works."""
    _, module, opt, crit, dl = _private(mode, _model(), _data(), poisson_sampling="fixed_shape",
                                        max_batch_size=20)
    assert sum(len(x) for x, _ in dl) > 0
    for x, y in dl:
        _step(module, opt, crit, x, y)
