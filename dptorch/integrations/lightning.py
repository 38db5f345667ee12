"""Differentially private training with Lightning 2.x: :class:`DPCallback` and
:class:`DPLightningDataModule`.

``DPCallback`` makes any ``LightningModule`` private without changing it::

    trainer = L.Trainer(max_epochs=10, callbacks=[DPCallback(target_epsilon=3,
                        target_delta=1e-5, max_grad_norm=1.0)])
    trainer.fit(model, datamodule=dm)     # or train_dataloaders=..., or model.train_dataloader

What it wires, and where:

* ``setup("fit")``: it takes over the module's ``configure_optimizers`` and ``training_step``;
* ``configure_optimizers``: the module's own optimizer and the training loader (from the
  datamodule, the module or ``fit(train_dataloaders=...)``) go through
  ``PrivacyEngine.make_private``. The module is wrapped, for per-sample clipping, as a whole:
  ``training_step`` runs inside the GradSampleModule (``"bk"`` by default), so every forward
  the step makes is hooked and checked; the loader becomes Poisson-sampled; Lightning gets the
  DP optimizer (its schedulers are moved onto it);
* every training batch: ``pl_module.log("epsilon", ...)`` (progress bar and loggers);
* checkpoints: the accountant's history, the noise and sampling generators and the DP settings
  are the callback's state (``state_dict``), restored by ``fit(ckpt_path=...)`` before the
  optimizer is built, so a resumed run continues the ε history and the noise;
* ``teardown`` (or ``on_exception`` when ``fit`` raises): the module gets its own methods
  back and its hooks are removed.

Refused, with the reason: gradient accumulation (``accumulate_grad_batches > 1``: two Poisson
batches are not one), gradient clipping by the Trainer (it would act on the un-noised sum),
16-bit precision with a loss scaler, several devices, several optimizers, manual optimization
(``automatic_optimization = False``: the optimizer steps inside ``training_step``), ``"ghost"``
mode (use ``"bk"``: same norms, one backward pass).

Both the ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning`` namespaces work: the
classes here adopt the ``Callback`` / ``LightningDataModule`` base of the namespace found
(``namespace=`` picks one when both are installed; a datamodule follows the one it wraps).
"""

from __future__ import annotations

import importlib
import logging
import math
import secrets
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..accountants import get_noise_multiplier
from ..data_loader import DPDataLoader, switch_generator
from ..privacy_engine import PrivacyEngine
from . import release

logger = logging.getLogger(__name__)

__all__ = ["DPCallback", "DPLightningDataModule", "available_namespaces"]

#: the importable names of the two Lightning namespaces, preferred first
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_ALIASES = {"lightning": "lightning.pytorch", "lightning.pytorch": "lightning.pytorch",
            "pytorch_lightning": "pytorch_lightning", "pl": "pytorch_lightning"}


def available_namespaces() -> list[str]:
    """The Lightning namespaces that import here (``"lightning.pytorch"``,
    ``"pytorch_lightning"``)."""
    out = []
    for name in NAMESPACES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        out.append(name)
    return out


def _missing() -> ImportError:
    return ImportError(
        "dptorch's Lightning integration needs Lightning 2.x: neither 'lightning' nor "
        "'pytorch_lightning' is installed. Install the dptorch extra: "
        'pip install "dptorch[lightning]".'
    )


if not available_namespaces():
    raise _missing()


def _namespace_of(obj: Any) -> str | None:
    """The Lightning namespace whose classes ``obj``'s class derives from, if any."""
    for klass in type(obj).__mro__:
        mod = klass.__module__ or ""
        for ns in NAMESPACES:
            if mod == ns or mod.startswith(ns + "."):
                return ns
    return None


