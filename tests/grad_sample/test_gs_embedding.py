"""Embedding / EmbeddingBag per-sample gradients against brute force."""

from __future__ import annotations

import pytest
import torch
from gs_helpers import MODES, assert_grad_samples_match
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.grad_sample import GradSampleModule


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=5, deadline=None)
@given(
    vocab=st.integers(2, 8), dim=st.integers(1, 4), batch=st.integers(1, 4),
    seq=st.lists(st.integers(1, 4), min_size=0, max_size=2), use_padding=st.booleans(),
    scale_grad_by_freq=st.booleans(), max_norm=st.sampled_from([None, 1.0]), seed=st.integers(0, 99),
)
def test_embedding_matches_brute_force(
    mode, loss_reduction, batch_first, vocab, dim, batch, seq, use_padding, scale_grad_by_freq,
    max_norm, seed,
):
    if mode == "ew" and not batch_first:
        pytest.skip("ExpandedWeights supports only batch_first=True")
    if mode == "ew" and scale_grad_by_freq:
        scale_grad_by_freq = False  # torch's ExpandedWeights rejects it
    if mode == "functorch":
        max_norm = None  # vmap cannot batch the in-place embedding_renorm_ (torch limitation)
    if (mode == "ew" or not batch_first) and not seq:  # ew: 1-D ids have "no batch" for torch
        seq = [2]
    torch.manual_seed(seed)
    padding_idx = vocab // 2 if use_padding else None
    layer = nn.Embedding(vocab, dim, padding_idx=padding_idx, max_norm=max_norm,
                         scale_grad_by_freq=scale_grad_by_freq).double()
    shape = (batch, *seq) if batch_first else (seq[0], batch, *seq[1:])
    ids = torch.randint(0, vocab, shape)
    if padding_idx is not None:
        ids.view(-1)[0] = padding_idx  # make sure the padding row is looked up
    assert_grad_samples_match(
        layer, (ids,), mode, batch_first, loss_reduction, check_reduced=not scale_grad_by_freq
    )


def test_embedding_padding_row_is_zero_and_repeats_count():
    layer = nn.Embedding(4, 2, padding_idx=0).double()
    gsm = GradSampleModule(layer, loss_reduction="sum")
    ids = torch.tensor([[0, 1, 1], [2, 0, 3]])
    out = gsm(ids)
    out.sum().backward()
    gs = layer.weight.grad_sample
    expected = torch.zeros(2, 4, 2, dtype=torch.float64)
    expected[0, 1] = 2.0
    expected[1, 2] = 1.0
    expected[1, 3] = 1.0
    torch.testing.assert_close(gs, expected)


@st.composite
def bag_cases(draw):
    mode = draw(st.sampled_from(["sum", "mean"]))
    vocab = draw(st.integers(2, 7))
    dim = draw(st.integers(1, 3))
    n_bags = draw(st.integers(1, 4))
    padding_idx = draw(st.sampled_from([None, 1]))
    two_d = draw(st.booleans())
    include_last = (not two_d) and draw(st.booleans())
    weighted = mode == "sum" and draw(st.booleans())
    if two_d:
        bag_len = draw(st.integers(1, 4))
        sizes = [bag_len] * n_bags
    else:
        sizes = [draw(st.integers(0, 3)) for _ in range(n_bags)]
    return dict(mode=mode, vocab=vocab, dim=dim, padding_idx=padding_idx, two_d=two_d,
                include_last=include_last, weighted=weighted, sizes=sizes,
                scale=False, seed=draw(st.integers(0, 99)))


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@settings(max_examples=20, deadline=None)
@given(case=bag_cases(), offsets_as_kwarg=st.booleans())
def test_embedding_bag_matches_brute_force(mode, loss_reduction, case, offsets_as_kwarg):
    torch.manual_seed(case["seed"])
    layer = nn.EmbeddingBag(
        case["vocab"], case["dim"], mode=case["mode"], padding_idx=case["padding_idx"],
        include_last_offset=case["include_last"], scale_grad_by_freq=case["scale"],
    ).double()
    sizes = case["sizes"]
    total = sum(sizes)
    ids = torch.randint(0, case["vocab"], (total,))
    if total:
        ids[0] = 1  # duplicates and (maybe) padding
        ids[-1] = 1
    psw = torch.rand(total, dtype=torch.float64) if case["weighted"] else None
    if case["two_d"]:
        if mode == "functorch" and psw is not None:
            psw = None
        ids2 = ids.view(len(sizes), sizes[0])
        psw2 = None if psw is None else psw.view_as(ids2)
        args = (ids2,) if psw2 is None else (ids2, None, psw2)
        assert_grad_samples_match(
            layer, args, mode, loss_reduction=loss_reduction, check_reduced=not case["scale"]
        )
        return
    if mode == "functorch":
        pytest.skip("functorch cannot split a 1-D input with offsets into samples")
    starts = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)[:-1]), dtype=torch.long)
    offsets = torch.cat([starts, torch.tensor([total])]) if case["include_last"] else starts

    def sample_inputs(b):
        lo, hi = int(starts[b]), int(starts[b]) + sizes[b]
        off = torch.tensor([0, hi - lo]) if case["include_last"] else torch.tensor([0])
        return (ids[lo:hi], off, None if psw is None else psw[lo:hi])

    if offsets_as_kwarg:
        kwargs = {"offsets": offsets, "per_sample_weights": psw}
        assert_grad_samples_match(layer, (ids,), mode, loss_reduction=loss_reduction,
                                  sample_inputs=lambda b: sample_inputs(b), kwargs=kwargs,
                                  brute_kwargs=False, check_reduced=not case["scale"])
    else:
        assert_grad_samples_match(layer, (ids, offsets, psw), mode,
                                  loss_reduction=loss_reduction, sample_inputs=sample_inputs,
                                  check_reduced=not case["scale"])


def test_embedding_bag_rejected_where_unsupported():
    with pytest.raises(NotImplementedError, match="EmbeddingBag"):
        assert_grad_samples_match(nn.EmbeddingBag(5, 2).double(), (torch.zeros(2, 3).long(),), "ew")
    for kwargs, msg in [({"mode": "max"}, "mode='max'"),
                        ({"scale_grad_by_freq": True}, "scale_grad_by_freq")]:
        gsm = GradSampleModule(nn.EmbeddingBag(5, 2, **kwargs))
        with pytest.raises(NotImplementedError, match=msg):
            gsm(torch.zeros(2, 3).long()).sum().backward()
