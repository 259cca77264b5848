"""Files served over HTTP(S) (`https://host/path/model.safetensors`, and the Hugging Face
Hub's `resolve/` URLs), read by byte ranges (`lazyckpt._storage.http.range_reads`), for
`lazyckpt._storage.paths`: read-only; a folder has no listing over plain HTTP, so it
lists what `folders.register` gave (the Hub's file list at a pinned commit, or what a
format found by name). A file whose copy is in the Hugging Face cache (`Site.local`)
is read from that copy, on disk.
"""

from __future__ import annotations

import os
import posixpath
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

from lazyckpt._errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageAccessError,
)
from lazyckpt._storage.folders import cached_fix, describe, listing, local_copy, site
from lazyckpt._storage.futures import RangeAnswer
from lazyckpt._storage.http import web_options
from lazyckpt._storage.http.range_reads import SAFE, WHOLE_LIMIT, Pin, client
from lazyckpt._storage.http.transport import Into, Scatter
from lazyckpt._storage.identities import FileIdentities
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.local import check_size, open_file, pread_into
from lazyckpt._storage.metrics import count_direct
from lazyckpt._storage.network import Stop


def _headers(url: str) -> dict[str, str]:
    """What requests for `url` send from the `storage_options` of the call in progress;
    nothing for a Hub folder, whose token its Site holds."""
    found = site(url)
    return {} if found is not None and found.generation else web_options.headers(url)


def _pin(url: str) -> Pin:
    """What a request for the file at `url` in the call in progress sends: its headers,
    and the query string of a pre-signed URL."""
    return Pin(headers=_headers(url), query=web_options.query(url))


class WebFiles:
    """The files of a folder over HTTP, read as tensorstore's kvstores are
    (`read(key, byte_range=)` returning a future of a result with `state` and
    `value`), so that the safetensors reader reads them as it reads a bucket. Each
    file's size and version are pinned at its first answer: the files one open reads.
    The first read that the server failed at every attempt (unreachable, 5xx, missed
    deadlines) stops those submitted before it (`Stop`); a definite answer (403, a
    damaged file's bytes) stops no other read, so `verify` still checks the rest.
    The headers of the open's `storage_options` are taken when it is made: its reads
    send them whenever they run, whatever a later open of the folder passes; and so
    the query strings of its files given as pre-signed URLs."""

    def __init__(self, folder: str) -> None:
        self.folder = folder.rstrip("/")
        self._headers = _headers(self.folder)
        self._queries = web_options.queries(self.folder)
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self._stop = Stop()
        self.identities = FileIdentities()
        """The copies in the Hugging Face cache it read, each as first read: its store's
        positioned reads of them check these too."""

    def read(
        self,
        key: str,
        *,
        byte_range: slice | None = None,
        batch: ts.Batch | None = None,
        short: bool = False,
    ) -> ts.Future[RangeAnswer]:
        """The bytes of `key` in `byte_range` (with `short`, up to the file's end);
        reads are not batched (`batch` is tensorstore's, for the same call shape)."""
        start = None if byte_range is None else byte_range.start
        stop = None if byte_range is None else byte_range.stop
        return self._submit(key, start, stop, short=short)

    def size(self, key: str) -> int | None:
        """The size of `key` as its first answer in this store said, if it answered."""
        with self._lock:
            pin = self._pins.get(key)
        return pin.size if pin is not None else None

    def adopt(self, key: str, other: WebFiles) -> None:
        """Take what `other`'s reads of `key` saw (its size, version, that it was
        there) as this store's own, as if they were its reads: a file's header read
        for this open before its store was made."""
        with other._lock:
            pin = other._pins.get(key)
        if pin is not None:
            with self._lock:
                self._pins.setdefault(key, pin)

    def read_into(self, key: str, start: int, into: Into) -> ts.Future[RangeAnswer]:
        """The bytes of `key` from `start`, read straight into `into` (all of it; a
        `Scatter`'s buffers in turn)."""
        return self._submit(key, start, start + len(into), into=into)

    def _submit(
        self,
        key: str,
        start: int | None,
        stop: int | None,
        *,
        short: bool = False,
        into: Into | None = None,
    ) -> ts.Future[RangeAnswer]:
        url = f"{self.folder}/{urllib.parse.quote(key, safe=SAFE.replace('%', ''))}"
        promise: ts.Promise[RangeAnswer]
        future: ts.Future[RangeAnswer]
        promise, future = ts.Promise.new()
        local = local_copy(f"{self.folder}/{key}")
        if local is not None:  # in the Hugging Face cache: a few system calls, here
            try:
                answer = read_cached(
                    local, url, start, stop, short=short, into=into, identities=self.identities
                )
                promise.set_result(answer)
            except Exception as error:  # noqa: BLE001 - handed to whoever awaits
                promise.set_exception(error)
            return future
        with self._lock:
            query = self._queries.get(key, "")
            pin = self._pins.setdefault(key, Pin(headers=self._headers, query=query))
        ticket = self._stop.ticket()

        def run() -> None:
            try:
                answer = client().read(
                    url,
                    start,
                    stop,
                    short=short,
                    pin=pin,
                    halt=self._stop,
                    ticket=ticket,
                    into=into,
                )
            except Exception as error:  # noqa: BLE001 - handed to whoever awaits
                if getattr(error, "gave_up", False):  # the server failed every attempt
                    self._stop.fail(ticket, str(error))
                promise.set_exception(error)
            else:
                promise.set_result(answer)

        client().submit(url, run)
        return future


