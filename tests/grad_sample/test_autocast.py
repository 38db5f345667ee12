"""Mixed precision: per-sample gradients and clipping under ``torch.autocast`` (Opacus #764).

The layers see bf16/fp16 inputs and output gradients while the parameters stay float32; every
mode computes per-sample gradients, norms and clipped sums in float32 (the low-precision values
upcast), so the released update is the float32 one within the forward pass's round-off, and it
has the parameters' dtype. ew cannot, and says so.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8 * 6, 4)

    def forward(self, ids):
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.relu(self.ln(h)).flatten(1))


def _update(base: nn.Module, mode: str, dtype: torch.dtype | None, bound: float):
    """One DP step (σ = 0, whole batch): parameter change, per-sample norms, ``p.grad`` dtypes."""
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (32, 6))
    y = torch.randint(0, 4, (32,))
    net = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0
        out = PrivacyEngine().make_private(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(ids, y), batch_size=32), noise_multiplier=0.0,
            max_grad_norm=bound, grad_sample_mode=mode, poisson_sampling=False,
        )
    model, opt = out[0], out[1]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(ids)
        if mode == "ghost":
            out[2](logits.float(), y).backward()
        else:
            nn.functional.cross_entropy(logits.float(), y).backward()
    if mode in ("hooks", "functorch"):
        norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in model.parameters()]).norm(dim=0)
    else:
        norms = model.per_sample_gradient_norms
    opt.step()
    delta = torch.cat([(p - q).detach().flatten() for p, q in zip(net.parameters(), base.parameters())])
    return delta, norms, {p.grad.dtype for p in net.parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_autocast_matches_float32(mode, dtype):
    torch.manual_seed(1)
    base = Net()
    want, want_norms, _ = _update(base, mode, None, bound=0.05)
    got, got_norms, grad_dtypes = _update(base, mode, dtype, bound=0.05)
    assert grad_dtypes == {torch.float32}
    assert got_norms.dtype == torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3  # the forward's round-off (8 or 11 bits)
    torch.testing.assert_close(got_norms, want_norms, rtol=tol, atol=0)
    assert float((got - want).norm() / want.norm()) < tol
    # every sample was clipped (norms >> 0.05): the update is a sum of unit-norm directions
    assert bool((got_norms > 0.05).all())


def test_ew_refuses_autocast():
    with pytest.raises(NotImplementedError, match="autocast"):
        _update(Net(), "ew", torch.bfloat16, bound=1.0)
