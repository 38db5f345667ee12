"""Seventh review round: silent failures found and fixed, each tried against the brute-force
per-sample computation (float64, noise 0) or shown to be refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleModule
from dptorch.optimizers import DPOptimizer

from .invariants import MODES, assert_exact_or_refused, dp_update

DT = torch.float64


def test_per_sample_rows_of_different_lengths_are_refused_not_padded():
    """*Finding*: per-sample gradients with fewer rows for one parameter (set by hand, or two
    wrapped models fed batches of different sizes under one optimizer) were zero-padded up to the
    longest, so row ``i`` of each parameter was clipped as one sample although nothing says the
    rows are the same records. Opacus fails on them (``torch.stack``); dptorch refuses with a
    ValueError that says why."""
    a, b = nn.Linear(3, 2).to(DT), nn.Linear(3, 2).to(DT)
    opt = DPOptimizer(
        torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    ga, gb = GradSampleModule(a), GradSampleModule(b)
    ga(torch.randn(4, 3, dtype=DT)).sum().backward()
    gb(torch.randn(3, 3, dtype=DT)).sum().backward()
    before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
    with pytest.raises(ValueError, match="different numbers of rows"):
        opt.step()
    for p, q in zip([*a.parameters(), *b.parameters()], before):
        assert torch.equal(p, q)


def test_equal_rows_under_one_optimizer_still_clip_jointly():
    """Two wrapped models with the same batch size under one optimizer: row ``i`` of both is
    clipped as one sample (the joint norm), as in Opacus."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2).to(DT), nn.Linear(3, 2).to(DT)
    opt = DPOptimizer(
        torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=4,
    )
    ga, gb = GradSampleModule(a), GradSampleModule(b)
    xa, xb = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    ga(xa).sum().backward()
    gb(xb).sum().backward()
    params = [*a.parameters(), *b.parameters()]
    gs = [p.grad_sample.reshape(4, -1) for p in params]
    norms = torch.cat(gs, dim=1).norm(dim=1)
    f = (0.3 / (norms + 1e-6)).clamp(max=1.0)
    want = [p.detach() - torch.einsum("b,b...->...", f, p.grad_sample) / 4 for p in params]
    opt.step()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the batch axis, followed
class _SeqFirstInside(nn.Module):
    """Batch-first input ``(B, T, 3)``; the middle layer runs sequence first, ``(T, B, 8)``, as
    XLNet, FSMT and Longformer do internally."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x).transpose(0, 1)
        h = torch.tanh(self.mid(h))
        return self.out(h.transpose(0, 1)).sum(1)


class _AttentionLike(nn.Module):
    """Moves dimensions the way attention does, with the batch staying first: must stay exact
    when ``T = B`` (no false refusal)."""

    def __init__(self, d: int = 4, heads: int = 2):
        super().__init__()
        self.qkv, self.proj, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 2)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.mT / 2, dim=-1)
        h = (att @ v).transpose(1, 2).reshape(b, t, d)
        h = self.proj(h)[:, :, None].squeeze(2)
        return self.head(h.movedim(1, 2).mean(-1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [4, 5])
def test_a_layer_fed_sequence_first_is_refused_even_when_t_equals_b(mode, t):
    """*Finding* (every mode, silent): a batch-first model whose middle layer takes
    ``(T, B, d)``. With ``T ≠ B`` the row count refused it; with ``T = B`` its positions were
    clipped as samples (1.25 relative error; XLNet released 2–3 C for one record). The trace now
    follows the batch axis through ``transpose`` and refuses the layer whatever T is."""
    torch.manual_seed(0)
    model = _SeqFirstInside().to(DT)
    x, y = torch.randn(4, t, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    with pytest.raises(ValueError, match=r"mid \(Linear\) receives .* batch is in dimension 1"):
        dp_update(model, mode, x, y, 0.5)


@pytest.mark.parametrize("mode", MODES)
def test_dimension_moves_that_keep_the_batch_first_stay_exact_at_t_equals_b(mode):
    torch.manual_seed(0)
    model = _AttentionLike().to(DT)
    x, y = torch.randn(4, 4, 4, dtype=DT), torch.randn(4, 2, dtype=DT)
    assert assert_exact_or_refused(model, mode, x, y, 0.3, must_work=True) == "exact"


class _TimeMajorMLP(nn.Module):
    """``(T, B, 3) → (B, 2)``: every layer sequence first, summed over time at the end."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))).sum(0)


