"""docs/privacy.md holds the short-horizon table exactly as short_horizon_table.py prints it."""

from __future__ import annotations

from pathlib import Path

from short_horizon_table import table

DOC = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"


def test_docs_short_horizon_table_is_generated():
    assert table() in DOC.read_text()
