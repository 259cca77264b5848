"""Showing lazy trees: a text and HTML summary, from metadata alone.

`summary(tree)` lists every leaf in tree order with its shape, dtype, size, saved
partition spec and mesh, and every subtree with the count and total size of the
arrays below it. Nothing here reads array data, so a 10,000-array checkpoint shows
at once; the HTML form (what notebooks display) is a collapsible tree.
"""

from __future__ import annotations

import html
from typing import Any, TypeGuard

import attrs
import jax
import numpy as np

from lazyckpt._array.sharding import SavedSharding
from lazyckpt._array.tree import Key, Path, children, keystr
from lazyckpt._html import STYLE, array_nbytes, array_row, array_type, key_cell, spec_of
from lazyckpt._lazy import LazyArray
from lazyckpt._placement import saved_from_one_device
from lazyckpt._text import human_bytes, printable

_OPEN_ALL_UP_TO = 400  # rows; bigger trees open only their first level

ShownArray = LazyArray | np.ndarray | jax.Array | jax.ShapeDtypeStruct
"""A leaf that shows as an array (see `is_array`)."""


@attrs.frozen
class Row:
    """One line of a summary: a subtree (`group`) or a leaf."""

    path: Path
    depth: int
    group: bool
    arrays: int = 0  # arrays at or below this row
    nbytes: int = 0  # their size as views, in their dtypes
    leaf: object = None
    kind: str = ""
    """The container's type, where it is not a dict, list or tuple (`State`, `Param`)."""
    keys_shown: int = 1
    """Trailing keys of `path` the row's name shows: a leaf alone in a box such as an
    `nnx.Variable` shows as `kernel/value`."""

    @property
    def name(self) -> str:
        return keystr(self.path[-self.keys_shown :]) if self.path else "(root)"

    def describe(self) -> dict[str, Any]:
        """The row as JSON-ready data (what `lazyckpt inspect --json` prints)."""
        out: dict[str, Any] = {"path": keystr(self.path)}
        if self.kind:
            out["type"] = self.kind
        if self.group:
            out.update(kind="tree", arrays=self.arrays, nbytes=self.nbytes)
            return out
        leaf = self.leaf
        if isinstance(leaf, LazyArray):
            sharding = leaf.sharding
            out.update(
                kind="array",
                shape=list(leaf.shape),
                dtype=str(leaf.dtype),
                nbytes=leaf.nbytes,
                chunks=list(leaf.chunks),
                sharding=None if sharding is None else _sharding_dict(sharding),
            )
            if leaf.dtype != leaf.stored.dtype and not leaf.key_impl:
                out["stored_dtype"] = str(leaf.stored.dtype)
            return out
        if is_array(leaf):
            out.update(
                kind="array",
                shape=list(leaf.shape),
                dtype=str(leaf.dtype),
                nbytes=array_nbytes(leaf),
            )
            return out
        out.update(kind="value", value=_json_value(leaf))
        return out


def _sharding_dict(sharding: SavedSharding) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": sharding.kind}
    if sharding.kind == "NamedSharding":
        out["mesh"] = sharding.mesh_axes
        out["spec"] = [list(e) if isinstance(e, tuple) else e for e in sharding.partition_spec]
    elif sharding.device is not None:
        out["device"] = sharding.device
    return out


def _json_value(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict | list | tuple) and not value:
        return type(value)()
    return repr(value)


def rows(tree: object) -> list[Row]:
    """Every subtree and leaf of `tree`, in tree order, with totals per subtree."""
    out: list[Row] = []
    _collect(tree, (), 0, out)
    return out


_PLAIN = (dict, list, tuple)


def _collect(node: object, path: Path, depth: int, out: list[Row]) -> tuple[int, int]:
    kids = children(node)
    if not kids:  # a leaf, None or an empty container
        if is_array(node):
            nbytes = array_nbytes(node)
            out.append(Row(path, depth, False, 1, nbytes, node))
            return 1, nbytes
        out.append(Row(path, depth, False, leaf=node))
        return 0, 0
    kind = "" if type(node) in _PLAIN else type(node).__name__
    if len(kids) == 1 and (kind or kids[0][0] == "value") and children(kids[0][1]) is None:
        # A box around one leaf (nnx.Variable, nn.Partitioned, or such a box as saved):
        # one row, `kernel/value`.
        key, leaf = kids[0]
        count = int(is_array(leaf))
        nbytes = array_nbytes(leaf) if count else 0
        out.append(Row((*path, key), depth, False, count, nbytes, leaf, kind, keys_shown=2))
        return count, nbytes
    index = len(out)
    out.append(Row(path, depth, True, kind=kind))
    arrays = nbytes = 0
    for key, child in _display_order(kids):
        count, size = _collect(child, (*path, key), depth + 1, out)
        arrays += count
        nbytes += size
    out[index] = attrs.evolve(out[index], arrays=arrays, nbytes=nbytes)
    return arrays, nbytes


def _display_order(kids: list[tuple[Key, object]]) -> list[tuple[Key, object]]:
    """Layers keyed '0', '1', ..., '10' (as checkpoints store int keys) in numeric
    order, not jax's string order. (Compared as digits, shortest first: int() would
    refuse a key of thousands of digits.)"""
    if all(isinstance(key, str) and key.isascii() and key.isdigit() for key, _ in kids):
        return sorted(kids, key=lambda kid: _by_number(str(kid[0]).lstrip("0")))
    return kids


def _by_number(digits: str) -> tuple[int, str]:
    return len(digits), digits


