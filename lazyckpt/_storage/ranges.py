"""Range requests over HTTP(S), for `lazyckpt._storage.web`: the client, and the folders
whose files lazyckpt knows (`register`).

Reads are Range requests with the standard library's `http.client`, on lazyckpt's own
threads, one kept-alive connection per host and thread:

- A redirect is followed, and remembered per file (the Hub's `resolve/` answers with a
  signed URL at its CDN); the `Authorization` header goes only to the origin it was
  given for, never to the place a redirect leads. A remembered address that expires
  (401, 403, 410) is resolved again, once.
- 429 and 5xx answers, and connections that fail, are tried `RETRIES` times, backing
  off (`Retry-After` when the server gives one), then they are a `StorageAccessError`.
- A server that ignores Range (a 200 with the whole file) is refused: the connection
  is closed before the body is read, so no model is downloaded by accident.
- What a file holds (its size from `Content-Range`, its ETag) is pinned at its first
  answer in an open (`Pin`); an answer that disagrees later is a
  `CheckpointChangedError`, never a mix of two files.
- File names are quoted when asked for (a space, `?`, `#` or non-ASCII letter).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import posixpath
import threading
import time
import urllib.parse
from collections.abc import Iterator

import attrs

from lazyckpt._errors import CheckpointChangedError, CorruptCheckpointError, StorageAccessError
from lazyckpt._storage.metrics import count_direct, count_request

RETRIES = 5
"""Attempts at a request that fails for a reason that may pass (429, 5xx, a failed
connection), 0.25 s apart at first and doubling up to 4 s (about 4 s in all), or as
long as `Retry-After` asks, up to 8 s a wait."""
_REDIRECTS = 5
_TIMEOUT = 60.0
_EXPIRED = (401, 403, 410)  # a signed address that is no longer valid
SAFE = "/%:@!$&'()*+,;=~"
"""What a URL's path keeps unquoted (RFC 3986 `pchar`, `/`, and `%` of what the caller
quoted already); a space, `?`, `#` or non-ASCII letter in a file name is quoted."""


@attrs.frozen
class Site:
    """A folder that lazyckpt knows the files of."""

    names: tuple[str, ...]
    headers: dict[str, str] = attrs.field(factory=dict)
    """Headers of requests to the folder's own origin (`Authorization`)."""
    generation: tuple[object, ...] = ()
    """What identifies its contents (a Hub commit): pinned, never asked again."""
    describe: str = ""
    """How errors name it (`org/model at revision main (commit 1a2b...)`)."""


_SITES: dict[str, Site] = {}
_SITES_LOCK = threading.Lock()


def register(folder: str, site: Site) -> None:
    """Tell the storage which files `folder` holds, and how to ask for them."""
    with _SITES_LOCK:
        _SITES[folder.rstrip("/")] = site


def site(path: str) -> Site | None:
    """The registered folder that holds `path`, or is it."""
    folder = path.rstrip("/")
    with _SITES_LOCK:
        return _SITES.get(folder) or _SITES.get(posixpath.dirname(folder))


def hub_listed(folder: str) -> bool:
    """Whether `folder` was listed at a pinned revision (a Hub commit), which never
    changes; a folder probed over plain HTTP is probed again at each open."""
    with _SITES_LOCK:
        found = _SITES.get(folder.rstrip("/"))
    return found is not None and bool(found.generation)


def listing(folder: str) -> Site | None:
    """The registered folder `folder`, exactly."""
    with _SITES_LOCK:
        return _SITES.get(folder.rstrip("/"))


def describe(path: str) -> str:
    found = site(path)
    return f"{path} ({found.describe})" if found is not None and found.describe else path


@attrs.frozen
class Answer:
    """What a read returns, shaped as tensorstore's `KvStore.ReadResult`."""

    state: str
    """"value", or "missing" where the server has no such file."""
    value: bytes = b""
    size: int | None = None
    """The whole file's size, where the server said (`Content-Range`)."""


@attrs.define
class Pin:
    """A file's size and ETag as its first answer in one open gave them."""

    size: int | None = None
    etag: str | None = None


