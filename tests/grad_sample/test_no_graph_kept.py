"""A finished DP step keeps none of its autograd graph alive.

The per-sample hooks must not hold the forward's tensors past the step: a graph kept alive
leaks the tensors it references at every step (a language model's logits: 50 MB per step at
batch 2 of a tiny GPT-2), and it keeps the parameters' ``AccumulateGrad`` nodes from the first
step, on whatever CUDA stream created them, which breaks CUDA-graph capture on another stream.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.layers import DPGRU, DPLSTM, DPMultiheadAttention

MODES = ["hooks", "functorch", "ghost", "bk"]


class Seq(nn.Module):
    """Linear layers on ``(B, T, d)`` (their output is a view of a 2-d product), an in-place
    activation on that view, a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.act(self.fc(self.emb(ids))))


class Recurrent(nn.Module):
    """DPLSTM (its recurrence is one custom autograd Function) and DPGRU, bidirectional."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.lstm = DPLSTM(8, 8, batch_first=True, bidirectional=True)
        self.gru = DPGRU(16, 8, batch_first=True)
        self.head = nn.Linear(8, 30)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.head(self.gru(h)[0])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.attn = DPMultiheadAttention(8, 2, batch_first=True)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 30)

    def forward(self, ids):
        h = self.emb(ids)
        h = self.attn(h, h, h)[0]
        return self.head(self.conv(h.transpose(1, 2)).transpose(1, 2))


def _graph_tensors() -> list[torch.Tensor]:
    """Every live tensor with a ``grad_fn`` (a graph's output kept alive)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch.distributed objects
        out = []
        for t in gc.get_objects():
            if not isinstance(t, torch.Tensor):
                continue
            try:
                if t.grad_fn is not None:
                    out.append(t)
            except RuntimeError:  # an ExpandedWeight left by another test has no grad_fn
                continue
        return out


def _marked(params) -> int:
    return sum("dptorch_test" in get_gradient_edge(p).node.metadata for p in params)


@pytest.mark.parametrize("model_cls", [Seq, Recurrent, Attention])
@pytest.mark.parametrize("mode", MODES)
def test_step_leaves_no_graph_alive(mode, model_cls):
    torch.manual_seed(0)
    ids = torch.randint(0, 30, (6, 5))
    net = model_cls()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(ids), batch_size=6), noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=False,
            criterion=nn.CrossEntropyLoss(),
        )
    model, opt = out[0], out[1]
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    before = {id(t) for t in _graph_tensors()}  # other tests' tensors, still referenced there
    outputs = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        logits = model(ids)
        outputs.append(torch.utils.weak.WeakIdRef(logits))
        crit(logits.transpose(1, 2), ids).backward()
        opt.step()
        for p in params:  # mark the accumulators this step's graph used
            get_gradient_edge(p).node.metadata["dptorch_test"] = True
        del logits
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(ref() is None for ref in outputs), "a step's output is still alive"
    assert _marked(params) == 0, "a step's graph (its AccumulateGrad nodes) is still alive"
    alive = [t for t in _graph_tensors() if id(t) not in before]
    assert not alive, [tuple(t.shape) for t in alive]


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
@pytest.mark.parametrize("build", ["gpt2", "t5"])
def test_hugging_face_step_leaves_no_graph_alive(mode, build):
    """A tiny GPT-2 (tied LM head) and T5 with their default forward: the logits and every
    layer's output are freed after the step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "privacy"))
    import hf_models

    case = getattr(hf_models, build)()
    inputs, labels = case.make_batch(4, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = PrivacyEngine().make_private(
            module=case.model, optimizer=torch.optim.SGD(case.model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(labels), batch_size=4), noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=False,
        )
    before = {id(t) for t in _graph_tensors()}
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        case.loss_fn(model(**inputs), labels, reduction="mean").backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    alive = [t for t in _graph_tensors() if id(t) not in before]
    assert not alive, [tuple(t.shape) for t in alive]
