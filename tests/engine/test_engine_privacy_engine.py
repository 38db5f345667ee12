"""PrivacyEngine: argument validation, training steps, accounting, BatchMemoryManager,
schedulers and checkpoints."""

import io
import math
import re

import pytest
import torch
from engine_helpers import TinyNet, make_data, make_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import GradSampleModule, PrivacyEngine
from dptorch.optimizers import AdaClipDPOptimizer, DPOptimizer, DPPerLayerOptimizer
from dptorch.schedulers import (
    ExponentialGradClip,
    ExponentialNoise,
    LambdaGradClip,
    LambdaNoise,
    StepGradClip,
    StepNoise,
)
from dptorch.utils.batch_memory_manager import BatchMemoryManager


def _private(engine=None, model=None, dl=None, **kw):
    engine = engine or PrivacyEngine(accountant="rdp")
    model = model or TinyNet()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=dl or make_loader(make_data(64), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(kw)
    return (engine, *engine.make_private(**args))


def _steps(history):
    return [s for s, _, n in history for _ in range(n)]


# ---------------------------------------------------------------------------- bad input
BAD_CASES = {
    "negative noise": dict(noise_multiplier=-0.1),
    "nan noise": dict(noise_multiplier=float("nan")),
    "zero clip": dict(max_grad_norm=0.0),
    "negative clip": dict(max_grad_norm=-1.0),
    "per-layer scalar": dict(clipping="per_layer", max_grad_norm=1.0),
    "per-layer wrong length": dict(clipping="per_layer", max_grad_norm=[1.0, 1.0]),
    "unknown clipping": dict(clipping="elementwise"),
    "unknown reduction": dict(loss_reduction="max"),
    "unknown mode": dict(grad_sample_mode="magic"),
    "no dataset": dict(data_loader=[(torch.randn(2, 6), torch.zeros(2, dtype=torch.long))]),
    "empty dataset": dict(
        data_loader=DataLoader(TensorDataset(torch.zeros(0, 6), torch.zeros(0)), batch_size=4)
    ),
    "adaclip sigma too large": dict(
        clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
        max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=0.1,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_arguments_raise_before_anything_is_wrapped(case):
    model = TinyNet()
    with pytest.raises(ValueError):
        _private(model=model, **BAD_CASES[case])
    # nothing happened to the model: no hooks, no per-sample gradient machinery
    assert all(not m._forward_hooks for m in model.modules())


def test_optimizer_parameter_mismatch_is_named():
    model = TinyNet()
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"not the model's.*#4"):
        PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=torch.optim.SGD([*model.parameters(), other.weight], lr=0.1),
            data_loader=make_loader(make_data(16)),
            noise_multiplier=1.0, max_grad_norm=1.0,
        )
    with pytest.raises(ValueError, match=r"not in the optimizer: fc2\.weight, fc2\.bias"):
        PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=torch.optim.SGD(model.fc1.parameters(), lr=0.1),
            data_loader=make_loader(make_data(16)),
            noise_multiplier=1.0, max_grad_norm=1.0,
        )
    # frozen parameters outside the optimizer are fine
    for p in model.fc2.parameters():
        p.requires_grad_(False)
    _private(model=model, optimizer=torch.optim.SGD(model.fc1.parameters(), lr=0.1))


def test_unsupported_model_lists_every_offending_module():
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError) as e:
        _private(model=model)
    msg = str(e.value)
    assert "1 (BatchNorm1d)" in msg and "3 (BatchNorm1d)" in msg
    assert "ModuleValidator.fix(model)" in msg
    assert not PrivacyEngine(accountant="rdp").is_compatible(
        module=model, optimizer=None, data_loader=None
    )


def test_secure_mode_refuses_seeds():
    with pytest.raises(ValueError, match="noise_generator"):
        _private(engine=PrivacyEngine(accountant="rdp", secure_mode=True),
                 noise_generator=torch.Generator())
    seeded = make_loader(make_data(16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="generator"):
        _private(engine=PrivacyEngine(accountant="rdp", secure_mode=True), dl=seeded)
    engine, model, opt, dl = _private(engine=PrivacyEngine(accountant="rdp", secure_mode=True))
    assert dl.batch_sampler.secure_mode and opt.secure_mode and opt.generator is None


def test_make_private_with_epsilon_validates_targets():
    for bad in (dict(target_epsilon=0.0), dict(target_delta=1.0), dict(epochs=0)):
        args = dict(target_epsilon=1.0, target_delta=1e-5, epochs=2, **{})
        args.update(bad)
        model = TinyNet()
        with pytest.raises(ValueError):
            PrivacyEngine(accountant="rdp").make_private_with_epsilon(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=make_loader(make_data(32)), max_grad_norm=1.0, **args,
            )


# ---------------------------------------------------------------------------- training
def test_training_counts_steps_and_forbids_accumulation():
    engine, model, opt, dl = _private()
    assert isinstance(model, GradSampleModule) and type(opt) is DPOptimizer
    assert opt.expected_batch_size == 8 and dl.sample_rate == pytest.approx(1 / 8)
    for x, y in dl:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert engine.accountant.history == [(1.0, 1 / 8, 8)]
    assert math.isfinite(engine.get_epsilon(1e-5)) and engine.get_epsilon(1e-5) > 0
    x, y = make_data(8)[:]
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="BatchMemoryManager"):
        nn.functional.cross_entropy(model(x), y).backward()


