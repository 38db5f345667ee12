"""Samplings beyond plain Poisson batches: fixed-shape Poisson batches and user-level units.

``make_private(poisson_sampling="fixed_shape", max_batch_size=M)``
    Each step draws a Poisson batch (every record with probability q), then fills a physical
    batch of exactly ``M`` rows: the sampled records, then padding rows. A padding row gets clip
    factor 0, so it adds nothing to the released gradient, in every mode. If more than ``M``
    records are drawn, a uniformly random subset of ``M`` is kept; the probability of that,
    ``P(Binomial(N + 1, q) > M)`` per step (N + 1: the larger of two neighbouring data sets),
    summed over the run into ``τ``, costs ``(1 + e^ε)·τ`` of δ (:func:`truncated_delta`). Shapes never change, which
    ``torch.compile`` and CUDA graphs need and which hides the batch size from timing.

``make_private(privacy_unit="user", user_id=..., max_records_per_user=m)``
    The unit of privacy is a user, who may own many records. Each step draws every *user* with
    probability q (``1 / len(data_loader)``), then up to ``m`` of each drawn user's records (a
    uniformly random subset when the user has more; all of them when ``m`` is ``None``). The
    gradient that is clipped to C is the *sum* of a user's per-record gradients, so adding or
    removing a user changes the released sum by at most C: the accountant's ε, at rate q, is
    user-level.

The sampler tells the clipping which rows are padding and which rows belong to one user through
a :class:`~dptorch.utils.batch_layout.LayoutQueue` shared with the optimizer's clipping contract.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from .accountants.truncation import (  # noqa: F401 - re-exported: dptorch.sampling's API
    Truncation,
    epsilon_with_truncation,
    rank_rows,
    step_truncation_probability,
    truncated_delta,
    truncation_delta,
    truncation_probability,
)
from .data_loader import DPDataLoader, poisson_sampling_indices, rebuilt_loader_kwargs
from .utils._poisson import check_secure_generator, poisson_mask, resolve_steps
from .utils.batch_layout import BatchLayout, LayoutQueue
from .utils.randomness import secure_uniform
from .utils.uniform_sampler import DistributedUniformWithReplacementSampler

logger = logging.getLogger(__name__)

__all__ = [
    "FixedShapePoissonSampler",
    "SamplingPlan",
    "UserPoissonSampler",
    "LayoutDataLoader",
    "DistributedFixedShapePoissonSampler",
    "choose_max_batch_size",
    "rank_rows",
    "step_truncation_probability",
    "truncation_probability",
    "truncation_delta",
    "sampling_plan",
]

#: per-step truncation probability that ``make_private`` aims for when it chooses M itself
DEFAULT_TRUNCATION_PER_STEP = 1e-10


def choose_max_batch_size(num_records: int, sample_rate: float, per_step: float) -> int:
    """The smallest ``M`` whose :func:`truncation_probability` is at most ``per_step``."""
    from scipy.stats import binom

    m = int(binom.isf(per_step, num_records + 1, sample_rate))
    while truncation_probability(num_records, sample_rate, m) > per_step:
        m += 1
    while m > 0 and truncation_probability(num_records, sample_rate, m - 1) <= per_step:
        m -= 1
    return max(m, 1)


def _random_subset(idx: torch.Tensor, k: int, generator, secure_mode: bool) -> torch.Tensor:
    """``k`` entries of ``idx`` drawn uniformly without replacement."""
    if secure_mode:
        order = secure_uniform((idx.numel(),)).argsort()
    else:
        order = torch.randperm(idx.numel(), generator=generator)
    return idx[order[:k]]


class FixedShapePoissonSampler(Sampler[list[int]]):
    """Poisson batches in a fixed shape: ``steps`` batches of exactly ``max_batch_size``
    indices each, the Poisson-sampled records first, then padding (the first record of the pool,
    marked as padding in the pushed :class:`BatchLayout`). Truncates to a uniformly random
    subset when more are drawn (counted in :attr:`truncations`).

    Args: as :class:`~dptorch.utils.uniform_sampler.UniformWithReplacementSampler`, plus
        ``max_batch_size`` (M) and ``layouts`` (the queue the layouts are pushed to).
    """

    def __init__(self, *, num_samples: int, sample_rate: float, max_batch_size: int,
                 layouts: LayoutQueue, generator: torch.Generator | None = None,
                 steps: int | None = None, secure_mode: bool = False,
                 indices: torch.Tensor | None = None):
        check_secure_generator(secure_mode, generator)
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self.max_batch_size, self.layouts = max_batch_size, layouts
        self.generator, self.secure_mode = generator, secure_mode
        self.steps = resolve_steps(steps, sample_rate)
        self.indices = indices
        self.truncations = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        pool = self.indices if self.indices is not None else torch.arange(self.num_samples)
        m = self.max_batch_size
        for _ in range(self.steps):
            picked = poisson_mask(self.num_samples, self.sample_rate, self.generator,
                                  self.secure_mode).nonzero().reshape(-1)
            if picked.numel() > m:
                self.truncations += 1
                picked = _random_subset(picked, m, self.generator, self.secure_mode).sort().values
            k = picked.numel()
            rows = torch.cat([pool[picked], pool[:1].expand(m - k)])
            self.layouts.push(BatchLayout.records(k, m))
            yield rows.tolist()


class DistributedFixedShapePoissonSampler(DistributedUniformWithReplacementSampler):
    """Fixed-shape Poisson batches under DDP: each rank Poisson-samples its shard (as
    :class:`~dptorch.utils.uniform_sampler.DistributedUniformWithReplacementSampler`) and fills
    a batch of exactly ``max_batch_size`` rows (this rank's share, the same on every rank) with
    the drawn records, then padding; a uniformly random subset is kept when more are drawn."""

    def __init__(self, *, max_batch_size: int, layouts: LayoutQueue, **kwargs: Any):
        super().__init__(**kwargs)
        self.max_batch_size, self.layouts = max_batch_size, layouts
        self.truncations = 0

    def __iter__(self) -> Iterator[list[int]]:
        shard, m = self.shard(), self.max_batch_size
        for _ in range(self.steps):
            picked = self.sample_mask().nonzero().reshape(-1)
            if picked.numel() > m:
                self.truncations += 1
                picked = _random_subset(picked, m, self.rank_generator,
                                        self.secure_mode).sort().values
            k = picked.numel()
            self.layouts.push(BatchLayout.records(k, m))
            yield torch.cat([shard[picked], shard[:1].expand(m - k)]).tolist()
        self.epoch += 1


class UserPoissonSampler(Sampler[list[int]]):
    """User-level Poisson batches: each user joins each batch with probability
    ``sample_rate``, with up to ``max_records_per_user`` of their records (uniformly chosen when
    they have more). A user's rows are contiguous; the pushed :class:`BatchLayout` maps rows to
    users.

    Args:
        user_of: ``(n,)`` long, the user (``0 .. U-1``) of each record of the pool.
        sample_rate: q, the probability that a user joins a batch.
        max_records_per_user: m, or ``None`` for all of a user's records.
        layouts: the queue the layouts are pushed to.
        generator, steps, secure_mode: as for Poisson batches.
        indices: the dataset index of each record of the pool (``None``: ``range(n)``).
    """

    def __init__(self, *, user_of: torch.Tensor, sample_rate: float,
                 max_records_per_user: int | None, layouts: LayoutQueue,
                 generator: torch.Generator | None = None, steps: int | None = None,
                 secure_mode: bool = False, indices: torch.Tensor | None = None):
        check_secure_generator(secure_mode, generator)
        self.sample_rate, self.max_records_per_user = sample_rate, max_records_per_user
        self.layouts, self.generator, self.secure_mode = layouts, generator, secure_mode
        self.steps = resolve_steps(steps, sample_rate)
        pool = indices if indices is not None else torch.arange(user_of.numel())
        order = torch.argsort(user_of, stable=True)
        self._records = pool[order]
        counts = torch.bincount(user_of)
        self.num_users = int(counts.numel())
        self._counts = counts.tolist()
        self._offsets = (torch.cumsum(counts, 0) - counts).tolist()

    def __len__(self) -> int:
        return self.steps

    def user_records(self, u: int) -> torch.Tensor:
        """The dataset indices of user ``u``'s records."""
        return self._records[self._offsets[u]: self._offsets[u] + self._counts[u]]

    def __iter__(self) -> Iterator[list[int]]:
        m = self.max_records_per_user
        for _ in range(self.steps):
            users = poisson_mask(self.num_users, self.sample_rate, self.generator,
                                 self.secure_mode).nonzero().reshape(-1).tolist()
            rows, groups = [], []
            for slot, u in enumerate(users):
                recs = self.user_records(u)
                if m is not None and recs.numel() > m:
                    recs = _random_subset(recs, m, self.generator, self.secure_mode).sort().values
                rows.append(recs)
                groups.append(torch.full((recs.numel(),), slot, dtype=torch.long))
            idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
            g = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.long)
            self.layouts.push(BatchLayout(g, len(users)))
            yield idx.tolist()


