"""A broadcast view (`broadcast_to`: a torch tensor saved `expand`ed, its strides 0)
reduced to the values it stores: its `core`, a view of its rank that is 1 where it
repeats, whose broadcast is the view. `stats` weighs the core's values by their
repeats, `diff` compares the two sides where both are constant, and `save` refuses a
view that is almost all repeats unless asked: none of them goes through the repeats
of a tiny file that declares exabytes.

The core follows a broadcast through indexing, casts, transposes and sign flips
(negation and conjugation commute with it); a repeat under anything else (a reshape,
a stack, a computed view: `opaque`) stays in it, and what it costs is then weighed
against what its sources store (`_engine.workload`, `excessive`)."""

from __future__ import annotations

from lazyckpt._array.broadcast_to import BroadcastTo
from lazyckpt._array.compose import Cast, Node, Transpose, as_index
from lazyckpt._array.selection import NewAxis, Selection, Stored
from lazyckpt._array.signs import SignFlipped
from lazyckpt._array.view import ArrayView
from lazyckpt._text import human_bytes

FACTOR = 1024
FLOOR = 1 << 30
"""A view is excessive past `FLOOR` bytes and `FACTOR` times what it stores: a real
expanded tensor (a bias or mask spread over a batch, a scalar over a small array)
repeats itself tens to hundreds of times or stays small, so one past both is almost
all repeats, as a hostile file declares them."""


def repeats(view: ArrayView) -> bool:
    """Whether `view` repeats stored values: a broadcast is in what it is made of."""
    node = view.stored
    return isinstance(node, Node) and (
        isinstance(node, BroadcastTo) or any(repeats(part) for part in node.parts)
    )


def core(view: ArrayView) -> ArrayView:
    """The view whose broadcast (`np.broadcast_to(core, view.shape)`) is `view`, of its
    rank and dtype, of size 1 where it repeats, reading no value twice; `view` itself
    where nothing repeats, or where a repeat lies under a node it does not follow."""
    node = view.stored
    if not isinstance(node, Node) or view.size == 0 or not repeats(view):
        return view
    whole = view.selection.is_full(node.shape)
    if isinstance(node, BroadcastTo):
        found = _selected(core(node.array), view.selection)
    elif whole and isinstance(node, Cast):  # (rounds through the inner dtype first)
        found = core(node.array).astype(node.dtype)
    elif whole and isinstance(node, Transpose):
        found = core(node.array).transpose(node.perm)
    elif isinstance(node, SignFlipped):  # the node itself, over the box of its part's core
        inner = core(node.array).shape
        cut = tuple(slice(0, 1) if c == 1 else slice(None) for c in inner)
        found = _selected(
            view._rebased(Selection.full(node.shape), node.dtype)[cut], view.selection
        )
    else:
        return view
    if found.dtype != view.dtype:
        found = found.astype(view.dtype)
    fits = len(found.shape) == len(view.shape) and all(
        c in (1, n) for c, n in zip(found.shape, view.shape, strict=True)
    )
    return found if fits else view


def opaque(view: ArrayView) -> Node | None:
    """The node that a repeat of `view` lies under where `core` does not follow it
    (a stack, a reshape, a computed view), or None where `core` reads each stored
    value of `view` once."""
    node = view.stored
    if not isinstance(node, Node) or view.size == 0 or not repeats(view):
        return None
    whole = view.selection.is_full(node.shape)
    if isinstance(node, BroadcastTo | SignFlipped) or (
        whole and isinstance(node, Cast | Transpose)
    ):
        return opaque(node.array)
    return node


def _selected(inner: ArrayView, selection: Selection) -> ArrayView:
    """`selection` of the broadcast of `inner` (the node's shape, 1 where it repeats),
    taken from `inner`: its one element along a repeated dimension stands for them all."""
    kept = inner[
        tuple(_entry(item, n) for item, n in zip(selection.stored, inner.shape, strict=True))
    ]
    return kept[tuple(None if isinstance(dim, NewAxis) else slice(None) for dim in selection.view)]


def _entry(item: Stored, size: int) -> int | slice:
    if size == 1:
        return 0 if isinstance(item, int) else slice(0, 1)
    return as_index(item)


def excessive(work: int, stored: int) -> bool:
    """Whether going through `work` bytes made from `stored` bytes is past both bounds."""
    return work > FLOOR and work > FACTOR * stored


def described(key: str, view: ArrayView, stored: int) -> str:
    """`KEY: a view of SHAPE (DTYPE, SIZE) made of SIZE stored, repeated`, for refusals."""
    return (
        f"{key}: a view of shape {view.shape} ({view.dtype}, {human_bytes(view.nbytes)}) "
        f"made of {human_bytes(stored)} stored, repeated (a tensor saved expanded: strides 0)"
    )


def unrepeated_index(view: ArrayView) -> str:
    """The index of `view` that keeps its stored values once (`x[:1, :, :1]`)."""
    found = core(view).shape
    cut = [":1" if c == 1 and n > 1 else ":" for c, n in zip(found, view.shape, strict=True)]
    while cut and cut[-1] == ":":
        cut.pop()
    return f"[{', '.join(cut)}]" if cut else ""
