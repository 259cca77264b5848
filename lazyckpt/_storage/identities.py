"""Which file each local path of a checkpoint named when lazyckpt first looked there:
its device and inode, which each read compares with its own descriptor's `fstat`
(`FileIdentities`). The checkpoint's generation, compared at the end of a read,
cannot see a file moved aside, another read in its place and the first moved back,
nor a file made a link out of the folder after `open`; this can, with no system call
more per read.

The files a store names at `open` (a weight file, an OCDBT database's files) are each
recorded by a `stat` then. A folder of chunk files (an Orbax checkpoint written
without OCDBT: one file per chunk, up to millions) is recorded whole at the first read
of a file in it, from one listing (`os.scandir` gives each entry's inode without a
call per file), as three arrays of 8 bytes an entry: a hash of its name, its device
and its inode (a tenth of the memory of a dict of paths, for millions of files).
A file its folder's listing does not hold, or a link in it that leads out of the
checkpoint, is no file of the checkpoint.

Local byte ranges that lazyckpt reads itself go through `read_checked`: one descriptor,
checked, for the whole range, answered as tensorstore's kvstores answer.
"""

from __future__ import annotations

import contextlib
import os
from array import array
from collections.abc import Iterable
from typing import cast

import attrs
import numpy as np

from lazyckpt._errors import CheckpointChangedError
from lazyckpt._storage.futures import RangeAnswer
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.local import open_file, pread_into, within
from lazyckpt._storage.metrics import count_direct


@attrs.frozen
class _Listing:
    """A folder's files as listed, sorted by the hash of their names (two names of one
    hash both kept: either file is the one at either name)."""

    names: np.ndarray
    devices: np.ndarray
    inodes: np.ndarray

    def holds(self, name: str, device: int, inode: int) -> bool:
        key = hash(name)
        low = int(np.searchsorted(self.names, key, side="left"))
        high = int(np.searchsorted(self.names, key, side="right"))
        return any(
            int(self.devices[at]) == device and int(self.inodes[at]) == inode
            for at in range(low, high)
        )


_NONE = _Listing(np.empty(0, np.int64), np.empty(0, np.uint64), np.empty(0, np.uint64))
"""A folder that holds no file of the checkpoint: missing, or out of it."""


class FileIdentities:
    """The device and inode of the file at each path a store reads, as first seen:
    where `root` is given (an Orbax checkpoint's folder), a path in it is judged by
    its folder's listing, taken at the first read there, in which a link counts only
    where it leads into `root` (or the Hugging Face cache's blobs, for a snapshot of
    it) or `outside_links` allows it; other paths are recorded at `open`
    (`remember`) or at their first read."""

    def __init__(self, root: str | None = None, *, outside_links: bool = False) -> None:
        # (no lock: `setdefault` is atomic, and a lock held by a thread at a fork
        # would be held forever in the child)
        self._seen: dict[str, tuple[int, int]] = {}
        self._root = None if root is None else root.rstrip(os.sep) or os.sep
        self._resolved = None if root is None else os.path.realpath(root)
        self._outside_links = outside_links
        self._folders: dict[str, _Listing | None] = {}

    def remember(self, paths: Iterable[str]) -> None:
        """Take the files at `paths` now (links followed; those that exist) as the ones
        first seen there."""
        for path in paths:
            with contextlib.suppress(OSError):
                info = os.stat(path)
                self._seen.setdefault(path, (info.st_dev, info.st_ino))

    def same(self, path: str, info: os.stat_result, *, first: bool = True) -> bool:
        """Whether the file `info` describes is the one first seen at `path`. Where none
        was: in a folder listed, False; else True, and (with `first`) it is the one
        from now on."""
        found = (info.st_dev, info.st_ino)
        known = self._seen.get(path)
        if known is not None:
            return known == found
        folder, name = os.path.split(path)
        listing = self._listing(folder)
        if listing is not None:
            return listing.holds(name, *found)
        if first:
            return self._seen.setdefault(path, found) == found
        return True

    def _listing(self, folder: str) -> _Listing | None:
        """The listing of `folder`, a folder of `root`, taken at its first use; None
        where there is no root, or the folder cannot be listed (its files are then
        recorded as first read)."""
        if self._root is None or self._resolved is None:
            return None
        folder = folder.rstrip(os.sep) or os.sep
        if folder != self._root and not folder.startswith(self._root.rstrip(os.sep) + os.sep):
            return None
        if folder not in self._folders:
            found = _listed(folder, self._resolved, self._outside_links)
            self._folders.setdefault(folder, found)
        return self._folders[folder]


