"""One HTTP GET, bounded in time and in memory, tried again where the failure may pass:
the transport under `lazyckpt._storage.http.range_reads`.

The standard library's `http.client` on lazyckpt's own threads, one kept-alive
connection per host and thread, with what it lacks added here:

- **A deadline for the whole answer.** A socket timeout restarts with every byte, so
  a server that sends one a second would hold a read forever. Every receive here
  waits at most until the request's deadline: `timeout` for the answer to begin, plus
  its body's size at `min_rate` (`lazyckpt._storage.network`).
- **Bodies bounded as they stream.** A body larger than the caller's limit (a range's
  length, or a limit for the kind of file read whole) is refused from its
  `Content-Length` before anything is allocated, or as soon as a chunked body passes
  it; an error's body is read up to a few KiB only.
- **Retries with a bound.** 429, 5xx, failed connections and missed deadlines are
  tried `retries` times in all, backing off (or as `Retry-After` asks); a burst of
  reads stops at the first that fails for good (`network.Stop`).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from lazyckpt import _display
from lazyckpt._errors import LazyckptError, StorageAccessError
from lazyckpt._storage import network
from lazyckpt._storage.metrics import count_direct, count_request

RETRIED = (429, 500, 502, 503, 504)
_ERROR_BODY = 4096
"""Bytes of an error's, or a redirect's, body read (for its message); a longer one is
left unread and its connection closed."""
_PIECE = 1 << 20
"""Bytes asked of a body of unknown length at a time."""
SAFE = "/%:@!$&'()*+,;=~"
"""What a URL's path keeps unquoted (RFC 3986 `pchar`, `/`, and `%` of what the caller
quoted already); a space, `?`, `#` or non-ASCII letter in a file name is quoted."""


class Scatter:
    """Buffers that one body fills in turn, with no copy: a range of a file whose parts
    belong in different places (the stored bytes of several arrays, each in its own
    result). Sliced as a memoryview is, by byte."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = tuple(views)

    def __len__(self) -> int:
        return sum(len(view) for view in self.views)

    def __getitem__(self, span: slice) -> Scatter:
        start, stop, _ = span.indices(len(self))
        cut, at = [], 0
        for view in self.views:
            low, high = max(start - at, 0), min(stop - at, len(view))
            if low < high:
                cut.append(view[low:high])
            at += len(view)
        return Scatter(cut)


Into = memoryview | Scatter
"""What a body may be read straight into: one buffer, or several in turn."""


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    """Lower-case names."""
    body: bytes | bytearray | memoryview
    """A view of the caller's buffer where the body was read into one; empty where it
    was read into a `Scatter` of buffers."""
    scattered: int = 0
    """The bytes of the body read into a `Scatter`."""

    @property
    def received(self) -> int:
        """The bytes of the body."""
        return len(self.body) + self.scattered


@attrs.define
class _Clock:
    """A request's deadline: `timeout` for its answer to begin, and its body's
    `expected` bytes at `min_rate` after that."""

    start: float
    timeout: float
    min_rate: float
    expected: int = 0

    def allowed(self) -> float:
        """Seconds the request may take, as things stand."""
        return self.timeout + self.expected / self.min_rate

    def left(self) -> float:
        return self.start + self.allowed() - time.monotonic()


class Late(TimeoutError):
    """A request missed its deadline of `allowed` seconds."""

    def __init__(self, allowed: float) -> None:
        super().__init__(f"no complete answer within {allowed:.3g} s")
        self.allowed = allowed


class _TimedRaw(io.RawIOBase):
    """A socket's receives (through the socket's own `makefile`, which keeps the socket
    open for the answer's body after the connection lets go of it, as for an answer
    that closes the connection), each waiting no later than the request's deadline."""

    def __init__(self, sock: socket.socket, clock: _Clock) -> None:
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._clock = clock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._clock.left()
        if left <= 0:
            raise Late(self._clock.allowed())
        self._sock.settimeout(min(left, self._clock.timeout))
        try:
            count = self._raw.readinto(buffer)
        except TimeoutError:
            raise Late(self._clock.allowed()) from None
        if count is None:  # (a socket with a timeout never answers "would block")
            raise Late(self._clock.allowed())
        return count

    def close(self) -> None:
        self._raw.close()
        super().close()


