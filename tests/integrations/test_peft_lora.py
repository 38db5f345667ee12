"""PEFT LoRA with dptorch: exact per-sample gradients, or a refusal, never silent corruption.

Opacus users report DP-LoRA runs that train "normally" with recent PEFT releases and give
unusable models (Opacus #820). dptorch's answer, pinned here against whatever ``peft`` is
installed:

* **exact**: LoRA adapters (and the ``modules_to_save`` classification head) of BERT and Llama
  built from a config get the DP-SGD update of the brute-force per-sample loop
  (tests/privacy/reference.py: each record alone, float64), in every mode; nothing else moves;
* **or refused**: every LoRA variant the installed PEFT offers here is either exact or refused
  with ``ValueError`` on the first step (DoRA, whose magnitude computes ``lora_A`` on an
  identity matrix, is refused), and a LoRA layer that uses its weights functionally — what a
  future PEFT release could do — is refused, not trained with unclipped gradients;
* **what was trained is what is saved**: after DPTrainer steps, the adapter saved with
  ``save_pretrained`` and loaded into a fresh base model reproduces the trained model's
  outputs, merged or not, and the update of the step is the reference's.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from privacy.hf_models import HFCase  # noqa: E402
from privacy.reference import reference_dp  # noqa: E402
from privacy.test_hf_exact import assert_all_close, dp_update  # noqa: E402

from dptorch import PrivacyEngine  # noqa: E402

from .hf_helpers import quiet_build  # noqa: E402

B = 4
MODES = ("hooks", "functorch", "bk", "ghost", "ew")

LORA = {
    "bert_cls": dict(target_modules=["query", "value"], task_type="SEQ_CLS"),
    "llama": dict(target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    "gpt2": dict(target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True),
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def lora_case(name: str, seed: int = 0, **extra) -> HFCase:
    """The tiny model ``name`` (tests/privacy/hf_models.py) with LoRA adapters (rank 4, random
    ``lora_B`` so that every adapter weight has a gradient), float64, train mode."""
    case = quiet_build(name, seed)
    torch.manual_seed(seed + 1)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     **{**LORA[name], **extra})
    model = get_peft_model(case.model, cfg).double().train()
    return HFCase(f"{name}+lora", model, case.make_batch, case.loss_fn, case.float32_internals)


def _c_between_norms(case, inputs, labels):
    ref = reference_dp(case.model, inputs, labels, case.loss_fn, 1.0)
    s = ref.norms.sort().values
    c = float(s[B // 2 - 1] + s[B // 2]) / 2
    return c, reference_dp(case.model, inputs, labels, case.loss_fn, c)


def _trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["bert_cls", "llama"])
def test_lora_dp_step_is_exact(name, mode):
    case = lora_case(name)
    trainable = _trainable(case.model)
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    if name == "bert_cls":  # the classification head is trained too (modules_to_save)
        assert any("modules_to_save" in n for n in trainable)
    inputs, labels = case.make_batch(B, 0)
    c, ref = _c_between_norms(case, inputs, labels)
    assert (ref.factors < 1).sum() == B // 2
    update, _ = dp_update(case, mode, inputs, labels, c)
    tol = 1e-5 if case.float32_internals and mode == "ghost" else 1e-9
    assert_all_close({n: update[n] for n in trainable}, ref.clipped_sum, tol, f"LoRA {mode}")
    frozen = [n for n in update if n not in trainable and update[n].abs().max() != 0]
    assert not frozen, f"frozen parameters moved: {frozen[:3]}"


VARIANTS = {
    "plain": {},
    "rslora": dict(use_rslora=True),
    "lora_bias": dict(lora_bias=True),
    "bias_all": dict(bias="all"),
    "all_linear": dict(target_modules="all-linear"),
    "dora": dict(use_dora=True),
}


@pytest.mark.parametrize("mode", ["hooks", "bk", "ew"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_lora_variant_is_exact_or_refused(name, variant, mode):
    """The invariant that makes PEFT upgrades safe: whatever a LoRA variant computes, the DP
    update is the reference's or the step raises ValueError. Nothing in between."""
    try:
        case = lora_case(name, **VARIANTS[variant])
    except (ValueError, TypeError, NotImplementedError) as e:  # variant absent from this PEFT
        pytest.skip(f"peft {peft.__version__}: {e}")
    inputs, labels = case.make_batch(B, 0)
    c, ref = _c_between_norms(case, inputs, labels)
    try:
        update, _ = dp_update(case, mode, inputs, labels, c)
    except ValueError as e:
        assert "per-sample" in str(e) or "per sample" in str(e), e
        outcome = "refused"
    else:
        assert_all_close({n: update[n] for n in ref.clipped_sum}, ref.clipped_sum, 1e-9,
                         f"{variant} {mode}")
        outcome = "exact"
    # ExpandedWeights cannot differentiate GPT-2's Conv1D (a trainable bias with bias="all")
    ew_refusal = mode == "ew" and name == "gpt2" and variant == "bias_all"
    if variant != "dora" and not ew_refusal:
        assert outcome == "exact", f"{variant} should be exact"


