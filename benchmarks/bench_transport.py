"""HTTP clients that read byte ranges, against lazyckpt's own (`lazyckpt._storage.http.range_reads`):
how fast each reads a model over a wide-area link, and what each does with a server
that breaks the rules (issue 36: which transport to use; issue 28: what clients get
wrong).

    python benchmarks/bench_transport.py [--repeat 3] [--links 60:40,10:200,150:20]

1. Throughput. The loopback Hub of tests/hub_server.py runs in its own process, paced
   as in bench_wan (a round trip per request, a rate cap per connection), serving
   bench_wan's 256 MiB model: 4 shards of 64 MiB. Each client, in a fresh process,
   reads every byte of the 4 shards as byte ranges into one preallocated NumPy buffer
   a shard, from the CDN's URLs (the Hub's `resolve/` ones for HfFileSystem, which
   follows the redirect). It prints the median of `--repeat` runs: seconds, requests
   (the server's log), and peak memory above the baseline over the data.
2. Hostile servers. tests/hostile_server.py (and the Hub, for the cases about a
   redirect, a commit and the Hub's own client) breaks one rule a case; each client
   meets each case in a fresh process, killed at `--cap` seconds or 1 GiB grown.
   Every client gets a 5 s timeout and 2 attempts where it has a setting for them:
   lazyckpt `network_options(timeout=5, retries=2)`; obstore `timeout` and
   `connect_timeout` "5s", `max_retries=1`; fsspec aiohttp's `sock_connect` and
   `sock_read` 5 s; HfFileSystem `HF_HUB_DOWNLOAD_TIMEOUT=5`; tensorstore (no timeout
   setting) `http_request_retries.max_retries=2`.

obstore hands each range back as its own `Bytes` (Rust-owned, read-only, zero-copy to
NumPy): no call reads into a caller's buffer, so every other client here pays one copy
into place; lazyckpt's transport reads each body into the buffer itself.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench_wan import _client as point_at_hub
from bench_wan import model_files
from common import machine, measure, versions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20
REPO = "org/model"
TOKEN = "Bearer hf_bench_secret"
GROWTH_CAP = 1 << 30
"""Resident memory past which a hostile case's process is killed: a body read without
bound."""


@dataclass(frozen=True)
class Link:
    """Where one paced Hub serves the model."""

    endpoint: str
    cdn_folder: str  # `{cdn}/cdn/{repo}/{sha}`: what `resolve/` redirects to
    names: tuple[str, ...]
    sizes: tuple[int, ...]


# -- 1. throughput ---------------------------------------------------------------------


def serve(root: str, latency: float, rate: float, orders: Any, answers: Any) -> None:
    """The Hub, in its own process: answers `"count"` with the requests served since
    it was last asked, until `"stop"`."""
    from tests import hub_server

    # A CDN takes many connections at once; the standard library's backlog of 5 drops
    # the rest, whose clients then wait out TCP's retry of 1 s, 3 s, 7 s...
    hub_server._Listener.request_queue_size = 1024
    with hub_server.HubServer(root) as hub:
        files = model_files()
        sha = hub.commit(REPO, files)
        hub.latency, hub.rate = latency, rate
        names = tuple(sorted(n for n in files if n.endswith(".safetensors")))
        for name in names:  # (its ETag, a hash of the file, is made once: not on a clock)
            hub.blob(hub.root / REPO / sha / name)
        folder = f"{hub.cdn}/cdn/{REPO}/{sha}"
        answers.put(Link(hub.endpoint, folder, names, tuple(len(files[n]) for n in names)))
        while (order := orders.get()) != "stop":
            assert order == "count"
            answers.put(len(hub.log))
            hub.clear_log()


def spans(size: int, piece: int) -> list[tuple[int, int]]:
    return [(start, min(start + piece, size)) for start in range(0, size, piece)]


Operation = Callable[[], list[Any]]


def lazyckpt_reader(piece: int, connections: int) -> Callable[[Link], Operation]:
    """`range_reads.client().read` on its own threads (`connections` an origin), each body
    read by the transport straight into its place in the buffer (`into=`)."""

    def setup(link: Link) -> Operation:
        import numpy as np

        import lazyckpt
        from lazyckpt._storage.http import range_reads

        lazyckpt.network_options(connections=connections)
        client = range_reads.client()

        def operation() -> list[Any]:
            out = [np.empty(size, np.uint8) for size in link.sizes]
            done = []
            for name, size, buffer in zip(link.names, link.sizes, out, strict=True):
                url, pin, view = f"{link.cdn_folder}/{name}", range_reads.Pin(), buffer.data
                done += [
                    client.submit(url, client.read, url, a, b, pin=pin, into=view[a:b])
                    for a, b in spans(size, piece)
                ]
            for future in done:
                future.result()
            return out

        return operation

    return setup


def obstore_store(folder: str, retry_config: Any = None, **options: Any) -> Any:
    from obstore.store import HTTPStore

    return HTTPStore.from_url(
        folder, client_options={"allow_http": True, **options}, retry_config=retry_config
    )


def obstore_ranges(link: Link) -> Operation:
    """`obstore.get_ranges_async` a shard, the 4 at once (it coalesces adjacent ranges)."""
    import numpy as np
    import obstore

    store = obstore_store(link.cdn_folder)

    async def shard(name: str, buffer: Any) -> None:
        pieces = spans(len(buffer), 4 * MiB)
        found = await obstore.get_ranges_async(
            store, name, starts=[a for a, _ in pieces], ends=[b for _, b in pieces]
        )
        for (a, b), value in zip(pieces, found, strict=True):
            buffer[a:b] = np.frombuffer(value, np.uint8)  # (Rust-owned bytes: one copy)

    async def everything(out: list[Any]) -> None:
        await asyncio.gather(*(shard(n, b) for n, b in zip(link.names, out, strict=True)))

    def operation() -> list[Any]:
        out = [np.empty(size, np.uint8) for size in link.sizes]
        asyncio.run(everything(out))
        return out

    return operation


def obstore_fan_out(link: Link) -> Operation:
    """`obstore.get_range_async` a range of 4 MiB, 16 in flight."""
    import numpy as np
    import obstore

    store = obstore_store(link.cdn_folder)

    async def everything(out: list[Any]) -> None:
        gate = asyncio.Semaphore(16)

        async def one(name: str, buffer: Any, a: int, b: int) -> None:
            async with gate:
                value = await obstore.get_range_async(store, name, start=a, end=b)
            buffer[a:b] = np.frombuffer(value, np.uint8)

        await asyncio.gather(
            *(
                one(name, buffer, a, b)
                for name, buffer in zip(link.names, out, strict=True)
                for a, b in spans(len(buffer), 4 * MiB)
            )
        )

    def operation() -> list[Any]:
        out = [np.empty(size, np.uint8) for size in link.sizes]
        asyncio.run(everything(out))
        return out

    return operation


def _cat_ranges(fs: Any, link: Link, paths: list[str]) -> Operation:
    """`fs.cat_ranges` of every range of every shard, copied into place."""
    import numpy as np

    def operation() -> list[Any]:
        out = [np.empty(size, np.uint8) for size in link.sizes]
        where = [(b, a, z) for b in out for a, z in spans(len(b), 4 * MiB)]
        found = fs.cat_ranges(
            [p for p, b in zip(paths, out, strict=True) for _ in spans(len(b), 4 * MiB)],
            [a for _, a, _ in where],
            [z for _, _, z in where],
        )
        for (buffer, a, z), value in zip(where, found, strict=True):
            buffer[a:z] = np.frombuffer(value, np.uint8)
        return out

    return operation


def fsspec_http(link: Link) -> Operation:
    from fsspec.implementations.http import HTTPFileSystem

    paths = [f"{link.cdn_folder}/{name}" for name in link.names]
    return _cat_ranges(HTTPFileSystem(), link, paths)


def hf_filesystem(link: Link) -> Operation:
    cache = tempfile.mkdtemp()
    point_at_hub(link.endpoint, cache)
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem(endpoint=link.endpoint, token=False)
    return _cat_ranges(fs, link, [f"{REPO}/{name}" for name in link.names])


def tensorstore_http(link: Link) -> Operation:
    """The `http` kvstore's reads, all issued at once (its default: 32 in flight)."""
    import numpy as np
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "http", "base_url": link.cdn_folder + "/"}).result()

    def operation() -> list[Any]:
        out = [np.empty(size, np.uint8) for size in link.sizes]
        wanted = [
            (buffer, name, a, b)
            for name, buffer in zip(link.names, out, strict=True)
            for a, b in spans(len(buffer), 4 * MiB)
        ]
        # Each future let go of once its bytes are in place (a kept one holds them).
        futures: list[Any] = [None] * len(wanted)
        left, done, failed = [len(wanted)], threading.Event(), []

        def place(future: Any, i: int, buffer: Any, a: int, b: int) -> None:
            try:
                buffer[a:b] = np.frombuffer(future.result().value, np.uint8)
            except Exception as error:  # noqa: BLE001 (raised on the caller's thread)
                failed.append(error)
            futures[i] = None
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        lock = threading.Lock()
        for i, (buffer, name, a, b) in enumerate(wanted):
            futures[i] = store.read(name, byte_range=slice(a, b))
            futures[i].add_done_callback(partial(place, i=i, buffer=buffer, a=a, b=b))
        done.wait()
        if failed:
            raise failed[0]
        return out

    return operation


