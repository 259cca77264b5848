"""Matching a lazy tree to the caller's target tree, as Orbax restores onto a target.

A target is any pytree (`nnx.State`, a Linen `TrainState`, optax states, dicts with
int keys, `nn.Partitioned` boxes...) whose leaves say what to restore there:
`jax.ShapeDtypeStruct`s and `jax.Array`s (that shape, dtype and sharding), NumPy
arrays (to host, in that dtype), Shardings, Devices or PartitionSpecs (the
checkpoint's leaf or subtree there, placed so), None (that subtree left as it is;
a target of None alone, which places nothing, is refused), or Python scalars and
strings (the checkpoint's value, of that type).

Leaves are paired by key path the way Orbax names them on disk: int and str keys
are equal (`0` and `'0'`), NamedTuple and dataclass fields go by name, and a final
`value` level (an `nnx.Variable` or `nn.Partitioned` box) may be on either side only.
The result has the target's structure. Matching is strict: every difference is
collected, then reported at once in one `TreeMismatchError`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeGuard

import attrs
import numpy as np

from lazyckpt._array.dtypes import issubdtype
from lazyckpt._array.tree import Path, flatten, keystr, map_leaves, map_with_path, subtree
from lazyckpt._errors import TreeMismatchError
from lazyckpt._lazy import LazyArray, is_jax_array, key_dtype
from lazyckpt._placement.saved import PlacementSpec, is_placement_spec, resolve
from lazyckpt._text import Detail, fold

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh, Sharding
    from jax.typing import DTypeLike

Missing = Literal["error", "keep"] | Callable[[str, Any], object]

_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_VALUES = (bool, int, float, complex, str, np.generic)
TargetArray: TypeAlias = "jax.ShapeDtypeStruct | jax.Array | np.ndarray"
"""A target leaf restored as an array (see `_is_array`)."""
TargetValue = bool | int | float | complex | str | np.generic
"""A target leaf restored as a value of its type (one of `_VALUES`)."""
_MAX_LINES = 20
_SUBTREE_LINES = 3  # a subtree missing on one side takes one line once it would take more
# Per kind of difference: how the headline counts one, and several; how a line starts.
_LABELS = {
    "missing": (
        "target leaf missing from the checkpoint",
        "target leaves missing from the checkpoint",
        "missing from the checkpoint",
    ),
    "selected": (
        "target leaf left out by select=",
        "target leaves left out by select=",
        "left out by select=",
    ),
    "unexpected": (
        "checkpoint leaf not in the target",
        "checkpoint leaves not in the target",
        "not in the target",
    ),
    "shape": ("shape differs", "shapes differ", "shape"),
    "dtype": ("dtype needs a lossy cast", "dtypes need a lossy cast", "lossy cast"),
    "key": ("PRNG key of another type", "PRNG keys of another type", "key"),
    "kind": ("leaf of another kind", "leaves of another kind", "kind"),
}


@attrs.frozen(eq=False)
class Placement:
    """A LazyArray to read, and where: a sharding, or None for a NumPy array."""

    array: LazyArray
    sharding: Sharding | None


def _is_array(leaf: object) -> TypeGuard[TargetArray]:
    """Whether a target leaf is restored as an array: a NumPy array, or a jax one
    (which cannot exist before jax is imported: a target of NumPy arrays needs no jax)."""
    return isinstance(leaf, np.ndarray) or is_jax_array(leaf)


def _is_key_dtype(dtype: DTypeLike) -> bool:
    """Whether `dtype` is a dtype of jax's typed PRNG keys (none before jax is imported)."""
    jax = sys.modules.get("jax")
    return jax is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def host(tree: object) -> object:
    """`tree` with every LazyArray marked for reading to host memory."""
    return map_leaves(lambda x: Placement(x, None) if isinstance(x, LazyArray) else x, tree)


