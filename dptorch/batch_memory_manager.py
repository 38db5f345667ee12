"""BatchMemoryManager: train on large logical (Poisson) batches with bounded memory.

Each logical batch drawn by the data loader's batch sampler is split into physical batches of
at most ``max_physical_batch_size`` samples. As the loader yields a physical batch it tells the
optimizer which logical batch the batch belongs to and whether it ends it: the step of every
physical batch but the last is skipped (only clip and accumulate), so noise, parameter update
and accounting happen once per logical batch, exactly as if the logical batch had been processed
at once. A physical batch the training loop drops (``zero_grad(); continue``) only loses its own
contribution; if it was the last of its logical batch, that logical batch is never released.
"""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from collections import deque
from collections.abc import Iterator

from torch.utils.data import DataLoader, Sampler

from .optimizers.optimizer import DPOptimizer
from .sampling import iterate_with_layouts
from .utils.batch_layout import LayoutQueue

logger = logging.getLogger(__name__)

__all__ = ["BatchMemoryManager", "BatchSplittingSampler", "wrap_data_loader"]


class BatchSplittingSampler(Sampler[list[int]]):
    """Splits every batch of ``sampler`` into chunks of at most ``max_batch_size`` indices.

    Each chunk's tag, ``(logical batch id, is last chunk)``, is queued for the pass that drew it
    (DataLoader prefetching draws ahead of training); the loader of :func:`wrap_data_loader`
    hands it to the optimizer when it yields that chunk, so the skip decision follows the batch
    trained on, whatever the training loop drops. The sampler must be iterated by that loader.
    An empty logical batch gives one empty physical batch, on which the step happens (noise only).
    """

    def __init__(
        self, *, sampler: Sampler[list[int]], max_batch_size: int, optimizer: DPOptimizer,
        layouts: LayoutQueue | None = None,
    ):
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.optimizer = optimizer
        self.layouts = layouts
        #: the tags of the chunks drawn by the latest pass and not yet yielded, oldest first
        self.tags: deque[tuple[int, bool]] = deque()
        self._tagged_loader = False  # set by the loader that hands the tags to the optimizer

    def __iter__(self) -> Iterator[list[int]]:
        """A new pass, with a queue of tags of its own (:attr:`tags`, read by the loader right
        after it starts the pass)."""
        self.tags = deque()
        return self._chunks(self.tags)

    def _chunks(self, tags: deque[tuple[int, bool]]) -> Iterator[list[int]]:
        if not self._tagged_loader:
            raise ValueError(
                "BatchSplittingSampler must be iterated by the loader of wrap_data_loader (or "
                "BatchMemoryManager), which tells the optimizer which logical batch each "
                "physical batch it yields belongs to; another DataLoader cannot, and the "
                "optimizer would release physical batches on their own or mix logical batches."
            )
        drop_unfinished(self.optimizer)  # a pass broken off and iterated again
        if self.layouts is not None:
            yield from self._split_with_layouts(self.layouts, tags)
            return
        for batch_idxs in self.sampler:
            logical_id = next(_logical_ids)
            batch_idxs = list(batch_idxs)
            if not batch_idxs:
                tags.append((logical_id, True))
                yield []
                continue
            n_chunks = math.ceil(len(batch_idxs) / self.max_batch_size)
            for i in range(n_chunks):
                tags.append((logical_id, i == n_chunks - 1))
                yield batch_idxs[i * self.max_batch_size : (i + 1) * self.max_batch_size]

    def _split_with_layouts(
        self, layouts: LayoutQueue, tags: deque[tuple[int, bool]]
    ) -> Iterator[list[int]]:
        """Splits fixed-shape batches into fixed chunks, and user-level batches between users,
        pushing each chunk's layout in place of the batch's."""
        for batch_idxs in self.sampler:
            logical_id = next(_logical_ids)
            batch_idxs = list(batch_idxs)
            layout = layouts.pop_latest()
            bounds = layout.chunks(self.max_batch_size)
            for i, (lo, hi) in enumerate(bounds):
                tags.append((logical_id, i == len(bounds) - 1))
                layouts.push(layout.slice(lo, hi))
                yield batch_idxs[lo:hi]

    def __len__(self) -> int:
        """Expected number of physical batches (Poisson batch sizes vary; this is an estimate:
        ``steps × ceil(expected logical batch / max_batch_size)``)."""
        sample_rate = getattr(self.sampler, "sample_rate", None)
        num_samples = getattr(self.sampler, "num_samples", None)
        if sample_rate is None or num_samples is None:
            batch_size = getattr(self.sampler, "batch_size", None)  # a fixed-size BatchSampler
            if batch_size is None:
                return len(self.sampler)  # type: ignore[arg-type]
            # every full batch splits into the same number of chunks; a last short one fewer
            n = len(self.sampler.sampler)  # type: ignore[attr-defined]
            full, rest = divmod(n, batch_size)
            if getattr(self.sampler, "drop_last", False):
                rest = 0
            per_full = math.ceil(batch_size / self.max_batch_size)
            return full * per_full + math.ceil(rest / self.max_batch_size)
        expected = sample_rate * num_samples
        return len(self.sampler) * max(1, math.ceil(expected / self.max_batch_size))  # type: ignore[arg-type]


