"""A loopback address through which tensorstore reads files over HTTP(S) with lazyckpt's
own client, so that Orbax checkpoints on the Hub and at https:// URLs are read by
tensorstore's `ocdbt` and `zarr` drivers as they are from a bucket.

tensorstore's own `http` kvstore cannot read them as lazyckpt must: it does not follow
the Hub's redirects to its CDN, it sends no token, and on the hostile servers of
`benchmarks/bench_transport.py` it hung on a dripping body, grew without bound on an
endless one, and mixed two versions of a replaced file. So tensorstore is given an
`http` kvstore whose base URL is this relay, on 127.0.0.1, and each of its requests is
answered by `WebFiles`: the Hub's redirects followed, each file pinned to its version,
every request bounded in time and memory, files in the Hugging Face cache read from
disk.

- **Who may ask.** The relay listens on 127.0.0.1 only, at a port the system picks,
  and answers only paths that start with a secret made at start-up (`secrets`), so
  another local user cannot send requests with the caller's token.
- **What a request becomes.** `GET /SECRET/FOLDER/KEY` with `Range: bytes=A-B` is
  `WebFiles.read(KEY, bytes A to B+1)` of the registered folder (`serve`); a range past
  the file's end is a 416, as tensorstore expects of a server; a missing file, a 404.
- **Versions.** Each answer carries the ETag `"pinned"`: the version the folder's
  `WebFiles` pinned at its first answer, which a later answer that disagrees turns into
  `CheckpointChangedError`. A revalidation (`If-None-Match`) of a file already served is
  answered 304 without a request.
- **Errors.** lazyckpt's own error (a deadline, a changed file, a truncated one) is kept
  here under a fresh id and answered 403 with the id in the body, which tensorstore
  neither retries nor hides: it quotes the body in its error, and `relayed` gives the
  original back to whoever maps tensorstore's errors to lazyckpt's.
"""

from __future__ import annotations

import collections
import itertools
import re
import secrets
import threading
import urllib.parse
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lazyckpt._errors import LazyckptError
from lazyckpt._storage.web import WebFiles

_ERROR_MARK = "lazyckpt-relayed-error-"
_ERROR_ID = re.compile(re.escape(_ERROR_MARK) + r"([0-9a-f]{16})")
_KEPT_ERRORS = 1024
"""The most relayed errors kept for `relayed` (the oldest are dropped first)."""
_RANGE = re.compile(r"bytes=([0-9]{1,19})-([0-9]{0,19})", re.ASCII)
_SUFFIX = re.compile(r"bytes=-([0-9]{1,19})", re.ASCII)
_ETAG = '"pinned"'
_KEPT_BYTES = 4 << 20
"""The most bytes of answers kept for tensorstore's reads that repeat: it reads an
OCDBT manifest and b-tree nodes at each open of the database and its index, which
on local disk costs nothing and over a network a round trip each."""
_KEPT_ANSWER = 1 << 20
"""The largest answer kept: a b-tree node (18 KiB for 10,000 arrays; more where small
arrays are inline in it). Windows of chunk data, which are never read twice, are kept
too where they are this small, within `_KEPT_BYTES`."""

Reply = tuple[int, dict[str, str], bytes | bytearray | memoryview]
"""An answer: status, headers, body."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # (a request in flight never holds up the interpreter's exit)
    request_queue_size = 256
    """Connections waiting to be accepted: tensorstore opens dozens at once, and the
    default backlog of 5 left the others to the kernel's retry, a second later."""
    relay: _Relay


class _Relay:
    """The relay's listener and the folders it serves, by number."""

    def __init__(self) -> None:
        self.secret = secrets.token_hex(16)
        self.folders: dict[str, WebFiles] = {}
        self.served: dict[str, set[str]] = {}
        self.errors: collections.OrderedDict[str, LazyckptError] = collections.OrderedDict()
        self.kept: collections.OrderedDict[tuple[str, str, str | None], Reply] = (
            collections.OrderedDict()
        )
        self.kept_bytes = 0
        self.lock = threading.Lock()
        self.numbers = itertools.count()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.relay = self
        threading.Thread(
            target=self.server.serve_forever, name="lazyckpt-relay", daemon=True
        ).start()

    def address(self, files: WebFiles, owner: object) -> str:
        """The base URL at which tensorstore reads `files`, for as long as `owner` lives."""
        number = str(next(self.numbers))
        with self.lock:
            self.folders[number] = files
            self.served[number] = set()
        weakref.finalize(owner, self.forget, number)
        port = self.server.server_address[1]
        return f"http://127.0.0.1:{port}/{self.secret}/{number}/"

    def forget(self, number: str) -> None:
        with self.lock:
            self.folders.pop(number, None)
            self.served.pop(number, None)
            for asked in [asked for asked in self.kept if asked[0] == number]:
                self.kept_bytes -= len(self.kept.pop(asked)[2])

    def answer(self, number: str, files: WebFiles, key: str, asked: str | None) -> Reply:
        """`serve`'s answer, or the same answer kept from before: the folder's files are
        pinned to one version, so an answer never goes stale."""
        with self.lock:
            reply = self.kept.get((number, key, asked))
            if reply is not None:
                self.kept.move_to_end((number, key, asked))
                return reply
        reply = serve(files, key, asked)
        body = reply[2]
        if len(body) <= _KEPT_ANSWER:
            body = bytes(body)  # (not a view of a buffer that a later read reuses)
            with self.lock:
                if number in self.folders and (number, key, asked) not in self.kept:
                    self.kept[number, key, asked] = (reply[0], reply[1], body)
                    self.kept_bytes += len(body)
                while self.kept_bytes > _KEPT_BYTES:
                    self.kept_bytes -= len(self.kept.popitem(last=False)[1][2])
        return reply[0], reply[1], body

    def keep(self, error: LazyckptError) -> str:
        """An id under which `relayed` finds `error`."""
        found = secrets.token_hex(8)
        with self.lock:
            self.errors[found] = error
            while len(self.errors) > _KEPT_ERRORS:
                self.errors.popitem(last=False)
        return found


