"""make_graphed_dp_step: the captured DP step is the eager one, never stale, always accounted.

The guard (:func:`step_signature`), the refusals, the deferred accountant hook and the static
padding mask are checked on the CPU, and so is the Python around capture and replay (skip
requests, failed captures, zero_grad between steps, the mask's refill), with torch.cuda's graph
API replaced by a stand-in (``fake_cuda``). Capture and replay need a GPU: those tests run where
CUDA is available (the device machine of benchmarks/README) and compare every graphed step with
the eager step, float64, after changes of C, σ, the learning rate and trainable parameters.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine, graphed_step
from dptorch.clipping import ClippingContract
from dptorch.grad_sample import wrap_model
from dptorch.graphed_step import make_graphed_dp_step, step_signature
from dptorch.optimizers import (
    AdaClipDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
)
from dptorch.utils.batch_layout import BatchLayout

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
N, D, K = 48, 5, 3


class _Text(nn.Module):
    """Embedding (with a padding row) + LayerNorm + Linear, on ids ``(B, 4)``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, D, padding_idx=0)
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, K)

    def forward(self, x):
        ids = (x.abs() * 3).long().clamp(max=8)[:, :4]
        return self.fc(torch.tanh(self.ln(self.emb(ids))).mean(1)) + self.fc(x[:, :D])


def _model(device="cpu") -> nn.Module:
    torch.manual_seed(1)
    return _Text().double().to(device)


def _dp(mode: str, device="cpu", sigma=0.0, momentum=0.0, **opt_kw):
    model = _model(device)
    kw = dict(noise_multiplier=sigma, max_grad_norm=0.7, expected_batch_size=8, **opt_kw)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    if mode in ("bk", "ghost"):
        gsm = wrap_model(model, mode, max_grad_norm=0.7)
        opt = DPOptimizerFastGradientClipping(sgd, **kw)
        gsm.bind_clipping(opt.clipping)
    else:
        gsm = wrap_model(model, mode)
        opt = DPOptimizer(sgd, **kw)
    return gsm, opt


def _batch(i: int, device="cpu"):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, D, generator=g, dtype=torch.float64)
    return x.to(device), torch.randint(0, K, (8,), generator=g).to(device)


# ---------------------------------------------------------------------------------- CPU
def test_signature_follows_everything_a_graph_bakes_in():
    gsm, opt = _dp("bk", momentum=0.9)
    x, y = _batch(0)
    F.cross_entropy(gsm(x), y).backward()
    opt.step()
    opt.zero_grad()
    base = step_signature(gsm, opt)
    F.cross_entropy(gsm(x), y).backward()
    opt.step()  # in-place updates of parameters and momentum keep every storage
    assert step_signature(gsm, opt) == base

    def changed(edit, undo):
        edit()
        try:
            return step_signature(gsm, opt) != base
        finally:
            undo()
            assert step_signature(gsm, opt) == base

    fc = gsm._module.fc
    buf = opt.state[fc.weight]["momentum_buffer"]
    data = fc.weight.data
    assert changed(lambda: setattr(opt, "max_grad_norm", 0.3),
                   lambda: setattr(opt, "max_grad_norm", 0.7))
    assert changed(lambda: setattr(opt, "noise_multiplier", 2.0),
                   lambda: setattr(opt, "noise_multiplier", 0.0))
    assert changed(lambda: setattr(opt, "expected_batch_size", 9),
                   lambda: setattr(opt, "expected_batch_size", 8))
    assert changed(lambda: opt.param_groups[0].__setitem__("lr", 0.1),
                   lambda: opt.param_groups[0].__setitem__("lr", 0.5))
    assert changed(lambda: fc.bias.requires_grad_(False), lambda: fc.bias.requires_grad_(True))
    assert changed(gsm.eval, gsm.train)
    assert changed(gsm.disable_hooks, gsm.enable_hooks)
    assert changed(lambda: setattr(fc.weight, "data", data.clone()),
                   lambda: setattr(fc.weight, "data", data))
    assert changed(lambda: opt.state[fc.weight].__setitem__("momentum_buffer", buf.clone()),
                   lambda: opt.state[fc.weight].__setitem__("momentum_buffer", buf))
    # with the caller's cached module list, a replaced layer is still seen
    mods = list(gsm.modules())
    assert step_signature(gsm, opt, mods) == base
    gsm._module.fc = nn.Linear(D, K).double()
    assert step_signature(gsm, opt, mods) != base
    gsm._module.fc = fc
    assert step_signature(gsm, opt, mods) == base


