"""The ``dptorch`` command line.

Subcommands are registered in :data:`SUBCOMMANDS`: each entry maps a name to a function that
adds its parser to the ``argparse`` sub-parsers object and sets ``handler`` (a function
``(args, parser) -> int``) as a default. To add a subcommand (e.g. ``train-digits``), write one
``_add_<name>(subparsers)`` function and add it to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence

from .accountants import create_accountant, get_noise_multiplier
from .accountants.registry import available_accountants
from .scripts.argtypes import (
    nonnegative_float,
    positive_float,
    positive_int,
    unit_half_open,
    unit_open,
)
from .utils._poisson import robust_floor
from .version import __version__

_ALL = "all"

#: printed after an accountant's result: GDP's warning is silenced here, so say it in the output
_NOTES = {"gdp": "  [CLT approximation: may under-estimate epsilon]"}


def _add_schedule_args(p: argparse.ArgumentParser, default_accountant: str) -> None:
    p.add_argument("--sample-rate", type=unit_half_open, required=True,
                   help="probability q that a record is in a batch (batch size / dataset size)")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=positive_float,
                        help="training epochs; steps = epochs / sample-rate, rounded down")
    length.add_argument("--steps", type=positive_int, help="number of optimizer steps")
    p.add_argument("--delta", type=unit_open, required=True, help="target delta, in (0, 1)")
    p.add_argument("--accountant", default=default_accountant,
                   choices=[*available_accountants(), _ALL],
                   help=f"accounting method, or 'all' (default: {default_accountant})")


def _steps(args: argparse.Namespace) -> int:
    return args.steps if args.steps is not None else robust_floor(args.epochs / args.sample_rate)


def _names(args: argparse.Namespace) -> list[str]:
    return available_accountants() if args.accountant == _ALL else [args.accountant]


def _run_privacy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    steps = _steps(args)
    if steps < 1:
        parser.error("--epochs / --sample-rate gives fewer than 1 step; raise --epochs")
    for name in _names(args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = create_accountant(name)
            acc.history = [(args.noise_multiplier, args.sample_rate, steps)]
            eps = acc.get_epsilon(args.delta)
        print(f"{name}: epsilon = {eps:.4f} (delta = {args.delta:g}, steps = {steps})"
              f"{_NOTES.get(name, '')}")
    return 0


def _run_calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for name in _names(args):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sigma = get_noise_multiplier(
                    target_epsilon=args.target_epsilon, target_delta=args.delta,
                    sample_rate=args.sample_rate, epochs=args.epochs, steps=args.steps,
                    accountant=name, epsilon_tolerance=args.tolerance,
                )
        except ValueError as err:
            parser.error(str(err))
        print(f"{name}: noise_multiplier = {sigma:.4f} (target epsilon = {args.target_epsilon:g}, "
              f"delta = {args.delta:g}, steps = {_steps(args)}){_NOTES.get(name, '')}")
    return 0


def _add_privacy(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("privacy", help="epsilon spent by a DP-SGD schedule",
                              description="Print the epsilon spent by DP-SGD with the given "
                                          "noise multiplier and schedule, per accountant.")
    p.add_argument("--noise-multiplier", type=nonnegative_float, required=True,
                   help="noise standard deviation divided by the clipping norm (sigma >= 0)")
    _add_schedule_args(p, default_accountant=_ALL)
    p.set_defaults(handler=_run_privacy)


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="noise multiplier for a target epsilon",
                              description="Print the smallest noise multiplier whose epsilon "
                                          "does not exceed the target, per accountant.")
    p.add_argument("--target-epsilon", type=positive_float, required=True,
                   help="privacy budget epsilon to reach (> 0)")
    p.add_argument("--tolerance", type=positive_float, default=0.01,
                   help="tolerance on sigma and epsilon of the search (default: 0.01)")
    _add_schedule_args(p, default_accountant="prv")
    p.set_defaults(handler=_run_calibrate)


def _add_train_digits(subparsers: argparse._SubParsersAction) -> None:
    from .scripts.train_digits import add_parser

    add_parser(subparsers)


def _add_audit(subparsers: argparse._SubParsersAction) -> None:
    from .auditing.cli import add_parser

    add_parser(subparsers)


#: subcommand name -> registrar adding its parser; add new subcommands here
SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "privacy": _add_privacy,
    "calibrate": _add_calibrate,
    "train-digits": _add_train_digits,
    "audit": _add_audit,
}


class _OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument as one line (``dptorch CMD: error: ...``) and exits with 2;
    ``--help`` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = _OneLineErrorParser(prog="dptorch", description="dptorch command line tools.")
    parser.add_argument("--version", action="version", version=f"dptorch {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS.values():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parses ``argv`` (default ``sys.argv[1:]``) and runs the subcommand.

    Bad arguments print a one-line error and exit with status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    return args.handler(args, sub)


if __name__ == "__main__":
    sys.exit(main())
