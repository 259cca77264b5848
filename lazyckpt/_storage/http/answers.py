"""What an answer to one of `lazyckpt._storage.http.range_reads`' requests must hold, and the
errors that name, for the file asked for, what it held instead and what to do.

- A 206's `Content-Range` must hold exactly the bytes asked for (or those up to the
  file's end); its complete length may be `*` (RFC 9110: not known to the server),
  which says nothing of the file's size, so no change of it.
- Its body must be the file's bytes as stored: lazyckpt asks for `identity`, so a
  `Content-Encoding` (a proxy that compressed it) is refused, never read as the file's.
- A 304 answers a conditional request lazyckpt never makes (`If-None-Match`): a cache
  between here and the server answered for it.
- A Hub file's answer must say that it is from the commit the open resolved
  (`X-Repo-Commit`), and name the blob that the commit's listing gave: the Hub
  resolves a branch or tag named as a commit before the commit itself, so anyone who
  can push one would otherwise serve another commit's files for it.
"""

from __future__ import annotations

import re

from lazyckpt._errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageAccessError,
    UnversionedWarning,
    warn,
)
from lazyckpt._storage import network
from lazyckpt._storage.folders import describe
from lazyckpt._storage.http.transport import Response, host, said, split_url

_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)", re.ASCII)
_UNSATISFIED = re.compile(r"bytes \*/([0-9]{1,19})", re.ASCII)
_ETAG = re.compile(r'(?:w/)?"?([0-9a-f]{40}|[0-9a-f]{64})"?', re.ASCII)
"""A Hub file's ETag: its blob, quoted, weak or not (as `huggingface_hub` reads it)."""
_COMPRESSIONS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress"})
"""The content codings that change the bytes sent (RFC 9110 and IANA's registry);
other values (`identity`, or the `none` and `UTF-8` that some stores set by mistake)
leave them as stored."""


def checked_range(
    url: str, wanted: tuple[int, int | None] | None, short: bool, answer: Response
) -> int | None:
    """The file's size from a 206's `Content-Range` (None where it says `*`), which
    must hold the bytes `wanted` (or those up to the file's end, where `short`) and
    agree with the body."""
    body = answer.received
    text = answer.headers.get("content-range", "")
    match = _CONTENT_RANGE.fullmatch(text.strip())
    if match is None:
        raise StorageAccessError(
            f"{describe(url)}: the server answered a Range request with Content-Range "
            f"{said(text, 60)}; lazyckpt needs `bytes FIRST-LAST/SIZE`"
        )
    first, last = int(match[1]), int(match[2])
    size = None if match[3] == "*" else int(match[3])
    if size is not None and last >= size:
        raise StorageAccessError(
            f"{describe(url)}: the server answered with Content-Range {said(text, 60)}, which "
            "ends past the file's size; it does not serve byte ranges correctly"
        )
    low, high = wanted or (0, None)
    if first != low or last - first + 1 != body:
        raise StorageAccessError(
            f"{describe(url)}: asked for bytes {low} to {high}, the server answered "
            f"bytes {first} to {last + 1} ({body} bytes of body); it does not serve "
            "byte ranges correctly: download the file, and open the copy"
        )
    if high is not None and body < high - low:
        if size is not None and last + 1 < size:
            raise StorageAccessError(
                f"{describe(url)}: asked for bytes {low} to {high}, the server answered "
                f"only to {last + 1} of {size}; try again, or download the file"
            )
        if not short:
            raise truncated(url, size, wanted)
    return size


def check_identity(url: str, found: dict[str, str], *, ranged: bool) -> None:
    """Refuse a body that is not the file's bytes as stored: encoded (gzip, br...)
    on its way, though lazyckpt asked for `Accept-Encoding: identity`."""
    encoding = found.get("content-encoding", "").strip().lower()
    codings = {coding.strip() for coding in encoding.split(",")}
    if codings.isdisjoint(_COMPRESSIONS):  # (`identity`, or a value that names none)
        return
    asked = "a Range request" if ranged else "a request"
    raise StorageAccessError(
        f"{describe(url)}: the server answered {asked} for the file's bytes as stored "
        f"(Accept-Encoding: identity) with Content-Encoding {said(encoding, 40)}: the bytes "
        "sent are compressed, not the file's, so they were not used. A proxy or the "
        "server compressed them: turn that off for this file (or read it without the "
        "proxy), or download the file and open the copy"
    )


def not_modified(url: str) -> StorageAccessError:
    return StorageAccessError(
        f"{describe(url)}: the server answered HTTP 304 Not Modified, which answers only "
        "a request that asks whether a copy is still current (If-None-Match, "
        "If-Modified-Since); lazyckpt asked for the file's bytes, never that. A caching "
        "proxy between here and the server answered for it: read the file without the "
        "proxy, or download the file and open the copy"
    )


