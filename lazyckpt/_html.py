"""The HTML pieces of a summary: the style sheet, the key cell and one array's row.

They know arrays by their attributes alone (`shape`, `dtype`, a saved `sharding`,
`chunks`), so `LazyArray._repr_html_` and the tree summary share them without the
array class and the summary depending on each other.
"""

from __future__ import annotations

import html
import math
from typing import Any, Protocol

from lazyckpt._array.sharding import SavedSharding, spec_str
from lazyckpt._array.view import ArrayView
from lazyckpt._text import human_bytes


class Shaped(Protocol):
    """An array as a row shows it: a LazyArray, a jax or NumPy array, or a
    `jax.ShapeDtypeStruct`."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> object: ...


STYLE = """<style>
.lazyckpt{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.5}
.lazyckpt details>summary{cursor:pointer;list-style:none;position:relative;padding-left:1.2em}
.lazyckpt details>summary::-webkit-details-marker{display:none}
.lazyckpt details>summary::before{content:"\\25B8";position:absolute;left:0;color:#888}
.lazyckpt details[open]>summary::before{content:"\\25BE"}
.lazyckpt .kids{margin-left:.5em;border-left:1px solid #ddd;padding-left:.7em}
.lazyckpt .row{display:flex;gap:1.5em;white-space:nowrap}
.lazyckpt .leaf{padding-left:1.2em}
.lazyckpt .k{font-weight:600;overflow:hidden;text-overflow:ellipsis;flex:none}
.lazyckpt .t{width:16em;color:#05a;flex:none}
.lazyckpt .n{width:6em;text-align:right;color:#555;flex:none}
.lazyckpt .s{width:11em;color:#a50;flex:none}
.lazyckpt .m{width:11em;color:#777;flex:none}
.lazyckpt .c{color:#777}
.lazyckpt .head{font-weight:600;margin-bottom:.3em}
</style>"""


def array_type(array: Any) -> str:
    """`float32[64,128]`, as the type column shows an array."""
    return f"{array.dtype}[{','.join(str(n) for n in array.shape)}]"


def times(count: int) -> str:
    """`58 x `, before what each of `count` siblings alike is; nothing for one."""
    return f"{count:,} x " if count > 1 else ""


def array_text(array: Any, kind: str = "", count: int = 1) -> str:
    """An array's type column: `float32[64,128]`, after its box's type (`Param`), and
    with how many siblings alike the row stands for (`32 x`)."""
    typed = f"{kind} {array_type(array)}" if kind else array_type(array)
    return times(count) + typed


def spec_text(sharding: SavedSharding | None) -> tuple[str, str]:
    """The saved partition spec and mesh as two short strings ("" when unknown)."""
    if sharding is None:
        return "", ""
    if sharding.kind == "NamedSharding":
        mesh = " ".join(f"{name}={size}" for name, size in sharding.mesh_axes.items())
        return spec_str(sharding.partition_spec), f"mesh {mesh}"
    if sharding.kind == "SingleDeviceSharding":
        return "single device", str(sharding.device or "")
    return sharding.kind, ""


def spec_of(array: object) -> tuple[str, str]:
    """The saved partition spec and mesh of a LazyArray; ("", "") for other arrays."""
    sharding = getattr(array, "sharding", None)
    return spec_text(sharding) if isinstance(sharding, SavedSharding) else ("", "")


def array_nbytes(array: Shaped) -> int:
    """An array's size in its dtype; 0 where the dtype has no byte size."""
    itemsize = int(getattr(array.dtype, "itemsize", 0) or 0)
    return int(math.prod(array.shape)) * itemsize


def key_cell(name: str, depth: int) -> str:
    """The key cell, narrower by each level's indent so later columns line up."""
    width = f"calc({_KEY_EM}em - {depth - 1} * (1.2em + 1px))"
    return f'<span class="k" style="width:{width}">{name}</span>'


_KEY_EM = 18


def array_row(
    key: str, name: str, array: Shaped, depth: int = 1, kind: str = "", count: int = 1
) -> str:
    """One array's row; with `count`, the row of that many siblings alike (`32 x`)."""
    spec, mesh = spec_of(array)
    chunks = getattr(array, "chunks", None)
    chunks_text = "chunks " + "x".join(str(n) for n in chunks) if chunks else ""
    typed = array_text(array, kind, count)
    return (
        f'<div class="row leaf" data-path="{key}">{key_cell(name, depth)}'
        f'<span class="t">{html.escape(typed)}</span>'
        f'<span class="n">{human_bytes(count * array_nbytes(array))}</span>'
        f'<span class="s">{html.escape(spec)}</span><span class="m">{html.escape(mesh)}</span>'
        f'<span class="c">{chunks_text}</span></div>'
    )


def array_html(array: ArrayView) -> str:
    """A LazyArray as one summary row, for notebooks."""
    name = html.escape(array.key or "(array)")
    return f'<div class="lazyckpt">{STYLE}{array_row(name, name, array)}</div>'
