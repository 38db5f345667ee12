"""Where the time of a bk DP step goes, per workload, measured the fair way.

One process per workload, one thread; inside it *only* the non-private step and the bk step of
the same model (forward, backward, clipping, noise, SGD step) are built, and they are timed
alternately. The ratio is the median over repeats of (DP step / the non-private step timed just
before it), with its interquartile range. A second phase, in the same process, times each stage
of both steps with accumulating timers around the stage functions (the instrumented steps are
not the ones whose ratio is reported):

* non-private: forward, backward, optimizer step;
* bk: forward (of which: the capture hooks' Python), backward (of which: per-sample norms,
  Python in the backward hooks, and at the end of the pass: clipped sums, the rest of the
  end-of-pass bookkeeping), ``clip_and_accumulate`` (the step-record checks), noise, the wrapped
  optimizer's step.

A third phase (its own process, ``MALLOC_MMAP_THRESHOLD_`` set) measures the peak resident
memory of one step of each.

    python benchmarks/bench_profile.py                      # every workload, table on stdout
    python benchmarks/bench_profile.py --workloads gpt2 bert --repeats 5
    python benchmarks/bench_profile.py --quick              # 3 repeats

Workloads: the five of bench_modes.py, and two realistic Hugging Face transformers built from a
config (4 layers, hidden 256, 4 heads, sequence 128, batch 16, the model's default forward and
loss): ``gpt2`` (GPT2LMHeadModel, causal-LM loss, LM head tied to the token embeddings) and
``bert`` (BertForSequenceClassification, right-padded attention mask).
Not part of the test suite (benchmarks/ is not collected).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import types
from collections import defaultdict

from _timing import emit, run_worker, single_threaded

WORKLOADS = ["convnet64", "convnet256", "cifar32", "mlp256", "transformer32", "lstm64", "gpt2", "bert"]
HF_WORKLOADS = ("gpt2", "bert")


# ----------------------------------------------------------------------------- workloads
def build(workload: str, quick: bool):
    """``(model, batch kwargs-or-tensor, loss_fn(model, batch))`` for ``workload``."""
    import torch
    import torch.nn.functional as F

    if workload not in HF_WORKLOADS:
        from bench_modes import _build

        model, x, y = _build("dptorch", workload, quick)
        return model, x, lambda m, x: F.cross_entropy(m(x), y)
    import transformers as tf

    tf.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    b, t = 16, (64 if quick else 128)
    if workload == "gpt2":
        cfg = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128)
        model = tf.GPT2LMHeadModel(cfg)
        assert model.lm_head.weight is model.transformer.wte.weight
        ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
        batch = {"input_ids": ids, "labels": ids}
    else:
        cfg = tf.BertConfig(
            num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
            num_labels=2,
        )
        model = tf.BertForSequenceClassification(cfg)
        ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
        lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
        mask = (torch.arange(t)[None] < lengths[:, None]).long()
        batch = {"input_ids": ids, "attention_mask": mask,
                 "labels": torch.randint(0, 2, (b,), generator=g)}
    model.train()
    return model, batch, lambda m, batch: m(**batch).loss


# ----------------------------------------------------------------------------- steps
def make_steps(workload: str, quick: bool):
    import torch

    from dptorch.grad_sample import wrap_model
    from dptorch.optimizers import DPOptimizerFastGradientClipping

    single_threaded()
    model, batch, loss_fn = build(workload, quick)
    plain = copy.deepcopy(model)
    b = (batch["input_ids"] if isinstance(batch, dict) else batch).shape[0]
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01)
    gsm = wrap_model(model, "bk", max_grad_norm=1.0)
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=0.01),
        noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=b,
    )
    gsm.bind_clipping(opt.clipping)

    def np_step():
        sgd.zero_grad()
        loss_fn(plain, batch).backward()
        sgd.step()

    def dp_step():
        opt.zero_grad()
        loss_fn(gsm, batch).backward()
        opt.step()

    def np_reset():
        sgd.zero_grad(set_to_none=True)

    def dp_reset():
        opt.zero_grad(set_to_none=True)

    return (np_step, np_reset, plain, sgd), (dp_step, dp_reset, gsm, opt), batch, loss_fn


def ratios(np_step, dp_step, repeats: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        np_step()
        dp_step()
    t_np, t_dp = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np_step()
        t1 = time.perf_counter()
        dp_step()
        t2 = time.perf_counter()
        t_np.append(t1 - t0)
        t_dp.append(t2 - t1)
    r = sorted(d / n for d, n in zip(t_dp, t_np))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return {"t_np": statistics.median(t_np), "t_dp": statistics.median(t_dp),
            "ratio": statistics.median(r), "q1": q[0], "q3": q[2]}


# ----------------------------------------------------------------------------- the profile
class Timers:
    """Accumulating wall-clock timers around functions (re-entrant calls are not counted twice)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.depth = defaultdict(int)

    def wrap(self, key: str, fn):
        def timed(*args, **kwargs):
            if self.depth[key]:
                return fn(*args, **kwargs)
            self.depth[key] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - t0
                self.depth[key] -= 1

        return timed

    def patch(self, obj, name: str, key: str) -> None:
        setattr(obj, name, self.wrap(key, getattr(obj, name)))


