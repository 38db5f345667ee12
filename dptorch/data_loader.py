"""DPDataLoader: a DataLoader whose batches are drawn by Poisson sampling.

Poisson sampling (each record joins each batch independently with probability ``q``) is what
the DP-SGD accountants assume. Batch sizes vary and may be zero; the collate function is wrapped
so that an empty batch comes out as zero-size tensors of the right trailing shape and dtype, and
a training step on it still adds noise and is accounted for.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data._utils.collate import default_collate

from .utils.randomness import secure_generator_seed
from .utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
    as_index_tensor,
    validate_sample_rate,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DPDataLoader",
    "CollateFnWithEmpty",
    "wrap_collate_with_empty",
    "switch_generator",
    "shape_safe",
    "dtype_safe",
    "poisson_sampling_indices",
    "check_data_loader",
    "records_in_loader",
    "expected_batch_size",
    "prepare_data_loader",
    "steps_per_pass",
    "uses_each_record_once",
    "check_fixed_size_loader",
    "DistinctIndicesBatchSampler",
    "rebuilt_loader_kwargs",
]

# DataLoader settings carried over by DPDataLoader.from_data_loader (batching is replaced).
_CARRIED_KWARGS = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _empty_like_batch(batch: Any, batch_dim: int) -> Any:
    """The zero-size version of a collated batch: tensors keep dtype, device and trailing shape
    (new tensors, so the template batch's storage is not kept alive)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch.new_empty((0,))
        shape = list(batch.shape)
        shape[batch_dim if batch.dim() > batch_dim else 0] = 0
        return batch.new_empty(shape)
    if isinstance(batch, Mapping):
        return type(batch)({k: _empty_like_batch(v, batch_dim) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_empty_like_batch(v, batch_dim) for v in batch))
    if isinstance(batch, tuple):
        return tuple(_empty_like_batch(v, batch_dim) for v in batch)
    if isinstance(batch, list):
        # default_collate turns a list of per-field values into a list of batched fields; a
        # list of non-tensors (strings) is one field's values: empty.
        if batch and all(isinstance(v, (torch.Tensor, Mapping, tuple, list)) for v in batch):
            return [_empty_like_batch(v, batch_dim) for v in batch]
        return []
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: _empty_like_batch(getattr(batch, f.name), batch_dim)
                  for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **fields)
    if batch is None or isinstance(batch, (str, bytes, int, float, bool)):
        return batch
    # returning the template itself would replay its records in every empty Poisson batch
    raise TypeError(
        f"Cannot build an empty batch of type {type(batch).__name__} (the collate function's "
        "output): an empty Poisson batch must have the batch's structure with no records. "
        "Return tensors, dicts, tuples, lists, namedtuples or dataclasses from collate_fn, or "
        "handle empty sample lists in collate_fn yourself."
    )


def shape_safe(x: Any) -> tuple:
    """``x.shape``, or ``()`` for values without one (Python scalars)."""
    return getattr(x, "shape", ())


def dtype_safe(x: Any) -> torch.dtype | type:
    """``x.dtype``, or ``type(x)`` for values without one (``int`` / ``float`` labels)."""
    return getattr(x, "dtype", type(x))


