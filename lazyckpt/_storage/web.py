"""Files served over HTTP(S) (`https://host/path/model.safetensors`, and the Hugging Face
Hub's `resolve/` URLs), read by byte ranges (`lazyckpt._storage.ranges`), for
`lazyckpt._storage.paths`: read-only; a folder has no listing over plain HTTP, so it
lists what `ranges.register` gave (the Hub's file list at a pinned commit, or what a
caller probed).
"""

from __future__ import annotations

import posixpath
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import tensorstore as ts

from lazyckpt._errors import CheckpointNotFoundError, StorageAccessError
from lazyckpt._storage import web_options
from lazyckpt._storage.network import Stop
from lazyckpt._storage.ranges import SAFE, WHOLE_LIMIT, Answer, Pin, client, listing, site

SCHEMES = ("http", "https")


def is_web(path: str) -> bool:
    return path.split("://", 1)[0] in SCHEMES if "://" in path else False


def _headers(url: str) -> dict[str, str]:
    """What requests for `url` send from the `storage_options` of the call in progress;
    nothing for a Hub folder, whose token its Site holds."""
    found = site(url)
    return {} if found is not None and found.generation else web_options.headers(url)


class WebFiles:
    """The files of a folder over HTTP, read as tensorstore's kvstores are
    (`read(key, byte_range=)` returning a future of a result with `state` and
    `value`), so that the safetensors reader reads them as it reads a bucket. Each
    file's size and version are pinned at its first answer: the files one open reads.
    The first read that the server failed at every attempt (unreachable, 5xx, missed
    deadlines) stops those submitted before it (`Stop`); a definite answer (403, a
    damaged file's bytes) stops no other read, so `verify` still checks the rest.
    The headers of the open's `storage_options` are taken when it is made: its reads
    send them whenever they run, whatever a later open of the folder passes."""

    def __init__(self, folder: str) -> None:
        self.folder = folder.rstrip("/")
        self._headers = _headers(self.folder)
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self._stop = Stop()

    def read(
        self,
        key: str,
        *,
        byte_range: slice | None = None,
        batch: ts.Batch | None = None,
        short: bool = False,
    ) -> ts.Future[Answer]:
        """The bytes of `key` in `byte_range` (with `short`, up to the file's end);
        reads are not batched (`batch` is tensorstore's, for the same call shape)."""
        url = f"{self.folder}/{urllib.parse.quote(key, safe=SAFE.replace('%', ''))}"
        start = None if byte_range is None else byte_range.start
        stop = None if byte_range is None else byte_range.stop
        with self._lock:
            pin = self._pins.setdefault(key, Pin(headers=self._headers))
        ticket = self._stop.ticket()
        promise: ts.Promise[Answer]
        future: ts.Future[Answer]
        promise, future = ts.Promise.new()

        def run() -> None:
            try:
                answer = client().read(
                    url, start, stop, short=short, pin=pin, halt=self._stop, ticket=ticket
                )
            except Exception as error:  # noqa: BLE001 - handed to whoever awaits
                if getattr(error, "gave_up", False):  # the server failed every attempt
                    self._stop.fail(ticket, str(error))
                promise.set_exception(error)
            else:
                promise.set_result(answer)

        client().pool(url).submit(run)
        return future


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
        raise StorageAccessError(
            f"{path}: over HTTP, lazyckpt reads safetensors models only (not Orbax "
            "checkpoints); copy the checkpoint to a disk or a bucket"
        )

    def listdir(self, path: str) -> list[str]:
        found = listing(path)
        if found is None:
            raise CheckpointNotFoundError(
                f"{path}: a folder over HTTP has no listing; give the URL of its "
                "model.safetensors or model.safetensors.index.json"
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
        return client().read(path, 0, 1, pin=Pin(headers=_headers(path))).state == "value"

    def exists(self, path: str) -> bool:
        return self.isdir(path) or self.isfile(path)

    def read_bytes(self, path: str, limit: int) -> bytes | None:
        # Refused as it streams past the limit: the caller's for its kind of file,
        # never more than `WHOLE_LIMIT` over HTTP (a caller's default is 1 GiB).
        answer = client().read(path, limit=min(limit, WHOLE_LIMIT), pin=Pin(headers=_headers(path)))
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