def _listed(folder: str, root: str, outside_links: bool) -> _Listing | None:
    """The files of `folder` (its entries but folders), each by the hash of its name:
    a file by the inode its entry gives, a link by what it leads to, where that lies
    in `root` (or `outside_links`)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return _NONE
    except OSError:
        return None
    names, devices, inodes = array("q"), array("Q"), array("Q")
    try:
        where = _path_of(fd, folder)
        if not (outside_links or within(where, root)):
            return _NONE  # (a folder made a link out of the checkpoint)
        device = os.fstat(fd).st_dev
        exact: bool | None = None
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    continue
                if entry.is_symlink():
                    target = os.path.realpath(os.path.join(where, entry.name))
                    if not (outside_links or within(target, root)):
                        continue
                    try:
                        info = os.stat(entry.name, dir_fd=fd)
                    except OSError:
                        continue  # (a dangling link: reading it says so)
                    at = (info.st_dev, info.st_ino)
                else:
                    at = (device, entry.inode())
                    if exact is None:
                        # Where a file system's listing gives other numbers than `stat`
                        # (some FUSE mounts, overlays of several file systems), each
                        # file is asked instead.
                        info = entry.stat(follow_symlinks=False)
                        exact = (info.st_dev, info.st_ino) == at
                    if not exact:
                        info = entry.stat(follow_symlinks=False)
                        at = (info.st_dev, info.st_ino)
                names.append(hash(entry.name))
                devices.append(at[0])
                inodes.append(at[1])
    except OSError:
        return None
    finally:
        os.close(fd)
    hashes = np.frombuffer(names, np.int64)
    order = np.argsort(hashes, kind="stable")
    return _Listing(
        hashes[order],
        np.frombuffer(devices, np.uint64)[order],
        np.frombuffer(inodes, np.uint64)[order],
    )


def _path_of(fd: int, folder: str) -> str:
    """Where the folder open as `fd` is, resolved: what the system says of the
    descriptor (a folder renamed since it was opened is judged as what was opened),
    else `realpath`."""
    with contextlib.suppress(OSError):
        found = os.readlink(f"/proc/self/fd/{fd}")
        if found.startswith("/"):
            return found
    return os.path.realpath(folder)


def changed_error(location: str) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"{location} was overwritten or changed since it was opened, so what was read "
        "might mix the old checkpoint and the new one; open it again"
    )


def open_checked(identities: FileIdentities, path: str) -> tuple[int, os.stat_result] | None:
    """`local.open_file(path)`, where it is the file `identities` first saw there;
    else `CheckpointChangedError` naming it (a file gone reads as missing, as it
    did: the caller says whether one must be there)."""
    found = open_file(path)
    if found is not None and not identities.same(path, found[1]):
        os.close(found[0])
        raise changed_error(path)
    return found


def read_checked(
    identities: FileIdentities,
    path: str,
    byte_range: slice | None = None,
    into: memoryview | None = None,
) -> ts.Future[ts.KvStore.ReadResult]:
    """`read_at_once`, answered as tensorstore's kvstores answer: a future, done
    already, of its answer or its error."""
    promise: ts.Promise[ts.KvStore.ReadResult]
    future: ts.Future[ts.KvStore.ReadResult]
    promise, future = ts.Promise.new()
    try:
        promise.set_result(read_at_once(identities, path, byte_range, into))
    except Exception as error:  # noqa: BLE001 - handed to whoever awaits
        promise.set_exception(error)
    return future


def read_at_once(
    identities: FileIdentities,
    path: str,
    byte_range: slice | None = None,
    into: memoryview | None = None,
) -> ts.KvStore.ReadResult:
    """The bytes of the local file `path` in `byte_range`, as tensorstore's kvstores
    answer (a missing file's state `missing`; a range it does not hold, an
    `OUT_OF_RANGE` error, raised), by lazyckpt's positioned reads through one
    descriptor of the file `identities` first saw there (`open_checked`): never bytes
    of two files. Read on the caller's thread (a few system calls), without
    tensorstore, and straight `into` a buffer of the range's length where one is given
    (the answer's value is then `into` itself)."""
    found = open_checked(identities, path)
    if found is None:
        return cast("ts.KvStore.ReadResult", RangeAnswer("missing"))
    fd, info = found
    try:
        start, stop = _span(byte_range, info.st_size)
        value = _pread(fd, start, stop) if into is None else into
        done = len(value) if into is None else pread_into(fd, into[: stop - start], start)
    finally:
        os.close(fd)
    count_direct(done)
    if done < stop - start:  # (shortened in place since `fstat`)
        _span(slice(start, stop), start + done)
    return cast("ts.KvStore.ReadResult", RangeAnswer("value", value))


def copied(into: memoryview, result: ts.KvStore.ReadResult) -> ts.KvStore.ReadResult:
    """`result`, its value copied `into` the buffer where it fills it exactly (else the
    caller says what is wrong)."""
    if result.state == "value" and len(result.value) == len(into):
        into[:] = result.value
    return result


def _span(byte_range: slice | None, size: int) -> tuple[int, int]:
    """Where `byte_range` lies in a value of `size` bytes (a negative start counts from
    its end); tensorstore's `OUT_OF_RANGE` error where it does not."""
    if byte_range is None:
        return 0, size
    start = byte_range.start or 0
    stop = size if byte_range.stop is None else byte_range.stop
    at = start + size if start < 0 else start
    if not 0 <= at <= stop <= size:
        shown = "?" if byte_range.stop is None else str(byte_range.stop)
        raise ValueError(
            f"OUT_OF_RANGE: Requested byte range [{start}, {shown}) is not valid for value "
            f"of size {size}"
        )
    return at, stop


def _pread(fd: int, start: int, stop: int) -> bytes:
    """The bytes `[start, stop)` of `fd` (fewer where it ends first), in one `bytes`
    made by the read itself: no copy."""
    parts = [os.pread(fd, stop - start, start)]
    done = len(parts[0])
    while done < stop - start and parts[-1]:  # (Linux reads at most 2 GiB at once)
        parts.append(os.pread(fd, stop - start - done, start + done))
        done += len(parts[-1])
    return parts[0] if len(parts) == 1 else b"".join(parts)