def test_per_layer_bounds_are_in_the_signature():
    model = _model()
    opt = DPPerLayerOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                              max_grad_norm=[1.0] * len(list(model.parameters())),
                              expected_batch_size=8)
    base = step_signature(model, opt)
    opt.clipping.max_grad_norms = [0.5] * len(list(model.parameters()))
    assert step_signature(model, opt) != base


@pytest.mark.parametrize("what", ["cpu", "secure", "generator", "adaclip", "warmup"])
def test_refused_before_training(what):
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8)
    if what == "secure":
        opt, match = DPOptimizer(sgd, secure_mode=True, **kw), "secure_mode"
    elif what == "generator":
        opt, match = DPOptimizer(sgd, generator=torch.Generator(), **kw), "generator"
    elif what == "adaclip":
        opt = AdaClipDPOptimizer(sgd, target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                                 max_clipbound=2.0, min_clipbound=0.1,
                                 unclipped_num_std=1.0, **kw)
        match = "AdaClipDPOptimizer is not supported"
    else:
        opt = DPOptimizer(sgd, **kw)
        match = "CUDA" if what == "cpu" else "warmup_steps"
    with pytest.raises(ValueError, match=match):
        make_graphed_dp_step(model, opt, lambda x: model(x).sum(),
                             warmup_steps=0 if what == "warmup" else 3)


def test_deferred_step_hooks_run_once_per_executed_step():
    gsm, opt = _dp("bk")
    seen = []
    opt.attach_step_hook(lambda o: seen.append(o.noise_multiplier))
    x, y = _batch(0)
    with opt.deferred_step_hooks():
        F.cross_entropy(gsm(x), y).backward()
        opt.step()
    assert seen == []
    opt.run_step_hooks()
    opt.zero_grad()
    F.cross_entropy(gsm(x), y).backward()
    opt.step()
    assert seen == [0.0, 0.0]


def test_held_layout_reads_its_buffer_at_use():
    """A captured graph reads the padding mask from the buffer: refilling the buffer changes
    which rows the clipping zeroes, with no new layout object."""
    contract = ClippingContract(1.0)
    buf = torch.empty(4, dtype=torch.bool)
    contract.layouts.current = BatchLayout.records(3, 4).held_in(buf)
    norms = torch.full((4,), 0.5)
    assert contract.flat_factors(norms).tolist() == [1.0, 1.0, 1.0, 0.0]
    buf.copy_(BatchLayout.records(1, 4).valid)
    assert contract.flat_factors(norms).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_deferred_step_hooks_end_with_an_exception():
    gsm, opt = _dp("bk")
    seen = []
    opt.attach_step_hook(lambda o: seen.append(1))
    with pytest.raises(RuntimeError), opt.deferred_step_hooks():
        raise RuntimeError("a failed capture")
    x, y = _batch(0)
    F.cross_entropy(gsm(x), y).backward()
    opt.step()
    assert seen == [1]


def test_signature_sees_the_wrapped_optimizers_groups_after_load_state_dict():
    """A learning rate loaded from a checkpoint (load_state_dict replaces the param_groups
    list) is a change."""
    gsm, opt = _dp("bk")
    base = step_signature(gsm, opt)
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.01
    opt.load_state_dict(state)
    assert step_signature(gsm, opt) != base


def test_signature_sees_buffers_and_parameters_outside_the_module():
    gsm, opt = _dp("bk")
    extra = nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    opt.add_param_group({"params": [extra]})
    gsm._module.ln.register_buffer("scale", torch.ones(D, dtype=torch.float64))
    base = step_signature(gsm, opt)
    extra.requires_grad_(True)
    assert step_signature(gsm, opt) != base
    extra.requires_grad_(False)
    assert step_signature(gsm, opt) == base
    gsm._module.ln.scale = torch.ones(D, dtype=torch.float64)  # a new storage
    assert step_signature(gsm, opt) != base


def test_batch_tensors_off_the_gpu_are_refused():
    graphed_step._check_batch([3, "mean", None])
    with pytest.raises(ValueError, match="on cpu"):
        graphed_step._check_batch([torch.zeros(2)])


