"""The ``flexpack`` command line: ``pack``, ``stats`` and ``demo``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="pack the bundled corpus and prove packed == per-document")
    demo.add_argument("--out", default="flexpack-demo", help="folder for the PNGs it writes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from flexpack.demo import main as demo_main

        return demo_main(out=args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
