"""DPTrainer (dptorch.integrations.transformers) on tiny GPT-2 and BERT models built from a config.

* a two-step run logs ``epsilon`` at every step, equal to an independent accountant fed the
  same (σ, q, steps) history;
* with ``noise_multiplier=0`` and a tight C the parameter change of every step equals the
  brute-force per-sample reference (each record's gradient alone, float64, clipped, summed,
  divided by the expected logical batch) over exactly the records the Poisson sampler drew —
  labels ``-100`` (padding) ignored in the loss and the clipping, physical batches of at most
  ``per_device_train_batch_size`` records;
* a run resumed from a checkpoint continues with the same ε history and ends on the same
  parameters as the uninterrupted run (the accountant, the noise and the sampling continue);
  a checkpoint without the privacy state is refused;
* the settings DPTrainer cannot train correctly are refused.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dptorch.accountants import create_accountant  # noqa: E402
from dptorch.integrations.transformers import (  # noqa: E402
    PRIVACY_STATE_NAME,
    DPTrainer,
    PrivacyArguments,
)

from .hf_helpers import (  # noqa: E402
    ACCUMULATION,
    N_RECORDS,
    PHYSICAL,
    RecordingDataset,
    StepRecorder,
    assert_update_close,
    quiet_build,
    reference_update,
    token_mean_loss,
    training_args,
    with_params,
)

MODELS = ["gpt2_padded", "bert_cls_padded"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _trainer(case, tmp_path, *, dataset=None, **privacy):
    dataset = dataset if dataset is not None else RecordingDataset(case)
    args = training_args(str(tmp_path), **privacy.pop("args", {}))
    privacy.setdefault("max_grad_norm", 1.0)
    trainer = DPTrainer(model=case.model, args=args, train_dataset=dataset, **privacy)
    return trainer, dataset


@pytest.mark.parametrize("name", MODELS)
def test_epsilon_logged_equals_accountant(name, tmp_path):
    case = quiet_build(name)
    trainer, _ = _trainer(case, tmp_path, noise_multiplier=1.0, target_delta=1e-3)
    trainer.train()
    logged = [(h["step"], h["epsilon"]) for h in trainer.state.log_history if "loss" in h]
    assert [s for s, _ in logged] == [1, 2]
    q = trainer.sample_rate
    assert q == 1 / math.ceil(N_RECORDS / (PHYSICAL * ACCUMULATION))
    for step, eps in logged:
        acc = create_accountant("prv")
        for _ in range(step):
            acc.step(noise_multiplier=1.0, sample_rate=q)
        assert eps == pytest.approx(acc.get_epsilon(1e-3), rel=1e-9), step
        assert eps > 0
    assert trainer.privacy_engine.accountant.history == [(1.0, q, 2)]
    assert logged[-1][1] == trainer.get_epsilon()
    final = trainer.state.log_history[-1]
    assert "train_loss" in final and final["epsilon"] == logged[-1][1]
    # the Trainer's pre-noise gradient norm (not private) is not logged
    assert not any("grad_norm" in h for h in trainer.state.log_history)
    # after train(): a plain model again (no hooks, no per-sample state)
    assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in case.model.modules())
    assert all(not hasattr(p, "summed_grad") for p in case.model.parameters())


def test_second_train_continues_the_accounting(tmp_path):
    case = quiet_build("gpt2_padded")
    trainer, _ = _trainer(case, tmp_path, target_epsilon=4.0, target_delta=1e-3)
    trainer.train()
    sigma, eps = trainer.noise_multiplier, trainer.get_epsilon()
    assert eps <= 4.0
    trainer.train()
    assert trainer.noise_multiplier == sigma
    (s, q, steps), = trainer.privacy_engine.accountant.history  # one phase: the same sigma
    assert (s, q, steps) == (pytest.approx(sigma, rel=1e-12), trainer.sample_rate, 4)
    assert trainer.get_epsilon() > eps


@pytest.mark.parametrize(
    ("name", "mode"),
    [(n, m) for n in MODELS for m in ("bk", "hooks", "ghost")]
    + [("bert_cls_padded", "ew"), ("bert_cls_padded", "functorch")],
)
def test_noise_free_update_equals_per_sample_loop(name, mode, tmp_path):
    """Each step's update with σ = 0 and a tight C (every record clipped) is the reference
    clipped sum over the records drawn, divided by the expected logical batch size."""
    case = quiet_build(name)
    pristine = copy.deepcopy(case.model)
    trainer, dataset = _trainer(case, tmp_path, noise_multiplier=0.0, max_grad_norm=1e-3,
                                grad_sample_mode=mode)
    rec = StepRecorder(dataset, case.model)
    trainer.add_callback(rec)
    trainer.train()
    assert len(rec.batches) == 2
    loss_fn = token_mean_loss(case)
    expected_batch = trainer.dp_optimizer.expected_batch_size
    assert expected_batch == N_RECORDS * trainer.sample_rate == PHYSICAL * ACCUMULATION
    sizes = []
    for before, after, indices in zip(rec.before, rec.after, rec.batches):
        assert len(set(indices)) == len(indices)
        sizes.append(len(indices))
        inputs, labels = dataset.batch(indices)
        ref, norms = reference_update(with_params(pristine, before), inputs, labels, loss_fn,
                                      1e-3, expected_batch)
        assert bool((norms > 1e-3).all()), "C must clip every record"
        for n, r in ref.items():
            # the update is a difference of O(1) float64 parameters: 1e-13 absolute round-off
            assert_update_close(after[n] - before[n], r, 1e-9, f"{n} {mode}")
    assert max(sizes) > 0


def test_update_between_norms_with_physical_batches(tmp_path):
    """C between the records' norms (some clipped, some not), and slices of the logical batch
    larger than a physical batch: the update is still the reference, so the physical batches
    (clipped, accumulated, one noise and one accountant step per logical batch) change
    nothing."""
    case = quiet_build("gpt2_padded")
    pristine = copy.deepcopy(case.model)
    dataset = RecordingDataset(case)
    loss_fn = token_mean_loss(case)
    inputs, labels = dataset.batch(list(range(N_RECORDS)))
    _, norms = reference_update(pristine, inputs, labels, loss_fn, 1.0, 1.0)
    c = float(norms.median())
    # the sampling generator is seeded from OS entropy unless noise_seed is given: this seed
    # draws a logical batch of more than 4 records within the 4 steps
    trainer, _ = _trainer(case, tmp_path, dataset=dataset, noise_multiplier=0.0, max_grad_norm=c,
                          noise_seed=0,
                          args={"max_steps": 4, "per_device_train_batch_size": 2,
                                "learning_rate": 0.1})
    rec = StepRecorder(dataset, case.model)
    trainer.add_callback(rec)
    trainer.train()
    # logical batch 2 x 2 = 4 in expectation (q = 1/4), cut into 2 slices of physical batches
    # of at most 2: a draw of 5 or more records needs a third physical batch
    assert max(len(b) for b in rec.batches) > 4, rec.batches
    assert len(trainer.privacy_engine.accountant) == 4
    expected_batch = trainer.dp_optimizer.expected_batch_size
    assert expected_batch == 4
    for before, after, indices in zip(rec.before, rec.after, rec.batches):
        if not indices:
            assert all(torch.equal(after[n], before[n]) for n in before)
            continue
        inputs, labels = dataset.batch(indices)
        ref, _ = reference_update(with_params(pristine, before), inputs, labels, loss_fn, c,
                                  expected_batch)
        for n, r in ref.items():
            assert_update_close(after[n] - before[n], 0.1 * r, 1e-9, n)


def test_target_epsilon_is_reached_not_exceeded(tmp_path):
    case = quiet_build("bert_cls")
    trainer, _ = _trainer(case, tmp_path, target_epsilon=3.0, target_delta=1e-3,
                          args={"max_steps": 4})
    trainer.train()
    eps = trainer.get_epsilon()
    assert eps <= 3.0 + 1e-9
    assert eps > 3.0 - 0.1
    assert len(trainer.privacy_engine.accountant) == 4


def test_privacy_arguments_dataclass(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    _, pa = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--target_epsilon", "4", "--target_delta", "1e-4",
         "--per_sample_max_grad_norm", "0.5", "--grad_sample_mode", "hooks"]
    )
    assert (pa.target_epsilon, pa.per_sample_max_grad_norm, pa.grad_sample_mode) == (4.0, 0.5,
                                                                                      "hooks")
    case = quiet_build("bert_cls")
    trainer, _ = _trainer(case, tmp_path, privacy_args=pa, max_grad_norm=None)
    trainer.setup_privacy()
    assert trainer.dp_optimizer.max_grad_norm == 0.5
    assert type(trainer.dp_module).__name__ == "GradSampleModule"


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("optim", "at"), [("sgd", 2), ("adamw_torch", 2), ("sgd", 1)])
def test_resume_continues_the_epsilon_history(optim, at, tmp_path):
    """Run A: 4 steps (2 epochs of 2), a checkpoint at every step. Run B: a fresh trainer
    resumed from checkpoint ``at`` (2: an epoch boundary; 1: mid-epoch). B logs A's ε at every
    step and ends on A's parameters: accountant, noise and sampling continue where they stopped
    (the noise is never replayed) and the run keeps its number of steps."""
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 1, "optim": optim,
                "learning_rate": 0.05}
    case_a = quiet_build("gpt2_padded")
    trainer_a, _ = _trainer(case_a, tmp_path / "a", noise_multiplier=0.8, target_delta=1e-3,
                            args=settings)
    trainer_a.train()
    ckpt = tmp_path / "a" / f"checkpoint-{at}"
    assert (ckpt / PRIVACY_STATE_NAME).is_file()
    eps_a = [h["epsilon"] for h in trainer_a.state.log_history if "loss" in h]

    case_b = quiet_build("gpt2_padded")
    trainer_b, _ = _trainer(case_b, tmp_path / "b", noise_multiplier=0.8, target_delta=1e-3,
                            args=settings)
    trainer_b.train(resume_from_checkpoint=str(ckpt))
    eps_b = [h["epsilon"] for h in trainer_b.state.log_history if "loss" in h]
    assert eps_b == eps_a and len(eps_a) == 4
    assert trainer_b.privacy_engine.accountant.history == trainer_a.privacy_engine.accountant.history
    pa, pb = _params(case_a.model), _params(case_b.model)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


def test_resume_from_a_checkpoint_without_privacy_state_is_refused(tmp_path):
    case = quiet_build("bert_cls")
    settings = {"max_steps": 2, "save_strategy": "steps", "save_steps": 1}
    trainer, _ = _trainer(case, tmp_path, noise_multiplier=1.0, args=settings)
    trainer.train()
    ckpt = tmp_path / "checkpoint-1"
    os.remove(ckpt / PRIVACY_STATE_NAME)
    again, _ = _trainer(quiet_build("bert_cls"), tmp_path / "again", noise_multiplier=1.0,
                        args=settings)
    with pytest.raises(ValueError, match="restart epsilon at 0"):
        again.train(resume_from_checkpoint=str(ckpt))


def test_refusals(tmp_path):
    case = quiet_build("bert_cls")
    dataset = RecordingDataset(case)
    args = training_args(str(tmp_path))
    with pytest.raises(ValueError, match="exactly one of target_epsilon"):
        DPTrainer(model=case.model, args=args, train_dataset=dataset, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        DPTrainer(model=case.model, args=args, train_dataset=dataset, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="compute_loss_func"):
        DPTrainer(model=case.model, args=args, train_dataset=dataset, noise_multiplier=1.0,
                  max_grad_norm=1.0, compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(NotImplementedError, match="model_init"):
        DPTrainer(model_init=lambda: case.model, args=args, train_dataset=dataset,
                  noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="grad_sample_mode"):
        DPTrainer(model=case.model, args=args, train_dataset=dataset, noise_multiplier=1.0,
                  max_grad_norm=1.0, grad_sample_mode="fast")
    # ew cannot differentiate GPT-2's Conv1D: refused when training starts, the model untouched
    gpt2 = quiet_build("gpt2_padded")
    refused = DPTrainer(model=gpt2.model, args=args, train_dataset=RecordingDataset(gpt2),
                        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ew")
    with pytest.raises(ValueError, match=r"Conv1D.*grad_sample_mode='bk'"):
        refused.train()
    assert all(not vars(p) for p in gpt2.model.parameters())
    assert all(not m._forward_hooks for m in gpt2.model.modules())
    # the user's TrainingArguments are not modified; DPTrainer's copy clips nothing globally
    trainer = DPTrainer(model=case.model, args=args, train_dataset=dataset,
                        noise_multiplier=1.0, max_grad_norm=1.0)
    assert args.max_grad_norm == 1.0 and trainer.args.max_grad_norm == 0.0
    assert trainer.args.ignore_data_skip


class _FixedBatches:
    """Stands in for the Poisson loader: yields the collated records of each index list of
    ``draws`` (an empty list gives the zero-row batch the Poisson loader yields)."""

    def __init__(self, dataset: RecordingDataset, draws: list[list[int]]):
        self.dataset, self.draws = dataset, draws

    def __len__(self) -> int:
        return len(self.draws)

    def __iter__(self):
        for indices in self.draws:
            inputs, labels = self.dataset.batch(indices or [0])
            batch = {**inputs, "labels": labels}
            yield {k: v[:0] for k, v in batch.items()} if not indices else batch


def test_logical_batches_of_any_size_make_one_step_each(tmp_path):
    """BatchMemoryManager semantics for every size a Poisson draw can have: empty, one record
    (the second accumulation slice is then empty), and more records than
    ``per_device_train_batch_size × gradient_accumulation_steps`` (a slice is then cut into two
    physical batches). Each logical batch is one noise-free step whose update is the reference
    clipped sum over its records, one accountant step, and no forward pass sees more than
    ``per_device_train_batch_size`` records."""
    from dptorch.integrations.transformers import _PoissonSlices

    draws = [[], [3], list(range(11)), [1, 2, 5]]

    class Fixed(DPTrainer):
        def get_train_dataloader(self):
            self.setup_privacy()
            return _PoissonSlices(_FixedBatches(self.train_dataset, draws),
                                  self.args.gradient_accumulation_steps)

    case = quiet_build("gpt2_padded")
    pristine = copy.deepcopy(case.model)
    dataset = RecordingDataset(case)
    c = 1e-3
    trainer = Fixed(model=case.model, args=training_args(str(tmp_path), max_steps=len(draws)),
                    train_dataset=dataset, noise_multiplier=0.0, max_grad_norm=c)
    rec = StepRecorder(dataset, case.model)
    trainer.add_callback(rec)
    forwards: list[int] = []
    handle = case.model.register_forward_pre_hook(
        lambda m, a, kw: forwards.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        trainer.train()
    finally:
        handle.remove()
    assert len(rec.before) == len(draws)
    # 11 records = slices of 6 and 5, each cut into physical batches of at most 4
    assert forwards == [1, 4, 2, 4, 1, 2, 1], forwards
    assert len(trainer.privacy_engine.accountant) == len(draws)
    loss_fn = token_mean_loss(case)
    expected_batch = trainer.dp_optimizer.expected_batch_size
    for before, after, indices in zip(rec.before, rec.after, draws):
        if not indices:
            assert all(torch.equal(after[n], before[n]) for n in before)  # σ = 0, no record
            continue
        inputs, labels = dataset.batch(indices)
        ref, norms = reference_update(with_params(pristine, before), inputs, labels, loss_fn, c,
                                      expected_batch)
        assert bool((norms > c).all())
        for n, r in ref.items():
            assert_update_close(after[n] - before[n], r, 1e-9, f"{n} ({len(indices)} records)")


def _left_padded(dataset: RecordingDataset) -> RecordingDataset:
    """The records of ``dataset`` with their padding moved to the left."""
    out = copy.copy(dataset)
    out.items, out.seen = [], []
    for item in dataset.items:
        n = int(item["attention_mask"].sum())
        shift = item["attention_mask"].shape[0] - n
        out.items.append({k: torch.roll(v, shift) for k, v in item.items()})
    return out


def test_left_padding_is_refused_unless_positions_are_given(tmp_path):
    """A record's loss must not depend on how much padding its batch adds (the longest record
    of the Poisson batch sets it). Right padding: it does not. Left padding without
    position_ids: it does (the positions of the record's tokens move), so training refuses it;
    with per-record position_ids it does not, and training runs."""
    from dptorch.integrations.transformers import detect_task, per_sample_loss

    case = quiet_build("gpt2_padded")
    model = case.model.eval()
    task = detect_task(model)
    right = RecordingDataset(case)
    left = _left_padded(right)
    i = next(k for k, it in enumerate(right.items)
             if 0 < it["attention_mask"].sum() < len(it["attention_mask"]))

    def loss(item, extra: int, side: str, positions: bool = False) -> float:
        """The record's loss with ``extra`` more pads on ``side``."""
        def pad(k, v):
            fill = torch.full((extra,), -100 if k == "labels" else 0, dtype=v.dtype)
            return torch.cat([v, fill] if side == "right" else [fill, v])[None]

        batch = {k: pad(k, v) for k, v in item.items()}
        if positions:
            batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        labels = batch.pop("labels")
        with torch.no_grad():
            return float(per_sample_loss(task, model(**batch), labels)[0])

    def same(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-12 * abs(a)

    assert same(loss(right.items[i], 0, "right"), loss(right.items[i], 3, "right"))
    assert not same(loss(left.items[i], 0, "left"), loss(left.items[i], 3, "left"))
    assert same(loss(left.items[i], 0, "left", True), loss(left.items[i], 3, "left", True))

    case.model.train()
    trainer, _ = _trainer(case, tmp_path, dataset=left, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="left-padded.*position_ids"):
        trainer.train()
    for it in left.items:  # per-record positions, as a collator can add them
        it["position_ids"] = (it["attention_mask"].cumsum(0) - 1).clamp(min=0)
    trainer, _ = _trainer(quiet_build("gpt2_padded"), tmp_path, dataset=left,
                          noise_multiplier=1.0)
    trainer.train()
    assert len(trainer.privacy_engine.accountant) == 2


def test_packed_batches_are_refused(tmp_path):
    """A packed (padding-free) batch holds several records in one row; DP-SGD would clip them
    as one sample. ``check_packing`` recognises the boundary keys and ``position_ids`` that drop
    between two attended tokens of a row, and lets padded batches through (right padding with
    masked positions, left padding with per-record positions). A custom packing collator is
    refused at the first training step, before any update, NEFTune and a
    ``DataCollatorWithFlattening`` when ``train()`` starts."""
    from transformers import DataCollatorWithFlattening

    from dptorch.integrations.transformers import check_packing

    ids = torch.ones(1, 6, dtype=torch.long)
    for packed in ({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])},
                   {"input_ids": ids, "position_ids": torch.tensor([[2, 3, 4, 2, 3, 4]])},
                   {"input_ids": ids, "position_ids": torch.tensor([0, 1, 0, 1, 2, 3])},
                   {"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 3, 6])},
                   {"input_ids": ids, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1]])}):
        with pytest.raises(ValueError, match="packed.*padding collator"):
            check_packing(packed)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    for padded in ({"input_ids": ids.expand(2, 6), "attention_mask": mask},
                   {"input_ids": ids.expand(2, 6), "attention_mask": mask,
                    "position_ids": torch.tensor([[0, 1, 2, 3, 0, 0], [1, 1, 0, 1, 2, 3]])},
                   {"input_ids": ids, "position_ids": torch.arange(6)[None]}):
        check_packing(padded)

    case = quiet_build("gpt2_padded")
    before = {n: p.detach().clone() for n, p in case.model.named_parameters()}

    def pack(features):
        out = DataCollatorWithFlattening()(
            [{k: f[k][f["attention_mask"].bool()] for k in ("input_ids", "labels")}
             for f in features])
        return {k: out[k] for k in ("input_ids", "labels", "position_ids")}

    trainer, _ = _trainer(case, tmp_path, noise_multiplier=0.0,
                          args={"remove_unused_columns": False})
    trainer.data_collator = pack
    with pytest.raises(ValueError, match=r"packed \(position_ids"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in case.model.named_parameters())
    assert len(trainer.privacy_engine.accountant) == 0
    trainer.data_collator = DataCollatorWithFlattening()
    with pytest.raises(ValueError, match="data_collator=DataCollatorWithFlattening"):
        trainer.train()
    trainer.data_collator = None
    trainer.args.neftune_noise_alpha = trainer.neftune_noise_alpha = 5.0
    with pytest.raises(ValueError, match="NEFTune"):
        trainer.train()
    assert all(not m._forward_hooks for m in case.model.modules())