def read_cached(
    file: str,
    url: str,
    start: int | None = None,
    stop: int | None = None,
    *,
    short: bool = False,
    limit: int = WHOLE_LIMIT,
    into: Into | None = None,
    identities: FileIdentities | None = None,
) -> RangeAnswer:
    """The bytes `[start, stop)` of `file`, the local copy of the file at `url` (the
    whole file, up to `limit` bytes, without a range; with `short`, fewer where it ends
    before `stop`), answered as `Client.read` answers for the file over HTTP, with its
    size; read straight `into` a buffer where one is given. Read only where it is a regular file (`open_file`: a FIFO in the cache
    would block forever), and where `identities` are given, the file they first saw
    there (each read opens it again: no bytes of another file in an answer); counted
    as lazyckpt's direct reads are."""
    found = open_file(file)
    if found is None:
        raise CheckpointChangedError(
            f"{describe(url)}: its copy in the Hugging Face cache is gone since the model "
            "was opened; open it again"
        )
    fd, info = found
    try:
        if identities is not None and not identities.same(file, info):
            raise CheckpointChangedError(
                f"{describe(url)}: its copy in the Hugging Face cache was replaced since "
                "the model was opened; open it again"
            )
        size = info.st_size
        low = start or 0
        high = size if stop is None else stop
        if start is None and stop is None:
            check_size(file, size, limit)
        if high > size and not short:
            raise _short_copy(file, url, size, high)
        wanted = max(min(high, size) - low, 0)
        data: bytearray | Into = bytearray(wanted) if into is None else into[:wanted]
        done = 0
        for view in data.views if isinstance(data, Scatter) else (memoryview(data),):
            done += pread_into(fd, view, low + done)
        if done < wanted:  # shortened since `fstat`
            raise _short_copy(file, url, low + done, high)
        count_direct(done)
        return RangeAnswer("value", b"" if isinstance(data, Scatter) else data, size)
    finally:
        os.close(fd)


def _short_copy(file: str, url: str, size: int, needed: int) -> CorruptCheckpointError:
    # (Not named by its path in the cache, which messages show as the hf:// path it
    # is: `cached_fix` names its blob, the file to delete.)
    return CorruptCheckpointError(
        f"{describe(url)}: its copy in the Hugging Face cache holds {size} bytes, fewer "
        f"than the {needed} needed; the cached file is truncated: {cached_fix(file)}"
    )


