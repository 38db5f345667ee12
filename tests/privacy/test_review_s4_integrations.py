"""Review s4: the integrations (Hugging Face DPTrainer, PEFT, Lightning DPCallback) and the
multi-process path (DDP over gloo, 2 ranks).

Findings (these tests fail on the reviewed code and pass once it is fixed):

* DPTrainer trains a *packed* batch (``DataCollatorWithFlattening``: every record of the logical
  batch concatenated into one row, ``position_ids`` restarting per record) as ONE sample: the
  records are clipped jointly, so one record changes the released sum by up to 2C (add/remove)
  while the noise is calibrated to C.
* DPTrainer accepts ``neftune_noise_alpha``: NEFTune scales each record's embedding noise by
  ``1/sqrt(T·d)`` with T the padded length of the batch (the longest record drawn with it), so a
  record's clipped gradient depends on the other records of its Poisson batch — the coupling
  DPTrainer refuses for left padding.
* ``make_private`` on DDP ranks whose settings differ (per-rank batch size, hence sample rate q
  and expected batch size, or the clipping bound C) trains silently: rank 1's records are sampled
  at a higher rate / clipped at a larger C than rank 0's accountant (the ε one reports) assumes.
* DPCallback with manual optimization refuses with an error that blames the model ("parameter
  ... used by add_ ... call the owning module ... or freeze the parameter"), not manual
  optimization.

Coverage of attacks handled correctly (not elsewhere in tests/): LoRA adapters injected after
``make_private`` (exact, hooks/bk/functorch), DPTrainer with evaluation between steps (exact
update, one accountant step per logical batch), Lightning resumed from a *mid-epoch* checkpoint
with validation between steps (same ε and parameters as the uninterrupted run).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- helpers
def _tests_on_path() -> None:
    root = str(HERE.parent)
    if root not in sys.path:
        sys.path.insert(0, root)


def _hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _tests_on_path()
    from integrations import hf_helpers  # noqa: PLC0415

    return hf_helpers


# ----------------------------------------------------------------------------- HF: packing
class _Records(torch.utils.data.Dataset):
    """Variable-length token records (lists of ids), as a tokenizer would return them."""

    def __init__(self, n: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(3, 7, (1,), generator=g))
            self.items.append({"input_ids": torch.randint(2, 64, (length,), generator=g).tolist()})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def test_dptrainer_packed_batch_is_not_one_record(tmp_path):
    """``DataCollatorWithFlattening`` packs the whole logical batch into one row ``[1, ΣL]``
    (``position_ids`` restart at each record). DPTrainer takes dimension 0 as the records, so it
    clips the *sum* of all the records' gradients as one sample: with q = 1 and σ = 0 it
    releases ``clip_C(Σ g_i) / B`` instead of ``Σ clip_C(g_i) / B``. One record then moves the
    released gradient by up to 2C (and the pack's token-mean loss couples the records), while
    σ is calibrated to sensitivity C. Fixed: refused (ValueError: rows are not records), or
    trained per record (the update then equals the per-record reference)."""
    h = _hf()
    from transformers import DataCollatorWithFlattening  # noqa: PLC0415

    from dptorch.integrations.transformers import DPTrainer, per_sample_loss  # noqa: PLC0415

    case = h.quiet_build("gpt2")
    pristine = copy.deepcopy(case.model)
    data = _Records(8)
    c = 1e-3
    args = h.training_args(str(tmp_path), per_device_train_batch_size=8,
                           gradient_accumulation_steps=1, max_steps=1,
                           remove_unused_columns=False, logging_steps=10)
    trainer = DPTrainer(model=case.model, args=args, train_dataset=data,
                        data_collator=DataCollatorWithFlattening(), noise_multiplier=0.0,
                        max_grad_norm=c, grad_sample_mode="hooks")
    assert trainer.get_train_dataloader().loader.sample_rate == 1.0  # every record, every step
    try:
        trainer.train()
    except ValueError:
        return  # refused: the rows of a packed batch are not records
    # the brute-force reference: each record alone (its own forward), clipped, summed
    expected_batch = trainer.dp_optimizer.expected_batch_size
    assert expected_batch == len(data)
    params = dict(pristine.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for item in data.items:
        ids = torch.tensor([item["input_ids"]])
        pristine.zero_grad()
        loss = per_sample_loss("causal_lm", pristine(input_ids=ids), ids)[0]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in params.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        factor = min(1.0, c / (float(norm) + 1e-6))
        assert factor < 1.0
        for n in total:
            total[n] += factor * grads[n]
    got = {n: p.detach() - params[n].detach() for n, p in case.model.named_parameters()}
    ref_norm = math.sqrt(sum(float((t / expected_batch).pow(2).sum()) for t in total.values()))
    got_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in got.values()))
    assert got_norm == pytest.approx(ref_norm, rel=1e-6), (
        f"released update norm {got_norm:.4g}, per-record reference {ref_norm:.4g}: the packed "
        "row was clipped as one record"
    )


# ----------------------------------------------------------------------------- HF: NEFTune
def test_dptrainer_refuses_neftune(tmp_path):
    """NEFTune (``TrainingArguments.neftune_noise_alpha``) adds to the embeddings uniform noise
    of half-width ``alpha / sqrt(T · d)``, T the padded length of the batch: a record's loss
    distribution, hence its clipped gradient, depends on the longest record drawn with it, so
    adding or removing one record changes the others' contributions (the sensitivity bound fails,
    exactly as with left padding, which DPTrainer refuses). DPTrainer trains it silently."""
    h = _hf()
    from transformers.integrations.neftune import neftune_post_forward_hook  # noqa: PLC0415

    from dptorch.integrations.transformers import DPTrainer  # noqa: PLC0415

    # the coupling: the noise scale of one record's embeddings shrinks when the batch is longer
    emb = nn.Embedding(10, 4).train()
    emb.neftune_noise_alpha = 5.0
    torch.manual_seed(0)
    short = neftune_post_forward_hook(emb, None, torch.zeros(1, 3, 4))
    longer = neftune_post_forward_hook(emb, None, torch.zeros(1, 12, 4))
    assert short.abs().max() > longer[:, :3].abs().max() * 1.5

    case = h.quiet_build("gpt2_padded")
    args = h.training_args(str(tmp_path), neftune_noise_alpha=5.0)
    trainer = DPTrainer(model=case.model, args=args, train_dataset=h.RecordingDataset(case),
                        noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises((ValueError, NotImplementedError), match="(?i)neftune"):
        trainer.train()


# ----------------------------------------------------------------------------- HF: evaluation
def test_dptrainer_evaluation_between_steps_changes_nothing(tmp_path):
    """``eval_strategy="steps"`` with ``eval_steps=1``: the evaluation forward passes (eval mode,
    no grad, through the hooked model) between logical batches leave every update equal to the
    per-sample reference over the records drawn, one accountant step per logical batch."""
    h = _hf()
    from dptorch.integrations.transformers import DPTrainer  # noqa: PLC0415

    case = h.quiet_build("gpt2_padded")
    pristine = copy.deepcopy(case.model)
    data = h.RecordingDataset(case)
    args = h.training_args(str(tmp_path), max_steps=3, eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=3)
    trainer = DPTrainer(model=case.model, args=args, train_dataset=data,
                        eval_dataset=copy.deepcopy(data), noise_multiplier=0.0,
                        max_grad_norm=1e-3, grad_sample_mode="bk")
    rec = h.StepRecorder(data, case.model)
    trainer.add_callback(rec)
    trainer.train()
    assert sum("eval_loss" in x for x in trainer.state.log_history) == 3
    assert trainer.privacy_engine.accountant.history == [(0.0, trainer.sample_rate, 3)]
    loss_fn = h.token_mean_loss(case)
    eb = trainer.dp_optimizer.expected_batch_size
    checked = 0
    for before, after, idx in zip(rec.before, rec.after, rec.batches):
        if not idx:
            continue
        inputs, labels = data.batch(idx)
        ref, _ = h.reference_update(h.with_params(pristine, before), inputs, labels, loss_fn,
                                    1e-3, eb)
        for n, r in ref.items():
            h.assert_update_close(after[n] - before[n], r, 1e-8, n)
        checked += 1
    assert checked >= 2


# ----------------------------------------------------------------------------- PEFT after wrap
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_lora_adapters_injected_after_make_private_are_exact(mode):
    """LoRA adapters injected into the model *after* ``make_private`` (new submodules, added to
    the DP optimizer with ``add_param_group``) get exact per-sample clipping: the σ = 0 update
    equals the per-sample loop (each record alone, float64, clipped jointly over the old and new
    trainable parameters)."""
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model  # noqa: PLC0415

    from dptorch import PrivacyEngine  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    c = 1e-3
    torch.manual_seed(0)
    net = _Net().double()
    for p in net.parameters():
        p.requires_grad_(False)
    net.fc2.weight.requires_grad_(True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    gsm, opt, _ = PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD([net.fc2.weight], lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=c, grad_sample_mode=mode)
    config = LoraConfig(r=2, target_modules=["fc1"], init_lora_weights=False)
    inject_adapter_in_model(config, net)
    net.double()
    new = [p for n, p in net.named_parameters() if "lora" in n]
    assert new
    for p in new:
        p.requires_grad_(True)
    opt.add_param_group({"params": new})
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    # the reference model: a plain copy (no hooks) with the same parameters
    ref = _Net().double()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["fc1"], init_lora_weights=False), ref)
    ref.double()
    with torch.no_grad():
        for (n, p), (n2, p2) in zip(net.named_parameters(), ref.named_parameters()):
            assert n == n2
            p2.copy_(p)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt.zero_grad()
    F.cross_entropy(gsm(x), y).backward()
    opt.step()
    rp = dict(ref.named_parameters())
    total = {n: torch.zeros_like(rp[n]) for n in names}
    for i in range(len(x)):
        ref.zero_grad()
        F.cross_entropy(ref(x[i:i + 1]), y[i:i + 1]).backward()
        grads = {n: rp[n].grad.clone() for n in names}
        norm = float(torch.sqrt(sum(gr.pow(2).sum() for gr in grads.values())))
        for n in names:
            total[n] += min(1.0, c / (norm + 1e-6)) * grads[n]
    after = dict(net.named_parameters())
    for n in names:
        torch.testing.assert_close(after[n].detach() - before[n], -total[n] / len(x),
                                   rtol=1e-9, atol=1e-15)


# ----------------------------------------------------------------------------- Lightning
def _pl():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl  # noqa: PLC0415

    return pl


def _light_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _light_module(pl, manual: bool = False):
    ds = _light_data()

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.net = nn.Linear(5, 3)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(ds, batch_size=8)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(ds, batch_size=16)

    return M()


def _light_trainer(pl, callbacks, **kw):
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", num_sanity_val_steps=0, **kw)


def test_lightning_manual_optimization_error_names_the_cause():
    """``automatic_optimization = False`` (``manual_backward`` + ``opt.step()`` inside
    ``training_step``) runs the optimizer step inside the GradSampleModule's forward; DPCallback
    then raises an error saying that ``net.weight`` is "used by add_ in the model's top-level
    forward" and suggests calling the owning module or freezing the parameter — neither the
    reason nor a fix. Fixed: refused up front naming manual optimization, or trained correctly
    (one clipped, accounted step per batch)."""
    pl = _pl()
    from dptorch.lightning import DPCallback  # noqa: PLC0415

    cb = DPCallback(noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode="hooks", seed=0)
    trainer = _light_trainer(pl, [cb], max_epochs=1, limit_val_batches=0)
    try:
        trainer.fit(_light_module(pl, manual=True))
    except (ValueError, NotImplementedError) as e:
        assert "manual" in str(e).lower() or "automatic_optimization" in str(e), str(e)[:400]
        return
    assert len(cb.privacy_engine.accountant) == trainer.global_step == 4


def test_lightning_mid_epoch_resume_with_validation(tmp_path):
    """A checkpoint saved mid-epoch (every training step, validation every 2 batches), resumed
    in a fresh Trainer: same number of accountant steps, same ε and bit-identical parameters as
    the uninterrupted run (accountant, noise and Poisson sampling continue, σ = 1)."""
    pl = _pl()
    from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: PLC0415

    from dptorch.lightning import DPCallback  # noqa: PLC0415

    def run(folder, ckpt=None):
        cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks",
                        seed=5)
        saver = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_top_k=-1,
                                filename="{step}")
        t = _light_trainer(pl, [cb, saver], max_epochs=2, val_check_interval=2,
                           enable_checkpointing=True)
        m = _light_module(pl)
        t.fit(m, ckpt_path=ckpt)
        return m, cb

    model_a, cb_a = run(tmp_path / "a")
    ckpt = tmp_path / "a" / "step=3.ckpt"  # inside the first epoch of 4 steps
    assert ckpt.is_file()
    model_b, cb_b = run(tmp_path / "b", str(ckpt))
    assert len(cb_a.privacy_engine.accountant) == len(cb_b.privacy_engine.accountant) == 8
    assert cb_b.get_epsilon(1e-3) == cb_a.get_epsilon(1e-3)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


# ----------------------------------------------------------------------------- DDP
def _ddp_settings_worker(rank: int, world_size: int) -> dict:
    """make_private on a DDP model with a per-rank batch size, then with a per-rank C; records
    whether each was refused and what each rank's optimizer and sampler use."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: PLC0415

    from dptorch import PrivacyEngine  # noqa: PLC0415

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    out = {}
    for name, batch, c in (("batch", 4 if rank == 0 else 16, 1.0),
                           ("clip", 4, 1.0 if rank == 0 else 5.0)):
        net = nn.Linear(4, 2)
        loader = DataLoader(ds, batch_size=batch, sampler=DistributedSampler(ds))
        try:
            _, opt, dl = PrivacyEngine().make_private(
                module=DDP(net), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                data_loader=loader, noise_multiplier=1.0, max_grad_norm=c)
            out[name] = ("trained", dl.batch_sampler.sample_rate, opt.max_grad_norm)
        except ValueError as e:
            out[name] = ("refused", str(e))
    return out