class CollateFnWithEmpty:
    """Wraps a collate function so that an empty list of samples gives an empty batch.

    The empty batch has the structure, dtypes and trailing shapes of a real batch, with a
    zero-size batch dimension, taken from (first that applies):

    1. ``dataset`` (dptorch): a one-sample batch of ``dataset[0]``, collated once by the same
       function: exact (dicts, namedtuples) even when the very first batch is empty;
    2. the first non-empty batch seen;
    3. ``sample_empty_shapes`` and ``dtypes`` (one entry per field, e.g.
       ``[(0, *shape_safe(x)) for x in dataset[0]]`` and ``[dtype_safe(x) ...]``): a list of
       zero-filled tensors of those shapes;
    4. else ``[]``.

    Args:
        collator_fn: the collate function to wrap; ``None`` passes the list of samples through.
        batch_first: whether the batch dimension of collated tensors is 0 (else 1).
        rand_on_empty: must be ``False``: replacing an empty Poisson batch by random data
            changes the sampling the privacy accountant assumes (``ValueError``).
        sample_empty_shapes: shapes of the fields of an empty batch (case 3).
        dtypes: dtypes of those fields (case 3).
        dataset: the dataset whose first record gives the structure (case 1).
    """

    def __init__(
        self,
        collator_fn: Callable | None,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        sample_empty_shapes: Sequence[tuple] | None = None,
        dtypes: Sequence[torch.dtype | type] | None = None,
        *,
        dataset: Dataset | None = None,
    ) -> None:
        if rand_on_empty:
            raise ValueError(
                "rand_on_empty=True is not supported: returning random data for an empty "
                "Poisson batch changes the sampling the accountant assumes. Empty batches are "
                "handled as zero-size tensors (a noise-only step)."
            )
        self.wrapped_collator_fn = collator_fn
        self.batch_first = batch_first
        self.rand_on_empty = rand_on_empty
        self.sample_empty_shapes = sample_empty_shapes
        self.dtypes = dtypes
        self.dataset = dataset
        self._empty_batch: Any = None

    def _collate(self, batch: list[Any]) -> Any:
        return batch if self.wrapped_collator_fn is None else self.wrapped_collator_fn(batch)

    def _template(self, batch: Any) -> Any:
        return _empty_like_batch(batch, 0 if self.batch_first else 1)

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch) > 0:
            out = self._collate(batch)
            if self._empty_batch is None and self.dataset is None:
                self._empty_batch = self._template(out)
            return out
        if self._empty_batch is None:
            if self.dataset is not None:
                self._empty_batch = self._template(self._collate([self.dataset[0]]))
            elif self.sample_empty_shapes is not None and self.dtypes is not None:
                return [
                    torch.zeros(shape, dtype=dtype)
                    for shape, dtype in zip(self.sample_empty_shapes, self.dtypes)
                ]
            else:
                logger.warning(
                    "The first batch is empty and its structure is unknown: returning []. Pass "
                    "dataset= (or sample_empty_shapes= and dtypes=) to get zero-size tensors."
                )
                return []
        return self._empty_batch


def wrap_collate_with_empty(
    *,
    collate_fn: Callable | None,
    batch_first: bool = True,
    rand_on_empty: bool = False,
    sample_empty_shapes: Sequence[tuple] | None = None,
    dtypes: Sequence[torch.dtype | type] | None = None,
    dataset: Dataset | None = None,
) -> CollateFnWithEmpty:
    """``collate_fn`` that also handles empty batches (see :class:`CollateFnWithEmpty`); an
    already wrapped function is re-wrapped, not nested."""
    if isinstance(collate_fn, CollateFnWithEmpty):
        collate_fn = collate_fn.wrapped_collator_fn
    return CollateFnWithEmpty(
        collate_fn,
        batch_first=batch_first,
        rand_on_empty=rand_on_empty,
        sample_empty_shapes=sample_empty_shapes,
        dtypes=dtypes,
        dataset=dataset,
    )


def _loader_generator(generator: torch.Generator | None, secure_mode: bool) -> torch.Generator:
    """A private generator for the DataLoader's own draws (worker base seeds).

    ``DataLoader`` draws one number per iterator from its ``generator`` (or the global RNG); a
    dedicated generator keeps that draw from shifting the sampling or noise random streams, which
    makes a checkpointed-and-resumed run identical to an uninterrupted one.
    """
    g = torch.Generator()
    if secure_mode:
        seed = secure_generator_seed()
    else:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    g.manual_seed(seed)
    return g


_SAMPLER_FIX = (
    "Fix: put the records to train on in torch.utils.data.Subset(dataset, indices) and pass a "
    "plain DataLoader(subset, batch_size=...) (or DataLoader(dataset, batch_size=..., "
    "sampler=SubsetRandomSampler(indices))); or pass poisson_sampling=False to keep this "
    "sampler, knowing that only the no-amplification bound of PrivacyEngine.get_epsilon is then "
    "a proven guarantee."
)


def _unsupported_sampler(what: str, sampler: object, reason: str) -> ValueError:
    return ValueError(
        f"The data loader's {what} {type(sampler).__name__} cannot be turned into Poisson "
        f"sampling: {reason}. Poisson sampling (what the privacy accounting assumes) would draw "
        "from a different set of records, or with other probabilities, than this loader does, "
        "so the records trained on and the ones accounted for would differ. " + _SAMPLER_FIX
    )


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def loader_sampler(data_loader: DataLoader) -> Sampler:
    """The sampler that orders ``data_loader``'s records: its batch sampler's, else its own."""
    inner = getattr(data_loader.batch_sampler, "sampler", None)
    return inner if inner is not None else data_loader.sampler


