"""DP-SGD training of a small convolutional network on scikit-learn's 8x8 digits.

The MNIST example of the DP-SGD literature, shrunk to run offline on a laptop CPU in well under a
minute: scikit-learn ships the 1,797 digit images, so nothing is downloaded.

It shows the usual dptorch workflow:

1. build a model and, with ``--batchnorm``, let ``ModuleValidator.fix`` replace the BatchNorm
   layers (which mix the samples of a batch, so per-sample gradients are not defined) by GroupNorm;
2. ``PrivacyEngine.make_private`` (fixed ``--sigma``) or ``make_private_with_epsilon``
   (``--epsilon``): Poisson-sampled DPDataLoader, per-sample clipping, Gaussian noise;
3. optionally ``BatchMemoryManager`` (``--max-physical-batch-size``) to bound memory while the
   logical, Poisson-sampled batch stays large;
4. ``PrivacyEngine.get_epsilon`` after every epoch.

The flags, the ``make_private``/``make_private_with_epsilon`` set-up and the epoch loop that
the classifier examples share live in ``examples/_common.py``.

Examples::

    python examples/mnist_digits_cnn.py                       # sigma = 1.0, 20 epochs
    python examples/mnist_digits_cnn.py --epsilon 3           # calibrate sigma to epsilon = 3
    python examples/mnist_digits_cnn.py --batchnorm --max-physical-batch-size 16
    python examples/mnist_digits_cnn.py --smoke               # 1 epoch, 3 steps
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import add_run_args, add_training_args, check_args, fit, make_private, privacy_summary
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.validators import ModuleValidator


class DigitsConvNet(nn.Module):
    """Two conv blocks and a two-layer head for 1x8x8 images (8x8 -> 4x4 -> 2x2).

    With ``batchnorm=True`` each conv is followed by ``nn.BatchNorm2d``, which DP-SGD cannot
    train (a sample's output depends on the other samples of the batch);
    ``ModuleValidator.fix`` swaps it for ``nn.GroupNorm``.
    """

    def __init__(self, batchnorm: bool = False, channels: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.norm1 = nn.BatchNorm2d(channels) if batchnorm else nn.Identity()
        self.conv2 = nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1)
        self.norm2 = nn.BatchNorm2d(2 * channels) if batchnorm else nn.Identity()
        self.fc1 = nn.Linear(2 * channels * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2)  # (B, C, 4, 4)
        x = F.max_pool2d(F.relu(self.norm2(self.conv2(x))), 2)  # (B, 2C, 2, 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train/test split of the digits as (N, 1, 8, 8) tensors.

    Pixels (0..16) are mapped to [-1, 1] by a fixed formula. Standardising with the training
    set's mean and std would use the private data outside the accounted epsilon.
    """
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)

    def to_ds(a, b) -> TensorDataset:
        images = torch.tensor(a / 8.0 - 1.0, dtype=torch.float32).view(-1, 1, 8, 8)
        return TensorDataset(images, torch.tensor(b, dtype=torch.long))

    return to_ds(x_tr, y_tr), to_ds(x_te, y_te)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p, epochs=20, lr=0.05, lr_help="SGD learning rate", momentum=0.9,
                      batch_size=64)
    p.add_argument("--batchnorm", action="store_true",
                   help="build the model with BatchNorm and fix it with ModuleValidator.fix")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.epochs, args.max_steps = 1, 3
    check_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train_ds, test_ds = load_data(args.seed)

    model = DigitsConvNet(batchnorm=args.batchnorm)
    if not ModuleValidator.is_valid(model):
        errors = ModuleValidator.validate(model, strict=False)
        print(f"model not trainable with DP-SGD ({len(errors)} problem(s)), e.g. {errors[0]}")
        model = ModuleValidator.fix(model)  # BatchNorm -> GroupNorm (a new module)
        print("after ModuleValidator.fix:", model.norm1, model.norm2)
    model = model.to(device)
    # the optimizer must be built on the fixed model's parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size)
    test_loader = DataLoader(test_ds, batch_size=256)
    engine = PrivacyEngine(accountant=args.accountant)
    # engine.make_private(..., noise_multiplier=args.sigma), or with --epsilon
    # engine.make_private_with_epsilon(..., target_epsilon=args.epsilon, epochs=args.epochs)
    model, optimizer, train_loader = make_private(
        engine, args, device, module=model, optimizer=optimizer, data_loader=train_loader
    )
    print(f"training on {len(train_ds)} images: "
          f"{privacy_summary(args, optimizer, train_loader)}")

    # per epoch: train (with --max-physical-batch-size under BatchMemoryManager), evaluate,
    # engine.get_epsilon(args.delta)
    fit(engine, model, optimizer, train_loader, test_loader, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
