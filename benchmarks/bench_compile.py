"""``torch.compile`` with the fast-clipping modes: does it run, is it exact, where does Dynamo
break the graph, and what does it buy.

For each workload (fixed shapes: the same batch every step, as fixed-shape sampling or padding
with masked rows would give) and each mode in ``bk``/``ghost``, in its own process, one thread:

* ``eager``: the non-private and the DP step, uncompiled;
* ``before``: ``torch.compile(model)`` first, then wrapped (what ``make_private`` does to a
  compiled model);
* ``after``: the wrapped module compiled (``torch.compile(gsm)``).

The non-private baseline is compiled the same way. Reported: the median step times, the DP
step over the non-private step *of the same compilation*, the largest parameter difference
from the eager DP run after the timed steps (noise 0, so it must be 0 up to float round-off),
and Dynamo's graph-break count with the distinct reasons (``--reasons``).

    python benchmarks/bench_compile.py [--workloads mlp256 convnet64] [--repeats 9] [--reasons]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

from _timing import emit, interleaved_medians, run_worker, single_threaded


def worker(workload: str, mode: str, where: str, repeats: int) -> dict:
    import logging

    import torch
    import torch._dynamo as dynamo
    import torch.nn.functional as F
    from bench_modes import _build
    from torch._dynamo.utils import counters

    from dptorch.grad_sample import wrap_model
    from dptorch.optimizers import DPOptimizerFastGradientClipping
    from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    warnings.filterwarnings("ignore")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    single_threaded()
    model, x, y = _build("dptorch", workload, quick=False)
    b = len(y)

    def dp(m, where):
        m = copy.deepcopy(m)
        if where == "before":
            m = torch.compile(m)
        gsm = wrap_model(m, mode, max_grad_norm=1.0)
        opt = DPOptimizerFastGradientClipping(
            torch.optim.SGD(gsm.parameters(), lr=0.01), noise_multiplier=0.0,
            max_grad_norm=1.0, expected_batch_size=b,
        )
        gsm.bind_clipping(opt.clipping)
        net = torch.compile(gsm) if where == "after" else gsm
        crit = torch.nn.CrossEntropyLoss()
        if mode == "ghost":
            crit = DPLossFastGradientClipping(gsm, opt, crit)

        def step():
            opt.zero_grad()
            crit(net(x), y).backward()
            opt.step()

        return step, gsm

    plain = copy.deepcopy(model)
    net_np = plain if where == "eager" else torch.compile(plain)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01)

    def np_step():
        sgd.zero_grad()
        F.cross_entropy(net_np(x), y).backward()
        sgd.step()

    dynamo.reset()
    counters.clear()
    try:
        dp_step, gsm = dp(model, where)
        t_np, t_dp = interleaved_medians([np_step, dp_step], repeats)
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    breaks = dict(counters["graph_break"])
    ref_step, ref = dp(model, "eager")
    for _ in range(repeats + 3):
        ref_step()
    diff = max(
        (a - r).abs().max().item() for a, r in zip(gsm.parameters(), ref.parameters())
    )
    reasons = sorted({" ".join(str(k).split())[:160] for k in breaks})
    return {"t_np": t_np, "t_dp": t_dp, "breaks": sum(breaks.values()), "reasons": reasons,
            "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=["mlp256", "convnet64"])
    parser.add_argument("--modes", nargs="*", default=["bk", "ghost"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--reasons", action="store_true", help="print the graph-break reasons")
    parser.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "MODE", "WHERE"))
    args = parser.parse_args()
    if args.worker:
        emit(worker(*args.worker, args.repeats))
        return
    print(f"{'workload':<12}{'mode':<7}{'compile':<8}{'non-private':>12}{'DP':>10}{'ratio':>7}"
          f"{'breaks':>8}{'max diff':>10}")
    for w in args.workloads:
        for mode in args.modes:
            for where in ("eager", "before", "after"):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", w, mode, where,
                       "--repeats", str(args.repeats)]
                r = run_worker(cmd, timeout=1800)
                if "error" in r:
                    print(f"{w:<12}{mode:<7}{where:<8} error: {r['error']}")
                    continue
                print(f"{w:<12}{mode:<7}{where:<8}{1e3 * r['t_np']:>10.2f}ms{1e3 * r['t_dp']:>8.2f}ms"
                      f"{r['t_dp'] / r['t_np']:>7.2f}{r['breaks']:>8}{r['diff']:>10.1e}")
                if args.reasons:
                    for reason in r["reasons"]:
                        print(f"    break: {reason}")


if __name__ == "__main__":
    main()
