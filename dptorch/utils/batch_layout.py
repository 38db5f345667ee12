"""What the rows of a physical batch are: which privacy unit each row belongs to, or padding.

Record-level Poisson batches need no layout: every row is its own unit. Two samplings do:

* fixed-shape Poisson batches (``poisson_sampling="fixed_shape"``) fill a batch of constant
  size with the sampled records, then padding rows, which must contribute nothing;
* user-level sampling (``privacy_unit="user"``) puts several records of one user in a batch,
  and the clipping bounds the *sum* of a user's per-record gradients.

A :class:`BatchLayout` says both with one vector, ``groups[i]``: the unit of row ``i`` (``0 ..
num_groups-1``), or ``-1`` for a padding row. A unit's gradient is the sum of its rows'
per-sample gradients, and a padding row's clip factor is 0. The data loader publishes the layout
of the batch it yields through a :class:`LayoutQueue` that the clipping code holds by reference.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["BatchLayout", "LayoutQueue"]


@dataclass(frozen=True)
class BatchLayout:
    """The privacy unit of each row of one physical batch.

    Attributes:
        groups: ``(B,)`` long: the unit of each row in ``0 .. num_groups-1``; ``-1`` marks a
            padding row.
        num_groups: the number of units U.
    """

    groups: torch.Tensor
    num_groups: int

    @classmethod
    def records(cls, num_real: int, num_rows: int) -> BatchLayout:
        """``num_real`` records (one unit each) followed by ``num_rows - num_real`` padding
        rows."""
        groups = torch.full((num_rows,), -1, dtype=torch.long)
        groups[:num_real] = torch.arange(num_real)
        return cls(groups, num_real)

    @property
    def num_rows(self) -> int:
        return int(self.groups.shape[0])

    @cached_property
    def valid(self) -> torch.Tensor:
        """``(B,)`` bool: the rows that are not padding."""
        return self.groups >= 0

    @cached_property
    def one_row_per_group(self) -> bool:
        """Whether every unit has exactly one row (record-level, possibly padded)."""
        g = self.groups[self.groups >= 0]
        return g.numel() == self.num_groups and (g.numel() == 0 or int(g.bincount().max()) == 1)

    def held_in(self, valid: torch.Tensor) -> BatchLayout:
        """This layout with its padding mask kept in ``valid``, a ``(B,)`` bool tensor (on the
        GPU, a buffer that a captured CUDA graph reads at every replay): :attr:`valid` is copied
        into it, and the returned layout's :attr:`valid` is ``valid`` itself."""
        valid.copy_(self.valid)
        out = BatchLayout(self.groups, self.num_groups)
        out.__dict__["valid"] = valid  # the cached property's value
        return out

    def check_rows(self, n: int, where: str) -> None:
        """Raises ``ValueError`` unless the batch seen by ``where`` has this layout's rows."""
        if n != self.num_rows:
            raise ValueError(
                f"{where}: the batch has {n} rows but the data loader's last batch had "
                f"{self.num_rows} (its layout says which rows are padding or belong to the same "
                "user). Feed the batches of the loader returned by make_private unchanged, one "
                "forward and backward pass per batch."
            )

    def group_sum(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sums the rows of each unit: ``t`` with ``B`` rows along ``dim`` -> ``U`` rows
        (padding rows dropped)."""
        keep = self.valid.to(t.device)
        idx = self.groups.to(t.device)[keep]
        rows = t.index_select(dim, keep.nonzero().reshape(-1))
        shape = list(t.shape)
        shape[dim] = self.num_groups
        return t.new_zeros(shape).index_add_(dim, idx, rows)

    def expand(self, per_group: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Each row takes its unit's value: ``U`` rows along ``dim`` -> ``B`` rows; a padding
        row gets 0."""
        g = self.groups.to(per_group.device)
        out = per_group.index_select(dim, g.clamp(min=0))
        shape = [1] * out.dim()
        shape[dim] = -1
        return out * self.valid.to(per_group.device).view(shape).to(out.dtype)

    def unit_norm_sq(self, row_vectors: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Squared L2 norm of each unit's gradient from per-row gradients ``row_vectors`` (rows
        along ``dim``, the gradient in the dimensions after it), given back per row: shape
        ``row_vectors.shape[:dim + 1]``, each row its unit's value, a padding row 0."""
        sq = self.group_sum(row_vectors, dim).pow(2)
        if sq.dim() > dim + 1:
            sq = sq.flatten(dim + 1).sum(dim + 1)
        return self.expand(sq, dim)

    def chunks(self, size: int) -> list[tuple[int, int]]:
        """Row ranges of physical chunks of at most ``size`` rows: fixed cuts every ``size``
        rows when every unit is one row, else cuts between units only (``ValueError`` if a
        unit alone has more than ``size`` rows)."""
        n = self.num_rows
        if n == 0:
            return [(0, 0)]
        if self.one_row_per_group:
            return [(i, min(i + size, n)) for i in range(0, n, size)]
        g = self.groups.tolist()
        starts = [i for i in range(n) if i == 0 or g[i] != g[i - 1]] + [n]
        out, lo = [], 0
        for a, b in zip(starts, starts[1:]):
            if b - a > size:
                raise ValueError(
                    f"A user has {b - a} records in this batch, more than max_physical_batch_size"
                    f" = {size}: a user's records must be clipped together, in one physical "
                    "batch. Raise max_physical_batch_size or lower max_records_per_user."
                )
            if b - lo > size:
                out.append((lo, a))
                lo = a
        out.append((lo, n))
        return out

    def slice(self, start: int, stop: int) -> BatchLayout:
        """The layout of rows ``start:stop`` (a physical chunk of a logical batch); units are
        renumbered from 0, and a unit must not straddle the cut (``ValueError``)."""
        part = self.groups[start:stop]
        inside = part[part >= 0]
        outside = torch.cat([self.groups[:start], self.groups[stop:]])
        if inside.numel() and torch.isin(inside, outside).any():
            raise ValueError(
                "A physical batch boundary splits the records of one user: each user's records "
                "must be clipped together. Use a max_physical_batch_size that is a multiple of "
                "max_records_per_user."
            )
        uniq, new = inside.unique(return_inverse=True)
        groups = part.clone()
        groups[part >= 0] = new
        return BatchLayout(groups, int(uniq.numel()))


class LayoutQueue:
    """The layouts of batches drawn but not yet trained on, in order, and the current one.

    Shared by reference: the batch sampler :meth:`push` es a layout when it draws a batch (the
    DataLoader draws ahead of training when it prefetches), the data loader :meth:`activate` s
    it when it yields that batch, and the clipping code reads it with :meth:`training_layout`.
    ``None``: every row is its own unit and none is padding.

    A layout describes the batch yielded last by the live pass over the loader, so everything
    that could pair a batch with another batch's layout is refused (``ValueError``):

    * a second pass started while another is live (``zip(loader, loader)``, a look at
      ``next(iter(loader))`` between steps): training reads raise until a pass starts alone,
      and a pass whose token (:meth:`begin`) is no longer current cannot activate a layout;
    * training with no layout while the loader needs them (:attr:`required`): a batch of a pass
      that has ended, or not from this loader;
    * a non-empty batch yielded and not trained on before the next one (a wrapper that fetches
      batches ahead of training would clip batch ``t`` with the layout of batch ``t + 1``, and
      padding rows, copies of a real record, would count as records). Skipping a batch is
      refused for the same reason: the two cannot be told apart.
    """

    def __init__(self) -> None:
        self._pending: deque[BatchLayout] = deque()
        self.current: BatchLayout | None = None
        #: every training batch must have a layout (set by the loaders that produce them)
        self.required = False
        self._pass = 0  # token of the latest pass over the loader
        self._live: set[int] = set()  # passes begun and not ended
        self._overlap = False  # a pass began while another was live
        self._trained = True  # the current batch was read for training (or there is none)
        self._skipped = False  # a non-empty batch was yielded and never trained on

    def push(self, layout: BatchLayout) -> None:
        self._pending.append(layout)

    def pop_pending(self) -> BatchLayout:
        """The oldest layout drawn and not yet activated (used to split it into chunks)."""
        return self._pending.popleft()

    def pop_latest(self) -> BatchLayout:
        """The layout drawn last (a batch splitter takes it to push its chunks' instead)."""
        return self._pending.pop()

    def begin(self) -> int:
        """Starts a pass over the loader (forgetting drawn batches and the current layout);
        returns its token."""
        # a live pass whose current batch was trained can no longer pair a batch with another
        # batch's layout (its token cannot activate one); one whose batch is untrained can
        self._overlap = bool(self._live) and self.current is not None and not self._trained
        self.reset()
        self._pass += 1
        self._live.add(self._pass)
        return self._pass

    def activate(self, token: int | None = None) -> None:
        """The next drawn batch is the one being trained on (``token``: the pass yielding it)."""
        if token is not None and token != self._pass:
            # its draw may already have pushed a layout among the live pass's: refuse the
            # live pass's training reads too, until a pass starts alone
            self._overlap = True
            raise ValueError(
                "Two passes over the data loader of make_private (poisson_sampling="
                "'fixed_shape' or privacy_unit='user') were live at once (zip(loader, loader), "
                "or iter(loader) called again during an epoch): the padding rows and users of "
                "a batch are known only for the live pass. Iterate the loader once at a time."
            )
        if self.current is not None and not self._trained and self.current.num_rows > 0:
            self._skipped = True
        self.current = self._pending.popleft() if self._pending else None
        self._trained = False

    def end(self, token: int) -> None:
        """The pass ``token`` is over (a stale pass's end leaves the current layout)."""
        self._live.discard(token)
        if token == self._pass:
            self.current = None

    def training_layout(self) -> BatchLayout | None:
        """:attr:`current`, read to clip the batch being trained on."""
        if self._overlap:
            self._trained = True  # refused: consumed, so that a retry's pass starts clean
            raise ValueError(
                "Two passes over the data loader of make_private (poisson_sampling="
                "'fixed_shape' or privacy_unit='user') were live at once (zip(loader, loader), "
                "or iter(loader) called again during an epoch): the padding rows and users of "
                "a batch are known only for the live pass, and this batch may be the other "
                "pass's. Iterate the loader once at a time (close or finish an earlier "
                "iterator first)."
            )
        if self._skipped:
            self._trained = True
            raise ValueError(
                "The data loader of make_private (poisson_sampling='fixed_shape' or "
                "privacy_unit='user') yielded a batch that was not trained on before it yielded "
                "the next one. Its padding rows and users are known only for the batch yielded "
                "last, so a wrapper that fetches batches ahead of training (a prefetcher, a "
                "framework's data fetcher) would clip a batch with another batch's layout; a "
                "skipped batch looks the same. Train on every batch before drawing the next, "
                "from the loader itself, or use poisson_sampling=True."
            )
        if self.current is None and self.required:
            raise ValueError(
                "Training on a batch without its layout while the data loader of make_private "
                "(poisson_sampling='fixed_shape' or privacy_unit='user') needs one: the batch "
                "comes from a pass over the loader that has ended (e.g. next(iter(loader))) or "
                "from another loader. Train on the batches of a live `for batch in loader` pass."
            )
        self._trained = True
        return self.current

    def reset(self) -> None:
        """Forgets drawn batches and the current layout."""
        self._pending.clear()
        self.current = None
        self._trained, self._skipped = True, False

    def __repr__(self) -> str:
        return f"LayoutQueue(current={self.current!r}, pending={len(self._pending)})"
