"""``dptorch audit``: the privacy audits from the command line.

``dptorch audit --mode bk --sigma 1 --q 1 --steps 1`` runs :func:`audit_mechanism` (white-box
Dirac-canary audit of the real ``make_private`` pipeline) and prints the accounted ε, the audited
lower bound, μ̂ against μ and a verdict; ``dptorch audit --one-run --epsilon 8`` runs the one-run
audit of a DP training run on digits (:func:`audit_digits_one_run`). The exit status is 1 when
the verdict is a violation, else 0.
"""

from __future__ import annotations

import argparse

from ..accountants.registry import available_accountants
from ..scripts.argtypes import positive_float, positive_int, unit_half_open, unit_open

__all__ = ["add_parser"]


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # imported here: building the ``dptorch`` parser must not load the audit's dependencies
    from .mechanism import VERDICT_VIOLATION, MechanismAuditConfig, audit_mechanism

    if args.one_run:
        from .digits import audit_digits_one_run

        result = audit_digits_one_run(
            epsilon=args.epsilon,
            delta=args.delta,
            canaries=args.canaries or 1000,
            scores=args.scores,
            epochs=args.epochs,
            grad_sample_mode=args.mode,
            accountant=args.accountant,
            confidence=args.confidence,
            seed=args.seed,
        )
        print(result.report())
        return 1 if result.verdict == VERDICT_VIOLATION else 0
    try:
        config = MechanismAuditConfig(
            grad_sample_mode=args.mode,
            noise_multiplier=args.sigma,
            sample_rate=args.q,
            steps=args.steps,
            max_grad_norm=args.max_grad_norm,
            clipping=args.clipping,
            multi_pass=args.multi_pass,
            world_size=args.world_size,
            max_physical_batch_size=args.max_physical_batch_size,
            trials=args.trials,
            canaries_per_step=args.canaries or 500,
            loss_reduction=args.loss_reduction,
            accountant=args.accountant,
            delta=args.delta,
            confidence=args.confidence,
            tolerance=args.tolerance,
            seed=args.seed,
        )
    except ValueError as err:
        parser.error(str(err))
    try:
        result = audit_mechanism(config)
    except ValueError as err:  # make_private (or a check of the real pipeline) refused
        parser.error(str(err))
    print(result.report())
    if args.plot:
        if result.plot(args.plot):
            print(f"  trade-off curves written to {args.plot}")
        else:
            print("  (--plot needs matplotlib: pip install matplotlib)")
    return 1 if result.verdict == VERDICT_VIOLATION else 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``audit`` on the ``dptorch`` command's sub-parsers."""
    p = subparsers.add_parser(
        "audit",
        help="measure the privacy the implementation really gives (privacy audit)",
        description="White-box audit of DP-SGD steps through the real make_private pipeline "
        "(default), or a one-run audit of a DP training run on digits (--one-run). Prints the "
        "accounted epsilon, the audited lower bound epsilon_lb with its confidence, mu_hat vs "
        "mu, and a verdict. Exit status 1 on a violation.",
    )
    p.add_argument("--mode", default="hooks",
                   help="grad_sample_mode: hooks, functorch, ew, ghost, bk (default: hooks)")
    p.add_argument("--sigma", "--noise-multiplier", dest="sigma", type=positive_float, default=1.0,
                   help="noise multiplier sigma (default: 1)")
    p.add_argument("--q", "--sample-rate", dest="q", type=unit_half_open, default=1.0,
                   help="sample rate q, of the form 1/k (default: 1)")
    p.add_argument("--steps", type=positive_int, default=1,
                   help="optimizer steps composed in one trial (default: 1)")
    p.add_argument("--max-grad-norm", type=positive_float, default=1.0,
                   help="clipping norm C (default: 1)")
    p.add_argument("--clipping", choices=("flat", "per_layer", "adaptive"), default="flat",
                   help="clipping kind (default: flat)")
    p.add_argument("--multi-pass", choices=("sum", "split"), default=None,
                   help="two backward passes per step: summed (accum_passes=True) or split")
    p.add_argument("--world-size", type=positive_int, default=1,
                   help="processes of a gloo group on this machine (default: 1)")
    p.add_argument("--max-physical-batch-size", type=positive_int, default=None,
                   help="run each Poisson batch through BatchMemoryManager in physical batches "
                        "of at most this size")
    p.add_argument("--trials", type=positive_int, default=20_000,
                   help="trials; half choose the tests, half measure them (default: 20000)")
    p.add_argument("--canaries", type=positive_int, default=None,
                   help="canaries per step (mechanism audit, default 500) or in the run "
                        "(--one-run, default 1000)")
    p.add_argument("--loss-reduction", choices=("mean", "sum"), default="mean")
    p.add_argument("--delta", type=unit_open, default=1e-5, help="delta (default: 1e-5)")
    p.add_argument("--confidence", type=unit_open, default=0.95,
                   help="joint confidence of the reported bounds (default: 0.95)")
    p.add_argument("--tolerance", type=unit_open, default=0.1,
                   help="'consistent' needs the mu interval to reach (1 - tolerance) mu "
                        "(default: 0.1)")
    p.add_argument("--accountant", choices=available_accountants(), default="prv",
                   help="accountant whose epsilon is compared (default: prv)")
    p.add_argument("--seed", type=int, default=0, help="seed (the audit is deterministic)")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write the trade-off curves to this PNG (needs matplotlib)")
    one = p.add_argument_group("one-run audit (--one-run)")
    one.add_argument("--one-run", action="store_true",
                     help="audit a DP training run on digits with canaries instead")
    one.add_argument("--epsilon", type=positive_float, default=8.0,
                     help="target epsilon of the audited run (default: 8)")
    one.add_argument("--epochs", type=positive_int, default=30, help="epochs (default: 30)")
    one.add_argument("--scores", choices=("black", "white"), default="black",
                     help="membership scores: final losses (black) or per-step gradient "
                          "alignment (white, slower) (default: black)")
    p.set_defaults(handler=_run)
