"""``wrap_model=False`` (Opacus 1.6): the hooks are attached to the user's model itself.

The model keeps its class and identity and is what the training loop calls; the object
``make_private`` returns first holds the hooks, the per-sample state and ``cleanup()``. Every
mode that can work from hooks gives bitwise the wrapped path's update (noise 0 and seeded
noise), which equals float64 brute force; the checks of the wrapped path (the use trace,
parameters unfrozen later) still apply; ew refuses.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import (
    GradSampleHooks,
    GradSampleHooksBookKeeping,
    GradSampleHooksFastGradientClipping,
    GradSampleModule,
)

MODES = ["hooks", "functorch", "ghost", "bk"]
C = 0.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.ln(self.fc1(x))))


class FunctionalReuse(Net):
    """fc2's weight also used functionally: no hook sees that use."""

    def forward(self, x):
        h = torch.tanh(self.ln(self.fc1(x)))
        return self.fc2(h) + F.linear(h, self.fc2.weight)


def _data(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(
        n, 3, generator=g, dtype=torch.float64
    )


def _step(base: nn.Module, mode: str, wrap: bool, sigma: float = 0.0, steps: int = 1):
    """``steps`` DP steps (SGD lr 1, loss sum, the whole data set as one batch); returns the
    parameter change, the model object called, and ``make_private``'s first return value."""
    net = copy.deepcopy(base)
    x, y = _data()
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0, fixed-size batches
        out = engine.make_private(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
            noise_multiplier=sigma, max_grad_norm=C, poisson_sampling=False,
            loss_reduction="sum", grad_sample_mode=mode, wrap_model=wrap,
            noise_generator=torch.Generator().manual_seed(7),
            **({"criterion": nn.MSELoss(reduction="sum")} if mode == "ghost" else {}),
        )
    model = out[0] if wrap else net
    opt = out[1]
    before = [p.detach().clone() for p in net.parameters()]
    for _ in range(steps):
        opt.zero_grad()
        pred = model(x)
        if mode == "ghost":
            out[2](pred, y).backward()
        else:
            (pred - y).pow(2).sum().backward()
        opt.step()
    delta = [b - p.detach() for b, p in zip(before, net.parameters())]
    return delta, net, out[0]


def _brute_force(base: nn.Module) -> list[torch.Tensor]:
    x, y = _data()
    params = list(base.parameters())
    total = [torch.zeros_like(p) for p in params]
    for b in range(len(x)):
        grads = torch.autograd.grad((base(x[b : b + 1]) - y[b : b + 1]).pow(2).sum(), params)
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        for t, g in zip(total, grads):
            t += min(1.0, C / (norm + 1e-6)) * g
    return total


@pytest.mark.parametrize("mode", MODES)
def test_in_place_equals_wrapped_and_brute_force(mode):
    torch.manual_seed(0)
    base = Net().double()
    got, net, hooks = _step(base, mode, wrap=False)
    want, _, _ = _step(base, mode, wrap=True)
    assert type(net) is Net and hooks._module is net
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, r in zip(got, _brute_force(base)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)
    # with noise, over several steps (the trace runs once, then the plain path)
    noisy_in_place, _, _ = _step(base, mode, wrap=False, sigma=1.0, steps=3)
    noisy_wrapped, _, _ = _step(base, mode, wrap=True, sigma=1.0, steps=3)
    for g, w in zip(noisy_in_place, noisy_wrapped):
        assert torch.equal(g, w)


@pytest.mark.parametrize("mode", MODES)
def test_checks_still_apply_in_place(mode):
    """A parameter used where no hook sees it is refused, exactly as when wrapped."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="fc2"):
        _step(FunctionalReuse().double(), mode, wrap=False)


def test_cleanup_leaves_a_plain_model():
    torch.manual_seed(0)
    net = Net().double()
    hooks = GradSampleHooks(net, loss_reduction="sum")
    x, y = _data()
    (net(x) - y).pow(2).sum().backward()
    assert all(p.grad_sample.shape[0] == len(x) for p in net.parameters())
    hooks.cleanup()
    net.zero_grad()
    (net(x) - y).pow(2).sum().backward()
    assert not any(hasattr(p, "grad_sample") for p in net.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


@pytest.mark.parametrize(
    "cls", [GradSampleHooks, GradSampleHooksFastGradientClipping, GradSampleHooksBookKeeping]
)
def test_hooks_classes_attach_in_place(cls):
    net = Net()
    hooks = cls(net)
    assert isinstance(hooks, GradSampleModule) and hooks._module is net
    assert net._forward_pre_hooks and net._forward_hooks


def test_ew_refuses_in_place():
    with pytest.raises(NotImplementedError, match="wrap_model=False"):
        _step(Net().double(), "ew", wrap=False)


def test_hugging_face_default_forward_in_place():
    """GPT-2 from a config, called as users call it (input_ids, default position ids), bk with
    the hooks on the model itself: bitwise the wrapped update."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (6, 8))
    labels = torch.randint(0, 50, (6, 8))
    results = []
    for wrap in (True, False):
        net = copy.deepcopy(base).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = PrivacyEngine().make_private(
                module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(ids, labels), batch_size=6),
                noise_multiplier=0.0, max_grad_norm=0.1, poisson_sampling=False,
                grad_sample_mode="bk", wrap_model=wrap,
            )
        model, opt = (out[0] if wrap else net), out[1]
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), reduction="none").view(6, 8).mean(1).mean().backward()
        opt.step()
        assert type(net) is transformers.GPT2LMHeadModel
        results.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, p) for a, p in zip(results[1], base.parameters()))


def test_get_hooks_class():
    from dptorch.grad_sample.gsm_no_op import GradSampleHooksNoOp
    from dptorch.grad_sample.utils import get_hooks_class

    assert get_hooks_class("hooks") is get_hooks_class("functorch") is GradSampleHooks
    assert get_hooks_class("ghost") is GradSampleHooksFastGradientClipping
    assert get_hooks_class("bk") is GradSampleHooksBookKeeping
    assert get_hooks_class("no_op") is GradSampleHooksNoOp
    with pytest.raises(ValueError, match="wrap the model"):
        get_hooks_class("ew")
