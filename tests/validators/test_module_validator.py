"""ModuleValidator: what it reports, what fix() produces, and the fixed model training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleModule
from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from dptorch.validators import (
    IllegalModuleConfigurationError,
    ModuleValidator,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    UnsupportedModuleError,
    register_module_fixer,
    register_module_validator,
)
from dptorch.validators.batch_norm import default_num_groups


def test_validate_lists_every_problem_with_paths():
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.Sequential(nn.BatchNorm2d(6), nn.InstanceNorm2d(6, track_running_stats=True)),
    )
    errors = ModuleValidator.validate(model)
    assert [type(e) for e in errors] == [ShouldReplaceModuleError, IllegalModuleConfigurationError]
    assert str(errors[0]).startswith("1.0 (BatchNorm2d)")
    assert str(errors[1]).startswith("1.1 (InstanceNorm2d)")
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(UnsupportedModuleError, match=r"(?s)1\.0 \(BatchNorm2d\).*1\.1"):
        ModuleValidator.validate(model, strict=True)
    assert ModuleValidator.validate(nn.Linear(2, 2), strict=True) == []


def test_recurrent_and_attention_flagged_only_when_trainable():
    model = nn.ModuleDict(
        {"lstm": nn.LSTM(2, 3), "gru": nn.GRU(2, 3), "rnn": nn.RNN(2, 3), "mha": nn.MultiheadAttention(4, 2)}
    )
    paths = sorted(str(e).split(" ")[0] for e in ModuleValidator.validate(model))
    assert paths == ["gru", "lstm", "mha", "rnn"]
    model.requires_grad_(False)
    assert ModuleValidator.validate(model) == []
    assert ModuleValidator.fix(model)["lstm"].__class__ is nn.LSTM  # nothing to fix


def test_shared_per_sample_gradient_rules():
    class MyBN(nn.BatchNorm1d):  # a subclass: no registered rule, caught by the shared check
        pass

    class Buffered(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x):
            return x * self.w

    errors = ModuleValidator.validate(nn.Sequential(MyBN(4), Buffered()))
    assert [type(e) for e in errors] == [ShouldReplaceModuleError, UnsupportableModuleError]
    assert "0 (MyBN)" in str(errors[0]) and "1 (Buffered)" in str(errors[1])
    # GradSampleModule keeps reporting BatchNorm as NotImplementedError naming path and fix
    with pytest.raises(NotImplementedError, match=r"(?s)0 \(MyBN\).*ModuleValidator.fix"):
        GradSampleModule(nn.Sequential(MyBN(4)), strict=True)


@pytest.mark.parametrize(
    "bn, groups",
    [(nn.BatchNorm2d(48), 24), (nn.BatchNorm2d(64), 32), (nn.BatchNorm2d(7), 7), (nn.BatchNorm3d(6), 6), (nn.BatchNorm1d(6), 3), (nn.BatchNorm1d(7), 1)],
)
def test_batchnorm_group_rule(bn, groups):
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
    gn = ModuleValidator.fix(bn)
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == groups
    assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
    assert gn.weight.requires_grad


def test_default_num_groups_brute_force():
    for c in range(1, 200):
        want = max(g for g in range(1, 33) if c % g == 0)
        assert default_num_groups(c) == want


def test_fix_num_groups_options_and_errors():
    model = nn.Sequential(nn.Conv2d(3, 12, 1), nn.BatchNorm2d(12))
    assert ModuleValidator.fix(model, num_groups=3)[1].num_groups == 3
    assert ModuleValidator.fix(model, num_groups=lambda c: c // 6)[1].num_groups == 2
    with pytest.raises(ValueError, match=r"1 .*num_groups=5 does not divide num_features=12"):
        ModuleValidator.fix(model, num_groups=5)
    inorm = ModuleValidator.fix(model, replace_bn_with_in=True)[1]
    assert isinstance(inorm, nn.InstanceNorm2d) and not inorm.track_running_stats
    assert isinstance(model[1], nn.BatchNorm2d)  # the original is untouched


def test_instance_norm_fix_keeps_function():
    inorm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    with torch.no_grad():
        inorm.weight.normal_()
    fixed = ModuleValidator.fix(inorm)
    assert not fixed.track_running_stats
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(fixed(x), inorm(x))


def test_fix_recurrent_and_attention_same_function():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True, proj_size=2)
    lstm.weight_hh_l0.requires_grad_(False)
    fixed = ModuleValidator.fix(lstm)
    assert isinstance(fixed, DPLSTM) and fixed.proj_size == 2
    assert not fixed.weight_hh_l0.requires_grad and fixed.weight_ih_l0.requires_grad
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(fixed(x)[0], lstm(x)[0], atol=1e-5, rtol=1e-5)
    rnn = nn.RNN(3, 4, nonlinearity="relu")
    fixed_rnn = ModuleValidator.fix(rnn)
    assert isinstance(fixed_rnn, DPRNN) and fixed_rnn.nonlinearity == "relu"
    torch.testing.assert_close(fixed_rnn(x)[0], rnn(x)[0], atol=1e-5, rtol=1e-5)
    mha = nn.MultiheadAttention(6, 2, kdim=4, vdim=5, add_bias_kv=True, batch_first=True)
    fixed_mha = ModuleValidator.fix(mha)
    assert isinstance(fixed_mha, DPMultiheadAttention)
    q, k, v = torch.randn(2, 3, 6), torch.randn(2, 4, 4), torch.randn(2, 4, 5)
    torch.testing.assert_close(fixed_mha(q, k, v)[0], mha(q, k, v)[0], atol=1e-5, rtol=1e-5)


def test_shared_submodule_replaced_once():
    gru = nn.GRU(2, 3)
    model = nn.ModuleList([gru, gru])
    fixed = ModuleValidator.fix(model)
    assert isinstance(fixed[0], DPGRU) and fixed[0] is fixed[1]


def test_register_user_rules():
    class Doubler(nn.Module):
        def forward(self, x):
            return 2 * x

    class Halver(nn.Module):
        def forward(self, x):
            return x / 2

    try:
        @register_module_validator(Doubler)
        def _validate(module):
            return [ShouldReplaceModuleError("doubling is not private; use Halver")]

        @register_module_fixer(Doubler)
        def _fix(module, **kwargs):
            return Halver()

        model = nn.Sequential(nn.Linear(2, 2), Doubler())
        (e,) = ModuleValidator.validate(model)
        assert str(e).startswith("1 (Doubler): doubling")
        fixed = ModuleValidator.fix_and_validate(model)
        assert isinstance(fixed[1], Halver)
    finally:
        ModuleValidator.VALIDATORS.pop(Doubler, None)
        ModuleValidator.FIXERS.pop(Doubler, None)


class Mixed(nn.Module):
    """Conv + BatchNorm2d image branch, LSTM + GRU + attention sequence branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True, bidirectional=True)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, img):  # img: (B, 1, 6, 6) -> sequence of 6 rows of 4 pooled channels
        x = torch.relu(self.bn(self.conv(img)))  # (B, 4, 6, 6)
        seq = x.mean(3).transpose(1, 2)  # (B, 6, 4)
        seq, _ = self.lstm(seq)
        seq, _ = self.gru(seq)  # (B, 6, 16)
        seq, _ = self.mha(seq, seq, seq)
        return self.fc(seq.mean(1))


