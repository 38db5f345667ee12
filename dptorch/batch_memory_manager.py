"""BatchMemoryManager: train on large logical (Poisson) batches with bounded memory.

Each logical batch drawn by the data loader's batch sampler is split into physical batches of
at most ``max_physical_batch_size`` samples. The optimizer is told to skip (only clip and
accumulate) on every physical batch but the last, so noise, parameter update and accounting
happen once per logical batch, exactly as if the logical batch had been processed at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from functools import partial

from torch.utils.data import DataLoader, Sampler

from .optimizers.optimizer import DPOptimizer
from .sampling import iterate_with_layouts
from .utils.batch_layout import LayoutQueue

logger = logging.getLogger(__name__)

__all__ = ["BatchMemoryManager", "BatchSplittingSampler", "wrap_data_loader"]


class BatchSplittingSampler(Sampler[list[int]]):
    """Splits every batch of ``sampler`` into chunks of at most ``max_batch_size`` indices and
    queues ``optimizer.signal_skip_step`` for each chunk (skip on all but the last).

    An empty logical batch gives one empty physical batch, on which the step happens (noise only).
    The skip signals are queued when a chunk is *produced*, so DataLoader prefetching (workers)
    keeps them in order.
    """

    def __init__(
        self, *, sampler: Sampler[list[int]], max_batch_size: int, optimizer: DPOptimizer,
        layouts: LayoutQueue | None = None,
    ):
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.optimizer = optimizer
        self.layouts = layouts

    def __iter__(self) -> Iterator[list[int]]:
        drop_unfinished(self.optimizer)  # a pass broken off and iterated again
        if self.layouts is not None:
            yield from self._split_with_layouts(self.layouts)
            return
        for batch_idxs in self.sampler:
            batch_idxs = list(batch_idxs)
            if not batch_idxs:
                self.optimizer.signal_skip_step(do_skip=False, physical_batch=True)
                yield []
                continue
            n_chunks = math.ceil(len(batch_idxs) / self.max_batch_size)
            for i in range(n_chunks):
                self.optimizer.signal_skip_step(do_skip=i < n_chunks - 1, physical_batch=True)
                yield batch_idxs[i * self.max_batch_size : (i + 1) * self.max_batch_size]

    def _split_with_layouts(self, layouts: LayoutQueue) -> Iterator[list[int]]:
        """Splits fixed-shape batches into fixed chunks, and user-level batches between users,
        pushing each chunk's layout in place of the batch's."""
        for batch_idxs in self.sampler:
            batch_idxs = list(batch_idxs)
            layout = layouts.pop_latest()
            bounds = layout.chunks(self.max_batch_size)
            for i, (lo, hi) in enumerate(bounds):
                self.optimizer.signal_skip_step(do_skip=i < len(bounds) - 1, physical_batch=True)
                layouts.push(layout.slice(lo, hi))
                yield batch_idxs[lo:hi]

    def __len__(self) -> int:
        """Expected number of physical batches (Poisson batch sizes vary; this is an estimate:
        ``steps × ceil(expected logical batch / max_batch_size)``)."""
        sample_rate = getattr(self.sampler, "sample_rate", None)
        num_samples = getattr(self.sampler, "num_samples", None)
        if sample_rate is None or num_samples is None:
            return len(self.sampler)  # type: ignore[arg-type]
        expected = sample_rate * num_samples
        return len(self.sampler) * max(1, math.ceil(expected / self.max_batch_size))  # type: ignore[arg-type]


def wrap_data_loader(
    *, data_loader: DataLoader, max_batch_size: int, optimizer: DPOptimizer
) -> DataLoader:
    """A DataLoader over the same dataset whose batches are the physical batches."""
    layouts = getattr(data_loader, "layouts", None)  # fixed-shape / user-level loaders
    return (DataLoader if layouts is None else partial(_LayoutLoader, layouts=layouts))(
        dataset=data_loader.dataset,
        batch_sampler=BatchSplittingSampler(
            sampler=data_loader.batch_sampler,
            max_batch_size=max_batch_size,
            optimizer=optimizer,
            layouts=layouts,
        ),
        num_workers=data_loader.num_workers,
        collate_fn=data_loader.collate_fn,
        pin_memory=data_loader.pin_memory,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context,
        generator=data_loader.generator,
        prefetch_factor=data_loader.prefetch_factor,
        persistent_workers=data_loader.persistent_workers,
    )


class _LayoutLoader(DataLoader):
    """The physical batches of a fixed-shape or user-level loader, each activating its
    layout when yielded."""

    def __init__(self, *args, layouts: LayoutQueue, **kwargs):
        self.layouts = layouts
        super().__init__(*args, **kwargs)

    def __iter__(self):
        return iterate_with_layouts(super().__iter__, self.layouts)


class BatchMemoryManager:
    """Context manager yielding a loader of physical batches of at most
    ``max_physical_batch_size`` samples, for a DP optimizer stepping on logical batches.

    Use it like the plain loader, calling ``optimizer.step()`` and ``optimizer.zero_grad()``
    after every physical batch: the optimizer only updates on the last physical batch of each
    logical batch (per-sample gradients are cleared, their clipped sum is kept in between).

    Example::

        with BatchMemoryManager(data_loader=dl, max_physical_batch_size=32,
                                optimizer=optimizer) as loader:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    """

    def __init__(
        self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: DPOptimizer
    ):
        if (
            isinstance(max_physical_batch_size, bool)
            or not isinstance(max_physical_batch_size, int)
            or max_physical_batch_size <= 0
        ):
            raise ValueError(
                f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size!r}"
            )
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError(
                "BatchMemoryManager needs the DPOptimizer returned by make_private (it must be "
                f"told which physical batches end a logical batch); got {type(optimizer).__name__}."
            )
        if data_loader.batch_sampler is None:
            raise ValueError("BatchMemoryManager needs a data loader with a batch sampler.")
        self.data_loader = data_loader
        self.optimizer = optimizer
        self.max_physical_batch_size = max_physical_batch_size

    def __enter__(self) -> DataLoader:
        drop_unfinished(self.optimizer)
        return wrap_data_loader(
            data_loader=self.data_loader,
            max_batch_size=self.max_physical_batch_size,
            optimizer=self.optimizer,
        )

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        drop_unfinished(self.optimizer)


def drop_unfinished(optimizer: DPOptimizer) -> None:
    """Forgets a logical batch broken off (an early break, an exception): its skip signals, and
    the clipped sums of its physical steps, which were never released; kept, they would be added
    to the next logical batch, a different Poisson batch (two records' worth of sensitivity in
    one step accounted as one). Runs when a BatchMemoryManager is entered or left and when its
    loader starts a pass."""
    optimizer._step_skip_queue.clear()
    if optimizer.last_step_skipped:
        optimizer.discard_step()
