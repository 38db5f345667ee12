"""Prints the short-horizon table of docs/privacy.md (T = 1…10 steps at the MNIST setting
q = 256/60000, σ = 1, δ = 1e-5): dptorch's PRV/PLD and RDP ε beside dp-accounting's
``PLDAccountant`` (from ``data/dp_accounting_pld.json``, written by ``make_reference.py``;
discretisation interval 1e-4) and the exact one- and two-step values by quadrature.

    .venv/bin/python tests/accountants/short_horizon_table.py

``test_docs_table.py`` checks that docs/privacy.md holds exactly this output.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

Q, SIGMA, DELTA = 256 / 60000, 1.0, 1e-5
DATA = os.path.join(os.path.dirname(__file__), "data", "dp_accounting_pld.json")


def reference() -> dict[int, dict]:
    with open(DATA) as f:
        points = json.load(f)["points"]
    return {p["steps"]: p for p in points
            if (p["q"], p["sigma"], p["delta"], p["relation"]) == (Q, SIGMA, DELTA, "add_remove")}


def table() -> str:
    sys.path.insert(0, os.path.dirname(__file__))
    from acc_helpers import single_step_exact, two_step_exact

    from dptorch.accountants import create_accountant

    ref = reference()
    exact = {1: single_step_exact(Q, SIGMA, DELTA), 2: two_step_exact(Q, SIGMA, DELTA)}
    rows = [
        "| T | dptorch PRV = PLD | dp-accounting `PLDAccountant` | exact (quadrature) | "
        "dptorch RDP |",
        "|---|---|---|---|---|",
    ]
    for t in range(1, 11):
        vals = {}
        for name in ("prv", "pld", "rdp"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                acc = create_accountant(name)
                acc.history = [(SIGMA, Q, t)]
                vals[name] = acc.get_epsilon(DELTA)
        assert vals["prv"] == vals["pld"]
        ex = f"{exact[t]:.5f}" if t in exact else "–"
        rows.append(f"| {t} | {vals['prv']:.5f} | {ref[t]['dp_accounting_accountant']:.5f} | "
                    f"{ex} | {vals['rdp']:.4f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