def resolve_namespace(namespace: str | None = None, like: Any = None) -> ModuleType:
    """The Lightning module to build on: ``namespace`` if given (``"lightning"``,
    ``"pytorch_lightning"``), else the one ``like`` belongs to, else the first installed."""
    if namespace is not None:
        if namespace not in _ALIASES:
            raise ValueError(
                f"namespace must be 'lightning' or 'pytorch_lightning', got {namespace!r}."
            )
        name = _ALIASES[namespace]
    else:
        name = _namespace_of(like) if like is not None else None
        if name is None:
            found = available_namespaces()
            if not found:
                raise _missing()
            name = found[0]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"Lightning namespace {name!r} is not installed; install it or the dptorch extra: "
            'pip install "dptorch[lightning]".'
        ) from e


class _NamespaceDispatch:
    """Base of the classes that exist once per Lightning namespace: ``Cls(...)`` returns an
    instance of ``Cls``'s variant deriving from the namespace's ``_lightning_base`` class
    (cached, importable as ``dptorch.integrations.lightning.<Cls>_<namespace>``)."""

    _lightning_base: str = ""
    _variants: dict = {}

    def __new__(cls, *args: Any, namespace: str | None = None, **kwargs: Any):
        if cls.__dict__.get("_concrete", False):
            return super().__new__(cls)
        like = args[0] if args else next(iter(kwargs.values()), None)
        ns = resolve_namespace(namespace, like=cls._namespace_hint(like))
        concrete = _variant(cls, ns)
        return concrete.__new__(concrete, *args, namespace=namespace, **kwargs)

    @classmethod
    def _namespace_hint(cls, first_arg: Any) -> Any:
        return None


def _variant(cls: type, ns: ModuleType) -> type:
    key = (cls, ns.__name__)
    found = _NamespaceDispatch._variants.get(key)
    if found is None:
        base = getattr(ns, cls._lightning_base)
        suffix = ns.__name__.replace(".", "_")
        name = f"{cls.__name__}_{suffix}"
        found = type(name, (cls, base), {"_concrete": True, "__module__": __name__,
                                          "__qualname__": name})
        _NamespaceDispatch._variants[key] = found
        globals()[name] = found  # picklable
    return found


