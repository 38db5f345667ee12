"""DPMultiheadAttention: same outputs, weights and state dict as nn.MultiheadAttention; exact
per-sample gradients (torch's layer on one sample at a time, float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.grad_sample import GradSampleModule
from dptorch.layers import DPMultiheadAttention, SequenceBias

E, H = 6, 2

config = st.fixed_dictionaries(
    {
        "bias": st.booleans(),
        "add_bias_kv": st.booleans(),
        "add_zero_attn": st.booleans(),
        "kv_dims": st.booleans(),
        "batch_first": st.booleans(),
    }
)


def make_pair(c, dtype=torch.float32, dropout=0.0):
    kw = dict(
        embed_dim=E,
        num_heads=H,
        dropout=dropout,
        bias=c["bias"],
        add_bias_kv=c["add_bias_kv"],
        add_zero_attn=c["add_zero_attn"],
        kdim=4 if c["kv_dims"] else None,
        vdim=5 if c["kv_dims"] else None,
        batch_first=c["batch_first"],
    )
    ref = nn.MultiheadAttention(**kw).to(dtype)
    if c["bias"]:
        with torch.no_grad():  # torch initialises these to 0: make them count
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    dp = DPMultiheadAttention(**kw).to(dtype)
    dp.load_state_dict(ref.state_dict())
    return dp, ref


def inputs(c, b, lq, s, dtype=torch.float32):
    kd, vd = (4, 5) if c["kv_dims"] else (E, E)

    def shape(d, n):
        return (b, n, d) if c["batch_first"] else (n, b, d)

    return (
        torch.randn(shape(E, lq), dtype=dtype),
        torch.randn(shape(kd, s), dtype=dtype),
        torch.randn(shape(vd, s), dtype=dtype),
    )


def masks(b, lq, s, kind):
    extra = 0  # the layer pads masks itself for bias_kv / zero_attn
    if kind == "none":
        return {}
    kpm = torch.zeros(b, s + extra, dtype=torch.bool)
    kpm[0, -1] = True
    am = torch.triu(torch.ones(lq, s, dtype=torch.bool), diagonal=2)
    if kind == "bool":
        return {"key_padding_mask": kpm, "attn_mask": am}
    return {"attn_mask": torch.randn(b * H, lq, s), "key_padding_mask": torch.randn(b, s)}


@settings(max_examples=15, deadline=None)
@given(
    c=config,
    mask=st.sampled_from(["none", "bool", "float"]),
    avg=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_torch(c, mask, avg, seed):
    torch.manual_seed(seed)
    dp, ref = make_pair(c)
    b, lq, s = 3, 4, 5
    q, k, v = inputs(c, b, lq, s)
    m = masks(b, lq, s, mask)
    out_r, w_r = ref(q, k, v, average_attn_weights=avg, **m)
    out_d, w_d = dp(q, k, v, average_attn_weights=avg, **m)
    torch.testing.assert_close(out_d, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w_d, w_r, atol=1e-5, rtol=1e-5)
    out_d2, none = dp(q, k, v, need_weights=False, **m)
    assert none is None
    torch.testing.assert_close(out_d2, out_r, atol=1e-5, rtol=1e-5)


def test_unbatched_causal_and_dropout_match_torch():
    c = dict(bias=True, add_bias_kv=False, add_zero_attn=False, kv_dims=False, batch_first=True)
    torch.manual_seed(0)
    dp, ref = make_pair(c, dropout=0.3)
    x = torch.randn(4, E)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    dp.eval()
    ref.eval()
    torch.testing.assert_close(
        dp(x, x, x, attn_mask=causal, is_causal=True)[0],
        ref(x, x, x, attn_mask=causal, is_causal=True)[0],
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(RuntimeError, match="attn_mask"):
        dp(x, x, x, is_causal=True)
    # training: dropout on the attention weights, same masks as torch for the same seed
    dp.train()
    ref.train()
    xb = torch.randn(2, 4, E)
    torch.manual_seed(7)
    out_r, w_r = ref(xb, xb, xb, average_attn_weights=False)
    torch.manual_seed(7)
    out_d, w_d = dp(xb, xb, xb, average_attn_weights=False)
    assert (w_d == 0).any()
    torch.testing.assert_close(w_d, w_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_d, out_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dims", [False, True])
def test_state_dict_is_torchs(kv_dims):
    c = dict(bias=True, add_bias_kv=True, add_zero_attn=False, kv_dims=kv_dims, batch_first=False)
    dp, ref = make_pair(c)
    sd_d, sd_r = dp.state_dict(), ref.state_dict()
    assert list(sd_d) == list(sd_r)
    for k in sd_r:
        assert torch.equal(sd_d[k], sd_r[k]), k
    outer = nn.Sequential(nn.Identity(), DPMultiheadAttention(E, H, add_bias_kv=True, kdim=4 if kv_dims else None, vdim=5 if kv_dims else None))
    outer.load_state_dict(nn.Sequential(nn.Identity(), ref).state_dict())
    assert torch.equal(outer[1].klinear.bias, ref.in_proj_bias[E : 2 * E])
    assert torch.equal(outer[1].bias_k, ref.bias_k)


def test_sequence_bias():
    sb = SequenceBias(3)
    x = torch.randn(4, 2, 3)
    y = sb(x)
    assert y.shape == (5, 2, 3)
    torch.testing.assert_close(y[-1], sb.bias.expand(2, 3).detach())
    sbf = SequenceBias(3, batch_first=True)
    assert sbf(x.transpose(0, 1)).shape == (2, 5, 3)


def reference_grads(ref, c, q, k, v, weight_out, m):
    """Per-sample gradients of torch's layer, one sample at a time, keyed by DP names."""
    b = q.shape[0] if c["batch_first"] else q.shape[1]
    rows = []
    for i in range(b):
        def one(t, i=i):
            return t[i : i + 1] if c["batch_first"] else t[:, i : i + 1]
        mi = {}
        if "key_padding_mask" in m:
            mi["key_padding_mask"] = m["key_padding_mask"][i : i + 1]
        if "attn_mask" in m:
            am = m["attn_mask"]
            mi["attn_mask"] = am if am.dim() == 2 else am[i * H : (i + 1) * H]
        out, _ = ref(one(q), one(k), one(v), **mi)
        loss = (out * one(weight_out)).sum()
        names = [n for n, p in ref.named_parameters()]
        gs = dict(zip(names, torch.autograd.grad(loss, list(ref.parameters()))))
        row = {}
        if "in_proj_weight" in gs:
            row["qlinear.weight"], row["klinear.weight"], row["vlinear.weight"] = gs["in_proj_weight"].split(E)
        else:
            for s, lin in (("q", "qlinear"), ("k", "klinear"), ("v", "vlinear")):
                row[f"{lin}.weight"] = gs[f"{s}_proj_weight"]
        if c["bias"]:
            row["qlinear.bias"], row["klinear.bias"], row["vlinear.bias"] = gs["in_proj_bias"].split(E)
            row["out_proj.bias"] = gs["out_proj.bias"]
        row["out_proj.weight"] = gs["out_proj.weight"]
        if c["add_bias_kv"]:
            row["seq_bias_k.bias"] = gs["bias_k"].reshape(-1)
            row["seq_bias_v.bias"] = gs["bias_v"].reshape(-1)
        rows.append(row)
    return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}