class Client:
    """Range requests over kept-alive connections, with redirects and retries. Where a
    file's URL redirects is remembered for the process (a redirect to a signed address
    that expires is resolved again); what a file holds is pinned per open (`Pin`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._locations: dict[str, str] = {}
        self._lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="lazyckpt-web")

    def read(
        self,
        url: str,
        start: int | None = None,
        stop: int | None = None,
        *,
        short: bool = False,
        pin: Pin | None = None,
    ) -> Answer:
        """The bytes `[start, stop)` of the file at `url` (the whole file without a
        range; with `short`, fewer where the file ends before `stop`), checked against
        `pin`; `Answer("missing")` where the server has none."""
        pin = pin if pin is not None else Pin()
        registered = site(url)
        headers = dict(registered.headers) if registered is not None else {}
        wanted = None
        if start is not None:
            if stop is not None and stop <= start:
                return Answer("value", b"", pin.size)
            wanted = (start, stop)
        with self._lock:
            known = self._locations.get(url)
        answer = self._fetch(url, known or url, headers, wanted, pin, short)
        if answer is None and known is not None:  # a signed address expired
            with self._lock:
                self._locations.pop(url, None)
            answer = self._fetch(url, url, headers, wanted, pin, short)
        if answer is None:
            raise StorageAccessError(
                f"{describe(url)}: access denied; for a gated or private Hugging Face "
                "repository, log in (`hf auth login`) or set HF_TOKEN to a token that "
                "was granted access"
            )
        return answer

    def _fetch(
        self,
        url: str,
        target: str,
        headers: dict[str, str],
        wanted: tuple[int, int | None] | None,
        pin: Pin,
        short: bool,
    ) -> Answer | None:
        """One read of `url` starting at `target`; None where access was refused."""
        origin = _origin(url)
        for _ in range(_REDIRECTS + 1):
            sent = {"Accept-Encoding": "identity", "User-Agent": "lazyckpt"}
            if _origin(target) == origin:
                sent.update(headers)
            if wanted is not None:
                low, high = wanted
                sent["Range"] = f"bytes={low}-{'' if high is None else high - 1}"
            status, answer_headers, body = self._request(url, target, sent)
            if status in (301, 302, 303, 307, 308):
                target = urllib.parse.urljoin(target, answer_headers.get("location", ""))
                continue
            if status == 404:
                return Answer("missing")
            if status in _EXPIRED:
                return None
            if status == 416:  # the range starts past the end: `bytes */SIZE`
                size = _total(url, answer_headers, body, status)
                self._check_pin(url, pin, size, answer_headers.get("etag"))
                if short:
                    return Answer("value", b"", size)
                raise ValueError(f"OUT_OF_RANGE: {describe(url)} holds {size} bytes")
            if wanted is not None and status == 200:
                raise StorageAccessError(
                    f"{describe(url)}: the server ignores Range requests (it answered with "
                    "the whole file); lazyckpt reads byte ranges only, so it will not "
                    "download the file whole: download it first, and open the copy"
                )
            if status not in (200, 206):
                raise StorageAccessError(
                    f"{describe(url)}: the server answered HTTP {status} "
                    f"({body[:120].decode('utf-8', 'replace')!r})"
                )
            size = _total(url, answer_headers, body, status)
            self._check_pin(url, pin, size, answer_headers.get("etag"))
            if target != url:
                with self._lock:
                    self._locations[url] = target
            if wanted is not None and status == 206:
                first = _first_byte(url, answer_headers)
                if first != wanted[0]:
                    raise ValueError(
                        f"OUT_OF_RANGE: {describe(url)} answered bytes from {first}, not "
                        f"{wanted[0]}"
                    )
                if not short and wanted[1] is not None and len(body) < wanted[1] - wanted[0]:
                    raise ValueError(
                        f"OUT_OF_RANGE: {describe(url)} holds {size} bytes, fewer than the "
                        f"{wanted[1]} needed"
                    )
            return Answer("value", body, size)
        raise StorageAccessError(f"{describe(url)}: more than {_REDIRECTS} redirects")

    def _check_pin(self, url: str, pin: Pin, size: int | None, etag: str | None) -> None:
        with self._lock:
            known = (pin.size, pin.etag)
            pin.size = pin.size if pin.size is not None else size
            pin.etag = pin.etag if pin.etag is not None else etag
        changed = (known[0] is not None and size is not None and size != known[0]) or (
            known[1] is not None and etag is not None and etag != known[1]
        )
        if changed:
            raise CheckpointChangedError(
                f"{describe(url)} changed since it was opened (size {known[0]} -> {size}, "
                f"ETag {known[1]} -> {etag}); open it again"
            )

    def _request(
        self, url: str, target: str, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        """GET `target`, tried again where the failure may pass. A kept-alive connection
        that the server closed meanwhile is replaced at once, without counting."""
        parts = urllib.parse.urlsplit(target)
        path = urllib.parse.quote(parts.path or "/", safe=SAFE)
        path += f"?{parts.query}" if parts.query else ""
        delay, last, attempt = 0.25, "", 0
        while attempt < RETRIES:
            reused = (parts.scheme, parts.netloc) in self._connections()
            try:
                with self._connection(target) as connection:
                    connection.request("GET", path, headers=headers)
                    response = connection.getresponse()
                    count_request()
                    answer_headers = {k.lower(): v for k, v in response.getheaders()}
                    status = response.status
                    if status == 200 and "Range" in headers:
                        connection.close()  # never the whole body of a file
                        return status, answer_headers, b""
                    body = response.read()
                    count_direct(len(body))
            except (http.client.InvalidURL, UnicodeError) as error:
                raise StorageAccessError(
                    f"{target}: not a URL lazyckpt can ask for ({error})"
                ) from None
            except (OSError, http.client.HTTPException) as error:
                stale = isinstance(
                    error, http.client.RemoteDisconnected | BrokenPipeError | ConnectionResetError
                )
                if reused and stale:
                    continue  # the server closed an idle connection: a new one, now
                last = f"{type(error).__name__}: {error}"
            else:
                if status not in (429, 500, 502, 503, 504):
                    return status, answer_headers, body
                last = f"HTTP {status}"
                after = answer_headers.get("retry-after", "")
                if after.isdigit():
                    delay = max(delay, min(float(after), 8.0))
            attempt += 1
            if attempt < RETRIES:
                time.sleep(delay)
                delay = min(2 * delay, 4.0)
        raise StorageAccessError(
            f"{describe(url)}: {_origin(target)} could not be reached or kept failing "
            f"({last}) after {RETRIES} attempts; check the network and the URL (for the Hub: "
            "HF_ENDPOINT)"
        )

    def _connections(self) -> dict[tuple[str, str], http.client.HTTPConnection]:
        """This thread's kept-alive connections, by scheme and host."""
        found: dict[tuple[str, str], http.client.HTTPConnection]
        found = self._local.__dict__.setdefault("connections", {})
        return found

    @contextlib.contextmanager
    def _connection(self, url: str) -> Iterator[http.client.HTTPConnection]:
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        connections = self._connections()
        connection = connections.get(key)
        if connection is None:
            kind = (
                http.client.HTTPSConnection
                if parts.scheme == "https"
                else http.client.HTTPConnection
            )
            connection = connections[key] = kind(parts.netloc, timeout=_TIMEOUT)
        try:
            yield connection
        except BaseException:
            connections.pop(key, None)
            connection.close()
            raise


_CLIENT: Client | None = None
_CLIENT_LOCK = threading.Lock()


def client() -> Client:
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            _CLIENT = Client()
        return _CLIENT


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc


def _total(url: str, headers: dict[str, str], body: bytes, status: int) -> int | None:
    """The file's size, from `Content-Range` (`bytes A-B/SIZE`, `bytes */SIZE`)."""
    if status in (206, 416):
        found = headers.get("content-range", "").rpartition("/")[2]
        return int(found) if found.isdigit() else None
    return len(body)


def _first_byte(url: str, headers: dict[str, str]) -> int:
    found = headers.get("content-range", "")
    try:
        return int(found.split()[1].split("-")[0])
    except (IndexError, ValueError):
        raise CorruptCheckpointError(
            f"{describe(url)}: the server answered a Range request with Content-Range "
            f"{found[:60]!r}"
        ) from None
