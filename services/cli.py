"""The `tandem` command: one subcommand per tool or service, each imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module offers add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("common.models.make_model_cli", "write a seeded random-weight model folder"),
    "generate": ("common.engine.batch_generate", "offline batch inference from a JSONL file"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if argv and argv[0] in SUBCOMMANDS:
        # Import only the chosen subcommand: torch and friends are slow to import.
        name = argv[0]
        module = importlib.import_module(SUBCOMMANDS[name][0])
        module.add_arguments(sub.add_parser(name, help=SUBCOMMANDS[name][1]))
    else:
        for name, (_, help_text) in SUBCOMMANDS.items():
            sub.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    if not hasattr(args, "command") or args.command not in SUBCOMMANDS:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