@pytest.mark.parametrize("mode", MODES)
def test_sequence_first_throughout_with_batch_first_false_is_exact(mode):
    """``(T, B, d)`` everywhere, declared with ``batch_first=False``, at ``T = B``: exact."""
    torch.manual_seed(0)
    model = _TimeMajorMLP().to(DT)
    x, y = torch.randn(4, 4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    assert assert_exact_or_refused(model, mode, x, y, 0.3, batch_first=False,
                                   must_work=True) == "exact"


@pytest.mark.parametrize("mode", MODES)
def test_xlnet_is_refused_when_its_sequence_length_equals_the_batch(mode):
    """XLNet transposes ``input_ids`` to ``(T, B)`` before its embedding; at ``T = B`` dptorch
    released 2–3 C for one record (Opacus 1.6 raises). Now refused at the embedding."""
    tf = pytest.importorskip("transformers")
    cfg = tf.XLNetConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, d_inner=32,
                         dropout=0.0, num_labels=2)
    torch.manual_seed(0)
    model = tf.XLNetForSequenceClassification(cfg).to(DT)
    from dptorch.grad_sample import wrap_model

    gsm = wrap_model(model, mode, batch_first=True, loss_reduction="sum")
    ids = torch.randint(0, 32, (4, 4))
    with pytest.raises(ValueError, match=r"word_embedding \(Embedding\) receives .* dimension 1"):
        gsm(input_ids=ids)


class _WritesIntoPositions(nn.Module):
    """A position table called on ``[1, T]`` ids whose output the model scales in place (as
    Longformer's global attention does to a batch-1 projection): dptorch expands that output
    to the batch (a view), so the in-place op cannot run."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(10, 4), nn.Embedding(8, 4), nn.Linear(4, 2)

    def forward(self, ids):
        p = self.pos(torch.arange(ids.shape[1])[None])
        p.mul_(0.5)
        return self.out(self.tok(ids) + p).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_an_op_failing_on_an_expanded_output_names_the_layer(mode):
    """*Finding* (raw torch error): the failure now says which layer was expanded and why."""
    torch.manual_seed(0)
    model = _WritesIntoPositions().to(DT)
    ids, y = torch.randint(0, 10, (3, 5)), torch.randn(3, 2, dtype=DT)
    with pytest.raises(ValueError, match=r"mul_ .*expanded to the batch from the output of pos"):
        dp_update(model, mode, ids, y, 0.5)


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_hook_torch_func_cannot_run_is_refused_in_functorch_mode(mode):
    """*Finding* (raw torch error): Hugging Face's gradient checkpointing adds a forward hook
    calling ``output.requires_grad_()`` on the input embeddings, which ran inside torch.func's
    vmap in functorch mode (then a ValueError naming the layer and the fix). Since session 8
    torch.func recomputes the layer's forward without its own hooks: every mode is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    model[0].register_forward_hook(lambda m, i, o: o.requires_grad_(True))
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    assert assert_exact_or_refused(model, mode, x, y, 0.5, must_work=True) == "exact"


