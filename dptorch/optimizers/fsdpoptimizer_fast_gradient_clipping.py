"""The DP optimizer of the FSDP2 modes (``grad_sample_mode="ghost_fsdp"`` and ``"bk_fsdp"``).

The module leaves in each sharded ``p.grad`` this rank's shard of the clipped sum over *every*
rank's samples (FSDP's reduce-scatter, made a sum). What remains of DP-SGD is per coordinate,
and each coordinate lives on exactly one rank:

1. ``clip_and_accumulate`` (the fast-clipping optimizer's): ``p.summed_grad += p.grad``, after
   checking that every backward pass was clipped;
2. ``add_noise``: rank 0 draws ``N(0, (σ·C)²)`` noise for each *whole* parameter (one draw of its
   generator for all parameters, in order, exactly as the single-process optimizer does) and
   scatters it: each rank adds its own slice to its shard. Every coordinate gets one draw, from
   one generator, whatever the generators or seeds of the other ranks (per-rank draws from
   identically seeded generators would give different shards the same noise);
3. ``scale_grad``: for ``loss_reduction="mean"`` divide by ``expected_batch_size × world_size ×
   accumulated_iterations`` (``expected_batch_size`` is per rank, as with DDP), i.e. by the
   global expected batch size.

No all-reduce: unlike :class:`~dptorch.optimizers.DistributedDPOptimizer`, the sum over the
ranks was formed by the reduce-scatter of the backward pass.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..utils.fsdp_utils import scatter_from_rank0, sharding_problem
from .ddpoptimizer import _require_process_group
from .optimizer import _generate_noise
from .optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping
from .unit_grads import _check_processed_flag, _mark_as_processed

__all__ = ["FSDPOptimizerFastGradientClipping"]


class FSDPOptimizerFastGradientClipping(DPOptimizerFastGradientClipping):
    """DP optimizer for a model sharded by FSDP2's ``fully_shard`` and wrapped with
    ``grad_sample_mode="ghost_fsdp"`` or ``"bk_fsdp"`` (Opacus 1.6 name).

    Args: those of :class:`DPOptimizerFastGradientClipping` (flat clipping). Every parameter of
    ``optimizer`` must be a ``DTensor`` sharded on one 1-D device mesh (``fully_shard``);
    ``expected_batch_size`` is the expected batch size **of one rank** (``q · N / world_size``,
    what ``make_private`` passes).

    After ``step()`` the update applied on each rank is its shard of
    ``(Σ_ranks Σ_b clip(g_b) + N(0, (σ·C)² I)) / (q · N)``, noise drawn once per coordinate.
    """

    #: the rank that draws the noise
    NOISE_RANK = 0

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        **kwargs,
    ):
        self.rank, self.world_size = _require_process_group(None)
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )
        meshes = set()
        for i, p in enumerate(self.params):
            why = sharding_problem(p)
            if why is not None:
                raise ValueError(
                    f"Parameter {i} of the optimizer (shape {tuple(p.shape)}): {why}. "
                    f"{type(self).__name__} adds the noise to each rank's shard, so every "
                    "parameter must be sharded by fully_shard on a 1-D mesh. Fix: call "
                    "fully_shard on the root module before creating the optimizer."
                )
            meshes.add(p.device_mesh)
        if len(meshes) > 1:
            raise ValueError(
                "The parameters are sharded on several device meshes; the FSDP DP optimizer "
                "needs one (the noise rank and the world size are the mesh's)."
            )
        if meshes:
            mesh = meshes.pop()
            self.world_size = mesh.size()
            self.rank = mesh.get_local_rank()

    @property
    def is_noise_rank(self) -> bool:
        """Whether this rank draws the noise (rank 0 of the mesh)."""
        return self.rank == self.NOISE_RANK

    def _full_noise(self, std: float) -> list[torch.Tensor]:
        """Rank 0: ``N(0, std²)`` noise shaped like each whole parameter, drawn as the
        single-process optimizer draws it (one ``normal_`` of the generator per dtype and device
        over all parameters in order; secure mode: each tensor from the OS CSPRNG). Other ranks:
        uninitialised tensors of those shapes (ignored by the scatter)."""
        params = self.params
        if not self.is_noise_rank:
            return [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in params]
        if self.secure_mode:
            return [
                _generate_noise(std, torch.empty(p.shape, dtype=p.dtype, device=p.device),
                                self.generator, self.secure_mode)
                for p in params
            ]
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.dtype, p.device), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(params)
        for (dtype, device), idx in groups.items():
            sizes = [params[i].numel() for i in idx]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            flat.normal_(0.0, std, generator=self.generator)
            for i, chunk in zip(idx, flat.split(sizes)):
                out[i] = chunk.view(params[i].shape)
        return out

    def add_noise(self) -> None:
        """``p.grad = p.summed_grad + this rank's slice of rank 0's noise`` for each sharded
        parameter: every coordinate of the model gets exactly one draw of ``N(0, (σ·C)²)``."""
        std = self.noise_std
        params = self.params
        for p in params:
            _check_processed_flag(p.summed_grad)
        if std == 0:
            for p in params:
                p.grad = p.summed_grad.clone()
                _mark_as_processed(p.summed_grad)
            return
        for p, full in zip(params, self._full_noise(std)):
            noise = scatter_from_rank0(full, p)
            p.grad = p.summed_grad + noise
            _mark_as_processed(p.summed_grad)

    def scale_grad(self) -> None:
        """Divides by ``expected_batch_size × world_size × accumulated_iterations`` for "mean"
        (``expected_batch_size`` is per rank)."""
        super().scale_grad()
        if self.loss_reduction == "mean":
            for p in self.params:
                p.grad /= self.world_size
