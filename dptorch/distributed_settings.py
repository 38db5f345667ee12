"""The DP settings every rank of a distributed run must share, checked with one all-gather.

Distributed DP-SGD releases ``Σ_ranks clipped sums + one draw of N(0, (σ·C)²)`` (the noise is
drawn on rank 0) and rank 0's accountant charges rank 0's sample rate. Both are only right when
every rank samples at the same rate q, clips to the same bound C, uses the same σ, and so on:
with a larger batch size (q) or a larger C on rank 1, rank 1's records are sampled more often /
contribute more than the noise and the reported ε account for. Each rank derives these
settings from its own arguments, so they are compared across ranks before anything is built.

:func:`settings_must_agree` is the context manager ``PrivacyEngine.make_private`` and the
distributed DP optimizers (at construction) run their checks in: the body computes the local
settings and passes them to ``agree``, which all-gathers them and raises the **same**
``ValueError`` on every rank when they differ (naming each setting and its value per rank). A
rank whose own checks raise before ``agree`` still joins the gather (with its error), so the
other ranks raise too instead of waiting for it forever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

__all__ = ["check_settings_agree", "engine_settings", "optimizer_settings", "settings_must_agree"]

#: Key of the entry a rank gathers when its own checks failed.
_FAILED = "__failed__"

Agree = Callable[[Mapping[str, Any]], None]

#: How to make a setting agree, for the error message.
_HINTS = {
    "sample_rate": "q = 1/len(data_loader): give every rank's DataLoader the same batch_size "
    "and dataset",
    "num_records": "N: every rank's loader must draw from the same dataset",
    "expected_batch_size": "per rank, q·N / world_size, from each rank's data loader",
}

_UNSET = object()


def _plain(value: Any) -> Any:
    """``value`` as a comparable plain Python value (tuples for sequences), or ``_UNSET`` when
    it is not one (a tensor, a process group, a callable...)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _UNSET if any(v is _UNSET for v in items) else tuple(items)
    return _UNSET


def engine_settings(
    a: Any,
    kwargs: Mapping[str, Any],
    *,
    sample_rate: float,
    num_records: int,
    expected_batch_size: float,
    noise_multiplier: float,
    secure_mode: bool,
) -> dict[str, Any]:
    """The settings of one rank's ``make_private`` (or ``make_private_with_epsilon``) call that
    every rank must share: ``a`` holds its named arguments and sampling plan, ``kwargs`` the
    extra optimizer / sampling arguments (those with plain values are compared as well)."""
    plan = a.plan
    settings: dict[str, Any] = {
        "sample_rate": sample_rate,
        "num_records": num_records,
        "expected_batch_size": expected_batch_size,
        "noise_multiplier": noise_multiplier,
        "max_grad_norm": _plain(a.max_grad_norm),
        "clipping": a.clipping,
        "grad_sample_mode": a.grad_sample_mode,
        "loss_reduction": a.loss_reduction,
        "poisson_sampling": plan.poisson,
        "fixed_shape": plan.fixed_shape,
        "max_batch_size": plan.max_batch_size,
        "privacy_unit": plan.privacy_unit,
        "max_records_per_user": plan.max_records_per_user,
        "secure_mode": secure_mode,
        "multi_pass": a.multi_pass,
        "batch_first": a.batch_first,
    }
    for name in ("target_epsilon", "target_delta", "epochs"):  # make_private_with_epsilon
        if hasattr(a, name):
            settings[name] = _plain(getattr(a, name))
    for name, value in sorted(kwargs.items()):
        plain = _plain(value)
        if plain is not _UNSET:
            settings.setdefault(name, plain)
    return settings


