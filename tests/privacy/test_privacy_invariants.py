"""Privacy invariants, tried as an attacker would: every case x every mode either gives the exact
clipped sum (brute force, float64, noise 0) or refuses with ``ValueError``, never a number that
releases an unclipped or wrong gradient. Cases that real models hit must work, not be refused."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

from .invariants import (
    MODES,
    VARIANTS,
    assert_exact_or_refused,
    dp_update,
    reference_update,
    sample_loss,
    variant_bounds,
)

B, T, H = 4, 5, 6


@pytest.fixture(autouse=True)
def _float64():
    """Every case in float64 (exactness to 1e-7); the default is restored after each test."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _data(seed=0, shape=(B, 4), out=3, huge=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if huge:
        x[0] *= 50  # one sample with a huge gradient: clipped
    y = torch.randn(shape[0], out, generator=g)
    return x, y


class TiedFunctionalHead(nn.Module):
    """A registered layer's weight reused functionally (a tied head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 3)
        self.out = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        return self.out(h) + F.linear(h, self.out.weight)


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) / 2)

    def forward(self, x):
        y = x @ self.weight
        # computed from the weight beside the first output (one derived from the first output,
        # tanh(y), is exact: test_review_s8_grad2.py)
        return y, torch.tanh(x @ self.weight)


class UsesBothOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.two = TwoOutputs()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        a, b = self.two(x)
        return self.head(a + b)


class WeightWithoutCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x) + x @ self.layer.weight.t()


class PositionBroadcast(nn.Module):
    """Hugging Face's default forward: position ids of shape [1, T], broadcast over the batch."""

    def __init__(self, vocab=7):
        super().__init__()
        self.tok = nn.Embedding(vocab, H)
        self.pos = nn.Embedding(T, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, 3)

    def forward(self, ids):
        pos_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        h = self.norm(self.tok(ids) + self.pos(pos_ids))
        return self.head(torch.tanh(h)).mean(1)


class RelativeBias(nn.Module):
    """T5's relative attention bias: an Embedding over a [T, T] bucket index."""

    def __init__(self, n_buckets=2 * T):
        super().__init__()
        self.inp = nn.Linear(4, H)
        self.rel = nn.Embedding(n_buckets, 1)
        self.head = nn.Linear(H, 3)

    def forward(self, x):  # x: [B, T', 4]
        t = x.shape[1]
        q = torch.arange(t)
        bucket = (q[None, :] - q[:, None]) + t
        h = self.inp(x)
        scores = h @ h.transpose(1, 2) + self.rel(bucket).squeeze(-1)
        return self.head(torch.softmax(scores, -1) @ h).mean(1)


class ExpandedThenFlattened(nn.Module):
    """Swin-v2-like: a layer on a batch-independent [1, N, 2] table whose output is flattened
    and gathered before it meets the batch: expanding it to the batch would credit every
    sample's gradient to the first rows."""

    def __init__(self):
        super().__init__()
        self.cpb = nn.Linear(2, 2)
        self.register_buffer("table", torch.randn(1, 4, 2))
        self.register_buffer("index", torch.tensor([0, 3, 1, 2]))
        self.head = nn.Linear(4 * 2, 3)

    def forward(self, x):  # x [B, 8]
        bias = self.cpb(self.table).reshape(-1, 2)[self.index]  # [4, 2]
        return self.head(x * bias.flatten())


class ParentOwnsChildBias(nn.Module):
    """BERT's MLM head: ``bias`` registered in the head and in its ``decoder``."""

    def __init__(self):
        super().__init__()
        self.transform = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 3)
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(torch.tanh(self.transform(x)))


def mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("mode", VARIANTS)
@pytest.mark.parametrize(
    "make", [TiedFunctionalHead, UsesBothOutputs, WeightWithoutCall], ids=lambda f: f.__name__
)
def test_contributions_no_hook_saw_are_refused(make, mode):
    torch.manual_seed(0)
    x, y = _data()
    model = make()
    bounds = variant_bounds(model, mode, 1.0)
    assert assert_exact_or_refused(model, mode, x, y, bounds) == "refused"


@pytest.mark.parametrize("mode", VARIANTS)
def test_hf_position_ids_broadcast_is_exact(mode):
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (B, T))
    y = torch.randn(B, 3)
    model = PositionBroadcast()
    bounds = variant_bounds(model, mode, 0.3)
    assert_exact_or_refused(model, mode, ids, y, bounds, must_work=True)


