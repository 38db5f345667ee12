"""make_private(multi_pass=...), per-layer clipping, BatchMemoryManager and the DCGAN example."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from mp_helpers import IN_DIM, brute_per_sample_grads, make_disc, run_passes
from torch.utils.data import DataLoader, TensorDataset

from dptorch import GradSampleModule
from dptorch.optimizers import DPPerLayerOptimizer

ROOT = Path(__file__).resolve().parents[2]


def _engine():
    try:
        from dptorch import PrivacyEngine

        return PrivacyEngine(accountant="rdp")
    except (ImportError, AttributeError) as e:  # the accountants are built separately
        pytest.skip(f"PrivacyEngine accountant not available: {e}")


def _loader(n=40, batch_size=8):
    x = torch.randn(n, IN_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x), batch_size=batch_size)


def _accounted_steps(accountant) -> int:
    return sum(h[-1] for h in accountant.history)


def _make_private(engine, **kw):
    model = make_disc()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("max_grad_norm", 1.0)
    return engine.make_private(module=model, optimizer=opt, data_loader=_loader(), **kw)


@pytest.mark.parametrize(
    "kw",
    [{"accum_passes": True}, {"accum_passes": False, "num_private_passes": 2}],
    ids=["basic", "split"],
)
def test_make_private_multi_pass_counts_one_step_per_step(kw):
    engine = _engine()
    gsm, opt, loader = _make_private(engine, multi_pass=True, **kw)
    assert gsm.multi_pass and opt.accum_passes is kw["accum_passes"]
    for i, (x,) in enumerate(loader):
        opt.zero_grad()
        gsm(x).mean().backward()
        gsm(torch.randn_like(x)).mean().backward()  # same size as the real batch
        assert opt.accumulated_iterations == 1
        opt.step()
        assert _accounted_steps(engine.accountant) == i + 1
    assert opt.noise_std == pytest.approx(kw.get("num_private_passes", 1))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"multi_pass": True}, "needs accum_passes"),
        ({"accum_passes": True}, "multi_pass=True as well"),
        ({"accum_passes": False, "num_private_passes": 1}, "multi_pass=True as well"),
        ({"multi_pass": True, "accum_passes": False}, "num_private_passes >= 1"),
        ({"multi_pass": True, "accum_passes": True, "grad_sample_mode": "ew"}, "hooks"),
        ({"multi_pass": True, "accum_passes": True, "clipping": "adaptive"}, "adaptive"),
    ],
)
def test_make_private_rejects_inconsistent_multi_pass_arguments(kw, match):
    engine = _engine()
    model = make_disc()
    with pytest.raises(ValueError, match=match):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=_loader(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            **kw,
        )
    assert not hasattr(model[0].weight, "grad_sample")  # nothing was wrapped


def test_make_private_with_batch_memory_manager():
    from dptorch.utils.batch_memory_manager import BatchMemoryManager

    engine = _engine()
    gsm, opt, loader = _make_private(
        engine, multi_pass=True, accum_passes=False, num_private_passes=1
    )
    n_logical = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as dl:
        for (x,) in dl:
            gsm(x).mean().backward()
            if not opt.skip_requested:  # once per logical batch: in its last physical batch
                with gsm.public_pass():  # fixed size, independent of the data
                    gsm(torch.randn(2, IN_DIM, dtype=torch.float64)).mean().backward()
            opt.step()
            n_logical += not opt._is_last_step_skipped
            opt.zero_grad()
    assert _accounted_steps(engine.accountant) == n_logical == len(loader)


@pytest.mark.parametrize("accum", [True, False], ids=["basic", "split"])
def test_per_layer_clipping_per_layer_pass_sample(accum):
    c = [0.02, 0.3, 0.05, 0.4]
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    kw = {"accum_passes": True} if accum else {"accum_passes": False, "num_private_passes": 2}
    opt = DPPerLayerOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=c,
        expected_batch_size=None,
        loss_reduction="sum",
        **kw,
    )
    gen = torch.Generator().manual_seed(3)
    passes = [(2 * torch.randn(4, IN_DIM, generator=gen, dtype=torch.float64), s) for s in (1, -1)]
    run_passes(gsm, passes)
    opt.clip_and_accumulate()
    per_pass = [brute_per_sample_grads(make_disc(), x, s) for x, s in passes]
    for i, p in enumerate(model.parameters()):
        units = torch.stack([g[i] for g in per_pass])  # (P, B, ...)
        if accum:
            units = units.sum(0, keepdim=True)
        norms = units.flatten(2).norm(dim=2)
        f = (c[i] / (norms + 1e-6)).clamp(max=1.0)
        ref = (units * f.view(*f.shape, *([1] * (units.dim() - 2)))).sum((0, 1))
        torch.testing.assert_close(p.summed_grad, ref, rtol=1e-9, atol=1e-12)
    assert opt.noise_scale_factor == (1 if accum else 2)


def _load_example():
    spec = importlib.util.spec_from_file_location("dcgan_example", ROOT / "examples" / "dcgan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("clipping", ["basic", "split"])
def test_dcgan_example_smoke(clipping, tmp_path, caplog):
    _engine()
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    dcgan = _load_example()
    out = tmp_path / "samples.png"
    with caplog.at_level("INFO", logger="dcgan"):
        eps = dcgan.main(["--clipping", clipping, "--steps", "3", "--out", str(out)])
    assert 0 < eps < math.inf
    assert "epsilon" in caplog.text
    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50
