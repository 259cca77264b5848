"""The commands behind `lazyckpt._cli.main`: each opens, reads or writes through the public
verbs. Kept apart from the parser, which `--help` and argument errors need alone, because
these import tensorstore and the formats. Only the commands that need jax import it
(`convert`, `demo`): `inspect` and `show` answer without waiting for it."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import EllipsisType
from typing import Any, TextIO

import numpy as np

import lazyckpt
from lazyckpt._array.patterns import spelled
from lazyckpt._array.tree import near_paths, subtree
from lazyckpt._display import as_given
from lazyckpt._errors import LazyckptError, NoMatchError, RenameError
from lazyckpt._orbax.layout import locate
from lazyckpt._storage.paths import basename, is_remote, normalize
from lazyckpt._text import ascii_int, human_bytes, printable, shown


def say(text: object = "", file: TextIO | None = None) -> None:
    """Print `text`, with control characters escaped: keys and strings come from the
    checkpoint, and must not drive the terminal. Data is printed as it is; messages
    name paths as the user gave them (see `say_message`)."""
    print(printable(str(text), lines=True), file=file)


def say_message(text: str) -> None:
    """Print a message to stderr with paths as the user gave them and URLs without
    their query strings (`lazyckpt._display`), whatever made it: an error from a
    library below lazyckpt too."""
    say(as_given(text), file=sys.stderr)


def show_warning(
    message: Warning | str, category: type[Warning], *args: object, **kwargs: object
) -> None:
    say_message(f"lazyckpt: warning: {message}")


def _open(args: argparse.Namespace) -> object:
    tree = lazyckpt.open(args.path, step=args.step, item=args.item)
    if getattr(args, "dequantize", False):
        tree = lazyckpt.dequantize(tree)
    return lazyckpt.select(tree, args.select) if getattr(args, "select", None) else tree


def _inspect(args: argparse.Namespace) -> None:
    steps = _steps(args.path)
    tree = _open(args)
    # JSON is for scripts: every leaf, whatever the fold.
    fold = not (args.expand or args.json)
    summary = lazyckpt.summary(tree, title=_title(args, steps), depth=args.depth, fold=fold)
    if args.json:
        shown_path = as_given(normalize(args.path))
        out = {"path": shown_path, "steps": steps, "leaves": summary.describe()}
        print(json.dumps(out, indent=1))
        return
    say(summary.text())


def _steps(path: str) -> list[int]:
    try:
        return lazyckpt.steps(path)
    except LazyckptError:
        return []


def _title(args: argparse.Namespace, steps: list[int]) -> str:
    """The path, the steps of a root and the step shown, and the item shown of a step
    with several (`item state; also: extra, metadata`)."""
    title = as_given(normalize(args.path))
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
    tree = _open(args)
    found = _subtree(tree, key)
    if not isinstance(found, lazyckpt.LazyArray):
        if index:
            raise LazyckptError(f"{key} is not an array, so it takes no index [{index}]")
        say(found if not isinstance(found, dict | list | tuple) else lazyckpt.summary(found))
        return
    view = found[parse_index(index)] if index else found
    say(f"{view!r}")
    with np.printoptions(threshold=200, edgeitems=4, linewidth=100):
        say(view.get())


def _subtree(tree: object, key: str) -> object:
    """The node at `key`: a key path, or a Hugging Face name (`model.norm.weight`) for
    one, read as `select` reads a dotted pattern."""
    wanted = key.strip("/")
    found = list(lazyckpt.leaves(tree))
    wanted = spelled(wanted, [path.split("/") for path, _ in found])
    for path, leaf in found:  # keys may hold '/' themselves
        if path == wanted:
            return leaf
    try:
        return subtree(tree, wanted.split("/") if wanted else [])
    except KeyError:
        raise NoMatchError(
            f"no key {key.strip('/')!r} in the checkpoint; {near_paths(tree, [key])}"
        ) from None


_IndexPart = int | slice | EllipsisType | None
"""One part of a NumPy basic index, as `parse_index` reads it."""


def _split_index(text: str) -> tuple[str, str]:
    """`name[index]` as its name and index text; the index's `[` is the one that
    matches the final `]` (lists of picks nest their own)."""
    text = text.strip()
    if text.endswith("]") and "[" in text:
        depth = 0
        for at in range(len(text) - 1, -1, -1):
            depth += {"]": 1, "[": -1}.get(text[at], 0)
            if depth == 0:
                return text[:at], text[at + 1 : -1]
    return text, ""


def _parts(text: str) -> list[str]:
    """`text` split at its commas outside brackets."""
    parts, depth, start = [], 0, 0
    for at, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    return [*parts, text[start:]]


def parse_index(text: str) -> tuple[_IndexPart | list[int], ...]:
    """A NumPy index from its text, without eval: ints, slices, `...`, None, and lists
    of ints that pick (`[3, 17, 42]`).

    >>> parse_index("0:3, :8"), parse_index("-1, ..., None, ::2")
    ((slice(0, 3, None), slice(None, 8, None)), (-1, Ellipsis, None, slice(None, None, 2)))
    >>> parse_index("[3, 17, -1], :8")
    ([3, 17, -1], slice(None, 8, None))
    """
    out: list[_IndexPart | list[int]] = []
    for part in (p.strip() for p in _parts(text)):
        if part.startswith("[") and part.endswith("]"):
            inner = part[1:-1].strip()
            out.append([_integer(p, text) for p in inner.split(",")] if inner else [])
        elif part == "...":
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
    # ASCII digits, as Python writes ints: int() also takes '\u0661', '1_0' and 5,000
    # digits (then raising its own ValueError).
    number = ascii_int(part.strip().removeprefix("-"))
    if number is None:
        raise LazyckptError(
            f"index {shown(text)}: {shown(part.strip())} is not an integer (up to 18 "
            "digits); use ints, slices (a:b:c), lists of ints ([3, 17]), ... or None"
        )
    return -number if part.strip().startswith("-") else number


def _stats(args: argparse.Namespace) -> None:
    results = lazyckpt.stats(_open(args), bins=args.bins, memory_budget=args.memory_budget)
    if args.json:
        print(json.dumps(results.describe(), indent=1))
    else:
        say(results.text(fold=not args.expand))
    if args.plot:  # (after the table: a figure that cannot be drawn loses no numbers)
        _draw(results.plot(), args.plot)


def _draw(figure: Any, path: str) -> None:
    try:  # (a name without a suffix is written as a PNG, under that very name)
        figure.savefig(path, format=None if Path(path).suffix else "png")
    except (OSError, ValueError) as error:  # a folder that is not there, an unknown suffix
        raise LazyckptError(f"--plot {path}: the figure cannot be written ({error})") from None


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
        say(as_given(str(result)))  # a report on files: its messages name them
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
        say(result.text(fold=not args.expand))
    if args.plot:
        _draw(result.plot(), args.plot)
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


_RENAME_FLAGS = {
    "rename_missing_ok=True": "--rename-missing-ok",
    "rename_dotted=True": "--rename-dotted",
    "use rename_dotted=False": "leave out --rename-dotted",
}


def _as_flags(message: str) -> str:
    """A refusal of `convert`'s rename, naming the flags to pass, not its keywords."""
    for keyword, flag in _RENAME_FLAGS.items():
        message = message.replace(keyword, flag)
    return message


