"""The DP step over the non-private step on a GPU, per workload, mode and precision.

For each workload (the five of bench_modes.py and the Hugging Face transformers of
bench_profile.py, those at batch 32 here; ``gpt2s`` is GPT-2 small, 12 layers, hidden 768) and
each precision (``fp32``; ``bf16``: ``torch.autocast(dtype=torch.bfloat16)`` around forward and
loss, parameters in float32), one process builds the non-private model and the DP model of each
mode from the same weights and times them alternately. A step is ``zero_grad``, forward, loss,
backward, optimizer step (noise included), timed between ``torch.cuda.synchronize()`` calls;
the ratio is the median over repeats of (DP step / the non-private step timed just before it),
with its interquartile range. Peak GPU memory (``max_memory_allocated``) of each step is
reported beside it. With ``--trace``, a ``torch.profiler`` table of the bk step's CUDA kernels
for ``gpt2`` bf16 is written beside the results.

    python benchmarks/bench_gpu.py --out results_gpu.json            # every workload
    python benchmarks/bench_gpu.py --workloads gpt2 --precisions bf16 --repeats 20

Not part of the test suite (benchmarks/ is not collected). Needs CUDA (``--device cpu`` runs
the same code on the CPU, to check the script).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys

import torch
import torch.nn.functional as F
from _timing import paired_ratios

WORKLOADS = ["convnet64", "convnet256", "mlp256", "transformer32", "lstm64", "gpt2", "bert",
             "gpt2s"]
MODES = ["bk", "ghost", "hooks"]


def build(workload: str, batch: int, device: str):
    """``(model, batch, target or None, loss_fn(model, batch))`` on ``device`` (the target of
    a Hugging Face model is in its batch)."""
    if workload not in ("gpt2", "bert", "gpt2s"):
        from bench_modes import _build

        model, x, y = _build("dptorch", workload, False)
        x, y = x.to(device), y.to(device)
        return model.to(device), x, y, lambda m, x: F.cross_entropy(m(x), y)
    import transformers as tf

    tf.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    t = 128
    if workload in ("gpt2", "gpt2s"):
        size = dict(n_layer=4, n_embd=256, n_head=4) if workload == "gpt2" else {}
        cfg = tf.GPT2Config(n_positions=t, **size)
        model = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=g)
        data = {"input_ids": ids, "labels": ids}
    else:
        cfg = tf.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                            intermediate_size=1024, num_labels=2)
        model = tf.BertForSequenceClassification(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=g)
        lengths = torch.randint(t // 2, t + 1, (batch,), generator=g)
        mask = (torch.arange(t)[None] < lengths[:, None]).long()
        data = {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(0, 2, (batch,), generator=g)}
    model.train()
    data = {k: v.to(device) for k, v in data.items()}
    return model.to(device), data, None, lambda m, d: m(**d).loss


def _ghost_loss(workload: str, gsm, opt, y):
    """The ghost loss wrapper's ``(model, batch) -> loss`` for ``workload``."""
    from dptorch.grad_sample.fast_clipping_loss import DPLossFastGradientClipping

    if workload in ("gpt2", "gpt2s"):
        def token_ce(logits, labels, shape=None):  # next-token loss per sample, shape (B,)
            lg, lb = logits[:, :-1], labels[:, 1:]
            per_tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), lb.reshape(-1),
                                      reduction="none")
            return per_tok.view(lb.shape).mean(1)
        crit = _Criterion(token_ce)
        wrapper = DPLossFastGradientClipping(gsm, opt, crit)
        return lambda m, d: wrapper(m(input_ids=d["input_ids"]).logits, d["labels"])
    if workload == "bert":
        wrapper = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss())
        return lambda m, d: wrapper(
            m(input_ids=d["input_ids"], attention_mask=d["attention_mask"]).logits.float(),
            d["labels"])
    wrapper = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss())
    return lambda m, x: wrapper(m(x), y)


class _Criterion(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.reduction = fn, "mean"

    def forward(self, out, target, shape=None):
        per = self.fn(out, target)
        return per if self.reduction == "none" else (per.mean() if self.reduction == "mean"
                                                      else per.sum())


def allow_tf32(device: str) -> None:
    """TF32 matmuls and convolutions on a CUDA device (the setting of every GPU figure)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def make_pair(workload: str, mode: str, batch: int, device: str):
    """Non-private and DP step closures of the same model (same initial weights)."""
    from dptorch.grad_sample import wrap_model
    from dptorch.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

    torch.manual_seed(0)
    model, data, y, loss_fn = build(workload, batch, device)
    plain = copy.deepcopy(model)
    b = (data["input_ids"] if isinstance(data, dict) else data).shape[0]
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=b)
    if mode in ("bk", "ghost"):
        gsm = wrap_model(model, mode, max_grad_norm=1.0)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.01), **kw)
        gsm.bind_clipping(opt.clipping)
        dp_loss = _ghost_loss(workload, gsm, opt, y) if mode == "ghost" else loss_fn
    else:
        gsm = wrap_model(model, mode)
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.01), **kw)
        dp_loss = loss_fn
    return (plain, sgd, loss_fn), (gsm, opt, dp_loss), data


def timed_steps(pair, data, precision: str, device: str, repeats: int, warmup: int):
    (plain, sgd, np_loss), (gsm, opt, dp_loss), = pair
    amp = (torch.autocast(device_type=device, dtype=torch.bfloat16) if precision == "bf16"
           else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def np_step():
        sgd.zero_grad()
        with amp:
            loss = np_loss(plain, data)
        loss.backward()
        sgd.step()

    def dp_step():
        opt.zero_grad()
        with amp:
            loss = dp_loss(gsm, data)
        loss.backward()
        opt.step()

    def peak(step):
        if device != "cuda":
            return 0
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        return torch.cuda.max_memory_allocated() - base

    for _ in range(warmup):
        np_step()
        dp_step()
    m_np, m_dp = peak(np_step), peak(dp_step)
    res = paired_ratios(np_step, dp_step, repeats, sync)
    return {**res, "mem_np_mb": m_np / 2**20, "mem_dp_mb": m_dp / 2**20,
            "mem_ratio": (m_dp / m_np) if m_np else None}, dp_step


def trace(dp_step, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dp_step()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=WORKLOADS)
    ap.add_argument("--modes", nargs="*", default=MODES)
    ap.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=32, help="batch of the transformers")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, help="path of the gpt2 bf16 bk kernel table")
    args = ap.parse_args()
    allow_tf32(args.device)
    results = []
    for w in args.workloads:
        for mode in args.modes:
            for prec in args.precisions:
                if prec == "bf16" and w in ("lstm64",):
                    continue  # DPLSTM under autocast: not measured
                try:
                    pair = make_pair(w, mode, args.batch, args.device)
                    res, dp_step = timed_steps(pair[:2], pair[2], prec, args.device,
                                               args.repeats, args.warmup)
                    if args.trace and w == "gpt2" and mode == "bk" and prec == "bf16":
                        trace(dp_step, args.trace)
                except Exception as e:  # report and go on: one failure must not hide the rest
                    res = {"error": f"{type(e).__name__}: {e}"[:300]}
                row = {"workload": w, "mode": mode, "precision": prec, **res}
                results.append(row)
                print(json.dumps(row), flush=True)
                pair = None
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
