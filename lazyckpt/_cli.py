"""The `lazyckpt` command line."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

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
    convert = commands.add_parser(
        "convert",
        help="rewrite a checkpoint: keep some leaves, cast floats, re-chunk; streamed",
        description="Rewrite the checkpoint at SOURCE as an Orbax PyTree checkpoint at "
        "DESTINATION, streaming arrays within a memory budget.",
    )
    convert.add_argument("source", help="checkpoint folder, step folder or manager root")
    convert.add_argument("destination", help="folder to create")
    convert.add_argument(
        "--select",
        action="append",
        metavar="PATTERN",
        help="keep leaves matching PATTERN ('params/**/kernel'); repeat for several",
    )
    convert.add_argument("--dtype", help="cast floating-point arrays to this dtype (bfloat16)")
    convert.add_argument("--step", type=int, help="step of a CheckpointManager root")
    convert.add_argument("--item", help="item of a composite step (state, params, ...)")
    convert.add_argument(
        "--memory-budget", type=parse_size, metavar="SIZE", help="bytes in flight (256MiB)"
    )
    convert.add_argument(
        "--chunk-size", type=parse_size, metavar="SIZE", help="stored chunk size (4MiB)"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace DESTINATION")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from lazyckpt._demo import run

            run(keep=args.keep)
        elif args.command == "convert":
            _convert(args)
    except LazyckptError as error:
        if args.traceback:
            raise
        print(f"lazyckpt: error: {error}", file=sys.stderr)
        return 1
    return 0


def _convert(args: argparse.Namespace) -> None:
    from lazyckpt._convert import convert
    from lazyckpt._format import human_bytes
    from lazyckpt._save import DEFAULT_CHUNK_BYTES

    try:
        dtype = _dtype(args.dtype) if args.dtype else None
    except TypeError as error:
        raise LazyckptError(f"--dtype {args.dtype!r}: {error}") from None
    out = convert(
        args.source,
        args.destination,
        select=args.select,
        dtype=dtype,
        step=args.step,
        item=args.item,
        chunk_bytes=args.chunk_size or DEFAULT_CHUNK_BYTES,
        memory_budget=args.memory_budget,
        overwrite=args.overwrite,
        progress=False if args.quiet else None,
    )
    size = sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(out)
        for name in names
    )
    print(f"wrote {out} ({human_bytes(size)})")


def _dtype(name: str) -> Any:
    import jax.numpy as jnp

    try:
        return jnp.dtype(name)
    except TypeError:
        raise TypeError("not a dtype name; try float32, bfloat16 or float16") from None


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `256MiB`, `1G`, `64k` or `1048576` (binary units).

    >>> parse_size("256MiB"), parse_size("1g"), parse_size("4096")
    (268435456, 1073741824, 4096)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes or a number with KiB, MiB, GiB (256MiB)"
        )
    return int(float(match[1]) * _UNITS[match[2]])


if __name__ == "__main__":
    sys.exit(main())