def poisson_sampling_indices(
    data_loader: DataLoader, *, distributed: bool = False
) -> torch.Tensor | None:
    """The dataset indices that Poisson sampling of ``data_loader`` must draw from.

    ``None`` means the whole dataset: the loader's sampler is a ``SequentialSampler`` or a
    ``RandomSampler`` without replacement over all of it (or, in distributed training, a
    ``DistributedSampler`` over all of it with one replica per rank; or a dptorch Poisson
    sampler). For a ``SubsetRandomSampler`` it is its ``indices`` (a 1-D ``torch.long`` tensor):
    only those records may ever be trained on, and the accounting uses ``N = len(indices)``.

    Any other sampler or batch sampler (``WeightedRandomSampler``, ``RandomSampler`` with
    replacement or with ``num_samples``, a custom ``batch_sampler``, a ``DistributedSampler``
    outside distributed training, user classes) raises ``ValueError``: Poisson sampling cannot
    reproduce the set of records or the probabilities it draws with. So do duplicate or
    out-of-range subset indices.
    """
    dataset = data_loader.dataset
    n = len(dataset)  # type: ignore[arg-type]
    batch_sampler = data_loader.batch_sampler
    if isinstance(
        batch_sampler, (UniformWithReplacementSampler, DistributedUniformWithReplacementSampler)
    ):
        indices = batch_sampler.indices
        size = (
            batch_sampler.num_samples
            if isinstance(batch_sampler, UniformWithReplacementSampler)
            else batch_sampler.total_size
        )
        if indices is None and size != n:
            raise _unsupported_sampler(
                "batch_sampler",
                batch_sampler,
                f"it samples {size} records, not the {n} of the dataset",
            )
        return None if indices is None else _check_subset(indices, n)
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise _unsupported_sampler(
            "batch_sampler",
            batch_sampler,
            "a custom batch_sampler chooses the records of each batch",
        )
    sampler = loader_sampler(data_loader)
    if isinstance(sampler, SubsetRandomSampler):
        return _check_subset(sampler.indices, n)
    if type(sampler) is SequentialSampler:
        if len(sampler) != n:
            raise _unsupported_sampler(
                "sampler", sampler, f"it yields {len(sampler)} records, not the {n} of the dataset"
            )
        return None
    if type(sampler) is RandomSampler:
        if sampler.replacement:
            raise _unsupported_sampler(
                "sampler", sampler, "it draws records with replacement (replacement=True)"
            )
        if sampler.num_samples != n or len(sampler.data_source) != n:
            raise _unsupported_sampler(
                "sampler",
                sampler,
                f"it draws {sampler.num_samples} records per epoch from {len(sampler.data_source)}, "
                f"not each of the {n} records of the dataset once",
            )
        return None
    if type(sampler) is DistributedSampler:
        world = _world_size() if distributed else 1
        if sampler.num_replicas != world or len(sampler.dataset) != n:
            raise _unsupported_sampler(
                "sampler",
                sampler,
                f"it yields the shard of rank {sampler.rank} out of {sampler.num_replicas} replicas "
                f"of a {len(sampler.dataset)}-record dataset, but "
                + (
                    f"the world size is {world}"
                    if distributed
                    else "the model is not distributed (wrap it in DistributedDataParallel or "
                    "dptorch's DPDDP for distributed training, which samples each rank's shard)"
                ),
            )
        return None
    raise _unsupported_sampler(
        "sampler",
        sampler,
        "dptorch cannot tell which records it draws or with which probabilities (only "
        "SequentialSampler, RandomSampler without replacement, SubsetRandomSampler and, in "
        "distributed training, DistributedSampler are understood)",
    )


