"""Paths on local disk and in object storage (`s3://bucket/prefix`, `gs://bucket/prefix`).

Local paths go to `os`; bucket paths to tensorstore's `s3` and `gcs` kvstores. A bucket
has no folders, so a folder is a key prefix: its listing comes from one recursive
LIST of the prefix that a call (`open`, `steps`, `save`...) asks about first, kept
for the rest of that call (`session`), so that finding the checkpoint under a
manager root costs one request, not one per folder looked at.

Endpoint, region and credentials come from the usual environment variables
(`AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, `AWS_REGION` or `AWS_DEFAULT_REGION`,
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `GOOGLE_APPLICATION_CREDENTIALS`), or
from `storage_options` (`endpoint`, `region`, or any tensorstore kvstore option).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import os
import posixpath
import secrets
import stat
from collections.abc import Iterator, Mapping
from typing import Any

import tensorstore as ts

from lazyckpt._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LazyckptError,
    StorageAccessError,
)

SCHEMES = {"s3": "s3", "gs": "gcs"}


_OPTIONS: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "lazyckpt_storage_options", default=None
)
_LISTINGS: contextvars.ContextVar[dict[tuple[str, str, str], list[str]] | None]
_LISTINGS = contextvars.ContextVar("lazyckpt_listings", default=None)


@contextlib.contextmanager
def session(options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within: bucket listings are cached, and `options` apply to bucket paths."""
    outer = _LISTINGS.get()
    listings = _LISTINGS.set({} if outer is None else outer)
    given = _OPTIONS.set(dict(options) if options else _OPTIONS.get())
    try:
        yield
    finally:
        _OPTIONS.reset(given)
        _LISTINGS.reset(listings)


def is_remote(path: str) -> bool:
    return path.split("://", 1)[0] in SCHEMES if "://" in path else False


def normalize(path: str | os.PathLike[str]) -> str:
    """An absolute local path, or a bucket URL without trailing slashes."""
    text = os.fspath(path)
    if is_remote(text):
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
        return f"{scheme}://{bucket}/{prefix}".rstrip("/") if prefix else f"{scheme}://{bucket}"
    if "://" in text:
        raise CheckpointNotFoundError(
            f"{text}: lazyckpt reads local paths, s3:// and gs:// URLs; "
            f"{text.split('://', 1)[0]}:// is not one of them"
        )
    return os.path.abspath(text)


def join(path: str, name: str) -> str:
    return f"{path}/{name}" if is_remote(path) else os.path.join(path, name)


def basename(path: str) -> str:
    return path.rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path)


def dirname(path: str) -> str:
    if is_remote(path):
        head = path.rsplit("/", 1)[0]
        return head if "://" in head and head.split("://", 1)[1] else path
    return os.path.dirname(path)


def _split(path: str) -> tuple[str, str, str]:
    """scheme, bucket, key prefix (no slashes at either end)."""
    scheme, rest = path.split("://", 1)
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


RETRIES = 6
"""Attempts at a failed storage request before it is an error, 0.25 s apart at first
and doubling up to 8 s: about 16 s when the service is down (tensorstore's own default
kept retrying for over ten minutes). `storage_options={"retries": n}` changes it."""


