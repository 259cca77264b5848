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
  another local user cannot send requests with the caller's token. Each folder has a
  random id of its own; a key with an empty, `.` or `..` part is refused. `127.0.0.1`
  is added to `no_proxy`, so that tensorstore's client never sends the relay's
  requests (and its secret) to an `http_proxy`. A forked child would start a relay of
  its own, but tensorstore aborts a child forked after its threads started, at its
  first read: lazyckpt refuses that read by name instead (`per_process`).
- **What a request becomes.** `GET /SECRET/FOLDER/KEY` with `Range: bytes=A-B` is read
  from the registered folder's `WebFiles` in pieces of `_PIECE` bytes, each sent as it
  arrives (`serve`), so that an answer holds one piece in memory and its first bytes
  leave within a round trip. A range past the file's end is a 416, as tensorstore
  expects of a server; a missing file, a 404; a `HEAD`, what the file's first byte
  says.
- **Versions.** Each answer carries the ETag `"pinned"`: the version the folder's
  `WebFiles` pinned at its first answer, which a later answer that disagrees turns into
  `CheckpointChangedError`. A revalidation (`If-None-Match`) of a file that answered
  is a 304, with no request.
- **Errors.** lazyckpt's own error (a deadline, a changed file, a truncated one; any
  other failure becomes a `StorageAccessError`) is kept here under a fresh id and
  answered 403 with the id in the body, which tensorstore neither retries nor hides:
  it quotes the body in its error, and `relayed` gives the original back to whoever
  maps tensorstore's errors to lazyckpt's. An error after an answer began (its later
  pieces) closes the connection, and the request tensorstore makes again gets the 403.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import threading
import urllib.parse
import weakref
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from lazyckpt import _display
from lazyckpt._errors import LazyckptError, StorageAccessError
from lazyckpt._storage.futures import RangeAnswer
from lazyckpt._storage.http.transport import said
from lazyckpt._storage.http.web import WebFiles
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.per_process import PerProcess

_ERROR_MARK = "lazyckpt-relayed-error-"
_ERROR_ID = re.compile(re.escape(_ERROR_MARK) + r"([0-9a-f]{16})")
_KEPT_ERRORS = 1024
"""The most relayed errors kept for `relayed` (the oldest are dropped first)."""
_RANGE = re.compile(r"bytes=([0-9]{1,19})-([0-9]{0,19})", re.ASCII)
_SUFFIX = re.compile(r"bytes=-([0-9]{1,19})", re.ASCII)
_ETAG = '"pinned"'
_PIECE = 4 << 20
"""The bytes of an answer read from the server at once (and held while they are sent)."""
_KEPT_BYTES = 4 << 20
"""The most bytes of answers kept for tensorstore's reads that repeat: it reads an
OCDBT manifest and b-tree nodes at each open of the database and its index, which
on local disk costs nothing and over a network a round trip each."""
_KEPT_ANSWER = 256 << 10
"""The largest answer kept, less one byte: a b-tree node (18 KiB for 10,000 arrays),
not a window of a chunk that lazyckpt decodes (at least 256 KiB, never read twice),
which would push the nodes out. A node larger than this (one that holds hundreds of
small arrays inline) may be asked for twice."""


class RelayReply(NamedTuple):
    """An answer to one request: its body is `first`, then `rest` as it is read."""

    status: int
    headers: dict[str, str]
    length: int
    first: bytes | bytearray | memoryview = b""
    rest: Iterator[bytes | bytearray | memoryview] = iter(())


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # (a request in flight never holds up the interpreter's exit)
    request_queue_size = 256
    """Connections waiting to be accepted: tensorstore opens dozens at once, and the
    default backlog of 5 left the others to the kernel's retry, a second later."""
    relay: _Relay


