"""Checkpoints of a DP training run: model, optimizer with its DP settings, accountant,
schedulers and the random generator states, so that a resumed run continues bit for bit.

``PrivacyEngine.save_checkpoint`` / ``load_checkpoint`` (Opacus signatures) call
:func:`save_checkpoint` / :func:`load_checkpoint` with the engine's accountant.
"""

from __future__ import annotations

import os
import warnings
from typing import IO, Any, BinaryIO

import torch
from torch import nn
from torch.utils.data import DataLoader

from .accountants import IAccountant
from .grad_sample import AbstractGradSampleModule
from .optimizers import DPOptimizer
from .optimizers.arguments import is_real_number

__all__ = ["load_checkpoint", "sampling_context", "save_checkpoint"]

Path = str | os.PathLike | BinaryIO | IO[bytes]

_GSM_PREFIX = "_module."
# DP hyper-parameters that schedules and adaptive clipping change during training (AdaClip's
# noisy count; never its raw ``sample_size``, the exact size of the last Poisson batch)
_DP_SETTINGS = ("noise_multiplier", "unclipped_num")


def save_checkpoint(
    *,
    path: Path,
    module: nn.Module,
    accountant: IAccountant,
    optimizer: DPOptimizer | None = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    checkpoint_dict: dict[str, Any] | None = None,
    module_state_dict_kwargs: dict[str, Any] | None = None,
    torch_save_kwargs: dict[str, Any] | None = None,
    data_loader: DataLoader | None = None,
    sampling: dict[str, Any] | None = None,
) -> None:
    """Saves model, optimizer (with its DP settings), accountant, schedulers and the random
    generator states (global torch RNG, noise generator, ``data_loader``'s sampling) to ``path``,
    with the entries of ``checkpoint_dict``. ``sampling``: what the accountant's ε also depends
    on (:func:`sampling_context`), checked when the checkpoint is loaded.

    Refused (``ValueError``) inside a logical batch: the clipped sums of its skipped physical
    steps are not part of a checkpoint."""
    if isinstance(optimizer, DPOptimizer) and optimizer.last_step_skipped:
        raise ValueError(
            "save_checkpoint inside a logical batch (after a skipped step of BatchMemoryManager "
            "or signal_skip_step): its pending clipped sums would not be saved. Save after the "
            "step that completes the logical batch."
        )
    ckpt = dict(checkpoint_dict or {})
    if sampling is not None:
        ckpt["sampling_context"] = sampling
    ckpt["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
    ckpt["privacy_accountant_state_dict"] = accountant.state_dict()
    if optimizer is not None:
        ckpt["optimizer_state_dict"] = optimizer.state_dict()
        if isinstance(optimizer, DPOptimizer):
            ckpt["dp_optimizer_state"] = _dp_settings(optimizer)
    if noise_scheduler is not None:
        ckpt["noise_scheduler_state_dict"] = noise_scheduler.state_dict()
    if grad_clip_scheduler is not None:
        ckpt["grad_clip_scheduler_state_dict"] = grad_clip_scheduler.state_dict()
    ckpt["rng_state"] = _rng_state(optimizer, data_loader)
    torch.save(ckpt, path, **(torch_save_kwargs or {}))


def load_checkpoint(
    *,
    path: Path,
    module: nn.Module,
    accountant: IAccountant,
    optimizer: DPOptimizer | None = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    map_location: Any = None,
    module_load_dict_kwargs: dict[str, Any] | None = None,
    torch_load_kwargs: dict[str, Any] | None = None,
    data_loader: DataLoader | None = None,
    restore_rng_state: bool = True,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restores what :func:`save_checkpoint` saved into the given objects; returns the remaining
    entries of the checkpoint (user data). Refused before anything is loaded: a checkpoint of
    another clipping kind, of another accountant mechanism, or whose sampling (fixed shape,
    privacy unit) differs from ``sampling``, the loading engine's. The file is unpickled
    (``weights_only=False``): trusted files only."""
    load_kwargs = {"weights_only": False, **(torch_load_kwargs or {})}
    if map_location is not None:
        load_kwargs["map_location"] = map_location
    ckpt = torch.load(path, **load_kwargs)
    # every refusal before anything is loaded
    clip_state = (ckpt.get("dp_optimizer_state") or {}).get("clipping")
    if isinstance(optimizer, DPOptimizer) and clip_state is not None:
        optimizer.clipping.check_state_dict(clip_state)
    accountant.check_state_dict(ckpt.get("privacy_accountant_state_dict"))
    _check_sampling(ckpt.pop("sampling_context", None), sampling)
    state = _match_gsm_prefix(ckpt.pop("module_state_dict"), module)
    module.load_state_dict(state, **(module_load_dict_kwargs or {}))
    accountant.load_state_dict(ckpt.pop("privacy_accountant_state_dict"))
    opt_state = ckpt.pop("optimizer_state_dict", None)
    dp_state = ckpt.pop("dp_optimizer_state", None)
    if optimizer is not None and opt_state:
        optimizer.load_state_dict(opt_state)
        if dp_state and isinstance(optimizer, DPOptimizer):
            _load_dp_settings(optimizer, dp_state)
    elif (optimizer is not None) != bool(opt_state):
        warnings.warn(
            "The checkpoint has "
            + ("no optimizer state" if optimizer is not None else "an optimizer state")
            + " but an optimizer was "
            + ("" if optimizer is not None else "not ")
            + "given.",
            stacklevel=3,
        )
    for key, sched in (
        ("noise_scheduler_state_dict", noise_scheduler),
        ("grad_clip_scheduler_state_dict", grad_clip_scheduler),
    ):
        sd = ckpt.pop(key, None)
        if sched is not None and sd:
            sched.load_state_dict(sd)
    rng = ckpt.pop("rng_state", None)
    if restore_rng_state and rng is not None:
        _load_rng_state(rng, optimizer, data_loader)
    return ckpt


def _rng_state(optimizer: DPOptimizer | None, data_loader: DataLoader | None) -> dict[str, Any]:
    """The states of the global torch RNG, the noise generator and the loader's generators."""
    state = {"torch": torch.get_rng_state()}
    gen = getattr(optimizer, "generator", None)
    if isinstance(gen, torch.Generator):
        state["noise_generator"] = gen.get_state()
    if data_loader is not None:
        for key, gen in _loader_generators(data_loader).items():
            state[key] = gen.get_state()
        sampler = _sampler_epoch(data_loader)
        if sampler is not None:
            state["sampler_epoch"] = sampler.epoch
    return state


def _load_rng_state(
    state: dict[str, Any], optimizer: DPOptimizer | None, data_loader: DataLoader | None
) -> None:
    """Restores what :func:`_rng_state` saved."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if data_loader is not None:
        for key, gen in _loader_generators(data_loader).items():
            if key in state:
                gen.set_state(state[key])
        sampler = _sampler_epoch(data_loader)
        if sampler is not None and "sampler_epoch" in state:
            sampler.epoch = int(state["sampler_epoch"])
        _reseed_rank_generators(data_loader)
    # last: the noise generator may also be the sampler's, and was saved after it
    noise_gen = getattr(optimizer, "generator", None)
    if isinstance(noise_gen, torch.Generator) and "noise_generator" in state:
        noise_gen.set_state(state["noise_generator"])


def _dp_settings(optimizer: DPOptimizer) -> dict[str, Any]:
    """DP hyper-parameters that schedules / adaptive clipping change during training: the noise
    multiplier, AdaClip's counts, and the clipping contract's bound(s)."""
    out: dict[str, Any] = {"clipping": optimizer.clipping.state_dict()}
    for k in _DP_SETTINGS:
        if k in optimizer.__dict__:
            v = getattr(optimizer, k)
            out[k] = float(v) if is_real_number(v) else v
    return out


def _load_dp_settings(optimizer: DPOptimizer, state: dict[str, Any]) -> None:
    """Restores what :func:`_dp_settings` saved (or the bounds of an older checkpoint)."""
    state = dict(state)
    clipping = state.pop("clipping", None)
    if clipping is not None:
        optimizer.clipping.load_state_dict(clipping)
    else:  # checkpoints written before the clipping contract
        norms = state.pop("max_grad_norms", None)
        flat = state.pop("max_grad_norm", None)
        if norms is not None and optimizer.clipping.per_layer:
            optimizer.clipping.max_grad_norms = norms
        elif flat is not None:
            optimizer.clipping.max_grad_norm = flat
    sigma = state.get("noise_multiplier")
    if sigma is not None and sigma != optimizer.noise_multiplier:
        warnings.warn(
            f"load_checkpoint: the checkpoint's noise_multiplier {sigma:g} replaces this "
            f"optimizer's {optimizer.noise_multiplier:g} (a schedule's value at the save); "
            "the accountant counts the steps that follow with it.",
            stacklevel=4,
        )
    for k, v in state.items():
        setattr(optimizer, k, v)


def _samplers(data_loader: DataLoader) -> list[Any]:
    return [data_loader.batch_sampler, getattr(data_loader.batch_sampler, "sampler", None),
            data_loader.sampler]


def _loader_generators(data_loader: DataLoader) -> dict[str, torch.Generator]:
    """The generators whose state determines a loader's future batches: its samplers' and its
    own."""
    out = {}
    for key, obj in [
        *(("sampler_generator", o) for o in _samplers(data_loader)),
        ("loader_generator", data_loader),
    ]:
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and key not in out:
            out[key] = gen
    return out


def _reseed_rank_generators(data_loader: DataLoader) -> None:
    """A distributed sampler draws from a ``rank_generator`` seeded once from its ``generator``
    and its rank. After a restore it is seeded again from the restored ``generator``: left
    alone, it would replay the first run's masks; restored from rank 0's file, every rank
    would draw rank 0's masks. Its rank is mixed in, so the ranks stay independent."""
    for obj in _samplers(data_loader):
        if getattr(obj, "rank_generator", None) is not None:
            obj.generator = obj.generator  # the setter draws a new rank seed


def _sampler_epoch(data_loader: DataLoader) -> Any:
    """The first sampler with an ``epoch`` (a distributed sampler's shard permutation)."""
    return next((o for o in _samplers(data_loader) if isinstance(getattr(o, "epoch", None), int)),
                None)


def sampling_context(plan: Any, num_records: int | None) -> dict[str, Any] | None:
    """What ε depends on beyond the accountant's events, as plain data: fixed-shape batches
    (their truncation costs δ, from ``max_batch_size``, the world size and the number of
    records) and the privacy unit (ε of a record or of a user). ``plan``: a
    :class:`dptorch.sampling.SamplingPlan` (``None``: not known)."""
    if plan is None:
        return None
    return {"fixed_shape": plan.fixed_shape, "max_batch_size": plan.max_batch_size,
            "world_size": plan.world_size, "privacy_unit": plan.privacy_unit,
            "num_records": num_records}


def _check_sampling(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    if saved is None or current is None:
        return
    keys = ["fixed_shape", "privacy_unit"]
    if saved["fixed_shape"] or current["fixed_shape"]:
        keys += ["max_batch_size", "world_size", "num_records"]
    diff = [f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} here" for k in keys
            if saved.get(k) != current.get(k)]
    if diff:
        raise ValueError(
            "The checkpoint's accountant history was spent with other sampling ("
            + "; ".join(diff) + "): its ε would be computed with this engine's. Resume with "
            "make_private's sampling arguments of the run that wrote the checkpoint."
        )


def _match_gsm_prefix(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """Adds or strips the GradSampleModule ``_module.`` prefix so a checkpoint of a wrapped
    model loads into a plain one and vice versa."""
    wants = isinstance(module, AbstractGradSampleModule)
    has = bool(state) and all(k.startswith(_GSM_PREFIX) for k in state)
    if wants and not has:
        return {_GSM_PREFIX + k: v for k, v in state.items()}
    if has and not wants:
        return {k[len(_GSM_PREFIX) :]: v for k, v in state.items()}
    return state
