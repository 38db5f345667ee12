"""DPRNN / DPGRU / DPLSTM: same function and state dict as torch's layers, exact per-sample
gradients (checked against torch's own layers run on one sample at a time, float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dptorch.grad_sample import GradSampleModule
from dptorch.layers import DPGRU, DPLSTM, DPRNN

PAIRS = {"lstm": (DPLSTM, nn.LSTM), "gru": (DPGRU, nn.GRU), "rnn": (DPRNN, nn.RNN)}


def make_pair(kind, dtype=torch.float32, path="native", **kw):
    dp_cls, t_cls = PAIRS[kind]
    ref = t_cls(**kw).to(dtype)
    dp = dp_cls(**kw).to(dtype)
    dp.load_state_dict(ref.state_dict())
    dp.use_native_kernel = path == "native"
    assert (dp._native_kernel(torch.zeros(1, 1, kw["input_size"])) is None) == (path != "native")
    return dp, ref


def as_tuple(h):
    return h if isinstance(h, tuple) else (h,)


config = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["lstm", "gru", "rnn"]),
        "num_layers": st.integers(1, 2),
        "bidirectional": st.booleans(),
        "batch_first": st.booleans(),
        "bias": st.booleans(),
        "proj": st.booleans(),
        "relu": st.booleans(),
    }
)


def layer_kwargs(c, input_size=3, hidden_size=4):
    kw = dict(
        input_size=input_size,
        hidden_size=hidden_size,
        num_layers=c["num_layers"],
        bidirectional=c["bidirectional"],
        batch_first=c["batch_first"],
        bias=c["bias"],
    )
    if c["kind"] == "lstm" and c["proj"]:
        kw["proj_size"] = 2
    if c["kind"] == "rnn" and c["relu"]:
        kw["nonlinearity"] = "relu"
    return kw


def initial_state(kind, kw, b, dtype=torch.float32):
    n = kw["num_layers"] * (2 if kw["bidirectional"] else 1)
    h = torch.randn(n, b, kw.get("proj_size") or kw["hidden_size"], dtype=dtype)
    if kind == "lstm":
        return (h, torch.randn(n, b, kw["hidden_size"], dtype=dtype))
    return h


@settings(max_examples=16, deadline=None)
@given(
    c=config,
    with_hx=st.booleans(),
    seed=st.integers(0, 2**16),
    path=st.sampled_from(["native", "decomposed"]),
)
def test_forward_matches_torch(c, with_hx, seed, path):
    torch.manual_seed(seed)
    kw = layer_kwargs(c)
    dp, ref = make_pair(c["kind"], path=path, **kw)
    b, t = 3, 5
    x = torch.randn((b, t, 3) if c["batch_first"] else (t, b, 3))
    hx = initial_state(c["kind"], kw, b) if with_hx else None
    out_ref, h_ref = ref(x, hx)
    out_dp, h_dp = dp(x, hx)
    torch.testing.assert_close(out_dp, out_ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(as_tuple(h_dp), as_tuple(h_ref)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # inference path (values only)
        torch.testing.assert_close(dp(x, hx)[0], out_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["native", "decomposed"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_packed_unsorted_and_unbatched_match_torch(kind, path):
    torch.manual_seed(1)
    kw = dict(input_size=3, hidden_size=4, num_layers=2, bidirectional=True, batch_first=True)
    dp, ref = make_pair(kind, path=path, **kw)
    lengths = torch.tensor([2, 5, 1, 4])
    x = torch.randn(4, 5, 3)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    hx = initial_state(kind, kw, 4)
    out_ref, h_ref = ref(packed, hx)
    out_dp, h_dp = dp(packed, hx)
    assert torch.equal(out_dp.batch_sizes, out_ref.batch_sizes)
    assert torch.equal(out_dp.sorted_indices, out_ref.sorted_indices)
    torch.testing.assert_close(out_dp.data, out_ref.data, atol=1e-5, rtol=1e-5)
    for a, r in zip(as_tuple(h_dp), as_tuple(h_ref)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # unbatched (T, I) input
    o1, h1 = ref(x[0])
    o2, h2 = dp(x[0])
    torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-5)
    for a, r in zip(as_tuple(h2), as_tuple(h1)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_parameter_names_and_state_dict_round_trip():
    torch.manual_seed(0)
    ref = nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2)
    dp = DPLSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2)
    assert [n for n, _ in dp.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(dp.state_dict()) == list(ref.state_dict())
    assert list(dp.named_parameters(recurse=False)) == []  # the cells own them
    dp.load_state_dict(ref.state_dict())
    assert dp.weight_hh_l1_reverse is dp.l1_reverse.hh.weight
    assert torch.equal(dp.weight_hr_l0, ref.weight_hr_l0)
    # back into torch, and nested in a model
    ref2 = nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2)
    ref2.load_state_dict(dp.state_dict())
    for (n, a), (_, b) in zip(ref2.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    outer = nn.Sequential(nn.Identity(), DPLSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2))
    outer.load_state_dict(nn.Sequential(nn.Identity(), ref).state_dict())
    assert "1.weight_ih_l0" in dict(outer.named_parameters())
    assert torch.equal(outer[1].l0.ih.weight, ref.weight_ih_l0)
    # assignment under torch's name reaches the cell
    new = nn.Parameter(torch.zeros(20, 3))
    dp.weight_ih_l0 = new
    assert dp.l0.ih.weight is new and dp.weight_ih_l0 is new


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="proj_size"):
        DPGRU(3, 4, proj_size=2)
    with pytest.raises(RuntimeError, match="input_size"):
        DPLSTM(3, 4)(torch.randn(5, 2, 7))
    with pytest.raises(RuntimeError, match="h_0"):
        DPLSTM(3, 4)(torch.randn(5, 2, 3), (torch.zeros(1, 3, 4), torch.zeros(1, 2, 4)))


# ------------------------------------------------------------------ per-sample gradients
def per_sample_reference(kind, kw, state, xs, hxs, weights):
    """Per-sample gradients of each sample's loss, torch's layer run on that sample alone
    (float64): ``{torch param name: (B, *shape)}``."""
    t_cls = PAIRS[kind][1]
    ref = t_cls(**kw).double()
    ref.load_state_dict(state)
    grads = {n: [] for n, _ in ref.named_parameters()}
    for i, x in enumerate(xs):
        xi = x.unsqueeze(0) if kw["batch_first"] else x.unsqueeze(1)
        hx = None if hxs is None else tuple(h[:, i : i + 1] for h in as_tuple(hxs))
        if hx is not None and kind != "lstm":
            hx = hx[0]
        out, h = ref(xi, hx)
        out = out[0] if kw["batch_first"] else out[:, 0]
        loss = (out * weights["out"][i, : out.shape[0]]).sum()
        for j, hh in enumerate(as_tuple(h)):
            loss = loss + (hh[:, 0] * weights["h"][j][:, i]).sum()
        gs = torch.autograd.grad(loss, list(ref.parameters()))
        for (n, _), g in zip(ref.named_parameters(), gs):
            grads[n].append(g)
    return {n: torch.stack(g) for n, g in grads.items()}


def run_dp(dp, kind, kw, x_in, hxs, weights, lengths, reduction, force_functorch):
    gsm = GradSampleModule(
        dp, batch_first=kw["batch_first"], loss_reduction=reduction, force_functorch=force_functorch
    )
    out, h = gsm(x_in, hxs)
    if lengths is not None:
        out, _ = pad_packed_sequence(out, batch_first=True)
        t = out.shape[1]
        valid = (torch.arange(t)[None, :] < lengths[:, None]).to(out.dtype)[..., None]
        per = (out * weights["out"][:, :t] * valid).flatten(1).sum(1)
    elif kw["batch_first"]:
        per = (out * weights["out"]).flatten(1).sum(1)
    else:
        per = (out.transpose(0, 1) * weights["out"]).flatten(1).sum(1)
    for j, hh in enumerate(as_tuple(h)):
        per = per + (hh * weights["h"][j]).sum((0, 2))
    loss = per.mean() if reduction == "mean" else per.sum()
    loss.backward()
    return {n: p.grad_sample for n, p in dp.named_parameters()}


@settings(max_examples=10, deadline=None)
@given(
    c=config,
    packed=st.booleans(),
    with_hx=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    functorch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_per_sample_gradients_exact(c, packed, with_hx, reduction, functorch, seed):
    torch.manual_seed(seed)
    kw = layer_kwargs(c)
    dp, ref = make_pair(c["kind"], dtype=torch.float64, **kw)
    b, t_max = 4, 5
    lengths = torch.tensor([5, 2, 4, 1]) if packed else torch.full((b,), t_max)
    xs = [torch.randn(int(n), 3, dtype=torch.float64) for n in lengths]
    hxs = initial_state(c["kind"], kw, b, torch.float64) if with_hx else None
    feat = (2 if kw["bidirectional"] else 1) * (kw.get("proj_size") or kw["hidden_size"])
    n_states = kw["num_layers"] * (2 if kw["bidirectional"] else 1)
    weights = {
        "out": torch.randn(b, t_max, feat, dtype=torch.float64),
        "h": [
            torch.randn(n_states, b, s, dtype=torch.float64)
            for s in ([kw.get("proj_size") or 4, 4] if c["kind"] == "lstm" else [4])
        ],
    }
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    if packed:
        x_in = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    else:
        x_in = padded if kw["batch_first"] else padded.transpose(0, 1)
    got = run_dp(dp, c["kind"], kw, x_in, hxs, weights, lengths if packed else None, reduction, functorch)
    want = per_sample_reference(c["kind"], kw, ref.state_dict(), xs, hxs, weights)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-9, msg=n)


def test_gsm_batch_first_independent_of_layer_layout():
    """RNNLinear calls are batch first whatever GradSampleModule's batch_first says."""
    torch.manual_seed(3)
    kw = dict(input_size=3, hidden_size=4, batch_first=True)
    dp, ref = make_pair("gru", dtype=torch.float64, **kw)
    model = nn.Sequential(dp)
    gsm = GradSampleModule(model, batch_first=False, loss_reduction="sum")
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    out, _ = gsm(x)
    out.sum().backward()
    for i in range(3):
        ref.zero_grad()
        ref(x[i : i + 1])[0].sum().backward()
        torch.testing.assert_close(dp.weight_hh_l0.grad_sample[i], ref.weight_hh_l0.grad)


