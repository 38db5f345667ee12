"""Per-step training time: char-level LSTM classifier, DPLSTM + GradSampleModule (hooks) +
DPOptimizer vs nn.LSTM non-private.

Model: Embedding(256, 64) -> LSTM(64, 128) -> Linear(128, 18) on the last hidden state;
sequence length 32, batch 64, one CPU thread. The two steps are timed alternately; prints the
medians and their ratio.

    .venv/bin/python benchmarks/bench_dplstm.py [--repeats 30] [--quick]
"""

from __future__ import annotations

import argparse

import torch
from _timing import interleaved_medians, single_threaded
from torch import nn

from dptorch.grad_sample import GradSampleModule
from dptorch.layers import DPLSTM
from dptorch.optimizers import DPOptimizer


class CharLSTM(nn.Module):
    def __init__(self, lstm: nn.Module):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.lstm = lstm
        self.fc = nn.Linear(128, 18)

    def forward(self, x):  # x: (B, T) bytes
        out, _ = self.lstm(self.emb(x))
        return self.fc(out[:, -1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=None, help="default 30 (3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 30)
    single_threaded()
    x = torch.randint(0, 256, (64, 32))
    y = torch.randint(0, 18, (64,))

    base = CharLSTM(nn.LSTM(64, 128, batch_first=True))
    base_opt = torch.optim.SGD(base.parameters(), lr=0.1)
    dp_model = GradSampleModule(CharLSTM(DPLSTM(64, 128, batch_first=True)))
    dp_opt = DPOptimizer(
        torch.optim.SGD(dp_model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=64,
    )

    def step(model, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    t_base, t_dp = interleaved_medians(
        [lambda: step(base, base_opt), lambda: step(dp_model, dp_opt)], repeats
    )
    print(f"nn.LSTM non-private:          {t_base * 1e3:8.2f} ms/step")
    print(f"DPLSTM + GradSampleModule:    {t_dp * 1e3:8.2f} ms/step "
          "(forward+backward+DPOptimizer.step)")
    print(f"ratio DP / non-private:       {t_dp / t_base:8.2f}x")


if __name__ == "__main__":
    main()
