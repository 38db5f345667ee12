"""Seventh review round, data loading: an empty Poisson batch must carry no record."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

from dptorch.data_loader import DPDataLoader


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


class _Opaque:
    def __init__(self, x, y):
        self.x, self.y = x, y


def _collate(cls):
    return lambda samples: cls(torch.stack([s[0] for s in samples]),
                               torch.stack([s[1] for s in samples]))


def _dataset():
    return TensorDataset(torch.arange(40.0).reshape(10, 4), torch.arange(10))


def test_an_empty_poisson_batch_of_a_dataclass_has_no_records():
    """*Finding*: for a collate function returning a type the empty-batch builder did not know,
    the template batch itself (a real batch: ``dataset[0]``) was returned for every empty draw,
    so records that were not drawn were trained on. A dataclass is now emptied field by field."""
    loader = DPDataLoader(_dataset(), sample_rate=0.1, collate_fn=_collate(_Batch),
                          generator=torch.Generator().manual_seed(3))
    sizes = []
    for b in loader:
        assert isinstance(b, _Batch)
        assert b.x.shape[1:] == (4,) and b.x.shape[0] == b.y.shape[0]
        sizes.append(b.x.shape[0])
    assert 0 in sizes  # this seed draws empty batches


def test_an_empty_poisson_batch_of_an_unknown_type_is_refused():
    loader = DPDataLoader(_dataset(), sample_rate=0.05, collate_fn=_collate(_Opaque),
                          generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="Cannot build an empty batch of type _Opaque"):
        for b in loader:
            assert b.x.shape[0] > 0  # never a replayed record set in place of an empty draw


@pytest.mark.parametrize("n,batch,physical", [(256, 8, 4), (250, 8, 3), (30, 7, 7), (31, 10, 4)])
def test_batch_memory_manager_length_with_fixed_size_batches(n, batch, physical):
    """*Finding*: ``len()`` of BatchMemoryManager's loader counted logical batches (32 for 64
    physical ones) with ``poisson_sampling=False``; it now counts what it yields."""
    from torch.utils.data import DataLoader

    from dptorch import PrivacyEngine
    from dptorch.utils.batch_memory_manager import BatchMemoryManager

    ds = TensorDataset(torch.randn(n, 5), torch.randn(n))
    m = torch.nn.Linear(5, 1)
    with pytest.warns(UserWarning):
        m, opt, dl = PrivacyEngine().make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=batch), noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False,
        )
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=physical, optimizer=opt) as pl:
        count = 0
        for x, y in pl:
            (m(x).squeeze(1) - y).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            count += 1
        assert len(pl) == count
