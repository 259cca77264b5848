"""A misbehaving HTTP server on 127.0.0.1, for tests/test_network.py: plain files with
Range support, and per file a trick that breaks the rules (an endless body, one byte
a second, a range longer than asked, a redirect to another scheme, no validators...).

Every loop here is bounded: an endless body stops after `ENDLESS` bytes or when the
client goes, a slow one after `SLOW_BYTES` bytes, and the server stops with the test.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate, parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

ENDLESS = 2 << 30
"""The most an 'endless' body sends before the server gives up on the client."""
SLOW_BYTES = 120
"""The most bytes a 'slow' answer drips, one a second, before the server gives up."""

Trick = Callable[["_Handler", "File"], bool]
"""Answers a request its own way; returns False to answer it as usual instead."""


@dataclass
class File:
    data: bytes
    etag: str | None = None
    modified: float | None = None
    """The Last-Modified time (seconds since the epoch), or None to send none."""
    trick: Trick | None = None


@dataclass
class Request:
    path: str
    headers: dict[str, str]


@dataclass
class HostileServer:
    files: dict[str, File] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    protocol: str = "HTTP/1.1"
    """HTTP/1.0 closes the connection after each answer."""

    def __post_init__(self) -> None:
        handler = type("Handler", (_Handler,), {"protocol_version": self.protocol})
        self._listener = _Listener(("127.0.0.1", 0), handler)
        self._listener.owner = self  # type: ignore[attr-defined]
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._listener.serve_forever, daemon=True)
        self.stopped = threading.Event()

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stopped.set()
        self._listener.shutdown()
        self._listener.server_close()

    @property
    def url(self) -> str:
        host, port = self._listener.server_address[:2]
        return f"http://{host!s}:{port}"

    def put(
        self,
        name: str,
        data: bytes,
        *,
        etag: bool = True,
        modified: float | None = None,
        last_modified: bool = True,
        trick: Trick | None = None,
    ) -> str:
        """Serve `data` at `/name`, its validators as asked; its URL."""
        with self._lock:
            version = len(self.log) + time.time_ns()
            self.files[name] = File(
                data,
                f'"{version:x}-{len(data):x}"' if etag else None,
                (modified if modified is not None else time.time()) if last_modified else None,
                trick,
            )
        return f"{self.url}/{name}"

    def requests(self, name: str) -> list[Request]:
        with self._lock:
            return [r for r in self.log if r.path.lstrip("/") == name]


_RANGE = re.compile(r"bytes=([0-9]+)-([0-9]*)")


class _Listener(ThreadingHTTPServer):
    """The server's socket: a client that drops its connection (as lazyckpt does with
    an answer it refuses) is no error of the server's, and prints nothing."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass

    @property
    def owner(self) -> HostileServer:
        return self.server.owner  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        owner = self.owner
        with owner._lock:
            owner.log.append(Request(self.path, dict(self.headers.items())))
            file = owner.files.get(unquote(urlsplit(self.path).path.lstrip("/")))
        if file is None:
            return self.answer(404, {}, b"not found")
        if file.trick is not None and file.trick(self, file):
            return None
        return self.serve(file)

    def validators(self, file: File) -> dict[str, str]:
        found = {}
        if file.etag is not None:
            found["ETag"] = file.etag
        if file.modified is not None:
            found["Last-Modified"] = formatdate(file.modified, usegmt=True)
        return found

    def serve(self, file: File, *, extra: int = 0) -> None:
        """As a server should (with `extra` bytes past the range asked for)."""
        headers = self.validators(file)
        match = self.headers.get("If-Match")
        since = self.headers.get("If-Unmodified-Since")
        if (match is not None and match != file.etag) or (
            since is not None
            and file.modified is not None
            and int(file.modified) > parsedate_to_datetime(since).timestamp()
        ):
            return self.answer(412, headers, b"")
        size = len(file.data)
        wanted = _RANGE.fullmatch(self.headers.get("Range", ""))
        if wanted is None:
            return self.answer(200, headers, file.data)
        start = int(wanted[1])
        stop = min(int(wanted[2]) + 1 if wanted[2] else size, size)
        if start >= size:
            return self.answer(416, {**headers, "Content-Range": f"bytes */{size}"}, b"")
        body = file.data[start:stop] + bytes(extra)
        last = start + len(body) - 1
        headers["Content-Range"] = f"bytes {start}-{last}/{size}"
        return self.answer(206, headers, body)

    def answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def endless_chunks(self, headers: dict[str, str]) -> None:
        """A chunked body that never ends (until `ENDLESS` bytes, or the client goes)."""
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        piece = b" " * (1 << 20)
        try:
            for _ in range(ENDLESS // len(piece)):
                if self.owner.stopped.is_set():
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        except OSError:
            return  # the client went, as it should

    def drip(self, prefix: bytes, count: int = SLOW_BYTES) -> None:
        """Raw bytes `prefix`, then one byte a second (until `count`, or the client goes)."""
        try:
            self.wfile.write(prefix)
            self.wfile.flush()
            for _ in range(count):
                if self.owner.stopped.wait(1.0):
                    return
                self.wfile.write(b" ")
                self.wfile.flush()
        except OSError:
            return
        self.close_connection = True