class LayoutDataLoader(DPDataLoader):
    """A :class:`~dptorch.data_loader.DPDataLoader` whose batch sampler is a fixed-shape or a
    user-level sampler; it activates each batch's layout in :attr:`layouts` when it yields the
    batch (batches come in sampler order; ``in_order=False`` is refused)."""

    def __init__(self, dataset: Dataset, *, make_sampler: Callable[..., Sampler],
                 layouts: LayoutQueue, **kwargs: Any):
        if kwargs.get("in_order") is False:
            raise ValueError(
                "in_order=False: the data loader may yield batches out of the order they were "
                "drawn in, and the layout of each batch (which rows are padding or one user's) "
                "would not match it. Keep in_order=True."
            )
        self._sampler_factory, self.layouts = make_sampler, layouts
        super().__init__(dataset, **kwargs)

    def _make_batch_sampler(self, *, num_samples, sample_rate, generator, distributed,
                            secure_mode, indices=None) -> Sampler:
        return self._sampler_factory(num_samples=num_samples, sample_rate=sample_rate,
                                     generator=generator, secure_mode=secure_mode,
                                     indices=indices, distributed=distributed)

    def __iter__(self):
        return iterate_with_layouts(super().__iter__, self.layouts)


def iterate_with_layouts(batches: Callable[[], Iterator[Any]], layouts: LayoutQueue) -> Iterator[Any]:
    """Yields the batches of ``batches()``, making each one's layout current as it is yielded,
    as one pass of ``layouts`` (:meth:`LayoutQueue.begin`: layouts of an abandoned pass are
    dropped, and that pass can no longer activate one)."""
    layouts.required = True
    token = layouts.begin()
    try:
        for batch in batches():
            layouts.activate(token)
            yield batch
    finally:
        layouts.end(token)


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class SamplingPlan:
    """How ``make_private`` draws batches, as plain data.

    Attributes:
        poisson: Poisson sampling (record- or user-level); ``False``: the loader as it is.
        fixed_shape: pad (and truncate) every batch to ``max_batch_size`` rows.
        max_batch_size: M (fixed shape), else ``None``.
        privacy_unit: ``"record"`` or ``"user"``.
        user_of: ``(N,)`` long, the user of each dataset record (user level).
        max_records_per_user: m (user level; ``None``: all of a user's records).
        world_size: the DDP ranks sharing a fixed shape (each pads to ``ceil(M / W)`` rows).
    """

    poisson: bool = True
    fixed_shape: bool = False
    max_batch_size: int | None = None
    privacy_unit: str = "record"
    user_of: torch.Tensor | None = None
    max_records_per_user: int | None = None
    world_size: int = 1

    @property
    def needs_layout(self) -> bool:
        return self.fixed_shape or self.privacy_unit == "user"

    def truncation(self, num_records: int) -> Truncation | None:
        """What the accountant needs to charge truncation (fixed shape), else ``None``."""
        if not self.fixed_shape:
            return None
        return Truncation(num_records, self.max_batch_size or 0, self.world_size)

    def units(self, data_loader: Any, num_records: int) -> int:
        """The number of privacy units ``data_loader`` draws from (users, or records)."""
        if self.privacy_unit != "user":
            return num_records
        indices = poisson_sampling_indices(data_loader)
        users = self.user_of if indices is None else self.user_of[indices]
        return int(users.unique().numel())

    def loader(self, data_loader: Any, *, layouts: LayoutQueue, **kwargs: Any) -> LayoutDataLoader:
        """The :class:`LayoutDataLoader` that draws batches by this plan from the records
        ``data_loader`` draws from."""
        settings = rebuilt_loader_kwargs(data_loader, kwargs.pop("generator", None),
                                         kwargs.get("secure_mode", False),
                                         kwargs.get("distributed", False))
        indices = settings["indices"]

        if self.privacy_unit == "user":
            users = self.user_of if indices is None else self.user_of[indices]
            _, user_of = users.unique(return_inverse=True)

            def make(*, num_samples, sample_rate, generator, secure_mode, indices, distributed):
                return UserPoissonSampler(
                    user_of=user_of, sample_rate=sample_rate, layouts=layouts,
                    max_records_per_user=self.max_records_per_user, generator=generator,
                    secure_mode=secure_mode, indices=indices)
        else:
            rows = rank_rows(self.max_batch_size or 0, self.world_size)

            def make(*, num_samples, sample_rate, generator, secure_mode, indices, distributed):
                if distributed:
                    return DistributedFixedShapePoissonSampler(
                        total_size=num_samples, sample_rate=sample_rate, max_batch_size=rows,
                        layouts=layouts, generator=generator, secure_mode=secure_mode,
                        indices=indices)
                return FixedShapePoissonSampler(
                    num_samples=num_samples, sample_rate=sample_rate, layouts=layouts,
                    max_batch_size=rows, generator=generator, secure_mode=secure_mode,
                    indices=indices)

        return LayoutDataLoader(make_sampler=make, layouts=layouts, **settings, **kwargs)


