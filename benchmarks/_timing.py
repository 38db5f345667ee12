"""Timing conventions shared by the benchmark scripts.

* one DP mode per process: a driver runs each measurement in a fresh interpreter
  (:func:`run_worker`), single-threaded (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``);
* inside it the non-private and the DP step are timed alternately (:func:`interleaved_medians`),
  so that drifts of the machine hit both alike, and the median of the repeats is reported;
* a worker prints its result as one line ``RESULT <json>`` (:func:`emit`).

This module is imported by worker processes of Opacus's interpreter too: it needs torch only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

_RESULT = "RESULT "


def single_threaded(seed: int = 0) -> None:
    """One intra-op thread and a fixed seed: the setting of every measurement."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)


def interleaved_medians(
    steps: Sequence[Callable[[], object]], repeats: int, warmup: int = 3
) -> list[float]:
    """Median wall time (s) of each of ``steps``, called alternately ``repeats`` times after
    ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, ts in zip(steps, times):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def paired_ratios(
    f_np: Callable[[], object], f_dp: Callable[[], object], repeats: int,
    sync: Callable[[], object] = lambda: None,
) -> dict:
    """Times ``f_np`` then ``f_dp``, ``repeats`` times, each between ``sync()`` calls (a GPU's
    ``torch.cuda.synchronize``); returns their median times ``np_ms``/``dp_ms`` and the median
    ``ratio`` of each DP time to the non-private time just before it, with its quartiles."""
    r, t_np, t_dp = [], [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        f_np()
        sync()
        t1 = time.perf_counter()
        f_dp()
        sync()
        t2 = time.perf_counter()
        t_np.append(t1 - t0)
        t_dp.append(t2 - t1)
        r.append((t2 - t1) / (t1 - t0))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return {"np_ms": 1e3 * statistics.median(t_np), "dp_ms": 1e3 * statistics.median(t_dp),
            "ratio": statistics.median(r), "q1": q[0], "q3": q[2]}


def emit(result: dict) -> None:
    """Worker side: prints ``result`` for :func:`run_worker`."""
    print(_RESULT + json.dumps(result), flush=True)


def run_worker(
    argv: Sequence[str],
    *,
    opacus: bool = False,
    extra_env: dict[str, str] | None = None,
    timeout: float | None = 900,
) -> dict:
    """Driver side: runs ``argv`` (an interpreter and its arguments) single-threaded and returns
    the dict the worker passed to :func:`emit`, or ``{"error": ...}``. ``opacus``: run outside this
    checkout (no ``PYTHONPATH``, working directory ``/tmp``) so that Opacus's interpreter cannot
    import dptorch's files by accident."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(extra_env or {}))
    if opacus:
        env.pop("PYTHONPATH", None)
    try:
        out = subprocess.run(
            list(argv), capture_output=True, text=True, env=env, timeout=timeout,
            cwd="/tmp" if opacus else None,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}


# ----------------------------------------------------------------------------- shared models
class SampleConvNet(nn.Module):
    """The MNIST network of Opacus's examples and benchmarks (input ``(B, 1, 28, 28)``)."""

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


def mlp() -> nn.Module:
    """784-512-512-10 perceptron (input ``(B, 784)``)."""
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def build_classifier(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """``(model, input shape without the batch)`` for ``"sampleconvnet"`` or ``"mlp"``."""
    if name.lower() == "sampleconvnet":
        return SampleConvNet(), (1, 28, 28)
    if name.lower() == "mlp":
        return mlp(), (784,)
    raise KeyError(name)
