"""`hardy` command line: one subcommand module per concern, user errors as one line + exit 2."""
from __future__ import annotations

import argparse
import logging
import sys

from hardy import __version__
from hardy.cli import compress, data, demo, doctor, export, generate, info, plan, probe, serve, train
from hardy.cli import eval as eval_cmd
from hardy.cli.common import EXIT_USAGE, Parser
from hardy.errors import HardyError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hardy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hardy {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (demo, info, generate, eval_cmd, compress, export, serve, data, train, plan, probe, doctor):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="hardy: %(levelname)s: %(message)s" if args.debug else "hardy: %(message)s")
    try:
        return int(args.func(args) or 0)
    except HardyError as e:
        if args.debug:
            raise
        sys.stderr.write(f"hardy: error: {e}\n")  # one write: ranks sharing a terminal do not interleave
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hardy: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
