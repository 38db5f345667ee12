"""The grad_sample_mode registry (dptorch.modes): a user-registered mode trains through
make_private, "no_op" is accepted as in Opacus, and every mode-dependent answer comes from the
mode's entry."""

import ast
from pathlib import Path

import pytest
import torch
from engine_helpers import TinyNet, make_data, make_loader
from torch import nn

from dptorch import PrivacyEngine, modes
from dptorch.grad_sample import GradSampleModule, GradSampleModuleNoOp
from dptorch.grad_sample.utils import (
    GSM_CLASSES,
    get_gsm_class,
    register_grad_sample_mode,
    wrap_model,
)
from dptorch.modes import Mode, get_mode, known_modes, register_mode
from dptorch.optimizers import DPOptimizer, get_optimizer_class


@pytest.fixture(autouse=True)
def _restore_registry(monkeypatch):
    """Modes registered by a test disappear after it."""
    monkeypatch.setattr(modes, "_MODES", dict(modes._MODES))
    monkeypatch.setattr(modes, "_PER_SAMPLE_OPTIMIZERS", dict(modes._PER_SAMPLE_OPTIMIZERS))


class CountingGSM(GradSampleModule):
    """A user's GradSampleModule flavour: counts its forward passes."""

    def __init__(self, m, **kwargs):
        super().__init__(m, **kwargs)
        self.forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return super().forward(*args, **kwargs)


def _private(engine=None, model=None, **kw):
    engine = engine or PrivacyEngine(accountant="rdp")
    model = model or TinyNet()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=make_loader(make_data(64), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(kw)
    return engine.make_private(**args)


def _untouched(model: nn.Module) -> bool:
    return all(not m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------------- registering
def test_user_mode_trains_through_make_private():
    register_mode(Mode("counting", CountingGSM, multi_pass_clippings=("flat",)))
    assert "counting" in known_modes() and GSM_CLASSES["counting"] is CountingGSM
    assert get_gsm_class("counting") is CountingGSM
    assert get_optimizer_class("flat", False, "counting") is DPOptimizer

    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, dl = _private(engine=engine, grad_sample_mode="counting")
    assert type(gsm) is CountingGSM and type(opt) is DPOptimizer
    before = [p.detach().clone() for p in gsm.parameters()]
    x, y = next(iter(dl))
    opt.zero_grad()
    nn.functional.cross_entropy(gsm(x), y).backward()
    assert all(p.grad_sample.shape[0] == len(x) for p in gsm.parameters())
    opt.step()
    assert gsm.forwards == 1 and engine.accountant.history
    assert any(not torch.equal(a, p) for a, p in zip(before, gsm.parameters()))

    # the entry's multi-pass support is what make_private checks
    gsm, opt, dl = _private(grad_sample_mode="counting", multi_pass=True, accum_passes=True)
    assert gsm.multi_pass
    with pytest.raises(ValueError, match="supports clipping 'flat', got 'per_layer'"):
        _private(
            grad_sample_mode="counting", multi_pass=True, accum_passes=True,
            clipping="per_layer", max_grad_norm=[1.0] * 4,
        )


def test_register_grad_sample_mode_is_a_view_on_the_registry():
    register_grad_sample_mode("counting2", CountingGSM)
    assert get_mode("counting2").gsm_class is CountingGSM
    assert not get_mode("counting2").fast_clipping  # fills p.grad_sample
    gsm, opt, _ = _private(grad_sample_mode="counting2", clipping="adaptive",
                           target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                           max_clipbound=10.0, min_clipbound=0.01, unclipped_num_std=2.0,
                           noise_multiplier=0.5)
    assert type(gsm) is CountingGSM and type(opt).__name__ == "AdaClipDPOptimizer"
    # replacing the class of a built-in mode keeps its other settings
    register_grad_sample_mode("functorch", CountingGSM)
    assert get_mode("functorch").gsm_kwargs["force_functorch"]
    assert wrap_model(TinyNet(), "functorch").force_functorch
    with pytest.raises(ValueError, match="AbstractGradSampleModule"):
        register_grad_sample_mode("bad", nn.Linear)


def test_mode_optimizers_and_checks_are_used_before_anything_is_modified():
    class MyOptimizer(DPOptimizer):
        pass

    def refuse_sum(module, *, loss_reduction, **_):
        if loss_reduction == "sum":
            raise ValueError("this mode needs loss_reduction='mean'")

    register_mode(
        Mode("mine", CountingGSM, optimizers={("flat", False): MyOptimizer}, checks=(refuse_sum,))
    )
    gsm, opt, _ = _private(grad_sample_mode="mine")
    assert type(opt) is MyOptimizer
    model = TinyNet()
    with pytest.raises(ValueError, match="needs loss_reduction='mean'"):
        _private(model=model, grad_sample_mode="mine", loss_reduction="sum")
    assert _untouched(model)
    # a fast-clipping mode gets no per-sample-gradient optimizer it did not register
    register_mode(Mode("norms_only", CountingGSM, fast_clipping=True))
    model = TinyNet()
    with pytest.raises(ValueError, match="Unsupported combination"):
        _private(model=model, grad_sample_mode="norms_only")
    assert _untouched(model)


def test_optimizers_registered_before_the_module_class_are_kept():
    class MyOptimizer(DPOptimizer):
        pass

    from dptorch.optimizers import register_optimizer_class

    register_optimizer_class(MyOptimizer, clipping="flat", distributed=False, grad_sample_mode="late")
    assert "late" not in known_modes()  # no module class yet
    with pytest.raises(ValueError, match="no GradSampleModule class"):
        get_gsm_class("late")
    register_mode(Mode("late", CountingGSM))
    assert get_optimizer_class("flat", False, "late") is MyOptimizer


def test_unknown_mode_names_the_known_ones():
    with pytest.raises(ValueError) as e:
        get_mode("magic")
    for name in ("hooks", "functorch", "ew", "ghost", "bk", "no_op"):
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="must be a string"):
        get_mode(1)


@pytest.mark.parametrize("name", ["hooks", "functorch", "ew", "ghost", "bk", "no_op"])
def test_builtin_entries_decide_what_make_private_returns(name):
    mode = get_mode(name)
    out = _private(grad_sample_mode=name)
    assert len(out) == (4 if mode.returns_criterion else 3)
    assert type(out[0]) is mode.gsm_class
    assert type(out[1]) is mode.optimizer_class("flat", False)
    if mode.fast_clipping:  # the module clips with the optimizer's contract, by reference
        assert out[0].clipping is out[1].clipping


# ---------------------------------------------------------------------------- no_op
def test_no_op_mode_clips_and_steps_on_user_grad_samples():
    """grad_sample_mode="no_op" (Opacus: GradSampleModuleNoOp + the generic optimizer): the module
    computes nothing, the user fills p.grad_sample, the optimizer clips and steps on it."""
    torch.manual_seed(0)
    model = TinyNet()
    c = 0.5
    with pytest.warns(UserWarning, match="poisson_sampling=False"):
        out = _private(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            grad_sample_mode="no_op",
            noise_multiplier=0.0,
            max_grad_norm=c,
            loss_reduction="sum",
            poisson_sampling=False,
        )
    assert len(out) == 3
    gsm, opt, dl = out
    assert type(gsm) is GradSampleModuleNoOp and type(opt) is DPOptimizer
    x, y = next(iter(dl))
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_one(p, xi, yi):
        out = torch.func.functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None], reduction="sum")

    per_sample = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    gsm(x)  # the wrapper only runs the model
    assert all(p.grad_sample is None for p in gsm.parameters())  # None from wrapping on
    for n, p in model.named_parameters():
        p.grad_sample = per_sample[n].clone()
        p.grad = per_sample[n].sum(0)
    norms = torch.stack([per_sample[n].flatten(1).norm(dim=1) for n in names]).norm(dim=0)
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    expected = {
        n: params[n] - torch.einsum("b,b...->...", factors, per_sample[n]) for n in names
    }
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n])


