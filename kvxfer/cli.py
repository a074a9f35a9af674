"""The ``kvxfer`` command: ``demo | bench | probe | doctor | proxy``.

Each subcommand lives in its own module and is imported only when run, so
``kvxfer doctor`` works without NIXL and ``kvxfer --help`` stays instant.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvxfer.tools.demo", "pull and push a model-shaped KV cache between two processes"),
    "bench": ("kvxfer.tools.bench", "benchmark kvxfer against raw NIXL and memcpy"),
    "probe": ("kvxfer.tools.probe", "handshake with a running instance and show what it serves"),
    "doctor": ("kvxfer.tools.doctor", "check RDMA NICs, routes, NIXL and the side channel"),
    "proxy": ("kvxfer.adapters.vllm.proxy", "run a prefill/decode proxy in front of vLLM"),
}


def _usage() -> str:
    lines = ["usage: kvxfer <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run `kvxfer <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvxfer`` console script."""
    try:
        rc = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at exit: a reader that went away shows up below
    except BrokenPipeError:
        # The reader went away (`kvxfer bench ... | head`): stop quietly, as a shell
        # tool does, and keep Python's own flush at exit from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for such a pipeline
    return rc


def _run(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from kvxfer._version import PROTOCOL_VERSION, __version__

        print(f"kvxfer {__version__} (protocol {PROTOCOL_VERSION})")
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"kvxfer: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    rc: int = module.main(args[1:])
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
