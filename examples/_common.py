"""Pieces shared by the DP-SGD classifier examples (mnist_digits_cnn, char_lstm, text_classifier).

Not an example itself: the scripts import it (``from _common import ...``), which works when a
script runs as ``python examples/NAME.py`` because Python puts the script's folder on
``sys.path``. What is here:

- ``add_training_args`` / ``add_run_args`` / ``check_args``: the command-line flags every example
  has (``--epochs``, ``--sigma`` or ``--epsilon``, ``--delta``, ``--max-grad-norm``, ``--lr``,
  ``--batch-size``, ``--max-physical-batch-size``, ``--accountant``, ``--seed``, ``--device``,
  ``--max-steps``, ``--smoke``) and their checks;
- ``make_private``: ``PrivacyEngine.make_private`` with a fixed ``--sigma``, or
  ``make_private_with_epsilon`` to calibrate sigma to ``--epsilon``;
- ``fit``: the epoch loop (optionally under ``BatchMemoryManager``), evaluation and
  ``PrivacyEngine.get_epsilon`` after every epoch, and the per-epoch and final report lines.

A batch of the data loaders is ``(*inputs, labels)``: the model is called as ``model(*inputs)``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from dptorch import PrivacyEngine
from dptorch.utils.batch_memory_manager import BatchMemoryManager

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- command line
def add_training_args(p: argparse.ArgumentParser, *, epochs: int, lr: float, lr_help: str,
                      batch_size: int, momentum: float | None = None) -> None:
    """``--epochs``, ``--sigma``/``--epsilon`` (exclusive), ``--delta``, ``--max-grad-norm``,
    ``--lr``, (``--momentum`` when a default is given), ``--batch-size`` and
    ``--max-physical-batch-size``, with the script's defaults."""
    p.add_argument("--epochs", type=int, default=epochs)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--sigma", type=float, default=1.0,
                        help="noise multiplier (default 1.0); ignored with --epsilon")
    budget.add_argument("--epsilon", type=float, default=None,
                        help="target epsilon: calibrate sigma with make_private_with_epsilon")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping norm C")
    p.add_argument("--lr", type=float, default=lr, help=lr_help)
    if momentum is not None:
        p.add_argument("--momentum", type=float, default=momentum)
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help="expected (Poisson) logical batch size")
    p.add_argument("--max-physical-batch-size", type=int, default=None,
                   help="split logical batches into physical ones of at most this size "
                        "(BatchMemoryManager)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """``--accountant``, ``--seed``, ``--device``, ``--max-steps`` and ``--smoke``."""
    p.add_argument("--accountant", choices=("prv", "rdp", "gdp", "pld"), default="prv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop each epoch after this many optimizer steps")
    p.add_argument("--smoke", action="store_true", help="tiny run: 1 epoch of 3 steps")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace,
               positive: tuple[str, ...] = ()) -> None:
    """Exits with a usage error (status 2) on a bad value of a common flag; ``positive`` names
    the script's own flags (as attributes, ``names_per_class``) that must be integers > 0."""
    for name in ("epochs", "batch_size", *positive):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if not (args.max_grad_norm > 0 and args.lr > 0 and args.sigma >= 0):
        p.error("--max-grad-norm and --lr must be > 0, --sigma >= 0")
    if args.epsilon is not None and not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        p.error("--epsilon must be a finite number > 0")
    if not 0 < args.delta < 1:
        p.error("--delta must be in (0, 1)")


# ----------------------------------------------------------------------------- privacy
def make_private(engine: PrivacyEngine, args: argparse.Namespace, device: torch.device,
                 **kwargs) -> tuple:
    """With ``--epsilon``: ``engine.make_private_with_epsilon`` (sigma calibrated so that
    ``--epochs`` epochs cost ``--epsilon`` at ``--delta``); else ``engine.make_private`` with
    ``noise_multiplier=--sigma``. Both clip at ``--max-grad-norm`` and draw the noise from a
    generator seeded with ``--seed``. ``kwargs`` (``module``, ``optimizer``, ``data_loader``, ...)
    go to the engine; returns what it returns, e.g. ``(module, optimizer, data_loader)``."""
    common = dict(kwargs, max_grad_norm=args.max_grad_norm,
                  noise_generator=torch.Generator(device=device).manual_seed(args.seed))
    if args.epsilon is not None:
        return engine.make_private_with_epsilon(
            **common, target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs
        )
    return engine.make_private(**common, noise_multiplier=args.sigma)


def privacy_summary(args: argparse.Namespace, optimizer, train_loader: DataLoader) -> str:
    """``sample rate q, sigma s, C c, accountant a`` of a private optimizer and loader."""
    return (f"sample rate {1 / len(train_loader):.4f}, sigma {optimizer.noise_multiplier:.3f}, "
            f"C {args.max_grad_norm}, accountant {args.accountant}")


# ----------------------------------------------------------------------------- training
def cross_entropy_or_noise(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; an empty Poisson batch (``out`` of shape (0, classes)) gets ``out.sum()``,
    a zero loss whose backward still lets the optimizer take its noise-only step."""
    return F.cross_entropy(out, y) if len(y) else out.sum()


def train_epoch(model: nn.Module, optimizer, loader, device: torch.device,
                max_steps: int | None, loss_fn: LossFn) -> tuple[float, float]:
    """One pass over ``loader``; returns the mean loss and the accuracy on the seen batches.

    With BatchMemoryManager ``optimizer.step()`` only updates the model on the last physical
    batch of each logical batch; ``optimizer._is_last_step_skipped`` tells which one it was.
    """
    losses, correct, seen, steps = [], 0, 0, 0
    for *inputs, y in loader:
        inputs, y = [t.to(device) for t in inputs], y.to(device)
        optimizer.zero_grad()
        out = model(*inputs)
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
        if len(y):
            losses.append(loss.item())
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
        if not optimizer._is_last_step_skipped:  # a BatchMemoryManager physical batch, not a step
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
    return sum(losses) / max(len(losses), 1), correct / max(seen, 1)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy of ``model`` on ``loader``."""
    model.eval()
    correct = total = 0
    for *inputs, y in loader:
        inputs, y = [t.to(device) for t in inputs], y.to(device)
        correct += (model(*inputs).argmax(1) == y).sum().item()
        total += len(y)
    model.train()
    return correct / max(total, 1)


def fit(engine: PrivacyEngine, model: nn.Module, optimizer, train_loader: DataLoader,
        test_loader: DataLoader, args: argparse.Namespace, device: torch.device, *,
        loss_fn: LossFn = cross_entropy_or_noise, chance: float | None = None) -> tuple[float, float]:
    """Trains for ``--epochs`` epochs (each under ``BatchMemoryManager`` when
    ``--max-physical-batch-size`` is set, and cut at ``--max-steps`` steps), printing the loss,
    the accuracies and ``engine.get_epsilon(--delta)`` after each; then prints the ``final:``
    line (with the ``chance`` accuracy when given). Returns the final (test accuracy, epsilon)."""
    start = time.perf_counter()
    acc = eps = math.nan
    for epoch in range(1, args.epochs + 1):
        if args.max_physical_batch_size:
            with BatchMemoryManager(data_loader=train_loader, optimizer=optimizer,
                                    max_physical_batch_size=args.max_physical_batch_size) as loader:
                loss, train_acc = train_epoch(model, optimizer, loader, device, args.max_steps,
                                              loss_fn)
        else:
            loss, train_acc = train_epoch(model, optimizer, train_loader, device, args.max_steps,
                                          loss_fn)
        acc = evaluate(model, test_loader, device)
        eps = engine.get_epsilon(args.delta)
        print(f"epoch {epoch:2d}: loss {loss:.4f}  train accuracy {train_acc:.3f}  "
              f"test accuracy {acc:.3f}  epsilon {eps:.3f} (delta {args.delta:g})")
    chance_note = "" if chance is None else f" (chance {chance:.3f})"
    print(f"final: test accuracy {acc:.3f}{chance_note}, epsilon {eps:.3f} "
          f"at delta {args.delta:g} ({time.perf_counter() - start:.1f} s)")
    return acc, eps
