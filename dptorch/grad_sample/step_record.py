"""The per-step record: the explicit contract between a GradSampleModule and its DP optimizer.

Between two optimizer steps, the module appends one :class:`PassRecord` per backward pass: the
batch size that every per-sample tensor of the pass has, the parameters a hook covered, whether
the pass was declared public, and (fast clipping) the bound its clip factors used. The
optimizer reads the record before it releases anything and writes only its own fields
(:meth:`StepRecord.mark_consumed`, :meth:`StepRecord.mark_released`,
:meth:`StepRecord.mark_clipped_in_place`). ``zero_grad`` on either side starts a new record.

The optimizer finds the record of its parameters with :func:`record_of` (a weak map from
parameter to record, written once by the module when it wraps the model).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "grad_state",
    "PassRecord",
    "StepRecord",
    "record_of",
    "records_for",
    "records_version",
    "register_record",
    "unregister_record",
]


@dataclass
class PassRecord:
    """One backward pass.

    ``batch_size``: rows of every per-sample tensor (or norm) of the pass; ``covered``: ids of
    the parameters some hook computed a per-sample result for; ``public``: run inside
    ``public_pass()``; ``clip_bound``: the bound(s) the fast-clipping factors used (``None``
    where the optimizer clips); ``clipped``: the pass added a clipped sum to ``p.grad``;
    ``grad_state``: :func:`grad_state` of every trainable parameter right after that.
    """

    batch_size: int | None = None
    covered: set[int] = field(default_factory=set)
    public: bool = False
    clip_bound: float | tuple[float, ...] | None = None
    clipped: bool = False
    grad_state: dict[int, tuple[int, int] | None] | None = None


def grad_state(p: torch.Tensor) -> tuple[int, int] | None:
    """Identity and version of ``p.grad`` (``None`` without one): any later write to ``p.grad``
    (an extra backward pass, an edit in place, a new tensor) changes it."""
    g = p.grad
    return None if g is None else (id(g), g._version)


class StepRecord:
    """What the backward passes since the last step produced, and what the optimizer did."""

    def __init__(self) -> None:
        self.passes: list[PassRecord] = []
        self.consumed = False
        self.released = False
        self.clipped_in_place = False
        #: :func:`grad_state` of each parameter right after ``zero_grad`` zeroed ``p.grad``
        self.zeroed: dict[int, tuple[int, int] | None] = {}

    # written by the module ------------------------------------------------------------------
    def add_pass(self, rec: PassRecord) -> None:
        self.passes.append(rec)

    # written by the optimizer ---------------------------------------------------------------
    def mark_consumed(self) -> None:
        """The per-sample results were clipped into the optimizer's sum."""
        self.consumed = True

    def mark_released(self) -> None:
        """A noisy gradient was released into ``p.grad``."""
        self.released = True

    def mark_clipped_in_place(self) -> None:
        """Manual ``clip()`` replaced ``p.grad_sample`` by clipped values."""
        self.clipped_in_place = True

    # either side ------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new step begins (``zero_grad``)."""
        self.passes = []
        self.consumed = False
        self.released = False
        self.clipped_in_place = False
        self.zeroed = {}

    def mark_zeroed(self, params: Iterable[torch.Tensor]) -> None:
        """``zero_grad`` just zeroed (or unset) the ``p.grad`` of ``params``."""
        self.zeroed.update((id(p), grad_state(p)) for p in params)

    @property
    def covered(self) -> set[int]:
        """Ids of the parameters covered by any pass."""
        out: set[int] = set()
        for rec in self.passes:
            out |= rec.covered
        return out

    def __repr__(self) -> str:
        return (
            f"StepRecord(passes={len(self.passes)}, consumed={self.consumed}, "
            f"released={self.released})"
        )


_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: bumped by every change of ``_RECORDS`` other than the death of a parameter
_version = 0


def records_version() -> int:
    """A number that changes whenever a parameter is linked or unlinked: a result of
    :func:`records_for` stays valid while it is unchanged, for parameters kept alive."""
    return _version


def register_record(params: Iterable[torch.Tensor], record: StepRecord) -> None:
    """Links ``params`` to ``record`` (the module that wraps them last wins)."""
    global _version
    _version += 1
    for p in params:
        _RECORDS[p] = record


def unregister_record(params: Iterable[torch.Tensor], record: StepRecord) -> None:
    """Unlinks those of ``params`` that are linked to ``record``."""
    global _version
    _version += 1
    for p in params:
        if _RECORDS.get(p) is record:
            del _RECORDS[p]


def record_of(p: torch.Tensor) -> StepRecord | None:
    """The record of the module that wraps ``p``, or ``None`` (an unwrapped parameter)."""
    return _RECORDS.get(p)


def records_for(params: Iterable[torch.Tensor]) -> list[StepRecord]:
    """The distinct records of ``params`` (normally one)."""
    out: list[StepRecord] = []
    for p in params:
        r = _RECORDS.get(p)
        if r is not None and all(r is not o for o in out):
            out.append(r)
    return out
