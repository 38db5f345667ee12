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

Examples::

    python examples/mnist_digits_cnn.py                       # sigma = 1.0, 20 epochs
    python examples/mnist_digits_cnn.py --epsilon 3           # calibrate sigma to epsilon = 3
    python examples/mnist_digits_cnn.py --batchnorm --max-physical-batch-size 16
    python examples/mnist_digits_cnn.py --smoke               # 1 epoch, 3 steps
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.utils.batch_memory_manager import BatchMemoryManager
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


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    model.train()
    return correct / max(total, 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--sigma", type=float, default=1.0,
                        help="noise multiplier (default 1.0); ignored with --epsilon")
    budget.add_argument("--epsilon", type=float, default=None,
                        help="target epsilon: calibrate sigma with make_private_with_epsilon")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping norm C")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=64,
                   help="expected (Poisson) logical batch size")
    p.add_argument("--max-physical-batch-size", type=int, default=None,
                   help="split logical batches into physical ones of at most this size "
                        "(BatchMemoryManager)")
    p.add_argument("--batchnorm", action="store_true",
                   help="build the model with BatchNorm and fix it with ModuleValidator.fix")
    p.add_argument("--accountant", choices=("prv", "rdp", "gdp", "pld"), default="prv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop each epoch after this many optimizer steps")
    p.add_argument("--smoke", action="store_true", help="tiny run: 1 epoch of 3 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.epochs, args.max_steps = 1, 3
    for name in ("epochs", "batch_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if not (args.max_grad_norm > 0 and args.lr > 0 and args.sigma >= 0):
        p.error("--max-grad-norm and --lr must be > 0, --sigma >= 0")
    if args.epsilon is not None and not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        p.error("--epsilon must be a finite number > 0")
    if not 0 < args.delta < 1:
        p.error("--delta must be in (0, 1)")
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
    common = dict(module=model, optimizer=optimizer, data_loader=train_loader,
                  max_grad_norm=args.max_grad_norm,
                  noise_generator=torch.Generator(device=device).manual_seed(args.seed))
    if args.epsilon is not None:
        model, optimizer, train_loader = engine.make_private_with_epsilon(
            **common, target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs
        )
    else:
        model, optimizer, train_loader = engine.make_private(**common, noise_multiplier=args.sigma)
    print(f"training on {len(train_ds)} images: sample rate {1 / len(train_loader):.4f}, "
          f"sigma {optimizer.noise_multiplier:.3f}, C {args.max_grad_norm}, "
          f"accountant {args.accountant}")

    start = time.perf_counter()
    acc = eps = math.nan
    for epoch in range(1, args.epochs + 1):
        if args.max_physical_batch_size:
            with BatchMemoryManager(data_loader=train_loader, optimizer=optimizer,
                                    max_physical_batch_size=args.max_physical_batch_size) as loader:
                loss, train_acc = train_epoch(model, optimizer, loader, device, args.max_steps)
        else:
            loss, train_acc = train_epoch(model, optimizer, train_loader, device, args.max_steps)
        acc = evaluate(model, test_loader, device)
        eps = engine.get_epsilon(args.delta)
        print(f"epoch {epoch:2d}: loss {loss:.4f}  train accuracy {train_acc:.3f}  "
              f"test accuracy {acc:.3f}  epsilon {eps:.3f} (delta {args.delta:g})")
    print(f"final: test accuracy {acc:.3f}, epsilon {eps:.3f} at delta {args.delta:g} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def train_epoch(model, optimizer, loader, device, max_steps: int | None) -> tuple[float, float]:
    """One pass over ``loader``; returns the mean loss and the accuracy on the seen batches.

    With BatchMemoryManager ``optimizer.step()`` only updates the model on the last physical
    batch of each logical batch; ``optimizer._is_last_step_skipped`` tells which one it was.
    """
    losses, correct, seen, steps = [], 0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        out = model(x)  # an empty Poisson batch gives a (0, 10) output and a noise-only step
        loss = F.cross_entropy(out, y) if len(y) else out.sum()
        loss.backward()
        optimizer.step()
        if len(y):
            losses.append(loss.item())
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
        if not optimizer._is_last_step_skipped:
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
    return sum(losses) / max(len(losses), 1), correct / max(seen, 1)


if __name__ == "__main__":
    sys.exit(main())
