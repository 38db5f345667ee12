"""A complete one-run audit: DP-SGD on scikit-learn's digits with canaries, then
:class:`~dptorch.auditing.one_run.OneRunAuditor`'s bound (what ``dptorch audit --one-run``
runs).

The canaries are ``m`` random sign images (every pixel ±1, outside the data's distribution) with
random labels; each joins the 1,437 training images with probability ½. The model (an MLP,
64-``hidden``-10, tanh) is trained with ``make_private_with_epsilon`` to the target ε on the
training set with the included canaries, by the usual loop. Scores: black-box (minus each
canary's final loss) or white-box (gradient alignment, observed at every step).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..privacy_engine import PrivacyEngine
from ..scripts.train_digits import load_digits_split
from .one_run import OneRunAuditor, OneRunResult

__all__ = ["audit_digits_one_run"]


def audit_digits_one_run(
    *,
    epsilon: float = 8.0,
    delta: float = 1e-5,
    canaries: int = 1000,
    scores: str = "black",
    hidden: int = 256,
    epochs: int = 30,
    batch_size: int = 128,
    lr: float = 1.0,
    max_grad_norm: float = 1.0,
    grad_sample_mode: str = "bk",
    accountant: str = "prv",
    confidence: float = 0.95,
    seed: int = 0,
) -> OneRunResult:
    """Trains on digits with ``canaries`` canaries at ``(epsilon, delta)`` and audits the run.

    ``scores``: ``"black"`` (final losses) or ``"white"`` (gradient alignment at every step;
    slower). Returns the :class:`OneRunResult`; its ``details`` hold the test accuracy, the
    noise multiplier and the wall time."""
    if scores not in ("black", "white"):
        raise ValueError(f"scores must be 'black' or 'white', got {scores!r}")
    start = time.perf_counter()
    torch.manual_seed(seed)
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed)
    gen = torch.Generator().manual_seed(seed + 10)
    canary_x = torch.randint(0, 2, (canaries, x_train.shape[1]), generator=gen).float() * 2 - 1
    canary_y = torch.randint(0, 10, (canaries,), generator=gen)
    auditor = OneRunAuditor(canary_x, canary_y, seed=seed + 11)
    train_set = auditor.training_set(TensorDataset(x_train, y_train))

    net = nn.Sequential(nn.Linear(x_train.shape[1], hidden), nn.Tanh(), nn.Linear(hidden, 10))
    engine = PrivacyEngine(accountant=accountant)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=lr),
        data_loader=DataLoader(train_set, batch_size=batch_size),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        grad_sample_mode=grad_sample_mode,
        noise_generator=torch.Generator().manual_seed(seed + 12),
    )
    loss_fn = nn.functional.cross_entropy
    watch = auditor.observe(model, optimizer, loss_fn) if scores == "white" else contextlib.nullcontext()
    with watch:
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
    s = auditor.white_box_scores if scores == "white" else auditor.black_box_scores(model, loss_fn)
    result = auditor.audit(s, epsilon=engine.get_epsilon(delta), delta=delta, confidence=confidence)
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    result.details.update(
        test_accuracy=accuracy,
        noise_multiplier=optimizer.noise_multiplier,
        seconds=time.perf_counter() - start,
    )
    return result
