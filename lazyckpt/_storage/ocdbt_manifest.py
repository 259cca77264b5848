"""The manifest of an OCDBT database's newest version, read by lazyckpt before
tensorstore's driver reads it: whole, and no longer than it says it is.

tensorstore's driver reads a manifest whole, whatever its length. So lazyckpt reads
at most the length it holds (on disk, from `stat`) or that its header claims (in a
bucket, or over HTTP), up to `ocdbt_format.MAX_DECODED_BYTES`, and refuses by name one
that holds more or fewer bytes than that (`ocdbt_format.manifest` then checks its
contents): in a bucket, by reading its last byte and one past it as well; over HTTP,
from the size that the relay pinned at its first answer.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.ocdbt_format import MAX_DECODED_BYTES, FormatError, Manifest, manifest
from lazyckpt._text import shown

Sizes = Callable[[str], int | None]
"""The size of a file of the database, where the store that reads it knows it (over
HTTP: `WebFiles.size`, as the file's first answer said), else None."""


def newest(
    base: ts.KvStore, location: str, folder: str | None, sizes: Sizes | None = None
) -> Manifest | None:
    """The manifest of the newest version of the database in `base` (`location`, as
    errors name it; `folder`, its folder on this machine where it is local; `sizes`,
    the sizes of its files where its store knows them); None where there is none (an
    empty database, as the driver reads it)."""
    found = _decoded(base, location, folder, sizes, "manifest.ocdbt")
    if found is None or not found.numbered:
        return found
    # The versions are in numbered manifests: the driver reads the newest.
    listed = base.list(ts.KvStore.KeyRange(b"manifest.0", b"manifest.:")).result()
    numbers = [_generation(key[len(b"manifest.") :]) for key in listed]
    newest_number = max((n for n in numbers if n), default=0)
    if not newest_number:
        return None
    name = f"manifest.{newest_number:016x}"
    found = _decoded(base, location, folder, sizes, name)
    if found is not None and found.numbered:
        raise CorruptCheckpointError(_bad(location, name, "holds no versions"))
    return found


def _decoded(
    base: ts.KvStore, location: str, folder: str | None, sizes: Sizes | None, name: str
) -> Manifest | None:
    data = _read(base, location, folder, sizes, name)
    if data is None:
        return None
    try:
        return manifest(data)
    except FormatError as error:
        raise CorruptCheckpointError(_bad(location, name, str(error))) from None


def _read(
    base: ts.KvStore, location: str, folder: str | None, sizes: Sizes | None, name: str
) -> bytes | None:
    """The manifest `name`, where it holds (on disk) or claims (elsewhere) at most
    `MAX_DECODED_BYTES`, read by range up to that length, where it holds no more; None
    where it is missing."""
    if folder is not None:
        try:
            info = os.stat(os.path.join(folder, name))
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):  # (a FIFO would block the read forever)
            raise CorruptCheckpointError(_bad(location, name, "is no regular file"))
        size = info.st_size
    else:
        try:
            head = base.read(name, byte_range=slice(0, 12)).result()
        except ValueError as error:
            if "OUT_OF_RANGE" not in str(error):
                raise
            raise CorruptCheckpointError(
                _bad(location, name, "holds fewer than the 12 bytes of its header")
            ) from None
        if head.state != "value":
            return None
        size = int.from_bytes(head.value[4:12], "little")
    if size > MAX_DECODED_BYTES:
        says = "holds" if folder is not None else "says it holds"
        raise CorruptCheckpointError(
            _bad(location, name, f"{says} {size:,} bytes, more than lazyckpt reads")
        )
    claimed = "it held a moment before" if folder is not None else "its header says"
    known = None if folder is not None or sizes is None else sizes(name)
    if known is not None and known > size:
        raise CorruptCheckpointError(
            _bad(location, name, f"holds {known:,} bytes, more than the {size:,} {claimed}")
        )
    # (a shorter one whole, as on disk: `manifest` says how long it is)
    whole = base.read(name, byte_range=slice(0, size if known is None else min(size, known)))
    # (in a bucket, its last byte and one past it as well, since the driver reads the
    # whole object: there must be none past it; GCS answers a range that begins at the
    # end otherwise than one that goes past it)
    probe = folder is None and known is None
    past = base.read(name, byte_range=slice(max(size - 1, 0), size + 1)) if probe else None
    try:
        read = whole.result()
    except ValueError as error:
        if "OUT_OF_RANGE" not in str(error):
            raise
        raise CorruptCheckpointError(
            _bad(location, name, f"holds fewer than the {size:,} bytes {claimed}")
        ) from None
    if past is not None and _found(past):
        raise CorruptCheckpointError(
            _bad(location, name, f"holds more than the {size:,} bytes {claimed}")
        )
    return read.value if read.state == "value" else None


def _found(read: ts.Future[ts.KvStore.ReadResult]) -> bool:
    """Whether `read` found its bytes; not where they go past the end."""
    try:
        return read.result().state == "value"
    except ValueError as error:
        if "OUT_OF_RANGE" not in str(error):
            raise
        return False


def _bad(location: str, name: str, problem: str) -> str:
    return (
        f"{location}: the OCDBT database's manifest {shown(name)} {problem}; the "
        "checkpoint is damaged, or was made to harm its readers: copy it again from a "
        "source you trust"
    )


def _generation(name: bytes) -> int:
    """The generation a numbered manifest's name gives (16 hex digits), else 0."""
    text = name.decode("ascii", "replace")
    digits = "0123456789abcdefABCDEF"
    return int(text, 16) if len(text) == 16 and all(c in digits for c in text) else 0