READERS: dict[str, Callable[[Link], Operation]] = {
    "lazyckpt 4 MiB x 16": lazyckpt_reader(4 * MiB, 16),
    "lazyckpt 2 MiB x 32": lazyckpt_reader(2 * MiB, 32),
    "lazyckpt 4 MiB x 64": lazyckpt_reader(4 * MiB, 64),
    "obstore get_ranges (coalesced)": obstore_ranges,
    "obstore get_range_async 4 MiB x 16": obstore_fan_out,
    "fsspec HTTPFileSystem.cat_ranges 4 MiB": fsspec_http,
    "HfFileSystem.cat_ranges 4 MiB": hf_filesystem,
    "tensorstore http kvstore 4 MiB": tensorstore_http,
}


def run(reader: str, link: Link) -> dict[str, Any]:
    """One measurement in this (fresh) process; the bytes are checked after it."""
    operation = READERS[reader](link)
    found = measure(operation, keep=True)
    data = found.pop("result")
    expected = model_files()
    for name, buffer in zip(link.names, data, strict=True):
        if buffer.tobytes() != expected[name]:
            raise AssertionError(f"{reader} read {name} wrong")
    return found


def _in_process(reader: str, link: Link) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(run, (reader, link))


def throughput(links: str, readers: list[str], repeat: int) -> None:
    context = multiprocessing.get_context("spawn")
    anchor = readers[0]
    print(f"| link | client | s | requests | peak / data | s / {anchor}'s |")
    print("|---|---|---|---|---|---|")
    for spec in links.split(","):
        milliseconds, megabytes = (float(x) for x in spec.split(":"))
        with tempfile.TemporaryDirectory() as root:
            orders, answers = context.Queue(), context.Queue()
            server = context.Process(
                target=serve, args=(root, milliseconds / 1000, megabytes * 1e6, orders, answers)
            )
            server.start()
            try:
                link = answers.get(timeout=300)
                data = sum(link.sizes)
                runs: dict[str, list[dict[str, Any]]] = {r: [] for r in readers}
                for _ in range(repeat):
                    for reader in readers:  # alternating
                        orders.put("count")
                        answers.get(timeout=60)
                        found = _in_process(reader, link)
                        orders.put("count")
                        found["requests"] = answers.get(timeout=60)
                        runs[reader].append(found)
                medians = {
                    r: {
                        key: statistics.median(found[key] for found in runs[r])
                        for key in ("seconds", "requests", "peak_above_baseline")
                    }
                    for r in readers
                }
                for reader, found in medians.items():
                    print(
                        f"| {milliseconds:g} ms, {megabytes:g} MB/s | {reader} "
                        f"| {found['seconds']:.2f} | {found['requests']:.0f} "
                        f"| {found['peak_above_baseline'] / data:.2f}x "
                        f"| {found['seconds'] / medians[anchor]['seconds']:.2f}x |",
                        flush=True,
                    )
            finally:
                orders.put("stop")
                server.join(30)


