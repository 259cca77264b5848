"""What a format asks of a folder over HTTP by the names its files have, where the
folder has no listing: which of some names are files there (`present`), and the first
bytes of files read ahead while an index is still being read (`read_ahead`), taken
by the store that opens them (`Store.read_heads`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from lazyckpt._errors import StorageAccessError
from lazyckpt._storage.folders import local_copy
from lazyckpt._storage.futures import RangeAnswer
from lazyckpt._storage.http.web import WebFiles
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none


def present(folder: str, names: Sequence[str]) -> set[str]:
    """Which of `names` are files in `folder` (an http(s):// URL): asked all at once
    (one byte of each). A name refused (a bucket served over HTTP answers 403 for a
    missing object where it may not list) counts as missing, unless every name was
    refused."""
    files = WebFiles(folder)
    asked = {name: files.read(name, byte_range=slice(0, 1), short=True) for name in names}
    found, refused = set(), []
    for name, read in asked.items():
        try:
            if read.result().state == "value":
                found.add(name)
        except StorageAccessError as error:
            refused.append(error)
    if refused and len(refused) == len(asked):
        raise refused[0]
    return found


_AHEAD: dict[tuple[str, str], tuple[WebFiles, ts.Future[RangeAnswer]]] = {}
_AHEAD_LOCK = threading.Lock()
_AHEAD_FILES = 256
"""The most files of a folder whose first bytes are read ahead."""


def read_ahead(folder: str, names: Sequence[str], n: int) -> None:
    """Start reading the first `n` bytes of the files `names` of `folder` over HTTP
    (those not in the Hugging Face cache), for the store that opens them next
    (`Store.read_heads`); replaces what was read ahead of `folder` before."""
    wanted = [name for name in names if local_copy(f"{folder}/{name}") is None]
    files = WebFiles(folder)
    with _AHEAD_LOCK:
        _drop(folder)
        for name in wanted[:_AHEAD_FILES]:
            read = files.read(name, byte_range=slice(0, n), short=True)
            _AHEAD[folder, name] = (files, read)


def forget_ahead(folder: str) -> None:
    """Drop what `read_ahead` read of `folder` and no store took (an open that failed)."""
    with _AHEAD_LOCK:
        _drop(folder)


def take_ahead(
    folder: str, names: Sequence[str]
) -> dict[str, tuple[WebFiles, ts.Future[RangeAnswer]]]:
    """The reads ahead of `names` in `folder`, each with the files that made it (whose
    pins its taker adopts); those of its other files are dropped."""
    with _AHEAD_LOCK:
        taken = {name: found for name in names if (found := _AHEAD.pop((folder, name), None))}
        _drop(folder)
    return taken


def _drop(folder: str) -> None:
    """Drop the reads ahead of `folder` (`_AHEAD_LOCK` held)."""
    for key in [key for key in _AHEAD if key[0] == folder]:
        del _AHEAD[key]