def test_dropout_between_layers_only_in_training():
    torch.manual_seed(0)
    dp, ref = make_pair("lstm", input_size=3, hidden_size=4, num_layers=2, dropout=0.5)
    x = torch.randn(5, 2, 3)
    dp.eval()
    ref.eval()
    torch.testing.assert_close(dp(x)[0], ref(x)[0], atol=1e-5, rtol=1e-5)
    dp.train()
    outs = torch.stack([dp(x)[0] for _ in range(3)])
    assert not torch.allclose(outs[0], outs[1])  # random masks


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_torch_kernel_only_while_nothing_observes_the_projections(mode):
    """Unobserved, DPLSTM runs torch's kernel; once a GradSampleModule (any mode), a hook of
    anyone's, a global module hook or a torch.func transform watches the RNNLinear calls, it
    runs its own recurrence, so every per-sample hook sees them."""
    from dptorch.grad_sample import wrap_model

    dp = DPLSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    assert dp._native_kernel(x) is torch.lstm
    assert DPGRU(3, 4)._native_kernel(x) is torch.gru
    assert DPRNN(3, 4, nonlinearity="relu")._native_kernel(x) is torch.rnn_relu
    gsm = wrap_model(nn.Sequential(dp), mode, batch_first=True, loss_reduction="sum")
    assert dp._native_kernel(x) is None
    gsm._close()
    assert dp._native_kernel(x) is torch.lstm
    handle = dp.l0.hh.register_forward_pre_hook(lambda *a: None)
    assert dp._native_kernel(x) is None
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    assert dp._native_kernel(x) is None
    handle.remove()
    seen = []
    torch.func.vmap(lambda xi: seen.append(dp._native_kernel(xi)) or xi)(x)
    assert seen == [None]
    dp.use_native_kernel = False
    assert dp._native_kernel(x) is None