def _user_ids(user_id: Any, dataset: Dataset) -> torch.Tensor:
    """``(N,)`` long user index of each record from ``user_id``: a function of the record, or
    a sequence / tensor with one entry per record."""
    n = len(dataset)  # type: ignore[arg-type]
    if callable(user_id):
        values = [user_id(dataset[i]) for i in range(n)]
    elif isinstance(user_id, (torch.Tensor, Sequence)) and not isinstance(user_id, str):
        values = user_id.tolist() if isinstance(user_id, torch.Tensor) else list(user_id)
        if len(values) != n:
            raise ValueError(
                f"user_id has {len(values)} entries but the dataset has {n} records: give one "
                "user id per record (a dataset column), or a function of the record."
            )
    else:
        raise ValueError(
            "privacy_unit='user' needs user_id=: a function record -> user id, or a sequence "
            f"with one user id per record; got {type(user_id).__name__}."
        )
    codes: dict[Any, int] = {}
    try:
        out = [codes.setdefault(v.item() if isinstance(v, torch.Tensor) else v, len(codes))
               for v in values]
    except TypeError as e:
        raise ValueError(f"user ids must be hashable (ints or strings): {e}") from None
    return torch.tensor(out, dtype=torch.long)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


def sampling_plan(poisson_sampling: Any, kwargs: dict[str, Any], dataset: Dataset | None, *,
                  batch_rate: Callable[[], tuple[float, int]] | None = None,
                  truncation_target: float | None = None, world_size: int = 1) -> SamplingPlan:
    """The :class:`SamplingPlan` of ``make_private``'s ``poisson_sampling`` and the keyword
    arguments it pops from ``kwargs``: ``max_batch_size``, ``privacy_unit``, ``user_id``,
    ``max_records_per_user``. Raises ``ValueError`` on anything inconsistent, before training.

    ``batch_rate()`` gives ``(q, N)`` when M must be chosen; ``truncation_target`` is the
    per-step truncation probability to aim for (default :data:`DEFAULT_TRUNCATION_PER_STEP`);
    ``world_size``: the DDP ranks that share the fixed shape.
    """
    max_batch_size = kwargs.pop("max_batch_size", None)
    unit = kwargs.pop("privacy_unit", "record")
    user_id = kwargs.pop("user_id", None)
    max_per_user = kwargs.pop("max_records_per_user", None)
    if poisson_sampling not in (True, False, "fixed_shape") or (
        isinstance(poisson_sampling, int) and not isinstance(poisson_sampling, bool)
    ):
        raise ValueError(
            f"poisson_sampling must be True, False or 'fixed_shape', got {poisson_sampling!r}."
        )
    if unit not in ("record", "user"):
        raise ValueError(f"privacy_unit must be 'record' or 'user', got {unit!r}.")
    fixed = poisson_sampling == "fixed_shape"
    if max_batch_size is not None and not fixed:
        raise ValueError("max_batch_size is the fixed shape of poisson_sampling='fixed_shape'; "
                         "pass that too, or drop max_batch_size.")
    if unit == "record" and (user_id is not None or max_per_user is not None):
        raise ValueError("user_id and max_records_per_user need privacy_unit='user'.")
    if unit == "user":
        if poisson_sampling is not True:
            raise ValueError(
                "privacy_unit='user' draws users by Poisson sampling: use poisson_sampling=True "
                "(fixed-shape user batches are not supported yet)."
            )
        if max_per_user is not None:
            _positive_int("max_records_per_user", max_per_user)
        if dataset is None:
            raise ValueError("privacy_unit='user' needs the data loader's dataset.")
        return SamplingPlan(privacy_unit="user", user_of=_user_ids(user_id, dataset),
                            max_records_per_user=max_per_user)
    if not fixed:
        return SamplingPlan(poisson=bool(poisson_sampling))
    if max_batch_size is None:
        q, n = batch_rate()  # type: ignore[misc]
        target = DEFAULT_TRUNCATION_PER_STEP if truncation_target is None else truncation_target
        # each rank's share: the largest shard, at a W-th of the target (summed over ranks)
        shard = len(range(0, n, world_size))
        max_batch_size = world_size * choose_max_batch_size(shard, q, target / world_size)
    else:
        _positive_int("max_batch_size", max_batch_size)
    return SamplingPlan(fixed_shape=True, max_batch_size=max_batch_size, world_size=world_size)


