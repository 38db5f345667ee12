"""The DP step captured in a CUDA graph, over the non-private step captured the same way.

On a GPU a small model's step is bound by the host: Python and kernel launches, not the
kernels (see README, "On a GPU"). A CUDA graph replays a captured step's kernels with no Python
at all, so it removes exactly the per-layer host work that bk adds. This benchmark measures how
far that goes, for each workload of ``bench_gpu.py`` (bk mode, fixed-shape batches):

* ``graph``: replay of the captured DP step (zero_grad excluded: a replay rewrites every
  gradient) over replay of the captured non-private step, median of alternated repeats;
* ``eager``: the same two steps run eagerly in the same process, for comparison;
* ``api``: the same DP step through :func:`dptorch.graphed_step.make_graphed_dp_step` (its
  checks before every replay included) over the captured non-private step;
* ``exact``: with σ = 0 and dropout off, the parameters after one replay against one eager DP step from the same
  weights (max |difference| over max |update|);
* ``fresh_noise``: with σ = 1, two replays from the same weights must draw different noise, of
  the right scale: the std of their difference over ``lr · σ · C · √2 / B``.

    python benchmarks/bench_cuda_graph.py --workloads gpt2 --precisions bf16 --out r.jsonl

Run one workload per process: a capture that fails leaves torch's CUDA generator in capture
state, and every later draw in that process fails. ``--out`` appends one JSON line per row.

A graph bakes in what Python decided at capture: the clipping bound, σ, the learning rate, the
set of trainable parameters and the batch shape. This script is a measurement, not a training
API: replaying a captured DP step after changing any of them would silently train with the old
values. ``--device cpu`` runs the same code with replay replaced by an eager call, to check the
script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
from _timing import paired_ratios
from bench_gpu import allow_tf32, make_pair

WORKLOADS = ["gpt2", "bert", "gpt2s", "transformer32", "convnet256", "mlp256"]


def _capture(body, zero_grad, device: str, warmup: int = 3):
    """Runs ``body`` ``warmup`` times on a side stream, then captures it; returns ``replay()``."""
    if device != "cuda":
        def replay():
            zero_grad()
            body()
        return replay
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            zero_grad()
            body()
    torch.cuda.current_stream().wait_stream(s)
    zero_grad()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g.replay


def _steps(pair, data, precision: str, device: str):
    (plain, sgd, np_loss), (gsm, opt, dp_loss) = pair
    amp = (torch.autocast(device_type=device, dtype=torch.bfloat16) if precision == "bf16"
           else contextlib.nullcontext())

    def np_body():
        with amp:
            loss = np_loss(plain, data)
        loss.backward()
        sgd.step()

    def dp_body():
        with amp:
            loss = dp_loss(gsm, data)
        loss.backward()
        opt.step()

    return (np_body, lambda: sgd.zero_grad(set_to_none=True),
            dp_body, lambda: opt.zero_grad(set_to_none=True), gsm, opt)


def _params(m):
    return [p.detach().clone() for p in m.parameters()]


def _restore(m, saved):
    with torch.no_grad():
        for p, s in zip(m.parameters(), saved):
            p.copy_(s)


def run(workload: str, precision: str, device: str, batch: int, repeats: int) -> dict:

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out: dict = {}
    # timing, with noise
    pair = make_pair(workload, "bk", batch, device)
    np_body, np_zero, dp_body, dp_zero, gsm, opt = _steps(pair[:2], pair[2], precision, device)

    def eager_np():
        np_zero()
        np_body()

    def eager_dp():
        dp_zero()
        dp_body()

    for _ in range(3):
        eager_np()
        eager_dp()
    out["eager"] = paired_ratios(eager_np, eager_dp, max(repeats // 2, 5), sync)
    p0 = _params(gsm)
    np_replay = _capture(np_body, np_zero, device)
    dp_replay = _capture(dp_body, dp_zero, device)
    out["graph"] = paired_ratios(np_replay, dp_replay, repeats, sync)
    if device == "cuda":
        from dptorch.graphed_step import make_graphed_dp_step

        amp = (torch.autocast(device_type=device, dtype=torch.bfloat16) if precision == "bf16"
               else contextlib.nullcontext())
        dp_loss, data = pair[1][2], pair[2]

        def loss_fn(d):
            with amp:
                return dp_loss(gsm, d)

        step = make_graphed_dp_step(gsm, opt, loss_fn, warmup_steps=1)
        step(data)
        out["api"] = paired_ratios(np_replay, lambda: step(data), repeats, sync)
        out["api"]["captures"] = step.captures
        # the same graph without the checks before each replay: what they cost on the host
        out["api_graph_only"] = paired_ratios(np_replay, step._graph.replay, repeats, sync)
    # two replays from the same weights draw different noise, of std lr·σ·C/B per coordinate
    _restore(gsm, p0)
    dp_replay()
    a = _params(gsm)
    _restore(gsm, p0)
    dp_replay()
    b = _params(gsm)
    diff = torch.cat([(x - y).flatten().float() for x, y in zip(a, b)])
    b_rows = (pair[2]["input_ids"] if isinstance(pair[2], dict) else pair[2]).shape[0]
    expected = 0.01 * opt.noise_multiplier * opt.max_grad_norm * 2 ** 0.5 / b_rows
    out["fresh_noise"] = {"std_over_expected": float(diff.std()) / expected,
                          "identical": bool((diff == 0).all())}
    pair = dp_replay = np_replay = None
    # exactness, σ = 0: one replay against one eager step from the same weights
    pair = make_pair(workload, "bk", batch, device)
    pair[1][1].noise_multiplier = 0.0
    for m in pair[1][0].modules():  # dropout draws differ between two runs; exactness needs none
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    np_body, np_zero, dp_body, dp_zero, gsm, opt = _steps(pair[:2], pair[2], precision, device)
    p0 = _params(gsm)
    dp_zero()
    dp_body()
    eager = _params(gsm)
    _restore(gsm, p0)
    dp_replay = _capture(dp_body, dp_zero, device)
    _restore(gsm, p0)
    dp_replay()
    got = _params(gsm)
    err = max(float((g - e).abs().max()) for g, e in zip(got, eager))
    upd = max(float((e - s).abs().max()) for e, s in zip(eager, p0))
    out["exact"] = {"max_abs_diff_over_max_update": err / upd if upd else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=WORKLOADS)
    ap.add_argument("--precisions", nargs="*", default=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    allow_tf32(args.device)
    results = []
    for w in args.workloads:
        for prec in args.precisions:
            try:
                res = run(w, prec, args.device, args.batch, args.repeats)
            except Exception as e:  # report and go on, with where it broke
                import traceback

                res = {"error": f"{type(e).__name__}: {e}"[:400],
                       "where": traceback.format_exc()[-1500:]}
            row = {"workload": w, "precision": prec, **res}
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        with open(args.out, "a") as f:
            for row in results:
                f.write(json.dumps({"device": device, "torch": torch.__version__, **row}) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