@attrs.frozen
class Summary:
    """What `lazyckpt.summary` returns: shows as text (`print`, `repr`) and as a
    collapsible HTML tree in notebooks; `describe()` gives the same as data."""

    rows: tuple[Row, ...]
    title: str = ""
    note: str = ""
    """A last line about the whole tree: that it was saved from one device."""

    def describe(self) -> list[dict[str, Any]]:
        return [row.describe() for row in self.rows if row.path]

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def text(self) -> str:
        lines = [self._headline()] if self.title else []
        table = []
        for row in self.rows:
            if not row.path:
                continue
            indent = "  " * (row.depth - 1)
            name = printable(row.name)  # keys come from the checkpoint: no escapes reach it
            if row.group:
                table.append((f"{indent}{name}/", _group_type(row), _size(row), "", ""))
            elif is_array(row.leaf):
                spec, mesh = spec_of(row.leaf)
                table.append((f"{indent}{name}", _leaf_type(row), _size(row), spec, mesh))
            else:
                table.append((f"{indent}{name}", printable(_short(row.leaf)), "", "", ""))
        widths = [max((len(r[i]) for r in table), default=0) for i in range(5)]
        for r in table:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2])]
            lines.append("  ".join([*cells, r[3].ljust(widths[3]), r[4]]).rstrip())
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _headline(self) -> str:
        root = self.rows[0] if self.rows else None
        arrays, nbytes = (root.arrays, root.nbytes) if root else (0, 0)
        return f"{printable(self.title)}: {_count(arrays)}, {human_bytes(nbytes)}"

    def _repr_html_(self) -> str:
        total = sum(1 for row in self.rows if row.path)
        open_all = total <= _OPEN_ALL_UP_TO
        parts = ['<div class="lazyckpt">', STYLE]
        if self.title:
            parts.append(f'<div class="head">{html.escape(self._headline())}</div>')
        depth_open: list[int] = []
        for row in self.rows:
            if not row.path:
                continue
            while depth_open and depth_open[-1] >= row.depth:
                depth_open.pop()
                parts.append("</div></details>")
            key = html.escape(keystr(row.path), quote=True)
            name = html.escape(row.name)
            if row.group:
                opened = " open" if open_all or row.depth == 1 else ""
                parts.append(
                    f'<details{opened} data-path="{key}"><summary class="row">'
                    f"{key_cell(name + '/', row.depth)}"
                    f'<span class="t">{html.escape(_group_type(row))}</span>'
                    f'<span class="n">{_size(row)}</span></summary><div class="kids">'
                )
                depth_open.append(row.depth)
            elif is_array(row.leaf):
                parts.append(array_row(key, name, row.leaf, row.depth, row.kind))
            else:
                value = html.escape(_short(row.leaf))
                parts.append(
                    f'<div class="row leaf" data-path="{key}">{key_cell(name, row.depth)}'
                    f'<span class="t">{value}</span></div>'
                )
        parts.extend("</div></details>" for _ in depth_open)
        if self.note:
            parts.append(f'<div class="head">{html.escape(self.note)}</div>')
        parts.append("</div>")
        return "".join(parts)


def _count(arrays: int) -> str:
    return f"{arrays} array" + ("" if arrays == 1 else "s")


def _size(row: Row) -> str:
    return human_bytes(row.nbytes) if row.arrays else ""


def _group_type(row: Row) -> str:
    return ", ".join(part for part in (row.kind, _count(row.arrays) if row.arrays else "") if part)


def _leaf_type(row: Row) -> str:
    return f"{row.kind} {array_type(row.leaf)}" if row.kind else array_type(row.leaf)


def is_array(value: object) -> TypeGuard[ShownArray]:
    """Whether a leaf shows as an array: a LazyArray, a jax or NumPy array, or an
    abstract one (`jax.ShapeDtypeStruct`)."""
    return isinstance(value, ShownArray)


def _short(value: object, limit: int = 60) -> str:
    if callable(value) and not isinstance(value, type):
        # Functions held in a model (an activation, an apply_fn): by name, not address.
        name = getattr(value, "__name__", None) or type(value).__name__
        return f"<function {name}>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summary(tree: object, title: str = "", *, depth: int | None = None) -> Summary:
    """A summary of a lazy tree (or any pytree) from metadata alone.

    Shows as an aligned text table, and in notebooks as a collapsible HTML tree; each
    subtree carries the number and total size of the arrays below it. A last line
    says when the checkpoint was saved from one device (no sharding to reuse).

    Args:
        tree: A lazy tree from `lazyckpt.open`, or any pytree (jax and NumPy arrays,
            `jax.ShapeDtypeStruct`s, an `nnx.State`).
        title: A headline with the total number and size of the arrays.
        depth: Show rows down to this many levels; deeper subtrees show only as their
            totals. `None` shows everything.

    >>> print(lazyckpt.summary(lazyckpt.open(path)))
    opt_state/  1 array       256 B
      mu        float32[8,8]  256 B
    params/     2 arrays      288 B
      b         float32[8]     32 B  P()          mesh x=4 y=2
      w         float32[8,8]  256 B  P('x', 'y')  mesh x=4 y=2
    step        3
    >>> print(lazyckpt.summary(lazyckpt.open(path), depth=1))
    opt_state/  1 array   256 B
    params/     2 arrays  288 B
    step        3
    """
    if depth is not None and depth < 1:
        raise ValueError(f"summary: depth must be 1 or more, found {depth}")
    every = rows(tree)
    shown = [row for row in every if depth is None or row.depth <= depth]
    device = saved_from_one_device(row.leaf for row in every if not row.group)
    note = (
        f"saved from one device ({device}): there is no sharding to reuse, "
        "saved_shardings(mesh) would replicate every array; pass your own shardings"
        if device
        else ""
    )
    return Summary(tuple(shown), title, note)