def check_data_loader(
    data_loader: DataLoader, *, poisson_sampling: bool = True, secure_mode: bool = False
) -> None:
    """Raises ``ValueError`` unless ``data_loader`` can be trained on privately: it has a
    non-empty sized dataset (map-style for ``poisson_sampling``) and yields batches; in
    ``secure_mode`` with Poisson sampling, it has no seeded generator (the sampling must come
    from the OS CSPRNG)."""
    dataset = getattr(data_loader, "dataset", None)
    if dataset is None:
        raise ValueError(
            "The data loader has no .dataset: the privacy accounting needs the dataset size."
        )
    if poisson_sampling and isinstance(dataset, IterableDataset):
        raise ValueError(
            "Poisson sampling needs a map-style dataset (len and indexing); got an "
            f"IterableDataset ({type(dataset).__name__})."
        )
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("The dataset has no len(): the accountant needs its size.") from None
    if n == 0:
        raise ValueError("The data loader's dataset is empty: there is nothing to train on.")
    if len(data_loader) == 0:
        raise ValueError("The data loader yields no batch (len(data_loader) == 0).")
    if isinstance(data_loader, DataLoader) and data_loader.batch_sampler is None:
        # batch_size=None (automatic batching off). Opacus 1.6 accepts it (q = 1 / N) and fails
        # later, at the first forward pass on the unbatched items.
        raise ValueError(
            "The data loader was built with batch_size=None (automatic batching off): it yields "
            "single records without a batch dimension, so there are no batches to sample and "
            "len(data_loader) is not a number of batches. Build it with a batch size, e.g. "
            "DataLoader(dataset, batch_size=256): with Poisson sampling each step's batch has "
            "batch_size records in expectation (q = 1 / len(data_loader))."
        )
    if secure_mode and poisson_sampling and getattr(data_loader, "generator", None) is not None:
        raise ValueError(
            "secure_mode=True: the data loader has a seeded generator, but the sampling must "
            "come from the OS CSPRNG. Build the DataLoader without generator=."
        )


def records_in_loader(
    data_loader: DataLoader, *, poisson_sampling: bool, distributed: bool = False
) -> int:
    """N, the number of records ``data_loader`` can yield: ``len(indices)`` of its
    ``SubsetRandomSampler``, else the dataset size. The accounting uses it (expected batch size
    ``q · N``, the δ < 1/N check).

    With ``poisson_sampling`` a sampler that Poisson sampling cannot reproduce raises
    ``ValueError`` (see :func:`poisson_sampling_indices`); without, a loader whose batches the
    accounting cannot charge does (see :func:`check_fixed_size_loader`)."""
    if poisson_sampling:
        indices = poisson_sampling_indices(data_loader, distributed=distributed)
        return len(data_loader.dataset) if indices is None else len(indices)  # type: ignore[arg-type]
    check_fixed_size_loader(data_loader, distributed=distributed)
    sampler = loader_sampler(data_loader)
    if isinstance(sampler, SubsetRandomSampler):
        return len(sampler.indices)
    return len(data_loader.dataset)  # type: ignore[arg-type]


def steps_per_pass(data_loader: DataLoader, poisson_sampling: bool = False) -> int | None:
    """``None`` with ``poisson_sampling`` (the accountant then charges Poisson-sampled steps).
    For a loader kept as it is (``poisson_sampling=False``): ``len(data_loader)`` when each
    pass over it provably uses every record at most once (:func:`uses_each_record_once`),
    else 1 (any step may use any record; the loader ``make_private`` returns then refuses a
    batch that holds a record twice, see :class:`DistinctIndicesBatchSampler`). The accountant
    charges one Gaussian per pass."""
    if poisson_sampling:
        return None
    return max(1, len(data_loader)) if uses_each_record_once(data_loader) else 1


def uses_each_record_once(data_loader: DataLoader) -> bool:
    """Whether each pass over ``data_loader`` provably uses every record at most once: torch's
    ``BatchSampler`` over a ``SequentialSampler``, a ``RandomSampler`` without replacement
    drawing at most ``N``, a ``SubsetRandomSampler`` of distinct indices, or a
    ``DistributedSampler`` that pads nothing. Exact types only: a subclass may draw otherwise
    (repeat records), as may any other sampler."""
    if isinstance(getattr(data_loader, "dataset", None), IterableDataset):
        return False
    if type(data_loader.batch_sampler) is not BatchSampler:
        return False
    sampler = loader_sampler(data_loader)
    kind = type(sampler)
    if kind is SequentialSampler:
        return True
    if kind is RandomSampler:
        return not sampler.replacement and sampler.num_samples <= len(sampler.data_source)
    if kind is SubsetRandomSampler:
        idx = [int(i) for i in sampler.indices]
        return len(set(idx)) == len(idx)
    if kind is DistributedSampler:
        return sampler.total_size <= len(sampler.dataset)  # type: ignore[arg-type]
    return False


