"""User-level DP on scikit-learn's 8x8 digits, with synthetic users, and fixed-shape batches.

Many data sets hold several records per person. Record-level ε bounds what a model reveals about
one *record*; a person with ten records is protected only at about 10·ε (group privacy). This
example gives each user ``--records-per-user`` digits (synthetic user ids) and trains the same
model twice:

1. record level, with fixed-shape Poisson batches (``poisson_sampling="fixed_shape"``): every
   batch has the same number of rows, padding rows contribute nothing, and the rare truncation
   is added to δ;
2. user level (``privacy_unit="user"``): users are Poisson-sampled, up to
   ``--max-records-per-user`` of each drawn user's records enter the batch, and the *sum* of a
   user's per-record gradients is clipped to C. Its ε covers a whole user.

It prints both ε values beside the group-privacy bound that the record-level run gives a user.

    python examples/user_level_digits.py            # 10 records per user, 15 epochs
    python examples/user_level_digits.py --smoke    # a few steps
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        acc = (net(x).argmax(1) == y).float().mean().item()
    net.train()
    return acc


def train(unit: str, args, train_set, test_x, test_y, users) -> tuple[float, float]:
    """Trains one model; returns (test accuracy, ε at args.delta)."""
    net = model()
    engine = PrivacyEngine(accountant="prv")
    # fixed shape: a batch above max_batch_size is truncated, and that probability is charged
    # to delta at every step; the default bound (a few standard deviations over the mean)
    # reaches delta = 1e-5 after about 140 steps, twice the expected size never does
    extra = (dict(poisson_sampling="fixed_shape", max_batch_size=2 * args.batch_size)
             if unit == "record" else
             dict(privacy_unit="user", user_id=users,
                  max_records_per_user=args.max_records_per_user))
    # user level: q = 1 / len(record loader) is the probability that a *user* is drawn, so a
    # loader of batch_size b draws about b·U/N users (b records), not b users. For about a
    # quarter as many users per batch as the record-level batch has records, b = (B/4)·N/U.
    users_per_batch = max(1, args.batch_size // 4)
    batch = (args.batch_size if unit == "record"
             else max(1, round(users_per_batch * len(train_set) / len(set(users)))))
    lr = args.lr if unit == "record" else args.lr / 4  # 4x fewer units per batch: 4x the noise
    module, opt, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
        data_loader=DataLoader(train_set, batch_size=batch), noise_multiplier=args.sigma,
        max_grad_norm=args.max_grad_norm, grad_sample_mode=args.mode, **extra)
    for epoch in range(1, args.epochs + 1):
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = F.cross_entropy(module(x), y)
            loss.backward()
            opt.step()
            if args.smoke and step == 2:
                break
        print(f"{unit:>6}-level epoch {epoch:2d}: loss {loss.item():.3f} | test accuracy "
              f"{accuracy(net, test_x, test_y):.3f}, epsilon {engine.get_epsilon(args.delta):.2f}")
    return accuracy(net, test_x, test_y), engine.get_epsilon(args.delta)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records-per-user", type=int, default=10)
    ap.add_argument("--max-records-per-user", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=128, help="expected records per batch")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--mode", default="bk", help="grad_sample_mode")
    ap.add_argument("--smoke", action="store_true", help="1 epoch, 3 steps per run")
    args = ap.parse_args(argv)
    if args.smoke:
        args.epochs = 1
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    tr_x, te_x, tr_y, te_y = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    users = (torch.arange(len(tr_x)) // args.records_per_user).tolist()  # synthetic user ids
    train_set = TensorDataset(tr_x, tr_y)
    print(f"{len(tr_x)} training digits, {len(set(users))} users of {args.records_per_user} records")
    acc_r, eps_r = train("record", args, train_set, te_x, te_y, users)
    acc_u, eps_u = train("user", args, train_set, te_x, te_y, users)
    k = args.records_per_user
    # group privacy: k records at (ε, δ) give (kε, k·e^{(k-1)ε}·δ) to a user
    group_delta = k * math.exp((k - 1) * eps_r) * args.delta
    print(f"record level: epsilon {eps_r:.2f} per record; for a user of {k} records that is "
          f"({k * eps_r:.1f}, {group_delta:.2g})-DP by group privacy")
    print(f"user level:   epsilon {eps_u:.2f} per user, test accuracy {acc_u:.3f}")
    print(f"final: test accuracy {acc_u:.3f}, epsilon {eps_u:.2f} at delta {args.delta:g} "
          "(user level)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