class WebFolders:
    """The `Storage` of HTTP(S) URLs: read-only; a folder lists what `register` gave."""

    atomic_rename = False

    def join(self, path: str, name: str) -> str:
        return f"{path.rstrip('/')}/{name}"

    def basename(self, path: str) -> str:
        return posixpath.basename(path.rstrip("/"))

    def dirname(self, path: str) -> str:
        return posixpath.dirname(path.rstrip("/"))

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        raise self._read_only(path)  # (reads go through `Store.open`, which knows HTTP)

    def listdir(self, path: str) -> list[str]:
        found = listing(path)
        if found is None:
            raise CheckpointNotFoundError(
                f"{path}: a folder over plain HTTP has no listing, and no checkpoint was "
                "found there by name; give the URL of the folder that holds an Orbax "
                "checkpoint's _METADATA (a step's or item's folder, not a "
                "CheckpointManager root), or a model's model.safetensors or "
                "model.safetensors.index.json"
            )
        return sorted({name.split("/", 1)[0] for name in found.names})

    def starting_with(self, prefix: str) -> list[str]:
        folder, _, start = prefix.rstrip("/").rpartition("/")
        try:
            names = self.listdir(folder)
        except CheckpointNotFoundError:
            return []
        return [name for name in names if name.startswith(start)]

    def isdir(self, path: str) -> bool:
        folder = path.rstrip("/")
        if listing(folder) is not None:
            return True
        found = site(folder)
        name = posixpath.basename(folder)
        return found is not None and any(n.startswith(name + "/") for n in found.names)

    def isfile(self, path: str) -> bool:
        if listing(path) is not None:
            return False  # a folder
        found = site(path)
        if found is not None:
            return posixpath.basename(path) in found.names
        if web_options.signed_above(path) is not None:
            return False  # (under a pre-signed URL, a file's: no request)
        return client().read(path, 0, 1, pin=_pin(path)).state == "value"

    def exists(self, path: str) -> bool:
        return self.isdir(path) or self.isfile(path)

    def read_bytes(self, path: str, limit: int) -> bytes | None:
        # Refused as it streams past the limit: the caller's for its kind of file,
        # never more than `WHOLE_LIMIT` over HTTP (a caller's default is 1 GiB).
        found = listing(self.dirname(path))
        if found is not None and found.lacks(self.basename(path)):
            return None  # (not in the Hub's listing at the pinned commit: no request)
        if web_options.signed_above(path) is not None:
            return None  # (under a pre-signed URL, a file's: no request)
        local = local_copy(path)
        if local is not None:
            answer = read_cached(local, path, limit=min(limit, WHOLE_LIMIT))
        else:
            answer = client().read(path, limit=min(limit, WHOLE_LIMIT), pin=_pin(path))
        return bytes(answer.value) if answer.state == "value" else None

    def _read_only(self, path: str) -> StorageAccessError:
        return StorageAccessError(
            f"{path}: lazyckpt reads over HTTP but does not write; save to a local folder "
            "or a bucket"
        )

    def write_bytes(self, path: str, data: bytes) -> None:
        raise self._read_only(path)

    def make_folder(self, path: str) -> None:
        raise self._read_only(path)

    def delete_folder(self, path: str) -> None:
        raise self._read_only(path)

    def delete_file(self, path: str) -> None:
        raise self._read_only(path)

    def copy_file(self, source: str, target: str) -> None:
        raise self._read_only(target)

    def probe_write(self, path: str) -> None:
        raise self._read_only(path)

    def generation(self, folder: str, files: tuple[str, ...]) -> tuple[object, ...]:
        found = listing(folder)
        return found.generation if found is not None else ()

    def unsafe_entries(self, folder: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        return [], []

    def walk_files(self, path: str) -> Iterator[str]:
        found = listing(path)
        yield from (found.names if found is not None else ())