_FIXED_SIZE_FIX = (
    "Fix: poisson_sampling=True (dptorch draws Poisson batches from the records this loader "
    "draws from), or a sampler that draws without replacement (shuffle=True, "
    "RandomSampler(replacement=False), WeightedRandomSampler(..., replacement=False), "
    "SubsetRandomSampler of distinct indices)."
)


def check_fixed_size_loader(data_loader: DataLoader, *, distributed: bool = False) -> None:
    """Raises ``ValueError`` unless the accounting of ``poisson_sampling=False`` can charge
    ``data_loader``'s batches: each release is charged as one Gaussian in which a record
    contributes at most one clipped gradient (per pass of ``len(data_loader)`` steps for the
    samplers of :func:`uses_each_record_once`, per step otherwise). Refused: a sampler that
    draws with replacement (``WeightedRandomSampler`` or ``RandomSampler`` with
    ``replacement=True``: a record drawn ``k`` times into one batch is clipped ``k`` times and
    moves the sum by ``k·C``), an ``IterableDataset`` (no indices: nothing to check), and, in
    distributed training, anything but a ``DistributedSampler`` that gives each rank a disjoint
    shard (else one record can be in several ranks' batches of one release). Batches of other
    samplers are checked as they are drawn (:class:`DistinctIndicesBatchSampler`)."""
    if isinstance(data_loader.dataset, IterableDataset):
        raise ValueError(
            f"poisson_sampling=False with an IterableDataset ({type(data_loader.dataset).__name__}): "
            "the dataset, not a sampler, decides which records each batch holds, so dptorch "
            "cannot check that a batch holds each record at most once, which the accounting "
            "assumes (every step is charged as one Gaussian of sensitivity max_grad_norm). "
            "Fix: a map-style dataset (len and indexing), with poisson_sampling=True or a "
            "sampler without replacement."
        )
    sampler = loader_sampler(data_loader)
    if isinstance(sampler, (RandomSampler, WeightedRandomSampler)) and getattr(
        sampler, "replacement", False
    ):
        raise ValueError(
            f"poisson_sampling=False with a {type(sampler).__name__}(replacement=True): it "
            "draws records with replacement, so one batch can hold a record several times. Each "
            "copy is clipped on its own and a record drawn k times moves the summed gradient by "
            "k·max_grad_norm, while the accounting charges every step as one Gaussian in which "
            "a record contributes at most max_grad_norm: epsilon would be under-reported. "
            + _FIXED_SIZE_FIX
        )
    if distributed:
        world = _world_size()
        if not (
            type(data_loader.batch_sampler) is BatchSampler
            and type(sampler) is DistributedSampler
            and sampler.num_replicas == world
            and sampler.total_size <= len(sampler.dataset)  # type: ignore[arg-type]
        ):
            raise ValueError(
                "poisson_sampling=False in distributed training needs each rank's data loader "
                "to draw a disjoint shard of the data: a DistributedSampler(dataset, "
                f"num_replicas={world}) (drop_last=True, or a dataset size divisible by the "
                f"world size, so that it pads no record into two shards); got a "
                f"{type(sampler).__name__}. A release sums the ranks' batches, so a record in "
                "several ranks' batches moves it by several clipped gradients while the "
                "accounting charges one. Or use poisson_sampling=True (dptorch gives each rank "
                "its share of one Poisson batch)."
            )
        _check_shards_agree(sampler)


