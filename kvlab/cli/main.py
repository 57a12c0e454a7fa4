"""Entry point: parse the subcommand, run it, turn user errors into one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvlab.errors import KvlabError

SUBCOMMANDS = ("run", "chat", "info", "bench", "kvquality", "serve", "loadtest", "estimate",
               "probe", "viz")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlab", description=__doc__)
    subs = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"kvlab.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"kvlab.cli.{name}":
                raise
            continue
        module.register(subs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
