"""DPCallback and DPLightningDataModule (dptorch.integrations.lightning, dptorch.lightning) on
scikit-learn's digits, under the ``lightning`` and ``pytorch_lightning`` namespaces (each test
runs once per installed namespace and is skipped for a missing one).

* the callback makes a plain LightningModule private: Poisson batches, ε logged with
  ``self.log`` (progress bar, ``callback_metrics``, CSV logger) equal to an independent
  accountant, the module's own methods and no hooks left after ``fit``;
* a noise-free step with a tight C is the brute-force per-sample reference (every forward pass
  of ``training_step`` is hooked);
* the accountant, noise and sampling are saved in Lightning checkpoints and a resumed run
  continues them (same ε history, same parameters as the uninterrupted run); a checkpoint
  without them is refused;
* ``DPLightningDataModule`` (Opacus's path ``dptorch.lightning``) Poisson-samples the wrapped
  datamodule's training loader and delegates the rest.
"""

from __future__ import annotations

import copy
import csv
import glob
import importlib
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("sklearn")

from dptorch.accountants import create_accountant  # noqa: E402
from dptorch.data_loader import DPDataLoader  # noqa: E402

NAMESPACES = ["lightning", "pytorch_lightning"]


@pytest.fixture(params=NAMESPACES)
def ns(request):
    """``(namespace name, its lightning.pytorch-like module)``; skipped when not installed."""
    name = request.param
    pytest.importorskip(name)
    module = importlib.import_module("lightning.pytorch" if name == "lightning" else name)
    return name, module


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def digits(n: int | None = None, dtype=torch.float32):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 8.0 - 1.0, dtype=dtype), torch.tensor(y)
    if n is not None:
        x, y = x[:n], y[:n]
    return torch.utils.data.TensorDataset(x, y)


def make_classes(pl):
    class DigitsModule(pl.LightningModule):
        def __init__(self, lr: float = 0.5):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))
            self.lr = lr

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    class DigitsData(pl.LightningDataModule):
        def __init__(self, n=None, batch_size=64, dtype=torch.float32):
            super().__init__()
            self.n, self.batch_size, self.dtype = n, batch_size, dtype

        def setup(self, stage=None):
            self.train = digits(self.n, self.dtype)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.train, batch_size=256)

    return DigitsModule, DigitsData


def trainer(pl, tmp_path, callbacks, **kw):
    kw = {"max_epochs": 2, "logger": False, "enable_progress_bar": False,
          "enable_model_summary": False, "enable_checkpointing": False,
          "default_root_dir": str(tmp_path), "num_sanity_val_steps": 0, **kw}
    return pl.Trainer(callbacks=callbacks, accelerator="cpu", devices=1, **kw)


def test_callback_trains_privately_and_logs_epsilon(ns, tmp_path):
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)
    torch.manual_seed(0)
    model, dm = DigitsModule(), DigitsData()
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, seed=0,
                    namespace=name)
    assert isinstance(cb, pl.Callback)
    logger = pl.loggers.CSVLogger(str(tmp_path))
    t = trainer(pl, tmp_path, [cb], logger=logger, log_every_n_steps=5, limit_val_batches=1)
    t.fit(model, datamodule=dm)
    steps_per_epoch = len(dm.train_dataloader())
    assert isinstance(t.train_dataloader, DPDataLoader)
    assert cb.sample_rate == 1 / steps_per_epoch
    acc = create_accountant("prv")
    for _ in range(2 * steps_per_epoch):
        acc.step(noise_multiplier=1.0, sample_rate=cb.sample_rate)
    eps = acc.get_epsilon(1e-5)
    assert cb.privacy_engine.accountant.history == [(1.0, cb.sample_rate, 2 * steps_per_epoch)]
    assert cb.get_epsilon() == pytest.approx(eps, rel=1e-12)
    assert float(t.callback_metrics["epsilon"]) == pytest.approx(eps, rel=1e-6)
    rows = list(csv.DictReader(open(glob.glob(f"{tmp_path}/**/metrics.csv", recursive=True)[0])))
    logged = [float(r["epsilon"]) for r in rows if r.get("epsilon")]
    assert len(logged) >= 2 and logged == sorted(logged) and logged[-1] <= eps + 1e-6
    assert float(t.callback_metrics["val_acc"]) > 0.3  # it learned (chance: 0.1)
    # after fit: the module's own methods, no hooks, no per-sample or clipped-sum attribute
    _assert_plain(model)


def test_callback_target_epsilon(ns, tmp_path):
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)
    cb = DPCallback(target_epsilon=2.0, target_delta=1e-5, max_grad_norm=1.0, seed=0,
                    namespace=name)
    t = trainer(pl, tmp_path, [cb], max_epochs=1, limit_val_batches=0)
    t.fit(DigitsModule(), datamodule=DigitsData())
    assert 2.0 - 0.05 < cb.get_epsilon() <= 2.0


