"""`zeropp`: the command-line tool for looking at what the compiler does.

    zeropp passes            the passes, in the order they run, one line each
"""

from __future__ import annotations

import argparse
import sys

from .passes import PASSES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp", description="Inspect the zeropp compiler passes.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("passes", help="list the passes in the order they run")
    args = parser.parse_args(argv)
    if args.command == "passes":
        width = max(len(p.name) for p in PASSES)
        for graph_pass in PASSES:
            print(f"{graph_pass.name:<{width}}  [{graph_pass.stage}]  {graph_pass.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