# ------------------------------------------- CPU: the Python around capture and replay
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's graph API on the CPU, for the Python that surrounds capture and replay: a
    "capture" runs the step (a real one only records it, so a captured call here trains once,
    at capture) and a "replay" runs the callbacks of the returned list (a real one re-runs the
    recorded kernels, writing into the tensors the capture left)."""
    on_replay = []

    class Graph:
        def replay(self):
            for f in on_replay:
                f()

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(graphed_step, "_check_device", lambda module: None)
    monkeypatch.setattr(graphed_step, "_check_batch", lambda leaves: None)
    return on_replay


def _graphed(mode="bk", warmup_steps=1, **kw):
    gsm, opt = _dp(mode, **kw)
    events = []
    opt.attach_step_hook(lambda o: events.append(o.privacy_event(0.1)))
    step = make_graphed_dp_step(gsm, opt, lambda x, y: F.cross_entropy(gsm(x), y),
                                warmup_steps=warmup_steps)
    return gsm, opt, step, events


def test_hooks_run_once_per_step_and_never_at_capture(fake_cuda):
    gsm, opt, step, events = _graphed(warmup_steps=2)
    for i in range(6):
        step(*_batch(i))
        assert len(events) == i + 1
    assert step.captures == 1 and not opt._step_hooks_deferred


def test_a_step_is_charged_before_its_replay_releases_it(fake_cuda):
    """The accountant's hook runs before the replay: a replay that fails part-way (an
    interrupt) may have released the step's noisy gradient, so it must already be counted."""
    gsm, opt, step, events = _graphed()
    step(*_batch(0))
    step(*_batch(1))  # captured
    charged = []
    fake_cuda.append(lambda: charged.append(len(events)))
    step(*_batch(2))
    assert charged == [3]

    def interrupted():
        raise KeyboardInterrupt

    fake_cuda.append(interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(*_batch(3))
    assert len(events) == 4


def test_a_skip_request_is_refused_and_left_in_place(fake_cuda):
    """A replay cannot skip (signal_skip_step, BatchMemoryManager): refused, not replayed as a
    whole step."""
    gsm, opt, step, events = _graphed()
    step(*_batch(0))
    step(*_batch(1))  # captured
    opt.signal_skip_step(True)
    with pytest.raises(ValueError, match="skipped step"):
        step(*_batch(2))
    assert opt._step_skip_queue == [True] and len(events) == 2


def test_a_pending_logical_batch_is_never_captured(fake_cuda):
    """An eager warm-up step that was skipped leaves its clipped sum in p.summed_grad: a capture
    would add that tensor to the released gradient at every replay."""
    gsm, opt, step, events = _graphed()
    opt.signal_skip_step(True)
    opt.signal_skip_step(False)
    step(*_batch(0))  # eager, skipped: only clipped and summed
    assert opt.last_step_skipped
    with pytest.raises(ValueError, match="skipped step"):
        step(*_batch(1))
    assert step.captures == 0 and events == []


def test_replays_consume_do_not_skip_signals(fake_cuda):
    gsm, opt, step, events = _graphed()
    for i in range(4):
        opt.signal_skip_step(False)  # a logical batch of one physical batch
        step(*_batch(i))
    assert opt._step_skip_queue == [] and len(events) == 4 and step.captures == 1


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_between_graphed_steps_keeps_the_accounting(fake_cuda, set_to_none):
    """A user's zero_grad() between graphed steps drops p.grad_sample; the replay then writes
    the released gradient into p.grad, and without the captured tensors put back the
    accountant's hook refused the (already executed) step."""
    gsm, opt, step, events = _graphed("hooks", sigma=1.0)
    fake_cuda.append(lambda: [p.grad.fill_(1.0) for p in opt.params if p.grad is not None])
    for i in range(4):
        opt.zero_grad(set_to_none=set_to_none)
        step(*_batch(i))
    assert len(events) == 4 and all(e == events[0] for e in events)
    assert all(p.grad is not None and p.grad_sample is not None for p in opt.params)


def test_a_failed_capture_is_captured_again(fake_cuda):
    gsm, opt = _dp("bk")
    fail = [False]

    def loss_fn(x, y):
        if fail[0]:
            raise RuntimeError("boom")
        return F.cross_entropy(gsm(x), y)

    seen = []
    opt.attach_step_hook(lambda o: seen.append(1))
    step = make_graphed_dp_step(gsm, opt, loss_fn, warmup_steps=1)
    step(*_batch(0))
    step(*_batch(1))
    opt.max_grad_norm, fail[0] = 0.3, True
    with pytest.raises(RuntimeError, match="boom"):
        step(*_batch(2))
    assert all(p.grad is None for p in opt.params)  # nothing a capture never computed is kept
    opt.max_grad_norm, fail[0] = 0.7, False  # the key of the first capture again
    step(*_batch(3))
    assert step.captures == 2 and len(seen) == 3 and not opt._step_hooks_deferred


@pytest.mark.parametrize("what", ["generator", "secure_mode"])
def test_noise_source_changed_after_wrapping_is_refused_at_capture(fake_cuda, what):
    gsm, opt, step, events = _graphed(sigma=1.0)
    step(*_batch(0))
    step(*_batch(1))
    setattr(opt, what, torch.Generator() if what == "generator" else True)
    with pytest.raises(ValueError, match=what):
        step(*_batch(2))
    assert len(events) == 2


def test_padding_mask_follows_each_batch_layout(fake_cuda):
    """The loader activates a layout per batch: the capture installs the static mask, each
    replay refills it; a batch without layout is captured again; a user-level one refused."""
    gsm, opt, step, events = _graphed()
    layouts = opt.clipping.layouts
    layouts.current = BatchLayout.records(5, 8)
    step(*_batch(0))
    layouts.current = BatchLayout.records(3, 8)
    step(*_batch(1))  # captured
    assert layouts.current.valid is step._valid
    assert step._valid.tolist() == [True] * 3 + [False] * 5
    layouts.current = BatchLayout.records(6, 8)
    step(*_batch(2))  # replayed
    assert step._valid.tolist() == [True] * 6 + [False] * 2 and step.captures == 1
    layouts.current = None
    step(*_batch(3))
    assert step.captures == 2
    layouts.current = BatchLayout(torch.tensor([0, 0, 1, 2, 3, 4, 5, -1]), 6)
    with pytest.raises(ValueError, match="user-level"):
        step(*_batch(4))
    assert len(events) == 4


# ---------------------------------------------------------------------------------- GPU
def _loss_fn(mode, gsm, opt):
    if mode != "ghost":
        return lambda x, y: F.cross_entropy(gsm(x), y)
    from dptorch.grad_sample.fast_clipping_loss import DPLossFastGradientClipping

    wrapper = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss())
    return lambda x, y: wrapper(gsm(x), y)


