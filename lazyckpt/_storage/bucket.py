"""Checkpoint folders in object storage (`s3://bucket/prefix`, `gs://bucket/prefix`),
through tensorstore's `s3` and `gcs` kvstores, for `lazyckpt._storage.paths`.

A bucket has no folders, so a folder is a key prefix: its listing comes from one
recursive LIST of the prefix that a call (`open`, `steps`, `save`...) asks about
first, kept for the rest of that call (`session`), so that finding the checkpoint
under a manager root costs one request, not one per folder looked at.

Endpoint, region and credentials come from the usual environment variables
(`AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, `AWS_REGION` or `AWS_DEFAULT_REGION`,
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `GOOGLE_APPLICATION_CREDENTIALS`), or
from `storage_options` (`endpoint`, `region`, `retries`, or any tensorstore kvstore
option).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import numbers
import os
import secrets
from collections.abc import Iterator, Mapping
from typing import Any

from lazyckpt._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    LazyckptError,
    LazyTypeError,
    StorageAccessError,
)
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.local import check_size
from lazyckpt._storage.per_process import tensorstore_io
from lazyckpt._text import shown

SCHEMES = {"s3": "s3", "gs": "gcs"}
"""URL scheme: tensorstore kvstore driver."""

RETRIES = 6
"""Attempts at a failed storage request before it is an error, 0.25 s apart at first
and doubling up to 8 s: about 16 s when the service is down (tensorstore's own default
kept retrying for over ten minutes). `storage_options={"retries": n}` changes it."""

_OPTIONS: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "lazyckpt_storage_options", default=None
)
_LISTINGS: contextvars.ContextVar[dict[tuple[str, str, str], list[str]] | None]
_LISTINGS = contextvars.ContextVar("lazyckpt_listings", default=None)


@contextlib.contextmanager
def session(options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within: bucket listings are cached, and `options` apply to bucket paths."""
    if options and "retries" in options:
        _retries(options["retries"])  # (checked here: requests turn errors into their own)
    outer = _LISTINGS.get()
    listings = _LISTINGS.set({} if outer is None else outer)
    given = _OPTIONS.set(dict(options) if options else _OPTIONS.get())
    try:
        yield
    finally:
        _OPTIONS.reset(given)
        _LISTINGS.reset(listings)