def _spawn_entry(rank, world_size, port, out_dir):
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    torch.save(_ddp_settings_worker(rank, world_size), os.path.join(out_dir, f"{rank}.pt"))
    dist.barrier()
    # the refused make_private calls leave DDP reducers behind; gloo's teardown of those has
    # aborted ("terminate called without an active exception") on a loaded 2-core CI machine
    # after both results were saved: leave without running C++ destructors
    os._exit(0)


def test_ddp_ranks_with_different_sampling_or_clipping_are_refused():
    """Each rank's ``make_private`` derives q = 1/len(its loader), the expected batch size and C
    from its own arguments, and nothing checks that the ranks agree. With batch size 4 on rank 0
    and 16 on rank 1, rank 1 Poisson-samples its shard at q = 1/2 while rank 0's accountant (the
    ε the docs say to report) charges q = 1/8; with C = 1 on rank 0 and C = 5 on rank 1, rank 1
    releases clipped sums 5x larger than the noise σ·C (drawn on rank 0) is calibrated to. Both
    train silently. Fixed: every rank refuses (ValueError) a world whose ranks disagree."""
    import socket  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415
    import torch.multiprocessing as mp  # noqa: PLC0415

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_spawn_entry, args=(2, port, out_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(2)]
    for name, setting in (("batch", "sample_rate"), ("clip", "max_grad_norm")):
        outcomes = [r[name] for r in results]
        assert all(o[0] == "refused" for o in outcomes), (
            f"{name}: ranks trained with different settings: {outcomes}"
        )
        assert outcomes[0][1] == outcomes[1][1], "every rank must raise the same error"
        assert setting in outcomes[0][1] and "rank 1" in outcomes[0][1], outcomes[0][1]
