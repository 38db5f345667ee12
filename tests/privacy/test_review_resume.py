"""Review of checkpoints and resume: a run cut by save_checkpoint / load_checkpoint into fresh
objects must continue as if it never stopped (same parameters with the same seeds, same epsilon),
in every grad_sample_mode and sampling, with noise, clipping and learning-rate schedulers
attached; what cannot be restored exactly must be refused (the last section: bugs found by
review and fixed)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine, checkpoint
from dptorch.accountants import create_accountant
from dptorch.schedulers import ExponentialNoise, StepGradClip
from dptorch.utils.batch_memory_manager import BatchMemoryManager
from dptorch.utils.uniform_sampler import DistributedUniformWithReplacementSampler

N, BATCH, DELTA = 40, 8, 1e-5
USERS = torch.arange(N) % 13
ADACLIP = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
               min_clipbound=0.01, unclipped_num_std=2.0)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def _build(seed=0, *, mode="hooks", sampling=True, clipping="flat", sigma=1.1, accountant="rdp",
           schedulers=True, lr=True, **extra):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = PrivacyEngine(accountant=accountant)
    c = [0.3, 0.3, 0.4, 0.4] if clipping == "per_layer" else 0.7
    out = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=sigma,
        max_grad_norm=c, poisson_sampling=sampling, clipping=clipping, grad_sample_mode=mode,
        **extra,
    )
    if mode == "ghost":
        model, opt, crit, dl = out
    else:
        (model, opt, dl), crit = out, nn.CrossEntropyLoss()
    scheds = {}
    if schedulers:
        scheds = {"noise": ExponentialNoise(opt, gamma=0.9),
                  "clip": StepGradClip(opt, step_size=2, gamma=0.8)}
    if lr:
        scheds["lr"] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return engine, model, opt, crit, dl, scheds


def _train(run, n, state):
    """``n`` steps over the loader's stream; every third step all schedulers step."""
    _, model, opt, crit, dl, scheds = run
    for _ in range(n):
        try:
            x, y = next(state["it"])
        except (StopIteration, KeyError):
            state["it"] = iter(dl)
            x, y = next(state["it"])
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        state["step"] = state.get("step", 0) + 1
        if state["step"] % 3 == 0:
            for s in scheds.values():
                s.step()


def _save(run) -> io.BytesIO:
    engine, model, opt, _, _, scheds = run
    buf = io.BytesIO()
    extra = {"lr": scheds["lr"].state_dict()} if "lr" in scheds else None
    engine.save_checkpoint(path=buf, module=model, optimizer=opt, noise_scheduler=scheds.get("noise"),
                           grad_clip_scheduler=scheds.get("clip"), checkpoint_dict=extra)
    buf.seek(0)
    return buf


def _load(run, buf) -> None:
    engine, model, opt, _, _, scheds = run
    extra = engine.load_checkpoint(path=buf, module=model, optimizer=opt,
                                   noise_scheduler=scheds.get("noise"),
                                   grad_clip_scheduler=scheds.get("clip"))
    if "lr" in scheds:
        scheds["lr"].load_state_dict(extra["lr"])


def _eps(engine, delta=DELTA):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return engine.get_epsilon(delta)


def _straight_and_resumed(total=10, cut=6, delta=DELTA, resume_cfg=None, **cfg):
    """(params, epsilon) of a straight run and of one saved after ``cut`` steps, then loaded
    into fresh objects (other model init, global RNG disturbed) built with ``resume_cfg``."""
    torch.manual_seed(100)
    run = _build(**cfg)
    _train(run, total, {})
    straight = ([p.detach().clone() for p in run[1].parameters()], _eps(run[0], delta))
    torch.manual_seed(100)
    run = _build(**cfg)
    _train(run, cut, {})
    buf = _save(run)
    torch.rand(100)
    run2 = _build(seed=1, **(resume_cfg or cfg))
    _load(run2, buf)
    _train(run2, total - cut, {"step": cut})
    return straight, ([p.detach().clone() for p in run2[1].parameters()], _eps(run2[0], delta))


def _assert_same(straight, resumed):
    for a, b in zip(straight[0], resumed[0]):
        assert torch.equal(a, b)
    assert resumed[1] == straight[1]


# ---------------------------------------------------------------------------- verified correct
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
@pytest.mark.parametrize("sampling", [True, "fixed_shape"])
def test_resume_mid_epoch_with_all_schedulers_is_identical(mode, sampling):
    """Noise, clipping and LR schedulers, Adam state, noise and sampler generators: the resumed
    run (cut mid-epoch) equals the straight one bit for bit, and so does epsilon."""
    _assert_same(*_straight_and_resumed(mode=mode, sampling=sampling))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_resume_per_layer_clipping_with_clip_schedule(mode):
    _assert_same(*_straight_and_resumed(mode=mode, clipping="per_layer"))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_resume_user_level_sampling(mode):
    _assert_same(*_straight_and_resumed(mode=mode, privacy_unit="user", user_id=USERS,
                                        max_records_per_user=2))


def test_resume_adaptive_clipping_keeps_the_adapted_bound():
    _assert_same(*_straight_and_resumed(clipping="adaptive", sigma=0.5, schedulers=False,
                                        **ADACLIP))


def test_resume_fixed_size_batches_exact_at_pass_end_conservative_mid_pass():
    """poisson_sampling=False: a resume at the end of a pass gives the same epsilon; mid-pass the
    new accountant hook starts a new pass (the loader's position is not in the checkpoint), so
    epsilon can only grow."""
    _assert_same(*_straight_and_resumed(sampling=False, cut=5))
    straight, resumed = _straight_and_resumed(sampling=False, cut=6)
    assert resumed[1] >= straight[1]