class _Transform:
    """`--unstack`, `--stack` and `--script`, in that order, as one transform that
    pickles (by the script's path), so that `--processes` can send it to each process."""

    def __init__(self, unstack: tuple[str, ...], stack: tuple[str, ...], script: str | None):
        self.unstack, self.stack, self.script = unstack, stack, script
        self._loaded: Callable[[object], object] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"unstack": self.unstack, "stack": self.stack, "script": self.script}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.unstack, self.stack, self.script = state["unstack"], state["stack"], state["script"]
        self._loaded = None

    def script_function(self) -> Callable[[object], object]:
        if self._loaded is None:
            self._loaded = _script(self.script or "")
        return self._loaded

    def steps(self) -> list[Callable[[object], object]]:
        steps: list[Callable[[object], object]] = []
        steps += [functools.partial(lazyckpt.unstack_layers, at=key) for key in self.unstack]
        steps += [functools.partial(lazyckpt.stack_layers, at=key) for key in self.stack]
        return steps + ([self.script_function()] if self.script else [])

    def __call__(self, tree: object) -> object:
        for step in self.steps():
            tree = step(tree)
        return tree


def _convert(args: argparse.Namespace) -> None:
    from lazyckpt._orbax.plan import DEFAULT_CHUNK_BYTES  # (saving: imports jax)

    transform = _Transform(tuple(args.unstack), tuple(args.stack), args.script)
    if args.script:
        transform.script_function()  # (a script that fails to load fails before any work)
    rules = [tuple(rule) for rule in args.rename]
    if args.rename_file:
        rules += _rename_rules(args.rename_file)
    options: dict[str, Any] = {
        "source": args.path,
        "destination": args.destination,
        "to": args.to,
        "select": args.select,
        "dequantize": args.dequantize,
        "transform": transform if transform.steps() else None,
        "dtype": _dtype(args.dtype) if args.dtype else None,
        "rename": rules,
        "rename_dotted": args.rename_dotted,
        "rename_missing_ok": args.rename_missing_ok,
        "step": args.step,
        "item": args.item,
        "chunk_bytes": args.chunk_bytes or DEFAULT_CHUNK_BYTES,
        "max_shard_size": args.max_shard_size,
        "memory_budget": args.memory_budget,
        "overwrite": args.overwrite,
        "allow_expand": args.allow_expand,
        "progress": False if args.quiet else None,
        "metadata": dict(args.metadata) or None,  # (format=pt goes with it: save's)
        "processes": args.processes,
    }
    try:
        if args.dry_run:
            say(lazyckpt.convert(**options, dry_run=True))
            return
        out = lazyckpt.convert(**options)
    except RenameError as error:
        raise RenameError(_as_flags(str(error))) from None
    carried = getattr(out, "carried", ())
    if carried:
        say(f"carried {len(carried)} files that are not weights: {', '.join(carried)}")
    if is_remote(out):
        say(as_given(f"wrote {out}"))
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
    say(as_given(f"wrote {out} ({human_bytes(size)})"))


def _dtype(name: str) -> np.dtype[Any]:
    import jax.numpy as jnp  # (knows bfloat16 by name; convert imports jax anyway)

    try:
        return jnp.dtype(name)
    except TypeError:
        raise LazyckptError(
            f"--dtype {name!r} is not a dtype name; try float32, bfloat16 or float16"
        ) from None


def _demo(args: argparse.Namespace) -> None:
    from lazyckpt._cli.demo import run as run_demo  # (imports jax)

    run_demo(keep=args.keep)


RUN: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "inspect": _inspect,
    "show": _show,
    "stats": _stats,
    "verify": _verify,
    "diff": _diff,
    "convert": _convert,
    "demo": _demo,
}
