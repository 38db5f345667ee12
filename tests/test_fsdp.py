"""FSDP2 (``fully_shard``) with ``grad_sample_mode="ghost_fsdp"`` and ``"bk_fsdp"``, over two
gloo processes on CPU.

One spawn of two ranks runs every scenario (``_worker``) and rank 0 saves what it saw; the tests
below check it against single-process runs done here:

* exactness: 2 ranks x 4 samples, noise 0, float64: the released gradient (gathered from the
  shards) equals the non-FSDP ``ghost`` / ``bk`` step on the concatenated batch of 8, for an
  MLP (root-only unit, uneven shards) and an Embedding + LayerNorm + Linear model (one unit per
  layer);
* noise: with sigma > 0 and *different* generator seeds on the two ranks, the released
  gradient equals the single-process step whose generator has rank 0's seed (noise drawn once,
  by rank 0, and each coordinate gets its draw once), and the noise part has std sigma*C/8;
* refusals: the non-FSDP modes, per-layer clipping, unsharded parameters and a model without
  fully_shard are refused with messages naming the fix;
* the FSDP-generated layer classes find their layer rules; a user subclass does not;
* ``make_private(grad_sample_mode="ghost_fsdp")`` builds the FSDP optimizer and steps.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dptorch.grad_sample import GradSampleModuleBookKeeping, GradSampleModuleFastGradientClipping
from dptorch.grad_sample.fast_clipping_loss import DPLossFastGradientClipping
from dptorch.optimizers import DPOptimizerFastGradientClipping

WORLD = 2
B_LOCAL = 4
B = WORLD * B_LOCAL
C = 0.7
SIGMA = 1.3
SEED_RANK0 = 7
SEED_RANK1 = 99
STEPS = 2  # the released gradient of the last step is compared (the noise of the last draw)

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is needed for the FSDP tests",
)


# ----------------------------------------------------------------------------- models and data
class TokenModel(nn.Module):
    """Embedding + LayerNorm + Linear, mean-pooled over the sequence: ``(B, T)`` ids -> ``(B, 5)``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 6)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        h = torch.relu(self.proj(self.norm(self.emb(x))))
        return self.head(h.mean(1))


class MyLinear(nn.Linear):
    """A user subclass with its own forward: it must not get nn.Linear's rule silently."""

    def forward(self, x):
        return super().forward(x) * 2