class _ScaledEmbedding(nn.Embedding):
    """Hugging Face's ``*ScaledWordEmbedding`` (M2M100, NLLB): a forward of its own."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


class _TiedScaled(nn.Module):
    def __init__(self, functional_use: bool = False):
        super().__init__()
        self.emb, self.head = _ScaledEmbedding(12, 4, padding_idx=1), nn.Linear(4, 12, bias=False)
        self.head.weight = self.emb.weight
        self.functional_use = functional_use

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        out = self.head(h)
        if self.functional_use:
            out = out + nn.functional.linear(h, self.emb.weight)
        return out.sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_a_head_tied_to_an_embedding_with_its_own_forward_is_exact(mode):
    """*Finding* (bk refused, giving a wrong reason): the tied weight was in bk's set of
    parameters that autograd must not differentiate (the Linear head's), but the embedding's own
    forward differentiates it. Exact in every mode now; a use outside both layers is still
    refused."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 12, (4, 5)), torch.randn(4, 12, dtype=DT)
    model = _TiedScaled().to(DT)
    assert assert_exact_or_refused(model, mode, ids, y, 0.5, must_work=True) == "exact"
    with pytest.raises(ValueError, match="emb.weight"):
        dp_update(_TiedScaled(functional_use=True).to(DT), mode, ids, y, 0.5)


class _EinsumSeqFirst(_SeqFirstInside):
    def forward(self, x):
        h = torch.einsum("btd->tbd", self.inp(x))
        return self.out(torch.tanh(self.mid(h)).transpose(0, 1)).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_an_einsum_that_moves_the_batch_is_followed(mode):
    torch.manual_seed(0)
    x, y = torch.randn(4, 4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    with pytest.raises(ValueError, match=r"mid \(Linear\) receives .* batch is in dimension 1"):
        dp_update(_EinsumSeqFirst().to(DT), mode, x, y, 0.5)


def _sw(x):
    return x.transpose(0, 1)


def _written_into(x):
    out = x.new_zeros(_sw(x).shape)
    out[:] = _sw(x)
    return out


#: ways to make a sequence-first ``(T, B, d)`` tensor that the trace cannot follow exactly
_LOSES_AXIS = {
    "stack_of_slices": lambda x: torch.stack([x[:, t] for t in range(x.shape[1])]),
    "stack_unbind": lambda x: torch.stack(list(x.unbind(1))),
    "as_strided": lambda x: _sw(x).contiguous().as_strided((x.shape[1], x.shape[0], x.shape[2]),
                                                          _sw(x).contiguous().stride()),
    "new_empty_copy": lambda x: x.new_empty(_sw(x).shape).copy_(_sw(x)),
    "setitem": _written_into,
    "advanced_index": lambda x: _sw(x)[torch.arange(x.shape[1])],
    "mixed_axes": lambda x: torch.gather(x, 0, torch.zeros_like(x, dtype=torch.long)) * 0 + _sw(x),
}


class _LosesAxis(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f, self.lin = f, nn.Linear(3, 3)

    def forward(self, x):
        return self.f(self.lin(self.f(x))).sum((1, 2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", sorted(_LOSES_AXIS))
def test_a_layer_input_whose_batch_axis_is_lost_is_refused_when_t_equals_b(how, mode):
    """*Finding of the second review* (every mode, silent at T = B: one record moved the update
    by about T·C): ops the trace does not follow exactly left the axis unknown, and an unknown
    axis passed. Now an input with several dimensions of the batch's size and an unknown axis
    is refused; a write into a tensor made elsewhere carries the written tensor's axis."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 4, 3, dtype=DT), torch.randn(4, dtype=DT)
    with pytest.raises(ValueError, match="receives an input of shape"):
        dp_update(_LosesAxis(_LOSES_AXIS[how]).to(DT), mode, x, y, 0.1)


class _BatchFirstRNN(nn.Module):
    """A hand-written recurrent net stacking its states batch first (``dim=1``); hidden size 4
    equals the batch size and the sequence length, on purpose."""

    def __init__(self):
        super().__init__()
        self.cell, self.head = nn.Linear(3 + 4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 4)
        hs = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], 1)))
            hs.append(h)
        return self.head(torch.stack(hs, dim=1)).sum((1, 2))


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_first_stack_of_states_stays_exact_when_sizes_coincide(mode):
    torch.manual_seed(0)
    x, y = torch.randn(4, 4, 3, dtype=DT), torch.randn(4, dtype=DT)
    assert assert_exact_or_refused(_BatchFirstRNN().to(DT), mode, x, y, 0.2, must_work=True) == "exact"


class _SeqFirstLSTM(nn.Module):
    """A batch-first model running a sequence-first DPLSTM (``batch_first=False``) with
    ``x.transpose(0, 1)``, or, with ``wrong``, handing that transposed tensor to a DPLSTM built
    ``batch_first=True`` (its recurrence then runs along the batch). Sizes all 4, on purpose."""

    def __init__(self, wrong: bool = False):
        super().__init__()
        from dptorch.layers import DPLSTM

        self.wrong = wrong
        self.lstm, self.head = DPLSTM(4, 4, batch_first=wrong), nn.Linear(4, 1)

    def forward(self, x):
        out, _ = self.lstm(x.transpose(0, 1))
        return self.head(out if self.wrong else out.transpose(0, 1)).sum((1, 2))


@pytest.mark.parametrize("mode", MODES)
def test_a_dp_layer_fed_against_its_own_layout_is_refused_and_used_right_is_exact(mode):
    """*Finding of the second review* (silent): a ``(T, B, d)`` tensor given to DPLSTM or
    DPMultiheadAttention built with ``batch_first=True`` was trained on (the layers fix their
    own layout, so the trace did not check them). Now refused; the right use stays exact at
    T = B = hidden size, where the DPLSTM's output axis comes from its layout."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 4, 4, dtype=DT), torch.randn(4, dtype=DT)
    assert assert_exact_or_refused(_SeqFirstLSTM().to(DT), mode, x, y, 0.3, must_work=True) == "exact"
    with pytest.raises(ValueError, match=r"lstm \(DPLSTM, batch_first=True\) receives"):
        dp_update(_SeqFirstLSTM(wrong=True).to(DT), mode, x, y, 0.3)


@pytest.mark.parametrize("mode", MODES)
def test_t5_with_decoder_length_equal_to_the_batch_is_not_refused(mode):
    """T5 shifts its labels into decoder ids through ``new_zeros`` and a sliced write; with the
    decoder length equal to the batch size those ids must keep a known batch axis (else the
    embedding's input would look ambiguous and be refused)."""
    tf = pytest.importorskip("transformers")
    cfg = tf.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(cfg).to(DT)
    from dptorch.grad_sample import wrap_model

    gsm = wrap_model(model, mode, batch_first=True, loss_reduction="sum")
    ids, labels = torch.randint(1, 32, (4, 6)), torch.randint(1, 32, (4, 4))
    out = gsm(input_ids=ids, labels=labels)
    assert out.logits.shape == (4, 4, 32)
