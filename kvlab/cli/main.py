"""Entry point: parse the subcommand, run it, turn user errors into one line and exit 2.

Only the named subcommand's module is imported (all of them for `kvlab --help` or a
mistyped name), so each command loads what it uses and no more: `kvlab estimate` never
loads the server, `kvlab run` never the estimator."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvlab.errors import KvlabError

SUBCOMMANDS = ("run", "chat", "embed", "info", "bench", "kvquality", "serve", "loadtest",
               "estimate", "probe", "viz")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlab", description=__doc__.split("\n")[0])
    subs = parser.add_subparsers(dest="command", required=True)
    for name in _needed(sys.argv[1:] if argv is None else argv):
        try:
            module = importlib.import_module(f"kvlab.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"kvlab.cli.{name}":
                raise
            continue
        module.register(subs)
    return parser


def _needed(argv: list[str]) -> tuple[str, ...]:
    """The subcommand the arguments name, or every one (help, or no or an unknown name)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return (first,) if first in SUBCOMMANDS else SUBCOMMANDS


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvlabError as e:
        print(f"kvlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvlab info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
