"""Range requests over HTTP(S), for `lazyckpt._storage.http.web`: the client of the folders
whose files lazyckpt knows (`lazyckpt._storage.folders`). Each request goes out through
`lazyckpt._storage.http.transport`, bounded in time and memory; here are the rules of what
an answer must be:

- A redirect is followed to http(s) only, and remembered per file (the Hub's
  `resolve/` answers with a signed URL at its CDN); the `Authorization` header goes
  only to the origin it was given for. A remembered address that expires (401, 403,
  410) is resolved again, once, and so is a Hub file's address at its CDN, remembered
  or just given, that refuses it; so is one that answers 404 for a file the Hub lists
  at the pinned commit, which cannot have gone: a 404 there again is a missing object.
- A server that ignores Range (a 200 with the whole file) is refused: the connection
  is closed before the body is read, so no model is downloaded by accident. A 206
  must hold exactly the bytes asked for, or the file's end, as stored (no
  `Content-Encoding`): the rules of `lazyckpt._storage.http.answers`.
- What a file holds (its size, ETag and Last-Modified date) is pinned at its first
  answer in an open (`Pin`). Later requests ask the server to check it (`If-Match`,
  `If-Unmodified-Since`), and an answer that disagrees, a 412, or a 404 for a file
  that was there is a `CheckpointChangedError`, never a mix of two versions. A file at
  a plain URL whose server says neither its ETag nor its date is refused, or read
  with a warning (`NetworkOptions.unversioned`); the Hub's are pinned by commit, and
  each must say it is that commit's, before its bytes are used (`answers.from_commit`).
- File names are quoted when asked for (a space, `?`, `#` or non-ASCII letter). A
  pre-signed file's query string goes with each request for it (`Pin.query`), and no
  error shows it: they name the file by its URL without it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

import attrs

from lazyckpt._errors import LazyckptError, StorageAccessError, TooLargeError
from lazyckpt._storage import network
from lazyckpt._storage.folders import describe, site
from lazyckpt._storage.futures import RangeAnswer
from lazyckpt._storage.http import answers
from lazyckpt._storage.http.transport import SAFE as SAFE
from lazyckpt._storage.http.transport import Into, Response, Transport, host, said
from lazyckpt._storage.http.transport import origin as _origin
from lazyckpt._storage.http.transport import split_url as _split
from lazyckpt._storage.per_process import PerProcess

T = TypeVar("T")

_REDIRECTS = 5
_THREADS = "lazyckpt-web"
_EXPIRED = (401, 403, 410)  # a signed address that is no longer valid
WHOLE_LIMIT = 64 << 20
"""The most bytes of a file read whole (no range) where the caller names no limit of
its own for its kind of file."""


@attrs.frozen
class _Refused:
    """`Client._fetch`'s answer where there is no value: access refused (401, 403,
    410), or a 404 for a file the Hub lists at the pinned commit (which cannot have
    gone); `at` is the address that answered so."""

    status: int
    at: str


@attrs.define
class Pin:
    """What one open knows of a file: its size, ETag and Last-Modified date at its first answer."""

    size: int | None = None
    etag: str | None = None
    modified: str | None = None
    seen: bool = False
    """Whether the file answered once: a 404 afterwards means it was deleted."""
    location: str | None = None
    """Where the file's URL redirected to, for a plain URL: asked again at each open
    (a Hub file's, at a pinned commit, is remembered for the process)."""
    headers: dict[str, str] = attrs.field(factory=dict)
    """The open's own (a plain URL's `storage_options`), sent to the file's origin only."""
    query: str = attrs.field(default="", repr=False)
    """The query string the open's URL of the file carried (a pre-signed file's
    signature): sent with each request for it, never shown."""

    def address(self, url: str) -> str:
        """What is asked for first for the file at `url`: with its query string."""
        return f"{url}?{self.query}" if self.query else url

    def conditions(self) -> dict[str, str]:
        """Headers that make the server refuse (412) where the file changed since."""
        found = {}
        if self.etag is not None and not self.etag.startswith("W/"):
            found["If-Match"] = self.etag  # (a weak ETag never matches If-Match)
        if self.modified is not None:
            found["If-Unmodified-Since"] = self.modified
        return found


class Client:
    """Range requests with redirects, pins and the rules of what an answer must be.
    Where a Hub file's URL redirects is remembered for the process (a redirect to a
    signed address that expires is resolved again), a plain URL's for an open; what a
    file holds is pinned per open. Each origin has its own threads (`pool`), so that a
    server that stalls holds up no other server's reads."""

    def __init__(self) -> None:
        self._transport = Transport()
        self._locations: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, str], tuple[int, concurrent.futures.ThreadPoolExecutor]] = {}

    def submit(
        self, url: str, fn: Callable[..., T], *args: object, **kwargs: object
    ) -> concurrent.futures.Future[T]:
        """Run `fn` on the threads that read from `url`'s origin: up to `connections`
        at once (`NetworkOptions`; a change of it takes effect at the origin's next
        read, while what the old threads run still finishes)."""
        origin = _origin(url)
        connections = network.options().connections
        with self._lock:  # (never submitted to a pool another thread shut down)
            size, found = self._pools.get(origin, (0, None))
            if found is None or size != connections:
                if found is not None:
                    found.shutdown(wait=False)
                found = concurrent.futures.ThreadPoolExecutor(
                    connections, thread_name_prefix=_THREADS
                )
                self._pools[origin] = (connections, found)
            return found.submit(fn, *args, **kwargs)

    def read(
        self,
        url: str,
        start: int | None = None,
        stop: int | None = None,
        *,
        short: bool = False,
        pin: Pin | None = None,
        limit: int = WHOLE_LIMIT,
        halt: network.Stop | None = None,
        ticket: int = 0,
        into: Into | None = None,
    ) -> RangeAnswer:
        """The bytes `[start, stop)` of the file at `url` (the whole file, up to
        `limit` bytes, without a range; with `short`, fewer where the file ends before
        `stop`), checked against `pin`; `RangeAnswer("missing")` where the server has none.
        `halt` stops the read where another of its burst failed for good. With
        `into` (a buffer of `stop - start` bytes, or a `Scatter` of buffers that add up
        to them), the bytes are read straight into it and the answer's value is a view
        of it (empty for a `Scatter`)."""
        _origin(url)
        if not threading.current_thread().name.startswith(_THREADS):
            # On the pool's threads, whose kept-alive connections live as long as it
            # does (a caller's thread that ends would drop its connections unclosed).
            return self.submit(
                url,
                self.read,
                url,
                start,
                stop,
                short=short,
                pin=pin,
                limit=limit,
                halt=halt,
                ticket=ticket,
                into=into,
            ).result()
        pin = pin if pin is not None else Pin()
        registered = site(url)
        headers = {**(registered.headers if registered is not None else {}), **pin.headers}
        wanted = None
        if start is not None:
            if stop is not None and stop <= start:
                return RangeAnswer("value", b"", pin.size)
            wanted = (start, stop)
            if stop is not None:
                limit = stop - start
        if into is not None and (wanted is None or wanted[1] is None or len(into) != limit):
            raise ValueError(f"a buffer of {len(into)} bytes for bytes {start} to {stop}")
        hub = registered is not None and bool(registered.generation)
        with self._lock:
            known = self._locations.get(url) if hub else pin.location
        ask = _Ask(url, headers, wanted, limit, short, pin, halt, ticket, into)
        answer = self._fetch(ask, known or pin.address(url))
        # A remembered address that expired or lost the file, or the Hub's CDN (another
        # origin, which gets no token) that refused the address the Hub just gave:
        # asked of the URL again, once.
        elsewhere = isinstance(answer, _Refused) and _origin(answer.at) != _origin(url)
        again = isinstance(answer, _Refused) and (known is not None or (hub and elsewhere))
        if again:
            with self._lock:
                self._locations.pop(url, None)
                pin.location = None
            answer = self._fetch(ask, pin.address(url))
        if isinstance(answer, RangeAnswer):
            return answer
        if answer.status == 404:
            raise answers.lost(url, again=again)
        if hub and _origin(answer.at) != _origin(url):
            raise answers.refused_elsewhere(url, answer.status, answer.at)
        if hub:
            raise StorageAccessError(
                f"{describe(url)}: access denied; for a gated or private Hugging Face "
                "repository, log in (`hf auth login`) or set HF_TOKEN to a token that "
                "was granted access"
            )
        if pin.query:
            raise StorageAccessError(
                f"{describe(url)}: access denied (HTTP 401, 403 or 410) to the URL with "
                "its query string; a pre-signed URL's signature may have expired: sign "
                "the file's URL again, and open the new one"
            )
        raise StorageAccessError(
            f"{describe(url)}: access denied (HTTP 401, 403 or 410); check the URL, "
            "or pass credentials: storage_options={'token': ...} or {'headers': {...}}"
        )

    def get(self, url: str, headers: dict[str, str], *, limit: int, named: str) -> Response:
        """A GET of an API (the Hub's repository info), its answer whatever its status,
        its body at most `limit` bytes; redirects followed to http(s), `headers` only
        to `url`'s origin. `named` is how errors name it."""
        if not threading.current_thread().name.startswith(_THREADS):
            return self.submit(url, self.get, url, headers, limit=limit, named=named).result()
        target = url
        for _ in range(_REDIRECTS + 1):
            sent = {"Accept": "application/json", "User-Agent": "lazyckpt"}
            if _origin(target) == _origin(url):
                sent.update(headers)

            def too_large(declared: int | None) -> LazyckptError:
                holds = f"more than {limit}" if declared is None else f"{declared}"
                return TooLargeError(
                    f"{named}: the answer holds {holds} bytes, over the {limit} lazyckpt "
                    "reads of it (a broken or hostile server)"
                )

            answer = self._transport.get(
                named, target, sent, limit=limit, ranged=False, too_large=too_large
            )
            if answer.status not in (301, 302, 303, 307, 308):
                return answer
            target = _redirect(named, target, answer.headers.get("location", ""))
        raise StorageAccessError(f"{named}: more than {_REDIRECTS} redirects")

    def _fetch(self, ask: _Ask, target: str) -> RangeAnswer | _Refused:
        """One read starting at `target`, following its redirects."""
        url, pin = ask.url, ask.pin
        origin = _origin(url)
        registered = site(url)
        versioned = registered is None or not registered.generation  # a Hub commit is pinned
        # A Hub file's answers must say they are its commit's (`answers.from_commit`):
        # one at least before its bytes are used; an address the Hub gave was vouched
        # for when it was given.
        commit = None if registered is None or versioned else str(registered.generation[0])
        blob = registered.blobs.get(_name(url)) if registered is not None else None
        vouched = commit is None or target != url
        for _ in range(_REDIRECTS + 1):
            sent = {"Accept-Encoding": "identity", "User-Agent": "lazyckpt"}
            if _origin(target) == origin:
                sent.update(ask.headers)
            if versioned:
                sent.update(pin.conditions())
            if ask.wanted is not None:
                low, high = ask.wanted
                sent["Range"] = f"bytes={low}-{'' if high is None else high - 1}"
            answer = self._transport.get(
                describe(url),
                target,
                sent,
                limit=ask.limit,
                ranged=ask.wanted is not None,
                too_large=ask.too_large,
                stop=ask.halt,
                ticket=ask.ticket,
                into=ask.into,
            )
            status, found = answer.status, answer.headers
            if commit is not None:
                vouched = answers.from_commit(url, commit, blob, found) or vouched
            if status in (301, 302, 303, 307, 308):
                target = _redirect(url, target, found.get("location", ""))
                continue
            if status == 404:
                if not versioned and registered is not None and not registered.lacks(_name(url)):
                    return _Refused(404, target)  # (listed at a pinned commit)
                if pin.seen:
                    raise answers.changed(url, "it is gone (HTTP 404)")
                return RangeAnswer("missing")
            if status == 412:  # what `Pin.conditions` asked the server to check
                raise answers.changed(url, "the server says so (HTTP 412 Precondition Failed)")
            if status in _EXPIRED:
                return _Refused(status, target)
            if status == 304:  # (to no If-None-Match: lazyckpt sends none)
                raise answers.not_modified(url)
            if status == 416:  # the range starts past the end: `bytes */SIZE`
                size = answers.unsatisfied(found)
                self._check_pin(url, pin, size, found, versioned, validators=False)
                low = ask.wanted[0] if ask.wanted is not None else 0
                if size is not None and low < size:
                    raise StorageAccessError(
                        f"{describe(url)}: the server refused bytes {low} on as out of range "
                        f"(HTTP 416), yet says the file holds {size} bytes; it does not serve "
                        "byte ranges correctly: download the file, and open the copy"
                    )
                if ask.short:
                    return RangeAnswer("value", b"", size)
                raise answers.truncated(url, size, ask.wanted)
            if ask.wanted is not None and status == 200:
                raise StorageAccessError(
                    f"{describe(url)}: the server ignores Range requests (it answered with "
                    "the whole file); lazyckpt reads byte ranges only, so it will not "
                    "download the file whole: download it first, and open the copy"
                )
            if status not in (200, 206):
                # (Its body whole, a few KiB at most: a secret it quotes is hidden before
                # it is cut short, never left in part.)
                body = bytes(answer.body).decode("utf-8", "replace")
                raise StorageAccessError(
                    f"{describe(url)}: the server answered HTTP {status} "
                    f"({said(body, 120, queries=(urllib.parse.urlsplit(target).query,))})"
                )
            if not vouched:
                raise answers.unvouched(url, str(commit))
            answers.check_identity(url, found, ranged=ask.wanted is not None)
            size = (
                len(answer.body)
                if status == 200
                else answers.checked_range(url, ask.wanted, ask.short, answer)
            )
            # (A `bytes a-b/*` answer says nothing of the size: the pin's, where known.)
            size = self._check_pin(url, pin, size, found, versioned, sized=size is not None)
            if target != pin.address(url):
                with self._lock:
                    if versioned:
                        pin.location = target
                    else:
                        self._locations[url] = target
            return RangeAnswer("value", answer.body, size)
        raise StorageAccessError(f"{describe(url)}: more than {_REDIRECTS} redirects")

    def _check_pin(
        self,
        url: str,
        pin: Pin,
        size: int | None,
        found: dict[str, str],
        versioned: bool,
        *,
        validators: bool = True,
        sized: bool = True,
    ) -> int | None:
        """Pin the file's size and validators at its first answer; a later answer
        must agree. A validator the first answer gave and a later one drops, or the
        other way, is a change too: another server, or another version. (A 416,
        `validators=False`, says the size alone; a 206 of `bytes a-b/*`, `sized=False`,
        says no size, and the answer has the pin's, where an earlier one said it.)"""
        etag, modified = found.get("etag"), found.get("last-modified")
        with self._lock:
            first = not pin.seen
            if first:
                pin.seen = True
                pin.size, pin.etag, pin.modified = size, etag, modified
            known = (pin.size, pin.etag, pin.modified)
            if pin.size is None:
                pin.size = size  # (a `bytes a-b/*` answer first: the size, once said)
            pinned = pin.size
        if first:
            if versioned and etag is None and modified is None:
                answers.unversioned(url)
            return pinned
        news = (size if sized else known[0], etag, modified)
        news = news if validators else (size, *known[1:])
        for what, before, now in zip(("size", "ETag", "Last-Modified"), known, news, strict=True):
            if before != now and (before is not None or what != "size"):
                said_now = "the answer gave none" if now is None else f"now {_told(now)}"
                raise answers.changed(url, f"its {what} was {_told(before)}, {said_now}")
        return pinned


