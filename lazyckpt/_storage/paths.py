"""Paths on local disk and in object storage, behind one small protocol.

Every checkpoint path is a local path, an `s3://bucket/prefix` or `gs://bucket/prefix`
URL, or an `https://` (or `http://`) URL, which an `hf://` path on the Hugging Face Hub
becomes (`lazyckpt._storage.http.hub`). What lazyckpt asks of storage is the `Storage`
protocol, which three backends implement: `LocalFolders` (`lazyckpt._storage.local`,
through `os`), `BucketFolders` (`lazyckpt._storage.bucket`, through tensorstore's
kvstores) and `WebFolders` (`lazyckpt._storage.http.web`, read-only, by the Range requests
of `lazyckpt._storage.http.range_reads`). The functions
here pick the backend by the path's scheme, in one place (`storage`), and validate
what is read at the boundary: metadata files are read only up to `METADATA_LIMIT`,
and text must be UTF-8.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from lazyckpt._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LazyckptError,
    StorageAccessError,
)
from lazyckpt._storage.bucket import SCHEMES, BucketFolders, bucket_spec
from lazyckpt._storage.bucket import session as _bucket_session
from lazyckpt._storage.bucket import split as bucket_split
from lazyckpt._storage.bucket import storage_error as bucket_error
from lazyckpt._storage.folders import hub_listed
from lazyckpt._storage.http import web_options
from lazyckpt._storage.http.relay import relayed, shown
from lazyckpt._storage.http.web import WebFolders
from lazyckpt._storage.local import LocalFolders

METADATA_LIMIT = 1 << 30
"""The largest metadata file (`_METADATA`, `_sharding`, `_strings.json`...) read: 1 GiB,
about five million leaves' worth; anything larger is damage, or hostile."""

GENERATION_FILES = ("_METADATA", "manifest.ocdbt", "_sharding", "_strings.json", "checkpoint")
"""The files whose identity makes a checkpoint's generation (see `generation`)."""