def _check_shards_agree(sampler: DistributedSampler) -> None:
    """The ranks' ``DistributedSampler``s shard one permutation disjointly only if each has its
    own rank and all agree on the seed, shuffling, ``drop_last`` and the data set's size (a
    ``seed=rank``, or a hard-coded ``rank``, puts one record into several ranks' batches).
    Every rank gathers every rank's settings first, so all raise together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = (dist.get_rank(), sampler.rank, sampler.seed, sampler.shuffle, sampler.drop_last,
            len(sampler.dataset), sampler.num_replicas)  # type: ignore[arg-type]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    wrong = [(r, s) for r, s, *_ in everyone if r != s]
    if wrong:
        raise ValueError(
            "poisson_sampling=False in distributed training: DistributedSampler built with "
            f"another rank than its process's ((process rank, sampler rank): {wrong}), so two "
            "ranks draw the same shard and a record's clipped gradient is summed twice into one "
            "release, which the accounting charges once. Fix: DistributedSampler(dataset) (it "
            "reads the rank of the process group), or rank=torch.distributed.get_rank()."
        )
    if any(other[2:] != mine[2:] for other in everyone):
        raise ValueError(
            "poisson_sampling=False in distributed training: the ranks' DistributedSamplers "
            "disagree on (seed, shuffle, drop_last, dataset size, num_replicas): "
            f"{[other[2:] for other in everyone]}. Their shards are then cuts of different "
            "permutations, which can put a record into several ranks' batches of one release "
            "while the accounting charges it once. Fix: the same seed on every rank (not "
            "seed=rank), the same data set and options, and sampler.set_epoch(epoch) on every "
            "rank."
        )


class DistinctIndicesBatchSampler(Sampler[list[int]]):
    """The batches of ``batch_sampler``, each checked to hold every dataset index at most once
    (``ValueError`` otherwise, naming the index): what the ``poisson_sampling=False`` accounting
    assumes of a sampler it cannot identify. Other attributes are the wrapped sampler's (read
    and written through), so generator switching and checkpoints see its generators."""

    def __init__(self, batch_sampler: Sampler, num_records: int | None = None) -> None:
        object.__setattr__(self, "batch_sampler", batch_sampler)
        object.__setattr__(self, "num_records", num_records)

    def _key(self, i: Any) -> Any:
        """The record an index names: ``i`` and ``i - N`` (a negative index) are one record of a
        dataset of ``N`` records."""
        if isinstance(i, torch.Tensor) and i.numel() == 1:
            i = i.item()
        if hasattr(i, "__index__") and not isinstance(i, bool):
            i = int(i.__index__())
            n = self.num_records
            if n is not None and -n <= i < 0:
                i += n
        return i

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batch_sampler:
            raw = batch.tolist() if isinstance(batch, torch.Tensor) else batch
            keys = [self._key(i) for i in raw]
            if len(set(keys)) != len(keys):
                seen: set = set()
                twice = next(i for i in keys if i in seen or seen.add(i))
                raise ValueError(
                    f"poisson_sampling=False: the data loader's sampler put dataset index {twice!r} "
                    f"into one batch {keys.count(twice)} times ({type(self.batch_sampler).__name__} "
                    f"over {type(getattr(self.batch_sampler, 'sampler', None)).__name__}, which "
                    "dptorch cannot prove draws each record at most once). The accounting charges "
                    "every step as one Gaussian in which a record contributes at most one clipped "
                    "gradient; a record drawn k times moves the sum by k·max_grad_norm, so epsilon "
                    "would be under-reported. " + _FIXED_SIZE_FIX
                )
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("batch_sampler", "num_records") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.batch_sampler, name, value)


def expected_batch_size(num_records: int, sample_rate: float, distributed: bool = False) -> float:
    """``q · N``, robust to float round-off. Distributed: the per-rank share
    ``q · N / world_size``, kept fractional so that the distributed optimizer's division by
    ``expected_batch_size × world_size`` is exactly by ``q · N``."""
    expected = max(1, int(num_records * sample_rate + 1e-9))
    return expected / _world_size() if distributed else expected


def prepare_data_loader(
    data_loader: DataLoader,
    *,
    poisson_sampling: bool,
    distributed: bool = False,
    batch_first: bool = True,
    secure_mode: bool = False,
) -> DataLoader:
    """The loader ``make_private`` trains with: a Poisson-sampling :class:`DPDataLoader` over the
    records ``data_loader`` draws from, or, with ``poisson_sampling=False``, ``data_loader``
    itself with a warning (the accounting assumes Poisson sampling); in ``secure_mode`` its
    shuffling is then reseeded from the OS CSPRNG. A sampler that is not known to use each
    record at most once per pass (:func:`uses_each_record_once`) gives instead a DataLoader
    with the same dataset, collate function, generator and worker settings whose batch sampler
    refuses a batch holding a record twice (:class:`DistinctIndicesBatchSampler`)."""
    if poisson_sampling:
        return DPDataLoader.from_data_loader(
            data_loader, distributed=distributed, batch_first=batch_first, secure_mode=secure_mode
        )
    warnings.warn(
        "poisson_sampling=False: batches are not Poisson samples, but the privacy accounting "
        "assumes Poisson sampling with rate 1/len(data_loader): the accountant's amplified "
        "epsilon (engine.accountant.get_epsilon) is not a proven guarantee for this training. "
        "PrivacyEngine.get_epsilon reports the sound, larger bound instead (no amplification, "
        "replace-one neighbours, each record used once per pass) and states its assumptions.",
        UserWarning,
        stacklevel=4,
    )
    if secure_mode:
        gen = torch.Generator()
        gen.manual_seed(secure_generator_seed())
        try:
            switch_generator(data_loader=data_loader, generator=gen)
        except ValueError:
            logger.info("secure_mode: the data loader draws no random numbers to secure.")
    if uses_each_record_once(data_loader):
        return data_loader
    # a sampler dptorch cannot identify: every batch is checked as it is drawn
    carried = {k: getattr(data_loader, k) for k in _CARRIED_KWARGS if hasattr(data_loader, k)}
    try:
        n = len(data_loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    checked = DataLoader(
        data_loader.dataset,
        batch_sampler=DistinctIndicesBatchSampler(data_loader.batch_sampler, n),
        collate_fn=data_loader.collate_fn,
        generator=data_loader.generator,
        **carried,
    )
    # what code reads of the user's loader (``loader.sampler.set_epoch``, ``batch_size``,
    # ``drop_last``) stays the user's: only batch_sampler, which draws the batches, is checked
    for name in ("sampler", "batch_size", "drop_last"):
        object.__setattr__(checked, name, getattr(data_loader, name))
    return checked


def _check_subset(
    indices: Sequence[int] | torch.Tensor, n: int, name: str = "The SubsetRandomSampler's indices"
) -> torch.Tensor:
    """Subset indices as a tensor, each in ``[0, n)`` and distinct (``ValueError`` otherwise)."""
    try:
        t = as_index_tensor(indices, size=len(indices), name=name)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{name} must be integers: {e}") from None
    if t.numel() == 0:
        raise ValueError(f"{name} are empty: there is nothing to train on.")
    bad = t[(t < 0) | (t >= n)]
    if bad.numel():
        raise ValueError(
            f"{name} must be in [0, {n}) (the dataset has {n} records), got "
            f"{bad[:5].tolist()}{' ...' if bad.numel() > 5 else ''}. Use non-negative positions "
            "in the loader's dataset."
        )
    return t


class DPDataLoader(DataLoader):
    """DataLoader over a map-style dataset with Poisson-sampled batches.

    Each record (of ``indices`` when given, else of the whole dataset) joins each batch
    independently with probability ``sample_rate``; an epoch is ``1 / sample_rate`` batches
    (``len()``). Empty batches are zero-size tensors.

    Args:
        dataset: a map-style dataset.
        sample_rate: probability ``q`` of each record joining each batch, in (0, 1].
        collate_fn: as in DataLoader (wrapped to handle empty batches).
        drop_last: accepted for compatibility; ignored (Poisson batches have no "last").
        generator: ``torch.Generator`` for the sampling (global RNG when ``None``).
        distributed: DDP sampling (one shard of every Poisson batch per rank).
        batch_first: whether the batch dimension of collated tensors is 0 (empty batches).
        secure_mode: sampling randomness from the OS CSPRNG (no generator allowed).
        indices: the dataset indices to sample from (distinct, in ``[0, len(dataset))``; a
            training subset). ``None``: the whole dataset. Records outside it are never drawn.
        **kwargs: other DataLoader arguments (num_workers, pin_memory, ...).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        collate_fn: Callable | None = None,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        distributed: bool = False,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        secure_mode: bool = False,
        indices: Sequence[int] | torch.Tensor | None = None,
        **kwargs,
    ):
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "Poisson sampling needs a map-style dataset (with __len__ and __getitem__); got "
                f"an IterableDataset ({type(dataset).__name__})."
            )
        if rand_on_empty:
            raise NotImplementedError(
                "rand_on_empty is not supported: replacing an empty Poisson batch by a random "
                "record changes the sampling the accountant assumes. Empty batches are handled "
                "(zero-size tensors, noise-only step)."
            )
        validate_sample_rate(sample_rate)
        num_samples = len(dataset)  # type: ignore[arg-type]
        if num_samples == 0:
            raise ValueError("The dataset is empty: there is nothing to train on.")
        if indices is not None:
            indices = _check_subset(indices, num_samples, name="indices")
            num_samples = len(indices)
        if drop_last:
            logger.info("DPDataLoader ignores drop_last: Poisson batches have no partial last batch.")
        self.sample_rate = sample_rate
        self.distributed = distributed
        self.secure_mode = secure_mode
        batch_sampler = self._make_batch_sampler(
            num_samples=num_samples,
            sample_rate=sample_rate,
            generator=generator,
            distributed=distributed,
            secure_mode=secure_mode,
            indices=indices,
        )
        kwargs.pop("batch_size", None)
        kwargs.pop("shuffle", None)
        kwargs.pop("sampler", None)
        kwargs.pop("batch_sampler", None)
        super().__init__(
            dataset=dataset,
            batch_sampler=batch_sampler,
            collate_fn=wrap_collate_with_empty(
                collate_fn=default_collate if collate_fn is None else collate_fn,
                batch_first=batch_first,
                dataset=dataset,
            ),
            generator=_loader_generator(generator, secure_mode),
            **kwargs,
        )

    @staticmethod
    def _make_batch_sampler(
        *,
        num_samples: int,
        sample_rate: float,
        generator: torch.Generator | None,
        distributed: bool,
        secure_mode: bool,
        indices: torch.Tensor | None = None,
    ) -> Sampler:
        """The Poisson batch sampler over ``num_samples`` records (the entries of ``indices``
        when given) (hook for the distributed variant)."""
        if distributed:
            # each rank Poisson-samples its own shard of the data set (dptorch.distributed)
            return DistributedUniformWithReplacementSampler(
                total_size=num_samples,
                sample_rate=sample_rate,
                generator=generator,
                secure_mode=secure_mode,
                indices=indices,
            )
        return UniformWithReplacementSampler(
            num_samples=num_samples,
            sample_rate=sample_rate,
            generator=generator,
            secure_mode=secure_mode,
            indices=indices,
        )

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        distributed: bool = False,
        generator: torch.Generator | None = None,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        secure_mode: bool = False,
    ) -> DPDataLoader:
        """A DPDataLoader over ``data_loader``'s dataset with ``sample_rate = 1 / len(data_loader)``.

        Keeps the dataset, collate function and worker settings; batching is replaced by Poisson
        sampling over the records the loader draws from: the whole dataset, or the ``indices``
        of its ``SubsetRandomSampler`` (held-out records are never drawn). Samplers whose records
        or probabilities Poisson sampling cannot reproduce (``WeightedRandomSampler``, sampling
        with replacement, custom batch samplers, ...) raise ``ValueError``; see
        :func:`poisson_sampling_indices`. ``generator`` defaults to ``data_loader.generator``
        (ignored in secure mode only if it is ``None``; a seeded generator with ``secure_mode``
        is an error).
        """
        check_data_loader(data_loader)
        return cls(
            **rebuilt_loader_kwargs(data_loader, generator, secure_mode, distributed),
            distributed=distributed,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
            secure_mode=secure_mode,
        )