def match(
    tree: object,
    target: object,
    *,
    partial: bool = False,
    missing: Missing = "error",
    lossy_casts: bool = False,
    mesh: Mesh | None = None,
    to_host: bool = False,
    unselected: object = None,
) -> object:
    """`target`'s structure, each leaf replaced by what restores it: a `Placement`,
    a value, or (for placement specs and None leaves) the checkpoint's subtree there.

    `to_host` reads every array into NumPy (the shardings are not used). `unselected`
    is the tree that `tree` was selected from (`tree` itself where nothing was): a
    target leaf that only it holds was left out by the selection, and is said so.
    """
    if missing not in ("error", "keep") and not callable(missing):
        raise TreeMismatchError(
            f"missing={missing!r}: expected 'error' (the default: a target leaf the "
            "checkpoint lacks is an error), 'keep' (it keeps the target's leaf) or a "
            "function of its path and target leaf that returns what to put there"
        )
    matcher = _Matcher(tree, partial, missing, lossy_casts, mesh, to_host)
    if unselected is not None and unselected is not tree:
        matcher.unselected = {_norm(path) for path, _ in flatten(unselected)}
    restored = map_with_path(matcher.restore, target, none_is_leaf=True)
    arrays = sum(isinstance(leaf, LazyArray) for _, leaf in flatten(restored))
    if matcher.named == 0 and arrays:  # (what would come back unread)
        raise TreeMismatchError(_places_nothing(target, matcher.nones, arrays, to_host))
    matcher.check()
    return restored


def _places_nothing(target: object, nones: int, arrays: int, to_host: bool) -> str:
    """Why a target of None alone is refused, and what to pass instead."""
    what = (
        "target=None"
        if target is None
        else f"every leaf of the target ({nones}) is None"
        if nones
        else "the target has no leaves"
    )
    verb, instead = (
        ("read", "or load(tree) without like=")
        if to_host
        else ("placed", "or one Sharding for every array")
    )
    return (
        f"{what}: nothing would be {verb}, and {arrays} of the checkpoint's arrays would come "
        "back unread as LazyArrays (a None target leaf leaves the checkpoint's leaf as it "
        "is). Pass what to restore: a target of jax.ShapeDtypeStructs or jax.Arrays "
        f"(jax.eval_shape, nnx.eval_shape), NumPy arrays or Shardings, {instead}. "
        "(equinox's eqx.is_array is False for a ShapeDtypeStruct, so "
        "eqx.partition(eqx.filter_eval_shape(...), eqx.is_array) keeps only None: "
        "partition with lambda x: isinstance(x, jax.ShapeDtypeStruct))"
    )


def _norm(path: Path) -> tuple[str, ...]:
    return tuple(str(key) for key in path)


def _describe(leaf: object) -> str:
    if isinstance(leaf, LazyArray) or _is_array(leaf):
        return f"{leaf.dtype}[{','.join(str(n) for n in leaf.shape)}]"
    jax = sys.modules.get("jax")
    sharding = jax is not None and isinstance(leaf, jax.sharding.Sharding)
    text = type(leaf).__name__ if sharding else repr(leaf)
    return text if len(text) <= 40 else text[:37] + "..."


