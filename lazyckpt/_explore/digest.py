"""Digests of arrays' values for `diff`'s moves: arrays of one group that `difference`
finds equal share a digest, so that a removed leaf is compared only with the added
ones that share its digest, after each array was read once for it.

A digest sums, modulo the prime `P`, a keyed hash of each value's words
(`difference.canonical`) and of its place, so that the blocks the values come in do
not change it. Along the dimensions where an array of the group repeats (a broadcast
view, `sides.repeated`), places are weighed by powers of a random base instead, whose
sum over a repeat has a closed form: a broadcast view's digest, taken from its stored
values, is that of the same values stored whole. Each call draws its keys anew, so
that no input can be made to collide; a collision would cost a comparison, never a
wrong move."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np

from lazyckpt._engine import stream
from lazyckpt._explore import difference
from lazyckpt._explore.sides import Side, check_reads, repeated
from lazyckpt._lazy import LazyArray

P = (1 << 61) - 1
"""A Mersenne prime: a product of two numbers below it reduces with shifts."""
_LOW = np.uint64((1 << 32) - 1)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))  # splitmix64's


def digests(
    groups: Sequence[Sequence[tuple[str, Side]]], memory_budget: int | None
) -> list[list[int | None]]:
    """The digest of each `(path, array)` of each group (arrays of one shape and
    dtype), None where their dtype has none (`difference.canonical`), from their
    stored values streamed once within `memory_budget`; refused by name where that
    would go through far more than they store (`sides.check_reads`)."""
    keys = _Keys()
    sums = []
    for group in groups:
        weighed = _repeating(group)
        sums.append([_Sum(keys, path, array, weighed) for path, array in group])
    taken = [made for group_sums in sums for made in group_sums if made.digestible]
    check_reads([(made.path, made.core) for made in taken])
    lazy = [(made, made.core) for made in taken if isinstance(made.core, LazyArray)]
    for position, index, block in stream.read_blocks([core for _, core in lazy], memory_budget):
        lazy[position][0].add(index, block)
    for made in taken:
        if not isinstance(made.core, LazyArray):
            made.add(tuple(slice(0, n) for n in made.core.shape), np.asarray(made.core))
    return [[made.value() for made in group_sums] for group_sums in sums]


def _repeating(group: Sequence[tuple[str, Side]]) -> frozenset[int]:
    """The dimensions along which any array of `group` repeats its stored values."""
    return frozenset().union(*(repeated(array)[1] for _, array in group))


class _Keys:
    """One call's random keys: of places, and a base per weighed dimension."""

    def __init__(self) -> None:
        self.place = np.uint64(secrets.randbits(64))
        self.factor = np.uint64(secrets.randbits(64) | 1)  # (odd: a bijection of places)
        self._bases: dict[int, int] = {}

    def base(self, dim: int) -> int:
        if dim not in self._bases:
            # (not 1, whose sums have no closed form)
            self._bases[dim] = 2 + secrets.randbelow(P - 3)
        return self._bases[dim]

    def powers(self, dim: int, low: int, high: int) -> np.ndarray:
        """`base(dim) ** i % P` for `i` in `range(low, high)`, doubling the run each step."""
        base = self.base(dim)
        run = np.ones(1, np.uint64)
        while run.size < high - low:
            run = np.concatenate([run, _mulmod(run, np.uint64(pow(base, run.size, P)))])
        return _mulmod(run[: high - low], np.uint64(pow(base, low, P)))

    def repeat_sum(self, dim: int, size: int) -> int:
        """`sum(base(dim) ** i for i in range(size)) % P`: the weight of a value that
        repeats `size` times along `dim`."""
        base = self.base(dim)
        return (pow(base, size, P) - 1) * pow(base - 1, -1, P) % P


