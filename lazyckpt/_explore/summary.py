"""Showing lazy trees: a text and HTML summary, from metadata alone.

`summary(tree)` lists the tree in tree order: each leaf with its shape, dtype, size,
saved partition spec and mesh, each subtree with the count and total size of the
arrays below it. Numbered siblings alike in structure fold into one entry (see
`lazyckpt._explore.rows`), so a 100,000-array model fits a screen. Nothing here reads
array data; the HTML form (what notebooks display) is a collapsible tree.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

import attrs

from lazyckpt._array.compose import sources
from lazyckpt._array.sharding import saved_from_one_device
from lazyckpt._array.tree import gc_paused, keystr
from lazyckpt._display import as_given
from lazyckpt._explore.arguments import count
from lazyckpt._explore.rows import Row, is_array, layout, leaves_of, walk
from lazyckpt._html import STYLE, array_row, array_text, key_cell, spec_of, times
from lazyckpt._lazy import LazyArray
from lazyckpt._safetensors.format import SINGLE
from lazyckpt._text import human_bytes, printable, shown
from lazyckpt._weights.read import SINGLES

_OPEN_ALL_UP_TO = 400  # rows; bigger trees open only their first level


@attrs.frozen
class Summary:
    """What `lazyckpt.summary` returns: shows as text (`print`, `repr`) and as a
    collapsible HTML tree in notebooks; `describe()` gives the same as data."""

    rows: tuple[Row, ...]
    title: str = ""
    note: str = ""
    """A last line about the whole tree: that it was saved from one device."""
    source: str = ""
    """The one file the tree's arrays lie in (what `open` picked in a folder), or ''."""

    def describe(self) -> list[dict[str, Any]]:
        return [row.describe() for row in self.rows if row.path]

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def text(self) -> str:
        lines = [self._headline()] if self.title else []
        table = [_cells(row) for row in self.rows if row.path]
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
        title = printable(as_given(self.title))  # `hf://org/name@1a2b3c4`, not its URL
        file = self.source.rsplit("/", 1)[-1]
        if file and not self.title.rstrip("/").endswith(file):  # (a folder's file, named)
            title = f"{title} (read {printable(file)})"
        return f"{title}: {_count(arrays)}, {human_bytes(nbytes)}"

    def _repr_html_(self) -> str:
        shown = [row for row in self.rows if row.path]
        parts = ['<div class="lazyckpt">', STYLE]
        if self.title:
            parts.append(f'<div class="head">{html.escape(self._headline())}</div>')
        _html_rows(shown, len(shown) <= _OPEN_ALL_UP_TO, parts)
        if self.note:
            parts.append(f'<div class="head">{html.escape(self.note)}</div>')
        parts.append("</div>")
        return "".join(parts)


def _cells(row: Row) -> tuple[str, str, str, str, str]:
    """A row's text: name, type, size, saved spec (or whose structure it repeats), mesh."""
    indent = "  " * (row.depth - 1)
    name = printable(row.name)  # keys come from the checkpoint: no escapes reach it
    if row.group:
        return f"{indent}{name}/", _group_type(row), _size(row), _same_as(row), ""
    if is_array(row.leaf):
        spec, mesh = spec_of(row.leaf)
        return f"{indent}{name}", array_text(row.leaf, row.kind, row.count), _size(row), spec, mesh
    return f"{indent}{name}", times(row.count) + printable(_short(row.leaf)), "", "", ""


def _html_rows(rows: list[Row], open_all: bool, parts: list[str]) -> None:
    """`rows` as nested `<details>`: subtrees open (all of them in a small tree),
    folded groups closed until clicked; a row that repeats another's structure, one line."""
    depth_open: list[int] = []
    for row in rows:
        while depth_open and depth_open[-1] >= row.depth:
            depth_open.pop()
            parts.append("</div></details>")
        key = html.escape(keystr(row.path), quote=True)
        name = html.escape(printable(row.name))
        if row.same_as:
            parts.append(
                f'<div class="row leaf" data-path="{key}">{key_cell(name + "/", row.depth)}'
                f'<span class="t">{html.escape(_group_type(row))}</span>'
                f'<span class="n">{_size(row)}</span>'
                f'<span class="c">{html.escape(_same_as(row))}</span></div>'
            )
        elif row.group:
            opened = " open" if (open_all or row.depth == 1) and row.count == 1 else ""
            parts.append(
                f'<details{opened} data-path="{key}"><summary class="row">'
                f"{key_cell(name + '/', row.depth)}"
                f'<span class="t">{html.escape(_group_type(row))}</span>'
                f'<span class="n">{_size(row)}</span></summary><div class="kids">'
            )
            depth_open.append(row.depth)
        elif is_array(row.leaf):
            parts.append(array_row(key, name, row.leaf, row.depth, row.kind, row.count))
        else:
            value = html.escape(times(row.count) + printable(_short(row.leaf)))
            parts.append(
                f'<div class="row leaf" data-path="{key}">{key_cell(name, row.depth)}'
                f'<span class="t">{value}</span></div>'
            )
    parts.extend("</div></details>" for _ in depth_open)


