"""Fast-clipping (``grad_sample_mode="ghost"`` / ``"bk"``) part of the shared 2-process run.

:func:`fast_clipping_checks` runs inside the spawned gloo processes (called by
``ddp_workers.all_checks``); :func:`fast_reference` computes the single-process references in the
test process. Everything is float64 on a tiny Embedding + LayerNorm + Conv1d + Linear model.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from ddp_workers import (
    DELTA,
    EPOCHS,
    TRAIN_BATCH,
    TRAIN_C,
    TRAIN_SIGMA,
    full_loss,
    train_data,
    train_model,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dptorch import PrivacyEngine
from dptorch.distributed import DPDDP, disable_gradient_sync
from dptorch.grad_sample import wrap_model
from dptorch.optimizers import get_optimizer_class
from dptorch.utils.batch_memory_manager import BatchMemoryManager
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

B = 8  # global batch size
VOCAB, LENGTH = 11, 6
FAST_C = 0.3  # flat clipping norm: most samples are clipped
#: per-layer norms, one per trainable parameter (emb.w, ln.w, ln.b, conv.w, conv.b, fc.w, fc.b)
FAST_NORMS = [0.2, 0.05, 0.03, 0.1, 0.02, 0.15, 0.04]
FAST_SIGMA = 1.3
FAST_NOISE_STEPS = 40


class FastNet(nn.Module):
    """Embedding -> LayerNorm -> Conv1d -> Linear: every bk path (no-weight-grad autograd
    functions for Embedding/Conv/Linear, zeroed autograd gradient for LayerNorm)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.ln = nn.LayerNorm(4)
        self.conv = nn.Conv1d(4, 3, 2)
        self.fc = nn.Linear(3 * (LENGTH - 1), 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids)).transpose(1, 2)
        return self.fc(torch.tanh(self.conv(h)).flatten(1))


def fast_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FastNet().double()


def fast_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (
        torch.randint(0, VOCAB, (B, LENGTH), generator=g),
        torch.randint(0, 3, (B,), generator=g),
    )


def _norm(clipping: str):
    return FAST_NORMS if clipping == "per_layer" else FAST_C


def fast_dp(module, mode, *, distributed, clipping="flat", sigma=0.0, ebs=B, generator=None,
            reduction="mean"):
    """``(gsm, optimizer, criterion)`` built by hand; ghost gets its DPLossFastGradientClipping."""
    norm = _norm(clipping)
    gsm = wrap_model(
        module,
        mode,
        loss_reduction=reduction,
        **({"max_grad_norm": norm} if mode in ("ghost", "bk") else {}),
    )
    cls = get_optimizer_class(clipping, distributed, mode)
    opt = cls(
        torch.optim.SGD(gsm.parameters(), lr=0.0),
        noise_multiplier=sigma,
        max_grad_norm=norm,
        expected_batch_size=ebs if reduction == "mean" else None,
        loss_reduction=reduction,
        generator=generator,
    )
    crit = nn.CrossEntropyLoss(reduction=reduction)
    if mode == "ghost":
        crit = DPLossFastGradientClipping(gsm, opt, crit, reduction)
    return gsm, opt, crit


def fast_step(gsm, opt, crit, x, y) -> list[torch.Tensor]:
    """One DP step at learning rate 0; returns the released gradients."""
    opt.zero_grad()
    crit(gsm(x), y).backward()
    opt.step()
    return [p.grad.detach().clone() for p in gsm.parameters()]


def fast_reference(mode: str, clipping: str = "flat", x=None, y=None, reduction="mean"):
    """Single process, whole batch (or ``x, y``), σ = 0; ``mode="hooks"`` materialises
    per-sample gradients."""
    if x is None:
        x, y = fast_data()
    return fast_step(
        *fast_dp(fast_model(), mode, distributed=False, clipping=clipping, reduction=reduction), x, y
    )


def _torch_ddp(module: nn.Module) -> DDP:
    ddp = DDP(module)
    disable_gradient_sync(ddp)
    return ddp


def _make_private(module, mode, world_size, *, clipping="flat", sigma=0.0, generator=None):
    """make_private on a per-rank loader of the fast data set (q = 1, expected batch B per world);
    the batches are fed by hand, the loader only sets q."""
    x, y = fast_data()
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=B // world_size, sampler=DistributedSampler(ds))
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(
        module=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=_norm(clipping),
        clipping=clipping,
        grad_sample_mode=mode,
        noise_generator=generator,
    )
    if mode == "ghost":
        gsm, opt, crit, _ = out
    else:
        gsm, opt, _ = out
        crit = nn.CrossEntropyLoss()
    return gsm, opt, crit


def _noisy(gsm, opt, crit, x, y) -> torch.Tensor:
    return torch.stack(
        [torch.cat([g.flatten() for g in fast_step(gsm, opt, crit, x, y)])
         for _ in range(FAST_NOISE_STEPS)]
    )