def _name(url: str) -> str:
    """The name of the file at `url` in its folder, as listed."""
    return urllib.parse.unquote(url.rsplit("/", 1)[-1])


def _told(value: int | str | None) -> str:
    """A size as it is; a validator as the server sent it, quoted (`said`)."""
    return said(value, 80) if isinstance(value, str) else str(value)


@attrs.frozen
class _Ask:
    """What one read asks for, through its redirects."""

    url: str
    headers: dict[str, str]
    wanted: tuple[int, int | None] | None
    limit: int
    short: bool
    pin: Pin
    halt: network.Stop | None
    ticket: int
    into: Into | None = None

    def too_large(self, declared: int | None) -> LazyckptError:
        if self.wanted is not None:
            return StorageAccessError(
                f"{describe(self.url)}: the server answered "
                f"{'more' if declared is None else declared} bytes to a request for "
                f"{self.limit}; it does not serve byte ranges correctly, so lazyckpt cannot "
                "read this file from it: download it, and open the copy"
            )
        holds = f"more than {self.limit}" if declared is None else f"{declared}"
        return TooLargeError(
            f"{describe(self.url)} holds {holds} bytes, over the {self.limit} lazyckpt "
            "reads of such a file; it is not the file it should be (a broken or hostile "
            "server), so it was not read"
        )


def _redirect(url: str, target: str, location: str) -> str:
    """Where a redirect leads: http(s) only. Errors hide the query strings of both
    addresses (the one asked, and a signed one the server gave)."""
    queries = (urllib.parse.urlsplit(target).query, location.partition("#")[0].partition("?")[2])
    try:
        found = urllib.parse.urljoin(target, location)
        parts = _split(found)
    except ValueError as error:
        raise StorageAccessError(
            f"{describe(url)}: the server redirected to {said(location, 120, queries=queries)}, "
            f"which is not a URL ({said(str(error), queries=queries)})"
        ) from None
    if parts.scheme not in ("http", "https") or not host(parts):
        raise StorageAccessError(
            f"{describe(url)}: the server redirected to {said(location, 120, queries=queries)}; "
            "lazyckpt follows redirects to http:// and https:// URLs only"
        )
    return found


_CLIENT = PerProcess(Client)


def client() -> Client:
    return _CLIENT.get()
