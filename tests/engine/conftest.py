"""Shared settings of the engine tests."""

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_dptorch_logs():
    """Silences dptorch's warnings during the engine tests only (restored afterwards)."""
    logger = logging.getLogger("dptorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
