"""Review (session 8, second round): user hooks on sampled layers, and what the hooks keep alive.

Invariant: with noise 0, SGD at lr 1 and a summed loss, the released update is
``Σ_b clip_C(g_b)`` where ``g_b`` is sample ``b``'s gradient of the model *as the user runs it*,
hooks included (brute force: each sample alone, float64), or the step raises a ``ValueError``.

Findings (each fails on the code before the fix):

* the capture's tensor hook on a layer output was moved last among that tensor's hooks at the
  end of the forward pass, and a tensor hook registered after it was refused: torch's
  ``FlopCounterMode`` / ``ModuleTracker`` (Lightning's ``measure_flops``) around a DP step and
  an observing ``out.register_hook(print)`` were refused in every mode. The capture is now a
  pre-hook of the output's autograd node (autograd runs it after every tensor hook of the
  output), ghost's norm pass moves its tensor hooks last when it starts;
* a layer that keeps a tensor of its forward on itself (``self.last = y``) kept the whole model
  alive after ``del model`` in every mode: the capture hook held the GradSampleModule, which
  holds the module, which holds the tensor, which holds the hook (a cycle through autograd
  that the garbage collector does not see);
* the global ``_OutputWitness`` hook stayed registered after the user's global hook was removed
  and the model deleted, until some module was called (torch.compile warns about it).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.modules.module as torch_module
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleModule, wrap_model
from dptorch.optimizers import get_optimizer_class
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

from .invariants import MODES, dp_update, reference_update, sample_loss

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
C = 0.05


def _xy(b=6, seed=0, d_out=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 4, generator=g, dtype=DT) * 3,
            torch.randn(b, d_out, generator=g, dtype=DT))


def _mlp():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _assert_close(got, ref):
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-7, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")


def _step(model, mode, x, y, after_forward):
    """One DP step (as :func:`dp_update`) of a copy of ``model``, ``after_forward(model, out)``
    running between the forward pass and the backward pass; returns ``{name: before - after}``."""
    model = copy.deepcopy(model)
    fast = mode in ("ghost", "bk")
    cls = get_optimizer_class("flat", False, mode)
    opt = cls(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
              max_grad_norm=C, expected_batch_size=x.shape[0], loss_reduction="sum")
    gsm = wrap_model(model, mode, loss_reduction="sum",
                     **({"clipping": opt.clipping} if fast else {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    out = gsm(x)
    after_forward(model, out)
    if mode == "ghost":
        DPLossFastGradientClipping(gsm, opt, nn.MSELoss(reduction="sum"), "sum")(out, y).backward()
    else:
        sample_loss(out, y).backward()
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- observers
def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def _module_tracker():
    from torch.utils.module_tracker import ModuleTracker

    return ModuleTracker()


@pytest.mark.parametrize("tool", [_flop_counter, _module_tracker], ids=["flops", "tracker"])
@pytest.mark.parametrize("mode", MODES)
def test_finding_flop_counter_around_a_dp_step_is_exact(mode, tool):
    """*Finding*: torch's FlopCounterMode and ModuleTracker (global forward hooks registering
    an observing multi-grad hook on every module's output) around a DP step were refused."""
    x, y = _xy()
    with tool():
        got = dp_update(_mlp(), mode, x, y, C)
    _assert_close(got, reference_update(_mlp(), x, y, C))


@pytest.mark.parametrize("what", ["register_hook", "retain_grad"])
@pytest.mark.parametrize("mode", MODES)
def test_finding_an_observing_tensor_hook_after_the_forward_pass_is_exact(mode, what):
    """*Finding*: ``out.register_hook(print)`` between the forward and backward passes was
    refused in every mode."""
    x, y = _xy()
    seen = []

    def observe(model, out):
        if what == "retain_grad":
            out.retain_grad()
            seen.append(out)
        else:
            out.register_hook(lambda g: seen.append(g.norm()) and None)

    got = _step(_mlp(), mode, x, y, observe)
    _assert_close(got, reference_update(_mlp(), x, y, C))
    assert seen