#: ids of the logical batches drawn by every BatchSplittingSampler of this process
_logical_ids = itertools.count()


def wrap_data_loader(
    *, data_loader: DataLoader, max_batch_size: int, optimizer: DPOptimizer
) -> DataLoader:
    """A DataLoader over the same dataset whose batches are the physical batches."""
    layouts = getattr(data_loader, "layouts", None)  # fixed-shape / user-level loaders
    return _PhysicalLoader(
        optimizer=optimizer,
        layouts=layouts,
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


class _PhysicalLoader(DataLoader):
    """The physical batches of a :class:`BatchSplittingSampler`: as it yields one, it tells
    the optimizer the batch's tag (:meth:`DPOptimizer.begin_physical_batch`) and activates its
    layout (fixed-shape or user-level loaders)."""

    def __init__(self, *args, optimizer: DPOptimizer, layouts: LayoutQueue | None, **kwargs):
        self.optimizer = optimizer
        self.layouts = layouts
        super().__init__(*args, **kwargs)
        self.batch_sampler._tagged_loader = True

    def __iter__(self):
        if self.layouts is None:
            return self._tagged()
        return iterate_with_layouts(self._tagged, self.layouts)

    def _tagged(self) -> Iterator:
        batches = super().__iter__()  # starts the sampler's pass, which gets a tag queue
        tags = self.batch_sampler.tags
        try:
            for batch in batches:
                self.optimizer.begin_physical_batch(*tags.popleft())
                yield batch
        finally:  # a loop broken off leaves no tag behind for steps on another loader
            self.optimizer.end_physical_batches()
        # the pass is over: a logical batch whose last physical batch was dropped is dropped
        if self.optimizer.last_step_skipped:
            warnings.warn(
                "BatchMemoryManager: the last logical batch of the pass ended without its last "
                "physical batch being stepped (the training loop dropped it), so it was never "
                "released: its clipped gradients are dropped.",
                RuntimeWarning,
                stacklevel=2,
            )
        drop_unfinished(self.optimizer)


class BatchMemoryManager:
    """Context manager yielding a loader of physical batches of at most
    ``max_physical_batch_size`` samples, for a DP optimizer stepping on logical batches.

    Use it like the plain loader, calling ``optimizer.step()`` and ``optimizer.zero_grad()``
    after every physical batch: the optimizer only updates on the last physical batch of each
    logical batch (per-sample gradients are cleared, their clipped sum is kept in between).
    Which step releases follows the physical batch yielded last, so a loop may drop a batch
    (``optimizer.zero_grad(); continue``): a logical batch then loses that batch's records, and
    is not released at all when its last physical batch is dropped (``RuntimeWarning``).
    ``optimizer.skip_requested`` is ``False`` exactly for the last physical batch of a logical
    batch. Call ``step()`` once per physical batch, and no ``signal_skip_step`` inside the loop.

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
    optimizer._skip_requests.clear()
    optimizer.end_physical_batches()
    if optimizer.last_step_skipped:
        optimizer.discard_step()