@cuda
@pytest.mark.parametrize("mode", ["bk", "ghost", "hooks"])
def test_graphed_steps_equal_eager_steps_through_changes(mode):
    """Eager and graphed training from the same weights and batches, σ = 0, float64: equal
    after every step, also after C, the learning rate and a layer's trainability change (each
    a new capture), and the accountant hook ran once per step."""
    dev = "cuda"
    (ge, oe), (gg, og) = _dp(mode, dev, momentum=0.5), _dp(mode, dev, momentum=0.5)
    counts = {"eager": 0, "graph": 0}
    oe.attach_step_hook(lambda o: counts.__setitem__("eager", counts["eager"] + 1))
    og.attach_step_hook(lambda o: counts.__setitem__("graph", counts["graph"] + 1))
    eager_loss = _loss_fn(mode, ge, oe)
    step = make_graphed_dp_step(gg, og, _loss_fn(mode, gg, og), warmup_steps=2)
    for i in range(12):
        for o, g in ((oe, ge), (og, gg)):
            if i == 6:
                o.max_grad_norm = 0.2
                o.param_groups[0]["lr"] = 0.25
            if i == 9:
                g._module.ln.weight.requires_grad_(False)
                g._module.ln.bias.requires_grad_(False)
        x, y = _batch(i, dev)
        oe.zero_grad(set_to_none=True)
        eager_loss(x, y).backward()
        oe.step()
        loss = step(x, y)
        assert torch.isfinite(loss)
        for pe, pg in zip(ge.parameters(), gg.parameters()):
            torch.testing.assert_close(pg, pe, rtol=1e-10, atol=1e-12)
    assert counts == {"eager": 12, "graph": 12}
    assert step.captures == 3  # step 2, C and lr at step 6, trainability at step 9


@cuda
def test_replays_draw_fresh_noise_of_the_right_scale():
    gsm, opt = _dp("bk", "cuda", sigma=1.0)
    step = make_graphed_dp_step(gsm, opt, lambda x, y: F.cross_entropy(gsm(x), y),
                                warmup_steps=1)
    x, y = _batch(0, "cuda")
    step(x, y)
    p0 = [p.detach().clone() for p in gsm.parameters()]
    updates = []
    for _ in range(2):
        with torch.no_grad():
            for p, s in zip(gsm.parameters(), p0):
                p.copy_(s)
        step(x, y)
        updates.append(torch.cat([(p - s).flatten() for p, s in zip(gsm.parameters(), p0)]))
    diff = updates[0] - updates[1]
    expected = 0.5 * 1.0 * 0.7 * 2 ** 0.5 / 8  # lr · σ · C · √2 / B
    assert diff.abs().min() > 0
    assert abs(diff.std().item() / expected - 1) < 0.5  # few coordinates: a loose band