def bucket_spec(path: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of the bucket that `path` is in (no path)."""
    scheme, bucket, _ = _split(path)
    options = dict(_OPTIONS.get() or {})
    retries = int(options.pop("retries", RETRIES))
    spec: dict[str, Any] = {
        "driver": SCHEMES[scheme],
        "bucket": bucket,
        "context": {
            f"{SCHEMES[scheme]}_request_retries": {
                "max_retries": max(1, retries),
                "initial_delay": "0.25s",
                "max_delay": "8s",
            }
        },
    }
    if scheme == "s3":
        endpoint = options.pop("endpoint", None) or os.environ.get(
            "AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL")
        )
        region = options.pop("region", None) or os.environ.get(
            "AWS_REGION", os.environ.get("AWS_DEFAULT_REGION")
        )
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
    spec.update(options)
    return spec


def kvstore_spec(path: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of the folder `path` (trailing slash)."""
    if not is_remote(path):
        return {"driver": "file", "path": path + "/"}
    _, _, key = _split(path)
    return {**bucket_spec(path), "path": key + "/" if key else ""}


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """Every key that starts with `prefix` (which ends with '/', or is empty)."""
    if not prefix:
        return ts.KvStore.KeyRange()
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _bucket(path: str) -> ts.KvStore:
    return ts.KvStore.open(bucket_spec(path)).result()


def _keys(path: str) -> list[str]:
    """Every key under the folder `path`, relative to it, sorted (one LIST per call:
    later questions about folders inside it are answered from the same listing)."""
    scheme, bucket, key = _split(path)
    prefix = f"{key}/" if key else ""
    cache = _LISTINGS.get()
    if cache is not None:
        for (known_scheme, known_bucket, known), keys in cache.items():
            if (known_scheme, known_bucket) != (scheme, bucket) or not prefix.startswith(known):
                continue
            inner = prefix[len(known) :]
            if not inner:
                return keys
            start = bisect.bisect_left(keys, inner)
            stop = bisect.bisect_left(keys, inner[:-1] + chr(ord(inner[-1]) + 1))
            return [k[len(inner) :] for k in keys[start:stop]]
    try:
        listed = _bucket(path).list(_prefix_range(prefix)).result()
    except Exception as error:  # noqa: BLE001 - turned into a clear error below
        raise storage_error(path, error) from None
    # Filtered again here: some S3/GCS emulators ignore the listing's range.
    keys = sorted(k.decode()[len(prefix) :] for k in listed if k.decode().startswith(prefix))
    if cache is not None:
        cache[(scheme, bucket, prefix)] = keys
    return keys


def _cached(path: str) -> bool:
    """Whether a listing of this call already covers `path`."""
    scheme, bucket, key = _split(path)
    prefix = f"{key}/" if key else ""
    cache = _LISTINGS.get() or {}
    return any((s, b) == (scheme, bucket) and prefix.startswith(known) for s, b, known in cache)


def storage_error(path: str, error: Exception) -> LazyckptError:
    """A clear error for a failed bucket request: which of the usual causes it is."""
    text = str(error)
    lowered = text.lower()
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered:
        return CheckpointNotFoundError(
            f"{path}: the bucket {_split(path)[1]!r} does not exist (or is not reachable at "
            "this endpoint); check the URL and AWS_ENDPOINT_URL / storage_options"
        )
    if "credential" in lowered or "signature" in lowered or "invalidaccesskeyid" in lowered:
        return StorageAccessError(
            f"{path}: the storage service rejected the credentials ({text[:200]}); set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or GOOGLE_APPLICATION_CREDENTIALS)"
        )
    denied = "accessdenied" in lowered or "access denied" in lowered or "permission" in lowered
    if denied and not _has_credentials():
        return StorageAccessError(
            f"{path}: access denied, and no credentials were found ({text[:120]}); set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
            "GOOGLE_APPLICATION_CREDENTIALS for gs://"
        )
    if denied or "forbidden" in lowered:
        return StorageAccessError(
            f"{path}: access denied ({text[:200]}); the credentials lack permission for "
            "this bucket or prefix"
        )
    if (
        "could not connect" in lowered
        or "couldn't connect" in lowered
        or "retry attempts" in lowered
    ):
        return StorageAccessError(
            f"{path}: the storage service could not be reached ({text[:200]}); check the "
            "endpoint (AWS_ENDPOINT_URL, storage_options['endpoint']) and that the service "
            "is up; storage_options={'retries': n} sets how often lazyckpt tries"
        )
    return LazyckptError(f"{path}: the storage request failed ({text[:300]})")


def _has_credentials() -> bool:
    names = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE")
    if any(os.environ.get(name) for name in names) or os.environ.get(
        "GOOGLE_APPLICATION_CREDENTIALS"
    ):
        return True
    home = os.path.expanduser("~")
    return os.path.exists(os.path.join(home, ".aws", "credentials"))


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file (an object, in a bucket)."""
    if not is_remote(path):
        with open(path, "wb") as f:
            f.write(data)
        return
    _, _, key = _split(path)
    try:
        _bucket(path).write(key, data).result()
    except Exception as error:  # noqa: BLE001 - turned into a clear error
        raise storage_error(path, error) from None


def probe_write(path: str) -> None:
    """That objects can be written beside the bucket folder `path`: one small object,
    written and deleted; the storage's error (StorageAccessError) if not."""
    probe = f"{path}.lazyckpt-write-probe-{secrets.token_hex(4)}"
    write_bytes(probe, b"")
    _, _, key = _split(probe)
    try:
        _bucket(probe).delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    except Exception as error:  # noqa: BLE001 - turned into a clear error
        raise storage_error(probe, error) from None


def delete_folder(path: str) -> None:
    """Delete every object under the bucket folder `path`."""
    _, _, key = _split(path)
    prefix = f"{key}/" if key else ""
    try:
        # The commit marker first, alone: a crash part-way then leaves an unfinished
        # folder, never a "finished" one with files missing.
        marker = prefix + "commit_success.txt"
        _bucket(path).delete_range(ts.KvStore.KeyRange(marker, marker + "\0")).result()
        _bucket(path).delete_range(_prefix_range(prefix)).result()
    except Exception as error:  # noqa: BLE001 - turned into a clear error
        raise storage_error(path, error) from None
    cache = _LISTINGS.get()
    if cache is not None:
        cache.clear()


def listdir(path: str) -> list[str]:
    """Names directly inside the folder `path`, sorted."""
    if not is_remote(path):
        return sorted(os.listdir(path))
    return sorted({k.split("/", 1)[0] for k in _keys(path) if k})


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    return bool(_keys(path))


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    return isdir(path) or isfile(path)


def isfile(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    parent, name = dirname(path), basename(path)
    if parent == path:
        return False
    if _cached(parent):
        return name in _keys(parent)
    return read_bytes(path) is not None  # one GET, rather than listing the parent


METADATA_LIMIT = 1 << 30
"""The largest metadata file (`_METADATA`, `_sharding`, `_strings.json`...) read: 1 GiB,
about five million leaves' worth; anything larger is damage, or hostile."""


def read_bytes(path: str, limit: int = METADATA_LIMIT) -> bytes | None:
    """The file's contents, or None if it does not exist.

    Only regular files are read (a link to /dev/zero or a FIFO in a checkpoint is
    refused, never read or waited on), and only up to `limit` bytes.
    """
    if not is_remote(path):
        try:
            # Non-blocking, so that opening a FIFO does not wait for a writer.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as error:
            raise CorruptCheckpointError(
                f"{path} cannot be read ({error.strerror}); check its permissions"
            ) from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                return None
            if not stat.S_ISREG(info.st_mode):
                raise CorruptCheckpointError(
                    f"{path} is not a regular file ({_kind(info.st_mode)}); a checkpoint's "
                    "files are plain files: the checkpoint is damaged or hostile, refusing "
                    "to read it"
                )
            _check_size(path, info.st_size, limit)
            data = f.read(info.st_size + 1)  # (read asks for its size up front: not limit)
            _check_size(path, len(data), limit)
            return data
    _, _, key = _split(path)
    try:
        result = _bucket(path).read(key, byte_range=slice(0, limit + 1)).result()
    except ValueError as error:
        if "OUT_OF_RANGE" not in str(error):
            raise storage_error(path, error) from None
        result = _bucket(path).read(key).result()  # shorter than the range: all of it
    except Exception as error:  # noqa: BLE001 - turned into a clear error
        raise storage_error(path, error) from None
    if result.state != "value":
        return None
    _check_size(path, len(result.value), limit)
    return result.value


def _check_size(path: str, size: int, limit: int) -> None:
    if size > limit:
        raise CorruptCheckpointError(
            f"{path} is {size} bytes, more than the {limit} such a file can need; the "
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


_GENERATION_FILES = ("_METADATA", "manifest.ocdbt", "_sharding", "_strings.json", "checkpoint")


def generation(folder: str) -> tuple[Any, ...]:
    """What identifies the checkpoint in `folder` as it is now. It changes when the
    checkpoint is replaced (a save with overwrite=True renames a new folder into
    place) or its metadata is rewritten: on a local disk, the folder's inode and its
    metadata files' inodes, times and sizes (a few stats); in a bucket, the object
    generation of `_METADATA` and the OCDBT manifest (two requests)."""
    if is_remote(folder):
        _, _, key = _split(folder)
        out = []
        for name in _GENERATION_FILES[:2]:
            try:
                result = (
                    _bucket(folder)
                    .read(f"{key}/{name}" if key else name, byte_range=slice(0, 0))
                    .result()
                )
            except Exception as error:  # noqa: BLE001 - turned into a clear error
                raise storage_error(folder, error) from None
            out.append((result.state, result.stamp.generation))
        return tuple(out)
    try:
        top = os.stat(folder)
    except OSError:
        return (None,)
    found: list[Any] = [(top.st_dev, top.st_ino)]
    for name in _GENERATION_FILES:
        try:
            info = os.stat(os.path.join(folder, name))
            found.append((info.st_ino, info.st_mtime_ns, info.st_size))
        except OSError:
            found.append(None)
    return tuple(found)


def links_outside(folder: str) -> list[tuple[str, str]]:
    """Symlinks under the local `folder` that resolve outside it, as (link, target)
    pairs (no links are followed while looking)."""
    if is_remote(folder):
        return []
    root = os.path.realpath(folder)
    found = []
    todo = [folder]
    while todo:
        current = todo.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if target != root and not target.startswith(root + os.sep):
                    found.append((os.path.relpath(entry.path, folder), target))
            elif entry.is_dir(follow_symlinks=False):
                todo.append(entry.path)
    return sorted(found)


def walk_files(path: str) -> Iterator[str]:
    """Relative paths of every file under the folder `path`."""
    if is_remote(path):
        yield from (k for k in _keys(path) if k)
        return
    for folder, _, files in os.walk(path):
        for name in files:
            yield os.path.relpath(os.path.join(folder, name), path).replace(os.sep, "/")
