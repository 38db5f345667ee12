"""Review (session 8): user hooks on sampled layers.

Invariant: with noise 0, SGD at lr 1 and a summed loss, the released update is
``Σ_b clip_C(g_b)`` where ``g_b`` is sample ``b``'s gradient of the model *as the user runs it*,
hooks included (brute force: each sample alone, float64), or the step raises a ``ValueError``
naming the layer, the reason and the fix.

Findings (each fails on the code before the fix):

* a forward hook that rescales a sampled layer's output, registered before wrapping (or after
  it with ``prepend=True``), ran before dptorch's capture hook, which took the gradient at the
  rescaled output while the grad samplers' formulas assume ``output = layer(input)``: hooks and
  bk wrong, ghost released up to 3·C for one sample;
* functorch mode recomputed the layer through ``functional_call``, i.e. with its hooks: a forward
  pre-hook ran a second time on the already pre-hooked inputs, and a forward hook registered
  after wrapping was part of the recompute while the gradient was taken before it;
* the same recompute gave ghost the norms of a layer without a grad sampler, and bk its clipped
  sum (``generic_clipped_sum``): a pre-hook on it released 2·C in ghost;
* a global forward hook (``register_module_forward_hook``) that rescales outputs runs before any
  module's own hook, so no ordering can fix it: now refused (observing global hooks still work);
* a gradient-scaling tensor hook registered on a layer's output during the forward pass ran
  after the capture's tensor hook (ghost released up to 5·C); the capture now runs after every
  tensor hook of the output (test_review_s8_hooks2.py), whenever it was registered;
* a ``forward`` replaced on the instance (accelerate's ``add_hook_to_module``) was ignored by the
  layer's rule (hooks, ghost wrong) and dropped by bk.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.modules.module as torch_module
from torch import nn

from dptorch.grad_sample import GradSampleModule

from .invariants import MODES, assert_exact_or_refused, dp_update, reference_update

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
C = 0.05
ALL_MODES = MODES + ["ew"]


def _xy(b=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, generator=g, dtype=DT) * 3, torch.randn(b, 3, generator=g, dtype=DT)


def _mlp():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


class Gate(nn.Module):
    """A layer without a grad sampler: torch.func (and bk's generic clipped sum) recompute it."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=DT))

    def forward(self, x):
        return x * self.w


class Block(nn.Module):
    """No grad sampler, a sampled child and an activation: their hooks are part of its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5).to(DT)
        self.s = nn.Parameter(torch.full((5,), 0.7, dtype=DT))
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.lin(x)) * self.s


def _mixed():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 5), Gate(5), Block(), nn.Linear(5, 3)).to(DT)


def scale_out(m, args, out):
    return out * 3 + 1


def scale_out_kw(m, args, kwargs, out):
    return out * 2 - 0.5


def scale_out_inplace(m, args, out):
    out.mul_(2)


def scale_in(m, args):
    return (args[0] * 2 - 1,)


def scale_in_kw(m, args, kwargs):
    return (args[0].tanh(),), kwargs


def _exact_or_refused(model, mode, x, y, *, after=None, must_work=False) -> str:
    """:func:`assert_exact_or_refused`, with ``after(model)`` registering hooks on the wrapped
    model (after wrapping, before the forward pass) and on the reference's copy alike."""
    if after is None:
        return assert_exact_or_refused(model, mode, x, y, C, must_work=must_work)
    try:
        got = dp_update(model, mode, x, y, C, before_backward=lambda m, opt, gsm: after(m))
    except ValueError as e:
        if must_work:
            raise
        assert str(e)
        return "refused"
    ref_model = copy.deepcopy(model)
    after(ref_model)
    ref = reference_update(ref_model, x, y, C)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-7, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")
    return "exact"


def _released_norm(model, mode, x, y, after=None) -> float:
    kw = {} if after is None else {"before_backward": lambda m, opt, gsm: after(m)}
    upd = dp_update(model, mode, x, y, C, **kw)
    return float(torch.sqrt(sum(u.pow(2).sum() for u in upd.values())))


# --------------------------------------------------------------------------- forward hooks
OUTPUT_HOOKS = {
    "plain": lambda m: m.register_forward_hook(scale_out),
    "with_kwargs": lambda m: m.register_forward_hook(scale_out_kw, with_kwargs=True),
    "inplace": lambda m: m.register_forward_hook(scale_out_inplace),
    "always_call": lambda m: m.register_forward_hook(scale_out, always_call=True),
    "prepend": lambda m: m.register_forward_hook(scale_out, prepend=True),
}


@pytest.mark.parametrize("kind", list(OUTPUT_HOOKS))
@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_output_hook_registered_before_wrapping_is_exact(mode, kind):
    """*Finding*: hooks/bk 33-70% wrong, ghost's clip factors from the wrong norms."""
    model = _mlp()
    OUTPUT_HOOKS[kind](model[0])
    OUTPUT_HOOKS[kind](model[2])
    x, y = _xy()
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"


@pytest.mark.parametrize("kind", list(OUTPUT_HOOKS))
@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_output_hook_registered_after_wrapping_is_exact(mode, kind):
    """*Finding*: with ``prepend=True`` the hook ran before the capture hook (hooks, ghost, bk
    wrong); without it, functorch's recompute included the hook (wrong)."""
    x, y = _xy()

    def after(m):
        OUTPUT_HOOKS[kind](m[0])
        OUTPUT_HOOKS[kind](m[2])

    assert _exact_or_refused(_mlp(), mode, x, y, after=after, must_work=True) == "exact"


@pytest.mark.parametrize("mode", MODES)
def test_finding_ghost_releases_at_most_c_for_one_sample_with_an_output_hook(mode):
    """*Finding*: ghost released 3·C for a single sample (its norm was taken at the rescaled
    output, a third of the truth, while autograd released the true gradient)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    model[0].register_forward_hook(lambda m, i, o: o * 3.0)
    x, y = _xy(b=1)
    assert _released_norm(model, mode, x, y * 3) <= C * (1 + 1e-6)


@pytest.mark.parametrize("where", ["gate", "block", "block.lin", "block.act"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("mode", MODES)
def test_finding_output_hook_on_layers_without_a_grad_sampler(mode, when, where):
    """A layer recomputed by torch.func (or bk's generic clipped sum): its own hooks must not
    run in the recompute, those of its submodules must (they are part of its forward)."""
    x, y = _xy()
    target = {"gate": "1", "block": "2", "block.lin": "2.lin", "block.act": "2.act"}[where]

    def add(m):
        m.get_submodule(target).register_forward_hook(scale_out)

    if when == "before":
        model = _mixed()
        add(model)
        assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"
    else:
        assert _exact_or_refused(_mixed(), mode, x, y, after=add, must_work=True) == "exact"


# --------------------------------------------------------------------------- forward pre-hooks
PRE_HOOKS = {
    "plain": lambda m: m.register_forward_pre_hook(scale_in),
    "with_kwargs": lambda m: m.register_forward_pre_hook(scale_in_kw, with_kwargs=True),
    "prepend": lambda m: m.register_forward_pre_hook(scale_in, prepend=True),
}


@pytest.mark.parametrize("kind", list(PRE_HOOKS))
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_pre_hook_is_exact(mode, when, kind):
    """*Finding*: functorch's recompute ran the pre-hook again on the captured (already
    pre-hooked) inputs: up to 55% wrong."""
    x, y = _xy()

    def add(m):
        PRE_HOOKS[kind](m[0])
        PRE_HOOKS[kind](m[2])

    if when == "before":
        model = _mlp()
        add(model)
        assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"
    else:
        assert _exact_or_refused(_mlp(), mode, x, y, after=add, must_work=True) == "exact"


@pytest.mark.parametrize("where", ["gate", "block", "block.act"])
@pytest.mark.parametrize("mode", MODES)
def test_finding_pre_hook_on_layers_without_a_grad_sampler(mode, where):
    """*Finding*: ghost released 2·C for one sample through a Gate with a pre-hook (its norm came
    from the twice pre-hooked recompute); bk's clipped sum of such a layer was recomputed the same
    way."""
    target = {"gate": "1", "block": "2", "block.act": "2.act"}[where]
    model = _mixed()
    model.get_submodule(target).register_forward_pre_hook(scale_in)
    x, y = _xy()
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"


@pytest.mark.parametrize("factor", [0.5, 2.0])
@pytest.mark.parametrize("mode", MODES)
def test_finding_one_sample_through_a_pre_hooked_gate_releases_at_most_c(mode, factor):
    torch.manual_seed(5)
    model = nn.Sequential(Gate(3)).to(DT)
    model[0].register_forward_pre_hook(lambda m, a: (a[0] * factor,))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 3, generator=g, dtype=DT) * 3, torch.randn(1, 3, generator=g, dtype=DT) * 3
    assert _released_norm(model, mode, x, y) <= C * (1 + 1e-6)
    x6, y6 = _xy()
    model6 = nn.Sequential(Gate(4), nn.Linear(4, 3)).to(DT)
    model6[0].register_forward_pre_hook(lambda m, a: (a[0] * factor - 0.3,))
    assert _exact_or_refused(model6, mode, x6, y6, must_work=True) == "exact"


# --------------------------------------------------------------------------- observers
@pytest.mark.parametrize("mode", ALL_MODES)
def test_observing_hooks_keep_working(mode):
    """Hooks that only look (logging, Hugging Face's ``enable_input_require_grads``, which calls
    ``output.requires_grad_()``) run, and the step is exact."""
    seen = []
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape), prepend=True)
    model[2].register_forward_hook(lambda m, i, o: o.requires_grad_(True))
    x, y = _xy()
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"
    assert seen


@pytest.mark.parametrize("mode", MODES)
def test_full_backward_hooks_on_a_recomputed_layer(mode):
    """torch.func's recompute no longer runs the layer's own backward hooks (its output gradient
    was taken after them), so functorch mode handles them instead of refusing."""
    model = _mixed()
    model[1].register_full_backward_pre_hook(lambda m, go: (go[0] * 5,))
    model[3].register_full_backward_hook(lambda m, gi, go: (gi[0] * 5,))
    x, y = _xy()
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"


# --------------------------------------------------------------------------- replaced forward
def _accelerate_hook(scale: bool):
    accelerate_hooks = pytest.importorskip("accelerate.hooks")

    class Hook(accelerate_hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Hook.calls += 1
            return args, kwargs

        def post_forward(self, module, output):
            return output * 3 + 1 if scale else output

    return Hook(), accelerate_hooks.add_hook_to_module


@pytest.mark.parametrize("scale", [True, False], ids=["rescaling", "observing"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_accelerate_hook_on_a_sampled_layer(mode, scale):
    """*Finding*: accelerate's hooks replace the instance's ``forward``; the layer's rule
    describes its class's forward, so a rescaling ``post_forward`` made hooks and ghost wrong,
    and bk replaced the replacement by its own forward (the hook silently dropped). A layer
    whose forward was replaced on the instance is now handled by ``torch.func`` (exact), and bk
    leaves it in place."""
    hook, add = _accelerate_hook(scale)
    model = _mlp()
    add(model[0], hook)
    x, y = _xy()
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_forward_assigned_on_the_instance(mode):
    import types

    model = _mlp()
    model[2].forward = types.MethodType(lambda self, h: nn.Linear.forward(self, h) * 2, model[2])
    x, y = _xy()
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"


def test_bk_keeps_an_accelerate_forward():
    from dptorch.grad_sample import GradSampleModuleBookKeeping

    hook, add = _accelerate_hook(False)
    model = _mlp()
    add(model[0], hook)
    replaced = model[0].forward
    gsm = GradSampleModuleBookKeeping(model, loss_reduction="sum")
    assert model[0].forward is replaced
    calls = type(hook).calls
    gsm(_xy()[0]).sum().backward()
    assert type(hook).calls > calls
    gsm.to_standard_module()
    assert model[0].forward is replaced


# --------------------------------------------------------------------------- tensor hooks
class _ScaledGrad(nn.Module):
    """The parent's forward registers a gradient-scaling tensor hook on a layer's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = nn.Linear(4, 5).to(DT), nn.Linear(5, 3).to(DT)

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 5)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_a_tensor_hook_on_a_layer_output_registered_in_forward(mode):
    """*Finding*: a tensor hook that the parent's forward (or a forward hook) registers on a
    layer's output changes the gradient the layer's backward receives, but it ran after the
    capture's own tensor hook, which took the gradient before it (ghost: norms 5x too small,
    released up to 5·C). The capture now runs after every tensor hook of the output."""
    x, y = _xy()
    assert _exact_or_refused(_ScaledGrad(), mode, x, y, must_work=True) == "exact"
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: o.register_hook(lambda g: g * 5) and None)
    assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_hook_registered_between_forward_and_backward_is_exact(mode):
    """A tensor hook that rescales the gradient of the model's output (a layer's output),
    registered after the forward pass, runs before the capture (a pre-hook of the output's
    autograd node; ghost's norm pass moves its tensor hooks last): exact, every per-sample
    gradient 5 times larger before clipping (second review: it was refused)."""
    from dptorch.grad_sample import wrap_model
    from dptorch.optimizers import get_optimizer_class
    from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = _mlp()
    x, y = _xy()
    ref_model = copy.deepcopy(model)
    cls = get_optimizer_class("flat", False, mode)
    opt = cls(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
              max_grad_norm=C, expected_batch_size=6, loss_reduction="sum")
    fast = mode in ("ghost", "bk")
    gsm = wrap_model(model, mode, loss_reduction="sum",
                     **({"clipping": opt.clipping} if fast else {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    out = gsm(x)
    out.register_hook(lambda g: g * 5)
    crit = nn.MSELoss(reduction="sum")
    if mode == "ghost":
        crit = DPLossFastGradientClipping(gsm, opt, crit, "sum")
    crit(out, y).backward()
    opt.step()
    # brute force: each sample's loss times 5 (the hook scales every parameter's gradient)
    named = list(ref_model.named_parameters())
    after = dict(model.named_parameters())
    for n, p in named:
        ref = torch.zeros_like(p)
        for b in range(6):
            loss = 5 * (ref_model(x[b:b + 1]) - y[b:b + 1]).pow(2).sum()
            grads = torch.autograd.grad(loss, [q for _, q in named])
            norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
            ref += min(1.0, C / (norm + 1e-6)) * grads[[m for m, _ in named].index(n)]
        torch.testing.assert_close(before[n] - after[n].detach(), ref, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- global hooks
@pytest.fixture
def global_hook():
    handles = []

    def register(fn, pre=False):
        reg = (torch_module.register_module_forward_pre_hook if pre
               else torch_module.register_module_forward_hook)
        handles.append(reg(fn))

    yield register
    for h in handles:
        h.remove()


def _linear_only(m, i, o):
    if isinstance(m, nn.Linear):
        return o * 1.5
    return None


def _linear_inplace(m, i, o):
    if isinstance(m, nn.Linear):
        o.mul_(2)


@pytest.mark.parametrize("fn", [_linear_only, _linear_inplace])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_global_output_hook_is_exact_or_refused(mode, fn, global_hook):
    """*Finding*: a global forward hook that rescales outputs runs before any module's own
    hooks: the capture hook took the gradient at its result (hooks, ghost, bk wrong). Now
    refused, naming the layer; ExpandedWeights is exact."""
    global_hook(fn)
    x, y = _xy()
    model = _mlp()
    if mode == "ew":
        assert _exact_or_refused(model, mode, x, y, must_work=True) == "exact"
        return
    with pytest.raises(ValueError, match=r"0 \(Linear\): a global forward hook .* replaced"):
        dp_update(model, mode, x, y, C)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_finding_global_pre_hook_is_exact(mode, global_hook):
    """*Finding*: functorch's recompute ran global pre-hooks a second time."""
    global_hook(lambda m, a: (a[0] * 0.5 + 0.1,) if isinstance(m, nn.Linear) else None, pre=True)
    x, y = _xy()
    assert _exact_or_refused(_mlp(), mode, x, y, must_work=True) == "exact"


@pytest.mark.parametrize("mode", MODES)
def test_observing_global_hook_keeps_working(mode, global_hook):
    calls = []
    global_hook(lambda m, i, o: calls.append(type(m).__name__))
    x, y = _xy()
    assert _exact_or_refused(_mixed(), mode, x, y, must_work=True) == "exact"
    assert "Linear" in calls


def test_the_global_witness_goes_away():
    """The check of global hooks installs a global hook of its own only while another is
    registered, and removes it with the hooks or when the other goes."""

    def witnesses():
        return [h for h in torch_module._global_forward_hooks.values()
                if type(h).__name__ == "_OutputWitness"]

    x, _ = _xy()
    gsm = GradSampleModule(_mlp(), loss_reduction="sum")
    gsm(x).sum().backward()
    assert not witnesses()
    h = torch_module.register_module_forward_hook(lambda m, i, o: None)
    try:
        gsm(x).sum().backward()
        assert len(witnesses()) == 1
        assert next(iter(torch_module._global_forward_hooks.values())) is witnesses()[0]
    finally:
        h.remove()
    nn.Linear(2, 2)(torch.randn(1, 2))  # the witness sees nothing left to watch
    assert not witnesses()
    h = torch_module.register_module_forward_hook(lambda m, i, o: None)
    try:
        gsm.zero_grad()
        gsm(x).sum().backward()
        assert len(witnesses()) == 1
        gsm.remove_hooks()
        assert not witnesses()
    finally:
        h.remove()


# --------------------------------------------------------------------------- ordering refusals
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_hook_that_runs_before_the_capture_hook_is_refused(mode):
    """A hook registered with ``prepend=True`` while the model runs (or before calling a layer
    outside the wrapped model's forward) still precedes the capture hook in that call: refused."""
    model = _mlp()
    x, y = _xy()

    def sneaky(m, a):  # on the model itself: runs after the wrapper ordered the hooks
        m[2].register_forward_hook(scale_out, prepend=True)

    model.register_forward_pre_hook(sneaky)
    with pytest.raises(ValueError, match=r"2 \(Linear\): a forward hook registered .*prepend=True"):
        dp_update(model, mode, x, y, C)


def test_a_layer_called_directly_with_a_prepended_hook_is_refused():
    model = _mlp()
    gsm = GradSampleModule(model, loss_reduction="sum")
    x, _ = _xy()
    gsm(x).sum().backward()
    gsm.zero_grad()
    model[0].register_forward_hook(scale_out, prepend=True)
    with pytest.raises(ValueError, match=r"0 \(Linear\): a forward hook registered"):
        model[0](x)
    gsm(x).sum().backward()  # the wrapped model's forward puts the capture hook first again
    assert model[0].weight.grad_sample.shape == (6, 5, 4)


def test_a_global_hook_added_before_a_direct_call_is_refused(global_hook):
    model = _mlp()
    gsm = GradSampleModule(model, loss_reduction="sum")
    x, _ = _xy()
    gsm(x).sum().backward()
    gsm.zero_grad()
    global_hook(lambda m, i, o: None)
    with pytest.raises(ValueError, match=r"0 \(Linear\): a global forward hook .* cannot check"):
        model[0](x)


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_in_place_attachment_is_exact(mode):
    """``wrap_model=False`` (hooks on the model itself): the same ordering."""
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine

    model = _mlp()
    model[0].register_forward_hook(scale_out)
    model[2].register_forward_pre_hook(scale_in)
    x, y = _xy()
    ref = reference_update(copy.deepcopy(model), x, y, C)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    dl = DataLoader(TensorDataset(x, y), batch_size=6)
    crit = nn.MSELoss(reduction="sum")
    kw = {"criterion": crit} if mode == "ghost" else {}
    res = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=dl, noise_multiplier=0.0, max_grad_norm=C,
        grad_sample_mode=mode, loss_reduction="sum", poisson_sampling=False, wrap_model=False,
        **kw,
    )
    opt = res[1]
    crit = res[2] if mode == "ghost" else crit
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- parameters in hooks
@pytest.mark.parametrize("mode", MODES)
def test_finding_a_parameter_used_in_a_hook(mode):
    """*Finding*: an output hook registered before wrapping that multiplies by the layer's own
    bias ran inside the hooked call, so the use trace accepted it, but the layer's formula does
    not cover it (hooks and ghost wrong). It now runs after the capture hook, where the trace
    sees a use outside the layer and refuses it, as it refuses a pre-hook computing from a
    parameter (old-style ``torch.nn.utils.weight_norm``)."""
    x, y = _xy()
    model = _mlp()
    model[2].register_forward_pre_hook(lambda m, a: (a[0] * m.bias.sum(),))
    assert _exact_or_refused(model, mode, x, y) in ("exact", "refused")
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: o * m.bias.sum())
    assert _exact_or_refused(model, mode, x, y) in ("exact", "refused")
