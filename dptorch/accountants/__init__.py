"""Privacy accountants: RDP, GDP, PRV and PLD, privacy events, a registry, and noise calibration."""

from .accountant import IAccountant
from .events import (
    ComposedEvent,
    FixedSizeBatchEvent,
    GaussianEvent,
    NonPrivateEvent,
    NoOpEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    SelfComposedEvent,
)
from .gdp import GaussianAccountant
from .pld import PLDAccountant
from .prv import PRVAccountant
from .rdp import RDPAccountant
from .registry import create_accountant, register_accountant
from .utils import get_noise_multiplier

__all__ = [
    "IAccountant",
    "RDPAccountant",
    "GaussianAccountant",
    "PRVAccountant",
    "PLDAccountant",
    "create_accountant",
    "register_accountant",
    "get_noise_multiplier",
    "PrivacyEvent",
    "GaussianEvent",
    "PoissonSampledEvent",
    "FixedSizeBatchEvent",
    "SelfComposedEvent",
    "ComposedEvent",
    "NoOpEvent",
    "NonPrivateEvent",
]
