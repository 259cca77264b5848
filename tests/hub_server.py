"""A loopback stand-in for the Hugging Face Hub, for tests that must not leave 127.0.0.1.

It speaks the parts of the Hub protocol that lazyckpt and `huggingface_hub` use:

- `GET /api/models/{repo_id}` and `/api/models/{repo_id}/revision/{revision}`: the repo's
  JSON (`id`, `sha`, `siblings`, `private`, `gated`; `?blobs=true` adds sizes and LFS data);
  a revision is a branch, a tag, or a commit by its sha or the first digits of it
  (`1a2b3c4`, where they begin one commit only), everywhere a revision is taken;
- `GET /api/models/{repo_id}/tree/{revision}[/{path}]` (`?recursive=true`) and
  `POST /api/models/{repo_id}/paths-info/{revision}`: what `list_repo_files` and
  `HfFileSystem` list with;
- `HEAD`/`GET /{repo_id}/resolve/{revision}/{path}`: small files are answered there with
  `X-Repo-Commit` and a git `ETag` (with `resolve_cache`, as the Hub answers for a
  public repository's, with a 307 carrying `X-Repo-Commit` to
  `/api/resolve-cache/models/{repo_id}/{sha}/{path}?...&etag=...`, which answers so);
  LFS files (by suffix) with a 302 to `/cdn/{repo_id}/{sha}/{path}` on a second port
  (another origin, as the Hub's CDN is) carrying `X-Repo-Commit`, `X-Linked-Etag` (the
  sha256) and `X-Linked-Size`. A revision is a branch or tag before it is a commit,
  as on the Hub: a branch named as a commit answers for it, `resolve/` included;
- `GET`/`HEAD /cdn/...` and `/plain/...`: bytes with `Range` support (206 with
  `Content-Range`, 416 out of range), no Hub API.

Repos live in a folder tree `{root}/{repo_id}/{commit_sha}/...`; branches and tags are an
in-memory mapping to commit shas, so a test "pushes" with `commit(...)`. Errors carry the
Hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, `GatedRepo`).
Failures can be injected (`fail_next`), `Range` can be ignored (`ignore_range`), and every
request is logged (`log`, `clear_log`).

    >>> import tempfile, urllib.request
    >>> with HubServer(tempfile.mkdtemp()) as hub:
    ...     sha = hub.commit("org/model", {"config.json": b"{}"})
    ...     with urllib.request.urlopen(hub.endpoint + "/org/model/resolve/main/config.json") as r:
    ...         (r.read(), r.headers["X-Repo-Commit"] == sha)
    (b'{}', True)
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import ssl
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate, parsedate_to_datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

SHA_RE = re.compile(r"[0-9a-f]{40}")
SHORT_SHA_RE = re.compile(r"[0-9a-f]{4,40}")
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".npz")
PLAIN = "plain"


@dataclass(frozen=True)
class Request:
    """One logged request, as the server saw and answered it."""

    server: Literal["hub", "cdn"]
    method: str
    path: str  # with the query string, still quoted
    range: str | None
    authorization: str | None
    status: int
    bytes_sent: int  # body bytes only
    headers: dict[str, str] = field(default_factory=dict, compare=False)  # all request headers


@dataclass
class Repo:
    """Access rules and refs of one repo; its commits are folders under `{root}/{repo_id}/`."""

    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit sha
    private: bool = False
    gated: Literal[False, "auto", "manual"] = False
    allowed_tokens: set[str] = field(default_factory=set)  # granted tokens (private, gated)


@dataclass
class _Fault:
    status: int
    count: int
    retry_after: str | None
    path_prefix: str


@dataclass(frozen=True)
class _Blob:
    size: int
    git_oid: str  # git blob sha1 of what git stores: the bytes, or the LFS pointer
    sha256: str | None  # set for LFS files
    pointer_size: int | None


class _HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


class _Listener(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    """Connections waiting to be accepted, as a real server's backlog holds them
    (nginx's 511): socketserver's 5 left the rest of a burst of 32 connections to the
    kernel's retry of their SYN, a second later."""

    def __init__(
        self, hub: HubServer, name: Literal["hub", "cdn"], tls: ssl.SSLContext | None = None
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:  # (each connection's handshake is made by its own thread)
            self.socket = tls.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )
        self.hub = hub
        self.name: Literal["hub", "cdn"] = name

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that drops its connection (a test's slow link given up on) is no
        error of the server's, and prints nothing."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HubServer:
    """The server: `endpoint` is the Hub's base URL (for HF_ENDPOINT), `cdn` the CDN's.

    `valid_tokens` are the tokens the server knows (any other bearer token is answered 401
    "Invalid credentials in Authorization header"); a repo's `allowed_tokens` are those of
    its members, who may read it when it is private or gated.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        valid_tokens: set[str] | None = None,
        lfs_suffixes: tuple[str, ...] = LFS_SUFFIXES,
        same_origin_cdn: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.root = Path(root)
        self.scheme = "http" if tls is None else "https"
        self.root.mkdir(parents=True, exist_ok=True)
        self.plain_root = self.root / f".{PLAIN}"
        self.valid_tokens: set[str] = set(valid_tokens or ())
        self.lfs_suffixes = lfs_suffixes
        self.same_origin_cdn = same_origin_cdn
        self.ignore_range = False
        self.latency = 0.0
        """Seconds each request waits before its answer: a wide-area round trip
        (`benchmarks/bench_wan.py`)."""
        self.rate: float | None = None
        """Bytes a second each connection's bodies are sent at, at most (a CDN's one
        TCP stream); None: as fast as loopback goes."""
        self.plain_validators: tuple[str, ...] = ("ETag", "Last-Modified")
        """What plain files are served with (as nginx serves static files), and checked
        against `If-Match` and `If-Unmodified-Since`."""
        self.resolve_cache = False
        """Whether small files of a public repository are redirected to their commit's
        `/api/resolve-cache/` address, as the Hub does (a 307, then the file there)."""
        self.cdn_query = ""
        """A query string the redirects to the CDN carry (`X-Amz-Signature=...`, as the
        Hub's signed addresses do); the CDN ignores it."""
        self.repos: dict[str, Repo] = {}
        self._log: list[Request] = []
        self._faults: list[_Fault] = []
        self._blobs: dict[Path, _Blob] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._hub = _Listener(self, "hub", tls)
        self._cdn = _Listener(self, "cdn", tls)
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> HubServer:
        for listener in (self._hub, self._cdn):
            thread = threading.Thread(target=listener.serve_forever, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for listener in (self._hub, self._cdn):
            listener.shutdown()
            listener.server_close()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return (
            self.endpoint
            if self.same_origin_cdn
            else f"{self.scheme}://127.0.0.1:{self._cdn.server_address[1]}"
        )

    def plain_url(self, path: str) -> str:
        return f"{self.endpoint}/{PLAIN}/{quote(path)}"

    # -- content -----------------------------------------------------------------------

    def create_repo(
        self,
        repo_id: str,
        *,
        private: bool = False,
        gated: Literal[False, "auto", "manual"] = False,
        allowed_tokens: set[str] | None = None,
    ) -> Repo:
        """Create (or reconfigure) a repo; `commit` creates a public one on first use."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo(repo_id))
            repo.private, repo.gated = private, gated
            repo.allowed_tokens = set(allowed_tokens or ())
            return repo

    def commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes],
        *,
        branch: str = "main",
        delete: tuple[str, ...] = (),
        keep_parent: bool = True,
    ) -> str:
        """Write a new commit on `branch` (its files plus `files`, less `delete`); its sha."""
        repo = self.repos.get(repo_id) or self.create_repo(repo_id)
        parent = repo.refs.get(branch)
        with self._lock:
            self._counter += 1
            seed = f"{repo_id}\0{branch}\0{parent}\0{self._counter}\0".encode()
        digest = hashlib.sha1(seed)
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name])
        sha = digest.hexdigest()
        folder = self.root / repo_id / sha
        if parent is not None and keep_parent:
            shutil.copytree(self.root / repo_id / parent, folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        for name in delete:
            (folder / name).unlink()
        repo.refs[branch] = sha
        return sha

    def tag(self, repo_id: str, name: str, revision: str = "main") -> str:
        repo = self.repos[repo_id]
        sha = repo.refs.get(revision, revision)
        repo.refs[name] = sha
        return sha

    def swap(self, repo_id: str, sha: str, name: str, data: bytes) -> None:
        """Serve `data` as the file `name` of commit `sha`, whose listing still gives
        the old one's blob: a store that lost or replaced the commit's object."""
        file = self.root / repo_id / sha / name
        file.write_bytes(data)
        with self._lock:
            self._blobs.pop(file, None)

    def add_plain_file(self, path: str, data: bytes) -> str:
        """Serve `data` at `/plain/{path}` (Range support, no Hub API); its URL."""
        target = self.plain_root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return self.plain_url(path)

    # -- faults and log ----------------------------------------------------------------

    def fail_next(
        self,
        count: int,
        status: int = 503,
        *,
        retry_after: float | None = 0,
        path_prefix: str = "/",
    ) -> None:
        """Answer the next `count` requests whose path starts with `path_prefix` with `status`.

        Queued after any failures still pending; `retry_after=None` sends no Retry-After.
        """
        after = None if retry_after is None else f"{retry_after:g}"
        with self._lock:
            self._faults.append(_Fault(status, count, after, path_prefix))

    def clear_faults(self) -> None:
        """Drop the failures `fail_next` queued and not yet served."""
        with self._lock:
            self._faults.clear()

    @property
    def log(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    def _record(self, entry: Request) -> None:
        with self._lock:
            self._log.append(entry)

    def _take_fault(self, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.count > 0 and path.startswith(fault.path_prefix):
                    fault.count -= 1
                    return fault
            return None

    # -- protocol ----------------------------------------------------------------------

    def is_lfs(self, path: str, data: bytes = b"") -> bool:
        """Whether the Hub keeps the file in LFS: by its suffix (a repo's
        `.gitattributes`), or as its upload does for binary files (a NUL byte in the
        first 8 KB: an Orbax checkpoint's `manifest.ocdbt` and `d/` files)."""
        return path.endswith(self.lfs_suffixes) or b"\0" in data[:8192]

    def blob(self, file: Path) -> _Blob:
        with self._lock:
            cached = self._blobs.get(file)
        if cached is not None:
            return cached
        data = file.read_bytes()
        if self.is_lfs(file.name, data):
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n"
            ).encode()
            blob = _Blob(len(data), _git_oid(pointer), sha256, len(pointer))
        else:
            blob = _Blob(len(data), _git_oid(data), None, None)
        with self._lock:
            self._blobs[file] = blob
        return blob

    def check_access(self, repo_id: str, authorization: str | None, *, files: bool) -> Repo:
        """The repo, or the Hub's error for this caller (`files`: a resolve, not the API)."""
        token = None
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or token not in self.valid_tokens:
                raise _HTTPError(401, "Invalid credentials in Authorization header")
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token not in repo.allowed_tokens):
            # The Hub answers 401 to anonymous callers and 404 to signed-in ones.
            status = 404 if token is not None else 401
            raise _HTTPError(status, "Repository not found", "RepoNotFound")
        if files and repo.gated and token not in repo.allowed_tokens:
            if token is None:
                message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in."
                raise _HTTPError(401, message, "GatedRepo")
            message = (
                f"Access to model {repo_id} is restricted and you are not in the authorized list."
            )
            raise _HTTPError(403, message, "GatedRepo")
        return repo

    def resolve(self, repo: Repo, revision: str) -> str:
        """The commit a revision names: a branch or tag (by its name, or in full as
        git names it, `refs/heads/NAME`), else a commit by its 40 hex digits or by the
        first 4 or more of them, where they begin one commit only (as the Hub resolves
        `859350e`, and git a short hash, after the refs)."""
        for full in ("refs/heads/", "refs/tags/"):
            if revision.startswith(full) and revision[len(full) :] in repo.refs:
                revision = revision[len(full) :]
        sha = repo.refs.get(revision)
        if sha is None and SHORT_SHA_RE.fullmatch(revision):
            folder = self.root / repo.repo_id
            found = [p.name for p in folder.glob(f"{revision}*") if SHA_RE.fullmatch(p.name)]
            sha = found[0] if len(found) == 1 else None
        if sha is None:
            raise _HTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return sha

    def files(self, repo: Repo, sha: str) -> list[str]:
        folder = self.root / repo.repo_id / sha
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def entry(self, folder: Path, path: str) -> dict[str, Any]:
        target = folder / path
        if target.is_dir():
            return {"type": "directory", "oid": _git_oid(path.encode()), "size": 0, "path": path}
        blob = self.blob(target)
        entry: dict[str, Any] = {
            "type": "file",
            "oid": blob.git_oid,
            "size": blob.size,
            "path": path,
        }
        if blob.sha256 is not None:
            entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": blob.pointer_size}
        return entry

    def repo_json(self, repo: Repo, sha: str, blobs: bool) -> dict[str, Any]:
        siblings: list[dict[str, Any]] = []
        folder = self.root / repo.repo_id / sha
        for name in self.files(repo, sha):
            sibling: dict[str, Any] = {"rfilename": name}
            if blobs:
                blob = self.blob(folder / name)
                sibling.update(size=blob.size, blobId=blob.git_oid)
                if blob.sha256 is not None:
                    sibling["lfs"] = {
                        "sha256": blob.sha256,
                        "size": blob.size,
                        "pointerSize": blob.pointer_size,
                    }
            siblings.append(sibling)
        return {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "private": repo.private,
            "gated": repo.gated,
            "disabled": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": siblings,
        }


def folder_files(folder: Path, under: str = "") -> dict[str, bytes]:
    """The files of a local `folder` as `HubServer.commit` takes them, named by their
    paths in it (under `under/`, where given)."""
    prefix = f"{under}/" if under else ""
    return {
        f"{prefix}{file.relative_to(folder).as_posix()}": file.read_bytes()
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """`bytes=a-b`, `bytes=a-` or `bytes=-n` as [start, stop); None when unsatisfiable."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if match is None or match.group(1) == match.group(2) == "":
        raise _HTTPError(400, f"Bad Range header: {header!r}")
    first, last = match.group(1), match.group(2)
    if first == "":
        start, stop = max(size - int(last), 0), size
        return (start, stop) if int(last) > 0 and size > 0 else None
    start = int(first)
    stop = size if last == "" else min(int(last) + 1, size)
    if start >= size or stop <= start:
        return None
    return start, stop


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Listener

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):  # (TLS: on this connection's thread)
            self.request.settimeout(30)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # the hub's own log is the record

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        try:
            fault = self.hub._take_fault(self.path)
            if fault is not None:
                headers = {} if fault.retry_after is None else {"Retry-After": fault.retry_after}
                raise _HTTPError(fault.status, HTTPStatus(fault.status).phrase, headers=headers)
            self._route(body)
        except _HTTPError as error:
            self._error(error)
        except Exception as error:  # noqa: BLE001 (a bug here: answer 500, do not hang)
            self._error(_HTTPError(500, f"{type(error).__name__}: {error}"))

    def _route(self, body: bytes) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        parts = url.path.strip("/").split("/")
        authorization = self.headers.get("Authorization")
        if parts[0] == PLAIN and len(parts) > 1:
            file = self.hub.plain_root.joinpath(*map(unquote, parts[1:]))
            if not file.is_file():
                raise _HTTPError(404, "Not found")
            return self._send_file(file, self._validated(file))
        if parts[0] == "cdn" and len(parts) > 3:
            repo_id, sha, path = "/".join(parts[1:3]), parts[3], unquote("/".join(parts[4:]))
            file = self.hub.root / repo_id / sha / path
            if not SHA_RE.fullmatch(sha) or not path or not file.is_file():
                raise _HTTPError(404, "Not found")
            return self._send_file(file, {"ETag": f'"{self.hub.blob(file).sha256}"'})
        if self.server.name == "cdn":
            raise _HTTPError(404, "Not found")
        if parts[:3] == ["api", "resolve-cache", "models"] and len(parts) > 6:
            repo_id, sha, path = "/".join(parts[3:5]), parts[5], unquote("/".join(parts[6:]))
            self.hub.check_access(repo_id, authorization, files=True)
            file = self.hub.root / repo_id / sha / path
            if not SHA_RE.fullmatch(sha) or not file.is_file():
                raise _HTTPError(404, "Entry not found", "EntryNotFound")
            etag = f'"{self.hub.blob(file).git_oid}"'
            return self._send_file(file, {"X-Repo-Commit": sha, "ETag": etag})
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts[2:], query, body, authorization)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision = "/".join(parts[:2]), unquote(parts[3])
            return self._resolve(repo_id, revision, unquote("/".join(parts[4:])), authorization)
        raise _HTTPError(404, "Not found")

    def _api(
        self, parts: list[str], query: dict[str, list[str]], body: bytes, authorization: str | None
    ) -> None:
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        repo = self.hub.check_access(repo_id, authorization, files=False)
        if not rest or (rest[0] == "revision" and len(rest) == 2):
            sha = self.hub.resolve(repo, unquote(rest[1]) if rest else "main")
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            return self._send_json(self.hub.repo_json(repo, sha, blobs))
        if rest[0] in ("tree", "paths-info") and len(rest) >= 2:
            sha = self.hub.resolve(repo, unquote(rest[1]))
            folder = self.hub.root / repo_id / sha
            inner = unquote("/".join(rest[2:])).strip("/")
            if rest[0] == "paths-info":
                form = parse_qs(body.decode())
                paths = [p.strip("/") for p in form.get("paths", [])]
                entries = [self.hub.entry(folder, p) for p in paths if (folder / p).exists()]
                return self._send_json(entries)
            if not (folder / inner).is_dir():
                raise _HTTPError(404, f"{inner} does not exist on {sha}", "EntryNotFound")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            base = folder / inner
            found = base.rglob("*") if recursive else base.iterdir()
            names = sorted(p.relative_to(folder).as_posix() for p in found)
            return self._send_json([self.hub.entry(folder, n) for n in names])
        raise _HTTPError(404, "Not found")

    def _resolve(self, repo_id: str, revision: str, path: str, authorization: str | None) -> None:
        repo = self.hub.check_access(repo_id, authorization, files=True)
        sha = self.hub.resolve(repo, revision)
        file = self.hub.root / repo_id / sha / path
        commit = {"X-Repo-Commit": sha}
        if not file.is_file():
            raise _HTTPError(404, "Entry not found", "EntryNotFound", commit)
        blob = self.hub.blob(file)
        public = not repo.private and not repo.gated
        if blob.sha256 is None and self.hub.resolve_cache and public and blob.size:
            asked = quote(f"/{repo_id}/resolve/{revision}/{path}", safe="")
            location = f"/api/resolve-cache/models/{repo_id}/{sha}/{quote(path)}"
            location += f"?{asked}=&etag=%22{blob.git_oid}%22"
            return self._send(307, {**commit, "Location": location}, b"")
        if blob.sha256 is None:
            return self._send_file(file, {**commit, "ETag": f'"{blob.git_oid}"'})
        location = f"{self.hub.cdn}/cdn/{repo_id}/{sha}/{quote(path)}"
        location += f"?{self.hub.cdn_query}" if self.hub.cdn_query else ""
        headers = {
            **commit,
            "ETag": f'"{blob.git_oid}"',
            "X-Linked-Etag": f'"{blob.sha256}"',
            "X-Linked-Size": str(blob.size),
            "Location": location,
        }
        return self._send(302, headers, b"")

    def _validated(self, file: Path) -> dict[str, str]:
        """A plain file's validators, as nginx makes them (its ETag from its time and
        size); 412 where the request's `If-Match` or `If-Unmodified-Since` fails."""
        info = file.stat()
        found = {
            "ETag": f'"{info.st_mtime_ns:x}-{info.st_size:x}"',
            "Last-Modified": formatdate(info.st_mtime, usegmt=True),
        }
        found = {k: v for k, v in found.items() if k in self.hub.plain_validators}
        match = self.headers.get("If-Match")
        since = self.headers.get("If-Unmodified-Since")
        if (match is not None and "ETag" in found and match != found["ETag"]) or (
            since is not None
            and "Last-Modified" in found
            and int(info.st_mtime) > parsedate_to_datetime(since).timestamp()
        ):
            raise _HTTPError(412, "Precondition Failed")
        return found

    def _send_file(self, file: Path, headers: dict[str, str]) -> None:
        size = file.stat().st_size
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        wanted = self.headers.get("Range")
        if wanted is None or self.hub.ignore_range:
            return self._send(200, headers, file, 0, size)
        span = _parse_range(wanted, size)
        if span is None:
            raise _HTTPError(
                416, "Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"}
            )
        start, stop = span
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        return self._send(206, headers, file, start, stop)

    def _send_json(self, payload: object) -> None:
        data = json.dumps(payload).encode()
        return self._send(200, {"Content-Type": "application/json; charset=utf-8"}, data)

    def _error(self, error: _HTTPError) -> None:
        headers = {**error.headers, "X-Error-Message": error.message}
        if error.code is not None:
            headers["X-Error-Code"] = error.code
        data = json.dumps({"error": error.message}).encode()
        return self._send(error.status, {**headers, "Content-Type": "application/json"}, data)

    def _send(
        self,
        status: int,
        headers: dict[str, str],
        body: bytes | Path,
        start: int = 0,
        stop: int = 0,
    ) -> None:
        if isinstance(body, bytes):
            start, stop = 0, len(body)
        sent = 0 if self.command == "HEAD" else stop - start
        # Logged before the answer goes out, so that a client that has its answer finds it.
        self.hub._record(
            Request(
                self.server.name,
                self.command,
                self.path,
                self.headers.get("Range"),
                self.headers.get("Authorization"),
                status,
                sent,
                dict(self.headers.items()),
            )
        )
        if self.hub.latency:
            time.sleep(self.hub.latency)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(stop - start))
        self.end_headers()
        if sent == 0:
            return
        rate, began, written = self.hub.rate, time.monotonic(), 0
        for chunk in _chunks(body, start, stop, 1 << 20 if rate is None else 1 << 16):
            self.wfile.write(chunk)
            written += len(chunk)
            if rate is not None:  # paced: no faster than `rate` on this connection
                time.sleep(max(0.0, began + written / rate - time.monotonic()))


def _chunks(body: bytes | Path, start: int, stop: int, size: int = 1 << 20) -> Iterator[bytes]:
    if isinstance(body, bytes):
        yield body[start:stop]
        return
    with body.open("rb") as f:
        f.seek(start)
        while start < stop:
            chunk = f.read(min(size, stop - start))
            if not chunk:
                return
            start += len(chunk)
            yield chunk