class _TimedSocket:
    """What `http.client.HTTPResponse` asks of a socket (`makefile`), through `_TimedRaw`."""

    def __init__(self, sock: socket.socket, clock: _Clock) -> None:
        self._sock = sock
        self._clock = clock

    def makefile(self, mode: str, *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_TimedRaw(self._sock, self._clock), 1 << 16)


_INTERIM_LINES = 100


class _Response(http.client.HTTPResponse):
    """An answer read through `_TimedRaw`, past every interim (1xx) answer before it:
    `http.client` skips `100 Continue` only, and would take `103 Early Hints` for the
    answer, leaving the real one to be read as the next request's."""

    def __init__(self, sock: socket.socket, *args: Any, clock: _Clock, **kwargs: Any) -> None:
        super().__init__(_TimedSocket(sock, clock), *args, **kwargs)  # type: ignore[arg-type]

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 < status < 200 or status == 101:
                return version, status, reason
            for _ in range(_INTERIM_LINES):  # its headers, skipped
                if self.fp.readline(1 << 16) in (b"\r\n", b"\n", b""):
                    break
            else:
                raise http.client.HTTPException("an interim answer with too many headers")


def _timed(clock: _Clock) -> Callable[..., http.client.HTTPResponse]:
    def response(sock: socket.socket, *args: Any, **kwargs: Any) -> http.client.HTTPResponse:
        return _Response(sock, *args, clock=clock, **kwargs)

    return response


class _Refused(Exception):
    """A body over its limit: `found` bytes declared, or None where it streamed past."""

    def __init__(self, found: int | None) -> None:
        self.found = found


class _Connections:
    """One thread's kept-alive connections, closed when the thread ends (a pool of
    threads replaced when `NetworkOptions.connections` changes)."""

    def __init__(self) -> None:
        self.by_origin: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def __del__(self) -> None:
        for connection in self.by_origin.values():
            connection.close()