# ----------------------------------------------------------------------------- data module
class DPLightningDataModule(_NamespaceDispatch):
    """Opacus's ``DPLightningDataModule``: wraps a ``LightningDataModule`` so that its training
    loader is Poisson-sampled (``DPDataLoader.from_data_loader``); everything else is delegated.

    Args:
        datamodule: the data module to wrap (its namespace is the wrapper's).
        generator: ``torch.Generator`` of the Poisson sampling (saved in the datamodule's
            ``state_dict``).
        namespace: ``"lightning"`` or ``"pytorch_lightning"`` when ``datamodule`` belongs to
            neither.
    """

    _lightning_base = "LightningDataModule"

    @classmethod
    def _namespace_hint(cls, first_arg: Any) -> Any:
        return first_arg

    def __init__(self, datamodule: Any, generator: torch.Generator | None = None, *,
                 namespace: str | None = None):
        super().__init__()
        self.datamodule = datamodule
        self.generator = generator

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        self.datamodule.setup(stage)

    def teardown(self, stage: str | None = None) -> None:
        self.datamodule.teardown(stage)

    def train_dataloader(self):
        dataloader = self.datamodule.train_dataloader()
        return DPDataLoader.from_data_loader(dataloader, distributed=False, generator=self.generator)

    def val_dataloader(self):
        return self.datamodule.val_dataloader()

    def test_dataloader(self):
        return self.datamodule.test_dataloader()

    def predict_dataloader(self):
        return self.datamodule.predict_dataloader()

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return self.datamodule.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.datamodule.on_before_batch_transfer(batch, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.datamodule.on_after_batch_transfer(batch, dataloader_idx)

    def state_dict(self) -> dict[str, Any]:
        state = {"datamodule": self.datamodule.state_dict()}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "datamodule" in state_dict:
            self.datamodule.load_state_dict(state_dict["datamodule"])
        if self.generator is not None and "generator" in state_dict:
            self.generator.set_state(state_dict["generator"])


# ----------------------------------------------------------------------------- the callback
class _TrainingStep(nn.Module):
    """The module the GradSampleModule wraps: its forward is the LightningModule's own
    ``training_step``, so every forward pass the step makes is hooked and traced."""

    def __init__(self, pl_module: nn.Module, step: Callable[..., Any]):
        super().__init__()
        self.pl_module = pl_module
        self._step = step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(*args, **kwargs)


def _split_optimizers(result: Any) -> tuple[torch.optim.Optimizer, Callable[[Any], Any]]:
    """The one optimizer of a ``configure_optimizers`` result, and a function rebuilding that
    result around another optimizer (schedulers moved onto it)."""

    def move(sched: Any, new: Any) -> None:
        target = sched.get("scheduler") if isinstance(sched, dict) else sched
        if target is not None and hasattr(target, "optimizer"):
            target.optimizer = new

    if isinstance(result, torch.optim.Optimizer):
        return result, lambda new: new
    if isinstance(result, dict) and "optimizer" in result:
        def rebuild_dict(new):
            out = dict(result)
            out["optimizer"] = new
            if "lr_scheduler" in out:
                move(out["lr_scheduler"], new)
            return out
        return result["optimizer"], rebuild_dict
    if isinstance(result, (list, tuple)):
        if (len(result) == 2 and isinstance(result[0], (list, tuple))
                and isinstance(result[1], (list, tuple))):
            opts, scheds = result
            if len(opts) == 1:
                def rebuild_pair(new):
                    for s in scheds:
                        move(s, new)
                    return [new], list(scheds)
                return opts[0], rebuild_pair
        elif len(result) == 1:
            inner, rebuild = _split_optimizers(result[0])
            return inner, lambda new: [rebuild(new)]
    raise NotImplementedError(
        "DPCallback supports one optimizer (optionally with schedulers); configure_optimizers "
        f"returned {type(result).__name__}. Use one optimizer with parameter groups (a learning "
        "rate per group), or make the model and optimizer private yourself with "
        "dptorch.PrivacyEngine.make_private, without DPCallback."
    )


def _check_module(pl_module: Any) -> None:
    """Refuses manual optimization (``automatic_optimization = False``): ``training_step`` then
    runs ``manual_backward`` and ``optimizer.step()`` itself, inside the forward pass that
    DPCallback wraps for per-sample clipping (the GradSampleModule's), so the backward and the
    DP step happen in the middle of the hooked forward instead of once per Poisson batch after
    it, and DPCallback cannot guarantee that every step is clipped, noised and accounted."""
    if getattr(pl_module, "automatic_optimization", True) is False:
        raise ValueError(
            f"DPCallback does not support manual optimization: {type(pl_module).__name__} sets "
            "automatic_optimization = False, so its training_step runs the backward pass and the "
            "optimizer step inside the forward pass that DPCallback wraps for per-sample "
            "clipping. Use automatic optimization (return the loss from training_step), or call "
            "dptorch.PrivacyEngine.make_private on the module, optimizer and data loader "
            "yourself, without DPCallback."
        )


class DPCallback(_NamespaceDispatch):
    """A Lightning callback that trains the ``LightningModule`` with DP-SGD (module docstring).

    Args:
        max_grad_norm: C, the per-sample clipping bound.
        noise_multiplier: σ; or ``target_epsilon`` (σ calibrated for the run), not both.
        target_epsilon, target_delta: the guarantee (``target_delta`` defaults to 1 / (10 N)).
        epochs: epochs the calibration assumes (default: the Trainer's ``max_epochs``, or its
            ``max_steps``).
        grad_sample_mode: ``"bk"`` (default), ``"hooks"``, ``"functorch"`` or ``"ew"``.
        accountant: ``"prv"`` (default), ``"pld"``, ``"rdp"``, ``"gdp"``.
        loss_reduction: the reduction of the loss ``training_step`` returns (``"mean"``).
        secure_mode: noise and sampling from the OS CSPRNG.
        seed: seed of the noise and sampling generators, for reproducible noise (default: fresh
            OS entropy, never the global RNG that ``seed_everything`` fixes); their states go
            into checkpoints, so a resumed run continues them. Unsafe for models you release:
            two runs with one seed on neighbouring data (a retraining after a deletion, a sweep
            over C) add the same noise, which cancels in the difference of the two models.
        namespace: ``"lightning"`` or ``"pytorch_lightning"`` (default: the first installed).

    After ``fit`` starts: ``privacy_engine``, ``dp_module``, ``dp_optimizer``,
    ``noise_multiplier``, ``sample_rate``, ``target_delta``, :meth:`get_epsilon`.
    """

    _lightning_base = "Callback"

    def __init__(
        self,
        *,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: int | None = None,
        grad_sample_mode: str = "bk",
        accountant: str = "prv",
        loss_reduction: str = "mean",
        secure_mode: bool = False,
        seed: int | None = None,
        epsilon_tolerance: float = 0.01,
        namespace: str | None = None,
    ):
        super().__init__()
        if (target_epsilon is None) == (noise_multiplier is None):
            raise ValueError("DPCallback needs exactly one of target_epsilon and noise_multiplier.")
        if grad_sample_mode not in ("bk", "hooks", "functorch", "ew"):
            raise ValueError(
                f"DPCallback supports grad_sample_mode 'bk', 'hooks', 'functorch' and 'ew', got "
                f"{grad_sample_mode!r} ('ghost' needs a per-sample loss wrapper: use 'bk', which "
                "computes the same norms in one backward pass)."
            )
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0, got {max_grad_norm!r}.")
        self.max_grad_norm = float(max_grad_norm)
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.epochs = epochs
        self.grad_sample_mode = grad_sample_mode
        self.accountant = accountant
        self.loss_reduction = loss_reduction
        self.secure_mode = secure_mode
        self.epsilon_tolerance = epsilon_tolerance
        self.noise_multiplier = noise_multiplier
        self.privacy_engine: PrivacyEngine | None = None
        self.dp_module: nn.Module | None = None
        self.dp_optimizer: Any = None
        self.sample_rate: float | None = None
        self._num_records: int | None = None
        self._pending_state: dict[str, Any] | None = None
        self._patched: Any = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._noise_generator: torch.Generator | None = None
        self._sampling_generator: torch.Generator | None = None
        if secure_mode and seed is not None:
            raise ValueError(
                "DPCallback: seed cannot be used with secure_mode, which draws the noise and the "
                "sampling from the OS CSPRNG (no seed)."
            )
        if not secure_mode:
            # not from the global RNG: seed_everything(42) in two runs on neighbouring data would
            # add the same noise, and the difference of the two models would reveal a record
            if seed is None:
                noise_seed, sampling_seed = secrets.randbits(63), secrets.randbits(63)
            else:
                noise_seed, sampling_seed = seed, seed ^ 0x5DEECE66D
            self._noise_generator = torch.Generator().manual_seed(noise_seed)
            self._sampling_generator = torch.Generator().manual_seed(sampling_seed)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        _check_module(pl_module)
        if self._patched is not None:  # a previous fit that did not tear down
            self._restore(pl_module)
        original = pl_module.configure_optimizers
        step = pl_module.training_step
        callback = self

        def configure_optimizers():
            return callback._make_private(trainer, pl_module, original(), step)

        pl_module.configure_optimizers = configure_optimizers
        self._patched = (original, step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self._patched is not None:
            self._restore(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Lightning does not call ``teardown`` when ``fit`` raises: the module gets its own
        methods back and its hooks are removed here instead."""
        if self._patched is not None:
            self._restore(pl_module)

    def _restore(self, pl_module: Any) -> None:
        for name in ("configure_optimizers", "training_step"):
            pl_module.__dict__.pop(name, None)
        if self.dp_module is not None:  # hooks, per-sample attributes, clipped sums removed
            release(self.dp_module, self.dp_optimizer)
        self._patched = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if self.privacy_engine is not None:
            pl_module.log("epsilon", self.get_epsilon(), on_step=True, on_epoch=False,
                          prog_bar=True, logger=True)

    @property
    def state_key(self) -> str:
        """One key whatever the namespace variant, so a checkpoint written under ``lightning``
        resumes under ``pytorch_lightning`` too."""
        return "dptorch.DPCallback"

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Refuses to resume from a checkpoint without this callback's privacy state: the
        privacy spent before it is unknown, and resuming would restart ε at 0."""
        if not checkpoint.get("callbacks", {}).get(self.state_key):
            raise ValueError(
                "The checkpoint has no DPCallback privacy state (it was not written by a "
                "DPCallback run), so the privacy spent before it is unknown and resuming would "
                "restart epsilon at 0. To fine-tune its weights as a new private run, load them "
                "into the module and call fit() without ckpt_path."
            )

    def state_dict(self) -> dict[str, Any]:
        """The privacy state a resumed run needs (empty before ``fit`` made the model private)."""
        if self.privacy_engine is None:
            return dict(self._pending_state or {})
        return {
            "accountant": self.privacy_engine.accountant.state_dict(),
            "noise_multiplier": float(self.dp_optimizer.noise_multiplier),
            "max_grad_norm": float(self.dp_optimizer.max_grad_norm),
            "sample_rate": self.sample_rate,
            "num_records": self._num_records,
            "target_delta": self.target_delta,
            "noise_generator": None if self._noise_generator is None
            else self._noise_generator.get_state(),
            "sampling_generator": None if self._sampling_generator is None
            else self._sampling_generator.get_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning before ``configure_optimizers`` on resume: kept until the model is
        private, then restored (accountant, generators)."""
        self._pending_state = dict(state_dict)
        if self.privacy_engine is not None:
            self._apply_pending()

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default ``target_delta``)."""
        if self.privacy_engine is None:
            return 0.0
        acc = self.privacy_engine.accountant
        delta = self.target_delta if delta is None else delta
        steps = len(acc)
        if delta == self.target_delta and self._epsilon_cache and self._epsilon_cache[0] == steps:
            return self._epsilon_cache[1]
        eps = float(self.privacy_engine.get_epsilon(delta)) if steps else 0.0
        if delta == self.target_delta:
            self._epsilon_cache = (steps, eps)
        return eps

    # ------------------------------------------------------------------ make private
    def _check_trainer(self, trainer: Any) -> None:
        problems = []
        if getattr(trainer, "accumulate_grad_batches", 1) != 1:
            problems.append(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} (two Poisson batches "
                "are not one: use a larger batch size)"
            )
        if getattr(trainer, "gradient_clip_val", None):
            problems.append(
                "gradient_clip_val (the Trainer would clip the un-noised gradient sum; the "
                "per-sample bound is DPCallback's max_grad_norm)"
            )
        if getattr(trainer, "world_size", 1) > 1:
            problems.append("several devices (use dptorch.PrivacyEngine with DDP directly)")
        precision = str(getattr(trainer, "precision", "32"))
        if precision.startswith("16"):
            problems.append(f"precision={precision!r} (its loss scaler rescales the gradients)")
        if problems:
            raise NotImplementedError("DPCallback does not support " + "; ".join(problems) + ".")
        if "bf16" in precision:
            warnings.warn(
                "DPCallback with bf16 precision: per-sample clipping under autocast has not been "
                "verified against float32.", UserWarning, stacklevel=3,
            )

    def _total_steps(self, trainer: Any, steps_per_epoch: int) -> int:
        max_steps = getattr(trainer, "max_steps", -1) or -1
        epochs = self.epochs if self.epochs is not None else getattr(trainer, "max_epochs", None)
        by_epochs = None if epochs is None or epochs < 0 else int(epochs) * steps_per_epoch
        if max_steps > 0:
            return max_steps if by_epochs is None else min(max_steps, by_epochs)
        if by_epochs is None:
            raise ValueError(
                "DPCallback(target_epsilon=...) needs the length of the run: give epochs=, or "
                "the Trainer's max_epochs / max_steps."
            )
        return max(1, by_epochs)

    def _make_private(self, trainer: Any, pl_module: Any, result: Any, step: Callable) -> Any:
        _check_module(pl_module)  # again: the module's own setup() runs after the callback's
        self._check_trainer(trainer)
        optimizer, rebuild = _split_optimizers(result)
        source = trainer.fit_loop._data_source  # the datamodule, the module or fit(...)'s loader
        loader = source.dataloader()
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise NotImplementedError(
                "DPCallback needs one torch DataLoader for training (Poisson sampling), got "
                f"{type(loader).__name__}."
            )
        n = len(loader.dataset)
        q = 1 / len(loader)
        delta = self.target_delta if self.target_delta is not None else 1 / (10 * n)
        engine = self.privacy_engine or PrivacyEngine(
            accountant=self.accountant, secure_mode=self.secure_mode
        )
        sigma = self.noise_multiplier
        if self.target_epsilon is not None:
            sigma = get_noise_multiplier(
                target_epsilon=self.target_epsilon, target_delta=delta, sample_rate=q,
                steps=self._total_steps(trainer, len(loader)),
                accountant=engine.accountant.mechanism(), epsilon_tolerance=self.epsilon_tolerance,
            )
        module = _TrainingStep(pl_module, step)
        dp_module, dp_optimizer, dp_loader = engine.make_private(
            module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
            max_grad_norm=self.max_grad_norm, grad_sample_mode=self.grad_sample_mode,
            loss_reduction=self.loss_reduction, noise_generator=self._noise_generator,
            poisson_sampling=True,
        )
        if self._sampling_generator is not None:
            switch_generator(data_loader=dp_loader, generator=self._sampling_generator)
        source.instance, source.name = dp_loader, ""  # Lightning now trains on Poisson batches

        def training_step(*args: Any, **kwargs: Any) -> Any:
            return dp_module(*args, **kwargs)

        pl_module.training_step = training_step
        self.privacy_engine = engine
        self.dp_module, self.dp_optimizer = dp_module, dp_optimizer
        self.noise_multiplier = float(sigma)
        self.target_epsilon = None  # calibrated once: a later fit continues with this sigma
        self.sample_rate, self.target_delta, self._num_records = q, delta, n
        if self._pending_state:
            self._apply_pending()
        logger.info(
            "DPCallback: N=%d, q=%.6g, sigma=%.4g, C=%g, mode %s, delta=%.3g",
            n, q, sigma, self.max_grad_norm, self.grad_sample_mode, delta,
        )
        return rebuild(dp_optimizer)

    def _apply_pending(self) -> None:
        state, self._pending_state = self._pending_state, None
        if not state:
            return
        if state.get("num_records") != self._num_records:
            raise ValueError(
                f"The checkpoint's privacy state was accounted on {state.get('num_records')} "
                f"records, this training set has {self._num_records}: privacy accounting is per "
                "dataset, so the run cannot be resumed on other data."
            )
        for key, mine in (("sample_rate", self.sample_rate),
                          ("noise_multiplier", self.dp_optimizer.noise_multiplier)):
            if not math.isclose(float(state[key]), float(mine), rel_tol=1e-12):
                warnings.warn(
                    f"Resuming with {key}={mine} where the checkpoint had {state[key]}: the "
                    "accountant composes both.", UserWarning, stacklevel=3,
                )
        self.privacy_engine.accountant.load_state_dict(state["accountant"])
        self._epsilon_cache = None
        for key, gen in (("noise_generator", self._noise_generator),
                         ("sampling_generator", self._sampling_generator)):
            if gen is not None and state.get(key) is not None:
                gen.set_state(state[key])
