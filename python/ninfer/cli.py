"""The `ninfer` command (docs/cli.md).

Each subcommand is one `Command` in `COMMANDS`: a function that adds its arguments to a parser
and a function that runs it and returns the exit status. User errors never show a traceback:
a handler raises `CliError` (or lets a `ConvertError` through) and `main` prints
`error: <message>` to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CliError", "Command", "COMMANDS", "main"]

# Exit statuses: 1 = the operation ran and found a problem (e.g. a checksum mismatch),
# 2 = the input was unusable (missing file, bad magic, unknown recipe, bad arguments).
EXIT_FAILED = 1
EXIT_USAGE = 2


class CliError(Exception):
    def __init__(self, message: str, status: int = EXIT_USAGE):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Command:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _configure_convert(p: argparse.ArgumentParser) -> None:
    from ninfer.convert import RECIPES

    p.add_argument("source", help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("output", help="artifact file to write (or an existing directory to write into)")
    p.add_argument(
        "--recipe",
        default="bf16",
        help="encodings to use: " + "; ".join(f"{r.name}: {r.description}" for r in RECIPES.values()),
    )
    p.add_argument(
        "--components",
        help="comma-separated components to include (text, mtp); default: text, plus mtp when present",
    )
    p.add_argument("--name", help="model name stored in the artifact (default: the source directory name)")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress line and no warnings on stderr")


def _run_convert(args: argparse.Namespace) -> int:
    from ninfer.convert import convert

    comps = args.components.split(",") if args.components is not None else None
    report = convert(
        args.source,
        args.output,
        args.recipe,
        comps,
        name=args.name,
        overwrite=args.force,
        progress=not args.quiet,
    )
    if not args.quiet:
        print(f"{report['paths']['artifact']}  sha256 {report['sha256']}", file=sys.stderr)
        print(f"report: {report['paths']['conversion_json']}", file=sys.stderr)
    return 0


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".ninfer artifact")
    p.add_argument("--verify", action="store_true", help="check every tensor checksum (exit 1 on a mismatch)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_inspect(args: argparse.Namespace) -> int:
    from ninfer import _core
    from ninfer.convert.summary import format_summary, summarize

    try:
        art = _core.Artifact(args.file)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    if args.verify:
        try:
            art.verify()
        except ValueError as e:
            raise CliError(str(e), EXIT_FAILED) from None
    summary = summarize(art, args.file, verified=args.verify)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


COMMANDS: dict[str, Command] = {
    "convert": Command("convert a Hugging Face checkpoint into a .ninfer artifact", _configure_convert, _run_convert),
    "inspect": Command("describe a .ninfer artifact (and verify its checksums)", _configure_inspect, _run_inspect),
}


def build_parser() -> argparse.ArgumentParser:
    from ninfer import __version__

    parser = argparse.ArgumentParser(prog="ninfer", description="Fast inference for Qwen3.5/3.6 hybrid MoE models.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        cmd.configure(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`ninfer = "ninfer.cli:main"`); returns the exit status."""
    from ninfer.convert import ConvertError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