_RELAY: _Relay | None = None
_RELAY_LOCK = threading.Lock()


def _relay() -> _Relay:
    global _RELAY
    with _RELAY_LOCK:
        if _RELAY is None:
            _RELAY = _Relay()
        return _RELAY


def address(folder: str, owner: object) -> str:
    """The base URL of a tensorstore `http` kvstore that reads the files of `folder`
    (an http(s):// URL) through lazyckpt's client, pinned for as long as `owner` (the
    store that reads them) lives."""
    return _relay().address(WebFiles(folder), owner)


def shown(error: BaseException) -> str:
    """The text of a tensorstore error, with each relay address in it replaced by the
    URL of the folder it reads (the relay's port and secret mean nothing to a reader)."""
    text = str(error)
    if _RELAY is None:
        return text
    relay = _RELAY
    port = relay.server.server_address[1]
    pattern = re.compile(rf"http://127\.0\.0\.1:{port}/{relay.secret}/([0-9]+)/")

    def folder(match: re.Match[str]) -> str:
        with relay.lock:
            files = relay.folders.get(match[1])
        return f"{files.folder}/" if files is not None else "(a folder no longer open)/"

    return pattern.sub(folder, text)


def relayed(error: BaseException) -> LazyckptError | None:
    """lazyckpt's own error behind a tensorstore error from a relayed read, if it is one."""
    match = _ERROR_ID.search(str(error))
    if match is None or _RELAY is None:
        return None
    with _RELAY.lock:
        return _RELAY.errors.get(match[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # (tensorstore keeps its connections to the relay open)
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # (every request would be written to stderr)

    def do_GET(self) -> None:
        relay = self.server.relay
        parts = self.path.split("?", 1)[0].split("/", 3)
        if len(parts) < 4 or not secrets.compare_digest(parts[1], relay.secret):
            self._send(404, {}, b"")
            return
        with relay.lock:
            files = relay.folders.get(parts[2])
            served = relay.served.get(parts[2])
        if files is None or served is None:
            self._send(404, {}, b"")
            return
        key = urllib.parse.unquote(parts[3])
        if key in served and self.headers.get("If-None-Match") == _ETAG:
            self._send(304, {"ETag": _ETAG}, b"")
            return
        try:
            status, headers, body = relay.answer(parts[2], files, key, self.headers.get("Range"))
        except LazyckptError as error:
            self._send(403, {}, (_ERROR_MARK + relay.keep(error)).encode())
            return
        if status in (200, 206):
            served.add(key)
        self._send(status, headers, body)

    def _send(
        self, status: int, headers: dict[str, str], body: bytes | bytearray | memoryview
    ) -> None:
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True  # tensorstore gave up on the request


def serve(files: WebFiles, key: str, asked: str | None) -> Reply:
    """The status, headers and body that answer a GET of `key` with the Range header
    `asked` (None: the whole file), read through `files`."""
    if asked is None:
        answer = files.read(key).result()
        if answer.state != "value":
            return 404, {}, b""
        return 200, {"ETag": _ETAG}, answer.value
    wanted = _wanted(asked.strip())
    if wanted is None:
        return 416, {}, b""
    start, stop = wanted
    if start < 0:  # the last bytes (a zarr3 shard's index): the file's size first
        head = files.read(key, byte_range=slice(0, 1), short=True).result()
        if head.state != "value" or head.size is None:
            return 404, {}, b""
        start, stop = max(head.size + start, 0), head.size
    answer = files.read(key, byte_range=slice(start, stop), short=True).result()
    if answer.state != "value":
        return 404, {}, b""
    size = answer.size if answer.size is not None else "*"
    if not answer.value:
        return 416, {"Content-Range": f"bytes */{size}"}, b""
    last = start + len(answer.value) - 1
    return 206, {"ETag": _ETAG, "Content-Range": f"bytes {start}-{last}/{size}"}, answer.value


def _wanted(asked: str) -> tuple[int, int | None] | None:
    """The bytes `[start, stop)` that the Range header `asked` names (to the end where
    `stop` is None; the last `-start` bytes where `start` is negative); None for
    several ranges, which tensorstore never asks for."""
    match = _RANGE.fullmatch(asked)
    if match is not None:
        return int(match[1]), int(match[2]) + 1 if match[2] else None
    match = _SUFFIX.fullmatch(asked)
    return None if match is None else (-int(match[1]), None)
