"""Command line: `jax-vmm info` (or `python -m jax_vmm info`)."""

from __future__ import annotations

import argparse
import os
import sys

from .info import main as info_main

DESCRIPTION = "jax_vmm: virtual-memory KV-cache buffers and graph-safe scratch for JAX."


def _prog() -> str:
    """The command as the user typed it: the console script, or python -m."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("jax-vmm") else "python -m jax_vmm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=_prog(), description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "info",
        help="platforms, VMM support per device, granularity, memory, JAX allocator settings",
    )
    args = parser.parse_args(argv)
    if args.command is None:  # a bare command: say what it can do
        parser.print_help()
        return 0
    return info_main()


if __name__ == "__main__":
    sys.exit(main())
