"""Shared settings of the engine tests."""

import logging

logging.getLogger("dptorch").setLevel(logging.ERROR)
