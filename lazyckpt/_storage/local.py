"""Checkpoint folders on a local (or mounted) file system, for `lazyckpt._storage.paths`."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from lazyckpt._errors import CheckpointWriteError, CorruptCheckpointError, StorageAccessError


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write all of `data` at `offset`: `os.pwrite` may write less than asked (Linux
    moves at most 0x7ffff000 bytes per call), so write the rest until none is left."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # (a full disk raises ENOSPC instead)
            raise CheckpointWriteError(
                f"writing at offset {offset} made no progress ({len(view)} bytes left); "
                "check the file system"
            )
        view, offset = view[written:], offset + written


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into all of `view` from `offset`, as `pwrite_all` writes: `os.preadv` may
    read less than asked. The bytes read: fewer than `len(view)` only where the file
    ends first."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class LocalFolders:
    """`lazyckpt._storage.paths.Storage` for local paths: `os` calls, files read only when they
    are regular files (a link to /dev/zero or a FIFO in a checkpoint is refused, never
    read or waited on)."""

    atomic_rename = True

    def join(self, path: str, name: str) -> str:
        return os.path.join(path, name)

    def basename(self, path: str) -> str:
        return os.path.basename(path)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return {"driver": "file", "path": path + "/"}

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def starting_with(self, prefix: str) -> list[str]:
        start = os.path.basename(prefix)
        return sorted(n for n in os.listdir(os.path.dirname(prefix)) if n.startswith(start))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_bytes(self, path: str, limit: int) -> bytes | None:
        fd = open_regular(path)
        if fd is None:
            return None
        info = os.fstat(fd)
        with os.fdopen(fd, "rb") as f:
            check_size(path, info.st_size, limit)
            data = f.read(info.st_size + 1)  # (read asks for its size up front: not limit)
            check_size(path, len(data), limit)
            return data

    def write_bytes(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)

    def make_folder(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def delete_folder(self, path: str) -> None:
        if os.path.exists(path):
            shutil.rmtree(path)

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def copy_file(self, source: str, target: str) -> None:
        shutil.copyfile(source, target)

    def probe_write(self, path: str) -> None:
        probe = f"{path}.lazyckpt-write-probe-{secrets.token_hex(4)}"
        try:
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as error:
            raise StorageAccessError(
                f"{path}: cannot write beside it ({error.strerror}); check the folder's "
                "permissions and free space"
            ) from None

    def generation(self, folder: str, files: tuple[str, ...]) -> tuple[object, ...]:
        """The folder's inode, and its metadata files' inodes, times and sizes (a few
        stats): a save with overwrite=True renames a new folder into place."""
        try:
            top = os.stat(folder)
        except OSError:
            return (None,)
        found: list[object] = [(top.st_dev, top.st_ino)]
        for name in files:
            try:
                info = os.stat(os.path.join(folder, name))
                found.append((info.st_ino, info.st_mtime_ns, info.st_size))
            except OSError:
                found.append(None)
        return tuple(found)

    def unsafe_entries(self, folder: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        root = os.path.realpath(folder)
        outside, special = [], []
        todo = [folder]
        while todo:
            current = todo.pop()
            try:
                entries = list(os.scandir(current))
            except OSError:
                continue
            for entry in entries:
                name = os.path.relpath(entry.path, folder)
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if not within(target, root):
                        outside.append((name, target))
                elif entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                    continue
                elif entry.is_file(follow_symlinks=False):
                    continue  # (from the listing itself: no system call per file)
                try:
                    mode = os.stat(entry.path).st_mode  # what the entry, or its link, is
                except OSError:
                    continue  # a dangling link: reading it says so
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    special.append((name, _kind(mode)))
        return sorted(outside), sorted(special)

    def walk_files(self, path: str) -> Iterator[str]:
        for folder, _, files in os.walk(path):
            for name in files:
                yield os.path.relpath(os.path.join(folder, name), path).replace(os.sep, "/")


def within(target: str, root: str) -> bool:
    """Whether the resolved path `target` lies in the resolved folder `root`, or in the
    blobs folder of the Hugging Face cache where `root` lies in a snapshot of it."""
    if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
        return True
    blobs = _cache_blobs(root)
    return bool(blobs and target.startswith(blobs + os.sep))


def _cache_blobs(root: str) -> str | None:
    """The blobs folder of the repository, where `root` lies in a snapshot of the
    Hugging Face cache (`.../models--ORG--NAME/snapshots/COMMIT/...`), whose files are
    the cache's links into it; None elsewhere."""
    parts = root.split(os.sep)
    for at in range(len(parts) - 2, 0, -1):
        if parts[at] == "snapshots" and parts[at - 1].startswith(_CACHE_REPOS):
            return os.sep.join([*parts[:at], "blobs"])
    return None


_CACHE_REPOS = ("models--", "datasets--", "spaces--")


def open_regular(path: str) -> int | None:
    """A descriptor of `path` open for reading, where it is a regular file; None where
    it does not exist or is a folder; else `CorruptCheckpointError` (see `open_file`)."""
    found = open_file(path)
    return None if found is None else found[0]


def open_file(path: str) -> tuple[int, os.stat_result] | None:
    """A descriptor of `path` open for reading and its `fstat`, where it is a regular
    file; None where it does not exist or is a folder; else `CorruptCheckpointError`.
    Opened non-blocking, so that a FIFO does not wait for a writer, and judged by
    `fstat` of the descriptor itself: what is read is what was checked, whatever the
    path is renamed to meanwhile (and `identities.FileIdentities` can tell which file
    it is)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as error:
        raise CorruptCheckpointError(
            f"{path} cannot be read ({error.strerror}); check its permissions"
        ) from None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode):
        return fd, info
    os.close(fd)
    if stat.S_ISDIR(info.st_mode):
        return None
    raise not_regular(path, info.st_mode)


def check_regular(paths: Iterable[str]) -> list[tuple[str, os.stat_result]]:
    """Refuse, as `open_regular` does, any of `paths` that exists and is no regular
    file or folder: for files that tensorstore opens itself, with a blocking `open`.
    Each one that exists, and its `stat`.

    `os.stat` (no open: a device is not touched) tells what the path is now; the
    caller checks just before tensorstore's read, whose `open` may still meet a FIFO
    put in place in between: see `Store.check_files` for that window."""
    found = []
    for path in paths:
        try:
            info = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # (tensorstore reads it as missing, or says what is wrong)
        except OSError as error:
            raise CorruptCheckpointError(
                f"{path} cannot be read ({error.strerror}); check its permissions"
            ) from None
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            raise not_regular(path, info.st_mode)
        found.append((path, info))
    return found


def not_regular(path: str, mode: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is not a regular file ({_kind(mode)}); a checkpoint's files are plain "
        "files: the checkpoint is damaged or hostile, refusing to read it"
    )


def check_size(path: str, size: int, limit: int) -> None:
    if size > limit:
        raise CorruptCheckpointError(
            f"{path} holds more than {limit} bytes, more than such a file can need; the "
            "checkpoint is damaged or hostile, refusing to read it"
        )


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"
