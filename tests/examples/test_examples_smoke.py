"""Smoke tests of examples/*.py (their ``--smoke`` mode) and of the ``dptorch train-digits`` job.

The examples are loaded from their files and their ``main(argv)`` is called in-process; each run
takes a few optimizer steps. The assertions check that a run finishes and reports an accuracy
and an epsilon, not how good they are.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FINAL = re.compile(r"final: test accuracy (\d\.\d+).*epsilon (\d+\.\d+) at delta")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(name: str, argv: list[str], capsys) -> tuple[float, float, str]:
    """Runs the example, returns (final test accuracy, final epsilon, stdout)."""
    assert load_example(name).main(argv) == 0
    out = capsys.readouterr().out
    match = FINAL.search(out)
    assert match, out
    acc, eps = float(match.group(1)), float(match.group(2))
    assert 0.0 <= acc <= 1.0
    assert 0.0 < eps < math.inf
    assert re.search(r"epoch +1: loss \d+\.\d+ .*epsilon \d", out), out
    return acc, eps, out


@pytest.mark.parametrize(
    "argv",
    [
        ["--smoke"],
        ["--smoke", "--batchnorm", "--max-physical-batch-size", "16", "--epsilon", "3"],
    ],
    ids=["sigma", "batchnorm-bmm-epsilon"],
)
def test_mnist_digits_cnn(argv, capsys):
    _, eps, out = run_example("mnist_digits_cnn", argv, capsys)
    if "--batchnorm" in argv:
        assert "GroupNorm" in out  # ModuleValidator.fix replaced BatchNorm
        assert eps <= 3.0 + 1e-6


def test_char_lstm(capsys):
    _, _, out = run_example("char_lstm", ["--smoke", "--max-physical-batch-size", "64"], capsys)
    assert "training names of 18 languages" in out


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_text_classifier(mode, capsys):
    from dptorch.grad_sample.utils import GSM_CLASSES

    if mode not in GSM_CLASSES:
        pytest.skip(f"grad_sample_mode {mode!r} is not registered")
    _, _, out = run_example("text_classifier", ["--smoke", "--grad-sample-mode", mode], capsys)
    assert f"grad_sample_mode {mode!r}" in out


def test_text_classifier_epsilon(capsys):
    _, eps, _ = run_example("text_classifier", ["--smoke", "--epsilon", "2"], capsys)
    assert eps <= 2.0 + 1e-6


def test_examples_reject_bad_values(capsys):
    with pytest.raises(SystemExit) as exc:
        load_example("mnist_digits_cnn").main(["--smoke", "--max-grad-norm", "-1"])
    assert exc.value.code == 2
    assert "error: --max-grad-norm" in capsys.readouterr().err


# ---------------------------------------------------------------------------- train-digits CLI
def test_train_digits_cli(tmp_path, capsys):
    from dptorch.cli import main

    plot = tmp_path / "digits.png"
    argv = ["train-digits", "--epochs", "2", "--no-progress", "--epsilon", "2"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = None
    if plot is not None:
        argv += ["--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "== dptorch train-digits summary ==" in out
    for label in ("test accuracy (DP)", "test accuracy (non-private)", "epsilon",
                  "noise multiplier (sigma)", "max grad norm (C)", "epochs / sample rate",
                  "wall time"):
        assert re.search(rf"^{re.escape(label)} +: ", out, re.M), label
    eps = float(re.search(r"^epsilon +: (\d+\.\d+) at delta = 1e-05", out, re.M).group(1))
    assert 0 < eps <= 2.0 + 1e-6
    acc = float(re.search(r"^test accuracy \(DP\) +: (\d+\.\d+)%", out, re.M).group(1))
    assert 0 <= acc <= 100
    assert re.search(r"^epochs / sample rate +: 2 / ", out, re.M)
    if plot is not None:
        assert f"plot written to {plot}" in out
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "bad", [["--epsilon", "-1"], ["--epochs", "0"], ["--delta", "2"], ["--batch-size", "5000"]]
)
def test_train_digits_cli_bad_value(bad, capsys):
    from dptorch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train-digits", "--no-progress", *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0].startswith("dptorch train-digits: error:"), err
    assert bad[0] in errors[0], err
    assert "Traceback" not in err


def test_user_level_digits(capsys):
    _, _, out = run_example("user_level_digits", ["--smoke"], capsys)
    assert "per user" in out and "by group privacy" in out
