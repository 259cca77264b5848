"""`verify`: decode every stored chunk of a checkpoint, and say which arrays are damaged.

For users who copy checkpoints around: each chunk is decoded whole, as a stream
within the memory budget (a 1 GiB chunk holds a few MiB), so every checksum the
chunks carry is checked, and every chunk is checked to be present, to decode, and to
hold exactly the bytes its array declares. Damage is reported by key path, and the
verification goes on to the other arrays; an array whose chunks cannot even be listed
(a damaged b-tree node of the OCDBT database), or a checkpoint that does not open, is
reported as not checked, with the reason. Arrays without checksums (zstd without its
content checksum, as Orbax writes it, or no compression) are named too: for them a
flipped bit inside the data decodes to a wrong value that nothing can detect.

An array of a zip archive (`.npz`, `torch.save`) is checked against its member's
CRC-32: a deflated member's as it is inflated to its end, a stored member's by
reading the member whole once more. (Reads of a stored member's arrays read only the
bytes they need, and cannot check a CRC-32 of the whole member.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import tensorstore as ts

from lazyckpt._array.geometry import (
    Box,
    as_slices,
    bounds,
    box_bytes,
    chunk_box,
    chunks_in,
    clip,
    intersect,
    product,
    slabs,
    split_dim,
)
from lazyckpt._array.tree import Select, selected
from lazyckpt._display import as_given
from lazyckpt._engine.decode import ChunkStream, decodes, job_bytes
from lazyckpt._engine.fill import windows
from lazyckpt._engine.memory import check_fits
from lazyckpt._engine.progress import shown
from lazyckpt._engine.scheduler import HELD, Scheduler, in_pool
from lazyckpt._engine.stored import StoredArray, stored_array
from lazyckpt._errors import CorruptCheckpointError, LazyckptError, renamed
from lazyckpt._lazy import LazyArray
from lazyckpt._open import arrays_listed
from lazyckpt._open import open as open_checkpoint
from lazyckpt._read import arrays_of
from lazyckpt._sizes import optional_size
from lazyckpt._storage.futures import then
from lazyckpt._storage.kvstore import check_unchanged
from lazyckpt._text import fold, human_bytes
from lazyckpt._weights.arrays import MemberArray
from lazyckpt._weights.zips import Stored

_SHOWN = 20  # damaged arrays listed in full by str(); the rest are counted
_NAMES = 8  # folded key paths listed per line of names; the rest are counted
_WHOLE = "(the checkpoint)"
"""The key of the one not-checked entry of a checkpoint that does not open, where
`_METADATA` cannot say which arrays it holds."""


@attrs.frozen
class Damage:
    """What is wrong with one array: its first damaged chunk, and how many are."""

    key: str
    problem: str
    chunks: int

    def __str__(self) -> str:
        more = f" (and {self.chunks - 1} more damaged chunks)" if self.chunks > 1 else ""
        return f"{self.key}: {self.problem}{more}"


@attrs.frozen
class Verification:
    """What `verify` found. `damaged` lists arrays whose chunks are missing, do not
    decode or fail their checksums; `not_checked` the arrays that could not be checked,
    and why (their chunks could not be listed, or the checkpoint does not open: then
    every array `_METADATA` lists, or one entry for the whole checkpoint); `fine` the
    arrays whose every chunk decoded; `unchecked` names the arrays whose chunks carry
    no checksum, so that a flipped bit in their data would have gone unseen."""

    arrays: int
    chunks: int
    nbytes: int
    """Decoded bytes checked."""
    damaged: list[Damage]
    unchecked: list[str]
    not_checked: list[Damage] = attrs.field(factory=list)
    fine: list[str] = attrs.field(factory=list)
    opened: bool = True
    """Whether the checkpoint opened (False: `not_checked` says why, for every array)."""

    @property
    def ok(self) -> bool:
        """Whether every array was checked and no damage was found."""
        return not self.damaged and not self.not_checked

    def describe(self) -> dict[str, Any]:
        """As JSON-ready data."""
        return {
            "ok": self.ok,
            "opened": self.opened,
            "arrays": self.arrays,
            "chunks": self.chunks,
            "bytes": self.nbytes,
            "damaged": [attrs.asdict(d) for d in self.damaged],
            "not_checked": [{"key": d.key, "problem": d.problem} for d in self.not_checked],
            "fine": self.fine,
            "unchecked": self.unchecked,
        }

    def __str__(self) -> str:
        found = [f"{len(self.damaged)} damaged"] if self.damaged else []
        if self.not_checked:
            found.append(f"{len(self.not_checked)} not checked")
        head = (
            f"{self.arrays} arrays, {self.chunks} chunks, {human_bytes(self.nbytes)} decoded: "
            + (", ".join(found) or "no damage found")
        )
        if not self.opened:
            what = f"none of its {self.arrays} arrays" if self.arrays else "nothing"
            head = f"the checkpoint does not open: {what} was checked"
        lines = [head, *(f"  {d}" for d in self.damaged[:_SHOWN])]
        if len(self.damaged) > _SHOWN:
            lines.append(f"  ... and {len(self.damaged) - _SHOWN} more damaged arrays")
        reasons: dict[str, list[str]] = {}
        for entry in self.not_checked:
            reasons.setdefault(entry.problem, []).append(entry.key)
        for problem, keys in reasons.items():
            lines.append(f"  not checked: {_names(keys)}: {problem}")
        if self.fine and (self.damaged or self.not_checked):
            lines.append(f"  fine: {_names(self.fine)}")
        if self.unchecked:
            some = ", ".join(self.unchecked[:5]) + (", ..." if len(self.unchecked) > 5 else "")
            lines.append(
                f"{len(self.unchecked)} of the arrays carry no checksums ({some}): their chunks "
                "are all there and decode to the right size, but a flipped bit inside their "
                "data would decode to wrong values unseen"
            )
        return "\n".join(lines)


def _names(keys: list[str]) -> str:
    """`keys` folded by layer number, the first few of them."""
    folded = [line.path for line in fold(((key, "") for key in keys), vary=False)]
    more = f" and {len(folded) - _NAMES} more" if len(folded) > _NAMES else ""
    return ", ".join(folded[:_NAMES]) + more


@renamed(which="select")
def verify(
    tree: Any,
    select: Select | None = None,
    *,
    step: int | None = None,
    item: str | None = None,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int | str | None = None,
    progress: bool | None = None,
) -> Verification:
    """Decode every stored chunk behind the LazyArrays of `tree` and report damage by
    key path.

    Each chunk is read and decoded whole (for a sliced view, the chunks it touches)
    and its values dropped: checksums are verified, missing and truncated chunks
    found. The work follows what is stored (the chunks are listed first), not what a
    header declares. Damage always ends in the report: an array whose chunks cannot be
    listed is not checked, with the reason, and so is a checkpoint given by path that
    does not open (its arrays as `_METADATA` lists them). A chunk that cannot be read
    for other reasons (storage unreachable, the checkpoint overwritten meanwhile)
    raises, as any read does.

    Args:
        tree: A lazy tree, any pytree holding LazyArrays, or one LazyArray; or a
            path that `open` takes.
        select: Only the leaves matching a path pattern (`params/**/kernel`), any of
            a list of patterns, or a predicate `(path, leaf) -> bool`; see `select`.
        step: For a path: the step, as for `open`.
        item: For a path: the item of the step folder, as for `open`.
        storage_options: As for `open`.
        memory_budget: As for `load`.
        progress: As for `load`.

    Returns:
        A `Verification`: `ok`, the damaged arrays, those not checked and why, the
        fine ones, and those without checksums.

    >>> result = lazyckpt.verify(lazyckpt.open(path))
    >>> result.ok, result.damaged
    (True, [])
    """
    budget = optional_size("memory_budget", memory_budget)
    if isinstance(tree, str | os.PathLike):
        try:
            tree = open_checkpoint(tree, step=step, item=item, storage_options=storage_options)
        except CorruptCheckpointError as error:
            listed = _listed(tree, select, step, item, storage_options)
            return _unopened(listed, error)
    single = isinstance(tree, LazyArray)
    found = [(tree.key, tree)] if single else arrays_of(selected(tree, select))
    # A composed view is checked through the stored arrays it is made of.
    found = [(p if s is a else s.key, s) for p, a in found for s in a.sources]
    first: dict[int, tuple[str, LazyArray]] = {}
    for path, array in found:  # views of one stored array are checked once
        first.setdefault(id(array.stored), (path, array))
    problems: dict[str, _Problems] = {}
    plans = []
    not_checked = []
    for path, array in first.values():
        try:
            plans.append((path, array, _plan(array, problems.setdefault(path, _Problems()))))
        except CorruptCheckpointError as error:  # its chunks cannot even be listed
            not_checked.append(Damage(path, _line(_short(stored_array(array), str(error))), 0))
    members = _zip_members(plans)
    total = sum(plan.nbytes for _, _, plan in plans)
    total += sum(member.member.packed for member, _ in members.values())
    with shown(progress, total, "lazyckpt verify") as bar:
        scheduler = Scheduler(budget, bar)
        read_bytes, window = windows(scheduler.budget)
        chunks = 0
        for path, array, plan in plans:
            stored, found_here = stored_array(array), problems[path]
            decoded = decodes(stored)
            for index in plan.chunks:
                if len(found_here) >= _MAX_PROBLEMS:
                    break  # a header declaring a huge grid of missing chunks: enough said
                chunks += 1
                box = chunk_box(index, stored.chunks)
                nbytes = _chunk_bytes(stored, box)
                if decoded:
                    held = job_bytes(read_bytes, window)
                    start = _decode_start(stored, index, read_bytes, window)
                else:
                    check_fits(f"a stored chunk of {stored.key!r}", nbytes)
                    held = HELD * nbytes
                    start = _tensorstore_start(stored, index)
                scheduler.submit(start, found_here.append_if, held=held, work=nbytes)
        for member, paths in members.values():
            scheduler.submit(
                _crc_start(member, read_bytes),
                _noting([problems[path] for path in paths]),
                held=read_bytes,
                work=member.member.packed,
            )
        scheduler.drain()
    check_unchanged(stored_array(array).store for _, array, _ in plans)
    damaged = [
        Damage(path, _short(stored_array(array), messages[0]), len(messages))
        for path, array, _ in plans
        if (messages := problems[path])
    ]
    return Verification(
        arrays=len(plans) + len(not_checked),
        chunks=chunks,
        nbytes=total,
        damaged=damaged,
        unchecked=[path for path, array, _ in plans if not stored_array(array).checksummed],
        not_checked=not_checked,
        fine=[path for path, _, _ in plans if not problems[path]],
    )


def _zip_members(
    plans: list[tuple[str, LazyArray, _Plan]],
) -> dict[tuple[int, str, int], tuple[Stored, list[str]]]:
    """The stored zip members that hold the arrays of `plans`, each with the key
    paths of its arrays (tied tensors share one)."""
    out: dict[tuple[int, str, int], tuple[Stored, list[str]]] = {}
    for path, array, _ in plans:
        stored = stored_array(array)
        if isinstance(stored, MemberArray) and stored.member is not None:
            member = stored.member
            where = (id(member.file.store), member.file.key, member.member.header)
            out.setdefault(where, (member, []))[1].append(path)
    return out


def _crc_start(member: Stored, piece: int) -> Callable[[], Any]:
    def check() -> str | None:
        try:
            return member.problem(piece)
        except CorruptCheckpointError as error:  # (cut short: a finding too)
            return str(error)

    return lambda: in_pool(check)


def _noting(lists: list[_Problems]) -> Callable[[str | None], None]:
    """Note a problem with a zip member under each array it holds."""

    def note(problem: str | None) -> None:
        for found in lists:
            found.append_if(problem)

    return note


def _listed(
    path: str | os.PathLike[str],
    select: Select | None,
    step: int | None,
    item: str | None,
    storage_options: dict[str, Any] | None,
) -> list[str]:
    """The arrays that `_METADATA` lists at `path`, those `select` matches (a predicate
    needs the arrays, so it keeps them all); none where it cannot be read, or where
    `path` is not an Orbax checkpoint at all (a torch file, a `.npz`, a folder of
    `pytorch_model.bin` shards): the report then gives the error `open` met, not this
    listing's."""
    try:
        keys = arrays_listed(path, step=step, item=item, storage_options=storage_options)
        if select is not None and not callable(select):
            keys = list(selected(dict.fromkeys(keys, 0), select))
    except LazyckptError:  # (NoMatchError too: none of them is selected)
        return []
    return keys


