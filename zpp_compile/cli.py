"""`zeropp`: the command-line tool for looking at what the compiler does.

    zeropp passes                                   the passes, in the order they run
    zeropp dump [--out DIR] [--disable-pass NAME]... SCRIPT [ARGS...]
                                                    run a script (or `torchrun ... SCRIPT`) with dumping on
    zeropp report DIR [--rank R] [--format json]    the collectives of a dump, against plain ZeRO-3
    zeropp explain CONFIG.json --params N --world W --ranks-per-node R
                                                    predicted communication per step, nothing run

A user mistake (a bad config or flag, an unreadable or damaged dump, a failing script) ends with a
one-line message on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from .environment import DISABLE_PASSES_ENV, DUMP_DIR_ENV
from .reports import text_table

if TYPE_CHECKING:
    import torch

    from .config import Config

# Each command imports what it needs (torch among it) when it runs: `zeropp --help` loads none of it.


class UsageError(Exception):
    """A mistake on the command line or in its inputs; reported without a traceback."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")
        return 0
    except Exception as error:
        from .config import ConfigError

        if not isinstance(error, (UsageError, ConfigError)):
            raise
        print(f"zeropp {args.command}: error: {error}", file=sys.stderr)
        return 1


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, like the others (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zeropp", description="Inspect what the zeropp compiler does.")
    parser.add_argument("--wide", action="store_true",
                        help=f"lines as long as they come, exact byte counts (default: within {text_table.WIDTH} "
                             "columns)")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("passes", help="list the passes in the order they run").set_defaults(handler=_passes)

    dump = commands.add_parser(
        "dump", help="run a script with graph dumping on",
        description="Runs `python SCRIPT ARGS` (or the command given, e.g. `torchrun ...`) with every zeropp-compiled "
                    f"graph dumped per rank and per pass ({DUMP_DIR_ENV}, {DISABLE_PASSES_ENV}).")
    dump.add_argument("--out", default="zeropp_dump", help="dump folder (default: ./zeropp_dump)")
    dump.add_argument("--disable-pass", action="append", default=[], metavar="NAME",
                      help="switch a pass off (repeatable); see `zeropp passes`")
    dump.add_argument("cmd", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]")
    dump.set_defaults(handler=_dump)

    report = commands.add_parser("report", help="the collectives of a dump, against plain ZeRO-3")
    report.add_argument("dir", help="a dump folder (with rank0/, rank1/, ...) or one rank's folder")
    report.add_argument("--rank", type=int, default=0, help="which rank's graphs (default 0)")
    report.add_argument("--format", choices=("table", "json"), default="table")
    report.add_argument("--brief", action="store_true", help="totals only: no per-pass or per-collective lines")
    report.set_defaults(handler=_report)

    explain = commands.add_parser("explain", help="predicted communication per step, without running anything")
    explain.add_argument("config", help="a zeropp JSON config")
    explain.add_argument("--params", required=True, type=_count, help="parameter count: 1300000000, 1.3B, 350M")
    explain.add_argument("--world", required=True, type=int, help="total ranks")
    explain.add_argument("--ranks-per-node", type=int, help="ranks per node (default: the config's ranks_per_node)")
    explain.add_argument("--stored-dtype", default="fp32", help="parameter dtype when the config has no param_dtype")
    explain.add_argument("--format", choices=("table", "json"), default="table")
    explain.set_defaults(handler=_explain)
    return parser


# ------------------------------------------------------------------------------------ passes


def _passes(args: argparse.Namespace) -> int:
    from .passes import PASSES

    print(text_table.render(None, [(p.name, f"[{p.stage}]", p.summary) for p in PASSES], width=_width(args)))
    return 0


def _width(args: argparse.Namespace) -> int | None:
    return None if args.wide else text_table.WIDTH


# -------------------------------------------------------------------------------------- dump


def _dump(args: argparse.Namespace) -> int:
    from .passes import PASSES

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise UsageError("no script given; usage: zeropp dump [--out DIR] SCRIPT [ARGS...]")
    known = [p.name for p in PASSES]
    unknown = [name for name in args.disable_pass if name not in known]
    if unknown:
        raise UsageError(f"--disable-pass {', '.join(unknown)}: no such pass; known: {', '.join(known)}")
    if command[0].endswith(".py"):
        if not Path(command[0]).is_file():
            raise UsageError(f"script {command[0]!r} not found")
        command = [sys.executable, *command]
    elif shutil.which(command[0]) is None:
        raise UsageError(f"command {command[0]!r} not found")
    out = Path(args.out).resolve()
    if any(out.glob("rank*/*.comm.json")):
        raise UsageError(f"{out} already holds a dump; remove it or choose another --out")
    env = {**os.environ, DUMP_DIR_ENV: str(out), DISABLE_PASSES_ENV: ",".join(args.disable_pass)}
    status = subprocess.run(command, env=env).returncode
    if status != 0:
        print(f"zeropp dump: error: {' '.join(command)} exited with status {status}; "
              f"the dump in {out} may be incomplete", file=sys.stderr)
        return status if 0 < status < 256 else 1
    graphs = sorted(out.glob("rank*/*.comm.json"))
    if not graphs:
        raise UsageError("the script compiled no graph with backend='zeropp' (torch.compile(model, backend='zeropp'))")
    ranks = sorted({p.parent.name for p in graphs})
    print(f"zeropp dump: {len(graphs)} graphs from {len(ranks)} rank(s) in {out}; see `zeropp report {args.out}`")
    return 0


# ------------------------------------------------------------------------------------ report


def _report(args: argparse.Namespace) -> int:
    from .reports.dump import LAYER_RUNS, read_layer_runs, read_pass_summary
    from .reports.ledger import CommReport, GraphComm

    folder = _rank_folder(Path(args.dir), args.rank)
    graphs = _read_dump(sorted(folder.glob("*.comm.json"), key=_compile_order), GraphComm.from_dict)
    summaries = _read_dump(sorted(folder.glob("*.summary.json"), key=_compile_order), read_pass_summary)
    runs = _read_dump([path for path in [folder / LAYER_RUNS] if path.is_file()], read_layer_runs)
    report = CommReport.from_graphs(graphs, runs[0] if runs else None)
    if args.format == "json":
        print(json.dumps({**report.to_dict(), "rank": args.rank, "graphs": [g.graph_name for g in graphs],
                          "passes": summaries}, indent=1))
        return 0
    if not args.brief:
        print(_pass_table(summaries, _width(args)))
        print()
    print(report.table(collectives=not args.brief, width=_width(args)))
    return 0


def _rank_folder(root: Path, rank: int) -> Path:
    if not root.is_dir():
        raise UsageError(f"{root} is not a folder; give the --out folder of `zeropp dump` (or Config.dump_dir)")
    folder = root if any(root.glob("*.comm.json")) else root / f"rank{rank}"
    if not any(folder.glob("*.comm.json")):
        raise UsageError(f"no graph dump (*.comm.json) for rank {rank} under {root}; was the script run "
                         "with `zeropp dump`, ZEROPP_DUMP_DIR or Config.dump_dir, and did it compile a graph?")
    return folder


def _read_dump(paths: list[Path], read: Callable[[Any], Any]) -> list[Any]:
    """Each dump file's JSON, through `read` (which checks it); any fault is one UsageError."""
    values = []
    for path in paths:
        try:
            values.append(read(json.loads(path.read_text())))
        except OSError as error:
            raise UsageError(f"cannot read {path}: {error}") from None
        except ValueError as error:  # not UTF-8, not JSON, or not what `zeropp dump` writes
            raise UsageError(f"{path} is not a zeropp dump file as `zeropp dump` writes it: {error}") from None
    return values


def _compile_order(path: Path) -> tuple[int, int, str]:
    """Dump files in the order they were written: by graph (g2 before g10), then joint, forward
    (or inference), backward, then by pass index."""
    match = re.match(r"g(\d+)\.(\w+)\.", path.name)
    if not match:
        return (-1, 0, path.name)
    kinds = {"joint": 0, "forward": 1, "inference": 1, "backward": 2}
    return (int(match.group(1)), kinds.get(match.group(2), 3), path.name)


def _pass_table(summaries: list[dict[str, Any]], width: int | None) -> str:
    def count(rows: list[dict[str, Any]]) -> str:
        return ", ".join(f"{r['count']} {r['op']} {r['dtype']} ({r['intra_bytes'] + r['inter_bytes']:,} B)"
                         for r in rows) or "none"

    rows = []
    for s in summaries:
        added = ", ".join(f"+{n} {op.split('.')[-2] if '.' in op else op}" for op, n in s["added"].items()
                          if not op.startswith("aten."))
        rows.append((s["graph"], s["pass"], f"{s['nodes_before']} -> {s['nodes_after']}",
                     f"{count(s['collectives_before'])} -> {count(s['collectives_after'])}"
                     + (f"; {added}" if added else "")))
    headers = ("graph", "pass", "nodes", "collectives before -> after (count, op, dtype, bytes received), "
               "non-aten ops added")
    return text_table.render(headers, rows, align="<<><", width=width)


# ----------------------------------------------------------------------------------- explain


def _explain(args: argparse.Namespace) -> int:
    from .config import Config, ConfigError
    from .reports.explain import predict

    config = Config.from_json(args.config)
    try:
        stored = Config(param_dtype=args.stored_dtype).param_dtype
    except ConfigError:
        raise UsageError(f"--stored-dtype {args.stored_dtype!r}: use fp32, bf16 or fp16") from None
    if args.world < 1:
        raise UsageError(f"--world {args.world} must be a positive number of ranks")
    if config.ranks_per_node:  # the config's value overrides the launcher's, which the flag stands for
        local = config.ranks_per_node
        if args.world % local:
            overrides = f", and overrides --ranks-per-node {args.ranks_per_node}" if args.ranks_per_node else ""
            raise UsageError(f"the config's ranks_per_node={local} ({args.config}) does not divide --world "
                             f"{args.world}{overrides}; change ranks_per_node in the config or --world")
    else:
        local = args.ranks_per_node
        if local is None:
            raise UsageError("give --ranks-per-node (the config sets no ranks_per_node)")
        if local < 1 or args.world % local:
            raise UsageError(f"--world {args.world} must be a positive multiple of the ranks per node ({local})")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prediction = predict(config, args.params, args.world, local, stored)
    for warning in caught:
        print(f"zeropp explain: warning: {warning.message}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(prediction.to_dict(), indent=1))
        return 0
    print(text_table.prose(f"{args.params:,} parameters (M = {2 * args.params:,} bytes), {args.world} ranks = "
                           f"{args.world // local} node(s) x {local}; {_describe(config, stored)}", _width(args)))
    print(prediction.table(_width(args)))
    return 0


def _describe(config: Config, stored: torch.dtype) -> str:
    qgz = f"INT{config.intra_node_gradient_bits}/INT{config.gradient_bits}" if config.quantized_gradients else "off"
    parts = [f"qwZ {'INT8' if config.quantized_weights else 'off'}",
             f"hpZ {config.hpz_partition_size or 'off'}"
             + (" (dequantized copy)" if config.hpz_partition_size and config.quantized_weights
                and not config.hpz_quantized_copy else ""),
             f"qgZ {qgz}",
             f"weights {str(config.param_dtype or stored).removeprefix('torch.')}",
             f"reduce {str(config.reduce_dtype).removeprefix('torch.')}"]
    if config.disable_passes:
        parts.append(f"disabled: {', '.join(config.disable_passes)}")
    return ", ".join(parts)


def _count(text: str) -> int:
    """'1300000000', '1.3B', '350M', '7e9' -> an integer count."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 1300000000, 1.3B, 350M)") from None
    if not math.isfinite(value):  # nan, inf, or past float's range (1e400)
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite parameter count (e.g. 1300000000, 1.3B, 350M)")
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of parameters")
    return int(value)


if __name__ == "__main__":
    sys.exit(main())
