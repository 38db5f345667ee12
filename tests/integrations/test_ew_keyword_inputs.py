"""ExpandedWeights (``grad_sample_mode="ew"``) with keyword inputs, as Hugging Face models are
called: ``gsm(input_ids=..., attention_mask=...)``.

* it works: BERT (position ids of shape ``[1, T]`` expanded to the batch, padded attention
  masks) gets the exact DP update of the per-sample reference, and so does a plain module with
  keyword-only inputs and an empty Poisson batch;
* or it refuses clearly: a model with a trainable layer ExpandedWeights cannot differentiate
  (GPT-2's ``Conv1D``, Llama's ``RMSNorm``) is refused by ``make_private`` with a ``ValueError``
  naming the layer and the fix, before the model or the optimizer is modified (on a copy: the
  cached models of tests/privacy/test_hf_exact.py are shared by the whole session); a layer called on inputs that are not the batch (MPNet's
  relative position bias) is refused on the first forward pass.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from privacy.test_hf_exact import _setup, assert_all_close, dp_update  # noqa: E402

from dptorch import PrivacyEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("name", ["bert_cls", "bert_cls_padded", "bert_mlm"])
def test_ew_hf_keyword_forward_is_exact(name):
    case, inputs, labels, c, ref = _setup(name)
    update, _ = dp_update(case, "ew", inputs, labels, c)
    assert_all_close(update, ref.clipped_sum, 1e-9, "ew DP update")


def _loader(n=16, batch=4):
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (n, 6)), torch.randint(0, 3, (n,)))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _state(model: nn.Module) -> tuple:
    """Everything wrapping may change: hooks, forward overrides and attributes of every layer
    and parameter (``summed_grad``, ``grad_sample``, ...), the parameters' values."""
    layers = [
        (n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
         len(m._backward_pre_hooks), sorted(k for k in vars(m) if not k.startswith("_")))
        for n, m in model.named_modules()
    ]
    params = [(n, sorted(vars(p)), len(p._backward_hooks or {}), p.detach().clone())
              for n, p in model.named_parameters()]
    return layers, params


def _same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(x[:3] == y[:3] and torch.equal(x[3], y[3])
                                for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_ew_refuses_at_make_private_what_it_cannot_differentiate(name):
    case, *_ = _setup(name)
    model = copy.deepcopy(case.model)  # never wrap the cached model other tests share
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _state(model)
    with pytest.raises(ValueError, match=r"(Conv1D|RMSNorm).*grad_sample_mode='bk'"):
        PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=_loader(), noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="ew",
        )
    # refused before anything was modified: no hook, no attribute on a layer or parameter
    assert _same_state(_state(model), before)
    assert not opt.state and opt.param_groups[0]["params"] == list(model.parameters())
    # so the model still trains with another mode
    gsm, dp_opt, _ = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=_loader(), noise_multiplier=0.0,
        max_grad_norm=1.0, grad_sample_mode="bk",
    )
    inputs, labels = case.make_batch(4, 0)
    case.loss_fn(gsm(**inputs), labels, "mean").backward()
    dp_opt.step()
    assert not _same_state(_state(model), before)  # the state check can tell a wrapped model
    gsm.to_standard_module()


def test_ew_refuses_a_layer_called_on_non_batch_inputs():
    case, inputs, labels, c, _ = _setup("mpnet_cls")
    with pytest.raises(ValueError, match="do not come from the batch"):
        dp_update(case, "ew", inputs, labels, c)


class KeywordModel(nn.Module):
    """A model called with keyword inputs only: ``model(tokens=..., mask=...)``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, *, tokens, mask):
        h = self.emb(tokens) * mask.unsqueeze(-1)
        return self.out(h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


def test_ew_keyword_only_model_trains_like_hooks():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 5)), torch.randint(0, 3, (32,)))
    updates = {}
    for mode in ("hooks", "ew"):
        torch.manual_seed(0)
        model = KeywordModel().double()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = PrivacyEngine()
        gsm, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(data, batch_size=8,
                                                    generator=torch.Generator().manual_seed(3)),
            noise_multiplier=0.0, max_grad_norm=0.5, grad_sample_mode=mode,
        )
        steps = 0
        for tokens, y in loader:  # includes whatever Poisson draws, empty ones too
            opt.zero_grad()
            mask = (tokens % 5 != 0).double()
            F.cross_entropy(gsm(tokens=tokens, mask=mask), y).backward()
            opt.step()
            steps += 1
        assert len(engine.accountant) == steps == 4
        updates[mode] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    for n in updates["hooks"]:
        assert torch.allclose(updates["ew"][n], updates["hooks"][n], rtol=1e-9, atol=1e-12), n


def test_ew_empty_keyword_batch():
    model = KeywordModel().double()
    gsm, opt, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ew",
    )
    tokens = torch.zeros(0, 5, dtype=torch.long)
    F.cross_entropy(gsm(tokens=tokens, mask=torch.zeros(0, 5, dtype=torch.float64)),
                    torch.zeros(0, dtype=torch.long), reduction="sum").backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # noise only