def describe_truncation(plan: SamplingPlan, num_records: int, sample_rate: float) -> str:
    """One line for the log: M, the expected batch and the per-step truncation probability."""
    m = plan.max_batch_size or 0
    p = step_truncation_probability(num_records, sample_rate, m, plan.world_size)
    mean = num_records * sample_rate
    ranks = (f" ({rank_rows(m, plan.world_size)} on each of {plan.world_size} ranks)"
             if plan.world_size > 1 else "")
    return (f"fixed-shape Poisson batches of {m} rows{ranks} (expected {mean:.1f} records, sd "
            f"{math.sqrt(mean * (1 - sample_rate)):.1f}): truncated with probability {p:.3g} "
            "per step, which costs (1 + e^eps) times that in delta")


# ----------------------------------------------------------------------------- engine glue
def check_plan(plan: SamplingPlan, *, mode: str, clipping: str, distributed: bool,
               multi_pass: bool) -> None:
    """Refuses, before training, the settings a fixed-shape or user-level plan cannot serve
    exactly (``ValueError`` naming the setting and the fix)."""
    if not plan.needs_layout:
        return
    what = "privacy_unit='user'" if plan.privacy_unit == "user" else "poisson_sampling='fixed_shape'"
    problems = []
    if distributed and plan.privacy_unit == "user":
        problems.append("distributed training (DDP)")
    if multi_pass:
        problems.append("multi_pass=True")
    if clipping == "adaptive":
        problems.append("clipping='adaptive' (its unclipped count would count padding rows or "
                        "records instead of units)")
    if clipping == "per_layer" and plan.privacy_unit == "user":
        problems.append("clipping='per_layer'")
    if mode == "ew":
        problems.append("grad_sample_mode='ew'")
    if problems:
        raise ValueError(
            f"{what} does not support {', '.join(problems)} yet. Use flat clipping in a hooks, "
            "functorch, ghost or bk mode, or record-level Poisson sampling."
        )