class _Matcher:
    """The checkpoint's leaves by normalized key path, and what matching found."""

    def __init__(
        self,
        tree: object,
        partial: bool,
        missing: Missing,
        lossy_casts: bool,
        mesh: Mesh | None,
        to_host: bool,
    ) -> None:
        self.tree = tree
        self.partial = partial
        self.missing = missing
        self.lossy_casts = lossy_casts
        self.mesh = mesh
        self.to_host = to_host
        self.leaves: dict[tuple[str, ...], tuple[Path, object]] = {}
        for path, leaf in flatten(tree):
            self.leaves[_norm(path)] = (path, leaf)
        self.prefixes = {norm[:i] for norm in self.leaves for i in range(len(norm))}
        self.used: set[tuple[str, ...]] = set()
        self.named = self.nones = 0  # target leaves that name something, and None ones
        self.problems: dict[str, list[tuple[str, Detail]]] = {kind: [] for kind in _LABELS}
        self.missing_paths: list[tuple[str, ...]] = []
        self.unexpected_paths: list[tuple[str, ...]] = []
        self.target_prefixes: set[tuple[str, ...]] = set()
        self.selected_paths: list[tuple[str, ...]] = []
        self.unselected: set[tuple[str, ...]] = set()
        """The leaves of the tree before `select=`, where one made this tree."""

    def restore(self, path: Path, want: object) -> object:
        """What the target leaf `want` at `path` becomes."""
        norm = _norm(path)
        self.target_prefixes.update(norm[:i] for i in range(len(norm) + 1))
        where = keystr(path)
        if want is None:
            self.nones += 1
        else:
            self.named += 1
        if not (
            want is None or is_placement_spec(want) or _is_array(want) or isinstance(want, _VALUES)
        ):
            swapped = "; LazyArrays go in the tree, the first argument"
            return self._problem(
                "kind",
                where or "(the root)",
                f"the target leaf is a {type(want).__name__}; expected a ShapeDtypeStruct, "
                "jax.Array, NumPy array, Sharding, Device, PartitionSpec, None or a scalar"
                + (swapped if isinstance(want, LazyArray) else ""),
            )
        if (want is None or is_placement_spec(want)) and norm in self.prefixes:
            return self._subtree(path, norm, want)
        found = self._find(norm)
        if found is None:
            if want is None:
                return None
            return self._missing(where, norm, want)
        self.used.add(found)
        _, leaf = self.leaves[found]
        where = where or (leaf.key if isinstance(leaf, LazyArray) else "") or "(the root)"
        if want is None:
            return leaf
        if is_placement_spec(want):
            return self._place(where, leaf, want)
        if _is_array(want):
            return self._array(where, leaf, want)
        assert isinstance(want, _VALUES)  # (the kinds checked first)
        return self._value(where, leaf, want)

    def _find(self, norm: tuple[str, ...]) -> tuple[str, ...] | None:
        """The checkpoint leaf at `norm`."""
        return self._in(norm, self.leaves)

    @staticmethod
    def _in(norm: tuple[str, ...], paths: Collection[tuple[str, ...]]) -> tuple[str, ...] | None:
        """The path of `paths` that is `norm`, allowing a final `value` level on one side."""
        if norm in paths:
            return norm
        if norm and norm[-1] == "value" and norm[:-1] in paths:
            return norm[:-1]
        if (*norm, "value") in paths:
            return (*norm, "value")
        return None

    def _subtree(self, path: Path, norm: tuple[str, ...], want: PlacementSpec | None) -> object:
        """The checkpoint's subtree at `norm`, its arrays placed as `want` says."""
        for other in self.leaves:
            if other[: len(norm)] == norm:
                self.used.add(other)
        node = subtree(self.tree, norm)
        if want is None:
            return node
        where = keystr(path)
        return map_leaves(lambda leaf: self._place(where, leaf, want), node)

    def _place(self, where: str, leaf: object, wanted: PlacementSpec | None) -> object:
        if not isinstance(leaf, LazyArray):
            return leaf
        if self.to_host:
            return Placement(leaf, None)
        return Placement(leaf, resolve(leaf.key or where, wanted, self.mesh))

    def _array(self, where: str, leaf: object, want: TargetArray) -> object:
        shape, dtype = tuple(want.shape), want.dtype
        if isinstance(leaf, LazyArray):
            keys = _as_keys(leaf, dtype, shape)
            if keys is None:
                keys = _key_data(leaf, dtype, shape)
            if keys is None and leaf.key_impl and leaf.dtype != dtype:
                data = f"{_describe(leaf)}, its data {_describe(leaf._key_data())}"
                return self._problem("key", where, _versus(_describe(want), data))
            if keys is None and leaf.shape != shape:
                return self._problem("shape", where, _versus(shape, leaf.shape))
            view = keys if keys is not None else self._cast(where, leaf, dtype)
            if view is None:
                return None
            if self.to_host or isinstance(want, np.ndarray):
                return Placement(view, None)
            wanted = want.sharding
            if wanted is None and leaf.sharding is not None:
                wanted = leaf.sharding.on_saved_devices()  # as Orbax does
            return Placement(view, resolve(where, wanted, self.mesh))
        if isinstance(leaf, bool | int | float | complex | np.generic) and shape == ():
            value = self._scalar(where, leaf, dtype)
            if value is None or self.to_host or isinstance(want, np.ndarray):
                return value
            import jax  # (`want` is a jax object)

            return jax.device_put(value, resolve(where, getattr(want, "sharding", None), self.mesh))
        return self._kind(where, want, leaf)

    def _value(self, where: str, leaf: object, want: TargetValue) -> object:
        if isinstance(leaf, LazyArray) and leaf.shape == () and not leaf.key_impl:
            leaf = leaf.get().item()
        if isinstance(want, str) != isinstance(leaf, str) or isinstance(leaf, LazyArray):
            return self._kind(where, want, leaf)
        if isinstance(want, str) or type(leaf) is type(want):
            return leaf
        value = self._scalar(where, leaf, np.asarray(want).dtype)
        return None if value is None else type(want)(value.item())

    def _cast(self, where: str, leaf: LazyArray, dtype: DTypeLike) -> Any:
        if leaf.dtype == dtype:
            return leaf
        if _is_key_dtype(dtype) or leaf.key_impl:  # (keys are never cast, lossy or not)
            return self._problem("key", where, _versus(dtype, leaf.dtype))
        if not (self.lossy_casts or lossless(leaf.dtype, dtype)):
            return self._problem("dtype", where, _versus(dtype, leaf.dtype))
        return leaf.astype(dtype)

    def _scalar(self, where: str, value: object, dtype: DTypeLike) -> Any:
        try:  # (a cast that changes the value warns too: `exact` says so instead)
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                converted = np.asarray(value).astype(dtype)
                exact = bool(converted == np.asarray(value))
        except (TypeError, ValueError, OverflowError):  # (an array, a ShapeDtypeStruct, keys)
            return self._problem("kind", where, _versus(dtype, _describe(value)))
        source = np.asarray(value).dtype
        if not (exact or self.lossy_casts or lossless(source, dtype)):
            return self._problem("dtype", where, _versus(dtype, repr(value)))
        return converted

    def _missing(self, where: str, norm: tuple[str, ...], want: object) -> object:
        if self.missing == "keep":
            return want
        if callable(self.missing):
            return self.missing(where, want)
        if self._in(norm, self.unselected) is not None:
            self.selected_paths.append(norm)
            return self._problem("selected", where or "(the root)", _describe(want))
        self.missing_paths.append(norm)
        return self._problem("missing", where or "(the root)", _describe(want))

    def _kind(self, where: str, want: object, leaf: object) -> Any:
        return self._problem("kind", where, _versus(_describe(want), _describe(leaf)))

    def _problem(self, kind: str, where: str, detail: str | Detail) -> Any:
        self.problems[kind].append((where, (("", detail),) if isinstance(detail, str) else detail))
        return None

    def check(self) -> None:
        """Raise one error listing every difference found."""
        if not self.partial:
            for norm, (path, leaf) in self.leaves.items():
                if norm not in self.used:
                    self.unexpected_paths.append(norm)
                    self._problem("unexpected", keystr(path), _describe(leaf))
        if not any(self.problems.values()):
            return
        raise TreeMismatchError("\n".join(self._report()))

    def _report(self) -> list[str]:
        counts = {kind: len(found) for kind, found in self.problems.items()}
        summary = ", ".join(
            f"{n} {_LABELS[kind][0 if n == 1 else 1]}" for kind, n in counts.items() if n
        )
        lines = [f"the target does not match the checkpoint: {summary}"]
        absent = {
            "missing": (self.missing_paths, self.prefixes | set(self.leaves)),
            "selected": (self.selected_paths, self.prefixes | set(self.leaves)),
            "unexpected": (self.unexpected_paths, self.target_prefixes),
        }
        folded = []
        for kind, found in self.problems.items():
            if kind in absent and len(absent[kind][0]) == len(found):
                folded += [(kind, line) for line in fold(_by_subtree(found, *absent[kind]))]
            else:
                folded += [(kind, line) for line in fold(found)]
        for shown, (kind, line) in enumerate(folded):
            if shown == _MAX_LINES:
                rest = sum(line.count for _, line in folded[shown:])
                lines.append(f"  ... and {rest} more")
                break
            lines.append(f"  {_LABELS[kind][2]}: {line}")
        hint = self._hint()
        if hint:
            lines.append(hint)
        fixes = []
        if counts["unexpected"]:
            fixes.append("partial=True restores only what the target names")
        if counts["missing"] or counts["selected"]:
            fixes.append("missing='keep' (or a function of path and target leaf) fills the rest")
        if counts["selected"]:
            fixes.append("or select= the leaves the target names too")
        if counts["dtype"]:
            fixes.append("lossy_casts=True allows casts that may change values")
        if fixes:
            lines.append("to restore anyway: " + "; ".join(fixes))
        if counts["key"]:
            lines.append(
                "PRNG keys are restored as saved, never cast: give the target keys of the "
                "checkpoint's type (jax.random.key(0, impl=...)), or uint32 key data of "
                "their shape (what jax.random.key_data returns)"
            )
        return lines

    def _hint(self) -> str:
        """Where the checkpoint holds all the missing paths under one prefix: name it."""
        if not self.missing_paths or not self.missing_paths[0]:
            return ""  # (a target that is one leaf: any leaf of the checkpoint would do)
        first = self.missing_paths[0]
        places = []
        for norm in self.leaves:
            if len(norm) > len(first) and norm[len(norm) - len(first) :] == first:
                prefix = norm[: len(norm) - len(first)]
                if all((*prefix, *m) in self.leaves for m in self.missing_paths):
                    places.append(prefix)
        if not places:
            return ""
        index = "".join(f"[{key!r}]" for key in places[0])
        others = f" (and {len(places) - 1} other places)" if len(places) > 1 else ""
        return (
            f"  hint: the checkpoint has the target's leaves under {'/'.join(places[0])!r}"
            f"{others}: pass tree{index} as the tree"
        )


