"""Code run inside the spawned gloo processes (and the single-process references).

Everything distributed runs in ONE spawned run (spawning costs seconds): :func:`all_checks`
calls each ``*_checks`` function and returns their results by name; the tests in this folder
compare them with single-process references.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dptorch import GradSampleModule
from dptorch.distributed import DPDDP, disable_gradient_sync, is_distributed_module
from dptorch.optimizers import DPOptimizer
from dptorch.optimizers.ddpoptimizer import DistributedDPOptimizer
from dptorch.utils.uniform_sampler import DistributedUniformWithReplacementSampler

B = 8  # global batch size
C = 0.3  # clipping norm (small enough that most samples are clipped)
SIGMA = 1.3
NOISE_STEPS = 40


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(B, 5, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (B,), generator=g)
    return x, y


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def step_grads(model, opt, x, y, reduction="mean") -> list[torch.Tensor]:
    """One DP step at learning rate 0 (the model does not move); returns the released grads."""
    opt.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    opt.step()
    return [p.grad.detach().clone() for p in model.parameters()]


def make_dp_optimizer(model, cls=DPOptimizer, *, sigma=0.0, ebs=B, reduction="mean", **kw):
    return cls(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=ebs,
        loss_reduction=reduction,
        **kw,
    )


def optimizer_checks(rank: int, world_size: int) -> dict:
    x, y = make_data()
    per_rank = B // world_size
    xl, yl = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    out: dict = {}

    # clipped sums, "mean" and "sum", DPDDP-wrapped model (ranks start from different weights)
    model = GradSampleModule(DPDDP(make_model(seed=rank)))
    assert is_distributed_module(model)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    opt = make_dp_optimizer(model, DistributedDPOptimizer, ebs=per_rank)
    out["mean"] = step_grads(model, opt, xl, yl)
    model_sum = GradSampleModule(DPDDP(make_model(seed=rank)), loss_reduction="sum")
    opt_sum = make_dp_optimizer(model_sum, DistributedDPOptimizer, reduction="sum", ebs=None)
    out["sum"] = step_grads(model_sum, opt_sum, xl, yl, "sum")

    # noise: identically seeded generators on both ranks must still give one draw for the world
    opt = make_dp_optimizer(
        model,
        DistributedDPOptimizer,
        sigma=SIGMA,
        ebs=per_rank,
        generator=torch.Generator().manual_seed(7),
    )
    out["noisy"] = torch.stack(
        [torch.cat([g.flatten() for g in step_grads(model, opt, xl, yl)]) for _ in range(NOISE_STEPS)]
    )

    # an empty local batch on rank 1 (forward and backward on zero samples)
    opt = make_dp_optimizer(model, DistributedDPOptimizer, ebs=per_rank)
    if rank == 1:
        out["empty"] = step_grads(model, opt, xl[:0], yl[:0])
    else:
        out["empty"] = step_grads(model, opt, xl, yl)

    # skipped steps: rank 0 uses 2 physical batches, rank 1 one (no collective on skipped steps)
    model, opt = model_sum, opt_sum
    opt.zero_grad()
    if rank == 0:
        half = per_rank // 2
        F.cross_entropy(model(xl[:half]), yl[:half], reduction="sum").backward()
        opt.signal_skip_step(True)
        opt.step()
        opt.zero_grad()
        F.cross_entropy(model(xl[half:]), yl[half:], reduction="sum").backward()
    else:
        F.cross_entropy(model(xl), yl, reduction="sum").backward()
    opt.step()
    out["skip"] = [p.grad.detach().clone() for p in model.parameters()]

    # torch DDP: its backward all-reduce is switched off; the DP optimizer does the reduction
    ddp = DDP(make_model(seed=0))
    disable_gradient_sync(ddp)
    ddp_model = GradSampleModule(ddp)
    local = copy.deepcopy(make_model(seed=0))
    F.cross_entropy(local(xl), yl).backward()
    F.cross_entropy(ddp_model(xl), yl).backward()
    out["ddp_local_grad_kept"] = all(
        torch.allclose(p.grad, q.grad) for p, q in zip(ddp_model.parameters(), local.parameters())
    )
    opt = make_dp_optimizer(ddp_model, DistributedDPOptimizer, ebs=per_rank)
    out["ddp"] = step_grads(ddp_model, opt, xl, yl)

    # the sampler, with the default (torch.distributed) rank and the same global seed everywhere
    torch.manual_seed(0)
    sampler = DistributedUniformWithReplacementSampler(total_size=21, sample_rate=0.5, steps=30)
    out["shard"] = sampler.shard().tolist()
    out["batches"] = list(sampler)
    out["world"] = (dist.get_rank(), dist.get_world_size())
    return out


def reference(reduction="mean", x=None, y=None) -> list[torch.Tensor]:
    """Single-process DPOptimizer on the whole batch (or on ``x, y``)."""
    if x is None:
        x, y = make_data()
    model = GradSampleModule(make_model(seed=0), loss_reduction=reduction)
    opt = make_dp_optimizer(model, reduction=reduction, ebs=B if reduction == "mean" else None)
    return step_grads(model, opt, x, y, reduction)


# ---------------------------------------------------------------------------- per-layer clipping
PER_LAYER_NORMS = [0.2, 0.1, 0.15, 0.05]


def per_layer_reference() -> list[torch.Tensor]:
    from dptorch.optimizers import DPPerLayerOptimizer

    x, y = make_data()
    model = GradSampleModule(make_model(seed=0))
    opt = DPPerLayerOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=PER_LAYER_NORMS,
        expected_batch_size=B,
    )
    return step_grads(model, opt, x, y)


def per_layer_checks(rank: int, world_size: int) -> list[torch.Tensor]:
    from dptorch.optimizers import DistributedPerLayerOptimizer

    x, y = make_data()
    per_rank = B // world_size
    model = GradSampleModule(DPDDP(make_model(seed=0)))
    opt = DistributedPerLayerOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=PER_LAYER_NORMS,
        expected_batch_size=per_rank,
    )
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return step_grads(model, opt, x[sl], y[sl])


# ---------------------------------------------------------------------------- training
N_TRAIN = 600
TRAIN_BATCH = 60  # global (expected) batch size: q = 0.1
EPOCHS = 3  # the last one through BatchMemoryManager
TRAIN_SIGMA = 0.8
TRAIN_C = 1.0
DELTA = 1e-5


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(3, 8, generator=g) * 2
    y = torch.randint(0, 3, (N_TRAIN,), generator=g)
    return centers[y] + torch.randn(N_TRAIN, 8, generator=g), y


def train_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def _epoch(model, optimizer, loader) -> None:
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()


def _make_private(engine, model, loader):
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=loader,
        noise_multiplier=TRAIN_SIGMA,
        max_grad_norm=TRAIN_C,
    )


def training_checks(rank: int, world_size: int, out_dir: str) -> dict:
    """DDP + make_private: 2 plain epochs and one through BatchMemoryManager, then a checkpoint
    saved by rank 0 and loaded by every rank into fresh objects."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from dptorch import PrivacyEngine
    from dptorch.utils.batch_memory_manager import BatchMemoryManager

    x, y = train_data()
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=TRAIN_BATCH // world_size, sampler=DistributedSampler(ds))
    torch.manual_seed(0)  # same global seed on every rank: the sampler must still decorrelate
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, dl = _make_private(engine, DDP(train_model()), loader)
    out: dict = {
        "optimizer": type(optimizer).__name__,
        "sampler": type(dl.batch_sampler).__name__,
        "sample_rate": dl.sample_rate,
        "expected_batch_size": optimizer.expected_batch_size,
        "losses": [full_loss(model, x, y)],
    }
    batch_sizes = []
    for _ in range(EPOCHS - 1):
        for xb, yb in dl:
            batch_sizes.append(len(yb))
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        out["losses"].append(full_loss(model, x, y))
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=8, optimizer=optimizer) as mdl:
        _epoch(model, optimizer, mdl)
    out["losses"].append(full_loss(model, x, y))
    out["batch_sizes"] = batch_sizes
    out["eps"] = engine.get_epsilon(DELTA)
    out["history"] = list(getattr(engine.accountant, "history", []))
    out["params"] = torch.cat([p.detach().flatten() for p in model.parameters()])

    path = f"{out_dir}/ckpt.pt"
    if rank == 0:
        engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    dist.barrier()
    engine2 = PrivacyEngine(accountant="rdp")
    model2, optimizer2, _ = _make_private(engine2, DDP(train_model()), loader)
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    out["eps_resumed"] = engine2.get_epsilon(DELTA)
    out["params_resumed"] = torch.cat([p.detach().flatten() for p in model2.parameters()])
    return out