def test_empty_batch_step_adds_noise_and_is_accounted():
    for sigma in (0.0, 2.0):
        engine, model, opt, _ = _private(noise_multiplier=sigma, noise_generator=torch.Generator().manual_seed(0))
        before = [p.detach().clone() for p in model.parameters()]
        x, y = torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        if sigma == 0:
            assert torch.equal(grads, torch.zeros_like(grads))
        else:
            # pure noise, std σC / expected_batch_size = 0.25
            assert torch.isfinite(grads).all()
            assert 0.15 < grads.std().item() < 0.35
            assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        opt.zero_grad()
        assert sum(n for _, _, n in engine.accountant.history) == 1


def test_non_poisson_warns_and_still_accounts():
    with pytest.warns(UserWarning, match="Poisson"):
        engine, model, opt, dl = _private(poisson_sampling=False)
    assert isinstance(dl, DataLoader) and dl.batch_size == 8
    for x, y in dl:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert engine.accountant.history == [(1.0, 1 / 8, 8)]


def test_clipping_modes_through_make_private():
    _, model, opt, dl = _private(clipping="per_layer", max_grad_norm=[1.0, 0.5, 1.0, 0.5])
    assert isinstance(opt, DPPerLayerOptimizer)
    _, model, opt, dl = _private(
        clipping="adaptive", noise_multiplier=0.5, target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.01, unclipped_num_std=2.0,
    )
    assert isinstance(opt, AdaClipDPOptimizer)
    start = opt.max_grad_norm
    for x, y in dl:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.max_grad_norm != start and 0.01 <= opt.max_grad_norm <= 10.0


# ---------------------------------------------------------------------------- schedulers
def test_noise_schedule_is_what_the_accountant_records():
    engine, model, opt, dl = _private(noise_multiplier=2.0)
    sched = ExponentialNoise(opt, gamma=0.5)
    seen = []
    for _ in range(3):
        for i, (x, y) in enumerate(dl):
            if i == 3:
                break
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            seen.append(opt.noise_multiplier)
        sched.step()
    assert seen == [2.0] * 3 + [1.0] * 3 + [0.5] * 3
    assert _steps(engine.accountant.history) == seen


@pytest.mark.parametrize(
    "make, attr, expected",
    [
        (lambda o: StepNoise(o, step_size=2, gamma=0.5), "noise_multiplier", [4, 4, 2, 2, 1]),
        (lambda o: LambdaNoise(o, noise_lambda=lambda e: 1 + e), "noise_multiplier", [4, 8, 12, 16, 20]),
        (lambda o: ExponentialGradClip(o, gamma=0.5), "max_grad_norm", [4, 2, 1, 0.5, 0.25]),
        (lambda o: StepGradClip(o, step_size=3, gamma=0.1), "max_grad_norm", [4, 4, 4, 0.4, 0.4]),
        (lambda o: LambdaGradClip(o, scheduler_function=lambda e: 0.5**e), "max_grad_norm", [4, 2, 1, 0.5, 0.25]),
    ],
)
def test_scheduler_values_and_state(make, attr, expected):
    opt = DPOptimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1), noise_multiplier=4.0,
                      max_grad_norm=4.0, expected_batch_size=2)
    sched = make(opt)
    got = [getattr(opt, attr)]
    for _ in range(4):
        sched.step()
        got.append(getattr(opt, attr))
    assert got == pytest.approx(expected)
    state = sched.state_dict()
    assert "optimizer" not in state and all(not callable(v) for v in state.values())
    assert state["last_epoch"] == 4
    torch.save(state, io.BytesIO())  # picklable (no lambdas)


def test_scheduler_refuses_invalid_values():
    opt = DPOptimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=2)
    with pytest.raises(ValueError, match="noise_multiplier"):
        LambdaNoise(opt, noise_lambda=lambda e: -1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        ExponentialNoise(torch.optim.SGD(TinyNet().parameters(), lr=0.1), gamma=0.5)


# ---------------------------------------------------------------------------- BatchMemoryManager
def _bmm_run(use_bmm: bool):
    torch.manual_seed(0)
    model = TinyNet().double()
    ds = make_data(96, dtype=torch.float64)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
        data_loader=make_loader(ds, batch_size=24), noise_multiplier=0.8, max_grad_norm=0.5,
        noise_generator=torch.Generator().manual_seed(5),
    )
    dl.batch_sampler.generator = torch.Generator().manual_seed(9)
    sizes = []
    if use_bmm:
        with BatchMemoryManager(data_loader=dl, max_physical_batch_size=5, optimizer=opt) as loader:
            for x, y in loader:
                sizes.append(len(x))
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    else:
        for x, y in dl:
            sizes.append(len(x))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], engine.accountant.history, sizes