def _as_keys(leaf: LazyArray, dtype: DTypeLike, shape: tuple[int, ...]) -> LazyArray | None:
    """Typed PRNG keys of `dtype` and `shape` read from the raw uint32 key data that
    `leaf` holds (checkpoints that do not record the key implementation); None when
    that is not what `leaf` is."""
    if leaf.key_impl or leaf.dtype != np.uint32 or not _is_key_dtype(dtype):
        return None
    for impl in _KEY_IMPLS:
        key, data_shape = key_dtype(impl)
        if key == dtype and leaf.shape == (*shape, *data_shape):
            return attrs.evolve(leaf, dtype=key, key_impl=impl)
    return None


def _key_data(leaf: LazyArray, dtype: DTypeLike, shape: tuple[int, ...]) -> LazyArray | None:
    """The raw uint32 data of the typed PRNG keys `leaf` holds, where the target asks
    for exactly that (a legacy `jax.random.PRNGKey` in the target); None otherwise."""
    if not leaf.key_impl or _is_key_dtype(dtype):
        return None
    data = leaf._key_data()
    return data if data.shape == shape and data.dtype == np.dtype(dtype) else None


def _versus(target: object, checkpoint: object) -> Detail:
    return (("target", str(target)), ("checkpoint", str(checkpoint)))


