"""Cost of per-sample gradients: forward+backward with grad samples / plain forward+backward.

One subprocess per (library, mode), each single-threaded, timing the plain and the per-sample
step interleaved (median of repeats). Opacus runs too when ``--opacus-python`` points at an
interpreter that has it (default ``/work/opacus-venv/bin/python``).

    .venv/bin/python benchmarks/bench_grad_sample.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

logger = logging.getLogger("bench_grad_sample")

CASES = [("SampleConvNet", 64), ("SampleConvNet", 256), ("MLP", 256)]
MODES = ["hooks", "functorch", "ew"]


def build(model_name: str):
    import torch.nn.functional as F
    from torch import nn

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
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    if model_name == "SampleConvNet":
        return SampleConvNet(), (1, 28, 28)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10),
    ), (784,)


def child(lib: str, mode: str, repeats: int) -> None:
    import copy

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if lib == "opacus":
        from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights
    else:
        from dptorch.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights

    def wrap(m):
        if mode == "ew":
            return GradSampleModuleExpandedWeights(m, loss_reduction="mean")
        return GradSampleModule(m, loss_reduction="mean", force_functorch=mode == "functorch")

    results = {}
    for model_name, batch in CASES:
        model, shape = build(model_name)
        private = wrap(copy.deepcopy(model))
        x = torch.randn(batch, *shape)
        y = torch.randint(0, 10, (batch,))
        loss_fn = torch.nn.CrossEntropyLoss()

        def step(m, x=x, y=y, loss_fn=loss_fn):
            t = time.perf_counter()
            loss_fn(m(x), y).backward()
            dt = time.perf_counter() - t
            for p in m.parameters():
                p.grad = None
                p.grad_sample = None  # what both libraries' zero_grad leave
            return dt

        for _ in range(3):
            step(model), step(private)
        plain, dp = [], []
        for _ in range(repeats):
            plain.append(step(model))
            dp.append(step(private))
        results[f"{model_name}@{batch}"] = {
            "plain_ms": 1e3 * statistics.median(plain),
            "dp_ms": 1e3 * statistics.median(dp),
        }
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--opacus-python", default="/work/opacus-venv/bin/python")
    parser.add_argument("--child", nargs=2, metavar=("LIB", "MODE"))
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.repeats)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    runs = [("dptorch", sys.executable)]
    if os.path.exists(args.opacus_python):
        runs.append(("opacus", args.opacus_python))
    rows = []
    for lib, python in runs:
        for mode in MODES:
            cmd = [python, __file__, "--child", lib, mode, "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                logger.warning("%s/%s failed: %s", lib, mode, proc.stderr.strip()[-300:])
                continue
            for case, r in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                rows.append((case, lib, mode, r["plain_ms"], r["dp_ms"]))
    logger.info("%-18s %-8s %-10s %10s %10s %7s", "case", "lib", "mode", "plain ms", "dp ms", "ratio")
    for case, lib, mode, plain, dp in sorted(rows):
        logger.info("%-18s %-8s %-10s %10.2f %10.2f %7.2f", case, lib, mode, plain, dp, dp / plain)


if __name__ == "__main__":
    main()
