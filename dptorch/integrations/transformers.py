"""Differentially private training with the Hugging Face ``Trainer``: :class:`DPTrainer`.

A Trainer script becomes private by swapping ``Trainer`` for ``DPTrainer`` and adding the
privacy arguments::

    trainer = DPTrainer(
        model=model, args=TrainingArguments(...), train_dataset=train, eval_dataset=test,
        data_collator=collator,
        target_epsilon=8.0, target_delta=1e-5,   # or noise_multiplier=...
        max_grad_norm=1.0,                        # per-sample clipping bound C
    )
    trainer.train()            # logs "epsilon" with the loss (TensorBoard, W&B, log_history)
    trainer.get_epsilon()

What changes with respect to ``Trainer`` (details in docs/integrations.md):

* **Batches.** The training set is Poisson-sampled (each record joins each step's batch
  independently with probability ``q``): the *logical* batch has ``per_device_train_batch_size ×
  gradient_accumulation_steps`` records in expectation, and ``q = 1 / ceil(N / that)``. Each of
  the Trainer's ``gradient_accumulation_steps`` micro-steps gets one slice of the logical batch,
  cut again into *physical* batches of at most ``per_device_train_batch_size`` records, with
  ``BatchMemoryManager`` semantics: every physical batch is clipped and accumulated, the noise,
  the update and the accounting happen once per logical batch.
* **Loss.** Each record's loss is computed on its own (``compute_per_sample_loss``): the mean
  (``token_loss="mean"``, default) or sum of its token cross-entropies for causal-LM, masked-LM,
  token-classification and seq2seq heads (labels ``-100`` ignored), or its classification /
  regression loss for sequence-classification heads, from the model's default forward
  (``model(**inputs)``, position ids and attention masks as the model builds them). The loss the
  model computes itself averages the tokens of the *whole batch*, which makes one record's
  gradient depend on the lengths of the others: it is never used for training.
* **Clipping.** Per sample, in ``grad_sample_mode`` (``"bk"`` by default: one backward pass;
  also ``"hooks"``, ``"functorch"``, ``"ghost"``, ``"ew"``). The Trainer's own gradient
  clipping (``TrainingArguments.max_grad_norm``) is turned off, and so is its ``grad_norm`` log:
  both act on the gradient sum *before* the noise, whose norm is not private.
* **Accounting.** ``epsilon`` is added to every ``Trainer.log`` call. The accountant's history,
  the noise and sampling generators and the DP settings are saved in every checkpoint
  (``dptorch_privacy.pt``) and restored by ``train(resume_from_checkpoint=...)``; a checkpoint
  without them is refused (it would restart ε at 0). Poisson batches are independent draws, so
  resuming never re-reads "the rest of the epoch" (``ignore_data_skip`` is forced on).
* **PEFT.** A ``peft`` model trains its adapters (and ``modules_to_save`` heads) only; their
  per-sample gradients are exact (tested against a per-sample loop, LoRA on BERT and Llama).

Refused with a clear error (rather than trained wrongly): ``fp16`` (the loss scaler would clip
scaled gradients), several processes or GPUs, DeepSpeed/FSDP, ``auto_find_batch_size``,
activation checkpointing, ``torch_compile``, ``compute_loss_func`` (a batch loss; pass
``per_sample_loss`` instead), ``model_init`` (hyperparameter search spends privacy that is not
accounted), an ``IterableDataset``, ``neftune_noise_alpha`` (its noise scale depends on the
padded length of the batch), packed batches (``DataCollatorWithFlattening``: one row holds
several records, which would be clipped as one).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import secrets
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from . import release, require

require("hf", "transformers", "accelerate", what="dptorch.integrations.transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

from ..accountants import get_noise_multiplier  # noqa: E402
from ..privacy_engine import PrivacyEngine  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = [
    "DPTrainer",
    "PrivacyArguments",
    "PRIVACY_STATE_NAME",
    "check_packing",
    "check_padding",
    "detect_task",
    "per_sample_loss",
]

#: file of a Trainer checkpoint folder that holds the privacy state
PRIVACY_STATE_NAME = "dptorch_privacy.pt"
IGNORE_INDEX = -100
_MODES = ("bk", "hooks", "functorch", "ghost", "ew")
_TASKS = ("causal_lm", "masked_lm", "token_classification", "seq2seq", "sequence_classification")


# ----------------------------------------------------------------------------- arguments
@dataclass
class PrivacyArguments:
    """The privacy settings of a :class:`DPTrainer` (a dataclass, so that
    ``HfArgumentParser((TrainingArguments, PrivacyArguments))`` turns them into flags).

    Give ``target_epsilon`` (σ is then calibrated for the whole run: ``max_steps``, or
    ``num_train_epochs`` epochs of ``1/q`` steps) or ``noise_multiplier``, not both.
    """

    target_epsilon: float | None = field(
        default=None, metadata={"help": "ε to reach at the end of training (σ is calibrated)."}
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "δ of the guarantee; default 1 / (10 N)."}
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "σ, noise std relative to the clipping bound."}
    )
    per_sample_max_grad_norm: float | None = field(
        default=None, metadata={"help": "C, the per-sample gradient clipping bound (required)."}
    )
    grad_sample_mode: str = field(
        default="bk", metadata={"help": "bk (default), hooks, functorch, ghost or ew."}
    )
    accountant: str = field(default="prv", metadata={"help": "prv, pld, rdp or gdp."})
    secure_mode: bool = field(
        default=False, metadata={"help": "Noise and sampling from the OS CSPRNG."}
    )
    noise_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the noise and sampling generators, for reproducible noise "
                  "(default: fresh OS entropy per run). Unsafe for models you release: two runs "
                  "with one seed on neighbouring data add the same noise, which cancels in the "
                  "difference of the two models."},
    )
    token_loss: str = field(
        default="mean",
        metadata={"help": "A sequence's loss: mean (default) or sum of its token losses."},
    )
    epsilon_tolerance: float = field(
        default=0.01, metadata={"help": "Precision of the σ calibration."}
    )

    def check(self) -> None:
        """Raises ``ValueError`` on inconsistent or out-of-range settings."""
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "DPTrainer needs exactly one of target_epsilon (σ is then calibrated for the "
                "run) and noise_multiplier; got "
                f"target_epsilon={self.target_epsilon!r}, noise_multiplier={self.noise_multiplier!r}."
            )
        c = self.per_sample_max_grad_norm
        if c is None or isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
            raise ValueError(
                "DPTrainer needs max_grad_norm (PrivacyArguments.per_sample_max_grad_norm), the "
                f"per-sample clipping bound C > 0; got {c!r}."
            )
        if self.grad_sample_mode not in _MODES:
            raise ValueError(
                f"grad_sample_mode must be one of {_MODES} for DPTrainer, got "
                f"{self.grad_sample_mode!r}."
            )
        if self.token_loss not in ("mean", "sum"):
            raise ValueError(f"token_loss must be 'mean' or 'sum', got {self.token_loss!r}.")
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must lie in (0, 1), got {self.target_delta!r}.")
        if self.noise_seed is not None:
            if isinstance(self.noise_seed, bool) or not isinstance(self.noise_seed, int):
                raise ValueError(f"noise_seed must be an int or None, got {self.noise_seed!r}.")
            if self.secure_mode:
                raise ValueError(
                    "noise_seed cannot be used with secure_mode: secure_mode draws the noise and "
                    "the sampling from the OS CSPRNG, which has no seed."
                )


# ----------------------------------------------------------------------------- per-sample losses
def detect_task(model: nn.Module) -> str | None:
    """The head of a Hugging Face model (a ``peft`` model's base model): one of ``"causal_lm"``,
    ``"masked_lm"``, ``"token_classification"``, ``"seq2seq"``, ``"sequence_classification"``,
    or ``None`` when it is none of these."""
    base = model
    get_base = getattr(model, "get_base_model", None)  # peft
    if callable(get_base):
        base = get_base()
    name = type(base).__name__

    def named(mapping_name: str) -> bool:
        mapping = getattr(modeling_auto, mapping_name, {})
        for v in mapping.values():
            if name == v or (isinstance(v, (tuple, list)) and name in v):
                return True
        return False

    if named("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES") or name.endswith(
        "ForSequenceClassification"
    ):
        return "sequence_classification"
    if named("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES") or name.endswith(
        "ForTokenClassification"
    ):
        return "token_classification"
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False) and (
        named("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")
        or name.endswith("ForConditionalGeneration")
    ):
        return "seq2seq"
    if named("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") or name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if named("MODEL_FOR_MASKED_LM_MAPPING_NAMES") or name.endswith("ForMaskedLM"):
        return "masked_lm"
    return None


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, Mapping) and "logits" in outputs:
        logits = outputs["logits"]
    elif hasattr(outputs, "logits"):
        logits = outputs.logits
    else:
        logits = outputs[0]
    # as the models' own losses: half-precision logits are upcast
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def token_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``(B,)``: each sequence's token cross-entropies (logits ``[B, T, V]``, labels ``[B, T]``;
    ``shift``: position ``t`` predicts label ``t + 1``), ``-100`` labels left out, reduced per
    sequence by ``"mean"`` (over its labelled tokens; 0 if it has none) or ``"sum"``."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    labels = labels.to(logits.device)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(labels.shape)
    per_seq = ce.reshape(labels.shape[0], -1).sum(1)
    if reduction == "sum":
        return per_seq
    count = (labels != IGNORE_INDEX).reshape(labels.shape[0], -1).sum(1).clamp(min=1)
    return per_seq / count.to(per_seq.dtype)


def per_sample_loss(
    task: str,
    outputs: Any,
    labels: torch.Tensor,
    *,
    config: Any = None,
    token_loss: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``(B,)``, the loss of each record of the batch for a head of type ``task``
    (:func:`detect_task`); sequence classification follows the model's ``problem_type`` as the
    Hugging Face models do (regression: MSE, single label: cross-entropy, multi-label: binary
    cross-entropy averaged over the labels)."""
    logits = _logits(outputs)
    if task == "causal_lm":
        return token_losses(logits, labels, shift=True, reduction=token_loss,
                            label_smoothing=label_smoothing)
    if task in ("masked_lm", "token_classification", "seq2seq"):
        return token_losses(logits, labels, shift=False, reduction=token_loss,
                            label_smoothing=label_smoothing)
    if task != "sequence_classification":
        raise ValueError(f"Unknown task {task!r}; expected one of {_TASKS}.")
    labels = labels.to(logits.device)
    num_labels = getattr(config, "num_labels", logits.shape[-1])
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    b = logits.shape[0]
    if problem == "regression":
        pred = logits.squeeze(-1) if num_labels == 1 else logits
        target = labels.to(pred.dtype).view_as(pred)
        return F.mse_loss(pred, target, reduction="none").reshape(b, -1).mean(1)
    if problem == "single_label_classification":
        return F.cross_entropy(
            logits.view(b, -1), labels.view(-1), reduction="none", label_smoothing=label_smoothing
        )
    return F.binary_cross_entropy_with_logits(
        logits, labels.to(logits.dtype), reduction="none"
    ).reshape(b, -1).mean(1)


class _PrecomputedLoss(nn.Module):
    """The criterion handed to ghost clipping's loss wrapper: its input already holds the
    per-sample losses ``(B,)``; it only applies ``reduction``."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, losses: torch.Tensor, _target: Any = None) -> torch.Tensor:
        if self.reduction == "none":
            return losses
        return losses.sum() if self.reduction == "sum" else losses.mean()


# ----------------------------------------------------------------------------- batches
def _rows(batch: Any) -> int:
    """The number of records of a collated batch: dimension 0 of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    for v in values:
        if isinstance(v, (torch.Tensor, Mapping, list, tuple)):
            return _rows(v)
    raise ValueError("DPTrainer: a training batch holds no tensor; cannot tell its size.")


def _slice(obj: Any, start: int, stop: int, rows: int) -> Any:
    """Records ``start:stop`` of a collated batch of ``rows`` records (tensors and lists with
    ``rows`` entries are sliced along dimension 0, dicts entry by entry)."""
    if isinstance(obj, torch.Tensor):
        return obj[start:stop] if obj.dim() and obj.shape[0] == rows else obj
    if isinstance(obj, Mapping):
        return {k: _slice(v, start, stop, rows) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and len(obj) == rows:
        return type(obj)(obj[start:stop]) if isinstance(obj, list) else tuple(obj[start:stop])
    return obj


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` near-equal consecutive chunks of ``range(n)``."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


class _Slice(dict):
    """One micro-step of a logical Poisson batch: a dict batch (what the Trainer expects) with
    ``rows_after``, the number of records of the logical batch in the later slices, and
    ``logical_size``."""

    rows_after: int = 0
    logical_size: int = 0
    first: bool = True


class _PoissonSlices:
    """What ``DPTrainer.get_train_dataloader`` returns: every logical batch of the Poisson loader
    cut into ``n_slices`` consecutive slices, one per Trainer micro-step
    (``gradient_accumulation_steps``). ``len()`` is ``n_slices ×`` the number of steps per
    epoch, so the Trainer steps once per logical batch."""

    def __init__(self, loader: DataLoader, n_slices: int):
        self.loader = loader
        self.n_slices = n_slices
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return len(self.loader) * self.n_slices

    def __iter__(self):
        for batch in self.loader:
            rows = _rows(batch)
            bounds = _split(rows, self.n_slices)
            for i, (a, b) in enumerate(bounds):
                piece = _Slice(_slice(batch, a, b, rows) if isinstance(batch, Mapping) else
                               {"_batch": _slice(batch, a, b, rows)})
                piece.rows_after = rows - b
                piece.logical_size = rows
                piece.first = i == 0
                yield piece


def check_padding(batch: Mapping[str, Any]) -> None:
    """Refuses a batch whose ``attention_mask`` has a 0 before a 1 in some row (left padding)
    while it gives no ``position_ids``: the Hugging Face models then number the positions from
    the start of the *padded* row, so a record's loss depends on how much padding the longest
    record of its Poisson batch adds, and adding or removing one record changes the clipped
    gradients of the others (the DP sensitivity bound no longer holds)."""
    mask = batch.get("attention_mask")
    if "position_ids" in batch or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    if mask.shape[1] > 1 and bool(((mask[:, :-1] == 0) & (mask[:, 1:] != 0)).any()):
        raise ValueError(
            "DPTrainer: a training batch is left-padded (its attention_mask has a 0 before a 1) "
            "and gives no position_ids. The model would number each record's tokens from the "
            "start of the padded row, so a record's loss would depend on the longest record of "
            "its Poisson batch and one record would change the others' clipped gradients, which "
            "breaks the DP guarantee. Pad on the right (tokenizer.padding_side = 'right'), or "
            "have the data collator add position_ids computed per record."
        )


#: keys of a padding-free (packed) batch: the record boundaries inside a row
#: (``DataCollatorWithFlattening``, TRL's ``padding_free``)
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _packed_error(what: str) -> ValueError:
    """The refusal of packed batches (:func:`check_packing`); ``what`` says how they were found."""
    return ValueError(
        f"DPTrainer: the training batches are packed ({what}): several records share one row "
        "(e.g. DataCollatorWithFlattening or a padding-free collator). Under DP-SGD the rows are "
        "the records: the records of a row would be clipped together as one sample, so one "
        "record could change the released gradient by up to 2C while the noise is calibrated "
        "to C. Use a padding collator, one record per row (e.g. DataCollatorWithPadding, or "
        "DataCollatorForLanguageModeling without flattening / padding_free)."
    )


def check_packing(batch: Mapping[str, Any]) -> None:
    """Refuses a packed (padding-free) batch: one row holding several records, as
    ``DataCollatorWithFlattening`` builds (the whole batch in one row ``[1, ΣL]``). It is
    recognised by a key marking record boundaries (``cu_seq_lens_q/k``, ``max_length_q/k``,
    ``seq_idx``) or by ``position_ids`` that drop inside a row between two attended tokens (a
    new record starts; padding, masked by ``attention_mask``, is not counted). DP-SGD clips
    each *row* as one sample, so the records of a row would be clipped jointly: one record
    could move the released sum by up to 2C while the noise is calibrated to C."""
    found = [k for k in _PACKING_KEYS if k in batch]
    pos = batch.get("position_ids")
    if not found and isinstance(pos, torch.Tensor) and 1 <= pos.dim() <= 2 and pos.shape[-1] > 1:
        drop = pos[..., 1:] < pos[..., :-1]
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape == pos.shape:
            drop &= (mask[..., 1:] != 0) & (mask[..., :-1] != 0)
        if bool(drop.any()):
            found = ["position_ids restart inside a row"]
    if found:
        raise _packed_error(", ".join(found))


def _derived_seed(seed: int, tag: str) -> int:
    digest = hashlib.sha256(f"dptorch:{seed}:{tag}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


# ----------------------------------------------------------------------------- the trainer
class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD (see the module docstring).

    Args:
        *args, **kwargs: those of ``transformers.Trainer``.
        privacy_args: a :class:`PrivacyArguments`; the keyword arguments below override it.
        target_epsilon, target_delta, noise_multiplier: the guarantee (``target_delta``
            defaults to ``1 / (10 N)``); give ``target_epsilon`` or ``noise_multiplier``.
        max_grad_norm: C, the per-sample clipping bound (required). Not the Trainer's
            ``TrainingArguments.max_grad_norm``, which DPTrainer turns off.
        grad_sample_mode: ``"bk"`` (default), ``"hooks"``, ``"functorch"``, ``"ghost"``, ``"ew"``.
        accountant: ``"prv"`` (default), ``"pld"``, ``"rdp"``, ``"gdp"``.
        secure_mode: noise and Poisson sampling from the OS CSPRNG (else from ``torch``
            generators seeded from fresh OS entropy, or from ``noise_seed``; their states are
            saved in checkpoints, so a resumed run continues them).
        noise_seed: seed of the noise and sampling generators, for reproducible noise. Not
            ``args.seed``: two runs with the same seed on neighbouring data (a retraining after
            a deletion, a sweep over C or the learning rate) add the *same* noise, which cancels
            in the difference of the two models and reveals a record's clipped gradient. Use it
            for debugging and tests, never for models you release.
        token_loss: a sequence's loss is the ``"mean"`` (default) or ``"sum"`` of its token
            losses.
        per_sample_loss: ``fn(outputs, labels) -> (B,)`` losses, for heads that
            :func:`detect_task` does not know (or override :meth:`compute_per_sample_loss`).

    Attributes (after the first ``train()`` / ``get_train_dataloader()``): ``privacy_engine``,
    ``dp_module`` (the GradSampleModule around ``model``), ``dp_optimizer``, ``noise_multiplier``,
    ``sample_rate``, ``target_delta``.
    """

    def __init__(
        self,
        *args: Any,
        privacy_args: PrivacyArguments | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        noise_multiplier: float | None = None,
        max_grad_norm: float | None = None,
        grad_sample_mode: str | None = None,
        accountant: str | None = None,
        secure_mode: bool | None = None,
        token_loss: str | None = None,
        noise_seed: int | None = None,
        per_sample_loss: Callable[[Any, Any], torch.Tensor] | None = None,
        **kwargs: Any,
    ):
        pa = copy.copy(privacy_args) if privacy_args is not None else PrivacyArguments()
        for name, value in (
            ("target_epsilon", target_epsilon), ("target_delta", target_delta),
            ("noise_multiplier", noise_multiplier), ("per_sample_max_grad_norm", max_grad_norm),
            ("grad_sample_mode", grad_sample_mode), ("accountant", accountant),
            ("secure_mode", secure_mode), ("token_loss", token_loss), ("noise_seed", noise_seed),
        ):
            if value is not None:
                setattr(pa, name, value)
        pa.check()
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "DPTrainer cannot use compute_loss_func: it returns one loss for the whole batch, "
                "and DP-SGD needs each record's loss. Pass per_sample_loss=fn(outputs, labels) "
                "returning a (batch,) tensor, or override DPTrainer.compute_per_sample_loss."
            )
        if kwargs.get("model_init") is not None or len(args) > 6 and args[6] is not None:
            raise NotImplementedError(
                "DPTrainer does not support model_init (hyperparameter search): every trial "
                "trains on the private data, and the privacy spent by the search is not "
                "accounted. Tune on public data, or account for the trials yourself."
            )
        args = list(args)
        training_args = args[1] if len(args) > 1 else kwargs.get("args")
        if training_args is None:
            training_args = TrainingArguments(output_dir="tmp_trainer")
        training_args = self._private_training_args(training_args)
        if len(args) > 1:
            args[1] = training_args
        else:
            kwargs["args"] = training_args
        self.privacy_args = pa
        self.per_sample_loss = per_sample_loss
        self.privacy_engine: PrivacyEngine | None = None
        self.dp_module: nn.Module | None = None
        self.dp_optimizer: Any = None
        self.noise_multiplier: float | None = None
        self.sample_rate: float | None = None
        self.target_delta: float | None = pa.target_delta
        self._dp_criterion: Any = None
        self._private = False  # the model is wrapped (hooks on) for this train() call
        self._dp_loader: DataLoader | None = None
        self._num_records: int | None = None
        self._task: str | None = None
        self._epsilon_cache: tuple[tuple[int, float], float] | None = None
        # Not from args.seed (42 by default): two runs on neighbouring data would add the same
        # noise, and the difference of the two models would reveal a record's clipped gradient.
        self._noise_generator = None
        self._sampling_generator = None
        if not pa.secure_mode:
            if pa.noise_seed is None:
                noise_seed, sampling_seed = secrets.randbits(63), secrets.randbits(63)
            else:
                noise_seed = _derived_seed(pa.noise_seed, "noise")
                sampling_seed = _derived_seed(pa.noise_seed, "sampling")
            self._noise_generator = torch.Generator().manual_seed(noise_seed)
            self._sampling_generator = torch.Generator().manual_seed(sampling_seed)
        super().__init__(*args, **kwargs)
        self._check_supported()
        # the per-sample losses are computed here; the Trainer need not count tokens for them
        self.model_accepts_loss_kwargs = False

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _private_training_args(args: TrainingArguments) -> TrainingArguments:
        """A copy of ``args`` with the Trainer's global gradient clipping off and data skipping
        on resume off; refuses ``fp16``."""
        if getattr(args, "fp16", False):
            raise ValueError(
                "DPTrainer does not support fp16: its loss scaler multiplies the loss, so the "
                "per-sample gradients would be clipped at the wrong scale. Train in float32 "
                "(or bf16, which needs no scaler)."
            )
        args = copy.copy(args)
        if args.max_grad_norm and args.max_grad_norm > 0:
            logger.info(
                "DPTrainer: TrainingArguments.max_grad_norm=%s (global clipping of the summed "
                "gradient) is turned off; the per-sample bound is DPTrainer's max_grad_norm.",
                args.max_grad_norm,
            )
        args.max_grad_norm = 0.0
        # Poisson batches are independent draws: a resumed run draws new batches instead of
        # re-drawing (and skipping) the batches of the interrupted epoch
        args.ignore_data_skip = True
        return args

    def _check_supported(self) -> None:
        args = self.args
        problems = []
        if args.world_size > 1 or args.n_gpu > 1:
            problems.append(
                f"training on several processes or GPUs (world_size={args.world_size}, "
                f"n_gpu={args.n_gpu}): use dptorch.PrivacyEngine with DistributedDataParallel "
                "(docs/distributed.md)"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            problems.append("DeepSpeed / FSDP")
        if args.auto_find_batch_size:
            problems.append("auto_find_batch_size (the batch size fixes the sampling rate)")
        if getattr(args, "activation_checkpointing", False) or getattr(
            args, "gradient_checkpointing", False
        ):
            problems.append(
                "activation (gradient) checkpointing, which re-runs layers inside the backward "
                "pass that the per-sample hooks record"
            )
        if getattr(args, "torch_compile", False):
            problems.append("torch_compile")
        if getattr(self.accelerator, "scaler", None) is not None:
            problems.append("a gradient scaler (fp16)")
        if problems:
            raise NotImplementedError(
                "DPTrainer does not support " + "; ".join(problems) + "."
            )
        if getattr(args, "bf16", False):
            warnings.warn(
                "DPTrainer with bf16: per-sample gradients and clipping run under autocast; their "
                "precision has not been verified against float32.",
                UserWarning,
                stacklevel=3,
            )

    def _check_before_training(self) -> None:
        """Refuses, when ``train()`` starts (before NEFTune or the per-sample hooks touch the
        model), what couples a record's clipped gradient to the other records of its batch:

        * ``neftune_noise_alpha``: NEFTune adds embedding noise of half-width
          ``alpha / sqrt(T·d)``, T the padded length of the batch, i.e. of its longest record;
        * a ``DataCollatorWithFlattening`` (packed rows; :func:`check_packing` refuses any
          other packed batch at the first training step)."""
        alpha = getattr(self, "neftune_noise_alpha", None)
        if alpha is None:
            alpha = getattr(self.args, "neftune_noise_alpha", None)
        if alpha is not None:
            raise ValueError(
                f"DPTrainer does not support NEFTune (neftune_noise_alpha={alpha!r}): its noise "
                "scale alpha/sqrt(T*d) depends on the padded length T of the batch, i.e. on the "
                "other records drawn with a record, so one record would change the others' "
                "clipped gradients and the DP guarantee would not hold. Set "
                "neftune_noise_alpha=None (DP-SGD already adds its own noise)."
            )
        collator = self.data_collator
        if type(collator).__name__ == "DataCollatorWithFlattening" or getattr(
            collator, "padding_free", False
        ):
            raise _packed_error(f"data_collator={type(collator).__name__}")

    def _train_collator_and_dataset(self) -> tuple[Any, Callable | None]:
        """The training set and collate function as ``Trainer`` would use them (unused columns
        removed)."""
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets  # noqa: PLC0415

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return dataset, collator

    def total_steps(self, steps_per_epoch: int) -> int:
        """The optimizer steps of the whole run: ``max_steps``, or ``num_train_epochs`` epochs of
        ``steps_per_epoch`` (= 1 / q) steps, as the Trainer counts them."""
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        return max(1, math.ceil(self.args.num_train_epochs * steps_per_epoch))

    def setup_privacy(self) -> None:
        """Makes the model, optimizer and training data private (once; the first
        ``get_train_dataloader()`` or ``create_optimizer()`` calls it): builds the optimizer,
        calibrates σ if ``target_epsilon`` was given, and calls ``PrivacyEngine.make_private``
        with a loader whose batch size is the logical batch."""
        if self._private:
            return
        pa = self.privacy_args
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset.")
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "DPTrainer needs a map-style train_dataset (len and indexing) for Poisson "
                "sampling; got an IterableDataset."
            )
        dataset, collator = self._train_collator_and_dataset()
        logical = self._train_batch_size * self.args.gradient_accumulation_steps
        loader_kwargs: dict[str, Any] = {
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
        }
        if self.args.dataloader_num_workers > 0:
            loader_kwargs["persistent_workers"] = self.args.dataloader_persistent_workers
            loader_kwargs["prefetch_factor"] = self.args.dataloader_prefetch_factor
        plain = DataLoader(
            dataset, batch_size=logical, collate_fn=collator,
            generator=self._sampling_generator, **loader_kwargs,
        )
        n = len(dataset)
        steps_per_epoch = len(plain)
        q = 1 / steps_per_epoch
        delta = pa.target_delta if pa.target_delta is not None else 1 / (10 * n)
        # a second train() continues the same accounting, with the sigma of the first
        engine = self.privacy_engine or PrivacyEngine(
            accountant=pa.accountant, secure_mode=pa.secure_mode
        )
        sigma = pa.noise_multiplier if self.noise_multiplier is None else self.noise_multiplier
        if sigma is None:
            sigma = get_noise_multiplier(
                target_epsilon=pa.target_epsilon, target_delta=delta, sample_rate=q,
                steps=self.total_steps(steps_per_epoch), accountant=engine.accountant.mechanism(),
                epsilon_tolerance=pa.epsilon_tolerance,
            )
        optimizer = self.optimizer
        if optimizer is None:
            optimizer = super().create_optimizer()
        extra = {}
        if pa.grad_sample_mode == "ghost":
            extra["criterion"] = _PrecomputedLoss()
        self.model.train()  # the Trainer trains it anyway; make_private checks training mode
        out = engine.make_private(
            module=self.model,
            optimizer=optimizer,
            data_loader=plain,
            noise_multiplier=sigma,
            max_grad_norm=float(pa.per_sample_max_grad_norm),
            grad_sample_mode=pa.grad_sample_mode,
            noise_generator=self._noise_generator,
            loss_reduction="mean",
            poisson_sampling=True,
            **extra,
        )
        if pa.grad_sample_mode == "ghost":
            self.dp_module, self.dp_optimizer, self._dp_criterion, self._dp_loader = out
        else:
            self.dp_module, self.dp_optimizer, self._dp_loader = out
        self.optimizer = self.dp_optimizer
        self.privacy_engine = engine
        self._private = True
        self.noise_multiplier = float(sigma)
        self.sample_rate = q
        self.target_delta = delta
        self._num_records = n
        logger.info(
            "DPTrainer: N=%d, logical batch %d (q=%.6g), physical batch <= %d, sigma=%.4g, "
            "C=%g, mode %s, delta=%.3g", n, logical, q, self._train_batch_size, sigma,
            pa.per_sample_max_grad_norm, pa.grad_sample_mode, delta,
        )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; afterwards the model is a plain model again (per-sample hooks
        removed), so saving, evaluating, generating or training it further without DP behave
        as without dptorch. ``get_epsilon`` keeps answering; another ``train()`` wraps it again
        and continues the same accounting with the same σ."""
        self._check_before_training()
        try:
            return super().train(*args, **kwargs)
        finally:
            self.release_privacy()

    def release_privacy(self) -> None:
        """Removes the per-sample hooks and DP state from the model (``train`` calls it at the
        end). The privacy engine, with its accountant, stays."""
        if not self._private:
            return
        release(self.dp_module, self.dp_optimizer)
        # the next train() makes the Trainer's optimizer private again
        self.optimizer = self.dp_optimizer.original_optimizer
        self._private = False

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The DP optimizer (:meth:`setup_privacy` builds it from the Trainer's optimizer)."""
        self.setup_privacy()
        return self.optimizer

    def get_train_dataloader(self) -> _PoissonSlices:
        """The Poisson-sampled training batches, each logical batch cut into
        ``gradient_accumulation_steps`` slices (one per Trainer micro-step)."""
        self.setup_privacy()
        return _PoissonSlices(self._dp_loader, self.args.gradient_accumulation_steps)

    # ------------------------------------------------------------------ the step
    def compute_per_sample_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """``(B,)``: the loss of each record of ``inputs`` under ``model`` (the GradSampleModule
        around ``self.model``), from the model's default forward ``model(**inputs)`` without the
        labels (kept for seq2seq models, which build their decoder inputs from them). Override
        it for other losses; the result must be one loss per record, each depending on that
        record only."""
        inputs = dict(inputs)
        if "_batch" in inputs and len(inputs) == 1:  # a batch that is not a dict
            raise ValueError(
                "DPTrainer expects dict batches (what the Hugging Face collators return); "
                "override compute_per_sample_loss for other batch structures."
            )
        labels = inputs.pop("labels", None)
        shift_labels = inputs.pop("shift_labels", None)
        if self.per_sample_loss is not None:
            return self.per_sample_loss(model(**inputs), labels)
        if self._task is None:
            self._task = detect_task(self.model)
            if self._task is None:
                raise ValueError(
                    f"DPTrainer does not know the loss of {type(self.model).__name__}: pass "
                    "per_sample_loss=fn(outputs, labels) returning one loss per record, or "
                    "override compute_per_sample_loss."
                )
        if labels is None:
            raise ValueError(
                "DPTrainer: the training batch has no 'labels' (check the data collator, e.g. "
                "DataCollatorForLanguageModeling(tokenizer, mlm=False) for causal LMs)."
            )
        if self._task == "seq2seq":
            inputs["labels"] = labels
        outputs = model(**inputs)
        task = self._task
        if shift_labels is not None and task == "causal_lm":
            labels, task = shift_labels, "token_classification"  # already aligned
        return per_sample_loss(
            task, outputs, labels, config=getattr(self.model, "config", None),
            token_loss=self.privacy_args.token_loss,
            label_smoothing=float(self.args.label_smoothing_factor or 0.0),
        )

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One slice of a logical batch: physical batches of at most
        ``per_device_train_batch_size`` records, each forward/backward through the
        GradSampleModule and clipped; every physical batch but the logical batch's last is
        accumulated (a skipped optimizer step), the last is left for the Trainer's
        ``optimizer.step()`` (noise, update, accounting). Returns the slice's share of the
        logical batch's mean loss."""
        if not isinstance(inputs, _Slice):
            raise ValueError(
                "DPTrainer.training_step needs the batches of DPTrainer.get_train_dataloader() "
                "(Poisson-sampled logical batches); do not override get_train_dataloader."
            )
        opt = self.dp_optimizer
        if inputs.first:
            opt.zero_grad(set_to_none=True)  # a new logical batch starts from nothing
        self.dp_module.train()
        rows_after, logical = inputs.rows_after, inputs.logical_size
        batch = self._prepare_inputs(dict(inputs)) if len(inputs) else {}
        check_packing(batch)
        check_padding(batch)
        rows = _rows(batch) if batch else 0
        physical = self._train_batch_size
        chunks = [(a, min(a + physical, rows)) for a in range(0, rows, physical)]
        total = torch.zeros((), device=self.args.device)
        for k, (a, b) in enumerate(chunks):
            chunk = _slice(batch, a, b, rows)
            with self.compute_loss_context_manager():
                losses = self.compute_per_sample_loss(self.dp_module, chunk)
            if losses.dim() != 1 or losses.shape[0] != b - a:
                raise ValueError(
                    f"compute_per_sample_loss must return one loss per record, shape ({b - a},); "
                    f"got {tuple(losses.shape)}."
                )
            if self._dp_criterion is not None:  # ghost clipping: the loss wrapper's backward
                self._dp_criterion(losses, None).backward()
            else:
                losses.mean().backward()
            total = total + losses.detach().float().sum().to(total.device)
            last = k == len(chunks) - 1 and rows_after == 0
            if not last:  # BatchMemoryManager semantics: clip and accumulate only
                opt.signal_skip_step(do_skip=True, physical_batch=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        return total / max(logical, 1)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """No ``grad_norm`` in the logs: before the DP step ``p.grad`` holds the un-noised
        (clipped, or in hooks mode raw) gradient sum, whose norm is not private; computing it
        with ``clip_grad_norm_`` would also rescale ``p.grad`` in place."""
        return None

    # ------------------------------------------------------------------ accounting
    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the trainer's ``target_delta``)."""
        if self.privacy_engine is None:
            return 0.0
        delta = self.target_delta if delta is None else delta
        key = (len(self.privacy_engine.accountant), delta)
        if self._epsilon_cache is not None and self._epsilon_cache[0] == key:
            return self._epsilon_cache[1]
        eps = float(self.privacy_engine.get_epsilon(delta)) if key[0] else 0.0
        self._epsilon_cache = (key, eps)
        return eps

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log`` with ``epsilon`` (at ``target_delta``) added once training started."""
        if self.privacy_engine is not None and "epsilon" not in logs:
            logs = {**logs, "epsilon": self.get_epsilon()}
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def privacy_state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to keep the guarantee: the accountant's history, the noise
        and sampling generators' states (the noise continues, never repeats), the DP settings."""
        opt = self.dp_optimizer
        return {
            "version": 1,
            "accountant": self.privacy_engine.accountant.state_dict(),
            "noise_multiplier": float(opt.noise_multiplier),
            "max_grad_norm": float(opt.max_grad_norm),
            "sample_rate": self.sample_rate,
            "num_records": self._num_records,
            "target_delta": self.target_delta,
            "grad_sample_mode": self.privacy_args.grad_sample_mode,
            "noise_generator": None if self._noise_generator is None
            else self._noise_generator.get_state(),
            "sampling_generator": None if self._sampling_generator is None
            else self._sampling_generator.get_state(),
        }

    def load_privacy_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`privacy_state_dict` into this (already private) trainer. Refuses a
        state of another dataset size (accounting is per dataset)."""
        if state.get("num_records") != self._num_records:
            raise ValueError(
                f"The checkpoint's privacy state was accounted on {state.get('num_records')} "
                f"records, this training set has {self._num_records}: privacy accounting is per "
                "dataset, so the run cannot be resumed on other data."
            )
        for key, mine in (("sample_rate", self.sample_rate),
                          ("noise_multiplier", self.dp_optimizer.noise_multiplier),
                          ("max_grad_norm", self.dp_optimizer.max_grad_norm)):
            if not math.isclose(float(state[key]), float(mine), rel_tol=1e-12):
                warnings.warn(
                    f"Resuming with {key}={mine} where the checkpoint had {state[key]}: the "
                    "accountant composes both, but a target_epsilon calibrated for one run "
                    "setting no longer holds for the mix.",
                    UserWarning,
                    stacklevel=2,
                )
        self.privacy_engine.accountant.load_state_dict(state["accountant"])
        self._epsilon_cache = None
        for key, gen in (("noise_generator", self._noise_generator),
                         ("sampling_generator", self._sampling_generator)):
            if gen is not None and state.get(key) is not None:
                gen.set_state(state[key])

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self.privacy_engine is not None and self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            os.makedirs(folder, exist_ok=True)
            torch.save(self.privacy_state_dict(), os.path.join(folder, PRIVACY_STATE_NAME))
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self.setup_privacy()
        path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no {PRIVACY_STATE_NAME}: it was not written by DPTrainer, so "
                "the privacy spent before it is unknown and resuming would restart epsilon at 0. "
                "To fine-tune those weights as a new private run, load them into the model and "
                "call train() without resume_from_checkpoint."
            )
        self.load_privacy_state_dict(torch.load(path, weights_only=True))