def _by_subtree(
    found: list[tuple[str, Detail]], norms: list[tuple[str, ...]], other: set[tuple[str, ...]]
) -> list[tuple[str, Detail, int, str]]:
    """`found`'s lines, those under a subtree that the other side lacks entirely (a
    missing layer) in one line, `layer_25/{attn/..., mlp/...}  12 leaves`, once they
    would take more than a few lines."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, norm in enumerate(norms):
        cut = next((k for k in range(1, len(norm)) if norm[:k] not in other), len(norm))
        groups.setdefault(norm[:cut], []).append(i)
    out: list[tuple[str, Detail, int, str]] = []
    for prefix, members in groups.items():
        below = [norms[i][len(prefix) :] for i in members]
        if len(fold(("/".join(b), found[i][1]) for b, i in zip(below, members, strict=True))) <= (
            _SUBTREE_LINES
        ):
            out += [(*found[i], 1, "") for i in members]
            continue
        while len({b[0] for b in below}) == 1 and all(len(b) > 1 for b in below):
            prefix, below = (*prefix, below[0][0]), [b[1:] for b in below]
        children: dict[str, list[tuple[str, ...]]] = {}
        for b in below:
            children.setdefault(b[0], []).append(b)
        names = [
            ("/".join(paths[0]) if len(paths) == 1 else f"{child}/...", "")
            for child, paths in children.items()
        ]
        shown = [f.path for f in fold(names, vary=False)]
        listed = ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")
        where = "/".join(prefix)
        out.append((where, (("", f"{len(members)} leaves"),), len(members), f"/{{{listed}}}"))
    return out


def lossless(source: DTypeLike, dest: DTypeLike) -> bool:
    """Whether casting `source` to `dest` leaves values as they are, up to rounding of
    floating-point numbers (float32 to bfloat16 restores mixed-precision models)."""
    try:
        if issubdtype(source, np.floating) and issubdtype(dest, np.floating):
            return True
        return bool(np.can_cast(source, dest, "safe"))
    except TypeError:  # (a dtype NumPy does not know: jax's typed PRNG keys)
        return False
