"""DP-SGD on scikit-learn's digits with DistributedDataParallel (gloo, CPU).

Run with 2 processes on this machine::

    torchrun --nproc_per_node=2 examples/ddp_digits.py

or without torchrun (1 process). Each process trains on its own Poisson-sampled shard of every
batch; the clipped gradients are summed across processes and noised once. Only rank 0 logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dptorch import PrivacyEngine

logger = logging.getLogger("ddp_digits")


def init_distributed() -> tuple[int, int]:
    """Joins the torchrun process group (or makes a 1-process one when run directly)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed)

    def to_ds(a, b):
        # fixed, data-independent scaling of the 0..16 pixels: statistics of the private training
        # set (its mean/std) would leak outside the accounted epsilon
        return TensorDataset(
            torch.tensor(a / 8.0 - 1.0, dtype=torch.float32), torch.tensor(b, dtype=torch.long)
        )

    return to_ds(x_train, y_train), to_ds(x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128, help="global expected batch size")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rank, world_size = init_distributed()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(message)s",
    )
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    train_ds, test_ds = load_data(args.seed)

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    # a per-rank loader: its length sets the sample rate q = world_size * batch / N
    loader = DataLoader(
        train_ds,
        batch_size=args.batch_size // world_size,
        sampler=DistributedSampler(train_ds, seed=args.seed),
    )

    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=args.sigma,
        max_grad_norm=args.max_grad_norm,
    )
    logger.info(
        "%d processes, %s, sample rate %.4f, %d steps per epoch",
        world_size,
        type(optimizer).__name__,
        loader.sample_rate,
        len(loader),
    )

    x_test, y_test = (t.to(device) for t in test_ds.tensors)
    for epoch in range(1, args.epochs + 1):
        model.train()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # empty local batches work too
            optimizer.step()
        model.eval()
        with torch.no_grad():
            logits = model(x_test)
            loss = F.cross_entropy(logits, y_test).item()
            acc = (logits.argmax(1) == y_test).float().mean().item()
        logger.info(
            "epoch %2d  test loss %.3f  test accuracy %.3f  epsilon %.2f (delta=%g)",
            epoch,
            loss,
            acc,
            engine.get_epsilon(args.delta),
            args.delta,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
