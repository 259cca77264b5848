"""The `lazyckpt` command line: inspect, show, stats, diff, convert, demo."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any, TextIO

import jax.numpy as jnp
import numpy as np

import lazyckpt
from lazyckpt import _sizes as sizes
from lazyckpt._array.tree import subtree
from lazyckpt._cli.demo import run as run_demo
from lazyckpt._errors import LazyckptError, NoMatchError, SizeError
from lazyckpt._orbax.layout import locate
from lazyckpt._orbax.plan import DEFAULT_CHUNK_BYTES
from lazyckpt._storage.paths import basename, is_remote, normalize
from lazyckpt._text import human_bytes, printable


def parse_size(text: str) -> int:
    """Bytes from a SIZE flag, as the API reads sizes (`lazyckpt._sizes`); a bad one
    is argparse's usage error, which names the flag.

    >>> parse_size("256MiB"), parse_size("5GB"), parse_size("4096")
    (268435456, 5000000000, 4096)
    """
    try:
        return sizes.parse_size(text)
    except SizeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazyckpt", description="Open JAX checkpoints lazily; read only what you ask for."
    )
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, *, source: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary)
        if source:
            sub.add_argument("path", help="checkpoint folder, step folder or manager root")
            sub.add_argument("--step", type=int, help="step of a CheckpointManager root")
            sub.add_argument("--item", help="item of a step folder (state, params, ...)")
        return sub

    def selecting(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--select",
            action="append",
            metavar="PATTERN",
            help="only leaves matching PATTERN ('params/**/kernel'); repeat for several",
        )

    def budget(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--memory-budget",
            type=parse_size,
            metavar="SIZE",
            help="bytes in flight: 256MiB, 1GB (10^9) or bytes",
        )

    inspect = command("inspect", "the tree: shapes, dtypes, sizes, saved shardings; reads no data")
    selecting(inspect)
    inspect.add_argument("--depth", type=int, metavar="N", help="show N levels of the tree")
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts")

    show = command("show", "print a few values: lazyckpt show PATH 'params/embed[0:3, :8]'")
    show.add_argument("key", help="key path, with an optional NumPy-style index")

    stats = command("stats", "min, max, mean, std, NaN and Inf counts, read chunk by chunk")
    selecting(stats)
    budget(stats)
    stats.add_argument("--bins", type=int, help="also a histogram with this many bins")
    stats.add_argument("--json", action="store_true", help="print JSON for scripts")

    verify = command("verify", "decode every chunk within the budget; report damage by key path")
    selecting(verify)
    budget(verify)
    verify.add_argument("--json", action="store_true", help="print JSON for scripts")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")

    diff = command(
        "diff", "compare two checkpoints: structure, shapes, dtypes, values", source=False
    )
    diff.add_argument("first", help="checkpoint A")
    diff.add_argument("second", help="checkpoint B")
    diff.add_argument("--step", type=int, nargs=2, metavar=("A", "B"), help="steps of roots")
    diff.add_argument("--item", help="item of the step folders (state, params, ...)")
    selecting(diff)
    budget(diff)
    diff.add_argument("--values", action="store_true", help="compare values too (reads data)")
    diff.add_argument("--json", action="store_true", help="print JSON for scripts")
    diff.add_argument("--exit-code", action="store_true", help="exit with 1 if they differ")

    convert = command(
        "convert",
        "rewrite a checkpoint as Orbax or safetensors: keep leaves, rename, cast, re-chunk; "
        "streamed",
    )
    convert.add_argument("destination", help="folder (or .safetensors file) to create")
    convert.add_argument(
        "--to", choices=("orbax", "safetensors"), help="format (default: from DESTINATION)"
    )
    selecting(convert)
    budget(convert)
    convert.add_argument("--dtype", help="cast floating-point arrays to this dtype (bfloat16)")
    convert.add_argument(
        "--rename",
        nargs=2,
        action="append",
        default=[],
        metavar=("PATTERN", "REPLACEMENT"),
        help="rename key paths by a regular expression ('^params/' 'model/'); repeatable",
    )
    convert.add_argument(
        "--rename-file",
        metavar="FILE",
        help="rename rules, one 'PATTERN REPLACEMENT' per line ('#' comments)",
    )
    convert.add_argument(
        "--unstack",
        action="append",
        default=[],
        metavar="KEY",
        help="split the scanned arrays under KEY into KEY/{i}/... per layer; repeatable",
    )
    convert.add_argument(
        "--stack",
        action="append",
        default=[],
        metavar="KEY",
        help="stack KEY/{i}/... per-layer arrays into KEY/...; repeatable",
    )
    convert.add_argument(
        "--script",
        metavar="FILE.py",
        help="a Python file defining convert(tree) -> tree, run on the lazy tree (after "
        "--unstack/--stack, before --rename)",
    )
    convert.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="safetensors: most bytes of tensors per file (default 5GB: 5 x 10^9 bytes)",
    )
    convert.add_argument(
        "--chunk-bytes",
        type=parse_size,
        default=DEFAULT_CHUNK_BYTES,
        metavar="SIZE",
        help="about how many bytes per stored chunk (default 4MiB)",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace DESTINATION")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")

    demo = command(
        "demo", "write a small sharded checkpoint and walk through lazyckpt on it", source=False
    )
    demo.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    return parser


def _say(text: object = "", file: TextIO | None = None) -> None:
    """Print `text`, with control characters escaped: keys and strings come from the
    checkpoint, and must not drive the terminal."""
    print(printable(str(text), lines=True), file=file)


def _show_warning(
    message: Warning | str, category: type[Warning], *args: object, **kwargs: object
) -> None:
    _say(f"lazyckpt: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            # One plain line per warning, as errors are: not Python's source-line form.
            warnings.showwarning = _show_warning
            return _RUN[args.command](args) or 0
    except BrokenPipeError:  # `lazyckpt inspect ... | head`
        return 0
    except Exception as error:
        if args.traceback:
            raise
        message = (
            str(error) if isinstance(error, LazyckptError) else f"{type(error).__name__}: {error}"
        )
        _say(f"lazyckpt: error: {message}", file=sys.stderr)
        return 1


def _open(args: argparse.Namespace) -> object:
    tree = lazyckpt.open(args.path, step=args.step, item=args.item)
    return lazyckpt.select(tree, args.select) if getattr(args, "select", None) else tree


def _inspect(args: argparse.Namespace) -> None:
    steps = _steps(args.path)
    tree = _open(args)
    summary = lazyckpt.summary(tree, title=_title(args, steps), depth=args.depth)
    if args.json:
        out = {"path": normalize(args.path), "steps": steps, "leaves": summary.describe()}
        print(json.dumps(out, indent=1))
        return
    _say(summary.text())


def _steps(path: str) -> list[int]:
    try:
        return lazyckpt.steps(path)
    except LazyckptError:
        return []


def _title(args: argparse.Namespace, steps: list[int]) -> str:
    """The path, the steps of a root and the step shown, and the item shown of a step
    with several (`item state; also: extra, metadata`)."""
    title = normalize(args.path)
    notes = []
    if steps:
        shown = args.step if args.step is not None else steps[-1]
        listed = ", ".join(map(str, steps[-20:])) + (" ..." if len(steps) > 20 else "")
        notes.append(f"steps: {listed}; showing {shown}")
    items = lazyckpt.items(args.path, step=args.step) if steps or args.item else {}
    if items:
        item = basename(locate(args.path, step=args.step, item=args.item))
        others = [name for name in items if name != item]
        notes.append(f"item {item}" + (f"; also: {', '.join(others)}" if others else ""))
    return title + (f" ({'; '.join(notes)})" if notes else "")


def _show(args: argparse.Namespace) -> None:
    key, index = _split_index(args.key)
    tree = lazyckpt.open(args.path, step=args.step, item=args.item)
    found = _subtree(tree, key)
    if not isinstance(found, lazyckpt.LazyArray):
        if index:
            raise LazyckptError(f"{key} is not an array, so it takes no index [{index}]")
        _say(found if not isinstance(found, dict | list | tuple) else lazyckpt.summary(found))
        return
    view = found[parse_index(index)] if index else found
    _say(f"{view!r}")
    with np.printoptions(threshold=200, edgeitems=4, linewidth=100):
        _say(view.get())


def _subtree(tree: object, key: str) -> object:
    wanted = key.strip("/")
    for path, leaf in lazyckpt.leaves(tree):  # keys may hold '/' themselves
        if path == wanted:
            return leaf
    try:
        return subtree(tree, wanted.split("/") if wanted else [])
    except KeyError:
        near = [p for p, _ in lazyckpt.leaves(tree)][:8]
        raise NoMatchError(
            f"no key {wanted!r} in the checkpoint; its keys look like {near}"
        ) from None


_IndexPart = int | slice | EllipsisType | None
"""One part of a NumPy basic index, as `parse_index` reads it."""


def _split_index(text: str) -> tuple[str, str]:
    text = text.strip()
    if text.endswith("]") and "[" in text:
        start = text.rindex("[")
        return text[:start], text[start + 1 : -1]
    return text, ""


def parse_index(text: str) -> tuple[_IndexPart, ...]:
    """A NumPy basic index from its text, without eval.

    >>> parse_index("0:3, :8"), parse_index("-1, ..., None, ::2")
    ((slice(0, 3, None), slice(None, 8, None)), (-1, Ellipsis, None, slice(None, None, 2)))
    """
    out: list[_IndexPart] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "...":
            out.append(Ellipsis)
        elif part in ("None", "newaxis", "np.newaxis"):
            out.append(None)
        elif ":" in part:
            bounds = part.split(":")
            if len(bounds) > 3:
                raise LazyckptError(f"index {text!r}: {part!r} has more than two ':'")
            out.append(slice(*(_integer(b, text) if b.strip() else None for b in bounds)))
        else:
            out.append(_integer(part, text))
    return tuple(out)


def _integer(part: str, text: str) -> int:
    try:
        return int(part)
    except ValueError:
        raise LazyckptError(
            f"index {text!r}: {part!r} is not an integer; use ints, slices (a:b:c), ... or None"
        ) from None


def _stats(args: argparse.Namespace) -> None:
    results = lazyckpt.stats(_open(args), bins=args.bins, memory_budget=args.memory_budget)
    if args.json:
        print(json.dumps(results.describe(), indent=1))
        return
    _say(results)


def _verify(args: argparse.Namespace) -> int:
    result = lazyckpt.verify(
        args.path,
        args.select,
        step=args.step,
        item=args.item,
        memory_budget=args.memory_budget,
        progress=False if args.quiet or args.json else None,
    )
    if args.json:
        print(json.dumps(result.describe(), indent=1))
    else:
        _say(result)
    return 0 if result.ok else 1


def _diff(args: argparse.Namespace) -> int:
    result = lazyckpt.diff(
        args.first,
        args.second,
        select=args.select,
        step=tuple(args.step) if args.step else None,
        item=args.item,
        values=args.values,
        memory_budget=args.memory_budget,
    )
    if args.json:
        print(json.dumps(result.describe(), indent=1))
    else:
        _say(result)
    return 1 if args.exit_code and result else 0


def _script(path: str) -> Callable[[object], object]:
    """The `convert(tree)` function of a conversion script."""
    try:
        source = Path(path).read_text()
    except OSError as error:
        raise LazyckptError(f"--script {path}: cannot be read ({error.strerror})") from None
    namespace: dict[str, object] = {"__name__": "lazyckpt_script", "__file__": path}
    exec(compile(source, path, "exec"), namespace)  # the user's own script, as python would
    found = namespace.get("convert")
    if not callable(found):
        raise LazyckptError(f"--script {path}: defines no function convert(tree) -> tree")
    return found


def _rename_rules(path: str) -> list[tuple[str, str]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise LazyckptError(f"--rename-file {path}: cannot be read ({error.strerror})") from None
    rules = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise LazyckptError(
                f"--rename-file {path}, line {number}: expected 'PATTERN REPLACEMENT', "
                f"found {len(fields)} fields"
            )
        rules.append((fields[0], fields[1]))
    return rules


def _convert(args: argparse.Namespace) -> None:
    steps: list[Callable[[object], object]] = []
    steps += [functools.partial(lazyckpt.unstack_layers, at=key) for key in args.unstack]
    steps += [functools.partial(lazyckpt.stack_layers, at=key) for key in args.stack]
    if args.script:
        steps.append(_script(args.script))
    rules = [tuple(rule) for rule in args.rename]
    if args.rename_file:
        rules += _rename_rules(args.rename_file)

    def transform(tree: object) -> object:
        for step in steps:
            tree = step(tree)
        return tree

    out = lazyckpt.convert(
        args.path,
        args.destination,
        to=args.to,
        select=args.select,
        transform=transform if steps else None,
        dtype=_dtype(args.dtype) if args.dtype else None,
        rename=rules,
        step=args.step,
        item=args.item,
        chunk_bytes=args.chunk_bytes,
        max_shard_size=args.max_shard_size,
        memory_budget=args.memory_budget,
        overwrite=args.overwrite,
        progress=False if args.quiet else None,
    )
    if is_remote(out):
        _say(f"wrote {out}")
        return
    size = (
        os.path.getsize(out)
        if os.path.isfile(out)
        else sum(
            os.path.getsize(os.path.join(folder, name))
            for folder, _, names in os.walk(out)
            for name in names
        )
    )
    _say(f"wrote {out} ({human_bytes(size)})")


def _dtype(name: str) -> np.dtype[Any]:
    try:
        return jnp.dtype(name)
    except TypeError:
        raise LazyckptError(
            f"--dtype {name!r} is not a dtype name; try float32, bfloat16 or float16"
        ) from None


def _demo(args: argparse.Namespace) -> None:
    run_demo(keep=args.keep)


_RUN: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "inspect": _inspect,
    "show": _show,
    "stats": _stats,
    "verify": _verify,
    "diff": _diff,
    "convert": _convert,
    "demo": _demo,
}


if __name__ == "__main__":
    sys.exit(main())