def _count(arrays: int) -> str:
    return f"{arrays:,} array" + ("" if arrays == 1 else "s")


def _size(row: Row) -> str:
    return human_bytes(row.nbytes) if row.arrays else ""


def _group_type(row: Row) -> str:
    each = _count(row.arrays // row.count) if row.arrays else ""
    return times(row.count) + ", ".join(part for part in (row.kind, each) if part)


def _same_as(row: Row) -> str:
    return (
        f"{'each ' if row.count > 1 else ''}same structure as {printable(row.same_as)}"
        if row.same_as
        else ""
    )


def _short(value: object, limit: int = 60) -> str:
    if callable(value) and not isinstance(value, type):
        # Functions held in a model (an activation, an apply_fn): by name, not address.
        name = getattr(value, "__name__", None) or type(value).__name__
        return f"<function {name}>"
    try:
        text = repr(value)
    except ValueError:  # an int of thousands of digits
        return shown(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@gc_paused()  # (its walk makes a node per entry, none in cycles: 150,000 for a large model)
def summary(
    tree: object, title: str = "", *, depth: int | None = None, fold: bool = True
) -> Summary:
    """A summary of a lazy tree (or any pytree) from metadata alone.

    Shows as an aligned text table, and in notebooks as a collapsible HTML tree; each
    subtree carries the number and total size of the arrays below it. A last line
    says when the checkpoint was saved from one device (no sharding to reuse).

    Folded (the default), a model of any size takes a screen:

    - numbered siblings alike in structure (names, shapes, dtypes, saved shardings
      and chunks) are one entry, `layers/{3..60}/  58 x 1,558 arrays`, with their
      total size; the rows under it show one of them. Siblings that differ form
      groups of their own, and one alone shows as itself. A folded name is a
      `select` pattern for the entries it stands for.
    - a subtree of three or more leaves equal in structure (keys, shapes, dtypes,
      saved shardings; not values) to another is one row, `same structure as PATH`,
      naming the copy shown in full: the shallowest, and of those the first in tree
      order (a train state's `params`, named from Adam's `mu` and `nu`);
    - a dict of one entry shares its row (`norm/scale`).

    Args:
        tree: A lazy tree from `lazyckpt.open`, or any pytree (jax and NumPy arrays,
            `jax.ShapeDtypeStruct`s, an `nnx.State`).
        title: A headline with the total number and size of the arrays.
        depth: Show rows down to this many levels; deeper subtrees show only as their
            totals. `None` shows everything.
        fold: False shows every subtree and leaf on its own row.

    >>> print(lazyckpt.summary(lazyckpt.open(path)))
    opt_state/mu  float32[8,8]  256 B
    params/       2 arrays      288 B
      b           float32[8]     32 B  P()          mesh x=4 y=2
      w           float32[8,8]  256 B  P('x', 'y')  mesh x=4 y=2
    step          3
    >>> print(lazyckpt.summary(lazyckpt.open(path), depth=1))
    opt_state/mu  float32[8,8]  256 B
    params/       2 arrays      288 B
    step          3
    >>> print(lazyckpt.summary({"layers": [np.zeros((4, 8)) for _ in range(32)]}))
    layers/{0..31}  32 x float64[4,8]  8.0 KiB
    """
    if depth is not None:
        depth = count("summary", "depth", depth, "pass depth=1 for the top level, or None for all")
    root = walk(tree)
    shown = [row for row in layout(root, fold=fold) if depth is None or row.depth <= depth]
    device = saved_from_one_device(leaves_of(root))
    note = (
        f"saved from one device ({device}): there is no sharding to reuse, "
        "saved_shardings(mesh) would replicate every array; pass your own shardings"
        if device
        else ""
    )
    return Summary(tuple(shown), title, note, _source(leaves_of(root)))


def _source(found: Iterable[object]) -> str:
    """The one file that every array of a tree lies in (safetensors and weight files
    know theirs): one that `open` picked in a folder. '' where they lie in several, not
    in files of their own, not on a local disk (a URL's query may carry credentials),
    or in the file a model of its format is named (`model.safetensors`)."""
    files = {
        getattr(part.stored, "file", "")
        for leaf in found
        if isinstance(leaf, LazyArray)
        for part in sources(leaf)
    }
    file = files.pop() if len(files) == 1 else ""
    if "://" in file or file.rsplit("/", 1)[-1] in (SINGLE, *SINGLES):
        return ""  # (a model's own file name goes without saying)
    return file
