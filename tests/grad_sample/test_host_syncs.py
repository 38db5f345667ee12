"""dptorch adds no host synchronisation to a DP step (what CUDA-graph capture needs).

A CUDA graph cannot capture an op whose output shape or control flow depends on a tensor's
value (``torch.unique``, ``nonzero``, boolean indexing, ``.item()``): the host must wait for the
GPU. Such ops are found here on the CPU, by their ATen names, while a whole DP step (forward,
backward, ``optimizer.step()``) runs; only those called from dptorch's own code count (Hugging
Face's mask helpers have their own, and skip them under capture).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dptorch.grad_sample import wrap_model
from dptorch.grad_sample.embedding import _pair_groups
from dptorch.grad_sample.fast_clipping_loss import DPLossFastGradientClipping
from dptorch.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy"))
import hf_models  # noqa: E402

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive",
             "masked_select", "equal", "is_nonzero", "masked_scatter"}
_DPTORCH = str(Path(__file__).parents[2] / "dptorch")
_TRACE = f"{_DPTORCH}/grad_sample/use_trace.py"  # passes the model's own torch calls through
_TORCH = f"{Path(torch.__file__).parent}/"


#: dptorch's checks that read a value on the host outside a CUDA graph capture and take a
#: sync-free path under capture (as Hugging Face's mask helpers): the torch.func recompute's
#: comparison with the forward (a mismatching sample's gradient is made NaN under capture)
_SKIPPED_UNDER_CAPTURE = {(f"{_DPTORCH}/grad_sample/recompute_state.py", "check_recompute")}


class HostSyncs(TorchDispatchMode):
    """Records ``(op, dptorch frame)`` of every value-dependent op called from dptorch."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sync = name in _SYNC_OPS
        if name == "index":
            sync = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or [])
        if name == "repeat_interleave":
            sync = isinstance(args[0], torch.Tensor) and len(args) > 1 and isinstance(
                args[1], torch.Tensor) and "output_size" not in kwargs
        if sync:  # whose op: the innermost frame of dptorch or the model's own code
            frames = [f for f in traceback.extract_stack()
                      if f.filename != _TRACE and not f.filename.startswith(_TORCH)]
            frame = frames[-2] if len(frames) > 1 else None  # [-1]: this method
            if frame is not None and frame.filename.startswith(_DPTORCH) and (
                frame.filename, frame.name) not in _SKIPPED_UNDER_CAPTURE:
                self.found.append((name, f"{frame.filename}:{frame.lineno}"))
        return func(*args, **kwargs)


class _TextModel(nn.Module):
    """Embedding with a padding row, LayerNorm, a Linear used at every position, a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.ln(self.emb(ids)))).mean(1))


def _cases():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (4,), generator=g)
    ce = nn.CrossEntropyLoss()
    ids = torch.randint(0, 11, (4, 5), generator=g)
    ids[0, :2] = 0  # padding lookups
    return {
        "mlp": (lambda: nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)),
                (torch.randn(4, 8, generator=g),), y, ce),
        "conv": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(),
                                       nn.Linear(4 * 4 * 4, 3)),
                 (torch.randn(4, 2, 6, 6, generator=g),), y, ce),
        "text": (_TextModel, (ids,), y, ce),
    }


def _step(model, mode, inputs, target, criterion, layout_steps=2):
    """``layout_steps`` DP steps of ``model`` in ``mode`` under :class:`HostSyncs`."""
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    if mode in ("bk", "ghost"):
        gsm = wrap_model(model, mode, max_grad_norm=1.0)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.1), **kw)
        gsm.bind_clipping(opt.clipping)
    else:
        gsm = wrap_model(model, mode)
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), **kw)
    if mode == "ghost":
        wrapper = DPLossFastGradientClipping(gsm, opt, criterion)
        loss_of = lambda out: wrapper(out, target)  # noqa: E731
    else:
        loss_of = lambda out: criterion(out, target)  # noqa: E731
    watch = HostSyncs()
    for _ in range(layout_steps):
        opt.zero_grad(set_to_none=True)
        with watch:
            out = gsm(*inputs) if not isinstance(inputs, dict) else gsm(**inputs)
            loss_of(out).backward()
            opt.step()
    return watch.found


@pytest.mark.parametrize("mode", ["bk", "ghost", "hooks", "functorch"])
@pytest.mark.parametrize("case", ["mlp", "conv", "text"])
def test_dp_step_has_no_host_sync(case, mode):
    build, inputs, target, criterion = _cases()[case]
    torch.manual_seed(0)
    assert _step(build(), mode, inputs, target, criterion) == []


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("name", ["gpt2", "gpt2_padded", "bert_cls_padded"])
def test_hugging_face_step_has_no_host_sync(name, mode):
    """The default forward, ``[1, T]`` position ids, tied embeddings, padding masks."""
    case = hf_models.build(name)
    inputs, labels = case.make_batch(4, 0)

    class Loss(nn.Module):
        reduction = "mean"

        def forward(self, out, target):
            return case.loss_fn(out, target, self.reduction)

    assert _step(case.model, mode, inputs, labels, Loss()) == []


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 12), max_size=30))
def test_pair_groups_matches_unique(keys):
    """Groups in sorted key order, their sizes, 0 past the last group: ``torch.unique``'s
    answer with shapes fixed by the number of keys."""
    t = torch.tensor(keys, dtype=torch.long)
    group, counts = _pair_groups(t)
    uniq, inverse, ucounts = torch.unique(t, return_inverse=True, return_counts=True)
    assert group.shape == counts.shape == t.shape
    assert torch.equal(group, inverse)
    assert torch.equal(counts[: uniq.numel()], ucounts)
    assert not counts[uniq.numel():].any()
