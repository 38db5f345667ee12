"""Differences from Opacus 1.6 found by running Opacus's own test suite against dptorch: module
paths and names, ``p.grad_sample`` right after wrapping, ``remove_hooks()`` of the in-place
form, the ExpandedWeights refusal of BatchNorm, and ``ModuleValidator.fix`` argument checks."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import (
    GradSampleHooks,
    GradSampleHooksFastGradientClipping,
    GradSampleModule,
    GradSampleModuleBookKeeping,
    GradSampleModuleExpandedWeights,
    GradSampleModuleFastGradientClipping,
    GradSampleModuleNoOp,
)
from dptorch.validators import ModuleValidator
from dptorch.validators.errors import UnsupportedModuleError


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()


def _brute_force_grad_samples(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample gradients of ``model(x).sum()`` (loss_reduction="sum"), one sample at a time."""
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(model(x[i : i + 1]).sum(), list(model.parameters()))
        rows.append(grads)
    return [torch.stack(g) for g in zip(*rows)]


# ----------------------------------------------------------------------------- module paths
def test_ddp_fast_gradient_clipping_module_path() -> None:
    from dptorch.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizer

    mod = importlib.import_module("dptorch.optimizers.ddpoptimizer_fast_gradient_clipping")
    cls = mod.DistributedDPOptimizerFastGradientClipping
    assert cls is DistributedDPOptimizerFastGradientClipping
    assert issubclass(cls, DPOptimizer)
    assert mod.__all__ == ["DistributedDPOptimizerFastGradientClipping"]


def test_misspelled_alias_and_star_import() -> None:
    import dptorch.optimizers as optimizers

    assert "DistributedDPOptimizerFastGradientlipping" in optimizers.__all__
    assert (
        optimizers.DistributedDPOptimizerFastGradientlipping
        is optimizers.DistributedDPOptimizerFastGradientClipping
    )
    ns: dict = {}
    exec("from dptorch.optimizers import *", ns)
    assert all(name in ns for name in optimizers.__all__)


def test_check_torch_version_for_ew_sample() -> None:
    from dptorch.utils.per_sample_gradients_utils import check_torch_version_for_ew_sample

    assert check_torch_version_for_ew_sample() is True  # dptorch needs torch >= 2


def test_create_norm_sample() -> None:
    from dptorch.grad_sample.grad_sample_module_fast_gradient_clipping import create_norm_sample

    p = nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    gs = torch.randn(5, 3, 2, dtype=torch.float64)
    create_norm_sample(param=p, grad_sample=gs, max_batch_len=5)
    expected = torch.stack([gs[i].flatten().pow(2).sum().sqrt() for i in range(5)])
    torch.testing.assert_close(p._norm_sample, expected, rtol=0, atol=1e-12)
    create_norm_sample(param=p, grad_sample=gs[:0], max_batch_len=0)
    assert p._norm_sample.shape == (0,) and p._norm_sample.dtype == torch.float64
    frozen = nn.Parameter(torch.zeros(3, 2), requires_grad=False)
    create_norm_sample(param=frozen, grad_sample=gs.float(), max_batch_len=5)
    assert not hasattr(frozen, "_norm_sample")


# ----------------------------------------------------------------------------- grad_sample = None
WRAPPERS = {
    "hooks": lambda m: GradSampleModule(m),
    "functorch": lambda m: GradSampleModule(m, force_functorch=True),
    "ew": lambda m: GradSampleModuleExpandedWeights(m),
    "in_place": lambda m: GradSampleHooks(m),
    "no_op": lambda m: GradSampleModuleNoOp(m),
    "bk": lambda m: GradSampleModuleBookKeeping(m, max_grad_norm=1.0),
    "ghost": lambda m: GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0),
    "fgc": lambda m: GradSampleModuleFastGradientClipping(
        m, max_grad_norm=1.0, use_ghost_clipping=False
    ),
    "fgc_in_place": lambda m: GradSampleHooksFastGradientClipping(
        m, max_grad_norm=1.0, use_ghost_clipping=False
    ),
}


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_grad_sample_is_none_after_wrapping(kind: str) -> None:
    m = _mlp()
    m[2].bias.requires_grad_(False)
    wrapped = WRAPPERS[kind](m)
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert "grad_sample" in p.__dict__ and p.grad_sample is None, name
        else:
            assert not hasattr(p, "grad_sample"), name
    if kind in ("hooks", "functorch", "ew", "in_place"):
        wrapped(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        assert m[0].weight.grad_sample.shape == (5, 3, 4)


# ----------------------------------------------------------------------------- remove_hooks
def _hook_count(m: nn.Module) -> int:
    return sum(
        len(s._forward_hooks) + len(s._forward_pre_hooks) + len(s._backward_hooks)
        for s in m.modules()
    )


def test_remove_hooks_removes_root_hooks_and_model_rewraps() -> None:
    m = _mlp()
    h = GradSampleHooks(m, loss_reduction="sum")
    assert _hook_count(m) > 0
    h.remove_hooks()
    assert _hook_count(m) == 0
    m(torch.randn(3, 4, dtype=torch.float64)).sum().backward()  # a plain module again
    assert all(p.grad_sample is None for p in m.parameters())
    m.zero_grad()

    x = torch.randn(6, 4, dtype=torch.float64)
    expected = _brute_force_grad_samples(m, x)
    gsm = GradSampleModule(m, loss_reduction="sum")
    gsm(x).sum().backward()
    for p, e in zip(m.parameters(), expected):
        torch.testing.assert_close(p.grad_sample, e, rtol=0, atol=1e-12)


def test_remove_hooks_then_in_place_rewrap() -> None:
    m = _mlp()
    GradSampleHooks(m, loss_reduction="sum").remove_hooks()
    h2 = GradSampleHooks(m, loss_reduction="sum")
    x = torch.randn(4, 4, dtype=torch.float64)
    m(x).sum().backward()
    h2.remove_hooks()
    expected = _brute_force_grad_samples(m, x)
    for p, e in zip(m.parameters(), expected):
        torch.testing.assert_close(p.grad_sample, e, rtol=0, atol=1e-12)
    assert _hook_count(m) == 0


def test_unfreezing_after_wrapping_still_samples_in_place() -> None:
    """The hooks re-installed when the trainable parameters change keep the root hooks."""
    m = _mlp()
    x = torch.randn(4, 4, dtype=torch.float64)
    expected = _brute_force_grad_samples(m, x)
    m[0].weight.requires_grad_(False)
    GradSampleHooks(m, loss_reduction="sum")
    m[0].weight.requires_grad_(True)
    m(x).sum().backward()
    for p, e in zip(m.parameters(), expected):
        torch.testing.assert_close(p.grad_sample, e, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- ew + BatchNorm
def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2))