def profile(workload: str, quick: bool, repeats: int) -> dict:
    import dataclasses

    from dptorch.grad_sample import grad_sample_module as gsm_mod
    from dptorch.grad_sample import grad_sample_module_bk as bk_mod
    from dptorch.grad_sample import registry

    (np_step, _, plain, sgd), (dp_step, _, gsm, opt), batch, loss_fn = make_steps(workload, quick)
    res = ratios(np_step, dp_step, repeats)

    tm = Timers()
    # rule functions: norms (ghost or instantiated) and clipped sums
    for key, rule in list(registry.LAYER_RULES.items()):
        changes = {}
        for f, label in (("norm_sq", "norms"), ("grad_sample", "norms"),
                         ("clipped_sum", "clipped_sum")):
            fn = getattr(rule, f)
            if fn is not None:
                changes[f] = tm.wrap(label, fn)
        registry.LAYER_RULES[key] = dataclasses.replace(rule, **changes)
    bk_mod.generic_clipped_sum = tm.wrap("clipped_sum", bk_mod.generic_clipped_sum)
    if hasattr(bk_mod, "weighted_sum"):  # instantiated per-sample gradients
        bk_mod.weighted_sum = tm.wrap("clipped_sum", bk_mod.weighted_sum)
    gsm_mod.ft_compute_per_sample_gradient = tm.wrap(
        "norms", gsm_mod.ft_compute_per_sample_gradient
    )
    cls = type(gsm)
    for name, key in (("_forward_hook", "fwd_hooks"), ("_on_backprops", "bwd_hooks"),
                      ("_end_of_backward", "end_of_pass"), ("_bk_forward", "bk_forward")):
        # a bound method (the hooks hold it weakly, gsm_base.weak_method), timed
        setattr(gsm, name, types.MethodType(tm.wrap(key, getattr(cls, name)), gsm))
    # instance-level forwards installed at wrapping time point at the bound method: reinstall
    gsm._remove_bk()
    gsm._install_bk()
    gsm.remove_hooks()
    gsm.add_hooks(loss_reduction=gsm.loss_reduction, batch_first=gsm.batch_first)
    gsm._trace_armed = False
    for name, key in (("clip_and_accumulate", "clip_checks"), ("add_noise", "noise"),
                      ("pre_step", "pre_step")):
        tm.patch(opt, name, key)
    tm.patch(opt.original_optimizer, "step", "opt_dp")
    tm.patch(sgd, "step", "opt_np")

    def staged(model, zero, step, prefix):
        zero()
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        tm.total[prefix + "fwd"] += t1 - t0
        tm.total[prefix + "bwd"] += t2 - t1
        tm.total[prefix + "step"] += t3 - t2

    for _ in range(2):
        staged(plain, sgd.zero_grad, sgd.step, "np_")
        staged(gsm, opt.zero_grad, opt.step, "dp_")
    tm.total.clear()
    for _ in range(repeats):
        staged(plain, sgd.zero_grad, sgd.step, "np_")
        staged(gsm, opt.zero_grad, opt.step, "dp_")
    prof = {k: v / repeats for k, v in tm.total.items()}
    n_params = sum(p.numel() for p in gsm.parameters() if p.requires_grad)
    return {**res, "profile": prof, "n_params": n_params}


def memory(workload: str, quick: bool) -> dict:
    from bench_modes import _peak_bytes

    (np_step, np_reset, *_), (dp_step, dp_reset, *_), _, _ = make_steps(workload, quick)
    np_step()
    dp_step()
    return {"m_np": _peak_bytes(np_step, np_reset), "m_dp": _peak_bytes(dp_step, dp_reset)}


