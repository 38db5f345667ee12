"""DP-SGD training of a character-level LSTM that guesses the "language" of a name.

The classic task classifies surnames by their language of origin. To stay offline this example
generates its own names: each of the 18 "languages" is a first-order Markov chain over the
letters a-z (random start and transition probabilities, peaked so that the languages have
recognisable letter pairs) with its own length range. The model is

    nn.Embedding -> dptorch.layers.DPLSTM -> nn.Linear

fed a ``PackedSequence`` of the variable-length names. ``DPLSTM`` is a drop-in replacement for
``nn.LSTM`` whose gates are ``nn.Linear`` layers, so per-sample gradients come from the ordinary
Linear grad sampler, summed over the time steps of each name. (``ModuleValidator.fix`` would also
replace an ``nn.LSTM`` by a ``DPLSTM``.)

Examples::

    python examples/char_lstm.py                   # sigma = 1.0, 10 epochs
    python examples/char_lstm.py --epsilon 5       # calibrate sigma to epsilon = 5
    python examples/char_lstm.py --smoke           # 1 epoch, 3 steps
"""

from __future__ import annotations

import argparse
import math
import string
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.layers import DPLSTM
from dptorch.utils.batch_memory_manager import BatchMemoryManager

ALPHABET = string.ascii_lowercase
PAD = 0  # token 0 pads; letters are 1..26


def make_languages(n_classes: int, rng: np.random.Generator) -> list[dict]:
    """One Markov chain per class: start distribution, transition matrix, length range."""
    k = len(ALPHABET)
    languages = []
    for _ in range(n_classes):
        lo = int(rng.integers(3, 7))
        languages.append({
            "start": rng.dirichlet(np.full(k, 0.1)),
            "trans": rng.dirichlet(np.full(k, 0.05), size=k),
            "lengths": (lo, lo + int(rng.integers(2, 6))),
        })
    return languages


def sample_name(lang: dict, rng: np.random.Generator) -> list[int]:
    length = int(rng.integers(lang["lengths"][0], lang["lengths"][1] + 1))
    letters = [int(rng.choice(len(ALPHABET), p=lang["start"]))]
    while len(letters) < length:
        letters.append(int(rng.choice(len(ALPHABET), p=lang["trans"][letters[-1]])))
    return [c + 1 for c in letters]


def make_dataset(n_per_class: int, n_classes: int, seed: int) -> tuple[TensorDataset, int]:
    """Names padded to the longest one: ``(tokens (N, T), lengths (N,), labels (N,))``."""
    rng = np.random.default_rng(seed)
    languages = make_languages(n_classes, rng)
    names, labels = [], []
    for label, lang in enumerate(languages):
        for _ in range(n_per_class):
            names.append(sample_name(lang, rng))
            labels.append(label)
    max_len = max(map(len, names))
    tokens = torch.full((len(names), max_len), PAD, dtype=torch.long)
    for i, name in enumerate(names):
        tokens[i, : len(name)] = torch.tensor(name)
    lengths = torch.tensor([len(n) for n in names])
    return TensorDataset(tokens, lengths, torch.tensor(labels)), max_len


def decode(tokens: torch.Tensor, length: int) -> str:
    return "".join(ALPHABET[t - 1] for t in tokens[:length].tolist())


class CharLSTMClassifier(nn.Module):
    def __init__(self, n_classes: int, embedding_dim: int = 32, hidden_size: int = 64):
        super().__init__()
        self.embedding = nn.Embedding(len(ALPHABET) + 1, embedding_dim)
        self.lstm = DPLSTM(embedding_dim, hidden_size, batch_first=True)
        self.fc = nn.Linear(hidden_size, n_classes)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        if tokens.shape[0] == 0:  # an empty Poisson batch cannot be packed
            _, (h, _) = self.lstm(x)
        else:
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            _, (h, _) = self.lstm(packed)  # h: (num_layers, B, hidden), last valid step of each
        return self.fc(h[-1])


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for tokens, lengths, y in loader:
        tokens, y = tokens.to(device), y.to(device)
        correct += (model(tokens, lengths).argmax(1) == y).sum().item()
        total += len(y)
    model.train()
    return correct / max(total, 1)


def train_epoch(model, optimizer, loader, device, max_steps: int | None) -> tuple[float, float]:
    losses, correct, seen, steps = [], 0, 0, 0
    for tokens, lengths, y in loader:
        tokens, y = tokens.to(device), y.to(device)
        optimizer.zero_grad()
        out = model(tokens, lengths)
        loss = F.cross_entropy(out, y) if len(y) else out.sum()  # empty batch: noise-only step
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--sigma", type=float, default=1.0,
                        help="noise multiplier (default 1.0); ignored with --epsilon")
    budget.add_argument("--epsilon", type=float, default=None,
                        help="target epsilon: calibrate sigma with make_private_with_epsilon")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping norm C")
    p.add_argument("--lr", type=float, default=4.0, help="SGD learning rate")
    p.add_argument("--batch-size", type=int, default=256,
                   help="expected (Poisson) logical batch size")
    p.add_argument("--max-physical-batch-size", type=int, default=None,
                   help="bound memory with BatchMemoryManager")
    p.add_argument("--names-per-class", type=int, default=400)
    p.add_argument("--classes", type=int, default=18)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--accountant", choices=("prv", "rdp", "gdp", "pld"), default="prv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop each epoch after this many optimizer steps")
    p.add_argument("--smoke", action="store_true", help="tiny run: 1 epoch of 3 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.epochs, args.max_steps, args.names_per_class = 1, 3, 40
    for name in ("epochs", "batch_size", "names_per_class", "classes", "hidden_size"):
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
    # the generator's seed is fixed: --seed changes the split, the model and the noise
    data, max_len = make_dataset(args.names_per_class, args.classes, seed=1234)
    n_test = len(data) // 5
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    train_ds = TensorDataset(*(t[perm[n_test:]] for t in data.tensors))
    test_ds = TensorDataset(*(t[perm[:n_test]] for t in data.tensors))
    samples = ", ".join(decode(train_ds.tensors[0][i], int(train_ds.tensors[1][i]))
                        for i in range(5))
    print(f"{len(train_ds)} training names of {args.classes} languages "
          f"(max length {max_len}), e.g. {samples}")

    model = CharLSTMClassifier(args.classes, hidden_size=args.hidden_size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size)
    test_loader = DataLoader(test_ds, batch_size=512)

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
    print(f"sample rate {1 / len(train_loader):.4f}, sigma {optimizer.noise_multiplier:.3f}, "
          f"C {args.max_grad_norm}, accountant {args.accountant}")

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
    print(f"final: test accuracy {acc:.3f} (chance {1 / args.classes:.3f}), epsilon {eps:.3f} "
          f"at delta {args.delta:g} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