def test_batch_memory_manager_equals_logical_batches():
    p_logical, h_logical, sizes_logical = _bmm_run(False)
    p_phys, h_phys, sizes_phys = _bmm_run(True)
    assert h_phys == h_logical == [(0.8, 0.25, 4)]
    assert max(sizes_phys) <= 5 and len(sizes_phys) > len(sizes_logical)
    assert sum(sizes_phys) == sum(sizes_logical)
    for a, b in zip(p_logical, p_phys):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_batch_memory_manager_empty_logical_batch_still_steps():
    engine, model, opt, dl = _private(noise_generator=torch.Generator().manual_seed(0))
    dl.batch_sampler.sample_rate = 1e-9  # every logical batch is empty
    before = [p.detach().clone() for p in model.parameters()]
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=3, optimizer=opt) as loader:
        n = 0
        for x, y in loader:
            assert x.shape == (0, 6)
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
            opt.zero_grad()
            n += 1
    assert n == 8 and sum(k for _, _, k in engine.accountant.history) == 8
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ---------------------------------------------------------------------------- checkpoints
def _ckpt_setup(seed_model: int):
    torch.manual_seed(seed_model)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 3))
    engine = PrivacyEngine(accountant="rdp")
    model, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        data_loader=make_loader(make_data(40), batch_size=8), noise_multiplier=1.1,
        max_grad_norm=0.7,
    )
    sched = ExponentialNoise(opt, gamma=0.9)
    return engine, model, opt, dl, sched


def _train(model, opt, dl, sched, n_steps, state):
    """Trains n_steps over the loader's stream; ``state['it']`` keeps the epoch iterator."""
    for _ in range(n_steps):
        try:
            x, y = next(state["it"])
        except (StopIteration, KeyError):
            state["it"] = iter(dl)
            x, y = next(state["it"])
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        state["step"] = state.get("step", 0) + 1
        if state["step"] % 3 == 0:
            sched.step()


def test_checkpoint_resume_is_bitwise_identical(tmp_path):
    torch.manual_seed(100)
    engine, model, opt, dl, sched = _ckpt_setup(0)
    _train(model, opt, dl, sched, 14, {})
    ref_params = [p.detach().clone() for p in model.parameters()]
    ref_eps = engine.get_epsilon(1e-5)
    ref_hist = list(engine.accountant.history)

    torch.manual_seed(100)
    engine, model, opt, dl, sched = _ckpt_setup(0)
    state = {}
    _train(model, opt, dl, sched, 7, state)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=opt, noise_scheduler=sched,
                           checkpoint_dict={"epoch": 7})
    # something else happens to the global RNG in between (another process, other code)
    torch.rand(1000)

    engine2, model2, opt2, dl2, sched2 = _ckpt_setup(1)  # fresh objects, other init
    extra = engine2.load_checkpoint(path=path, module=model2, optimizer=opt2, noise_scheduler=sched2)
    assert extra == {"epoch": 7}
    assert opt2.noise_multiplier == opt.noise_multiplier
    _train(model2, opt2, dl2, sched2, 7, {"step": 7})
    for a, b in zip(ref_params, model2.parameters()):
        assert torch.equal(a, b)
    assert engine2.accountant.history == ref_hist
    assert engine2.get_epsilon(1e-5) == ref_eps


def test_checkpoint_loads_into_plain_module():
    engine, model, opt, _ = _private()
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=model)
    buf.seek(0)
    plain = TinyNet()
    engine.load_checkpoint(path=buf, module=plain)
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- user script
USER_SCRIPT = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.validators import ModuleValidator

torch.manual_seed(0)
x = torch.randn(600, 10)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
train_loader = DataLoader(TensorDataset(x, y), batch_size=60)
model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
model = ModuleValidator.fix(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
privacy_engine = PrivacyEngine()
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model, optimizer=optimizer, data_loader=train_loader,
    target_epsilon=8.0, target_delta=1e-5, epochs=4, max_grad_norm=1.0,
)
for epoch in range(4):
    with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=32,
                            optimizer=optimizer) as loader:
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
    epsilon = privacy_engine.get_epsilon(1e-5)
model.eval()
accuracy = (model(x).argmax(1) == y).float().mean().item()
"""


def test_user_opacus_script_runs_with_renamed_import():
    ns: dict = {}
    exec(compile(re.sub(r"\bopacus\b", "dptorch", USER_SCRIPT), "<user>", "exec"), ns)
    assert 0 < ns["epsilon"] <= 8.0 * 1.05
    assert ns["accuracy"] > 0.75