# ---------------------------------------------------------------------------- layering
def test_modes_module_imports_nothing_from_dptorch():
    """dptorch.modes is the bottom of the import graph: grad_sample and optimizers import it."""
    tree = ast.parse(Path(modes.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("dptorch"), node.module
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("dptorch") for a in node.names)


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_prewrapped_fast_module_adopts_the_optimizers_contract(mode):
    """A model the user wrapped in a fast-clipping module before make_private clips with the
    optimizer's contract afterwards: one C, shared by reference."""
    gsm = get_gsm_class(mode)(TinyNet(), max_grad_norm=5.0)
    out = _private(model=gsm, grad_sample_mode=mode, max_grad_norm=1.0)
    module, optimizer = out[0], out[1]
    assert module is gsm and module.clipping is optimizer.clipping
    optimizer.max_grad_norm = 0.25
    assert module.clipping.max_grad_norm == 0.25


def test_user_step_hook_keeps_the_accountant_counting():
    """Opacus: attach_step_hook replaces the accountant's hook, so accounting silently stops.
    dptorch runs both; assigning ``step_hook`` (Opacus's attribute) replaces them all."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
    net = torch.nn.Linear(4, 3)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    seen = []
    opt.attach_step_hook(lambda o: seen.append(len(engine.accountant)))
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(engine.accountant) == len(loader) > 0
    assert seen == list(range(1, len(loader) + 1))  # after the accountant's, at every step
    accountant_hook = opt.step_hooks[0]
    opt.step_hook = None
    assert opt.step_hook is None and opt.step_hooks == []
    opt.step_hook = accountant_hook
    assert opt.step_hook is accountant_hook
