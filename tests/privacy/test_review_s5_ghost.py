"""Review (session 5) of ghost's graph check (083fbc0, fe718cc: ``param_edges.param_consumers``,
``GradSampleModule._sanction_consumers`` / ``check_param_uses``).

Invariant: with ``noise_multiplier=0``, SGD at lr 1 and ``loss_reduction="mean"``, the released
update is ``Σ_b clip_C(g_b) / B``, where ``g_b`` is sample ``b``'s *whole* gradient (the brute
force: each sample alone, float64). A clear refusal (ValueError / RuntimeError /
NotImplementedError) is accepted wherever a test says so.

Tests named ``test_finding_*`` fail on the code they were written against (a real problem);
the others pin behaviour that holds.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore")

DT = torch.float64
B = 8
C = 1.0
REFUSALS = (ValueError, RuntimeError, NotImplementedError)


def _xy(scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, generator=g, dtype=DT) * scale, torch.randint(0, 3, (B,), generator=g)


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _ghost(model):
    ref = copy.deepcopy(model)
    x, y = _xy()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gm, opt, crit, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode="ghost")
    return ref, gm, opt, crit


def _update(model, run):
    before = [p.detach().clone() for p in model.parameters()]
    run()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def _brute(ref, loss_i):
    ps = list(ref.parameters())
    total = [torch.zeros_like(p) for p in ps]
    for i in range(B):
        g = torch.autograd.grad(loss_i(ref, i), ps, allow_unused=True)
        g = [torch.zeros_like(p) if t is None else t for t, p in zip(g, ps)]
        c = min(1.0, C / (float(torch.sqrt(sum((t ** 2).sum() for t in g))) + 1e-6))
        total = [a + c * t for a, t in zip(total, g)]
    return [t / B for t in total]


def _assert_brute(upd, bf):
    err = float(torch.sqrt(sum(((u - b) ** 2).sum() for u, b in zip(upd, bf))))
    nu = float(torch.sqrt(sum((u ** 2).sum() for u in upd)))
    nb = float(torch.sqrt(sum((b ** 2).sum() for b in bf)))
    assert err <= 1e-9 * max(1.0, nb), (
        f"released update (norm {nu:.4g}) != brute force (norm {nb:.4g}), error {err:.3g}")


def _exact_or_refused(model, run, loss_i):
    ref, gm, opt, crit = _ghost(model)
    try:
        upd = _update(model, lambda: run(model, gm, opt, crit))
    except REFUSALS:
        return
    _assert_brute(upd, _brute(ref, loss_i))


# ---------------------------------------------------------------- findings (fail today)
def test_finding_plain_backward_before_the_dp_backward_is_released():
    """*Finding* (silent privacy failure). ``zero_grad(); reg.backward(); dp_loss.backward();
    step()``: the unclipped gradient of an ordinary backward pass run *before* the DP loss's
    backward stays in ``p.grad``; ghost's second pass adds the clipped sum to it and
    ``mark_clipped_pass`` records the sum as the clipped state, so the optimizer releases it
    (update norm ~433 for C = 1). The same order *after* the DP backward is refused; hooks
    ignores p.grad; bk refuses. Fix: before the second pass, require p.grad to be None/zero or
    the state recorded by the previous clipped pass."""
    x, y = _xy()

    def run(model, gm, opt, crit):
        opt.zero_grad()
        (1000 * model.b.weight.sum()).backward()
        crit(gm(x), y).backward()
        opt.step()

    torch.manual_seed(1)
    _exact_or_refused(_Two().to(DT), run,
                      lambda r, i: F.cross_entropy(r(x[i:i + 1]), y[i:i + 1]))


@pytest.mark.parametrize("kind", ["hook", "post_accumulate"])
def test_finding_parameter_gradient_hook_rescales_the_clipped_sum(kind):
    """*Finding* (silent privacy failure). A hook on a trainable parameter
    (``p.register_hook``, ``register_post_accumulate_grad_hook``) runs in ghost's second
    backward pass, *after* clipping: ``g * 1000`` releases 1000x the clipped sum (norm ~183
    for C = 1). hooks mode is exact (it uses grad_sample, not p.grad). Fix: refuse trainable
    parameters with tensor hooks / post-accumulate hooks in ghost (check ``p._backward_hooks``
    and ``p._post_accumulate_grad_hooks`` in check_param_uses), or run the second pass with
    ``torch.autograd.grad`` into the parameters and add the result to p.grad."""
    x, y = _xy()
    torch.manual_seed(1)
    model = _Two().to(DT)
    ref, gm, opt, crit = _ghost(model)
    if kind == "hook":
        model.b.weight.register_hook(lambda g: g * 1000)
    else:
        def post(p):
            p.grad.mul_(1000)
        model.b.weight.register_post_accumulate_grad_hook(post)

    def run():
        crit(gm(x), y).backward()
        opt.step()

    try:
        upd = _update(model, run)
    except REFUSALS:
        return
    _assert_brute(upd, _brute(ref, lambda r, i: F.cross_entropy(r(x[i:i + 1]), y[i:i + 1])))


def test_finding_parameter_term_built_before_the_forward_pass():
    """*Finding* (silent privacy failure). ``_sanction_consumers`` accepts every node reachable
    from a traced forward's output, including nodes built *before* the forward: here the
    training loop feeds ``x + 100 * a.bias`` to the model; the ``AddBackward`` into ``a.bias``
    is sanctioned, no hook sees that use, and its gradient is released with clip factors
    computed without it. Fix: sanction only the nodes created inside a hooked call of a module
    that samples the parameter (e.g. in ``_capture_call``, walk from the call's output and stop
    at the call's inputs and at nodes whose ``_sequence_nr()`` predates the call)."""
    x, y = _xy(0.1)

    def run(model, gm, opt, crit):
        crit(gm(x + 100 * model.a.bias), y).backward()
        opt.step()

    torch.manual_seed(1)
    _exact_or_refused(_Two().to(DT), run,
                      lambda r, i: F.cross_entropy(r(x[i:i + 1] + 100 * r.a.bias), y[i:i + 1]))


@pytest.mark.parametrize("how", ["eval", "disable_hooks"])
def test_finding_untraced_forward_output_fed_to_a_training_forward(how):
    """*Finding* (silent privacy failure). An eval-mode (or hooks-off) forward pass's output
    given as the *input* of a training forward: the training pass's ``_sanction_consumers``
    walks into the untraced pass's graph and sanctions its ``AddmmBackward`` nodes, so
    ``check_param_uses`` passes and the untraced pass's gradient is released with clip factors
    that ignore it. (Added to the loss instead, the same output is refused.)"""
    x, y = _xy(0.1)

    def run(model, gm, opt, crit):
        if how == "eval":
            gm.eval()
            z = gm(x)
            gm.train()
        else:
            gm.disable_hooks()
            z = gm(x)
            gm.enable_hooks()
        crit(gm(torch.cat([z * 100, x[:, :1]], 1)), y).backward()
        opt.step()

    def loss_i(r, i):
        z = r(x[i:i + 1])
        return F.cross_entropy(r(torch.cat([z * 100, x[i:i + 1, :1]], 1)), y[i:i + 1])

    torch.manual_seed(1)
    _exact_or_refused(_Two().to(DT), run, loss_i)


class _ViewUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.wt = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.wt is not None:
            h = h + x @ self.wt
        return self.b(h)


def test_finding_parameter_view_made_outside_forward_used_inside():
    """*Finding* (silent privacy failure). ``module.wt = module.a.weight.t()`` made outside
    the forward and used inside it: the use trace only tags the Parameter object itself, so the
    view's use is not seen; ``_sanction_consumers`` sanctions the ``TBackward`` node (reachable
    from the output) and the view's gradient is released unclipped (update ~0.87 vs brute
    force ~0.47). The same ``.t()`` inside the forward is refused."""
    x, y = _xy(0.1)

    torch.manual_seed(1)
    model = _ViewUser().to(DT)
    ref, gm, opt, crit = _ghost(model)
    model.wt = model.a.weight.t()
    ref.wt = ref.a.weight.t()

    def run():
        crit(gm(x * 100), y).backward()
        opt.step()

    try:
        upd = _update(model, run)
    except REFUSALS:
        return
    _assert_brute(upd, _brute(ref, lambda r, i: F.cross_entropy(r(x[i:i + 1] * 100), y[i:i + 1])))


class _DetachingMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        wd = w.detach()
        ctx.save_for_backward(x, wd)
        return x @ wd.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class _CustomFnUser(_Two):
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) + _DetachingMatmul.apply(x, self.a.weight))


