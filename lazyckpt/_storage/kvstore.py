"""The one I/O core: a checkpoint item's kvstore, pinned to one generation of it. Its reads
return tensorstore futures (but `read_at_once`'s), which the sync and async faces share."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import attrs

from lazyckpt._display import given_repr
from lazyckpt._errors import (
    CheckpointChangedError,
    CorruptCheckpointError,
    LazyckptError,
    StorageAccessError,
)
from lazyckpt._storage import paths, probes
from lazyckpt._storage.deferred import DeferredKvStore, new_context
from lazyckpt._storage.folders import listing
from lazyckpt._storage.futures import RangeAnswer, then
from lazyckpt._storage.http import relay
from lazyckpt._storage.http.transport import Scatter
from lazyckpt._storage.http.web import WebFiles
from lazyckpt._storage.identities import (
    FileIdentities,
    changed_error,
    copied,
    open_checked,
    read_at_once,
    read_checked,
)
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.local import check_regular
from lazyckpt._storage.ocdbt import Index
from lazyckpt._storage.ocdbt_tree import Tree
from lazyckpt._storage.per_process import tensorstore_io

T = TypeVar("T")


def from_one_generation(
    folder: str,
    read: Callable[[tuple[object, ...]], T],
    files: tuple[str, ...] = paths.GENERATION_FILES,
) -> T:
    """`read(generation)`, from one generation of the checkpoint in `folder`: when the
    checkpoint is replaced meanwhile (its `files` vanish or disagree), read again,
    once; a second change raises `CheckpointChangedError`, never a mix."""
    for _ in range(2):
        before = paths.generation(folder, files)
        try:
            result = read(before)
        except LazyckptError:
            if paths.generation(folder, files) == before:
                raise
            continue  # files vanished or disagreed because a save replaced them: again
        if paths.generation(folder, files) == before:
            return result
    raise changed_error(folder)


def check_unchanged(stores: Iterable[Store]) -> None:
    """After a read: that none of the checkpoints it read from changed meanwhile."""
    for store in {id(store): store for store in stores}.values():
        store.check_unchanged()


def _inside(relative: str) -> bool:
    """Whether the path `relative` names a file inside the folder it is relative to
    (a hostile checkpoint's names are read by tensorstore's driver, whose errors say
    what is wrong with them)."""
    parts = relative.split("/")
    return (
        bool(relative)
        and not relative.startswith("/")
        and not {"..", "", "."} & set(parts)
        and "\\" not in relative
        and "\0" not in relative
    )


@attrs.frozen(eq=False)
class Store:
    """Where one PyTree item's arrays live, and the context used to read them."""

    location: str = attrs.field(repr=given_repr)
    ocdbt: bool
    _context: ts.Context | None = attrs.field(repr=False, alias="context")  # (see `context`)
    kvstore_spec: dict[str, Any] = attrs.field(repr=False)
    kvstore: ts.KvStore = attrs.field(repr=False)
    """tensorstore's (a local folder's opened at its first use: `DeferredKvStore`), or for
    files over HTTP a `WebFiles`, which reads as one does."""
    generation: tuple[object, ...] = attrs.field(default=(), repr=False)
    """The checkpoint's `paths.generation` when it was opened."""
    files: tuple[str, ...] = attrs.field(default=paths.GENERATION_FILES, repr=False)
    """The files whose identity makes up the generation."""
    index: Index | None = attrs.field(default=None, repr=False)
    """An OCDBT database's b-tree, walked once for reads of many keys."""
    web: WebFiles | None = attrs.field(default=None, repr=False)
    """Over HTTP, for tensorstore's drivers: the folder's files that the relay serves
    them, read by lazyckpt itself where it knows the byte ranges it wants (its pins
    are the relay's: one version of each file)."""
    identities: FileIdentities = attrs.field(factory=FileIdentities, kw_only=True, repr=False)
    """The local files it reads, each as first seen (`open_file`; an Orbax checkpoint's
    folders of chunk files, each as listed at its first read); over HTTP, the copies
    in the Hugging Face cache, shared with its `WebFiles`."""
    _database_files: list[str] = attrs.field(factory=list, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @property
    def context(self) -> ts.Context:
        """tensorstore's context of the store's reads and arrays (a local folder's: made late)."""
        return self._context or cast(DeferredKvStore, self.kvstore).context

    def changed(self) -> bool:
        """Whether the checkpoint was replaced or rewritten since it was opened."""
        return bool(self.generation) and (
            paths.generation(self.location, self.files) != self.generation
        )

    def check_unchanged(self) -> None:
        """Raise `CheckpointChangedError` if the checkpoint changed since it was opened:
        what was read may mix the old checkpoint and the new one."""
        if self.changed():
            raise self.changed_error()

    def changed_error(self) -> CheckpointChangedError:
        """That the checkpoint changed since it was opened, naming it: its file where
        it is one (a `.safetensors`, `.npz` or torch file), else its folder."""
        if len(self.files) == 1:
            return changed_error(paths.join(self.location, self.files[0]))
        return changed_error(self.location)

    def check_files(self, keys: Iterable[str]) -> None:
        """Refuse a read of `keys` where a local file it would read is no regular file
        (`CorruptCheckpointError` naming it), or no longer the file first seen there
        (`open_file`; `CheckpointChangedError`): in a folder, each key's file; in
        an OCDBT database, whose values may lie in any of its files, every data file
        and manifest.

        For what tensorstore still reads from a local disk itself (lazyckpt reads the
        rest through one descriptor of the file first seen there: `read`): the arrays
        of an Orbax checkpoint whose coding lazyckpt does not decode (blosc, gzip,
        filters: its `zarr` driver decodes them), and an OCDBT database's b-tree, with
        its values wherever lazyckpt's index does not place them (then only its `ocdbt`
        driver does). tensorstore opens each file with a blocking `open`, so a FIFO put
        in a file's place after `open` would hang the read forever; callers check just
        before tensorstore's read. A window remains, from this `stat` to tensorstore's
        `open` of each file: short for a read's first file, up to the length of the
        read for its last. A FIFO put in place within it blocks that read (the next read's check
        refuses it); a file swapped in and back out within it goes unseen:
        tensorstore's reads do not say which file they opened."""
        if paths.is_remote(self.location):
            return
        files = (
            self._files_of_database()
            if self.ocdbt
            else [os.path.join(self.location, key) for key in keys]
        )
        # (and, from the same `stat`s, that each is still the file first seen there)
        for path, info in check_regular(files):
            if not self.identities.same(path, info, first=False):
                raise changed_error(path)

    def open_file(self, path: str) -> tuple[int, os.stat_result] | None:
        """`local.open_file(path)`, where it is the file first seen there (at `open`, or
        at its first read; a chunk file, as its folder was then: `FileIdentities`);
        else `CheckpointChangedError` naming it. Each piece of a read opens its file
        again: a file swapped meanwhile would mix two files in one result."""
        return open_checked(self.identities, path)

    def read(
        self, key: str, byte_range: slice | None = None, into: memoryview | None = None
    ) -> ts.Future[ts.KvStore.ReadResult]:
        """`key`'s bytes in `byte_range`, as `kvstore.read` answers (`into`: landed in that
        buffer, of the range's length): a local folder's file read by lazyckpt (`read_at_once`),
        others through the kvstore, checked first (`check_files`)."""
        if self.reads_itself(key):
            return read_checked(self.identities, os.path.join(self.location, key), byte_range, into)
        self.check_files([key])
        self.check_tensorstore()
        read = self.kvstore.read(key, byte_range=byte_range)
        return read if into is None else then(read, functools.partial(copied, into))

    def reads_itself(self, key: str) -> bool:
        """Whether lazyckpt reads `key` itself (a local folder's file), never tensorstore."""
        return not (self.ocdbt or paths.is_remote(self.location)) and _inside(key)

    def read_at_once(self, key: str, byte_range: slice | None = None) -> ts.KvStore.ReadResult:
        """`read`'s answer (or error) at once, where lazyckpt reads `key` itself."""
        return read_at_once(self.identities, os.path.join(self.location, key), byte_range)

    def read_into(self, key: str, start: int, into: memoryview) -> ts.Future[ts.KvStore.ReadResult]:
        """`key`'s bytes from `start` landed in `into` (its length of them; the answer's
        value is their view, shorter where the file ends first): over HTTP read straight
        into it by lazyckpt's client, elsewhere as `read` reads it (checked first)."""
        if isinstance(self.kvstore, WebFiles):
            return cast(
                "ts.Future[ts.KvStore.ReadResult]", self.kvstore.read_into(key, start, into)
            )
        return self.read(key, slice(start, start + len(into)), into)

    def read_scattered(
        self, file: str, start: int, views: Sequence[memoryview]
    ) -> ts.Future[ts.KvStore.ReadResult]:
        """The bytes of the folder's `file` from `start`, landed in `views` in turn, in one
        request by lazyckpt's client: over HTTP, where tensorstore's drivers read the
        rest through the relay (an OCDBT data file's values that its index placed)."""
        assert self.scatters, "read_scattered reads a folder over HTTP"
        assert self.web is not None
        read = self.web.read_into(file, start, Scatter(list(views)))
        return cast("ts.Future[ts.KvStore.ReadResult]", read)

    @property
    def scatters(self) -> bool:
        """Whether `read_scattered` can land one request's bytes in several buffers (a
        checkpoint folder over HTTP, read by lazyckpt's client beside the relay)."""
        return self.web is not None

    @property
    def short_reads(self) -> bool:
        """Whether the backend answers a range past a file's end with the bytes there
        are, and pins each file's size at its first answer (`read_short`, `pinned_size`:
        a folder over HTTP, which reads no range counted from the end); tensorstore's
        kvstores fail such a read (OUT_OF_RANGE)."""
        return isinstance(self.kvstore, WebFiles)

    def read_short(self, key: str, start: int, n: int) -> ts.Future[RangeAnswer]:
        """Up to `n` bytes of `key` from `start`, fewer where it ends first, with the
        file's size where the server said it (only where `short_reads`)."""
        assert self.short_reads, "read_short reads a folder over HTTP"
        return cast(WebFiles, self.kvstore).read(
            key, byte_range=slice(start, start + n), short=True
        )

    def pinned_size(self, key: str) -> int | None:
        """`key`'s size as the first answer of a `short_reads` backend said; None before."""
        assert self.short_reads, "pinned_size is pinned by a folder over HTTP"
        return cast(WebFiles, self.kvstore).size(key)

    def read_heads(self, keys: Sequence[str], n: int) -> list[ts.Future[RangeAnswer]]:
        """The first `n` bytes of each of `keys` (`read_short`): the reads `probes.read_ahead`
        started for them, taken (their pins this store's), or new ones; what was read
        ahead of the folder's other files is dropped."""
        assert self.short_reads, "read_heads reads a folder over HTTP"
        files = cast(WebFiles, self.kvstore)
        ahead = probes.take_ahead(self.location, keys)
        for key, (other, _) in ahead.items():
            files.adopt(key, other)
        return [ahead[key][1] if key in ahead else self.read_short(key, 0, n) for key in keys]

    def _files_of_database(self) -> list[str]:
        """The OCDBT database's manifests and data files (`d/`), its own and those of
        the per-process databases in it: listed once, as their names never change."""
        with self._lock:
            if not self._database_files:
                for folder, _, names in os.walk(self.location):
                    in_data = os.path.basename(folder) == "d"
                    self._database_files.extend(
                        os.path.join(folder, name)
                        for name in names
                        if in_data or name == "manifest.ocdbt"
                    )
            return self._database_files

    @classmethod
    def open(
        cls,
        location: str,
        *,
        ocdbt: bool,
        generation: tuple[object, ...] = (),
        files: tuple[str, ...] = paths.GENERATION_FILES,
        drivers: bool = False,
        listed: bool = False,
        outside_links: bool = False,
    ) -> Store:
        """The store of the checkpoint item at `location`; over HTTP, read by `WebFiles`
        (safetensors' byte ranges), or with `drivers` by tensorstore's `ocdbt` and
        `zarr` drivers through lazyckpt's client (Orbax's arrays). With `listed`, a
        local file that is not one of `files` counts as the checkpoint's only where its
        folder's listing, taken at its first read, holds it, and a link only where it
        leads into the folder, or `outside_links` allows it (`FileIdentities`)."""
        if not (ocdbt or paths.is_remote(location)):
            # Files lazyckpt reads itself: tensorstore's kvstore made at first use (no import).
            spec = paths.kvstore_spec(location)
            kvstore = cast("ts.KvStore", DeferredKvStore(location, spec))
            seen = FileIdentities(location if listed else None, outside_links=outside_links)
            store = cls(location, ocdbt, None, spec, kvstore, generation, files, identities=seen)
            store.identities.remember(os.path.join(location, name) for name in files)
            return store
        context = new_context()
        if paths.is_web(location) and not drivers:
            # Read by lazyckpt's own Range requests: the safetensors reader calls `read`
            # alone, which `WebFiles` answers as tensorstore's kvstores do.
            over_http = WebFiles(location)
            kvstore = cast(ts.KvStore, over_http)
            seen = over_http.identities
            return cls(location, ocdbt, context, {}, kvstore, generation, files, identities=seen)
        tensorstore_io(location)
        web = None
        if paths.is_web(location):
            # tensorstore's drivers, reading through lazyckpt's client (`relay`); the
            # relay serves the folder for as long as the context (held by the store
            # and by every array opened from it) lives.
            web = WebFiles(location)
            base = {"driver": "http", "base_url": relay.address(web, context)}
        else:
            base = paths.kvstore_spec(location)
        spec = (
            {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#metadata"}
            if ocdbt
            else base
        )
        try:
            kvstore = ts.KvStore.open(spec, context=context).result()
        except Exception as error:
            if not paths.is_remote(location):
                raise
            raise paths.storage_error(location, error) from None
        local = not paths.is_remote(location)
        seen = (
            web.identities
            if web is not None
            else FileIdentities(location if listed and local else None, outside_links=outside_links)
        )
        index = (
            Index(
                Tree(
                    kvstore.base,
                    location,
                    location if local else None,
                    sizes=None if web is None else web.size,  # (as the relay pinned them)
                ),
                coalesce=not local,
                # (a data file's values read by lazyckpt itself, from the file first seen)
                read_file=(lambda file, at: read_checked(seen, os.path.join(location, file), at))
                if local
                else None,
            )
            if ocdbt and kvstore.base is not None
            else None
        )
        store = cls(
            location, ocdbt, context, spec, kvstore, generation, files, index, web, identities=seen
        )
        if local:  # (a database's files, as they are now)
            store.identities.remember(store._files_of_database())
        if index is not None:
            store._check_tree(index)
        return store

    def _check_tree(self, index: Index) -> None:
        """Read the OCDBT database's b-tree whole before tensorstore's driver reads any
        of it (`Index.check`): a manifest or node that would decode too large, or no
        b-tree's, is refused here, by name."""
        self.check_files(())  # (the check reads the database's files: none is a FIFO)
        try:
            index.check()
        except LazyckptError:
            raise
        except ValueError as error:  # (a read that failed, in tensorstore's words)
            raise self._failure(error, "reading the b-tree of", "data files") from None

    def check_tensorstore(self) -> None:
        """Before a read through tensorstore's kvstore: refused by name in a forked
        child, where tensorstore would abort (`tensorstore_io`)."""
        if not isinstance(self.kvstore, WebFiles):
            tensorstore_io(self.location)

    def local_file(self, key: str) -> tuple[str, int, int | None] | None:
        """Where `key`'s value lies in a local file, for positioned reads of it: the
        file, the value's offset in it and its length (None: to the file's end); None
        where only the kvstore reads it (a bucket, HTTP, an OCDBT database whose index
        was not walked or does not place the key in a data file)."""
        if paths.is_remote(self.location):
            return None
        if not self.ocdbt:
            return (os.path.join(self.location, key), 0, None) if _inside(key) else None
        if self.index is None:
            return None
        if not self.index.walked:
            self.check_tensorstore()  # (the walk reads through tensorstore)
        place = self.index.locate(key)
        if not isinstance(place, tuple) or not _inside(place[0]):
            return None
        file, offset, length = place
        return os.path.join(self.location, file), offset, length

    def list_keys(self, prefix: str) -> list[str]:
        """The keys under `prefix` (every key when it is empty), in no order."""
        if paths.is_web(self.location) and not self.ocdbt:
            return self._listed(prefix)
        tensorstore_io(self.location)
        if self.index is not None:
            # (lazyckpt's own listing: the driver's lists every path to a node that the
            # b-tree names many times, and can exhaust memory)
            try:
                return self.index.list_keys(prefix)
            except LazyckptError:
                raise
            except ValueError as error:
                raise self._failure(error, f"listing {prefix!r} in", "files") from None
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1]) if start else b""
        try:
            found = self.kvstore.list(ts.KvStore.KeyRange(start, end)).result()
        except ValueError as error:
            raise self._failure(error, f"listing {prefix!r} in", "files") from None
        return [key.decode("utf-8", errors="replace") for key in found]

    def _listed(self, prefix: str) -> list[str]:
        """The keys under `prefix` of a folder over HTTP, which tensorstore cannot list:
        from the Hub's listing at its commit."""
        found = listing(self.location)
        if found is None or found.asked is not None:
            raise StorageAccessError(
                f"{self.location}: listing {prefix!r} needs the folder's file list, which a "
                "server over plain HTTP does not give; copy the checkpoint to a disk or a "
                "bucket to list its files"
            )
        return [name for name in found.names if name.startswith(prefix)]

    def read_keys(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of `keys` (None where missing), read together in one batch."""
        with ts.Batch() as batch:
            futures = self.read_many(keys, [None] * len(keys), batch)
        results: list[bytes | None] = []
        for key, future in zip(keys, futures, strict=True):
            if not isinstance(future, ts.Future):
                results.append(future)
                continue
            try:
                result = future.result()
            except ValueError as error:
                raise self._failure(error, f"reading {key!r} from", "data files") from None
            results.append(result.value if result.state == "value" else None)
        return results

    def _failure(self, error: Exception, doing: str, files: str) -> LazyckptError:
        """What a failed listing or read (`doing`) of the store is: a replaced
        checkpoint, lazyckpt's own error from a read over HTTP, or damaged `files`."""
        if self.changed():
            return self.changed_error()
        return paths.read_failure(
            error,
            lambda text: CorruptCheckpointError(
                f"{self.location}: {doing} the {'OCDBT database' if self.ocdbt else 'folder'} "
                f"failed ({text}); the checkpoint's {files} are missing or damaged, copy it "
                "again"
            ),
        )

    def read_many(
        self, keys: Sequence[str], byte_ranges: Sequence[slice | None], batch: ts.Batch
    ) -> list[bytes | ts.Future[ts.KvStore.ReadResult] | None]:
        """The values of `keys`, each cut to its byte range if it has one, in `batch`:
        through an OCDBT database's b-tree index where its first read (`open`'s) found
        it worth building (values already known, or futures of the data files' bytes),
        else a future of each key's read through the driver."""
        if not (self.ocdbt or paths.is_remote(self.location)):  # (local files: `read`)
            return [self.read(key, span) for key, span in zip(keys, byte_ranges, strict=True)]
        self.check_files(keys)
        self.check_tensorstore()
        found = self.index.read(keys, byte_ranges, batch) if self.index else None
        if found is not None:
            return found
        return [
            self.kvstore.read(key, batch=batch)
            if byte_range is None
            else self.kvstore.read(key, byte_range=byte_range, batch=batch)
            for key, byte_range in zip(keys, byte_ranges, strict=True)
        ]
