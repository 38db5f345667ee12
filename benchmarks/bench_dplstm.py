"""Per-step training time: char-level LSTM classifier, DPLSTM + GradSampleModule (hooks) +
DPOptimizer vs nn.LSTM non-private.

Model: Embedding(256, 64) -> LSTM(64, 128) -> Linear(128, 18) on the last hidden state;
sequence length 32, batch 64, one CPU thread. Prints medians and their ratio.

    .venv/bin/python benchmarks/bench_dplstm.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from dptorch.grad_sample import GradSampleModule
from dptorch.layers import DPLSTM

try:
    from dptorch.optimizers import DPOptimizer
except ImportError:  # pragma: no cover - while the optimizer is being written
    DPOptimizer = None


class CharLSTM(nn.Module):
    def __init__(self, lstm: nn.Module):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.lstm = lstm
        self.fc = nn.Linear(128, 18)

    def forward(self, x):  # x: (B, T) bytes
        out, _ = self.lstm(self.emb(x))
        return self.fc(out[:, -1])


def time_steps(model, opt, x, y, repeats: int, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (64, 32))
    y = torch.randint(0, 18, (64,))

    base = CharLSTM(nn.LSTM(64, 128, batch_first=True))
    t_base = time_steps(base, torch.optim.SGD(base.parameters(), lr=0.1), x, y, args.repeats)

    dp_model = GradSampleModule(CharLSTM(DPLSTM(64, 128, batch_first=True)))
    sgd = torch.optim.SGD(dp_model.parameters(), lr=0.1)
    if DPOptimizer is not None:
        opt = DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=64)
        what = "forward+backward+DPOptimizer.step"
    else:
        opt = sgd
        what = "forward+backward (per-sample grads) + SGD step"
    t_dp = time_steps(dp_model, opt, x, y, args.repeats)

    print(f"nn.LSTM non-private:          {t_base * 1e3:8.2f} ms/step")
    print(f"DPLSTM + GradSampleModule:    {t_dp * 1e3:8.2f} ms/step ({what})")
    print(f"ratio DP / non-private:       {t_dp / t_base:8.2f}x")


if __name__ == "__main__":
    main()