# -- 2. hostile servers ----------------------------------------------------------------


class Session:
    """One client's reads in a hostile case's process, its timeouts 5 s, 2 attempts."""

    def read(self, url: str, start: int, stop: int, token: str | None) -> bytes:
        raise NotImplementedError


class LazyckptSession(Session):
    def __init__(self) -> None:
        import lazyckpt
        from lazyckpt._storage import folders
        from lazyckpt._storage.http import range_reads

        lazyckpt.network_options(timeout=5, retries=2)
        self.range_reads = range_reads
        self.folders = folders
        self.pins: dict[str, Any] = {}

    def read(self, url: str, start: int, stop: int, token: str | None) -> bytes:
        range_reads = self.range_reads
        folder, name = url.rsplit("/", 1)
        if token is not None:
            self.folders.register(
                folder, self.folders.Site((name,), headers={"Authorization": token})
            )
        pin = self.pins.setdefault(url, range_reads.Pin())
        return bytes(range_reads.client().read(url, start, stop, pin=pin).value)


class ObstoreSession(Session):
    def __init__(self) -> None:
        import obstore

        self.obstore = obstore
        self.stores: dict[tuple[str, str | None], Any] = {}

    def read(self, url: str, start: int, stop: int, token: str | None) -> bytes:
        from datetime import timedelta

        folder, name = url.rsplit("/", 1)
        store = self.stores.get((folder, token))
        if store is None:
            headers = {"default_headers": {"Authorization": token}} if token else {}
            store = self.stores[folder, token] = obstore_store(
                folder,
                retry_config={"max_retries": 1, "retry_timeout": timedelta(seconds=10)},
                timeout="5s",
                connect_timeout="5s",
                **headers,
            )
        return bytes(self.obstore.get_range(store, name, start=start, end=stop))