class _Kept(nn.Sequential):
    """Keeps the first layer's output (a forward hook of the user's), so that a test can
    register a tensor hook on it after the forward pass; ``scale`` applies the same rescaling
    inside the forward pass (the brute-force reference)."""

    def __init__(self, scale=None):
        torch.manual_seed(5)
        super().__init__(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        self.to(DT)
        self.scale = scale
        self[0].register_forward_hook(self._keep)

    def _keep(self, m, i, o):
        self.h = o
        if self.scale is not None and o.requires_grad:
            o.register_hook(lambda g: g * self.scale)


@pytest.mark.parametrize("on", ["output", "hidden"])
@pytest.mark.parametrize("mode", MODES)
def test_a_rescaling_tensor_hook_registered_after_the_forward_pass_is_exact(mode, on):
    """A tensor hook that rescales a layer output's gradient, registered between the forward
    and the backward pass, runs before the capture (node pre-hook; ghost: the norm pass moves
    its tensor hooks last): exact, not released with the wrong norms (ghost: up to 5·C)."""
    x, y = _xy()

    def rescale(model, out):
        (out if on == "output" else model.h).register_hook(lambda g: g * 5)

    got = _step(_Kept(), mode, x, y, rescale)
    if on == "hidden":
        ref = reference_update(_Kept(scale=5.0), x, y, C)
    else:  # every parameter is before the output: 5 times each per-sample gradient
        ref = _reference_scaled_loss(x, y, 5.0)
    _assert_close(got, ref)


def _reference_scaled_loss(x, y, s):
    """Brute force of a model whose output's gradient is multiplied by ``s``."""
    model = _Kept()
    named = [(n, p) for n, p in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in named}
    for b in range(x.shape[0]):
        loss = s * sample_loss(model(x[b:b + 1]), y[b:b + 1])
        grads = torch.autograd.grad(loss, [p for _, p in named])
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        f = min(1.0, C / (norm + 1e-6))
        for (n, _), g in zip(named, grads):
            total[n] += f * g
    return total


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_hook_registered_during_the_backward_pass(mode):
    """A hook on the model's output that registers a rescaling hook on a hidden layer's output
    (which runs later in the same backward pass): exact where the capture is a node pre-hook
    (hooks, functorch, bk); refused in ghost's norm pass, whose capture is a tensor hook that
    the late one would follow."""
    x, y = _xy()

    def late(model, out):
        out.register_hook(lambda g: model.h.register_hook(lambda g2: g2 * 5) and None)

    if mode == "ghost":
        with pytest.raises(ValueError, match=r"0 \(Linear\): a tensor hook .* during the backward"):
            _step(_Kept(), mode, x, y, late)
        return
    _assert_close(_step(_Kept(), mode, x, y, late), reference_update(_Kept(scale=5.0), x, y, C))


class _SecondOutput(nn.Module):
    """A layer without a grad sampler whose output is the second output of its autograd node
    (``torch.var_mean``: the node pre-hook reads the gradient by output number)."""

    def __init__(self, d=5):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2 * d, dtype=DT).reshape(d, 2))

    def forward(self, x):
        _, mean = torch.var_mean(x.unsqueeze(-1) * self.w, dim=-1)
        return mean


class _SecondModel(nn.Sequential):
    """Keeps ``_SecondOutput``'s output; ``scale`` rescales its gradient in the forward pass."""

    def __init__(self, scale=None):
        torch.manual_seed(5)
        super().__init__(nn.Linear(4, 5), nn.Tanh(), _SecondOutput(), nn.Linear(5, 3))
        self.to(DT)
        self.scale = scale
        self[2].register_forward_hook(self._keep)

    def _keep(self, m, i, o):
        self.kept = o
        if self.scale is not None and o.requires_grad:
            o.register_hook(lambda g: g * self.scale)


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_output_that_is_its_nodes_second_output(mode):
    x, y = _xy()
    model = _SecondModel()
    model(x)
    assert model.kept.output_nr == 1
    _assert_close(dp_update(_SecondModel(), mode, x, y, C), reference_update(_SecondModel(), x, y, C))
    got = _step(_SecondModel(), mode, x, y, lambda m, out: m.kept.register_hook(lambda g: g * 3))
    _assert_close(got, reference_update(_SecondModel(scale=3.0), x, y, C))


