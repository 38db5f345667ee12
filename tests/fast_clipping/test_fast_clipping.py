"""End-to-end: the ghost and bk DP-SGD updates equal the flat-clipping update computed from
materialised per-sample gradients (hooks mode) with the same noise draw (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.layers import DPLSTM, DPMultiheadAttention
from dptorch.optimizers import get_optimizer_class
from dptorch.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

from .helpers import assert_same_params, dp_step, reference_norms

FAST = ["ghost", "bk", "bk-nowrap"]


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)


def _run(model, mode, crit, batches, **kw):
    wrapper = mode != "bk-nowrap"
    return dp_step(model, mode.replace("-nowrap", ""), crit, batches, wrapper=wrapper, **kw)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, 3, stride=2, groups=2)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x):
        x = torch.relu(self.gn(self.c1(x)))
        return self.fc(torch.relu(self.c2(x)).flatten(1))


class Transformer(nn.Module):
    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.attn = DPMultiheadAttention(d, 2, batch_first=True, add_bias_kv=True)
        self.rms = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        a = self.ln(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.rms(h))
        return self.head(h.mean(1))


class CharLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.lstm = DPLSTM(4, 5, batch_first=True)
        self.out = nn.Linear(5, 3)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.out(h[:, -1])


class Tied(nn.Module):
    """Embedding weight shared with the output projection (two calls per parameter)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 6)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.proj(self.emb(ids))).mean(1))


def _data(name, b=6):
    if name == "conv":
        return ConvNet(), torch.randn(b, 1, 6, 6), torch.randint(0, 3, (b,))
    if name == "transformer":
        return Transformer(), torch.randint(0, 11, (b, 5)), torch.randint(0, 3, (b,))
    if name == "lstm":
        return CharLSTM(), torch.randint(0, 7, (b, 4)), torch.randint(0, 3, (b,))
    if name == "tied":
        return Tied(), torch.randint(0, 6, (b, 3)), torch.randint(0, 6, (b,))
    raise KeyError(name)


MODELS = ["conv", "transformer", "lstm", "tied"]


@pytest.mark.parametrize("name", MODELS)
def test_norms_match_materialised(name):
    model, x, y = _data(name)
    crit = nn.CrossEntropyLoss()
    want = reference_norms(model, crit, x, y)
    for mode in ("ghost", "bk"):
        gsm = wrap_model(copy.deepcopy(model), mode, loss_reduction="sum")
        loss = nn.functional.cross_entropy(gsm(x), y, reduction="sum")
        gsm.norm_backward(loss) if mode == "ghost" else loss.backward()
        torch.testing.assert_close(gsm.per_sample_gradient_norms, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", FAST)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_update_matches_materialised(name, mode, reduction):
    model, x, y = _data(name)
    crit = nn.CrossEntropyLoss(reduction=reduction)
    ref, _ = dp_step(model, "hooks", crit, [(x, y)], C=0.3)
    out, _ = _run(model, mode, crit, [(x, y)], C=0.3)
    assert_same_params(ref, out)


@pytest.mark.parametrize("mode", FAST)
@pytest.mark.parametrize("skip_between", [True, False])
def test_accumulation_equals_logical_batch(mode, skip_between):
    """Physical batches (BatchMemoryManager-style skipped steps, or several backward passes)
    give the update of the logical batch; hooks mode is the reference for both."""
    model, x, y = _data("transformer", b=7)
    crit = nn.CrossEntropyLoss()
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    ref, _ = dp_step(model, "hooks", crit, batches, skip_between=skip_between, expected_batch_size=7)
    out, _ = _run(model, mode, crit, batches, skip_between=skip_between, expected_batch_size=7)
    assert_same_params(ref, out)
    if skip_between:  # BatchMemoryManager: equals one step on the whole logical batch
        whole, _ = _run(model, mode, crit, [(x, y)], expected_batch_size=7)
        assert_same_params(whole, out)


@pytest.mark.parametrize("mode", FAST)
def test_empty_batch(mode):
    model, x, y = _data("conv")
    crit = nn.CrossEntropyLoss()
    batches = [(x[:0], y[:0])]
    ref, _ = dp_step(model, "hooks", crit, batches, expected_batch_size=4)
    out, gsm = _run(model, mode, crit, batches, expected_batch_size=4)
    assert_same_params(ref, out)
    assert all(torch.isfinite(p).all() for p in out.parameters())


@pytest.mark.parametrize("mode", FAST)
def test_frozen_trainable_mix(mode):
    model, x, y = _data("transformer")
    for p in list(model.emb.parameters()) + list(model.attn.out_proj.parameters()):
        p.requires_grad_(False)
    model.mlp[0].bias.requires_grad_(False)
    crit = nn.CrossEntropyLoss()
    ref, _ = dp_step(model, "hooks", crit, [(x, y)])
    out, _ = _run(model, mode, crit, [(x, y)])
    assert_same_params(ref, out)


@pytest.mark.parametrize("mode", FAST)
def test_batch_second(mode):
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    x, y = torch.randn(4, 6, 3), torch.randn(4, 6, 2)  # (T, B, d)
    crit = nn.MSELoss(reduction="sum")

    class Crit(nn.Module):  # per-sample loss over the batch dimension 1
        reduction = "sum"

        def forward(self, out, target):
            err = (out - target).pow(2).sum((0, 2))
            return err if self.reduction == "none" else err.sum()

    del crit
    ref, _ = dp_step(model, "hooks", Crit(), [(x, y)], batch_first=False)
    out, _ = _run(model, mode, Crit(), [(x, y)], batch_first=False)
    assert_same_params(ref, out)


def test_per_layer_bk_matches_hooks():
    model, x, y = _data("conv")
    n = sum(1 for p in model.parameters() if p.requires_grad)
    C = [0.1 * (i + 1) for i in range(n)]
    crit = nn.CrossEntropyLoss()
    ref, _ = dp_step(model, "hooks", crit, [(x, y)], C=C, clipping="per_layer")
    out, _ = dp_step(model, "bk", crit, [(x, y)], C=C, clipping="per_layer", wrapper=False)
    assert_same_params(ref, out)


def test_bk_costs_no_autograd_weight_gradient():
    """The bk layers' parameters are not given autograd gradients: p.grad after backward is the
    clipped sum only (infinite C: the plain gradient of the loss)."""
    model, x, y = _data("conv")
    gsm = wrap_model(copy.deepcopy(model), "bk", max_grad_norm=1e12)
    nn.functional.cross_entropy(gsm(x), y).backward()
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(x), y).backward()
    for p, q in zip(gsm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad * 1.0, q.grad * len(y))
    gsm.to_standard_module()
    assert all("forward" not in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------- errors
def _opt(gsm, **kw):
    return DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=4, **kw,
    )