@pytest.mark.parametrize("mode", VARIANTS)
def test_expanded_output_that_loses_its_batch_axis_is_refused(mode):
    torch.manual_seed(0)
    x, y = _data(shape=(B, 8))
    model = ExpandedThenFlattened()
    bounds = variant_bounds(model, mode, 1.0)
    assert assert_exact_or_refused(model, mode, x, y, bounds) == "refused"


@pytest.mark.parametrize("mode", VARIANTS)
@pytest.mark.parametrize("t", [T, B], ids=["T!=B", "T==B"])
def test_batch_independent_index_is_refused(mode, t):
    torch.manual_seed(0)
    x, y = _data(shape=(B, t, 4))
    model = RelativeBias()
    bounds = variant_bounds(model, mode, 1.0)
    assert assert_exact_or_refused(model, mode, x, y, bounds) == "refused"


@pytest.mark.parametrize("mode", VARIANTS)
def test_parameter_owned_by_parent_and_child_counts_once(mode):
    torch.manual_seed(0)
    x, y = _data()
    model = ParentOwnsChildBias()
    bounds = variant_bounds(model, mode, 0.4)
    assert_exact_or_refused(model, mode, x, y, bounds, must_work=True)


@pytest.mark.parametrize("mode", VARIANTS)
def test_wrong_batch_first_is_refused(mode):
    torch.manual_seed(0)

    class PoolOverTime(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 5)
            self.b = nn.Linear(5, 3)

        def forward(self, x):  # x: [T, B, 4], but the wrapper is told batch_first=True
            return self.b(torch.tanh(self.a(x)).mean(0))

    x = torch.randn(T, B, 4)
    y = torch.randn(B, 3)
    model = PoolOverTime()
    with pytest.raises(ValueError, match="rows"):
        dp_update(model, mode, x, y, variant_bounds(model, mode, 1.0))


@pytest.mark.parametrize("mode", VARIANTS)
def test_unfrozen_after_wrapping_is_hooked_or_refused(mode):
    per_layer = mode.endswith("per_layer")
    torch.manual_seed(0)
    x, y = _data()
    model = mlp()
    model[0].weight.requires_grad_(False)

    def unfreeze(m, opt, gsm):
        m[0].weight.requires_grad_(True)

    bounds = [0.5] * 3 if per_layer else 0.5
    try:
        got = dp_update(model, mode, x, y, bounds, before_backward=unfreeze)
    except ValueError:
        assert per_layer, "a flat contract covers every parameter: unfreezing must just work"
        return
    ref_model = copy.deepcopy(model)
    ref_model[0].weight.requires_grad_(True)
    ref = reference_update(ref_model, x, y, 0.5)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r)


@pytest.mark.parametrize("mode", VARIANTS)
def test_clip_bound_changed_after_make_private_is_used(mode):
    torch.manual_seed(0)
    x, y = _data()
    model = mlp()

    def change(m, opt, gsm):
        opt.max_grad_norm = 0.1 * opt.max_grad_norm  # e.g. a grad-clip scheduler

    got = dp_update(model, mode, x, y, variant_bounds(model, mode, 1.0), before_backward=change)
    ref = reference_update(model, x, y, variant_bounds(model, mode, 0.1))
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r)


@pytest.mark.parametrize("mode", MODES)
def test_clip_bound_changed_between_backward_and_step(mode):
    torch.manual_seed(0)
    x, y = _data()

    def change(m, opt, gsm):
        opt.max_grad_norm = 0.1

    if mode in ("ghost", "bk"):  # they clipped in backward with C=1: refused, not re-noised
        with pytest.raises(ValueError, match="changed from 1 to 0.1"):
            dp_update(mlp(), mode, x, y, 1.0, between=change)
        return
    model = mlp()
    got = dp_update(model, mode, x, y, 1.0, between=change)  # the optimizer clips at step
    ref = reference_update(model, x, y, 0.1)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r)