class FsspecSession(Session):
    def __init__(self) -> None:
        import aiohttp
        from fsspec.implementations.http import HTTPFileSystem

        timeout = aiohttp.ClientTimeout(sock_connect=5, sock_read=5)
        self.fs = HTTPFileSystem(client_kwargs={"timeout": timeout})

    def read(self, url: str, start: int, stop: int, token: str | None) -> bytes:
        headers = {"Authorization": token} if token else {}
        return bytes(self.fs.cat_file(url, start=start, end=stop, headers=headers))


class HfSession(Session):
    """`url` is a path in the repo (`org/model/file`), read through the Hub's API."""

    def __init__(self, endpoint: str) -> None:
        os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = "5"
        os.environ["HF_HUB_ETAG_TIMEOUT"] = "5"
        point_at_hub(endpoint, tempfile.mkdtemp())
        from huggingface_hub import HfFileSystem

        self.endpoint = endpoint
        self.systems: dict[str | None, Any] = {}
        self.kind = HfFileSystem

    def read(self, url: str, start: int, stop: int, token: str | None) -> bytes:
        fs = self.systems.get(token)
        if fs is None:
            secret = token.split()[1] if token else False
            fs = self.systems[token] = self.kind(endpoint=self.endpoint, token=secret)
        return bytes(fs.cat_file(url, start=start, end=stop))


