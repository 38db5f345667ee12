"""Per-step time of DP-SGD (PrivacyEngine.make_private) vs non-private SGD.

Each (model, batch size) runs in its own process with ``torch.set_num_threads(1)``; inside it the
non-private and the private step (forward, backward, optimizer step) are timed alternately and
the median of the repeats is reported.

    python benchmarks/bench_engine.py [--repeats 50] [--quick]   # all configurations, a table
    python benchmarks/bench_engine.py --one sampleconvnet 64      # one measurement
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from _timing import build_classifier, emit, interleaved_medians, run_worker, single_threaded
from torch.utils.data import DataLoader, TensorDataset

CONFIGS = [("sampleconvnet", 64), ("sampleconvnet", 256), ("mlp", 256)]


def measure(model_name: str, batch: int, repeats: int) -> dict:
    """Median step times (s) of ``{"nonprivate": ..., "private": ...}``."""
    from dptorch import PrivacyEngine

    single_threaded()
    model, shape = build_classifier(model_name)
    plain = copy.deepcopy(model)
    n = batch * 8
    loader = DataLoader(
        TensorDataset(torch.randn(n, *shape), torch.randint(0, 10, (n,))), batch_size=batch
    )
    private, dp_optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    sgd = torch.optim.SGD(plain.parameters(), lr=0.05)
    # fixed-size batches in both modes so that the step cost is comparable
    x = torch.randn(batch, *shape)
    y = torch.randint(0, 10, (batch,))

    def step(m, optimizer):
        optimizer.zero_grad()
        F.cross_entropy(m(x), y).backward()
        optimizer.step()

    t_np, t_dp = interleaved_medians(
        [lambda: step(plain, sgd), lambda: step(private, dp_optimizer)], repeats
    )
    return {"nonprivate": t_np, "private": t_dp}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "BATCH"))
    ap.add_argument("--repeats", type=int, default=None, help="default 50 (5 with --quick)")
    ap.add_argument("--quick", action="store_true", help="5 repeats")
    args = ap.parse_args()
    repeats = args.repeats or (5 if args.quick else 50)
    if args.one:
        name, batch = args.one
        emit(measure(name, int(batch), repeats))
        return
    print(f"{'model':<15}{'batch':>6}{'non-private ms':>16}{'private ms':>12}{'ratio':>8}")
    for name, batch in CONFIGS:
        res = run_worker(
            [sys.executable, os.path.abspath(__file__), "--one", name, str(batch),
             "--repeats", str(repeats)]
        )
        if "error" in res:
            print(f"{name:<15}{batch:>6}  failed: {res['error']}")
            continue
        ratio = res["private"] / res["nonprivate"]
        print(f"{name:<15}{batch:>6}{res['nonprivate'] * 1e3:>16.2f}{res['private'] * 1e3:>12.2f}"
              f"{ratio:>8.2f}")


if __name__ == "__main__":
    main()