@pytest.mark.parametrize(
    "case",
    ["tied_functional", "two_outputs", "weight_without_call", "parent_bias", "relative_T!=B",
     "relative_T==B", "positions"],
)
def test_expanded_weights_exact_or_refused(case):
    """ExpandedWeights differentiates every use of an expanded parameter itself: functional
    uses are exact where torch has a rule and refused where not; a call on position ids of
    shape [1, T] is exact (dptorch expands them to the batch); other batch-independent calls
    are refused by the structure check, even at T == B."""
    torch.manual_seed(0)
    x, y = _data()
    model = {"tied_functional": TiedFunctionalHead, "two_outputs": UsesBothOutputs,
             "weight_without_call": WeightWithoutCall, "parent_bias": ParentOwnsChildBias}.get(case)
    if case.startswith("relative"):
        model = RelativeBias
        x, y = _data(shape=(B, T if case.endswith("!=B") else B, 4))
    if case == "positions":
        model = PositionBroadcast
        x, y = torch.randint(0, 7, (B, T)), torch.randn(B, 3)
    model = model()
    try:
        got = dp_update(model, "ew", x, y, 0.5)
    except (ValueError, NotImplementedError) as e:
        assert case not in ("parent_bias", "tied_functional", "positions"), e
        return
    assert case in ("parent_bias", "tied_functional", "positions")
    ref = reference_update(model, x, y, 0.5)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_flattened_token_output_is_not_refused(mode):
    """A model returning one row per token ([B*T]) has output rows != input rows: the rows of the
    per-sample results are then only required to agree with each other (no false refusal)."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2), nn.Flatten(0, 1))
    gsm = wrap_model(model, mode, loss_reduction="sum",
                     **({"max_grad_norm": 1.0} if mode != "hooks" else {}))
    x = torch.randn(B, T, 4)
    out = gsm(x)
    assert out.shape == (B * T, 2)
    if mode == "ghost":
        gsm.norm_backward(out.pow(2).sum())
        assert gsm.per_sample_gradient_norms.shape == (B,)
    else:
        out.pow(2).sum().backward()
        assert gsm.record.passes[-1].batch_size == B


def test_bk_refuses_a_parameter_term_in_the_loss():
    """bk computes no autograd weight gradient for Linear: any that arrives (here from a weight
    penalty in the loss) is a contribution no per-sample hook saw."""
    model = mlp()
    x, y = _data()
    gsm = wrap_model(model, "bk", loss_reduction="sum", max_grad_norm=1.0)
    loss = (gsm(x) - y).pow(2).sum() + model[0].weight.pow(2).sum()
    with pytest.raises(ValueError, match="0.weight"):
        loss.backward()


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_fast_modes_share_one_contract(mode):
    from dptorch import PrivacyEngine

    model = mlp()
    ds = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
    out = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(ds, batch_size=5), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode=mode,
    )
    gsm, opt = out[0], out[1]
    assert gsm.clipping is opt.clipping
    opt.max_grad_norm = 0.25
    assert gsm.max_grad_norm == 0.25
    assert opt.noise_std == pytest.approx(0.25)


def test_standalone_fast_module_with_another_bound_is_refused():
    """Opacus-style wiring without the loss wrapper: module and optimizer built with different
    C. The step record shows the bound the backward pass used; the step refuses it."""
    from dptorch.optimizers import get_optimizer_class

    model = mlp()
    gsm = wrap_model(model, "bk", loss_reduction="sum", max_grad_norm=1.0)
    opt = get_optimizer_class("flat", False, "bk")(
        torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=0.5,
        expected_batch_size=4, loss_reduction="sum",
    )
    gsm(torch.randn(4, 4)).sum().backward()
    with pytest.raises(ValueError, match="changed from 1 to 0.5"):
        opt.step()


def test_noise_follows_a_changed_bound():
    """Noise std = σ·C_new (measured), the bound the backward pass clipped with."""
    torch.manual_seed(0)
    model = nn.Linear(200, 50)
    from dptorch.optimizers import get_optimizer_class

    opt = get_optimizer_class("flat", False, "bk")(
        torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=2.0, max_grad_norm=1.0,
        expected_batch_size=4, loss_reduction="sum", generator=torch.Generator().manual_seed(1),
    )
    gsm = wrap_model(model, "bk", loss_reduction="sum", clipping=opt.clipping)
    opt.max_grad_norm = 0.05
    x = torch.zeros(4, 200)  # zero gradient: the update is the noise
    opt.zero_grad()
    gsm(x).sum().mul(0).backward()
    before = model.weight.detach().clone()
    opt.step()
    std = float((before - model.weight.detach()).std())
    assert std == pytest.approx(2.0 * 0.05, rel=0.1)


# --------------------------------------------------------------------------- property-based
@st.composite
def random_models(draw):
    """Small models from registry layers, with optional shared, tied and functional uses."""
    depth = draw(st.integers(1, 3))
    share = draw(st.booleans())
    functional = draw(st.booleans())
    parent_bias = draw(st.booleans())
    norm = draw(st.booleans())
    seed = draw(st.integers(0, 50))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.inp = nn.Linear(4, 5)
            self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(depth))
            self.norm = nn.LayerNorm(5) if norm else nn.Identity()
            self.out = nn.Linear(5, 3)
            if share and depth > 1:
                self.blocks[1].weight = self.blocks[0].weight  # tied between modules
            if parent_bias:
                self.bias = self.out.bias

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            for blk in self.blocks:
                h = torch.tanh(blk(h)) + h
            h = self.norm(h)
            y = self.out(h)
            if functional:
                y = y + F.linear(h, self.out.weight)
            return y

    return Model(), functional


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=8, deadline=None)
@given(case=random_models(), c=st.sampled_from([0.05, 0.5, 5.0]))
def test_random_models_exact_or_refused(mode, case, c):
    model, functional = case
    x, y = _data(seed=3)
    outcome = assert_exact_or_refused(model, mode, x, y, c)
    assert outcome == ("refused" if functional else "exact")


# --------------------------------------------------------------------------- review findings
class EyePositions(nn.Module):
    """A layer on ``torch.eye(T)`` (rows are positions, not samples) added over the batch."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, H)
        self.pos = nn.Linear(T, H)
        self.head = nn.Linear(H, 3)

    def forward(self, x):  # x [B, T, 4]
        h = self.inp(x) + self.pos(torch.eye(x.shape[1]))
        return self.head(torch.tanh(h)).mean(1)


