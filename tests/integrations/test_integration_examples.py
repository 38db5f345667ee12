"""Smoke runs of examples/hf_finetune.py and examples/lightning_digits.py (their ``--smoke``
mode, in-process): each finishes and prints its final line with the evaluation loss and ε."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(name: str, argv: list[str], capsys) -> str:
    """Runs ``examples/<name>.py`` with ``argv`` in this process; the environment variables it
    sets (Lightning's ``seed_everything`` sets ``PL_GLOBAL_SEED``) are restored afterwards."""
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    environ = dict(os.environ)
    try:
        spec.loader.exec_module(module)
        assert module.main(argv) == 0
    finally:
        sys.modules.pop(spec.name, None)
        os.environ.clear()
        os.environ.update(environ)
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--smoke"], ["--smoke", "--model", "bert", "--lora"]],
                         ids=["gpt2", "bert-lora"])
def test_hf_finetune(argv, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    if "--lora" in argv:
        pytest.importorskip("peft")
    out = run("hf_finetune", argv, capsys)
    m = re.search(r"final: eval loss (\d+\.\d+) \(before training (\d+\.\d+)\).*epsilon "
                  r"(\d+\.\d+) at delta", out)
    assert m, out
    assert 0 < float(m.group(3)) <= 8.0 + 1e-9
    assert math.isfinite(float(m.group(1)))
    assert "3 steps" in out


def test_lightning_digits(capsys):
    pytest.importorskip("sklearn")
    if not (importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning")):
        pytest.skip("Lightning is not installed")
    out = run("lightning_digits", ["--smoke"], capsys)
    m = re.search(r"final: test accuracy (\d\.\d+), test loss (\d+\.\d+), epsilon (\d+\.\d+)", out)
    assert m, out
    assert 0 < float(m.group(3)) <= 3.0 + 1e-9
    assert "3 DP steps" in out
