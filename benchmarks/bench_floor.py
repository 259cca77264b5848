"""What opening DeepSeek-V3's metadata costs at the least, in pure Python, and what a
tree whose subtrees are built only when walked would break (issue 48).

    python benchmarks/bench_floor.py [--root DIR] [--repeat N] [--lazy-node]

The model is `bench_summary.py`'s (91,991 tensors in 163 safetensors shards). The
floors are cumulative, each the fastest of `--repeat` fresh processes, no checks:

- headers: each shard's 8-byte length and JSON header read, and parsed with the
  standard library's `json` (and with `orjson` and `msgspec` where they are
  installed: lazyckpt does not depend on them);
- + an object: one plain object of 6 slots per tensor (a LazyArray holds 6);
- + nesting: each name split on `.` (its key path, kept in the object), nested into
  dicts;
- + walk: every leaf with its key path, as `lazyckpt.leaves` gives them (what
  `bench_summary.py` times after `open`).

The collector is paused meanwhile, as `lazyckpt.open` pauses it.

`--lazy-node` (needs jax) remakes the opened tree with subtrees that build their
children only when asked, and shows what `jax.tree_util` makes of them: a dict
subclass is one leaf to it, and a registered node another node type than dict, so a
tree of them does not match a plain dict target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import operator
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import fastest, fmt_bytes, in_fresh_process, machine, measure

from lazyckpt._array.tree import gc_paused
from tests.model_shapes import deepseek_v3

PARSERS = ("json", "orjson", "msgspec")


def parser(name: str) -> Callable[[bytes], Any]:
    if name == "orjson":
        import orjson

        return orjson.loads
    if name == "msgspec":
        import msgspec

        return msgspec.json.decode
    return json.loads


def headers(folder: str, parse: Callable[[bytes], Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each shard's name and parsed header, one at a time (as lazyckpt drops each
    header's JSON objects once it has checked them: all at once, they take 100 MiB)."""
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            yield shard.name, parse(f.read(length))


class Leaf:
    """A bare stand-in for a LazyArray: 6 slots, a plain `__init__`."""

    __slots__ = ("dtype", "file", "name", "path", "shape", "start")

    def __init__(
        self,
        path: tuple[str, ...],
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        start: int,
        file: str,
    ) -> None:
        self.path, self.name, self.dtype, self.shape, self.start, self.file = (
            path,
            name,
            dtype,
            shape,
            start,
            file,
        )


def leaves_of(
    parsed: Iterator[tuple[str, dict[str, Any]]], split: bool
) -> list[tuple[tuple[str, ...], Leaf]]:
    out = []
    for shard, header in parsed:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            path = tuple(map(sys.intern, name.split("."))) if split else (name,)
            start = entry["data_offsets"][0]
            leaf = Leaf(path, name, entry["dtype"], tuple(entry["shape"]), start, shard)
            out.append((path, leaf))
    return out


def nest(items: list[tuple[tuple[str, ...], Leaf]]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path, leaf in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return root


def walk(node: dict[str, Any], path: str, out: list[tuple[str, Leaf]]) -> None:
    """Each leaf with its key path joined by `/`, dict keys sorted: as `leaves` walks."""
    for key, child in sorted(node.items(), key=operator.itemgetter(0)):
        if type(child) is dict:
            walk(child, f"{path}{key}/", out)
        else:
            out.append((path + key, child))


def floor(folder: str, step: str, parser_name: str) -> dict[str, Any]:
    parse = parser(parser_name)

    def run() -> int:
        with gc_paused():  # (as lazyckpt.open: the collector's passes would dominate)
            return steps()

    def steps() -> int:
        parsed = headers(folder, parse)
        if step == "headers":
            return sum(len(header) - ("__metadata__" in header) for _, header in parsed)
        items = leaves_of(parsed, split=step != "object")
        if step == "object":
            return len(items)
        tree = nest(items)
        if step == "nesting":
            return len(items)
        out: list[tuple[str, Leaf]] = []
        walk(tree, "", out)
        return len(out)

    return measure(run, keep=True)


def lazy_node(folder: str) -> None:
    """The model's tree with its dicts replaced by subtrees that build their children
    only when asked, two ways, and what `jax.tree_util` makes of each next to the plain
    tree: a dict subclass that fills itself on first access, and a registered pytree
    node that builds its children when jax flattens it."""
    import jax

    import lazyckpt

    plain = lazyckpt.open(folder)

    class LazyDict(dict):  # type: ignore[type-arg]
        """Filled from `make` on first access (here from the plain subtree, as a real
        one would build its LazyArrays from the headers)."""

        def __init__(self, make: Callable[[], dict[str, Any]]) -> None:
            super().__init__()
            self.make = make

    class LazyNode:
        def __init__(self, make: Callable[[], dict[str, Any]]) -> None:
            self.make = make

    def flatten(node: LazyNode) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        kids = node.make()
        keys = tuple(sorted(kids))
        return [(jax.tree_util.DictKey(k), kids[k]) for k in keys], keys

    jax.tree_util.register_pytree_with_keys(
        LazyNode, flatten, lambda keys, kids: dict(zip(keys, kids, strict=True))
    )

    def lazily(kind: type, tree: dict[str, Any]) -> Any:
        return kind(lambda: {k: lazily(kind, v) if type(v) is dict else v for k, v in tree.items()})

    target = jax.tree_util.tree_map(lambda leaf: 0, plain)  # a plain dict target
    for kind in (LazyDict, LazyNode):
        print(f"{kind.__name__}:")
        _show(lazily(kind, plain), plain, target)


def _show(tree: object, plain: object, target: object) -> None:
    """What jax's tree functions make of `tree`, beside the plain tree and a target."""
    import jax

    checks: list[tuple[str, Callable[[], object]]] = [
        ("leaves", lambda: f"{len(jax.tree_util.tree_leaves(tree)):,}"),
        (
            "same structure as the plain tree",
            lambda: jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(plain),
        ),
        ("jax.tree.map(f, tree, plain_target)", lambda: _kind(jax.tree.map(_first, tree, target))),
        ("jax.tree.map(f, plain_target, tree)", lambda: _kind(jax.tree.map(_first, target, tree))),
        ("isinstance(tree, dict)", lambda: isinstance(tree, dict)),
    ]
    for name, check in checks:
        try:
            shown = check()
        except Exception as error:  # noqa: BLE001 - what breaks is the point
            shown = f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"
        print(f"  {name}: {shown}")


def _first(a: object, b: object) -> object:
    return a


def _kind(tree: object) -> str:
    return f"a {type(tree).__name__}"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--root", default="/tmp/lazyckpt-bench-summary")
    args.add_argument("--repeat", type=int, default=3)
    args.add_argument("--lazy-node", action="store_true")
    options = args.parse_args()
    folder = str(deepseek_v3(Path(options.root) / "DeepSeek-V3"))
    print(f"machine: {machine()}\nmodel: {folder}\n")
    if options.lazy_node:
        lazy_node(folder)
        return
    print(f"{'floor':34} {'time':>8} {'peak memory':>13}")
    for name in PARSERS:
        if importlib.util.find_spec(name) is None:
            print(f"{name:34} not installed")
            continue
        for step in ("headers", "object", "nesting", "walk"):
            best = fastest(
                [in_fresh_process(floor, folder, step, name) for _ in range(options.repeat)]
            )
            label = f"{name}: {step if step == 'headers' else '+ ' + step}"
            print(
                f"{label:34} {best['seconds']:7.3f}s {fmt_bytes(best['peak_above_baseline']):>13}"
            )


if __name__ == "__main__":
    main()
