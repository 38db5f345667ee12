"""``dptorch train-digits``: a complete DP-SGD training run on scikit-learn's digits.

The data set (1,797 8x8 images, 10 classes) ships inside scikit-learn, so nothing is
downloaded. The model is trained with ``PrivacyEngine.make_private_with_epsilon`` (Poisson
sampling, per-sample clipping, Gaussian noise calibrated to the target ε) and compared with the
same model trained without DP. Pixels are scaled with a fixed, data-independent map
(``x / 8 - 1``), so no statistic of the private training set leaks outside the accounted ε.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .argtypes import positive_float, positive_int, unit_open

logger = logging.getLogger(__name__)

MODELS = ("cnn", "mlp", "linear")


class DigitsCNN(nn.Module):
    """A small convolutional classifier for 1x8x8 images (GroupNorm-free, DP-friendly)."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv1(x.view(-1, 1, 8, 8)))
        x = nn.functional.avg_pool2d(x, 2)
        x = torch.tanh(self.conv2(x))
        x = nn.functional.avg_pool2d(x, 2)
        return self.fc(x.flatten(1))


def build_model(name: str) -> nn.Module:
    """``"cnn"``, ``"mlp"`` (64-64-10, tanh) or ``"linear"`` (softmax regression)."""
    if name == "cnn":
        return DigitsCNN()
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    if name == "linear":
        return nn.Linear(64, 10)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def load_digits_split(seed: int, test_fraction: float = 0.2):
    """Train/test tensors of the digits data set, features scaled to [-1, 1] data-independently."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "train-digits needs scikit-learn: pip install 'dptorch[examples]'"
        ) from e
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )

    def to_tensors(a, b):
        return torch.tensor(a / 8.0 - 1.0, dtype=torch.float32), torch.tensor(b)

    return to_tensors(x_tr, y_tr), to_tensors(x_te, y_te)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


@dataclass
class RunResult:
    dp_accuracy: float
    nonprivate_accuracy: float
    epsilon: float
    delta: float
    noise_multiplier: float
    max_grad_norm: float
    epochs: int
    sample_rate: float
    wall_time_s: float
    history: list[dict] = field(default_factory=list)


def train_nonprivate(model, train, test, *, epochs, batch_size, lr, seed) -> float:
    """Same model, same optimiser family, shuffled mini-batches, no clipping or noise."""
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(TensorDataset(*train), batch_size=batch_size, shuffle=True, generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return accuracy(model, *test)


def train_dp(
    *,
    epsilon: float = 3.0,
    delta: float = 1e-5,
    epochs: int = 20,
    batch_size: int = 256,
    max_grad_norm: float = 0.2,
    lr: float = 0.05,
    model: str = "linear",
    accountant: str = "prv",
    seed: int = 0,
    progress: bool = True,
    baseline: bool = True,
) -> RunResult:
    """Trains ``model`` on digits with DP-SGD to ``(epsilon, delta)``; returns the summary."""
    from ..privacy_engine import PrivacyEngine

    start = time.perf_counter()
    torch.manual_seed(seed)
    train, test = load_digits_split(seed)
    net = build_model(model)
    nonprivate_net = build_model(model)
    nonprivate_net.load_state_dict(net.state_dict())

    engine = PrivacyEngine(accountant=accountant)
    loader = DataLoader(TensorDataset(*train), batch_size=batch_size)
    dp_net, optimizer, dp_loader = engine.make_private_with_epsilon(
        module=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=lr),
        data_loader=loader,
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        noise_generator=torch.Generator().manual_seed(seed + 1),
    )
    sample_rate = 1.0 / len(loader)
    history: list[dict] = []
    bar = _progress(range(epochs), progress)
    for epoch in bar:
        losses = []
        for xb, yb in dp_loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(dp_net(xb), yb)
            loss.backward()
            optimizer.step()
            if len(yb):
                losses.append(loss.item())
        eps = engine.get_epsilon(delta)
        acc = accuracy(dp_net, *test)
        row = {"epoch": epoch + 1, "loss": _mean(losses), "accuracy": acc, "epsilon": eps}
        history.append(row)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{acc:.3f}", eps=f"{eps:.2f}")
        logger.info("epoch %d: %s", epoch + 1, row)

    nonprivate_acc = math.nan
    if baseline:
        nonprivate_acc = train_nonprivate(
            nonprivate_net, train, test, epochs=epochs, batch_size=batch_size, lr=lr / 5,
            seed=seed,
        )
    return RunResult(
        dp_accuracy=history[-1]["accuracy"],
        nonprivate_accuracy=nonprivate_acc,
        epsilon=engine.get_epsilon(delta),
        delta=delta,
        noise_multiplier=optimizer.noise_multiplier,
        max_grad_norm=max_grad_norm,
        epochs=epochs,
        sample_rate=sample_rate,
        wall_time_s=time.perf_counter() - start,
        history=history,
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _progress(it, enabled: bool):
    if not enabled:
        return it
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return it
    return tqdm(it, desc="DP training", unit="epoch")


def write_plot(result: RunResult, path: str) -> None:
    """PNG with test accuracy and ε after each epoch (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover
        raise SystemExit("--plot needs matplotlib: pip install 'dptorch[examples]'") from e
    epochs = [r["epoch"] for r in result.history]
    fig, ax1 = plt.subplots(figsize=(6, 4))
    ax1.plot(epochs, [r["accuracy"] for r in result.history], "b-o", label="DP test accuracy")
    ax1.axhline(result.nonprivate_accuracy, color="b", ls="--", label="non-private")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("test accuracy", color="b")
    ax2 = ax1.twinx()
    ax2.plot(epochs, [r["epsilon"] for r in result.history], "r-s", label="epsilon")
    ax2.set_ylabel(f"epsilon (delta={result.delta:g})", color="r")
    ax1.set_title("dptorch: DP-SGD on digits")
    # one legend inside the axes (lower right stays clear: both curves end near the top)
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(handles=handles, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(result: RunResult) -> str:
    return "\n".join(
        [
            "== dptorch train-digits summary ==",
            f"test accuracy (DP)          : {result.dp_accuracy:.2%}",
            f"test accuracy (non-private) : {result.nonprivate_accuracy:.2%}",
            f"epsilon                     : {result.epsilon:.3f} at delta = {result.delta:g}",
            f"noise multiplier (sigma)    : {result.noise_multiplier:.4f}",
            f"max grad norm (C)           : {result.max_grad_norm:g}",
            f"epochs / sample rate        : {result.epochs} / {result.sample_rate:.4f}",
            f"wall time                   : {result.wall_time_s:.1f} s",
        ]
    )


# ---------------------------------------------------------------------- command line
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``train-digits`` on the ``dptorch`` command line."""
    p = subparsers.add_parser(
        "train-digits",
        help="DP-SGD training run on scikit-learn's digits (offline)",
        description="Train a classifier on scikit-learn's 8x8 digits with DP-SGD "
        "(make_private_with_epsilon), show progress, and print test accuracy of the DP and the "
        "non-private model, epsilon, sigma, C, epochs and wall time.",
    )
    p.add_argument("--epsilon", type=positive_float, default=3.0, help="target epsilon (default 3)")
    p.add_argument("--delta", type=unit_open, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--epochs", type=positive_int, default=20, help="epochs (default 20)")
    p.add_argument("--batch-size", type=positive_int, default=256,
                   help="expected (Poisson) batch size (default 256)")
    p.add_argument("--max-grad-norm", type=positive_float, default=0.2,
                   help="per-sample clipping norm C (default 0.2)")
    p.add_argument("--lr", type=positive_float, default=0.05, help="Adam learning rate (default 0.05)")
    p.add_argument("--model", choices=MODELS, default="linear",
                   help="architecture (default linear = softmax regression)")
    p.add_argument("--accountant", choices=("prv", "pld", "rdp", "gdp"), default="prv",
                   help="privacy accountant (default prv)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write accuracy and epsilon per epoch to this PNG file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.batch_size > 1437:
        parser.error("--batch-size must be at most the training set size (1437)")
    if args.plot:  # fail before training, not after it
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            parser.error(f"--plot: folder {folder} does not exist")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'dptorch[examples]'")
    try:
        result = train_dp(
            epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
            batch_size=args.batch_size, max_grad_norm=args.max_grad_norm, lr=args.lr,
            model=args.model, accountant=args.accountant, seed=args.seed,
            progress=not args.no_progress,
        )
    except ValueError as e:
        parser.error(str(e))
    print(summary(result))
    if args.plot:
        write_plot(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0