def test_finding_custom_autograd_function_on_a_childs_parameter():
    """*Finding* (silent privacy failure). A custom ``autograd.Function`` in the parent's
    forward taking ``self.a.weight`` (its forward computes on ``w.detach()``, as fused kernels
    do): ``Function.apply`` is not seen by the use trace's TorchFunctionMode and the ops inside
    do not require grad, so the use is not refused; ``_sanction_consumers`` sanctions the
    Function's backward node and its gradient is released unclipped."""
    x, y = _xy(0.1)

    def run(model, gm, opt, crit):
        crit(gm(x * 100), y).backward()
        opt.step()

    torch.manual_seed(1)
    _exact_or_refused(_CustomFnUser().to(DT), run,
                      lambda r, i: F.cross_entropy(r(x[i:i + 1] * 100), y[i:i + 1]))


def test_finding_second_dp_loss_of_an_earlier_forward_uses_stale_clip_factors():
    """*Finding* (silent privacy failure). ``outA = gm(xA); crit(gm(xB), y).backward();
    crit(outA, y).backward(); step()``: the second DP loss passes ``check_param_uses`` (the
    sanctioned set is spent but not cleared until the next forward), its norm pass finds no
    kept outputs (cleared by the first pass) and returns, so ``get_clipping_coef`` returns the
    *first* loss's factors; ``mark_clipped_pass`` re-marks the existing pass, so even the
    Poisson no-accumulation rule is bypassed. Released norm ~8.4 (at most 2C = 2 possible).
    Fix: clear
    ``per_sample_gradient_norms`` after use (and ``_traced_consumers`` in check_param_uses);
    refuse a DP loss that reaches parameters while no hooked output is pending."""
    x, y = _xy()
    xa, _ = _xy(100.0, seed=1)

    def run(model, gm, opt, crit):
        out_a = gm(xa)
        crit(gm(x), y).backward()
        crit(out_a, y).backward()
        opt.step()

    def loss_i(r, i):
        return (F.cross_entropy(r(x[i:i + 1]), y[i:i + 1])
                + 0 * F.cross_entropy(r(xa[i:i + 1]), y[i:i + 1]))

    torch.manual_seed(1)
    model = _Two().to(DT)
    ref, gm, opt, crit = _ghost(model)
    try:
        upd = _update(model, lambda: run(model, gm, opt, crit))
    except REFUSALS:
        return
    # two DP losses of B samples each: at best the sum of two clipped sums; never more than 2C
    bf_b = _brute(ref, lambda r, i: F.cross_entropy(r(x[i:i + 1]), y[i:i + 1]))
    bf_a = _brute(ref, lambda r, i: F.cross_entropy(r(xa[i:i + 1]), y[i:i + 1]))
    _assert_brute(upd, [a + b for a, b in zip(bf_a, bf_b)])