def test_noise_free_step_is_the_per_sample_reference(ns, tmp_path):
    """σ = 0, C below every per-sample norm, one step in float64: the change of the parameters
    is ``-lr · Σ_b C g_b / |g_b| / expected batch`` over the records of the Poisson batch."""
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, _ = make_classes(pl)
    torch.manual_seed(0)
    model = DigitsModule(lr=1.0).double()
    pristine = copy.deepcopy(model)
    data = digits(64, torch.float64)
    seen = []

    class Recording(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            seen.append(int(i))
            return data[i]

    c = 1e-4
    cb = DPCallback(noise_multiplier=0.0, max_grad_norm=c, seed=1, namespace=name)
    t = trainer(pl, tmp_path, [cb], max_steps=1, limit_val_batches=0)
    t.fit(model, train_dataloaders=torch.utils.data.DataLoader(Recording(), batch_size=16))
    assert seen and len(set(seen)) == len(seen)
    grads = []
    for i in seen:
        x, y = data[i]
        pristine.zero_grad()
        F.cross_entropy(pristine.net(x[None]), y[None]).backward()
        grads.append({n: p.grad.clone() for n, p in pristine.named_parameters()})
    expected = cb.dp_optimizer.expected_batch_size
    assert expected == 16
    for n, p in model.named_parameters():
        ref = -sum(g[n] * min(1.0, c / (sum(v.pow(2).sum() for v in g.values()).sqrt() + 1e-6))
                   for g in grads) / expected
        before = dict(pristine.named_parameters())[n]
        got = p.detach() - before.detach()
        assert (got - ref).abs().max() <= 1e-9 * ref.abs().max() + 1e-15, n


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_checkpoint_saves_and_restores_the_accountant(ns, tmp_path):
    """A: 2 epochs straight. B: 1 epoch, checkpoint, then a new Trainer, module and callback
    resumed from it for the second epoch. Same ε history, same final parameters."""
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)

    def run(max_epochs, ckpt_path=None, save=None):
        torch.manual_seed(0)
        model = DigitsModule()
        cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, namespace=name)
        t = trainer(pl, tmp_path, [cb], max_epochs=max_epochs, limit_val_batches=0)
        t.fit(model, datamodule=DigitsData(n=512), ckpt_path=ckpt_path)
        if save is not None:
            t.save_checkpoint(save)
        return model, cb

    model_a, cb_a = run(2)
    path = str(tmp_path / "epoch1.ckpt")
    _, cb_half = run(1, save=path)
    state = torch.load(path, weights_only=False)["callbacks"]["dptorch.DPCallback"]
    assert state["accountant"]["history"] == cb_half.privacy_engine.accountant.history
    model_b, cb_b = run(2, ckpt_path=path)
    assert cb_b.privacy_engine.accountant.history == cb_a.privacy_engine.accountant.history
    assert cb_b.get_epsilon() == cb_a.get_epsilon()
    pa, pb = _params(model_a), _params(model_b)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


def test_resume_with_entropy_seeded_noise_matches_the_straight_run(ns, tmp_path):
    """Default ``seed=None``: the generators come from OS entropy, so two callbacks draw
    different noise. A: 2 epochs straight, checkpointed after the first. B: a new Trainer,
    module and callback resumed from A's checkpoint. Same ε history, same final parameters: the
    checkpoint carries A's noise and sampling streams."""
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)
    ckpt_dir = tmp_path / "ckpt"

    def run(ckpt_path=None, save=False):
        torch.manual_seed(0)
        model = DigitsModule()
        cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, namespace=name)
        saver = [pl.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), save_top_k=-1,
                                              every_n_epochs=1, save_on_train_epoch_end=True)]
        t = trainer(pl, tmp_path, [cb, *(saver if save else [])], max_epochs=2,
                    limit_val_batches=0, enable_checkpointing=save)
        t.fit(model, datamodule=DigitsData(n=512), ckpt_path=ckpt_path)
        return model, cb

    model_a, cb_a = run(save=True)
    first = sorted(glob.glob(str(ckpt_dir / "epoch=0*.ckpt")))
    assert len(first) == 1
    model_b, cb_b = run(ckpt_path=first[0])
    assert cb_b.privacy_engine.accountant.history == cb_a.privacy_engine.accountant.history
    pa, pb = _params(model_a), _params(model_b)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