def test_checkpoint_of_another_mode_keeps_epsilon():
    straight, resumed = _straight_and_resumed(mode="hooks", resume_cfg=dict(mode="ghost"))
    assert resumed[1] == straight[1]
    for a, b in zip(straight[0], resumed[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_loading_twice_is_idempotent():
    torch.manual_seed(100)
    run = _build()
    _train(run, 4, {})
    data = _save(run).getvalue()
    run2 = _build(seed=1)
    _load(run2, io.BytesIO(data))
    first = ([p.clone() for p in run2[1].parameters()], run2[2].noise_multiplier,
             run2[2].max_grad_norm, run2[0].accountant.state_dict(), _eps(run2[0]))
    _load(run2, io.BytesIO(data))
    assert all(torch.equal(a, b) for a, b in zip(first[0], run2[1].parameters()))
    assert (run2[2].noise_multiplier, run2[2].max_grad_norm) == first[1:3]
    assert run2[0].accountant.state_dict() == first[3] and _eps(run2[0]) == first[4]


def test_lr_scheduler_built_after_resume_drives_the_wrapped_groups():
    torch.manual_seed(100)
    run = _build(schedulers=False, lr=False)
    _train(run, 3, {})
    buf = _save(run)
    run2 = _build(seed=1, schedulers=False, lr=False)
    _load(run2, buf)
    opt = run2[2]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(run2, 1, {})
    sched.step()
    assert opt.param_groups is opt.original_optimizer.param_groups
    assert opt.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


# ------------------------------------------------------------- found by review, fixed
def _dist_sampler():
    return DistributedUniformWithReplacementSampler(total_size=N, sample_rate=0.2,
                                                    num_replicas=2, rank=0, steps=100)


def _dist_resume():
    """Batches of a DDP-style run (rank 0), straight and cut after 3 steps; both processes seed
    the global RNG alike at start, as the DDP scripts do."""
    torch.manual_seed(0)
    it = iter(_dist_sampler())
    straight = [next(it) for _ in range(6)]
    torch.manual_seed(0)
    sampler = _dist_sampler()
    dl = DataLoader(_data(), batch_sampler=sampler)
    it = iter(sampler)
    first = [next(it) for _ in range(3)]
    buf = io.BytesIO()
    checkpoint.save_checkpoint(path=buf, module=nn.Linear(1, 1), data_loader=dl,
                               accountant=create_accountant("rdp"))
    buf.seek(0)
    torch.manual_seed(0)
    sampler2 = _dist_sampler()
    checkpoint.load_checkpoint(path=buf, module=nn.Linear(1, 1), accountant=create_accountant("rdp"),
                               data_loader=DataLoader(_data(), batch_sampler=sampler2))
    it = iter(sampler2)
    return straight, first, [next(it) for _ in range(3)]


def test_resumed_distributed_sampler_does_not_repeat_earlier_batches():
    _, first, resumed = _dist_resume()
    assert resumed != first


def test_resumed_distributed_sampler_draws_a_fresh_stream():
    """Every rank loads rank 0's file, so a rank's stream cannot be restored exactly: each rank
    seeds a fresh one from the restored generator and its rank (neither the first run's
    batches again, nor rank 0's masks on every rank: tests/privacy/test_review_fixes.py)."""
    straight, first, resumed = _dist_resume()
    assert resumed != first and resumed != straight[3:]


def test_fixed_shape_history_loaded_into_another_plan_keeps_its_truncation_cost():
    cfg = dict(sampling="fixed_shape", max_batch_size=19, sigma=3.0, schedulers=False, lr=False)
    torch.manual_seed(100)
    run = _build(**cfg)
    _train(run, 9, {})
    eps = _eps(run[0], 1e-2)
    buf = _save(run)
    for other in (dict(sampling=True), dict(sampling="fixed_shape", max_batch_size=40)):
        run2 = _build(seed=1, sigma=3.0, schedulers=False, lr=False, **other)
        buf.seek(0)
        try:
            _load(run2, buf)
        except ValueError:
            continue  # refusing the other plan is a fix too
        assert _eps(run2[0], 1e-2) >= eps


def test_refused_accountant_mechanism_loads_nothing():
    torch.manual_seed(100)
    run = _build(schedulers=False, lr=False)
    _train(run, 3, {})
    buf = _save(run)
    run2 = _build(seed=1, accountant="prv", schedulers=False, lr=False)
    before = [p.clone() for p in run2[1].parameters()]
    with pytest.raises(ValueError, match="mechanism"):
        _load(run2, buf)
    assert all(torch.equal(a, b) for a, b in zip(before, run2[1].parameters()))


def test_save_inside_a_logical_batch_is_refused():
    """Between two physical steps of one logical batch the pending clipped sums are not part of
    a checkpoint: refused. Leaving the BatchMemoryManager drops the unfinished logical batch
    (never released), after which saving works."""
    torch.manual_seed(100)
    engine, model, opt, crit, dl, _ = _build(schedulers=False, lr=False)
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=2, optimizer=opt) as loader:
        for x, y in loader:
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.last_step_skipped:
                with pytest.raises(ValueError, match="inside a logical batch"):
                    engine.save_checkpoint(path=io.BytesIO(), module=model, optimizer=opt)
                break
        else:
            pytest.fail("no logical batch was split")
    assert not opt.last_step_skipped
    assert all(getattr(p, "summed_grad", None) is None for p in opt.params)
    engine.save_checkpoint(path=io.BytesIO(), module=model, optimizer=opt)