class Transport:
    """GETs over kept-alive connections, one per host and thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(
        self,
        url: str,
        target: str,
        headers: dict[str, str],
        *,
        limit: int,
        ranged: bool,
        too_large: Callable[[int | None], LazyckptError],
        stop: network.Stop | None = None,
        ticket: int = 0,
        into: Into | None = None,
    ) -> Response:
        """GET `target` (for the file `url`, as errors name it), its body at most
        `limit` bytes (`too_large(declared size)` is raised past it). A 200 to a
        `ranged` request comes back without its body, never read. A 206's body is
        read straight `into` the caller's buffer where one is given (of `limit`
        bytes), with no copy."""
        parts = urllib.parse.urlsplit(target)
        path = urllib.parse.quote(parts.path or "/", safe=SAFE)
        path += f"?{parts.query}" if parts.query else ""
        queries = (parts.query,)  # (hidden wherever an error quotes it)
        options = network.options()
        delay, last, attempt = network.FIRST_DELAY, "", 0
        limited: str | None = None  # the last answer's Retry-After, where it was a 429
        while attempt < options.retries:
            if stop is not None:
                stop.check(ticket, url)
            reused = (parts.scheme, host(parts)) in self._connections()
            try:
                with self._connection(target, options.timeout) as connection:
                    answer = self._once(connection, path, headers, options, limit, ranged, into)
            except _Refused as refused:
                raise too_large(refused.found) from None
            except ssl.SSLCertVerificationError as error:  # (definite: never retried)
                found = said(str(error.verify_message or error.reason), queries=queries)
                raise StorageAccessError(
                    f"{url}: the TLS certificate of {host(parts)} could not be verified "
                    f"({found}); where the server's CA is a private one, point SSL_CERT_FILE "
                    "at its certificate"
                ) from None
            except (http.client.InvalidURL, UnicodeError, ValueError) as error:
                # Named by `url`, not by `target`: a redirect's (a signed CDN address)
                # is never shown, nor a query string that `error` quotes (by its repr).
                raise StorageAccessError(
                    f"{url}: its address, or one it was redirected to, is not a URL "
                    f"lazyckpt can ask for ({said(str(error), queries=queries)})"
                ) from None
            except Late as late:
                last = (
                    f"no complete answer within {late.allowed:.3g} s, its deadline "
                    f"({options.timeout:g} s, and the body at {options.min_rate} bytes/s)"
                )
            except (OSError, http.client.HTTPException) as error:
                stale = isinstance(
                    error, http.client.RemoteDisconnected | BrokenPipeError | ConnectionResetError
                )
                if reused and stale:
                    continue  # the server closed an idle connection: a new one, now
                last = f"{type(error).__name__}: {said(str(error), queries=queries)}"
            else:
                if answer.status not in RETRIED:
                    return answer
                last = f"HTTP {answer.status}"
                limited = answer.headers.get("retry-after", "") if answer.status == 429 else None
                wait = network.retry_after(answer.headers.get("retry-after"))
                if wait is not None:
                    delay = max(delay, wait)
            attempt += 1
            if attempt < options.retries:
                if stop is not None:
                    stop.sleep(ticket, delay)
                else:
                    time.sleep(delay)
                delay = min(2 * delay, network.MAX_DELAY)
        if last.startswith("HTTP") and limited is not None:
            failed = _rate_limited(url, parts, limited, options.retries)
            failed.gave_up = True  # type: ignore[attr-defined]
            raise failed
        failed = StorageAccessError(
            f"{url}: {parts.scheme}://{host(parts)} could not be reached or kept failing "
            f"({last}) after {options.retries} attempts; check the network and the URL (for "
            "the Hub: HF_ENDPOINT), or allow more with lazyckpt.network_options(timeout=, "
            "retries=)"
        )
        failed.gave_up = True  # type: ignore[attr-defined]  # (what stops a burst: network.Stop)
        raise failed

    def _once(
        self,
        connection: http.client.HTTPConnection,
        path: str,
        headers: dict[str, str],
        options: network.NetworkOptions,
        limit: int,
        ranged: bool,
        into: Into | None,
    ) -> Response:
        clock = _Clock(time.monotonic(), options.timeout, options.min_rate)
        if connection.sock is not None:
            connection.sock.settimeout(options.timeout)
        connection.timeout = options.timeout
        connection.response_class = _timed(clock)  # type: ignore[assignment]
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        count_request()
        status = response.status
        found = {k.lower(): v for k, v in response.getheaders()}
        if status == 200 and ranged:
            connection.close()  # never the whole body of a file
            return Response(status, found, b"")
        wanted = status in (200, 206)
        length = response.length
        body: bytearray | memoryview | Scatter | None
        if status == 206 and into is not None:
            body = _body_into(response, into, clock)
        else:
            body = _body(response, limit if wanted else _ERROR_BODY, clock)
        if body is None:  # over the limit: its declared length, or what streamed past
            connection.close()
            if wanted:
                raise _Refused(length if length is not None and length > limit else None)
        else:
            response.close()  # read whole: the connection takes the next request
        count_direct(0 if body is None else len(body))
        if isinstance(body, Scatter):
            return Response(status, found, b"", len(body))
        return Response(status, found, b"" if body is None else body)

    def _connections(self) -> dict[tuple[str, str], http.client.HTTPConnection]:
        """This thread's kept-alive connections, by scheme and host."""
        held: _Connections = self._local.__dict__.setdefault("connections", _Connections())
        return held.by_origin

    @contextlib.contextmanager
    def _connection(self, url: str, timeout: float) -> Iterator[http.client.HTTPConnection]:
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, host(parts))
        connections = self._connections()
        connection = connections.get(key)
        if connection is None:
            kind = (
                http.client.HTTPSConnection
                if parts.scheme == "https"
                else http.client.HTTPConnection
            )
            connection = connections[key] = kind(key[1], timeout=timeout)
        try:
            yield connection
        except BaseException:
            connections.pop(key, None)
            connection.close()
            raise


def _rate_limited(
    url: str, parts: urllib.parse.SplitResult, after: str, attempts: int
) -> StorageAccessError:
    """A server that answered 429 to the last of `attempts`, asking (`Retry-After`,
    where `after` is not empty) to wait."""
    wait = network.retry_after(after)
    asked = ""
    if after:
        asked = f", asking to wait {said(after, 40, queries=(parts.query,))} (Retry-After"
        capped = wait is not None and wait >= network.MAX_RETRY_AFTER
        asked += f"; lazyckpt waits {network.MAX_RETRY_AFTER:g} s at most)" if capped else ")"
    return StorageAccessError(
        f"{url}: {parts.scheme}://{host(parts)} rate-limited the requests (HTTP 429 Too "
        f"Many Requests) {attempts} times{asked}; wait and try again, read with fewer "
        "connections or allow more attempts (lazyckpt.network_options(connections=, "
        "retries=)); on the Hugging Face Hub, set HF_TOKEN (or `hf auth login`): signed-in "
        "users have higher rate limits"
    )


