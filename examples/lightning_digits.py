"""DP-SGD with Lightning: an unchanged LightningModule made private by ``DPCallback``.

scikit-learn's 8x8 digits (shipped with it, nothing is downloaded), a small MLP written as an
ordinary ``LightningModule`` (``training_step`` returns the mean cross-entropy,
``configure_optimizers`` returns SGD) and an ordinary ``LightningDataModule``. Privacy is one
callback::

    trainer = L.Trainer(max_epochs=15, callbacks=[DPCallback(target_epsilon=3,
                        target_delta=1e-5, max_grad_norm=1.0)])
    trainer.fit(model, datamodule=DigitsData())

The callback Poisson-samples the training loader, wraps the module for per-sample clipping
(``bk`` mode), gives Lightning the DP optimizer, logs ``epsilon`` with ``self.log`` (progress
bar, CSV logger) and keeps the accountant in checkpoints. ``--datamodule`` also wraps the data
module in ``DPLightningDataModule`` (Opacus's ``opacus.lightning`` class, here
``dptorch.lightning``), which Poisson-samples its training loader itself.

Works with ``import lightning`` (default) and ``import pytorch_lightning``
(``--namespace pytorch_lightning``).

Examples::

    python examples/lightning_digits.py                 # epsilon 3, 15 epochs
    python examples/lightning_digits.py --sigma 1.0     # fixed noise multiplier
    python examples/lightning_digits.py --smoke         # 3 steps
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dptorch.lightning import DPCallback, DPLightningDataModule  # pip install "dptorch[lightning]"


def lightning_classes(pl):
    """The example's LightningModule and LightningDataModule, in the namespace ``pl``."""

    class DigitsMLP(pl.LightningModule):
        def __init__(self, lr: float):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
            self.lr = lr

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            self.log("val_loss", F.cross_entropy(logits, y))
            self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)

    class DigitsData(pl.LightningDataModule):
        """Train/test split of the digits; pixels mapped to [-1, 1] by a fixed formula
        (statistics of the private data would be a release outside the accounted epsilon)."""

        def __init__(self, batch_size: int, seed: int):
            super().__init__()
            self.batch_size, self.seed = batch_size, seed

        def setup(self, stage=None):
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            x, y = load_digits(return_X_y=True)
            x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=self.seed,
                                                      stratify=y)

            def ds(a, b):
                return torch.utils.data.TensorDataset(
                    torch.tensor(a / 8.0 - 1.0, dtype=torch.float32), torch.tensor(b))

            self.train, self.test = ds(x_tr, y_tr), ds(x_te, y_te)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.test, batch_size=512)

    return DigitsMLP, DigitsData


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=float, default=3.0, help="target epsilon (default 3)")
    budget.add_argument("--sigma", type=float, default=None, help="fixed noise multiplier")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=64, help="expected Poisson batch size")
    p.add_argument("--mode", default="bk", choices=("bk", "hooks", "functorch", "ew"))
    p.add_argument("--namespace", default=None, choices=("lightning", "pytorch_lightning"))
    p.add_argument("--datamodule", action="store_true",
                   help="also wrap the data module in DPLightningDataModule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny run: 1 epoch of 3 steps")
    args = p.parse_args(argv)
    if args.sigma is not None:
        args.epsilon = None
    elif not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        p.error("--epsilon must be > 0")
    if args.smoke:
        args.epochs = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.namespace
    if name is None:
        name = "lightning" if importlib.util.find_spec("lightning") else "pytorch_lightning"
    pl = importlib.import_module("lightning.pytorch" if name == "lightning" else name)
    pl.seed_everything(args.seed, verbose=False)
    DigitsMLP, DigitsData = lightning_classes(pl)
    model = DigitsMLP(lr=args.lr)
    data = DigitsData(args.batch_size, args.seed)
    if args.datamodule:
        data = DPLightningDataModule(data, generator=torch.Generator().manual_seed(args.seed))

    privacy = DPCallback(
        max_grad_norm=args.max_grad_norm, target_epsilon=args.epsilon,
        noise_multiplier=args.sigma, target_delta=args.delta, grad_sample_mode=args.mode,
        seed=args.seed, namespace=name,
    )
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's tips about workers and loggers
        trainer = pl.Trainer(
            max_epochs=args.epochs, limit_train_batches=3 if args.smoke else None,
            callbacks=[privacy], logger=pl.loggers.CSVLogger(tmp), default_root_dir=tmp,
            accelerator="cpu", devices=1, enable_checkpointing=False,
            enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=5,
            enable_progress_bar=not args.smoke,
        )
        trainer.fit(model, datamodule=data)
        metrics = trainer.validate(model, datamodule=data, verbose=False)[0]
    print(f"{name}: {len(privacy.privacy_engine.accountant)} DP steps, sigma "
          f"{privacy.noise_multiplier:.3f}, sample rate {privacy.sample_rate:.4g}, "
          f"C {args.max_grad_norm}, mode {args.mode}")
    print(f"final: test accuracy {metrics['val_acc']:.3f}, test loss {metrics['val_loss']:.4f}, "
          f"epsilon {privacy.get_epsilon():.3f} at delta {args.delta:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