class TensorstoreSession(Session):
    def __init__(self) -> None:
        import tensorstore as ts

        self.ts = ts
        self.stores: dict[tuple[str, str | None], Any] = {}

    def read(self, url: str, start: int, stop: int, token: str | None) -> bytes:
        folder, name = url.rsplit("/", 1)
        store = self.stores.get((folder, token))
        if store is None:
            spec: dict[str, Any] = {
                "driver": "http",
                "base_url": folder + "/",
                "context": {"http_request_retries": {"max_retries": 2}},
            }
            if token:
                spec["headers"] = [f"Authorization: {token}"]
            store = self.stores[folder, token] = self.ts.KvStore.open(spec).result()
        found = store.read(name, byte_range=slice(start, stop)).result()
        if found.state != "value":
            raise LookupError(f"read state {found.state!r}")
        return bytes(found.value)


SESSIONS: dict[str, Callable[[str], Session]] = {
    "lazyckpt": lambda endpoint: LazyckptSession(),
    "obstore": lambda endpoint: ObstoreSession(),
    "fsspec HTTP": lambda endpoint: FsspecSession(),
    "HfFileSystem": HfSession,
    "tensorstore http": lambda endpoint: TensorstoreSession(),
}


@dataclass
class Attempt:
    """What one client is asked in one case: reads of `url` (a Hub path for
    HfFileSystem), `between` run by the parent between the first and the second."""

    url: str
    reads: list[tuple[int, int]]
    token: str | None = None
    between: Callable[[], None] | None = field(default=None, compare=False)


def attempt(client: str, endpoint: str, plan: Attempt, results: Any, halfway: Any, go: Any) -> None:
    """One client's reads in one case, in this (fresh) process: a line on `results`
    when it starts, and one with what it found."""
    import warnings

    warnings.simplefilter("ignore")
    session = SESSIONS[client](endpoint)
    results.put({"started": True})
    start = time.perf_counter()
    found: list[tuple[int, str]] = []
    try:
        for i, (a, b) in enumerate(plan.reads):
            if i:
                halfway.set()
                go.wait(30)
            data = session.read(plan.url, a, b, plan.token)
            found.append((len(data), hashlib.sha256(data).hexdigest()))
        error = None
    except Exception as caught:  # noqa: BLE001 (what each client raises is the finding)
        error = f"{type(caught).__name__}: {' '.join(str(caught).split())[:200]}"
    results.put({"seconds": time.perf_counter() - start, "found": found, "error": error})


@dataclass
class Outcome:
    seconds: float
    found: list[tuple[int, str]]
    error: str | None
    killed: str | None  # "time" or "memory"
    peak: int  # resident bytes above those after setting up, as the parent saw them


def _resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def watch(client: str, endpoint: str, plan: Attempt, cap: float) -> Outcome:
    """Run `attempt` in a fresh process, killed at `cap` seconds after it started or
    at `GROWTH_CAP` resident bytes."""
    context = multiprocessing.get_context("spawn")
    results, halfway, go = context.Queue(), context.Event(), context.Event()
    between, plan.between = plan.between, None  # (run here, not pickled)
    child = context.Process(target=attempt, args=(client, endpoint, plan, results, halfway, go))
    child.start()
    results.get(timeout=120)  # set up: imports are not on the clock
    baseline = _resident(child.pid or 0)
    began, peak, killed = time.monotonic(), baseline, None
    while child.is_alive() and results.empty():
        if halfway.is_set() and not go.is_set():
            if between is not None:
                between()
            go.set()
        peak = max(peak, _resident(child.pid or 0))
        if peak - baseline > GROWTH_CAP:
            killed = "memory"
        elif time.monotonic() - began > cap:
            killed = "time"
        if killed:
            child.kill()
            break
        time.sleep(0.05)
    seconds = time.monotonic() - began
    found: dict[str, Any] = {"found": [], "error": None}
    if killed is None:
        try:
            found = results.get(timeout=10)
            seconds = found["seconds"]
        except Exception:  # noqa: BLE001 (the child died without a word)
            found["error"] = f"the process died (exit status {child.exitcode})"
    child.join(10)
    return Outcome(seconds, found["found"], found["error"], killed, peak - baseline)