def test_discarded_training_forwards_release_their_graphs():
    """*Finding, fixed* (memory). Every training forward with gradients on used to add its
    parameter-feeding nodes to a set held by the module, replaced only at the first forward
    after a DP backward: N forwards whose loss is discarded (a train-mode validation pass with
    grad, a rollout) kept N graphs alive with their saved activations (200 forwards of a
    256-1024-10 MLP at B=64: +100 MiB). Sanctions now live in each node's own metadata, and
    the module's ``zero_grad`` drops the kept outputs of forwards never back-propagated."""
    import gc
    import weakref

    torch.manual_seed(1)
    model = _Two().to(DT)
    _, gm, opt, crit = _ghost(model)
    x, y = _xy()
    saved = []
    for _ in range(5):
        xi = x.clone().requires_grad_()  # saved by the first layer for its backward
        saved.append(weakref.ref(xi))
        gm(xi).sum().item()
        del xi
    gm.zero_grad()
    opt.zero_grad()
    gc.collect()
    assert all(r() is None for r in saved)
    crit(gm(x), y).backward()  # the next step still trains
    opt.step()


# ---------------------------------------------------------------- pinned behaviour (holds)
def test_two_training_forwards_one_loss_is_exact():
    x, y = _xy()
    x2, _ = _xy(3.0, seed=1)

    def run(model, gm, opt, crit):
        (crit(gm(x), y) + crit(gm(x2), y)).backward()
        opt.step()

    torch.manual_seed(1)
    model = _Two().to(DT)
    ref, gm, opt, crit = _ghost(model)
    upd = _update(model, lambda: run(model, gm, opt, crit))
    _assert_brute(upd, _brute(ref, lambda r, i: F.cross_entropy(r(x[i:i + 1]), y[i:i + 1])
                              + F.cross_entropy(r(x2[i:i + 1]), y[i:i + 1])))