def test_resume_without_privacy_state_is_refused(ns, tmp_path):
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)
    t = trainer(pl, tmp_path, [], max_epochs=1, limit_val_batches=0)
    t.fit(DigitsModule(), datamodule=DigitsData(n=256))
    path = str(tmp_path / "plain.ckpt")
    t.save_checkpoint(path)
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, namespace=name)
    t2 = trainer(pl, tmp_path, [cb], max_epochs=2, limit_val_batches=0)
    with pytest.raises(ValueError, match="restart epsilon at 0"):
        t2.fit(DigitsModule(), datamodule=DigitsData(n=256), ckpt_path=path)


@pytest.mark.parametrize("setting", [{"accumulate_grad_batches": 2}, {"gradient_clip_val": 1.0}])
def test_callback_refusals(ns, tmp_path, setting):
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, namespace=name)
    t = trainer(pl, tmp_path, [cb], max_epochs=1, limit_val_batches=0, **setting)
    model = DigitsModule()
    with pytest.raises(NotImplementedError, match=next(iter(setting))):
        t.fit(model, datamodule=DigitsData(n=128))
    _assert_plain(model)


def _assert_plain(model) -> None:
    """The module has its own methods back, and no hook or per-sample attribute is left."""
    assert "training_step" not in model.__dict__ and "configure_optimizers" not in model.__dict__
    assert all(not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__
               for m in model.modules())
    left = {n: sorted(vars(p)) for n, p in model.named_parameters() if vars(p) or p._backward_hooks}
    assert not left, left


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_failed_fit_leaves_the_module_plain(ns, tmp_path, mode):
    """Lightning calls no ``teardown`` when ``fit`` raises: the callback restores the module in
    ``on_exception`` (here a ``training_step`` that fails on the third batch, after two DP
    steps), so that it can be trained, privately or not, again."""
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)

    class Failing(DigitsModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    model = Failing()
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
                    namespace=name)
    t = trainer(pl, tmp_path, [cb], max_epochs=1, limit_val_batches=0)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(model, datamodule=DigitsData(n=256))
    assert len(cb.privacy_engine.accountant) == 2
    _assert_plain(model)
    cb2 = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, namespace=name)
    t2 = trainer(pl, tmp_path, [cb2], max_steps=2, limit_val_batches=0)
    t2.fit(DigitsModule(), datamodule=DigitsData(n=256))  # a fresh module trains
    _assert_plain(model)


def test_dp_lightning_datamodule(ns, tmp_path):
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback
    from dptorch.lightning import DPLightningDataModule

    DigitsModule, DigitsData = make_classes(pl)
    inner = DigitsData(n=256, batch_size=32)
    gen = torch.Generator().manual_seed(0)
    dm = DPLightningDataModule(inner, generator=gen)
    assert isinstance(dm, pl.LightningDataModule) and isinstance(dm, DPLightningDataModule)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, DPDataLoader) and loader.sample_rate == 1 / 8
    assert dm.val_dataloader().batch_size == 256
    assert "generator" in dm.state_dict()
    # with the callback: the loader is already Poisson, make_private keeps the sampling rate
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, namespace=name)
    t = trainer(pl, tmp_path, [cb], max_epochs=1, limit_val_batches=0)
    t.fit(DigitsModule(), datamodule=DPLightningDataModule(DigitsData(n=256, batch_size=32)))
    assert cb.sample_rate == 1 / 8 and len(cb.privacy_engine.accountant) == 8


def test_missing_extras_name_the_extra(monkeypatch):
    import sys

    for mod in [m for m in sys.modules if m.startswith("dptorch.integrations.")] + [
        "dptorch.lightning"
    ]:
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"dptorch\[hf\]"):
        importlib.import_module("dptorch.integrations.transformers")
    for mod in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"dptorch\[lightning\]"):
        importlib.import_module("dptorch.lightning")
    assert os.path.basename(importlib.import_module("dptorch").__file__) == "__init__.py"


@pytest.mark.parametrize("where", ["init", "setup"])
def test_manual_optimization_is_refused(ns, tmp_path, where):
    """``automatic_optimization = False`` (the optimizer stepped inside ``training_step``) is
    refused before any step, naming manual optimization, whether the module sets it in
    ``__init__`` (seen in the callback's ``setup``) or in its own ``setup`` (which Lightning
    runs after the callback's; seen when the optimizer is made private). The module is left
    plain."""
    name, pl = ns
    from dptorch.integrations.lightning import DPCallback

    DigitsModule, DigitsData = make_classes(pl)

    class Manual(DigitsModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = where != "init"

        def setup(self, stage):
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self.net(batch[0]), batch[1]))
            opt.step()

    model = Manual()
    before = copy.deepcopy(model.state_dict())
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, namespace=name)
    t = trainer(pl, tmp_path, [cb], max_epochs=1, limit_val_batches=0)
    with pytest.raises(ValueError, match="manual optimization.*automatic_optimization"):
        t.fit(model, datamodule=DigitsData(n=128))
    assert cb.privacy_engine is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    _assert_plain(model)