@pytest.mark.parametrize("mode", ["hooks", "ew"])
def test_batchnorm_refused_with_unsupported_module_error(mode: str) -> None:
    m = _bn_model()
    loader = DataLoader(
        TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 2, (8,))), batch_size=4
    )
    with pytest.raises(UnsupportedModuleError):
        PrivacyEngine().make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode=mode,
        )


def test_ew_refusals_are_unsupported_module_errors() -> None:
    from dptorch.grad_sample.gsm_exp_weights import ExpandedWeightsUnsupportedError

    with pytest.raises(UnsupportedModuleError):
        GradSampleModuleExpandedWeights(_bn_model())
    with pytest.raises(NotImplementedError):  # still what it was
        GradSampleModuleExpandedWeights(_bn_model())
    assert issubclass(ExpandedWeightsUnsupportedError, ValueError)


# ----------------------------------------------------------------------------- validator
def test_fix_refuses_instance_norm_with_num_groups() -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with pytest.raises(ValueError, match="mutually exclusive"):
        ModuleValidator.fix(m, replace_bn_with_in=True, num_groups=4)
    assert isinstance(ModuleValidator.fix(m, replace_bn_with_in=True)[1], nn.InstanceNorm1d)
    fixed = ModuleValidator.fix(m, num_groups=4)[1]
    assert isinstance(fixed, nn.GroupNorm) and fixed.num_groups == 4
    # nothing to replace: nothing to refuse (as Opacus, whose BatchNorm fixer checks)
    ModuleValidator.fix(nn.Linear(2, 2), replace_bn_with_in=True, num_groups=4)


# ----------------------------------------------------------------------------- FSDP2Wrapper
_FSDP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.fsdp import FSDPModule
    from dptorch.grad_sample import GradSampleModuleFastGradientClipping
    from dptorch.grad_sample import GradSampleModuleFastGradientClippingFSDP
    from dptorch.grad_sample.fast_clipping_loss import DPLossFastGradientClipping
    from dptorch.optimizers import (
        DPOptimizerFastGradientClipping, FSDPOptimizerFastGradientClipping)
    from dptorch.utils.fsdp_utils import FSDP2Wrapper, iterate_submodules

    def make():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Embedding(10, 6), nn.LayerNorm(6), nn.Flatten(), nn.ReLU(), nn.Linear(18, 3)
        ).double()

    x = torch.randint(0, 10, (8, 3)); y = torch.randint(0, 3, (8,))

    def step(model, gsm_cls, opt_cls):
        opt = opt_cls(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                      max_grad_norm=0.3, expected_batch_size=8)
        gsm = gsm_cls(model, clipping=opt.clipping)
        crit = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
        opt.zero_grad(); crit(gsm(x), y).backward(); opt.step()
        return [p.grad for p in model.parameters()]

    ref = step(make(), GradSampleModuleFastGradientClipping, DPOptimizerFastGradientClipping)
    model = make()
    assert [type(m).__name__ for m in iterate_submodules(model)] == [
        "Embedding", "LayerNorm", "Linear"]
    out = FSDP2Wrapper(model)
    assert out is model and isinstance(model, FSDPModule)
    units = [i for i, m in enumerate(model) if isinstance(m, FSDPModule)]
    assert units == [0, 1, 4], units
    got = step(model, GradSampleModuleFastGradientClippingFSDP, FSDPOptimizerFastGradientClipping)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.full_tensor(), r, rtol=0, atol=1e-12)
    print("FSDP2WRAPPER-OK", flush=True)
    os._exit(0)
    """
)


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is needed",
)
def test_fsdp2_wrapper_shards_each_layer_and_steps_exactly(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "fsdp2_wrapper.py"
    script.write_text(_FSDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(port)], capture_output=True, text=True, env=env,
        timeout=300,
    )
    assert "FSDP2WRAPPER-OK" in run.stdout, run.stdout + run.stderr


def test_bk_remove_hooks_gives_the_layers_their_forward_back() -> None:
    from dptorch.grad_sample import wrap_model

    m = _mlp()
    g = wrap_model(m, "bk", batch_first=True, loss_reduction="sum")
    assert any("forward" in s.__dict__ for s in m.modules())
    g.remove_hooks()
    assert not any("forward" in s.__dict__ for s in m.modules())
    assert _hook_count(m) == 0
    x = torch.randn(4, 4, dtype=torch.float64)
    expected = _brute_force_grad_samples(m, x)
    gsm = GradSampleModule(m, loss_reduction="sum")
    gsm(x).sum().backward()
    for p, e in zip(m.parameters(), expected):
        torch.testing.assert_close(p.grad_sample, e, rtol=0, atol=1e-12)