def _asked(handler: Any, size: int) -> tuple[int, int]:
    """The [start, stop) a request's `Range: bytes=a-b` asks for."""
    first, _, last = handler.headers.get("Range", "bytes=0-")[6:].partition("-")
    return int(first), min(int(last) + 1 if last else size, size)


def _drip(handler: Any, file: Any) -> bool:
    """A 206 whose body comes a byte a second."""
    start, stop = _asked(handler, len(file.data))
    head = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Length: {stop - start}\r\n"
        f"Content-Range: bytes {start}-{stop - 1}/{len(file.data)}\r\nETag: {file.etag}\r\n\r\n"
    )
    handler.drip(head.encode() + file.data[start : start + 8])
    return True


def _endless(handler: Any, file: Any) -> bool:
    """A 206 for the range asked, its chunked body endless (until the client goes)."""
    from tests.hostile_server import ENDLESS

    start, stop = _asked(handler, len(file.data))
    handler.send_response(206)
    handler.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(file.data)}")
    handler.send_header("ETag", file.etag)
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    piece = b" " * MiB
    try:
        for _ in range(ENDLESS // MiB):
            if handler.owner.stopped.is_set():
                return True
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    except OSError:
        pass  # the client went
    handler.close_connection = True
    return True


@dataclass
class Servers:
    hostile: Any
    hub: Any
    secret: Path  # a local file a redirect points at
    sent: dict[str, int] = field(default_factory=dict)  # body bytes a trick wrote, by file


Plan = Callable[[Servers, str, str], Attempt | None]
"""A case's reads for one client (None: it does not apply) at a fresh file name."""
Judge = Callable[[Servers, str, Outcome], str]


def _error(outcome: Outcome) -> str:
    kind = (outcome.error or "").split(":")[0]
    return f"{kind} in {outcome.seconds:.1f} s"


def _killed(outcome: Outcome, cap: float) -> str | None:
    if outcome.killed == "memory":
        return f"**unbounded**: killed at {GROWTH_CAP >> 20} MiB grown, {outcome.seconds:.1f} s"
    if outcome.killed == "time":
        return f"**hangs** (killed at {cap:g} s)"
    return None


DATA = bytes(range(256)) * (4 * MiB // 256)  # 4 MiB
CHANGED = bytes(255 - b for b in DATA)  # same size, other bytes


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plan_drip(servers: Servers, client: str, name: str) -> Attempt | None:
    if client == "HfFileSystem":
        return None
    return Attempt(servers.hostile.put(name, DATA, trick=_drip), [(0, 256 << 10)])


def plan_endless(servers: Servers, client: str, name: str) -> Attempt | None:
    if client == "HfFileSystem":
        return None
    return Attempt(servers.hostile.put(name, DATA, trick=_endless), [(0, MiB)])


def plan_token(servers: Servers, client: str, name: str) -> Attempt:
    servers.hub.clear_log()
    if client == "HfFileSystem":
        return Attempt("org/private/model.safetensors", [(0, MiB)], TOKEN)
    url = f"{servers.hub.endpoint}/org/private/resolve/main/model.safetensors"
    return Attempt(url, [(0, MiB)], TOKEN)


def judge_token(servers: Servers, name: str, outcome: Outcome) -> str:
    leaked = any(r.server == "cdn" and r.authorization for r in servers.hub.log)
    reached = any(r.server == "cdn" for r in servers.hub.log)
    told = (
        "**token sent to the CDN**"
        if leaked
        else "token kept from the CDN"
        if reached
        else "no redirect followed"
    )
    return f"{told}; " + ("read ok" if outcome.error is None else _error(outcome))


def plan_scheme(servers: Servers, client: str, name: str) -> Attempt | None:
    if client == "HfFileSystem":
        return None

    def away(handler: Any, file: Any) -> bool:
        handler.answer(302, {"Location": servers.secret.as_uri()}, b"")
        return True

    return Attempt(servers.hostile.put(name, b"", trick=away), [(0, 64)])


def judge_scheme(servers: Servers, name: str, outcome: Outcome) -> str:
    if outcome.error is not None:
        return f"refused: {_error(outcome)}"
    secret = servers.secret.read_bytes()[:64]
    if outcome.found and outcome.found[0][1] == _sha(secret):
        return "**follows it: reads the local file**"
    return f"returns {outcome.found[0][0]} bytes"


def plan_changed(servers: Servers, client: str, name: str) -> Attempt:
    reads = [(0, MiB), (MiB, 2 * MiB)]
    if client == "HfFileSystem":
        repo = f"org/{name.removesuffix('.bin')}"
        servers.hub.commit(repo, {"model.safetensors": DATA})
        return Attempt(
            f"{repo}/model.safetensors",
            reads,
            between=lambda: servers.hub.commit(repo, {"model.safetensors": CHANGED}) and None,
        )
    url = servers.hostile.put(name, DATA, modified=1e9)
    return Attempt(
        url, reads, between=lambda: servers.hostile.put(name, CHANGED, modified=2e9) and None
    )


def judge_changed(servers: Servers, name: str, outcome: Outcome) -> str:
    if outcome.error is not None:
        return f"detected: {_error(outcome)}"
    second = outcome.found[1][1]
    if second == _sha(CHANGED[MiB : 2 * MiB]):
        return "**mixes two versions silently**"
    if second == _sha(DATA[MiB : 2 * MiB]):
        return "reads the first version (pinned)"
    return "returns other bytes"


def plan_whole(servers: Servers, client: str, name: str) -> Attempt:
    if client == "HfFileSystem":
        servers.hub.ignore_range = True
        return Attempt(f"{REPO}/model-00001-of-00004.safetensors", [(0, MiB)])

    def whole(handler: Any, file: Any) -> bool:
        handler.send_response(200)
        for key, value in handler.validators(file).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(file.data)))
        handler.end_headers()
        try:
            for start in range(0, len(file.data), MiB):
                handler.wfile.write(file.data[start : start + MiB])
                servers.sent[name] = servers.sent.get(name, 0) + MiB
        except OSError:
            pass
        return True

    return Attempt(servers.hostile.put(name, DATA * 16, trick=whole), [(0, MiB)])