class _Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.use_ckpt = True

    def block(self, h):
        return torch.tanh(self.a(h))

    def forward(self, x):
        h = self.p(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.use_ckpt else self.block(h)
        return self.b(h)


def test_non_reentrant_checkpoint_is_exact():
    """Recomputation in backward re-runs the hooks but the released update is exact."""
    x, y = _xy()
    torch.manual_seed(1)
    model = _Ckpt().to(DT)
    ref, gm, opt, crit = _ghost(model)
    ref.use_ckpt = False

    def run():
        crit(gm(x), y).backward()
        opt.step()

    _assert_brute(_update(model, run),
                  _brute(ref, lambda r, i: F.cross_entropy(r(x[i:i + 1]), y[i:i + 1])))


def test_eval_forward_added_to_the_loss_is_refused():
    x, y = _xy()
    torch.manual_seed(1)
    model = _Two().to(DT)
    _, gm, opt, crit = _ghost(model)
    gm.eval()
    extra = crit(gm(x), y)
    gm.train()
    with pytest.raises(ValueError, match="outside the model's hooked forward"):
        (crit(gm(x), y) + extra).backward()


def test_gpt2_tied_head_with_eval_and_train_mode_validation_passes():
    """No false refusal: tiny GPT-2 (tied LM head) in ghost, with an eval loop (no_grad and
    grad-enabled) and a discarded train-mode pass between steps."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    v, t = 40, 6
    m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=v, n_embd=16, n_layer=2, n_head=2,
                                         n_positions=16))
    ids = torch.randint(0, v, (8, t))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gm, opt, crit, dl = PrivacyEngine().make_private(
        module=m, optimizer=opt, data_loader=DataLoader(TensorDataset(ids), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost",
        criterion=nn.CrossEntropyLoss(label_smoothing=0.1), poisson_sampling=False)

    def loss(batch):
        lg = gm(input_ids=batch).logits
        return crit(lg[:, :-1].reshape(-1, v), batch[:, 1:].reshape(-1),
                    shape=(batch.shape[0], t - 1, v))

    for (bi,) in dl:
        opt.zero_grad()
        loss(bi).backward()
        opt.step()
        gm.eval()
        with torch.no_grad():
            loss(ids[:2]).item()
        loss(ids[:2]).item()
        gm.train()
        loss(ids[:2]).item()
