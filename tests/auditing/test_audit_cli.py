"""``dptorch audit`` from the command line."""

from __future__ import annotations

import re

import pytest

from dptorch.cli import main


def test_audit_bk_is_consistent(capsys):
    assert main(["audit", "--mode", "bk", "--sigma", "1", "--q", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "verdict:   consistent" in out
    mu_hat = float(re.search(r"mu_hat = ([0-9.]+)", out).group(1))
    assert abs(mu_hat - 1.0) <= 0.1
    assert re.search(r"accounted: epsilon = [0-9.]+ at delta = 1e-05", out)
    assert re.search(r"epsilon_lb = [0-9.]+ at delta = 1e-05 \(95% confidence", out)


def test_audit_violation_exit_status(capsys):
    import audit_fixtures  # noqa: F401  (registers the broken modes)

    assert main(["audit", "--mode", "audit-bug-unclipped", "--trials", "2000"]) == 1
    assert "violation" in capsys.readouterr().out


def test_audit_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert main(["audit", "--trials", "2000", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv", [["--q", "0.3"], ["--sigma", "0"], ["--mode", "nope"]])
def test_audit_bad_arguments(argv, capsys):
    with pytest.raises((SystemExit, ValueError)):
        main(["audit", *argv])
