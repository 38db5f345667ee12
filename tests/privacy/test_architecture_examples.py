"""The worked examples of docs/architecture.md run, and do what the text says they do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dptorch import modes
from dptorch.grad_sample import LAYER_RULES
from dptorch.optimizers import DPOptimizer

from .invariants import MODES, assert_exact_or_refused

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _sections() -> dict[str, str]:
    """``{"## heading": python code of that section}`` for every section with ```python blocks."""
    out: dict[str, str] = {}
    heading = ""
    for part in re.split(r"^(## .*)$", DOC.read_text(), flags=re.M):
        if part.startswith("## "):
            heading = part.strip()
        else:
            code = "\n".join(re.findall(r"```python\n(.*?)```", part, flags=re.S))
            if code:
                out[heading] = code
    return out


@pytest.fixture
def run_section(monkeypatch):
    """Runs a section's code; the layer rules and modes it registers disappear after the test."""
    monkeypatch.setattr(modes, "_MODES", dict(modes._MODES))
    added = []

    def run(heading: str) -> dict:
        before = set(LAYER_RULES)
        ns: dict = {"__name__": "architecture_example"}
        exec(compile(_sections()[heading], f"{DOC}:{heading}", "exec"), ns)
        added.extend(set(LAYER_RULES) - before)
        return ns

    yield run
    for t in added:
        LAYER_RULES.pop(t, None)


def test_every_example_section_is_tested():
    assert set(_sections()) == {"## Adding a layer", "## Adding a mode"}


@pytest.mark.parametrize("mode", MODES + ["bk-per_layer"])
def test_adding_a_layer(run_section, mode):
    ns = run_section("## Adding a layer")
    scale = ns["Scale"]
    rule = LAYER_RULES[scale]
    assert rule.missing() == [] and rule.grad_sample is ns["scale_grad_sample"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), scale(3)).double()
    with torch.no_grad():
        model[1].weight.normal_()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    y = torch.randn(6, 5, 3, dtype=torch.float64)
    bounds = [0.5, 0.5, 0.5] if mode.endswith("per_layer") else 0.5
    assert_exact_or_refused(model, mode, x, y, bounds, must_work=True)


def test_adding_a_mode(run_section):
    ns = run_section("## Adding a mode")
    model, optimizer = ns["model"], ns["optimizer"]
    assert modes.get_mode("counting").gsm_class is ns["CountingGSM"]
    assert isinstance(model, ns["CountingGSM"]) and type(optimizer) is DPOptimizer
    assert model.forwards == len(ns["loader"]) > 0  # it trained, through the registered class
    assert optimizer.noise_multiplier == 1.0 and optimizer.max_grad_norm == 1.0