class _Sum:
    """One array's digest, summed block by block over its stored values (`core`)."""

    def __init__(self, keys: _Keys, path: str, array: Side, weighed: frozenset[int]) -> None:
        self.path = path
        self.core, repeats = repeated(array)
        self.digestible = difference.canonical(np.empty(0, array.dtype)) is not None
        self._keys = keys
        shape = tuple(array.shape)
        self._scale = math.prod(keys.repeat_sum(d, shape[d]) for d in repeats) % P
        self._weighed = [d for d in sorted(weighed) if d not in repeats and shape[d] > 1]
        hashed = [d for d in range(len(shape)) if d not in weighed]
        self._strides = [(d, math.prod(shape[e] for e in hashed if e > d)) for d in hashed]
        self._total = 0

    def add(self, index: tuple[slice, ...], block: np.ndarray) -> None:
        """Add the values of `block`, `core[index]`, a piece at a time."""
        offsets = [s.indices(n)[0] for s, n in zip(index, self.core.shape, strict=True)]
        # A run of the array in C order (rows of it, as blocks mostly are) counts its
        # places; other boxes work them out from each value's coordinates.
        run = not self._weighed and _one_run(block.shape, self.core.shape)
        first = sum(offsets[d] * stride for d, stride in self._strides)
        flat = block.reshape(-1)
        for start in range(0, flat.size, difference.PIECE):
            piece = flat[start : start + difference.PIECE]
            if run:
                place = np.arange(first + start, first + start + piece.size, dtype=np.uint64)
                coords = []
            else:
                at = np.unravel_index(np.arange(start, start + piece.size), block.shape)
                coords = [c + o for c, o in zip(at, offsets, strict=True)]
                place = np.zeros(piece.size, np.uint64)
                for d, stride in self._strides:
                    place += coords[d].astype(np.uint64) * np.uint64(stride)
            hashed = self._hashed(place, piece)
            for d in self._weighed:
                low, high = int(coords[d].min()), int(coords[d].max()) + 1
                weights = self._keys.powers(d, low, high)
                hashed = _mulmod(hashed, weights[coords[d] - low])
            self._total = (self._total + _summod(hashed)) % P

    def _hashed(self, place: np.ndarray, piece: np.ndarray) -> np.ndarray:
        """A keyed hash of each value's place and words, below 2**61 (at most P, which
        counts as 0)."""
        words = difference.canonical(piece) or []
        hashed = (place ^ self._keys.place) * self._keys.factor
        for word in words[:1]:
            hashed ^= word
        hashed = _mix(hashed)
        for word in words[1:]:
            hashed = _mix(hashed ^ word)
        hashed >>= np.uint64(3)
        return hashed

    def value(self) -> int | None:
        return self._total * self._scale % P if self.digestible else None


def _one_run(box: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a box of `box`'s shape in an array of `shape` is one run in C order:
    whole along every dimension after its first longer than 1."""
    first = next((d for d, n in enumerate(box) if n != 1), len(box))
    return all(box[d] == shape[d] for d in range(first + 1, len(box)))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: each bit of the result depends on every bit of `x`."""
    x = x ^ (x >> np.uint64(30))
    x *= _MIX[0]
    x ^= x >> np.uint64(27)
    x *= _MIX[1]
    x ^= x >> np.uint64(31)
    return x


def _mulmod(a: np.ndarray, b: np.ndarray | np.uint64) -> np.ndarray:
    """`a * b % P` for numbers below 2**61, in 32-bit halves, so that nothing overflows:
    2**61 is 1 modulo P, so 2**64 is 8, and a multiple of 2**61 folds onto the rest."""
    a_high, a_low = a >> np.uint64(32), a & _LOW
    b_high, b_low = b >> np.uint64(32), b & _LOW
    low = a_low * b_low  # below 2**64
    middle = a_high * b_low + a_low * b_high  # below 2**62: times 2**32, folded at 2**61
    total = (
        ((a_high * b_high) << np.uint64(3))
        + (middle >> np.uint64(29))
        + ((middle & np.uint64((1 << 29) - 1)) << np.uint64(32))
        + (low & np.uint64(P))
        + (low >> np.uint64(61))
    )
    total = (total & np.uint64(P)) + (total >> np.uint64(61))
    result: np.ndarray = np.where(total >= np.uint64(P), total - np.uint64(P), total)
    return result


def _summod(values: np.ndarray) -> int:
    """`sum(values) % P` of at most 2**32 numbers below 2**61, in 32-bit halves."""
    low = int(np.sum(values & _LOW, dtype=np.uint64))
    high = int(np.sum(values >> np.uint64(32), dtype=np.uint64))
    return ((high << 32) + low) % P