def single_process_training() -> dict:
    """The same training in this process (no DDP), for the epsilon and loss comparison."""
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine

    x, y = train_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=TRAIN_BATCH)
    torch.manual_seed(0)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, dl = _make_private(engine, train_model(), loader)
    for _ in range(EPOCHS):
        _epoch(model, optimizer, dl)
    return {
        "eps": engine.get_epsilon(DELTA),
        "sample_rate": dl.sample_rate,
        "expected_batch_size": optimizer.expected_batch_size,
        "loss": full_loss(model, x, y),
    }


# ---------------------------------------------------------------------------- entry point
FIXED_M = 72  # global fixed shape: 36 rows per rank, 30 expected records per rank


def fixed_shape_checks(rank: int, world_size: int, mode: str) -> dict:
    """DDP + make_private(poisson_sampling="fixed_shape") at noise 0 and learning rate 0: each
    step's local batch (rows, which are padding) and the released gradient, for the parent's
    brute force over both ranks' real rows."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from dptorch import PrivacyEngine

    x, y = train_data()
    ds = TensorDataset(x.double(), y)
    loader = DataLoader(ds, batch_size=TRAIN_BATCH // world_size, sampler=DistributedSampler(ds))
    torch.manual_seed(0)
    model = DDP(train_model().double())
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=TRAIN_C, grad_sample_mode=mode,
        poisson_sampling="fixed_shape", max_batch_size=FIXED_M,
    )
    gsm, opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    steps = []
    for i, (xb, yb) in enumerate(dl):
        valid = dl.layouts.current.valid.clone()
        opt.zero_grad()
        crit(gsm(xb), yb).backward()
        opt.step()
        steps.append({"x": xb[valid], "y": yb[valid], "rows": len(xb),
                      "grads": [p.grad.detach().clone() for p in gsm.parameters()]})
        if i == 2:
            break
    return {"steps": steps, "sampler": type(dl.batch_sampler).__name__,
            "expected_batch_size": opt.expected_batch_size}


def shard_checks(rank: int, world_size: int) -> dict:
    """make_private(poisson_sampling=False) over DistributedSamplers that do not shard one
    permutation disjointly (``seed=rank``; a hard-coded ``rank=0``), and over ones that do:
    the refusal message on each rank, or ``None``."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from dptorch import PrivacyEngine

    x, y = train_data()
    ds = TensorDataset(x, y)
    out = {}
    for name, kwargs in (("seed_rank", {"seed": rank}), ("rank_0", {"rank": 0}),
                         ("good", {"seed": 3})):
        model = DDP(train_model())
        loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, **kwargs))
        try:
            PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                poisson_sampling=False,
            )
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def all_checks(rank: int, world_size: int, out_dir: str) -> dict:
    """Every distributed check, in one spawned run."""
    out = {
        "optimizer": optimizer_checks(rank, world_size),
        "per_layer": per_layer_checks(rank, world_size),
    }
    from ddp_fast_workers import fast_clipping_checks, fast_training_checks  # imports this module

    for key, fn, args in (
        ("training", training_checks, (out_dir,)),
        ("fast", fast_clipping_checks, ()),
        ("fast_training", fast_training_checks, ()),
        ("fixed_shape_hooks", fixed_shape_checks, ("hooks",)),
        ("fixed_shape_bk", fixed_shape_checks, ("bk",)),
        ("shards", shard_checks, ()),
    ):
        try:
            out[key] = fn(rank, world_size, *args)
        except Exception as e:  # reported to the tests of `key`, which fail with the traceback
            import traceback

            out[f"{key}_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out
