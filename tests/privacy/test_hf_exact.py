"""Exact per-sample gradients for tiny Hugging Face models called with their default forward
(``gsm(**inputs)``), in every mode, against an independent brute force (tests/privacy/reference.py:
each sample alone, float64, plain autograd).

* ``hooks`` / ``functorch``: every ``p.grad_sample`` has shape ``(B, *p.shape)`` and equals the
  reference per-sample gradient;
* every mode: the released DP-SGD update (noise 0, SGD with lr 1) equals the reference sum of
  flat-clipped per-sample gradients, with C between the per-sample norms (some samples clipped,
  some not); ``ghost`` / ``bk``: ``per_sample_gradient_norms`` equals the reference norms;
* the relative-attention-bias adapters (dptorch/grad_sample/hf_adapters.py) keep the forward
  and make the bias tables' per-sample gradients exact: T5 and its copies in mT5, UMT5 and
  LongT5 (full, local and transient-global attention), and MPNet.

Models (tests/privacy/hf_models.py): BERT classification (also right-padded), BERT MLM with
tied embeddings, GPT-2 (also right-padded), T5 (also padded), MPNet, Llama, Qwen2 (tied).

Errors are relative to the largest entry of the reference, per parameter (floored, see
:data:`FLOOR`). Tolerance 1e-9 (float64 round-off), except where the model itself computes in
float32 whatever its dtype and the two computations scale differently: ghost clipping on
Llama/Qwen2 (RMSNorm) and T5 (T5LayerNorm's variance), and the model's own loss (logits
upcast to float32): 1e-5.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.grad_sample.hf_adapters import install_adapters
from dptorch.optimizers import get_optimizer_class
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

from .hf_models import BUILDERS, HFCase, T, build, masked_lm_loss
from .reference import Reference, per_sample_grads, reference_dp

B = 4
MODELS = list(BUILDERS)
MODES = ("hooks", "functorch", "ghost", "bk")
GRAD_SAMPLE_MODES = ("hooks", "functorch")


def tolerance(case: HFCase, mode: str) -> float:
    """Largest accepted relative error for ``case`` in ``mode``: float64 round-off (1e-9),
    except ghost clipping on a model with float32 internals (1e-5): its second backward pass
    differentiates ``Σ_b c_b loss_b``, whose float32 steps round differently from the
    reference's unscaled ones (observed ~1e-7)."""
    return 1e-5 if case.float32_internals and mode == "ghost" else 1e-9


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``max|got - ref| / max(max|ref|, floor)`` (0 if both are zero, ``inf`` if only the
    denominator is)."""
    diff = (got.double() - ref).abs().max().item()
    scale = max(ref.abs().max().item(), floor)
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / scale


#: a parameter's error is relative to at least this fraction of the largest reference entry of
#: all parameters: some gradients are zero in exact arithmetic (an attention key bias shifts
#: every score of a query by the same amount, which softmax cancels) and the reference holds
#: round-off there
FLOOR = 1e-3


def max_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """``(error, name)`` of the parameter with the largest :func:`rel_err` (``inf`` for a
    missing entry or a shape mismatch)."""
    floor = FLOOR * max(r.abs().max().item() for r in ref.values())
    worst = (0.0, "")
    for n, r in ref.items():
        g = got.get(n)
        e = float("inf") if g is None or g.shape != r.shape else rel_err(g, r, floor)
        worst = max(worst, (e, n))
    return worst


def assert_all_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float,
                     what: str) -> None:
    """Every entry of ``ref`` has an entry of the same shape in ``got`` within ``tol``
    (:func:`rel_err`, floored at :data:`FLOOR`); the message lists every parameter that is not,
    with its error."""
    floor = FLOOR * max(r.abs().max().item() for r in ref.values())
    bad = []
    for n, r in ref.items():
        g = got.get(n)
        if g is None or g.shape != r.shape:
            bad.append(f"{n}: shape {None if g is None else tuple(g.shape)}, expected {tuple(r.shape)}")
            continue
        e = rel_err(g, r, floor)
        if not e <= tol:
            bad.append(f"{n}: relative error {e:.3g}")
    assert not bad, f"{what} differs from the reference (tol {tol:g}):\n  " + "\n  ".join(bad)


@functools.cache
def _setup(name: str) -> tuple[HFCase, dict, torch.Tensor, float, Reference]:
    """``(case, inputs, labels, C, reference)``: C halfway between the 2nd and 3rd smallest
    per-sample norms, so that two samples are clipped and two are not."""
    case = build(name)
    inputs, labels = case.make_batch(B, 0)
    grads = per_sample_grads(case.model, inputs, labels, case.loss_fn)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    s = norms.sort().values
    c = float(s[B // 2 - 1] + s[B // 2]) / 2
    ref = reference_dp(case.model, inputs, labels, case.loss_fn, c)
    assert (ref.factors < 1).sum() == B // 2, ref.norms
    return case, inputs, labels, c, ref


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class PerSampleLoss(nn.Module):
    """Criterion for :class:`DPLossFastGradientClipping`: ``loss_fn(output, labels, reduction)``
    (the wrapper sets ``reduction="none"`` to get the ``(B,)`` per-sample losses)."""

    def __init__(self, loss_fn, reduction: str = "sum"):
        super().__init__()
        self.loss_fn = loss_fn
        self.reduction = reduction

    def forward(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, labels, self.reduction)


# ----------------------------------------------------------------------------- per-sample grads
@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("name", MODELS)
def test_grad_sample_exact(name: str, mode: str) -> None:
    """``p.grad_sample`` ``(B, *p.shape)`` of every trainable parameter (tied ones once) equals
    the brute-force per-sample gradient, and ``p.grad`` their sum."""
    case, inputs, labels, _, ref = _setup(name)
    gsm = wrap_model(copy.deepcopy(case.model), mode, batch_first=True, loss_reduction="sum")
    case.loss_fn(gsm(**inputs), labels, "sum").backward()
    named = {n: p for n, p in gsm._module.named_parameters() if p.requires_grad}
    assert named.keys() == ref.grads.keys()
    missing = [n for n, p in named.items() if not isinstance(getattr(p, "grad_sample", None),
                                                          torch.Tensor)]
    assert not missing, f"no grad_sample tensor for {missing}"
    tol = tolerance(case, mode)
    assert_all_close({n: p.grad_sample for n, p in named.items()}, ref.grads, tol, "grad_sample")
    assert_all_close({n: p.grad for n, p in named.items()},
                     {n: g.sum(0) for n, g in ref.grads.items()}, tol, "p.grad")


# ----------------------------------------------------------------------------- DP update
def dp_update(case: HFCase, mode: str, inputs: dict, labels: torch.Tensor, c: float,
              reduction: str = "sum") -> tuple[dict[str, torch.Tensor], nn.Module]:
    """One DP-SGD step (flat clipping at ``c``, noise 0, SGD lr 1) on a copy of the model with
    its default forward; returns ``({name: parameter change}, gsm)``. ghost: the per-sample
    losses go through :class:`DPLossFastGradientClipping`; other modes: plain ``backward()``."""
    model = copy.deepcopy(case.model)
    extra = {"max_grad_norm": c} if mode in ("ghost", "bk") else {}
    gsm = wrap_model(model, mode, batch_first=True, loss_reduction=reduction, **extra)
    params = [p for p in gsm.parameters() if p.requires_grad]
    opt = get_optimizer_class("flat", False, mode)(
        torch.optim.SGD(params, lr=1.0), noise_multiplier=0.0, max_grad_norm=c,
        expected_batch_size=labels.shape[0], loss_reduction=reduction,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    out = gsm(**inputs)
    if mode == "ghost":
        crit = DPLossFastGradientClipping(gsm, opt, PerSampleLoss(case.loss_fn, reduction),
                                          reduction)
        crit(out, labels).backward()
    else:
        case.loss_fn(out, labels, reduction).backward()
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, gsm


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_dp_update_exact(name: str, mode: str) -> None:
    """The released update equals the reference clipped sum; fast-clipping modes also report
    the reference per-sample norms."""
    case, inputs, labels, c, ref = _setup(name)
    update, gsm = dp_update(case, mode, inputs, labels, c)
    tol = tolerance(case, mode)
    if mode in ("ghost", "bk"):
        norms = gsm.per_sample_gradient_norms
        assert norms.shape == (B,), tuple(norms.shape)
        assert rel_err(norms, ref.norms) <= tol, (norms, ref.norms)
    assert_all_close(update, ref.clipped_sum, tol, "DP update")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["bert_mlm", "gpt2_padded", "t5"])
def test_dp_update_mean_reduction(name: str, mode: str) -> None:
    """``loss_reduction="mean"``: the update is the clipped sum divided by the batch size."""
    case, inputs, labels, c, ref = _setup(name)
    update, _ = dp_update(case, mode, inputs, labels, c, reduction="mean")
    assert_all_close(update, {n: g / B for n, g in ref.clipped_sum.items()}, tolerance(case, mode),
                     "DP update (mean)")


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_model_computed_loss(name: str, mode: str) -> None:
    """The loss the model computes itself (``labels`` passed to the forward: mean token
    cross-entropy over the batch, computed in float32, ``loss_reduction="mean"``) gives the
    update of the per-sample loss "mean of the sample's token cross-entropies"."""
    case, inputs, labels, _, _ = _setup(name)

    def token_mean(out, lab, reduction):
        return case.loss_fn(out, lab, reduction) / (T - 1)

    ref_grads = per_sample_grads(case.model, {**inputs, "labels": labels}, labels, token_mean)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref_grads.values()))
    c = float(norms.median())
    model = copy.deepcopy(case.model)
    extra = {"max_grad_norm": c} if mode == "bk" else {}
    gsm = wrap_model(model, mode, batch_first=True, loss_reduction="mean", **extra)
    opt = get_optimizer_class("flat", False, mode)(
        torch.optim.SGD([p for p in gsm.parameters() if p.requires_grad], lr=1.0),
        noise_multiplier=0.0, max_grad_norm=c, expected_batch_size=B, loss_reduction="mean",
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gsm(**inputs, labels=labels).loss.backward()
    opt.step()
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    expected = {n: torch.einsum("b,b...->...", factors, g) / B for n, g in ref_grads.items()}
    update = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    # the model's loss upcasts the logits to float32: float32 round-off whatever the model
    assert_all_close(update, expected, 1e-5, "DP update (model's own loss)")


# ----------------------------------------------------------------------------- T5 adapter
def _t5_family(name: str) -> nn.Module:
    """A tiny T5-family model with relative attention bias (float64, train mode)."""
    common = dict(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    if name == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(**common))
    elif name == "mt5":
        model = tf.MT5ForConditionalGeneration(tf.MT5Config(**common))
    elif name == "umt5":  # a bias table in every layer
        model = tf.UMT5ForConditionalGeneration(tf.UMT5Config(**common))
    elif name == "longt5_local":  # blocked bias [1, 1, H, l, 3l]
        model = tf.LongT5ForConditionalGeneration(
            tf.LongT5Config(**common, encoder_attention_type="local", local_radius=2))
    elif name == "longt5_tglobal":
        model = tf.LongT5ForConditionalGeneration(tf.LongT5Config(
            **common, encoder_attention_type="transient-global", local_radius=2,
            global_block_size=2))
    else:
        raise KeyError(name)
    return model.double().train()


T5_FAMILY = ["t5", "mt5", "umt5", "longt5_local", "longt5_tglobal"]


def _t5_batch(b: int = 3) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(2, 64, (b, 5), generator=g)
    return {"input_ids": torch.randint(2, 64, (b, 7), generator=g), "labels": labels}, labels


def _bias_attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "has_relative_attention_bias", False)]


@pytest.mark.parametrize("name", T5_FAMILY)
def test_relative_bias_adapter_forward_and_removal(name: str) -> None:
    """With the adapter, each adapted attention returns a per-sample bias whose leading axis
    is the batch, equal to the class's bias broadcast to it; the model's output is unchanged;
    removing the adapter deletes the instance attributes and the output stays the same."""
    model = _t5_family(name)
    inputs, _ = _t5_batch()
    with torch.no_grad():
        plain = model(**inputs).logits
    attns = _bias_attentions(model)
    removers = install_adapters(model)
    assert len(removers) == len(attns) > 0
    assert install_adapters(model) == []  # never twice

    # record every compute_bias call (arguments and per-sample bias) of the adapted instances
    calls: list[tuple[nn.Module, tuple, dict, torch.Tensor]] = []
    adapted_fns = {a: a.__dict__["compute_bias"] for a in attns}
    for a, fn in adapted_fns.items():
        def record(*args, _a=a, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            calls.append((_a, args, kwargs, out))
            return out

        a.__dict__["compute_bias"] = record
    with torch.no_grad():
        adapted = model(**inputs).logits
    for a, fn in adapted_fns.items():
        a.__dict__["compute_bias"] = fn
    torch.testing.assert_close(adapted, plain, rtol=0, atol=1e-13)
    assert {id(a) for a, *_ in calls} == {id(a) for a in attns}
    for attn, args, kwargs, bias in calls:
        original = type(attn).compute_bias(attn, *args, **kwargs)  # [1, H, q, k]
        assert original.shape[0] == 1 and bias.shape == (3, *original.shape[1:]), (
            tuple(bias.shape), tuple(original.shape))
        torch.testing.assert_close(bias, original.expand_as(bias), rtol=0, atol=0)

    for r in removers:
        r()
    for attn in attns:
        assert not {"forward", "compute_bias"} & attn.__dict__.keys()
        assert not any(k.startswith("_dptorch") for k in attn.__dict__)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, plain, rtol=0, atol=0)


def test_mpnet_adapter_forward_and_removal() -> None:
    """MPNet: the adapted ``compute_position_bias`` equals the class's (already expanded to the
    batch), the output is unchanged, and removing the adapter restores the class method."""
    case = build("mpnet_cls")
    model = case.model
    inputs, _ = case.make_batch(3, 0)
    with torch.no_grad():
        plain = model(**inputs).logits
    encoder = model.mpnet.encoder
    removers = install_adapters(model)
    assert len(removers) == 1 and "compute_position_bias" in encoder.__dict__
    x = torch.randn(3, T, 16, dtype=torch.float64)
    bias = encoder.compute_position_bias(x)
    torch.testing.assert_close(bias, type(encoder).compute_position_bias(encoder, x),
                               rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, plain, rtol=0, atol=1e-13)
    removers[0]()
    assert "compute_position_bias" not in encoder.__dict__


def test_relative_bias_adapter_deep_copy() -> None:
    """A deep copy of an adapted model is adapted by itself (bound methods follow the copy)."""
    model = _t5_family("t5")
    inputs, _ = _t5_batch()
    install_adapters(model)
    clone = copy.deepcopy(model)
    attn = clone.encoder.block[0].layer[0].SelfAttention
    assert attn.compute_bias.__self__ is attn and attn.forward.__self__ is attn
    with torch.no_grad():
        torch.testing.assert_close(clone(**inputs).logits, model(**inputs).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("name", T5_FAMILY)
def test_relative_bias_adapter_grad_sample(name: str) -> None:
    """Adapter installed by hand before wrapping (hooks mode): every parameter's per-sample
    gradient, the relative-bias tables included, equals the brute force."""
    model = _t5_family(name)
    inputs, labels = _t5_batch()
    ref = per_sample_grads(model, inputs, labels, masked_lm_loss)
    install_adapters(model)
    gsm = wrap_model(model, "hooks", batch_first=True, loss_reduction="sum")
    masked_lm_loss(gsm(**inputs), labels, "sum").backward()
    named = dict(gsm._module.named_parameters())
    tables = [n for n in ref if "relative_attention_bias" in n]
    assert tables
    assert all(ref[n].abs().max() > 0 for n in tables)
    assert_all_close({n: named[n].grad_sample for n in ref}, ref, 1e-9, "grad_sample")


def test_wrapping_installs_and_unwrapping_removes_the_adapter() -> None:
    """``GradSampleModule`` installs the adapters when it wraps the model and removes them in
    ``to_standard_module()``: the user gets back a model of the original behaviour."""
    model = _t5_family("t5")
    attns = _bias_attentions(model)
    gsm = wrap_model(model, "hooks", loss_reduction="sum")
    assert all("compute_bias" in a.__dict__ for a in attns)
    assert gsm.to_standard_module() is model
    assert not any({"forward", "compute_bias"} & a.__dict__.keys() for a in attns)
