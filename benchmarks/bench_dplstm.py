"""Per-step training time of a char-level LSTM classifier: what DPLSTM costs before and with
privacy, against torch's native ``nn.LSTM`` (oneDNN's fused kernels on a CPU).

Model: Embedding(256, 64) -> LSTM(64, 128) -> Linear(128, 18) on the last hidden state;
sequence length 32, batch 64, one CPU thread. In one process, alternately: the native
non-private step, DPLSTM's non-private step, and the DP step (``make_private``, one mode).
Prints each median with its interquartile range as a ratio to the native step, and the minor
page faults per step (every fresh megabyte costs about 0.35 ms on this project's VM).

    .venv/bin/python benchmarks/bench_dplstm.py [--mode bk] [--repeats 30] [--quick]
    .venv/bin/python benchmarks/bench_dplstm.py --only native   # one step type alone
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings

import torch
from _timing import single_threaded
from torch import nn

from dptorch import PrivacyEngine
from dptorch.layers import DPLSTM


class CharLSTM(nn.Module):
    def __init__(self, lstm: nn.Module):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.lstm = lstm
        self.fc = nn.Linear(128, 18)

    def forward(self, x):  # x: (B, T) bytes
        out, _ = self.lstm(self.emb(x))
        return self.fc(out[:, -1])


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="bk", help="grad_sample_mode of the DP step")
    parser.add_argument("--repeats", type=int, default=None, help="default 30 (5 with --quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["native", "dplstm", "dp"], default=None,
                        help="time one step alone in this process (no allocator interplay)")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 30)
    single_threaded()
    x = torch.randint(0, 256, (64, 32))
    y = torch.randint(0, 18, (64,))

    def plain(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt

    native = plain(CharLSTM(nn.LSTM(64, 128, batch_first=True)))
    dplstm = plain(CharLSTM(DPLSTM(64, 128, batch_first=True)))
    model = CharLSTM(DPLSTM(64, 128, batch_first=True))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp_model, dp_opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode=args.mode, poisson_sampling=False,
        )
    runs = {"nn.LSTM, non-private": native, "DPLSTM, non-private": dplstm,
            f"DPLSTM, DP step ({args.mode})": (dp_model, dp_opt)}
    if args.only is not None:
        name = list(runs)[["native", "dplstm", "dp"].index(args.only)]
        runs = {name: runs[name]}

    def step(model, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    times = {k: [] for k in runs}
    faults = {k: [] for k in runs}
    for r in range(repeats + 3):
        for name, (m, o) in runs.items():
            f0, t0 = _faults(), time.perf_counter()
            step(m, o)
            if r >= 3:
                times[name].append(time.perf_counter() - t0)
                faults[name].append(_faults() - f0)
    base = statistics.median(times.get("nn.LSTM, non-private", next(iter(times.values()))))
    print(f"{'step':32s} {'median':>9s} {'ratio to nn.LSTM':>17s} {'IQR':>14s} {'faults':>7s}")
    for name, ts in times.items():
        q1, _, q3 = statistics.quantiles([t / base for t in ts], n=4)
        print(f"{name:32s} {statistics.median(ts) * 1e3:7.2f}ms {statistics.median(ts) / base:16.2f}x"
              f"  [{q1:.2f}, {q3:.2f}] {statistics.median(faults[name]):7.0f}")


if __name__ == "__main__":
    main()