def plan_for(a: Any, kwargs: dict[str, Any]) -> SamplingPlan:
    """:func:`sampling_plan` for the arguments ``a`` of ``make_private`` (or
    ``make_private_with_epsilon``: M is then chosen so that truncation costs at most a tenth of
    ``target_delta`` over ``epochs``)."""
    from .data_loader import records_in_loader
    from .distributed import is_distributed_module

    loader = a.data_loader
    target = None
    if getattr(a, "target_delta", None) is not None and a.poisson_sampling == "fixed_shape":
        steps = a.epochs * max(1, len(loader))  # truncation at most a tenth of target_delta
        target = a.target_delta / (10 * steps * (1.0 + math.exp(a.target_epsilon)))

    def rate() -> tuple[float, int]:
        return 1 / len(loader), records_in_loader(loader, poisson_sampling=True)

    world = 1
    if a.poisson_sampling == "fixed_shape" and is_distributed_module(a.module):
        world = torch.distributed.get_world_size()
    return sampling_plan(a.poisson_sampling, kwargs, getattr(loader, "dataset", None),
                         batch_rate=rate, truncation_target=target, world_size=world)


def check_truncation(accountant: Any, truncation: Truncation | None) -> None:
    """Raises ``ValueError`` when ``accountant`` holds steps of other (truncated or not)
    sampling: one accountant charges one truncation."""
    if len(accountant) and accountant.truncation != truncation:
        raise ValueError(
            f"This engine's accountant holds steps sampled with truncation "
            f"{accountant.truncation} and the new make_private samples with {truncation}: one "
            "accountant cannot charge both. Use a new PrivacyEngine for the new sampling."
        )


def with_truncation(plan: SamplingPlan, calibrate: Callable[..., float] | None, a: Any,
                    sample_rate: float, num_records: int) -> Callable[..., float] | None:
    """Logs the fixed shape's truncation cost and, for ``make_private_with_epsilon``, makes
    ``calibrate`` aim at the Poisson δ that leaves ``target_delta`` at ``target_epsilon``
    once the truncation of the planned steps is added (:func:`truncated_delta`)."""
    if not plan.fixed_shape:
        return calibrate
    logger.info(describe_truncation(plan, num_records, sample_rate))
    if calibrate is None:
        return None
    steps = a.epochs * len(a.data_loader)
    tau = truncation_delta([(sample_rate, steps)], num_records, plan.max_batch_size or 0,
                           plan.world_size)
    poisson_delta = a.target_delta - truncated_delta(a.target_epsilon, 0.0, tau)
    if poisson_delta <= 0:
        raise ValueError(
            f"max_batch_size={plan.max_batch_size} truncates too often for target_delta="
            f"{a.target_delta:g}: raise max_batch_size, or leave it out to have it chosen."
        )
    return partial(calibrate, target_delta=poisson_delta)
