"""DP step over non-private step on tiny Hugging Face models built from a config (random
weights, default forward and loss): GPT-2, BERT (sequence classification), Llama and T5, two
layers, hidden 64, sequence 12, batch 16. At this size the step is dominated by per-layer Python,
so it measures the host overhead of each mode (what bounds a GPU step).

One process per (model, mode), one thread; inside it the non-private and the DP step
(``make_private``) alternate and the medians of 20 repeats are compared.

    .venv/bin/python benchmarks/bench_tiny_hf.py [--modes hooks bk] [--models gpt2 bert llama t5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings

MODELS = ["gpt2", "bert", "llama", "t5"]


def build(name: str):
    import transformers as tf

    tf.logging.set_verbosity_error()
    if name == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=32)
        )
    if name == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
            vocab_size=1000, num_labels=2,
        ))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1000,
        ))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
            vocab_size=1000, decoder_start_token_id=0, pad_token_id=0,
        ))
    raise KeyError(name)


def worker(name: str, mode: str, repeats: int) -> dict:
    import torch

    from dptorch import PrivacyEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(name).train()
    b, t = 16, 12
    ids = torch.randint(0, 1000, (b, t))
    batch = {"input_ids": ids, "labels": torch.randint(0, 2, (b,)) if name == "bert" else ids}
    plain = copy.deepcopy(model)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode=mode, poisson_sampling=False,
            criterion=torch.nn.CrossEntropyLoss(),
        )
    dp_model, dp_opt = out[0], out[1]
    # ghost back-propagates through its loss wrapper: per-sample losses, then the DP loss
    criterion = out[2] if mode == "ghost" else None

    def step(m, opt):
        opt.zero_grad()
        if criterion is not None and m is dp_model:
            logits = m(**{k: v for k, v in batch.items() if k != "labels"}).logits
            if name == "bert":
                criterion(logits, batch["labels"]).backward()
            else:  # causal LM: position t predicts token t + 1
                criterion(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:]).backward()
        else:
            m(**batch).loss.backward()
        opt.step()

    times: list[list[float]] = [[], []]
    for r in range(repeats + 5):
        for k, (m, opt) in enumerate(((plain, sgd), (dp_model, dp_opt))):
            t0 = time.perf_counter()
            step(m, opt)
            if r >= 5:
                times[k].append(time.perf_counter() - t0)
    t_np, t_dp = (statistics.median(ts) for ts in times)
    return {"np_ms": t_np * 1e3, "dp_ms": t_dp * 1e3, "ratio": t_dp / t_np}


def main() -> None:
    from _timing import emit, run_worker

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--modes", nargs="*", default=["hooks", "bk"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        emit(worker(*args.one, args.repeats))
        return
    print(f"{'model':8s}{'mode':7s}{'non-private':>12s}{'DP step':>10s}{'ratio':>8s}")
    for name in args.models:
        for mode in args.modes:
            r = run_worker([sys.executable, __file__, "--one", name, mode,
                            "--repeats", str(args.repeats)])
            if "error" in r:
                print(f"{name:8s}{mode:7s}  error: {r['error']}")
            else:
                print(f"{name:8s}{mode:7s}{r['np_ms']:10.1f}ms{r['dp_ms']:8.1f}ms{r['ratio']:8.2f}")


if __name__ == "__main__":
    main()