def rebuilt_loader_kwargs(
    data_loader: DataLoader, generator: torch.Generator | None, secure_mode: bool,
    distributed: bool = False,
) -> dict[str, Any]:
    """The arguments of a Poisson loader that replaces ``data_loader``: its dataset, the sample
    rate ``1 / len(data_loader)``, the records it draws from (:func:`poisson_sampling_indices`),
    its collate function and worker settings, and ``generator`` (default: the loader's, except
    in secure mode)."""
    if generator is None and not secure_mode:
        generator = data_loader.generator
    carried = {k: getattr(data_loader, k) for k in _CARRIED_KWARGS if hasattr(data_loader, k)}
    return dict(
        dataset=data_loader.dataset,
        sample_rate=1 / len(data_loader),
        indices=poisson_sampling_indices(data_loader, distributed=distributed),
        collate_fn=data_loader.collate_fn,
        generator=generator,
        **carried,
    )


def switch_generator(*, data_loader: DataLoader, generator: torch.Generator | None) -> DataLoader:
    """Makes ``data_loader``'s sampling use ``generator`` (in place; returns the loader).

    Works on Poisson (``UniformWithReplacementSampler``) and shuffling (``RandomSampler``)
    loaders; raises ``ValueError`` when the sampling has no generator to switch.
    """
    for sampler in (data_loader.batch_sampler, data_loader.sampler):
        if sampler is not None and hasattr(sampler, "generator"):
            sampler.generator = generator
            return data_loader
        inner = getattr(sampler, "sampler", None)  # BatchSampler(RandomSampler)
        if inner is not None and hasattr(inner, "generator"):
            inner.generator = generator
            return data_loader
    raise ValueError(
        f"Cannot switch the generator of {type(data_loader).__name__}: its sampler "
        f"({type(data_loader.sampler).__name__}) draws no random numbers."
    )

