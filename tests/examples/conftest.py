"""The examples import their shared helpers as ``from _common import ...``, which works when a
script runs as ``python examples/NAME.py`` (its folder is then on ``sys.path``). The tests load
the scripts from their files instead, so the folder is put on ``sys.path`` here."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
