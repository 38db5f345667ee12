"""DP-SGD training of a one-block transformer text classifier on generated token sequences.

Every sequence is uniform noise over a vocabulary of ``--vocab`` tokens, except for one planted
*motif* (two tokens, possibly with a gap between them) at a random position; the motif decides
the class. Motifs of different classes share tokens, so the model has to relate positions
(attention), not only count tokens. Model::

    token + position nn.Embedding -> DPMultiheadAttention (+ residual, LayerNorm)
    -> MLP (+ residual, LayerNorm) -> mean over positions -> nn.Linear

``dptorch.layers.DPMultiheadAttention`` is a drop-in replacement for ``nn.MultiheadAttention``
built from ``nn.Linear`` layers (``ModuleValidator.fix`` swaps one for the other).

``--grad-sample-mode`` chooses how per-sample gradients (or only their norms) are computed:
``hooks`` (default), ``functorch``, ``ew``, and the fast-clipping modes ``ghost`` and ``bk``
when this dptorch has them (see docs/modes.md). With ``ghost`` ``make_private`` also returns a
criterion whose ``loss.backward()`` runs the two backward passes of ghost clipping.

The flags, the ``make_private``/``make_private_with_epsilon`` set-up and the epoch loop that
the classifier examples share live in ``examples/_common.py``.

Examples::

    python examples/text_classifier.py                          # sigma = 1.0, 8 epochs
    python examples/text_classifier.py --grad-sample-mode ghost
    python examples/text_classifier.py --epsilon 4 --smoke
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import add_run_args, add_training_args, check_args, fit, make_private, privacy_summary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample.utils import GSM_CLASSES
from dptorch.layers import DPMultiheadAttention

KNOWN_MODES = ("hooks", "functorch", "ew", "ghost", "bk")


def make_motifs(n_classes: int, vocab: int, seed: int) -> list[tuple[int, int, int]]:
    """Class ``k``'s motif ``(a_k, gap_k, b_k)``: token ``a_k``, then ``b_k`` ``gap_k`` positions
    later. Motif tokens come from a pool of 8 tokens shared by the classes (so that a single token
    does not give the class away) that the background never uses."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(vocab - 8, vocab)
    motifs: list[tuple[int, int, int]] = []
    while len(motifs) < n_classes:
        a, b = pool[torch.randperm(8, generator=g)[:2]].tolist()
        gap = int(torch.randint(1, 4, (1,), generator=g))
        if (a, gap, b) not in motifs:
            motifs.append((a, gap, b))
    return motifs


def make_dataset(n: int, motifs: list[tuple[int, int, int]], *, vocab: int, seq_len: int,
                 seed: int) -> TensorDataset:
    """``n`` sequences ``(n, seq_len)`` of background tokens, each with its class's motif planted
    at a random position, and their labels ``(n,)``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(motifs), (n,), generator=g)
    tokens = torch.randint(0, vocab - 8, (n, seq_len), generator=g)
    for i, label in enumerate(labels.tolist()):
        a, gap, b = motifs[label]
        pos = int(torch.randint(0, seq_len - gap, (1,), generator=g))
        tokens[i, pos] = a
        tokens[i, pos + gap] = b
    return TensorDataset(tokens, labels)


class TransformerClassifier(nn.Module):
    def __init__(self, vocab: int, seq_len: int, n_classes: int, d_model: int = 32,
                 n_heads: int = 4, d_ff: int = 64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.attn = DPMultiheadAttention(d_model, n_heads, batch_first=True)
        self.norm1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.norm2 = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # positions are expanded to the batch: the embedding layer then sees one row per sample
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.tokens(tokens) + self.positions(pos)
        x = self.norm1(x + self.attn(x, x, x, need_weights=False)[0])
        x = self.norm2(x + self.mlp(x))
        return self.head(x.mean(1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p, epochs=8, lr=3e-3, lr_help="Adam learning rate", batch_size=256)
    p.add_argument("--grad-sample-mode", choices=KNOWN_MODES, default="hooks",
                   help="per-sample gradient mode (ghost/bk: if this dptorch registers them)")
    p.add_argument("--train-size", type=int, default=8000)
    p.add_argument("--classes", type=int, default=6)
    p.add_argument("--vocab", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=16)
    add_run_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.epochs, args.max_steps, args.train_size = 1, 3, 1000
    check_args(p, args, positive=("train_size", "classes"))
    if args.vocab < 12 or args.seq_len < 5:
        p.error("--vocab must be >= 12 and --seq-len >= 5")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.grad_sample_mode not in GSM_CLASSES:
        print(f"grad_sample_mode {args.grad_sample_mode!r} is not available in this dptorch "
              f"(available: {', '.join(sorted(GSM_CLASSES))}); nothing to do.")
        return 0
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    motifs = make_motifs(args.classes, args.vocab, seed=1234)  # the task is the same for all seeds
    shape = dict(vocab=args.vocab, seq_len=args.seq_len)
    train_ds = make_dataset(args.train_size, motifs, **shape, seed=args.seed)
    test_ds = make_dataset(2000, motifs, **shape, seed=10_000 + args.seed)

    model = TransformerClassifier(args.vocab, args.seq_len, args.classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    train_loader = DataLoader(train_ds, batch_size=args.batch_size)
    test_loader = DataLoader(test_ds, batch_size=500)

    engine = PrivacyEngine(accountant=args.accountant)
    try:  # engine.make_private (--sigma) or engine.make_private_with_epsilon (--epsilon)
        private = make_private(engine, args, device, module=model, optimizer=optimizer,
                               criterion=criterion, data_loader=train_loader,
                               grad_sample_mode=args.grad_sample_mode)
    except NotImplementedError as e:  # e.g. "ew": torch's ExpandedWeights has no attention
        print(f"grad_sample_mode {args.grad_sample_mode!r} cannot train this model: {e}")
        return 1
    if len(private) == 4:  # ghost clipping: (module, optimizer, criterion, data_loader)
        model, optimizer, criterion, train_loader = private
    else:
        model, optimizer, train_loader = private
    print(f"{len(train_ds)} training sequences, {args.classes} classes; grad_sample_mode "
          f"{args.grad_sample_mode!r} ({type(model).__name__}); "
          f"{privacy_summary(args, optimizer, train_loader)}")

    # ghost: criterion is a DP loss whose backward() runs the two passes of ghost clipping
    fit(engine, model, optimizer, train_loader, test_loader, args, device, loss_fn=criterion,
        chance=1 / args.classes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