class _Relay:
    """The relay's listener, the folders it serves by id, and the errors it kept."""

    def __init__(self) -> None:
        self.secret = secrets.token_hex(16)
        self.folders: dict[str, WebFiles] = {}
        self.errors: collections.OrderedDict[str, LazyckptError] = collections.OrderedDict()
        self.failed: dict[tuple[str, str], str] = {}
        """Error ids of keys whose answer failed after it began, by folder and key."""
        self.kept: collections.OrderedDict[tuple[str, str, str | None], RelayReply] = (
            collections.OrderedDict()
        )
        self.kept_bytes = 0
        self.served: set[tuple[str, str]] = set()
        """Keys that answered, by folder: pinned, so a revalidation is answered 304."""
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.relay = self
        threading.Thread(
            target=self.server.serve_forever, name="lazyckpt-relay", daemon=True
        ).start()

    def address(self, files: WebFiles, owner: object) -> str:
        """The base URL at which tensorstore reads `files`, for as long as `owner` lives."""
        _bypass_proxies()  # (at each open: the environment may have changed since)
        folder = secrets.token_hex(8)
        with self.lock:
            self.folders[folder] = files
        weakref.finalize(owner, self.forget, folder)
        port = self.server.server_address[1]
        return f"http://127.0.0.1:{port}/{self.secret}/{folder}/"

    def forget(self, folder: str) -> None:
        with self.lock:
            self.folders.pop(folder, None)
            for asked in [asked for asked in self.kept if asked[0] == folder]:
                self.kept_bytes -= self.kept.pop(asked).length
            for failed in [failed for failed in self.failed if failed[0] == folder]:
                del self.failed[failed]
            self.served -= {served for served in self.served if served[0] == folder}

    def answer(self, folder: str, files: WebFiles, key: str, asked: str | None) -> RelayReply:
        """`serve`'s answer, or the same answer kept from before: the folder's files are
        pinned to one version, so an answer never goes stale."""
        with self.lock:
            reply = self.kept.get((folder, key, asked))
            if reply is not None:
                self.kept.move_to_end((folder, key, asked))
                return reply
        reply = serve(files, key, asked)
        if reply.length >= _KEPT_ANSWER or len(reply.first) != reply.length:
            return reply
        # (A copy: not a view of a buffer that a later read reuses.)
        reply = reply._replace(first=bytes(reply.first), rest=iter(()))
        with self.lock:
            if folder in self.folders and (folder, key, asked) not in self.kept:
                self.kept[folder, key, asked] = reply
                self.kept_bytes += reply.length
            while self.kept_bytes > _KEPT_BYTES:
                self.kept_bytes -= self.kept.popitem(last=False)[1].length
        return reply

    def keep(self, error: LazyckptError) -> str:
        """An id under which `relayed` finds `error`."""
        found = secrets.token_hex(8)
        with self.lock:
            self.errors[found] = error
            while len(self.errors) > _KEPT_ERRORS:
                self.errors.popitem(last=False)
        return found


def _bypass_proxies() -> None:
    """Add 127.0.0.1 to `no_proxy` (and `NO_PROXY`): tensorstore's client (curl) reads
    them at each request, and would send the relay's to an `http_proxy` otherwise."""
    for name in ("no_proxy", "NO_PROXY"):
        hosts = [host.strip() for host in os.environ.get(name, "").split(",") if host.strip()]
        if "127.0.0.1" not in hosts and "*" not in hosts:
            os.environ[name] = ",".join([*hosts, "127.0.0.1"])


_RELAY = PerProcess(_Relay)


def address(folder: str | WebFiles, owner: object) -> str:
    """The base URL of a tensorstore `http` kvstore that reads the files of `folder`
    (an http(s):// URL, or its `WebFiles`, whose pins a caller's own reads then share)
    through lazyckpt's client, pinned for as long as `owner` (the store that reads
    them) lives."""
    files = WebFiles(folder) if isinstance(folder, str) else folder
    return _RELAY.get().address(files, owner)


