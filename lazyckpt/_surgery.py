"""Lazy checkpoint surgery: `stack`, `concat`, `unstack` and `take` of LazyArrays, as
views.

They read nothing: a conversion (per-layer arrays into a scanned stack and back,
fused q/k/v, transposed kernels) is ordinary Python over lazy arrays, and only the
final `save`, `device_put` or `load` reads, each stored chunk once.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.nesting import PathClash, nested
from lazyckpt._array.tree import leaves
from lazyckpt._errors import LazyIndexError, LazyTypeError, NoMatchError
from lazyckpt._lazy import LazyArray, composed
from lazyckpt._text import ascii_int


def unstack(array: LazyArray, axis: int = 0) -> list[LazyArray]:
    """The slices of `array` along `axis`, as views: `unstack(x)[i]` is `x[i]`. Reads
    nothing; each view later reads only its own stored chunks, so a scanned stack of
    layers `(layers, ...)` becomes per-layer arrays without reading the others.

    Args:
        array: A LazyArray (a view too).
        axis: The dimension to split along.

    >>> w = lazyckpt.open(path)["params"]["w"]
    >>> rows = lazyckpt.unstack(w)
    >>> len(rows), rows[3].shape, float(rows[3].get()[0])
    (8, (8,), 24.0)
    """
    if not -array.ndim <= axis < array.ndim:
        raise LazyIndexError(f"{array.key} (shape {array.shape}): no axis {axis} to unstack")
    axis %= array.ndim
    before = (slice(None),) * axis
    return [array[(*before, i)] for i in range(array.shape[axis])]


def take(array: LazyArray, indices: Any, axis: int | None = None) -> LazyArray:
    """The elements of `array` at `indices` along `axis`, as `np.take`: a view that
    reads only the stored chunks (or, in safetensors and other raw files, the byte
    ranges) of what it picks. Indices may repeat, be negative and come in any order or
    shape; `axis=None` picks from the array flattened. The same as
    `array[(slice(None),) * axis + (indices,)]`.

    Args:
        array: A LazyArray (a view too).
        indices: Integers: a list, a NumPy or jax array, or one int.
        axis: The dimension to pick along; None for the flattened array.

    >>> embed = lazyckpt.open(path)["params"]["w"]             # (8, 8)
    >>> kept = lazyckpt.take(embed, [5, 0, 5], axis=0)          # reads rows 0 and 5
    >>> kept.shape, float(kept.get()[0, 1])
    ((3, 8), 41.0)
    """
    if axis is None:
        return array.reshape(-1)[np.asarray(indices)]
    try:
        axis = operator.index(axis)
    except TypeError:
        raise LazyIndexError(f"{array.key}: take() takes an int axis, not {axis!r}") from None
    if not -array.ndim <= axis < array.ndim:
        raise LazyIndexError(f"{array.key} (shape {array.shape}): no axis {axis} to take along")
    index = np.asarray(indices)
    if index.dtype == bool:
        raise LazyIndexError(
            f"{array.key}: take() picks by integer indices; index with a mask instead "
            "(array[:, mask])"
        )
    return array[(slice(None),) * (axis % array.ndim) + (index if index.ndim else int(index),)]


def _name(operation: str, arrays: Sequence[LazyArray]) -> tuple[str]:
    keys = [a.key for a in arrays]
    shown = ", ".join(keys) if len(keys) <= 2 else f"{keys[0]} .. {keys[-1]}"
    return (f"{operation}({shown})",)


def _parts(
    operation: str, arrays: Sequence[LazyArray], axis: int, extra: int
) -> tuple[np.dtype[Any], int]:
    """The common dtype of `arrays` and `axis` normalized, or a clear error."""
    if not arrays:
        raise LazyIndexError(f"{operation} needs at least one LazyArray")
    for a in arrays:
        if not isinstance(a, LazyArray):
            raise LazyTypeError(
                f"{operation} takes LazyArrays, found {type(a).__name__}; open the "
                "checkpoint with lazyckpt.open and pass its arrays"
            )
        a._composable(operation)
    ndim = arrays[0].ndim + extra
    if not -ndim <= axis < ndim:
        raise LazyIndexError(f"{operation}: axis {axis} is out of range for {ndim} dimensions")
    return np.result_type(*(a.dtype for a in arrays)), axis % ndim


def stack(arrays: Sequence[LazyArray], axis: int = 0) -> LazyArray:
    """`np.stack` of LazyArrays of one shape, as a view: reads nothing. Its parts
    keep their key paths (`x.sources`); indexing it indexes them, so `stack(xs)[i]`
    is `xs[i]`, and a read reads each part's stored chunks once.

    Args:
        arrays: LazyArrays (views too) of the same shape; the dtype is NumPy's
            promotion of theirs.
        axis: Where the new dimension goes.

    >>> p = lazyckpt.open(path)["params"]
    >>> layers = lazyckpt.stack([p["w"][0], p["w"][1], p["b"]])
    >>> layers.shape, float(layers[1, 2].get())
    ((3, 8), 10.0)
    """
    dtype, axis = _parts("stack", arrays, axis, 1)
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        listed = ", ".join(f"{a.key} {a.shape}" for a in arrays[:4])
        raise LazyIndexError(f"stack needs arrays of one shape, found {listed}")
    shape = arrays[0].shape
    node = compose.Stack((*shape[:axis], len(arrays), *shape[axis:]), dtype, tuple(arrays), axis)
    return composed(_name("stack", arrays), node, dtype)


def concat(arrays: Sequence[LazyArray], axis: int = 0) -> LazyArray:
    """`np.concatenate` of LazyArrays, as a view: reads nothing (fused q/k/v
    kernels, say). Indexing it indexes only the parts the index meets.

    Args:
        arrays: LazyArrays (views too) whose shapes differ only along `axis`.
        axis: The dimension to join along.

    >>> p = lazyckpt.open(path)["params"]
    >>> both = lazyckpt.concat([p["w"][:2], p["w"][6:]])
    >>> both.shape, float(both[2, 0].get())
    ((4, 8), 48.0)
    """
    dtype, axis = _parts("concat", arrays, axis, 0)
    rest = {a.shape[:axis] + a.shape[axis + 1 :] for a in arrays}
    if len(rest) != 1 or len({a.ndim for a in arrays}) != 1:
        listed = ", ".join(f"{a.key} {a.shape}" for a in arrays[:4])
        raise LazyIndexError(
            f"concat along axis {axis} needs shapes that differ only there, found {listed}"
        )
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    node = compose.Concat(tuple(shape), dtype, tuple(arrays), axis)
    return composed(_name("concat", arrays), node, dtype)


def unstack_layers(tree: object, at: str, axis: int = 0) -> dict[str, Any]:
    """A scanned tree made per-layer: every array under `at` (shape `(layers, ...)`)
    becomes one view per layer, `at/{i}/...`; the rest of the tree is kept. Reads
    nothing. The inverse of `stack_layers`.

    Args:
        tree: A lazy tree (any pytree holding LazyArrays).
        at: The key path of the scanned subtree, as lazyckpt writes it (`blocks`,
            `params/decoder/layers`).
        axis: The layer dimension of its arrays.

    >>> scanned = {"blocks": {"w": lazyckpt.open(path)["params"]["w"]}}
    >>> layers = lazyckpt.unstack_layers(scanned, "blocks")
    >>> sorted(layers["blocks"])[:3], layers["blocks"]["3"]["w"].shape
    (['0', '1', '2'], (8,))
    """
    found = list(leaves(tree))
    _not_per_layer(found, at)
    items, kept = [], []
    for key, leaf in found:
        rest = _under(key, at)
        if rest is None:
            items.append((tuple(key.split("/")), leaf, key))
            kept.append(key)
            continue
        if not isinstance(leaf, LazyArray):
            raise LazyTypeError(
                f"{key}: unstack_layers splits LazyArrays, found {type(leaf).__name__}; "
                "select the arrays first, or move this leaf out of "
                f"{at!r}"
            )
        for i, view in enumerate(unstack(leaf, axis)):
            items.append(((*_keys(at), str(i), *rest), view, f"{key}[{i}]"))
    if len(items) == len(kept):
        _nothing_under(at, tree, "unstack_layers")
    return _nest(items)


def stack_layers(tree: object, at: str, axis: int = 0) -> dict[str, Any]:
    """A per-layer tree made scanned: arrays at `at/{i}/...` for `i` in `0..n-1`
    become one stacked view per name, `at/...` of shape `(n, ...)` (along `axis`);
    the rest of the tree is kept. Reads nothing. The inverse of `unstack_layers`.

    Args:
        tree: A lazy tree (any pytree holding LazyArrays).
        at: The key path whose integer children are the layers (`model/layers`).
        axis: Where the layer dimension goes.

    >>> p = lazyckpt.open(path)["params"]
    >>> per_layer = {"layers": {"0": {"w": p["w"][0]}, "1": {"w": p["w"][1]}}}
    >>> lazyckpt.stack_layers(per_layer, "layers")["layers"]["w"].shape
    (2, 8)
    """
    kept: list[tuple[tuple[str, ...], object, str]] = []
    layers: dict[tuple[str, ...], dict[int, tuple[str, Any]]] = {}
    for key, leaf in leaves(tree):
        rest = _under(key, at)
        if rest is None or not _is_layer(rest[0]):
            kept.append((tuple(key.split("/")), leaf, key))
            continue
        number = ascii_int(rest[0])
        if number is None:
            raise LazyIndexError(
                f"{at.strip('/')}/{rest[0][:20]}...: a layer number of {len(rest[0])} "
                "digits, past any stack of layers 0..n-1; rename it first (lazyckpt.rename)"
            )
        found = layers.setdefault(tuple(rest[1:]), {})
        if number in found:
            raise LazyIndexError(
                f"{found[number][0]} and {key} are both layer {number}; rename "
                "one of them first (lazyckpt.rename)"
            )
        found[number] = (key, leaf)
    if not layers:
        _nothing_under(at, tree, "stack_layers")
    count = 1 + max((max(found) for found in layers.values()), default=-1)
    stacked: list[tuple[tuple[str, ...], object, str]] = []
    for names, found in layers.items():
        # The first few, within len(found) + 8 steps: count may be 10**17.
        missing = list(itertools.islice((i for i in range(count) if i not in found), 8))
        if missing:
            raise LazyIndexError(
                f"{at}/{{i}}/{'/'.join(names)}: layers {missing[:8]} of 0..{count - 1} are "
                "missing; every layer needs every array to be stacked"
            )
        arrays = [found[i][1] for i in range(count)]
        for key, leaf in (found[i] for i in range(count)):
            if not isinstance(leaf, LazyArray):
                raise LazyTypeError(
                    f"{key}: stack_layers stacks LazyArrays, found {type(leaf).__name__}"
                )
        where = f"{at}/{{i}}/{'/'.join(names)}"
        stacked.append(((*_keys(at), *names), stack(arrays, axis), where))
    return _nest(kept + stacked)


def _not_per_layer(found: list[tuple[str, Any]], at: str) -> None:
    """Refuse a tree already per layer at `at`, every array there under a layer number
    (`layers/0/w`): unstacking it again would split each layer along its first
    dimension (`layers/{i}/0/w`), a tree of nonsense names."""
    under = [(key, leaf, rest) for key, leaf in found if (rest := _under(key, at)) is not None]
    if not under or not all(_is_layer(rest[0]) for _, _, rest in under):
        return
    key, leaf, rest = under[0]
    shape = getattr(leaf, "shape", None)
    where = f"{at.strip('/')}/{rest[0]}"
    raise LazyIndexError(
        f"unstack_layers: {at!r} is already per layer: every array under it sits under a "
        f"layer number ({key}, shape {shape}); unstack_layers splits a scanned stack of "
        f"shape (layers, ...). To make it scanned, call stack_layers(tree, {at!r}); if "
        f"{where!r} is itself a scanned stack, pass at={where!r}"
    )


def _is_layer(key: str) -> bool:
    # Layer numbers are ASCII digits (`"\u0661"` is a name, not layer 1).
    return key.isascii() and key.isdigit()


def _nothing_under(at: str, tree: object, operation: str) -> None:
    top = sorted({key.split("/")[0] for key, _ in leaves(tree)})
    shown = ", ".join(top[:8]) + (", ..." if len(top) > 8 else "")
    raise NoMatchError(
        f"{operation}: no arrays under {at!r}"
        + (" whose next key is a layer number" if operation == "stack_layers" else "")
        + f"; the tree's top-level keys are [{shown}]; pass the key path of the layers"
    )


def _under(key: str, at: str) -> list[str] | None:
    prefix = at.strip("/") + "/"
    return key[len(prefix) :].split("/") if key.startswith(prefix) else None


def _keys(at: str) -> tuple[str, ...]:
    return tuple(at.strip("/").split("/"))


def _nest(items: list[tuple[tuple[str, ...], object, str]]) -> dict[str, Any]:
    try:
        return nested(items)
    except PathClash as clash:
        raise LazyIndexError(
            f"{clash.second} and {clash.first} would both be at {'/'.join(clash.at)}; "
            "rename one of them first (lazyckpt.rename)"
        ) from None
