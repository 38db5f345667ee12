"""The per-sample Gram matrices of the ghost norms in float16/bfloat16.

``norm_samplers.gram`` must give the float32 products of the narrow values, finite where a
float16 product would overflow, and the output Gram shared between the layers that read one
gradient is now also shared in bfloat16. Runs on the CPU and, where there is one, on the GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample.norm_samplers import gram

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 4), t1=st.integers(1, 9), t2=st.integers(1, 9), d=st.integers(1, 70),
       scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_gram_is_the_float32_product_of_the_narrow_values(device, dtype, b, t1, t2, d, scale):
    gen = torch.Generator().manual_seed(b * 1000 + t1 * 100 + t2 * 10 + d)
    x = (torch.randn(b, t1, d, generator=gen) * scale).to(dtype).to(device)
    y = (torch.randn(b, t2, d, generator=gen) * scale).to(dtype).to(device)
    out = gram(x, y)
    assert out.dtype == torch.float32 and out.shape == (b, t1, t2)
    ref = torch.bmm(x.double(), y.double().transpose(1, 2))
    # entries of 300² · 70 overflow float16 (65504); float32 accumulation keeps them finite
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=2e-5, atol=1e-6 * scale**2)
    torch.testing.assert_close(gram(x), gram(x, x))


def test_gram_keeps_wide_dtypes():
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    assert gram(x).dtype == torch.float64
    torch.testing.assert_close(gram(x), x @ x.transpose(1, 2))


class TiedSeq(nn.Module):
    """Embedding, a linear layer at 4 positions (ghost Gram norms), a head tied to the embedding
    (the cross term of two factored gradients)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _step(base, mode, device, dtype):
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (8, 4))
    net = copy.deepcopy(base).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0
        out = PrivacyEngine().make_private(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(ids), batch_size=8), noise_multiplier=0.0,
            max_grad_norm=0.05, grad_sample_mode=mode, poisson_sampling=False,
            criterion=nn.CrossEntropyLoss(),
        )
    model, opt = out[0], out[1]
    ids = ids.to(device)
    with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(ids)
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    criterion(logits.float().transpose(1, 2), ids).backward()
    norms = model.per_sample_gradient_norms.float().cpu()
    opt.step()
    delta = torch.cat([(p - q.to(device)).detach().flatten().cpu()
                       for p, q in zip(net.parameters(), base.parameters())])
    return norms, delta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_autocast_gram_norms_match_float32(device, mode):
    """Under bfloat16 autocast, the ghost norms of the tied model (its Grams from narrow
    activations and output gradients) are the float32 norms within the forward's round-off."""
    torch.manual_seed(1)
    base = TiedSeq()
    n32, d32 = _step(base, mode, device, None)
    n16, d16 = _step(base, mode, device, torch.bfloat16)
    assert (n32 > 0.05).all()  # every sample is clipped
    torch.testing.assert_close(n16, n32, rtol=3e-2, atol=0)
    assert (d16 - d32).norm() <= 3e-2 * d32.norm()