def judge_whole(servers: Servers, name: str, outcome: Outcome) -> str:
    servers.hub.ignore_range = False
    hub = servers.hostile.requests(name) == []
    sent = "" if hub else f"{servers.sent.get(name, 0) >> 20} MiB sent"
    peak = f"grew {outcome.peak >> 20} MiB"
    if outcome.error is not None:
        return f"refused: {_error(outcome)} ({', '.join(filter(None, (sent, peak)))})"
    length = outcome.found[0][0]
    if length != MiB:
        return f"**returns {length >> 20} MiB for 1 MiB**"
    return (
        f"**downloads the whole file**, returns the range ({', '.join(filter(None, (sent, peak)))})"
    )


def plan_busy(servers: Servers, client: str, name: str) -> Attempt:
    if client == "HfFileSystem":
        servers.hub.clear_log()
        servers.hub.fail_next(1, 503, retry_after=None, path_prefix="/cdn/")
        return Attempt(f"{REPO}/model-00001-of-00004.safetensors", [(0, MiB)])
    failures = [503]

    def busy(handler: Any, file: Any) -> bool:
        if not failures:
            return False
        handler.answer(failures.pop(), {}, b"busy")
        return True

    return Attempt(servers.hostile.put(name, DATA, trick=busy), [(0, MiB)])