def test_fix_makes_model_trainable_with_strict_grad_sample_module():
    torch.manual_seed(0)
    model = Mixed()
    with pytest.raises(NotImplementedError):
        GradSampleModule(model, strict=True)
    fixed = ModuleValidator.fix_and_validate(model)
    assert isinstance(fixed.bn, nn.GroupNorm) and fixed.bn.num_groups == 4
    assert isinstance(fixed.lstm, DPLSTM) and isinstance(fixed.gru, DPGRU)
    assert isinstance(fixed.mha, DPMultiheadAttention)
    gsm = GradSampleModule(fixed, strict=True)
    x = torch.randn(16, 1, 6, 6)
    y = (x[:, 0, :3].mean((1, 2)) > x[:, 0, 3:].mean((1, 2))).long()  # top half brighter?
    opt = torch.optim.Adam(gsm.parameters(), lr=0.005)
    losses = []
    for step in range(15):  # DP-SGD by hand: clip per-sample gradients to 5, average (no noise)
        opt.zero_grad()
        gsm.zero_grad()
        loss = nn.functional.cross_entropy(gsm(x), y)
        loss.backward()
        params = [p for p in gsm.parameters() if p.requires_grad]
        if step == 0:  # per-sample gradients average to the true gradient
            for p in params:
                torch.testing.assert_close(p.grad_sample.mean(0), p.grad, atol=1e-6, rtol=1e-4)
        norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params]).norm(dim=0)
        scale = (5.0 / (norms + 1e-6)).clamp(max=1.0)
        for p in params:
            assert p.grad_sample.shape == (16, *p.shape)
            p.grad = torch.einsum("b,b...->...", scale, p.grad_sample) / 16
        opt.step()
        losses.append(loss.item())
    assert min(losses[-3:]) < 0.8 * losses[0], losses
