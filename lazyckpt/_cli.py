"""The `lazyckpt` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lazyckpt._errors import LazyckptError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lazyckpt", description="Open JAX checkpoints lazily; read only what you ask for."
    )
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="write a small sharded checkpoint and walk through lazyckpt on it"
    )
    demo.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from lazyckpt._demo import run

            run(keep=args.keep)
    except LazyckptError as error:
        if args.traceback:
            raise
        print(f"lazyckpt: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
