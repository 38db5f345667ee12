"""Review of the layout machinery (fixed-shape Poisson batches, user-level units, LayoutQueue,
BatchMemoryManager): misalignments found by review, now refused (every mode), and behaviour
checked and found right (the accountant's own get_epsilon, the Opacus idiom, includes the
truncation of fixed-shape batches, as PrivacyEngine.get_epsilon does)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.batch_memory_manager import BatchMemoryManager

MODES = ["hooks", "functorch", "ghost", "bk"]
N, D, K = 60, 5, 3
FIXED = dict(poisson_sampling="fixed_shape", max_batch_size=20)
USERS = torch.arange(N) % 20  # 20 users of 3 records
USER = dict(privacy_unit="user", user_id=USERS, max_records_per_user=3)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, D, generator=g, dtype=torch.float64),
                         torch.randint(0, K, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, K)).double()


def _private(mode, model, ds, *, num_workers=0, sigma=0.0, seed=3, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(
        module=model, optimizer=opt,
        data_loader=DataLoader(ds, batch_size=12, num_workers=num_workers,
                               generator=torch.Generator().manual_seed(seed)),
        noise_multiplier=sigma, max_grad_norm=0.5, grad_sample_mode=mode, **kw)
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return engine, out[0], out[1], crit, out[-1]


def _step(module, opt, crit, x, y):
    before = [p.detach().clone() for p in module.parameters()]
    crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    return [b - p.detach() for b, p in zip(before, module.parameters())]


def _close(a, b):
    return all(torch.allclose(u, v, rtol=1e-10, atol=1e-13) for u, v in zip(a, b))


def _consistent(x, layout, x0) -> bool:
    """Fixed shape: the padding rows are copies of record 0 at the end, and the real rows are
    distinct records in index order (record 0 can only be row 0)."""
    valid = layout.valid
    is_x0 = (x == x0).all(1)
    return bool(is_x0[~valid].all()) and not bool(is_x0[1:][valid[1:]].any()) and \
        bool((valid[:-1].long() >= valid[1:].long()).all())


# ----------------------------------------------------------------------------- bugs
@pytest.mark.parametrize("mode", MODES)
def test_next_iter_peek_keeps_padding_out(mode):
    ds = _data()
    model = _model()
    ref = copy.deepcopy(model)
    _, module, opt, crit, dl = _private(mode, model, ds, **FIXED)
    _, rmod, ropt, rcrit, _ = _private(mode, ref, ds)
    x, y = next(iter(dl))  # the usual "one batch" idiom
    valid = ~(x == ds.tensors[0][0]).all(1)
    valid[0] = True  # (record 0 may be row 0)
    try:
        upd = _step(module, opt, crit, x, y)
    except ValueError:
        return  # refusing is fine
    assert _close(upd, _step(rmod, ropt, rcrit, x[valid], y[valid]))


def test_next_iter_peek_keeps_users_together():
    ds = _data()
    _, module, opt, crit, dl = _private("hooks", _model(), ds, **USER)
    x, y = next(iter(dl))
    crit(module(x), y).backward()
    try:
        norms = opt.per_sample_norms()[0]
    except ValueError:
        return
    idx = [int((ds.tensors[0] == r).all(1).nonzero()[0]) for r in x]
    u = USERS[idx]
    same = u[:, None] == u[None, :]
    assert bool((norms[:, None] == norms[None, :])[same].all())  # one norm per user


def test_two_iterators_interleaved():
    ds = _data()
    _, module, opt, crit, dl = _private("hooks", _model(), ds, seed=6, **FIXED)  # 11 / 5 rows
    it1, it2 = iter(dl), iter(dl)  # e.g. zip(dl, dl)
    for _ in range(3):
        (x1, y1), _ = next(it1), next(it2)
        try:
            crit(module(x1), y1).backward()
            assert _consistent(x1, opt.clipping.layouts.training_layout(), ds.tensors[0][0])
        except ValueError:
            return
        opt.zero_grad()


def test_peek_between_steps_with_workers():
    ds = _data()
    _, module, opt, crit, dl = _private("hooks", _model(), ds, num_workers=1, **FIXED)
    it = iter(dl)
    for _ in range(4):
        try:  # refused at the next batch or at its training read
            x, y = next(it)
            crit(module(x), y).backward()
            layout = opt.clipping.layouts.training_layout()
            opt.step()
        except ValueError:
            return
        opt.zero_grad()
        assert _consistent(x, layout, ds.tensors[0][0])
        next(iter(dl))  # a look at one training batch (evaluation, logging)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_broken_off_logical_batch_is_not_released(mode):
    ds = _data()
    _, module, opt, crit, dl = _private(mode, _model(), ds, **FIXED)
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=6, optimizer=opt) as phys:
        for x, y in phys:
            _step(module, opt, crit, x, y)
            break  # epoch broken off after a skipped physical step
    assert all(getattr(p, "summed_grad", None) is None for p in opt.params)


def test_accountant_epsilon_includes_truncation():
    engine, module, opt, crit, dl = _private("hooks", _model(), _data(), sigma=1.0, **FIXED)
    for x, y in dl:
        _step(module, opt, crit, x, y)

    def outcome(f):
        try:
            return round(f(1e-5), 6)
        except ValueError:
            return "refused"

    assert outcome(engine.accountant.get_epsilon) == outcome(engine.get_epsilon)


def test_skipping_a_batch_is_refused_with_the_reason():
    """A skipped batch cannot be told from a prefetched one (whose successor would be clipped
    with its layout): refused, and the message says a skipped batch looks the same."""
    _, module, opt, crit, dl = _private("hooks", _model(), _data(), **FIXED)
    with pytest.raises(ValueError, match="skipped batch looks the same"):
        for i, (x, y) in enumerate(dl):
            if i == 0:
                continue
            _step(module, opt, crit, x, y)


# ----------------------------------------------------------------------------- verified
@pytest.mark.parametrize("kw", [FIXED, USER], ids=["fixed", "user"])
def test_workers_early_break_and_bmm_stay_aligned(kw):
    """Workers prefetch (layouts queued in order), an epoch broken off, then BatchMemoryManager
    chunks: every trained batch has its own layout, and the accountant counts one step at q per
    logical batch only."""
    ds = _data()
    engine, module, opt, crit, dl = _private("hooks", _model(), ds, num_workers=2, **kw)
    x_of = ds.tensors[0]
    released = 0

    def check(x, layout):
        if "max_batch_size" in kw:
            assert _consistent(x, layout, x_of[0])
        elif len(x):
            u = USERS[[int((x_of == r).all(1).nonzero()[0]) for r in x]]
            g = layout.groups
            assert torch.equal(u[:, None] == u[None, :], g[:, None] == g[None, :])

    for i, (x, y) in enumerate(dl):
        check(x, dl.layouts.current)
        _step(module, opt, crit, x, y)
        released += 1
        if i == 1:
            break
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=6, optimizer=opt) as phys:
        for x, y in phys:
            check(x, phys.layouts.current)
            _step(module, opt, crit, x, y)
            released += not opt.last_step_skipped
    (sigma, q, steps), = engine.accountant.history
    assert steps == released == 2 + len(dl) and q == pytest.approx(1 / 5)


def _prefetch2(loader):
    it = iter(loader)
    buf = [next(it), next(it)]
    for b in it:
        yield buf.pop(0)
        buf.append(b)
    yield from buf


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_prefetch_by_two_and_peek_before_backward_with_iterator_alive(mode):
    _, module, opt, crit, dl = _private(mode, _model(), _data(), **FIXED)
    with pytest.raises(ValueError, match="not trained on before it yielded the next"):
        for x, y in _prefetch2(dl):
            _step(module, opt, crit, x, y)
    _, module, opt, crit, dl = _private(mode, _model(), _data(), **FIXED)
    it = iter(dl)
    x, y = next(it)
    next(it)  # looked ahead on the same iterator before training: refused
    with pytest.raises(ValueError, match="not trained on"):
        _step(module, opt, crit, x, y)


def test_skipped_empty_user_batches_are_fine():
    """Empty user-level batches may be skipped (continue) without tripping the check."""
    ds = _data()
    _, module, opt, crit, dl = _private("hooks", _model(), ds, privacy_unit="user",
                                        user_id=torch.arange(N) % 4, seed=5)  # empties
    empties = 0
    for x, y in dl:
        if len(x) == 0:
            empties += 1
            continue
        _step(module, opt, crit, x, y)
    for x, y in dl:  # a second epoch, same loader
        if len(x):
            _step(module, opt, crit, x, y)
    assert empties > 0