class Storage(Protocol):
    """What lazyckpt needs of a place that holds checkpoint folders."""

    atomic_rename: bool
    """Whether a folder renamed into place is published whole (local file systems).
    Where not (object storage), a save commits by writing `commit_success.txt` last,
    and only folders holding it are finished."""

    def join(self, path: str, name: str) -> str: ...
    def basename(self, path: str) -> str: ...
    def dirname(self, path: str) -> str: ...

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of the folder `path`."""
        ...

    def listdir(self, path: str) -> list[str]:
        """Names directly inside the folder `path`, sorted."""
        ...

    def starting_with(self, prefix: str) -> list[str]:
        """Names in the folder that holds `prefix` which start with its last part."""
        ...

    def isdir(self, path: str) -> bool: ...
    def isfile(self, path: str) -> bool: ...
    def exists(self, path: str) -> bool: ...

    def read_bytes(self, path: str, limit: int) -> bytes | None:
        """The file's contents, or None if it does not exist; more than `limit` bytes,
        or anything but a plain file, is a `CorruptCheckpointError`."""
        ...

    def write_bytes(self, path: str, data: bytes) -> None: ...

    def make_folder(self, path: str) -> None:
        """Make the folder `path` (and its parents) if it does not exist."""
        ...

    def delete_folder(self, path: str) -> None:
        """Delete the folder `path` and all it holds."""
        ...

    def delete_file(self, path: str) -> None:
        """Delete the file `path` if it exists."""
        ...

    def copy_file(self, source: str, target: str) -> None:
        """Copy the file `source` to `target` (replacing it)."""
        ...

    def probe_write(self, path: str) -> None:
        """Raise `StorageAccessError` unless files can be written beside `path`."""
        ...

    def generation(self, folder: str, files: tuple[str, ...]) -> tuple[object, ...]:
        """What identifies the folder's contents now: it changes when the folder is
        replaced or `files` in it are rewritten."""
        ...

    def unsafe_entries(self, folder: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """What under `folder` must not be read as it stands: `(path, target)` of each
        symlink that leads out of it, and `(path, kind)` of each entry that is no plain
        file or folder, itself or through a link (FIFOs block a read forever, devices
        never end), paths relative to `folder`; one walk for both."""
        ...

    def walk_files(self, path: str) -> Iterator[str]:
        """Paths of every file under the folder `path`, relative to it, with '/'."""
        ...


_LOCAL: Storage = LocalFolders()
_BUCKETS: Storage = BucketFolders()
_WEB: Storage = WebFolders()


def atomic_rename(path: str) -> bool:
    """Whether saves to `path` publish by renaming a folder into place (see `Storage`),
    or as a Hub commit does: whole, so a folder needs no commit marker to be finished."""
    return storage(path).atomic_rename or hub_listed(path)


def is_bucket(path: str) -> bool:
    return path.split("://", 1)[0] in SCHEMES if "://" in path else False


WEB_SCHEMES = ("http", "https")
"""The schemes of a folder read over HTTP (`lazyckpt._storage.http.web`)."""


def is_web(path: str) -> bool:
    return path.split("://", 1)[0] in WEB_SCHEMES if "://" in path else False


def storage_error(path: str, error: Exception) -> LazyckptError:
    """A clear error for a failed request to remote storage (lazyckpt's own errors,
    which HTTP reads raise, as they are, also through tensorstore's drivers)."""
    if isinstance(error, LazyckptError):
        return error
    found = relayed(error)
    if found is not None:
        return found
    if is_web(path):
        return StorageAccessError(
            f"{path}: reading it over HTTP failed ({shown(error)[:300]}); check the URL, "
            "and try again"
        )
    return bucket_error(path, error)


def read_failure(error: BaseException, damaged: Callable[[str], LazyckptError]) -> LazyckptError:
    """What a failed read through tensorstore is: lazyckpt's own error where it read
    the bytes over HTTP for tensorstore's drivers (the relay) and failed, else
    `damaged(text)`, with the error's text as a message may quote it (relay addresses
    shown as the folders they read, credentials hidden)."""
    found = relayed(error)
    return found if found is not None else damaged(shown(error))


def bucket_root(path: str) -> bool:
    """Whether `path` is a bucket's root (`s3://BUCKET`), beside which nothing lies."""
    return is_bucket(path) and not bucket_split(path)[2]


def is_remote(path: str) -> bool:
    """Whether `path` is not on a local disk: in a bucket, or over HTTP."""
    return is_bucket(path) or is_web(path)


def storage(path: str) -> Storage:
    """The backend that holds `path`."""
    if is_bucket(path):
        return _BUCKETS
    return _WEB if is_web(path) else _LOCAL


@contextlib.contextmanager
def session(options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within: bucket listings are cached, and `options` (`storage_options`) apply to
    bucket paths and, checked at `normalize`, to http(s):// URLs."""
    with _bucket_session(options), web_options.session(options):
        yield


def normalize(path: str | os.PathLike[str]) -> str:
    """An absolute local path, or a URL without trailing slashes; an `hf://` path
    becomes the place its files are read from, at the commit its revision names; an
    http(s):// URL its place, without the password and query string it may carry,
    which the call's requests send (`web_options.given`)."""
    text = os.fspath(path)
    if text.startswith("hf://"):
        from lazyckpt._storage.http import hub

        web_options.refuse_for(
            text, "an hf:// path is read with huggingface_hub's token: set HF_TOKEN, or log in"
        )
        return hub.resolve(text)
    if is_web(text):
        return web_options.given(text)  # without a password or query: never shown
    if is_bucket(text):
        web_options.refuse_for(
            text,
            "a bucket's credentials come from the environment (AWS_ACCESS_KEY_ID, "
            "GOOGLE_APPLICATION_CREDENTIALS) or its tensorstore kvstore options",
        )
        scheme, rest = text.split("://", 1)
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise CheckpointNotFoundError(
                f"{text}: the URL names no bucket ({scheme}://BUCKET/...)"
            )
        prefix = posixpath.normpath(prefix).lstrip("/") if prefix.strip("/") else ""
        if prefix == ".." or prefix.startswith("../"):
            raise CheckpointNotFoundError(
                f"{text}: '..' would leave the bucket {bucket!r}; write the path inside it"
            )
        found = f"{scheme}://{bucket}/{prefix}".rstrip("/") if prefix else f"{scheme}://{bucket}"
        bucket_spec(found)  # its bucket's name and the call's options checked, no request
        return found
    if "://" in text:
        raise CheckpointNotFoundError(
            f"{text}: lazyckpt reads local paths, s3://, gs://, hf:// and https:// URLs; "
            f"{text.split('://', 1)[0]}:// is not one of them"
        )
    return os.path.abspath(text)


def join(path: str, name: str) -> str:
    return storage(path).join(path, name)


def basename(path: str) -> str:
    return storage(path).basename(path)


def dirname(path: str) -> str:
    return storage(path).dirname(path)


def kvstore_spec(path: str) -> dict[str, Any]:
    return storage(path).kvstore_spec(path)


def listdir(path: str) -> list[str]:
    return storage(path).listdir(path)


def starting_with(prefix: str) -> list[str]:
    return storage(prefix).starting_with(prefix)


def isdir(path: str) -> bool:
    return storage(path).isdir(path)


def isfile(path: str) -> bool:
    return storage(path).isfile(path)


def exists(path: str) -> bool:
    return storage(path).exists(path)


def read_bytes(path: str, limit: int = METADATA_LIMIT) -> bytes | None:
    return storage(path).read_bytes(path, limit)


def read_text(path: str, limit: int = METADATA_LIMIT) -> str | None:
    """The file's text (UTF-8), or None if it does not exist; see `read_bytes`."""
    data = read_bytes(path, limit)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorruptCheckpointError(
            f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); the file is "
            "damaged, copy the checkpoint again"
        ) from None


def write_bytes(path: str, data: bytes) -> None:
    storage(path).write_bytes(path, data)


def make_folder(path: str) -> None:
    storage(path).make_folder(path)


def delete_folder(path: str) -> None:
    storage(path).delete_folder(path)


def delete_file(path: str) -> None:
    storage(path).delete_file(path)


def copy_file(source: str, target: str) -> None:
    storage(target).copy_file(source, target)


def probe_write(path: str) -> None:
    storage(path).probe_write(path)


def generation(folder: str, files: tuple[str, ...] = GENERATION_FILES) -> tuple[object, ...]:
    """What identifies the checkpoint in `folder` as it is now. It changes when the
    checkpoint is replaced (a save with overwrite=True) or its metadata (`files`)
    rewritten."""
    return storage(folder).generation(folder, files)


def unsafe_entries(folder: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    return storage(folder).unsafe_entries(folder)


def walk_files(path: str) -> Iterator[str]:
    return storage(path).walk_files(path)
