"""Command line: ``python -m jax_vmm info``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_vmm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="platforms, VMM support per device, granularity, memory, JAX allocator settings")
    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import main as info_main

        return info_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