class Outside(nn.Module):
    """Uses ``head.weight`` outside ``head``'s call: that gradient would escape clipping."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.head(h) + nn.functional.linear(h, self.head.weight)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    return TokenModel().double()


def make_data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        x = torch.randn(B, 6, generator=g, dtype=torch.float64) * 3
        y = torch.randint(0, 3, (B,), generator=g)
    else:
        x = torch.randint(0, 20, (B, 4), generator=g)
        y = torch.randint(0, 5, (B,), generator=g)
    return x, y


def shard(model: nn.Module, kind: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    if kind == "tok":  # one unit per layer, then the root
        for layer in (model.emb, model.norm, model.proj, model.head):
            fully_shard(layer)
    fully_shard(model)  # mlp: the root unit only (uneven shards: 3 rows over 2 ranks)
    return model


GSM = {"ghost": GradSampleModuleFastGradientClipping, "bk": GradSampleModuleBookKeeping}


def dp_step(gsm, optimizer, x, y) -> None:
    """One DP step through the fast-clipping loss wrapper."""
    crit = DPLossFastGradientClipping(gsm, optimizer, nn.CrossEntropyLoss(), "mean")
    optimizer.zero_grad()
    loss = crit(gsm(x), y)
    loss.backward()
    optimizer.step()


def single_process_grads(kind: str, mode: str, sigma: float, seed: int) -> dict:
    """The released gradients of the last of ``STEPS`` single-process steps (lr 0) on the whole
    batch of ``B``."""
    model = make_model(kind)
    x, y = make_data(kind)
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=B,
        generator=torch.Generator().manual_seed(seed),
    )
    gsm = GSM[mode](model, clipping=opt.clipping)
    for _ in range(STEPS):
        dp_step(gsm, opt, x, y)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- the two ranks
def _fsdp_step(rank: int, kind: str, mode: str, sigma: float) -> dict:
    from dptorch.grad_sample import (
        GradSampleModuleBookKeepingFSDP,
        GradSampleModuleFastGradientClippingFSDP,
    )
    from dptorch.optimizers import FSDPOptimizerFastGradientClipping

    model = shard(make_model(kind), kind)
    x, y = make_data(kind)
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    opt = FSDPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=B_LOCAL,  # per rank, as make_private passes it
        generator=torch.Generator().manual_seed(SEED_RANK0 if rank == 0 else SEED_RANK1),
    )
    cls = {"ghost": GradSampleModuleFastGradientClippingFSDP, "bk": GradSampleModuleBookKeepingFSDP}
    gsm = cls[mode](model, clipping=opt.clipping)
    for _ in range(STEPS):  # (lr=0) later steps check that the state is reset between steps
        dp_step(gsm, opt, x[rows], y[rows])
    return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _refusals(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from dptorch.grad_sample import (
        GradSampleModuleBookKeepingFSDP,
        GradSampleModuleFastGradientClippingFSDP,
    )
    from dptorch.grad_sample.registry import rule_for
    from dptorch.modes import get_mode

    out: dict = {}
    settings = dict(distributed=True, multi_pass=False, batch_first=True, loss_reduction="mean")

    def message(fn) -> str:
        try:
            fn()
        except (ValueError, NotImplementedError) as e:
            return str(e)
        return "<no error>"

    model = shard(make_model("mlp"), "mlp")
    for mode in ("hooks", "ghost", "bk"):
        out[f"mode_{mode}"] = message(
            lambda mode=mode: get_mode(mode).check(model, clipping="flat", **settings)
        )
    out["direct_bk"] = message(lambda: GradSampleModuleBookKeeping(model))
    out["per_layer"] = message(
        lambda: get_mode("bk_fsdp").check(model, clipping="per_layer", **settings)
    )
    out["per_layer_gsm"] = message(
        lambda: GradSampleModuleBookKeepingFSDP(model, max_grad_norm=[1.0] * 4)
    )
    out["not_fsdp"] = message(
        lambda: get_mode("ghost_fsdp").check(make_model("mlp"), clipping="flat", **settings)
    )
    partly = make_model("tok")
    fully_shard(partly.proj)  # the other layers keep plain, replicated parameters
    out["unsharded"] = message(
        lambda: get_mode("bk_fsdp").check(partly, clipping="flat", **settings)
    )
    outside = shard(Outside().double(), "mlp")
    gsm = GradSampleModuleFastGradientClippingFSDP(outside)
    out["outside_use"] = message(lambda: gsm(torch.ones(2, 4, dtype=torch.float64)))
    user = nn.Sequential(MyLinear(3, 4), nn.Linear(4, 2)).double()
    fully_shard(user[0])
    fully_shard(user[1])
    out["class_names"] = [type(m).__name__ for m in user]
    out["rule_fsdp_linear"] = rule_for(user[1]) is rule_for(nn.Linear(1, 1))
    out["rule_fsdp_user_subclass"] = rule_for(user[0])
    return out


def _make_private(rank: int) -> dict:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from dptorch import PrivacyEngine

    model = shard(make_model("mlp"), "mlp")
    x, y = make_data("mlp")
    # poisson_sampling=False in distributed training: each rank a disjoint shard (the release
    # sums the ranks' batches; the same records on both ranks would count twice)
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=B_LOCAL,
                        sampler=DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=False))
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, crit, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=C,
        grad_sample_mode="ghost_fsdp",
        criterion=nn.CrossEntropyLoss(),
        poisson_sampling=False,
    )
    before = [p.full_tensor().clone() for p in model.parameters()]
    for xb, yb in dl:
        opt.zero_grad()
        crit(gsm(xb), yb).backward()
        opt.step()
    after = [p.full_tensor() for p in model.parameters()]
    return {
        "gsm": type(gsm).__name__,
        "optimizer": type(opt).__name__,
        "expected_batch_size": opt.expected_batch_size,
        "moved": all(not torch.equal(a, b) for a, b in zip(before, after)),
        "epsilon": engine.get_epsilon(1e-5),
    }


def _worker(rank: int, port: int, path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict = {}
    cases = {
        f"{kind}_{mode}_{tag}": (lambda kind=kind, mode=mode, s=s: _fsdp_step(rank, kind, mode, s))
        for kind in ("mlp", "tok")
        for mode in ("ghost", "bk")
        for tag, s in (("exact", 0.0), ("noise", SIGMA))
    }
    cases["refusals"] = lambda: _refusals(rank)
    cases["make_private"] = lambda: _make_private(rank)
    try:
        for key, fn in cases.items():
            try:
                results[key] = fn()
            except Exception:  # reported by the test of that case
                results[f"{key}_error"] = traceback.format_exc()
            dist.barrier()
    finally:
        if rank == 0:
            torch.save(results, path)
    dist.barrier()
    # leave without C++ destructors: gloo's teardown has aborted ("terminate called without an
    # active exception") on a loaded 2-core machine after the results were saved
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("fsdp") / "results.pt")
    mp.spawn(_worker, args=(_free_port(), path), nprocs=WORLD, join=True)
    return torch.load(path, weights_only=False)


def _get(results: dict, key: str):
    if f"{key}_error" in results:
        pytest.fail(f"FSDP case {key} failed on rank 0:\n{results[key + '_error']}")
    return results[key]


# ----------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("kind", ["mlp", "tok"])
@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_fsdp_step_equals_single_process_step(fsdp_results, kind, mode):
    got = _get(fsdp_results, f"{kind}_{mode}_exact")
    ref = single_process_grads(kind, mode, 0.0, SEED_RANK0)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
    # clipping was active: the unclipped gradient differs
    assert any(ref[n].abs().sum() > 0 for n in ref)


@pytest.mark.parametrize("kind", ["mlp", "tok"])
@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_fsdp_noise_is_drawn_once_per_coordinate(fsdp_results, kind, mode):
    got = _get(fsdp_results, f"{kind}_{mode}_noise")
    clean = _get(fsdp_results, f"{kind}_{mode}_exact")
    # the single-process step with rank 0's generator: rank 1's generator is never used, and
    # every coordinate, whichever rank holds it, gets exactly its one draw
    ref = single_process_grads(kind, mode, SIGMA, SEED_RANK0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
    noise = torch.cat([(got[n] - clean[n]).flatten() for n in got])
    expected_std = SIGMA * C / B
    assert noise.numel() > 100
    assert abs(noise.std().item() / expected_std - 1) < 0.2, (noise.std(), expected_std)


def test_other_modes_refuse_fsdp_models(fsdp_results):
    r = _get(fsdp_results, "refusals")
    assert "sharded by FSDP2" in r["mode_hooks"] and "'bk_fsdp'" in r["mode_hooks"]
    assert "grad_sample_mode='ghost_fsdp'" in r["mode_ghost"]
    assert "grad_sample_mode='bk_fsdp'" in r["mode_bk"]
    assert "grad_sample_mode='bk_fsdp'" in r["direct_bk"]


def test_fsdp_modes_refuse_what_they_cannot_do(fsdp_results):
    r = _get(fsdp_results, "refusals")
    assert "clipping='per_layer' is not supported" in r["per_layer"]
    assert "Fix: clipping='flat'" in r["per_layer"]
    assert "Per-layer clipping" in r["per_layer_gsm"] and "bk_fsdp" in r["per_layer_gsm"]
    assert "fully_shard" in r["not_fsdp"] and "grad_sample_mode='ghost'" in r["not_fsdp"]
    assert r["unsharded"].startswith("Parameter emb.weight: it is a plain tensor")
    assert "call fully_shard on the root module" in r["unsharded"]


def test_fsdp_parameter_used_outside_its_layer_is_refused(fsdp_results):
    """The use trace sees FSDP's unsharded parameters: a use outside the owning layer's call is
    caught at the first forward pass (ghost would release that gradient unclipped)."""
    r = _get(fsdp_results, "refusals")
    assert "head.weight" in r["outside_use"], r["outside_use"]


def test_fsdp_generated_classes_find_their_rule(fsdp_results):
    r = _get(fsdp_results, "refusals")
    assert r["class_names"] == ["FSDPMyLinear", "FSDPLinear"]
    assert r["rule_fsdp_linear"] is True
    assert r["rule_fsdp_user_subclass"] is None


def test_make_private_ghost_fsdp(fsdp_results):
    r = _get(fsdp_results, "make_private")
    assert r["gsm"] == "GradSampleModuleFastGradientClippingFSDP"
    assert r["optimizer"] == "FSDPOptimizerFastGradientClipping"
    assert r["expected_batch_size"] == B / WORLD
    assert r["moved"]
    assert r["epsilon"] > 0


def test_single_process_reference_is_deterministic():
    """The reference itself: same seed, same step (guards the noise comparison)."""
    a = single_process_grads("mlp", "bk", SIGMA, SEED_RANK0)
    b = single_process_grads("mlp", "bk", SIGMA, SEED_RANK0)
    c = single_process_grads("mlp", "bk", SIGMA, SEED_RANK1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)