@settings(max_examples=10, deadline=None)
@given(
    c=config,
    mask=st.sampled_from(["none", "bool", "float"]),
    reduction=st.sampled_from(["mean", "sum"]),
    functorch=st.booleans(),
    gsm_bf=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_per_sample_gradients_exact(c, mask, reduction, functorch, gsm_bf, seed):
    torch.manual_seed(seed)
    dp, ref = make_pair(c, dtype=torch.float64)
    b, lq, s = 3, 4, 5
    q, k, v = inputs(c, b, lq, s, torch.float64)
    m = {key: (t.double() if t.is_floating_point() else t) for key, t in masks(b, lq, s, mask).items()}
    w = torch.randn(q.shape[:-1] + (E,), dtype=torch.float64)
    # the projections are batch first whatever GradSampleModule's batch_first says
    gsm = GradSampleModule(dp, batch_first=gsm_bf, loss_reduction=reduction, force_functorch=functorch)
    out, _ = gsm(q, k, v, **m)
    per = (out * w).sum(-1).sum(1 if c["batch_first"] else 0)
    (per.mean() if reduction == "mean" else per.sum()).backward()
    want = reference_grads(ref, c, q, k, v, w, m)
    got = {n: p.grad_sample for n, p in dp.named_parameters()}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-9, msg=n)