def test_ghost_plain_backward_refused():
    gsm = wrap_model(nn.Linear(3, 2), "ghost")
    opt = _opt(gsm)
    gsm(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ValueError, match="DPLossFastGradientClipping"):
        opt.step()


def test_step_without_new_backward_refused():
    gsm = wrap_model(nn.Linear(3, 2), "bk")
    opt = _opt(gsm)
    gsm(torch.randn(4, 3)).sum().backward()
    opt.step()
    with pytest.raises(ValueError):
        opt.step()


def test_unsupported_combinations():
    with pytest.raises(ValueError, match="Per-layer"):
        wrap_model(nn.Linear(3, 2), "ghost", max_grad_norm=[1.0, 1.0])
    with pytest.raises(ValueError, match="one clipping norm per parameter"):
        wrap_model(nn.Linear(3, 2), "bk", max_grad_norm=[1.0])
    with pytest.raises(ValueError):
        get_optimizer_class("per_layer", False, "ghost")
    gsm = wrap_model(nn.Linear(3, 2), "bk")
    with pytest.raises(ValueError, match="multi-pass"):
        _opt(gsm, accum_passes=False, num_private_passes=2)
    with pytest.raises(NotImplementedError):
        _opt(gsm).clip()
    crit = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(ValueError, match="loss_reduction"):
        DPLossFastGradientClipping(gsm, _opt(gsm), crit, "mean")


def test_loss_wrapper_arithmetic():
    gsm = wrap_model(nn.Linear(3, 2), "ghost")
    opt = _opt(gsm)
    crit = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss())
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    loss = crit(gsm(x), y)
    ref = nn.functional.cross_entropy(gsm(x), y)
    torch.testing.assert_close((2 * loss / 2 + 0).detach(), ref.detach())
    assert isinstance(loss.item(), float)
    with pytest.raises(TypeError):
        loss + torch.ones((), requires_grad=True)


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_make_private(mode):
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch.privacy_engine import PrivacyEngine

    ds = TensorDataset(torch.randn(32, 5), torch.randint(0, 3, (32,)))
    m = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    res = PrivacyEngine().make_private(
        module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode=mode, criterion=nn.CrossEntropyLoss(),
    )
    assert len(res) == (4 if mode == "ghost" else 3)
    gsm, opt = res[0], res[1]
    crit = res[2] if mode == "ghost" else nn.CrossEntropyLoss()
    for x, y in res[-1]:
        opt.zero_grad()
        crit(gsm(x), y).backward()
        opt.step()
    assert isinstance(opt, DPOptimizerFastGradientClipping)
