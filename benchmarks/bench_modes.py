"""Time and peak memory of one DP-SGD step per ``grad_sample_mode``, relative to non-private.

Every (library, mode, workload) runs in its own subprocess with ``torch.set_num_threads(1)``.
Inside it the non-private step (forward, backward, SGD step) and the mode's full DP step
(forward, backward, clipping, noise, step) are timed alternately; the median of the repeats is
reported as a ratio. Peak memory of one step of each is measured with the torch profiler
(resident high-water mark, reset between the two) and reported as a ratio too.

    python benchmarks/bench_modes.py            # full
    python benchmarks/bench_modes.py --quick    # fewer repeats, smaller workloads

With ``/work/opacus-venv`` present, Opacus 1.x's modes (hooks, ew, ghost) run side by side in
their own subprocesses (same models, built from ``opacus.layers``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from _timing import SampleConvNet, emit, interleaved_medians, mlp, run_worker, single_threaded

logger = logging.getLogger("bench_modes")

WORKLOADS = ["convnet64", "convnet256", "cifar32", "mlp256", "transformer32", "lstm64"]
DPTORCH_MODES = ["hooks", "functorch", "ew", "ghost", "bk"]
OPACUS_MODES = ["hooks", "ew", "ghost"]
OPACUS_PYTHON = "/work/opacus-venv/bin/python"


# ----------------------------------------------------------------------------- worker side
def _build(lib: str, workload: str, quick: bool):
    import torch
    from torch import nn

    layers = __import__(f"{lib}.layers", fromlist=["DPLSTM", "DPMultiheadAttention"])

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = layers.DPMultiheadAttention(d, 4, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, h):
            a = self.ln1(h)
            h = h + self.attn(a, a, a, need_weights=False)[0]
            return h + self.mlp(self.ln2(h))

    class TextTransformer(nn.Module):
        def __init__(self, d=128):
            super().__init__()
            self.emb = nn.Embedding(10000, d)
            self.blocks = nn.Sequential(Block(d), Block(d))
            self.head = nn.Linear(d, 2)

        def forward(self, ids):
            return self.head(self.blocks(self.emb(ids)).mean(1))

    class CharLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 64)
            self.lstm = layers.DPLSTM(64, 128, batch_first=True)
            self.out = nn.Linear(128, 18)

        def forward(self, ids):
            h, _ = self.lstm(self.emb(ids))
            return self.out(h[:, -1])

    g = torch.Generator().manual_seed(0)
    if workload.startswith("convnet"):
        b = int(workload[7:])
        return SampleConvNet(), torch.randn(b, 1, 28, 28, generator=g), torch.randint(0, 10, (b,), generator=g)
    if workload == "mlp256":
        return mlp(), torch.randn(256, 784, generator=g), torch.randint(0, 10, (256,), generator=g)
    if workload == "transformer32":
        t = 64 if quick else 128
        return TextTransformer(), torch.randint(0, 10000, (32, t), generator=g), torch.randint(0, 2, (32,), generator=g)
    if workload == "lstm64":
        return CharLSTM(), torch.randint(0, 256, (64, 32), generator=g), torch.randint(0, 18, (64,), generator=g)
    if workload == "cifar32":  # CIFAR-10-style VGG blocks (Opacus's CIFAR example), B=32
        def block(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU(), nn.Conv2d(o, o, 3, padding=1), nn.ReLU(),
                    nn.AvgPool2d(2)]
        model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.Flatten(),
                              nn.Linear(128 * 16, 10))
        return model, torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    raise KeyError(workload)


def _dp_step_fn(lib: str, mode: str, model, x, y):
    """A closure running one full DP step of ``mode`` (``lib`` = dptorch or opacus)."""
    import torch
    from torch import nn

    gs = __import__(f"{lib}.grad_sample", fromlist=["x"])
    opt_mod = __import__(f"{lib}.optimizers", fromlist=["x"])
    b = len(y)
    crit = nn.CrossEntropyLoss()
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=b)
    if mode in ("ghost", "bk"):
        fgc = __import__(f"{lib}.utils.fast_gradient_clipping_utils", fromlist=["x"])
        if lib == "opacus":
            gsm = gs.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True)
        else:
            gsm = gs.wrap_model(model, mode, max_grad_norm=1.0)
        opt = opt_mod.DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.01), **kw)
        loss_fn = fgc.DPLossFastGradientClipping(gsm, opt, crit) if mode == "ghost" else crit
    else:
        gsm = gs.wrap_model(model, mode) if lib == "dptorch" else gs.wrap_model(model, grad_sample_mode=mode)
        opt = opt_mod.DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.01), **kw)
        loss_fn = crit

    def step():
        opt.zero_grad()
        loss_fn(gsm(x), y).backward()
        opt.step()

    def reset():
        opt.zero_grad(set_to_none=True)

    return step, reset


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _peak_bytes(fn, reset) -> int:
    """Peak resident memory added by ``fn()`` from a state where ``reset()`` dropped the previous
    step's gradients: the high-water mark (reset through ``/proc/self/clear_refs``) minus the
    resident size before. The memory phase runs with ``MALLOC_MMAP_THRESHOLD_`` so that large
    tensors are mmapped and really returned (never in the timing phase: it slows allocation)."""
    import gc

    reset()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    fn()
    return max(_status_kb("VmHWM") - base, 0) * 1024


def worker(lib: str, mode: str, workload: str, repeats: int, quick: bool, phase: str) -> dict:
    """``phase="time"``: interleaved medians of the non-private and DP steps;
    ``phase="memory"``: their peak resident memory."""
    import copy

    import torch

    single_threaded()
    model, x, y = _build(lib, workload, quick)
    plain = copy.deepcopy(model)
    crit = torch.nn.CrossEntropyLoss()
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01)

    def np_step():
        sgd.zero_grad()
        crit(plain(x), y).backward()
        sgd.step()

    def np_reset():
        sgd.zero_grad(set_to_none=True)

    try:
        dp_step, dp_reset = _dp_step_fn(lib, mode, model, x, y)
        dp_step()  # warm-up (and fail early on unsupported combinations)
    except Exception as e:  # noqa: BLE001 - reported as "n/a" in the table
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    np_step()
    if phase == "memory":
        return {"m_np": _peak_bytes(np_step, np_reset), "m_dp": _peak_bytes(dp_step, dp_reset)}
    t_np, t_dp = interleaved_medians([np_step, dp_step], repeats, warmup=0)
    return {"t_np": t_np, "t_dp": t_dp}


# ----------------------------------------------------------------------------- driver side
def _run_one(python: str, lib: str, mode: str, workload: str, repeats: int, quick: bool) -> dict:
    """Timing and memory of one (library, mode, workload), each in its own process."""
    out: dict = {}
    for phase, env in (("time", None), ("memory", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
        cmd = [python, os.path.abspath(__file__), "--worker", lib, mode, workload, str(repeats)]
        cmd += ["--phase", phase] + (["--quick"] if quick else [])
        r = run_worker(cmd, opacus=lib == "opacus", extra_env=env)
        if "error" in r:
            return r
        out.update(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats, seq 64 transformer")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workloads", nargs="*", default=WORKLOADS)
    parser.add_argument("--modes", nargs="*", default=DPTORCH_MODES)
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--worker", nargs=4, metavar=("LIB", "MODE", "WORKLOAD", "REPEATS"))
    parser.add_argument("--phase", choices=("time", "memory"), default="time")
    args = parser.parse_args()
    if args.worker:
        lib, mode, workload, repeats = args.worker
        emit(worker(lib, mode, workload, int(repeats), args.quick, args.phase))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    repeats = args.repeats or (3 if args.quick else 7)
    runs = [("dptorch", sys.executable, m) for m in args.modes]
    if not args.no_opacus and os.path.exists(OPACUS_PYTHON):
        runs += [("opacus", OPACUS_PYTHON, m) for m in OPACUS_MODES]
    results: dict = {}
    for workload in args.workloads:
        for lib, python, mode in runs:
            r = _run_one(python, lib, mode, workload, repeats, args.quick)
            results[(workload, lib, mode)] = r
            logger.info("%-14s %-8s %-10s %s", workload, lib, mode, r)
    print()
    header = f"{'workload':<14}" + "".join(f"{lib[:2]}:{m:<10}" for lib, _, m in runs)
    print("time ratio (DP step / non-private step), median of", repeats)
    print(header)
    for w in args.workloads:
        cells = []
        for lib, _, m in runs:
            r = results[(w, lib, m)]
            cells.append(f"{'n/a':<13}" if "error" in r else f"{r['t_dp'] / r['t_np']:<13.2f}")
        print(f"{w:<14}" + "".join(cells))
    print("\npeak-memory ratio (DP step / non-private step)")
    print(header)
    for w in args.workloads:
        cells = []
        for lib, _, m in runs:
            r = results[(w, lib, m)]
            cells.append(f"{'n/a':<13}" if "error" in r else f"{r['m_dp'] / max(r['m_np'], 1):<13.2f}")
        print(f"{w:<14}" + "".join(cells))
    print("\nnon-private step (ms): " + ", ".join(
        f"{w}={1e3 * results[(w, 'dptorch', args.modes[0])].get('t_np', float('nan')):.1f}"
        for w in args.workloads
    ))
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    for k, e in errors.items():
        print(f"n/a {k}: {e}")


if __name__ == "__main__":
    main()
