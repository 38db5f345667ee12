"""Privacy property: for neighbouring real batches (one record added), the L2 distance between
the two pre-noise sums never exceeds the sensitivity the noise is calibrated to
(``noise_std / noise_multiplier``), in every configuration docs/multi_pass.md calls sound.

Generated samples are drawn independently of the data. Where their number is tied to the real
batch size, the two worlds are coupled as in the proof: the neighbour's generated batch is the
same one with one extra sample inserted at the same index as the extra real record.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mp_helpers import IN_DIM, make_disc, make_optimizer

from dptorch import GradSampleModule


def pre_noise_sum(passes, accum: bool, k: int | None, c: float):
    """The clipped sum the library would noise, and the sensitivity the noise assumes."""
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    kw = {"accum_passes": True} if accum else {"accum_passes": False, "num_private_passes": k}
    opt = make_optimizer(gsm, max_grad_norm=c, noise_multiplier=1.0, **kw)
    for x, s, public in passes:
        with gsm.public_pass() if public else contextlib.nullcontext():
            (s * gsm(x).sum()).backward()
    opt.clip_and_accumulate()
    flat = torch.cat(
        [
            (torch.zeros_like(p) if p.summed_grad is None else p.summed_grad).flatten()
            for p in model.parameters()
        ]
    )
    return flat, opt.noise_std / opt.noise_multiplier


def _insert(t: torch.Tensor, row: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([t[:k], row[None], t[k:]])


def build_passes(config: str, real, fake, fake_fixed):
    """Passes ``(inputs, sign, public)`` of one discriminator step; returns (passes, accum, k)."""
    if config == "accum_real_fake":  # fake batch: as many samples as real ones, paired by index
        return [(real, 1.0, False), (fake, -1.0, False)], True, None
    if config == "accum_real_fake_interp":  # + a penalty-like pass on per-index mixtures
        mix = 0.3 * real + 0.7 * fake
        return [(real, 1.0, False), (fake, -1.0, False), (mix, 0.5, False)], True, None
    if config == "split_fixed_fake_k1":  # the fake batch size does not depend on the data
        return [(real, 1.0, False), (fake_fixed, -1.0, True)], False, 1
    if config == "split_tied_fake_k2":  # fake batch tied to |real|: it counts as private
        return [(real, 1.0, False), (fake, -1.0, False)], False, 2
    if config == "split_real_twice_k2":  # two private passes over the same real batch
        return [(real, 1.0, False), (-real, 0.5, False), (fake_fixed, -1.0, True)], False, 2
    raise AssertionError(config)


CONFIGS = [
    "accum_real_fake",
    "accum_real_fake_interp",
    "split_fixed_fake_k1",
    "split_tied_fake_k2",
    "split_real_twice_k2",
]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    config=st.sampled_from(CONFIGS),
    m=st.integers(0, 5),
    pos=st.integers(0, 100),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.1, 1.0, 20.0]),
    c=st.sampled_from([0.01, 0.5, 10.0]),
)
def test_neighbouring_batches_within_sensitivity(config, m, pos, seed, scale, c):
    gen = torch.Generator().manual_seed(seed)

    def draw(n):
        return scale * torch.randn(n, IN_DIM, generator=gen, dtype=torch.float64)

    real, fake, fake_fixed = draw(m), draw(m), draw(3)
    x_star, z_star = draw(1)[0], draw(1)[0]
    k = pos % (m + 1)
    real2, fake2 = _insert(real, x_star, k), _insert(fake, z_star, k)
    s1, sens1 = pre_noise_sum(*build_passes(config, real, fake, fake_fixed), c)
    s2, sens2 = pre_noise_sum(*build_passes(config, real2, fake2, fake_fixed), c)
    assert sens1 == sens2
    assert torch.linalg.vector_norm(s2 - s1) <= sens1 * (1 + 1e-9)


def test_unsound_configuration_is_caught_by_the_property():
    """Sanity check that the property can fail: a generated pass whose size follows the real
    batch, declared public (num_private_passes=1), adds a second clipped unit: distance 2C."""
    c = 1e-3
    x_star = torch.full((IN_DIM,), 2.0, dtype=torch.float64)
    real = torch.randn(3, IN_DIM, dtype=torch.float64)
    fake = torch.randn(3, IN_DIM, dtype=torch.float64)
    passes1 = [(real, 1.0, False), (fake, 1.0, True)]
    passes2 = [(_insert(real, x_star, 1), 1.0, False), (_insert(fake, x_star, 1), 1.0, True)]
    s1, sens = pre_noise_sum(passes1, False, 1, c)
    s2, _ = pre_noise_sum(passes2, False, 1, c)
    assert torch.linalg.vector_norm(s2 - s1).item() == pytest.approx(2 * c, rel=1e-4)
    assert torch.linalg.vector_norm(s2 - s1) > sens