# ----------------------------------------------------------------------------- report
ROWS = [  # (label, key or function of the profile)
    ("forward", lambda p: p["dp_fwd"]),
    ("  capture hooks (Python)", lambda p: p.get("fwd_hooks", 0.0)),
    ("backward", lambda p: p["dp_bwd"]),
    ("  autograd (ex. hooks)", lambda p: p["dp_bwd"] - p.get("bwd_hooks", 0) - p.get("end_of_pass", 0)),
    ("  per-sample norms", lambda p: p.get("norms", 0.0)),
    ("  backward hooks (Python)", lambda p: p.get("bwd_hooks", 0) - p.get("norms", 0)),
    ("  clip-weighted sums", lambda p: p.get("clipped_sum", 0.0)),
    ("  end of pass (other)", lambda p: p.get("end_of_pass", 0) - p.get("clipped_sum", 0)),
    ("step", lambda p: p["dp_step"]),
    ("  record checks", lambda p: p.get("clip_checks", 0.0)),
    ("  noise", lambda p: p.get("noise", 0.0)),
    ("  optimizer", lambda p: p.get("opt_dp", 0.0)),
    ("  other (scale, hooks)", lambda p: p["dp_step"] - p.get("clip_checks", 0)
     - p.get("noise", 0) - p.get("opt_dp", 0)),
]


def report(results: dict) -> None:
    ws = list(results)
    print("bk DP step / non-private step, same process, one thread "
          "(median ratio over repeats [interquartile range]); peak RSS ratio")
    print(f"{'workload':<14}{'non-private':>12}{'bk':>10}{'ratio':>8}  {'IQR':<13}{'memory':>7}")
    for w in ws:
        r = results[w]
        if "error" in r:
            print(f"{w:<14} error: {r['error']}")
            continue
        mem = r["m_dp"] / max(r["m_np"], 1) if "m_dp" in r else float("nan")
        print(f"{w:<14}{1e3 * r['t_np']:>10.1f}ms{1e3 * r['t_dp']:>8.1f}ms{r['ratio']:>8.2f}  "
              f"[{r['q1']:.2f}, {r['q3']:.2f}]  {mem:>6.2f}")
    print("\nprofile (ms per step, instrumented steps; non-private in the first column)")
    ok = [w for w in ws if "profile" in results[w]]
    print(f"{'stage':<27}" + "".join(f"{w:>14}" for w in ok))
    np_rows = [("np forward", "np_fwd"), ("np backward", "np_bwd"), ("np step", "np_step")]
    for label, key in np_rows:
        print(f"{label:<27}" + "".join(f"{1e3 * results[w]['profile'][key]:>14.2f}" for w in ok))
    for label, fn in ROWS:
        print(f"{label:<27}" + "".join(f"{1e3 * fn(results[w]['profile']):>14.2f}" for w in ok))
    print(f"{'parameters':<27}" + "".join(f"{results[w]['n_params']:>14,}" for w in ok))


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=None, help="default 9 (3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="3 repeats, sequence 64")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument(
        "--compare", metavar="DIR",
        help="also measure the dptorch checkout in DIR (e.g. an exported older commit: "
             "git archive HEAD~1 | tar -x -C DIR), alternating with this one per workload",
    )
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "PHASE"))
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 9)
    if args.worker:
        w, phase = args.worker
        emit(profile(w, args.quick, repeats) if phase == "time" else memory(w, args.quick))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = {"this checkout": here}
    if args.compare:
        sources = {f"{args.compare} (compare)": os.path.abspath(args.compare), **sources}
    results: dict = {s: {} for s in sources}
    for w in args.workloads:
        for label, src in sources.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", w, "time",
                   "--repeats", str(repeats)] + (["--quick"] if args.quick else [])
            env = {"PYTHONPATH": src}
            r = run_worker(cmd, extra_env=env, timeout=3600)
            if "error" not in r and not args.no_memory:
                cmd[4] = "memory"
                r.update(run_worker(
                    cmd, extra_env={**env, "MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=3600
                ))
            results[label][w] = r
            print(f"{label} {w}: " + (r["error"] if "error" in r else f"{r['ratio']:.2f}"),
                  file=sys.stderr)
    for label in sources:
        print(f"\n=== {label} ===")
        report(results[label])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
