"""Cost of per-sample gradients: forward+backward with grad samples / plain forward+backward.

One subprocess per (library, mode), each single-threaded, timing the plain and the per-sample
step interleaved (median of repeats). Opacus runs too when ``--opacus-python`` points at an
interpreter that has it (default ``/work/opacus-venv/bin/python``).

    .venv/bin/python benchmarks/bench_grad_sample.py [--repeats 30] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial

from _timing import build_classifier, emit, interleaved_medians, run_worker, single_threaded

logger = logging.getLogger("bench_grad_sample")

CASES = [("SampleConvNet", 64), ("SampleConvNet", 256), ("MLP", 256)]
MODES = ["hooks", "functorch", "ew"]


def child(lib: str, mode: str, repeats: int) -> None:
    import copy

    import torch

    single_threaded()
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
        model, shape = build_classifier(model_name)
        private = wrap(copy.deepcopy(model))
        x = torch.randn(batch, *shape)
        y = torch.randint(0, 10, (batch,))
        loss_fn = torch.nn.CrossEntropyLoss()

        def step(m, x=x, y=y, loss_fn=loss_fn):
            for p in m.parameters():
                p.grad = None
                p.grad_sample = None  # what both libraries' zero_grad leave
            loss_fn(m(x), y).backward()

        plain, dp = interleaved_medians([partial(step, model), partial(step, private)], repeats)
        results[f"{model_name}@{batch}"] = {"plain_ms": 1e3 * plain, "dp_ms": 1e3 * dp}
    emit(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 30 (3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--opacus-python", default="/work/opacus-venv/bin/python")
    parser.add_argument("--child", nargs=2, metavar=("LIB", "MODE"))
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 30)
    if args.child:
        child(*args.child, repeats)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = [("dptorch", sys.executable)]
    if os.path.exists(args.opacus_python):
        runs.append(("opacus", args.opacus_python))
    rows = []
    for lib, python in runs:
        for mode in MODES:
            cmd = [python, os.path.abspath(__file__), "--child", lib, mode, "--repeats", str(repeats)]
            res = run_worker(cmd, opacus=lib == "opacus")
            if "error" in res:
                logger.warning("%s/%s failed: %s", lib, mode, res["error"])
                continue
            for case, r in res.items():
                rows.append((case, lib, mode, r["plain_ms"], r["dp_ms"]))
    logger.info("%-18s %-8s %-10s %10s %10s %7s", "case", "lib", "mode", "plain ms", "dp ms", "ratio")
    for case, lib, mode, plain, dp in sorted(rows):
        logger.info("%-18s %-8s %-10s %10.2f %10.2f %7.2f", case, lib, mode, plain, dp, dp / plain)


if __name__ == "__main__":
    main()
