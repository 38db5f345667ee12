"""Registry of accountant classes by mechanism name."""

from __future__ import annotations

from typing import Any

from .accountant import IAccountant
from .gdp import GaussianAccountant
from .pld import PLDAccountant
from .prv import PRVAccountant
from .rdp import RDPAccountant

_ACCOUNTANTS: dict[str, type[IAccountant]] = {
    "rdp": RDPAccountant,
    "gdp": GaussianAccountant,
    "prv": PRVAccountant,
    "pld": PLDAccountant,
}


def register_accountant(mechanism: str, accountant: type[IAccountant], force: bool = False) -> None:
    """Registers ``accountant`` under ``mechanism``; ``force=True`` replaces an existing entry."""
    if not (isinstance(accountant, type) and issubclass(accountant, IAccountant)):
        raise ValueError(f"accountant must be a subclass of IAccountant, got {accountant!r}.")
    if mechanism in _ACCOUNTANTS and not force:
        raise ValueError(
            f"an accountant is already registered for {mechanism!r}; pass force=True to replace it."
        )
    _ACCOUNTANTS[mechanism] = accountant


def create_accountant(mechanism: str, **kwargs: Any) -> IAccountant:
    """A new accountant for ``mechanism`` (``"rdp"``, ``"gdp"``, ``"prv"``, ``"pld"`` or
    registered); ``kwargs`` (e.g. ``neighboring_relation="replace_one"``) go to its constructor."""
    try:
        cls = _ACCOUNTANTS[mechanism]
    except KeyError:
        raise ValueError(
            f"unknown accounting mechanism {mechanism!r}; choose one of {sorted(_ACCOUNTANTS)} "
            "or register it with register_accountant()."
        ) from None
    return cls(**kwargs)


def available_accountants() -> list[str]:
    """Names of the registered mechanisms."""
    return sorted(_ACCOUNTANTS)