def said(text: str, limit: int = 200, *, queries: tuple[str, ...] = ()) -> str:
    r"""What a server sent (a status line, a header, a body, or an error that quotes
    them or a URL), for a message: the credentials it may quote hidden (those of
    `lazyckpt._display.hide`, and `queries`, the query strings of the addresses
    asked: `_display.scrubbed`), then its first `limit` characters quoted, with control
    characters escaped as `repr` escapes them (a NUL, an ESC that would retitle the
    terminal, a CR/LF that would forge a line), and '@' too, which the URL scrubber of
    `lazyckpt._display` would take for the end of a password, hiding the host before it.

    >>> print(said("EVIL\x1b[2J @evil.example\r\n"))
    'EVIL\x1b[2J \x40evil.example\r\n'
    >>> print(said("400: GET /x.bin?sig=5ec2e7a9 HTTP/1.1", queries=("sig=5ec2e7a9",)))
    '400: GET /x.bin?... HTTP/1.1'
    """
    return repr(_display.scrubbed(text, *queries)[:limit]).replace("@", "\\x40")


def host(parts: urllib.parse.SplitResult) -> str:
    """The host and port of a URL, without the user name and password it may carry
    (up to the last '@', as the URL standard reads it): what is connected to."""
    return parts.netloc.rpartition("@")[2]


def split_url(url: str) -> urllib.parse.SplitResult:
    """`url`'s parts; `ValueError` where it is no URL (a bad IPv6 host, or port)."""
    parts = urllib.parse.urlsplit(url)
    parts.port  # noqa: B018 - raises on a malformed port
    return parts


def origin(url: str) -> tuple[str, str]:
    """`(scheme, host)` of a URL, which must be one (its host and port, without a
    user name and password)."""
    try:
        parts = split_url(url)
    except ValueError as error:
        raise StorageAccessError(
            f"{_display.url_shown(url)[:200]}: not a URL lazyckpt can ask for ({said(str(error))})"
        ) from None
    return parts.scheme, host(parts)


def _body(response: http.client.HTTPResponse, limit: int, clock: _Clock) -> bytearray | None:
    """The body, at most `limit` bytes; None where there is more (the rest unread).
    Its buffer grows as bytes arrive, never ahead of them by more than it holds (a
    server that declares 100 MiB and sends a byte a second gets 1 MiB); its deadline
    grows with its size: declared, or as it streams."""
    length = response.length
    if length is not None and length > limit:
        return None
    total = length if length is not None else limit + 1
    body = bytearray(min(total, _PIECE))
    got = 0
    while got < total:
        if got == len(body):
            body.extend(bytes(min(len(body), total - got)))  # (doubling: as bytes arrived)
        clock.expected = length if length is not None else len(body)
        with memoryview(body) as view:
            count = response.readinto(view[got:])
        if count == 0:
            break
        got += count
    if length is not None and got < length:
        raise http.client.IncompleteRead(b"", length - got)
    if got > limit:
        return None
    del body[got:]
    return body


def _body_into(response: http.client.HTTPResponse, into: Into, clock: _Clock) -> Into | None:
    """The body read straight into `into`, the part of it that the body filled; None
    where the body holds more than `into` (the rest unread)."""
    length = response.length
    size = len(into)
    if length is not None and length > size:
        return None
    total = length if length is not None else size
    clock.expected = total
    got = 0
    for view in into.views if isinstance(into, Scatter) else (into,):
        end = min(len(view), total - got)
        filled = 0
        while filled < end:
            count = response.readinto(view[filled:end])
            if count == 0:
                break
            filled += count
        got += filled
        if filled < end or got == total:
            break
    if length is not None and got < length:
        raise http.client.IncompleteRead(b"", length - got)
    if length is None and got == size and response.read(1):
        return None  # a chunked body longer than asked for
    return into[:got]