def fast_clipping_checks(rank: int, world_size: int) -> dict:
    """Released gradients of the distributed fast-clipping optimizers, by case name: each value
    is ``(optimizer class name, grads)`` (or, for ``noisy/*``, a ``(steps, numel)`` tensor)."""
    x, y = fast_data()
    n = B // world_size
    sl = slice(rank * n, (rank + 1) * n)
    xl, yl = x[sl], y[sl]
    out: dict = {}

    def exact(name, gsm, opt, crit, xb=xl, yb=yl):
        out[name] = (type(opt).__name__, fast_step(gsm, opt, crit, xb, yb))

    # 2 ranks x B/2 at sigma = 0: by hand on DPDDP (rank 1 starts from other weights) and through
    # make_private on torch DDP
    for mode in ("bk", "ghost"):
        exact(f"{mode}/dpddp", *fast_dp(DPDDP(fast_model(seed=rank)), mode, distributed=True, ebs=n))
        exact(f"{mode}/ddp", *_make_private(_torch_ddp(fast_model()), mode, world_size))
        # by hand on torch DDP without disable_gradient_sync: wrapping must switch it off (bk
        # used to end with zero gradients, DDP's reducer overwriting the clipped sums)
        ddp = DDP(fast_model())
        exact(f"{mode}/ddp_by_hand", *fast_dp(ddp, mode, distributed=True, ebs=n))
        out[f"{mode}/ddp_by_hand_sync"] = ddp.require_backward_grad_sync
    # per-layer clipping (bk only)
    exact("bk_per_layer/dpddp", *fast_dp(
        DPDDP(fast_model()), "bk", distributed=True, clipping="per_layer", ebs=n))
    exact("bk_per_layer/ddp", *_make_private(
        _torch_ddp(fast_model()), "bk", world_size, clipping="per_layer"))

    # an empty local batch on rank 1; sum reduction with 2 physical batches on rank 0 (a skipped
    # step) and one on rank 1
    for mode in ("bk", "ghost"):
        gsm, opt, crit = fast_dp(DPDDP(fast_model()), mode, distributed=True, ebs=n)
        exact(f"{mode}/empty", gsm, opt, crit, xl[: n if rank == 0 else 0], yl[: n if rank == 0 else 0])
        gsm, opt, crit = fast_dp(DPDDP(fast_model()), mode, distributed=True, reduction="sum")
        opt.zero_grad()
        if rank == 0:
            crit(gsm(xl[:1]), yl[:1]).backward()
            opt.signal_skip_step(True)
            opt.step()
            opt.zero_grad()
            crit(gsm(xl[1:]), yl[1:]).backward()
        else:
            crit(gsm(xl), yl).backward()
        opt.step()
        out[f"{mode}/skip"] = (type(opt).__name__, [p.grad.detach().clone() for p in gsm.parameters()])

    # sigma > 0, identically seeded generators on both ranks: still one draw for the world
    out["noisy/bk"] = _noisy(*fast_dp(
        DPDDP(fast_model()), "bk", distributed=True, sigma=FAST_SIGMA, ebs=n,
        generator=torch.Generator().manual_seed(7)), xl, yl)
    out["noisy/ghost"] = _noisy(*_make_private(
        _torch_ddp(fast_model()), "ghost", world_size, sigma=FAST_SIGMA,
        generator=torch.Generator().manual_seed(7)), xl, yl)
    out["noisy/bk_per_layer"] = _noisy(*fast_dp(
        DPDDP(fast_model()), "bk", distributed=True, clipping="per_layer", sigma=FAST_SIGMA, ebs=n,
        generator=torch.Generator().manual_seed(7)), xl, yl)
    return out


# ---------------------------------------------------------------------------- training
def fast_training_checks(rank: int, world_size: int) -> dict:
    """make_private(grad_sample_mode="bk" / "ghost") on DDP / DPDDP models: the training of
    ``ddp_workers.training_checks`` (2 plain epochs, one through BatchMemoryManager)."""

    x, y = train_data()
    ds = TensorDataset(x, y)
    results = {}
    for mode, wrapper in (("bk", "ddp"), ("bk", "dpddp"), ("ghost", "ddp")):
        loader = DataLoader(ds, batch_size=TRAIN_BATCH // world_size, sampler=DistributedSampler(ds))
        torch.manual_seed(0)
        module = DDP(train_model()) if wrapper == "ddp" else DPDDP(train_model())
        engine = PrivacyEngine(accountant="rdp")
        made = engine.make_private(
            module=module,
            optimizer=torch.optim.SGD(module.parameters(), lr=0.5),
            data_loader=loader,
            noise_multiplier=TRAIN_SIGMA,
            max_grad_norm=TRAIN_C,
            grad_sample_mode=mode,
        )
        if mode == "ghost":
            model, optimizer, criterion, dl = made
        else:
            model, optimizer, dl = made
            criterion = nn.CrossEntropyLoss()
        losses = [full_loss(model, x, y)]
        for epoch in range(EPOCHS):  # the last epoch through BatchMemoryManager
            last = epoch == EPOCHS - 1
            with (
                BatchMemoryManager(data_loader=dl, max_physical_batch_size=8, optimizer=optimizer)
                if last
                else nullcontext(dl)
            ) as batches:
                for xb, yb in batches:
                    optimizer.zero_grad()
                    criterion(model(xb), yb).backward()
                    optimizer.step()
            losses.append(full_loss(model, x, y))
        results[f"{mode}/{wrapper}"] = {
            "optimizer": type(optimizer).__name__,
            "gsm": type(model).__name__,
            "expected_batch_size": optimizer.expected_batch_size,
            "losses": losses,
            "eps": engine.get_epsilon(DELTA),
            "history": list(getattr(engine.accountant, "history", [])),
            "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        }
    return results


__all__ = [
    "B",
    "FAST_C",
    "FAST_NOISE_STEPS",
    "FAST_NORMS",
    "FAST_SIGMA",
    "fast_clipping_checks",
    "fast_data",
    "fast_reference",
    "fast_training_checks",
]