class _InPlaceAfter(nn.Module):
    """A hooked view (Linear on (B, T, d)) modified in place by the next layer, and a rescaling
    hook registered on the modified tensor after the forward pass."""

    def __init__(self, scale=None):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = nn.Linear(4, 5).to(DT), nn.Linear(5, 3).to(DT)
        self.scale = scale

    def forward(self, x):
        h = self.a(x.unsqueeze(1).expand(-1, 2, -1))
        torch.relu_(h)
        if self.scale is not None and h.requires_grad:
            h.register_hook(lambda g: g * self.scale)
        self.h = h
        return self.b(h).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_a_rescaling_hook_after_an_in_place_op_on_a_hooked_view(mode):
    x, y = _xy()
    got = _step(_InPlaceAfter(), mode, x, y, lambda m, out: m.h.register_hook(lambda g: g * 4))
    _assert_close(got, reference_update(_InPlaceAfter(scale=4.0), x, y, C))


# --------------------------------------------------------------------------- what stays alive
class _Keep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        self.last = y  # kept with its graph, e.g. for visualisation
        return y


@pytest.mark.parametrize("cached", [True, False], ids=["caches_output", "plain"])
@pytest.mark.parametrize("mode", [*MODES, "ew"])
def test_finding_the_model_is_freed_after_training(mode, cached):
    """*Finding*: a layer caching its output (with its graph) on itself kept the whole model
    alive after ``del`` in every mode."""
    if mode == "ew":
        from dptorch.grad_sample.gsm_exp_weights import check_torch_version_for_ew_sample

        if not check_torch_version_for_ew_sample():
            pytest.skip("ExpandedWeights needs a newer torch")

    def run():
        torch.manual_seed(0)
        net = nn.Sequential(_Keep() if cached else nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
        res = PrivacyEngine().make_private(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=False,
            criterion=nn.CrossEntropyLoss())
        model, opt = res[0], res[1]
        crit = res[2] if mode == "ghost" else nn.CrossEntropyLoss()
        for _ in range(2):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        return weakref.ref(net), weakref.ref(model)

    refs = run()
    gc.collect()
    assert all(r() is None for r in refs)


# --------------------------------------------------------------------------- the global witness
def _witnesses():
    return [h for h in torch_module._global_forward_hooks.values()
            if type(h).__name__ == "_OutputWitness"]


def test_finding_the_witness_goes_with_its_module():
    """*Finding*: the witness stayed registered after the user's global hook was removed and
    the model deleted, until some module was called."""
    x, _ = _xy()
    gsm = GradSampleModule(_mlp(), loss_reduction="sum")
    h = torch_module.register_module_forward_hook(lambda m, i, o: None)
    try:
        gsm(x).sum().backward()
        assert len(_witnesses()) == 1
    finally:
        h.remove()
    del gsm
    gc.collect()
    assert not _witnesses()
    assert not torch_module._global_forward_hooks


def test_the_witness_goes_at_the_end_of_the_forward_pass_without_other_global_hooks():
    x, _ = _xy()
    gsm = GradSampleModule(_mlp(), loss_reduction="sum")
    handles = []

    def once(m, i, o):  # a global hook that removes itself during the forward pass
        handles[0].remove()

    handles.append(torch_module.register_module_forward_hook(once))
    try:
        gsm(x).sum().backward()
        assert not _witnesses()
    finally:
        handles[0].remove()
    assert gsm._module[0].weight.grad_sample.shape == (6, 5, 4)