def judge_busy(servers: Servers, name: str, outcome: Outcome) -> str:
    asked = servers.hostile.requests(name) or [r for r in servers.hub.log if r.server == "cdn"]
    if outcome.error is not None:
        return f"**{_error(outcome)}**, {len(asked)} request(s)"
    return f"retries: ok in {outcome.seconds:.1f} s, {len(asked)} requests"


def _plain(servers: Servers, name: str, outcome: Outcome) -> str:
    return _error(outcome) if outcome.error is not None else "read ok"


CASES: dict[str, tuple[Plan, Judge]] = {
    "(a) a 206 whose body drips a byte a second": (plan_drip, _plain),
    "(b) a 206 with an endless chunked body": (plan_endless, _plain),
    "(c) a redirect to another origin, with a token": (plan_token, judge_token),
    "(d) a redirect to file://": (plan_scheme, judge_scheme),
    "(e) the file replaced between two reads": (plan_changed, judge_changed),
    "(f) 200 and the whole 64 MiB file to a Range request": (plan_whole, judge_whole),
    "(g) a 503, then the file": (plan_busy, judge_busy),
}


def hostile(clients: list[str], cases: list[str], cap: float) -> None:
    from tests.hostile_server import HostileServer
    from tests.hub_server import HubServer

    print(f"\n| case | {' | '.join(clients)} |")
    print(f"|---|{'---|' * len(clients)}")
    details = []
    with (
        tempfile.TemporaryDirectory() as root,
        HostileServer() as plain,
        HubServer(root, valid_tokens={TOKEN.split()[1]}) as hub,
    ):
        hub.create_repo("org/private", private=True, allowed_tokens={TOKEN.split()[1]})
        hub.commit("org/private", {"model.safetensors": DATA})
        hub.commit(REPO, {"model-00001-of-00004.safetensors": DATA * 16})
        secret = Path(root) / "secret.txt"
        secret.write_bytes(b"a local file no server should hand out\n" * 4)
        servers = Servers(plain, hub, secret)
        for number, case in enumerate(cases):
            plan, judge = CASES[case]
            cells = []
            for client in clients:
                name = f"c{number}-{len(cells)}.bin"
                attempt_ = plan(servers, client, name)
                if attempt_ is None:
                    cells.append("n/a (the Hub's API only)")
                    continue
                outcome = watch(client, hub.endpoint, attempt_, cap)
                cells.append(_killed(outcome, cap) or judge(servers, name, outcome))
                if outcome.error:
                    details.append(f"- {case[:3]} {client}: {outcome.error}")
            print(f"| {case} | {' | '.join(cells)} |", flush=True)
    print("\nErrors, as raised:\n" + "\n".join(details))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--links", default="60:40,10:200,150:20", help="ROUND_TRIP_MS:MB_PER_S, comma-separated"
    )
    parser.add_argument("--readers", default=",".join(READERS), help="of table 1, comma-separated")
    parser.add_argument("--clients", default=",".join(SESSIONS), help="of table 2")
    parser.add_argument("--cases", default="abcdefg", help="of table 2, by letter")
    parser.add_argument("--cap", type=float, default=30.0, help="seconds a hostile case may take")
    args = parser.parse_args()
    print(machine())
    from importlib.metadata import version

    others = ("obstore", "fsspec", "aiohttp", "huggingface_hub")
    print(f"{versions()}, {', '.join(f'{n} {version(n)}' for n in others)}")
    if args.readers:
        throughput(args.links, args.readers.split(","), args.repeat)
    if args.cases:
        cases = [c for c in CASES if c[1] in args.cases]
        hostile(args.clients.split(","), cases, args.cap)


if __name__ == "__main__":
    main()
