"""Per-step time of DP-SGD (PrivacyEngine.make_private) vs non-private SGD.

Each (model, batch size, mode) runs in its own process with ``torch.set_num_threads(1)``; the
figure is the median over repeats of the mean step time (forward, backward, optimizer step).

    python benchmarks/bench_engine.py            # all configurations, prints a table
    python benchmarks/bench_engine.py --one sampleconvnet 64 private   # one measurement
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CONFIGS = [("sampleconvnet", 64), ("sampleconvnet", 256), ("mlp", 256)]


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        x = x.flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def build(model_name: str):
    if model_name == "sampleconvnet":
        return SampleConvNet(), (1, 28, 28)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10)), (784,)


def measure(model_name: str, batch: int, mode: str, steps: int = 20, repeats: int = 5) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape = build(model_name)
    n = batch * 8
    ds = TensorDataset(torch.randn(n, *shape), torch.randint(0, 10, (n,)))
    loader = DataLoader(ds, batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if mode == "private":
        from dptorch import PrivacyEngine

        model, optimizer, loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0,
        )
    # fixed-size batches in both modes so that the step cost is comparable
    x = torch.randn(batch, *shape)
    y = torch.randint(0, 10, (batch,))

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "BATCH", "MODE"))
    args = ap.parse_args()
    if args.one:
        name, batch, mode = args.one
        print(json.dumps({"seconds": measure(name, int(batch), mode)}))
        return
    print(f"{'model':<15}{'batch':>6}{'non-private ms':>16}{'private ms':>12}{'ratio':>8}")
    for name, batch in CONFIGS:
        res = {}
        for mode in ("nonprivate", "private"):
            out = subprocess.run(
                [sys.executable, __file__, "--one", name, str(batch), mode],
                capture_output=True, text=True, check=True,
            )
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
        ratio = res["private"] / res["nonprivate"]
        print(f"{name:<15}{batch:>6}{res['nonprivate'] * 1e3:>16.2f}{res['private'] * 1e3:>12.2f}"
              f"{ratio:>8.2f}")


if __name__ == "__main__":
    main()
