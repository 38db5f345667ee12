"""Shared pieces of the Hugging Face integration tests: tiny models from a config
(tests/privacy/hf_models.py), map-style datasets of their batches that record which records
were read, a callback that cuts those reads into optimizer steps, and the brute-force
per-sample reference (tests/privacy/reference.py)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from privacy.hf_models import HFCase, build
from privacy.reference import per_sample_grads
from transformers import TrainerCallback, TrainingArguments

N_RECORDS = 16
PHYSICAL = 4
ACCUMULATION = 2  # logical batch = 4 x 2 = 8 records in expectation, q = 1/2


class RecordingDataset(torch.utils.data.Dataset):
    """The records of ``case.make_batch(n, seed)`` as dicts (``input_ids``, ``attention_mask``
    when padded, ``labels``); ``seen`` lists every index read, in order."""

    def __init__(self, case: HFCase, n: int = N_RECORDS, seed: int = 1):
        inputs, labels = case.make_batch(n, seed)
        self.items = [
            {**{k: v[i] for k, v in inputs.items()}, "labels": labels[i]} for i in range(n)
        ]
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.seen.append(int(i))
        return self.items[i]

    def batch(self, indices: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(inputs, labels)`` of the records ``indices`` (for the reference)."""
        rows = [self.items[i] for i in indices]
        stacked = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        labels = stacked.pop("labels")
        return stacked, labels


class StepRecorder(TrainerCallback):
    """Per optimizer step: the records read (the logical Poisson batch) and the trainable
    parameters before and after the step."""

    def __init__(self, dataset: RecordingDataset, model: torch.nn.Module):
        self.dataset = dataset
        self.model = model
        self.batches: list[list[int]] = []
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []
        self._read = 0

    def _params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def on_step_begin(self, args, state, control, **kwargs):
        self.before.append(self._params())

    def on_step_end(self, args, state, control, **kwargs):
        self.batches.append(self.dataset.seen[self._read:])
        self._read = len(self.dataset.seen)
        self.after.append(self._params())


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    """Plain SGD (learning rate 1, constant, no weight decay) so that a step's parameter change
    is the released gradient; CPU, no reporting, no checkpoints unless asked."""
    kw: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=PHYSICAL,
        gradient_accumulation_steps=ACCUMULATION, max_steps=2, logging_steps=1,
        learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def token_mean_loss(case: HFCase):
    """The per-sample loss DPTrainer uses by default for ``case``: the mean of the record's
    token losses (causal LM), or its cross-entropy (classification), ``reduction``
    ``"sum"``/``"mean"``/``"none"`` over the batch as the reference expects."""
    from dptorch.integrations.transformers import detect_task, per_sample_loss

    task = detect_task(case.model)

    def loss_fn(output, labels, reduction="sum"):
        per = per_sample_loss(task, output, labels, config=case.model.config)
        return {"none": per, "sum": per.sum(), "mean": per.mean()}[reduction]

    return loss_fn


def reference_update(model, inputs, labels, loss_fn, c: float, expected_batch: float):
    """The noise-free DP-SGD step with SGD lr 1: ``-Σ_b clip_C(g_b) / expected_batch``."""
    grads = per_sample_grads(model, inputs, labels, loss_fn)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    return {
        n: -torch.einsum("b,b...->...", factors, g) / expected_batch for n, g in grads.items()
    }, norms


def quiet_build(name: str, seed: int = 0) -> HFCase:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(name, seed)


def with_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(params[n])
    return m


def assert_update_close(got: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    """``max|got - ref| <= rtol · max|ref| + 1e-13``: relative to the parameter's largest
    update, plus the absolute round-off of an update computed as a difference of O(1) float64
    parameters."""
    err = (got - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item() + 1e-13, f"{what}: error {err:.3g}"