def optimizer_settings(optimizer: Any) -> dict[str, Any]:
    """The settings of a distributed DP optimizer that every rank must share (its class, σ, C or
    the per-parameter bounds, the per-rank expected batch size, the reduction, secure mode)."""
    bounds = getattr(optimizer, "max_grad_norms", None)
    return {
        "optimizer class": type(optimizer).__name__,
        "noise_multiplier": _plain(optimizer.noise_multiplier),
        "max_grad_norm": _plain(list(bounds) if bounds is not None else optimizer.max_grad_norm),
        "expected_batch_size": _plain(optimizer.expected_batch_size),
        "loss_reduction": optimizer.loss_reduction,
        "secure_mode": bool(optimizer.secure_mode),
    }


def _gather(entry: dict[str, Any], process_group: dist.ProcessGroup | None) -> list[dict[str, Any]]:
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, entry, group=process_group)
    return gathered


def _fmt(value: Any) -> str:
    return "(absent)" if value is _UNSET else repr(value)


def _disagreement(gathered: list[dict[str, Any]], where: str) -> str | None:
    """The error message for ``gathered`` (one entry per rank), or ``None`` when they agree.
    Depends on ``gathered`` only, so every rank builds the same message."""
    failed = [(r, e[_FAILED]) for r, e in enumerate(gathered) if _FAILED in e]
    if failed:
        return (
            f"{where} failed on rank(s) {', '.join(str(r) for r, _ in failed)}: "
            + "; ".join(f"rank {r}: {msg.rstrip('.')}" for r, msg in failed)
            + ". Every rank refuses: no rank may train without the others. Fix the error there."
        )
    names = list(dict.fromkeys(k for e in gathered for k in e))
    lines = []
    for name in names:
        values = [e.get(name, _UNSET) for e in gathered]
        if any(v != values[0] for v in values):  # 1 == 1.0: numbers compare by value
            per_rank = ", ".join(f"rank {r}: {_fmt(v)}" for r, v in enumerate(values))
            hint = f" ({_HINTS[name]})" if name in _HINTS else ""
            lines.append(f"  {name}{hint}: {per_rank}")
    if not lines:
        return None
    return (
        f"{where}: the ranks of the distributed run disagree on DP settings:\n"
        + "\n".join(lines)
        + "\nThe noise is drawn once (on rank 0) for sensitivity σ·C and rank 0's accountant "
        "charges rank 0's sample rate, so every rank must sample at the same rate, clip to the "
        "same bound and use the same settings. Fix: pass the same arguments (and data loader "
        "batch size) on every rank."
    )


def check_settings_agree(
    settings: Mapping[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    where: str = "make_private",
) -> None:
    """All-gathers ``settings`` (plain, picklable values) over ``process_group`` and raises the
    same ``ValueError`` on every rank when any rank's differ, naming each setting and its value
    per rank. A collective: every rank of the group must call it. No-op outside
    ``torch.distributed`` or in a world of one."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(process_group) == 1:
        return
    message = _disagreement(_gather(dict(settings), process_group), where)
    if message is not None:
        raise ValueError(message)


@contextmanager
def settings_must_agree(
    distributed: bool,
    *,
    process_group: dist.ProcessGroup | None = None,
    where: str = "make_private",
) -> Iterator[Agree]:
    """Context manager that yields ``agree(settings)`` (:func:`check_settings_agree`, called
    once in the body with this rank's settings). If the body raises before calling it, this rank
    joins the gather with its error (so the other ranks raise a ``ValueError`` naming it instead
    of waiting) and its own exception propagates. Not ``distributed``: ``agree`` does nothing."""
    active = distributed and dist.is_available() and dist.is_initialized() and (
        dist.get_world_size(process_group) > 1
    )
    done = False

    def agree(settings: Mapping[str, Any]) -> None:
        nonlocal done
        done = True
        if active:
            check_settings_agree(settings, process_group=process_group, where=where)

    try:
        yield agree
    except Exception as e:
        if active and not done:
            done = True
            _gather({_FAILED: f"{type(e).__name__}: {str(e)[:500]}"}, process_group)
        raise
    if active and not done:
        raise RuntimeError(f"{where}: the DP settings were never compared across ranks (a bug).")