class ConstantTypeIds(nn.Module):
    """Hugging Face's ``token_type_ids = torch.zeros(input_shape)``: B identical rows."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(7, H)
        self.typ = nn.Embedding(2, H)
        self.head = nn.Linear(H, 3)

    def forward(self, ids):
        types = torch.zeros(ids.shape, dtype=torch.long)
        return self.head(torch.tanh(self.tok(ids) + self.typ(types))).mean(1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [B, T], ids=["B!=T", "B==T"])
def test_factory_rows_are_not_samples(mode, b):
    torch.manual_seed(0)
    x, y = _data(shape=(b, T, 4))
    assert assert_exact_or_refused(EyePositions(), mode, x, y, 1.0) == "refused"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [B, T], ids=["B!=T", "B==T"])
def test_constant_rows_are_exact(mode, b):
    torch.manual_seed(0)
    ids, y = torch.randint(0, 7, (b, T)), torch.randn(b, 3)
    assert_exact_or_refused(ConstantTypeIds(), mode, ids, y, 0.3, must_work=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_one_sample_first_forward_does_not_switch_the_trace_off(mode):
    torch.manual_seed(0)
    x, y = _data(shape=(B, B, 4))  # T == B: only the trace can tell
    model = RelativeBias()

    def dummy(m, opt, gsm):
        gsm(torch.zeros(1, B, 4))  # e.g. printing the output shape, in training mode

    with pytest.raises(ValueError, match="do not come from the batch"):
        dp_update(model, mode, x, y, 1.0, before_backward=dummy)


@pytest.mark.parametrize("mode", VARIANTS)
def test_frozen_between_backward_and_step_is_refused(mode):
    torch.manual_seed(0)
    x, y = _data()
    model = mlp()

    def freeze(m, opt, gsm):
        m[0].weight.requires_grad_(False)

    with pytest.raises(ValueError, match="frozen"):
        dp_update(model, mode, x, y, variant_bounds(model, mode, 1.0), between=freeze)


@pytest.mark.parametrize("mode", MODES)
def test_clip_bound_changed_within_a_logical_batch_is_refused(mode):
    from dptorch.optimizers import get_optimizer_class

    torch.manual_seed(0)
    model = mlp()
    opt = get_optimizer_class("flat", False, mode)(
        torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=10.0,
        expected_batch_size=2 * B, loss_reduction="sum",
    )
    gsm = wrap_model(model, mode, loss_reduction="sum",
                     **({"clipping": opt.clipping} if mode in ("ghost", "bk") else {}))
    crit = (DPLossFastGradientClipping(gsm, opt, nn.MSELoss(reduction="sum"), "sum")
            if mode == "ghost" else None)

    def physical_step(skip):
        x, y = _data(seed=int(skip))
        out = gsm(x)
        (crit(out, y) if crit else (out - y).pow(2).sum()).backward()
        opt.signal_skip_step(skip)
        opt.step()
        opt.zero_grad()

    physical_step(True)
    opt.max_grad_norm = 1.0  # a scheduler stepped inside the logical batch
    with pytest.raises(ValueError, match="within a logical batch"):
        physical_step(False)


@pytest.mark.parametrize("mode", ["ghost", "bk"])
@pytest.mark.parametrize("how", ["hooks_off_backward", "edit"])
def test_fast_modes_refuse_p_grad_written_outside_clipping(mode, how):
    torch.manual_seed(0)
    x, y = _data()

    def tamper(m, opt, gsm):
        if how == "edit":
            with torch.no_grad():
                m[0].weight.grad += 1.0
        else:
            gsm.disable_hooks()
            (gsm(x) - y).pow(2).sum().backward()
            gsm.enable_hooks()

    with pytest.raises(ValueError, match="changed after the last clipped backward pass"):
        dp_update(mlp(), mode, x, y, 1.0, between=tamper)


def test_checkpoint_of_another_clipping_kind_is_refused_before_loading(tmp_path):
    from dptorch import PrivacyEngine

    def engine(clipping):
        model = mlp()
        ds = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
        pe = PrivacyEngine(accountant="rdp")
        m, o, _ = pe.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(ds, batch_size=5), noise_multiplier=1.0,
            max_grad_norm=[1.0] * 4 if clipping == "per_layer" else 0.5, clipping=clipping,
        )
        return pe, m, o

    pe, m, o = engine("flat")
    pe.save_checkpoint(path=tmp_path / "c.pt", module=m, optimizer=o)
    pe2, m2, o2 = engine("per_layer")
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(ValueError, match="clipping is flat"):
        pe2.load_checkpoint(path=tmp_path / "c.pt", module=m2, optimizer=o2)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, before[k])


def test_ghost_empty_batch_with_an_elementwise_loss():
    """An empty Poisson batch through ghost's wrapper with MSELoss: noise is still released."""
    from dptorch.optimizers import get_optimizer_class

    model = mlp()
    opt = get_optimizer_class("flat", False, "ghost")(
        torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=4, loss_reduction="mean",
    )
    gsm = wrap_model(model, "ghost", loss_reduction="mean", clipping=opt.clipping)
    crit = DPLossFastGradientClipping(gsm, opt, nn.MSELoss(), "mean")
    before = model[0].weight.detach().clone()
    crit(gsm(torch.zeros(0, 4)), torch.zeros(0, 3)).backward()
    opt.step()
    assert not torch.equal(model[0].weight, before)


@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_unfrozen_after_make_private_without_zero_grad(mode, wrap):
    """The usual loop order: make_private, unfreeze a layer, forward/backward, step, with no
    zero_grad in between. The newly trainable parameters are clipped with the others and noised
    (it used to fail with an AttributeError on their missing summed_grad)."""
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine

    torch.manual_seed(0)
    x, y = _data()
    base = mlp()
    base[0].requires_grad_(False)
    model = copy.deepcopy(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)), noise_multiplier=0.0,
            max_grad_norm=0.5, poisson_sampling=False, loss_reduction="sum",
            grad_sample_mode=mode, wrap_model=wrap,
            **({"criterion": nn.MSELoss(reduction="sum")} if mode == "ghost" else {}),
        )
    model[0].requires_grad_(True)
    pred = (out[0] if wrap else model)(x)
    (out[2](pred, y) if mode == "ghost" else sample_loss(pred, y)).backward()
    out[1].step()
    ref_model = copy.deepcopy(base).requires_grad_(True)
    ref = reference_update(ref_model, x, y, 0.5)
    for n, r in ref.items():
        torch.testing.assert_close(before[n] - dict(model.named_parameters())[n].detach(), r)