def unsatisfied(found: dict[str, str]) -> int | None:
    """The file's size from a 416's `Content-Range: bytes */SIZE`, if it says it."""
    match = _UNSATISFIED.fullmatch(found.get("content-range", "").strip())
    return int(match[1]) if match else None


def truncated(url: str, size: int | None, wanted: tuple[int, int | None] | None) -> Exception:
    return CorruptCheckpointError(
        f"{describe(url)} holds {size if size is not None else 'fewer'} bytes, fewer than "
        f"the {wanted[1] if wanted else '?'} needed (bytes {wanted[0] if wanted else 0} on); "
        "the file is truncated, or shorter than its header says: download it again"
    )


def lost(url: str, *, again: bool) -> CheckpointNotFoundError:
    asked = " (again at the address the Hub then gave afresh)" if again else ""
    return CheckpointNotFoundError(
        f"{describe(url)}: the Hub lists this file at the commit, but its server answered "
        f"HTTP 404{asked}: the file's stored object is missing there. Try again later; if "
        "it stays missing, tell the repository's owners, or download it from elsewhere"
    )


def refused_elsewhere(url: str, status: int, at: str) -> StorageAccessError:
    """A Hub file whose `resolve/` URL the Hub redirected (so access was granted), and
    whose server there refused the address the Hub gave, twice."""
    try:
        where = f"{split_url(at).scheme}://{host(split_url(at))}"
    except ValueError:
        where = "the server it redirected to"
    return StorageAccessError(
        f"{describe(url)}: the Hub redirected to the file's address at {where}, which "
        f"refused it (HTTP {status}), again at the address the Hub then gave afresh; a "
        "firewall or proxy that lets the Hub through may block that host: allow it, or "
        "download the file elsewhere (huggingface_hub's hf_hub_download) and open the copy"
    )


def changed(url: str, why: str) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"{describe(url)} changed since it was opened ({why}); what was read would mix "
        "two versions: open it again"
    )


def unversioned(url: str) -> None:
    message = (
        f"{describe(url)}: the server gives neither an ETag nor a Last-Modified date, so "
        "a change to the file between two reads could not be detected"
    )
    if network.options().unversioned == "refuse":
        raise StorageAccessError(
            f"{message}; serve it with either header, or read it anyway with "
            "lazyckpt.network_options(unversioned='warn')"
        )
    warn(f"{message}; read anyway (network_options(unversioned='warn'))", UnversionedWarning)


def from_commit(url: str, commit: str, blob: str | None, found: dict[str, str]) -> bool:
    """Whether an answer (its headers, `found`) for a Hub file listed at `commit` says
    which commit it is from (`X-Repo-Commit`, which the Hub sends with every file and
    `huggingface_hub` reads). Refused where that is another commit (a branch or tag
    named as the commit, which the Hub resolves first), or where the file's blob
    (`X-Linked-Etag`, else `ETag`) is not `blob`, the one the commit's listing gave."""
    answered = found.get("x-repo-commit")
    if answered is None:
        return False
    if answered.strip().lower() != commit:
        raise CheckpointChangedError(
            f"{describe(url)}: the Hub answered for the file with commit {said(answered, 80)} "
            f"(X-Repo-Commit), not {commit}, the commit the open resolved: a branch or tag "
            f"named {commit} shadows that commit (the Hub resolves a branch or tag before a "
            "commit of the same name), so nothing of that answer was used. Ask the "
            "repository's owners to rename or delete that branch or tag; until then, this "
            "commit cannot be read from the Hub"
        )
    etag = found.get("x-linked-etag") or found.get("etag") or ""
    tag = _ETAG.fullmatch(etag.strip().lower())
    if blob is not None and tag is not None and len(tag[1]) == len(blob) and tag[1] != blob:
        raise CheckpointChangedError(
            f"{describe(url)}: the Hub answered for the file with blob {tag[1]} "
            f"(X-Linked-Etag or ETag), but the listing of commit {commit[:12]} that the open "
            f"read gives {blob}: not the file listed, so nothing of that answer was used. "
            "Open it again; if this persists, check HF_ENDPOINT (a mirror or proxy that "
            "serves other files)"
        )
    return True


def unvouched(url: str, commit: str) -> StorageAccessError:
    """A Hub file's answer that never said which commit it is from (`from_commit`)."""
    return StorageAccessError(
        f"{describe(url)}: the answer does not say which commit it is from (no X-Repo-Commit "
        f"header, which the Hub sends with every file), so lazyckpt cannot tell that it is "
        f"the file of commit {commit[:12]}, and did not use it; check HF_ENDPOINT (a mirror "
        "or proxy that drops the Hub's headers)"
    )
