"""One weight file's bytes, read by range through its folder's `Store` (a local file by
lazyckpt's own positioned reads, `Store.read`): the reads the formats of this package
parse their tables from (a zip's directory, a pickle, `.npy` headers, msgpack), each
checked for length so that a short file is a `CorruptCheckpointError` naming it, never
a parse of fewer bytes than declared."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeAlias, TypeVar

import attrs

from lazyckpt._display import given_repr
from lazyckpt._errors import CheckpointNotFoundError, CorruptCheckpointError, LazyckptError
from lazyckpt._storage import paths
from lazyckpt._storage.deferred import Answered, answer
from lazyckpt._storage.futures import RangeAnswer, then
from lazyckpt._storage.kvstore import Store
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

T = TypeVar("T")
_Future: TypeAlias = "ts.Future[T] | Answered[T]"
"""A read on its way, or answered already (a local file's, read by lazyckpt)."""

MAX_OFFSET = 1 << 62
"""Past any file's end: a declared offset beyond it is damage, not a large file."""


@attrs.frozen
class File:
    """The file `key` of `store`'s folder; `path` is how errors name it. `known`
    holds its first bytes where they were read already (all of it, `whole`): reads
    within them are not made again."""

    store: Store
    key: str
    path: str = attrs.field(repr=given_repr)
    known: bytes = attrs.field(default=b"", repr=False)
    whole: bool = False

    def knowing(self, n: int) -> File:
        """This file, its first `n` bytes read (a small file's all)."""
        head = self.read_short(0, n)
        return attrs.evolve(self, known=head, whole=len(head) < n)

    def read(self, start: int, stop: int, what: str) -> bytes:
        """The bytes `[start, stop)`, all of them."""
        return self.reads([(start, stop)], what)[0]

    def reads(self, spans: Sequence[tuple[int, int]], what: str) -> list[bytes]:
        """The bytes of each `(start, stop)` span, read concurrently."""
        futures = [self._read(start, stop, what) for start, stop in spans]
        return [future.result() for future in futures]

    def read_short(self, start: int, n: int) -> bytes:
        """Up to `n` bytes from `start` (fewer where the file ends first)."""
        if start + n <= len(self.known) or self.whole:
            return self.known[start : start + n]
        if self.store.short_reads:  # (over HTTP: the bytes there are, not OUT_OF_RANGE)
            return self._value(self.store.read_short(self.key, start, n), f"bytes from {start}")
        try:
            return self._value(self._store_read(slice(start, start + n)), f"bytes from {start}")
        except _Short:  # fewer than `n` remain: read to the end, which is nearer
            try:
                return self._value(self._store_read(slice(start, None)), f"bytes from {start}")
            except _Short:  # (past the end)
                return b""

    def head(self, n: int) -> bytes:
        """Up to `n` bytes from the start (fewer where the file is shorter)."""
        return self.read_short(0, n)

    def tail(self, n: int) -> bytes:
        """Up to `n` bytes at the end (the whole file where it is shorter)."""
        if self.whole:
            return self.known[-n:]
        if self.store.short_reads:  # (over HTTP: no range counted from the end)
            size = self.store.pinned_size(self.key)
            if size is None:
                self.head(1)
                size = self.store.pinned_size(self.key)
            if size is None:
                raise CorruptCheckpointError(f"{self.path}: the server did not say its size")
            return self.read(max(0, size - n), size, "its end")
        try:
            return self._value(self._store_read(slice(-n, None)), "its end")
        except _Short:  # shorter than `n`
            return self._value(self._store_read(None), "its end")

    def _store_read(self, span: slice | None) -> _Future[ts.KvStore.ReadResult]:
        """The store's read of `span`; a local file's read now, importing no tensorstore."""
        if self.store.reads_itself(self.key):
            return answer(lambda: self.store.read_at_once(self.key, span), lambda found: found)
        return self.store.read(self.key, span)

    def _value(
        self, future: _Future[ts.KvStore.ReadResult] | ts.Future[RangeAnswer], what: str
    ) -> bytes:
        try:
            result = future.result()
        except LazyckptError:
            raise
        except Exception as error:  # noqa: BLE001 - tensorstore's, turned into ours
            if "OUT_OF_RANGE" in str(error):
                raise _Short from None
            raise self._failed(error, what) from None
        if result.state != "value":
            raise CheckpointNotFoundError(f"{self.path} does not exist; check the path")
        return bytes(result.value)

    def _read(self, start: int, stop: int, what: str) -> _Future[bytes]:
        if not 0 <= start <= stop <= MAX_OFFSET:
            raise CorruptCheckpointError(
                f"{self.path}: {what} is declared at bytes {start} to {stop}; the file's "
                "tables are damaged, download or copy it again"
            )

        def value(result: ts.KvStore.ReadResult) -> bytes:
            if result.state != "value":
                raise CheckpointNotFoundError(f"{self.path} does not exist; check the path")
            if len(result.value) != stop - start:
                raise self._short(start, stop, what)
            return bytes(result.value)

        if stop <= len(self.known) or start == stop:
            return Answered(self.known[start:stop] if stop <= len(self.known) else b"")
        if self.whole:
            raise self._short(start, stop, what)
        failed = functools.partial(self._failed, what=what, span=(start, stop))
        if self.store.reads_itself(self.key):  # (a local file: read now, importing no tensorstore)
            return answer(
                lambda: self.store.read_at_once(self.key, slice(start, stop)), value, failed
            )
        return then(self.store.read(self.key, slice(start, stop)), value, failed)

    def _failed(
        self, error: Exception, what: str, span: tuple[int, int] | None = None
    ) -> LazyckptError:
        if isinstance(error, LazyckptError):
            return error
        if "OUT_OF_RANGE" in str(error) and span is not None:
            return self._short(*span, what)
        if self.store.changed():
            return self.store.changed_error()
        if paths.is_remote(self.path):
            return paths.storage_error(self.path, error)
        return CorruptCheckpointError(f"{self.path}: reading {what} failed ({error})")

    def _short(self, start: int, stop: int, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path} is too short for {what} (bytes {start} to {stop}); the file is "
            "truncated, download or copy it again"
        )


class _Short(Exception):
    """A whole-range read past the file's end (tensorstore's OUT_OF_RANGE)."""
