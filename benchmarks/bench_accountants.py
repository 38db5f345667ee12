"""Timing of dptorch's accountants (and Opacus 1.x's, if /work/opacus-venv exists).

Run: ``.venv/bin/python benchmarks/bench_accountants.py [--quick]``. Prints the time of
``get_epsilon`` after 1e4 and 1e6 steps (q = 256/60000, σ = 1.1 and σ = 3), of
``get_noise_multiplier`` (ε = 3, δ = 1e-5: MNIST q = 256/60000 for 60 epochs, and the
``train-digits`` job's q = 256/1437 for 20 epochs), and ε of every accountant on the TF Privacy
MNIST setting (σ = 1.1, 60 epochs, δ = 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

from _timing import run_worker

Q = 256 / 60000
GNM = [("MNIST, 60 ep", Q, 60), ("digits, 20 ep", 256 / 1437, 20)]
OPACUS_PY = "/work/opacus-venv/bin/python"

_SNIPPET = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from {pkg}.accountants import create_accountant
from {pkg}.accountants.utils import get_noise_multiplier
cfg = json.loads(sys.argv[1]); out = {{}}
for name in cfg["names"]:
    for sigma, steps in cfg["runs"]:
        acc = create_accountant(name); acc.history = [(sigma, cfg["q"], steps)]
        t = time.perf_counter()
        try:
            eps = acc.get_epsilon(1e-5)
        except Exception as e:
            eps = repr(e)[:60]
        out[f"{{name}} eps sigma={{sigma}} steps={{steps}}"] = (eps, time.perf_counter() - t)
    for label, q, epochs in cfg["gnm"]:
        t = time.perf_counter()
        try:
            s = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q,
                                     epochs=epochs, accountant=name)
        except Exception as e:
            s = repr(e)[:60]
        out[f"{{name}} noise_multiplier(eps=3, {{label}})"] = (s, time.perf_counter() - t)
print("RESULT " + json.dumps(out))
"""


def run(pkg: str, python: str, cfg: dict) -> dict:
    return run_worker(
        [python, "-c", _SNIPPET.format(pkg=pkg), json.dumps(cfg)],
        opacus=pkg == "opacus",
        timeout=3600,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="skip 1e6-step PRV and the Opacus PRV")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    runs = [(1.1, 14062), (1.1, 10**4), (1.1, 10**6), (3.0, 10**6)]
    names = ["rdp", "gdp", "prv", "pld"]
    ours = run("dptorch", os.path.join(os.path.dirname(__file__), "..", ".venv", "bin", "python"),
               {"names": names, "runs": runs, "q": Q, "gnm": GNM})
    print("== dptorch ==")
    for k, (v, t) in ours.items() if "error" not in ours else []:
        print(f"{k:45s} {v if isinstance(v, str) else f'{v:.4f}':>12s}  {t:8.3f} s")
    if "error" in ours:
        print(ours["error"])
    if os.path.exists(OPACUS_PY):
        onames = ["rdp", "gdp"] if args.quick else ["rdp", "gdp", "prv"]
        theirs = run("opacus", OPACUS_PY, {"names": onames, "runs": runs, "q": Q, "gnm": GNM})
        print("== opacus ==")
        for k, (v, t) in theirs.items() if "error" not in theirs else []:
            print(f"{k:45s} {v if isinstance(v, str) else f'{v:.4f}':>12s}  {t:8.3f} s")


if __name__ == "__main__":
    main()
