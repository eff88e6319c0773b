"""The `resin` command line."""
from __future__ import annotations

import argparse
import sys

from resin import hal


def cmd_backends(args: argparse.Namespace) -> int:
    sel = hal.describe_backend(args.backend, arch=args.arch, ops=args.ops)
    for key, value in sel.platform.describe():
        print(f"{key:>14}: {value}")
    print(f"{'backend':>14}: {sel.backend.name} ({sel.backend.note})\n")
    print(sel.format_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resin", description="Resin: LLM inference on any chip.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="platform facts and the op -> provider table",
                       description="Print the platform facts and which provider each HAL op would use, and why "
                                   "the providers before it were skipped. Works for absent hardware too.")
    p.add_argument("--backend", default="auto", choices=["auto", *hal.BACKENDS])
    p.add_argument("--arch", default=None, help="describe this architecture (e.g. gfx942, gfx950, sm_90)")
    p.add_argument("--ops", default=None, help="provider overrides, e.g. attention=native")
    p.set_defaults(func=cmd_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
