"""Expose parameters of submodules under other names (torch's names for dptorch's DP layers).

``DPLSTM`` keeps its weights in ``RNNLinear`` submodules (``l0.ih.weight``) so that they get
per-sample gradients, but users and checkpoints know them by ``nn.LSTM``'s names
(``weight_ih_l0``). :class:`RenameParamsMixin` registers each renamed parameter a second time,
as an alias under its new name, so that:

* ``module.weight_ih_l0`` is ``module.l0.ih.weight`` (the same ``Parameter`` object);
* ``named_parameters()`` / ``parameters()`` (of the layer and of any model containing it) list the
  new names, in registration order, each parameter once;
* ``named_parameters(recurse=False)`` lists no alias: the layer does not own them, its
  submodules do (so per-sample-gradient hooks go on the submodules only);
* ``state_dict()`` has the new names only, and ``load_state_dict`` accepts the new names (e.g. an
  ``nn.LSTM`` checkpoint), the internal ones, or both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn


class RenameParamsMixin:
    """Mixin for an ``nn.Module`` whose submodule parameters are published under other names.

    Call :meth:`set_rename_map` at the end of ``__init__`` (after the submodules exist)::

        class DPModel(RenameParamsMixin, nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(3, 4)
                self.set_rename_map({"fc.weight": "w", "fc.bias": "b"})
    """

    old_to_new: dict[str, str]
    new_to_old: dict[str, str]

    def set_rename_map(self, rename_map: Mapping[str, str]) -> None:
        """Publishes the parameter at dotted path ``old`` (relative to this module) as ``new``
        for every ``old -> new`` in ``rename_map``. A path whose parameter is ``None`` (e.g. a
        bias of a layer built with ``bias=False``) is skipped."""
        self.old_to_new = dict(rename_map)
        self.new_to_old = {v: k for k, v in self.old_to_new.items()}
        self._register_renamed_parameters()
        if not self.__dict__.get("_rename_hooks_installed", False):
            self.register_state_dict_post_hook(_drop_internal_keys)
            self.register_load_state_dict_pre_hook(_add_missing_aliases)
            self.register_load_state_dict_post_hook(_resync_after_load)
            self._rename_hooks_installed = True

    def _resolve(self, old: str) -> tuple[nn.Module, str]:
        *path, attr = old.split(".")
        owner = self
        for part in path:
            owner = getattr(owner, part)
        return owner, attr

    def _register_renamed_parameters(self) -> None:
        for new in list(self.new_to_old):
            self._parameters.pop(new, None)
        for old, new in self.old_to_new.items():
            owner, attr = self._resolve(old)
            p = owner._parameters.get(attr)
            if p is not None:
                self._parameters[new] = p

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if recurse:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)  # type: ignore[misc]
            return
        aliases = self.__dict__.get("new_to_old", {})
        for name, p in self._parameters.items():
            if p is not None and name not in aliases:
                yield (f"{prefix}.{name}" if prefix else name), p

    def __setattr__(self, name: str, value) -> None:
        aliases = self.__dict__.get("new_to_old")
        if aliases and name in aliases and (value is None or isinstance(value, nn.Parameter)):
            owner, attr = self._resolve(aliases[name])
            setattr(owner, attr, value)
            if value is None:
                self._parameters.pop(name, None)
            else:
                self._parameters[name] = value
            return
        super().__setattr__(name, value)  # type: ignore[misc]


def _drop_internal_keys(module: RenameParamsMixin, state_dict, prefix: str, local_metadata) -> None:
    for old in module.old_to_new:
        state_dict.pop(prefix + old, None)


def _add_missing_aliases(
    module: RenameParamsMixin,
    state_dict,
    prefix: str,
    local_metadata,
    strict,
    missing_keys,
    unexpected_keys,
    error_msgs,
) -> None:
    """Before loading: make both names of every renamed parameter present (either may be)."""
    for old, new in module.old_to_new.items():
        k_old, k_new = prefix + old, prefix + new
        if k_new in state_dict and k_old not in state_dict:
            state_dict[k_old] = state_dict[k_new]
        elif k_old in state_dict and k_new not in state_dict:
            state_dict[k_new] = state_dict[k_old]


def _resync_after_load(module: RenameParamsMixin, incompatible_keys) -> None:
    """``load_state_dict(assign=True)`` replaces the two names by distinct tensors: re-alias."""
    with torch.no_grad():
        module._register_renamed_parameters()