def _unopened(keys: list[str], error: Exception) -> Verification:
    """The report on a checkpoint that does not open: each array `_METADATA` lists
    (`keys`) as not checked, or the whole checkpoint where there are none."""
    reason = _line(str(error))
    entries = [Damage(key, reason, 0) for key in keys] or [Damage(_WHOLE, reason, 0)]
    return Verification(len(keys), 0, 0, [], [], not_checked=entries, opened=False)


def _line(message: str, limit: int = 400) -> str:
    """`message` on one line, cut to `limit` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_MAX_PROBLEMS = 100  # damaged chunks reported per array before its check stops


class _Problems(list[str]):
    def append_if(self, problem: str | None) -> None:
        if problem is not None:
            self.append(problem)


@attrs.frozen
class _Plan:
    chunks: Iterator[tuple[int, ...]]
    """Grid positions of the stored chunks to decode, lazily."""
    nbytes: int


def _plan(array: LazyArray, problems: list[str]) -> _Plan:
    """The stored chunks of `array`'s view to decode. Where lazyckpt knows the chunk
    keys, the stored cells (chunks or shards) are listed first: the chunks of cells
    that exist are decoded, and cells that were never written are damage unless the
    checkpoint allows them (then they read as the fill value). Either way the work
    follows what is stored, whatever grid a damaged header declares."""
    stored = stored_array(array)
    if stored.inline is not None or 0 in stored.shape or array.size == 0:
        return _Plan(iter(()), 0)  # values held in the metadata: nothing more to decode
    touched = bounds(array.selection)
    keys = stored.keys
    if keys is None:
        grid = chunks_in(touched, stored.chunks)
        return _Plan(grid, _aligned_bytes(stored, touched))
    cell_shape = keys.cells(stored.chunks)
    ranges = [
        range(low // c, (high - 1) // c + 1)
        for (low, high), c in zip(touched, cell_shape, strict=True)
    ]
    rank = len(stored.shape)
    prefix = f"{stored.name}/" if stored.name else ""
    present = sorted(
        cell
        for key in stored.store.list_keys(prefix)
        if (cell := keys.parse(stored.name, key, rank)) is not None
        and all(i in r for i, r in zip(cell, ranges, strict=True))
    )
    wanted = math.prod(len(r) for r in ranges)
    if len(present) < wanted and not stored.fill_missing:
        missing = next(
            cell
            for cell, have in zip(product(ranges), [*present, None], strict=False)
            if cell != have
        )
        word = "shard" if keys.shard is not None else "chunk"
        where = f"{word} {list(missing)} (stored as {keys.key(stored.name, missing)!r})"
        count = wanted - len(present)
        problems.append(
            f"{where} is missing from the store"
            if count == 1
            else f"{count} of its {wanted} {word}s are missing from the store, the first {where}"
        )

    def inner() -> Iterator[tuple[int, ...]]:
        for cell in present:
            box = intersect(chunk_box(cell, cell_shape), touched)
            if box is not None:
                yield from chunks_in(box, stored.chunks)

    nbytes = 0
    for cell in present:
        box = intersect(chunk_box(cell, cell_shape), touched)
        nbytes += _aligned_bytes(stored, box) if box is not None else 0
    return _Plan(inner(), nbytes)


def _aligned_bytes(stored: StoredArray, box: Box) -> int:
    """Decoded bytes of the chunks that `box` touches, within the array."""
    aligned = tuple(
        ((low // c) * c, min(((high - 1) // c + 1) * c, n))
        for (low, high), c, n in zip(box, stored.chunks, stored.shape, strict=True)
    )
    return box_bytes(aligned, stored.dtype.itemsize)


def _chunk_bytes(stored: StoredArray, box: Box) -> int:
    return box_bytes(clip(box, stored.shape), stored.dtype.itemsize)


def _decode_start(
    stored: StoredArray, index: tuple[int, ...], read_bytes: int, window: int
) -> Callable[[], Any]:
    assert stored.codec is not None
    order, itemsize = stored.codec.order, stored.dtype.itemsize
    box = chunk_box(index, stored.chunks)

    def decode() -> str | None:
        stream = ChunkStream(stored, index, read_bytes)
        split = split_dim(box, order, itemsize, window) if stored.shape else 0
        cuts = [stored.shape[split]] if stored.shape else []
        try:
            for slab in slabs(box, order, itemsize, window, cuts):
                stream.next(slab)
            stream.finish()
        except CorruptCheckpointError as error:
            return str(error)
        finally:
            stream.close()
        return None

    return lambda: in_pool(decode)


def _tensorstore_start(stored: StoredArray, index: tuple[int, ...]) -> Callable[[], Any]:
    region = as_slices(clip(chunk_box(index, stored.chunks), stored.shape))

    def start() -> ts.Future[str | None]:
        reading = then(
            then(stored.open(), lambda t: stored.read_region(t, region)),
            lambda _: None,
            stored.read_error,
        )
        promise: ts.Promise[str | None]
        future: ts.Future[str | None]
        promise, future = ts.Promise.new()

        def settle(done: ts.Future[Any]) -> None:
            try:
                done.result()
            except CorruptCheckpointError as error:  # a finding, not a failure
                promise.set_result(f"chunk {list(index)}: {_short(stored, str(error))}")
            except Exception as error:  # noqa: BLE001 - handed to whoever awaits
                promise.set_exception(error)
            else:
                promise.set_result(None)

        reading.add_done_callback(settle)
        return future

    return start


def _short(stored: StoredArray, message: str) -> str:
    """`message` without the checkpoint's location and the advice, which the report
    gives once. (Messages show the location as the user gave it: `lazyckpt._display`.)"""
    message = message.removeprefix(f"{as_given(stored.store.location)}: ")
    return message.split("; the checkpoint", 1)[0]