class FunctionalLoRA(nn.Module):
    """A LoRA layer computed with its weights used functionally (``F.linear(x, A.weight)``), as
    a PEFT release could: no per-sample hook sees those uses."""

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_A.weight), self.lora_B.weight)


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_functionally_computed_adapter_is_refused(mode):
    torch.manual_seed(0)
    model = nn.Sequential(FunctionalLoRA(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3))
    for p in model[0].base.parameters():
        p.requires_grad_(False)
    for p in model[2].parameters():
        p.requires_grad_(False)
    data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                                lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode=mode,
    )
    gsm, opt, loader = out[0], out[1], out[-1]
    x, y = next(iter(loader))
    with pytest.raises(ValueError, match="outside|functional"):
        loss = F.cross_entropy(gsm(x), y)
        (out[2](gsm(x), y) if mode == "ghost" else loss).backward()
        opt.step()


@pytest.mark.parametrize("name", ["bert_cls", "gpt2", "llama"])
def test_dptrainer_lora_trains_and_saves_what_it_trained(name, tmp_path):
    """DPTrainer on a PEFT model: σ = 0, tight C, two steps. Each step's update of the adapters
    (and head) is the reference's, the frozen base does not move, and the adapter saved with
    ``save_pretrained`` reproduces the trained model's outputs in a fresh base model, merged
    or not."""
    from dptorch.integrations.transformers import DPTrainer

    from .hf_helpers import (
        RecordingDataset,
        StepRecorder,
        assert_update_close,
        reference_update,
        token_mean_loss,
        training_args,
        with_params,
    )

    case = lora_case(name)
    pristine = copy.deepcopy(case.model)
    base_before = {n: p.detach().clone() for n, p in case.model.named_parameters()
                   if not p.requires_grad}
    dataset = RecordingDataset(case)
    trainer = DPTrainer(model=case.model, args=training_args(str(tmp_path)),
                        train_dataset=dataset, noise_multiplier=0.0, max_grad_norm=1e-3)
    rec = StepRecorder(dataset, case.model)
    trainer.add_callback(rec)
    trainer.train()
    loss_fn = token_mean_loss(case)
    expected = trainer.dp_optimizer.expected_batch_size
    for before, after, indices in zip(rec.before, rec.after, rec.batches):
        if not indices:
            continue
        inputs, labels = dataset.batch(indices)
        ref, norms = reference_update(with_params(pristine, before), inputs, labels, loss_fn,
                                      1e-3, expected)
        assert bool((norms > 1e-3).all())
        assert set(ref) == _trainable(case.model)
        # Llama's RMSNorm computes in float32 whatever the model's dtype, and the trainer's
        # loss is a batch mean (gradients scaled by 1/B in there): float32 round-off
        rtol = 1e-5 if case.float32_internals else 1e-8
        for n, r in ref.items():
            assert_update_close(after[n] - before[n], r, rtol, n)
    for n, p in case.model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n

    # the saved adapter is the trained one
    case.model.eval()
    inputs, _ = case.make_batch(3, 7)
    with torch.no_grad():
        trained = case.model(**inputs).logits
        initial = pristine.eval()(**inputs).logits
    assert not torch.allclose(trained, initial, atol=1e-12), "training changed nothing"
    case.model.save_pretrained(str(tmp_path / "adapter"))
    fresh = quiet_build(name).model.double().eval()
    reloaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).double().eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(**inputs).logits, trained, rtol=1e-9, atol=1e-9)
        merged = reloaded.merge_and_unload()
        assert torch.allclose(merged(**inputs).logits, trained, rtol=1e-7, atol=1e-7)