def split(path: str) -> tuple[str, str, str]:
    """scheme, bucket, key prefix (no slashes at either end)."""
    scheme, rest = path.split("://", 1)
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def bucket_spec(path: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of the bucket that `path` is in (no path), its
    `storage_options` checked before any request (`_checked`)."""
    scheme, bucket, _ = split(path)
    options = dict(_OPTIONS.get() or {})
    _check_options(path, options)
    retries = _retries(options.pop("retries", RETRIES))
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
        context = options.get("context")
        named = "aws_credentials" in options or (
            isinstance(context, dict) and "aws_credentials" in context
        )
        keys = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
        if keys and not named:
            # The keys the default chain would take first; asked for alone, so that its
            # other providers (profile files, web identity) print no errors on stderr
            # where their files are absent, at every open. Credentials the caller names
            # (a profile, anonymous) are theirs to choose.
            spec["aws_credentials"] = {"type": "environment"}
    spec.update(options)
    return _checked(path, spec)


_OWN = {"s3": ("endpoint", "region", "retries"), "gs": ("retries",)}
"""The `storage_options` lazyckpt itself reads for a bucket; the others are members of
tensorstore's kvstore spec, passed on."""
_KVSTORE = {
    "s3": "aws_credentials, aws_region, requester_pays, host_header, context",
    "gs": "gcs_user_project, context",
}
"""For messages: the members of tensorstore's kvstore spec that a user may pass."""
_URL_MEMBERS = ("driver", "bucket", "path")
"""Members of the spec that the URL gives: an option would read another place."""


def _check_options(path: str, options: Mapping[str, Any]) -> None:
    """Refuse, before any request, what lazyckpt's own options cannot be, and the
    members that the URL names."""
    scheme = split(path)[0]
    wrong = sorted(str(key) for key in options if key in _URL_MEMBERS)
    if wrong:
        raise _refused(path, f"{wrong}, which the URL gives ({scheme}://BUCKET/PATH)")
    for key in ("endpoint", "region") if scheme == "s3" else ():
        value = options.get(key)
        if value is not None and not isinstance(value, str):
            raise _refused(path, f"{key}={shown(value)} (a str)")
    endpoint = options.get("endpoint")
    if isinstance(endpoint, str) and not endpoint.startswith(("http://", "https://")):
        raise _refused(path, f"endpoint={shown(endpoint)} (an http:// or https:// URL)")


def _checked(path: str, spec: dict[str, Any]) -> dict[str, Any]:
    """`spec`, which tensorstore parses (no request): a mistyped or ill-typed option is
    refused here, at once, not after the retries of the first request."""
    scheme, bucket, _ = split(path)
    try:
        ts.KvStore.Spec({"driver": spec["driver"], "bucket": bucket})
    except ValueError as error:
        raise CheckpointNotFoundError(
            f"{path}: {shown(bucket)} is not a bucket's name ({error}); check the URL "
            f"({scheme}://BUCKET/PATH)"
        ) from None
    try:
        ts.KvStore.Spec(spec)
    except ValueError as error:
        raise _refused(path, f"what tensorstore's spec refuses ({error})") from None
    return spec


def _refused(path: str, found: str) -> LazyTypeError:
    scheme = split(path)[0]
    return LazyTypeError(
        f"{path}: storage_options for {scheme}:// take {list(_OWN[scheme])} and "
        f"tensorstore's {SCHEMES[scheme]} kvstore options ({_KVSTORE[scheme]}), not "
        f"{found}; fix or remove that option"
    )


def _retries(value: object) -> int:
    if (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and 1 <= int(value) <= 100
    ):
        return int(value)
    raise LazyTypeError(
        "storage_options['retries'] takes the attempts at a storage request, an int from "
        f"1 to 100, not {shown(value)}; pass storage_options={{'retries': {RETRIES}}} or leave "
        "it out"
    )


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """Every key that starts with `prefix` (which ends with '/', or is empty)."""
    if not prefix:
        return ts.KvStore.KeyRange()
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


class BucketFolders:
    """`lazyckpt._storage.paths.Storage` for `s3://` and `gs://` URLs."""

    atomic_rename = False

    def join(self, path: str, name: str) -> str:
        return f"{path}/{name}"

    def basename(self, path: str) -> str:
        return path.rsplit("/", 1)[-1]

    def dirname(self, path: str) -> str:
        head = path.rsplit("/", 1)[0]
        return head if "://" in head and head.split("://", 1)[1] else path

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        _, _, key = split(path)
        return {**bucket_spec(path), "path": key + "/" if key else ""}

    def listdir(self, path: str) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self._keys(path) if k})

    def starting_with(self, prefix: str) -> list[str]:
        """One LIST of the keys that start with `prefix` (not of its whole folder)."""
        _, _, key = split(prefix)
        start = key.rsplit("/", 1)[-1]
        try:
            listed = _bucket(prefix).list(prefix_range(key)).result()
        except Exception as error:  # noqa: BLE001 - turned into a clear error
            raise storage_error(prefix, error) from None
        names = {k.decode()[len(key) - len(start) :].split("/", 1)[0] for k in listed}
        return sorted(n for n in names if n.startswith(start))

    def isdir(self, path: str) -> bool:
        return bool(self._keys(path))

    def isfile(self, path: str) -> bool:
        parent, name = self.dirname(path), self.basename(path)
        if parent == path:
            return False
        if self._cached(parent):
            return name in self._keys(parent)
        return self.read_bytes(path, 1 << 30) is not None  # one GET, not a LIST of the parent

    def exists(self, path: str) -> bool:
        return self.isdir(path) or self.isfile(path)

    def read_bytes(self, path: str, limit: int) -> bytes | None:
        _, _, key = split(path)
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
        check_size(path, len(result.value), limit)
        return bytes(result.value)

    def write_bytes(self, path: str, data: bytes) -> None:
        _, _, key = split(path)
        try:
            _bucket(path).write(key, data).result()
        except Exception as error:  # noqa: BLE001 - turned into a clear error
            raise storage_error(path, error) from None
        self._forget()

    def make_folder(self, path: str) -> None:
        """Nothing to do: a folder is a key prefix."""

    def delete_folder(self, path: str) -> None:
        _, _, key = split(path)
        prefix = f"{key}/" if key else ""
        try:
            # The commit marker first, alone: a crash part-way then leaves an unfinished
            # folder, never a "finished" one with files missing.
            _bucket(path).write(prefix + "commit_success.txt", None).result()
            _bucket(path).delete_range(prefix_range(prefix)).result()
        except Exception as error:  # noqa: BLE001 - turned into a clear error
            raise storage_error(path, error) from None
        self._forget()

    def delete_file(self, path: str) -> None:
        _, _, key = split(path)
        try:
            _bucket(path).write(key, None).result()  # one key: a delete
        except Exception as error:  # noqa: BLE001 - turned into a clear error
            raise storage_error(path, error) from None
        self._forget()

    def copy_file(self, source: str, target: str) -> None:
        """Through this process (tensorstore has no server-side copy): one object in
        memory at a time, as an upload of it holds it."""
        _, _, key = split(source)
        try:
            result = _bucket(source).read(key).result()
        except Exception as error:  # noqa: BLE001 - turned into a clear error
            raise storage_error(source, error) from None
        if result.state != "value":
            raise storage_error(source, FileNotFoundError(f"{source} vanished before its copy"))
        self.write_bytes(target, result.value)

    def probe_write(self, path: str) -> None:
        """One small object beside `path`, written and deleted: before an overwrite,
        which stages the new checkpoint beside the old one."""
        if not split(path)[2]:  # (`s3://BUCKET.lazyckpt-...` would be another bucket)
            raise CheckpointExistsError(
                f"{path}: the bucket's root holds a checkpoint, and an overwrite stages the "
                "new one beside the old, where a bucket's root has nothing; save to a folder "
                f"in the bucket ({path}/NAME), or delete the bucket's objects and save again"
            )
        probe = f"{path}.lazyckpt-write-probe-{secrets.token_hex(4)}"
        self.write_bytes(probe, b"probe")  # (not empty: an emulator refuses empty uploads)
        _, _, key = split(probe)
        try:
            _bucket(probe).write(key, None).result()  # one key: a delete, not a range
        except Exception as error:  # noqa: BLE001 - turned into a clear error
            raise storage_error(probe, error) from None

    def generation(self, folder: str, files: tuple[str, ...]) -> tuple[object, ...]:
        """The object generations of the first two `files` (`_METADATA` and the OCDBT
        manifest: two requests), which any rewrite of the checkpoint changes."""
        _, _, key = split(folder)
        out = []
        for name in files[:2]:
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

    def unsafe_entries(self, folder: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        return [], []  # objects are neither links nor devices

    def walk_files(self, path: str) -> Iterator[str]:
        yield from (k for k in self._keys(path) if k)

    def _keys(self, path: str) -> list[str]:
        """Every key under the folder `path`, relative to it, sorted (one LIST per
        call: later questions about folders inside it are answered from it)."""
        scheme, bucket, key = split(path)
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
            listed = _bucket(path).list(prefix_range(prefix)).result()
        except Exception as error:  # noqa: BLE001 - turned into a clear error below
            raise storage_error(path, error) from None
        # Filtered again here: some S3/GCS emulators ignore the listing's range.
        keys = sorted(k.decode()[len(prefix) :] for k in listed if k.decode().startswith(prefix))
        if cache is not None:
            cache[(scheme, bucket, prefix)] = keys
        return keys

    def _cached(self, path: str) -> bool:
        """Whether a listing of this call already covers `path`."""
        scheme, bucket, key = split(path)
        prefix = f"{key}/" if key else ""
        cache = _LISTINGS.get() or {}
        return any((s, b) == (scheme, bucket) and prefix.startswith(known) for s, b, known in cache)

    def _forget(self) -> None:
        """After a write or delete: the listings of this call are out of date."""
        cache = _LISTINGS.get()
        if cache is not None:
            cache.clear()


def _bucket(path: str) -> ts.KvStore:
    tensorstore_io(path)
    return ts.KvStore.open(bucket_spec(path)).result()


def storage_error(path: str, error: Exception) -> LazyckptError:
    """A clear error for a failed bucket request: which of the usual causes it is."""
    if isinstance(error, LazyckptError):
        return error  # (lazyckpt's own, about the path or its options)
    text = str(error)
    lowered = text.lower()
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered:
        return CheckpointNotFoundError(
            f"{path}: the bucket {split(path)[1]!r} does not exist (or is not reachable at "
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
