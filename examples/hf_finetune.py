"""DP fine-tuning with the Hugging Face Trainer: swap ``Trainer`` for ``DPTrainer``.

Everything runs offline on a CPU: the model is a small GPT-2 (causal LM) or BERT (sequence
classification) built from a config with random weights, the tokenizer a word-level tokenizer
built in memory, and the text a generated corpus of short reviews ("the movie was really great
and the actors were fine", label positive / negative). The script is an ordinary Trainer script
— ``TrainingArguments``, a data collator, ``trainer.train()``, ``trainer.evaluate()`` — in which
``Trainer(...)`` became ``DPTrainer(..., target_epsilon=..., target_delta=...,
max_grad_norm=...)``. With ``--lora`` only LoRA adapters (and BERT's classification head) are
trained, through ``peft``.

What DPTrainer does under the hood (docs/integrations.md): Poisson sampling of the training
set with a logical batch of ``--batch-size × --accumulation`` records, physical batches of at
most ``--batch-size``, one loss per record (token mean; padding labelled -100 is ignored),
per-sample clipping in ``bk`` mode, noise calibrated to ``--epsilon``, and ``epsilon`` in the
Trainer's logs and checkpoints.

Examples::

    python examples/hf_finetune.py                       # GPT-2 from a config, epsilon 8
    python examples/hf_finetune.py --model bert --lora   # BERT classifier, LoRA adapters + head
    python examples/hf_finetune.py --smoke               # a few steps
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import warnings

from dptorch.integrations.transformers import DPTrainer  # needs: pip install "dptorch[hf]"

POSITIVE = ["great", "wonderful", "superb", "delightful", "moving", "brilliant", "charming"]
NEGATIVE = ["awful", "boring", "dull", "terrible", "clumsy", "painful", "tedious"]
ADVERBS = ["really", "quite", "truly", "rather", "very", "simply"]
#: the private data: movie reviews, two of whose adjectives never occur in the public data
MOVIES = ["movie", "film", "plot", "ending", "cast", "soundtrack", "script"]
MOVIE_EXTRA = (["gripping", "witty"], ["stale", "clunky"])
MOVIE_SECOND = ["the actors were fine", "the pace was slow", "the music was loud",
                "the camera work was steady", "the dialogue was sparse"]
#: public data (BERT's pre-training): book reviews
BOOKS = ["novel", "book", "chapter", "author", "prose", "story"]
BOOK_SECOND = ["the cover was plain", "the print was small", "the pages were thin"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def generate_reviews(n: int, seed: int, domain: str = "movies") -> list[tuple[str, int]]:
    """``n`` generated reviews ``(text, label)`` (1 positive, 0 negative) of 5 to 14 words:
    ``domain="movies"`` (the private data) or ``"books"`` (public data)."""
    rng = random.Random(seed)
    subjects, second = (MOVIES, MOVIE_SECOND) if domain == "movies" else (BOOKS, BOOK_SECOND)
    extra = MOVIE_EXTRA if domain == "movies" else ([], [])
    out = []
    for _ in range(n):
        label = int(rng.random() < 0.5)
        adj = rng.choice((POSITIVE + extra[0]) if label else (NEGATIVE + extra[1]))
        text = f"the {rng.choice(subjects)} was"
        if rng.random() < 0.6:
            text += f" {rng.choice(ADVERBS)}"
        text += f" {adj}"
        if rng.random() < 0.5:
            text += f" and {rng.choice(second)}"
        out.append((text, label))
    return out


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over the corpus' vocabulary (built in memory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    phrases = (POSITIVE + NEGATIVE + ADVERBS + MOVIES + MOVIE_SECOND + BOOKS + BOOK_SECOND
               + MOVIE_EXTRA[0] + MOVIE_EXTRA[1])
    words = sorted({w for s in phrases for w in s.split()} | {"the", "was", "and"})
    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", bos_token="[CLS]",
                                   eos_token="[SEP]")


def build_model(kind: str, tokenizer):
    """GPT-2 (causal LM) or BERT (sequence classification) from a small config, random
    weights."""
    import transformers as tf

    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2,
                            n_positions=32, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128, max_position_embeddings=32,
                        num_labels=2, pad_token_id=tokenizer.pad_token_id)
    return tf.BertForSequenceClassification(cfg)


def add_lora(kind: str, model):
    """LoRA adapters (rank 8) on the attention projections; BERT's classifier head stays
    trainable (``modules_to_save``); everything else is frozen."""
    from peft import LoraConfig, get_peft_model  # pip install peft

    targets, task = (["c_attn"], "CAUSAL_LM") if kind == "gpt2" else (["query", "value"], "SEQ_CLS")
    return get_peft_model(model, LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type=task,
        fan_in_fan_out=kind == "gpt2",  # GPT-2's Conv1D stores its weight transposed
    ))


def pretrain_on_public_data(model, train, collator, args) -> None:
    """Ordinary (non-private) training on *public* data, standing in for the pre-trained
    checkpoint a real fine-tuning starts from: DP-SGD from random weights needs far more
    private records than this example has (at initialisation the per-sample gradients of a
    classifier nearly cancel, and the noise drowns their mean)."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as tmp:
        Trainer(model=model, train_dataset=train, data_collator=collator, args=TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=32, num_train_epochs=1,
            learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True,
            save_strategy="no", logging_strategy="no", seed=args.seed,
        )).train()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt2", "bert"), default="gpt2")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only (peft)")
    p.add_argument("--epsilon", type=float, default=8.0, help="target epsilon (default 8)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 2e-3, 5e-3 with --lora)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="per_device_train_batch_size: the physical batch")
    p.add_argument("--accumulation", type=int, default=4,
                   help="gradient_accumulation_steps: logical batch = batch size x this")
    p.add_argument("--train-size", type=int, default=4000, help="private movie reviews")
    p.add_argument("--public-size", type=int, default=2000,
                   help="public book reviews for the non-private pre-training (0: none, "
                        "start the DP training from random weights)")
    p.add_argument("--mode", default="bk", choices=("bk", "hooks", "ghost", "functorch", "ew"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary dir)")
    p.add_argument("--smoke", action="store_true", help="a tiny run: 3 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.train_size, args.batch_size, args.accumulation = 256, 16, 2
        args.public_size = min(args.public_size, 64)
    if args.lr is None:
        args.lr = 5e-3 if args.lora else 2e-3
    if not (args.epsilon > 0 and math.isfinite(args.epsilon) and 0 < args.delta < 1):
        p.error("--epsilon must be > 0 and --delta in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithPadding,
        TrainingArguments,
        set_seed,
    )

    set_seed(args.seed)
    tokenizer = build_tokenizer()
    reviews = generate_reviews(args.train_size + 500, args.seed)

    def encode(pairs):
        enc = tokenizer([t for t, _ in pairs], truncation=True, max_length=32)
        rows = [{"input_ids": ids, "attention_mask": m}
                for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
        if args.model == "bert":
            for r, (_, y) in zip(rows, pairs):
                r["labels"] = y
        return rows

    train, test = encode(reviews[:args.train_size]), encode(reviews[args.train_size:])
    if args.model == "gpt2":  # labels = input ids, -100 on the padding
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        collator = DataCollatorWithPadding(tokenizer)
    model = build_model(args.model, tokenizer)
    if args.public_size > 0:
        public = encode(generate_reviews(args.public_size, args.seed + 1, domain="books"))
        pretrain_on_public_data(model, public, collator, args)
    if args.lora:
        model = add_lora(args.model, model)

    def accuracy(pred):
        return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.accumulation,
            per_device_eval_batch_size=256,
            num_train_epochs=args.epochs,
            max_steps=3 if args.smoke else -1,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            logging_steps=1 if args.smoke else 10,
            eval_strategy="no",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = DPTrainer(                       # was: Trainer(
            model=model,
            args=training_args,
            train_dataset=train,
            eval_dataset=test,
            data_collator=collator,
            compute_metrics=accuracy if args.model == "bert" else None,
            target_epsilon=args.epsilon,           # the privacy arguments
            target_delta=args.delta,
            max_grad_norm=args.max_grad_norm,
            grad_sample_mode=args.mode,
        )
        before = trainer.evaluate()["eval_loss"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer.train()
        metrics = trainer.evaluate()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    start = f"pre-trained on {args.public_size} public reviews" if args.public_size else "random"
    print(f"{args.model}{' + LoRA' if args.lora else ''} ({start}): DP-trained {trainable:,} of "
          f"{total:,} parameters on {len(train)} private reviews; "
          f"sigma {trainer.noise_multiplier:.3f}, "
          f"sample rate {trainer.sample_rate:.4g}, {len(trainer.privacy_engine.accountant)} steps")
    extra = f", eval accuracy {metrics['eval_accuracy']:.3f}" if "eval_accuracy" in metrics else ""
    print(f"final: eval loss {metrics['eval_loss']:.4f} (before training {before:.4f}){extra}, "
          f"epsilon {trainer.get_epsilon():.3f} at delta {args.delta:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
