"""The ``patchserve`` command (also ``python -m patchserve``). Its subcommands come from the ``patchserve.commands``
entry-point group, so each package adds its own (``patches``: inspect, tasks, register, prune; ``server``: serve;
``trainer``: train, eval, worker, submit, jobs; the client: predict, versions, rollback, delete) without this module
importing them."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from patchserve import __version__
from patchserve.patches.errors import PatchServeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchserve",
        description="Serve and train task patches (BitFit by default, LoRA opt-in) on one frozen shared encoder.",
    )
    parser.add_argument("--version", action="version", version=f"patchserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group="patchserve.commands"), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PatchServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
