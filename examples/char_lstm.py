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

The flags, the ``make_private``/``make_private_with_epsilon`` set-up and the epoch loop that
the classifier examples share live in ``examples/_common.py``.

Examples::

    python examples/char_lstm.py                   # sigma = 1.0, 10 epochs
    python examples/char_lstm.py --epsilon 5       # calibrate sigma to epsilon = 5
    python examples/char_lstm.py --smoke           # 1 epoch, 3 steps
"""

from __future__ import annotations

import argparse
import string
import sys

import numpy as np
import torch
from _common import add_run_args, add_training_args, check_args, fit, make_private, privacy_summary
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.layers import DPLSTM

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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p, epochs=10, lr=4.0, lr_help="SGD learning rate", batch_size=256)
    p.add_argument("--names-per-class", type=int, default=400)
    p.add_argument("--classes", type=int, default=18)
    p.add_argument("--hidden-size", type=int, default=64)
    add_run_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.epochs, args.max_steps, args.names_per_class = 1, 3, 40
    check_args(p, args, positive=("names_per_class", "classes", "hidden_size"))
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
    # engine.make_private (--sigma) or engine.make_private_with_epsilon (--epsilon)
    model, optimizer, train_loader = make_private(
        engine, args, device, module=model, optimizer=optimizer, data_loader=train_loader
    )
    print(privacy_summary(args, optimizer, train_loader))

    # an empty Poisson batch gives a (0, classes) output and a noise-only step (see forward)
    fit(engine, model, optimizer, train_loader, test_loader, args, device,
        chance=1 / args.classes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