@cuda
@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_fixed_shape_loader_graphed_equals_eager_and_epsilon(mode):
    """make_private with fixed-shape Poisson batches: the padding rows reach the graph through
    the static mask (parameters equal to eager training), and the accountant holds the eager
    run's history (σ = 0 here, so compared as events rather than as ε)."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(N, D, generator=g, dtype=torch.float64),
                       torch.randint(0, K, (N,), generator=g))
    runs = []
    for graphed in (False, True):
        model = _model("cuda")
        engine = PrivacyEngine(accountant="rdp")
        module, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(ds, batch_size=8, generator=torch.Generator().manual_seed(3)),
            noise_multiplier=0.0, max_grad_norm=0.5, grad_sample_mode=mode,
            poisson_sampling="fixed_shape", max_batch_size=16)
        step = make_graphed_dp_step(
            module, opt, lambda x, y, m=module: F.cross_entropy(m(x), y), warmup_steps=1
        ) if graphed else None
        for _ in range(2):
            for x, y in loader:
                x, y = x.cuda(), y.cuda()
                if step is None:
                    opt.zero_grad()
                    F.cross_entropy(module(x), y).backward()
                    opt.step()
                else:
                    step(x, y)
        runs.append(([p.detach().clone() for p in module.parameters()],
                     len(engine.accountant), list(engine.accountant.history)))
    (pe, ne, hist_e), (pg, ng, hist_g) = runs
    assert ne == ng > 0
    assert hist_g == hist_e
    for a, b in zip(pe, pg):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@cuda
def test_tiny_gpt2_graphed_equals_eager():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "privacy"))
    import hf_models

    losses = []
    params = []
    for graphed in (False, True):
        case = hf_models.build("gpt2")
        model = copy.deepcopy(case.model).cuda()
        gsm = wrap_model(model, "bk", max_grad_norm=0.3)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.5),
                                              noise_multiplier=0.0, max_grad_norm=0.3,
                                              expected_batch_size=4)
        gsm.bind_clipping(opt.clipping)

        def loss_fn(inputs, labels, case=case, gsm=gsm):
            return case.loss_fn(gsm(**inputs), labels, "mean")

        step = make_graphed_dp_step(gsm, opt, loss_fn, warmup_steps=1) if graphed else None
        out = []
        for i in range(4):
            inputs, labels = case.make_batch(4, i)
            inputs = {k: v.cuda() for k, v in inputs.items()}
            labels = labels.cuda()
            if step is None:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(inputs, labels)
                loss.backward()
                opt.step()
            else:
                loss = step(inputs, labels)
            out.append(loss.item())
        losses.append(out)
        params.append([p.detach().clone() for p in gsm.parameters()])
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)
    for a, b in zip(*params):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@cuda
def test_recapturing_every_step_warns():
    gsm, opt = _dp("bk", "cuda")
    step = make_graphed_dp_step(gsm, opt, lambda x, y: F.cross_entropy(gsm(x), y),
                                warmup_steps=1)
    x, y = _batch(0, "cuda")
    with pytest.warns(UserWarning, match="captured 2. of the last 20 steps again"):
        for i in range(22):
            opt.max_grad_norm = 0.5 + 0.01 * i  # a new C at every step: a new capture
            step(x, y)
    assert step.captures == 21


@cuda
def test_zero_grad_between_graphed_steps_cuda():
    """Not run where this was written (no GPU): the user's zero_grad() between graphed steps,
    per-sample gradients (hooks): one accounted event per step, the same as eager."""
    gsm, opt = _dp("hooks", "cuda", sigma=1.0)
    events = []
    opt.attach_step_hook(lambda o: events.append(o.privacy_event(0.1)))
    step = make_graphed_dp_step(gsm, opt, lambda x, y: F.cross_entropy(gsm(x), y),
                                warmup_steps=1)
    for i in range(4):
        opt.zero_grad()
        step(*_batch(i, "cuda"))
    assert len(events) == 4 and all(e == events[0] for e in events)
