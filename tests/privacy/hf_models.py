"""Tiny Hugging Face models built from a config (random weights, no download), for exactness tests.

Every builder returns an :class:`HFCase`: the model (``train()`` mode, dropout 0, float64), a
``make_batch(B, seed) -> (inputs, labels)`` whose ``inputs`` go to the model's default forward
as ``model(**inputs)``, and a ``loss_fn(output, labels, reduction)``:

* ``reduction="none"``: ``(B,)``, the loss of each sample: the sum of its token cross-entropies
  (``-100`` labels ignored), or its cross-entropy for sequence classification;
* ``"sum"`` / ``"mean"``: the sum / mean of those over the batch.

Sizes: vocabulary :data:`V`, hidden 16, 2 layers, 2 heads, sequence length :data:`T`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

V = 64  #: vocabulary size
T = 6  #: sequence length (encoder side for T5)
T_DEC = 5  #: T5 decoder length
HIDDEN = 16
N_LABELS = 3
IGNORE = -100

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


@dataclass
class HFCase:
    """A tiny model with its batches and loss.

    ``float32_internals``: the model computes part of its forward in float32 whatever its dtype
    (Llama/Qwen2 RMSNorm, T5LayerNorm's variance). A method that back-propagates the same
    per-sample losses as the reference agrees with it to float64 round-off, but one that
    back-propagates rescaled losses (ghost clipping: ``Σ_b c_b loss_b``) differs by float32
    round-off (relative ~1e-7).
    """

    name: str
    model: nn.Module
    make_batch: Callable[[int, int], Batch]
    loss_fn: Callable[..., torch.Tensor]
    float32_internals: bool = False


# ----------------------------------------------------------------------------- losses
def _reduce(per_sample: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_sample
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "mean":
        return per_sample.mean()
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B,)``: for logits ``[B, L, V]`` and labels ``[B, L]``, the sum over each sample's
    tokens of the cross-entropy, tokens labelled ``-100`` left out."""
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return ce.view(labels.shape).sum(1)


def classification_loss(output: Any, labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of ``output.logits`` ``[B, N_LABELS]`` against ``labels`` ``[B]``."""
    return _reduce(F.cross_entropy(output.logits, labels, reduction="none"), reduction)


def masked_lm_loss(output: Any, labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Token cross-entropy of ``output.logits`` ``[B, L, V]`` against ``labels`` ``[B, L]``
    (no shift: MLM and seq2seq decoder labels are aligned with the logits)."""
    return _reduce(token_losses(output.logits, labels), reduction)


def causal_lm_loss(output: Any, labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Next-token cross-entropy: logits ``[B, L, V]`` at positions ``0..L-2`` against labels at
    ``1..L-1``."""
    return _reduce(token_losses(output.logits[:, :-1], labels[:, 1:]), reduction)


# ----------------------------------------------------------------------------- batches
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lengths(b: int, g: torch.Generator, length: int = T) -> torch.Tensor:
    """``(B,)`` lengths in ``[length - 3, length]``, the first sample full (so one row is
    unpadded and the batch keeps its length)."""
    n = torch.randint(length - 3, length + 1, (b,), generator=g)
    n[0] = length
    return n


def _mask(lengths: torch.Tensor, length: int = T) -> torch.Tensor:
    """``[B, length]`` right-padding attention mask: 1 for the first ``lengths[b]`` tokens."""
    return (torch.arange(length)[None, :] < lengths[:, None]).long()


def _cls_batch(padded: bool) -> Callable[[int, int], Batch]:
    def make(b: int, seed: int = 0) -> Batch:
        g = _gen(seed)
        inputs = {"input_ids": torch.randint(2, V, (b, T), generator=g)}
        if padded:
            inputs["attention_mask"] = _mask(_lengths(b, g))
        return inputs, torch.randint(0, N_LABELS, (b,), generator=g)

    return make


def _mlm_batch(b: int, seed: int = 0) -> Batch:
    """Labels: the original token at about half of the positions (at least one per sample),
    ``-100`` elsewhere."""
    g = _gen(seed)
    ids = torch.randint(2, V, (b, T), generator=g)
    keep = torch.rand(b, T, generator=g) < 0.5
    keep[:, 0] = True
    return {"input_ids": ids}, torch.where(keep, ids, torch.full_like(ids, IGNORE))


def _causal_batch(padded: bool) -> Callable[[int, int], Batch]:
    def make(b: int, seed: int = 0) -> Batch:
        g = _gen(seed)
        ids = torch.randint(2, V, (b, T), generator=g)
        inputs = {"input_ids": ids}
        labels = ids.clone()
        if padded:
            mask = _mask(_lengths(b, g))
            inputs["attention_mask"] = mask
            labels[mask == 0] = IGNORE
        return inputs, labels

    return make


def _t5_batch(padded: bool) -> Callable[[int, int], Batch]:
    """``labels`` ``[B, T_DEC]`` also go into the inputs: the model builds its decoder inputs
    by shifting them right (its default training forward)."""

    def make(b: int, seed: int = 0) -> Batch:
        g = _gen(seed)
        inputs = {"input_ids": torch.randint(2, V, (b, T), generator=g)}
        labels = torch.randint(2, V, (b, T_DEC), generator=g)
        if padded:
            inputs["attention_mask"] = _mask(_lengths(b, g))
        inputs["labels"] = labels
        return inputs, labels

    return make


# ----------------------------------------------------------------------------- models
def _finish(model: nn.Module) -> nn.Module:
    return model.double().train()


def bert_cls(padded: bool = False) -> HFCase:
    """BertForSequenceClassification; ``padded``: right-padded attention masks."""
    cfg = tf.BertConfig(
        vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * HIDDEN, max_position_embeddings=16, num_labels=N_LABELS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
    )
    return HFCase(
        "bert_cls_padded" if padded else "bert_cls",
        _finish(tf.BertForSequenceClassification(cfg)),
        _cls_batch(padded),
        classification_loss,
    )


def bert_mlm() -> HFCase:
    """BertForMaskedLM, decoder weight tied to the word embeddings (and the prediction bias
    registered both in ``cls.predictions`` and in ``cls.predictions.decoder``)."""
    cfg = tf.BertConfig(
        vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * HIDDEN, max_position_embeddings=16, tie_word_embeddings=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = tf.BertForMaskedLM(cfg)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    return HFCase("bert_mlm", _finish(model), _mlm_batch, masked_lm_loss)


def gpt2(padded: bool = False) -> HFCase:
    """GPT2LMHeadModel, LM head tied to the token embeddings; ``padded``: right padding
    (labels ``-100`` there)."""
    cfg = tf.GPT2Config(
        vocab_size=V, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True,
    )
    model = tf.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return HFCase(
        "gpt2_padded" if padded else "gpt2", _finish(model), _causal_batch(padded), causal_lm_loss
    )


def t5(padded: bool = False) -> HFCase:
    """T5ForConditionalGeneration (relative attention bias in the first layer of encoder and
    decoder, LM head tied); ``padded``: right-padded encoder attention masks."""
    cfg = tf.T5Config(
        vocab_size=V, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return HFCase(
        "t5_padded" if padded else "t5",
        _finish(tf.T5ForConditionalGeneration(cfg)),
        _t5_batch(padded),
        masked_lm_loss,
        float32_internals=True,
    )


def mpnet_cls() -> HFCase:
    """MPNetForSequenceClassification (sentence-transformers' usual backbone): a relative
    position bias table shared by all layers, looked up once per forward (32 buckets, the
    number ``compute_position_bias`` uses whatever the config says)."""
    cfg = tf.MPNetConfig(
        vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * HIDDEN, max_position_embeddings=16, num_labels=N_LABELS,
        relative_attention_num_buckets=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1,
    )
    return HFCase(
        "mpnet_cls", _finish(tf.MPNetForSequenceClassification(cfg)), _cls_batch(False),
        classification_loss,
    )


def llama() -> HFCase:
    """LlamaForCausalLM (grouped-query attention, rotary positions, untied LM head)."""
    cfg = tf.LlamaConfig(
        vocab_size=V, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=0.0,
    )
    return HFCase(
        "llama", _finish(tf.LlamaForCausalLM(cfg)), _causal_batch(False), causal_lm_loss,
        float32_internals=True,
    )


def qwen2() -> HFCase:
    """Qwen2ForCausalLM (q/k/v biases, rotary positions, LM head tied as in Qwen2-0.5B)."""
    cfg = tf.Qwen2Config(
        vocab_size=V, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=0.0,
        tie_word_embeddings=True,
    )
    model = tf.Qwen2ForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return HFCase(
        "qwen2", _finish(model), _causal_batch(False), causal_lm_loss, float32_internals=True
    )


BUILDERS: dict[str, Callable[[], HFCase]] = {
    "bert_cls": bert_cls,
    "bert_cls_padded": lambda: bert_cls(padded=True),
    "bert_mlm": bert_mlm,
    "gpt2": gpt2,
    "gpt2_padded": lambda: gpt2(padded=True),
    "t5": t5,
    "t5_padded": lambda: t5(padded=True),
    "mpnet_cls": mpnet_cls,
    "llama": llama,
    "qwen2": qwen2,
}


def build(name: str, seed: int = 0) -> HFCase:
    """The case ``name`` of :data:`BUILDERS`, its random weights drawn with ``seed``."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BUILDERS[name]()