def shown(error: BaseException) -> str:
    """The text of a tensorstore error, with each relay address in it replaced by the
    URL of the folder it reads (the relay's port and secret mean nothing to a reader),
    and the credentials it may quote hidden (`lazyckpt._display.scrubbed`, once the
    addresses are replaced: hiding part of one would leave the rest, and its secret)."""
    text = str(error)
    relay = _RELAY.made()
    if relay is None:
        return _display.scrubbed(text)
    port = relay.server.server_address[1]
    pattern = re.compile(rf"http://127\.0\.0\.1:{port}/{relay.secret}/([0-9a-f]+)/")

    def folder(match: re.Match[str]) -> str:
        with relay.lock:
            files = relay.folders.get(match[1])
        return f"{files.folder}/" if files is not None else "(a folder no longer open)/"

    return _display.scrubbed(pattern.sub(folder, text))


def relayed(error: BaseException) -> LazyckptError | None:
    """lazyckpt's own error behind a tensorstore error from a relayed read, if it is one."""
    match = _ERROR_ID.search(str(error))
    relay = _RELAY.made()
    if match is None or relay is None:
        return None
    with relay.lock:
        return relay.errors.get(match[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # (tensorstore keeps its connections to the relay open)
    # Headers and body go out as two writes: with Nagle's algorithm on, the body waited
    # for the client's delayed acknowledgement, about 40 ms a request.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # (every request would be written to stderr)

    def do_GET(self) -> None:
        self._relay(body=True)

    def do_HEAD(self) -> None:
        self._relay(body=False)

    def _relay(self, *, body: bool) -> None:
        relay = self.server.relay
        parts = self.path.split("?", 1)[0].split("/", 3)
        if len(parts) < 4 or not secrets.compare_digest(parts[1], relay.secret):
            self._send(RelayReply(404, {}, 0))
            return
        folder, key = parts[2], urllib.parse.unquote(parts[3])
        with relay.lock:
            files = relay.folders.get(folder)
            failed = relay.failed.get((folder, key))
            served = (folder, key) in relay.served
        if failed is not None:
            self._send(_failure(failed))
            return
        if served and self.headers.get("If-None-Match") == _ETAG:
            # tensorstore revalidates an OCDBT manifest at each open of an array: the
            # file is pinned to the version it answered with, so it has not changed.
            self._send(RelayReply(304, {"ETag": _ETAG}, 0), body=False)
            return
        try:
            if files is None:
                raise StorageAccessError(
                    "a read of a checkpoint over HTTP went on after its tree was closed; "
                    "open it again"
                )
            if any(part in ("", ".", "..") for part in key.split("/")):
                raise StorageAccessError(f"{files.folder}: {key!r} is not a file's name in it")
            if body:
                reply = relay.answer(folder, files, key, self.headers.get("Range"))
            else:  # (a HEAD: what the file's first byte says, its status and size)
                reply = _head(relay.answer(folder, files, key, "bytes=0-0"))
        except Exception as error:  # noqa: BLE001 - kept, and handed to tensorstore's reader
            self._send(_failure(relay.keep(_as_ours(error, files, key))))
            return
        if reply.status in (200, 206):
            with relay.lock:
                relay.served.add((folder, key))
        self._send(reply, body=body, failed=(folder, key))

    def _send(
        self, reply: RelayReply, *, body: bool = True, failed: tuple[str, str] = ("", "")
    ) -> None:
        relay = self.server.relay
        try:
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(reply.length))
            self.end_headers()
            if not body:
                return
            self.wfile.write(reply.first)
            pieces = reply.rest
            while True:
                try:
                    piece = next(pieces, None)
                except Exception as error:  # noqa: BLE001 - the next request is told
                    with relay.lock:
                        relay.failed[failed] = relay.keep(_as_ours(error, None, failed[1]))
                    self.close_connection = True  # (the answer stops short: tensorstore asks again)
                    return
                if piece is None:
                    return
                self.wfile.write(piece)
        except OSError:
            self.close_connection = True  # tensorstore gave up on the request


def _head(first: RelayReply) -> RelayReply:
    """The answer to a HEAD of a file, from the answer to a GET of its first byte."""
    if first.status == 404:
        return first
    # The size after the '/' of `bytes 0-0/SIZE`, or of `bytes */0` for an empty file.
    size = int(first.headers["Content-Range"].rsplit("/", 1)[1])
    return RelayReply(200, {"ETag": _ETAG}, size)


def _failure(error_id: str) -> RelayReply:
    body = (_ERROR_MARK + error_id).encode()
    return RelayReply(403, {}, len(body), body)


def _as_ours(error: BaseException, files: WebFiles | None, key: str) -> LazyckptError:
    """`error` as lazyckpt's own: as it is, or a `StorageAccessError` naming the file."""
    if isinstance(error, LazyckptError):
        return error
    where = f"{files.folder}/{key}" if files is not None else key
    return StorageAccessError(
        f"{where}: reading it failed ({type(error).__name__}: {said(str(error))}); try again"
    )


def serve(files: WebFiles, key: str, asked: str | None) -> RelayReply:
    """The answer to a GET of `key` with the Range header `asked` (None: the whole
    file), read through `files` a piece at a time: the first piece before the answer
    starts, which says the file's size, the others as they are sent."""
    wanted = (0, None) if asked is None else _wanted(asked.strip())
    if wanted is None:
        return RelayReply(416, {}, 0)
    start, stop = wanted
    if start < 0:  # the last bytes (a zarr3 shard's index): the file's size first
        size = files.size(key)
        if size is None:
            head = files.read(key, byte_range=slice(0, 1), short=True).result()
            if head.state != "value":
                return RelayReply(404, {}, 0)
            size = _size(head, files, key)
        start, stop = max(size + start, 0), size
    first_stop = start + _PIECE if stop is None else min(stop, start + _PIECE)
    first = files.read(key, byte_range=slice(start, first_stop), short=True).result()
    if first.state != "value":
        return RelayReply(404, {}, 0)
    size = _size(first, files, key)
    end = size if stop is None else min(stop, size)
    if asked is None:
        return RelayReply(
            200, {"ETag": _ETAG}, size, first.value, _pieces(files, key, first_stop, end)
        )
    if start >= size:
        return RelayReply(416, {"Content-Range": f"bytes */{size}"}, 0)
    headers = {"ETag": _ETAG, "Content-Range": f"bytes {start}-{end - 1}/{size}"}
    return RelayReply(206, headers, end - start, first.value, _pieces(files, key, first_stop, end))


def _size(answer: RangeAnswer, files: WebFiles, key: str) -> int:
    if answer.size is None:
        raise StorageAccessError(
            f"{files.folder}/{key}: the server does not say the file's size (its "
            "Content-Range ends in '/*'), which reading it in pieces needs; download it"
        )
    return answer.size


def _pieces(
    files: WebFiles, key: str, start: int, stop: int
) -> Iterator[bytes | bytearray | memoryview]:
    """The bytes `[start, stop)` of `key`, a piece at a time, the next one asked for
    while the last is sent."""
    ahead: ts.Future[RangeAnswer] | None = None
    for low in range(start, stop, _PIECE):
        read = files.read(key, byte_range=slice(low, min(low + _PIECE, stop)))
        if ahead is not None:
            yield _whole(ahead.result(), files, key)
        ahead = read
    if ahead is not None:
        yield _whole(ahead.result(), files, key)


def _whole(answer: RangeAnswer, files: WebFiles, key: str) -> bytes | bytearray | memoryview:
    """A later piece's bytes, which the file's first answer said are there."""
    if answer.state != "value":
        raise StorageAccessError(
            f"{files.folder}/{key}: it is gone since its first bytes were read"
        )
    return answer.value


def _wanted(asked: str) -> tuple[int, int | None] | None:
    """The bytes `[start, stop)` that the Range header `asked` names (to the end where
    `stop` is None; the last `-start` bytes where `start` is negative); None for
    several ranges, which tensorstore never asks for."""
    match = _RANGE.fullmatch(asked)
    if match is not None:
        return int(match[1]), int(match[2]) + 1 if match[2] else None
    match = _SUFFIX.fullmatch(asked)
    return None if match is None else (-int(match[1]), None)
